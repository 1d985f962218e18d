//! The shim's side of the runtime helper: one [`Request`] per helper
//! process, waited for through the exit router, answered by one [`Reply`]
//! (see `protocol`).

use std::os::fd::{AsRawFd, OwnedFd};
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use nix::sys::signal::{killpg, Signal};
use nix::unistd::Pid;

use super::protocol::{self, Dump, Op, Reply, Request};
use super::SUBCOMMAND;
use crate::config::NetworkLock;
use crate::error::{Error, Result};
use crate::exits::{Exit, ExitRouter};

/// Receives a launched process's exit.
pub type ExitReceiver = tokio::sync::oneshot::Receiver<Exit>;
pub use crate::io::ChildStdio as Stdio;

/// CRIU's configuration file in a helper's work directory.
const CRIU_CONF: &str = ".crab-criu.conf";

/// Names, in a helper's environment (and so in what it starts: CRIU,
/// `zfs`), its work directory resolved: the mark a cleanup finds them by.
const HELPER_DIR_ENV: &str = "CRAB_HELPER_DIR";

/// Runs libcontainer operations in helper processes.
pub struct RuntimeClient {
    exe: PathBuf,
    criu: PathBuf,
    network_lock: NetworkLock,
    root: PathBuf,
    timeout: Duration,
    exits: Arc<ExitRouter>,
    n_calls: AtomicU64,
}

/// How to checkpoint (containerd's runc CheckpointOptions, as far as CRIU
/// through libcontainer supports them).
#[derive(Debug, Default)]
pub struct CheckpointOpts {
    /// CRIU's work directory (logs), if not the image directory.
    pub work_path: Option<PathBuf>,
    /// Stop the container after the dump.
    pub exit: bool,
    /// Dump established TCP connections.
    pub tcp_established: bool,
    /// Dump external unix sockets.
    pub ext_unix_sk: bool,
    /// Dump file locks.
    pub file_locks: bool,
    /// The init is crab-init (its report pipe is recorded).
    pub crab_init: bool,
    /// Something may have changed the sandbox's mounts (a privileged
    /// exec): every tmpfs stays in the images.
    pub mounts_changed: bool,
    /// CRIU's network lock would protect nothing (`netns::needs_lock`,
    /// seen while the tree is frozen): not at this dump, nor at a restore
    /// of it.
    pub quiet_network: bool,
    /// The running init's pid, when the tree is left running: if it starts
    /// dying during the dump, CRIU is stopped at once (a killed init can
    /// leave CRIU waiting forever for it to trap).
    pub init_pid: Option<i32>,
}

/// How to restore.
#[derive(Debug, Default)]
pub struct RestoreOpts {
    /// Restore established TCP connections (they were dumped).
    pub tcp_established: bool,
    /// The container has no runtime state yet (forked or imported): make
    /// it from this bundle.
    pub fresh_bundle: Option<PathBuf>,
    /// The sandbox's pinned network namespace (docker's), if it has one:
    /// the restore goes there.
    pub netns: Option<PathBuf>,
    /// The first restore of a pod's containers, all killed: the pod's
    /// network first loses the connections closed but not gone
    /// (`netns::reap_closed_tcp`).
    pub reap_closed: bool,
}

/// What a create or exec needs besides the container id.
pub struct Launch<'a> {
    /// Where the helper runs and leaves its reply (the bundle).
    pub work_dir: &'a Path,
    /// The container's stdio.
    pub stdio: Stdio,
    /// The unified cgroup to be born in (v1-hybrid hosts).
    pub unified_cgroup: Option<&'a Path>,
    /// Run it through crab-init, with this end of its channel (see
    /// `crate::init`).
    pub crab_init: Option<(protocol::Personality, OwnedFd)>,
}

// === impl RuntimeClient ===

impl RuntimeClient {
    /// A client that runs `exe runtime …` with libcontainer state under `root`.
    pub fn new(exe: PathBuf, root: PathBuf, timeout: Duration, exits: Arc<ExitRouter>) -> Self {
        RuntimeClient {
            exe,
            criu: PathBuf::from("criu"),
            network_lock: NetworkLock::Nftables,
            root,
            timeout,
            exits,
            n_calls: AtomicU64::new(0),
        }
    }

