//! The hold gate: a turn end's answer waits until the turn is safe.
//!
//! On a turn end the gate starts, in a task of the sandbox, the hook call and
//! the wait for the transcript's durability rule (see [`crate::transcript`]),
//! both under one deadline (the hook timeout). The request goes upstream at
//! the same time. The answer (response head, and so the first byte of a
//! stream) is released when both have finished: at once if they finished
//! first. Invariant: a failing or late hook releases the answer and is
//! recorded; the agent is never wedged.

use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use http::{Request, Response};
use tokio::sync::oneshot;
use tokio::time::Instant;
use tower::Service;

use crate::hook::{SafetyRollback, TurnEndCall, TurnVerdict};
use crate::outcome::GateOutcome;
use crate::replay_layer::response_of;
use crate::route::{Api, Route};
use crate::server::FromInside;
use crate::shared::Shared;
use crate::stats::TurnHold;
use crate::transcript::{Entry, SafetyRecord};
use crate::turn::TurnCtx;
use crate::{Error, ProxyBody};

/// The tower service that holds turn-end answers behind the gate (stacked in `Sandbox::service`).
#[derive(Clone)]
pub(crate) struct Gate<S> {
    shared: Arc<Shared>,
    inner: S,
}

/// Awaits `answer` and `gate` together; returns the answer, the outcome and
/// the hold: how long the answer waited for the gate (zero if the gate
/// opened first). `on_answer` runs when the answer arrives, with it, told
/// whether it must wait (the gate is still closed).
pub(crate) async fn hold<R, G>(
    gate: impl Future<Output = (G, Instant)>,
    answer: impl Future<Output = R>,
    on_answer: impl FnOnce(&R, bool),
) -> (R, G, Duration) {
    let opened = AtomicBool::new(false);
    let gate = async {
        let g = gate.await;
        opened.store(true, Ordering::SeqCst);
        g
    };
    let answer = async {
        let r = answer.await;
        on_answer(&r, !opened.load(Ordering::SeqCst));
        (r, Instant::now())
    };
    let ((r, answered_at), (outcome, opened_at)) = tokio::join!(answer, gate);
    (r, outcome, opened_at.saturating_duration_since(answered_at))
}

/// How a gate opened, and the engine's rollback of the turn, if it did.
type Opened = (GateOutcome, Option<SafetyRollback>);

/// Starts the gate of `turn`: the hook and the durability wait, in a task of
/// the sandbox (so the hook runs to its end even if the agent leaves).
fn open_gate(
    shared: &Arc<Shared>,
    turn: u64,
    branch: u64,
    inside: bool,
) -> impl Future<Output = (Opened, Instant)> {
    let expected = shared.expected_answer();
    let (tx, rx) = oneshot::channel();
    let durable_target = shared.transcript.submitted();
    let durable = shared.transcript.wait_durable(durable_target);
    let hook = shared.hook.clone();
    let sandbox = shared.id.clone();
    let timeout = shared.config.timeouts.hook;
    let cancel = shared.cancel.clone();
    let shared = shared.clone();
    shared.clone().tracker.spawn(async move {
        let deadline = Instant::now() + timeout;
        let work = async {
            let end = TurnEndCall {
                sandbox: &sandbox,
                turn,
                branch,
                expected_answer: expected,
                inside,
            };
            let hook = tokio::time::timeout_at(deadline, hook.turn_ended(end));
            let durable = tokio::time::timeout_at(deadline, durable);
            match tokio::join!(hook, durable) {
                (Err(_), _) => (GateOutcome::HookTimedOut, None),
                (Ok(Err(error)), _) => {
                    tracing::warn!(sandbox = %sandbox, turn, error = &error as &dyn std::error::Error, "turn hook failed; answer released");
                    (GateOutcome::HookFailed, None)
                }
                (Ok(Ok(TurnVerdict::RolledBack(r))), _) => {
                    record_rollback(&shared, turn, branch, &r);
                    (GateOutcome::RolledBack, Some(r))
                }
                (Ok(Ok(TurnVerdict::Safe)), Err(_)) => (GateOutcome::TranscriptTimedOut, None),
                (Ok(Ok(TurnVerdict::Safe)), Ok(Err(_lost))) => (GateOutcome::TranscriptFailed, None),
                (Ok(Ok(TurnVerdict::Safe)), Ok(Ok(()))) => (GateOutcome::Opened, None),
            }
        };
        let outcome = tokio::select! {
            outcome = work => outcome,
            () = cancel.cancelled() => (GateOutcome::Cancelled, None),
        };
        // The receiver is gone if the agent left; the outcome is then moot.
        let _ = tx.send((outcome, Instant::now()));
    });
    async move {
        rx.await
            .unwrap_or(((GateOutcome::Cancelled, None), Instant::now()))
    }
}

