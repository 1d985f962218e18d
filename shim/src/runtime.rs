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
//! Protocol: arguments on the command line; the container's stdio is the
//! helper's own stdio; the created pid goes to `--pid-file`; on failure the
//! helper writes the error chain to `--log` and exits 1.

use std::io::Write;
use std::path::{Path, PathBuf};

use clap::{Parser, Subcommand};
use libcontainer::container::builder::ContainerBuilder;
use libcontainer::container::{Container, ContainerStatus};
use libcontainer::syscall::syscall::SyscallType;
use libcontainer::workload::default::DefaultExecutor;

mod client;
mod criu;

pub use client::{CheckpointOpts, Launch, RestoreOpts, RuntimeClient};
pub use criu::{pinned_netns, DESCRIPTORS};

/// First argument that selects the helper personality of the binary.
pub const SUBCOMMAND: &str = "runtime";

#[derive(Parser)]
#[command(
    name = "containerd-shim-crab-v2 runtime",
    about = "crab shim's runtime helper (internal)"
)]
struct Cli {
    /// libcontainer state root.
    #[arg(long)]
    root: PathBuf,
    /// File that receives the error message on failure.
    #[arg(long)]
    log: PathBuf,
    /// The CRIU binary.
    #[arg(long, default_value = "criu")]
    criu: PathBuf,
    #[command(subcommand)]
    op: Op,
}

#[derive(Subcommand)]
enum Op {
    /// Create a container from a bundle; its init waits for `start`.
    Create {
        #[arg(long)]
        bundle: PathBuf,
        #[command(flatten)]
        launch: LaunchArgs,
        id: String,
    },
    /// Let a created container's init run its process.
    Start { id: String },
    /// Run an additional process (OCI `process.json`) in a running container.
    Exec {
        #[arg(long)]
        process: PathBuf,
        #[command(flatten)]
        launch: LaunchArgs,
        id: String,
    },
    /// Dump the container's processes with CRIU into an image directory.
    Checkpoint {
        #[arg(long)]
        image_path: PathBuf,
        #[arg(long)]
        work_path: Option<PathBuf>,
        /// Stop the container after the dump (default: leave it running).
        #[arg(long)]
        exit: bool,
        /// Dump established TCP connections.
        #[arg(long)]
        tcp_established: bool,
        /// Dump external unix sockets.
        #[arg(long)]
        ext_unix_sk: bool,
        /// Dump file locks.
        #[arg(long)]
        file_locks: bool,
        id: String,
    },
    /// Restore the container's processes from a CRIU image directory (its
    /// previous processes must be gone); the restored init's stdio is the
    /// helper's, its pid goes to `--pid-file`.
    Restore {
        #[arg(long)]
        image_path: PathBuf,
        #[arg(long)]
        work_path: PathBuf,
        /// Restore established TCP connections.
        #[arg(long)]
        tcp_established: bool,
        /// The sandbox's pinned network namespace now (docker's).
        #[arg(long)]
        netns: Option<PathBuf>,
        #[command(flatten)]
        launch: LaunchArgs,
        /// The container has no state yet (a sandbox forked or imported
        /// from a checkpoint): make it, and its cgroups with the spec's limits.
        #[arg(long)]
        bundle: Option<PathBuf>,
        id: String,
    },
    /// Run a filesystem backend operation (JSON `FsOp`); its answer, if it
    /// has one, goes to `--out`.
    Fs {
        #[arg(long)]
        request: String,
        #[arg(long)]
        out: PathBuf,
    },
    /// Remove a container's state and cgroups; `--force` kills it first.
    Delete {
        #[arg(long)]
        force: bool,
        id: String,
    },
}

/// Where a launched process's pid goes, and how it is born: the arguments
/// of every operation that makes a container process.
#[derive(clap::Args)]
struct LaunchArgs {
    /// File that receives the new process's pid.
    #[arg(long)]
    pid_file: PathBuf,
    /// libcontainer's console socket, for a process with a terminal.
    #[arg(long)]
    console_socket: Option<PathBuf>,
    /// The unified cgroup to be born in (v1-hybrid hosts).
    #[arg(long)]
    unified_cgroup: Option<PathBuf>,
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
    match run(&cli) {
        Ok(()) => 0,
        Err(e) => {
            let msg = format!("{e:#}");
            if let Ok(mut f) = std::fs::File::create(&cli.log) {
                let _ = f.write_all(msg.as_bytes());
            }
            1
        }
    }
}

