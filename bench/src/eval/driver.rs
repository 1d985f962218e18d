//! The agent of one task under one policy, outside its sandbox as
//! mini-swe-agent's docker environment is: each step's commands through
//! `ctr task exec`, then a chat completion through the sandbox's proxy
//! (crabd's host listener) that the scripted LLM answers after the step's
//! think time. It kills the sandbox's init once, where the task's
//! [`Fault`] says, recovers as its policy does, and captures the states
//! the verification compares.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::Receiver;
use std::time::{Duration, Instant, SystemTime};

use anyhow::{bail, Context};
use crab_tests::llm::chat_turn;
use crab_tests::sandbox::crabctl_direct;
use crab_tests::Containerd;

mod inside;

use super::agent_llm::{AgentLlm, Ask};
use super::fault::{Fault, Phase};
use super::policy::{Fresh, Policy, Recovery};
use super::sandbox;
use super::state::State;
use super::workload::Task;

/// What happened in one task's run.
#[derive(Debug, Default)]
pub struct Run {
    /// The task's time, state captures left out.
    pub time: Duration,
    /// The state after each step (-1: before the first), fault-free only.
    pub refs: BTreeMap<isize, State>,
    /// The state at the end.
    pub last: Option<State>,
    /// The recovery from the crash, if one was injected.
    pub recovered: Option<Recovered>,
    /// Why the run stopped early.
    pub error: Option<String>,
    /// Bytes the policy saved outside crabd (chat+fs's tars).
    pub saved_bytes: u64,
    /// Bytes of the process images its sandboxes' versions hold (crab's
    /// policies), as crabd lists them at the end.
    pub image_bytes: u64,
    /// The container ids the task used, in order (a fresh sandbox is a new one).
    pub ids: Vec<String>,
    /// What happened when, for the timeline.
    pub events: Vec<Event>,
    /// The class of each step's version (crab's policies), by step.
    pub classes: Vec<Option<String>>,
    /// The step each turn number the proxy gave a live answer belongs
    /// to (an agent outside; a retried request takes a number too).
    pub turns: BTreeMap<u64, usize>,
    /// Peak resident memory of the task's shims, KiB (the largest).
    pub shim_peak_kb: u64,
    /// Commands that exited non-zero (they run and fail as they would),
    /// and the first one's status and error.
    pub failed_commands: usize,
    /// See `failed_commands`.
    pub first_failure: Option<String>,
}

/// The recovery from one crash.
#[derive(Debug)]
pub struct Recovered {
    /// The step whose state the sandbox claims to be in after the
    /// recovery (-1: the image's).
    pub at: isize,
    /// Its state right then.
    pub state: State,
    /// From the kill to a sandbox that takes commands again.
    pub took: Duration,
    /// The version restored (crab's policies).
    pub version: Option<u64>,
    /// Steps whose commands ran again to catch up with the conversation.
    pub replayed: usize,
}

/// Something on a task's timeline, in seconds from its start.
#[derive(Debug, Clone)]
pub struct Event {
    /// What it was.
    pub kind: EventKind,
    /// When it began.
    pub start: f64,
    /// When it ended.
    pub end: f64,
}

/// The kinds of [`Event`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum EventKind {
    /// A step's commands ran.
    Command(usize),
    /// A step's LLM call (its turn end to its answer).
    Turn(usize),
    /// The kill and the recovery after it.
    Recovery,
}

/// One run's fixed inputs.
pub struct Setup<'a> {
    /// The policy's containerd (and crabd).
    pub ctd: &'a Containerd,
    /// The task's image reference.
    pub image: &'a str,
    /// The policy.
    pub policy: Policy,
    /// The crash, if any.
    pub fault: Option<Fault>,
    /// Where chat+fs keeps its tars.
    pub scratch: &'a Path,
    /// Called after each step.
    pub tick: &'a (dyn Fn() + Sync),
    /// Print every command's output.
    pub verbose: bool,
    /// `--agent-inside`: the agents' LLM (each sandbox runs its agent).
    pub agents: Option<&'a AgentLlm>,
    /// Where the sandboxes' transcripts are (`<id>.jsonl`).
    pub transcripts: &'a Path,
}