    /// The longest a call may take (`[shim] runtime_timeout_secs`).
    pub fn timeout(&self) -> Duration {
        self.timeout
    }

    /// Creates container `id` from `bundle`; returns its init's pid.
    pub async fn create(&self, id: &str, bundle: &Path, launch: Launch<'_>) -> Result<(i32, ExitReceiver)> {
        let op = Op::Create {
            bundle: bundle.to_owned(),
            launch: launch.spec(),
        };
        self.launch(id, op, launch).await
    }

    /// Runs the process described by `process_json` in container `id`;
    /// returns its pid.
    pub async fn exec(
        &self,
        id: &str,
        process_json: &Path,
        launch: Launch<'_>,
    ) -> Result<(i32, ExitReceiver)> {
        let op = Op::Exec {
            process: process_json.to_owned(),
            launch: launch.spec(),
        };
        self.launch(id, op, launch).await
    }

    /// Starts container `id`'s process.
    pub async fn start(&self, id: &str, work_dir: &Path) -> Result<()> {
        self.done(id, work_dir, Op::Start).await
    }

    /// Dumps container `id`'s processes into `image_path` with CRIU.
    pub async fn checkpoint(
        &self,
        id: &str,
        work_dir: &Path,
        image_path: &Path,
        opts: &CheckpointOpts,
    ) -> Result<()> {
        let op = Op::Checkpoint(Dump {
            image_path: image_path.to_owned(),
            work_path: opts.work_path.clone(),
            exit: opts.exit,
            tcp_established: opts.tcp_established,
            ext_unix_sk: opts.ext_unix_sk,
            file_locks: opts.file_locks,
            crab_init: opts.crab_init,
            mounts_changed: opts.mounts_changed,
            quiet_network: opts.quiet_network,
        });
        let watch = opts.init_pid.filter(|_| !opts.exit);
        match self.invoke(id, work_dir, op, Stdio::null(), None, watch).await? {
            (_, Reply::Done) => Ok(()),
            (name, other) => Err(unexpected(name, id, &other)),
        }
    }

    /// Restores container `id`'s processes from `image_path` (its previous
    /// processes must be gone); returns the restored init's pid.
    pub async fn restore(
        &self,
        id: &str,
        image_path: &Path,
        work_path: &Path,
        opts: &RestoreOpts,
        launch: Launch<'_>,
    ) -> Result<(i32, ExitReceiver)> {
        let op = Op::Restore(protocol::Restore {
            image_path: image_path.to_owned(),
            work_path: work_path.to_owned(),
            tcp_established: opts.tcp_established,
            netns: opts.netns.clone(),
            reap_closed: opts.reap_closed,
            launch: launch.spec(),
            bundle: opts.fresh_bundle.clone(),
        });
        self.launch(id, op, launch).await
    }

    /// Runs filesystem operation `op` for container `id` in a helper (it
    /// runs commands); returns its answer, if it has one.
    pub async fn fs(&self, id: &str, work_dir: &Path, op: &crate::fsop::FsOp) -> Result<Option<String>> {
        let op = Op::Fs { fs: op.clone() };
        match self.invoke(id, work_dir, op, Stdio::null(), None, None).await? {
            (_, Reply::Answer { text }) => Ok(text.filter(|a| !a.is_empty())),
            (name, other) => Err(unexpected(name, id, &other)),
        }
    }

    /// Deletes container `id`'s state and cgroups (`force`: kill it first).
    pub async fn delete(&self, id: &str, work_dir: &Path, force: bool) -> Result<()> {
        self.done(id, work_dir, Op::Delete { force }).await
    }

    /// Runs CRIU from `path` (a bare name is looked up on `PATH`), locking
    /// the network with `network_lock`.
    pub fn with_criu(mut self, path: PathBuf, network_lock: NetworkLock) -> Self {
        self.criu = path;
        self.network_lock = network_lock;
        self
    }