fn run(cli: &Cli) -> anyhow::Result<()> {
    use anyhow::Context;
    match &cli.op {
        Op::Create { bundle, launch, id } => {
            if let Some(cg) = &launch.unified_cgroup {
                join_cgroup(cg)?;
            }
            let c = ContainerBuilder::new(id.clone(), SyscallType::default())
                .with_executor(DefaultExecutor {})
                .with_root_path(&cli.root)?
                .with_pid_file(Some(&launch.pid_file))?
                .with_console_socket(launch.console_socket.as_ref())
                .validate_id()?
                .as_init(bundle)
                .with_systemd(false)
                .with_detach(true)
                .build()?;
            // runc brings up the loopback interface of a network namespace
            // it creates; libcontainer does not, and programs expect it.
            if let (Some(pid), true) = (c.pid(), creates_netns(bundle)?) {
                crate::netns::loopback_up(pid.as_raw()).context("bring up lo in the container")?;
            }
        }
        Op::Start { id } => load(&cli.root, id)?.start()?,
        Op::Exec { process, launch, id } => {
            if let Some(cg) = &launch.unified_cgroup {
                join_cgroup(cg)?;
            }
            join_time_namespace(&load(&cli.root, id)?)?;
            ContainerBuilder::new(id.clone(), SyscallType::default())
                .with_executor(DefaultExecutor {})
                .with_root_path(&cli.root)?
                .with_pid_file(Some(&launch.pid_file))?
                .with_console_socket(launch.console_socket.as_ref())
                .validate_id()?
                .as_tenant()
                .with_process(Some(process))
                .with_detach(true)
                .build()?;
        }
        Op::Checkpoint {
            image_path,
            work_path,
            exit,
            tcp_established,
            ext_unix_sk,
            file_locks,
            id,
        } => {
            let c = load(&cli.root, id)?;
            // A frozen container (containerd pauses before Checkpoint, crabd
            // freezes for a consistent filesystem snapshot) stays frozen:
            // CRIU is told the freezer cgroup.
            criu::dump(
                &c,
                &criu::DumpOpts {
                    criu: &cli.criu,
                    image_path,
                    work_path: work_path.as_deref(),
                    leave_running: !*exit,
                    tcp_established: *tcp_established,
                    ext_unix_sk: *ext_unix_sk,
                    file_locks: *file_locks,
                },
            )?;
            if *exit {
                let mut c = load(&cli.root, id)?;
                c.set_status(ContainerStatus::Stopped).save()?;
            }
        }
        Op::Restore {
            image_path,
            work_path,
            tcp_established,
            netns,
            launch,
            bundle,
            id,
        } => {
            if let Some(bundle) = bundle {
                new_state(&cli.root, id, bundle)?;
            }
            // CRIU leaves cgroups alone (the image may name another
            // container's): the restored tree is born in the helper's, which
            // are the container's own.
            let mut c = load(&cli.root, id)?;
            let spec =
                oci_spec::runtime::Spec::load(c.bundle().join("config.json")).context("read config.json")?;
            let linux = spec.linux().as_ref();
            let cgroups_path =
                crate::cgroup::spec_cgroups_path(linux.and_then(|l| l.cgroups_path().as_deref()), id);
            let fresh_limits = bundle.as_ref().and(linux.and_then(|l| l.resources().as_ref()));
            crate::cgroup::join(&cgroups_path, id, std::process::id() as i32, fresh_limits)?;
            if let Some(cg) = &launch.unified_cgroup {
                join_cgroup(cg)?;
            }
            let pid = criu::restore(
                &mut c,
                &criu::RestoreOpts {
                    criu: &cli.criu,
                    image_path,
                    work_path,
                    tcp_established: *tcp_established,
                    console_socket: launch.console_socket.as_deref(),
                    fresh: bundle.is_some(),
                    netns: netns.as_deref(),
                },
            )?;
            std::fs::write(&launch.pid_file, pid.to_string())
                .with_context(|| format!("write {}", launch.pid_file.display()))?;
        }
        Op::Fs { request, out } => {
            let op: crate::fsop::FsOp = serde_json::from_str(request).context("parse the fs request")?;
            let answer = op.run()?;
            std::fs::write(out, answer.unwrap_or_default())
                .with_context(|| format!("write {}", out.display()))?;
        }
        Op::Delete { force, id } => match load(&cli.root, id) {
            Ok(mut c) => c.delete(*force)?,
            // Nothing was created (create failed early): nothing to delete.
            Err(_) if !cli.root.join(id).exists() => {}
            Err(e) => return Err(e).context("load container state"),
        },
    }
    Ok(())
}

/// Whether the bundle's spec makes a new network namespace (one with no path).
fn creates_netns(bundle: &Path) -> anyhow::Result<bool> {
    use anyhow::Context;
    let spec = oci_spec::runtime::Spec::load(bundle.join("config.json")).context("read config.json")?;
    let namespaces = spec
        .linux()
        .as_ref()
        .and_then(|l| l.namespaces().clone())
        .unwrap_or_default();
    Ok(namespaces
        .iter()
        .any(|n| n.typ() == oci_spec::runtime::LinuxNamespaceType::Network && n.path().is_none()))
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
    Container::load(root.join(id)).with_context(|| format!("load container {id}"))
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
