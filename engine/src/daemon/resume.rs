//! A resume: a sandbox whose task died with its host (or its shim) starts
//! again in its own container (containerd's and its snapshot reused) from
//! one of its versions: a copy of the version's files is exchanged with its
//! writable layer in one step (the layer as it was is kept until the
//! version runs, and put back if it does not), and its shim restores the
//! init at Start from the version's process image, going on with the
//! sandbox's transcript. `[crabd] resume_on_boot` does this at crabd's
//! start for every sandbox it knew running.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Instant;

use crab_api::crabd::{Registration, ResumeReport, ResumeRequest};
use crab_api::{SandboxId, SandboxSelector, SnapshotName, VersionSel};
use tracing::Instrument;

use super::files::Files;
use super::versions::{movable_files, Pick};
use super::work::{blocking, blocking_io, detached};
use super::{ApiError, Daemon};
use crate::containerd::{Containerd, Restore};

// === impl Daemon ===

impl Daemon {
    /// Starts sandbox `sel`, whose task is gone, from `req.version` (else
    /// its head or, when that cannot be restored, its nearest valid
    /// ancestor; with no head, its newest valid version).
    pub(super) async fn resume(
        self: &Arc<Self>,
        sel: &SandboxSelector,
        req: ResumeRequest,
    ) -> Result<ResumeReport, ApiError> {
        let reg = self.registry.find(sel)?.registration;
        let d = self.clone();
        let span = tracing::warn_span!("resume", sandbox = %reg.id);
        detached(
            async move {
                let busy = d.busy(&reg.id);
                let _one_at_a_time = busy.lock().await;
                d.resume_locked(&reg, req.version).await
            }
            .instrument(span),
        )
        .await
    }

    async fn resume_locked(
        self: &Arc<Self>,
        reg: &Registration,
        which: Option<VersionSel>,
    ) -> Result<ResumeReport, ApiError> {
        let started = Instant::now();
        let pick = which.map_or(Pick::Head, Pick::Sel);
        let (version, images, passed_over) = self.pick(&reg.id, pick).await?;
        let number = version.record.version;
        let fs = movable_files(&version.record)?;
        let containerd = Containerd::connect(&reg.containerd, &reg.namespace).await?;
        let container = containerd.resumable(reg.id.as_str()).await?;
        let conversation = self.conversation_at(&reg.id, &version.record).await;
        let (files, id, upper) = (self.files.clone(), reg.id.clone(), container.upper.clone());
        let old = blocking_io(move || swap_in_copy(&files, &id, &fs.name, &upper)).await?;
        // The restored registration keeps this head: the next version
        // descends from the version resumed.
        let store = self.store.clone();
        let sid = reg.id.clone();
        blocking(move || store.set_head(&sid, Some(number))).await?;
        let grant = self.grant_restore(&reg.id, &reg.namespace, &images).await?;
        let restore = Restore {
            images: &images,
            conversation: conversation.as_ref(),
            token: grant.token(),
        };
        containerd.set_restore(reg.id.as_str(), Some(&restore)).await?;
        let started_task = containerd.start(&container).await;
        drop(grant);
        // The annotations served this start only: a later one is afresh.
        if let Err(e) = containerd.set_restore(reg.id.as_str(), None).await {
            tracing::warn!(error = %crab_api::error_chain(&e), "the restore annotations stay on the container");
        }
        // The layer as it was goes once the version runs; if it does not
        // run, that layer is the sandbox's again.
        let upper = container.upper.clone();
        let ok = started_task.is_ok();
        let dropped = blocking_io(move || {
            if !ok {
                exchange(&old, &upper)?;
                move_journal(&old, &upper)?;
            }
            std::fs::remove_dir_all(&old).map_err(|source| ApiError::Io {
                op: "remove the layer set aside",
                source,
            })?;
            match std::fs::remove_file(crab_snapshotter::rollback_journal(&old)) {
                Err(e) if e.kind() != std::io::ErrorKind::NotFound => Err(ApiError::Io {
                    op: "remove the journal of the layer set aside",
                    source: e,
                }),
                _ => Ok(()),
            }
        })
        .await;
        if let Err(e) = dropped {
            tracing::warn!(error = %crab_api::error_chain(&e), "the layer set aside stays");
        }
        let pid = started_task?;
        let total_ms = started.elapsed().as_secs_f64() * 1e3;
        tracing::warn!(version = number, pid, elapsed_ms = total_ms, "resumed");
        Ok(ResumeReport {
            version: number,
            pid,
            total_ms,
            passed_over,
        })
    }

