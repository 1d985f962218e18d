//! A container's rootfs: where it is mounted, the mounts that make it, and
//! the kind of filesystem that keeps its files, which decides how it is
//! snapshotted, rolled back and forgotten. Each kind's behaviour lives here,
//! once:
//!
//! | kind | made by | snapshots | kept in |
//! |---|---|---|---|
//! | overlay | containerd's overlayfs snapshotter, or dockerd (adopted, `premounted`) | overlay-copy of the upper directory | crabd's store |
//! | ZFS | crabzfs (a bind mount of a dataset) | ZFS snapshots | the dataset |
//! | btrfs | containerd's btrfs snapshotter (`btrfs`) | btrfs snapshots | `<fs>/.crab/<ns>/<id>` |
//! | plain | a directory in the bundle, several mounts, a read-only overlay | none | — |
//!
//! Operations that run commands (`zfs`, `btrfs`) run in the runtime helper
//! ([`crate::fsop`]); overlay copies run in the shim.

use std::path::{Path, PathBuf};

use containerd_shim::protos::api::Mount;
use crab_api::shim::FsTarget;
use crab_api::{BackendKind, FsSnapshot, Location, SnapshotName};

use crate::error::{Error, Result};
use crate::fsop::FsOp;
use crate::runtime::RuntimeClient;

mod btrfs;
mod premounted;

use btrfs::BtrfsRootfs;

/// A container's rootfs.
#[derive(Debug)]
pub struct Rootfs {
    /// Where the container's root is mounted: the bundle's `rootfs`, or
    /// the spec's root when someone else mounted it (see `premounted`).
    target: PathBuf,
    /// The mounts that make it (containerd's, or the adopted overlay);
    /// mounted again after a rollback.
    mounts: Vec<Mount>,
    /// Whether the shim mounted it (and unmounts it at delete).
    mounted: bool,
    /// What keeps its files.
    kind: Kind,
}

/// What keeps a rootfs's files.
#[derive(Debug)]
enum Kind {
    /// Not known yet (before [`Rootfs::mount`]).
    Unknown,
    /// An overlay: its upper directory is the sandbox's files.
    Overlay { upper: PathBuf },
    /// A ZFS dataset mounted at `mountpoint` (crabzfs).
    Zfs { dataset: String, mountpoint: PathBuf },
    /// A subvolume of containerd's btrfs snapshotter.
    Btrfs(BtrfsRootfs),
    /// Nothing the shim can snapshot, and why.
    Plain { reason: String },
}

/// Who runs a filesystem operation for the container, and on what.
pub struct FsCtx<'a> {
    /// The container (for errors and the helper's state).
    pub id: &'a str,
    /// Its bundle (the helper's work directory).
    pub bundle: &'a Path,
    /// The helper's client.
    pub runtime: &'a RuntimeClient,
}

// === impl Rootfs ===

impl Rootfs {
    /// The rootfs of a bundle whose CreateTask asked for `mounts`.
    pub fn new(bundle: &Path, mounts: Vec<Mount>) -> Self {
        Rootfs {
            target: bundle.join("rootfs"),
            mounts,
            mounted: false,
            kind: Kind::Unknown,
        }
    }

    /// Mounts containerd's mounts into the bundle (or adopts an overlay
    /// someone else mounted on the spec's `root`), checks the spec's root,
    /// and finds what keeps the files.
    ///
    /// # Errors
    /// [`Error::Mount`], [`Error::InvalidBundle`]; a rootfs nothing can
    /// snapshot is no error (it is plain).
    pub async fn mount(&mut self, root: Option<&Path>, namespace: &str, ctx: &FsCtx<'_>) -> Result<()> {
        let zfs = self.zfs_dataset(ctx).await;
        if !self.mounts.is_empty() {
            std::fs::create_dir_all(&self.target)
                .map_err(Error::io(format!("create {}", self.target.display())))?;
            self.mounted = true;
            self.mount_layers(ctx.id, true).await?;
        }
        // libcontainer reports a missing root as a bare ENOENT; name it.
        if let Some(root) = root.filter(|r| !r.is_dir()) {
            return Err(Error::InvalidBundle {
                bundle: ctx.bundle.to_owned(),
                reason: format!("root {} is not a directory", root.display()),
            });
        }
        if let (true, Some(root)) = (self.mounts.is_empty(), root) {
            // dockerd's overlay, mounted before the shim ran: adopted, not
            // unmounted at delete (dockerd does that).
            if let Some(m) = premounted::overlay_at(root) {
                self.mounts = vec![m];
                self.target = root.to_owned();
            }
        }
        self.kind = self.classify(zfs, namespace, ctx.id);
        Ok(())
    }

