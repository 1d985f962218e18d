//! A container: its init, its execs, its rootfs and cgroups, and the
//! lifecycle calls that change them.

use std::collections::HashMap;
use std::os::fd::OwnedFd;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use containerd_shim::api::{CheckpointTaskRequest, CreateTaskRequest, ExecProcessRequest, StateResponse};
use nix::sys::signal::Signal;
use nix::unistd::Pid;
use oci_spec::runtime::{Capability, Spec};
use tokio::sync::oneshot;

use crate::cgroup;
use crate::config::ProxyShimConfig;
use crate::error::{validate_id, Error, Result};
use crate::exits::Exit;
use crate::init::{self, Adoptions};
use crate::io::{self, StdioPaths};
use crate::process::{Process, ProcessState};
use crate::rootfs::{FsCtx, Rootfs};
use crate::runtime::{CheckpointOpts, Launch, Personality, RuntimeClient};
use crate::sandbox_proxy::{self, ProxyPlan, SandboxProxy};

mod members;
mod snapshot;

pub use members::Member;

/// One container of the shim.
pub struct Container {
    /// containerd's id.
    pub id: String,
    /// The bundle directory.
    pub bundle: PathBuf,
    /// Its first process.
    pub init: Process,
    /// Additional processes by exec id.
    pub execs: HashMap<String, Process>,
    /// The spec's cgroups path (as libcontainer resolves it).
    pub cgroups_path: PathBuf,
    /// The unified cgroup the shim made (v1-hybrid hosts).
    unified_cgroup: Option<PathBuf>,
    /// Its freezer, for checkpoints (a user's pause goes through
    /// libcontainer, which records it).
    freezer: crate::freezer::Freezer,
    /// Its rootfs: mounts, and what keeps its files.
    rootfs: Rootfs,
    /// The task publishing its OOM events; aborted at delete.
    pub oom_task: Option<tokio::task::JoinHandle<()>>,
    /// Whether Crab keeps this container as a sandbox (its proxy, turns
    /// and versions): all but a pod's pause container and sidecars
    /// (`crate::pod`).
    pub sandbox: bool,
    /// The Kubernetes pod it is in (`namespace/name`), if CRI runs it.
    pub pod: Option<String>,
    /// Its name in its pod when it is a member of one (an app container
    /// beside the pod's sandbox, `crate::pod`): it names its part of the
    /// pod's versions.
    pub pod_member: Option<String>,
    /// When it is a pod's sandbox: the shim's pods, where its turn ends
    /// find what to tell crabd of the pod's members.
    pods: Option<Arc<crate::pod::Pods>>,
    /// The sandbox's LLM proxy; stopped at delete.
    proxy: Option<SandboxProxy>,
    /// How the proxy was set up (its variables, which execs get too), to
    /// start it again in a restored network namespace.
    proxy_plan: Option<(String, ProxyPlan)>,
    /// A process image the init is restored from at Start (a sandbox
    /// forked or imported by crabd), instead of running the spec's process.
    pending_restore: Option<PathBuf>,
    /// Where that image stands in the sandbox's own conversation, when it
    /// is resumed in its own container (its transcript goes on).
    pending_conversation: Option<crab_api::shim::ConversationAt>,
    /// crab-init is mounted in the container (it can be its init).
    init_mounted: bool,
    /// The init is crab-init: the commands it adopted from execs, and the
    /// task following its report (see `crate::init`).
    adopted: Option<(Arc<Adoptions>, tokio::task::JoinHandle<()>)>,
    /// The signals containerd sent the current init (Kill): an end by one
    /// of them is asked for, never a crash to recover from.
    pub asked: Vec<Signal>,
    /// The init died and is being recovered: it has no live pid, so
    /// signals are kept for the restored init and execs wait.
    pub recovering: bool,
    /// The network namespace docker pinned for the sandbox, found while
    /// its init lived (a dead init's pid may be another's).
    netns_pin: Option<PathBuf>,
    /// How the sandbox comes back after a crash, once registered with
    /// crabd (see `crate::recovery`).
    pub recovery: Option<crate::recovery::Recovery>,
    /// An exec was given `CAP_SYS_ADMIN` (or no capability list): it may
    /// have changed the sandbox's mounts even after it exited, so its
    /// checkpoints keep every tmpfs in their images.
    mounts_changed: bool,
    /// What State answers while a checkpoint holds the container (shared
    /// with the task service, which reads it without the lock).
    pub held: Arc<crate::held_state::HeldStates>,
}

