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
//!
//! The cgroup is the one the init is in, as the kernel says
//! (`/proc/<pid>/cgroup`), which is also the one CRIU is told to freeze
//! ([`cgroup_of`]): never a path rebuilt from the spec, which the bundle's
//! owner writes. The shim's own cgroup and a hierarchy's root are refused.

use std::path::{Path, PathBuf};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

use crate::error::{Error, Result};

/// How long a freeze may take before it is given up (and thawed back).
const FREEZE_LIMIT: Duration = Duration::from_secs(5);

/// The first and the longest pause between two looks at a freeze.
const POLL_FIRST: Duration = Duration::from_micros(50);
const POLL_MAX: Duration = Duration::from_millis(2);

/// A container's freezer; its cgroup is learned when its init starts.
#[derive(Default)]
pub struct Freezer(OnceLock<Cgroup>);

/// Where the freezer of one cgroup is, and which kind it is.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Cgroup {
    /// cgroup v1's freezer hierarchy (also on v1-hybrid hosts, where
    /// libcontainer and CRIU use it): `freezer.state`.
    V1(PathBuf),
    /// cgroup v2: `cgroup.freeze`, and `cgroup.events` says when it holds.
    V2(PathBuf),
}

impl Freezer {
    /// Finds the cgroup of the init `pid`, just started (or restored) and
    /// so the container's, if it is not known yet. Best effort: a freeze
    /// looks again and says why it cannot.
    pub fn learn(&self, pid: i32) {
        if self.0.get().is_none() {
            if let Ok(c) = cgroup_of(pid) {
                let _ = self.0.set(c);
            }
        }
    }

    /// The processes in the learned cgroup and the cgroups below it (what
    /// the sandbox may have made), or `None` when none was learned.
    pub fn pids(&self) -> Option<std::io::Result<Vec<i32>>> {
        Some(procs_below(self.0.get()?.dir()))
    }

    /// Freezes (`frozen`) or thaws the cgroup of container `id`, whose
    /// init is `pid`, whatever state its processes are in. A freeze that
    /// does not hold within [`FREEZE_LIMIT`] is thawed back and reported.
    /// A thaw of a cgroup never learned has nothing crab froze: the pid of
    /// an init that is gone may be another process's.
    pub async fn set(&self, pid: i32, id: &str, frozen: bool) -> Result<()> {
        let op = if frozen { "freeze" } else { "thaw" };
        let failed = io_error(id, op);
        let cgroup = match self.0.get() {
            Some(c) => c.clone(),
            None if !frozen => return Ok(()),
            None => {
                let c = cgroup_of(pid).map_err(&failed)?;
                self.0.get_or_init(|| c).clone()
            }
        };
        tokio::task::spawn_blocking(move || match frozen {
            true => cgroup.freeze(),
            false => cgroup.thaw(),
        })
        .await
        .map_err(|e| failed(std::io::Error::other(e)))?
        .map_err(failed)
    }
}

/// The processes of cgroup `dir` and of every cgroup below it. A cgroup
/// removed meanwhile has none (libcgroups' `get_all_pids` fails then, and
/// a sandbox may remove its own cgroups while it is being killed).
pub fn procs_below(dir: &Path) -> std::io::Result<Vec<i32>> {
    let mut pids = Vec::new();
    add_procs_below(dir, &mut pids)?;
    Ok(pids)
}

