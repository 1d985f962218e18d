//! The host relay: crabd's host listener for agents that run outside their
//! sandbox. `/s/<sandbox>/<secret>/…` is passed, with the prefix stripped, to the
//! unix socket on which that sandbox's shim serves its [`crate::Sandbox`]:
//! the turn counter, transcript and gate live in the shim, so the relay adds
//! no proxy logic of its own. Bodies stream through both ways unbuffered.
//! Connections to a socket are kept open between requests, in a pool keyed
//! by the socket's path: a request is checked against the sandbox's secret
//! before the pool is asked, and two sandboxes registered at once never
//! share a path. A kept connection is reused for at most [`POOL_IDLE`]
//! after its last answer (and closed 5–10 s after it), below a shim's own
//! limit for a silent connection on its host-side socket (its client
//! header timeout, 30 s by default, and never under twice `POOL_IDLE`,
//! whatever the configuration). A request written on a kept connection that its shim closed at
//! that moment (the shim restarted) gets 502 `crab_sandbox_exchange_failed`
//! and is not sent again (the shim may have read it): the agent's SDK
//! retries it, on a fresh connection.

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
use hyper_util::client::legacy::Client;
use hyper_util::rt::{TokioExecutor, TokioTimer};
use hyperlocal::UnixConnector;
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;
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
    let client = Client::builder(TokioExecutor::new())
        .pool_idle_timeout(POOL_IDLE)
        .pool_max_idle_per_host(POOL_IDLE_PER_SOCKET)
        .pool_timer(TokioTimer::new())
        .build(UnixConnector);
    let relay = Relay {
        sockets,
        hosts: Arc::new([format!("127.0.0.1:{port}"), format!("localhost:{port}")]),
        client,
    };
    let conns = Connections::new(MAX_HOST_CONNECTIONS);
    // The client (its pool) goes with the last clone of the relay: idle
    // connections close then; one carrying an answer ends with its body.
    accept_loop(listener, client_header, conns, shutdown, move || relay.clone()).await;
}

/// How long a connection to a sandbox's socket is reused after its last
/// answer (a shim drops a silent one on that socket after its header
/// timeout, at least twice this).
pub const POOL_IDLE: Duration = Duration::from_secs(5);

/// Unused connections kept per sandbox socket: each holds one of the
/// sandbox's connection slots, and one serves an agent that asks one
/// question at a time.
const POOL_IDLE_PER_SOCKET: usize = 1;

/// The relay's tower service.
#[derive(Clone)]
struct Relay {
    sockets: Arc<dyn SandboxSockets>,
    /// The `Host` values a request may name.
    hosts: Arc<[String; 2]>,
    /// Keeps connections to the shims' sockets, by socket path.
    client: Client<UnixConnector, Incoming>,
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
        mut req: Request<Incoming>,
    ) -> Result<Response<ProxyBody>, Error> {
        *req.uri_mut() = socket_uri(&socket, req.uri())?;
        let resp = self.client.request(req).await.map_err(|source| {
            let (sandbox, source) = (id.to_string(), Box::new(source));
            if source.is_connect() {
                Error::SandboxUnreachable { sandbox, source }
            } else {
                Error::SandboxExchange { sandbox, source }
            }
        })?;
        Ok(resp.map(|body| body.map_err(|source| StreamError::Sandbox { source }).boxed()))
    }
}

/// `uri`'s path and query on the unix socket at `socket`, as the pool's
/// connector reads it: the socket's path, hex-encoded, is the host (and so
/// the pool's key).
fn socket_uri(socket: &std::path::Path, uri: &http::Uri) -> Result<http::Uri, Error> {
    use std::fmt::Write;
    use std::os::unix::ffi::OsStrExt;
    let pq = uri.path_and_query().map_or("/", PathAndQuery::as_str);
    let host = socket
        .as_os_str()
        .as_bytes()
        .iter()
        .fold(String::new(), |mut hex, b| {
            let _ = write!(hex, "{b:02x}");
            hex
        });
    http::Uri::builder()
        .scheme("unix")
        .authority(format!("{host}:0"))
        .path_and_query(pq)
        .build()
        .map_err(|_| Error::NotASandboxPath { path: pq.to_owned() })
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
