//! crabd: the host's checkpoint engine. It keeps the sandboxes that shims
//! register, turns checkpoint, turn-end, rollback, fork, export and import
//! requests into calls to each sandbox's shim and versions in the
//! [`VersionStore`], and serves them as the management API
//! (`crab_api::routes`) on a root-only unix socket.
//!
//! Each operation is a method of [`Daemon`] in a module of its own
//! (`checkpoint`, `turn_end`, `rollback`, `fork`, `export`, `import`,
//! `versions`, `sandboxes`); `http` holds the thin axum handlers that parse
//! a request, call one, and answer. `files` is the one owner of the file
//! snapshots crabd keeps. It also runs the host listener for agents outside
//! their sandbox (`host_listener`) and deletes the history of sandboxes whose
//! container containerd removed (`gc`).
//!
//! One operation per sandbox runs at a time; sandboxes do not wait for each
//! other. Work on a sandbox runs to its end even if the caller hangs up, so a
//! version is either published whole or not at all.

use std::collections::HashMap;
use std::os::unix::fs::PermissionsExt;
use std::path::PathBuf;
use std::sync::Arc;

use crab_api::config::CrabdConfig;
use crab_api::SandboxId;

use crate::{StoreError, VersionStore};

mod admit;
mod budget;
mod checkpoint;
mod disk_probe;
mod drain;
mod error;
mod events;
mod export;
mod files;
mod fork;
mod gc;
mod grant;
mod host_listener;
mod http;
mod import;
mod inspect;
mod keys;
mod making;
mod metrics;
mod registry;
mod resume;
mod rollback;
mod safety;
mod sandboxes;
mod schedule;
mod turn_end;
mod ui;
mod versions;
mod work;

pub use error::ApiError;
pub use inspect::{Inspection, InspectorError, TurnInspector};
pub use registry::Registry;

