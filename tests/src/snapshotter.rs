//! A private `containerd-crab-snapshotter` on a zfs-fuse pool, and the
//! containerd config that plugs it in as `crabzfs`.

use std::path::PathBuf;
use std::process::{Child, Command, Stdio};

use crate::zfs::Pool;
use crate::{bin_dir, wait_until};

/// The snapshotter process, killed on drop.
pub struct Snapshotter {
    /// Its socket.
    pub socket: PathBuf,
    /// Its root dataset.
    pub dataset: String,
    state: PathBuf,
    child: Option<Child>,
}

impl Snapshotter {
    /// Starts the snapshotter on `pool/snaps` (created if absent).
    pub fn start(pool: &Pool) -> Self {
        let dataset = format!("{}/snaps", pool.name);
        crate::ok(
            crate::zfs::cmd("zfs")
                .args(["create", "-p", &dataset])
                .output()
                .expect("zfs create"),
        );
        let mut s = Snapshotter {
            socket: pool.dir.join("snap.sock"),
            dataset,
            state: pool.dir.join("state"),
            child: None,
        };
        s.spawn(None);
        s
    }

    /// The containerd config that plugs this snapshotter in as `crabzfs`,
    /// with garbage collection right after every deletion (containerd
    /// removes snapshots from a backend in GC).
    pub fn containerd_config(&self) -> String {
        format!(
            "[plugins.\"io.containerd.gc.v1.scheduler\"]\n  deletion_threshold = 1\n  schedule_delay = \"0s\"\n\
             [proxy_plugins]\n  [proxy_plugins.crabzfs]\n    type = \"snapshot\"\n    address = \"{}\"\n",
            self.socket.display()
        )
    }

    /// The command that starts the process (its socket, dataset and state).
    pub fn command(&self) -> Command {
        let mut cmd = Command::new(bin_dir().join("containerd-crab-snapshotter"));
        cmd.arg("--address")
            .arg(&self.socket)
            .arg("--dataset")
            .arg(&self.dataset)
            .arg("--state-dir")
            .arg(&self.state)
            .env("CRAB_CONFIG", "/nonexistent")
            .stdin(Stdio::null());
        cmd
    }

    /// Its metadata database.
    pub fn metadata(&self) -> PathBuf {
        self.state.join("metadata.redb")
    }

    /// (Re)starts the process; `crash_at` arms a crash point.
    pub fn spawn(&mut self, crash_at: Option<&str>) {
        let _ = std::fs::remove_file(&self.socket);
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(self.state.with_file_name("snapshotter.log"))
            .expect("open snapshotter log");
        let mut cmd = self.command();
        cmd.stdout(Stdio::null()).stderr(log);
        if let Some(point) = crash_at {
            cmd.env("CRAB_SNAPSHOTTER_CRASH_AT", point);
        }
        self.child = Some(cmd.spawn().expect("start containerd-crab-snapshotter"));
        wait_until(20, || self.socket.exists().then_some(())).expect("snapshotter socket");
    }

    /// Waits (at most 20 s) for the process to die on its own (a crash
    /// point); returns whether it was killed by a signal.
    pub fn wait_crashed(&mut self) -> bool {
        let child = self.child.as_mut().expect("running");
        let status =
            wait_until(20, || child.try_wait().ok().flatten()).expect("the snapshotter did not crash");
        self.child = None;
        std::os::unix::process::ExitStatusExt::signal(&status).is_some()
    }

    /// Kills the process (SIGKILL), as a crash would, and reaps it.
    pub fn kill(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    /// Stops the process (SIGTERM) and waits for it.
    pub fn stop(&mut self) {
        if let Some(mut c) = self.child.take() {
            let pid = nix::unistd::Pid::from_raw(c.id() as i32);
            let _ = nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGTERM);
            let _ = c.wait();
        }
    }
}

impl Drop for Snapshotter {
    fn drop(&mut self) {
        self.stop();
    }
}
