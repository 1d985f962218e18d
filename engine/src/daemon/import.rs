//! Import: an archive that `export` wrote (on this host or another) as a
//! new sandbox whose version 1 is the archive's version, running.

use std::sync::Arc;
use std::time::Instant;

use axum::body::Body;
use crab_api::crabd::{ImportQuery, ImportReport};
use std::path::PathBuf;

use crab_api::shim::ConversationAt;
use crab_api::{BackendKind, FsSnapshot, SandboxId, VersionRecord};
use crab_proxy::transcript::conversation;
use futures_util::StreamExt;
use tokio::io::AsyncWriteExt;

use super::fork::FilesFrom;
use super::work::{blocking, blocking_io, detached, Staging};
use super::{ApiError, Daemon};
use crate::archive::{self, ArchiveError};
use crate::containerd::Containerd;
use crate::{Capture, NewVersion, StoreError};

// === impl Daemon ===

impl Daemon {
    /// Receives the archive `body` into a staging directory, checks it, and
    /// starts the sandbox it holds as `q` says. Nothing stays if it fails.
    pub(super) async fn import(
        self: &Arc<Self>,
        q: ImportQuery,
        body: Body,
    ) -> Result<ImportReport, ApiError> {
        let started = Instant::now();
        let staging = self.staging("import")?;
        receive(body, &staging.path().join("archive.tar")).await?;
        // From here on the import runs to its end (and its staging goes
        // with it) even if the caller hangs up.
        detached(import_staged(self.clone(), q, staging, started)).await
    }
}

async fn receive(body: Body, path: &std::path::Path) -> Result<(), ApiError> {
    let mut file = tokio::fs::File::create(path)
        .await
        .map_err(|source| ApiError::Io {
            op: "create the staged archive",
            source,
        })?;
    let mut stream = body.into_data_stream();
    while let Some(chunk) = stream.next().await {
        let chunk = chunk.map_err(|e| ApiError::BadRequest {
            reason: format!("the archive upload broke off: {e}"),
        })?;
        file.write_all(&chunk).await.map_err(|source| ApiError::Io {
            op: "write the staged archive",
            source,
        })?;
    }
    file.flush().await.map_err(|source| ApiError::Io {
        op: "write the staged archive",
        source,
    })
}

async fn import_staged(
    d: Arc<Daemon>,
    q: ImportQuery,
    staging: Staging,
    started: Instant,
) -> Result<ImportReport, ApiError> {
    let unpack_dir = staging.path().join("unpacked");
    let tar_path = staging.path().join("archive.tar");
    let mut unpacked = blocking_io(move || {
        let f = std::fs::File::open(&tar_path).map_err(|source| ApiError::Io {
            op: "open the staged archive",
            source,
        })?;
        archive::unpack(std::io::BufReader::new(f), &unpack_dir).map_err(ApiError::from)
    })
    .await?;
    // Before anything is written: who made the archive (its process images
    // are restored by CRIU as root, with the credentials and mounts they
    // record, which no check of the archive can vouch for), and what it
    // asks of this host.
    let d2 = d.clone();
    let trusted = blocking_io(move || Ok(super::keys::trusted(&d2.config.root, &d2.signing_key))).await?;
    vouch(&d, &trusted, &unpacked, q.insecure_unsigned)?;
    super::admit::admit(&mut unpacked.manifest.container, &d.config.import_bind_sources)?;
    let m = &unpacked.manifest;
    let new_id: SandboxId = q.name.clone().unwrap_or_else(|| m.version.sandbox.clone());
    let busy = d.busy(&new_id);
    let _one_at_a_time = busy.lock().await;
    if d.registry.get(&new_id).is_some() {
        return Err(ApiError::SandboxExists { id: new_id });
    }
    match d.store.register(&new_id) {
        Ok(()) => {}
        Err(StoreError::SandboxExists { .. }) if d.store.versions(&new_id)?.is_empty() => {}
        Err(StoreError::SandboxExists { .. }) => return Err(ApiError::SandboxExists { id: new_id }),
        Err(e) => return Err(e.into()),
    }
    let made = make_and_start(&d, q, &unpacked, &new_id, started).await;
    if made.is_err() {
        // Nothing half-imported stays: no version, no files, no history.
        let (d2, sid) = (d.clone(), new_id.clone());
        let _ = blocking_io(move || {
            if d2.store.versions(&sid).is_ok_and(|v| v.is_empty()) {
                let _ = d2.store.forget(&sid);
            }
            d2.files.remove_store(&sid);
            Ok(())
        })
        .await;
    }
    made
}