    /// Points the CRIU that `cmd` will start at a configuration file with
    /// the network lock method and `extra` lines, which rust-criu has no
    /// options for (CRIU reads `CRIU_CONFIG_FILE` in RPC mode too; the RPC
    /// request does not override them). A file the shim's environment
    /// names is read into it after the lock method (its choices win), and
    /// `extra` last.
    fn configure_criu(
        &self,
        cmd: &mut Command,
        work_dir: &Path,
        lock: NetworkLock,
        extra: &str,
    ) -> Result<()> {
        let theirs = match std::env::var_os("CRIU_CONFIG_FILE").filter(|f| !f.is_empty()) {
            Some(f) => std::fs::read_to_string(&f).map_err(Error::io(format!(
                "read CRIU_CONFIG_FILE {}",
                Path::new(&f).display()
            )))?,
            None => String::new(),
        };
        let conf = work_dir.join(CRIU_CONF);
        let text = format!("network-lock {}\n{theirs}\n{extra}", lock.as_str());
        std::fs::write(&conf, text).map_err(Error::io(format!("write {}", conf.display())))?;
        cmd.env("CRIU_CONFIG_FILE", conf);
        Ok(())
    }

    /// The router of reaped exits.
    pub fn exits(&self) -> &Arc<ExitRouter> {
        &self.exits
    }

    /// libcontainer's state root.
    pub fn root(&self) -> &Path {
        &self.root
    }

    /// Where console sockets are made (short paths under the state root).
    pub fn console_dir(&self) -> PathBuf {
        self.root.join(".console")
    }

    /// Runs `op`, which answers nothing.
    async fn done(&self, id: &str, work_dir: &Path, op: Op) -> Result<()> {
        match self.invoke(id, work_dir, op, Stdio::null(), None, None).await? {
            (_, Reply::Done) => Ok(()),
            (name, other) => Err(unexpected(name, id, &other)),
        }
    }

    /// Runs `op`, which makes a process; answers its pid and exit.
    async fn launch(&self, id: &str, op: Op, launch: Launch<'_>) -> Result<(i32, ExitReceiver)> {
        // The new process can exit before the helper does (an exec of
        // `true`): keep unclaimed exits until its pid is watched.
        let _spawning = self.exits.spawning();
        let channel = launch.crab_init.map(|(_, fd)| fd);
        match self
            .invoke(id, launch.work_dir, op, launch.stdio, channel, None)
            .await?
        {
            (_, Reply::Launched { pid }) => Ok((pid, self.exits.watch(pid))),
            (name, other) => Err(unexpected(name, id, &other)),
        }
    }

