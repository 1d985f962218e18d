//! `crab-bench density`: many sandboxes on one host, each driven by a
//! scripted agent that replays a real mini-swe-agent run
//! (`../shared/traces/mini-swe-agent.jsonl`): per step, the traced kind's
//! command runs in the sandbox through `ctr task exec` (as the agent's
//! `docker exec` did), then the agent asks its LLM through the sandbox's
//! proxy (`crabctl proxy-url`), which answers after the step's traced time,
//! scaled. Every turn end is a version, as the defaults make it.
//!
//! Side by side, from the same run: Crab (the inspector's classes, the
//! host's queue with its defaults), the same loop with every checkpoint
//! started at once (no slots, no byte budget), one `full` per turn (no
//! inspector, no queue: checkpointing the whole sandbox each turn), and no
//! checkpoint at all (the baseline of the end-to-end ratio).
//!
//! Per configuration: the exposed hold (the time an answer waited for its
//! version) per turn and as a share of each task's time, the bytes crabd
//! keeps (process images and file copies), the frozen time per
//! checkpoint, and the mean task time against no checkpointing.

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use crab_tests::llm::{chat_turn, ScriptedLlm};
use crab_tests::sandbox::wait_registered;
use crab_tests::{Containerd, CRAB};

use crate::stats::{percentile, percentile_f64};

/// One step of a traced run: what kind of command, and how long the LLM
/// took (scaled).
#[derive(Debug, Clone)]
struct Step {
    kind: String,
    think: Duration,
}

/// A configuration of the loop.
#[derive(Debug, Clone, Copy, PartialEq)]
enum Mode {
    Crab,
    AllAtOnce,
    FullEveryTurn,
    NoCheckpoint,
}

/// What one configuration measured.
#[derive(Debug, Default)]
struct Outcome {
    /// Each answer's hold.
    holds: Vec<Duration>,
    /// Each task's exposed hold over its time.
    shares: Vec<f64>,
    /// Each task's time.
    task_times: Vec<Duration>,
    /// Bytes under crabd's root at the end.
    kept_bytes: u64,
    /// Frozen seconds per checkpoint (mean), and checkpoints.
    frozen_mean: f64,
    n_checkpoints: f64,
    /// Seconds a capture waited for its slot, and took after (means).
    wait_mean: f64,
    capture_mean: f64,
    /// Versions by class: none, fs, proc, full.
    classes: [f64; 4],
}

// === impl Mode ===

impl Mode {
    fn name(self) -> &'static str {
        match self {
            Mode::Crab => "crab (inspector, host queue)",
            Mode::AllAtOnce => "inspector, all at once",
            Mode::FullEveryTurn => "full every turn",
            Mode::NoCheckpoint => "no checkpoint",
        }
    }

    /// The `crab.toml` of this mode.
    fn config(self, llm: &ScriptedLlm, transcripts: &Path) -> String {
        let proxy = format!(
            "[shim.proxy]\ntranscript_dir = \"{}\"\nopenai_upstream = \"http://127.0.0.1:{}\"\n\
             hold_timeout = 120\n",
            transcripts.display(),
            llm.port
        );
        let rest = match self {
            Mode::Crab => "[crabd]\ninspector = true\n",
            Mode::AllAtOnce => {
                "[crabd]\ninspector = true\n[crabd.schedule]\nslots = 1024\nbytes_per_sec = -1\n"
            }
            Mode::FullEveryTurn => {
                "[crabd]\ninspector = false\n[crabd.schedule]\nslots = 1024\nbytes_per_sec = -1\n"
            }
            Mode::NoCheckpoint => "checkpoint_on_turn = false\n",
        };
        format!("{proxy}{rest}")
    }
}

/// Runs the benchmark for each count of sandboxes and prints its table.
pub fn run(counts: &[usize], turns: usize, scale: f64, traces: &Path) -> anyhow::Result<()> {
    let max = counts.iter().copied().max().unwrap_or(0);
    let tasks = load(traces, max, turns, scale)?;
    let llm = ScriptedLlm::start();
    for &n in counts {
        let mut rows = Vec::new();
        for mode in [
            Mode::NoCheckpoint,
            Mode::Crab,
            Mode::AllAtOnce,
            Mode::FullEveryTurn,
        ] {
            let outcome =
                measure(mode, &tasks[..n], &llm).with_context(|| format!("{} with {n}", mode.name()))?;
            rows.push((mode, outcome));
        }
        print(n, turns, scale, &mut rows);
    }
    Ok(())
}

