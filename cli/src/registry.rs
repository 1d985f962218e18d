//! `crabctl push` and `crabctl pull`: versions shared through an ordinary
//! image registry, as OCI artifacts ([`artifact`]), so the hosts of a fleet
//! share versions through the registry they already run. A push sends only
//! the members the repository lacks; a pull hands crabd an archive that
//! its import checks like any other (signature, every member's sha256).
//!
//! Everything passes through a private temporary directory
//! ([`transfer::private_dir`]): the archive, its members, nowhere else.

mod artifact;
mod auth;
mod client;
mod reference;

use std::collections::HashMap;
use std::path::PathBuf;

use crab_api::crabd::{ImportQuery, ImportReport};
use crab_api::{Crabd, SandboxSelector, VersionSel};
use serde::Serialize;

pub use client::RegistryError;
pub use reference::{InvalidReference, Reference};

use crate::transfer::{self, TransferError};
use client::Registry;

/// The most a version's signature may weigh (an Ed25519 signature and key
/// in JSON take under 300 bytes).
const MAX_SIGNATURE: u64 = 4096;

/// What `crabctl push` did.
#[derive(Debug, Serialize)]
pub struct Pushed {
    /// Where the version is now.
    pub reference: String,
    /// Its manifest's digest (`REPO@DIGEST` names exactly this push).
    pub digest: String,
    /// Members of its archive, and their bytes.
    pub members: usize,
    /// Bytes of all members.
    pub bytes: u64,
    /// Members sent (the repository lacked them), and their bytes.
    pub sent: usize,
    /// Bytes sent.
    pub sent_bytes: u64,
}

/// What `crabctl pull` did.
#[derive(Debug, Serialize)]
pub struct Pulled {
    /// What was pulled.
    pub reference: String,
    /// Its manifest's digest.
    pub digest: String,
    /// Bytes of its members.
    pub bytes: u64,
    /// The sandbox that runs from it.
    pub sandbox: ImportReport,
}

