//! The API's handlers.

use std::sync::Arc;
use std::time::{Instant, SystemTime, UNIX_EPOCH};

use axum::body::Bytes;
use axum::extract::{Path, State};
use axum::Json;
use std::path::PathBuf;

use crab_snapshotter::{BackendKind, Location, SnapshotName};
use serde::de::DeserializeOwned;

use super::registry::Entry;
use super::{gc, ApiError, Daemon};
use crate::api::{
    CheckpointReport, CheckpointRequest, ForkReport, ForkRequest, FsTarget, Registration, RemovalReport,
    RollbackReport, RollbackRequest, SandboxInfo, ShimCheckpoint, ShimCheckpointed, ShimForget,
    ShimForgotten, ShimRestore, ShimRestored, TurnEnd, VersionSel, VersionView,
};
use crate::client::UnixClient;
use crate::containerd::Containerd;
use crate::{Capture, Class, FsSnapshot, NewVersion, SandboxId, StoreError};

pub(super) type Reply<T> = Result<Json<T>, ApiError>;

pub(super) fn parse<T: DeserializeOwned>(body: &Bytes) -> Result<T, ApiError> {
    serde_json::from_slice(body).map_err(|e| ApiError::BadRequest {
        reason: e.to_string(),
    })
}

/// Runs `work` on its own task, so that a caller hanging up does not cut it
/// short, and blocking store calls off the reactor where they are marked.
pub(super) async fn detached<T: Send + 'static>(
    work: impl std::future::Future<Output = Result<T, ApiError>> + Send + 'static,
) -> Result<T, ApiError> {
    tokio::spawn(work).await.map_err(|e| ApiError::Internal {
        reason: e.to_string(),
    })?
}

pub(super) async fn blocking<T: Send + 'static>(
    f: impl FnOnce() -> Result<T, StoreError> + Send + 'static,
) -> Result<T, ApiError> {
    tokio::task::spawn_blocking(f)
        .await
        .map_err(|e| ApiError::Internal {
            reason: e.to_string(),
        })?
        .map_err(ApiError::from)
}

fn shim(d: &Daemon, reg: &Registration) -> UnixClient {
    UnixClient::new(
        &reg.control,
        format!("the shim of {}", reg.id),
        d.config.shim_timeout(),
    )
}

fn info(d: &Daemon, entry: Entry) -> SandboxInfo {
    let Entry {
        registration,
        running,
        ..
    } = entry;
    let versions = SandboxId::new(&registration.id)
        .ok()
        .and_then(|sid| d.store.versions(&sid).ok())
        .unwrap_or_default();
    let proxy_url = registration
        .proxy
        .as_ref()
        .and_then(|_| d.proxy_url(&registration.id));
    SandboxInfo {
        registration,
        running,
        proxy_url,
        versions: versions.len(),
        latest: versions
            .iter()
            .rev()
            .find_map(|v| v.record.as_ref().map(|r| r.version)),
    }
}

/// `GET /v1/sandboxes`.
pub async fn list(State(d): State<Arc<Daemon>>) -> Reply<Vec<SandboxInfo>> {
    let all = d.registry.all();
    Ok(Json(all.into_iter().map(|r| info(&d, r)).collect()))
}

/// `GET /v1/sandboxes/{sel}`.
pub async fn show(State(d): State<Arc<Daemon>>, Path(sel): Path<String>) -> Reply<SandboxInfo> {
    let entry = d.registry.find(&sel)?;
    Ok(Json(info(&d, entry)))
}

/// `POST /v1/sandboxes`: a shim registers its sandbox.
pub async fn register(State(d): State<Arc<Daemon>>, body: Bytes) -> Reply<SandboxInfo> {
    let reg: Registration = parse(&body)?;
    let sid = SandboxId::new(&reg.id)?;
    // No per-sandbox lock here: crabd's own import holds it while the
    // shim it started registers.
    let _lifecycle = d.lifecycle.lock().await;
    let incarnation = gc::incarnation(&reg).await;
    if let Some(old) = d.registry.get(&reg.id) {
        if old.replaced_by(&reg, incarnation.as_ref()) {
            tracing::info!(
                sandbox = reg.id,
                "another sandbox took a removed one's id: the old history goes"
            );
            gc::purge(&d, &old).await?;
        }
    }
    match d.store.register(&sid) {
        Ok(()) | Err(StoreError::SandboxExists { .. }) => {}
        Err(e) => return Err(e.into()),
    }
    let entry = Entry {
        registration: reg.clone(),
        running: true,
        incarnation,
    };
    d.registry.insert(entry.clone())?;
    d.inspection.register(&reg.id, reg.cgroup.as_deref());
    tracing::info!(
        sandbox = reg.id,
        namespace = reg.namespace,
        pid = reg.pid,
        "registered"
    );
    Ok(Json(info(&d, entry)))
}

