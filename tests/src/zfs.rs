//! zfs-fuse for tests: the daemon (started if absent, left running for
//! the next test), a turn at it, and file-backed pools destroyed on drop.

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

use crate::{unique, wait_until};

/// zfs-fuse, the host's ZFS daemon, for tests, and this test's turn at
/// it: held until dropped, so drop it after the test's pools.
///
/// zfs-fuse wedges for good when two pools are made and used at once (two
/// `zfs create -p` on fresh pools were seen to hang a CI run for an hour),
/// so the tests of every binary, and the benchmark, take turns.
pub struct ZfsFuse {
    _turn: nix::fcntl::Flock<std::fs::File>,
}

impl ZfsFuse {
    /// Waits for this test's turn, then makes sure zfs-fuse runs: starts
    /// it when it does not.
    ///
    /// It is one daemon for the whole host, so a test never stops it; the
    /// turn is a host-wide lock, which also keeps two daemons from being
    /// started at once (that wedges both).
    pub fn start() -> Self {
        let lock = std::fs::File::create("/tmp/crab-tests-zfs-fuse.lock").expect("create lock file");
        let turn = nix::fcntl::Flock::lock(lock, nix::fcntl::FlockArg::LockExclusive)
            .map_err(|(_, e)| e)
            .expect("lock");
        let up = || {
            cmd("zpool")
                .arg("list")
                .output()
                .is_ok_and(|o| o.status.success())
        };
        if up() {
            return ZfsFuse { _turn: turn };
        }
        // Detached from the test: it outlives it, as a host daemon does.
        Command::new("setsid")
            .args(["-f", "zfs-fuse", "--no-daemon"])
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status()
            .expect("start zfs-fuse (run packaging/install-deps.sh)");
        wait_until(20, || up().then_some(())).expect("zfs-fuse did not come up");
        ZfsFuse { _turn: turn }
    }
}

/// The turn crab's own `zfs` and `zpool` commands take on zfs-fuse (see
/// `crab_snapshotter`'s `command` module).
const PRODUCT_TURN: &str = "/run/crab/zfs-fuse.lock";

/// `program` (`zfs` or `zpool`) as a test runs it: on zfs-fuse it waits
/// for and holds the turn crab's own commands take (a test's `zfs list`
/// must not run beside a snapshotter's `zfs destroy`), through `flock(1)`.
pub fn cmd(program: &str) -> Command {
    if Path::new("/dev/zfs").exists() {
        return Command::new(program);
    }
    use std::os::unix::fs::{DirBuilderExt, OpenOptionsExt};
    let _ = std::fs::DirBuilder::new()
        .recursive(true)
        .mode(0o700)
        .create("/run/crab");
    // Made as crab makes it (0600, no symlink followed) before flock(1)
    // would make it 0644.
    let _ = std::fs::OpenOptions::new()
        .write(true)
        .create(true)
        .mode(0o600)
        .custom_flags(nix::fcntl::OFlag::O_NOFOLLOW.bits())
        .open(PRODUCT_TURN);
    let mut cmd = Command::new("flock");
    cmd.args([PRODUCT_TURN, program]);
    cmd
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
            cmd("zpool")
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
        let out = cmd("zfs")
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
            cmd("zpool")
                .args(["destroy", "-f", &self.name])
                .status()
                .is_ok_and(|s| s.success())
                .then_some(())
        });
        let _ = std::fs::remove_dir_all(&self.dir);
        // The swap locks of its datasets (crab_snapshotter::ZfsBackend).
        let prefix = format!("{}@", self.name);
        for entry in std::fs::read_dir("/run/crab/zfs-swap")
            .into_iter()
            .flatten()
            .flatten()
        {
            if entry.file_name().to_string_lossy().starts_with(&prefix) {
                let _ = std::fs::remove_file(entry.path());
            }
        }
    }
}