/// Where and how the sandbox's LLM proxy runs.
pub struct ProxySetup<'a> {
    /// containerd namespace (transcripts are kept per namespace).
    pub namespace: &'a str,
    /// `[shim.proxy]`.
    pub config: &'a ProxyShimConfig,
    /// When the container is a pod's sandbox: the shim's pods
    /// (`crate::pod::Pods::turn_view`).
    pub pods: Option<Arc<crate::pod::Pods>>,
}

/// A process's exit, to be watched by the shim.
pub type ExitReceiver = oneshot::Receiver<Exit>;

// === impl Container ===

impl Container {
    /// What State answers for each of its processes now, by exec id (""
    /// for the init).
    pub fn state_answers(&self) -> HashMap<String, StateResponse> {
        let bundle = self.bundle.to_string_lossy();
        std::iter::once(("", &self.init))
            .chain(self.execs.iter().map(|(id, p)| (id.as_str(), p)))
            .map(|(id, p)| (id.to_owned(), p.state_response(&self.id, &bundle)))
            .collect()
    }

    /// Creates the container of `req`: rootfs, stdio, cgroups, init (waiting
    /// for Start), and when it is a `sandbox` its LLM proxy. Nothing is left
    /// behind if it fails.
    pub async fn create(
        req: &CreateTaskRequest,
        runtime: &RuntimeClient,
        proxy: &ProxySetup<'_>,
        sandbox: bool,
    ) -> Result<(Self, Option<ExitReceiver>)> {
        validate_id(&req.id)?;
        if !req.checkpoint.is_empty() {
            return Err(Error::Unsupported {
                call: "create from a checkpoint",
            });
        }
        let bundle = PathBuf::from(&req.bundle);
        let spec = Spec::load(bundle.join("config.json")).map_err(|e| Error::InvalidBundle {
            bundle: bundle.clone(),
            reason: e.to_string(),
        })?;
        let cgroups_path = cgroup::spec_cgroups_path(
            spec.linux().as_ref().and_then(|l| l.cgroups_path().as_deref()),
            &req.id,
        );
        let terminal = spec
            .process()
            .as_ref()
            .and_then(|p| p.terminal())
            .unwrap_or(false);
        let root = spec.root().as_ref().map(|r| bundle.join(r.path()));
        let stdio = StdioPaths {
            stdin: req.stdin.clone(),
            stdout: req.stdout.clone(),
            stderr: req.stderr.clone(),
            terminal: terminal || req.terminal,
        };
        let mut c = Container {
            id: req.id.clone(),
            bundle: bundle.clone(),
            init: Process::new("", stdio),
            execs: HashMap::new(),
            unified_cgroup: cgroup::unified_cgroup(&cgroups_path),
            freezer: crate::freezer::Freezer::default(),
            cgroups_path,
            rootfs: Rootfs::new(&bundle, req.rootfs.to_vec()),
            oom_task: None,
            sandbox,
            // Only CRI's own containers: anyone may annotate a container.
            pod: spec
                .annotations()
                .as_ref()
                .filter(|a| matches!(crate::pod::role(a), crate::pod::Role::Member { .. }))
                .and_then(crate::pod::name),
            pod_member: spec
                .annotations()
                .as_ref()
                .filter(|a| matches!(crate::pod::role(a), crate::pod::Role::Member { .. }))
                .filter(|_| !sandbox)
                .and_then(crate::pod::member_name),
            pods: proxy.pods.clone(),
            proxy: None,
            proxy_plan: None,
            pending_restore: spec
                .annotations()
                .as_ref()
                .and_then(|a| a.get(crab_api::shim::RESTORE_ANNOTATION))
                .map(PathBuf::from),
            pending_conversation: spec
                .annotations()
                .as_ref()
                .and_then(|a| a.get(crab_api::shim::CONVERSATION_ANNOTATION))
                .and_then(|json| match serde_json::from_str(json) {
                    Ok(at) => Some(at),
                    Err(e) => {
                        tracing::warn!(error = %e, "{}: conversation annotation ignored: its transcript starts afresh", req.id);
                        None
                    }
                }),
            init_mounted: false,
            adopted: None,
            held: Arc::default(),
            asked: Vec::new(),
            recovering: false,
            netns_pin: None,
            recovery: None,
            mounts_changed: false,
        };
        if let Some(images) = &c.pending_restore {
            if c.init.stdio.terminal {
                return Err(Error::Unsupported {
                    call: "restore of a container with a terminal",
                });
            }
            let root = &crate::config::get().crabd.root;
            crate::grant::take(root, spec.annotations().as_ref(), &c.id, proxy.namespace, images)?;
        }
        let mut plan = match proxy.config.enabled && sandbox {
            true => sandbox_proxy::inject(&bundle, proxy.config)?,
            false => None,
        };
        crate::spec_env::inject(&bundle, &crate::config::get().shim.env)?;
        if crate::config::get().shim.init {
            c.init_mounted = init::inject(&bundle, &init::installed(runtime.root())?)?;
        }
        if let Some(plan) = &mut plan {
            // Beside the control socket (validated id: a safe file name).
            plan.host_socket = Some(runtime.root().join(".ctl").join(format!("{}.proxy.sock", c.id)));
        }
        let ctx = FsCtx {
            id: &c.id,
            bundle: &c.bundle,
            runtime,
        };
        if let Err(e) = c.rootfs.mount(root.as_deref(), proxy.namespace, &ctx).await {
            c.cleanup(runtime).await;
            return Err(e);
        }
        if c.pending_restore.is_some() {
            // The init is restored at Start; its proxy starts then, in the
            // restored network namespace.
            c.proxy_plan = plan.map(|p| (proxy.namespace.to_owned(), p));
            return Ok((c, None));
        }
        match c.create_init(runtime).await {
            Ok(rx) => {
                if let Some(plan) = plan {
                    c.proxy_plan = Some((proxy.namespace.to_owned(), plan.clone()));
                    // A proxy that cannot start must not fail the container:
                    // the agent then meets a refused connection, and the log
                    // says why.
                    let hook =
                        sandbox_proxy::turn_hook(proxy.config, &crate::config::get().crabd, c.pods.clone());
                    match SandboxProxy::start(
                        proxy.namespace,
                        &c.id,
                        c.init.pid,
                        plan,
                        proxy.config,
                        hook,
                        None,
                    )
                    .await
                    {
                        Ok(p) => c.proxy = Some(p),
                        Err(e) => {
                            tracing::error!(error = %crab_api::error_chain(&e), "{}: no LLM proxy", c.id)
                        }
                    }
                }
                Ok((c, Some(rx)))
            }
            Err(e) => {
                c.cleanup(runtime).await;
                Err(e)
            }
        }
    }