    /// Runs one helper for `op` and answers its reply; a failure it
    /// reports is an [`Error::Runtime`] of its kind. The helper leads its
    /// own process group, so a helper that overruns the deadline (or whose
    /// `watch`ed process starts dying) is killed with everything it started
    /// that has not left the group (CRIU, `zfs`): nothing orphaned keeps
    /// working on the container after the call has failed.
    #[tracing::instrument(level = "debug", skip_all, fields(helper = op_name(&op), sandbox = id))]
    async fn invoke(
        &self,
        id: &str,
        work_dir: &Path,
        op: Op,
        stdio: Stdio,
        channel: Option<OwnedFd>,
        watch: Option<i32>,
    ) -> Result<(&'static str, Reply)> {
        let name = op_name(&op);
        let n = self.n_calls.fetch_add(1, Ordering::Relaxed);
        // The shim's pid too: a file an earlier shim of this bundle left
        // must never pass for this helper's reply.
        let reply_path = work_dir.join(format!(".crab-{name}-{}-{n}.reply", std::process::id()));
        match std::fs::remove_file(&reply_path) {
            Ok(()) => {}
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(e) => return Err(Error::io(format!("remove {}", reply_path.display()))(e)),
        }
        let criu_op = matches!(op, Op::Checkpoint(_) | Op::Restore(_));
        let request = Request {
            root: self.root.clone(),
            criu: self.criu.clone(),
            id: id.to_owned(),
            op,
        };
        let mut cmd = Command::new(&self.exe);
        cmd.arg(SUBCOMMAND)
            .arg("--reply")
            .arg(&reply_path)
            .arg("--request")
            .arg(serde_json::to_string(&request).expect("a request serializes"))
            .current_dir(work_dir)
            .process_group(0);
        if let Ok(dir) = work_dir.canonicalize() {
            cmd.env(HELPER_DIR_ENV, dir);
        }
        if criu_op {
            let extra = match &request.op {
                Op::Restore(r) => {
                    let bundle = r.bundle.as_deref().unwrap_or(work_dir);
                    super::joined_ns::config(bundle).map_err(|reason| Error::InvalidBundle {
                        bundle: bundle.to_owned(),
                        reason,
                    })?
                }
                _ => String::new(),
            };
            // No lock where it protects nothing (as the dump saw it):
            // locking and unlocking cost CRIU some milliseconds.
            let quiet = match &request.op {
                Op::Checkpoint(d) => d.quiet_network,
                Op::Restore(r) => r.image_path.join(super::criu::QUIET_NETWORK).exists(),
                _ => false,
            };
            let lock = if quiet {
                NetworkLock::Skip
            } else {
                self.network_lock
            };
            self.configure_criu(&mut cmd, work_dir, lock, &extra)?;
        }
        match stdio {
            Stdio::Fds {
                stdin,
                stdout,
                stderr,
            } => {
                cmd.stdin(stdin.map_or_else(std::process::Stdio::null, Into::into));
                cmd.stdout(stdout.map_or_else(std::process::Stdio::null, Into::into));
                cmd.stderr(stderr.map_or_else(std::process::Stdio::null, Into::into));
            }
            Stdio::Console { .. } => {
                cmd.stdin(std::process::Stdio::null());
                cmd.stdout(std::process::Stdio::null());
                cmd.stderr(std::process::Stdio::null());
            }
        }
        if let Some(fd) = &channel {
            let raw = fd.as_raw_fd();
            let target = crate::init::CHANNEL_FD;
            // SAFETY: between fork and exec the closure only calls dup2 or
            // fcntl, which are async-signal-safe; `raw` stays open until
            // `spawn` returns (the parent keeps `channel`).
            unsafe {
                cmd.pre_exec(move || {
                    let done = if raw == target {
                        libc::fcntl(target, libc::F_SETFD, 0)
                    } else {
                        libc::dup2(raw, target)
                    };
                    match done {
                        -1 => Err(std::io::Error::last_os_error()),
                        _ => Ok(()),
                    }
                });
            }
        }
        let guard = self.exits.spawning();
        // The child is never waited on through `Child`: the shim's reaper
        // collects it and the exit router hands its status back.
        let child = cmd
            .spawn()
            .map_err(Error::io(format!("spawn runtime helper for {name}")))?;
        let pid = child.id() as i32;
        drop(cmd);
        // The helper and what it starts hold the channel now.
        drop(channel);
        let exit = self.exits.watch(pid);
        drop(guard);
        let stopped = |error: Error| {
            // The group is the helper's pid: it is alive (not yet reaped),
            // so no other group can have taken that id.
            let _ = killpg(Pid::from_raw(pid), Signal::SIGKILL);
            let _ = std::fs::remove_file(&reply_path);
            Err(error)
        };
        let code = tokio::select! {
            // The helper's own end first: a dump that finished is not
            // abandoned because its init died right after.
            biased;
            waited = tokio::time::timeout(self.timeout, exit) => match waited {
                Ok(Ok(exit)) => exit.code,
                Ok(Err(_)) => unreachable!("the exit router lives as long as the shim"),
                Err(_) => {
                    return stopped(Error::RuntimeTimeout {
                        op: name,
                        id: id.to_owned(),
                        secs: self.timeout.as_secs(),
                    })
                }
            },
            () = dying(watch) => {
                return stopped(Error::InitDied {
                    op: name,
                    id: id.to_owned(),
                })
            }
        };
        let bytes = std::fs::read(&reply_path);
        let _ = std::fs::remove_file(&reply_path);
        let Ok(bytes) = bytes else {
            // Killed before it answered (the OOM killer): what it started
            // (CRIU) must not go on. Its group outlives it while a member
            // does, so the id is still the group's.
            let _ = killpg(Pid::from_raw(pid), Signal::SIGKILL);
            return Err(Error::RuntimeDied {
                op: name,
                id: id.to_owned(),
                status: code as i32,
            });
        };
        match serde_json::from_slice::<Reply>(&bytes) {
            Ok(Reply::Failed(f)) => Err(Error::Runtime {
                op: name,
                id: id.to_owned(),
                kind: f.kind,
                reason: f.message,
            }),
            Ok(reply) => Ok((name, reply)),
            Err(e) => Err(Error::Runtime {
                op: name,
                id: id.to_owned(),
                kind: protocol::FailureKind::BadRequest,
                reason: format!("unreadable reply: {e}"),
            }),
        }
    }
}

