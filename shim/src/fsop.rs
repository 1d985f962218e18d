//! Filesystem backend operations on a container's files, as one
//! serializable request, so that those that run commands (`zfs`, `btrfs`)
//! can run in the runtime helper: the shim reaps every child on SIGCHLD,
//! and a `Command` waiting in the shim would lose its child's status.

use std::path::PathBuf;

use crab_snapshotter::{Location, SnapshotName};
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
            FsOp::Snapshot { location, .. }
            | FsOp::Rollback { location, .. }
            | FsOp::Destroy { location, .. } => !matches!(location, Location::OverlayCopy { .. }),
            // btrfs answers from its snapshot's directory.
            FsOp::Has { location, .. } => matches!(location, Location::Zfs { .. }),
            FsOp::ZfsDatasetAt { .. } => true,
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
        }
    }
}
