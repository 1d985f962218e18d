//! `crab-bench eval`: real agent trajectories and terminal tasks replayed
//! against every recovery policy, one crash per task at a seeded point,
//! each recovery state-verified against the fault-free run; a markdown
//! report, its JSON, and pictures.
//!
//! Per policy one containerd and crabd (its `crab.toml`), every task's
//! sandbox on it, `--parallel` at once; the fault-free run goes first and
//! records the state after every step, which the others are held to.

mod agent_llm;
mod density;
mod driver;
mod fault;
mod plot;
mod policy;
mod report;
mod sandbox;
mod state;
mod testbed;
pub(crate) mod workload;

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Mutex;
use std::time::Instant;

use anyhow::Context;
use crab_tests::llm::ScriptedLlm;
use crab_tests::Containerd;
use indicatif::{MultiProgress, ProgressBar, ProgressStyle};

use driver::{drive, peak_kb, Setup};
use fault::Fault;
pub use policy::Policy;
use report::{Meta, PolicyResult, TaskResult};
use workload::Task;

/// What to evaluate (`crab-bench eval`'s options).
#[derive(Debug, Clone, clap::Args)]
pub struct Args {
    /// A small run of a few minutes: 1 SWE task and 2 terminal tasks,
    /// 8 steps each, think times x0.05.
    #[arg(long)]
    pub quick: bool,
    /// SWE tasks, from bench/eval/swe.toml's default set.
    #[arg(long, default_value_t = 8)]
    pub swe: usize,
    /// SWE tasks by name (SWE-bench instance ids), instead.
    #[arg(long = "swe-tasks", value_delimiter = ',')]
    pub swe_names: Vec<String>,
    /// Terminal tasks, from bench/eval/terminal.toml.
    #[arg(long, default_value_t = 6)]
    pub terminal: usize,
    /// Terminal tasks by name, instead.
    #[arg(long = "terminal-tasks", value_delimiter = ',')]
    pub terminal_names: Vec<String>,
    /// Steps per task (0: all).
    #[arg(long, default_value_t = 0)]
    pub turns: usize,
    /// Scale of the traced LLM times (1.0: as traced).
    #[arg(long, default_value_t = 0.1)]
    pub scale: f64,
    /// Seed of the crash placement.
    #[arg(long, default_value_t = 1)]
    pub seed: u64,
    /// Policies, comma-separated (fault-free always runs first; also:
    /// crab-broken).
    #[arg(long, value_delimiter = ',', value_parser = Policy::parse, default_value = "bare,traced,crab,full-ckpt,chat-only,chat+fs,restart")]
    pub policies: Vec<Policy>,
    /// Sandboxes at once.
    #[arg(long, default_value_t = 4)]
    pub parallel: usize,
    /// After the main run, the density study: for each N given
    /// (e.g. `8,16,32`), the tasks copied until N sandboxes run at once,
    /// under the fault-free run, the bare run (fault-free without the
    /// harness's state captures: the time reference), traced, crab and
    /// full-ckpt (those of --policies).
    #[arg(long, value_delimiter = ',')]
    pub density: Vec<usize>,
    /// Runs of each density's policies, each round in an order rotated
    /// by one (no policy always meets the coldest or the warmest host);
    /// end to end is then against each task's mean bare time over the
    /// rounds, with the rounds' spread beside it.
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u32).range(1..=10))]
    pub rounds: u32,
    /// Where the report goes.
    #[arg(long, default_value = "eval-report")]
    pub out: PathBuf,
    /// The traces (mini-swe-agent steps, JSON lines).
    #[arg(long, default_value = concat!(env!("CARGO_MANIFEST_DIR"), "/../../shared/traces/mini-swe-agent.jsonl"))]
    pub traces: PathBuf,
    /// Print every command's output (to stderr).
    #[arg(long)]
    pub verbose: bool,
    /// Each agent runs inside its sandbox (its memory and shell are the
    /// sandbox's), asking its LLM through the sandbox's proxy; otherwise
    /// it runs on the host, its commands through `ctr task exec`.
    #[arg(long)]
    pub agent_inside: bool,
}

// === impl Args ===

impl Args {
    /// These options, cut to `--quick`'s subset when it was given.
    pub fn quick_if_asked(&self) -> Args {
        match self.quick {
            true => Args {
                swe: 1,
                terminal: 2,
                turns: 8,
                scale: 0.05,
                ..self.clone()
            },
            false => self.clone(),
        }
    }
}

const TERMINAL_TOML: &str = include_str!("../../eval/terminal.toml");

