//! State-verified recovery under a scripted agent loop: 21 crashes (SIGKILL
//! of the sandbox's init) at seeded points of agent runs (during a command,
//! during a turn's checkpoint, during the LLM's wait), three in each of
//! seven sandboxes. Each time the sandbox runs again from its head version
//! by itself, with that version's files, processes and memory; the agent
//! then redoes what the version lacks and ends where a run without crashes
//! ends. Real containerd, crabd and CRIU; needs root: CI runs it as root.

use std::collections::BTreeMap;
use std::time::Duration;

use crab_tests::leftovers::assert_clean;
use crab_tests::llm::{chat_turn, ScriptedLlm};
use crab_tests::sandbox::{
    crabctl_ok, exec_sh, listed, proxy_url, run_stateful, tree_digest, try_ask, wait_registered, COUNTER,
    STORE,
};
use crab_tests::{wait_until, Containerd};
use nix::sys::signal::{kill, Signal};
use nix::unistd::Pid;

const SANDBOXES: u64 = 7;
/// Three recoveries fit the crash loop's limit (a fourth within a minute
/// would be the task's end).
const CRASHES_EACH: usize = 3;
const STEPS: u64 = 6;
const THINK: Duration = Duration::from_millis(300);

/// Where in a step a crash hits.
#[derive(Debug, Clone, Copy)]
enum Phase {
    /// While the step's command runs.
    Command,
    /// Right after the turn end: its checkpoint is under way.
    Checkpoint,
    /// Halfway through the LLM's answer.
    LlmWait,
}

/// xorshift64*: seeded, the same crashes on every run.
struct Seeded(u64);

impl Seeded {
    fn next(&mut self, below: u64) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d) % below
    }
}

/// What the agent can observe of its sandbox: the store's value, the
/// names and contents of the files under /data. None while its servers do
/// not answer.
type Observed = (String, BTreeMap<String, String>);

fn observe(pid: i32) -> Option<Observed> {
    try_ask(pid, COUNTER, "peek").ok()?;
    let value = try_ask(pid, STORE, "get k").ok()?;
    Some((value, tree_digest(pid, "/data")))
}

/// Step `step`'s command: the store's value and a file.
fn command(ctd: &Containerd, id: &str, pid: i32, step: u64) -> Result<(), String> {
    run_command(ctd, id, pid, step, "")
}

/// Step `step`'s command, which stays a while after its file is written
/// (a crash then lands in it).
fn command_lingering(ctd: &Containerd, id: &str, pid: i32, step: u64) -> Result<(), String> {
    run_command(ctd, id, pid, step, "; sleep 2")
}

fn run_command(ctd: &Containerd, id: &str, pid: i32, step: u64, tail: &str) -> Result<(), String> {
    let answer = try_ask(pid, STORE, &format!("set k {step}")).map_err(|e| e.to_string())?;
    if answer != "ok" {
        return Err(answer);
    }
    let out = ctd.ctr(&[
        "task",
        "exec",
        "--exec-id",
        &crab_tests::unique("cmd"),
        id,
        "sh",
        "-c",
        &format!("echo {step} > /data/s{tail}"),
    ]);
    out.status
        .success()
        .then_some(())
        .ok_or_else(|| crab_tests::stderr(&out))
}

/// The turn of the version crabd's `n`-th recovery of `id` restored (0: a
/// version that ended no turn, the agent's start).
fn recovered_turn(ctd: &Containerd, id: &str, n: usize) -> u64 {
    let entry = wait_until(20, || listed(ctd, id).filter(|e| e["recoveries"] == n as u64))
        .unwrap_or_else(|| panic!("{id}: crabd never counted recovery {n}: {:?}", listed(ctd, id)));
    let version = entry["last_recovery"]["version"].as_u64().expect("a version");
    let versions = crabctl_ok(ctd, &["versions", id]);
    let record = versions
        .as_array()
        .unwrap()
        .iter()
        .find(|v| v["version"] == version)
        .unwrap_or_else(|| panic!("{id}: version {version} is listed: {versions}"));
    record["turn"].as_u64().unwrap_or(0)
}