/// The longest a recovery may take before the run counts it failed.
const RECOVERY_LIMIT: Duration = Duration::from_secs(180);

/// How often the harness asks whether a recovery is done.
const RECOVERY_POLL: Duration = Duration::from_millis(100);

/// How long a crash during a command waits for the command to start in
/// the sandbox (then it comes anyway).
const COMMAND_START_SECS: u64 = 60;

/// Runs `task` as `setup` says. Errors only for the harness's own
/// failures; what went wrong in the sandbox is in [`Run::error`].
pub fn drive(setup: &Setup, task: &Task) -> anyhow::Result<Run> {
    let (mut agent, asks) = Agent::new(setup, task)?;
    let result = match asks {
        Some(asks) => agent.run_inside(&asks),
        None => agent.run(),
    };
    if let Some(llm) = setup.agents {
        llm.forget(&agent.key);
    }
    let Agent {
        mut run,
        started,
        captures,
        failed,
        ..
    } = agent;
    run.time = started.elapsed().saturating_sub(captures);
    (run.failed_commands, run.first_failure) = failed.into_inner().expect("failed commands");
    if let Err(e) = result {
        run.error = Some(format!("{e:#}"));
    }
    if setup.policy.checkpoints() {
        run.classes = classes(
            setup.ctd,
            run.ids.last().expect("a sandbox"),
            task.steps.len(),
            setup.agents.is_some(),
            &run.turns,
        );
    }
    if setup.policy.checkpoints() {
        run.image_bytes = run
            .ids
            .iter()
            .flat_map(|id| versions(setup.ctd, id).unwrap_or_default())
            .map(|v| image_bytes(&v))
            .sum();
    }
    run.shim_peak_kb = run
        .ids
        .iter()
        .filter_map(|id| shim_pid(id))
        .filter_map(peak_kb)
        .max()
        .unwrap_or(0);
    for id in &run.ids {
        sandbox::remove(setup.ctd, id);
    }
    Ok(run)
}

struct Agent<'a> {
    setup: &'a Setup<'a>,
    task: &'a Task,
    run: Run,
    id: String,
    url: String,
    started: Instant,
    /// Time spent capturing states (not the task's).
    captures: Duration,
    /// chat+fs: the step its tar holds, and the tar.
    saved: Option<(isize, PathBuf)>,
    /// Commands that failed, and the first one's error.
    failed: std::sync::Mutex<(usize, Option<String>)>,
    /// Its name to the agents' LLM (the same for every sandbox of the task).
    key: String,
}

impl<'a> Agent<'a> {
    /// The agent of `task`, its sandbox started; under `--agent-inside`,
    /// with the requests of the agent in the sandbox.
    fn new(setup: &'a Setup<'a>, task: &'a Task) -> anyhow::Result<(Self, Option<Receiver<Ask>>)> {
        let id = container_id(task, setup.policy, 0);
        let key = id.clone();
        // Before the sandbox starts: its agent asks at once.
        let asks = setup.agents.map(|llm| llm.register(&key));
        let url = start_sandbox(setup, task, &id, &key)?;
        // The task's time starts once its sandbox is up, as an agent's does.
        let started = Instant::now();
        let agent = Agent {
            setup,
            task,
            run: Run {
                ids: vec![id.clone()],
                ..Run::default()
            },
            id,
            url,
            started,
            captures: Duration::ZERO,
            saved: None,
            failed: Default::default(),
            key,
        };
        Ok((agent, asks))
    }

    fn now(&self) -> f64 {
        self.started.elapsed().as_secs_f64()
    }

