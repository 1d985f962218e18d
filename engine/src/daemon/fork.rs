//! A fork: a new sandbox, in the same containerd namespace, from one of a
//! sandbox's versions (its files copied, its processes restored at Start).

use std::path::Path;
use std::sync::Arc;
use std::time::Instant;

use crab_api::crabd::{ForkReport, ForkRequest};
use crab_api::{SandboxId, SandboxSelector, SnapshotName};
use tracing::Instrument;

use super::versions::movable_files;
use super::work::{blocking_io, detached, unix_ms};
use super::{ApiError, Daemon};
use crate::containerd::{ContainerTemplate, Containerd};

/// Where a copy's files come from: a snapshot of a sandbox's store.
pub(super) struct FilesFrom {
    /// The sandbox whose store holds it.
    pub sandbox: SandboxId,
    /// The snapshot.
    pub name: SnapshotName,
}

// === impl Daemon ===

impl Daemon {
    /// Starts a new sandbox from version `req.version` of sandbox `sel`.
    pub(super) async fn fork(
        self: &Arc<Self>,
        sel: &SandboxSelector,
        req: ForkRequest,
    ) -> Result<ForkReport, ApiError> {
        let reg = self.registry.find(sel)?.registration;
        let d = self.clone();
        let span = tracing::info_span!("fork", sandbox = %reg.id, version = %req.version);
        detached(
            async move {
                let busy = d.busy(&reg.id);
                let _one_at_a_time = busy.lock().await;
                let started = Instant::now();
                let (version, images) = d.restorable(&reg.id, req.version).await?;
                let number = version.record.version;
                let fs = movable_files(&version.record)?;
                let new_id = match req.name {
                    Some(name) => name,
                    None => SandboxId::new(format!("{}-fork{number}-{}", reg.id, unix_ms() % 100_000))?,
                };
                if d.registry.get(&new_id).is_some() {
                    return Err(ApiError::SandboxExists { id: new_id });
                }
                let containerd = Containerd::connect(&reg.containerd, &reg.namespace).await?;
                let template = containerd.template(reg.id.as_str()).await?;
                let from = FilesFrom {
                    sandbox: reg.id.clone(),
                    name: fs.name,
                };
                let pid = d
                    .start_copy(&containerd, &template, &new_id, &images, from)
                    .await?;
                let total_ms = started.elapsed().as_secs_f64() * 1e3;
                tracing::info!(fork = %new_id, pid, elapsed_ms = total_ms, "forked");
                Ok(ForkReport {
                    id: new_id,
                    pid,
                    version: number,
                    total_ms,
                })
            }
            .instrument(span),
        )
        .await
    }

    /// Creates sandbox `new_id` in `containerd` from `template`: its files
    /// a copy of `files`, its init restored from `images` when the shim
    /// starts it. Nothing is left if it fails.
    pub(super) async fn start_copy(
        self: &Arc<Self>,
        containerd: &Containerd,
        template: &ContainerTemplate,
        new_id: &SandboxId,
        images: &Path,
        files: FilesFrom,
    ) -> Result<u32, ApiError> {
        let files_from_elsewhere = files.sandbox != *new_id;
        let made = containerd.create_from(template, new_id.as_str(), images).await?;
        let upper = made.upper.clone();
        let d = self.clone();
        let to = new_id.clone();
        let copied = blocking_io(move || {
            // containerd made the upper directory; the copy makes it anew.
            if let Err(e) = std::fs::remove_dir(&upper) {
                tracing::debug!(error = %e, "remove the new, empty upper directory");
            }
            d.files.clone_into(&files.sandbox, &files.name, &to, &upper)
        })
        .await;
        let started = match copied {
            Ok(()) => containerd.start(&made).await.map_err(ApiError::from),
            Err(e) => Err(e),
        };
        if started.is_err() {
            containerd.remove(&made).await;
            // An import's own store holds the version it restores; a fork's
            // is new and goes.
            if files_from_elsewhere {
                let (files, id) = (self.files.clone(), new_id.clone());
                let _ = tokio::task::spawn_blocking(move || files.remove_store(&id)).await;
            }
        }
        started
    }
}