    async fn create_init(&mut self, runtime: &RuntimeClient) -> Result<ExitReceiver> {
        let (child, pending) = io::prepare(&self.init.stdio, &runtime.console_dir()).await?;
        let report = self.init_mounted.then(report_pipe).transpose()?;
        let (report, theirs) = report.unzip();
        let launch = Launch {
            work_dir: &self.bundle,
            stdio: child,
            unified_cgroup: self.unified_cgroup.as_deref(),
            crab_init: theirs.map(|fd| (Personality::Init, fd)),
        };
        let (pid, rx) = runtime.create(&self.id, &self.bundle, launch).await?;
        self.init.pid = pid;
        self.freezer.learn(pid);
        self.init.io = Some(pending.finish().await?);
        self.follow_init(report, runtime)?;
        Ok(rx)
    }

    /// Follows the report of a new init that is crab-init (`report`, its
    /// read end), or forgets the old one's, and finds docker's pin of its
    /// network namespace.
    fn follow_init(&mut self, report: Option<OwnedFd>, runtime: &RuntimeClient) -> Result<()> {
        // The old init is gone: its adopted commands' pidfds tell their
        // ends, with or without its report.
        if let Some((old, reader)) = self.adopted.take() {
            reader.abort();
            old.close();
        }
        self.adopted = report
            .map(|fd| Adoptions::follow(runtime.exits().clone(), fd))
            .transpose()?;
        self.netns_pin = crate::runtime::pinned_netns(self.init.pid);
        Ok(())
    }

