//! The upstream client: the innermost service of a sandbox's request path.
//! Forwards a request unchanged (bar hop-by-hop headers) to the provider's
//! base URL, with separate header, idle and total deadlines.

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::Bytes;
use http::header::{self, HeaderName};
use http::{Request, Response, Uri};
use http_body::{Body, Frame, SizeHint};
use http_body_util::{BodyExt, Full};
use hyper::body::Incoming;
use hyper_rustls::HttpsConnector;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;
use tokio::time::{Instant, Sleep};
use tower::Service;

use crate::config::{ConfigError, Timeouts, Upstreams};
use crate::route::{Provider, Route};
use crate::stats::StatsCell;
use crate::{Error, ProxyBody};

/// Why an upstream exchange failed before its response head arrived.
#[derive(Debug, thiserror::Error)]
pub enum UpstreamError {
    /// Connecting to the upstream failed (refused, DNS, TLS, connect timeout).
    #[error("upstream {uri} unreachable")]
    Unreachable {
        /// The URL tried.
        uri: String,
        /// What the client said.
        #[source]
        source: Box<hyper_util::client::legacy::Error>,
    },
    /// The connection broke or the upstream spoke bad HTTP.
    #[error("upstream {uri} failed the exchange")]
    Exchange {
        /// The URL tried.
        uri: String,
        /// What the client said.
        #[source]
        source: Box<hyper_util::client::legacy::Error>,
    },
    /// No response head within the header deadline.
    #[error("upstream sent no response head within {after:?}")]
    HeaderTimeout {
        /// The deadline.
        after: Duration,
    },
    /// The total deadline passed before the response head.
    #[error("upstream exchange exceeded its total deadline of {after:?}")]
    TotalTimeout {
        /// The deadline.
        after: Duration,
    },
    /// The request path and the base URL do not make a URL.
    #[error("cannot join upstream base {base} and path {path:?}")]
    BadPath {
        /// The base URL.
        base: String,
        /// The request's path and query.
        path: String,
    },
}

/// Why a response body stream ended early; the agent sees its connection cut.
#[derive(Debug, thiserror::Error)]
pub enum StreamError {
    /// The upstream connection broke mid-body.
    #[error("upstream body failed")]
    Upstream {
        /// What hyper said.
        #[source]
        source: hyper::Error,
    },
    /// The body from a sandbox's proxy socket broke off (host relay).
    #[error("sandbox proxy body failed")]
    Sandbox {
        /// What hyper said.
        #[source]
        source: hyper::Error,
    },
    /// The upstream went silent for longer than the idle deadline.
    #[error("upstream body idle for {after:?}")]
    IdleTimeout {
        /// The deadline.
        after: Duration,
    },
    /// The whole exchange exceeded the total deadline mid-body.
    #[error("upstream body exceeded the total deadline of {after:?}")]
    TotalTimeout {
        /// The deadline.
        after: Duration,
    },
}

/// Headers that describe one connection, not the message (RFC 9110 §7.6.1),
/// plus `host` (set from the upstream URL) and `accept-encoding` (so that
/// transcripts hold plain text; the body itself is never rewritten).
const HOP_BY_HOP: [HeaderName; 9] = [
    header::CONNECTION,
    HeaderName::from_static("keep-alive"),
    HeaderName::from_static("proxy-connection"),
    header::PROXY_AUTHORIZATION,
    header::TE,
    header::TRAILER,
    header::TRANSFER_ENCODING,
    header::UPGRADE,
    header::HOST,
];

/// Removes the hop-by-hop headers and those that `Connection` names.
fn strip_hop_by_hop(headers: &mut http::HeaderMap) {
    let named: Vec<HeaderName> = headers
        .get_all(header::CONNECTION)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(','))
        .filter_map(|name| HeaderName::from_bytes(name.trim().as_bytes()).ok())
        .collect();
    for h in HOP_BY_HOP.iter().chain(&named) {
        headers.remove(h);
    }
}

/// The prefix of crab's own response headers (`x-crab-turn`,
/// `x-crab-replayed`, `x-crab-notice`, `x-crab-error`): only the proxy
/// says them to the agent.
const CRAB_HEADERS: &[u8] = b"x-crab-";

/// Whether response header `name` is crab's to set, not an upstream's.
fn is_crab_header(name: &str) -> bool {
    name.as_bytes()
        .get(..CRAB_HEADERS.len())
        .is_some_and(|prefix| prefix.eq_ignore_ascii_case(CRAB_HEADERS))
}

/// Removes the headers an upstream sent in crab's name, which the agent
/// would take for the proxy's word (that its answer was replayed, that
/// its sandbox was rolled back).
fn strip_crab_headers(headers: &mut http::HeaderMap) {
    let theirs: Vec<HeaderName> = headers
        .keys()
        .filter(|name| is_crab_header(name.as_str()))
        .cloned()
        .collect();
    for name in theirs {
        headers.remove(name);
    }
}

