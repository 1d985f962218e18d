//! A checkpoint: a version of a sandbox of the class asked for. `none` is
//! a manifest line only; otherwise the shim freezes the sandbox, snapshots
//! its files (`fs`, `full`), dumps its processes (`proc`, `full`) and thaws
//! it, and crabd hashes, fsyncs and publishes the version after the thaw.
//! Retention runs after.
//!
//! Every checkpoint takes the sandbox's lock, then a slot of the host's
//! queue (`schedule`), then captures. A sandbox without a head (new,
//! restarted, or its head removed) gets a whole version whatever the class:
//! there is nothing for a partial one to inherit.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Instant;

use crab_api::crabd::{CheckpointReport, Registration, TurnEnd};
use crab_api::shim::{FsTarget, ShimCheckpoint, ShimCheckpointed};
use crab_api::{routes, Class, FsSnapshot, SnapshotName};

use crab_api::crabd::EventKind;

use super::metrics::Metrics;
use super::schedule::Slot;
use super::turn_end::pod_whole;
use super::work::{blocking, detached, unix_ms};
use super::{ApiError, Daemon};
use crate::{Capture, NewVersion};

// === impl Daemon ===

impl Daemon {
    /// A checkpoint asked for by a person (`crabctl checkpoint`), on a
    /// task of its own: the version is made whole even if the caller hangs
    /// up. It is due now in the host's queue.
    pub(super) async fn checkpoint_detached(
        self: &Arc<Self>,
        reg: Registration,
        class: Class,
    ) -> Result<CheckpointReport, ApiError> {
        let d = self.clone();
        detached(async move {
            let busy = d.busy(&reg.id);
            let _one_at_a_time = busy.lock().await;
            let mut class = d.effective_class(&reg, class)?;
            if class != Class::None {
                // A capture of a pod with other containers covers them, and
                // so is whole (the shim refuses a partial one).
                let members = d.pod_members(&reg);
                class = pod_whole(&reg, (members, members), class);
            }
            d.room_for_capture(&reg.id, class).await?;
            let slot = d
                .scheduler
                .admit(&reg.id, tokio::time::Instant::now(), true)
                .await;
            d.capture(&reg, class, None, Some(slot)).await
        })
        .await
    }

    /// The class a version of `reg`'s sandbox must have when `class` is
    /// asked for: whole when the sandbox has no head (nothing to inherit),
    /// processes only when it has no filesystem backend. The caller holds
    /// the sandbox's lock.
    pub(super) fn effective_class(&self, reg: &Registration, class: Class) -> Result<Class, ApiError> {
        // In memory: no blocking thread needed.
        Ok(match self.store.head(&reg.id)? {
            Some(_) => class,
            None if reg.fs_backend.is_some() => Class::Full,
            None => Class::Proc,
        })
    }

    /// Makes a version of `reg`'s sandbox of `class` (see
    /// [`Daemon::effective_class`]) and publishes it; `turn` is the turn
    /// end it belongs to, if a proxy asked. The caller holds the sandbox's
    /// lock and, unless `class` is `none`, a `slot`, which is freed here.
    #[tracing::instrument(skip_all, fields(sandbox = %reg.id, %class))]
    pub(super) async fn capture(
        self: &Arc<Self>,
        reg: &Registration,
        class: Class,
        turn: Option<TurnEnd>,
        slot: Option<Slot>,
    ) -> Result<CheckpointReport, ApiError> {
        let made = self.make_version(reg, class, turn, slot).await;
        let event = match &made {
            Ok(r) => EventKind::Checkpoint {
                version: r.version.version,
                class: r.version.class,
                turn: r.version.turn,
                bytes: r.version.images.iter().map(|f| f.bytes).sum(),
                frozen_ms: r.frozen_ms,
                total_ms: r.total_ms,
            },
            Err(e) => EventKind::Failed {
                what: "checkpoint".into(),
                error: crab_api::error_chain(e),
            },
        };
        self.log_event(&reg.id, event);
        made
    }

