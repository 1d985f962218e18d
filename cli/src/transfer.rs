//! What moving a version off this host shares: its archive exported into
//! a private temporary directory (0700, removed after), and the errors.

use std::path::{Path, PathBuf};

use crab_api::{Crabd, Progress, SandboxSelector, VersionSel};

use crate::registry::RegistryError;

/// Why moving a version off this host (push, pull, another layout) failed.
#[derive(Debug, thiserror::Error)]
pub enum TransferError {
    /// crabd refused the export or the import.
    #[error(transparent)]
    Crabd(#[from] crab_api::ClientError),
    /// The registry refused, or sent what it should not.
    #[error(transparent)]
    Registry(#[from] RegistryError),
    /// What the registry holds under the reference is no Crab version.
    #[error("{reference}: {reason}")]
    NotAVersion {
        /// The reference.
        reference: String,
        /// Why not.
        reason: String,
    },
    /// Not enough room for what is coming.
    #[error("{needed} bytes are needed in {dir} (TMPDIR), {free} are free")]
    NoRoom {
        /// The directory.
        dir: PathBuf,
        /// Bytes needed.
        needed: u64,
        /// Bytes free.
        free: u64,
    },
    /// A local step failed.
    #[error("{what}: {source}")]
    Local {
        /// The step.
        what: &'static str,
        /// Why.
        #[source]
        source: std::io::Error,
    },
}

/// Refuses when `dir`'s filesystem has less than `needed` bytes free
/// (before a registry's bytes fill it).
pub fn room_for(dir: &Path, needed: u64) -> Result<(), TransferError> {
    let stat = nix::sys::statvfs::statvfs(dir).map_err(|e| TransferError::Local {
        what: "read the free space of the temporary directory",
        source: e.into(),
    })?;
    let free = stat.blocks_available().saturating_mul(stat.fragment_size());
    if free < needed {
        return Err(TransferError::NoRoom {
            dir: dir.to_owned(),
            needed,
            free,
        });
    }
    Ok(())
}

/// A new directory only its owner reads, removed when dropped (or when
/// the command is interrupted: see `main`).
pub fn private_dir() -> Result<tempfile::TempDir, TransferError> {
    tempfile::Builder::new()
        .prefix("crabctl-transfer-")
        .tempdir()
        .map_err(|source| TransferError::Local {
            what: "make a private temporary directory",
            source,
        })
}

/// Version `version` of `sandbox`, exported by crabd into a private
/// directory (telling `progress`): the directory and the archive in it.
pub async fn exported(
    crabd: &Crabd,
    sandbox: &SandboxSelector,
    version: VersionSel,
    progress: Progress<'_>,
) -> Result<(tempfile::TempDir, PathBuf), TransferError> {
    let dir = private_dir()?;
    let archive = dir.path().join("export.tar");
    crabd.export(sandbox, version, &archive, progress).await?;
    Ok((dir, archive))
}
