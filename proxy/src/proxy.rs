//! The proxy: configuration, the upstream client and the registry of
//! sandboxes shared by every listener.

use std::collections::HashMap;
use std::sync::Arc;

use parking_lot::RwLock;

use crate::config::ProxyConfig;
use crate::hook::TurnHook;
use crate::tools::AgentTools;
use crate::upstream::{build_client, UpstreamClient};
use crate::{Error, Sandbox, SandboxId};

/// The proxy of one host (or one shim): cheap to clone, clones share state.
///
/// ```no_run
/// # async fn demo(config: crab_proxy::ProxyConfig) -> Result<(), crab_proxy::Error> {
/// use std::sync::Arc;
/// use crab_proxy::{serve_sandbox, NoopHook, Proxy, SandboxId};
/// use tokio_util::sync::CancellationToken;
///
/// let proxy = Proxy::new(config, Arc::new(NoopHook))?;
/// let sandbox = proxy.add_sandbox(SandboxId::new("sb1")?).await?;
/// let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.expect("bind");
/// serve_sandbox(listener, sandbox, CancellationToken::new()).await;
/// # Ok(()) }
/// ```
#[derive(Clone)]
pub struct Proxy {
    inner: Arc<Inner>,
}

struct Inner {
    config: Arc<ProxyConfig>,
    hook: Arc<dyn TurnHook>,
    tools: Option<Arc<dyn AgentTools>>,
    client: UpstreamClient,
    sandboxes: RwLock<HashMap<SandboxId, Sandbox>>,
}

impl Proxy {
    /// A proxy with `config` calling `hook` at every turn end.
    ///
    /// # Errors
    /// [`Error::Config`] when an upstream URL is not absolute http(s), or
    /// the TLS client cannot be set up.
    pub fn new(config: ProxyConfig, hook: Arc<dyn TurnHook>) -> Result<Self, Error> {
        Self::with_tools(config, hook, None)
    }

    /// A proxy as [`Proxy::new`] whose sandboxes serve the agent's
    /// rollback tool (`/crab/`, see [`AgentTools`]) through `tools`.
    ///
    /// # Errors
    /// As [`Proxy::new`].
    pub fn with_tools(
        config: ProxyConfig,
        hook: Arc<dyn TurnHook>,
        tools: Option<Arc<dyn AgentTools>>,
    ) -> Result<Self, Error> {
        config.upstreams.validate()?;
        config.limits.validate()?;
        let client = build_client(&config.timeouts)?;
        let inner = Inner {
            config: Arc::new(config),
            hook,
            tools,
            client,
            sandboxes: RwLock::new(HashMap::new()),
        };
        Ok(Self {
            inner: Arc::new(inner),
        })
    }

    /// Registers a sandbox and opens (creates) its transcript; turns are
    /// numbered from 1.
    ///
    /// # Errors
    /// [`Error::SandboxExists`], or [`Error::Transcript`] when its file
    /// cannot be opened.
    pub async fn add_sandbox(&self, id: SandboxId) -> Result<Sandbox, Error> {
        if self.inner.sandboxes.read().contains_key(&id) {
            return Err(Error::SandboxExists {
                sandbox: id.to_string(),
            });
        }
        let sandbox = Sandbox::open(
            id.clone(),
            self.inner.config.clone(),
            self.inner.hook.clone(),
            self.inner.tools.clone(),
            self.inner.client.clone(),
        )
        .await?;
        let mut map = self.inner.sandboxes.write();
        if map.contains_key(&id) {
            return Err(Error::SandboxExists {
                sandbox: id.to_string(),
            });
        }
        map.insert(id, sandbox.clone());
        Ok(sandbox)
    }

    /// The registered sandbox `id`.
    pub fn sandbox(&self, id: &SandboxId) -> Option<Sandbox> {
        self.inner.sandboxes.read().get(id).cloned()
    }

    /// Unregisters sandbox `id` (its listeners keep serving until stopped).
    pub fn remove_sandbox(&self, id: &SandboxId) -> Option<Sandbox> {
        self.inner.sandboxes.write().remove(id)
    }
}

impl Proxy {
    pub(crate) fn client_header_timeout(&self) -> std::time::Duration {
        self.inner.config.timeouts.client_header
    }
}
