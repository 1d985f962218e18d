//! The runtime helper: libcontainer's forking operations in a child process.
//!
//! libcontainer waits for its intermediate processes with `waitpid(pid)`,
//! while the shim reaps every child on `SIGCHLD` (it is a subreaper and must
//! collect container exits). In one process the shim's reaper would steal
//! libcontainer's statuses, so every operation that forks runs here, in a
//! short-lived `containerd-shim-crab-v2 runtime …` process, the way runc's shim
//! runs `runc`. The container's init and exec processes are reparented to the
//! shim (the nearest subreaper) when the helper exits.
//!
//! Protocol: one JSON [`protocol::Request`] on the command line, one JSON
//! [`protocol::Reply`] in the reply file (see `protocol`); the container's
//! stdio is the helper's own stdio.

use std::io::Write;
use std::path::{Path, PathBuf};

use clap::Parser;
use libcontainer::container::builder::ContainerBuilder;
use libcontainer::container::{Container, ContainerStatus};
use libcontainer::syscall::syscall::SyscallType;
use libcontainer::workload::default::DefaultExecutor;
use libcontainer::workload::{Executor, ExecutorError, ExecutorValidationError};

mod client;
mod criu;
pub(crate) mod joined_ns;
mod kdat;
mod masked;
pub(crate) mod protocol;
mod tmpfs;

pub use client::{kill_orphaned_helpers, CheckpointOpts, Launch, RestoreOpts, RuntimeClient};
pub use criu::{netns_outside, pinned_netns, DESCRIPTORS};
pub use protocol::Personality;
use protocol::{Failure, FailureKind, Launch as LaunchSpec, Op, Reply, Request};

/// Everything a restore of `images` into the container of `bundle` would
/// refuse (namespaces it cannot rejoin, tmpfs it cannot make again),
/// found before the restore kills the processes it replaces.
pub fn restore_preflight(bundle: &Path, images: &Path) -> std::result::Result<(), String> {
    joined_ns::preflight(bundle, images)?;
    let spec = oci_spec::runtime::Spec::load(bundle.join("config.json"))
        .map_err(|e| format!("read config.json: {e}"))?;
    tmpfs::preflight(&spec, images).map_err(|e| format!("{e:#}"))
}

/// Removes `path`, what an earlier dump into the same images left, if it
/// is there.
fn remove_stale(path: &Path) -> anyhow::Result<()> {
    match std::fs::remove_file(path) {
        Err(e) if e.kind() != std::io::ErrorKind::NotFound => {
            Err(anyhow::Error::new(e).context(format!("remove a stale {}", path.display())))
        }
        _ => Ok(()),
    }
}

/// Unmounts what a killed restore helper may have left mounted in CRIU's
/// work directory `work` (the masks' and kept-out tmpfs's fresh mounts),
/// so the bundle can go.
pub fn release_sources(work: &Path) {
    let Ok(entries) = std::fs::read_dir(work) else {
        return;
    };
    for e in entries.flatten() {
        let name = e.file_name();
        let name = name.to_string_lossy();
        if name == masked::SOURCE || name.starts_with(tmpfs::SOURCE_PREFIX) {
            masked::unmount(&e.path());
        }
    }
}

/// First argument that selects the helper personality of the binary.
pub const SUBCOMMAND: &str = "runtime";

#[derive(Parser)]
#[command(
    name = "containerd-shim-crab-v2 runtime",
    about = "crab shim's runtime helper (internal)"
)]
struct Cli {
    /// Where the reply goes.
    #[arg(long)]
    reply: PathBuf,
    /// The request, as JSON.
    #[arg(long)]
    request: String,
}

/// A helper failure: its kind, and the chain that explains it.
struct Failed {
    kind: FailureKind,
    error: anyhow::Error,
}

/// `error` as a failure of kind `kind`, unless it is a missing container.
fn failed(kind: FailureKind) -> impl FnOnce(anyhow::Error) -> Failed {
    move |error| {
        let kind = match error.downcast_ref::<NoSuchContainer>() {
            Some(_) => FailureKind::NoSuchContainer,
            None => kind,
        };
        Failed { kind, error }
    }
}

/// libcontainer has no state for the container.
#[derive(Debug, thiserror::Error)]
#[error("no state for container {id}")]
struct NoSuchContainer {
    id: String,
}

