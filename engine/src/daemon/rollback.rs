//! A rollback: the shim replaces the sandbox's processes (and files) with a
//! verified version's, after an undo checkpoint unless asked not to; or,
//! files only, writes the version's files in place under its running
//! processes, and a new whole version records the result. The
//! restored version becomes the sandbox's head: the next version descends
//! from it, and the inspector's ledger starts again from the restored
//! state. Turn ends whose capture had not started are superseded. A
//! recovery is the same restore of the head version, asked by the shim of
//! a sandbox whose init crashed.

use std::sync::Arc;
use std::time::Instant;

use crab_api::crabd::{Crash, EventKind, Recovery, Registration, RollbackReport, RollbackRequest};
use crab_api::shim::{
    ConversationAt, FsTarget, ShimFilesRestored, ShimRestore, ShimRestoreFiles, ShimRestored,
};
use crab_api::{routes, Class, SandboxId, SandboxSelector, VersionRecord, VersionSel};
use tracing::Instrument;

use super::versions::Pick;
use super::work::{blocking, detached};
use super::{ApiError, Daemon};

// === impl Daemon ===

impl Daemon {
    /// Puts sandbox `sel` back to version `req.version`.
    pub(super) async fn rollback(
        self: &Arc<Self>,
        sel: &SandboxSelector,
        req: RollbackRequest,
    ) -> Result<RollbackReport, ApiError> {
        let reg = self.registry.resolve(sel)?;
        let d = self.clone();
        let span = tracing::info_span!("rollback", sandbox = %reg.id, version = %req.version);
        detached(
            async move {
                let busy = d.busy(&reg.id);
                let _one_at_a_time = busy.lock().await;
                let done = match req.files_only {
                    true => d.restore_files(&reg, req.version).await,
                    false => {
                        d.restore_version(&reg, Pick::Sel(req.version), req.undo, None)
                            .await
                    }
                };
                d.log_event(&reg.id, rollback_event(&done, None));
                done
            }
            .instrument(span),
        )
        .await
    }

    /// Sandbox `id`'s init died without containerd asking (its shim says):
    /// its head version (else its newest valid one) is restored into the
    /// same container, without an undo checkpoint (nothing runs to save).
    pub(super) async fn recover(
        self: &Arc<Self>,
        id: &SandboxId,
        crash: Crash,
    ) -> Result<Recovery, ApiError> {
        let reg = self
            .registry
            .get(id)
            .map(|e| e.registration)
            .ok_or_else(|| ApiError::UnknownSandbox {
                sel: id.as_str().to_owned(),
            })?;
        let d = self.clone();
        let span = tracing::warn_span!("recover", sandbox = %reg.id, exit_status = crash.exit_status);
        detached(
            async move {
                let busy = d.busy(&reg.id);
                let _one_at_a_time = busy.lock().await;
                let started = Instant::now();
                let done = match d.restore_version(&reg, Pick::Head, false, None).await {
                    Ok(done) => done,
                    Err(e) => {
                        let error = crab_api::error_chain(&e);
                        d.log_event(
                            &reg.id,
                            EventKind::Failed {
                                what: "recovery".into(),
                                error,
                            },
                        );
                        return Err(e);
                    }
                };
                let recovery = Recovery {
                    version: done.version,
                    pid: done.pid,
                    exit_status: crash.exit_status,
                    at_unix_ms: std::time::SystemTime::now()
                        .duration_since(std::time::UNIX_EPOCH)
                        .map_or(0, |t| t.as_millis() as u64),
                    total_ms: started.elapsed().as_millis() as u64,
                    passed_over: done.passed_over,
                };
                d.registry.update(&reg.id, |e| {
                    e.recoveries += 1;
                    e.last_recovery = Some(recovery.clone());
                })?;
                d.metrics.recoveries.inc();
                d.log_event(
                    &reg.id,
                    EventKind::Recovery {
                        version: recovery.version,
                        exit_status: recovery.exit_status,
                        total_ms: recovery.total_ms,
                    },
                );
                tracing::warn!(
                    version = recovery.version,
                    pid = recovery.pid,
                    total_ms = recovery.total_ms,
                    passed_over = ?recovery.passed_over,
                    "recovered after a crash"
                );
                Ok(recovery)
            }
            .instrument(span),
        )
        .await
    }