/// Admits an archive signed by a key this host trusts (its own, or one in
/// `<root>/trusted-keys/`); any other only with `insecure_unsigned`.
fn vouch(
    d: &Daemon,
    trusted: &[String],
    unpacked: &archive::Unpacked,
    insecure_unsigned: bool,
) -> Result<(), ApiError> {
    let why = match &unpacked.signed_by {
        Some(key) if trusted.contains(key) => return Ok(()),
        Some(key) => format!(
            "the archive is signed by key {key}, which this host does not trust (to trust it, put it in a root-owned *.pub file in {})",
            super::keys::trusted_dir(&d.config.root).display()
        ),
        None => "the archive is not signed".to_owned(),
    };
    if insecure_unsigned {
        tracing::warn!(reason = %why, sandbox = %unpacked.manifest.version.sandbox, "imported without a trusted signature (--insecure-unsigned)");
        return Ok(());
    }
    Err(ApiError::Refused {
        reason: format!(
            "{why}: its process images would be restored as root with the credentials and mounts they record \
             (crabctl import --insecure-unsigned takes it anyway)"
        ),
    })
}

/// Publishes the archive's version as sandbox `new_id`'s first and starts
/// it in containerd.
async fn make_and_start(
    d: &Arc<Daemon>,
    q: ImportQuery,
    unpacked: &archive::Unpacked,
    new_id: &SandboxId,
    started: Instant,
) -> Result<ImportReport, ApiError> {
    let m = &unpacked.manifest;
    // The version, with its images moved in and its files imported.
    let name = m.fs.name.clone();
    let record = m.version.clone();
    let images_src = unpacked.images_dir.clone();
    let fs_stream = unpacked.fs_stream.clone();
    let images = m.images.clone();
    let allow_privileged = q.allow_privileged_files;
    let namespace = q.namespace.unwrap_or_else(|| d.config.namespace.clone());
    let address = q.containerd.unwrap_or_else(|| d.config.containerd.clone());
    let containerd = Containerd::connect(&address, &namespace).await?;
    // Named before anything of it is written (the id has no version yet:
    // every one it gets from here is this import's).
    let mut making = d.begin_making(&containerd, &m.container.snapshotter, new_id, true)?;
    let (d2, sid) = (d.clone(), new_id.clone());
    let published = blocking_io(move || -> Result<VersionRecord, ApiError> {
        let io = |op| move |source| ApiError::Io { op, source };
        let pending = d2.store.begin_version(
            &sid,
            NewVersion {
                turn: record.turn,
                branch: record.branch,
                transcript_turns: record.transcript_turns,
                capture: Capture::Full(FsSnapshot {
                    backend: BackendKind::OverlayCopy,
                    name: name.clone(),
                }),
            },
        )?;
        let dir = pending
            .images_dir()
            .expect("a full version has an images directory")
            .to_owned();
        for f in &images {
            let to = dir.join(&f.path);
            if let Some(parent) = to.parent() {
                std::fs::create_dir_all(parent).map_err(io("create an images directory"))?;
            }
            std::fs::rename(images_src.join(&f.path), &to).map_err(io("move an image file"))?;
        }
        let mut input = std::fs::File::open(&fs_stream).map_err(io("open the filesystem stream"))?;
        let policy = crab_snapshotter::StreamPolicy {
            privileged: allow_privileged,
        };
        d2.files.import(&sid, &name, &mut input, policy)?;
        Ok(pending.publish()?)
    })
    .await;
    let version = match published {
        Ok(version) => version,
        Err(e) => {
            // What was written goes before the record.
            d.undo_making(making).await;
            return Err(e);
        }
    };
    let conversation = import_conversation(unpacked, &namespace, new_id, &mut making).await;
    let store = d.store.clone();
    let (sid, n) = (new_id.clone(), version.version);
    let images_dir = blocking(move || store.get(&sid, n))
        .await
        .map(|v| v.images_dir.expect("an imported version holds its images"));
    let started_copy = match images_dir {
        Err(e) => {
            d.undo_making(making).await;
            Err(e)
        }
        Ok(images_dir) => {
            let mut template = m.container.clone();
            // The template's spec names the exported container; the copy is renamed.
            template.id = m.version.sandbox.as_str().to_owned();
            let from = FilesFrom {
                sandbox: new_id.clone(),
                name: m.fs.name.clone(),
            };
            let at = conversation.as_ref().map(|(at, _)| at);
            d.start_copy(&containerd, &template, new_id, &images_dir, from, at, making)
                .await
                .map(|mut copied| {
                    if let Some(m) = copied.making.take() {
                        m.done();
                    }
                    copied.pid
                })
        }
    };
    if let (Err(_), Some((_, path))) = (&started_copy, &conversation) {
        let _ = std::fs::remove_file(path);
    }
    let pid = match started_copy {
        Ok(pid) => pid,
        Err(e) => {
            // The version goes again (its files go with the store).
            let store = d.store.clone();
            let (sid, n) = (new_id.clone(), version.version);
            let _ = blocking(move || store.remove_version(&sid, n)).await;
            return Err(e);
        }
    };
    let total_ms = started.elapsed().as_secs_f64() * 1e3;
    tracing::info!(sandbox = %new_id, from = %m.version.sandbox, pid, elapsed_ms = total_ms, "imported");
    Ok(ImportReport {
        id: new_id.clone(),
        version: version.version,
        pid,
        total_ms,
    })
}