/// Entry point of the helper personality; returns the process exit code.
pub fn helper_main(args: &[String]) -> i32 {
    let cli = match Cli::try_parse_from(std::iter::once(SUBCOMMAND.to_owned()).chain(args.iter().cloned())) {
        Ok(cli) => cli,
        Err(e) => {
            // stderr may be the container's; this only happens on a shim bug.
            let _ = e.print();
            return 2;
        }
    };
    let reply = match serde_json::from_str::<Request>(&cli.request) {
        Ok(req) => run(&req).unwrap_or_else(|f| {
            Reply::Failed(Failure {
                kind: f.kind,
                message: format!("{:#}", f.error),
            })
        }),
        Err(e) => Reply::Failed(Failure {
            kind: FailureKind::BadRequest,
            message: format!("invalid request: {e}"),
        }),
    };
    let code = match reply {
        Reply::Failed(_) => 1,
        _ => 0,
    };
    let bytes = serde_json::to_vec(&reply).expect("a reply serializes");
    match std::fs::File::create(&cli.reply).and_then(|mut f| f.write_all(&bytes)) {
        Ok(()) => code,
        Err(_) => 3,
    }
}

fn run(req: &Request) -> Result<Reply, Failed> {
    use anyhow::Context;
    let (root, id) = (&req.root, &req.id);
    // Every path the helper makes from the id (state, pins) is one name
    // beneath the root.
    if id.is_empty() || id.starts_with('.') || id.contains('/') || id.contains('\0') {
        return Err(Failed {
            kind: FailureKind::BadRequest,
            error: anyhow::anyhow!("invalid container id {id:?}"),
        });
    }
    let container = failed(FailureKind::Container);
    match &req.op {
        Op::Create { bundle, launch } => {
            if let Some(cg) = &launch.unified_cgroup {
                join_cgroup(cg).map_err(failed(FailureKind::Container))?;
            }
            let pid = create(root, id, bundle, launch).map_err(container)?;
            Ok(Reply::Launched { pid })
        }
        Op::Start => {
            load(root, id)
                .and_then(|mut c| Ok(c.start()?))
                .map_err(container)?;
            Ok(Reply::Done)
        }
        Op::Exec { process, launch } => {
            let pid = exec(root, id, process, launch).map_err(container)?;
            Ok(Reply::Launched { pid })
        }
        Op::Checkpoint(dump) => {
            let c = load(root, id).map_err(failed(FailureKind::Container))?;
            // A frozen container (containerd pauses before Checkpoint, crabd
            // freezes for a consistent filesystem snapshot) stays frozen:
            // CRIU is told the freezer cgroup.
            criu::dump(
                &c,
                &criu::DumpOpts {
                    criu: &req.criu,
                    image_path: &dump.image_path,
                    work_path: dump.work_path.as_deref(),
                    leave_running: !dump.exit,
                    tcp_established: dump.tcp_established,
                    ext_unix_sk: dump.ext_unix_sk,
                    file_locks: dump.file_locks,
                    crab_init: dump.crab_init,
                    mounts_changed: dump.mounts_changed,
                    quiet_network: dump.quiet_network,
                    own_netns: &crate::netns::pin_path(root, id),
                },
            )
            .map_err(failed(FailureKind::Criu))?;
            if dump.exit {
                load(root, id)
                    .and_then(|mut c| Ok(c.set_status(ContainerStatus::Stopped).save()?))
                    .map_err(container)?;
            }
            Ok(Reply::Done)
        }
        Op::Restore(restore) => {
            let pid = restore_tree(root, &req.criu, id, restore)?;
            Ok(Reply::Launched { pid })
        }
        Op::Fs { fs } => {
            let text = fs
                .run()
                .context("filesystem operation")
                .map_err(failed(FailureKind::Fs))?;
            Ok(Reply::Answer { text })
        }
        Op::Delete { force } => {
            crate::netns::unpin(&crate::netns::pin_path(root, id))
                .context("unpin the network namespace")
                .map_err(failed(FailureKind::Container))?;
            match load(root, id) {
                Ok(mut c) => c.delete(*force).map_err(|e| container(e.into()))?,
                // Nothing was created, or a create failed before libcontainer
                // saved any state: what is left of its directory goes.
                Err(e) if e.downcast_ref::<NoSuchContainer>().is_some() => {
                    match std::fs::remove_dir_all(root.join(id)) {
                        Ok(()) => {}
                        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
                        Err(e) => {
                            return Err(container(
                                anyhow::Error::from(e).context("remove the state directory"),
                            ))
                        }
                    }
                }
                Err(e) => return Err(container(e)),
            }
            Ok(Reply::Done)
        }
    }
}