/// Kills the runtime helpers that a dead shim of the bundle at `bundle`
/// left running, each with its process group (the CRIU it started), and
/// waits (a second at most) for them to be gone; answers how many
/// processes it killed.
///
/// A shim watches its helpers: it stops a dump whose init starts dying,
/// because CRIU then waits forever for a traced task that waits for its
/// pid namespace's children, which only CRIU can reap. A killed shim
/// watches nothing, so its cleanup must stop them before it kills the
/// container. They are found in `/proc`, so no record of the dead shim's
/// can be missing: every helper, and all it starts (CRIU, `zfs`), carries
/// its resolved work directory in its environment (`CRAB_HELPER_DIR`),
/// which lies in the bundle; only root's processes count. Each process is
/// signalled through a pidfd opened before it is checked, so a pid reused
/// meanwhile is never hit.
pub async fn kill_orphaned_helpers(bundle: &Path) -> usize {
    let mut killed = Vec::new();
    if let Ok(bundle) = bundle.canonicalize() {
        for (group, identified) in orphaned_groups(&bundle) {
            tracing::warn!(group, "killing a runtime helper's group of the dead shim");
            killed.extend(kill_group(group, &identified));
        }
    }
    let deadline = tokio::time::Instant::now() + ORPHAN_WAIT;
    loop {
        let alive: Vec<i32> = killed.iter().copied().filter(|&p| alive(p)).collect();
        if alive.is_empty() {
            break;
        }
        if tokio::time::Instant::now() >= deadline {
            tracing::warn!(?alive, "killed runtime helpers still exit: going on");
            break;
        }
        tokio::time::sleep(WATCH_PERIOD).await;
    }
    killed.len()
}

/// How long a cleanup waits for killed helpers to be gone (containerd
/// gives the whole cleanup 5 s by default).
const ORPHAN_WAIT: Duration = Duration::from_secs(1);

/// Whether process `pid` exists and is no zombie.
fn alive(pid: i32) -> bool {
    procfs::process::Process::new(pid)
        .and_then(|p| p.stat())
        .is_ok_and(|s| s.state != 'Z')
}

/// The process groups of the runtime helpers of the bundle at `bundle`
/// (resolved), each with a pidfd of a member that bears the helpers' mark
/// (the helper, or what it started when it is gone).
fn orphaned_groups(bundle: &Path) -> Vec<(i32, OwnedFd)> {
    use rustix::process::{pidfd_open, Pid as RPid, PidfdFlags};
    let Ok(all) = procfs::process::all_processes() else {
        return Vec::new();
    };
    let mut groups: Vec<(i32, OwnedFd)> = Vec::new();
    for p in all.flatten() {
        // Cheap tests first: only root's processes can be helpers.
        let Ok(stat) = p.stat() else { continue };
        if stat.state == 'Z' || groups.iter().any(|(g, _)| *g == stat.pgrp) {
            continue;
        }
        if !p.status().is_ok_and(|s| s.euid == 0) {
            continue;
        }
        // Opened before the process is judged: it names this one for good.
        let Some(fd) = RPid::from_raw(p.pid).and_then(|pid| pidfd_open(pid, PidfdFlags::empty()).ok()) else {
            continue;
        };
        let marked = p.environ().is_ok_and(|env| {
            env.get(std::ffi::OsStr::new(HELPER_DIR_ENV))
                .is_some_and(|dir| Path::new(dir).is_absolute() && Path::new(dir).starts_with(bundle))
        });
        if marked {
            groups.push((stat.pgrp, fd));
        }
    }
    groups
}

