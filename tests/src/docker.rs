//! A private dockerd on a private containerd, configured with the repo's
//! `packaging/docker/daemon.json`.
//!
//! dockerd owns host-wide things (the `docker0` bridge, iptables chains), so
//! docker tests take a host-wide lock and run one at a time.

use std::fs::File;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};

use nix::fcntl::{Flock, FlockArg};

use crate::image::busybox_archive;
use crate::leftovers::Scope;
use crate::{ok, path_with_crab, unique, wait_until, Containerd};

/// The busybox image as docker names it.
pub const DOCKER_BUSYBOX: &str = "crab/busybox:test";

/// A running dockerd, stopped and cleaned up on drop.
pub struct Dockerd {
    /// The containerd it uses.
    pub containerd: Containerd,
    dir: PathBuf,
    child: Option<Child>,
    _lock: Flock<File>,
}

impl Dockerd {
    /// Starts containerd and dockerd, and loads the busybox image.
    pub fn start() -> Self {
        Self::start_with(&[])
    }

    /// Like [`Dockerd::start`], with `env` in its containerd's environment
    /// (which the shims inherit), e.g. a `CRAB_CONFIG`.
    pub fn start_with(env: &[(&str, &str)]) -> Self {
        let daemon_json = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../packaging/docker/daemon.json");
        Self::start_configured(env, &daemon_json)
    }

    /// Like [`Dockerd::start_with`], with dockerd reading `daemon_json`
    /// (e.g. the host's, as a package registered the runtime in it).
    pub fn start_configured(env: &[(&str, &str)], daemon_json: &Path) -> Self {
        let lock = File::create("/tmp/crab-tests-dockerd.lock").expect("create lock file");
        let lock = Flock::lock(lock, FlockArg::LockExclusive)
            .map_err(|(_, e)| e)
            .expect("lock");
        let containerd = Containerd::start_full("", env);
        let dir = PathBuf::from(format!("/tmp/{}", unique("crabdk")));
        std::fs::create_dir_all(&dir).expect("create dockerd dir");
        let log = File::create(dir.join("dockerd.log")).expect("create dockerd log");
        let child = Command::new("dockerd")
            .arg("--containerd")
            .arg(containerd.address())
            .arg("--data-root")
            .arg(dir.join("data"))
            .arg("--exec-root")
            .arg(dir.join("exec"))
            .arg("--pidfile")
            .arg(dir.join("dockerd.pid"))
            .arg("-H")
            .arg(format!("unix://{}/d.sock", dir.display()))
            .arg("--config-file")
            .arg(daemon_json)
            .env("PATH", path_with_crab())
            .stdin(Stdio::null())
            .stdout(log.try_clone().expect("dup log"))
            .stderr(log)
            .spawn()
            .expect("start dockerd (run packaging/install-deps.sh)");
        let d = Dockerd {
            containerd,
            dir,
            child: Some(child),
            _lock: lock,
        };
        wait_until(30, || d.docker(&["version"]).status.success().then_some(()))
            .unwrap_or_else(|| panic!("dockerd did not come up; see {}/dockerd.log", d.dir.display()));
        d.docker_ok(&["load", "-i", &busybox_archive().to_string_lossy()]);
        d
    }

    /// Its API address, as `DOCKER_HOST` takes it.
    pub fn host(&self) -> String {
        format!("unix://{}/d.sock", self.dir.display())
    }

    /// A `docker` command against this daemon.
    pub fn docker_cmd(&self, args: &[&str]) -> Command {
        let mut cmd = Command::new("docker");
        cmd.arg("-H").arg(self.host()).args(args);
        cmd
    }

    /// Runs `docker args…` and returns its output.
    pub fn docker(&self, args: &[&str]) -> Output {
        self.docker_cmd(args)
            .stdin(Stdio::null())
            .output()
            .expect("run docker")
    }

    /// Runs `docker args…`, asserts success, returns stdout.
    #[track_caller]
    pub fn docker_ok(&self, args: &[&str]) -> String {
        ok(self.docker(args))
    }

    /// Where docker's containers leave traces (namespace `moby`, cgroups
    /// under `/docker`).
    pub fn scope(&self) -> Scope {
        self.containerd.scope_of("moby", "docker")
    }
}

impl Drop for Dockerd {
    fn drop(&mut self) {
        let ids = self.docker(&["ps", "-aq"]);
        for id in String::from_utf8_lossy(&ids.stdout).lines() {
            let _ = self.docker(&["rm", "-f", id.trim()]);
        }
        let _ = self.docker(&["network", "prune", "-f"]);
        if let Some(mut child) = self.child.take() {
            let pid = nix::unistd::Pid::from_raw(child.id() as i32);
            let _ = nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGTERM);
            let _ = child.wait();
        }
        // dockerd leaves its overlay and netns mounts when stopped hard.
        let mounts = std::fs::read_to_string("/proc/self/mountinfo").unwrap_or_default();
        let mut points: Vec<&str> = mounts
            .lines()
            .filter_map(|l| l.split(' ').nth(4))
            .filter(|p| p.starts_with(&*self.dir.to_string_lossy()))
            .collect();
        points.sort_by_key(|p| std::cmp::Reverse(p.len()));
        for p in points {
            let _ = nix::mount::umount2(p, nix::mount::MntFlags::MNT_DETACH);
        }
        if !std::thread::panicking() {
            let _ = std::fs::remove_dir_all(&self.dir);
        }
    }
}