/// Creates container `id` from `bundle`; answers its init's pid.
fn create(root: &Path, id: &str, bundle: &Path, launch: &LaunchSpec) -> anyhow::Result<i32> {
    use anyhow::Context;
    let c = ContainerBuilder::new(id.to_owned(), SyscallType::default())
        .with_executor(CrabExecutor::of(launch))
        .with_root_path(root)?
        .with_console_socket(launch.console_socket.as_ref())
        .with_preserved_fds(preserved(launch))
        .validate_id()?
        .as_init(bundle)
        .with_systemd(false)
        .with_detach(true)
        .build()?;
    let pid = c.pid().context("the created container has no init pid")?;
    let spec = oci_spec::runtime::Spec::load(bundle.join("config.json")).context("read config.json")?;
    if crate::netns::may_pin(&spec) {
        let ns = PathBuf::from(format!("/proc/{pid}/ns/net"));
        crate::netns::pin(&ns, &crate::netns::pin_path(root, id)).context("pin the network namespace")?;
    }
    // runc brings up the loopback interface of a network namespace
    // it creates; libcontainer does not, and programs expect it.
    if crate::netns::creates(&spec) {
        crate::netns::loopback_up(pid.as_raw()).context("bring up lo in the container")?;
    }
    Ok(pid.as_raw())
}

/// Runs `process` in container `id`; answers its pid.
fn exec(root: &Path, id: &str, process: &Path, launch: &LaunchSpec) -> anyhow::Result<i32> {
    use anyhow::Context;
    if let Some(cg) = &launch.unified_cgroup {
        join_cgroup(cg)?;
    }
    join_time_namespace(&load(root, id)?)?;
    // From now on the sandbox may configure its network namespace, which
    // then belongs in its checkpoints (see `netns`). Unpinned before the
    // process runs.
    let spec: oci_spec::runtime::Process = serde_json::from_slice(
        &std::fs::read(process).with_context(|| format!("read {}", process.display()))?,
    )
    .context("parse the exec's process")?;
    if crate::netns::exec_may_configure(&spec) {
        crate::netns::unpin(&crate::netns::pin_path(root, id)).context("unpin the network namespace")?;
    }
    let pid = ContainerBuilder::new(id.to_owned(), SyscallType::default())
        .with_executor(CrabExecutor::of(launch))
        .with_root_path(root)?
        .with_console_socket(launch.console_socket.as_ref())
        .with_preserved_fds(preserved(launch))
        .validate_id()?
        .as_tenant()
        .with_process(Some(process))
        .with_detach(true)
        .build()?;
    Ok(pid.as_raw())
}

/// Restores container `id`'s tree from `restore`'s images; answers the
/// restored init's pid.
fn restore_tree(root: &Path, criu_bin: &Path, id: &str, restore: &protocol::Restore) -> Result<i32, Failed> {
    use anyhow::Context;
    let container = failed(FailureKind::Container);
    let prepared = (|| -> anyhow::Result<Container> {
        if let Some(bundle) = &restore.bundle {
            new_state(root, id, bundle)?;
        }
        // CRIU leaves cgroups alone (the image may name another
        // container's): the restored tree is born in the helper's, which
        // are the container's own.
        let c = load(root, id)?;
        let spec =
            oci_spec::runtime::Spec::load(c.bundle().join("config.json")).context("read config.json")?;
        let linux = spec.linux().as_ref();
        let cgroups_path =
            crate::cgroup::spec_cgroups_path(linux.and_then(|l| l.cgroups_path().as_deref()), id);
        let fresh_limits = restore
            .bundle
            .as_ref()
            .and(linux.and_then(|l| l.resources().as_ref()));
        crate::cgroup::join(&cgroups_path, id, std::process::id() as i32, fresh_limits)?;
        if let Some(cg) = &restore.launch.unified_cgroup {
            join_cgroup(cg)?;
        }
        Ok(c)
    })();
    let mut c = prepared.map_err(container)?;
    criu::restore(
        &mut c,
        &criu::RestoreOpts {
            criu: criu_bin,
            image_path: &restore.image_path,
            work_path: &restore.work_path,
            tcp_established: restore.tcp_established,
            console_socket: restore.launch.console_socket.as_deref(),
            report_fd: (restore.launch.crab_init == Some(Personality::Init))
                .then_some(crate::init::CHANNEL_FD),
            fresh: restore.bundle.is_some(),
            netns: restore.netns.as_deref(),
            own_netns: &crate::netns::pin_path(root, id),
            reap_closed: restore.reap_closed,
        },
    )
    .map_err(failed(FailureKind::Criu))
}

/// Runs the spec's process, or crab-init in its place (which runs it).
///
/// The spec's process is validated as libcontainer's own executor does, so
/// a missing binary fails the create or exec as before.
#[derive(Clone)]
struct CrabExecutor {
    personality: Option<Personality>,
}