/// The first `turns` steps of the first `n` traced runs with at least that
/// many steps, think times scaled by `scale` (at most 10 s).
fn load(traces: &Path, n: usize, turns: usize, scale: f64) -> anyhow::Result<Vec<Vec<Step>>> {
    let text = std::fs::read_to_string(traces).with_context(|| format!("read {}", traces.display()))?;
    let mut runs: Vec<(String, Vec<Step>)> = Vec::new();
    for line in text.lines() {
        let v: serde_json::Value = serde_json::from_str(line).context("a trace line")?;
        let task = v["task"].as_str().unwrap_or_default().to_owned();
        let secs = v["llm_latency_s"]
            .as_f64()
            .or_else(|| v["step_wall_s"].as_f64())
            .unwrap_or(1.0);
        let step = Step {
            kind: v["kind"].as_str().unwrap_or("read").to_owned(),
            think: Duration::from_secs_f64((secs * scale).clamp(0.05, 10.0)),
        };
        match runs.last_mut() {
            Some((t, steps)) if *t == task => steps.push(step),
            _ => runs.push((task, vec![step])),
        }
    }
    let picked: Vec<Vec<Step>> = runs
        .into_iter()
        .filter(|(_, s)| s.len() >= turns)
        .take(n)
        .map(|(_, s)| s.into_iter().take(turns).collect())
        .collect();
    if picked.len() < n {
        bail!("only {} traced runs have {turns} steps", picked.len());
    }
    Ok(picked)
}

/// The busybox command of step `i` of kind `kind`.
fn command(kind: &str, i: usize) -> String {
    match kind {
        "edit" => format!("echo 'line {i}' >> /work/file{}.py", i % 7),
        "run" | "test" => format!(
            "i=0; while [ $i -lt 3000 ]; do i=$((i+1)); done; echo $i > /work/out{}.txt",
            i % 3
        ),
        "install" => {
            format!("mkdir -p /work/pkg{i} && for f in a b c d e f g h; do echo $f > /work/pkg{i}/$f; done")
        }
        // A process left running by the exec (crab-init adopts it): the
        // next turn's version holds it.
        "background" => format!("sleep {} </dev/null >/dev/null 2>&1 &", 30 + i),
        // read, submit, no_command: they change nothing.
        _ => "cat /etc/passwd >/dev/null; ls -R /bin >/dev/null".to_owned(),
    }
}

fn measure(mode: Mode, tasks: &[Vec<Step>], llm: &ScriptedLlm) -> anyhow::Result<Outcome> {
    let base = std::env::temp_dir().join(crab_tests::unique("crab-density"));
    let transcripts = base.join("transcripts");
    std::fs::create_dir_all(&base)?;
    let config = base.join("crab.toml");
    std::fs::write(&config, mode.config(llm, &transcripts))?;
    let ctd = Containerd::start_full("", &[("CRAB_CONFIG", &config.to_string_lossy())]);
    let ids: Vec<String> = (0..tasks.len()).map(|i| format!("d{i}")).collect();
    let mut urls = Vec::new();
    for id in &ids {
        ctd.run_detached(CRAB, id, &["sh", "-c", "mkdir -p /work; exec sleep 36000"]);
        wait_registered(&ctd, id);
        urls.push(crab_tests::sandbox::proxy_url(&ctd, id));
    }
    let task_times: Vec<Duration> = std::thread::scope(|s| {
        let handles: Vec<_> = ids
            .iter()
            .zip(&urls)
            .zip(tasks)
            .map(|((id, url), steps)| {
                let ctd = &ctd;
                s.spawn(move || agent(ctd, id, url, steps))
            })
            .collect();
        handles
            .into_iter()
            .map(|h| h.join().expect("an agent thread"))
            .collect()
    });
    let mut outcome = Outcome {
        task_times: task_times.clone(),
        ..Outcome::default()
    };
    for (id, time) in ids.iter().zip(&task_times) {
        let path = transcripts.join(&ctd.namespace).join(format!("{id}.jsonl"));
        let holds = crate::observe::holds(&path);
        let total: Duration = holds.iter().sum();
        outcome.shares.push(total.as_secs_f64() / time.as_secs_f64());
        outcome.holds.extend(holds);
    }
    if mode != Mode::NoCheckpoint {
        let series = crate::observe::metrics(&ctd);
        let value = |name: &str| -> f64 { series.iter().find(|(k, _)| k == name).map_or(0.0, |(_, v)| *v) };
        let n = value("crab_frozen_seconds_count");
        outcome.n_checkpoints = n;
        let mean_of = |name: &str| {
            let count = value(&format!("{name}_count"));
            if count > 0.0 {
                value(&format!("{name}_sum")) / count
            } else {
                0.0
            }
        };
        outcome.frozen_mean = mean_of("crab_frozen_seconds");
        outcome.wait_mean = mean_of("crab_queue_wait_seconds");
        outcome.capture_mean = mean_of("crab_checkpoint_seconds");
        for (i, class) in ["none", "fs", "proc", "full"].iter().enumerate() {
            outcome.classes[i] = value(&format!("crab_versions_total{{class=\"{class}\"}}"));
        }
        outcome.kept_bytes = du(&ctd.crabd_root());
        if let Some(line) = std::fs::read_to_string(ctd.crabd_root().join("crabd.log"))
            .unwrap_or_default()
            .lines()
            .find(|l| l.contains("checkpoint queue"))
        {
            eprintln!("{}: {line}", mode.name());
        }
    }
    for id in &ids {
        ctd.remove(id);
    }
    drop(ctd);
    let _ = std::fs::remove_dir_all(&base);
    Ok(outcome)
}

