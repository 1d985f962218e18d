//! The host relay: crabd's host listener for agents that run outside their
//! sandbox. `/s/<sandbox>/<secret>/…` is passed, with the prefix stripped, to the
//! unix socket on which that sandbox's shim serves its [`crate::Sandbox`]:
//! the turn counter, transcript and gate live in the shim, so the relay adds
//! no proxy logic of its own. Bodies stream through both ways unbuffered.

use std::convert::Infallible;
use std::future::Future;
use std::path::PathBuf;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use http::uri::PathAndQuery;
use http::{Request, Response};
use http_body_util::BodyExt;
use hyper::body::Incoming;
use hyper_util::rt::TokioIo;
use tokio::net::{TcpListener, UnixStream};
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;
use tower::Service;

use crate::server::{accept_loop, Connections, MAX_HOST_CONNECTIONS};
use crate::{split_host_path, Error, ProxyBody, SandboxId, StreamError};

/// Where each sandbox's shim serves its proxy on the host (crabd's registry).
pub trait SandboxSockets: Send + Sync + 'static {
    /// The unix socket of sandbox `id` (the exact id, no prefix), if it is
    /// registered, has a proxy, and `secret` is its secret.
    fn proxy_socket(&self, id: &SandboxId, secret: &str) -> Option<PathBuf>;
}

/// Serves `/s/<sandbox>/<secret>/…` on `listener` by relaying each request
/// to the socket `sockets` names for that sandbox, until `shutdown` is
/// cancelled. A client must send its request head within `client_header`,
/// and name the listener itself as its `Host` (`127.0.0.1:PORT` or
/// `localhost:PORT`: a web page rebound to the loopback names its own).
///
/// Unknown sandboxes and wrong or missing secrets alike get 404, malformed
/// paths 400, foreign hosts 403, a sandbox whose socket does not answer
/// 502, each with the proxy's JSON error body.
///
/// ```no_run
/// # async fn demo() -> std::io::Result<()> {
/// use std::path::PathBuf;
/// use std::sync::Arc;
/// use std::time::Duration;
/// use crab_proxy::{serve_relay, SandboxId, SandboxSockets};
/// use tokio_util::sync::CancellationToken;
///
/// struct One;
/// impl SandboxSockets for One {
///     fn proxy_socket(&self, id: &SandboxId, secret: &str) -> Option<PathBuf> {
///         (id.as_str() == "sb1" && secret == "s3cret").then(|| PathBuf::from("/run/crab/runtime/default/.ctl/sb1.proxy.sock"))
///     }
/// }
/// let listener = tokio::net::TcpListener::bind("127.0.0.1:7879").await?;
/// serve_relay(listener, Arc::new(One), Duration::from_secs(30), CancellationToken::new()).await;
/// # Ok(()) }
/// ```
pub async fn serve_relay(
    listener: TcpListener,
    sockets: Arc<dyn SandboxSockets>,
    client_header: Duration,
    shutdown: CancellationToken,
) {
    let port = listener.local_addr().map_or(0, |a| a.port());
    let relay = Relay {
        sockets,
        hosts: Arc::new([format!("127.0.0.1:{port}"), format!("localhost:{port}")]),
        tracker: TaskTracker::new(),
        shutdown: shutdown.clone(),
    };
    let tracker = relay.tracker.clone();
    let conns = Connections::new(MAX_HOST_CONNECTIONS);
    accept_loop(listener, client_header, conns, shutdown, move || relay.clone()).await;
    tracker.close();
    tracker.wait().await;
}

/// The relay's tower service.
#[derive(Clone)]
struct Relay {
    sockets: Arc<dyn SandboxSockets>,
    /// The `Host` values a request may name.
    hosts: Arc<[String; 2]>,
    /// The client connections to the shims' sockets.
    tracker: TaskTracker,
    shutdown: CancellationToken,
}

// === impl Relay ===