/// `DELETE /v1/sandboxes/{id}`: the sandbox's task is gone. Its versions
/// stay until containerd removes its container (`gc`).
pub async fn unregister(State(d): State<Arc<Daemon>>, Path(id): Path<String>) -> Reply<serde_json::Value> {
    if !d.registry.update(&id, |e| e.running = false)? {
        return Err(ApiError::UnknownSandbox { sel: id });
    }
    d.inspection.unregister(&id);
    tracing::info!(sandbox = id, "stopped");
    Ok(Json(serde_json::json!({})))
}

/// `POST /v1/sandboxes/{sel}/checkpoint`.
pub async fn checkpoint(
    State(d): State<Arc<Daemon>>,
    Path(sel): Path<String>,
    body: Bytes,
) -> Reply<CheckpointReport> {
    let req: CheckpointRequest = parse(&body)?;
    let reg = d.registry.resolve(&sel)?;
    detached(async move { take_checkpoint(&d, reg, req.class, None).await.map(Json) }).await
}

/// Makes a version of `reg`'s sandbox as `class` asks, one operation per
/// sandbox at a time: a manifest line only (`none`), or a checkpoint by the
/// shim (freeze, snapshot files, dump processes, thaw), then publishes it.
/// `turn` is the turn end it belongs to, if a turn's proxy asked.
pub(super) async fn take_checkpoint(
    d: &Arc<Daemon>,
    reg: Registration,
    class: Class,
    turn: Option<TurnEnd>,
) -> Result<CheckpointReport, ApiError> {
    let busy = d.busy(&reg.id);
    let _one_at_a_time = busy.lock().await;
    let started = Instant::now();
    let sid = SandboxId::new(&reg.id)?;
    let needs_fs = matches!(class, Class::Fs | Class::Full);
    let fs = if needs_fs {
        let backend = reg
            .fs_backend
            .ok_or_else(|| ApiError::NoFsBackend { id: reg.id.clone() })?;
        let name = SnapshotName::new(&format!("c{}", unix_ms())).expect("a valid snapshot name");
        Some(FsSnapshot { backend, name })
    } else {
        None
    };
    let capture = match (class, fs.clone()) {
        (Class::Fs, Some(f)) => Capture::Fs(f),
        (Class::Full, Some(f)) => Capture::Full(f),
        (Class::Proc, _) => Capture::Proc,
        _ => Capture::Nothing,
    };
    let store = d.store.clone();
    let sid2 = sid.clone();
    let pending = blocking(move || {
        store.begin_version(
            &sid2,
            NewVersion {
                turn: turn.map(|t| t.turn),
                transcript_turns: turn.map_or(0, |t| t.transcript_turns),
                capture,
            },
        )
    })
    .await?;
    let frozen_ms = if class == Class::None {
        0.0
    } else {
        let call = ShimCheckpoint {
            images_dir: pending.images_dir().map(ToOwned::to_owned),
            fs: fs.map(|f| FsTarget {
                name: f.name,
                store: d.fs_store(&reg.id),
            }),
        };
        let done: ShimCheckpointed =
            shim(d, &reg)
                .post("/checkpoint", &call)
                .await
                .map_err(|source| ApiError::Shim {
                    id: reg.id.clone(),
                    source,
                })?;
        done.frozen_ms
    };
    let version = blocking(move || pending.publish()).await?;
    let total_ms = started.elapsed().as_secs_f64() * 1e3;
    if d.config.keep_versions > 0 {
        let store = d.store.clone();
        let keep = d.config.keep_versions;
        match blocking(move || store.retain(&sid, keep)).await {
            Ok(removal) => destroy_unused(d, &reg, &removal).await,
            Err(e) => tracing::warn!(sandbox = reg.id, "retention: {e}"),
        }
    }
    tracing::info!(sandbox = reg.id, version = version.version, turn = version.turn, class = ?version.class, frozen_ms, total_ms, "checkpoint published");
    Ok(CheckpointReport {
        version,
        frozen_ms,
        total_ms,
    })
}

/// `GET /v1/sandboxes/{sel}/versions`.
pub async fn versions(State(d): State<Arc<Daemon>>, Path(sel): Path<String>) -> Reply<Vec<VersionView>> {
    let reg = d.registry.find(&sel)?.registration;
    let sid = SandboxId::new(&reg.id)?;
    let store = d.store.clone();
    let list = blocking(move || store.versions(&sid)).await?;
    Ok(Json(
        list.into_iter()
            .map(|v| VersionView {
                line: v.line,
                record: v.record,
                defect: v.defect.map(|d| format!("{d:?}")),
            })
            .collect(),
    ))
}

