//! Filesystem backend operations on a container's files, as one
//! serializable request, so that those that run commands (`zfs`, `btrfs`)
//! can run in the runtime helper: the shim reaps every child on SIGCHLD,
//! and a `Command` waiting in the shim would lose its child's status.

use std::path::{Path, PathBuf};

use crab_snapshotter::{sync_tree, Location, Scope, SnapshotFiles, SnapshotName};
use serde::{Deserialize, Serialize};

/// One operation.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(tag = "op", rename_all = "kebab-case")]
pub enum FsOp {
    /// Snapshot the live tree as `name`.
    Snapshot {
        /// Where the files are.
        location: Location,
        /// The snapshot's name.
        name: SnapshotName,
    },
    /// Make the live tree equal to snapshot `name`.
    Rollback {
        /// Where the files are.
        location: Location,
        /// The snapshot's name.
        name: SnapshotName,
    },
    /// Delete snapshot `name`.
    Destroy {
        /// Where the files are.
        location: Location,
        /// The snapshot's name.
        name: SnapshotName,
    },
    /// Whether snapshot `name` exists: answers `yes` or `no`.
    Has {
        /// Where the files are.
        location: Location,
        /// The snapshot's name.
        name: SnapshotName,
    },
    /// Make the files seen at `live` (the mounted rootfs) snapshot
    /// `name`'s in place; answers `written removed`. An overlay snapshot
    /// is read through a read-only overlay of it over `lowers`, mounted
    /// at `work`.
    RestoreFiles {
        /// Where the files are.
        location: Location,
        /// The snapshot's name.
        name: SnapshotName,
        /// The mounted rootfs.
        live: PathBuf,
        /// The overlay's lower directories, top first.
        lowers: Vec<PathBuf>,
        /// An empty directory to mount on.
        work: PathBuf,
    },
    /// The ZFS dataset mounted at `mountpoint`, if any (a crabzfs rootfs).
    ZfsDatasetAt {
        /// The mount point.
        mountpoint: PathBuf,
    },
}

// === impl FsOp ===

impl FsOp {
    /// Whether it runs commands, and so must run in the helper.
    pub fn forks(&self) -> bool {
        match self {
            // btrfs snapshots by ioctl.
            FsOp::Snapshot { location, .. } => matches!(location, Location::Zfs { .. }),
            FsOp::Rollback { location, .. } => !matches!(location, Location::OverlayCopy { .. }),
            // btrfs deletes a snapshot by ioctl.
            FsOp::Destroy { location, .. } => matches!(location, Location::Zfs { .. }),
            // btrfs answers from its snapshot's directory.
            FsOp::Has { location, .. } => matches!(location, Location::Zfs { .. }),
            FsOp::ZfsDatasetAt { .. } => true,
            // Mounts and file writes only.
            FsOp::RestoreFiles { .. } => false,
        }
    }

    /// Runs it (blocking); some operations answer a line of text.
    pub fn run(&self) -> crab_snapshotter::Result<Option<String>> {
        match self {
            FsOp::Snapshot { location, name } => {
                crab_snapshotter::open(location)?.snapshot(name).map(|_| None)
            }
            FsOp::Rollback { location, name } => {
                crab_snapshotter::open(location)?.rollback(name).map(|()| None)
            }
            FsOp::Destroy { location, name } => {
                crab_snapshotter::open(location)?.destroy(name).map(|()| None)
            }
            FsOp::Has { location, name } => {
                let has = crab_snapshotter::open(location)?.has(name)?;
                Ok(Some(if has { "yes" } else { "no" }.to_owned()))
            }
            FsOp::ZfsDatasetAt { mountpoint } => Ok(crab_snapshotter::ZfsBackend::dataset_at(mountpoint)),
            FsOp::RestoreFiles {
                location,
                name,
                live,
                lowers,
                work,
            } => {
                let files = crab_snapshotter::open(location)?.files(name)?;
                let done = match files {
                    SnapshotFiles::Tree(dir) => sync_tree(&dir, live, &Scope::Whole)?,
                    SnapshotFiles::Layer { dir, live: upper } => {
                        let scope = Scope::of_layers(&[&dir, &upper])?;
                        let _mounted = ReadOnlyOverlay::mount(work, &dir, lowers)?;
                        sync_tree(work, live, &scope)?
                    }
                };
                Ok(Some(format!("{} {}", done.written, done.removed)))
            }
        }
    }
}

/// A read-only overlay of a snapshot's upper layer over the image's
/// layers, unmounted (and its directory removed) when dropped.
struct ReadOnlyOverlay {
    at: PathBuf,
}

impl ReadOnlyOverlay {
    fn mount(at: &Path, top: &Path, lowers: &[PathBuf]) -> crab_snapshotter::Result<Self> {
        let bad = |e: std::io::Error| crab_snapshotter::Error::Io {
            op: "mount the snapshot at",
            path: at.to_owned(),
            source: e,
        };
        if lowers.is_empty() {
            return Err(bad(std::io::Error::other("the overlay has no lower layers")));
        }
        let mut dirs = vec![top.to_owned()];
        dirs.extend(lowers.iter().cloned());
        let mut lowerdir = String::from("lowerdir=");
        for (i, d) in dirs.iter().enumerate() {
            let d = d
                .to_str()
                .filter(|d| d.starts_with('/') && !d.contains([':', ',']))
                .ok_or_else(|| {
                    bad(std::io::Error::other(format!(
                        "unusable layer path {}",
                        d.display()
                    )))
                })?;
            if i > 0 {
                lowerdir.push(':');
            }
            lowerdir.push_str(d);
        }
        // Left by a shim that died mid-sync: gone first.
        let _ = nix::mount::umount2(at, nix::mount::MntFlags::MNT_DETACH);
        let _ = std::fs::remove_dir(at);
        std::fs::create_dir_all(at).map_err(bad)?;
        let flags =
            nix::mount::MsFlags::MS_RDONLY | nix::mount::MsFlags::MS_NOSUID | nix::mount::MsFlags::MS_NODEV;
        if let Err(e) = nix::mount::mount(
            Some("overlay"),
            at,
            Some("overlay"),
            flags,
            Some(lowerdir.as_str()),
        ) {
            let _ = std::fs::remove_dir(at);
            return Err(bad(e.into()));
        }
        Ok(ReadOnlyOverlay { at: at.to_owned() })
    }
}

impl Drop for ReadOnlyOverlay {
    fn drop(&mut self) {
        if let Err(e) = nix::mount::umount2(&self.at, nix::mount::MntFlags::MNT_DETACH) {
            tracing::warn!(at = %self.at.display(), error = %e, "unmount the snapshot's overlay");
        }
        let _ = std::fs::remove_dir(&self.at);
    }
}