impl Relay {
    /// Where `req` goes, and the request with its prefix stripped.
    fn route(&self, mut req: Request<Incoming>) -> Result<(SandboxId, PathBuf, Request<Incoming>), Error> {
        let pq = req
            .uri()
            .path_and_query()
            .map_or("/", PathAndQuery::as_str)
            .to_owned();
        let host = req
            .headers()
            .get(http::header::HOST)
            .and_then(|h| h.to_str().ok())
            .unwrap_or_default();
        if !self.hosts.iter().any(|h| h.eq_ignore_ascii_case(host)) {
            return Err(Error::ForeignHost {
                host: host.to_owned(),
            });
        }
        let (id, tail) = split_host_path(&pq)?;
        // A wrong secret and an unknown sandbox answer alike.
        let unknown = || Error::UnknownSandbox {
            sandbox: id.to_string(),
        };
        let (secret, tail) = split_secret(&tail).ok_or_else(unknown)?;
        let socket = self.sockets.proxy_socket(&id, secret).ok_or_else(unknown)?;
        let bad_path = || Error::NotASandboxPath { path: pq.clone() };
        let mut parts = req.uri().clone().into_parts();
        parts.path_and_query = Some(tail.parse().map_err(|_| bad_path())?);
        *req.uri_mut() = http::Uri::from_parts(parts).map_err(|_| bad_path())?;
        Ok((id, socket, req))
    }

    /// Sends `req` to the sandbox's socket; the answer's body streams on.
    async fn forward(
        self,
        id: SandboxId,
        socket: PathBuf,
        req: Request<Incoming>,
    ) -> Result<Response<ProxyBody>, Error> {
        let stream = UnixStream::connect(&socket)
            .await
            .map_err(|source| Error::SandboxUnreachable {
                sandbox: id.to_string(),
                source,
            })?;
        let exchange = |source| Error::SandboxExchange {
            sandbox: id.to_string(),
            source,
        };
        let (mut sender, conn) = hyper::client::conn::http1::handshake(TokioIo::new(stream))
            .await
            .map_err(exchange)?;
        // The connection ends when this exchange's body is done or dropped,
        // or when the relay shuts down.
        let shutdown = self.shutdown.clone();
        self.tracker.spawn(async move {
            tokio::select! {
                result = conn => {
                    if let Err(error) = result {
                        tracing::debug!(%error, "sandbox socket connection ended with an error");
                    }
                }
                () = shutdown.cancelled() => {}
            }
        });
        let resp = sender.send_request(req).await.map_err(exchange)?;
        Ok(resp.map(|body| body.map_err(|source| StreamError::Sandbox { source }).boxed()))
    }
}

/// Splits `/<secret>/rest?q` (or `/<secret>?q`) into the secret and
/// `/rest?q`; None without a secret.
fn split_secret(tail: &str) -> Option<(&str, String)> {
    let rest = tail.strip_prefix('/')?;
    let end = rest.find(['/', '?']).unwrap_or(rest.len());
    let (secret, rest) = rest.split_at(end);
    if secret.is_empty() {
        return None;
    }
    Some((
        secret,
        if rest.starts_with('/') {
            rest.to_owned()
        } else {
            format!("/{rest}")
        },
    ))
}

impl Service<Request<Incoming>> for Relay {
    type Response = Response<ProxyBody>;
    type Error = Infallible;
    type Future = Pin<Box<dyn Future<Output = Result<Self::Response, Infallible>> + Send>>;

    fn poll_ready(&mut self, _cx: &mut Context<'_>) -> Poll<Result<(), Infallible>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, req: Request<Incoming>) -> Self::Future {
        let relay = self.clone();
        Box::pin(async move {
            let answer = match relay.route(req) {
                Ok((id, socket, req)) => relay.forward(id, socket, req).await,
                Err(error) => Err(error),
            };
            Ok(answer.unwrap_or_else(|error| {
                tracing::debug!(code = error.code(), "relay refused a request");
                error.into_response()
            }))
        })
    }
}
