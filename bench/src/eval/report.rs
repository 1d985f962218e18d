//! The verdicts and figures of an evaluation, as markdown and JSON.

use std::fmt::Write as _;
use std::time::Duration;

use serde_json::json;

use super::driver::Run;
use super::fault::Fault;
use super::policy::Policy;
use super::workload::Mix;
use crate::stats::{percentile, percentile_f64};

/// One task's run under one policy, with what was read after it.
#[derive(Debug)]
pub struct TaskResult {
    /// The task's name.
    pub task: String,
    /// Its mix.
    pub mix: Mix,
    /// Its crash (the same for every policy).
    pub fault: Option<Fault>,
    /// Whether its policy injects the crash.
    pub crashes: bool,
    /// The run.
    pub run: Run,
    /// Each turn's hold (the time its answer waited for its version).
    pub holds: Vec<Duration>,
    /// The class of each step's version, where it has one.
    pub classes: Vec<Option<String>>,
}

/// Every task under one policy.
#[derive(Debug)]
pub struct PolicyResult {
    /// The policy.
    pub policy: Policy,
    /// Its tasks.
    pub tasks: Vec<TaskResult>,
    /// Bytes crabd's checkpoints wrote (and chat+fs's tars).
    pub bytes: u64,
    /// Versions by class: none, fs, proc, full.
    pub classes: [u64; 4],
    /// Peak resident memory of crabd and of the largest shim, KiB.
    pub crabd_peak_kb: u64,
    /// See `crabd_peak_kb`.
    pub shim_peak_kb: u64,
    /// CPU time the host spent busy while the tasks ran (theirs, the
    /// runtime's, crabd's and the harness's).
    pub host_cpu: Duration,
    /// Of it: crab's processes', containerd's and the harness's (None
    /// where they could not be told apart).
    pub cpu: Option<crate::cpu::Split>,
}

/// Whether a recovery was right.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Verdict {
    /// The state after the recovery and at the end equal the fault-free run's.
    Correct,
    /// They do not: how.
    Incorrect(String),
    /// The run stopped: why.
    Failed(String),
    /// No crash was injected (the policy, or a task too short).
    NoCrash,
}

/// The run's parameters, for the report's head.
#[derive(Debug)]
pub struct Meta {
    /// The fault seed.
    pub seed: u64,
    /// The think-time scale.
    pub scale: f64,
    /// How many sandboxes ran at once.
    pub parallel: usize,
    /// The agents ran inside their sandboxes (`--agent-inside`).
    pub agent_inside: bool,
    /// The wall time of the whole evaluation.
    pub wall: Duration,
}

// === impl Verdict ===

impl Verdict {
    /// Its word in tables.
    pub fn word(&self) -> &'static str {
        match self {
            Verdict::Correct => "correct",
            Verdict::Incorrect(_) => "incorrect",
            Verdict::Failed(_) => "failed",
            Verdict::NoCrash => "no crash",
        }
    }

    /// Why, when it is not correct.
    pub fn why(&self) -> &str {
        match self {
            Verdict::Incorrect(why) | Verdict::Failed(why) => why,
            Verdict::Correct | Verdict::NoCrash => "",
        }
    }
}

/// The verdict of `result` against the fault-free run `reference` of the
/// same task: the state where the recovery claims the sandbox to be must
/// be the fault-free state at that step, and the end state its end state.
pub fn verdict(result: &TaskResult, reference: &TaskResult) -> Verdict {
    if let Some(error) = &result.run.error {
        return Verdict::Failed(error.clone());
    }
    let Some(recovered) = &result.run.recovered else {
        if result.crashes && result.fault.is_some() {
            return Verdict::Failed("the planned crash was not injected".into());
        }
        return Verdict::NoCrash;
    };
    let Some(want) = reference.run.refs.get(&recovered.at) else {
        return Verdict::Failed(format!(
            "the fault-free run has no state at step {}",
            recovered.at
        ));
    };
    if want.files.is_empty() && want.procs.is_empty() {
        return Verdict::Failed(
            "the fault-free state is empty: nothing to compare (check the task's directories)".into(),
        );
    }
    if let Some(diff) = recovered.state.diff(want) {
        return Verdict::Incorrect(format!("after the recovery (at step {}): {diff}", recovered.at));
    }
    match (&result.run.last, &reference.run.last) {
        (Some(last), Some(want)) => match last.diff(want) {
            Some(diff) => Verdict::Incorrect(format!("at the end: {diff}")),
            None => Verdict::Correct,
        },
        _ => Verdict::Failed("no end state".into()),
    }
}