    fn run(&mut self) -> anyhow::Result<()> {
        let policy = self.setup.policy;
        if policy == Policy::FaultFree {
            self.capture_ref(-1)?;
        }
        let fault = self.setup.fault.filter(|_| policy.crashes());
        let mut crashed = false;
        let mut step = 0;
        while step < self.task.steps.len() {
            let due = fault.filter(|f| !crashed && f.step == step);
            if let Some(f) = due.filter(|f| f.phase == Phase::Command) {
                let stop = AtomicBool::new(false);
                let mark = format!("{}.{step}", self.id);
                let seen = std::thread::scope(|s| {
                    let commands = s.spawn(|| self.commands_until(step, &stop, Some(&mark)));
                    // The crash comes `f.after` into a command that runs in
                    // the sandbox: on a loaded host `ctr task exec` can take
                    // longer than that to start it, and a command that
                    // only starts after the recovery is no crash's victim.
                    let _ = crab_tests::wait_until(COMMAND_START_SECS, || {
                        (commands.is_finished() || sandbox::marked_runs(&mark)).then_some(())
                    });
                    std::thread::sleep(f.after);
                    stop.store(true, Ordering::SeqCst);
                    let killed = sandbox::kill_init(self.setup.ctd, &self.id);
                    // Every command of the step ended well before the kill:
                    // the agent has seen the step (its effects die with the
                    // sandbox, to be run again); else it has not.
                    let seen = match commands.join() {
                        Ok(Ok(true)) => step as isize,
                        _ => f.agent_at(),
                    };
                    killed.map(|_| seen)
                })?;
                crashed = true;
                step = self.recover(seen)?;
                continue;
            }
            let begun = self.now();
            self.commands(step)?;
            self.event(EventKind::Command(step), begun);
            if policy == Policy::ChatFs {
                self.save_files(step as isize)?;
            }
            if let Some(f) = due {
                let begun = self.now();
                std::thread::scope(|s| {
                    let turn = s.spawn(|| chat_turn(&self.url, self.task.steps[step].think));
                    std::thread::sleep(f.after);
                    let killed = sandbox::kill_init(self.setup.ctd, &self.id);
                    // The answer may come or not: the agent has seen the step.
                    if let Ok(Ok(Some(n))) = turn.join() {
                        self.run.turns.insert(n, step);
                    }
                    killed
                })?;
                self.event(EventKind::Turn(step), begun);
                crashed = true;
                step = self.recover(f.agent_at())?;
                continue;
            }
            self.turn(step)?;
            if policy == Policy::FaultFree {
                self.capture_ref(step as isize)?;
            }
            (self.setup.tick)();
            step += 1;
        }
        let t = Instant::now();
        self.run.last = Some(State::capture(self.setup.ctd, &self.id, self.task)?);
        self.captures += t.elapsed();
        Ok(())
    }

    fn event(&mut self, kind: EventKind, start: f64) {
        let end = self.now();
        self.run.events.push(Event { kind, start, end });
    }

    /// Runs step `step`'s commands (their failures are the task's, and
    /// counted).
    fn commands(&self, step: usize) -> anyhow::Result<()> {
        self.commands_until(step, &AtomicBool::new(false), None).map(drop)
    }

    /// Step `step`'s commands, each marked `mark` (see
    /// [`sandbox::exec_marked`]), none started once `stop` is set; answers
    /// whether all ran and succeeded.
    fn commands_until(&self, step: usize, stop: &AtomicBool, mark: Option<&str>) -> anyhow::Result<bool> {
        let mut all = true;
        for command in &self.task.steps[step].commands {
            if stop.load(Ordering::SeqCst) {
                return Ok(false);
            }
            let out = sandbox::exec_marked(self.setup.ctd, &self.id, &self.task.cwd, command, None, mark)?;
            if self.setup.verbose {
                eprintln!(
                    "{} step {step}: {command:?} -> {}\n{}{}",
                    self.id,
                    out.status,
                    String::from_utf8_lossy(&out.stdout),
                    String::from_utf8_lossy(&out.stderr)
                );
            }
            if !out.status.success() {
                all = false;
                let mut failed = self.failed.lock().expect("failed commands");
                failed.0 += 1;
                failed.1.get_or_insert_with(|| {
                    let stderr = String::from_utf8_lossy(&out.stderr);
                    format!(
                        "step {step} ({}): {}",
                        out.status,
                        stderr.trim().chars().take(200).collect::<String>()
                    )
                });
            }
        }
        Ok(all)
    }

