//! The backends' error type.

use std::path::PathBuf;

use crate::backend::BackendKind;

/// What a backend operation can fail with.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The snapshot name is not a safe name.
    #[error(transparent)]
    InvalidName(#[from] crab_api::InvalidSnapshotName),
    /// The dataset name is not a ZFS dataset path.
    #[error("invalid dataset {dataset:?}")]
    InvalidDataset {
        /// The name given.
        dataset: String,
    },
    /// No snapshot of that name.
    #[error("no snapshot {name}")]
    NoSnapshot {
        /// The name asked for.
        name: String,
    },
    /// A snapshot of that name already exists.
    #[error("snapshot {name} already exists")]
    SnapshotExists {
        /// The name asked for.
        name: String,
    },
    /// The snapshot is the origin of another filesystem.
    #[error("snapshot {name} is in use by {user}")]
    SnapshotInUse {
        /// The snapshot.
        name: String,
        /// What depends on it.
        user: String,
    },
    /// The live filesystem does not exist.
    #[error("no live filesystem at {location}")]
    NoLive {
        /// Where it was expected.
        location: String,
    },
    /// The clone or import target already holds a filesystem.
    #[error("{location} already exists")]
    TargetExists {
        /// The target.
        location: String,
    },
    /// A location for another backend was given.
    #[error("a {given:?} location was given to the {expected:?} backend")]
    WrongLocation {
        /// The backend's kind.
        expected: BackendKind,
        /// The location's kind.
        given: BackendKind,
    },
    /// An external command (`zfs`, `btrfs`) could not be run.
    #[error("cannot run {program}")]
    Spawn {
        /// The program.
        program: String,
        /// What the OS said.
        #[source]
        source: std::io::Error,
    },
    /// An external command failed.
    #[error("{command} failed ({status}): {stderr}")]
    Command {
        /// The command line.
        command: String,
        /// Its exit status.
        status: String,
        /// What it printed on stderr.
        stderr: String,
    },
    /// An export stream is not what this backend writes.
    #[error("invalid export stream: {reason}")]
    BadStream {
        /// What is wrong with it.
        reason: String,
    },
    /// An export stream holds what its import may not write.
    #[error("refused: {reason}")]
    Refused {
        /// What, and how to allow it.
        reason: String,
    },
    /// The backend cannot do this.
    #[error("not supported: {what}")]
    Unsupported {
        /// What was asked.
        what: String,
    },
    /// A filesystem operation failed.
    #[error("{op} {path}")]
    Io {
        /// The operation.
        op: &'static str,
        /// The path it was applied to.
        path: PathBuf,
        /// What the OS said.
        #[source]
        source: std::io::Error,
    },
}

impl Error {
    /// An [`Error::Io`] for `op` on `path`.
    pub(crate) fn io(op: &'static str, path: impl Into<PathBuf>) -> impl FnOnce(std::io::Error) -> Error {
        let path = path.into();
        move |source| Error::Io { op, path, source }
    }
}