/// One agent: each step's command, then its turn; answers the task's time.
fn agent(ctd: &Containerd, id: &str, url: &str, steps: &[Step]) -> Duration {
    let started = Instant::now();
    for (i, step) in steps.iter().enumerate() {
        let out = ctd.ctr(&[
            "task",
            "exec",
            "--exec-id",
            &format!("s{i}"),
            id,
            "sh",
            "-c",
            &command(&step.kind, i),
        ]);
        if !out.status.success() {
            eprintln!("{id} step {i}: {}", String::from_utf8_lossy(&out.stderr));
        }
        if let Err(e) = chat_turn(url, step.think) {
            eprintln!("{id} step {i}: turn: {e}");
        }
    }
    started.elapsed()
}

/// Bytes under `dir`, each inode once (hard-linked file copies share).
fn du(dir: &PathBuf) -> u64 {
    let out = std::process::Command::new("du").arg("-sb").arg(dir).output();
    out.ok()
        .and_then(|o| {
            String::from_utf8_lossy(&o.stdout)
                .split_whitespace()
                .next()?
                .parse()
                .ok()
        })
        .unwrap_or(0)
}

fn print(n: usize, turns: usize, scale: f64, rows: &mut [(Mode, Outcome)]) {
    let baseline = rows
        .iter()
        .find(|(m, _)| *m == Mode::NoCheckpoint)
        .map(|(_, o)| mean(&o.task_times))
        .unwrap_or(f64::NAN);
    println!("\ndensity: {n} sandboxes, {turns} traced turns each (think times x{scale}), wall clock");
    println!(
        "{:<30} {:>9} {:>9} {:>9} {:>10} {:>10} {:>10} {:>9} {:>9} {:>9} {:>9} {:>8} {:>17}",
        "configuration",
        "hold p50",
        "hold p95",
        "hold p99",
        "share p50",
        "share p95",
        "share p99",
        "kept MB",
        "frozen",
        "wait",
        "capture",
        "e2e",
        "none/fs/proc/full"
    );
    for (mode, o) in rows.iter_mut() {
        let share = |p: f64, v: &mut Vec<f64>| format!("{:.3}%", percentile_f64(v, p) * 100.0);
        println!(
            "{:<30} {:>9} {:>9} {:>9} {:>10} {:>10} {:>10} {:>9.1} {:>9} {:>9} {:>9} {:>7.3}x {:>17}",
            mode.name(),
            crate::stats::ms(percentile(&mut o.holds, 50.0)),
            crate::stats::ms(percentile(&mut o.holds, 95.0)),
            crate::stats::ms(percentile(&mut o.holds, 99.0)),
            share(50.0, &mut o.shares),
            share(95.0, &mut o.shares),
            share(99.0, &mut o.shares),
            o.kept_bytes as f64 / 1e6,
            format!("{:.1}ms", o.frozen_mean * 1e3),
            format!("{:.1}ms", o.wait_mean * 1e3),
            format!("{:.1}ms", o.capture_mean * 1e3),
            mean(&o.task_times) / baseline,
            format!(
                "{}/{}/{}/{}",
                o.classes[0], o.classes[1], o.classes[2], o.classes[3]
            ),
        );
    }
    println!(
        "(hold: ms an answer waited for its version; share: a task's held time over its time; frozen, wait \
         (for a slot) and capture: means per checkpoint; targets: share p95 <= 0.2%, e2e <= 1.01x)"
    );
}

fn mean(v: &[Duration]) -> f64 {
    if v.is_empty() {
        return f64::NAN;
    }
    v.iter().map(Duration::as_secs_f64).sum::<f64>() / v.len() as f64
}