    /// Step `step`'s LLM call, through the sandbox's proxy.
    fn turn(&mut self, step: usize) -> anyhow::Result<()> {
        let begun = self.now();
        let think = self.task.steps[step].think;
        let numbered = match chat_turn(&self.url, think) {
            Ok(n) => n,
            Err(e) => {
                // One retry: a proxy that was busy restoring may have refused it.
                std::thread::sleep(Duration::from_secs(1));
                chat_turn(&self.url, think)
                    .with_context(|| format!("step {step}'s LLM call (first try: {e})"))?
            }
        };
        if let Some(n) = numbered {
            self.run.turns.insert(n, step);
        }
        self.event(EventKind::Turn(step), begun);
        Ok(())
    }

    fn capture_ref(&mut self, at: isize) -> anyhow::Result<()> {
        let t = Instant::now();
        let state = State::capture(self.setup.ctd, &self.id, self.task)?;
        if self.setup.verbose {
            eprintln!(
                "{} after step {at}: processes {:?}, probes {:?}",
                self.id, state.procs, state.probes
            );
        }
        self.run.refs.insert(at, state);
        self.captures += t.elapsed();
        Ok(())
    }

    /// chat+fs: a tar of the task's directories, as of step `at`.
    fn save_files(&mut self, at: isize) -> anyhow::Result<()> {
        let dirs: Vec<&str> = self.task.dirs.iter().map(|d| d.trim_start_matches('/')).collect();
        let out = sandbox::exec(
            self.setup.ctd,
            &self.id,
            "/",
            &format!("tar -C / -cf - {}", dirs.join(" ")),
            None,
        )?;
        if !out.status.success() {
            bail!(
                "saving files after step {at}: {}",
                String::from_utf8_lossy(&out.stderr).trim()
            );
        }
        let path = self.setup.scratch.join(format!("{}.tar", self.id));
        std::fs::write(&path, &out.stdout)?;
        self.run.saved_bytes += out.stdout.len() as u64;
        self.saved = Some((at, path));
        Ok(())
    }

    /// After the kill of `fault`: the policy's recovery, the state check
    /// of where it claims to be, the commands the conversation has seen
    /// run again; answers the next step to run.
    fn recover(&mut self, seen: isize) -> anyhow::Result<usize> {
        let killed = self.now();
        let killed_at = Instant::now();
        let killed_wall = SystemTime::now();
        let (at, version, running_since) = match self.setup.policy.recovery() {
            Recovery::Automatic { wrong } => self.recovered_by_crabd(wrong)?,
            Recovery::Fresh(fresh) => (self.fresh_sandbox(fresh, seen)?, None, None),
        };
        // crabd's own time of the restore where it told it: the harness's
        // polls are coarse (they would add their interval to the figure).
        let took = running_since
            .and_then(|t| t.duration_since(killed_wall).ok())
            .unwrap_or_else(|| killed_at.elapsed());
        let t = Instant::now();
        let state = State::capture(self.setup.ctd, &self.id, self.task)?;
        self.captures += t.elapsed();
        // The conversation has seen steps up to `seen`: those after the
        // restored state run again (their answers are in the transcript).
        let next = if self.setup.policy.recovery() == Recovery::Fresh(Fresh::FromScratch) {
            0
        } else {
            (seen + 1) as usize
        };
        let replay_from = (at + 1) as usize;
        for step in replay_from..next {
            let begun = self.now();
            self.commands(step)?;
            self.event(EventKind::Command(step), begun);
        }
        self.run.recovered = Some(Recovered {
            at,
            state,
            took,
            version,
            replayed: next.saturating_sub(replay_from),
        });
        self.event(EventKind::Recovery, killed);
        Ok(next)
    }

