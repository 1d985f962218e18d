//! One task's sandbox as the agent's harness sees it: a crab container on
//! the development image (the host's /usr bound read-only), its commands
//! run as mini-swe-agent's docker environment runs them (`bash -lc` in the
//! task's directory, through `ctr task exec`), and its init to kill.

use std::io::Read;
use std::path::Path;
use std::process::{Output, Stdio};
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use crab_tests::{Containerd, CRAB};

/// The environment every command gets: the testbed's Python first
/// (`python` is the host's python3), and the testbed importable as the
/// SWE-bench images install it.
const ENV: [&str; 3] = [
    "PATH=/opt/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
    "PYTHONPATH=/testbed:/opt/deps",
    "HOME=/root",
];

/// The longest a command runs (the traces' agent allowed 60 s).
pub const COMMAND_LIMIT: Duration = Duration::from_secs(60);

/// The agent a sandbox runs as its own process (`--agent-inside`).
pub struct InsideAgent<'a> {
    /// The host directory of `agent.py`, bound read-only.
    pub program: &'a Path,
    /// Its name to the LLM.
    pub key: &'a str,
    /// Where its commands run.
    pub cwd: &'a str,
}

/// Where a sandbox sees the agent's program.
const AGENT_DIR: &str = "/opt/crab-agent";

/// Starts container `id` of image `reference`, idling (or running `agent`),
/// and waits until crabd knows it; returns its proxy URL on crabd's host
/// listener.
pub fn start(
    ctd: &Containerd,
    id: &str,
    reference: &str,
    agent: Option<&InsideAgent>,
) -> anyhow::Result<String> {
    let mut args: Vec<String> = [
        "run",
        "-d",
        "--runtime",
        CRAB,
        "--mount",
        "type=bind,src=/usr,dst=/usr,options=rbind:ro",
    ]
    .map(str::to_owned)
    .to_vec();
    let command: Vec<String> = match agent {
        None => vec!["sleep".into(), "100000000".into()],
        Some(agent) => {
            args.push("--mount".into());
            args.push(format!(
                "type=bind,src={},dst={AGENT_DIR},options=rbind:ro",
                agent.program.display()
            ));
            let limit = COMMAND_LIMIT.as_secs();
            for var in ENV.map(str::to_owned).into_iter().chain([
                format!("CRAB_AGENT_KEY={}", agent.key),
                format!("CRAB_AGENT_CWD={}", agent.cwd),
                format!("CRAB_AGENT_LIMIT={limit}"),
            ]) {
                args.extend(["--env".to_owned(), var]);
            }
            // Isolated: the testbed's modules on PYTHONPATH never shadow
            // the agent's (its commands keep the environment).
            vec!["python3".into(), "-I".into(), format!("{AGENT_DIR}/agent.py")]
        }
    };
    args.extend([reference.to_owned(), id.to_owned()]);
    args.extend(command);
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let out = ctd.ctr(&args);
    if !out.status.success() {
        bail!("ctr run {id}: {}", String::from_utf8_lossy(&out.stderr).trim());
    }
    // Registered (a shim on a loaded host may take a while).
    let info = crab_tests::wait_until(120, || listed(ctd, id))
        .with_context(|| format!("crabd never listed {id}"))?;
    match info["proxy_url"].as_str() {
        Some(url) => Ok(url.to_owned()),
        None => bail!("{id} has no proxy URL (is crabd's host listener on?)"),
    }
}

/// `crabctl ps`'s entry for sandbox `id`, if it lists one. Asked of
/// crabd directly: the tests' relay that holds each answer to the API's
/// schema would be the harness's CPU beside the sandboxes at every poll.
pub fn listed(ctd: &Containerd, id: &str) -> Option<serde_json::Value> {
    crab_tests::sandbox::listed_by(crab_tests::sandbox::crabctl_direct, ctd, id)
}

/// Removes container `id` (whatever state its task is in).
pub fn remove(ctd: &Containerd, id: &str) {
    ctd.remove(id);
}

/// Runs `script` with `bash -lc` in `cwd` of sandbox `id` (stdin from
/// `stdin`, or none), at most [`COMMAND_LIMIT`]; answers its output.
pub fn exec(
    ctd: &Containerd,
    id: &str,
    cwd: &str,
    script: &str,
    stdin: Option<&Path>,
) -> anyhow::Result<Output> {
    exec_marked(ctd, id, cwd, script, stdin, None)
}

/// The variable whose value [`exec_marked`] gives a command's processes.
const MARK: &str = "CRAB_EVAL_MARK";

