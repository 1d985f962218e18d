//! The replay layer: answers turn-end requests from the transcript while a
//! replay is active (see `replay` for the matching rule), and writes the
//! `divergence` and `branch` entries of the turn that goes live after it.

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};

use bytes::Bytes;
use http::{HeaderName, HeaderValue, Request, Response, StatusCode};
use http_body_util::{BodyExt, Full};
use tower::Service;

use crate::replay::{step, ReplayStep};
use crate::route::Route;
use crate::server::FromInside;
use crate::shared::Shared;
use crate::transcript::{Entry, RecordedResponse};
use crate::{Error, ProxyBody};

/// The recorded answer as a response, marked `x-crab-replayed: <turn>`.
fn replayed_response(turn: u64, recorded: RecordedResponse) -> Response<ProxyBody> {
    let mut resp = response_of(&recorded);
    resp.headers_mut()
        .insert("x-crab-replayed", HeaderValue::from(turn));
    resp
}

/// A recorded answer as a response (status, headers but the framing ones,
/// body).
pub(crate) fn response_of(recorded: &RecordedResponse) -> Response<ProxyBody> {
    let body = recorded.body.to_bytes().unwrap_or_default();
    let mut resp = Response::new(Full::new(body).map_err(|never| match never {}).boxed());
    *resp.status_mut() = StatusCode::from_u16(recorded.status).unwrap_or(StatusCode::OK);
    let headers = resp.headers_mut();
    for (name, value) in &recorded.headers {
        let skip = matches!(
            name.as_str(),
            "content-length" | "transfer-encoding" | "connection"
        );
        if let (false, Ok(name), Ok(value)) = (
            skip,
            HeaderName::from_bytes(name.as_bytes()),
            HeaderValue::from_str(value),
        ) {
            headers.append(name, value);
        }
    }
    resp
}

/// The number a live turn end was given (by the replay's step, under the
/// same lock that decided it goes live), for `TurnMark`.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Numbered {
    pub(crate) turn: u64,
    pub(crate) branch: u64,
}

/// The tower service that answers replayed turns from the transcript (stacked in `Sandbox::service`).
#[derive(Clone)]
pub(crate) struct ReplayService<S> {
    shared: Arc<Shared>,
    inner: S,
}

impl<S> ReplayService<S> {
    pub(crate) fn new(shared: Arc<Shared>, inner: S) -> Self {
        Self { shared, inner }
    }
}

impl<S> Service<Request<Bytes>> for ReplayService<S>
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
        let turn_end = req.extensions().get::<Route>().is_some_and(|r| r.turn_end);
        if !turn_end {
            return Box::pin(self.inner.call(req));
        }
        let path = req.uri().path_and_query().map_or("/", |pq| pq.as_str());
        let inside = req.extensions().get::<FromInside>().is_some();
        let step = self
            .shared
            .with_turns(|state| step(state, self.shared.id.as_str(), inside, path, req.body()));
        match step {
            ReplayStep::Live {
                turn,
                branch,
                entries,
            } => {
                for entry in entries {
                    match &entry {
                        Entry::Divergence(d) => {
                            self.shared.stats.update(|s| s.n_divergences += 1);
                            tracing::warn!(sandbox = %self.shared.id, turn = d.turn, "replay diverged: the request goes live");
                        }
                        Entry::Branch(b) => {
                            tracing::info!(sandbox = %self.shared.id, branch = b.branch, parent = b.parent, after = b.after, "the conversation branches");
                        }
                        Entry::Turn(_) | Entry::Tool(_) | Entry::Safety(_) | Entry::Overflow(_) => {}
                    }
                    self.shared.transcript.submit(entry);
                }
                req.extensions_mut().insert(Numbered { turn, branch });
                Box::pin(self.inner.call(req))
            }
            ReplayStep::Answer { turn, response } => {
                self.shared.stats.update(|s| {
                    s.n_turns += 1;
                    s.n_replayed += 1;
                });
                tracing::info!(sandbox = %self.shared.id, turn, "turn answered from the transcript");
                Box::pin(std::future::ready(Ok(replayed_response(turn, response))))
            }
        }
    }
}
