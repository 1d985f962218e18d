//! Test helper: plain unified cgroups with shells in them (each process in
//! a mount namespace of its own, like a sandbox's).

use std::io::Write;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};

use crab_inspector::unified_mount;

/// A unified cgroup of its own, removed on drop (after its processes die),
/// and optionally a v1 freezer cgroup beside it (the shim's freezer on
/// this host: ENVIRONMENT.md).
pub struct TestCgroup {
    pub dir: PathBuf,
    freezer: Option<PathBuf>,
}

impl TestCgroup {
    pub fn new() -> TestCgroup {
        let dir = unified_mount()
            .expect("cgroup2 mounted")
            .join(crab_tests::unique("crab-insp-"));
        std::fs::create_dir(&dir).expect("create cgroup");
        TestCgroup { dir, freezer: None }
    }

    /// A cgroup whose processes also join a v1 freezer cgroup of their own.
    pub fn with_freezer() -> TestCgroup {
        let mut cg = TestCgroup::new();
        let freezer = Path::new("/sys/fs/cgroup/freezer").join(crab_tests::unique("crab-insp-"));
        std::fs::create_dir(&freezer).expect("create freezer cgroup (v1 freezer: ENVIRONMENT.md)");
        cg.freezer = Some(freezer);
        cg
    }

    /// Freezes (`true`) or thaws the freezer cgroup, and waits until it is.
    pub fn set_frozen(&self, frozen: bool) {
        let freezer = self.freezer.as_ref().expect("a cgroup with a freezer");
        let want = if frozen { "FROZEN" } else { "THAWED" };
        std::fs::write(freezer.join("freezer.state"), want).expect("write freezer.state");
        crab_tests::wait_until(10, || {
            let now = std::fs::read_to_string(freezer.join("freezer.state")).ok()?;
            (now.trim() == want).then_some(())
        })
        .unwrap_or_else(|| panic!("the freezer cgroup did not become {want}"));
    }

    fn procs(&self) -> Vec<PathBuf> {
        std::iter::once(self.dir.join("cgroup.procs"))
            .chain(self.freezer.iter().map(|f| f.join("cgroup.procs")))
            .collect()
    }

    /// Runs `sh -c script` inside the cgroup, in `cwd`, and waits for it.
    pub fn run(&self, cwd: &Path, script: &str) -> std::process::Output {
        let procs = self.procs();
        let mut cmd = Command::new("/bin/sh");
        cmd.arg("-c").arg(script).current_dir(cwd);
        // SAFETY: the closure only makes system calls (open, write, close,
        // unshare) on data prepared before the fork; it allocates nothing.
        unsafe {
            cmd.pre_exec(move || enter(&procs));
        }
        cmd.output().expect("run sh")
    }

    /// Starts a long-lived `sh` reading commands from stdin, in the cgroup.
    pub fn shell(&self, cwd: &Path) -> Shell {
        let procs = self.procs();
        let mut cmd = Command::new("/bin/sh");
        cmd.current_dir(cwd)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::null());
        // SAFETY: as in `run`.
        unsafe {
            cmd.pre_exec(move || enter(&procs));
        }
        Shell {
            child: cmd.spawn().expect("spawn sh"),
        }
    }
}

/// Joins the cgroups and a mount namespace of its own, like a sandbox's
/// process (the inspector ignores file records from the host's mount
/// namespace: they come from runtime helpers, not from the sandbox).
fn enter(procs: &[PathBuf]) -> std::io::Result<()> {
    for p in procs {
        std::fs::write(p, b"0")?;
    }
    nix::sched::unshare(nix::sched::CloneFlags::CLONE_NEWNS)?;
    Ok(())
}

impl Drop for TestCgroup {
    fn drop(&mut self) {
        if let Some(freezer) = &self.freezer {
            // A frozen task dies only when thawed.
            let _ = std::fs::write(freezer.join("freezer.state"), "THAWED");
        }
        for pid in std::fs::read_to_string(self.dir.join("cgroup.procs"))
            .unwrap_or_default()
            .lines()
        {
            if let Ok(pid) = pid.trim().parse::<i32>() {
                let _ = nix::sys::signal::kill(
                    nix::unistd::Pid::from_raw(pid),
                    nix::sys::signal::Signal::SIGKILL,
                );
            }
        }
        crab_tests::wait_until(10, || std::fs::remove_dir(&self.dir).ok());
        if let Some(freezer) = &self.freezer {
            crab_tests::wait_until(10, || std::fs::remove_dir(freezer).ok());
        }
    }
}

/// A persistent shell: each `run` sends a command and waits for its marker.
pub struct Shell {
    child: Child,
}

impl Shell {
    pub fn run(&mut self, command: &str) {
        use std::io::BufRead;
        let stdin = self.child.stdin.as_mut().expect("stdin");
        writeln!(stdin, "{command}\necho __done__").expect("write to shell");
        stdin.flush().expect("flush");
        let stdout = self.child.stdout.as_mut().expect("stdout");
        let mut reader = std::io::BufReader::new(stdout);
        let mut line = String::new();
        loop {
            line.clear();
            if reader.read_line(&mut line).expect("read shell") == 0 {
                panic!("shell exited");
            }
            if line.trim() == "__done__" {
                return;
            }
        }
    }

    pub fn pid(&self) -> u32 {
        self.child.id()
    }
}

impl Drop for Shell {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}
