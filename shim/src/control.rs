//! The shim's control socket, through which crabd checkpoints and restores
//! the container, and the container's registration with crabd.
//!
//! The socket is root-only (0600) and lives under the runtime state root;
//! the routes and messages are `crab_api::shim`'s. Work that a call starts
//! runs to its end even when the caller goes away: a crabd killed in the
//! middle of a checkpoint must not leave the container frozen.

use std::collections::HashMap;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use axum::extract::State;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::routing::post;
use axum::{Json, Router};
use crab_api::crabd::{ErrorBody, ErrorCode, Registration};
use crab_api::shim::{
    ShimCheckpoint, ShimForget, ShimForgotten, ShimRestore, ShimRestoreFiles, ShimRestored,
};
use crab_api::{routes, ClientError, Crabd, SandboxId};
use tokio::sync::Mutex;
use tracing::Instrument;

use crate::config::CrabdShimConfig;
use crate::container::{Container, Member};
use crate::error::Error;
use crate::events::{self, Events};
use crate::pod::Pods;
use crate::runtime::protocol::FailureKind;
use crate::runtime::RuntimeClient;

/// A container's control socket and its registration; stopped at delete.
pub struct Control {
    socket: PathBuf,
    server: tokio::task::JoinHandle<()>,
    crabd: Option<(Crabd, SandboxId)>,
}

#[derive(Clone)]
struct Ctx {
    /// The container's id, for the spans of its calls.
    id: String,
    container: Arc<Mutex<Container>>,
    /// Every container of the shim, where a pod's members are found.
    pod: PodView,
    runtime: Arc<RuntimeClient>,
    events: Arc<Events>,
}

/// The shim's containers and pods: a pod's sandbox finds its pod's other
/// app containers (its members) there.
#[derive(Clone)]
pub struct PodView {
    /// Every container of the shim, by id.
    pub containers: Arc<std::sync::Mutex<HashMap<String, Arc<Mutex<Container>>>>>,
    /// Which container is each pod's sandbox and which its members.
    pub pods: Arc<Pods>,
}

// === impl PodView ===

impl PodView {
    /// The members of the pod whose sandbox is `id`, by id (the order in
    /// which they are locked, after the sandbox).
    fn members(&self, id: &str) -> Vec<(String, Arc<Mutex<Container>>)> {
        let ids = self.pods.members(id);
        let all = self.containers.lock().expect("containers lock");
        ids.into_iter()
            .filter_map(|m| all.get(&m).cloned().map(|c| (m, c)))
            .collect()
    }
}

/// Locks every container of `members`, in order.
async fn lock_all(members: &[(String, Arc<Mutex<Container>>)]) -> Vec<Member<'_>> {
    let mut locked = Vec::with_capacity(members.len());
    for (_, m) in members {
        locked.push(m.lock().await);
    }
    locked
}

// === impl Control ===

impl Control {
    /// Serves `container`'s control socket and registers it with crabd
    /// (starting crabd when it is not running and the config says so).
    /// Failing to reach crabd is logged: the container runs on without.
    /// `restored`: the init came back from a process image (a fork or an
    /// import), not from the spec's process.
    pub async fn start(
        container: Arc<Mutex<Container>>,
        pod_view: PodView,
        runtime: Arc<RuntimeClient>,
        events: Arc<Events>,
        (namespace, containerd): (&str, &str),
        config: &CrabdShimConfig,
        restored: bool,
    ) -> std::io::Result<Control> {
        let (id, pid, crab_init, fs_backend, proxy, transcript, cgroup, own_snapshots, layer, pod) = {
            let c = container.lock().await;
            (
                c.id.clone(),
                c.init.pid,
                c.init_is_crab_init(),
                c.fs_backend(),
                c.proxy_socket(),
                c.transcript(),
                crate::cgroup::cgroup2_dir(&c.cgroups_path),
                c.own_snapshot_store(),
                c.writable_layer(),
                c.pod.clone(),
            )
        };
        let socket = runtime.root().join(".ctl").join(format!("{id}.sock"));
        std::fs::create_dir_all(socket.parent().expect("a socket path has a parent"))?;
        let _ = std::fs::remove_file(&socket);
        let listener = tokio::net::UnixListener::bind(&socket)?;
        std::fs::set_permissions(&socket, std::fs::Permissions::from_mode(0o600))?;
        let app = Router::new()
            .route(routes::shim::CHECKPOINT, post(checkpoint))
            .route(routes::shim::RESTORE, post(restore))
            .route(routes::shim::FORGET, post(forget))
            .route(routes::shim::RESTORE_FILES, post(restore_files))
            .with_state(Ctx {
                id: id.clone(),
                container: container.clone(),
                pod: pod_view,
                runtime,
                events,
            });
        // Lives until `stop`.
        let server = tokio::spawn(async move {
            if let Err(e) = axum::serve(listener, app).await {
                tracing::warn!(error = %e, "control socket");
            }
        });
        let mut control = Control {
            socket: socket.clone(),
            server,
            crabd: None,
        };
        let sandbox = match SandboxId::new(id.as_str()) {
            Ok(sandbox) => Some(sandbox),
            Err(e) => {
                tracing::warn!(error = %e, "not registered with crabd: crabd keeps no versions of it");
                None
            }
        };
        if let Some(id) = sandbox.filter(|_| config.register) {
            let client = Crabd::new(&config.socket, Duration::from_secs(5));
            let reg = Registration {
                id: id.clone(),
                namespace: namespace.to_owned(),
                containerd: PathBuf::from(containerd.trim_start_matches("unix://")),
                control: socket,
                pid,
                crab_init,
                fs_backend,
                cgroup,
                proxy,
                transcript,
                own_snapshots,
                layer,
                restored,
                pod,
            };
            match register(&client, &reg, config).await {
                Ok(()) => {
                    if config.recover == crab_api::config::RecoverPolicy::OnCrash {
                        // A restore may take as long as crabd gives a shim.
                        let limit = Duration::from_secs(config.shim_timeout_secs + 30);
                        let crabd = Crabd::new(&config.socket, limit);
                        container.lock().await.recovery =
                            Some(crate::recovery::Recovery::new(crabd, id.clone()));
                    }
                    control.crabd = Some((client, id));
                }
                Err(e) => tracing::warn!(error = %crab_api::error_chain(&e), "not registered with crabd"),
            }
        }
        Ok(control)
    }