    /// Replaces the processes (and files) of sandbox `reg` with version
    /// `which`'s, under the caller's hold of its busy lock, and makes that
    /// version its head. `notice`: None rewinds the conversation as usual;
    /// Some(notice) is a safety rollback's, which rewinds it only for an
    /// agent inside (Some(Some)), which gets the notice instead of the last
    /// answer it asks again, and leaves an agent outside as it is.
    pub(super) async fn restore_version(
        self: &Arc<Self>,
        reg: &Registration,
        which: Pick,
        undo: bool,
        notice: Option<Option<String>>,
    ) -> Result<RollbackReport, ApiError> {
        let d = self;
        let started = Instant::now();
        let (version, images_dir, passed_over) = d.pick(&reg.id, which).await?;
        let number = version.record.version;
        // From here the sandbox's state is replaced: turn ends not yet
        // captured are overtaken, and until the restore is done the sandbox
        // descends from no version (a crash in between makes the next
        // version whole, never a wrong pairing).
        d.turns.rolling_back(&reg.id);
        let _done = on_drop(|| d.turns.rolled_back(&reg.id));
        let store = d.store.clone();
        let sid = reg.id.clone();
        blocking(move || store.set_head(&sid, None)).await?;
        let conversation = match &notice {
            Some(None) => None,
            _ => d.conversation_at(&reg.id, &version.record).await,
        };
        let notice = notice.flatten();
        let call = ShimRestore {
            undo,
            conversation,
            notice,
            images_dir,
            fs: version.record.fs_snapshot.map(|f| FsTarget {
                name: f.name,
                store: d.files.store_dir(&reg.id),
            }),
        };
        let done: ShimRestored = d.call_shim(reg, routes::shim::RESTORE, &call).await?;
        // The sandbox is at the version from here: what follows is
        // bookkeeping, and a failure of it (a full disk) must not answer
        // that the rollback failed. A head left unset makes the next
        // version whole.
        d.registry.set_pid(&reg.id, done.pid);
        let store = d.store.clone();
        let sid = reg.id.clone();
        if let Err(e) = blocking(move || store.set_head(&sid, Some(number))).await {
            tracing::warn!(sandbox = %reg.id, version = number, error = %crab_api::error_chain(&e), "restored, but the head is not recorded: the next version is whole");
        }
        let d2 = d.clone();
        let sid = reg.id.clone();
        // The restored state is the next turn's start (the restored tasks
        // resuming their calls is no running: the inspector knows them).
        tokio::task::spawn_blocking(move || d2.inspection.reset(&sid)).await?;
        d.metrics.restore.observe(done.restore_ms / 1e3);
        let total_ms = started.elapsed().as_secs_f64() * 1e3;
        tracing::info!(
            version = number,
            pid = done.pid,
            restore_ms = done.restore_ms,
            elapsed_ms = total_ms,
            "restored"
        );
        Ok(RollbackReport {
            version: number,
            pid: done.pid,
            restore_ms: done.restore_ms,
            undo_ms: done.undo_ms,
            total_ms,
            files_from: None,
            passed_over,
        })
    }
}