/// Records a turn's safety rollback in the transcript (which rule, what
/// broke it, where the sandbox went back to), whether or not its agent is
/// still there to be told.
fn record_rollback(shared: &Shared, turn: u64, branch: u64, r: &SafetyRollback) {
    tracing::warn!(sandbox = %shared.id, turn, rule = r.rule, what = r.what, version = r.version, "turn rolled back by a safety rule");
    shared.transcript.submit(Entry::Safety(SafetyRecord {
        v: 1,
        sandbox: shared.id.to_string(),
        turn,
        branch,
        rule: r.rule.clone(),
        what: r.what.clone(),
        version: r.version,
        unix_ms: crate::transcript::unix_ms(),
    }));
}

/// The notice of a turn's safety rollback, as the answer to its request.
fn notice_instead(api: Api, request: &Bytes, r: SafetyRollback) -> Response<ProxyBody> {
    response_of(&crate::notice::response(api, request, &r.notice))
}

impl<S> Gate<S> {
    pub(crate) fn new(shared: Arc<Shared>, inner: S) -> Self {
        Self { shared, inner }
    }
}

impl<S> Service<Request<Bytes>> for Gate<S>
where
    S: Service<Request<Bytes>, Response = Response<ProxyBody>, Error = Error> + Clone + Send + 'static,
    S::Future: Send + 'static,
{
    type Response = Response<ProxyBody>;
    type Error = Error;
    type Future = Pin<Box<dyn Future<Output = Result<Self::Response, Error>> + Send>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, req: Request<Bytes>) -> Self::Future {
        let ctx = req.extensions().get::<TurnCtx>().cloned();
        let clone = self.inner.clone();
        let mut inner = std::mem::replace(&mut self.inner, clone);
        let Some(ctx) = ctx else {
            return Box::pin(inner.call(req));
        };
        let inside = req.extensions().get::<FromInside>().is_some();
        let api = req.extensions().get::<Route>().map_or(Api::Other, |r| r.api);
        let request = req.body().clone();
        let gate = open_gate(&self.shared, ctx.turn, ctx.branch, inside);
        let stats = self.shared.stats.clone();
        let shared = self.shared.clone();
        Box::pin(async move {
            let sent = Instant::now();
            let on_answer = |answer: &Result<Response<ProxyBody>, Error>, waits: bool| {
                // Only a real answer tells how long the LLM takes: an error
                // at once would make every deadline the earliest.
                if answer.as_ref().is_ok_and(|r| r.status().is_success()) {
                    shared.saw_answer(sent.elapsed());
                }
                if waits {
                    let (hook, sandbox, turn) = (shared.hook.clone(), shared.id.clone(), ctx.turn);
                    shared
                        .tracker
                        .spawn(async move { hook.answer_waiting(&sandbox, turn).await });
                }
            };
            let (result, (outcome, rolled_back), held) = hold(gate, inner.call(req), on_answer).await;
            ctx.set_released(outcome, held);
            stats.turn_released(TurnHold {
                turn: ctx.turn,
                hold: held,
                outcome,
            });
            if !held.is_zero() {
                let (hook, sandbox, turn) = (shared.hook.clone(), shared.id.clone(), ctx.turn);
                shared
                    .tracker
                    .spawn(async move { hook.answer_released(&sandbox, turn, held).await });
            }
            tracing::debug!(
                turn = ctx.turn,
                ?outcome,
                hold_ms = held.as_secs_f64() * 1000.0,
                "answer released"
            );
            match rolled_back {
                // The answer belongs to a state that is gone: dropped.
                Some(r) => Ok(notice_instead(api, &request, r)),
                None => result,
            }
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Gate opening after `gate_ms`, answer after `answer_ms` (tokio's
    /// paused clock): the hold is exactly the difference when positive.
    async fn check(gate_ms: u64, answer_ms: u64, expected_hold_ms: u64) {
        let start = Instant::now();
        let gate = async move {
            tokio::time::sleep(Duration::from_millis(gate_ms)).await;
            (GateOutcome::Opened, Instant::now())
        };
        let answer = tokio::time::sleep(Duration::from_millis(answer_ms));
        let ((), outcome, held) = hold(gate, answer, |_, _| {}).await;
        assert_eq!(outcome, GateOutcome::Opened);
        assert_eq!(
            held,
            Duration::from_millis(expected_hold_ms),
            "gate {gate_ms} answer {answer_ms}"
        );
        assert_eq!(start.elapsed(), Duration::from_millis(gate_ms.max(answer_ms)));
    }

    #[tokio::test(start_paused = true)]
    async fn holds() {
        for (gate_ms, answer_ms, expected) in [
            (0, 0, 0),
            (0, 100, 0),
            (500, 100, 400),
            (500, 0, 500),
            (100, 100, 0),
        ] {
            check(gate_ms, answer_ms, expected).await;
        }
    }
}