/// Runs the evaluation and writes its report under `args.out`.
pub fn run(args: &Args) -> anyhow::Result<()> {
    let started = Instant::now();
    let mut tasks = Vec::new();
    if args.swe > 0 || !args.swe_names.is_empty() {
        tasks.extend(workload::swe(
            workload::SWE_TOML,
            &args.traces,
            &args.swe_names,
            args.swe,
            args.turns,
            args.scale,
        )?);
    }
    tasks.extend(workload::terminal(
        TERMINAL_TOML,
        &args.terminal_names,
        args.terminal,
        args.turns,
        args.scale,
    )?);
    anyhow::ensure!(!tasks.is_empty(), "no tasks: give --swe or --terminal");
    let faults = plan(&tasks, args.seed);
    let mut policies = vec![Policy::FaultFree];
    policies.extend(args.policies.iter().copied().filter(|p| *p != Policy::FaultFree));
    std::fs::create_dir_all(&args.out).with_context(|| format!("create {}", args.out.display()))?;
    println!(
        "eval: {} tasks x {} policies, think times x{} of the traced ones, seed {}, {} sandboxes at once, agents {} their sandboxes",
        tasks.len(),
        policies.len(),
        args.scale,
        args.seed,
        args.parallel,
        if args.agent_inside { "inside" } else { "outside" }
    );
    let llm = ScriptedLlm::start();
    let agents = match args.agent_inside {
        true => Some(agent_llm::AgentLlm::start()?),
        false => None,
    };
    let upstream = agents.as_ref().map_or(llm.port, |a| a.port);
    let bars = MultiProgress::new();
    let mut results = Vec::new();
    let main = Stage {
        tasks: &tasks,
        faults: &faults,
        parallel: args.parallel,
        label: "",
    };
    for policy in &policies {
        let result = run_policy(*policy, &main, upstream, agents.as_ref(), args, &bars)
            .with_context(|| format!("policy {}", policy.name()))?;
        results.push(result);
    }
    let pictures = plot::draw(&results, &args.out)?;
    let meta = Meta {
        seed: args.seed,
        scale: args.scale,
        parallel: args.parallel,
        agent_inside: args.agent_inside,
        wall: started.elapsed(),
    };
    let main_md = report::markdown(&results, &meta, &pictures);
    let mut json = report::json(&results);
    // The main run's report stands before the density study begins: a
    // density that fails loses only itself.
    write_report(&args.out, &main_md, &json)?;
    let mut points = Vec::new();
    let mut density_errors = Vec::new();
    for &n in args.density.iter().filter(|n| **n > 0) {
        let copies = density::replicate(&tasks, n);
        let faults = plan(&copies, args.seed);
        let order = density::policies(&policies);
        let mut rounds = Vec::new();
        let mut failed = None;
        'rounds: for round in 0..args.rounds as usize {
            let label = match args.rounds {
                1 => format!("@{n}"),
                _ => format!("@{n}#{}", round + 1),
            };
            let stage = Stage {
                tasks: &copies,
                faults: &faults,
                parallel: n,
                label: &label,
            };
            let mut results = Vec::new();
            for policy in density::rotated(&order, round) {
                match run_policy(policy, &stage, upstream, agents.as_ref(), args, &bars) {
                    Ok(result) => results.push(result),
                    Err(e) => {
                        failed = Some(e.context(format!(
                            "policy {} with {n} sandboxes, round {}",
                            policy.name(),
                            round + 1
                        )));
                        break 'rounds;
                    }
                }
            }
            results.sort_by_key(|r| order.iter().position(|p| *p == r.policy));
            rounds.push(results);
        }
        // Rounds done before a failure still count.
        if let Some(e) = failed {
            eprintln!("eval: density {n}: {e:#}");
            density_errors.push((n, format!("{e:#}")));
        }
        if !rounds.is_empty() {
            points.push(density::Point { sandboxes: n, rounds });
        }
    }
    let mut md = main_md;
    if !args.density.is_empty() {
        let picture = plot::density(&density::rows(&points), &args.out)?;
        md.push_str(&density::markdown(&points, picture.as_deref(), &density_errors));
        json["density"] = density::json(&points, &density_errors);
        write_report(&args.out, &md, &json)?;
    }
    println!("{md}");
    println!("eval: report in {}", args.out.join("report.md").display());
    Ok(())
}

/// Writes `report.md` and `report.json` into `out`.
fn write_report(out: &std::path::Path, md: &str, json: &serde_json::Value) -> anyhow::Result<()> {
    std::fs::write(out.join("report.md"), md)?;
    std::fs::write(out.join("report.json"), serde_json::to_string_pretty(json)?)?;
    Ok(())
}

/// Each task's crash, planned from `seed` and its name.
fn plan(tasks: &[Task], seed: u64) -> Vec<Option<Fault>> {
    tasks
        .iter()
        .map(|t| Fault::plan(seed, &t.name, t.steps.len(), |i| t.steps[i].think))
        .collect()
}

/// Tasks run together under each policy: the main run's, or a density's.
struct Stage<'a> {
    tasks: &'a [Task],
    faults: &'a [Option<Fault>],
    /// Sandboxes at once.
    parallel: usize,
    /// Beside the policy's name in the progress bar and the logs'
    /// directory ("" for the main run).
    label: &'a str,
}

