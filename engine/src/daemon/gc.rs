//! The life of a sandbox's history. A sandbox is known by its writable
//! layer (`Registration::layer`), or, when it names none, by when
//! containerd made its container. Its history lives as long as that:
//!
//! - a task that stops keeps its versions (its shim unregisters: the entry
//!   is marked stopped), and a task that starts again on the same layer
//!   goes on from them (docker makes a new containerd container at each
//!   start, on the same layer);
//! - when the layer is gone (the container was removed), crabd deletes the
//!   versions, process images and file snapshots; so it does when a
//!   sandbox with the same id but another layer registers;
//! - a running entry whose shim is gone (a crash) is marked stopped.
//!
//! Nothing is deleted on a guess: a layer that cannot be looked at, or a
//! containerd that does not answer, keeps the history.

use std::sync::Arc;
use std::time::Duration;

use crab_api::crabd::Registration;
use crab_api::{BackendKind, SandboxId, SnapshotName};

use super::files::Files;
use super::registry::Entry;
use super::work::{blocking_io, unix_ms};
use super::{ApiError, Daemon};
use crate::containerd::Containerd;

/// How long crabd waits for containerd to say when it made a container.
const ASK_LIMIT: Duration = Duration::from_secs(2);

/// When containerd made `reg`'s container, if its registration names no
/// layer and containerd says.
pub(super) async fn incarnation(reg: &Registration) -> Option<String> {
    if reg.layer.is_some() {
        return None;
    }
    match tokio::time::timeout(ASK_LIMIT, created_at(reg)).await {
        Ok(Ok(at)) => at.filter(|at| !at.is_empty()),
        Ok(Err(e)) => {
            tracing::warn!(sandbox = %reg.id, error = %crab_api::error_chain(&e), "cannot tell when its container was made");
            None
        }
        Err(_) => {
            tracing::warn!(
                sandbox = %reg.id,
                "containerd did not say when its container was made"
            );
            None
        }
    }
}

async fn created_at(reg: &Registration) -> Result<Option<String>, ApiError> {
    let containerd = Containerd::connect(&reg.containerd, &reg.namespace).await?;
    Ok(containerd.created_at(reg.id.as_str()).await?)
}

/// Whether the stopped sandbox of `entry` is gone for good.
async fn is_gone(entry: &Entry) -> bool {
    if let Some(layer) = &entry.registration.layer {
        // A ZFS layer is its dataset's mount point: its directory stays
        // when the dataset is destroyed.
        let mounted = entry.registration.fs_backend == Some(BackendKind::Zfs);
        return match layer.try_exists() {
            Ok(false) => true,
            Ok(true) => mounted && !is_mount_point(layer),
            Err(_) => false,
        };
    }
    match tokio::time::timeout(ASK_LIMIT, created_at(&entry.registration)).await {
        Ok(Ok(None)) => true,
        Ok(Ok(Some(at))) => entry
            .incarnation
            .as_ref()
            .is_some_and(|was| !at.is_empty() && *was != at),
        Ok(Err(e)) => {
            tracing::debug!(sandbox = %entry.registration.id, error = %crab_api::error_chain(&e), "containerd not asked");
            false
        }
        Err(_) => false,
    }
}

/// Whether `dir` is on another filesystem than its parent (a look that
/// fails says yes: nothing is deleted on a guess).
fn is_mount_point(dir: &std::path::Path) -> bool {
    use std::os::unix::fs::MetadataExt;
    match (std::fs::metadata(dir), std::fs::metadata(dir.join(".."))) {
        (Ok(d), Ok(parent)) => d.dev() != parent.dev(),
        _ => true,
    }
}

/// Whether nothing answers on the control socket of `reg`'s shim.
async fn shim_is_gone(reg: &Registration) -> bool {
    match tokio::net::UnixStream::connect(&reg.control).await {
        Ok(_) => false,
        Err(e) => matches!(
            e.kind(),
            std::io::ErrorKind::NotFound | std::io::ErrorKind::ConnectionRefused
        ),
    }
}

/// Every `[crabd] gc_interval_secs`: marks stopped the running entries
/// whose shim is gone, and drops the history of the stopped ones whose
/// sandbox is gone.
pub(super) async fn collect(d: Arc<Daemon>) {
    let mut tick = tokio::time::interval(d.config.gc_interval());
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tick.tick().await;
        for entry in d.registry.all() {
            let id = entry.registration.id.clone();
            sweep_copies(&d, &id).await;
            if entry.running {
                if shim_is_gone(&entry.registration).await {
                    let mut marked = false;
                    let updated = d.registry.update(&id, |e| {
                        // Not a newer registration under the same id.
                        if e.running && e.same_sandbox(&entry) && e.registration.pid == entry.registration.pid
                        {
                            e.running = false;
                            marked = true;
                        }
                    });
                    match updated {
                        Ok(_) if marked => {
                            d.inspection.unregister(&id);
                            tracing::info!(sandbox = %id, "its shim is gone: stopped");
                        }
                        Ok(_) => {}
                        Err(e) => {
                            tracing::warn!(sandbox = %id, error = %crab_api::error_chain(&e), "mark stopped")
                        }
                    }
                }
                continue;
            }
            if !is_gone(&entry).await {
                continue;
            }
            let _lifecycle = d.lifecycle.lock().await;
            let busy = d.busy(&id);
            let _one_at_a_time = busy.lock().await;
            // Started again meanwhile, or replaced: not this one to drop.
            if !d
                .registry
                .get(&id)
                .is_some_and(|e| !e.running && e.same_sandbox(&entry))
            {
                continue;
            }
            match purge(&d, &entry).await {
                Ok(()) => tracing::info!(sandbox = %id, "sandbox removed: its history is deleted"),
                Err(e) => {
                    tracing::warn!(sandbox = %id, error = %crab_api::error_chain(&e), "history of a removed sandbox kept")
                }
            }
        }
        let store = d.store.clone();
        let _ = tokio::task::spawn_blocking(move || store.empty_trash()).await;
    }
}

