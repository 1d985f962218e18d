//! Listeners: a sandbox's own listener (the shim binds it in the sandbox's
//! network namespace and hands it over, or a unix socket on the host that
//! crabd relays to) and the host listener, where `/s/<sandbox>/…` routes to
//! that sandbox with the prefix stripped.

use std::convert::Infallible;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use http::uri::PathAndQuery;
use http::{Request, Response, Uri};
use http_body_util::BodyExt;
use hyper::body::Incoming;
use hyper::server::conn::http1;
use hyper_util::rt::{TokioIo, TokioTimer};
use hyper_util::service::TowerToHyperService;
use tokio::io::{AsyncRead, AsyncWrite};
use tokio::net::{TcpListener, UnixListener};
use tokio::sync::Semaphore;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;
use tower::{Service, ServiceExt};

use crate::{Error, Proxy, ProxyBody, Sandbox, SandboxId};

/// A bound listener the proxy can serve: TCP (a sandbox's loopback, the
/// host) or a unix socket (a sandbox's host-side socket).
pub trait Listener: Send + 'static {
    /// An accepted connection.
    type Stream: AsyncRead + AsyncWrite + Send + Unpin + 'static;

    /// Whether its peers are in the sandbox, so a restore puts them back
    /// too (see `replay`): a sandbox's TCP loopback, not a unix socket on
    /// the host.
    const IN_SANDBOX: bool;

    /// Accepts the next connection; returns it and the peer, for logs.
    fn accept(&self) -> impl Future<Output = std::io::Result<(Self::Stream, String)>> + Send;
}

impl Listener for TcpListener {
    type Stream = tokio::net::TcpStream;
    const IN_SANDBOX: bool = true;

    async fn accept(&self) -> std::io::Result<(Self::Stream, String)> {
        let (stream, peer) = TcpListener::accept(self).await?;
        // Small SSE chunks must not wait for Nagle.
        let _ = stream.set_nodelay(true);
        Ok((stream, peer.to_string()))
    }
}

impl Listener for UnixListener {
    type Stream = tokio::net::UnixStream;
    const IN_SANDBOX: bool = false;

    async fn accept(&self) -> std::io::Result<(Self::Stream, String)> {
        let (stream, _) = UnixListener::accept(self).await?;
        Ok((stream, "unix".to_owned()))
    }
}

/// Connections a host listener (every sandbox behind one port) holds at
/// once; each sandbox's own limit applies behind it too.
pub const MAX_HOST_CONNECTIONS: usize = 1024;

/// How long a connection over the limit has to send its request head
/// before it is closed without its 503.
const REFUSAL_TIME: Duration = Duration::from_secs(2);

/// Connections over the limit being answered at once; more are closed
/// without an answer (a connect loop cannot pile them up).
const MAX_REFUSING: usize = 64;

/// The connections a listener (or a sandbox's listeners together) may hold
/// at once, and those over it being refused.
#[derive(Debug, Clone)]
pub(crate) struct Connections {
    slots: Arc<Semaphore>,
    refusing: Arc<Semaphore>,
    limit: usize,
}

impl Connections {
    /// At most `limit` at once (at least one).
    pub(crate) fn new(limit: usize) -> Self {
        let limit = limit.clamp(1, Semaphore::MAX_PERMITS);
        Self {
            slots: Arc::new(Semaphore::new(limit)),
            refusing: Arc::new(Semaphore::new(MAX_REFUSING)),
            limit,
        }
    }
}

/// Serves `sandbox` on `listener` until `shutdown` is cancelled; then stops
/// accepting, drops open connections and returns once their tasks ended.
pub async fn serve_sandbox<L: Listener>(listener: L, sandbox: Sandbox, shutdown: CancellationToken) {
    let header_timeout = sandbox.shared_header_timeout();
    let conns = sandbox.connections();
    let service = sandbox.service();
    if L::IN_SANDBOX {
        let service = service.map_request(|mut req: Request<Incoming>| {
            req.extensions_mut().insert(FromInside);
            req
        });
        accept_loop(listener, header_timeout, conns, shutdown, move || service.clone()).await;
    } else {
        // The host-side socket's peer is crabd's relay, which reuses a kept
        // connection for up to POOL_IDLE after its last answer: a silent
        // connection is not dropped sooner, whatever the configuration.
        let header_timeout = header_timeout.max(crate::relay::POOL_IDLE * 2);
        accept_loop(listener, header_timeout, conns, shutdown, move || service.clone()).await;
    }
}

/// Marks a request that came from inside the sandbox (its own listener).
#[derive(Debug, Clone, Copy)]
pub(crate) struct FromInside;

/// Serves every registered sandbox of `proxy` on `listener` under
/// `/s/<sandbox>/…` until `shutdown` is cancelled.
pub async fn serve_host(listener: TcpListener, proxy: Proxy, shutdown: CancellationToken) {
    let header_timeout = proxy.client_header_timeout();
    let conns = Connections::new(MAX_HOST_CONNECTIONS);
    let service = HostService { proxy };
    accept_loop(listener, header_timeout, conns, shutdown, move || service.clone()).await;
}

/// Splits `/s/<sandbox>/rest?q` into the sandbox id and `/rest?q`.
///
/// # Errors
/// [`Error::NotASandboxPath`] without the `/s/<id>` prefix,
/// [`Error::InvalidSandboxId`] for a bad id.
pub fn split_host_path(path_and_query: &str) -> Result<(SandboxId, String), Error> {
    let not_ours = || Error::NotASandboxPath {
        path: path_and_query.to_owned(),
    };
    let rest = path_and_query.strip_prefix("/s/").ok_or_else(not_ours)?;
    let end = rest.find(['/', '?']).unwrap_or(rest.len());
    let (id, tail) = rest.split_at(end);
    let id = SandboxId::new(id)?;
    let tail = if tail.starts_with('/') {
        tail.to_owned()
    } else {
        format!("/{tail}")
    };
    Ok((id, tail))
}