    /// `[crabd] resume_on_boot`: resumes each of `known` (the sandboxes the
    /// registry had running when crabd started) whose task is gone; one
    /// that cannot be is logged and left.
    pub(super) async fn resume_on_boot(self: &Arc<Self>, known: Vec<Registration>) {
        for reg in known {
            let sel = SandboxSelector::from(reg.id.clone());
            match self.resume(&sel, ResumeRequest { version: None }).await {
                Ok(r) => {
                    tracing::warn!(sandbox = %reg.id, version = r.version, pid = r.pid, "resumed at start")
                }
                Err(e) => {
                    tracing::info!(sandbox = %reg.id, error = %crab_api::error_chain(&e), "not resumed at start")
                }
            }
        }
    }
}

/// Makes `upper` (the writable layer of sandbox `id`'s container) a copy of
/// its snapshot `name`, and answers where the layer as it was went. The
/// copy is made beside it and exchanged with it in one step
/// (`renameat2(RENAME_EXCHANGE)`), so `upper` is always a whole layer (gc
/// never sees it gone, a crash leaves one or the other); a copy left by a
/// resume crabd did not finish is removed first.
fn swap_in_copy(
    files: &Files,
    id: &SandboxId,
    name: &SnapshotName,
    upper: &Path,
) -> Result<PathBuf, ApiError> {
    let file_name = upper
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    let beside = upper.with_file_name(format!("{file_name}.crab-resume"));
    if beside.exists() {
        std::fs::remove_dir_all(&beside).map_err(|source| ApiError::Io {
            op: "remove an unfinished resume's copy",
            source,
        })?;
    }
    if let Err(e) = files.clone_into(id, name, id, &beside) {
        let _ = std::fs::remove_dir_all(&beside);
        return Err(e);
    }
    if let Err(e) = exchange(&beside, upper) {
        let _ = std::fs::remove_dir_all(&beside);
        return Err(e);
    }
    // A rollback journal of the layer as it was goes aside with it: the
    // version's whole copy must not be "finished" into another snapshot.
    move_journal(upper, &beside)?;
    Ok(beside)
}

/// Moves the rollback journal of layer `from` (if it has one) to layer
/// `to`'s name, synced.
fn move_journal(from: &Path, to: &Path) -> Result<(), ApiError> {
    let journal = crab_snapshotter::rollback_journal(from);
    match std::fs::rename(&journal, crab_snapshotter::rollback_journal(to)) {
        Ok(()) => Ok(crate::store::sync_parent(&journal)?),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
        Err(source) => Err(ApiError::Io {
            op: "move a rollback journal aside",
            source,
        }),
    }
}

/// Exchanges directories `a` and `b` atomically.
fn exchange(a: &Path, b: &Path) -> Result<(), ApiError> {
    nix::fcntl::renameat2(None, a, None, b, nix::fcntl::RenameFlags::RENAME_EXCHANGE).map_err(|e| {
        ApiError::Io {
            op: "exchange the writable layer",
            source: e.into(),
        }
    })
}

/// Whether the host booted since crabd last ran with this root: the
/// kernel's boot id differs from the one kept in `<root>/boot_id` (which is
/// then updated). Unknown counts as restarted.
pub(super) fn host_restarted(root: &Path) -> bool {
    let Ok(now) = std::fs::read_to_string("/proc/sys/kernel/random/boot_id") else {
        return true;
    };
    let kept = root.join("boot_id");
    let before = std::fs::read_to_string(&kept).unwrap_or_default();
    if before == now {
        return false;
    }
    if let Err(e) = std::fs::write(&kept, &now) {
        tracing::warn!(path = %kept.display(), error = %e, "the boot id is not kept");
    }
    true
}