/// Summary figures of one policy against the fault-free runs.
#[derive(Debug, Default)]
pub struct Summary {
    /// Crashed tasks recovered correctly, and crashed tasks.
    pub correct: usize,
    /// See `correct`.
    pub crashed: usize,
    /// Mean of each task's time over its fault-free time.
    pub e2e: f64,
    /// Holds as a share of task time: p50, p95, p99 over tasks.
    pub share: [f64; 3],
    /// Holds: p50, p95, p99 over turns.
    pub hold: [Duration; 3],
    /// Kill to running again: p50, p95.
    pub restore: [Duration; 2],
}

/// The run whose task times the others' end-to-end figures are against:
/// the bare run (no state captures loading the host) when it ran, else
/// the fault-free one.
pub fn time_reference(results: &[PolicyResult]) -> Option<&PolicyResult> {
    let find = |want: Policy| results.iter().find(|p| p.policy == want);
    find(Policy::Bare).or_else(|| find(Policy::FaultFree))
}

/// The summary of `p`: its recoveries against the fault-free run
/// `reference`, its times against `times` (see [`time_reference`]).
pub fn summarize(p: &PolicyResult, reference: &PolicyResult, times: &PolicyResult) -> Summary {
    let mut s = Summary::default();
    let mut ratios = Vec::new();
    let mut shares = Vec::new();
    let mut holds = Vec::new();
    let mut restores = Vec::new();
    for t in &p.tasks {
        let Some(r) = reference.tasks.iter().find(|r| r.task == t.task) else {
            continue;
        };
        match verdict(t, r) {
            Verdict::Correct => {
                s.correct += 1;
                s.crashed += 1;
            }
            Verdict::NoCrash => {}
            Verdict::Incorrect(_) | Verdict::Failed(_) => s.crashed += 1,
        }
        let base = times
            .tasks
            .iter()
            .find(|r| r.task == t.task && r.run.error.is_none())
            .map_or(Duration::ZERO, |r| r.run.time);
        if t.run.error.is_none() && base > Duration::ZERO {
            ratios.push(t.run.time.as_secs_f64() / base.as_secs_f64());
        }
        let held: Duration = t.holds.iter().sum();
        if t.run.time > Duration::ZERO {
            shares.push(held.as_secs_f64() / t.run.time.as_secs_f64());
        }
        holds.extend(&t.holds);
        restores.extend(t.run.recovered.as_ref().map(|r| r.took));
    }
    s.e2e = if ratios.is_empty() {
        f64::NAN
    } else {
        ratios.iter().sum::<f64>() / ratios.len() as f64
    };
    for (i, q) in [50.0, 95.0, 99.0].into_iter().enumerate() {
        s.share[i] = percentile_f64(&mut shares, q);
        s.hold[i] = percentile(&mut holds, q);
    }
    s.restore = [percentile(&mut restores, 50.0), percentile(&mut restores, 95.0)];
    s
}

fn mb(bytes: u64) -> f64 {
    bytes as f64 / 1e6
}

/// The checkpoint bytes of `p`'s tasks of `mix`: their versions' process
/// images and the files chat+fs saved.
pub fn mix_bytes(p: &PolicyResult, mix: Mix) -> u64 {
    p.tasks
        .iter()
        .filter(|t| t.mix == mix)
        .map(|t| t.run.image_bytes + t.run.saved_bytes)
        .sum()
}

/// The table of checkpoint bytes by mix, each beside full-ckpt's of the
/// same mix; empty without full-ckpt or bytes.
fn by_mix(results: &[PolicyResult]) -> String {
    let Some(full) = results.iter().find(|p| p.policy == Policy::FullCkpt) else {
        return String::new();
    };
    let mixes: Vec<Mix> = [Mix::Swe, Mix::Terminal]
        .into_iter()
        .filter(|m| full.tasks.iter().any(|t| t.mix == *m))
        .collect();
    let mut md = String::new();
    let _ = writeln!(
        md,
        "Checkpoint bytes by mix (each sandbox's versions as crabd lists them at the end, and chat+fs's saved files):\n"
    );
    let head: Vec<String> = mixes
        .iter()
        .map(|m| format!("{} MB | vs full-ckpt", m.name()))
        .collect();
    let _ = writeln!(md, "| policy | {} |", head.join(" | "));
    let _ = writeln!(md, "|---|{}", "---|---|".repeat(mixes.len()));
    for p in results
        .iter()
        .filter(|p| p.tasks.iter().any(|t| t.run.image_bytes + t.run.saved_bytes > 0))
    {
        let cells: Vec<String> = mixes
            .iter()
            .map(|m| {
                let (ours, theirs) = (mix_bytes(p, *m), mix_bytes(full, *m));
                let ratio = match theirs {
                    0 => "-".to_owned(),
                    t => format!("{:.1}%", 100.0 * ours as f64 / t as f64),
                };
                format!("{:.1} | {ratio}", mb(ours))
            })
            .collect();
        let _ = writeln!(md, "| {} | {} |", p.policy.name(), cells.join(" | "));
    }
    md
}