impl From<ArchiveError> for ApiError {
    fn from(e: ArchiveError) -> Self {
        ApiError::Archive(e)
    }
}

/// Writes the archive's conversation as sandbox `new_id`'s transcript,
/// where its shim in `namespace` keeps it (`[shim.proxy] transcript_dir`);
/// named in its `making`; answers where the sandbox stands in it, and the
/// file. None (logged) when the archive has none or it cannot be written:
/// the sandbox's conversation then starts afresh.
async fn import_conversation(
    unpacked: &archive::Unpacked,
    namespace: &str,
    new_id: &SandboxId,
    making: &mut super::making::MakingGuard,
) -> Option<(ConversationAt, PathBuf)> {
    let member = unpacked.manifest.transcript.as_ref()?;
    let staged = unpacked.transcript.clone()?;
    // A containerd namespace is one plain name; anything else is no path.
    let plain = !namespace.is_empty()
        && !namespace.starts_with('.')
        && namespace
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | '-'));
    if !plain {
        tracing::warn!(
            namespace,
            "the import's conversation starts afresh: not a namespace name"
        );
        return None;
    }
    let dir = match crab_api::config::transcript_dir(&crab_api::config::config_path()) {
        Ok(dir) => dir.join(namespace),
        Err(e) => {
            tracing::warn!(error = %crab_api::error_chain(&e), "the import's conversation starts afresh");
            return None;
        }
    };
    let records = match super::fork::bounded_entries(&staged).await {
        Ok(entries) => conversation(&entries, 0)?.into_values().collect(),
        Err(e) => {
            tracing::warn!(error = %crab_api::error_chain(&e), "the import's conversation starts afresh");
            return None;
        }
    };
    use std::os::unix::fs::DirBuilderExt;
    if let Err(e) = std::fs::DirBuilder::new()
        .recursive(true)
        .mode(0o700)
        .create(&dir)
    {
        tracing::warn!(error = %e, dir = %dir.display(), "the import's conversation starts afresh");
        return None;
    }
    let path = dir.join(format!("{new_id}.jsonl"));
    making
        .write_transcript(&path, new_id, records)
        .await
        .then_some((member.at, path))
}