    /// crab-init's report pipe for an init restored from `images`, when
    /// the image's init is crab-init.
    fn restore_report(images: &Path) -> Result<Option<(OwnedFd, OwnedFd)>> {
        init::in_image(images).then(report_pipe).transpose()
    }

    /// Starts the init (empty `exec_id`) or an exec; returns the pid and,
    /// for an exec, its exit receiver.
    pub async fn start(
        &mut self,
        exec_id: &str,
        runtime: &RuntimeClient,
    ) -> Result<(i32, Option<ExitReceiver>)> {
        if exec_id.is_empty() {
            self.expect_state(&self.init, ProcessState::Created, "start")?;
            if let Some(images) = self.pending_restore.take() {
                let (pid, rx) = self.restore_init(&images, runtime).await?;
                return Ok((pid, Some(rx)));
            }
            runtime.start(&self.id, &self.bundle).await?;
            self.init.state = ProcessState::Running;
            self.netns_pin = crate::runtime::pinned_netns(self.init.pid);
            return Ok((self.init.pid, None));
        }
        if self.init.state != ProcessState::Running || self.recovering {
            return Err(Error::BadState {
                id: self.id.clone(),
                state: if self.recovering {
                    "recovering"
                } else {
                    self.init.state.name()
                },
                op: "exec",
            });
        }
        let p = self.exec(exec_id)?;
        self.expect_state(p, ProcessState::Created, "start")?;
        let spec_path = self.bundle.join(format!(".crab-exec-{exec_id}.json"));
        let spec = p.spec.clone().unwrap_or_default();
        std::fs::write(&spec_path, spec).map_err(Error::io(format!("write {}", spec_path.display())))?;
        let (child, pending) = io::prepare(&p.stdio, &runtime.console_dir()).await?;
        let handshake = match &self.adopted {
            Some(_) => Some(
                std::os::unix::net::UnixStream::pair()
                    .map_err(Error::io("make the exec handshake".to_owned()))?,
            ),
            None => None,
        };
        let (ours, theirs) = handshake.unzip();
        let launch = Launch {
            work_dir: &self.bundle,
            stdio: child,
            unified_cgroup: self.unified_cgroup.as_deref(),
            crab_init: theirs.map(|s| (Personality::Exec, OwnedFd::from(s))),
        };
        let res = runtime.exec(&self.id, &spec_path, launch).await;
        let _ = std::fs::remove_file(&spec_path);
        let (mut pid, mut rx) = res?;
        let mut pidfd = None;
        if let (Some(ours), Some((adopted, _))) = (ours, &self.adopted) {
            // The exec's process hands its command to crab-init and exits:
            // the command is the exec.
            match adopted.hand_over(ours, pid, HANDOVER_LIMIT).await {
                Ok(command) => {
                    (pid, rx) = (command.pid, command.exit);
                    pidfd = Some(command.pidfd);
                }
                Err(e) => {
                    // Unless it is gone already (its pid may be another's).
                    if rx.try_recv().is_err() {
                        let _ = nix::sys::signal::kill(Pid::from_raw(pid), Signal::SIGKILL);
                    }
                    return Err(e);
                }
            }
        }
        let io = pending.finish().await?;
        let p = self.exec_mut(exec_id)?;
        p.pid = pid;
        p.pidfd = pidfd;
        p.io = Some(io);
        p.state = ProcessState::Running;
        Ok((pid, Some(rx)))
    }