    /// Waits for crabd's automatic recovery; answers the step of the
    /// version it restored, the version, and when it ran again (crabd's
    /// word; None for a broken recovery, whose own rollback comes after).
    /// `wrong`: then restores that version's parent, claiming the same
    /// step (a broken recovery).
    ///
    /// It polls every [`RECOVERY_POLL`], the task's status every tenth
    /// time: each poll runs `crabctl` (and `ctr`), CPU that on a loaded
    /// host slows the neighbours of the policy being measured.
    fn recovered_by_crabd(
        &mut self,
        wrong: bool,
    ) -> anyhow::Result<(isize, Option<u64>, Option<SystemTime>)> {
        let ctd = self.setup.ctd;
        let deadline = Instant::now() + RECOVERY_LIMIT;
        let mut polls = 0u32;
        let recovery = loop {
            if let Some(info) = sandbox::listed(ctd, &self.id) {
                if info["recoveries"].as_u64().unwrap_or(0) > 0 && info["running"] == true {
                    break info["last_recovery"].clone();
                }
            }
            polls += 1;
            if polls.is_multiple_of(10) && ctd.task_status(&self.id).as_deref() == Some("STOPPED") {
                bail!("the sandbox was not recovered: its task exited");
            }
            if Instant::now() > deadline {
                bail!("no recovery in {RECOVERY_LIMIT:?}");
            }
            std::thread::sleep(RECOVERY_POLL);
        };
        let running_since = recovery["at_unix_ms"]
            .as_u64()
            .filter(|_| !wrong)
            .map(|ms| SystemTime::UNIX_EPOCH + Duration::from_millis(ms));
        let number = recovery["version"]
            .as_u64()
            .context("a recovery names its version")?;
        let versions = versions(ctd, &self.id)?;
        let record = versions
            .iter()
            .find(|v| v["version"] == number)
            .context("the restored version is listed")?;
        let inside = self.setup.agents.is_some();
        let at = step_of(record, inside)?;
        if wrong {
            let parent = record["parent"]
                .as_u64()
                .context("the restored version has a parent")?;
            // An agent inside goes on from what it remembers: only files
            // put back apart from it make a recovery wrong.
            let how = match inside {
                true => "--files-only",
                false => "--no-undo",
            };
            let out = crabctl_direct(ctd, &["rollback", how, &self.id, &parent.to_string()]);
            if !out.status.success() {
                bail!(
                    "rollback to {parent}: {}",
                    String::from_utf8_lossy(&out.stderr).trim()
                );
            }
        }
        Ok((at, Some(number), running_since))
    }

    /// Replaces the dead sandbox with a fresh one from the image (with the
    /// saved files for chat+fs); answers the step its state is claimed to
    /// be: the last seen (chat-only), the last saved (chat+fs), none (restart).
    fn fresh_sandbox(&mut self, fresh: Fresh, seen: isize) -> anyhow::Result<isize> {
        let ctd = self.setup.ctd;
        crab_tests::wait_until(60, || {
            (ctd.task_status(&self.id).as_deref() != Some("RUNNING")).then_some(())
        })
        .context("the killed sandbox's task never stopped")?;
        sandbox::remove(ctd, &self.id);
        let id = container_id(self.task, self.setup.policy, self.run.ids.len());
        self.url = start_sandbox(self.setup, self.task, &id, &self.key)?;
        self.run.ids.push(id.clone());
        self.id = id;
        Ok(match fresh {
            Fresh::Nothing => seen,
            Fresh::FromScratch => -1,
            Fresh::Files => match self.saved.clone() {
                None => -1,
                Some((at, tar)) => {
                    let dirs = self.task.dirs.join(" ");
                    let script = format!("find {dirs} -mindepth 1 -delete 2>/dev/null; tar -C / -xpf -");
                    let out = sandbox::exec(ctd, &self.id, "/", &script, Some(&tar))?;
                    if !out.status.success() {
                        bail!(
                            "putting the files back: {}",
                            String::from_utf8_lossy(&out.stderr).trim()
                        );
                    }
                    at
                }
            },
        })
    }
}

/// Starts sandbox `id` of `task` as `setup` says (with its agent inside,
/// named `key`, under `--agent-inside`); answers its proxy URL.
fn start_sandbox(setup: &Setup, task: &Task, id: &str, key: &str) -> anyhow::Result<String> {
    let agent = setup.agents.map(|llm| sandbox::InsideAgent {
        program: llm.program_dir(),
        key,
        cwd: &task.cwd,
    });
    sandbox::start(setup.ctd, id, setup.image, agent.as_ref())
}