    /// The ZFS dataset of a bind-mounted rootfs (crabzfs's), if it is one.
    async fn zfs_dataset(&self, ctx: &FsCtx<'_>) -> Option<String> {
        let [m] = self.mounts.as_slice() else {
            return None;
        };
        if m.type_ != "bind" {
            return None;
        }
        let op = FsOp::ZfsDatasetAt {
            mountpoint: PathBuf::from(&m.source),
        };
        match run(op, ctx).await {
            Ok(found) => found.filter(|d| !d.is_empty()),
            Err(e) => {
                tracing::debug!(sandbox = ctx.id, error = %crab_api::error_chain(&e), "no ZFS dataset for its rootfs");
                None
            }
        }
    }

    fn classify(&mut self, zfs: Option<String>, namespace: &str, id: &str) -> Kind {
        if let (Some(dataset), [m]) = (zfs, self.mounts.as_slice()) {
            return Kind::Zfs {
                dataset,
                mountpoint: PathBuf::from(&m.source),
            };
        }
        let plain = |reason: &str| Kind::Plain {
            reason: reason.to_owned(),
        };
        match self.mounts.as_mut_slice() {
            [m] if m.type_ == "btrfs" => match BtrfsRootfs::find(&self.target, m, namespace, id) {
                Ok(Some(found)) => Kind::Btrfs(found),
                Ok(None) => plain("a btrfs mount"),
                Err(reason) => {
                    tracing::warn!(sandbox = id, reason, "its btrfs rootfs cannot be snapshotted");
                    Kind::Plain { reason }
                }
            },
            [m] if m.type_ == "overlay" => match m.options.iter().find_map(|o| o.strip_prefix("upperdir=")) {
                Some(upper) => Kind::Overlay {
                    upper: PathBuf::from(upper),
                },
                None => plain("a read-only overlay"),
            },
            [m] => Kind::Plain {
                reason: format!("a {} mount", m.type_),
            },
            [] => plain("a directory in the bundle"),
            _ => plain("several mounts"),
        }
    }

    /// The backend that snapshots its files, if one can.
    pub fn backend(&self) -> Option<BackendKind> {
        match &self.kind {
            Kind::Overlay { .. } => Some(BackendKind::OverlayCopy),
            Kind::Zfs { .. } => Some(BackendKind::Zfs),
            Kind::Btrfs(_) => Some(BackendKind::Btrfs),
            Kind::Unknown | Kind::Plain { .. } => None,
        }
    }

    /// Where the container's own files are on the host (overlay upper
    /// directory, ZFS mount point, btrfs subvolume): crabd keeps its
    /// history as long as that exists.
    pub fn writable_layer(&self) -> Option<PathBuf> {
        match &self.kind {
            Kind::Overlay { upper } => Some(upper.clone()),
            Kind::Zfs { mountpoint, .. } => Some(mountpoint.clone()),
            Kind::Btrfs(b) => Some(b.subvolume.clone()),
            Kind::Unknown | Kind::Plain { .. } => None,
        }
    }

    /// Where snapshots live that crabd does not keep itself (a btrfs
    /// store): crabd deletes them when containerd removes the container.
    pub fn own_snapshot_store(&self) -> Option<Location> {
        match &self.kind {
            Kind::Btrfs(b) => Some(b.location()),
            _ => None,
        }
    }

    /// Where the backend finds the files; an overlay's copies go to
    /// crabd's `store`, the others keep their own.
    fn location(&self, store: &Path, id: &str) -> Result<Location> {
        match &self.kind {
            Kind::Overlay { upper } => Ok(Location::OverlayCopy {
                upper: upper.clone(),
                store: store.to_owned(),
            }),
            Kind::Zfs { dataset, .. } => Ok(Location::Zfs {
                dataset: dataset.clone(),
            }),
            Kind::Btrfs(b) => Ok(b.location()),
            Kind::Unknown => Err(no_backend(id, "not mounted yet")),
            Kind::Plain { reason } => Err(no_backend(id, reason)),
        }
    }

    /// Whether a backend can snapshot it.
    ///
    /// # Errors
    /// [`Error::NoFsBackend`], with the reason.
    pub fn check_backend(&self, id: &str) -> Result<()> {
        self.location(Path::new(""), id).map(drop)
    }

    /// Snapshots the live files as `target` (the container is frozen).
    pub async fn snapshot(&self, target: &FsTarget, ctx: &FsCtx<'_>) -> Result<FsSnapshot> {
        let location = self.location(&target.store, ctx.id)?;
        let backend = location.kind();
        let name = target.name.clone();
        run(
            FsOp::Snapshot {
                location,
                name: name.clone(),
            },
            ctx,
        )
        .await?;
        Ok(FsSnapshot { backend, name })
    }