/// The report in markdown: the headline table beside the published
/// figures, then every task's verdict.
pub fn markdown(results: &[PolicyResult], meta: &Meta, pictures: &[String]) -> String {
    let (Some(reference), Some(times)) = (
        results.iter().find(|p| p.policy == Policy::FaultFree),
        time_reference(results),
    ) else {
        return "no fault-free run: nothing to compare with\n".into();
    };
    let full = results
        .iter()
        .find(|p| p.policy == Policy::FullCkpt)
        .map(|p| p.bytes);
    let mut md = String::new();
    let n_tasks = reference.tasks.len();
    let _ = writeln!(md, "# crab-bench eval\n");
    let _ = writeln!(
        md,
        "{n_tasks} tasks, one crash each (SIGKILL of the sandbox's init, seed {}), think times x{} of the traced ones, \
         {} sandboxes at once, agents {} their sandboxes, {:.0} s in all, on this machine ({} cores).\n",
        meta.seed,
        meta.scale,
        meta.parallel,
        if meta.agent_inside { "inside" } else { "outside" },
        meta.wall.as_secs_f64(),
        std::thread::available_parallelism().map_or(0, |n| n.get())
    );
    let _ = writeln!(
        md,
        "| policy | recovery correct | checkpoint MB | vs full-ckpt | versions none/fs/proc/full | hold p50/p95/p99 ms | \
         held share of task p50/p95/p99 | e2e vs {} | kill to running p50/p95 ms | crabd / shim peak MB |",
        times.policy.name()
    );
    let _ = writeln!(md, "|---|---|---|---|---|---|---|---|---|---|");
    for p in results {
        let s = summarize(p, reference, times);
        let correct = if s.crashed == 0 {
            "-".to_owned()
        } else {
            format!(
                "{}/{} ({:.0}%)",
                s.correct,
                s.crashed,
                100.0 * s.correct as f64 / s.crashed as f64
            )
        };
        let ratio = match full {
            Some(f) if f > 0 && p.bytes > 0 => format!("{:.1}%", 100.0 * p.bytes as f64 / f as f64),
            _ => "-".into(),
        };
        let ms = |d: Duration| format!("{:.0}", d.as_secs_f64() * 1e3);
        let pct = |x: f64| format!("{:.3}%", x * 100.0);
        let [a, b, c, d] = p.classes;
        let versions = a + b + c + d;
        let none = if versions > 0 {
            format!(" ({:.0}% none)", 100.0 * a as f64 / versions as f64)
        } else {
            String::new()
        };
        let _ = writeln!(
            md,
            "| {} | {correct} | {:.1} | {ratio} | {a}/{b}/{c}/{d}{none} | {}/{}/{} | {}/{}/{} | {:.3}x | {}/{} | {:.0} / {:.0} |",
            p.policy.name(),
            mb(p.bytes),
            ms(s.hold[0]),
            ms(s.hold[1]),
            ms(s.hold[2]),
            pct(s.share[0]),
            pct(s.share[1]),
            pct(s.share[2]),
            s.e2e,
            ms(s.restore[0]),
            ms(s.restore[1]),
            p.crabd_peak_kb as f64 / 1024.0,
            p.shim_peak_kb as f64 / 1024.0,
        );
    }
    let _ = writeln!(md, "\n{}", by_mix(results));
    let e2e_of = |policy| {
        results
            .iter()
            .find(|p| p.policy == policy)
            .map(|p| summarize(p, reference, times).e2e)
    };
    if let (Some(traced), Some(crab)) = (e2e_of(Policy::Traced), e2e_of(Policy::Crab)) {
        let _ = writeln!(
            md,
            "Crab's end to end, taken apart (separate runs, so roughly): {crab:.3}x ≈ {traced:.3}x for the inspector's \
             system-call programs alone (`traced`: attached, no checkpoint, no turn end, no crash) × {:.3}x for its \
             checkpoints, turn ends and recovery.\n",
            crab / traced
        );
    }
    let _ = writeln!(
        md,
        "The published system (same metrics, its testbed): recovery correct 100% (chat-only 8–13%, chat+files 28–100%), \
         up to 87% less checkpoint traffic than checkpointing every turn, 75–87% of turns `none`, end-to-end within 1.9% of \
         fault-free, p95 exposed delay 0.44% of task time. Crab's targets: 100%, ≤ 10% of full-ckpt's bytes on the SWE mix, ≤ 1.01x, ≤ 0.2%.\n"
    );
    let _ = writeln!(
        md,
        "Correct means state-verified: right after the recovery the sandbox's files (every file under the task's directories: \
         type, mode, owner, content), its processes (command lines) and its servers' memory (the task's probes) equal the \
         fault-free run's at the step the recovery claims, and at the end they equal the fault-free end.\n"
    );
    for pic in pictures {
        let _ = writeln!(md, "![{pic}]({pic})\n");
    }
    let failing: Vec<&TaskResult> = reference
        .tasks
        .iter()
        .filter(|t| t.run.failed_commands > 0)
        .collect();
    if !failing.is_empty() {
        let _ = writeln!(md, "## Commands that failed in the fault-free run\n");
        let _ = writeln!(md, "SWE commands run as the traces ran them and may fail here as they would (see bench/eval/swe.toml); a terminal task's should not.\n");
        for t in failing {
            let first = t.run.first_failure.as_deref().unwrap_or("").replace('\n', " ");
            let _ = writeln!(
                md,
                "- {}: {} commands; first: {first}",
                t.task, t.run.failed_commands
            );
        }
        let _ = writeln!(md);
    }
    let _ = writeln!(md, "## Every task\n");
    let _ = writeln!(md, "| task | mix | policy | crash (step, phase) | recovered to step | replayed | commands failed | verdict | why |");
    let _ = writeln!(md, "|---|---|---|---|---|---|---|---|---|");
    for p in results.iter().filter(|p| p.policy != Policy::FaultFree) {
        for t in &p.tasks {
            let Some(r) = reference.tasks.iter().find(|r| r.task == t.task) else {
                continue;
            };
            let v = verdict(t, r);
            let crash = t
                .fault
                .map_or("-".into(), |f| format!("{}, {}", f.step, f.phase.name()));
            let (at, replayed) = t.run.recovered.as_ref().map_or(("-".into(), "-".into()), |r| {
                (r.at.to_string(), r.replayed.to_string())
            });
            let mix = match t.mix {
                Mix::Swe => "swe",
                Mix::Terminal => "terminal",
            };
            let why = v.why().replace('|', "\\|");
            let failed = t.run.failed_commands;
            let _ = writeln!(
                md,
                "| {} | {mix} | {} | {crash} | {at} | {replayed} | {failed} | {} | {why} |",
                t.task,
                p.policy.name(),
                v.word()
            );
        }
    }
    md
}