/// Why crabd could not start or stopped.
#[derive(Debug, thiserror::Error)]
pub enum DaemonError {
    /// Another crabd answers on the socket.
    #[error("crabd is already running on {}", socket.display())]
    AlreadyRunning {
        /// The socket.
        socket: PathBuf,
    },
    /// The version store could not be opened (another crabd holds it, or
    /// the disk failed).
    #[error("open the version store")]
    Store(#[from] StoreError),
    /// A file or socket operation failed.
    #[error("{op} {}", path.display())]
    Io {
        /// What crabd was doing.
        op: &'static str,
        /// On what.
        path: PathBuf,
        /// Why it failed.
        #[source]
        source: std::io::Error,
    },
}

/// crabd's state, shared by every request.
#[derive(Debug)]
pub struct Daemon {
    config: CrabdConfig,
    store: VersionStore,
    registry: Registry,
    files: files::Files,
    busy: parking_lot::Mutex<HashMap<SandboxId, Arc<tokio::sync::Mutex<()>>>>,
    /// Held while a sandbox registers or its history is dropped (`gc`), so
    /// a drop never takes a newer registration with it. Not the per-sandbox
    /// lock: crabd's own import holds that while the shim registers.
    lifecycle: tokio::sync::Mutex<()>,
    /// The port the host listener is bound to, if it runs.
    proxy_port: Option<u16>,
    /// The port crabd's page is served on, if it is.
    ui_port: Option<u16>,
    /// What the host listener's per-sandbox secrets are made with.
    host_key: host_listener::HostKey,
    /// What this host signs its exports with.
    signing_key: keys::SigningKey,
    /// Turn classes from the inspector.
    inspection: Inspection,
    /// The host's checkpoint queue.
    scheduler: Arc<schedule::Scheduler>,
    /// Turn ends waiting for their version.
    turns: turn_end::TurnQueue,
    /// What crabd counts.
    metrics: Arc<metrics::Metrics>,
    /// What happened to each sandbox (`crabctl logs`, the page).
    events: events::EventLog,
    /// Cancelled when crabd begins to stop: streams that would never end
    /// (`crabctl logs -f`, watches, the page's) end then.
    stopping: tokio_util::sync::CancellationToken,
    /// The secret in the page's URL, new at every start.
    ui_secret: String,
    /// Held by the one drain that may run.
    draining: Arc<tokio::sync::Mutex<()>>,
    /// Each sandbox's last version that safety rules judged clean (in
    /// memory: after a restart, a turn is judged against its parent).
    clean: parking_lot::Mutex<HashMap<SandboxId, u64>>,
    /// Each sandbox's safety rollbacks since its last clean turn.
    breaches: parking_lot::Mutex<HashMap<SandboxId, u32>>,
}

// === impl Daemon ===

impl Daemon {
    /// Opens the store and the registry under `config.root`.
    ///
    /// # Errors
    /// [`DaemonError::Store`], [`DaemonError::Io`].
    pub fn open(config: CrabdConfig) -> Result<Daemon, DaemonError> {
        let store = VersionStore::open(&config.root)?;
        let dir = config.root.join("registry");
        let registry = Registry::open(&dir).map_err(|source| DaemonError::Io {
            op: "open the registry",
            path: dir,
            source,
        })?;
        // Grants of restores a previous crabd started: none is wanted now.
        if let Err(e) = std::fs::remove_dir_all(config.root.join("restores")) {
            if e.kind() != std::io::ErrorKind::NotFound {
                tracing::warn!(error = %e, "old restore grants stay");
            }
        }
        // Transfers a previous crabd did not finish.
        let staging = config.root.join("staging");
        if let Err(e) = std::fs::remove_dir_all(&staging) {
            if e.kind() != std::io::ErrorKind::NotFound {
                tracing::warn!(dir = %staging.display(), error = %e, "clear staging");
            }
        }
        let host_key =
            host_listener::HostKey::load_or_create(&config.root).map_err(|source| DaemonError::Io {
                op: "load the host listener's key",
                path: config.root.clone(),
                source,
            })?;
        let signing_key =
            keys::SigningKey::load_or_create(&config.root).map_err(|source| DaemonError::Io {
                op: "load the export signing key",
                path: config.root.clone(),
                source,
            })?;
        let metrics = Arc::new(metrics::Metrics::new());
        let events = events::EventLog::new(&config.root);
        events.sweep(|id| registry.get(id).is_some());
        let ui_secret = keys::random::<16>()
            .map_err(|source| DaemonError::Io {
                op: "make the page's secret",
                path: config.root.clone(),
                source,
            })?
            .iter()
            .map(|b| format!("{b:02x}"))
            .collect();
        let shape = schedule_shape(&config);
        tracing::info!(
            slots = shape.slots,
            bytes_per_sec = shape.bytes_per_sec,
            "checkpoint queue"
        );
        Ok(Daemon {
            scheduler: schedule::Scheduler::new(shape, metrics.clone()),
            turns: turn_end::TurnQueue::default(),
            metrics,
            events,
            stopping: tokio_util::sync::CancellationToken::new(),
            ui_secret,
            files: files::Files::new(config.root.join("fs")),
            host_key,
            signing_key,
            config,
            store,
            registry,
            busy: parking_lot::Mutex::new(HashMap::new()),
            lifecycle: tokio::sync::Mutex::new(()),
            proxy_port: None,
            ui_port: None,
            inspection: Inspection::new(None),
            draining: Arc::new(tokio::sync::Mutex::new(())),
            clean: parking_lot::Mutex::new(HashMap::new()),
            breaches: parking_lot::Mutex::new(HashMap::new()),
        })
    }

    /// Classifies turns with `inspector`, and follows the registered
    /// sandboxes with it.
    pub fn with_inspector(mut self, inspector: Box<dyn TurnInspector>) -> Self {
        self.inspection = Inspection::new(Some(inspector));
        for reg in self.registry.running() {
            self.inspection.register(&reg);
        }
        self
    }

    /// The lock that keeps a sandbox's operations one at a time.
    fn busy(&self, id: &SandboxId) -> Arc<tokio::sync::Mutex<()>> {
        self.busy.lock().entry(id.clone()).or_default().clone()
    }