    /// Registers an exec (it runs at Start).
    pub fn add_exec(&mut self, req: &ExecProcessRequest) -> Result<()> {
        validate_id(&req.exec_id)?;
        if self.execs.contains_key(&req.exec_id) {
            return Err(Error::AlreadyExists {
                kind: "exec",
                id: req.exec_id.clone(),
            });
        }
        if self.init.state != ProcessState::Running {
            return Err(Error::BadState {
                id: self.id.clone(),
                state: self.init.state.name(),
                op: "exec",
            });
        }
        let mut spec = req.spec.as_ref().map(|any| any.value.clone()).unwrap_or_default();
        if let Some((_, plan)) = self.proxy_plan.as_ref().filter(|(_, p)| !p.env.is_empty()) {
            if !spec.is_empty() {
                spec = sandbox_proxy::inject_exec(&spec, &plan.env, &plan.replaced)?;
            }
        }
        let defaults = &crate::config::get().shim.env;
        if !spec.is_empty() && !defaults.is_empty() {
            spec = crate::spec_env::inject_exec(&spec, defaults)?;
        }
        let terminal = serde_json::from_slice::<serde_json::Value>(&spec)
            .ok()
            .and_then(|v| v.get("terminal").and_then(serde_json::Value::as_bool))
            .unwrap_or(false);
        let mut p = Process::new(
            &req.exec_id,
            StdioPaths {
                stdin: req.stdin.clone(),
                stdout: req.stdout.clone(),
                stderr: req.stderr.clone(),
                terminal: terminal || req.terminal,
            },
        );
        // Unreadable here: libcontainer will say why; it changes nothing.
        let process = serde_json::from_slice::<oci_spec::runtime::Process>(&spec);
        if process.is_ok_and(|p| crate::netns::may_hold(&p, &[Capability::SysAdmin])) {
            self.mounts_changed = true;
        }
        p.spec = Some(spec);
        self.execs.insert(req.exec_id.clone(), p);
        Ok(())
    }

    /// Sends `signal` to the init (with `all`, to every process of the
    /// container) or to an exec.
    pub async fn kill(&mut self, exec_id: &str, signal: u32, all: bool) -> Result<()> {
        let sig = Signal::try_from(signal as i32).map_err(|_| Error::InvalidSignal { signal })?;
        if exec_id.is_empty() {
            // An end of the init by this signal is asked for, not a crash.
            if !self.asked.contains(&sig) {
                self.asked.push(sig);
            }
            if self.recovering {
                // The restored init gets it (see `crate::recovery`).
                return Ok(());
            }
        }
        let p = self.process(exec_id)?;
        if p.state == ProcessState::Stopped || p.pid <= 0 {
            if all && exec_id.is_empty() {
                // Kill-all after the init exited: stragglers of a container
                // without its own pid namespace may still run.
                return self.kill_all(sig).await;
            }
            return Err(Error::Finished {
                id: self.process_id(exec_id),
            });
        }
        if all && exec_id.is_empty() {
            return self.kill_all(sig).await;
        }
        let sent = match &p.pidfd {
            // An adopted command: through its pidfd, never a reused pid.
            Some(fd) => {
                // SAFETY: `sig` is a valid signal number (it came from nix's `Signal`).
                let rsig = unsafe { rustix::process::Signal::from_raw_unchecked(sig as i32) };
                rustix::process::pidfd_send_signal(fd, rsig)
                    .map_err(|e| nix::errno::Errno::from_raw(e.raw_os_error()))
            }
            None => nix::sys::signal::kill(Pid::from_raw(p.pid), sig),
        };
        sent.map_err(|e| match e {
            nix::errno::Errno::ESRCH => Error::Finished {
                id: self.process_id(exec_id),
            },
            e => Error::io(format!("kill {}", p.pid))(e.into()),
        })
    }

    /// What CRIU cannot dump, refused before the freeze and CRIU:
    /// [`Error::SharedPidNs`] when the init is not its pid namespace's, and
    /// [`Error::IoUring`] when a process of the container holds an io_uring.
    async fn refuse_undumpable(&self) -> Result<()> {
        if !is_pid_ns_init(self.init.pid) {
            return Err(Error::SharedPidNs { id: self.id.clone() });
        }
        self.refuse_io_uring().await
    }

    /// [`Error::IoUring`] when a process of the container holds an
    /// io_uring (CRIU cannot dump one).
    /// Off the shim's thread (it reads `/proc`, which a stalled process can
    /// hold up), for at most [`URING_SCAN_LIMIT`]; a scan that cannot
    /// finish leaves the verdict to CRIU. A ring made after the scan fails
    /// CRIU's dump, with its own error.
    async fn refuse_io_uring(&self) -> Result<()> {
        let pids = self.pids()?;
        let scan =
            tokio::task::spawn_blocking(move || crate::uring::find(std::path::Path::new("/proc"), &pids));
        match tokio::time::timeout(URING_SCAN_LIMIT, scan).await {
            Ok(Ok(None)) => Ok(()),
            Ok(Ok(Some(ring))) => Err(Error::IoUring {
                id: self.id.clone(),
                pid: ring.pid,
                comm: ring.comm,
                held: ring.held,
            }),
            Ok(Err(_)) | Err(_) => {
                tracing::warn!("{}: the io_uring scan did not finish; CRIU decides", self.id);
                Ok(())
            }
        }
    }

