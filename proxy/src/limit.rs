//! The request body limit: reads a request body into memory up to the
//! configured limit (the transcript and the replay matcher need it whole;
//! request bodies are bounded, answers are streamed). Larger bodies get 413;
//! a body that has not all arrived by the body deadline gets 408.

use std::error::Error as StdError;
use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use http::{header, Request, Response};
use http_body::Body;
use http_body_util::{BodyExt, LengthLimitError, Limited};
use tower::{Layer, Service};

use crate::{Error, ProxyBody};

/// Why a request body could not be read.
#[derive(Debug, thiserror::Error)]
pub enum RequestError {
    /// The body is larger than the limit.
    #[error("request body larger than {limit} bytes")]
    TooLarge {
        /// The limit.
        limit: usize,
    },
    /// The body did not all arrive within the deadline.
    #[error("request body not received within {secs} s")]
    BodyTimeout {
        /// The deadline, seconds.
        secs: u64,
    },
    /// The client's body stream failed (disconnect, bad chunking).
    #[error("cannot read the request body")]
    BodyRead {
        /// What the server said.
        #[source]
        source: Box<dyn StdError + Send + Sync>,
    },
}

/// Tower layer reading request bodies up to a limit.
#[derive(Debug, Clone, Copy)]
pub(crate) struct LimitLayer {
    limit: usize,
    deadline: Duration,
}

/// The service made by [`LimitLayer`].
#[derive(Debug, Clone)]
pub(crate) struct Limit<S> {
    limit: usize,
    deadline: Duration,
    inner: S,
}

impl LimitLayer {
    /// Bodies of at most `limit` bytes, all arrived within `deadline`.
    pub(crate) fn new(limit: usize, deadline: Duration) -> Self {
        Self { limit, deadline }
    }
}

impl<S> Layer<S> for LimitLayer {
    type Service = Limit<S>;

    fn layer(&self, inner: S) -> Self::Service {
        Limit {
            limit: self.limit,
            deadline: self.deadline,
            inner,
        }
    }
}

impl<S, B> Service<Request<B>> for Limit<S>
where
    S: Service<Request<Bytes>, Response = Response<ProxyBody>, Error = Error> + Clone + Send + 'static,
    S::Future: Send + 'static,
    B: Body<Data = Bytes> + Send + 'static,
    B::Error: Into<Box<dyn StdError + Send + Sync>>,
{
    type Response = Response<ProxyBody>;
    type Error = Error;
    type Future = Pin<Box<dyn Future<Output = Result<Self::Response, Error>> + Send>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, req: Request<B>) -> Self::Future {
        let (limit, deadline) = (self.limit, self.deadline);
        let clone = self.inner.clone();
        let mut inner = std::mem::replace(&mut self.inner, clone);
        Box::pin(async move {
            let declared = req
                .headers()
                .get(header::CONTENT_LENGTH)
                .and_then(|v| v.to_str().ok())
                .and_then(|v| v.parse::<u64>().ok());
            if declared.is_some_and(|n| n > limit as u64) {
                return Err(RequestError::TooLarge { limit }.into());
            }
            let (parts, body) = req.into_parts();
            let collected = tokio::time::timeout(deadline, Limited::new(body, limit).collect())
                .await
                .map_err(|_| RequestError::BodyTimeout {
                    secs: deadline.as_secs(),
                })?;
            let body = match collected {
                Ok(collected) => collected.to_bytes(),
                Err(source) if source.is::<LengthLimitError>() => {
                    return Err(RequestError::TooLarge { limit }.into());
                }
                Err(source) => return Err(RequestError::BodyRead { source }.into()),
            };
            inner.call(Request::from_parts(parts, body)).await
        })
    }
}