/// SIGKILLs every member of process group `group`, which process
/// `identified` (a pidfd) showed to be a helper's; answers their pids.
/// Members are gathered through pidfds opened before their group is
/// checked, and only killed if `identified` still exists then (a group's
/// number is not given to another while one of its members exists).
fn kill_group(group: i32, identified: &OwnedFd) -> Vec<i32> {
    use rustix::process::{pidfd_open, pidfd_send_signal, Pid as RPid, PidfdFlags, Signal as RSignal};
    let Ok(all) = procfs::process::all_processes() else {
        return Vec::new();
    };
    let members: Vec<(i32, OwnedFd)> = all
        .flatten()
        .filter(|p| p.stat().is_ok_and(|s| s.pgrp == group))
        .filter_map(|p| {
            let fd = pidfd_open(RPid::from_raw(p.pid)?, PidfdFlags::empty()).ok()?;
            let still = procfs::process::Process::new(p.pid)
                .and_then(|p| p.stat())
                .is_ok_and(|s| s.pgrp == group);
            still.then_some((p.pid, fd))
        })
        .collect();
    // The one that showed the group, first: if it is gone, so may be the
    // group, and its number another's.
    if pidfd_send_signal(identified, RSignal::KILL).is_err() {
        return Vec::new();
    }
    members
        .into_iter()
        .filter_map(|(pid, fd)| pidfd_send_signal(&fd, RSignal::KILL).is_ok().then_some(pid))
        .collect()
}

/// The operation's name, for errors and the reply file.
fn op_name(op: &Op) -> &'static str {
    match op {
        Op::Create { .. } => "create",
        Op::Start => "start",
        Op::Exec { .. } => "exec",
        Op::Checkpoint(_) => "checkpoint",
        Op::Restore(_) => "restore",
        Op::Fs { .. } => "fs",
        Op::Delete { .. } => "delete",
    }
}

/// How often a watched init is looked at during a helper's call.
const WATCH_PERIOD: Duration = Duration::from_millis(20);

/// Resolves once process `pid` has started to die (it is exiting, a zombie,
/// gone, or has SIGKILL pending, which a frozen process keeps until it is
/// thawed); never for `None`.
async fn dying(pid: Option<i32>) {
    let Some(pid) = pid else {
        return std::future::pending().await;
    };
    while !is_dying(pid) {
        tokio::time::sleep(WATCH_PERIOD).await;
    }
}

/// Whether process `pid` has started to die (see [`dying`]). Only its
/// absence counts as gone: a /proc that cannot be read says nothing.
fn is_dying(pid: i32) -> bool {
    /// The kernel's `PF_EXITING` task flag.
    const PF_EXITING: u32 = 0x4;
    /// SIGKILL's bit in a pending-signal mask.
    const SIGKILL_BIT: u64 = 1 << (libc::SIGKILL - 1);
    let gone = |e: procfs::ProcError| {
        let gone = matches!(e, procfs::ProcError::NotFound(_));
        if !gone {
            tracing::debug!("process {pid} unreadable: {e}");
        }
        gone
    };
    let process = match procfs::process::Process::new(pid) {
        Ok(p) => p,
        Err(e) => return gone(e),
    };
    let (stat, status) = match (process.stat(), process.status()) {
        (Ok(stat), Ok(status)) => (stat, status),
        (Err(e), _) | (_, Err(e)) => return gone(e),
    };
    // A SIGKILL is queued to the group's threads (and kept while frozen);
    // an exit_group queues it to every thread but the caller's (which may
    // be the leader's): any thread's mask tells.
    if (status.shdpnd | status.sigpnd) & SIGKILL_BIT != 0 {
        return true;
    }
    // Only a process of several threads needs its threads read (this runs
    // every WATCH_PERIOD of a dump).
    let killed_thread = status.threads > 1
        && process.tasks().is_ok_and(|mut tasks| {
            tasks.any(|t| {
                t.ok()
                    .and_then(|t| t.status().ok())
                    .is_some_and(|s| s.sigpnd & SIGKILL_BIT != 0)
            })
        });
    if killed_thread {
        return true;
    }
    // A leader that called pthread_exit shows these while its other
    // threads run on: only a last thread's exit is the process's.
    let exiting = stat.flags & PF_EXITING != 0 || matches!(stat.state, 'Z' | 'X' | 'x');
    exiting && status.threads <= 1
}