/// [`exec`], its processes marked with `mark` in their environment (see
/// [`marked_runs`]).
pub fn exec_marked(
    ctd: &Containerd,
    id: &str,
    cwd: &str,
    script: &str,
    stdin: Option<&Path>,
    mark: Option<&str>,
) -> anyhow::Result<Output> {
    static N: AtomicU64 = AtomicU64::new(0);
    let exec_id = format!("e{}", N.fetch_add(1, Ordering::Relaxed));
    let limit = COMMAND_LIMIT.as_secs().to_string();
    let mark = mark.map(|m| format!("{MARK}={m}"));
    // (ctr 1.6's exec takes no environment: env(1) sets it.)
    let mut args = vec!["task", "exec", "--exec-id", &exec_id, "--cwd", cwd, id, "env"];
    args.extend(ENV);
    args.extend(mark.as_deref());
    args.extend(["timeout", "-s", "KILL", &limit, "bash", "-lc", script]);
    let mut cmd = ctd.ctr_cmd(&args);
    match stdin {
        Some(path) => {
            cmd.stdin(std::fs::File::open(path).with_context(|| format!("open {}", path.display()))?)
        }
        None => cmd.stdin(Stdio::null()),
    };
    let mut child = cmd
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .context("run ctr")?;
    let mut stdout = child.stdout.take().expect("piped");
    let mut stderr = child.stderr.take().expect("piped");
    let out = std::thread::spawn(move || {
        let mut buf = Vec::new();
        let _ = stdout.read_to_end(&mut buf);
        buf
    });
    let err = std::thread::spawn(move || {
        let mut buf = Vec::new();
        let _ = stderr.read_to_end(&mut buf);
        buf
    });
    // ctr itself is bounded too: a wedged exec must not wedge the run.
    let deadline = Instant::now() + COMMAND_LIMIT + Duration::from_secs(30);
    let status = loop {
        if let Some(status) = child.try_wait()? {
            break status;
        }
        if Instant::now() > deadline {
            let _ = child.kill();
            bail!(
                "ctr task exec in {id} did not end in {:?}",
                COMMAND_LIMIT + Duration::from_secs(30)
            );
        }
        std::thread::sleep(Duration::from_millis(5));
    };
    Ok(Output {
        status,
        stdout: out.join().unwrap_or_default(),
        stderr: err.join().unwrap_or_default(),
    })
}

/// SIGKILL to sandbox `id`'s init, from the host: the crash.
pub fn kill_init(ctd: &Containerd, id: &str) -> anyhow::Result<i32> {
    let init = Init::of(ctd, id)?;
    init.kill()?;
    Ok(init.pid)
}

/// A sandbox's init, known by its host pid and start time (a pid reused
/// meanwhile is another process, never signalled).
pub struct Init {
    pid: i32,
    start: u64,
}

impl Init {
    /// Sandbox `id`'s init now.
    pub fn of(ctd: &Containerd, id: &str) -> anyhow::Result<Init> {
        let pid = ctd.task_pid(id).with_context(|| format!("{id} has no task"))?;
        let start = start_time(pid).with_context(|| format!("{id}'s init {pid} is gone"))?;
        Ok(Init { pid, start })
    }

    /// SIGKILL to it, if it is still the one found: the crash.
    pub fn kill(&self) -> anyhow::Result<()> {
        anyhow::ensure!(
            start_time(self.pid) == Some(self.start),
            "the init {} is gone already",
            self.pid
        );
        nix::sys::signal::kill(
            nix::unistd::Pid::from_raw(self.pid),
            nix::sys::signal::Signal::SIGKILL,
        )
        .with_context(|| format!("kill {}", self.pid))
    }

    /// Waits (10 s at most) until it has exited. An init exits only after
    /// every other process of its pid namespace has: nothing of the
    /// sandbox runs then.
    pub fn wait_gone(&self) {
        let gone = || {
            let stat = std::fs::read_to_string(format!("/proc/{}/stat", self.pid)).unwrap_or_default();
            let state = stat
                .rsplit_once(')')
                .and_then(|(_, rest)| rest.split_whitespace().next());
            state.is_none_or(|s| s == "Z" || s == "X") || start_time(self.pid) != Some(self.start)
        };
        let _ = crab_tests::wait_until(10, || gone().then_some(()));
    }
}

/// The start time (clock ticks after boot) of process `pid`.
fn start_time(pid: i32) -> Option<u64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // Field 22; the fields after the command's closing parenthesis start at 3.
    stat.rsplit_once(')')?.1.split_whitespace().nth(19)?.parse().ok()
}

/// Whether a process marked `mark` by [`exec_marked`] runs on this host
/// (a command of the sandbox has started, not only been asked for).
pub fn marked_runs(mark: &str) -> bool {
    let want = format!("{MARK}={mark}");
    crate::eval::state::process_dirs("/proc")
        .filter_map(|dir| std::fs::read(dir.join("environ")).ok())
        .any(|env| env.split(|b| *b == 0).any(|var| var == want.as_bytes()))
}