/// `POST /v1/sandboxes/{sel}/rollback`.
pub async fn rollback(
    State(d): State<Arc<Daemon>>,
    Path(sel): Path<String>,
    body: Bytes,
) -> Reply<RollbackReport> {
    let req: RollbackRequest = parse(&body)?;
    let reg = d.registry.resolve(&sel)?;
    detached(async move {
        let busy = d.busy(&reg.id);
        let _one_at_a_time = busy.lock().await;
        let started = Instant::now();
        let (version, images_dir) = restorable(&d, &reg.id, req.version).await?;
        let number = version.record.version;
        let call = ShimRestore {
            undo: req.undo,
            images_dir,
            fs: version.record.fs_snapshot.map(|f| FsTarget {
                name: f.name,
                store: d.fs_store(&reg.id),
            }),
        };
        let done: ShimRestored =
            shim(&d, &reg)
                .post("/restore", &call)
                .await
                .map_err(|source| ApiError::Shim {
                    id: reg.id.clone(),
                    source,
                })?;
        d.registry.update(&reg.id, |e| e.registration.pid = done.pid)?;
        let total_ms = started.elapsed().as_secs_f64() * 1e3;
        tracing::info!(
            sandbox = reg.id,
            version = number,
            restore_ms = done.restore_ms,
            total_ms,
            "rolled back"
        );
        Ok(Json(RollbackReport {
            version: number,
            pid: done.pid,
            restore_ms: done.restore_ms,
            undo_ms: done.undo_ms,
            total_ms,
        }))
    })
    .await
}

/// `DELETE /v1/sandboxes/{sel}/versions/{version}`.
pub async fn remove_version(
    State(d): State<Arc<Daemon>>,
    Path((sel, version)): Path<(String, String)>,
) -> Reply<RemovalReport> {
    let reg = d.registry.find(&sel)?.registration;
    let n = match version.parse::<VersionSel>() {
        Ok(VersionSel::Number(n)) => n,
        Ok(VersionSel::Latest) => {
            return Err(ApiError::BadRequest {
                reason: "rm-version takes a version number, not `latest`".to_owned(),
            })
        }
        Err(reason) => return Err(ApiError::BadRequest { reason }),
    };
    detached(async move {
        let busy = d.busy(&reg.id);
        let _one_at_a_time = busy.lock().await;
        let sid = SandboxId::new(&reg.id)?;
        let store = d.store.clone();
        let removal = blocking(move || store.remove_version(&sid, n)).await?;
        destroy_unused(&d, &reg, &removal).await;
        Ok(Json(RemovalReport {
            removed: removal.versions,
        }))
    })
    .await
}

/// `POST /v1/sandboxes/{sel}/fork`: a new sandbox, in the same containerd
/// namespace, from one of this sandbox's versions.
pub async fn fork(State(d): State<Arc<Daemon>>, Path(sel): Path<String>, body: Bytes) -> Reply<ForkReport> {
    let req: ForkRequest = parse(&body)?;
    let reg = d.registry.find(&sel)?.registration;
    detached(async move {
        let busy = d.busy(&reg.id);
        let _one_at_a_time = busy.lock().await;
        let started = Instant::now();
        let (version, images) = restorable(&d, &reg.id, req.version).await?;
        let number = version.record.version;
        let fs = movable_files(&reg.id, &version.record)?;
        let new_id = match req.name {
            Some(name) => name,
            None => format!("{}-fork{number}-{}", reg.id, unix_ms() % 100_000),
        };
        SandboxId::new(&new_id)?;
        if d.registry.get(&new_id).is_some() {
            return Err(ApiError::SandboxExists { id: new_id });
        }
        let containerd = Containerd::connect(&reg.containerd, &reg.namespace).await?;
        let template = containerd.template(&reg.id).await?;
        let files = (d.fs_store(&reg.id), fs.name);
        let pid = start_copy(&d, &containerd, &template, &new_id, &images, files).await?;
        let total_ms = started.elapsed().as_secs_f64() * 1e3;
        tracing::info!(
            sandbox = reg.id,
            fork = new_id,
            version = number,
            pid,
            total_ms,
            "forked"
        );
        Ok(Json(ForkReport {
            id: new_id,
            pid,
            version: number,
            total_ms,
        }))
    })
    .await
}

