//! Turn ends: a sandbox's proxy (in its shim) reports that turn N ended and
//! holds that turn's answer until crabd answers. crabd asks the inspector
//! for the turn's class (`daemon::inspect`), makes a version of that class
//! (a manifest line only for `none`), and the answer releases the agent.

use std::sync::Arc;

use axum::body::Bytes;
use axum::extract::{Path, State};
use axum::Json;
use tracing::Instrument;

use super::routes::{detached, parse, take_checkpoint, Reply};
use super::Daemon;
use crate::api::{CheckpointReport, TurnEnd};

/// `POST /v1/sandboxes/{sel}/turns`: returns once the turn's version is
/// published (or refuses; the proxy then releases the answer anyway and
/// records the failure).
pub async fn turn_ended(
    State(d): State<Arc<Daemon>>,
    Path(sel): Path<String>,
    body: Bytes,
) -> Reply<CheckpointReport> {
    let end: TurnEnd = parse(&body)?;
    let reg = d.registry.resolve(&sel)?;
    let span = tracing::info_span!("turn", sandbox = reg.id, turn = end.turn);
    detached(
        async move {
            let d2 = d.clone();
            let id = reg.id.clone();
            let report = tokio::task::spawn_blocking(move || d2.inspection.turn_end(&id))
                .await
                .map_err(|e| super::ApiError::Internal {
                    reason: e.to_string(),
                })?;
            tracing::info!(class = ?report.class, reasons = report.reasons.len(), "turn classified");
            take_checkpoint(&d, reg, report.class, Some(end)).await.map(Json)
        }
        .instrument(span),
    )
    .await
}
