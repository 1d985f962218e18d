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
use libcontainer::container::{CheckpointOptions, Container, ContainerStatus};
use libcontainer::syscall::syscall::SyscallType;
use libcontainer::workload::default::DefaultExecutor;

mod client;

pub use client::{CheckpointOpts, Launch, RuntimeClient};

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
    #[command(subcommand)]
    op: Op,
}

#[derive(Subcommand)]
enum Op {
    /// Create a container from a bundle; its init waits for `start`.
    Create {
        #[arg(long)]
        bundle: PathBuf,
        #[arg(long)]
        pid_file: PathBuf,
        #[arg(long)]
        console_socket: Option<PathBuf>,
        #[arg(long)]
        unified_cgroup: Option<PathBuf>,
        id: String,
    },
    /// Let a created container's init run its process.
    Start { id: String },
    /// Run an additional process (OCI `process.json`) in a running container.
    Exec {
        #[arg(long)]
        process: PathBuf,
        #[arg(long)]
        pid_file: PathBuf,
        #[arg(long)]
        console_socket: Option<PathBuf>,
        #[arg(long)]
        unified_cgroup: Option<PathBuf>,
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
    /// Remove a container's state and cgroups; `--force` kills it first.
    Delete {
        #[arg(long)]
        force: bool,
        id: String,
    },
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
        Op::Create {
            bundle,
            pid_file,
            console_socket,
            unified_cgroup,
            id,
        } => {
            if let Some(cg) = unified_cgroup {
                join_cgroup(cg)?;
            }
            let c = ContainerBuilder::new(id.clone(), SyscallType::default())
                .with_executor(DefaultExecutor {})
                .with_root_path(&cli.root)?
                .with_pid_file(Some(pid_file))?
                .with_console_socket(console_socket.as_ref())
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
        Op::Exec {
            process,
            pid_file,
            console_socket,
            unified_cgroup,
            id,
        } => {
            if let Some(cg) = unified_cgroup {
                join_cgroup(cg)?;
            }
            ContainerBuilder::new(id.clone(), SyscallType::default())
                .with_executor(DefaultExecutor {})
                .with_root_path(&cli.root)?
                .with_pid_file(Some(pid_file))?
                .with_console_socket(console_socket.as_ref())
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
            let mut c = load(&cli.root, id)?;
            // containerd pauses a task before it checkpoints it, but CRIU
            // cannot seize tasks in a frozen cgroup (libcontainer does not
            // pass --freeze-cgroup): thaw, let CRIU freeze the tree itself
            // (the dump stays consistent), and freeze again after.
            let was_paused = c.status() == ContainerStatus::Paused;
            if was_paused {
                c.resume().context("thaw for the dump")?;
            }
            let opts = CheckpointOptions {
                ext_unix_sk: *ext_unix_sk,
                file_locks: *file_locks,
                image_path: image_path.clone(),
                leave_running: !*exit,
                shell_job: false,
                tcp_established: *tcp_established,
                work_path: work_path.clone(),
                manage_cgroups_mode: rust_criu::CgMode::SOFT,
                link_remap: false,
            };
            let dumped = c.checkpoint(&opts).context("criu dump");
            if was_paused && !*exit {
                c.pause().context("freeze again after the dump")?;
            }
            dumped?;
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