/// Creates sandbox `new_id` in `containerd` from `template`: its files a
/// copy of snapshot `files.1` of the store `files.0`, its init restored
/// from `images` when the shim starts it. Nothing is left if it fails.
pub(super) async fn start_copy(
    d: &Daemon,
    containerd: &Containerd,
    template: &crate::containerd::ContainerTemplate,
    new_id: &str,
    images: &std::path::Path,
    files: (PathBuf, SnapshotName),
) -> Result<u32, ApiError> {
    let made = containerd.create_from(template, new_id, images).await?;
    let (source_store, name) = files;
    let upper = made.upper.clone();
    let target = Location::OverlayCopy {
        upper: made.upper.clone(),
        store: d.fs_store(new_id),
    };
    let copied = tokio::task::spawn_blocking(move || {
        // containerd made the upper directory; the copy makes it anew.
        if let Err(e) = std::fs::remove_dir(&upper) {
            tracing::debug!("remove the new, empty upper directory: {e}");
        }
        let backend = crab_snapshotter::OverlayCopyBackend::new(&source_store, &source_store);
        crab_snapshotter::Backend::clone_to(&backend, &name, &target).map(drop)
    })
    .await
    .map_err(|e| ApiError::Internal {
        reason: e.to_string(),
    })?;
    if let Err(source) = copied {
        containerd.remove(&made).await;
        return Err(ApiError::Fs {
            id: new_id.to_owned(),
            source,
        });
    }
    match containerd.start(&made).await {
        Ok(pid) => Ok(pid),
        Err(e) => {
            containerd.remove(&made).await;
            Err(e.into())
        }
    }
}

pub(super) fn unix_ms() -> u128 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap_or_default()
        .as_millis()
}

/// Version `which` of sandbox `id`, verified (checksums, image hashes), and
/// the directory of the process image it restores.
pub(super) async fn restorable(
    d: &Daemon,
    id: &str,
    which: VersionSel,
) -> Result<(crate::Version, PathBuf), ApiError> {
    let sid = SandboxId::new(id)?;
    let store = d.store.clone();
    let version = blocking(move || match which {
        VersionSel::Latest => store.latest_valid(&sid),
        VersionSel::Number(n) => store.get(&sid, n),
    })
    .await?;
    let images = version
        .images_dir
        .clone()
        .ok_or_else(|| ApiError::NoProcessImage {
            id: id.to_owned(),
            version: version.record.version,
        })?;
    Ok((version, images))
}

/// The file snapshot of version `record` of sandbox `id`, if it is one
/// crabd keeps and so can copy (for a fork or an export).
pub(super) fn movable_files(id: &str, record: &crate::VersionRecord) -> Result<FsSnapshot, ApiError> {
    let fs = record.fs_snapshot.clone().ok_or_else(|| ApiError::NoFsSnapshot {
        id: id.to_owned(),
        version: record.version,
    })?;
    if fs.backend != BackendKind::OverlayCopy {
        return Err(ApiError::NotMovable {
            id: id.to_owned(),
            version: record.version,
            backend: fs.backend,
        });
    }
    Ok(fs)
}

/// Destroys the file snapshots of sandbox `reg` that `removal` left unused:
/// the copies crabd keeps itself, and through the shim those on the
/// sandbox's own filesystem (the live tree is not touched).
async fn destroy_unused(d: &Daemon, reg: &Registration, removal: &crate::Removal) {
    let (copies, own): (Vec<&FsSnapshot>, Vec<&FsSnapshot>) = removal
        .unused_snapshots
        .iter()
        .partition(|s| s.backend == BackendKind::OverlayCopy);
    let store_dir = d.fs_store(&reg.id);
    for snap in copies {
        let backend = crab_snapshotter::OverlayCopyBackend::new(&store_dir, &store_dir);
        if let Err(e) = crab_snapshotter::Backend::destroy(&backend, &snap.name) {
            tracing::warn!(snapshot = %snap.name, "remove unused snapshot: {e}");
        }
    }
    if own.is_empty() {
        return;
    }
    if !d.registry.get(&reg.id).is_some_and(|e| e.running) {
        // Its shim is gone; they go with the rest when it is removed.
        return;
    }
    let call = ShimForget {
        snapshots: own.into_iter().map(|s| s.name.clone()).collect(),
    };
    match shim(d, reg).post::<_, ShimForgotten>("/forget", &call).await {
        Ok(done) if done.destroyed.len() == call.snapshots.len() => {}
        Ok(done) => tracing::warn!(
            sandbox = reg.id,
            asked = call.snapshots.len(),
            destroyed = done.destroyed.len(),
            "some unused snapshots are kept until the sandbox is deleted (see the shim's log)"
        ),
        Err(e) => tracing::warn!(
            sandbox = reg.id,
            "unused snapshots are kept until the sandbox is deleted: {e}"
        ),
    }
}

/// Any other path.
pub async fn not_found(uri: axum::http::Uri) -> ApiError {
    ApiError::BadRequest {
        reason: format!("no such API route: {}", uri.path()),
    }
}