/// Every task of `stage` under `policy`, on a containerd of its own.
fn run_policy(
    policy: Policy,
    stage: &Stage,
    upstream: u16,
    agents: Option<&agent_llm::AgentLlm>,
    args: &Args,
    bars: &MultiProgress,
) -> anyhow::Result<PolicyResult> {
    // mkdtemp: 0700, never a directory or link another user made first.
    let base_dir = tempfile::Builder::new().prefix("crab-eval").tempdir()?;
    let base = base_dir.path().to_owned();
    let transcripts = base.join("transcripts");
    let (tasks, faults) = (stage.tasks, stage.faults);
    let config = base.join("crab.toml");
    std::fs::write(&config, policy.config(upstream, &transcripts))?;
    let ctd = Containerd::start_full("", &[("CRAB_CONFIG", &config.to_string_lossy())]);
    let label = format!("{}{}", policy.name(), stage.label);
    let mut meter = crate::cpu::Meter::adopt(ctd.pid().context("containerd runs")?, &label);
    let mut images: BTreeMap<String, String> = BTreeMap::new();
    for t in tasks {
        if let std::collections::btree_map::Entry::Vacant(slot) = images.entry(format!("{:?}", t.image)) {
            slot.insert(testbed::import(&ctd, &t.image)?);
        }
    }
    let bar = bars.add(ProgressBar::new(tasks.iter().map(|t| t.steps.len() as u64).sum()));
    bar.set_style(
        ProgressStyle::with_template("{prefix:>12} {bar:40} {pos}/{len} steps {elapsed}")
            .expect("a template"),
    );
    bar.set_prefix(format!("{}{}", policy.name(), stage.label));
    let tick = || bar.inc(1);
    let namespace_transcripts = transcripts.join(&ctd.namespace);
    let next = AtomicUsize::new(0);
    let done = Mutex::new(Vec::new());
    let failure: Mutex<Option<anyhow::Error>> = Mutex::new(None);
    let busy_before = crate::stats::host_busy();
    if let Some(m) = meter.as_mut() {
        m.reset();
    }
    std::thread::scope(|s| {
        for _ in 0..stage.parallel.max(1) {
            s.spawn(|| loop {
                let i = next.fetch_add(1, Ordering::Relaxed);
                let Some(task) = tasks.get(i) else {
                    return;
                };
                let setup = Setup {
                    ctd: &ctd,
                    image: &images[&format!("{:?}", task.image)],
                    policy,
                    fault: faults[i],
                    scratch: &base,
                    tick: &tick,
                    verbose: args.verbose,
                    agents,
                    transcripts: &namespace_transcripts,
                };
                match drive(&setup, task) {
                    Ok(run) => {
                        let holds = run
                            .ids
                            .iter()
                            .flat_map(|id| {
                                crate::observe::holds(&namespace_transcripts.join(format!("{id}.jsonl")))
                            })
                            .collect();
                        let classes = run.classes.clone();
                        let result = TaskResult {
                            task: task.name.clone(),
                            mix: task.mix,
                            fault: faults[i],
                            crashes: policy.crashes(),
                            run,
                            holds,
                            classes,
                        };
                        done.lock().expect("results").push((i, result));
                    }
                    Err(e) => {
                        failure
                            .lock()
                            .expect("failure")
                            .get_or_insert(e.context(format!("task {}", task.name)));
                    }
                }
            });
        }
    });
    bar.finish();
    let host_cpu = crate::stats::host_busy().saturating_sub(busy_before);
    let cpu = meter.as_ref().and_then(crate::cpu::Meter::used);
    if let Some(e) = failure.into_inner().expect("failure") {
        return Err(e);
    }
    let mut done = done.into_inner().expect("results");
    done.sort_by_key(|(i, _)| *i);
    let tasks: Vec<TaskResult> = done.into_iter().map(|(_, r)| r).collect();
    // The logs of the run (the shims log through containerd's), for
    // whoever reads a verdict.
    let logs = args
        .out
        .join("logs")
        .join(format!("{}{}", policy.name().replace('+', "-"), stage.label));
    std::fs::create_dir_all(&logs)?;
    for (from, to) in [
        (ctd.dir.join("containerd.log"), "containerd.log"),
        (ctd.crabd_root().join("crabd.log"), "crabd.log"),
    ] {
        let _ = std::fs::copy(from, logs.join(to));
    }
    let metrics = crate::observe::metrics(&ctd);
    let sum = |prefix: &str| -> f64 {
        metrics
            .iter()
            .filter(|(k, _)| k.starts_with(prefix))
            .map(|(_, v)| v)
            .sum()
    };
    let class = |c: &str| sum(&format!("crab_versions_total{{class=\"{c}\"}}")) as u64;
    let bytes =
        sum("crab_checkpoint_bytes_total") as u64 + tasks.iter().map(|t| t.run.saved_bytes).sum::<u64>();
    let result = PolicyResult {
        policy,
        bytes,
        classes: [class("none"), class("fs"), class("proc"), class("full")],
        crabd_peak_kb: ctd.crabd_pid().and_then(peak_kb).unwrap_or(0),
        shim_peak_kb: tasks.iter().map(|t| t.run.shim_peak_kb).max().unwrap_or(0),
        host_cpu,
        cpu,
        tasks,
    };
    drop(ctd);
    drop(meter);
    drop(base_dir);
    Ok(result)
}
