//! Moving a sandbox between hosts: export one version as an archive
//! (`crate::archive`), import an archive as a new sandbox that runs.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Instant;

use axum::body::Body;
use axum::extract::{Path, Query, State};
use axum::http::header;
use axum::response::{IntoResponse, Response};
use axum::Json;
use crab_snapshotter::{Backend, BackendKind, OverlayCopyBackend};
use futures_util::StreamExt;
use serde::Deserialize;
use tokio::io::AsyncWriteExt;

use super::routes::{blocking, restorable, start_copy};
use super::{ApiError, Daemon};
use crate::api::{ImportReport, VersionSel};
use crate::archive::{self, ArchiveError};
use crate::containerd::Containerd;
use crate::{Capture, FsSnapshot, NewVersion, SandboxId, StoreError};

/// `GET /v1/sandboxes/{sel}/versions/{version}/export`: the archive of a
/// verified version, streamed.
pub async fn export(
    State(d): State<Arc<Daemon>>,
    Path((sel, version)): Path<(String, String)>,
) -> Result<Response, ApiError> {
    let reg = d.registry.find(&sel)?.registration;
    let which: VersionSel = version
        .parse()
        .map_err(|reason| ApiError::BadRequest { reason })?;
    let file = super::routes::detached(async move {
        let busy = d.busy(&reg.id);
        let _one_at_a_time = busy.lock().await;
        let (v, images_dir) = restorable(&d, &reg.id, which).await?;
        let number = v.record.version;
        let fs = super::routes::movable_files(&reg.id, &v.record)?;
        // The image files: this version's, or those of the one it reuses.
        let images = match v.record.process_image {
            Some(holder) if holder != number => {
                let store = d.store.clone();
                let sid = SandboxId::new(&reg.id)?;
                blocking(move || store.get(&sid, holder)).await?.record.images
            }
            _ => v.record.images.clone(),
        };
        let template = Containerd::connect(&reg.containerd, &reg.namespace)
            .await?
            .template(&reg.id)
            .await?;
        let staging = d.staging("export")?;
        let fs_store = d.fs_store(&reg.id);
        let record = v.record.clone();
        let made = tokio::task::spawn_blocking(move || -> Result<std::fs::File, ApiError> {
            let stream_path = staging.join(archive::FS_STREAM);
            let mut stream = std::fs::File::create(&stream_path).map_err(|source| ApiError::Io {
                op: "create the filesystem stream",
                source,
            })?;
            OverlayCopyBackend::new(&fs_store, &fs_store)
                .export(&fs.name, None, &mut stream)
                .map_err(|source| ApiError::Fs {
                    id: record.sandbox.as_str().to_owned(),
                    source,
                })?;
            let tar_path = staging.join("archive.tar");
            let out = std::fs::File::create(&tar_path).map_err(|source| ApiError::Io {
                op: "create the archive",
                source,
            })?;
            archive::pack(
                std::io::BufWriter::new(out),
                &record,
                &template,
                &images_dir,
                &images,
                &fs.name,
                &stream_path,
            )?;
            let file = std::fs::File::open(&tar_path).map_err(|source| ApiError::Io {
                op: "open the archive",
                source,
            })?;
            // The open file outlives its directory; nothing stays behind.
            let _ = std::fs::remove_dir_all(&staging);
            Ok(file)
        })
        .await
        .map_err(|e| ApiError::Internal {
            reason: e.to_string(),
        })??;
        Ok(made)
    })
    .await?;
    let len = file.metadata().map(|m| m.len()).unwrap_or(0);
    let stream = tokio_util::io::ReaderStream::new(tokio::fs::File::from_std(file));
    Ok((
        [
            (header::CONTENT_TYPE, "application/x-tar".to_owned()),
            (header::CONTENT_LENGTH, len.to_string()),
        ],
        Body::from_stream(stream),
    )
        .into_response())
}

/// Where an import goes: the new sandbox's id and containerd.
#[derive(Debug, Deserialize)]
pub struct ImportQuery {
    /// The new sandbox's container id (default: the exported sandbox's).
    pub name: Option<String>,
    /// The containerd namespace (default: `[crabd] namespace`).
    pub namespace: Option<String>,
    /// containerd's socket (default: `[crabd] containerd`).
    pub containerd: Option<PathBuf>,
}