impl CrabExecutor {
    fn of(launch: &LaunchSpec) -> Self {
        CrabExecutor {
            personality: launch.crab_init,
        }
    }
}

impl Executor for CrabExecutor {
    fn exec(&self, spec: &oci_spec::runtime::Spec) -> Result<(), ExecutorError> {
        let Some(personality) = self.personality else {
            return DefaultExecutor {}.exec(spec);
        };
        let args = spec
            .process()
            .as_ref()
            .and_then(|p| p.args().as_ref())
            .ok_or(ExecutorError::InvalidArg)?;
        let (mode, flag) = match personality {
            Personality::Init => ("init", "--report-fd"),
            Personality::Exec => ("exec", "--handshake-fd"),
        };
        let fd = crate::init::CHANNEL_FD.to_string();
        let argv = ["crab-init", mode, flag, &fd, "--"]
            .into_iter()
            .chain(args.iter().map(String::as_str))
            .map(|a| std::ffi::CString::new(a).map_err(|_| ExecutorError::InvalidArg))
            .collect::<Result<Vec<_>, _>>()?;
        let path = std::ffi::CString::new(crate::init::MOUNT_POINT).expect("no NUL in the mount point");
        let err = nix::unistd::execv(&path, &argv).unwrap_err();
        Err(ExecutorError::Execution(
            format!("exec {}: {err}", crate::init::MOUNT_POINT).into(),
        ))
    }

    fn validate(&self, spec: &oci_spec::runtime::Spec) -> Result<(), ExecutorValidationError> {
        DefaultExecutor {}.validate(spec)
    }
}

/// How many descriptors above stdio the launched process keeps: crab-init's
/// channel.
fn preserved(launch: &LaunchSpec) -> i32 {
    match launch.crab_init {
        Some(_) => 1,
        None => 0,
    }
}

/// Makes libcontainer's state for container `id` of `bundle`, which has no
/// process yet (its first one is about to be restored).
fn new_state(root: &Path, id: &str, bundle: &Path) -> anyhow::Result<()> {
    use anyhow::Context;
    let dir = root.join(id);
    std::fs::create_dir_all(&dir).with_context(|| format!("create {}", dir.display()))?;
    let spec = oci_spec::runtime::Spec::load(bundle.join("config.json")).context("read config.json")?;
    libcontainer::config::YoukiConfig::from_spec(&spec, id)
        .and_then(|c| c.save(&dir))
        .context("save the container's config")?;
    Container::new(id, ContainerStatus::Created, None, bundle, &dir)?
        .save()
        .context("save the container's state")?;
    Ok(())
}

fn load(root: &Path, id: &str) -> anyhow::Result<Container> {
    use anyhow::Context;
    let dir = root.join(id);
    if !dir.join("state.json").exists() {
        return Err(NoSuchContainer { id: id.to_owned() }.into());
    }
    Container::load(dir).with_context(|| format!("load container {id}"))
}

/// Moves this helper into the container's unified cgroup, so that every
/// process it forks is born there (on v1-hybrid hosts libcontainer only joins
/// the v1 hierarchies).
fn join_cgroup(cgroup: &Path) -> anyhow::Result<()> {
    use anyhow::Context;
    std::fs::create_dir_all(cgroup).with_context(|| format!("create cgroup {}", cgroup.display()))?;
    std::fs::write(cgroup.join("cgroup.procs"), std::process::id().to_string())
        .with_context(|| format!("join cgroup {}", cgroup.display()))
}

/// Joins the time namespace of the container's init when it differs from
/// the helper's. CRIU restores a tree into a time namespace of its own
/// (monotonic clocks must not jump), which libcontainer does not know: an
/// exec outside it would see other clocks, and CRIU could not dump it
/// with the tree later. The helper is single-threaded here, as setns of a
/// time namespace requires; the children it forks are born inside.
fn join_time_namespace(c: &Container) -> anyhow::Result<()> {
    use anyhow::Context;
    let Some(pid) = c.pid() else { return Ok(()) };
    let theirs = format!("/proc/{pid}/ns/time");
    let (Ok(t), Ok(o)) = (
        std::fs::metadata(&theirs),
        std::fs::metadata("/proc/self/ns/time"),
    ) else {
        return Ok(());
    };
    use std::os::unix::fs::MetadataExt;
    if t.ino() == o.ino() {
        return Ok(());
    }
    let ns = std::fs::File::open(format!("/proc/{pid}/ns/time")).context("open the init's time namespace")?;
    nix::sched::setns(ns, nix::sched::CloneFlags::from_bits_retain(libc::CLONE_NEWTIME))
        .context("join the init's time namespace")?;
    Ok(())
}