/// A reply that is not the one `op` gives (a helper of another version).
fn unexpected(op: &'static str, id: &str, reply: &Reply) -> Error {
    Error::Runtime {
        op,
        id: id.to_owned(),
        kind: protocol::FailureKind::BadRequest,
        reason: format!("unexpected reply {reply:?}"),
    }
}

// === impl Launch ===

impl Launch<'_> {
    /// How the helper is to launch the process.
    fn spec(&self) -> protocol::Launch {
        protocol::Launch {
            console_socket: match &self.stdio {
                Stdio::Console { path } => Some(path.clone()),
                Stdio::Fds { .. } => None,
            },
            unified_cgroup: self.unified_cgroup.map(Path::to_owned),
            crab_init: self.crab_init.as_ref().map(|(p, _)| *p),
        }
    }
}

#[cfg(test)]
mod tests {
    use std::os::unix::fs::PermissionsExt;
    use std::process::Child;
    use std::time::Instant;

    use super::*;

    /// A helper that never finishes: it starts, in its group, a `sleep` of
    /// a length no other process uses (answered), records the sleep's pid
    /// in the pidfile (answered), and waits.
    fn stuck_helper(dir: &Path) -> (PathBuf, PathBuf, String) {
        static N: AtomicU64 = AtomicU64::new(0);
        let length = format!("1000.{}{}", std::process::id(), N.fetch_add(1, Ordering::Relaxed));
        let pidfile = dir.join("grandchild.pid");
        let exe = dir.join("helper.sh");
        let script = format!(
            "#!/bin/sh\nsleep {length} >/dev/null 2>&1 &\necho $! > {0}.tmp\nmv {0}.tmp {0}\nwait\n",
            pidfile.display()
        );
        std::fs::write(&exe, script).unwrap();
        std::fs::set_permissions(&exe, std::fs::Permissions::from_mode(0o755)).unwrap();
        (exe, pidfile, length)
    }