/// The upstream client service.
#[derive(Clone)]
pub(crate) struct Upstream {
    client: Client<HttpsConnector<HttpConnector>, Full<Bytes>>,
    upstreams: Upstreams,
    timeouts: Timeouts,
    stats: Arc<StatsCell>,
}

/// A shareable HTTP/HTTPS client; one per [`crate::Proxy`].
pub(crate) type UpstreamClient = Client<HttpsConnector<HttpConnector>, Full<Bytes>>;

/// Builds the client: rustls with the ring provider named explicitly (so a
/// second provider elsewhere in a binary cannot make the default ambiguous),
/// webpki roots, HTTP/1.1, connect deadline.
pub(crate) fn build_client(timeouts: &Timeouts) -> Result<UpstreamClient, ConfigError> {
    let mut http = HttpConnector::new();
    http.enforce_http(false);
    http.set_connect_timeout(Some(timeouts.upstream_connect));
    http.set_nodelay(true);
    let https = hyper_rustls::HttpsConnectorBuilder::new()
        .with_provider_and_webpki_roots(rustls::crypto::ring::default_provider())
        .map_err(|source| ConfigError::Tls { source })?
        .https_or_http()
        .enable_http1()
        .wrap_connector(http);
    Ok(Client::builder(TokioExecutor::new()).build(https))
}

impl Upstream {
    pub(crate) fn new(
        client: UpstreamClient,
        upstreams: Upstreams,
        timeouts: Timeouts,
        stats: Arc<StatsCell>,
    ) -> Self {
        Self {
            client,
            upstreams,
            timeouts,
            stats,
        }
    }

    fn target(&self, req: &Request<Bytes>) -> Result<Uri, UpstreamError> {
        let provider = req
            .extensions()
            .get::<Route>()
            .map_or(Provider::OpenAi, |r| r.provider);
        let base = match provider {
            Provider::OpenAi => &self.upstreams.openai,
            Provider::Anthropic => &self.upstreams.anthropic,
        };
        let pq = req.uri().path_and_query().map_or("/", |pq| pq.as_str());
        let joined = format!("{}{}", base.path().trim_end_matches('/'), pq);
        let mut parts = base.clone().into_parts();
        let bad = || UpstreamError::BadPath {
            base: base.to_string(),
            path: pq.to_owned(),
        };
        parts.path_and_query = Some(joined.parse().map_err(|_| bad())?);
        Uri::from_parts(parts).map_err(|_| bad())
    }
}

impl Service<Request<Bytes>> for Upstream {
    type Response = Response<ProxyBody>;
    type Error = Error;
    type Future = Pin<Box<dyn Future<Output = Result<Self::Response, Error>> + Send>>;

    fn poll_ready(&mut self, _cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, req: Request<Bytes>) -> Self::Future {
        let target = self.target(&req);
        let client = self.client.clone();
        let timeouts = self.timeouts;
        let stats = self.stats.clone();
        Box::pin(async move {
            let uri = target?;
            let (parts, body) = req.into_parts();
            let mut out = Request::builder()
                .method(parts.method)
                .uri(uri.clone())
                .version(http::Version::HTTP_11);
            if let Some(headers) = out.headers_mut() {
                *headers = parts.headers;
                strip_hop_by_hop(headers);
                headers.remove(header::ACCEPT_ENCODING);
                // The proxy's own server answered any `100-continue`.
                headers.remove(header::EXPECT);
            }
            let out = out.body(Full::new(body)).map_err(|_| UpstreamError::BadPath {
                base: uri.to_string(),
                path: uri.to_string(),
            })?;

            let start = Instant::now();
            let total_deadline = start + timeouts.upstream_total;
            let header_deadline = start + timeouts.upstream_header;
            let resp = match tokio::time::timeout_at(header_deadline.min(total_deadline), client.request(out))
                .await
            {
                Ok(Ok(resp)) => resp,
                Ok(Err(source)) if source.is_connect() => {
                    return Err(UpstreamError::Unreachable {
                        uri: uri.to_string(),
                        source: Box::new(source),
                    }
                    .into());
                }
                Ok(Err(source)) => {
                    return Err(UpstreamError::Exchange {
                        uri: uri.to_string(),
                        source: Box::new(source),
                    }
                    .into());
                }
                Err(_) if header_deadline <= total_deadline => {
                    return Err(UpstreamError::HeaderTimeout {
                        after: timeouts.upstream_header,
                    }
                    .into());
                }
                Err(_) => {
                    return Err(UpstreamError::TotalTimeout {
                        after: timeouts.upstream_total,
                    }
                    .into())
                }
            };
            let (mut parts, body) = resp.into_parts();
            strip_hop_by_hop(&mut parts.headers);
            strip_crab_headers(&mut parts.headers);
            let body = TimedBody::new(body, timeouts, total_deadline, stats);
            Ok(Response::from_parts(parts, body.boxed()))
        })
    }
}

