//! A sandbox's processes kept aside, frozen, while a restore replaces
//! them: the undo of a rollback that costs no dump.
//!
//! They move from the sandbox's freezer cgroup into a frozen child of it
//! ([`ASIDE`]), and the sandbox's cgroup, empty, is thawed for the restored
//! tree. If the restore fails they move back (and run on, the very same
//! processes); once it has succeeded they are killed. A child cgroup
//! stays frozen when its parent thaws (v1: it froze itself; v2: its own
//! `cgroup.freeze`), and it keeps them under the sandbox's limits.
//!
//! Only processes of the sandbox's cgroup itself are taken: one in a
//! cgroup below it would not go back where it was, so the caller falls
//! back to a dump then.

use std::io;
use std::path::Path;
use std::time::{Duration, Instant};

use super::Cgroup;

/// The child cgroup, of a sandbox's freezer cgroup, that holds its
/// processes aside.
pub const ASIDE: &str = "crab-aside";

/// How long killed processes aside may take to leave their cgroup.
const KILL_LIMIT: Duration = Duration::from_secs(10);

/// Processes moved aside, frozen, out of their freezer cgroup.
#[derive(Debug)]
pub struct Aside {
    parent: Cgroup,
    held: Cgroup,
    pids: Vec<i32>,
}

impl Cgroup {
    /// The cgroup `name` below this one, of the same kind.
    fn child(&self, name: &str) -> Cgroup {
        match self {
            Self::V1(d) => Self::V1(d.join(name)),
            Self::V2(d) => Self::V2(d.join(name)),
        }
    }
}

// === impl Aside ===

impl Aside {
    /// Moves every process of `parent`, which the caller froze, into a
    /// frozen child cgroup, then thaws `parent`, empty now.
    ///
    /// # Errors
    /// `Unsupported` when a cgroup below `parent` holds processes (they
    /// would not go back where they were, and what an earlier kill left
    /// aside is among them); I/O errors of cgroupfs. Either way `parent`
    /// is as it was: its processes in it, frozen.
    pub fn take(parent: &Cgroup) -> io::Result<Aside> {
        for entry in std::fs::read_dir(parent.dir())? {
            let entry = entry?;
            if entry.file_type()?.is_dir() && !super::procs_below(&entry.path())?.is_empty() {
                return Err(io::Error::new(
                    io::ErrorKind::Unsupported,
                    format!("processes in the cgroup below {}", entry.path().display()),
                ));
            }
        }
        let held = parent.child(ASIDE);
        std::fs::create_dir(held.dir())?;
        let mut aside = Aside {
            parent: parent.clone(),
            held,
            pids: Vec::new(),
        };
        match aside.fill() {
            Ok(()) => Ok(aside),
            Err(e) => {
                // Back where they were, still frozen with their parent.
                let _ = aside.move_back();
                let _ = std::fs::remove_dir(aside.held.dir());
                Err(e)
            }
        }
    }

    fn fill(&mut self) -> io::Result<()> {
        // Empty, it is frozen at once.
        match &self.held {
            Cgroup::V1(d) => std::fs::write(d.join("freezer.state"), "FROZEN")?,
            Cgroup::V2(d) => std::fs::write(d.join("cgroup.freeze"), "1")?,
        }
        for pid in own_procs(self.parent.dir())? {
            match std::fs::write(self.held.dir().join("cgroup.procs"), pid.to_string()) {
                Ok(()) => self.pids.push(pid),
                // Gone meanwhile (a zombie reaped).
                Err(e) if e.raw_os_error() == Some(libc::ESRCH) => {}
                Err(e) => return Err(e),
            }
        }
        // Frozen, nothing forks: the parent is empty unless a move failed
        // unseen.
        if !own_procs(self.parent.dir())?.is_empty() {
            return Err(io::Error::other("processes stayed in the sandbox's cgroup"));
        }
        self.parent.thaw()?;
        if !self.held.is_frozen() {
            return Err(io::Error::other("the processes aside did not stay frozen"));
        }
        Ok(())
    }

    /// The processes held (as they were moved).
    pub fn pids(&self) -> &[i32] {
        &self.pids
    }

    /// The cgroup that holds them.
    pub fn dir(&self) -> &Path {
        self.held.dir()
    }

    /// Puts them back into the sandbox's cgroup, where they run again
    /// (the caller has emptied it of anything else first).
    ///
    /// # Errors
    /// When one could not be moved back (then they stay aside, frozen:
    /// the caller reports the sandbox lost, and its delete kills them).
    pub fn put_back(self) -> io::Result<()> {
        self.move_back()?;
        let _ = self.held.thaw();
        std::fs::remove_dir(self.held.dir())
    }

    fn move_back(&self) -> io::Result<()> {
        for pid in own_procs(self.held.dir())? {
            match std::fs::write(self.parent.dir().join("cgroup.procs"), pid.to_string()) {
                Ok(()) => {}
                Err(e) if e.raw_os_error() == Some(libc::ESRCH) => {}
                Err(e) => return Err(e),
            }
        }
        Ok(())
    }

    /// Kills them and removes their cgroup.
    ///
    /// # Errors
    /// When they do not leave it within [`KILL_LIMIT`], or cgroupfs fails.
    pub fn kill(self) -> io::Result<()> {
        kill_held(&self.held)
    }
}

/// Kills what a crashed shim left aside below `parent` and removes the
/// child cgroup; nothing there is no error. `parent` is thawed too (a
/// shim killed during its freeze left it frozen, and the child with it):
/// this is for a sandbox being deleted.
pub fn release(parent: &Cgroup) -> io::Result<()> {
    let held = parent.child(ASIDE);
    match held.dir().try_exists() {
        Ok(false) => Ok(()),
        Ok(true) => {
            tracing::warn!(
                "{}: killing processes a crashed shim left aside",
                held.dir().display()
            );
            for pid in super::procs_below(held.dir())? {
                let _ = nix::sys::signal::kill(nix::unistd::Pid::from_raw(pid), nix::sys::signal::SIGKILL);
            }
            parent.thaw()?;
            kill_held(&held)
        }
        Err(e) => Err(e),
    }
}

/// SIGKILLs every process of `held`, thaws it (a frozen v1 task dies
/// only once it runs), waits until it is empty and removes it.
fn kill_held(held: &Cgroup) -> io::Result<()> {
    let deadline = Instant::now() + KILL_LIMIT;
    let mut pause = Duration::from_micros(500);
    loop {
        let pids = super::procs_below(held.dir())?;
        if pids.is_empty() {
            break;
        }
        for pid in pids {
            let _ = nix::sys::signal::kill(nix::unistd::Pid::from_raw(pid), nix::sys::signal::SIGKILL);
        }
        held.thaw()?;
        if Instant::now() > deadline {
            return Err(io::Error::new(
                io::ErrorKind::TimedOut,
                format!("processes aside in {} would not die", held.dir().display()),
            ));
        }
        std::thread::sleep(pause);
        pause = (pause * 2).min(Duration::from_millis(5));
    }
    match std::fs::remove_dir(held.dir()) {
        Err(e) if e.kind() != io::ErrorKind::NotFound => Err(e),
        _ => Ok(()),
    }
}

/// The processes of cgroup `dir` itself (not of those below it).
fn own_procs(dir: &Path) -> io::Result<Vec<i32>> {
    std::fs::read_to_string(dir.join("cgroup.procs"))?
        .lines()
        .map(|l| l.trim().parse().map_err(io::Error::other))
        .collect()
}