    /// Unregisters from crabd and closes the socket.
    pub async fn stop(self) {
        if let Some((client, id)) = &self.crabd {
            if let Err(e) = client.unregister(id).await {
                tracing::warn!(sandbox = %id, error = %crab_api::error_chain(&e), "unregister from crabd");
            }
        }
        self.server.abort();
        let _ = std::fs::remove_file(&self.socket);
    }
}

/// Registers `reg`; when nothing listens, starts crabd and tries again for
/// a few seconds.
async fn register(client: &Crabd, reg: &Registration, config: &CrabdShimConfig) -> Result<(), ClientError> {
    match client.register(reg).await {
        Err(ClientError::Connect { .. }) if config.autostart => {}
        other => return other.map(drop),
    }
    if let Err(e) = spawn_crabd(&config.binary) {
        tracing::warn!(binary = %config.binary.display(), error = %e, "start crabd");
    }
    let mut last = None;
    for _ in 0..100 {
        tokio::time::sleep(Duration::from_millis(50)).await;
        match client.register(reg).await {
            Err(e @ ClientError::Connect { .. }) => last = Some(e),
            other => return other.map(drop),
        }
    }
    Err(last.expect("the loop ran"))
}

/// Starts crabd in a process group of its own, detached from the shim's
/// stdio; it reads the same `crab.toml` (`$CRAB_CONFIG` is inherited).
pub(crate) fn spawn_crabd(binary: &Path) -> std::io::Result<()> {
    use std::os::unix::process::CommandExt;
    let mut cmd = std::process::Command::new(binary);
    cmd.stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .process_group(0);
    // The shim's reaper collects it if it ever exits while the shim runs.
    cmd.spawn().map(drop)
}

async fn checkpoint(State(ctx): State<Ctx>, body: axum::body::Bytes) -> Response {
    let req: ShimCheckpoint = match serde_json::from_slice(&body) {
        Ok(r) => r,
        Err(e) => {
            return refuse(
                ErrorCode::InvalidRequest,
                format!("invalid checkpoint request: {e}"),
            )
        }
    };
    // Runs to its end even if crabd hangs up: the thaw must happen.
    let span = tracing::info_span!("checkpoint", sandbox = %ctx.id);
    let done = tokio::spawn(
        async move {
            let c = ctx.container.lock().await;
            let _held = c.held.hold(c.state_answers());
            let members = ctx.pod.members(&ctx.id);
            let members = lock_all(&members).await;
            let _held_too: Vec<_> = members.iter().map(|m| m.held.hold(m.state_answers())).collect();
            c.engine_checkpoint(&req, &ctx.runtime, &members).await
        }
        .instrument(span),
    )
    .await;
    match done {
        Ok(Ok(r)) => Json(r).into_response(),
        Ok(Err(e)) => refuse_error(e),
        Err(e) => refuse(ErrorCode::Internal, format!("checkpoint task: {e}")),
    }
}

