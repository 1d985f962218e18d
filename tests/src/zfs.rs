//! zfs-fuse for tests: the daemon (started if absent, stopped if the test
//! started it) and file-backed pools destroyed on drop.

use std::path::PathBuf;
use std::process::{Child, Command, Stdio};

use crate::{unique, wait_until};

/// zfs-fuse, running while this lives.
pub struct ZfsFuse {
    child: Option<Child>,
}

impl ZfsFuse {
    /// Starts zfs-fuse unless it already runs.
    pub fn start() -> Self {
        let up = || {
            Command::new("zpool")
                .arg("list")
                .output()
                .is_ok_and(|o| o.status.success())
        };
        if up() {
            return ZfsFuse { child: None };
        }
        let child = Command::new("zfs-fuse")
            .arg("--no-daemon")
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("start zfs-fuse (run packaging/install-deps.sh)");
        wait_until(10, || up().then_some(())).expect("zfs-fuse did not come up");
        ZfsFuse { child: Some(child) }
    }
}

impl Drop for ZfsFuse {
    fn drop(&mut self) {
        if let Some(mut c) = self.child.take() {
            let pid = nix::unistd::Pid::from_raw(c.id() as i32);
            let _ = nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGTERM);
            let _ = c.wait();
        }
    }
}

/// A pool on a sparse file, mounted under a private directory.
pub struct Pool {
    /// The pool's name.
    pub name: String,
    /// Its directory (image file and mount point).
    pub dir: PathBuf,
}

impl Pool {
    /// Creates a pool of `size` (e.g. `"512M"`).
    pub fn create(size: &str) -> Self {
        let name = unique("crabp");
        let dir = PathBuf::from(format!("/tmp/{name}"));
        std::fs::create_dir_all(&dir).expect("create pool dir");
        let img = dir.join("pool.img");
        crate::ok(
            Command::new("truncate")
                .args(["-s", size])
                .arg(&img)
                .output()
                .expect("truncate"),
        );
        crate::ok(
            Command::new("zpool")
                .args(["create", "-m"])
                .arg(dir.join("mnt"))
                .arg(&name)
                .arg(&img)
                .output()
                .expect("zpool create"),
        );
        Pool { name, dir }
    }

    /// Where the pool's root dataset is mounted.
    pub fn mountpoint(&self) -> PathBuf {
        self.dir.join("mnt")
    }

    /// `zfs list -H -o name -r DATASET` as lines.
    pub fn datasets(&self, under: &str) -> Vec<String> {
        let out = Command::new("zfs")
            .args(["list", "-H", "-o", "name", "-t", "filesystem", "-r", under])
            .output()
            .expect("zfs list");
        String::from_utf8_lossy(&out.stdout)
            .lines()
            .map(str::to_owned)
            .collect()
    }
}

impl Drop for Pool {
    fn drop(&mut self) {
        // zfs-fuse reports a pool busy for a moment after its last unmount.
        wait_until(10, || {
            Command::new("zpool")
                .args(["destroy", "-f", &self.name])
                .status()
                .is_ok_and(|s| s.success())
                .then_some(())
        });
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}