/// One sandbox's agent: steps 1..=STEPS (a command, then a turn through
/// the proxy, which is a version), with `crashes` (step, phase, delay) on
/// the way. The agent runs outside the sandbox (as mini-swe-agent's docker
/// environment does), so a crash costs it nothing of the conversation:
/// after a recovery it runs again the commands of the steps the version
/// lacks, and asks the LLM only for steps it has not seen. Answers how
/// many recoveries it checked.
fn agent(ctd: &Containerd, id: &str, mut pid: i32, crashes: &[(u64, Phase, Duration)]) -> usize {
    let url = proxy_url(ctd, id);
    // What each turn's version holds; the start is a version of no turn.
    let mut states: BTreeMap<u64, Observed> = BTreeMap::new();
    states.insert(0, observe(pid).expect("the servers answer"));
    crabctl_ok(ctd, &["checkpoint", id]);
    let mut checked = 0;
    let mut step = 1;
    // The newest step whose LLM turn was sent.
    let mut seen = 0;
    while step <= STEPS {
        if step <= seen {
            // Its answer is in the agent's memory: only the command again.
            command(ctd, id, pid, step).unwrap_or_else(|e| panic!("{id} step {step} again: {e}"));
            step += 1;
            continue;
        }
        let due = crashes.get(checked).filter(|c| c.0 == step).copied();
        let Some((_, phase, delay)) = due else {
            command(ctd, id, pid, step).unwrap_or_else(|e| panic!("{id} step {step}: {e}"));
            states.insert(step, observe(pid).expect("the servers answer"));
            chat_turn(&url, THINK).unwrap_or_else(|e| panic!("{id} turn {step}: {e}"));
            seen = step;
            step += 1;
            continue;
        };
        std::thread::scope(|s| match phase {
            Phase::Command => {
                // The crash lands while the command runs in this sandbox:
                // once it wrote its file, before it ends. (Killed before it
                // started, its exec would wait out the recovery and run in
                // the recovered sandbox, a change after the version.)
                let work = s.spawn(|| command_lingering(ctd, id, pid, step));
                let file = format!("/proc/{pid}/root/data/s");
                let wrote = wait_until(30, || {
                    let now = std::fs::read_to_string(&file).ok()?;
                    (now.trim() == step.to_string()).then_some(())
                });
                assert!(
                    wrote.is_some(),
                    "{id}: step {step}'s command never wrote its file"
                );
                std::thread::sleep(delay);
                kill(Pid::from_raw(pid), Signal::SIGKILL).unwrap();
                let _ = work.join();
            }
            Phase::Checkpoint | Phase::LlmWait => {
                command(ctd, id, pid, step).unwrap_or_else(|e| panic!("{id} step {step}: {e}"));
                states.insert(step, observe(pid).expect("the servers answer"));
                let turn = s.spawn(|| chat_turn(&url, THINK));
                std::thread::sleep(delay);
                kill(Pid::from_raw(pid), Signal::SIGKILL).unwrap();
                // The answer may come or not: the agent saw the step.
                let _ = turn.join();
            }
        });
        if !matches!(phase, Phase::Command) {
            seen = step;
        }
        // crabd recovers it by itself: a new init, from the head version.
        let old = pid;
        pid = wait_until(60, || ctd.task_pid(id).filter(|&p| p != old))
            .unwrap_or_else(|| panic!("{id}: no recovery after a crash at step {step} ({phase:?})"));
        checked += 1;
        let turn = recovered_turn(ctd, id, checked);
        let state = wait_until(20, || observe(pid)).unwrap_or_else(|| panic!("{id}: its servers came back"));
        assert_eq!(
            Some(&state),
            states.get(&turn),
            "{id}: crashed at step {step} ({phase:?}), recovered to the version of turn {turn}"
        );
        // The agent redoes the steps the version lacks.
        step = turn + 1;
    }
    let end = observe(pid).expect("the servers answer");
    assert_eq!(
        Some(&end),
        states.get(&STEPS),
        "{id}: the end of a run without crashes"
    );
    assert_eq!(end.0, STEPS.to_string());
    checked
}

#[test]
fn twenty_one_crashes_each_recover_to_their_head_version() {
    let llm = ScriptedLlm::start();
    let config = std::env::temp_dir().join(crab_tests::unique("crab-crashes"));
    std::fs::write(
        &config,
        format!(
            "[shim.proxy]\nopenai_upstream = \"http://127.0.0.1:{}\"\n",
            llm.port
        ),
    )
    .unwrap();
    let ctd = Containerd::start_full("", &[("CRAB_CONFIG", &config.to_string_lossy())]);
    let mut seeded = Seeded(0x5eed_c4ab);
    let plans: Vec<Vec<(u64, Phase, Duration)>> = (0..SANDBOXES)
        .map(|_| {
            // Three steps of the run, in order, each crashed once.
            let mut steps: Vec<u64> = Vec::new();
            while steps.len() < CRASHES_EACH {
                let s = 1 + seeded.next(STEPS);
                if !steps.contains(&s) {
                    steps.push(s);
                }
            }
            steps.sort_unstable();
            steps
                .into_iter()
                .map(|s| {
                    let (phase, delay) = match seeded.next(3) {
                        0 => (Phase::Command, Duration::from_millis(seeded.next(30))),
                        1 => (Phase::Checkpoint, Duration::from_millis(5 + seeded.next(40))),
                        _ => (Phase::LlmWait, THINK / 2),
                    };
                    (s, phase, delay)
                })
                .collect()
        })
        .collect();
    let ids: Vec<String> = (1..=SANDBOXES).map(|i| format!("crashy{i}")).collect();
    let pids: Vec<i32> = ids
        .iter()
        .map(|id| {
            let pid = run_stateful(&ctd, id);
            wait_registered(&ctd, id);
            exec_sh(&ctd, id, "mkdir -p /data");
            pid
        })
        .collect();
    let checked: usize = std::thread::scope(|s| {
        let runs: Vec<_> = ids
            .iter()
            .zip(&pids)
            .zip(&plans)
            .map(|((id, pid), plan)| s.spawn(|| agent(&ctd, id, *pid, plan)))
            .collect();
        runs.into_iter().map(|r| r.join().expect("an agent's run")).sum()
    });
    assert_eq!(checked, SANDBOXES as usize * CRASHES_EACH);
    let ids: Vec<&str> = ids.iter().map(String::as_str).collect();
    for id in &ids {
        ctd.remove(id);
    }
    assert_clean(&ctd.scope(), &ids);
    let _ = std::fs::remove_file(&config);
}