async fn restore(State(ctx): State<Ctx>, body: axum::body::Bytes) -> Response {
    let req: ShimRestore = match serde_json::from_slice(&body) {
        Ok(r) => r,
        Err(e) => return refuse(ErrorCode::InvalidRequest, format!("invalid restore request: {e}")),
    };
    let span = tracing::info_span!("restore", sandbox = %ctx.id);
    let done = tokio::spawn(
        async move {
            let mut c = ctx.container.lock().await;
            let member_list = ctx.pod.members(&ctx.id);
            let mut members = lock_all(&member_list).await;
            let mut restored_members = Vec::new();
            let done = c
                .engine_restore(&req, &ctx.runtime, &mut members, &mut restored_members)
                .await;
            drop(members);
            drop(c);
            // Whatever the outcome: a member restored before a failure runs.
            for m in restored_members {
                if let Some((_, container)) = member_list.iter().find(|(id, _)| *id == m.id) {
                    events::watch_exit(ctx.events.clone(), container.clone(), String::new(), m.pid, m.rx);
                }
            }
            let restored = done?;
            let pid = restored.pid;
            events::watch_exit(
                ctx.events.clone(),
                ctx.container.clone(),
                String::new(),
                pid,
                restored.rx,
            );
            match restored.failure {
                None => Ok(ShimRestored {
                    pid,
                    restore_ms: restored.restore_ms,
                    undo_ms: restored.undo_ms,
                }),
                Some(e) => Err(Error::RestoreUndone {
                    source: Box::new(e),
                    pid,
                }),
            }
        }
        .instrument(span),
    )
    .await;
    match done {
        Ok(Ok(r)) => Json(r).into_response(),
        Ok(Err(e)) => refuse_error(e),
        Err(e) => refuse(ErrorCode::Internal, format!("restore task: {e}")),
    }
}

async fn restore_files(State(ctx): State<Ctx>, body: axum::body::Bytes) -> Response {
    let req: ShimRestoreFiles = match serde_json::from_slice(&body) {
        Ok(r) => r,
        Err(e) => {
            return refuse(
                ErrorCode::InvalidRequest,
                format!("invalid restore-files request: {e}"),
            )
        }
    };
    // Runs to its end even if crabd hangs up: the thaw must happen.
    let span = tracing::info_span!("restore_files", sandbox = %ctx.id);
    let done = tokio::spawn(
        async move {
            let c = ctx.container.lock().await;
            let members = ctx.pod.members(&ctx.id);
            // Held until the files are back: no member starts meanwhile.
            let members = lock_all(&members).await;
            if members.iter().any(|m| m.member_runs()) {
                return Err(Error::PodMember {
                    id: ctx.id.clone(),
                    reason: "the pod's other containers run, and a rollback of files only would leave \
                             theirs as they are: roll back the whole version"
                        .to_owned(),
                });
            }
            let _held = c.held.hold(c.state_answers());
            c.engine_restore_files(&req, &ctx.runtime).await
        }
        .instrument(span),
    )
    .await;
    match done {
        Ok(Ok(r)) => Json(r).into_response(),
        Ok(Err(e)) => refuse_error(e),
        Err(e) => refuse(ErrorCode::Internal, format!("restore-files task: {e}")),
    }
}

async fn forget(State(ctx): State<Ctx>, body: axum::body::Bytes) -> Response {
    let req: ShimForget = match serde_json::from_slice(&body) {
        Ok(r) => r,
        Err(e) => return refuse(ErrorCode::InvalidRequest, format!("invalid forget request: {e}")),
    };
    let span = tracing::info_span!("forget", sandbox = %ctx.id);
    let done = tokio::spawn(
        async move {
            let c = ctx.container.lock().await;
            c.forget_snapshots(&req.snapshots, &ctx.runtime).await
        }
        .instrument(span),
    )
    .await;
    match done {
        Ok(destroyed) => Json(ShimForgotten { destroyed }).into_response(),
        Err(e) => refuse(ErrorCode::Internal, format!("forget task: {e}")),
    }
}

fn refuse_error(e: Error) -> Response {
    let code = match &e {
        Error::InvalidCheckpoint { .. } => ErrorCode::InvalidCheckpoint,
        Error::RestoreUndone { .. } => ErrorCode::RestoreUndone,
        Error::BadState { .. } => ErrorCode::NotRunning,
        Error::NoFsBackend { .. } => ErrorCode::NoFsBackend,
        Error::Unsupported { .. }
        | Error::IoUring { .. }
        | Error::SharedPidNs { .. }
        | Error::PodMember { .. } => ErrorCode::Unsupported,
        Error::Snapshot { .. }
        | Error::Runtime {
            kind: FailureKind::Fs,
            ..
        } => ErrorCode::Fs,
        Error::RestoreLost { .. } => ErrorCode::SandboxLost,
        _ => ErrorCode::Internal,
    };
    refuse(code, crab_api::error_chain(&e))
}

/// An error answer with `code`'s status.
fn refuse(code: ErrorCode, error: String) -> Response {
    let status = StatusCode::from_u16(code.http_status()).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
    (status, Json(ErrorBody { error, code })).into_response()
}