impl Daemon {
    /// Puts the files of version `which` back into sandbox `reg` in place,
    /// its processes kept, and records the result as a new whole version
    /// (files and processes as they now are), under the caller's hold of
    /// its busy lock. From the sync on, the sandbox descends from no
    /// version until that one is published: a crash or a failure in
    /// between makes the next version whole, never files paired with a
    /// process image that did not see them.
    async fn restore_files(
        self: &Arc<Self>,
        reg: &Registration,
        which: VersionSel,
    ) -> Result<RollbackReport, ApiError> {
        let started = Instant::now();
        let store = self.store.clone();
        let sid = reg.id.clone();
        let version = blocking(move || match which {
            VersionSel::Latest => store.latest_valid(&sid),
            VersionSel::Number(n) => store.get(&sid, n),
        })
        .await?;
        let from = version.record.version;
        let fs = version.record.fs_snapshot.ok_or_else(|| ApiError::NoFsSnapshot {
            id: reg.id.clone(),
            version: from,
        })?;
        let call = ShimRestoreFiles {
            fs: FsTarget {
                name: fs.name,
                store: self.files.store_dir(&reg.id),
            },
        };
        // The version that follows must fit: else nothing is touched.
        self.room_for_capture(&reg.id, Class::Full).await?;
        // Durably first: from the sync on, the files stop matching the
        // head's process image.
        let store = self.store.clone();
        let sid = reg.id.clone();
        blocking(move || store.set_head(&sid, None)).await?;
        let done: ShimFilesRestored = self.call_shim(reg, routes::shim::RESTORE_FILES, &call).await?;
        // No head: a whole version, processes as they run now.
        let class = self.effective_class(reg, Class::Full)?;
        let slot = self
            .scheduler
            .admit(&reg.id, tokio::time::Instant::now(), true)
            .await;
        let made = self.capture(reg, class, None, Some(slot)).await?;
        let total_ms = started.elapsed().as_secs_f64() * 1e3;
        tracing::info!(
            from,
            version = made.version.version,
            written = done.written,
            removed = done.removed,
            frozen_ms = done.frozen_ms,
            elapsed_ms = total_ms,
            "files restored"
        );
        Ok(RollbackReport {
            version: made.version.version,
            pid: reg.pid,
            restore_ms: done.frozen_ms,
            undo_ms: 0.0,
            total_ms,
            files_from: Some(from),
            passed_over: Vec::new(),
        })
    }

    /// Where version `record` stands in its sandbox's conversation: its
    /// turn and branch (a version that ended no turn, a checkpoint by hand
    /// or a drain's, stands where its nearest ancestor that did), and the
    /// turn its process image was taken at (the restored agent's memory;
    /// unknown for an image of no turn). None when no ancestor ended a
    /// turn: the conversation then goes on as it is.
    pub(super) async fn conversation_at(
        &self,
        id: &SandboxId,
        record: &VersionRecord,
    ) -> Option<ConversationAt> {
        let store = self.store.clone();
        let (sid, record) = (id.clone(), record.clone());
        let found = blocking(move || {
            let lookup = |v: u64| store.record(&sid, v);
            // The nearest of it and its ancestors that ended a turn
            // (parents are older versions, so the walk ends).
            let mut at = Some(record.clone());
            while let Some(r) = at.as_ref().filter(|r| r.turn.is_none()) {
                at = match r.parent.filter(|p| *p < r.version) {
                    Some(p) => lookup(p)?,
                    None => None,
                };
            }
            let image_turn = match record.process_image {
                Some(v) if v == record.version => record.turn,
                Some(v) => lookup(v)?.and_then(|r| r.turn),
                None => None,
            };
            Ok(at.and_then(|r| {
                r.turn.map(|turn| ConversationAt {
                    branch: r.branch,
                    turn,
                    image_turn,
                })
            }))
        })
        .await;
        match found {
            Ok(at) => at,
            Err(e) => {
                tracing::warn!(sandbox = %id, error = %crab_api::error_chain(&e), "where the version stands is unknown: no replay");
                None
            }
        }
    }
}

/// Runs `f` when dropped: on success, on error, and when the task ends.
fn on_drop(f: impl FnOnce()) -> impl Drop {
    struct Guard<F: FnOnce()>(Option<F>);
    impl<F: FnOnce()> Drop for Guard<F> {
        fn drop(&mut self) {
            if let Some(f) = self.0.take() {
                f();
            }
        }
    }
    Guard(Some(f))
}

/// The event of a rollback that ended as `done`; `reason` when no person
/// or agent asked for it.
pub(super) fn rollback_event(done: &Result<RollbackReport, ApiError>, reason: Option<String>) -> EventKind {
    match done {
        Ok(r) => EventKind::Rollback {
            version: r.version,
            undo_ms: (r.undo_ms > 0.0).then_some(r.undo_ms),
            total_ms: r.total_ms,
            reason,
        },
        Err(e) => EventKind::Failed {
            what: "rollback".into(),
            error: crab_api::error_chain(e),
        },
    }
}