fn add_procs_below(dir: &Path, pids: &mut Vec<i32>) -> std::io::Result<()> {
    let text = match std::fs::read_to_string(dir.join("cgroup.procs")) {
        Ok(t) => t,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(()),
        // A threaded cgroup lists no processes: its threads' processes are
        // in the domain above it, listed there.
        Err(e) if e.raw_os_error() == Some(libc::EOPNOTSUPP) => String::new(),
        Err(e) => return Err(e),
    };
    for line in text.lines() {
        pids.push(line.trim().parse().map_err(std::io::Error::other)?);
    }
    let entries = match std::fs::read_dir(dir) {
        Ok(e) => e,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(()),
        Err(e) => return Err(e),
    };
    for entry in entries {
        let entry = entry?;
        // cgroupfs holds files and cgroup directories only; never a link.
        if entry.file_type()?.is_dir() {
            add_procs_below(&entry.path(), pids)?;
        }
    }
    Ok(())
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

/// The freezer cgroup of process `pid`, as the kernel places it: the v1
/// freezer hierarchy when there is one, else the unified one. Refused:
/// the root of a hierarchy and the cgroup this process is in.
pub fn cgroup_of(pid: i32) -> std::io::Result<Cgroup> {
    let find = |pid: &str| -> std::io::Result<Cgroup> {
        let text = std::fs::read_to_string(format!("/proc/{pid}/cgroup"))?;
        parse(&text, mount_of)
    };
    let cgroup = find(&pid.to_string())?;
    let path = match &cgroup {
        Cgroup::V1(p) | Cgroup::V2(p) => p,
    };
    if path.parent().is_none() || cgroup == find("self")? || mount_of(&cgroup).as_deref() == Some(path) {
        return Err(std::io::Error::other(format!(
            "process {pid} is in the cgroup {} of the host or of the shim itself",
            path.display()
        )));
    }
    Ok(cgroup)
}

/// The mount point of the hierarchy `cgroup` names.
fn mount_of(cgroup: &Cgroup) -> Option<PathBuf> {
    match cgroup {
        Cgroup::V1(_) => {
            libcgroups::v1::util::get_subsystem_mount_point(&libcgroups::v1::ControllerType::Freezer).ok()
        }
        Cgroup::V2(_) => crate::cgroup::unified_mount(),
    }
}

/// The freezer cgroup in `/proc/<pid>/cgroup`'s `text`, below the mount
/// point `mount` gives for its kind.
fn parse(text: &str, mount: impl Fn(&Cgroup) -> Option<PathBuf>) -> std::io::Result<Cgroup> {
    let mut unified = None;
    for line in text.lines() {
        let mut parts = line.splitn(3, ':');
        let (_, controllers, path) = (parts.next(), parts.next(), parts.next());
        let (Some(controllers), Some(path)) = (controllers, path) else {
            continue;
        };
        let relative = path.trim_start_matches('/');
        if relative.split('/').any(|c| c == "..") {
            return Err(std::io::Error::other(format!("cgroup path {path:?}")));
        }
        if controllers.split(',').any(|c| c == "freezer") {
            let base = mount(&Cgroup::V1(PathBuf::new()))
                .ok_or_else(|| std::io::Error::other("no cgroup v1 freezer mount"))?;
            return Ok(Cgroup::V1(base.join(relative)));
        }
        if controllers.is_empty() {
            unified = Some(relative.to_owned());
        }
    }
    let relative = unified.ok_or_else(|| std::io::Error::other("the process is in no freezer cgroup"))?;
    let base = mount(&Cgroup::V2(PathBuf::new())).ok_or_else(|| std::io::Error::other("no cgroup2 mount"))?;
    Ok(Cgroup::V2(base.join(relative)))
}

impl Cgroup {
    /// Its directory.
    pub fn dir(&self) -> &Path {
        match self {
            Self::V1(d) | Self::V2(d) => d,
        }
    }

    /// Whether its processes are frozen now (by crab, CRIU, a user's pause
    /// or a parent cgroup); `false` when that cannot be read.
    pub fn is_frozen(&self) -> bool {
        match self {
            Self::V1(dir) => {
                std::fs::read_to_string(dir.join("freezer.state")).is_ok_and(|s| s.trim() == "FROZEN")
            }
            Self::V2(dir) => std::fs::read_to_string(dir.join("cgroup.events"))
                .is_ok_and(|e| e.lines().any(|l| l == "frozen 1")),
        }
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
                    // for a moment and frozen again, which lets a task that
                    // holds the freeze up (in vfork) move on.
                    if tries % 50 == 49 {
                        std::fs::write(dir.join("freezer.state"), "THAWED")?;
                        std::thread::sleep(Duration::from_millis(10));
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

    /// A shell counting into a file, in a cgroup of its own; thawed,
    /// killed, reaped and removed on drop, whatever the test did.
    struct Counter {
        child: std::process::Child,
        cgroup: Cgroup,
        file: PathBuf,
    }

    impl Counter {
        /// Starts one in a new cgroup of hierarchy `root` (needs root).
        fn start(root: &Path, kind: fn(PathBuf) -> Cgroup, name: &str) -> Self {
            let unique = format!("crab-freezer-{name}-{}", std::process::id());
            let dir = root.join(&unique);
            std::fs::create_dir(&dir).expect("make a cgroup (needs root)");
            let file = std::env::temp_dir().join(&unique);
            let child = std::process::Command::new("sh")
                .arg("-c")
                .arg(format!(
                    "i=0; while :; do i=$((i+1)); echo $i > {}; done",
                    file.display()
                ))
                .spawn()
                .expect("spawn sh");
            let counter = Counter {
                child,
                cgroup: kind(dir.clone()),
                file,
            };
            std::fs::write(dir.join("cgroup.procs"), counter.child.id().to_string())
                .expect("join the cgroup");
            counter
        }

        fn count(&self) -> String {
            std::fs::read_to_string(&self.file).unwrap_or_default()
        }
    }

    impl Drop for Counter {
        fn drop(&mut self) {
            let _ = self.cgroup.thaw();
            let _ = self.child.kill();
            let _ = self.child.wait();
            let _ = std::fs::remove_file(&self.file);
            let _ = std::fs::remove_dir(self.cgroup.dir());
        }
    }

    /// The counter stops while its cgroup is frozen and counts again once
    /// it is thawed.
    fn freezes_and_thaws(c: &Counter) {
        assert!(!c.cgroup.is_frozen(), "a running cgroup is not frozen");
        c.cgroup.freeze().expect("freeze");
        assert!(c.cgroup.is_frozen(), "a freeze holds once it returns");
        let before = c.count();
        std::thread::sleep(Duration::from_millis(100));
        assert_eq!(c.count(), before, "a frozen shell went on counting");
        c.cgroup.thaw().expect("thaw");
        let deadline = Instant::now() + Duration::from_secs(30);
        while c.count() == before {
            assert!(Instant::now() < deadline, "the thawed shell never counted again");
            std::thread::sleep(Duration::from_millis(10));
        }
    }

    #[test]
    fn v1_freezer_holds_a_cgroup_still() {
        let root = Path::new("/sys/fs/cgroup/freezer");
        assert!(root.is_dir(), "this host has the v1 freezer (ENVIRONMENT.md)");
        let c = Counter::start(root, Cgroup::V1, "v1");
        // Where the kernel placed it is what the shim finds (on a hybrid
        // host, the v1 freezer comes first).
        assert_eq!(
            cgroup_of(c.child.id() as i32).expect("the counter's cgroup"),
            c.cgroup
        );
        let freezer = Freezer::default();
        assert!(freezer.pids().is_none(), "nothing learned, nothing listed");
        freezer.learn(c.child.id() as i32);
        let pids = freezer.pids().expect("learned").expect("cgroup.procs");
        assert_eq!(pids, vec![c.child.id() as i32]);
        // One moved into a cgroup below is still the sandbox's.
        let below = c.cgroup.dir().join("below");
        std::fs::create_dir(&below).unwrap();
        std::fs::write(below.join("cgroup.procs"), c.child.id().to_string()).unwrap();
        let pids = freezer.pids().expect("learned").expect("cgroup.procs");
        std::fs::write(c.cgroup.dir().join("cgroup.procs"), c.child.id().to_string()).unwrap();
        std::fs::remove_dir(&below).unwrap();
        assert_eq!(pids, vec![c.child.id() as i32]);
        freezes_and_thaws(&c);
    }

    #[test]
    fn v2_freezer_holds_a_cgroup_still() {
        let root = crate::cgroup::unified_mount().expect("a cgroup2 mount (ENVIRONMENT.md)");
        freezes_and_thaws(&Counter::start(&root, Cgroup::V2, "v2"));
    }

    #[test]
    fn the_shims_own_cgroup_and_parent_paths_are_refused() {
        let own = cgroup_of(std::process::id() as i32).unwrap_err();
        assert!(own.to_string().contains("of the shim itself"), "{own}");
        let mount = |_: &Cgroup| Some(PathBuf::from("/sys/fs/cgroup/freezer"));
        assert!(parse("4:freezer:/a/../../x\n", mount).is_err());
        assert_eq!(
            parse("4:freezer:/ns/box\n0::/ns/box\n", mount).unwrap(),
            Cgroup::V1(PathBuf::from("/sys/fs/cgroup/freezer/ns/box"))
        );
    }
}