/// How far a transfer is: `(phase, bytes done, bytes in all)`.
pub type Progress<'a> = &'a (dyn Fn(&'static str, u64, Option<u64>) + Sync);

/// Exports version `version` of `sandbox` through crabd and pushes it to
/// `reference` (a tag), with the credentials `authfile` (else docker's
/// config) holds for its registry, telling `progress` (phases `export`,
/// `push`).
pub async fn push(
    crabd: &Crabd,
    sandbox: &SandboxSelector,
    version: VersionSel,
    reference: &Reference,
    authfile: Option<&std::path::Path>,
    progress: Progress<'_>,
) -> Result<Pushed, TransferError> {
    let reference_tag = match &reference.target {
        reference::Target::Tag(t) => t.clone(),
        reference::Target::Digest(_) => {
            return Err(TransferError::NotAVersion {
                reference: reference.to_string(),
                reason: "a push names a tag, not a digest".to_owned(),
            })
        }
    };
    let registry = Registry::new(reference, authfile)?;
    let (dir, archive) =
        transfer::exported(crabd, sandbox, version, &|n, total| progress("export", n, total)).await?;
    let members_dir = dir.path().join("members");
    let blobs = tokio::task::spawn_blocking(move || {
        std::fs::create_dir(&members_dir)?;
        artifact::split(&archive, &members_dir)
    })
    .await
    .expect("the split does not panic")
    .map_err(|source| TransferError::Local {
        what: "split the export into members",
        source,
    })?;
    let mut report = Pushed {
        reference: reference.to_string(),
        digest: String::new(),
        members: blobs.len(),
        bytes: blobs.iter().map(|b| b.size).sum(),
        sent: 0,
        sent_bytes: 0,
    };
    let mut sent = std::collections::HashSet::new();
    let mut done = 0;
    for blob in &blobs {
        progress("push", done, Some(report.bytes));
        done += blob.size;
        if sent.contains(&blob.digest) || registry.has_blob(&blob.digest).await? {
            continue;
        }
        registry.put_blob(&blob.digest, &blob.path, blob.size).await?;
        sent.insert(blob.digest.clone());
        report.sent += 1;
        report.sent_bytes += blob.size;
    }
    progress("push", done, Some(report.bytes));
    let annotations = HashMap::from([
        ("io.crab.sandbox".to_owned(), sandbox.to_string()),
        ("io.crab.version".to_owned(), version.to_string()),
    ]);
    let manifest = artifact::manifest(&blobs, annotations);
    report.digest = registry
        .put_manifest(&reference_tag, manifest, artifact::MANIFEST_TYPE)
        .await?;
    Ok(report)
}

/// Pulls the version at `reference` (credentials: as [`push`]) and has
/// crabd start a sandbox from it (`query`: as `crabctl import`), telling
/// `progress` (phases `pull`, `import`).
pub async fn pull(
    crabd: &Crabd,
    reference: &Reference,
    authfile: Option<&std::path::Path>,
    query: &ImportQuery,
    progress: Progress<'_>,
) -> Result<Pulled, TransferError> {
    let registry = Registry::new(reference, authfile)?;
    let (manifest, digest) = registry
        .get_manifest(reference.target(), artifact::MANIFEST_TYPE)
        .await?;
    let not_a_version = |reason: String| TransferError::NotAVersion {
        reference: reference.to_string(),
        reason,
    };
    let members = artifact::members(&manifest).map_err(not_a_version)?;
    let dir = transfer::private_dir()?;
    let total = members
        .iter()
        .try_fold(0u64, |sum, m| sum.checked_add(m.size))
        .ok_or_else(|| not_a_version("its members' sizes add up to more than 2^64 bytes".to_owned()))?;
    let files: Vec<PathBuf> = (0..members.len())
        .map(|n| dir.path().join(format!("member-{n}")))
        .collect();
    // The manifest and its signature first: a version this host would not
    // import is refused before its bulk is downloaded.
    let mut done = 0;
    for (m, file) in members
        .iter()
        .zip(&files)
        .filter(|(m, _)| artifact::is_metadata(&m.name))
    {
        let most = match m.name == crab_api::export::SIGNATURE {
            true => MAX_SIGNATURE,
            false => crab_api::export::MAX_METADATA,
        };
        if m.size > most {
            return Err(not_a_version(format!(
                "its {} is {} bytes (at most {most})",
                m.name, m.size
            )));
        }
        registry.get_blob(&m.digest, m.size, file).await?;
        done += m.size;
    }
    if !query.insecure_unsigned {
        let read = |name: &str| -> Result<Option<Vec<u8>>, TransferError> {
            match members.iter().position(|m| m.name == name) {
                Some(n) => std::fs::read(&files[n])
                    .map(Some)
                    .map_err(|source| TransferError::Local {
                        what: "read a downloaded member",
                        source,
                    }),
                None => Ok(None),
            }
        };
        let manifest = read(crab_api::export::MANIFEST)?
            .ok_or_else(|| not_a_version("it has no manifest".to_owned()))?;
        let signature = read(crab_api::export::SIGNATURE)?;
        let trusted = crabd.keys().await?.trusted;
        artifact::check_signed(&manifest, signature.as_deref(), &trusted, &members).map_err(not_a_version)?;
    }
    // The members, then the archive made of them: twice the bytes.
    transfer::room_for(dir.path(), total.saturating_mul(2))?;
    for (m, file) in members
        .iter()
        .zip(&files)
        .filter(|(m, _)| !artifact::is_metadata(&m.name))
    {
        progress("pull", done, Some(total));
        registry.get_blob(&m.digest, m.size, file).await?;
        done += m.size;
    }
    let archive = dir.path().join("import.tar");
    let joined = {
        let (members, archive) = (members.clone(), archive.clone());
        tokio::task::spawn_blocking(move || artifact::join(&members, &files, &archive))
            .await
            .expect("the join does not panic")
    };
    joined.map_err(|source| TransferError::Local {
        what: "write the archive",
        source,
    })?;
    let sandbox = crabd
        .import(&archive, query, &|n, total| progress("import", n, total))
        .await?;
    Ok(Pulled {
        reference: reference.to_string(),
        digest,
        bytes: members.iter().map(|m| m.size).sum(),
        sandbox,
    })
}
