//! The transcript tee: copies a turn's request and answer into its record as
//! the answer streams to the agent, without holding the stream back.
//!
//! Each chunk is passed on as soon as it arrives; the record keeps at most
//! the configured cap (chunks are reference-counted, not copied, until the
//! record is encoded). The record is submitted when the body ends, fails, or
//! is dropped by a departing agent (the end-of-stream callback is the body's
//! `poll_frame` returning its last frame, or its `Drop`).

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};

use bytes::Bytes;
use http::{Request, Response};
use http_body::{Body, Frame, SizeHint};
use http_body_util::BodyExt;
use tower::Service;

use crate::shared::Shared;
use crate::transcript::{
    record_headers, Entry, RecordedBody, RecordedRequest, RecordedResponse, StreamEnd, Timing, TurnRecord,
};
use crate::turn::TurnCtx;
use crate::upstream::StreamError;
use crate::{Error, ProxyBody};

/// The tower service that tees turn exchanges into the transcript (stacked in `Sandbox::service`).
#[derive(Clone)]
pub(crate) struct Tee<S> {
    shared: Arc<Shared>,
    inner: S,
}

/// A record being filled; submitted exactly once (on end, error or drop).
struct Draft {
    shared: Arc<Shared>,
    ctx: TurnCtx,
    record: TurnRecord,
    chunks: Vec<Bytes>,
    n_kept: usize,
}

/// A response body that feeds its chunks to a [`Draft`].
struct TeeBody {
    inner: ProxyBody,
    draft: Option<Draft>,
}

impl<S> Tee<S> {
    pub(crate) fn new(shared: Arc<Shared>, inner: S) -> Self {
        Self { shared, inner }
    }
}

impl<S> Service<Request<Bytes>> for Tee<S>
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
        let Some(ctx) = req.extensions().get::<TurnCtx>().cloned() else {
            return Box::pin(self.inner.call(req));
        };
        let record = TurnRecord {
            v: 1,
            sandbox: self.shared.id.to_string(),
            turn: ctx.turn,
            branch: ctx.branch,
            api: ctx.route.api,
            method: req.method().to_string(),
            path: req
                .uri()
                .path_and_query()
                .map_or("/", |pq| pq.as_str())
                .to_owned(),
            request: RecordedRequest {
                headers: record_headers(req.headers()),
                body: RecordedBody::from_bytes(req.body()),
            },
            response: None,
            error: None,
            gate: None,
            timing: Timing {
                started_unix_ms: ctx.started_unix_ms,
                headers_us: None,
                first_byte_us: None,
                end_us: 0,
                hold_us: None,
            },
        };
        let mut draft = Draft {
            shared: self.shared.clone(),
            ctx,
            record,
            chunks: Vec::new(),
            n_kept: 0,
        };
        let fut = self.inner.call(req);
        Box::pin(async move {
            match fut.await {
                Ok(resp) => {
                    draft.record.timing.headers_us = Some(draft.elapsed_us());
                    draft.record.response = Some(RecordedResponse {
                        status: resp.status().as_u16(),
                        headers: record_headers(resp.headers()),
                        body: RecordedBody::Text(String::new()),
                        n_bytes: 0,
                        capped: false,
                        end: StreamEnd::Complete,
                    });
                    let (parts, body) = resp.into_parts();
                    let mut tee = TeeBody {
                        inner: body,
                        draft: Some(draft),
                    };
                    if tee.inner.is_end_stream() {
                        tee.finish(StreamEnd::Complete);
                    }
                    Ok(Response::from_parts(parts, tee.boxed()))
                }
                Err(error) => {
                    draft.record.error = Some(error.code().to_owned());
                    draft.submit();
                    Err(error)
                }
            }
        })
    }
}

// === impl Draft ===

impl Draft {
    fn elapsed_us(&self) -> u64 {
        self.ctx.started.elapsed().as_micros() as u64
    }

    fn push(&mut self, chunk: &Bytes) {
        if self.record.timing.first_byte_us.is_none() {
            self.record.timing.first_byte_us = Some(self.elapsed_us());
        }
        let cap = self.shared.config.limits.transcript_body_cap;
        let Some(resp) = self.record.response.as_mut() else {
            return;
        };
        resp.n_bytes += chunk.len() as u64;
        let room = cap.saturating_sub(self.n_kept);
        if chunk.len() > room {
            resp.capped = true;
        }
        let kept = chunk.slice(..chunk.len().min(room));
        if !kept.is_empty() {
            self.n_kept += kept.len();
            self.chunks.push(kept);
        }
    }

    fn submit(mut self) {
        self.record.timing.end_us = self.elapsed_us();
        if let Some((outcome, hold)) = self.ctx.released() {
            self.record.gate = Some(outcome);
            self.record.timing.hold_us = Some(hold.as_micros() as u64);
        }
        if let Some(resp) = self.record.response.as_mut() {
            resp.body = RecordedBody::from_bytes(&self.chunks.concat());
        }
        self.shared.transcript.submit(Entry::Turn(self.record));
    }
}

// === impl TeeBody ===

impl TeeBody {
    fn finish(&mut self, end: StreamEnd) {
        if let Some(mut draft) = self.draft.take() {
            if let Some(resp) = draft.record.response.as_mut() {
                resp.end = end;
            }
            draft.submit();
        }
    }
}

impl Drop for TeeBody {
    fn drop(&mut self) {
        // Dropped before its end: the agent went away (hyper drops the body
        // of a response whose connection closed).
        self.finish(StreamEnd::ClientDisconnected);
    }
}

impl Body for TeeBody {
    type Data = Bytes;
    type Error = StreamError;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, StreamError>>> {
        let this = &mut *self;
        let polled = Pin::new(&mut this.inner).poll_frame(cx);
        match &polled {
            Poll::Ready(Some(Ok(frame))) => {
                if let (Some(data), Some(draft)) = (frame.data_ref(), this.draft.as_mut()) {
                    draft.push(data);
                }
                // A length-delimited body is over with its last data frame;
                // submit now so that the record is queued before the agent
                // can have read the end of the answer.
                if this.inner.is_end_stream() {
                    this.finish(StreamEnd::Complete);
                }
            }
            Poll::Ready(Some(Err(error))) => {
                let end = match error {
                    StreamError::Upstream { .. } | StreamError::Sandbox { .. } => StreamEnd::UpstreamError,
                    StreamError::IdleTimeout { .. } => StreamEnd::IdleTimeout,
                    StreamError::TotalTimeout { .. } => StreamEnd::TotalTimeout,
                };
                tracing::warn!(error = error as &dyn std::error::Error, "answer stream cut");
                this.finish(end);
            }
            Poll::Ready(None) => this.finish(StreamEnd::Complete),
            Poll::Pending => {}
        }
        polled
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}
