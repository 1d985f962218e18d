//! A container's freezer for a checkpoint's moment: its cgroup frozen and
//! thawed by its state file, found once.
//!
//! libcgroups' freezers (what libcontainer's pause uses) find the cgroup
//! by walking the host's mount table for every controller, and poll a
//! freeze in 10 ms sleeps: most freezes of a small sandbox complete in
//! well under a millisecond, and a sandbox is frozen, its agent waiting,
//! for as long as the poll sleeps. Here the poll backs off from 50 µs.
//! It also leaves libcontainer's recorded status alone: a capture is not
//! a user's pause, and a crash during one leaves nothing that says
//! "paused".

use std::path::{Path, PathBuf};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

use libcgroups::common::CgroupSetup;

use crate::error::{Error, Result};

/// How long a freeze may take before it is given up (and thawed back).
const FREEZE_LIMIT: Duration = Duration::from_secs(2);

/// The first and the longest pause between two looks at a freeze.
const POLL_FIRST: Duration = Duration::from_micros(50);
const POLL_MAX: Duration = Duration::from_millis(2);

/// A container's freezer; the cgroup is found at the first use.
#[derive(Default)]
pub struct Freezer(OnceLock<Cgroup>);

/// Where the freezer of one cgroup is, and which kind it is.
#[derive(Clone, Debug)]
enum Cgroup {
    /// cgroup v1's freezer hierarchy (also on v1-hybrid hosts, where
    /// libcontainer and CRIU use it): `freezer.state`.
    V1(PathBuf),
    /// cgroup v2: `cgroup.freeze`, and `cgroup.events` says when it holds.
    V2(PathBuf),
}

impl Freezer {
    /// Freezes (`frozen`) or thaws the cgroup at `cgroups_path` (the
    /// spec's, as libcontainer resolves it) of container `id`, whatever
    /// state its processes are in. A freeze that does not hold within
    /// [`FREEZE_LIMIT`] is thawed back and reported.
    pub async fn set(&self, cgroups_path: &Path, id: &str, frozen: bool) -> Result<()> {
        let cgroup = match self.0.get() {
            Some(c) => c.clone(),
            None => {
                let c = Cgroup::find(cgroups_path).map_err(io_error(id, "freezer lookup"))?;
                self.0.get_or_init(|| c).clone()
            }
        };
        let op = if frozen { "freeze" } else { "thaw" };
        let failed = io_error(id, op);
        tokio::task::spawn_blocking(move || match frozen {
            true => cgroup.freeze(),
            false => cgroup.thaw(),
        })
        .await
        .map_err(|e| failed(std::io::Error::other(e)))?
        .map_err(failed)
    }
}

/// A freezer error about container `id`.
fn io_error(id: &str, op: &'static str) -> impl Fn(std::io::Error) -> Error {
    let id = id.to_owned();
    move |source| Error::Cgroup {
        op,
        id: id.clone(),
        source: Box::new(source),
    }
}

impl Cgroup {
    /// The freezer of the cgroup at `cgroups_path` on this host.
    fn find(cgroups_path: &Path) -> std::io::Result<Self> {
        let relative = crate::cgroup::relative(cgroups_path);
        let setup = libcgroups::common::get_cgroup_setup().map_err(std::io::Error::other)?;
        Ok(match setup {
            CgroupSetup::Unified => {
                let mount = crate::cgroup::unified_mount()
                    .ok_or_else(|| std::io::Error::other("no cgroup2 mount"))?;
                Self::V2(mount.join(relative))
            }
            CgroupSetup::Legacy | CgroupSetup::Hybrid => {
                let mount =
                    libcgroups::v1::util::get_subsystem_mount_point(&libcgroups::v1::ControllerType::Freezer)
                        .map_err(std::io::Error::other)?;
                Self::V1(mount.join(relative))
            }
        })
    }