/// An upstream body under the idle and total deadlines; counts as an open
/// stream in the sandbox's stats while it lives.
struct TimedBody {
    inner: Incoming,
    idle_after: Duration,
    idle: Pin<Box<Sleep>>,
    total_after: Duration,
    total: Pin<Box<Sleep>>,
    stats: Arc<StatsCell>,
    done: bool,
}

impl TimedBody {
    fn new(inner: Incoming, timeouts: Timeouts, total_deadline: Instant, stats: Arc<StatsCell>) -> Self {
        stats.stream_opened();
        Self {
            inner,
            idle_after: timeouts.upstream_idle,
            idle: Box::pin(tokio::time::sleep(timeouts.upstream_idle)),
            total_after: timeouts.upstream_total,
            total: Box::pin(tokio::time::sleep_until(total_deadline)),
            stats,
            done: false,
        }
    }
}

impl Drop for TimedBody {
    fn drop(&mut self) {
        self.stats.stream_closed();
    }
}

impl Body for TimedBody {
    type Data = Bytes;
    type Error = StreamError;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, StreamError>>> {
        if self.done {
            return Poll::Ready(None);
        }
        let this = &mut *self;
        match Pin::new(&mut this.inner).poll_frame(cx) {
            Poll::Ready(Some(Ok(frame))) => {
                let next = Instant::now() + this.idle_after;
                this.idle.as_mut().reset(next);
                return Poll::Ready(Some(Ok(frame)));
            }
            Poll::Ready(Some(Err(source))) => {
                this.done = true;
                return Poll::Ready(Some(Err(StreamError::Upstream { source })));
            }
            Poll::Ready(None) => {
                this.done = true;
                return Poll::Ready(None);
            }
            Poll::Pending => {}
        }
        if this.total.as_mut().poll(cx).is_ready() {
            this.done = true;
            return Poll::Ready(Some(Err(StreamError::TotalTimeout {
                after: this.total_after,
            })));
        }
        if this.idle.as_mut().poll(cx).is_ready() {
            this.done = true;
            return Poll::Ready(Some(Err(StreamError::IdleTimeout {
                after: this.idle_after,
            })));
        }
        Poll::Pending
    }

    fn is_end_stream(&self) -> bool {
        self.done || self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}

#[cfg(test)]
mod tests {
    use http::HeaderMap;

    use super::*;

    /// The names `given` keeps through `filter`, sorted.
    fn check_with(filter: fn(&mut HeaderMap), given: &[(&str, &str)], kept: &[&str]) {
        let mut headers = HeaderMap::new();
        for (k, v) in given {
            headers.append(
                HeaderName::from_bytes(k.as_bytes()).expect("name"),
                v.parse().expect("value"),
            );
        }
        filter(&mut headers);
        let mut got: Vec<&str> = headers.keys().map(HeaderName::as_str).collect();
        got.sort_unstable();
        assert_eq!(got, kept, "{given:?}");
    }

    fn check(given: &[(&str, &str)], kept: &[&str]) {
        check_with(strip_hop_by_hop, given, kept);
    }

    #[test]
    fn an_upstreams_headers_in_crabs_name_are_dropped() {
        check_with(
            strip_crab_headers,
            &[
                ("x-crab-notice", "rolled-back"),
                ("X-Crab-Replayed", "3"),
                ("x-crab-turn", "9"),
                ("x-crabby", "kept"),
                ("content-type", "application/json"),
            ],
            &["content-type", "x-crabby"],
        );
    }

    #[test]
    fn hop_by_hop_headers() {
        for (given, kept) in [
            (
                &[
                    ("authorization", "Bearer x"),
                    ("x-api-key", "k"),
                    ("content-type", "a/b"),
                ][..],
                &["authorization", "content-type", "x-api-key"][..],
            ),
            (
                &[
                    ("connection", "keep-alive, x-trace"),
                    ("x-trace", "1"),
                    ("keep-alive", "5"),
                    ("x-other", "2"),
                ][..],
                &["x-other"][..],
            ),
            (
                &[
                    ("transfer-encoding", "chunked"),
                    ("te", "trailers"),
                    ("upgrade", "h2c"),
                    ("host", "h"),
                    ("proxy-authorization", "p"),
                ][..],
                &[][..],
            ),
        ] {
            check(given, kept);
        }
    }
}
