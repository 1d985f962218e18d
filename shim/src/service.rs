//! The shim's lifecycle towards containerd (start, delete, wait) and the
//! state shared by task API calls.

use std::collections::HashMap;
use std::os::unix::fs::FileTypeExt;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime};

use async_trait::async_trait;
use containerd_shim::api::DeleteResponse;
use containerd_shim::asynchronous::publisher::RemotePublisher;
use containerd_shim::asynchronous::util::write_str_to_file;
use containerd_shim::asynchronous::{spawn, ExitSignal, Shim};
use containerd_shim::protos::protobuf::MessageField;
use containerd_shim::{Flags, StartOpts};

use crate::config::Config;
use crate::container::{Container, ExitReceiver};
use crate::control::Control;
use crate::events::{self, Events};
use crate::exits::ExitRouter;
use crate::process::timestamp;
use crate::runtime::RuntimeClient;
use crate::RUNTIME_NAME;

/// Runs the shim personality: parses containerd's flags and serves.
pub fn shim_main() {
    let config = match Config::load() {
        Ok(c) => c,
        Err(e) => {
            eprintln!(
                "{RUNTIME_NAME}: {e}: {}",
                std::error::Error::source(&e)
                    .map(|s| s.to_string())
                    .unwrap_or_default()
            );
            std::process::exit(1);
        }
    };
    let shim_config = containerd_shim::Config {
        default_log_level: config.shim.log_level.clone(),
        ..Default::default()
    };
    // One thread is enough for one sandbox's calls and keeps the idle shim small.
    let rt = match tokio::runtime::Builder::new_current_thread().enable_all().build() {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("{RUNTIME_NAME}: start tokio runtime: {e}");
            std::process::exit(1);
        }
    };
    crate::config::set(config);
    rt.block_on(containerd_shim::asynchronous::run::<Service>(
        RUNTIME_NAME,
        Some(shim_config),
    ));
}

/// containerd's view of the shim process.
pub struct Service {
    exit: Arc<ExitSignal>,
    id: String,
    namespace: String,
    containerd: String,
}

/// State shared by every task API call.
pub struct TaskService {
    /// Containers by id.
    pub containers: Arc<Mutex<HashMap<String, Arc<tokio::sync::Mutex<Container>>>>>,
    /// The runtime helper.
    pub runtime: Arc<RuntimeClient>,
    /// Event publisher.
    pub events: Arc<Events>,
    /// Set when the shim should exit.
    pub exit: Arc<ExitSignal>,
    /// containerd namespace of this shim's containers.
    pub namespace: String,
    /// containerd's gRPC socket.
    pub containerd: String,
    /// Control sockets (and crabd registrations) of started containers.
    pub controls: tokio::sync::Mutex<HashMap<String, Control>>,
    /// Which container is each pod's sandbox (CRI pods share one shim).
    pub pods: Arc<crate::pod::Pods>,
    /// Each container's State answers while a checkpoint holds it.
    pub held: Mutex<HashMap<String, Arc<crate::held_state::HeldStates>>>,
}

// === impl Service ===

#[async_trait]
impl Shim for Service {
    type T = TaskService;

    async fn new(_runtime_id: &str, args: &Flags, _config: &mut containerd_shim::Config) -> Self {
        Service {
            exit: Arc::new(ExitSignal::default()),
            id: args.id.clone(),
            namespace: args.namespace.clone(),
            containerd: args.address.clone(),
        }
    }

    async fn start_shim(&mut self, opts: StartOpts) -> containerd_shim::Result<String> {
        // A pod's containers share one shim (`crate::pod`).
        let grouping = crate::pod::group(Path::new(".")).unwrap_or_else(|| opts.id.clone());
        let address = spawn(opts, &grouping, Vec::new()).await?;
        write_str_to_file("address", &address).await?;
        Ok(address)
    }

    async fn delete_shim(&mut self) -> containerd_shim::Result<DeleteResponse> {
        // containerd calls this when the shim died without deleting its
        // task: remove whatever the container left behind.
        let bundle = std::env::current_dir().unwrap_or_else(|_| PathBuf::from("."));
        let runtime = runtime_client(ExitRouter::start().await, &self.namespace);
        // First what the dead shim was running on the container (a dump
        // left alone can hold the killed container forever).
        crate::runtime::kill_orphaned_helpers(&bundle).await;
        // What a killed restore helper left mounted, so the bundle can go.
        crate::runtime::release_sources(&bundle.join(".crab-criu"));
        if let Err(e) = runtime.delete(&self.id, &bundle, true).await {
            tracing::warn!(error = %crab_api::error_chain(&e), "delete {} in {}", self.id, self.namespace);
        }
        let rootfs = bundle.join("rootfs");
        if let Err(e) = crate::rootfs::unmount(&rootfs) {
            tracing::warn!(error = %crab_api::error_chain(&e), "unmount {}", rootfs.display());
        }
        remove_unified_cgroup(&bundle, &self.id).await;
        // The dead shim could not remove its socket.
        if let Ok(address) = std::fs::read_to_string(bundle.join("address")) {
            let path = address.trim().trim_start_matches("unix://");
            if std::fs::symlink_metadata(path).is_ok_and(|m| m.file_type().is_socket()) {
                let _ = std::fs::remove_file(path);
            }
        }
        // Nor its control socket and its proxy's host socket (crabd's
        // registration stays: crabd answers for a sandbox whose shim is gone).
        let ctl = runtime.root().join(".ctl");
        for name in [format!("{}.sock", self.id), format!("{}.proxy.sock", self.id)] {
            let _ = std::fs::remove_file(ctl.join(name));
        }
        Ok(DeleteResponse {
            pid: 0,
            exit_status: 128 + libc::SIGKILL as u32,
            exited_at: MessageField::some(timestamp(SystemTime::now())),
            ..Default::default()
        })
    }