    /// Checks that snapshot `target` exists, before anything changes.
    ///
    /// # Errors
    /// [`Error::InvalidCheckpoint`] when it does not.
    pub async fn check_snapshot(&self, target: &FsTarget, ctx: &FsCtx<'_>) -> Result<()> {
        let op = FsOp::Has {
            location: self.location(&target.store, ctx.id)?,
            name: target.name.clone(),
        };
        if run(op, ctx).await?.as_deref() != Some("yes") {
            return Err(Error::InvalidCheckpoint {
                path: target.store.clone(),
                reason: format!("no filesystem snapshot {}", target.name),
            });
        }
        Ok(())
    }

    /// Unmounts the rootfs, makes its files snapshot `target`'s, and mounts
    /// it again (an overlay must not change under its mount). The
    /// container's processes are gone.
    pub async fn rollback(&self, target: &FsTarget, ctx: &FsCtx<'_>) -> Result<()> {
        let location = self.location(&target.store, ctx.id)?;
        unmount(&self.target).map_err(|source| Error::Mount {
            id: ctx.id.to_owned(),
            source,
        })?;
        let name = target.name.clone();
        let rolled = run(FsOp::Rollback { location, name }, ctx).await.map(drop);
        // A rollback that failed here is reported as such (its journal
        // stays for the next mount to finish), not tried again at once.
        self.mount_layers(ctx.id, false).await?;
        rolled
    }

    /// Whether a pod's version can keep these files as a member's (an
    /// overlay, copied into crabd's store beside the sandbox's own copies).
    ///
    /// # Errors
    /// [`Error::NoFsBackend`], with the reason.
    pub fn check_member_files(&self, id: &str) -> Result<()> {
        match &self.kind {
            Kind::Overlay { .. } => Ok(()),
            Kind::Zfs { .. } | Kind::Btrfs(_) => Err(no_backend(
                id,
                "a pod's other containers are versioned on overlayfs only, and this one is on ZFS or btrfs",
            )),
            Kind::Plain { reason } => Err(no_backend(id, reason)),
            Kind::Unknown => Err(no_backend(id, "not mounted yet")),
        }
    }

    /// The image layers below the writable one (an overlay's lower
    /// directories, top first, `:`-joined): which image the files are
    /// changes to.
    pub fn lower_layers(&self) -> String {
        self.mounts
            .iter()
            .flat_map(|m| &m.options)
            .filter_map(|o| o.strip_prefix("lowerdir="))
            .collect::<Vec<_>>()
            .join(":")
    }

    /// Makes the files snapshot `target`'s in place, through the mounted
    /// rootfs: the container's processes stay (the caller froze them).
    /// Answers the entries written and removed.
    pub async fn restore_files(&self, target: &FsTarget, ctx: &FsCtx<'_>) -> Result<(u64, u64)> {
        let location = self.location(&target.store, ctx.id)?;
        let lowers = self
            .mounts
            .iter()
            .flat_map(|m| &m.options)
            .filter_map(|o| o.strip_prefix("lowerdir="))
            .flat_map(|l| l.split(':'))
            .map(PathBuf::from)
            .collect();
        let op = FsOp::RestoreFiles {
            location,
            name: target.name.clone(),
            live: self.target.clone(),
            lowers,
            work: ctx.bundle.join(".crab-files"),
        };
        let out = run(op, ctx).await?.unwrap_or_default();
        let mut counts = out.split(' ').map(|n| n.parse().unwrap_or(0));
        Ok((counts.next().unwrap_or(0), counts.next().unwrap_or(0)))
    }

    /// Deletes snapshot `target`.
    pub async fn destroy(&self, target: &FsTarget, ctx: &FsCtx<'_>) -> Result<()> {
        let location = self.location(&target.store, ctx.id)?;
        let name = target.name.clone();
        run(FsOp::Destroy { location, name }, ctx).await.map(drop)
    }

    /// Deletes the snapshots `names` that the rootfs's own filesystem keeps
    /// (ZFS, btrfs); answers those deleted, and logs why any other is kept.
    pub async fn forget(&self, names: &[SnapshotName], ctx: &FsCtx<'_>) -> Vec<SnapshotName> {
        let location = match &self.kind {
            Kind::Zfs { .. } | Kind::Btrfs(_) => self.location(Path::new(""), ctx.id),
            _ => {
                tracing::warn!(sandbox = ctx.id, "no snapshots of its own to forget");
                return Vec::new();
            }
        };
        let Ok(location) = location else {
            return Vec::new();
        };
        let mut destroyed = Vec::new();
        for name in names {
            let op = FsOp::Destroy {
                location: location.clone(),
                name: name.clone(),
            };
            match run(op, ctx).await {
                Ok(_) => destroyed.push(name.clone()),
                Err(e) => {
                    tracing::warn!(snapshot = %name, error = %crab_api::error_chain(&e), "snapshot kept")
                }
            }
        }
        destroyed
    }