/// `POST /v1/import?name=&namespace=&containerd=` with an archive as the
/// body: a new sandbox whose version 1 is the archive's version, running.
pub async fn import(
    State(d): State<Arc<Daemon>>,
    query: Result<Query<ImportQuery>, axum::extract::rejection::QueryRejection>,
    body: Body,
) -> Result<Json<ImportReport>, ApiError> {
    let Query(q) = query.map_err(|e| ApiError::BadRequest {
        reason: e.body_text(),
    })?;
    let started = Instant::now();
    let staging = d.staging("import")?;
    let tar_path = staging.join("archive.tar");
    let received = receive(body, &tar_path).await;
    let result = match received {
        Ok(()) => super::routes::detached(import_staged(d.clone(), q, staging.clone(), started)).await,
        Err(e) => Err(e),
    };
    let _ = std::fs::remove_dir_all(&staging);
    result.map(Json)
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
    staging: PathBuf,
    started: Instant,
) -> Result<ImportReport, ApiError> {
    let unpack_dir = staging.join("unpacked");
    let tar_path = staging.join("archive.tar");
    let unpacked = tokio::task::spawn_blocking(move || {
        let f = std::fs::File::open(&tar_path).map_err(|source| ApiError::Io {
            op: "open the staged archive",
            source,
        })?;
        archive::unpack(std::io::BufReader::new(f), &unpack_dir).map_err(ApiError::from)
    })
    .await
    .map_err(|e| ApiError::Internal {
        reason: e.to_string(),
    })??;
    let m = &unpacked.manifest;
    let new_id = q
        .name
        .clone()
        .unwrap_or_else(|| m.version.sandbox.as_str().to_owned());
    let sid = SandboxId::new(&new_id)?;
    let busy = d.busy(&new_id);
    let _one_at_a_time = busy.lock().await;
    if d.registry.get(&new_id).is_some() {
        return Err(ApiError::SandboxExists { id: new_id });
    }
    match d.store.register(&sid) {
        Ok(()) => {}
        Err(StoreError::SandboxExists { .. }) if d.store.versions(&sid)?.is_empty() => {}
        Err(StoreError::SandboxExists { .. }) => return Err(ApiError::SandboxExists { id: new_id }),
        Err(e) => return Err(e.into()),
    }

    // The version, with its images moved in and its files imported.
    let fs_store = d.fs_store(&new_id);
    let name = m.fs.name.clone();
    let record = m.version.clone();
    let store = d.store.clone();
    let sid2 = sid.clone();
    let images_src = unpacked.images_dir.clone();
    let fs_stream = unpacked.fs_stream.clone();
    let images = m.images.clone();
    let version = tokio::task::spawn_blocking(move || -> Result<crate::VersionRecord, ApiError> {
        let pending = store.begin_version(
            &sid2,
            NewVersion {
                turn: record.turn,
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
                std::fs::create_dir_all(parent).map_err(|source| ApiError::Io {
                    op: "create an images directory",
                    source,
                })?;
            }
            std::fs::rename(images_src.join(&f.path), &to).map_err(|source| ApiError::Io {
                op: "move an image file",
                source,
            })?;
        }
        let mut input = std::fs::File::open(&fs_stream).map_err(|source| ApiError::Io {
            op: "open the filesystem stream",
            source,
        })?;
        OverlayCopyBackend::new(&fs_store, &fs_store)
            .import(&name, None, &mut input)
            .map_err(|source| ApiError::Fs {
                id: sid2.as_str().to_owned(),
                source,
            })?;
        Ok(pending.publish()?)
    })
    .await
    .map_err(|e| ApiError::Internal {
        reason: e.to_string(),
    })??;

    let namespace = q.namespace.unwrap_or_else(|| d.config.namespace.clone());
    let address = q.containerd.unwrap_or_else(|| d.config.containerd.clone());
    let started_copy = async {
        let containerd = Containerd::connect(&address, &namespace).await?;
        let store = d.store.clone();
        let sid3 = sid.clone();
        let n = version.version;
        let images_dir = blocking(move || store.get(&sid3, n))
            .await?
            .images_dir
            .expect("an imported version holds its images");
        let mut template = m.container.clone();
        // The template's spec names the exported container; the copy is renamed.
        template.id = m.version.sandbox.as_str().to_owned();
        start_copy(
            &d,
            &containerd,
            &template,
            &new_id,
            &images_dir,
            (d.fs_store(&new_id), m.fs.name.clone()),
        )
        .await
    }
    .await;
    let pid = match started_copy {
        Ok(pid) => pid,
        Err(e) => {
            // Nothing half-imported stays: the version goes again.
            let store = d.store.clone();
            let n = version.version;
            let _ = blocking(move || store.remove_version(&sid, n)).await;
            let _ = OverlayCopyBackend::new(&d.fs_store(&new_id), &d.fs_store(&new_id)).destroy(&m.fs.name);
            return Err(e);
        }
    };
    let total_ms = started.elapsed().as_secs_f64() * 1e3;
    tracing::info!(sandbox = new_id, from = %m.version.sandbox, pid, total_ms, "imported");
    Ok(ImportReport {
        id: new_id,
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
