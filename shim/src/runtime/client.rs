//! The shim's side of the runtime helper: spawn, wait through the exit
//! router, read the pid file or the error.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use nix::sys::signal::{kill, Signal};
use nix::unistd::Pid;

use super::SUBCOMMAND;
use crate::config::NetworkLock;
use crate::error::{Error, Result};
use crate::exits::{Exit, ExitRouter};

/// Receives a launched process's exit.
pub type ExitReceiver = tokio::sync::oneshot::Receiver<Exit>;
pub use crate::io::ChildStdio as Stdio;

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
}

/// What a create or exec needs besides the container id.
pub struct Launch<'a> {
    /// Where the pid file and error log go (the bundle).
    pub work_dir: &'a Path,
    /// The container's stdio.
    pub stdio: Stdio,
    /// The unified cgroup to be born in (v1-hybrid hosts).
    pub unified_cgroup: Option<&'a Path>,
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

    /// Creates container `id` from `bundle`; returns its init's pid.
    pub async fn create(&self, id: &str, bundle: &Path, launch: Launch<'_>) -> Result<(i32, ExitReceiver)> {
        let mut args = vec!["create".into(), "--bundle".into(), bundle.as_os_str().to_owned()];
        self.launch("create", id, &mut args, launch).await
    }

    /// Runs the process described by `process_json` in container `id`;
    /// returns its pid.
    pub async fn exec(
        &self,
        id: &str,
        process_json: &Path,
        launch: Launch<'_>,
    ) -> Result<(i32, ExitReceiver)> {
        let mut args = vec![
            "exec".into(),
            "--process".into(),
            process_json.as_os_str().to_owned(),
        ];
        self.launch("exec", id, &mut args, launch).await
    }

    /// Starts container `id`'s process.
    pub async fn start(&self, id: &str, work_dir: &Path) -> Result<()> {
        let args = vec!["start".into(), id.into()];
        self.invoke("start", id, work_dir, args, Stdio::null()).await
    }

    /// Dumps container `id`'s processes into `image_path` with CRIU.
    pub async fn checkpoint(
        &self,
        id: &str,
        work_dir: &Path,
        image_path: &Path,
        opts: &CheckpointOpts,
    ) -> Result<()> {
        let mut args: Vec<std::ffi::OsString> =
            vec!["checkpoint".into(), "--image-path".into(), image_path.into()];
        if let Some(w) = &opts.work_path {
            args.push("--work-path".into());
            args.push(w.into());
        }
        for (on, flag) in [
            (opts.exit, "--exit"),
            (opts.tcp_established, "--tcp-established"),
            (opts.ext_unix_sk, "--ext-unix-sk"),
            (opts.file_locks, "--file-locks"),
        ] {
            if on {
                args.push(flag.into());
            }
        }
        args.push(id.into());
        self.invoke("checkpoint", id, work_dir, args, Stdio::null()).await
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
        let mut args: Vec<std::ffi::OsString> = vec![
            "restore".into(),
            "--image-path".into(),
            image_path.into(),
            "--work-path".into(),
            work_path.into(),
        ];
        if opts.tcp_established {
            args.push("--tcp-established".into());
        }
        if let Some(bundle) = &opts.fresh_bundle {
            args.push("--bundle".into());
            args.push(bundle.into());
        }
        if let Some(netns) = &opts.netns {
            args.push("--netns".into());
            args.push(netns.into());
        }
        self.launch("restore", id, &mut args, launch).await
    }

    /// Runs filesystem operation `op` for container `id` in a helper (it
    /// runs commands); returns its answer, if it has one.
    pub async fn fs(&self, id: &str, work_dir: &Path, op: &crate::fsop::FsOp) -> Result<Option<String>> {
        let n = self.n_calls.fetch_add(1, Ordering::Relaxed);
        let out = work_dir.join(format!(".crab-fs-{n}.out"));
        let request = serde_json::to_string(op).expect("an fs operation serializes");
        let args = vec![
            "fs".into(),
            "--request".into(),
            request.into(),
            "--out".into(),
            out.clone().into(),
        ];
        let done = self.invoke("fs", id, work_dir, args, Stdio::null()).await;
        let answer = std::fs::read_to_string(&out).ok();
        let _ = std::fs::remove_file(&out);
        done?;
        Ok(answer.filter(|a| !a.is_empty()))
    }

    /// Deletes container `id`'s state and cgroups (`force`: kill it first).
    pub async fn delete(&self, id: &str, work_dir: &Path, force: bool) -> Result<()> {
        let mut args = vec!["delete".into()];
        if force {
            args.push("--force".into());
        }
        args.push(id.into());
        self.invoke("delete", id, work_dir, args, Stdio::null()).await
    }

    /// Runs CRIU from `path` (a bare name is looked up on `PATH`), locking
    /// the network with `network_lock`.
    pub fn with_criu(mut self, path: PathBuf, network_lock: NetworkLock) -> Self {
        self.criu = path;
        self.network_lock = network_lock;
        self
    }

    /// Points the CRIU that `cmd` will start at a configuration file with
    /// the network lock method, which rust-criu has no option for (CRIU
    /// reads `CRIU_CONFIG_FILE` in RPC mode too; the RPC request does not
    /// override the method). One the shim's environment names wins.
    fn configure_criu(&self, cmd: &mut Command, work_dir: &Path) -> Result<()> {
        if std::env::var_os("CRIU_CONFIG_FILE").is_some_and(|f| !f.is_empty()) {
            return Ok(());
        }
        let conf = work_dir.join(".crab-criu.conf");
        let text = format!("network-lock {}\n", self.network_lock.as_str());
        std::fs::write(&conf, text).map_err(Error::io(format!("write {}", conf.display())))?;
        cmd.env("CRIU_CONFIG_FILE", conf);
        Ok(())
    }

    /// libcontainer's state root.
    pub fn root(&self) -> &Path {
        &self.root
    }

    /// Where console sockets are made (short paths under the state root).
    pub fn console_dir(&self) -> PathBuf {
        self.root.join(".console")
    }

    async fn launch(
        &self,
        op: &'static str,
        id: &str,
        args: &mut Vec<std::ffi::OsString>,
        launch: Launch<'_>,
    ) -> Result<(i32, ExitReceiver)> {
        // The new process can exit before the helper does (an exec of
        // `true`): keep unclaimed exits until its pid is watched.
        let _spawning = self.exits.spawning();
        let n = self.n_calls.fetch_add(1, Ordering::Relaxed);
        let pid_file = launch.work_dir.join(format!(".crab-{op}-{n}.pid"));
        args.push("--pid-file".into());
        args.push(pid_file.clone().into());
        if let Stdio::Console { path } = &launch.stdio {
            args.push("--console-socket".into());
            args.push(path.into());
        }
        if let Some(cg) = launch.unified_cgroup {
            args.push("--unified-cgroup".into());
            args.push(cg.into());
        }
        args.push(id.into());
        let res = self
            .invoke(op, id, launch.work_dir, std::mem::take(args), launch.stdio)
            .await;
        let pid = res.and_then(|()| {
            let text = std::fs::read_to_string(&pid_file)
                .map_err(Error::io(format!("read {}", pid_file.display())))?;
            text.trim().parse::<i32>().map_err(|_| Error::Runtime {
                op,
                id: id.to_owned(),
                reason: format!("pid file holds {text:?}"),
            })
        });
        let _ = std::fs::remove_file(&pid_file);
        let pid = pid?;
        Ok((pid, self.exits.watch(pid)))
    }

    async fn invoke(
        &self,
        op: &'static str,
        id: &str,
        work_dir: &Path,
        args: Vec<std::ffi::OsString>,
        stdio: Stdio,
    ) -> Result<()> {
        let n = self.n_calls.fetch_add(1, Ordering::Relaxed);
        let log = work_dir.join(format!(".crab-{op}-{n}.log"));
        let mut cmd = Command::new(&self.exe);
        cmd.arg(SUBCOMMAND)
            .arg("--root")
            .arg(&self.root)
            .arg("--log")
            .arg(&log)
            .arg("--criu")
            .arg(&self.criu)
            .args(args)
            .current_dir(work_dir);
        if matches!(op, "checkpoint" | "restore") {
            self.configure_criu(&mut cmd, work_dir)?;
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
        let guard = self.exits.spawning();
        // The child is never waited on through `Child`: the shim's reaper
        // collects it and the exit router hands its status back.
        let child = cmd
            .spawn()
            .map_err(Error::io(format!("spawn runtime helper for {op}")))?;
        let pid = child.id() as i32;
        drop(cmd);
        let exit = self.exits.watch(pid);
        drop(guard);
        let code = match tokio::time::timeout(self.timeout, exit).await {
            Ok(Ok(exit)) => exit.code,
            Ok(Err(_)) => unreachable!("the exit router lives as long as the shim"),
            Err(_) => {
                let _ = kill(Pid::from_raw(pid), Signal::SIGKILL);
                return Err(Error::RuntimeTimeout {
                    op,
                    id: id.to_owned(),
                    secs: self.timeout.as_secs(),
                });
            }
        };
        let reason = std::fs::read_to_string(&log).unwrap_or_default();
        let _ = std::fs::remove_file(&log);
        if code != 0 {
            let reason = if reason.is_empty() {
                format!("runtime helper exited with status {code}")
            } else {
                reason
            };
            return Err(Error::Runtime {
                op,
                id: id.to_owned(),
                reason,
            });
        }
        Ok(())
    }
}