    /// A fresh staging directory for a transfer (`<root>/staging/…`),
    /// removed when the guard goes, on every path.
    fn staging(&self, kind: &str) -> Result<work::Staging, ApiError> {
        static N: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
        let n = N.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let dir = self
            .config
            .root
            .join("staging")
            .join(format!("{kind}-{}-{n}", work::unix_ms()));
        std::fs::create_dir_all(&dir).map_err(|source| ApiError::Io {
            op: "create a staging directory",
            source,
        })?;
        Ok(work::Staging::new(dir))
    }

    /// The API's routes (`crab_api::routes`), each a thin handler.
    pub fn router(self: Arc<Self>) -> axum::Router {
        http::router(self)
    }
}

/// The checkpoint queue's shape from `[crabd.schedule]`: 0 slots is four
/// per core (a capture mostly waits: on fsyncs, on CRIU's ptrace of the
/// sandbox, on its helper processes; `crab-bench density` held answers
/// longer with one or two per core); a budget of 0 is half the disk
/// probe's rate, -1 none.
fn schedule_shape(config: &CrabdConfig) -> schedule::Shape {
    let s = &config.schedule;
    let slots = match s.slots {
        0 => 4 * std::thread::available_parallelism().map_or(1, |n| n.get()),
        n => n,
    };
    let bytes_per_sec = match s.bytes_per_sec {
        0 => disk_probe::load_or_measure(&config.root).map(|p| p.write_bytes_per_sec / 2.0),
        n if n < 0 => None,
        n => Some(n as f64),
    };
    schedule::Shape { slots, bytes_per_sec }
}

/// Runs crabd until SIGTERM or SIGINT.
///
/// # Errors
/// [`DaemonError`] when it cannot start.
pub async fn serve(config: CrabdConfig) -> Result<(), DaemonError> {
    let socket = config.socket.clone();
    let mut daemon = Daemon::open(config)?;
    let listener = bind(&socket).await?;
    if let Some(i) = inspect::load(&daemon.config) {
        daemon = daemon.with_inspector(i);
    }
    let host = host_listener::bind(
        daemon.config.proxy_port,
        "host listener for agents outside their sandbox",
    )
    .await;
    daemon.proxy_port = host.as_ref().map(|(_, port)| *port);
    let page = host_listener::bind(daemon.config.ui_port, "crabd's page (crabctl ui)").await;
    daemon.ui_port = page.as_ref().map(|(_, port)| *port);
    let daemon = Arc::new(daemon);
    let stop_host = tokio_util::sync::CancellationToken::new();
    let host_task =
        host.map(|(listener, _)| host_listener::spawn(listener, daemon.clone(), stop_host.clone()));
    let page_task = page.map(|(listener, _)| ui::spawn(listener, daemon.clone(), stop_host.clone()));
    // Only after the host restarted: a crabd restarted alone finds its
    // sandboxes' tasks as containerd and their shims left them.
    if resume::host_restarted(&daemon.config.root) && daemon.config.resume_on_boot {
        // What ran when crabd last knew: gc marks the dead ones stopped soon.
        let known = daemon.registry.running();
        tokio::spawn({
            let daemon = daemon.clone();
            async move { daemon.resume_on_boot(known).await }
        });
    }
    let gc_task = tokio::spawn(gc::collect(daemon.clone()));
    let metrics_task = serve_metrics(&daemon).await;
    let pid_file = daemon.config.root.join("crabd.pid");
    if let Err(e) = std::fs::write(&pid_file, format!("{}\n", std::process::id())) {
        tracing::warn!(path = %pid_file.display(), error = %e, "write pid file");
    }
    // Forks and imports a killed crabd was making: whole or gone before
    // any request is served (one may name the same id).
    daemon.settle_interrupted_makings().await;
    tracing::info!(socket = %socket.display(), root = %daemon.config.root.display(), "crabd serving");
    let app = daemon.clone().router();
    let served = axum::serve(listener, app)
        .with_graceful_shutdown(drain_then_stop(daemon.clone()))
        .await
        .map_err(|source| DaemonError::Io {
            op: "serve",
            path: socket.clone(),
            source,
        });
    stop_host.cancel();
    gc_task.abort();
    if let Some(task) = metrics_task {
        task.abort();
    }
    if let Some(task) = host_task {
        let _ = task.await;
    }
    if let Some(task) = page_task {
        let _ = task.await;
    }
    let _ = std::fs::remove_file(&socket);
    let _ = std::fs::remove_file(&pid_file);
    tracing::info!("crabd stopped");
    served
}

/// Serves `/metrics` alone on `[crabd.schedule] metrics_address`, if set
/// (logged when it cannot bind: crabd runs on without it).
async fn serve_metrics(daemon: &Arc<Daemon>) -> Option<tokio::task::JoinHandle<()>> {
    let address = daemon.config.schedule.metrics_address.trim();
    if address.is_empty() {
        return None;
    }
    let listener = match tokio::net::TcpListener::bind(address).await {
        Ok(l) => l,
        Err(e) => {
            tracing::error!(address, error = %e, "metrics address not bound: /metrics only on the socket");
            return None;
        }
    };
    tracing::info!(address, "serving /metrics");
    let app = http::metrics_router(daemon.clone());
    Some(tokio::spawn(async move {
        if let Err(e) = axum::serve(listener, app).await {
            tracing::warn!(error = %e, "metrics listener");
        }
    }))
}

/// Binds the socket, root-only; a stale socket is replaced, a live one is
/// another crabd.
async fn bind(socket: &std::path::Path) -> Result<tokio::net::UnixListener, DaemonError> {
    let io = |op, source| DaemonError::Io {
        op,
        path: socket.to_owned(),
        source,
    };
    if tokio::net::UnixStream::connect(socket).await.is_ok() {
        return Err(DaemonError::AlreadyRunning {
            socket: socket.to_owned(),
        });
    }
    match std::fs::remove_file(socket) {
        Ok(()) => {}
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
        Err(e) => return Err(io("remove stale socket", e)),
    }
    if let Some(dir) = socket.parent() {
        std::fs::create_dir_all(dir).map_err(|e| io("create socket directory", e))?;
    }
    let listener = tokio::net::UnixListener::bind(socket).map_err(|e| io("bind", e))?;
    std::fs::set_permissions(socket, std::fs::Permissions::from_mode(0o600)).map_err(|e| io("chmod", e))?;
    Ok(listener)
}

/// Resolves on SIGTERM or SIGINT, after the drain `[crabd]
/// drain_grace_secs` asks for (crabd serves on while it runs).
async fn drain_then_stop(daemon: Arc<Daemon>) {
    shutdown().await;
    drain_at_stop(&daemon).await;
    // The graceful stop waits for every connection: none may be endless.
    daemon.stopping.cancel();
}

/// The drain `[crabd] drain_grace_secs` asks for when crabd stops.
async fn drain_at_stop(daemon: &Arc<Daemon>) {
    let grace_secs = daemon.config.drain_grace_secs;
    if grace_secs == 0 {
        return;
    }
    let dir = &daemon.config.drain_export_dir;
    let req = crab_api::crabd::DrainRequest {
        grace_secs,
        export_dir: (!dir.as_os_str().is_empty()).then(|| dir.clone()),
    };
    match daemon.drain(req).await {
        Ok(report) => {
            for s in &report.sandboxes {
                tracing::warn!(sandbox = %s.id, made = s.made, version = s.version, error = s.error.as_deref(), "drain at stop");
            }
        }
        Err(e) => tracing::error!(error = %crab_api::error_chain(&e), "drain at stop failed"),
    }
}

async fn shutdown() {
    use tokio::signal::unix::{signal, SignalKind};
    let (Ok(mut term), Ok(mut int)) = (signal(SignalKind::terminate()), signal(SignalKind::interrupt()))
    else {
        return std::future::pending().await;
    };
    tokio::select! {
        _ = term.recv() => {}
        _ = int.recv() => {}
    }
}