    /// [`Daemon::capture`]'s work.
    async fn make_version(
        self: &Arc<Self>,
        reg: &Registration,
        class: Class,
        turn: Option<TurnEnd>,
        slot: Option<Slot>,
    ) -> Result<CheckpointReport, ApiError> {
        let started = Instant::now();
        let (urgent, queued_ms) = slot
            .as_ref()
            .map_or((false, 0.0), |s| (s.urgent, s.waited.as_secs_f64() * 1e3));
        let fs = if class.needs_fs() {
            let backend = reg
                .fs_backend
                .ok_or_else(|| ApiError::NoFsBackend { id: reg.id.clone() })?;
            // Digits and a letter: always a valid name.
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
        // A turn's files-only version: the inspector followed the pod's
        // other containers and saw them change nothing (any change, or one
        // not followed, makes the turn whole).
        let members_unchanged = turn.is_some() && class == Class::Fs;
        let store = self.store.clone();
        let sid = reg.id.clone();
        let pending = blocking(move || {
            store.begin_version(
                &sid,
                NewVersion {
                    turn: turn.as_ref().map(|t| t.turn),
                    branch: turn.as_ref().map_or(0, |t| t.branch),
                    transcript_turns: turn.as_ref().map_or(0, |t| t.transcript_turns),
                    capture,
                },
            )
        })
        .await?;
        if class == Class::None && pending.parent().is_none() {
            // The head went (a restart raced this turn end): a line that
            // inherits nothing would restore nothing.
            return Err(ApiError::HeadMoved { id: reg.id.clone() });
        }
        let mut own = None;
        let frozen_ms = if class == Class::None {
            0.0
        } else {
            let call = ShimCheckpoint {
                images_dir: pending.images_dir().map(ToOwned::to_owned),
                fs: fs.map(|f| FsTarget {
                    name: f.name,
                    store: self.files.store_dir(&reg.id),
                }),
                members_unchanged,
            };
            // While the shim freezes, dumps and thaws, CRIU's calls in
            // the sandbox's tasks are the capture's, not their running.
            let window = |on: bool| {
                let d = self.clone();
                let sid = reg.id.clone();
                tokio::task::spawn_blocking(move || d.inspection.capturing(&sid, on))
            };
            window(true).await?;
            let done = self.call_shim(reg, routes::shim::CHECKPOINT, &call).await;
            window(false).await?;
            let done: ShimCheckpointed = done?;
            own = Some(
                pending
                    .images_dir()
                    .map(ToOwned::to_owned)
                    .into_iter()
                    .chain(done.work_dir)
                    .chain(done.member_work_dirs)
                    .collect::<Vec<PathBuf>>(),
            );
            done.frozen_ms
        };
        // The sandbox runs again: hashing and fsyncs happen after the thaw,
        // beside the inspector's forgetting of the capture's own files.
        let d = self.clone();
        let sid = reg.id.clone();
        let forgotten = tokio::task::spawn_blocking(move || {
            if let Some(own) = own {
                d.inspection.forget_own_files(&sid, &own);
            }
        });
        let published = blocking(move || pending.publish()).await;
        forgotten.await?;
        let version = published?;
        let bytes: u64 = version.images.iter().map(|f| f.bytes).sum();
        if let Some(slot) = slot {
            slot.finish(bytes);
        }
        let total_ms = started.elapsed().as_secs_f64() * 1e3;
        let m = &self.metrics;
        m.versions.get_or_create(&Metrics::class(version.class)).inc();
        m.bytes
            .get_or_create(&Metrics::kind("process_image"))
            .inc_by(bytes);
        m.checkpoint.observe(total_ms / 1e3);
        if class != Class::None {
            m.frozen.observe(frozen_ms / 1e3);
        }
        if self.config.keep_versions > 0 {
            let store = self.store.clone();
            let keep = self.config.keep_versions;
            let sid = reg.id.clone();
            match blocking(move || store.retain(&sid, keep)).await {
                Ok(removal) => self.destroy_unused(reg, &removal).await,
                Err(e) => tracing::warn!(sandbox = %reg.id, error = %crab_api::error_chain(&e), "retention"),
            }
        }
        tracing::info!(
            sandbox = %reg.id,
            version = version.version,
            parent = version.parent,
            turn = version.turn,
            class = %version.class,
            frozen_ms,
            elapsed_ms = total_ms,
            queued_ms,
            urgent,
            "version published"
        );
        Ok(CheckpointReport {
            version,
            frozen_ms,
            total_ms,
            rolled_back: None,
        })
    }
}
