//! The version store's error type.

use std::path::PathBuf;

use super::{Defect, SandboxId};

/// What a version store operation can fail with.
#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    /// The sandbox id is not a safe id.
    #[error(transparent)]
    InvalidSandboxId(#[from] crab_api::InvalidSandboxId),
    /// Another process holds the store's lock.
    #[error("version store {root} is in use by another process")]
    Locked {
        /// The store's root.
        root: PathBuf,
    },
    /// The sandbox was never registered.
    #[error("unknown sandbox {sandbox}")]
    UnknownSandbox {
        /// The sandbox asked for.
        sandbox: SandboxId,
    },
    /// The sandbox is registered already.
    #[error("sandbox {sandbox} is registered already")]
    SandboxExists {
        /// The sandbox.
        sandbox: SandboxId,
    },
    /// No intact manifest line holds this version, and no corrupt one can.
    #[error("sandbox {sandbox} has no version {version}")]
    UnknownVersion {
        /// The sandbox.
        sandbox: SandboxId,
        /// The version asked for.
        version: u64,
    },
    /// The sandbox has no version that passes verification.
    #[error("sandbox {sandbox} has no valid version")]
    NoValidVersion {
        /// The sandbox.
        sandbox: SandboxId,
    },
    /// The manifest line that would hold the version fails its checksum or
    /// does not parse.
    #[error("line {line} of the manifest of sandbox {sandbox} is corrupt")]
    CorruptManifestLine {
        /// The sandbox.
        sandbox: SandboxId,
        /// The line, from 1.
        line: u64,
    },
    /// The manifest line is intact but names another sandbox (a manifest
    /// copied between sandboxes).
    #[error("line {line} of the manifest of sandbox {sandbox} belongs to sandbox {found}")]
    NotOfSandbox {
        /// The sandbox whose manifest was read.
        sandbox: SandboxId,
        /// The line, from 1.
        line: u64,
        /// The sandbox the line names.
        found: String,
    },
    /// A process image file is missing.
    #[error("process image file {file} of version {version} of sandbox {sandbox} is missing")]
    MissingImage {
        /// The sandbox.
        sandbox: SandboxId,
        /// The version whose images directory should hold the file.
        version: u64,
        /// The file, relative to that directory.
        file: String,
    },
    /// A process image file's size or sha256 differs from its manifest line.
    #[error("process image file {file} of version {version} of sandbox {sandbox} is corrupt")]
    CorruptImage {
        /// The sandbox.
        sandbox: SandboxId,
        /// The version whose images directory holds the file.
        version: u64,
        /// The file, relative to that directory.
        file: String,
    },
    /// The version uses the process image of a version that is not in the
    /// manifest (or does not hold images).
    #[error(
        "version {version} of sandbox {sandbox} needs the process image of version {needs}, which is gone"
    )]
    MissingDependency {
        /// The sandbox.
        sandbox: SandboxId,
        /// The version asked for.
        version: u64,
        /// The version that should hold its process image.
        needs: u64,
    },
    /// A version of this sandbox is being written already.
    #[error("version {version} of sandbox {sandbox} is being written already")]
    PendingExists {
        /// The sandbox.
        sandbox: SandboxId,
        /// The pending version.
        version: u64,
    },
    /// The new version would reuse what the head holds, but the head's
    /// manifest line is corrupt: take a full checkpoint instead.
    #[error("cannot reuse the images of sandbox {sandbox}: its head, manifest line {line}, is corrupt")]
    CannotInherit {
        /// The sandbox.
        sandbox: SandboxId,
        /// The corrupt line, from 1.
        line: u64,
    },
    /// A kept version uses the process image of the version to remove.
    #[error("version {version} of sandbox {sandbox} holds the process image of version {user}")]
    VersionInUse {
        /// The sandbox.
        sandbox: SandboxId,
        /// The version asked to remove.
        version: u64,
        /// A version that depends on it.
        user: u64,
    },
    /// The images directory holds something other than regular files and
    /// directories.
    #[error("{path} is neither a regular file nor a directory")]
    UnsupportedImageEntry {
        /// The entry.
        path: PathBuf,
    },
    /// The manifest ends in a partial line that a failed append left and
    /// could not cut off; opening the store again repairs it.
    #[error("manifest {path} ends in a partial line: reopen the store to repair it")]
    PartialLine {
        /// The manifest.
        path: PathBuf,
    },
    /// A record could not be encoded (a bug: every record is serialisable).
    #[error("cannot encode a manifest line")]
    Encode(#[source] serde_json::Error),
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

// === impl StoreError ===

impl StoreError {
    /// An [`StoreError::Io`] for `op` on `path`.
    pub(crate) fn io(
        op: &'static str,
        path: impl Into<PathBuf>,
    ) -> impl FnOnce(std::io::Error) -> StoreError {
        let path = path.into();
        move |source| StoreError::Io { op, path, source }
    }

    /// The error for `defect` of `version`.
    pub(crate) fn from_defect(sandbox: &SandboxId, version: u64, defect: &Defect) -> StoreError {
        let sandbox = sandbox.clone();
        match defect.clone() {
            Defect::CorruptLine { line } => StoreError::CorruptManifestLine { sandbox, line },
            Defect::NotOfSandbox { line, found } => StoreError::NotOfSandbox { sandbox, line, found },
            Defect::MissingImage { holder, file } => StoreError::MissingImage {
                sandbox,
                version: holder,
                file,
            },
            Defect::CorruptImage { holder, file } => StoreError::CorruptImage {
                sandbox,
                version: holder,
                file,
            },
            Defect::MissingDependency { holder } => StoreError::MissingDependency {
                sandbox,
                version,
                needs: holder,
            },
        }
    }
}
