//! Turn ends: a sandbox's proxy (in its shim) reports that turn N ended and
//! holds that turn's answer until crabd answers. crabd decides the turn's
//! class and makes its version; the answer releases the agent.

use std::sync::Arc;

use axum::body::Bytes;
use axum::extract::{Path, State};
use axum::Json;
use tracing::Instrument;

use super::routes::{detached, parse, take_checkpoint, Reply};
use super::Daemon;
use crate::api::{CheckpointReport, Registration, TurnEnd};
use crate::Class;

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
            let class = classify(&reg, &end);
            take_checkpoint(&d, reg, class, Some(end)).await.map(Json)
        }
        .instrument(span),
    )
    .await
}

/// The class of the turn that just ended.
///
/// The seam for the inspector: it will answer `none`, `fs`, `proc` or
/// `full` from what the sandbox's processes did during the turn. Until it
/// exists every turn is `full`, the answer that never loses work.
fn classify(_reg: &Registration, _end: &TurnEnd) -> Class {
    Class::Full
}
