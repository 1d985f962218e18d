//! Test helpers: a private inspector (its own pin directory, unloaded at the
//! end) and plain unified cgroups with shells in them.

use std::io::Write;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use crab_inspector::{unified_mount, Inspector, InspectorConfig};

/// A private inspector, its pins under `/sys/fs/bpf/crab-test-<unique>`,
/// unloaded (pins removed) on drop, also when the test fails.
pub struct TestInspector {
    inspector: Option<Inspector>,
    pin_dir: PathBuf,
}

impl std::ops::Deref for TestInspector {
    type Target = Inspector;
    fn deref(&self) -> &Inspector {
        self.inspector.as_ref().expect("present until drop")
    }
}

impl Drop for TestInspector {
    fn drop(&mut self) {
        if let Some(i) = self.inspector.take() {
            let _ = i.unload();
        }
        let _ = std::fs::remove_dir_all(&self.pin_dir);
    }
}

/// Loads a private inspector.
pub fn inspector(noisy: &[&str], ring_bytes: u32, background: bool) -> TestInspector {
    let pin_dir = PathBuf::from(format!("/sys/fs/bpf/{}", crab_tests::unique("crab-test-")));
    let config = InspectorConfig {
        pin_dir: pin_dir.clone(),
        ring_bytes,
        noisy_comms: noisy.iter().map(|s| s.to_string()).collect(),
        drain_timeout: Duration::from_millis(200),
        max_reasons: 64,
        background_drain: background,
    };
    TestInspector {
        inspector: Some(Inspector::load(config).expect("load the inspector (needs root)")),
        pin_dir,
    }
}

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
        // SAFETY: the closure only calls async-signal-safe functions (open,
        // write, close via std::fs on a pre-computed path) between fork and exec.
        unsafe {
            cmd.pre_exec(move || {
                std::fs::write(&procs, b"0")?;
                Ok(())
            });
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
            cmd.pre_exec(move || {
                std::fs::write(&procs, b"0")?;
                Ok(())
            });
        }
        Shell {
            child: cmd.spawn().expect("spawn sh"),
        }
    }
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
