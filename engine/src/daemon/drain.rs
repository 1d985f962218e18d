//! A drain: the host is going away (a spot instance reclaimed, a node
//! drained), so every running sandbox gets a full version through the
//! host's queue, and, when asked, an archive of it to import elsewhere.
//!
//! The grace is one deadline for all; to make as many durable as possible
//! before it, the cheapest go first: each checkpoint is queued with the
//! deadline `start + its expected cost` (its last capture's bytes over
//! the queue's byte rate), so the queue's earliest-deadline
//! order is shortest-first. A sandbox not durable (and exported) by the
//! grace is reported missed; its work goes on, for what it is worth. One
//! drain runs at a time.

use std::os::unix::fs::{OpenOptionsExt, PermissionsExt};
use std::path::{Component, Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use crab_api::crabd::{DrainOutcome, DrainReport, DrainRequest, Registration, MAX_DRAIN_GRACE_SECS};
use crab_api::{Class, VersionSel};
use tokio::time::Instant;

use super::work::{blocking_io, detached};
use super::{ApiError, Daemon};

/// The byte rate a drain assumes when the queue has no budget.
const ASSUMED_BYTES_PER_SEC: f64 = 500e6;

// === impl Daemon ===

impl Daemon {
    /// Makes every running sandbox durable within `req.grace_secs`, each
    /// exported to `req.export_dir` when one is given.
    pub(super) async fn drain(self: &Arc<Self>, req: DrainRequest) -> Result<DrainReport, ApiError> {
        if !(1..=MAX_DRAIN_GRACE_SECS).contains(&req.grace_secs) {
            return Err(ApiError::BadRequest {
                reason: format!(
                    "a drain's grace is 1 to {MAX_DRAIN_GRACE_SECS} seconds, not {}",
                    req.grace_secs
                ),
            });
        }
        if let Some(dir) = &req.export_dir {
            check_export_dir(dir)?;
        }
        let Ok(only) = self.draining.clone().try_lock_owned() else {
            return Err(ApiError::DrainRunning);
        };
        let d = self.clone();
        detached(async move {
            let _only = only;
            d.drain_all(req).await
        })
        .await
    }

    async fn drain_all(self: &Arc<Self>, req: DrainRequest) -> Result<DrainReport, ApiError> {
        let started = Instant::now();
        let grace = Duration::from_secs(req.grace_secs);
        if let Some(dir) = &req.export_dir {
            let dir = dir.clone();
            blocking_io(move || make_private_dir(&dir)).await?;
        }
        let mut sandboxes: Vec<(Duration, Registration)> = self
            .registry
            .running()
            .into_iter()
            .map(|reg| (self.scheduler.expected_cost(&reg.id, ASSUMED_BYTES_PER_SEC), reg))
            .collect();
        sandboxes.sort_by_key(|(cost, reg)| (*cost, reg.id.clone()));
        tracing::warn!(
            sandboxes = sandboxes.len(),
            grace_secs = req.grace_secs,
            "draining the host"
        );
        let jobs = sandboxes.into_iter().map(|(cost, reg)| {
            let d = self.clone();
            let dir = req.export_dir.clone();
            let id = reg.id.clone();
            let work = tokio::spawn(async move { d.drain_one(reg, started + cost, started, dir).await });
            async move {
                match tokio::time::timeout_at(started + grace, work).await {
                    Ok(Ok(outcome)) => outcome,
                    Ok(Err(join)) => missed(id, join.to_string()),
                    Err(_) => missed(id, format!("not durable within the grace of {grace:?}")),
                }
            }
        });
        let sandboxes: Vec<DrainOutcome> = futures_util::future::join_all(jobs).await;
        let made = sandboxes.iter().filter(|s| s.made).count();
        let total_ms = started.elapsed().as_secs_f64() * 1e3;
        tracing::warn!(
            made,
            missed = sandboxes.len() - made,
            elapsed_ms = total_ms,
            "drained"
        );
        Ok(DrainReport {
            sandboxes,
            grace_secs: req.grace_secs,
            total_ms,
        })
    }

    /// One sandbox: a full version queued with `deadline`, then its archive.
    async fn drain_one(
        self: &Arc<Self>,
        reg: Registration,
        deadline: Instant,
        started: Instant,
        export_dir: Option<PathBuf>,
    ) -> DrainOutcome {
        let mut outcome = missed(reg.id.clone(), String::new());
        let busy = self.busy(&reg.id);
        let _one_at_a_time = busy.lock().await;
        let made = async {
            let class = self.effective_class(&reg, Class::Full)?;
            let slot = self.scheduler.admit(&reg.id, deadline, false).await;
            let report = self.capture(&reg, class, None, Some(slot)).await?;
            let number = report.version.version;
            outcome.version = Some(number);
            outcome.durable_ms = Some(started.elapsed().as_secs_f64() * 1e3);
            if let Some(dir) = export_dir {
                let file = self.archive_file(&reg, VersionSel::Number(number)).await?;
                let path = dir.join(format!("{}.crab", reg.id));
                let to = path.clone();
                blocking_io(move || write_private(file, &to)).await?;
                outcome.archive = Some(path);
                outcome.exported_ms = Some(started.elapsed().as_secs_f64() * 1e3);
            }
            Ok::<(), ApiError>(())
        }
        .await;
        match made {
            Ok(()) => {
                outcome.made = true;
                outcome.error = None;
            }
            Err(e) => outcome.error = Some(crab_api::error_chain(&e)),
        }
        outcome
    }
}

/// A sandbox the drain did not make durable, and why.
fn missed(id: crab_api::SandboxId, error: String) -> DrainOutcome {
    DrainOutcome {
        id,
        made: false,
        version: None,
        durable_ms: None,
        archive: None,
        exported_ms: None,
        error: Some(error),
    }
}

/// An export directory must be absolute and name no `..`.
fn check_export_dir(dir: &Path) -> Result<(), ApiError> {
    if !dir.is_absolute() || dir.components().any(|c| matches!(c, Component::ParentDir)) {
        return Err(ApiError::BadRequest {
            reason: format!(
                "an export directory is an absolute path without `..`, not {}",
                dir.display()
            ),
        });
    }
    Ok(())
}

/// Makes `dir` (and its parents) if absent, and the last one root's alone:
/// the archives hold the sandboxes' memory and environment. Refused when a
/// component is a symlink or the directory is another user's (who could
/// swap an archive in after it is written).
fn make_private_dir(dir: &Path) -> Result<(), ApiError> {
    use std::os::unix::fs::MetadataExt;
    let io = |op| move |source| ApiError::Io { op, source };
    std::fs::create_dir_all(dir).map_err(io("create the export directory"))?;
    let refused = |why: &str| ApiError::BadRequest {
        reason: format!("export directory {}: {why}", dir.display()),
    };
    if std::fs::canonicalize(dir).map_err(io("resolve the export directory"))? != dir {
        return Err(refused("a component of it is a symlink (give its real path)"));
    }
    let meta = std::fs::symlink_metadata(dir).map_err(io("inspect the export directory"))?;
    if !meta.is_dir() || meta.uid() != 0 {
        return Err(refused("not a directory of root's"));
    }
    std::fs::set_permissions(dir, std::fs::Permissions::from_mode(0o700))
        .map_err(io("chmod the export directory"))
}

/// Copies the archive `file` to `path` (0600, replacing an older one
/// whole: written beside it, synced, renamed in).
fn write_private(mut file: std::fs::File, path: &Path) -> Result<(), ApiError> {
    use std::io::Seek;
    let io = |op| move |source| ApiError::Io { op, source };
    let tmp = path.with_extension("crab.tmp");
    let _ = std::fs::remove_file(&tmp);
    let mut out = std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .custom_flags(nix::libc::O_NOFOLLOW)
        .open(&tmp)
        .map_err(io("create the archive"))?;
    file.rewind().map_err(io("read the archive"))?;
    std::io::copy(&mut file, &mut out).map_err(io("write the archive"))?;
    out.sync_all().map_err(io("sync the archive"))?;
    std::fs::rename(&tmp, path).map_err(io("rename the archive"))?;
    Ok(())
}
