//! The turn-end mark: carries each live turn end's number and branch (given
//! by the replay layer) to the layers below, marks its answer with the
//! number (`x-crab-turn`, as a replayed one is marked `x-crab-replayed`),
//! and counts auxiliary requests.

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use http::{Request, Response};
use parking_lot::Mutex;
use tokio::time::Instant;
use tower::Service;
use tracing::Instrument;

use crate::outcome::GateOutcome;
use crate::replay_layer::Numbered;
use crate::route::Route;
use crate::shared::Shared;
use crate::transcript::unix_ms;
use crate::{Error, ProxyBody};

/// The header of a live turn end's answer that gives its turn's number.
pub(crate) const TURN_HEADER: &str = "x-crab-turn";

/// A live turn end, put in the request's extensions by [`TurnMark`].
#[derive(Debug, Clone)]
pub(crate) struct TurnCtx {
    pub(crate) turn: u64,
    /// The branch of the conversation it is on.
    pub(crate) branch: u64,
    pub(crate) route: Route,
    pub(crate) started: Instant,
    pub(crate) started_unix_ms: u64,
    released: Arc<Mutex<Option<(GateOutcome, Duration)>>>,
}

impl TurnCtx {
    pub(crate) fn set_released(&self, outcome: GateOutcome, hold: Duration) {
        *self.released.lock() = Some((outcome, hold));
    }

    /// The gate's outcome and hold, once it opened.
    pub(crate) fn released(&self) -> Option<(GateOutcome, Duration)> {
        *self.released.lock()
    }
}

/// The tower service that assigns turn numbers (stacked in `Sandbox::service`).
#[derive(Clone)]
pub(crate) struct TurnMark<S> {
    shared: Arc<Shared>,
    inner: S,
}

impl<S> TurnMark<S> {
    pub(crate) fn new(shared: Arc<Shared>, inner: S) -> Self {
        Self { shared, inner }
    }
}

impl<S> Service<Request<Bytes>> for TurnMark<S>
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

    fn call(&mut self, mut req: Request<Bytes>) -> Self::Future {
        let route = req.extensions().get::<Route>().copied();
        let Some(route) = route.filter(|r| r.turn_end) else {
            self.shared.stats.update(|s| s.n_aux_requests += 1);
            return Box::pin(self.inner.call(req));
        };
        // The replay layer numbered it, deciding it goes live.
        let Numbered { turn, branch } = req
            .extensions()
            .get::<Numbered>()
            .copied()
            .unwrap_or_else(|| self.shared.next_turn());
        self.shared.stats.update(|s| s.n_turns += 1);
        let ctx = TurnCtx {
            turn,
            branch,
            route,
            started: Instant::now(),
            started_unix_ms: unix_ms(),
            released: Arc::new(Mutex::new(None)),
        };
        req.extensions_mut().insert(ctx);
        let span =
            tracing::info_span!("turn", sandbox = %self.shared.id, turn, branch, bytes = req.body().len());
        let shared = self.shared.clone();
        let clone = self.inner.clone();
        let mut inner = std::mem::replace(&mut self.inner, clone);
        Box::pin(async move {
            if shared.transcript.over_budget() {
                // An agent that drops its answers and asks again at once
                // outruns the writer: its turn waits for what is queued.
                let target = shared.transcript.submitted();
                // Lost records are the gate's to report.
                let _ = shared.transcript.wait_durable(target).await;
            }
            let mut response = inner.call(req).instrument(span).await?;
            response
                .headers_mut()
                .insert(TURN_HEADER, http::HeaderValue::from(turn));
            Ok(response)
        })
    }
}