    async fn wait(&mut self) {
        self.exit.wait().await;
    }

    async fn create_task_service(&self, publisher: RemotePublisher) -> TaskService {
        TaskService {
            containers: Arc::new(Mutex::new(HashMap::new())),
            runtime: Arc::new(runtime_client(ExitRouter::start().await, &self.namespace)),
            events: Arc::new(Events::new(publisher, self.namespace.clone())),
            exit: self.exit.clone(),
            namespace: self.namespace.clone(),
            containerd: self.containerd.clone(),
            controls: tokio::sync::Mutex::new(HashMap::new()),
            pods: Arc::default(),
            held: Mutex::new(HashMap::new()),
        }
    }
}

/// Removes the unified cgroup of the container whose bundle is `bundle`.
///
/// Its processes were just killed; the kernel refuses the removal (EBUSY)
/// until the last of them has exited, which takes a moment after SIGKILL.
async fn remove_unified_cgroup(bundle: &Path, id: &str) {
    let Ok(spec) = oci_spec::runtime::Spec::load(bundle.join("config.json")) else {
        return;
    };
    let path = crate::cgroup::spec_cgroups_path(
        spec.linux().as_ref().and_then(|l| l.cgroups_path().as_deref()),
        id,
    );
    let Some(unified) = crate::cgroup::unified_cgroup(&path) else {
        return;
    };
    for _ in 0..100 {
        match crate::cgroup::remove_unified(&unified) {
            Ok(()) => return,
            Err(e) if e.raw_os_error() == Some(libc::EBUSY) => {
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
            Err(e) => {
                tracing::warn!(error = %crab_api::error_chain(&e), "remove cgroup {}", unified.display());
                return;
            }
        }
    }
    tracing::warn!("cgroup {} still busy", unified.display());
}

/// The runtime client for containers of containerd namespace `namespace`.
///
/// Invariant: libcontainer state lives under `<state_dir>/<namespace>/<id>`,
/// so equal ids in two namespaces never meet (runc's shim does the same).
fn runtime_client(exits: Arc<ExitRouter>, namespace: &str) -> RuntimeClient {
    let cfg = &crate::config::get().shim;
    // This very binary even after a package upgrade replaced its file
    // (`current_exe` would then name a deleted path or a newer helper).
    let exe = PathBuf::from("/proc/self/exe");
    RuntimeClient::new(exe, cfg.state_dir.join(namespace), cfg.runtime_timeout(), exits)
        .with_criu(cfg.criu.clone(), cfg.criu_network_lock)
}

// === impl TaskService ===

impl TaskService {
    /// The container `id`.
    pub fn container(&self, id: &str) -> crate::error::Result<Arc<tokio::sync::Mutex<Container>>> {
        self.containers
            .lock()
            .expect("containers lock")
            .get(id)
            .cloned()
            .ok_or_else(|| crate::error::Error::NotFound {
                kind: "container",
                id: id.to_owned(),
            })
    }

    /// Serves the control socket of sandbox `id` and registers it with crabd.
    pub async fn start_control(
        &self,
        container: Arc<tokio::sync::Mutex<Container>>,
        id: &str,
        restored: bool,
    ) {
        let config = &crate::config::get().crabd;
        let pod = crate::control::PodView {
            containers: self.containers.clone(),
            pods: self.pods.clone(),
        };
        let started = Control::start(
            container,
            pod,
            self.runtime.clone(),
            self.events.clone(),
            (&self.namespace, &self.containerd),
            config,
            restored,
        )
        .await;
        match started {
            Ok(control) => {
                self.controls.lock().await.insert(id.to_owned(), control);
            }
            Err(e) => tracing::warn!(error = %crab_api::error_chain(&e), "{id}: no control socket"),
        }
    }

    /// Publishes TaskOOM for the OOM kills in `c`'s memory cgroup until it
    /// is deleted; see [`events::watch_oom`].
    pub fn watch_oom(&self, c: &mut Container) {
        events::watch_oom(self.events.clone(), c);
    }

    /// Follows a process until it exits; see [`events::watch_exit`].
    pub fn watch_exit(
        &self,
        container: Arc<tokio::sync::Mutex<Container>>,
        exec_id: String,
        pid: i32,
        rx: ExitReceiver,
    ) {
        events::watch_exit(self.events.clone(), container, exec_id, pid, rx);
    }
}
