//! A rootfs from containerd's btrfs snapshotter: the subvolume behind the
//! mount, where its snapshots go, and a mount that follows a rollback.
//!
//! containerd mounts the active snapshot by id (`subvolid=N`). A rollback
//! swaps a new subvolume in under the same path (see
//! `crab_snapshotter::BtrfsBackend`), so the shim mounts it again by path
//! (`subvol=/…`); containerd's snapshotter finds its snapshots by path too.

use std::path::{Path, PathBuf};

use containerd_shim::protos::api::Mount;
use crab_snapshotter::Location;

/// Where a btrfs rootfs's files and snapshots are on the host.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) struct BtrfsRootfs {
    /// The live subvolume, by a path outside the container.
    pub subvolume: PathBuf,
    /// The directory for its snapshots, on the same filesystem.
    pub store: PathBuf,
}

/// One line of `/proc/self/mountinfo` that matters here.
#[derive(Debug, Clone)]
pub(super) struct BtrfsMount {
    /// The mounted directory's path inside the filesystem.
    pub root: String,
    /// Where it is mounted.
    pub mount_point: PathBuf,
    /// The device.
    pub source: String,
}

// === impl BtrfsRootfs ===

impl BtrfsRootfs {
    /// Finds the subvolume that the btrfs mount `m` put on `rootfs`, and
    /// makes `m` mount it by path from now on.
    ///
    /// `Ok(None)` if `m` is not btrfs; an error says why a btrfs rootfs
    /// cannot be snapshotted.
    pub fn find(rootfs: &Path, m: &mut Mount, namespace: &str, id: &str) -> Result<Option<Self>, String> {
        if m.type_ != "btrfs" {
            return Ok(None);
        }
        let mounts = btrfs_mounts().map_err(|e| format!("read mountinfo: {e}"))?;
        let (on_rootfs, found) = Self::locate(&mounts, rootfs, namespace, id)?;
        if on_rootfs.root.contains(',') {
            return Err(format!("subvolume path {} has a comma", on_rootfs.root));
        }
        m.options
            .retain(|o| !o.starts_with("subvolid=") && !o.starts_with("subvol="));
        m.options.push(format!("subvol={}", on_rootfs.root));
        Ok(Some(found))
    }

    /// Finds, among the host's btrfs `mounts`, the one on `rootfs` and
    /// another mount of the same filesystem through which its subvolume has
    /// a path; the store is `.crab/<namespace>/<id>` under that mount.
    fn locate(
        mounts: &[BtrfsMount],
        rootfs: &Path,
        namespace: &str,
        id: &str,
    ) -> Result<(BtrfsMount, Self), String> {
        let on_rootfs = mounts
            .iter()
            .rev()
            .find(|m| m.mount_point == rootfs)
            .ok_or_else(|| format!("no btrfs mount on {}", rootfs.display()))?;
        let subvol = Path::new(&on_rootfs.root);
        mounts
            .iter()
            .filter(|m| m.source == on_rootfs.source && m.mount_point != rootfs)
            .filter_map(|m| {
                let below = subvol.strip_prefix(&m.root).ok()?;
                (!below.as_os_str().is_empty()).then_some((m, below))
            })
            // The closest: the fewest components below its root.
            .min_by_key(|(_, below)| below.components().count())
            .map(|(m, below)| {
                let found = BtrfsRootfs {
                    subvolume: m.mount_point.join(below),
                    store: m.mount_point.join(".crab").join(namespace).join(id),
                };
                (on_rootfs.clone(), found)
            })
            .ok_or_else(|| {
                format!(
                    "subvolume {} of {} is not reachable through any other mount",
                    on_rootfs.root, on_rootfs.source
                )
            })
    }

    /// The snapshot backend's location.
    pub fn location(&self) -> Location {
        Location::BtrfsSubvolume {
            subvolume: self.subvolume.clone(),
            store: self.store.clone(),
        }
    }
}

/// The btrfs mounts this process sees.
fn btrfs_mounts() -> procfs::ProcResult<Vec<BtrfsMount>> {
    Ok(procfs::process::Process::myself()?
        .mountinfo()?
        .into_iter()
        .filter(|m| m.fs_type == "btrfs")
        .filter_map(|m| {
            Some(BtrfsMount {
                source: m.mount_source?,
                root: m.root,
                mount_point: m.mount_point,
            })
        })
        .collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn mount(root: &str, at: &str, source: &str) -> BtrfsMount {
        BtrfsMount {
            root: root.to_owned(),
            mount_point: PathBuf::from(at),
            source: source.to_owned(),
        }
    }

    const SNAPSHOTTER: &str = "/var/lib/containerd/io.containerd.snapshotter.v1.btrfs";

    #[test]
    fn finds_the_subvolume_through_the_snapshotters_mount() {
        let mounts = [
            mount("/", "/mnt/other", "/dev/sdb"),
            mount("/", SNAPSHOTTER, "/dev/loop0"),
            mount("/active/12", "/run/b/rootfs", "/dev/loop0"),
        ];
        let (m, found) = BtrfsRootfs::locate(&mounts, Path::new("/run/b/rootfs"), "ns", "c1").unwrap();
        assert_eq!(m.root, "/active/12");
        assert_eq!(found.subvolume, Path::new(SNAPSHOTTER).join("active/12"));
        assert_eq!(found.store, Path::new(SNAPSHOTTER).join(".crab/ns/c1"));
    }

    #[test]
    fn prefers_the_closest_mount_and_ignores_siblings() {
        let mounts = [
            mount("/", "/top", "/dev/loop0"),
            mount("/data", "/data", "/dev/loop0"),
            mount("/dat", "/wrong", "/dev/loop0"),
            mount("/data/ctd/active/3", "/b/rootfs", "/dev/loop0"),
        ];
        let (_, found) = BtrfsRootfs::locate(&mounts, Path::new("/b/rootfs"), "ns", "c").unwrap();
        assert_eq!(found.subvolume, Path::new("/data/ctd/active/3"));
    }

    #[test]
    fn refuses_a_subvolume_with_no_other_path() {
        let mounts = [
            mount("/active/12", "/b/rootfs", "/dev/loop0"),
            mount("/", "/elsewhere", "/dev/loop1"),
        ];
        let err = BtrfsRootfs::locate(&mounts, Path::new("/b/rootfs"), "ns", "c").unwrap_err();
        assert!(err.contains("not reachable"), "{err}");
        let err = BtrfsRootfs::locate(&mounts, Path::new("/nowhere"), "ns", "c").unwrap_err();
        assert!(err.contains("no btrfs mount"), "{err}");
    }
}
