//! The host listener: agents that run outside their sandbox reach its LLM
//! proxy at `http://127.0.0.1:PORT/s/<sandbox>/<secret>/…`. crabd only
//! relays (with `crab_proxy::serve_relay`) to the unix socket on which the
//! sandbox's shim serves its proxy: turns, transcript and gate stay in the
//! shim.
//!
//! Every local user can connect to 127.0.0.1: the secret is what makes a
//! URL a sandbox's. It is an HMAC of the sandbox's id and its history's
//! nonce (random, in its registry entry) under a key in crabd's root (0600,
//! made once), so it outlives a crabd restart (an agent resumed after a
//! crash keeps its URL), a later sandbox with the same id gets another, and
//! only root, who reads the key or asks crabd's socket (`crabctl
//! proxy-url`), can hand it out.

use std::net::{Ipv4Addr, SocketAddr};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use crab_proxy::{SandboxId, SandboxSockets};
use tokio::net::TcpListener;
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

use super::registry::Entry;
use super::{keys, Daemon};

/// How long a client of the host listener may take to send a request head
/// (the slowloris guard; the sandbox's proxy applies its own after that).
const CLIENT_HEADER_TIMEOUT: Duration = Duration::from_secs(30);

/// Binds `127.0.0.1:port` for `what` (the host listener, the page);
/// `None` when `port` is 0 (disabled) or the bind fails (logged: crabd
/// still checkpoints without it).
pub(super) async fn bind(port: u16, what: &str) -> Option<(TcpListener, u16)> {
    if port == 0 {
        return None;
    }
    let addr = SocketAddr::from((Ipv4Addr::LOCALHOST, port));
    match TcpListener::bind(addr).await {
        Ok(listener) => {
            let port = listener.local_addr().map_or(port, |a| a.port());
            tracing::info!(%addr, "{what}");
            Some((listener, port))
        }
        Err(e) => {
            tracing::error!(%addr, "no {what}: bind failed: {e}");
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
    fn proxy_socket(&self, id: &SandboxId, secret: &str) -> Option<PathBuf> {
        let entry = self.registry.get(id).filter(|e| e.running)?;
        if !self.host_key.admits(id, &entry.nonce, secret) {
            return None;
        }
        entry.registration.proxy
    }
}

impl Daemon {
    /// The base URL of `entry`'s sandbox's proxy on the host listener, its
    /// secret included.
    pub(super) fn proxy_url(&self, entry: &Entry) -> Option<String> {
        let id = &entry.registration.id;
        self.proxy_port.map(|port| {
            format!(
                "http://127.0.0.1:{port}{}{id}/{}",
                crab_api::routes::HOST_PROXY_PREFIX,
                self.host_key.secret(id, &entry.nonce)
            )
        })
    }
}

/// A new history's nonce: 16 random bytes, hex.
pub(super) fn nonce() -> std::io::Result<String> {
    Ok(keys::random::<16>()?.iter().map(|b| format!("{b:02x}")).collect())
}

/// The key the host listener's secrets are made with.
pub(super) struct HostKey([u8; 32]);

/// The key's file under crabd's root.
const KEY_FILE: &str = "host-listener.key";

// === impl HostKey ===

impl HostKey {
    /// The key under `root`, made (0600) if there is none.
    pub(super) fn load_or_create(root: &Path) -> std::io::Result<HostKey> {
        let bytes = keys::load_or_create(root, KEY_FILE, || keys::random::<32>().map(Vec::from))?;
        let key: [u8; 32] = bytes.try_into().map_err(|_| {
            std::io::Error::new(
                std::io::ErrorKind::InvalidData,
                format!("{} is not 32 bytes", root.join(KEY_FILE).display()),
            )
        })?;
        Ok(HostKey(key))
    }

    /// Sandbox `id`'s secret for the history of `nonce`: 128 bits of an
    /// HMAC-SHA256 of both, hex.
    pub(super) fn secret(&self, id: &SandboxId, nonce: &str) -> String {
        use hmac::{Hmac, Mac};
        let mut mac = Hmac::<sha2::Sha256>::new_from_slice(&self.0).expect("HMAC takes any key length");
        mac.update(b"crab host listener\0");
        mac.update(id.as_str().as_bytes());
        mac.update(b"\0");
        mac.update(nonce.as_bytes());
        mac.finalize().into_bytes()[..16]
            .iter()
            .map(|b| format!("{b:02x}"))
            .collect()
    }

    /// Whether `secret` is sandbox `id`'s (in constant time).
    pub(super) fn admits(&self, id: &SandboxId, nonce: &str, secret: &str) -> bool {
        same(&self.secret(id, nonce), secret)
    }
}

impl std::fmt::Debug for HostKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("HostKey(..)")
    }
}

/// Whether `got` is `want`, in time that does not depend on where they
/// differ.
pub(super) fn same(want: &str, got: &str) -> bool {
    want.len() == got.len()
        && want
            .bytes()
            .zip(got.bytes())
            .fold(0u8, |acc, (a, b)| acc | (a ^ b))
            == 0
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_secret_is_the_sandboxs_own_and_survives_a_reload() {
        let root = tempfile::tempdir().unwrap();
        let key = HostKey::load_or_create(root.path()).unwrap();
        let (a, b) = (SandboxId::new("a").unwrap(), SandboxId::new("b").unwrap());
        let n = nonce().unwrap();
        assert_eq!(n.len(), 32);
        let secret = key.secret(&a, &n);
        assert_eq!(secret.len(), 32);
        assert!(key.admits(&a, &n, &secret));
        assert!(!key.admits(&b, &n, &secret), "another sandbox's secret");
        assert!(
            !key.admits(&a, &nonce().unwrap(), &secret),
            "a later sandbox with the same id"
        );
        assert!(!key.admits(&a, &n, &secret[..31]) && !key.admits(&a, &n, ""));
        let again = HostKey::load_or_create(root.path()).unwrap();
        assert_eq!(again.secret(&a, &n), secret, "the same key after a restart");
        use std::os::unix::fs::PermissionsExt;
        let mode = std::fs::metadata(root.path().join(KEY_FILE))
            .unwrap()
            .permissions()
            .mode();
        assert_eq!(mode & 0o777, 0o600);
        let other = HostKey::load_or_create(tempfile::tempdir().unwrap().path()).unwrap();
        assert_ne!(other.secret(&a, &n), secret, "another host's key");
    }
}