/// Deletes the file copies crabd keeps for sandbox `id` that no version
/// names: a checkpoint cut short (crabd or the shim killed between the
/// snapshot and the version's publication) leaves one. Skipped while an
/// operation holds the sandbox (a snapshot may be in the making), and when
/// a manifest line is unreadable (it may name a copy).
async fn sweep_copies(d: &Arc<Daemon>, id: &SandboxId) {
    let busy = d.busy(id);
    let Ok(_one_at_a_time) = busy.try_lock() else {
        return;
    };
    if !d.files.store_dir(id).exists() {
        return;
    }
    let (d2, sid) = (d.clone(), id.clone());
    let swept = blocking_io(move || {
        let mut named: Vec<SnapshotName> = Vec::new();
        for v in d2.store.versions(&sid)? {
            let Some(record) = v.record else {
                return Ok(Vec::new());
            };
            named.extend(
                record
                    .fs_snapshot
                    .filter(|f| f.backend == BackendKind::OverlayCopy)
                    .map(|f| f.name),
            );
        }
        d2.files.sweep(&sid, &named)
    })
    .await;
    match swept {
        Ok(gone) if !gone.is_empty() => {
            tracing::info!(sandbox = %id, ?gone, "file copies no version names removed")
        }
        Ok(_) => {}
        Err(e) => tracing::warn!(sandbox = %id, error = %crab_api::error_chain(&e), "file copies not swept"),
    }
}

/// Deletes everything crabd keeps of `entry`'s sandbox: versions, process
/// images, file snapshots (crabd's copies and the shim's own store), and
/// the entry itself. The bulk goes to the store's trash, emptied later.
/// The caller holds `Daemon::lifecycle`.
pub(super) async fn purge(d: &Daemon, entry: &Entry) -> Result<(), ApiError> {
    let reg = &entry.registration;
    let sid = reg.id.clone();
    let store = d.store.clone();
    let own = reg.own_snapshots.clone();
    let transcript = reg.transcript.clone();
    let unique = format!("fs-{sid}-{}", unix_ms());
    let files = d.files.clone();
    blocking_io(move || {
        match store.forget(&sid) {
            Ok(_) | Err(crate::StoreError::UnknownSandbox { .. }) => {}
            Err(e) => return Err(e.into()),
        }
        files.trash(&sid, &store.trash_dir(), &unique);
        if let Some(location) = own {
            Files::destroy_own(&location);
        }
        if let Some(path) = &transcript {
            remove_transcripts(path, &sid);
        }
        Ok(())
    })
    .await?;
    d.registry.remove_if(&reg.id, |e| e.same_sandbox(entry));
    d.scheduler.forget(&reg.id);
    d.turns.forget(&reg.id);
    d.events.remove(&reg.id);
    Ok(())
}

/// Deletes transcript `path` of sandbox `id` and those earlier containers
/// of the same id left beside it (`<id>.<nanos>.jsonl`): prompts and
/// answers go with the history they belong to.
fn remove_transcripts(path: &std::path::Path, id: &SandboxId) {
    let Some(dir) = path.parent() else { return };
    if path.file_name() != Some(std::ffi::OsStr::new(&format!("{id}.jsonl"))) {
        tracing::warn!(sandbox = %id, path = %path.display(), "not the sandbox's transcript: kept");
        return;
    }
    let earlier = |name: &str| {
        name.strip_prefix(&format!("{id}."))
            .and_then(|rest| rest.strip_suffix(".jsonl"))
            // Nanoseconds since the epoch (19 digits): never another
            // sandbox's id, such as `<id>.1`.
            .is_some_and(|n| n.len() >= 19 && n.bytes().all(|b| b.is_ascii_digit()))
    };
    let names = std::fs::read_dir(dir)
        .into_iter()
        .flatten()
        .flatten()
        .map(|e| e.file_name());
    for name in names.filter(|n| {
        n.to_str()
            .is_some_and(|n| n == format!("{id}.jsonl") || earlier(n))
    }) {
        let file = dir.join(&name);
        match std::fs::remove_file(&file) {
            Ok(()) => {
                tracing::info!(sandbox = %id, file = %file.display(), "transcript deleted with its history")
            }
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(e) => tracing::warn!(sandbox = %id, file = %file.display(), error = %e, "transcript kept"),
        }
    }
}
