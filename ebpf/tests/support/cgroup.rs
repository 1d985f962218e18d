//! Test helper: plain unified cgroups with shells in them (each process in
//! a mount namespace of its own, like a sandbox's).

use std::io::Write;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};

use crab_inspector::unified_mount;

/// A unified cgroup of its own, removed on drop (after its processes die).
pub struct TestCgroup {
    pub dir: PathBuf,
}

impl TestCgroup {
    pub fn new() -> TestCgroup {
        let dir = unified_mount()
            .expect("cgroup2 mounted")
            .join(crab_tests::unique("crab-insp-"));
        std::fs::create_dir(&dir).expect("create cgroup");
        TestCgroup { dir }
    }

    /// Runs `sh -c script` inside the cgroup, in `cwd`, and waits for it.
    pub fn run(&self, cwd: &Path, script: &str) -> std::process::Output {
        let procs = self.dir.join("cgroup.procs");
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
        let procs = self.dir.join("cgroup.procs");
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

/// Joins the cgroup and a mount namespace of its own, like a sandbox's
/// process (the inspector ignores file records from the host's mount
/// namespace: they come from runtime helpers, not from the sandbox).
fn enter(procs: &Path) -> std::io::Result<()> {
    std::fs::write(procs, b"0")?;
    nix::sched::unshare(nix::sched::CloneFlags::CLONE_NEWNS)?;
    Ok(())
}

impl Drop for TestCgroup {
    fn drop(&mut self) {
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
