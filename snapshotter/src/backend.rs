//! The backend trait and the types every backend shares.

use std::fmt;
use std::io::{Read, Write};
use std::path::PathBuf;

use serde::{Deserialize, Serialize};

use crate::{BtrfsBackend, Error, OverlayCopyBackend, Result, ZfsBackend};

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
    /// [`Error::SnapshotExists`] if `name` is taken.
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

    /// Makes a new, independent writable filesystem at `to` whose content is
    /// snapshot `name`, and returns its backend.
    ///
    /// # Errors
    /// [`Error::WrongLocation`] if `to` is for another kind of backend.
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
    /// [`Error::SnapshotInUse`] if another filesystem was cloned from it.
    fn destroy(&self, name: &SnapshotName) -> Result<()>;
}

/// The implementations.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum BackendKind {
    /// ZFS datasets and snapshots, through the `zfs` command.
    Zfs,
    /// btrfs subvolumes and read-only snapshots, through `btrfs`.
    Btrfs,
    /// Copies of an overlayfs upper directory, sharing unchanged files.
    OverlayCopy,
}

/// Where a sandbox's writable filesystem lives, per backend.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "kebab-case")]
pub enum Location {
    /// A ZFS dataset (`pool/path`), mounted by ZFS.
    Zfs {
        /// The dataset holding the live tree.
        dataset: String,
    },
    /// A directory on btrfs holding the `live` subvolume and `.snapshots/`.
    Btrfs {
        /// The directory.
        dir: PathBuf,
    },
    /// A btrfs subvolume made elsewhere (containerd's btrfs snapshotter's
    /// active snapshot), and a directory for its snapshots.
    BtrfsSubvolume {
        /// The live subvolume.
        subvolume: PathBuf,
        /// Where its snapshots are kept, on the same filesystem.
        store: PathBuf,
    },
    /// An overlayfs upper directory and a store directory for its copies.
    OverlayCopy {
        /// The upper directory (the live tree).
        upper: PathBuf,
        /// Where snapshots are kept (same filesystem as `upper` is best).
        store: PathBuf,
    },
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

/// A snapshot name: 1–64 letters, digits, `.`, `_`, `-`, not starting with
/// `.` or `-`, so it is a safe path component and ZFS name.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(try_from = "String", into = "String")]
pub struct SnapshotName(String);

// === impl SnapshotName ===

impl SnapshotName {
    /// Validates `name`.
    ///
    /// # Errors
    /// [`Error::InvalidName`].
    pub fn new(name: &str) -> Result<Self> {
        let ok = (1..=64).contains(&name.len())
            && name.as_bytes()[0].is_ascii_alphanumeric()
            && name
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'_' | b'-'));
        if !ok {
            return Err(Error::InvalidName {
                name: name.to_owned(),
            });
        }
        Ok(SnapshotName(name.to_owned()))
    }

    /// The name as text.
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl fmt::Display for SnapshotName {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl TryFrom<String> for SnapshotName {
    type Error = Error;
    fn try_from(s: String) -> Result<Self> {
        SnapshotName::new(&s)
    }
}

impl From<SnapshotName> for String {
    fn from(n: SnapshotName) -> String {
        n.0
    }
}

// === impl Location ===

impl Location {
    /// The backend kind this location is for.
    pub fn kind(&self) -> BackendKind {
        match self {
            Location::Zfs { .. } => BackendKind::Zfs,
            Location::Btrfs { .. } | Location::BtrfsSubvolume { .. } => BackendKind::Btrfs,
            Location::OverlayCopy { .. } => BackendKind::OverlayCopy,
        }
    }
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

#[cfg(test)]
mod tests {
    use super::*;

    fn check(name: &str, valid: bool) {
        assert_eq!(SnapshotName::new(name).is_ok(), valid, "{name:?}");
    }

    #[test]
    fn names() {
        check("v1", true);
        check("crab-12.3_x", true);
        check(&"a".repeat(64), true);
        check(&"a".repeat(65), false);
        check("", false);
        check("../x", false);
        check("a/b", false);
        check(".hidden", false);
        check("-flag", false);
        check("a@b", false);
        check("a b", false);
    }
}
