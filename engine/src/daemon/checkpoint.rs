//! A checkpoint: a version of a sandbox of the class asked for. `none` is
//! a manifest line only; otherwise the shim freezes the sandbox, snapshots
//! its files (`fs`, `full`), dumps its processes (`proc`, `full`) and thaws
//! it, and crabd publishes the version. Retention runs after.

use std::sync::Arc;
use std::time::Instant;

use crab_api::crabd::{CheckpointReport, Registration, TurnEnd};
use crab_api::shim::{FsTarget, ShimCheckpoint, ShimCheckpointed};
use crab_api::{routes, Class, FsSnapshot, SnapshotName};

use super::work::{blocking, detached, unix_ms};
use super::{ApiError, Daemon};
use crate::{Capture, NewVersion};

// === impl Daemon ===

impl Daemon {
    /// [`Daemon::checkpoint`] on a task of its own: the version is made
    /// whole even if the caller hangs up.
    pub(super) async fn checkpoint_detached(
        self: &Arc<Self>,
        reg: Registration,
        class: Class,
    ) -> Result<CheckpointReport, ApiError> {
        let d = self.clone();
        detached(async move { d.checkpoint(reg, class, None).await }).await
    }

    /// Makes a version of `reg`'s sandbox as `class` asks, one operation per
    /// sandbox at a time, and publishes it. `turn` is the turn end it
    /// belongs to, if a turn's proxy asked.
    #[tracing::instrument(skip_all, fields(sandbox = %reg.id, %class))]
    pub(super) async fn checkpoint(
        &self,
        reg: Registration,
        class: Class,
        turn: Option<TurnEnd>,
    ) -> Result<CheckpointReport, ApiError> {
        let busy = self.busy(&reg.id);
        let _one_at_a_time = busy.lock().await;
        let started = Instant::now();
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
        let store = self.store.clone();
        let sid = reg.id.clone();
        let pending = blocking(move || {
            store.begin_version(
                &sid,
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
                    store: self.files.store_dir(&reg.id),
                }),
            };
            let done: ShimCheckpointed = self.call_shim(&reg, routes::shim::CHECKPOINT, &call).await?;
            done.frozen_ms
        };
        let version = blocking(move || pending.publish()).await?;
        let total_ms = started.elapsed().as_secs_f64() * 1e3;
        if self.config.keep_versions > 0 {
            let store = self.store.clone();
            let keep = self.config.keep_versions;
            let sid = reg.id.clone();
            match blocking(move || store.retain(&sid, keep)).await {
                Ok(removal) => self.destroy_unused(&reg, &removal).await,
                Err(e) => tracing::warn!(sandbox = %reg.id, error = %crab_api::error_chain(&e), "retention"),
            }
        }
        tracing::info!(
            sandbox = %reg.id,
            version = version.version,
            turn = version.turn,
            class = %version.class,
            frozen_ms,
            elapsed_ms = total_ms,
            "version published"
        );
        Ok(CheckpointReport {
            version,
            frozen_ms,
            total_ms,
        })
    }
}
