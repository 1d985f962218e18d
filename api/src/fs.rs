//! The file-snapshot vocabulary that crosses process edges: which backend
//! holds a snapshot, its name, and where a sandbox's writable filesystem
//! lives. The backends themselves are `crab-snapshotter`'s.

use std::fmt;
use std::path::PathBuf;

use serde::{Deserialize, Serialize};

/// The filesystem backends.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
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

/// A snapshot name: 1–64 letters, digits, `.`, `_`, `-`, starting with a
/// letter or digit, so it is a safe path component and ZFS name.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(try_from = "String", into = "String")]
pub struct SnapshotName(String);

/// A string that is not a valid [`SnapshotName`].
#[derive(Debug, thiserror::Error)]
#[error("invalid snapshot name {name:?}: use 1-64 letters, digits, '.', '_' or '-', starting with a letter or digit")]
pub struct InvalidSnapshotName {
    /// The name given.
    pub name: String,
}

// === impl SnapshotName ===

impl SnapshotName {
    /// Validates `name`.
    ///
    /// # Errors
    /// [`InvalidSnapshotName`].
    pub fn new(name: &str) -> Result<Self, InvalidSnapshotName> {
        let ok = (1..=64).contains(&name.len())
            && name.as_bytes()[0].is_ascii_alphanumeric()
            && name
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'_' | b'-'));
        if !ok {
            return Err(InvalidSnapshotName {
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
    type Error = InvalidSnapshotName;
    fn try_from(s: String) -> Result<Self, InvalidSnapshotName> {
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