    /// Whether, within 10 s, no live process is a `sleep length` (a helper
    /// killed before it started one passes at once).
    fn no_sleep_left(length: &str) -> bool {
        let deadline = Instant::now() + Duration::from_secs(10);
        let running = || {
            procfs::process::all_processes().unwrap().flatten().any(|p| {
                p.cmdline().is_ok_and(|c| c == ["sleep", length]) && p.stat().is_ok_and(|s| s.state != 'Z')
            })
        };
        while running() {
            if Instant::now() > deadline {
                return false;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        true
    }

    fn grandchild(pidfile: &Path) -> i32 {
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            if let Ok(text) = std::fs::read_to_string(pidfile) {
                return text.trim().parse().unwrap();
            }
            assert!(Instant::now() < deadline, "the helper never started its sleep");
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    fn client(exe: PathBuf, dir: &Path, timeout: Duration) -> RuntimeClient {
        RuntimeClient::new(exe, dir.join("root"), timeout, Arc::new(ExitRouter::default()))
    }

    fn dump_opts(init: &Child) -> CheckpointOpts {
        CheckpointOpts {
            init_pid: Some(init.id() as i32),
            ..Default::default()
        }
    }

    /// A checkpoint helper that the shim started in `bundle` and left
    /// running (as a killed shim leaves it), once it has started what it
    /// starts: the pid of that (its sleep), and the sleep's length.
    async fn left_running(bundle: &Path) -> (i32, String) {
        let (exe, pidfile, length) = stuck_helper(bundle);
        let runtime = client(exe, bundle, Duration::from_secs(3600));
        let (images, opts) = (bundle.join("images"), CheckpointOpts::default());
        let dump = runtime.checkpoint("c1", bundle, &images, &opts);
        let started = tokio::task::spawn_blocking(move || grandchild(&pidfile));
        // The call is dropped; the helper is not stopped by that.
        let sleep = tokio::select! {
            _ = dump => panic!("a stuck helper ended"),
            pid = started => pid.unwrap(),
        };
        (sleep, length)
    }

    #[tokio::test]
    async fn a_dead_shims_helpers_are_killed_with_their_groups_and_no_other() {
        let dir = tempfile::tempdir().unwrap();
        let [bundle, other] = ["bundle", "other"].map(|d| {
            let path = dir.path().join(d);
            std::fs::create_dir(&path).unwrap();
            path
        });
        let (_, length) = left_running(&bundle).await;
        let (theirs, _) = left_running(&other).await;

        // The helper and the sleep it started, both marked.
        assert_eq!(kill_orphaned_helpers(&bundle).await, 2);
        assert!(no_sleep_left(&length), "what the helper started went with it");
        let group = procfs::process::Process::new(theirs)
            .unwrap()
            .stat()
            .unwrap()
            .pgrp;
        assert!(alive(theirs), "another bundle's helper runs on");

        let _ = killpg(Pid::from_raw(group), Signal::SIGKILL);
    }

    #[tokio::test]
    async fn a_dump_stops_when_the_init_is_killed_and_takes_criu_with_it() {
        let dir = tempfile::tempdir().unwrap();
        let (exe, pidfile, length) = stuck_helper(dir.path());
        let runtime = client(exe, dir.path(), Duration::from_secs(3600));
        let mut init = Command::new("sleep").arg("1000").spawn().unwrap();
        let images = dir.path().join("images");
        let opts = dump_opts(&init);
        let dump = runtime.checkpoint("c1", dir.path(), &images, &opts);
        let kill_init = async {
            // Once the helper has started what it starts.
            let pidfile = pidfile.clone();
            tokio::task::spawn_blocking(move || grandchild(&pidfile))
                .await
                .unwrap();
            assert!(!is_dying(init.id() as i32), "a running init is not dying");
            init.kill().unwrap();
        };
        let (result, ()) = tokio::join!(dump, kill_init);
        let err = result.expect_err("the dump of a killed init fails");
        assert!(matches!(err, Error::InitDied { op: "checkpoint", .. }), "{err}");
        assert!(
            no_sleep_left(&length),
            "what the helper started is killed with it"
        );
        init.wait().unwrap();
    }

    #[tokio::test]
    async fn a_helper_past_its_deadline_is_killed_with_its_group() {
        let dir = tempfile::tempdir().unwrap();
        let (exe, _, length) = stuck_helper(dir.path());
        let runtime = client(exe, dir.path(), Duration::from_millis(300));
        let mut init = Command::new("sleep").arg("1000").spawn().unwrap();
        let images = dir.path().join("images");
        let err = runtime
            .checkpoint("c1", dir.path(), &images, &dump_opts(&init))
            .await
            .expect_err("a stuck helper times out");
        assert!(matches!(err, Error::RuntimeTimeout { .. }), "{err}");
        assert!(
            no_sleep_left(&length),
            "what the helper started is killed with it"
        );
        assert!(!is_dying(init.id() as i32), "the watched init was left alone");
        init.kill().unwrap();
        init.wait().unwrap();
    }

    #[test]
    fn a_frozen_process_with_sigkill_pending_is_dying() {
        // cgroup v1's freezer keeps a killed task frozen until it is thawed:
        // only its pending SIGKILL tells.
        let freezer = Path::new("/sys/fs/cgroup/freezer");
        assert!(freezer.is_dir(), "this host has the v1 freezer (ENVIRONMENT.md)");
        let cgroup = freezer.join(format!("crab-dying-test-{}", std::process::id()));
        std::fs::create_dir(&cgroup).unwrap();
        let mut child = Command::new("sleep").arg("1000").spawn().unwrap();
        let pid = child.id() as i32;
        std::fs::write(cgroup.join("cgroup.procs"), pid.to_string()).unwrap();
        std::fs::write(cgroup.join("freezer.state"), "FROZEN").unwrap();
        let deadline = Instant::now() + Duration::from_secs(10);
        while std::fs::read_to_string(cgroup.join("freezer.state"))
            .unwrap()
            .trim()
            != "FROZEN"
        {
            assert!(Instant::now() < deadline, "the cgroup never froze");
            std::thread::sleep(Duration::from_millis(10));
        }
        assert!(!is_dying(pid), "a frozen process is not dying");
        nix::sys::signal::kill(Pid::from_raw(pid), Signal::SIGKILL).unwrap();
        let dying = is_dying(pid);
        std::fs::write(cgroup.join("freezer.state"), "THAWED").unwrap();
        child.wait().unwrap();
        std::fs::remove_dir(&cgroup).unwrap();
        assert!(dying, "a frozen process with SIGKILL pending is dying");
    }
}