/// Serves each connection `listener` accepts with a service from `make`,
/// while `conns` has a slot for it (one more gets a 503 and is closed),
/// until `shutdown` is cancelled.
pub(crate) async fn accept_loop<L, S>(
    listener: L,
    header_timeout: Duration,
    conns: Connections,
    shutdown: CancellationToken,
    make: impl Fn() -> S,
) where
    L: Listener,
    S: Service<Request<Incoming>, Response = Response<ProxyBody>, Error = Infallible>
        + Clone
        + Send
        + 'static,
    S::Future: Send + 'static,
{
    let tracker = TaskTracker::new();
    loop {
        let accepted = tokio::select! {
            () = shutdown.cancelled() => break,
            accepted = listener.accept() => accepted,
        };
        let (stream, peer) = match accepted {
            Ok(conn) => conn,
            Err(error) => {
                // EMFILE and friends: back off instead of spinning.
                tracing::warn!(%error, "accept failed");
                tokio::time::sleep(Duration::from_millis(50)).await;
                continue;
            }
        };
        let Ok(slot) = conns.slots.clone().try_acquire_owned() else {
            tracing::debug!(%peer, limit = conns.limit, "too many connections: refused");
            if let Ok(refusing) = conns.refusing.clone().try_acquire_owned() {
                let limit = conns.limit;
                tracker.spawn(async move {
                    refuse(stream, limit).await;
                    drop(refusing);
                });
            }
            continue;
        };
        let service = TowerToHyperService::new(make());
        let shutdown = shutdown.clone();
        tracker.spawn(async move {
            let _slot = slot;
            let conn = http1::Builder::new()
                .timer(TokioTimer::new())
                .header_read_timeout(header_timeout)
                .serve_connection(TokioIo::new(stream), service);
            tokio::select! {
                result = conn => {
                    if let Err(error) = result {
                        tracing::debug!(%peer, %error, "connection ended with an error");
                    }
                }
                () = shutdown.cancelled() => {}
            }
        });
    }
    tracker.close();
    tracker.wait().await;
}

/// Answers a connection over the limit with a 503 (the agent's SDK retries
/// it) and closes it. Its request body is read first (and dropped), so the
/// close does not reset the connection before the client reads the 503;
/// one that does not send its request within [`REFUSAL_TIME`] is closed
/// without it.
async fn refuse<T: AsyncRead + AsyncWrite + Send + Unpin + 'static>(stream: T, limit: usize) {
    let busy = tower::service_fn(move |req: Request<Incoming>| async move {
        // Read and dropped (within REFUSAL_TIME), never kept.
        let mut body = req.into_body();
        while let Some(Ok(_)) = body.frame().await {}
        Ok::<_, Infallible>(Error::TooManyConnections { limit }.into_response())
    });
    let conn = http1::Builder::new()
        .keep_alive(false)
        .serve_connection(TokioIo::new(stream), TowerToHyperService::new(busy));
    let _ = tokio::time::timeout(REFUSAL_TIME, conn).await;
}

/// The host listener's router.
#[derive(Clone)]
struct HostService {
    proxy: Proxy,
}

impl Service<Request<Incoming>> for HostService {
    type Response = Response<ProxyBody>;
    type Error = Infallible;
    type Future = Pin<Box<dyn Future<Output = Result<Self::Response, Infallible>> + Send>>;

    fn poll_ready(&mut self, _cx: &mut Context<'_>) -> Poll<Result<(), Infallible>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, mut req: Request<Incoming>) -> Self::Future {
        let pq = req
            .uri()
            .path_and_query()
            .map_or("/", PathAndQuery::as_str)
            .to_owned();
        let routed = split_host_path(&pq).and_then(|(id, tail)| {
            let sandbox = self.proxy.sandbox(&id).ok_or(Error::UnknownSandbox {
                sandbox: id.to_string(),
            })?;
            let mut parts = req.uri().clone().into_parts();
            parts.path_and_query = Some(
                tail.parse()
                    .map_err(|_| Error::NotASandboxPath { path: pq.clone() })?,
            );
            *req.uri_mut() =
                Uri::from_parts(parts).map_err(|_| Error::NotASandboxPath { path: pq.clone() })?;
            Ok(sandbox)
        });
        match routed {
            Ok(sandbox) => Box::pin(sandbox.service().oneshot(req)),
            Err(error) => Box::pin(std::future::ready(Ok(error.into_response()))),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn check(path: &str, expected: Option<(&str, &str)>) {
        let got = split_host_path(path).ok();
        let got = got.as_ref().map(|(id, tail)| (id.as_str(), tail.as_str()));
        assert_eq!(got, expected, "{path}");
    }

    #[test]
    fn host_paths() {
        for (path, expected) in [
            ("/s/sb1/v1/messages", Some(("sb1", "/v1/messages"))),
            ("/s/sb1/v1/models?limit=2", Some(("sb1", "/v1/models?limit=2"))),
            ("/s/sb1", Some(("sb1", "/"))),
            ("/s/sb1?x=1", Some(("sb1", "/?x=1"))),
            ("/s/a.b_c-1/", Some(("a.b_c-1", "/"))),
            ("/s/../etc/passwd", None),
            ("/s/%2e%2e/v1", None),
            ("/s//v1/messages", None),
            ("/v1/messages", None),
            ("/s", None),
        ] {
            check(path, expected);
        }
    }
}
