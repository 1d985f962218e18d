//! The history of sandboxes whose container is gone: a stopped sandbox
//! keeps its versions until containerd no longer has its container (or has
//! a new one with the same id), then its versions, process images and file
//! snapshots are deleted.

use std::sync::Arc;
use std::time::Duration;

use super::registry::Entry;
use super::{ApiError, Daemon};
use crate::api::Registration;
use crate::containerd::Containerd;
use crate::SandboxId;

/// How long crabd waits for containerd to say when it made a container.
const ASK_LIMIT: Duration = Duration::from_secs(5);

/// When containerd made `reg`'s container, if it can say: what tells a new
/// container with a removed one's id from it.
pub(super) async fn incarnation(reg: &Registration) -> Option<String> {
    match tokio::time::timeout(ASK_LIMIT, created_at(reg)).await {
        Ok(Ok(Some(at))) => Some(at),
        Ok(Ok(None)) => None,
        Ok(Err(e)) => {
            tracing::warn!(sandbox = reg.id, "cannot tell when its container was made: {e}");
            None
        }
        Err(_) => {
            tracing::warn!(
                sandbox = reg.id,
                "containerd did not say when its container was made"
            );
            None
        }
    }
}

async fn created_at(reg: &Registration) -> Result<Option<String>, ApiError> {
    let containerd = Containerd::connect(&reg.containerd, &reg.namespace).await?;
    Ok(containerd.created_at(&reg.id).await?)
}

/// Looks at the stopped sandboxes every `[crabd] gc_interval_secs`, and
/// drops the history of those whose container is gone.
pub(super) async fn collect(d: Arc<Daemon>) {
    let mut tick = tokio::time::interval(d.config.gc_interval());
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tick.tick().await;
        for entry in d.registry.all().into_iter().filter(|e| !e.running) {
            let id = entry.registration.id.clone();
            let now = tokio::time::timeout(ASK_LIMIT, created_at(&entry.registration)).await;
            let gone = match now {
                Ok(Ok(None)) => true,
                Ok(Ok(Some(at))) => entry.incarnation.as_ref().is_some_and(|was| *was != at),
                // containerd is down or slow: nothing is deleted on a guess.
                Ok(Err(e)) => {
                    tracing::debug!(sandbox = id, "containerd not asked: {e}");
                    false
                }
                Err(_) => false,
            };
            if !gone {
                continue;
            }
            let busy = d.busy(&id);
            let _one_at_a_time = busy.lock().await;
            // Started again meanwhile: it stays.
            if d.registry.get(&id).is_none_or(|e| e.running) {
                continue;
            }
            match purge(&d, &entry).await {
                Ok(()) => tracing::info!(sandbox = id, "container removed: its history is deleted"),
                Err(e) => tracing::warn!(sandbox = id, "history of a removed container kept: {e}"),
            }
        }
    }
}

/// Deletes everything crabd keeps of `entry`'s sandbox: versions, process
/// images, file snapshots (crabd's copies and the shim's own store), and
/// the entry itself.
pub(super) async fn purge(d: &Daemon, entry: &Entry) -> Result<(), ApiError> {
    let reg = &entry.registration;
    let sid = SandboxId::new(&reg.id)?;
    let store = d.store.clone();
    let copies = d.fs_store(&reg.id);
    let own = reg.own_snapshots.clone();
    tokio::task::spawn_blocking(move || -> Result<(), ApiError> {
        match store.forget(&sid) {
            Ok(_) | Err(crate::StoreError::UnknownSandbox { .. }) => {}
            Err(e) => return Err(e.into()),
        }
        if let Err(e) = std::fs::remove_dir_all(&copies) {
            if e.kind() != std::io::ErrorKind::NotFound {
                tracing::warn!(dir = %copies.display(), "file copies kept: {e}");
            }
        }
        if let Some(location) = own {
            destroy_store(&location);
        }
        Ok(())
    })
    .await
    .map_err(|e| ApiError::Internal {
        reason: e.to_string(),
    })??;
    d.registry.remove(&reg.id);
    Ok(())
}

/// Deletes every snapshot in the shim's own store, and the store.
fn destroy_store(location: &crab_snapshotter::Location) {
    let destroyed = crab_snapshotter::open(location).and_then(|b| {
        for s in b.list()? {
            b.destroy(&s.name)?;
        }
        Ok(())
    });
    if let Err(e) = destroyed {
        tracing::warn!(?location, "snapshots kept: {e}");
        return;
    }
    if let crab_snapshotter::Location::BtrfsSubvolume { store, .. } = location {
        let _ = std::fs::remove_dir(store);
        // The namespace's directory, once empty.
        let _ = store.parent().map(std::fs::remove_dir);
    }
}