    /// Every process of the container: those of the cgroup its init was
    /// placed in (learned when it started: one read) and of the cgroups
    /// below it; libcgroups' walk of the mount table when none was learned.
    pub(crate) fn pids(&self) -> Result<Vec<u32>> {
        match self.freezer.pids() {
            Some(Ok(pids)) => Ok(pids.into_iter().map(|p| p as u32).collect()),
            Some(Err(e)) => Err(Error::io("list the sandbox's processes")(e)),
            None => cgroup::pids(&self.cgroups_path, &self.id),
        }
    }

    async fn kill_all(&self, sig: Signal) -> Result<()> {
        let pids = self.pids().unwrap_or_default();
        for pid in pids {
            // The spec's process gets it through crab-init, which passes on
            // only what a pid 1 would get.
            if let Some((adopted, _)) = &self.adopted {
                if sig != Signal::SIGKILL && adopted.is_main(pid as i32, self.init.pid) {
                    continue;
                }
            }
            let _ = nix::sys::signal::kill(Pid::from_raw(pid as i32), sig);
        }
        Ok(())
    }

    /// Freezes (`pause`) or thaws the container.
    pub async fn freeze(&mut self, pause: bool, runtime: &RuntimeClient) -> Result<()> {
        let (from, to, op) = if pause {
            (ProcessState::Running, ProcessState::Paused, "pause")
        } else {
            (ProcessState::Paused, ProcessState::Running, "resume")
        };
        self.expect_state(&self.init, from, op)?;
        self.pause_recorded(pause, runtime).await?;
        self.init.state = to;
        Ok(())
    }

    /// Freezes the container's cgroup for a checkpoint. A freeze that
    /// failed is undone: the kernel may still complete it after the call
    /// gave up (a task in uninterruptible sleep), and nothing would thaw it.
    pub(crate) async fn freeze_for_capture(&self) -> Result<()> {
        let frozen = self.set_frozen(true).await;
        if frozen.is_err() {
            if let Err(e) = self.set_frozen(false).await {
                tracing::warn!(error = %crab_api::error_chain(&e), "{}: thaw after a failed freeze", self.id);
            }
        }
        frozen
    }

    /// Freezes or thaws the container's cgroup for a moment (a checkpoint,
    /// a recovery), leaving the recorded state alone. A thaw happens
    /// whatever the init's state: a sandbox whose init died while it was
    /// frozen (a crash during a checkpoint) would stay frozen, with
    /// whatever a recovery restores into its cgroup.
    pub(crate) async fn set_frozen(&self, frozen: bool) -> Result<()> {
        self.freezer.set(self.init.pid, &self.id, frozen).await
    }

    /// A user's pause or resume, through libcontainer, which records it. A
    /// resume thaws whatever the init's state: libcontainer refuses to
    /// resume a container whose init is gone.
    async fn pause_recorded(&self, pause: bool, runtime: &RuntimeClient) -> Result<()> {
        let op = if pause { "pause" } else { "resume" };
        let dir = runtime.root().join(&self.id);
        let id = self.id.clone();
        tokio::task::spawn_blocking(move || {
            let failed = |source: libcontainer::error::LibcontainerError| Error::Libcontainer {
                op,
                id: id.clone(),
                source: Box::new(source),
            };
            let mut c = libcontainer::container::Container::load(dir).map_err(failed)?;
            if pause {
                return c.pause().map_err(failed);
            }
            match c.resume() {
                Err(libcontainer::error::LibcontainerError::IncorrectStatus(status)) => {
                    tracing::warn!(
                        ?status,
                        "{id}: thawing the cgroup of a container that is not paused"
                    );
                    let manager =
                        libcgroups::common::create_cgroup_manager(libcgroups::common::CgroupConfig {
                            cgroup_path: c.spec().map_err(failed)?.cgroup_path,
                            systemd_cgroup: c.systemd(),
                            container_name: id.clone(),
                        })
                        .map_err(|e| failed(e.into()))?;
                    use libcgroups::common::CgroupManager;
                    manager
                        .freeze(libcgroups::common::FreezerState::Thawed)
                        .map_err(|e| {
                            failed(libcontainer::error::LibcontainerError::OtherCgroup(e.to_string()))
                        })
                }
                other => other.map_err(failed),
            }
        })
        .await
        .map_err(|e| Error::io(op)(std::io::Error::other(e)))?
    }

