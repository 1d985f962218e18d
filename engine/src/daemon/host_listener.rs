//! The host listener: agents that run outside their sandbox reach its LLM
//! proxy at `http://127.0.0.1:PORT/s/<sandbox>/…`. crabd only relays (with
//! `crab_proxy::serve_relay`) to the unix socket on which the sandbox's shim
//! serves its proxy: turns, transcript and gate stay in the shim.

use std::net::{Ipv4Addr, SocketAddr};
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use crab_proxy::{SandboxId, SandboxSockets};
use tokio::net::TcpListener;
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

use super::Daemon;

/// How long a client of the host listener may take to send a request head
/// (the slowloris guard; the sandbox's proxy applies its own after that).
const CLIENT_HEADER_TIMEOUT: Duration = Duration::from_secs(30);

/// Binds `127.0.0.1:port`; `None` when `port` is 0 (disabled) or the bind
/// fails (logged: crabd still checkpoints without it).
pub(super) async fn bind(port: u16) -> Option<(TcpListener, u16)> {
    if port == 0 {
        return None;
    }
    let addr = SocketAddr::from((Ipv4Addr::LOCALHOST, port));
    match TcpListener::bind(addr).await {
        Ok(listener) => {
            let port = listener.local_addr().map_or(port, |a| a.port());
            tracing::info!(%addr, "host listener for agents outside their sandbox");
            Some((listener, port))
        }
        Err(e) => {
            tracing::error!(%addr, "no host listener: bind failed: {e}");
            None
        }
    }
}

/// Serves the host listener until `stop` is cancelled.
pub(super) fn spawn(listener: TcpListener, daemon: Arc<Daemon>, stop: CancellationToken) -> JoinHandle<()> {
    tokio::spawn(crab_proxy::serve_relay(
        listener,
        daemon,
        CLIENT_HEADER_TIMEOUT,
        stop,
    ))
}

// === impl Daemon ===

impl SandboxSockets for Daemon {
    fn proxy_socket(&self, id: &SandboxId) -> Option<PathBuf> {
        self.registry
            .get(id)
            .filter(|e| e.running)
            .and_then(|e| e.registration.proxy)
    }
}

impl Daemon {
    /// The base URL of sandbox `id`'s proxy on the host listener.
    pub(super) fn proxy_url(&self, id: &SandboxId) -> Option<String> {
        self.proxy_port.map(|port| {
            format!(
                "http://127.0.0.1:{port}{}{id}",
                crab_api::routes::HOST_PROXY_PREFIX
            )
        })
    }
}