/// The container id of `task` under `policy`, its `n`th sandbox.
fn container_id(task: &Task, policy: Policy, n: usize) -> String {
    // containerd's ids: words joined by single '.', '_' or '-'.
    let task = task.name.replace("__", "-");
    let policy = policy.name().replace('+', "-");
    match n {
        0 => format!("{task}.{policy}"),
        n => format!("{task}.{policy}.{n}"),
    }
}

/// `crabctl versions` of sandbox `id`.
pub fn versions(ctd: &Containerd, id: &str) -> anyhow::Result<Vec<serde_json::Value>> {
    let out = crabctl_direct(ctd, &["versions", id]);
    if !out.status.success() {
        bail!(
            "crabctl versions {id}: {}",
            String::from_utf8_lossy(&out.stderr).trim()
        );
    }
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).context("crabctl versions --json")?;
    Ok(v.as_array().cloned().unwrap_or_default())
}

/// The step whose end version `record` is: its turn counts the agent's
/// LLM calls from 1, one per step, before any restore; an agent inside
/// asks once more first, for its first step (`inside`).
fn step_of(record: &serde_json::Value, inside: bool) -> anyhow::Result<isize> {
    let turn = record["turn"]
        .as_i64()
        .context("the restored version has a turn")?;
    Ok(turn as isize - 1 - isize::from(inside))
}

/// The bytes of the process image version `record` holds (none when it
/// shares an earlier version's).
fn image_bytes(record: &serde_json::Value) -> u64 {
    record["images"]
        .as_array()
        .map_or(0, |files| files.iter().filter_map(|f| f["bytes"].as_u64()).sum())
}

/// The class of the version of each of `steps` steps of sandbox `id`:
/// by the step its turn's answer was for (`turns`), or else (an agent
/// inside, whose answers the driver does not see) by its turn's number.
fn classes(
    ctd: &Containerd,
    id: &str,
    steps: usize,
    inside: bool,
    turns: &BTreeMap<u64, usize>,
) -> Vec<Option<String>> {
    let mut out: Vec<Option<String>> = vec![None; steps];
    let versions = versions(ctd, id).unwrap_or_default();
    let by_number = |v: &serde_json::Value| step_of(v, inside).ok().and_then(|s| usize::try_from(s).ok());
    let by_answer = |v: &serde_json::Value| v["turn"].as_u64().and_then(|t| turns.get(&t).copied());
    // By the answers first; then, for a step none answered (its sandbox
    // was killed during the LLM's wait, or the agent is inside), by the
    // turn's number.
    for v in &versions {
        if let (Some(step), Some(class)) = (by_answer(v), v["class"].as_str()) {
            if let Some(slot) = out.get_mut(step) {
                *slot = Some(class.to_owned());
            }
        }
    }
    for v in &versions {
        if let (Some(step), Some(class)) = (by_number(v), v["class"].as_str()) {
            if let Some(slot) = out.get_mut(step).filter(|s| s.is_none()) {
                *slot = Some(class.to_owned());
            }
        }
    }
    out
}

/// The pid of the shim of container `id` (its command line names it).
fn shim_pid(id: &str) -> Option<i32> {
    let needle = format!("\0-id\0{id}\0");
    std::fs::read_dir("/proc").ok()?.flatten().find_map(|e| {
        let pid: i32 = e.file_name().to_str()?.parse().ok()?;
        let cmdline = std::fs::read(e.path().join("cmdline")).ok()?;
        let text = String::from_utf8_lossy(&cmdline);
        (text.contains("containerd-shim-crab-v2") && text.contains(&needle)).then_some(pid)
    })
}

/// The peak resident memory of process `pid`, KiB.
pub fn peak_kb(pid: i32) -> Option<u64> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    status.lines().find_map(|l| {
        l.strip_prefix("VmHWM:")?
            .trim()
            .trim_end_matches("kB")
            .trim()
            .parse()
            .ok()
    })
}