    /// Dumps the container's processes with CRIU into `req.path` (the
    /// Checkpoint call; containerd makes a checkpoint image of that path).
    pub async fn checkpoint(&self, req: &CheckpointTaskRequest, runtime: &RuntimeClient) -> Result<()> {
        if !matches!(self.init.state, ProcessState::Running | ProcessState::Paused) {
            return Err(Error::BadState {
                id: self.id.clone(),
                state: self.init.state.name(),
                op: "checkpoint",
            });
        }
        let mut opts = CheckpointOpts {
            crab_init: self.init_is_crab_init(),
            init_pid: Some(self.init.pid),
            mounts_changed: self.mounts_changed,
            ..Default::default()
        };
        let mut image_path = PathBuf::from(&req.path);
        if let Some(any) = req.options.as_ref() {
            use containerd_shim::protos::protobuf::Message;
            // containerd and ctr send runc's CheckpointOptions when they
            // send any.
            let o = containerd_shim::protos::shim::oci::CheckpointOptions::parse_from_bytes(&any.value)
                .map_err(|e| Error::InvalidCheckpointOptions {
                    reason: e.to_string(),
                })?;
            opts.exit = o.exit;
            opts.tcp_established = o.open_tcp;
            opts.ext_unix_sk = o.external_unix_sockets;
            opts.file_locks = o.file_locks;
            if !o.image_path.is_empty() {
                image_path = PathBuf::from(o.image_path);
            }
            if !o.work_path.is_empty() {
                opts.work_path = Some(PathBuf::from(o.work_path));
            }
        }
        if image_path.as_os_str().is_empty() {
            return Err(Error::InvalidCheckpointOptions {
                reason: "no image path".to_owned(),
            });
        }
        self.refuse_undumpable().await?;
        let dumped = runtime
            .checkpoint(&self.id, &self.bundle, &image_path, &opts)
            .await;
        if matches!(
            dumped,
            Err(Error::InitDied { .. } | Error::RuntimeTimeout { .. } | Error::RuntimeDied { .. })
        ) && matches!(self.init.state, ProcessState::Running)
        {
            // CRIU froze the cgroup itself and was stopped before it thawed
            // it: a killed init could never exit, nor the sandbox run.
            if let Err(e) = self.set_frozen(false).await {
                tracing::warn!("{}: thaw after an abandoned dump: {e}", self.id);
            }
        }
        dumped
    }

    /// Removes an exited exec from the table and returns it.
    pub fn remove_exec(&mut self, exec_id: &str) -> Result<Process> {
        let p = self.exec(exec_id)?;
        if matches!(p.state, ProcessState::Running | ProcessState::Paused) {
            return Err(Error::BadState {
                id: exec_id.to_owned(),
                state: p.state.name(),
                op: "delete",
            });
        }
        Ok(self.execs.remove(exec_id).expect("checked just above"))
    }

    /// Deletes the container's runtime state, rootfs mounts and unified
    /// cgroup. The init must have exited or never started.
    pub async fn delete(&mut self, runtime: &RuntimeClient) -> Result<()> {
        if matches!(self.init.state, ProcessState::Running | ProcessState::Paused) {
            return Err(Error::BadState {
                id: self.id.clone(),
                state: self.init.state.name(),
                op: "delete",
            });
        }
        let force = self.init.state == ProcessState::Created;
        runtime.delete(&self.id, &self.bundle, force).await?;
        self.cleanup(runtime).await;
        Ok(())
    }