    fn freeze(&self) -> std::io::Result<()> {
        let deadline = Instant::now() + FREEZE_LIMIT;
        let mut pause = POLL_FIRST;
        let mut tries = 0u32;
        loop {
            let held = match self {
                Self::V1(dir) => {
                    // As runc: the write is repeated (tasks forked meanwhile
                    // are frozen too), and now and then the cgroup is thawed
                    // and frozen again, which unsticks a freeze that a task
                    // in vfork would otherwise hold up.
                    if tries % 50 == 49 {
                        std::fs::write(dir.join("freezer.state"), "THAWED")?;
                    }
                    std::fs::write(dir.join("freezer.state"), "FROZEN")?;
                    let state = std::fs::read_to_string(dir.join("freezer.state"))?;
                    match state.trim() {
                        "FROZEN" => true,
                        "FREEZING" => false,
                        other => return Err(std::io::Error::other(format!("freezer state {other:?}"))),
                    }
                }
                Self::V2(dir) => {
                    if tries == 0 {
                        std::fs::write(dir.join("cgroup.freeze"), "1")?;
                    }
                    let events = std::fs::read_to_string(dir.join("cgroup.events"))?;
                    events.lines().any(|l| l == "frozen 1")
                }
            };
            if held {
                return Ok(());
            }
            if Instant::now() >= deadline {
                let _ = self.thaw();
                return Err(std::io::Error::new(
                    std::io::ErrorKind::TimedOut,
                    format!("the cgroup did not freeze within {FREEZE_LIMIT:?}"),
                ));
            }
            std::thread::sleep(pause);
            pause = (pause * 2).min(POLL_MAX);
            tries += 1;
        }
    }

    fn thaw(&self) -> std::io::Result<()> {
        match self {
            Self::V1(dir) => std::fs::write(dir.join("freezer.state"), "THAWED"),
            Self::V2(dir) => std::fs::write(dir.join("cgroup.freeze"), "0"),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A shell counting into a file, in a new cgroup of `root`, stops
    /// counting while frozen and counts again once thawed. Needs root.
    fn freezes_and_thaws(root: &Path, make: fn(PathBuf) -> Cgroup) {
        let dir = root.join(format!("crab-freezer-test-{}", std::process::id()));
        std::fs::create_dir(&dir).expect("make a cgroup (needs root)");
        let file = std::env::temp_dir().join(format!("crab-freezer-count-{}", std::process::id()));
        let mut child = std::process::Command::new("sh")
            .arg("-c")
            .arg(format!(
                "i=0; while :; do i=$((i+1)); echo $i > {}; done",
                file.display()
            ))
            .spawn()
            .expect("spawn sh");
        std::fs::write(dir.join("cgroup.procs"), child.id().to_string()).expect("join the cgroup");
        let count = || std::fs::read_to_string(&file).unwrap_or_default();
        let cgroup = make(dir.clone());
        cgroup.freeze().expect("freeze");
        let before = count();
        std::thread::sleep(Duration::from_millis(100));
        assert_eq!(count(), before, "a frozen shell went on counting");
        cgroup.thaw().expect("thaw");
        let deadline = Instant::now() + Duration::from_secs(30);
        while count() == before {
            assert!(Instant::now() < deadline, "the thawed shell never counted again");
            std::thread::sleep(Duration::from_millis(10));
        }
        child.kill().expect("kill sh");
        child.wait().expect("reap sh");
        let _ = std::fs::remove_file(&file);
        std::fs::remove_dir(&dir).expect("remove the cgroup");
    }

    #[test]
    fn v1_freezer_holds_a_cgroup_still() {
        let root = Path::new("/sys/fs/cgroup/freezer");
        assert!(root.is_dir(), "this host has the v1 freezer (ENVIRONMENT.md)");
        freezes_and_thaws(root, Cgroup::V1);
    }

    #[test]
    fn v2_freezer_holds_a_cgroup_still() {
        let root = crate::cgroup::unified_mount().expect("a cgroup2 mount (ENVIRONMENT.md)");
        freezes_and_thaws(&root, Cgroup::V2);
    }
}
