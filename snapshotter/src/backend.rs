//! The backend trait and the types every backend shares.

use std::fmt;
use std::io::{Read, Write};
use std::path::PathBuf;

use serde::{Deserialize, Serialize};

pub use crab_api::{BackendKind, Location, SnapshotName};

use crate::{BtrfsBackend, OverlayCopyBackend, Result, SnapshotFiles, ZfsBackend};

/// A sandbox's writable filesystem and its named snapshots.
///
/// Snapshots are immutable; a name is used once per sandbox.
pub trait Backend: Send + Sync + fmt::Debug {
    /// Which implementation this is.
    fn kind(&self) -> BackendKind;

    /// Where the live, writable tree is mounted or stored.
    fn live_path(&self) -> Result<PathBuf>;

    /// Saves the live tree as `name`.
    ///
    /// # Errors
    /// [`crate::Error::SnapshotExists`] if `name` is taken.
    fn snapshot(&self, name: &SnapshotName) -> Result<Snapshot>;

    /// Every snapshot, oldest first.
    fn list(&self) -> Result<Vec<Snapshot>>;

    /// Whether snapshot `name` exists (a backend may answer faster than
    /// [`Backend::list`]).
    fn has(&self, name: &SnapshotName) -> Result<bool> {
        Ok(self.list()?.iter().any(|s| &s.name == name))
    }

    /// Makes the live tree equal to snapshot `name`; every snapshot survives.
    fn rollback(&self, name: &SnapshotName) -> Result<()>;

    /// Where snapshot `name`'s files can be read in place, for a
    /// files-only rollback ([`crate::sync_tree`]).
    ///
    /// # Errors
    /// [`crate::Error::Unsupported`] where the backend cannot show them.
    fn files(&self, name: &SnapshotName) -> Result<SnapshotFiles> {
        Err(crate::Error::Unsupported {
            what: format!("reading {:?} snapshot {name} in place", self.kind()),
        })
    }

    /// Makes a new, independent writable filesystem at `to` whose content is
    /// snapshot `name`, and returns its backend.
    ///
    /// # Errors
    /// [`crate::Error::WrongLocation`] if `to` is for another kind of backend.
    fn clone_to(&self, name: &SnapshotName, to: &Location) -> Result<Box<dyn Backend>>;

    /// Whether (and how much) the live tree changed since snapshot `name`,
    /// when the backend can tell.
    fn changed_since(&self, name: &SnapshotName) -> Result<Change>;

    /// Writes snapshot `name` as a byte stream: whole, or relative to
    /// `parent` (which the importing side must already have).
    fn export(&self, name: &SnapshotName, parent: Option<&SnapshotName>, out: &mut dyn Write) -> Result<()>;

    /// Reads a stream written by [`Backend::export`] of the same kind and
    /// makes it snapshot `name` here. Into an empty location, a whole stream
    /// also makes the live tree equal to it.
    fn import(&self, name: &SnapshotName, parent: Option<&SnapshotName>, input: &mut dyn Read) -> Result<()>;

    /// Deletes snapshot `name`.
    ///
    /// # Errors
    /// [`crate::Error::SnapshotInUse`] if another filesystem was cloned from it.
    fn destroy(&self, name: &SnapshotName) -> Result<()>;
}

/// One snapshot.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Snapshot {
    /// Its name.
    pub name: SnapshotName,
    /// Bytes stored for it alone, when the backend can tell.
    pub bytes: Option<u64>,
}

/// What changed in the live tree since a snapshot.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Change {
    /// Nothing.
    Unchanged,
    /// Something; `bytes` is an estimate of the changed data when known.
    Changed {
        /// Size of changed files (or data written), if known.
        bytes: Option<u64>,
    },
    /// The backend cannot tell.
    Unknown,
}

/// The backend for `location`; it need not hold a filesystem yet (an
/// import target).
pub fn open(location: &Location) -> Result<Box<dyn Backend>> {
    Ok(match location {
        Location::Zfs { dataset } => Box::new(ZfsBackend::new(dataset)?),
        Location::Btrfs { dir } => Box::new(BtrfsBackend::new(dir)),
        Location::BtrfsSubvolume { subvolume, store } => Box::new(BtrfsBackend::at(subvolume, store)),
        Location::OverlayCopy { upper, store } => Box::new(OverlayCopyBackend::new(upper, store)),
    })
}