    /// Best-effort removal of everything `create` may have made.
    async fn cleanup(&mut self, runtime: &RuntimeClient) {
        if let Some(p) = self.proxy.take() {
            p.stop().await;
        }
        if let Some(task) = self.oom_task.take() {
            task.abort();
        }
        if let Some((_, task)) = self.adopted.take() {
            task.abort();
        }
        if let Err(e) = runtime.delete(&self.id, &self.bundle, true).await {
            tracing::debug!(error = %crab_api::error_chain(&e), "cleanup of {}", self.id);
        }
        self.init.io = None;
        crate::runtime::release_sources(&self.criu_work_dir());
        self.rootfs.release(&self.id);
        if let Some(cg) = &self.unified_cgroup {
            if let Err(e) = cgroup::remove_unified(cg) {
                tracing::warn!(error = %crab_api::error_chain(&e), "remove cgroup {}", cg.display());
            }
        }
    }

    /// Who runs a filesystem operation of the rootfs, and on what.
    fn fs_ctx<'a>(&'a self, runtime: &'a RuntimeClient) -> FsCtx<'a> {
        FsCtx {
            id: &self.id,
            bundle: &self.bundle,
            runtime,
        }
    }

    /// The host-side socket of the sandbox's LLM proxy, if it runs.
    pub fn proxy_socket(&self) -> Option<PathBuf> {
        self.proxy.as_ref()?.host_socket().map(Path::to_owned)
    }

    /// The transcript of the sandbox's LLM proxy, if it runs.
    pub fn transcript(&self) -> Option<PathBuf> {
        self.proxy.as_ref().map(|p| p.transcript().to_owned())
    }

    /// Whether the running init is crab-init.
    pub fn init_is_crab_init(&self) -> bool {
        self.adopted.is_some()
    }

    /// What crab-init, the running init, reported (none without it).
    pub fn adoptions(&self) -> Option<Arc<Adoptions>> {
        self.adopted.as_ref().map(|(a, _)| a.clone())
    }

    /// The init (empty id) or an exec.
    pub fn process(&self, exec_id: &str) -> Result<&Process> {
        if exec_id.is_empty() {
            return Ok(&self.init);
        }
        self.exec(exec_id)
    }

    /// The init (empty id) or an exec, mutably.
    pub fn process_mut(&mut self, exec_id: &str) -> Result<&mut Process> {
        if exec_id.is_empty() {
            return Ok(&mut self.init);
        }
        self.exec_mut(exec_id)
    }

    fn exec(&self, exec_id: &str) -> Result<&Process> {
        self.execs.get(exec_id).ok_or_else(|| Error::NotFound {
            kind: "exec",
            id: exec_id.to_owned(),
        })
    }

    fn exec_mut(&mut self, exec_id: &str) -> Result<&mut Process> {
        self.execs.get_mut(exec_id).ok_or_else(|| Error::NotFound {
            kind: "exec",
            id: exec_id.to_owned(),
        })
    }

    fn process_id(&self, exec_id: &str) -> String {
        if exec_id.is_empty() {
            self.id.clone()
        } else {
            exec_id.to_owned()
        }
    }

    fn expect_state(&self, p: &Process, want: ProcessState, op: &'static str) -> Result<()> {
        if p.state != want {
            return Err(Error::BadState {
                id: self.process_id(&p.exec_id),
                state: p.state.name(),
                op,
            });
        }
        Ok(())
    }
}

/// How long an exec's process may take to name its command.
const HANDOVER_LIMIT: std::time::Duration = std::time::Duration::from_secs(5);

/// A pipe for crab-init's report: (the shim's read end, the init's write
/// end), both close-on-exec (the helper gets its end as descriptor 3).
fn report_pipe() -> Result<(OwnedFd, OwnedFd)> {
    nix::unistd::pipe2(nix::fcntl::OFlag::O_CLOEXEC)
        .map_err(|e| Error::io("make crab-init's report pipe".to_owned())(e.into()))
}

/// The longest the io_uring scan before a checkpoint may take.
const URING_SCAN_LIMIT: std::time::Duration = std::time::Duration::from_secs(2);

/// Whether CRIU can dump `pid`'s tree as a container's: it is in the
/// shim's own pid namespace (a host-pid container, dumped as any process
/// tree), or the init of a namespace of its own (the last number of its
/// `NSpid` is 1). A process that cannot be read counts as one: what CRIU
/// then meets is its to report.
fn is_pid_ns_init(pid: i32) -> bool {
    procfs::process::Process::new(pid)
        .and_then(|p| p.status())
        .ok()
        .and_then(|s| s.nspid)
        .is_none_or(|ns| ns.len() == 1 || ns.last() == Some(&1))
}