    /// Mounts the rootfs's mounts on its target (at create, and again after
    /// a rollback changed the files below).
    async fn mount_layers(&self, id: &str, finish_rollbacks: bool) -> Result<()> {
        for m in &self.mounts {
            // An overlay's upper that a rollback left half rewritten (the
            // shim was killed in it) is finished before anyone sees it.
            let upper = (finish_rollbacks && m.type_ == "overlay")
                .then(|| m.options.iter().find_map(|o| o.strip_prefix("upperdir=")))
                .flatten()
                .map(PathBuf::from);
            if let Some(upper) = upper {
                let finished = tokio::task::spawn_blocking(move || {
                    crab_snapshotter::finish_interrupted_rollback(&upper)
                })
                .await
                .map_err(|e| {
                    Error::io("finish an interrupted rollback".to_owned())(std::io::Error::other(e))
                })?;
                match finished {
                    Ok(Some(name)) => {
                        tracing::warn!(sandbox = id, snapshot = %name, "finished a rollback that was cut short")
                    }
                    Ok(None) => {}
                    Err(source) => {
                        return Err(Error::Snapshot {
                            id: id.to_owned(),
                            source,
                        })
                    }
                }
            }
            containerd_shim::asynchronous::util::mount_rootfs(m, &self.target)
                .await
                .map_err(|source| Error::Mount {
                    id: id.to_owned(),
                    source,
                })?;
        }
        Ok(())
    }

    /// Unmounts what the shim mounted (at delete; logged, best effort).
    pub fn release(&mut self, id: &str) {
        if !self.mounted {
            return;
        }
        match unmount(&self.target) {
            Ok(()) => self.mounted = false,
            Err(e) => {
                tracing::warn!(sandbox = id, error = %crab_api::error_chain(&e), rootfs = %self.target.display(), "unmount")
            }
        }
    }
}

fn no_backend(id: &str, reason: &str) -> Error {
    Error::NoFsBackend {
        id: id.to_owned(),
        reason: reason.to_owned(),
    }
}

/// Runs a filesystem operation: in the helper when it runs commands (the
/// shim's reaper would take their statuses), else here.
async fn run(op: FsOp, ctx: &FsCtx<'_>) -> Result<Option<String>> {
    if op.forks() {
        return ctx.runtime.fs(ctx.id, ctx.bundle, &op).await;
    }
    let id = ctx.id.to_owned();
    let blocking = |op: FsOp| tokio::task::spawn_blocking(move || op.run());
    let done = match late_snapshot(&op) {
        None => blocking(op).await,
        Some(destroy) => {
            // A btrfs snapshot waits for the subvolume's dirty data, which
            // the sandbox decides: it gets as long as the helper would,
            // then the caller fails and thaws. The ioctl cannot be
            // interrupted; if it lands later, the snapshot it made (of a
            // running sandbox, named by no version) is deleted.
            let limit = ctx.runtime.timeout();
            let mut task = blocking(op);
            match tokio::time::timeout(limit, &mut task).await {
                Ok(done) => done,
                Err(_) => {
                    let late = id.clone();
                    tokio::spawn(async move {
                        if let Ok(Ok(_)) = task.await {
                            let gone = blocking(destroy).await;
                            tracing::warn!(
                                sandbox = late,
                                deleted = matches!(gone, Ok(Ok(_))),
                                "a snapshot made after its checkpoint gave up"
                            );
                        }
                    });
                    return Err(Error::io("filesystem operation")(std::io::Error::new(
                        std::io::ErrorKind::TimedOut,
                        format!("a snapshot not made in {} s", limit.as_secs()),
                    )));
                }
            }
        }
    };
    done.map_err(|e| Error::io("filesystem operation")(std::io::Error::other(e)))?
        .map_err(|source| Error::Snapshot { id, source })
}

/// For an operation given a time limit (a btrfs snapshot), the one that
/// deletes what it makes if it ends after the limit.
fn late_snapshot(op: &FsOp) -> Option<FsOp> {
    match op {
        FsOp::Snapshot { location, name }
            if matches!(location, Location::Btrfs { .. } | Location::BtrfsSubvolume { .. }) =>
        {
            Some(FsOp::Destroy {
                location: location.clone(),
                name: name.clone(),
            })
        }
        _ => None,
    }
}

/// Unmounts everything at and below `target`.
pub fn unmount(target: &Path) -> std::result::Result<(), containerd_shim::Error> {
    containerd_shim::mount::umount_recursive(target.to_str(), libc::MNT_DETACH)
}
