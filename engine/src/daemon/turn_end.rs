//! Turn ends: a sandbox's proxy (in its shim) reports that turn N ended and
//! holds that turn's answer until crabd answers. crabd asks the inspector
//! for the turn's class (`inspect`), makes a version of that class (a
//! manifest line only for `none`), and the answer releases the agent.
//!
//! Invariant: a turn end names its sandbox by exact id; it is never
//! resolved as a prefix, so it cannot checkpoint another sandbox.

use std::sync::Arc;

use crab_api::crabd::{CheckpointReport, TurnEnd};
use crab_api::SandboxId;
use tracing::Instrument;

use super::work::detached;
use super::{ApiError, Daemon};

// === impl Daemon ===

impl Daemon {
    /// Makes the version of turn `end` of sandbox `id`; returns once it is
    /// published (or refuses; the proxy then releases the answer anyway and
    /// records the failure).
    pub(super) async fn turn_ended(
        self: &Arc<Self>,
        id: &SandboxId,
        end: TurnEnd,
    ) -> Result<CheckpointReport, ApiError> {
        let reg = self.registry.resolve_exact(id)?;
        let span = tracing::info_span!("turn", sandbox = %reg.id, turn = end.turn);
        let d = self.clone();
        detached(
            async move {
                let d2 = d.clone();
                let id = reg.id.clone();
                let report = tokio::task::spawn_blocking(move || d2.inspection.turn_end(&id)).await?;
                tracing::info!(class = %report.class, reasons = report.reasons.len(), "turn classified");
                d.checkpoint(reg, report.class, Some(end)).await
            }
            .instrument(span),
        )
        .await
    }
}