/// Task `t`'s run as JSON: its name, time, crash, each step's version
/// class (crab's policies) and every event of its timeline (`[kind, step, start s, end s]`, kind `command`, `llm` or
/// `recovery`, step null for a recovery).
pub fn timeline_json(t: &TaskResult) -> serde_json::Value {
    use super::driver::EventKind;
    let events: Vec<_> = t
        .run
        .events
        .iter()
        .map(|e| {
            let (kind, step) = match e.kind {
                EventKind::Command(i) => ("command", Some(i)),
                EventKind::Turn(i) => ("llm", Some(i)),
                EventKind::Recovery => ("recovery", None),
            };
            json!([kind, step, e.start, e.end])
        })
        .collect();
    json!({
        "task": t.task,
        "seconds": t.run.time.as_secs_f64(),
        "error": t.run.error,
        "crash": t.fault.filter(|_| t.crashes).map(|f| json!({"step": f.step, "phase": f.phase.name()})),
        "classes": t.classes,
        "events": events,
    })
}

/// The report as JSON (what the tests read).
pub fn json(results: &[PolicyResult]) -> serde_json::Value {
    let reference = results.iter().find(|p| p.policy == Policy::FaultFree);
    let policies: Vec<_> = results
        .iter()
        .map(|p| {
            let tasks: Vec<_> = p
                .tasks
                .iter()
                .map(|t| {
                    let v = reference
                        .and_then(|r| r.tasks.iter().find(|r| r.task == t.task))
                        .map_or(Verdict::Failed("no fault-free run".into()), |r| verdict(t, r));
                    json!({
                        "task": t.task,
                        "verdict": v.word(),
                        "why": v.why(),
                        "seconds": t.run.time.as_secs_f64(),
                        "recovered_to": t.run.recovered.as_ref().map(|r| r.at),
                        "version": t.run.recovered.as_ref().and_then(|r| r.version),
                        "crash": t.fault.map(|f| json!({"step": f.step, "phase": f.phase.name()})),
                        "failed_commands": t.run.failed_commands,
                        "first_failure": t.run.first_failure,
                        "files_at_end": t.run.last.as_ref().map(|s| s.files.len()),
                        "processes_at_end": t.run.last.as_ref().map(|s| s.procs.clone()),
                        "probes_at_end": t.run.last.as_ref().map(|s| s.probes.clone()),
                    })
                })
                .collect();
            let s = reference
                .zip(time_reference(results))
                .map(|(r, times)| summarize(p, r, times))
                .unwrap_or_default();
            json!({
                "policy": p.policy.name(),
                "correct": s.correct,
                "crashed": s.crashed,
                "bytes": p.bytes,
                "bytes_by_mix": {
                    "swe": mix_bytes(p, Mix::Swe),
                    "terminal": mix_bytes(p, Mix::Terminal),
                },
                "classes": p.classes,
                "e2e": s.e2e,
                "share_p95": s.share[1],
                "host_cpu_seconds": p.host_cpu.as_secs_f64(),
                "crab_cpu_seconds": p.cpu.map(|c| c.crab.as_secs_f64()),
                "containerd_cpu_seconds": p.cpu.map(|c| c.containerd.as_secs_f64()),
                "harness_cpu_seconds": p.cpu.map(|c| c.harness.as_secs_f64()),
                "tasks": tasks,
            })
        })
        .collect();
    json!({ "policies": policies })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::eval::driver::Recovered;
    use crate::eval::fault::Phase;
    use crate::eval::state::State;

    fn state(file: &str) -> State {
        State {
            files: [("work/a".to_owned(), file.to_owned())].into(),
            procs: vec!["sleep".into()],
            probes: vec![],
        }
    }

    fn result(run: Run) -> TaskResult {
        TaskResult {
            task: "t".into(),
            mix: Mix::Terminal,
            fault: None,
            crashes: true,
            run,
            holds: vec![],
            classes: vec![],
        }
    }

    fn reference() -> TaskResult {
        let mut run = Run {
            refs: [(-1, state("0")), (2, state("2")), (3, state("3"))].into(),
            last: Some(state("9")),
            ..Run::default()
        };
        run.time = Duration::from_secs(10);
        result(run)
    }

    fn recovered(at: isize, now: &str, last: &str) -> TaskResult {
        let fault = Fault {
            step: 3,
            phase: Phase::Command,
            after: Duration::ZERO,
        };
        let mut result = result(Run {
            recovered: Some(Recovered {
                at,
                state: state(now),
                took: Duration::from_millis(300),
                version: Some(3),
                replayed: 0,
            }),
            last: Some(state(last)),
            time: Duration::from_secs(11),
            ..Run::default()
        });
        result.fault = Some(fault);
        result
    }

    #[test]
    fn a_recovery_is_correct_only_where_it_claims_to_be_and_at_the_end() {
        let r = reference();
        assert_eq!(verdict(&recovered(2, "2", "9"), &r), Verdict::Correct);
        let wrong_step = verdict(&recovered(3, "2", "9"), &r);
        assert!(
            matches!(&wrong_step, Verdict::Incorrect(w) if w.contains("at step 3")),
            "{wrong_step:?}"
        );
        let wrong_end = verdict(&recovered(2, "2", "8"), &r);
        assert!(
            matches!(&wrong_end, Verdict::Incorrect(w) if w.contains("at the end")),
            "{wrong_end:?}"
        );
        let unknown = verdict(&recovered(1, "1", "9"), &r);
        assert!(matches!(unknown, Verdict::Failed(_)));
        let mut failed = recovered(2, "2", "9");
        failed.run.error = Some("boom".into());
        assert_eq!(verdict(&failed, &r), Verdict::Failed("boom".into()));
        let mut fault_free = reference();
        fault_free.crashes = false;
        fault_free.fault = Some(Fault {
            step: 1,
            phase: Phase::Command,
            after: Duration::ZERO,
        });
        assert_eq!(verdict(&fault_free, &r), Verdict::NoCrash);
        let mut missed = reference();
        missed.fault = fault_free.fault;
        assert!(matches!(verdict(&missed, &r), Verdict::Failed(w) if w.contains("not injected")));
    }

    #[test]
    fn bytes_are_split_by_mix_each_against_full_ckpt() {
        let task = |mix: Mix, bytes: u64| {
            let mut t = result(Run {
                image_bytes: bytes,
                ..Run::default()
            });
            t.mix = mix;
            t
        };
        let policy = |policy: Policy, swe: u64, terminal: u64| PolicyResult {
            policy,
            tasks: vec![task(Mix::Swe, swe), task(Mix::Terminal, terminal)],
            bytes: swe + terminal,
            classes: [0; 4],
            crabd_peak_kb: 0,
            shim_peak_kb: 0,
            host_cpu: Duration::ZERO,
            cpu: None,
        };
        let results = [
            policy(Policy::FaultFree, 0, 0),
            policy(Policy::Crab, 1_000_000, 30_000_000),
            policy(Policy::FullCkpt, 20_000_000, 40_000_000),
        ];
        assert_eq!(mix_bytes(&results[1], Mix::Terminal), 30_000_000);
        let md = by_mix(&results);
        assert!(
            md.contains("| policy | swe MB | vs full-ckpt | terminal MB | vs full-ckpt |"),
            "{md}"
        );
        assert!(md.contains("| crab | 1.0 | 5.0% | 30.0 | 75.0% |"), "{md}");
        assert!(
            md.contains("| full-ckpt | 20.0 | 100.0% | 40.0 | 100.0% |"),
            "{md}"
        );
        assert!(!md.contains("fault-free"), "no bytes, no row: {md}");
    }

    #[test]
    fn the_summary_counts_crashed_tasks_and_times_against_fault_free() {
        let reference = PolicyResult {
            policy: Policy::FaultFree,
            tasks: vec![reference()],
            bytes: 0,
            classes: [0; 4],
            crabd_peak_kb: 0,
            shim_peak_kb: 0,
            host_cpu: Duration::ZERO,
            cpu: None,
        };
        let mut t = recovered(2, "2", "9");
        t.holds = vec![Duration::from_millis(110)];
        let p = PolicyResult {
            policy: Policy::Crab,
            tasks: vec![t],
            bytes: 5,
            classes: [3, 1, 0, 1],
            crabd_peak_kb: 0,
            shim_peak_kb: 0,
            host_cpu: Duration::ZERO,
            cpu: None,
        };
        let s = summarize(&p, &reference, &reference);
        assert_eq!((s.correct, s.crashed), (1, 1));
        assert!((s.e2e - 1.1).abs() < 1e-9, "{}", s.e2e);
        assert!((s.share[1] - 0.01).abs() < 1e-9, "{:?}", s.share);
        assert_eq!(s.restore[0], Duration::from_millis(300));
        let md = markdown(
            &[reference, p],
            &Meta {
                seed: 1,
                scale: 0.1,
                parallel: 1,
                agent_inside: false,
                wall: Duration::from_secs(1),
            },
            &[],
        );
        assert!(md.contains("| crab | 1/1 (100%)"), "{md}");
    }

    #[test]
    fn a_timeline_names_each_event_and_the_crash_of_a_crashing_policy_only() {
        use crate::eval::driver::{Event, EventKind};
        let mut t = recovered(2, "2", "9");
        t.crashes = true;
        t.run.events = vec![
            Event {
                kind: EventKind::Command(3),
                start: 1.0,
                end: 2.0,
            },
            Event {
                kind: EventKind::Turn(3),
                start: 2.0,
                end: 2.5,
            },
            Event {
                kind: EventKind::Recovery,
                start: 2.5,
                end: 3.0,
            },
        ];
        let j = timeline_json(&t);
        assert_eq!(
            j["events"],
            json!([
                ["command", 3, 1.0, 2.0],
                ["llm", 3, 2.0, 2.5],
                ["recovery", null, 2.5, 3.0]
            ])
        );
        assert_eq!(j["crash"]["step"], 3);
        t.crashes = false;
        assert!(timeline_json(&t)["crash"].is_null());
    }
}
