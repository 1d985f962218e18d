//! The density study of `crab-bench eval --density 8,16,32`: the run's
//! tasks copied until there are N, all N sandboxes at once on one host,
//! under the fault-free run, `traced` (the inspector attached, nothing
//! else) and each policy that checkpoints (crab, full-ckpt), one seeded
//! crash per copy as in the main run for those. A policy's
//! end-to-end figure at N is against the fault-free run at the same N, so
//! it shows what checkpointing adds on a loaded host, not the load itself;
//! the fault-free task time says what the load is. With `--rounds R`
//! every density runs its policies R times, each round's order rotated by
//! one, and a policy's end-to-end figure is against each task's mean
//! fault-free time over the rounds, shown with the rounds' least and
//! greatest (the fault-free rounds' own spread is the host's noise). The
//! scaling law is a least-squares line through each policy's figures
//! over N.

use std::collections::HashMap;
use std::fmt::Write as _;

use serde_json::json;

use super::driver::EventKind;
use super::policy::Policy;
use super::report::{summarize, time_reference, verdict, PolicyResult, TaskResult, Verdict};
use super::workload::{Mix, Task};
use crate::cpu::Split;
use crate::stats::fit;

/// Every policy's runs with `sandboxes` at once.
#[derive(Debug)]
pub struct Point {
    /// Sandboxes at once.
    pub sandboxes: usize,
    /// Each round's runs: the fault-free run first, then each policy's.
    pub rounds: Vec<Vec<PolicyResult>>,
}

/// One policy's figures at one density.
#[derive(Debug, Clone, PartialEq)]
pub struct Row {
    /// Sandboxes at once.
    pub sandboxes: usize,
    /// The policy.
    pub policy: Policy,
    /// Mean of each task's time over its mean fault-free time at this
    /// density, over the rounds.
    pub e2e: f64,
    /// The least and the greatest of the rounds' `e2e`.
    pub e2e_spread: (f64, f64),
    /// Rounds run.
    pub rounds: usize,
    /// Busy CPU seconds of the host while the tasks ran, mean of the rounds.
    pub host_cpu_secs: f64,
    /// Of it, CPU seconds of crab's processes (shims, crabd, CRIU),
    /// containerd's and the harness's, mean of the rounds.
    pub cpu_secs: [f64; 3],
    /// p95 over tasks of holds as a share of task time (the worst round's).
    pub share_p95: f64,
    /// Mean task time, seconds.
    pub task_secs: f64,
    /// Where a task's time went, mean seconds per task: its commands, its
    /// LLM calls (turn end to answer: think time and holds) and its
    /// recovery (kill to running again).
    pub phases: Phases,
    /// Crashed tasks recovered correctly, and crashed tasks.
    pub correct: usize,
    /// See `correct`.
    pub crashed: usize,
    /// Checkpoint bytes written, mean of the rounds.
    pub bytes: u64,
}

/// Mean seconds per task spent in each kind of [`Event`](super::driver::Event).
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct Phases {
    /// Running the steps' commands.
    pub commands: f64,
    /// Waiting for the LLM's answers (think time, holds).
    pub llm: f64,
    /// From the kill to running again.
    pub recovery: f64,
}

/// `tasks` copied, in turn, until there are `n`, the mixes taken in turn
/// (so that a density below the number of tasks is not one mix only); the
/// copies of a task are named `<name>-2`, `<name>-3`, … (so each has its
/// own sandbox and its own seeded crash).
pub fn replicate(tasks: &[Task], n: usize) -> Vec<Task> {
    if tasks.is_empty() {
        return Vec::new();
    }
    let tasks = interleave(tasks);
    (0..n)
        .map(|i| {
            let mut t = (*tasks[i % tasks.len()]).clone();
            let copy = i / tasks.len() + 1;
            if copy > 1 {
                t.name = format!("{}-{copy}", t.name);
            }
            t
        })
        .collect()
}

/// `tasks` reordered to take one of each mix in turn, each mix in its own
/// order.
fn interleave(tasks: &[Task]) -> Vec<&Task> {
    let swe: Vec<&Task> = tasks.iter().filter(|t| t.mix == Mix::Swe).collect();
    let other: Vec<&Task> = tasks.iter().filter(|t| t.mix != Mix::Swe).collect();
    let mut out = Vec::with_capacity(tasks.len());
    for i in 0..swe.len().max(other.len()) {
        out.extend(swe.get(i));
        out.extend(other.get(i));
    }
    out
}

/// The policies of the density study among `asked`: fault-free first
/// (the states), bare (the time reference), then those that checkpoint or
/// trace (what density can slow down).
pub fn policies(asked: &[Policy]) -> Vec<Policy> {
    let mut out = vec![Policy::FaultFree, Policy::Bare];
    out.extend(
        asked
            .iter()
            .copied()
            .filter(|p| p.checkpoints() || *p == Policy::Traced),
    );
    out
}

/// `policies` in the order of round `round` (from 0): rotated by one
/// each round, so that no policy always runs first on a cold host.
pub fn rotated(policies: &[Policy], round: usize) -> Vec<Policy> {
    let mut out = policies.to_vec();
    if !policies.is_empty() {
        out.rotate_left(round % policies.len());
    }
    out
}

/// Each task's mean time over the reference runs of `rounds` that ran it
/// through, in seconds: each round's [`time_reference`].
fn reference_times(rounds: &[Vec<PolicyResult>]) -> HashMap<&str, f64> {
    let mut sums: HashMap<&str, (f64, usize)> = HashMap::new();
    let runs = rounds.iter().filter_map(|round| time_reference(round));
    for t in runs.flat_map(|p| &p.tasks) {
        if t.run.error.is_none() && !t.run.time.is_zero() {
            let sum = sums.entry(t.task.as_str()).or_default();
            *sum = (sum.0 + t.run.time.as_secs_f64(), sum.1 + 1);
        }
    }
    sums.into_iter()
        .map(|(task, (sum, n))| (task, sum / n as f64))
        .collect()
}

/// Mean over `p`'s tasks (those that ran through and have a reference)
/// of the task's time over its reference time.
fn e2e(p: &PolicyResult, reference: &HashMap<&str, f64>) -> f64 {
    let ratios: Vec<f64> = p
        .tasks
        .iter()
        .filter(|t| t.run.error.is_none())
        .filter_map(|t| Some(t.run.time.as_secs_f64() / reference.get(t.task.as_str())?))
        .collect();
    mean(&ratios)
}

/// Every policy's figures at every density, in order.
pub fn rows(points: &[Point]) -> Vec<Row> {
    let mut rows = Vec::new();
    for point in points {
        let reference = reference_times(&point.rounds);
        let Some(first) = point.rounds.first() else {
            continue;
        };
        for policy in first.iter().map(|p| p.policy) {
            // Each round's run of the policy, with that round's fault-free
            // run (the states a recovery is held to).
            let runs: Vec<(&PolicyResult, &PolicyResult)> = point
                .rounds
                .iter()
                .filter_map(|round| {
                    let find = |want: Policy| round.iter().find(|p| p.policy == want);
                    Some((find(policy)?, find(Policy::FaultFree)?))
                })
                .collect();
            if runs.is_empty() {
                continue;
            }
            // A round whose tasks all failed has no figure.
            let e2es: Vec<f64> = runs
                .iter()
                .map(|(p, _)| e2e(p, &reference))
                .filter(|e| e.is_finite())
                .collect();
            let spread = e2es
                .iter()
                .fold((f64::INFINITY, f64::NEG_INFINITY), |(lo, hi), e| {
                    (lo.min(*e), hi.max(*e))
                });
            let (mut correct, mut crashed, mut share_p95) = (0, 0, 0.0f64);
            for (p, r) in &runs {
                let s = summarize(p, r, r);
                (correct, crashed) = (correct + s.correct, crashed + s.crashed);
                share_p95 = share_p95.max(s.share[1]);
            }
            let times: Vec<f64> = runs
                .iter()
                .flat_map(|(p, _)| &p.tasks)
                .map(|t| t.run.time.as_secs_f64())
                .collect();
            let cpu: Vec<f64> = runs.iter().map(|(p, _)| p.host_cpu.as_secs_f64()).collect();
            let ran: Vec<&TaskResult> = runs
                .iter()
                .flat_map(|(p, _)| &p.tasks)
                .filter(|t| t.run.error.is_none())
                .collect();
            rows.push(Row {
                sandboxes: point.sandboxes,
                policy,
                e2e: mean(&e2es),
                e2e_spread: if e2es.is_empty() {
                    (f64::NAN, f64::NAN)
                } else {
                    spread
                },
                rounds: runs.len(),
                host_cpu_secs: mean(&cpu),
                cpu_secs: [
                    |c: &Split| c.crab,
                    |c: &Split| c.containerd,
                    |c: &Split| c.harness,
                ]
                .map(|of| {
                    let secs: Vec<f64> = runs
                        .iter()
                        .filter_map(|(p, _)| p.cpu.as_ref())
                        .map(|c| of(c).as_secs_f64())
                        .collect();
                    mean(&secs)
                }),
                share_p95,
                task_secs: mean(&times),
                phases: phases(&ran),
                correct,
                crashed,
                bytes: runs.iter().map(|(p, _)| p.bytes).sum::<u64>() / runs.len() as u64,
            });
        }
    }
    rows
}

/// Mean seconds per task of `tasks` in each kind of event.
fn phases(tasks: &[&TaskResult]) -> Phases {
    let mut sum = Phases::default();
    for t in tasks {
        for e in &t.run.events {
            let took = (e.end - e.start).max(0.0);
            match e.kind {
                EventKind::Command(_) => sum.commands += took,
                EventKind::Turn(_) => sum.llm += took,
                EventKind::Recovery => sum.recovery += took,
            }
        }
    }
    let n = tasks.len().max(1) as f64;
    Phases {
        commands: sum.commands / n,
        llm: sum.llm / n,
        recovery: sum.recovery / n,
    }
}

fn mean(xs: &[f64]) -> f64 {
    match xs.len() {
        0 => f64::NAN,
        n => xs.iter().sum::<f64>() / n as f64,
    }
}

/// Each policy's figure `of` over the densities: `(sandboxes, figure)`.
pub fn series(rows: &[Row], policy: Policy, of: impl Fn(&Row) -> f64) -> Vec<(f64, f64)> {
    rows.iter()
        .filter(|r| r.policy == policy)
        .map(|r| (r.sandboxes as f64, of(r)))
        .collect()
}

/// The policies in `rows`, in first-seen order.
pub fn policies_in(rows: &[Row]) -> Vec<Policy> {
    let mut out: Vec<Policy> = Vec::new();
    for r in rows {
        if !out.contains(&r.policy) {
            out.push(r.policy);
        }
    }
    out
}

/// The density section of the report, with the densities whose run
/// failed (`errors`: sandboxes, why).
pub fn markdown(points: &[Point], picture: Option<&str>, errors: &[(usize, String)]) -> String {
    let rows = rows(points);
    let mut md = String::new();
    let _ = writeln!(md, "## Density\n");
    for (n, why) in errors {
        let _ = writeln!(
            md,
            "The run with {n} sandboxes failed: {}\n",
            why.replace('\n', " ")
        );
    }
    if rows.is_empty() {
        return md;
    }
    let _ = writeln!(
        md,
        "The run's tasks copied until N sandboxes run at once, one seeded crash per copy; each policy's end-to-end \
         figure is against the bare run at the same N (what checkpointing adds on that load): fault-free without \
         the harness's state capture after each step, whose work on a loaded host slows the neighbours of the \
         fault-free run (its own row shows by how much). The bare task time shows the load itself. Target: crab \
         ≤ 1.05x at 32 sandboxes. Host CPU is the CPU time the whole host was busy while the tasks ran; of it, \
         crab's processes' (the shims, crabd and what they run: CRIU, the shims' helpers; by cgroup), \
         containerd's and the harness's (`crab-bench` and the `ctr` and `crabctl` it runs).\n"
    );
    let rounds = rows.iter().map(|r| r.rounds).max().unwrap_or(1);
    if rounds > 1 {
        let _ = writeln!(
            md,
            "{rounds} rounds at each N, each in an order rotated by one; end to end is against each task's mean \
             bare time over the rounds, with the least and greatest round in brackets (the bare row's \
             spread is this host's own noise). CPU times are the mean of the rounds.\n"
        );
    }
    let _ = writeln!(
        md,
        "| sandboxes | policy | recovery correct | e2e vs bare | held share p95 | mean task s | commands / LLM / recovery s per task | host CPU s | of it crab / containerd / harness s | checkpoint MB |"
    );
    let _ = writeln!(md, "|---|---|---|---|---|---|---|---|---|---|");
    for r in &rows {
        let correct = match r.crashed {
            0 => "-".to_owned(),
            n => format!("{}/{n}", r.correct),
        };
        let e2e = match r.rounds {
            1 => format!("{:.3}x", r.e2e),
            _ => format!("{:.3}x ({:.3}–{:.3})", r.e2e, r.e2e_spread.0, r.e2e_spread.1),
        };
        let _ = writeln!(
            md,
            "| {} | {} | {correct} | {e2e} | {:.3}% | {:.1} | {:.1} / {:.1} / {:.2} | {:.0} | {:.1} / {:.1} / {:.1} | {:.1} |",
            r.sandboxes,
            r.policy.name(),
            r.share_p95 * 100.0,
            r.task_secs,
            r.phases.commands,
            r.phases.llm,
            r.phases.recovery,
            r.host_cpu_secs,
            r.cpu_secs[0],
            r.cpu_secs[1],
            r.cpu_secs[2],
            r.bytes as f64 / 1e6
        );
    }
    let wrong = not_correct(points);
    if !wrong.is_empty() {
        let _ = writeln!(md, "\nRecoveries not state-correct:\n");
        for (n, policy, task, v) in &wrong {
            let _ = writeln!(
                md,
                "- {n} sandboxes, {}, {task}: {}: {}",
                policy.name(),
                v.word(),
                v.why()
            );
        }
    }
    let failing: Vec<String> = points
        .iter()
        .flat_map(|point| {
            point
                .rounds
                .iter()
                .flatten()
                .filter(|p| matches!(p.policy, Policy::FaultFree | Policy::Bare))
                .flat_map(|p| p.tasks.iter().map(move |t| (p.policy, t)))
                .filter(|(_, t)| t.run.failed_commands > 0 || t.run.error.is_some())
                .map(move |(policy, t)| {
                    let first = t.run.first_failure.as_deref().unwrap_or("").replace('\n', " ");
                    let stopped = match &t.run.error {
                        Some(e) => format!(
                            " (the run stopped, left out of end to end: {})",
                            e.replace('\n', " ")
                        ),
                        None => String::new(),
                    };
                    format!(
                        "- {} sandboxes, {}, {}: {} commands; first: {first}{stopped}",
                        point.sandboxes,
                        policy.name(),
                        t.task,
                        t.run.failed_commands
                    )
                })
        })
        .collect();
    if !failing.is_empty() {
        let _ = writeln!(
            md,
            "\nCommands that failed in a fault-free or bare run (a state the others are held to; on a loaded host a command can \
             outlive its limit):\n\n{}",
            failing.join("\n")
        );
    }
    let _ = writeln!(md, "\nScaling (least squares over N):\n");
    for p in policies_in(&rows) {
        let (what, line) = match p {
            Policy::Bare => ("mean task time", fit(&series(&rows, p, |r| r.task_secs))),
            _ => ("e2e vs bare", fit(&series(&rows, p, |r| r.e2e))),
        };
        let text = match (p, line) {
            (_, None) => "fewer than two densities: no line".to_owned(),
            (Policy::Bare, Some((a, b))) => format!("{a:.2} s + {b:.3} s per sandbox"),
            (_, Some((a, b))) => format!(
                "{a:.3}x + {:.4}x per sandbox ({:+.2}% per 8 sandboxes)",
                b,
                b * 800.0
            ),
        };
        let _ = writeln!(md, "- {} ({what}): {text}", p.name());
    }
    let _ = writeln!(md);
    if let Some(pic) = picture {
        let _ = writeln!(md, "![{pic}]({pic})\n");
    }
    md
}

/// Every crashed task whose recovery was not state-correct: sandboxes at
/// once, policy, task, verdict.
pub fn not_correct(points: &[Point]) -> Vec<(usize, Policy, String, Verdict)> {
    let mut out = Vec::new();
    for (point, round) in points
        .iter()
        .flat_map(|point| point.rounds.iter().map(move |r| (point, r)))
    {
        let Some(reference) = round.iter().find(|p| p.policy == Policy::FaultFree) else {
            continue;
        };
        for p in round {
            for t in &p.tasks {
                let Some(r) = reference.tasks.iter().find(|r| r.task == t.task) else {
                    continue;
                };
                let v = verdict(t, r);
                if matches!(v, Verdict::Incorrect(_) | Verdict::Failed(_)) {
                    out.push((point.sandboxes, p.policy, t.task.clone(), v));
                }
            }
        }
    }
    out
}

/// The density study as JSON, with the densities whose run failed.
pub fn json(points: &[Point], errors: &[(usize, String)]) -> serde_json::Value {
    let rows: Vec<_> = rows(points)
        .iter()
        .map(|r| {
            json!({
                "sandboxes": r.sandboxes,
                "policy": r.policy.name(),
                "e2e": r.e2e,
                "e2e_low": r.e2e_spread.0,
                "e2e_high": r.e2e_spread.1,
                "rounds": r.rounds,
                "host_cpu_seconds": r.host_cpu_secs,
                "crab_cpu_seconds": r.cpu_secs[0],
                "containerd_cpu_seconds": r.cpu_secs[1],
                "harness_cpu_seconds": r.cpu_secs[2],
                "share_p95": r.share_p95,
                "task_seconds": r.task_secs,
                "command_seconds": r.phases.commands,
                "llm_seconds": r.phases.llm,
                "recovery_seconds": r.phases.recovery,
                "correct": r.correct,
                "crashed": r.crashed,
                "bytes": r.bytes,
            })
        })
        .collect();
    let wrong: Vec<_> = not_correct(points)
        .into_iter()
        .map(|(n, p, task, v)| {
            json!({"sandboxes": n, "policy": p.name(), "task": task, "verdict": v.word(), "why": v.why()})
        })
        .collect();
    let errors: Vec<_> = errors
        .iter()
        .map(|(n, why)| json!({"sandboxes": n, "error": why}))
        .collect();
    // Every task's timeline, for a step-by-step comparison of policies.
    let mut tasks = Vec::new();
    for point in points {
        for (round, runs) in point.rounds.iter().enumerate() {
            for p in runs {
                for t in &p.tasks {
                    let mut task = super::report::timeline_json(t);
                    task["sandboxes"] = json!(point.sandboxes);
                    task["round"] = json!(round + 1);
                    task["policy"] = json!(p.policy.name());
                    tasks.push(task);
                }
            }
        }
    }
    json!({ "rows": rows, "not_correct": wrong, "errors": errors, "tasks": tasks })
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;
    use crate::eval::workload::{Image, Step};

    fn task(name: &str) -> Task {
        task_of(name, Mix::Terminal)
    }

    fn task_of(name: &str, mix: Mix) -> Task {
        Task {
            name: name.into(),
            mix,
            image: Image::Terminal,
            cwd: "/work".into(),
            dirs: vec!["/work".into()],
            ignore: Vec::new(),
            probes: Vec::new(),
            steps: vec![Step {
                commands: vec!["true".into()],
                think: Duration::from_millis(10),
            }],
        }
    }

    #[test]
    fn copies_cycle_through_the_tasks_each_under_a_name_of_its_own() {
        let tasks = [task("kv-server"), task("python-repl")];
        let copies = replicate(&tasks, 5);
        let names: Vec<&str> = copies.iter().map(|t| t.name.as_str()).collect();
        assert_eq!(
            names,
            [
                "kv-server",
                "python-repl",
                "kv-server-2",
                "python-repl-2",
                "kv-server-3"
            ]
        );
        assert!(copies.iter().all(|t| t.steps == tasks[0].steps));
        assert!(replicate(&tasks, 0).is_empty());
        // The mixes in turn: 3 SWE tasks and 2 terminal ones, 4 sandboxes.
        let mixed = [
            task_of("s1", Mix::Swe),
            task_of("s2", Mix::Swe),
            task_of("s3", Mix::Swe),
            task("t1"),
            task("t2"),
        ];
        let names: Vec<String> = replicate(&mixed, 7).into_iter().map(|t| t.name).collect();
        assert_eq!(names, ["s1", "t1", "s2", "t2", "s3", "s1-2", "t1-2"]);
        assert!(replicate(&[], 8).is_empty());
    }

    /// `policy`'s run of tasks `a` and `b` taking `secs` each, the CPU
    /// busy `cpu` s.
    fn run(policy: Policy, secs: [f64; 2], cpu: u64) -> PolicyResult {
        let tasks = ["a", "b"]
            .into_iter()
            .zip(secs)
            .map(|(name, secs)| crate::eval::report::TaskResult {
                task: name.into(),
                mix: Mix::Swe,
                fault: None,
                crashes: false,
                run: crate::eval::driver::Run {
                    time: Duration::from_secs_f64(secs),
                    ..Default::default()
                },
                holds: vec![],
                classes: vec![],
            })
            .collect();
        PolicyResult {
            policy,
            tasks,
            bytes: 100,
            classes: [0; 4],
            crabd_peak_kb: 0,
            shim_peak_kb: 0,
            host_cpu: Duration::from_secs(cpu),
            cpu: None,
        }
    }

    #[test]
    fn rounds_rotate_and_hold_each_policy_to_the_mean_fault_free_time() {
        let order = [Policy::FaultFree, Policy::Traced, Policy::Crab];
        assert_eq!(rotated(&order, 0), order);
        assert_eq!(
            rotated(&order, 1),
            [Policy::Traced, Policy::Crab, Policy::FaultFree]
        );
        assert_eq!(rotated(&order, 4), rotated(&order, 1));
        assert!(rotated(&[], 3).is_empty());
        // Task a's fault-free mean is 11 s, b's 20 s.
        let point = Point {
            sandboxes: 32,
            rounds: vec![
                vec![
                    run(Policy::FaultFree, [10.0, 20.0], 100),
                    run(Policy::Crab, [11.0, 22.0], 120),
                ],
                vec![
                    run(Policy::FaultFree, [12.0, 20.0], 110),
                    run(Policy::Crab, [13.2, 20.0], 130),
                ],
            ],
        };
        let rows = rows(&[point]);
        let close = |a: f64, b: f64| (a - b).abs() < 1e-9;
        let free = &rows[0];
        assert_eq!((free.policy, free.rounds), (Policy::FaultFree, 2));
        // (10/11 + 1) / 2 and (12/11 + 1) / 2: the host's own noise.
        assert!(close(free.e2e, 1.0), "{free:?}");
        assert!(close(free.e2e_spread.0, (10.0 / 11.0 + 1.0) / 2.0), "{free:?}");
        assert!(close(free.e2e_spread.1, (12.0 / 11.0 + 1.0) / 2.0), "{free:?}");
        assert!(close(free.host_cpu_secs, 105.0), "{free:?}");
        let crab = &rows[1];
        // Round 1: (1.0 + 1.1) / 2; round 2: (1.2 + 1.0) / 2.
        assert!(
            close(crab.e2e_spread.0, 1.05) && close(crab.e2e_spread.1, 1.1),
            "{crab:?}"
        );
        assert!(close(crab.e2e, 1.075), "{crab:?}");
        assert!(
            close(crab.task_secs, (11.0 + 22.0 + 13.2 + 20.0) / 4.0),
            "{crab:?}"
        );
        assert_eq!(crab.bytes, 100);
        let md = markdown(
            &[Point {
                sandboxes: 32,
                rounds: vec![],
            }],
            None,
            &[],
        );
        assert!(!md.contains("| 32 |"), "no rounds, no rows: {md}");
    }

    #[test]
    fn only_policies_that_checkpoint_or_trace_are_studied_after_the_fault_free_run() {
        let asked = [
            Policy::FaultFree,
            Policy::Traced,
            Policy::Crab,
            Policy::FullCkpt,
            Policy::ChatOnly,
            Policy::ChatFs,
            Policy::Restart,
        ];
        assert_eq!(
            policies(&asked),
            [
                Policy::FaultFree,
                Policy::Bare,
                Policy::Traced,
                Policy::Crab,
                Policy::FullCkpt
            ]
        );
    }

    #[test]
    fn the_bare_run_is_the_time_reference_where_it_ran() {
        let point = Point {
            sandboxes: 16,
            rounds: vec![vec![
                run(Policy::FaultFree, [12.0, 24.0], 0),
                run(Policy::Bare, [10.0, 20.0], 0),
                run(Policy::Crab, [11.0, 22.0], 0),
            ]],
        };
        let rows = rows(&[point]);
        let e2e = |p: Policy| rows.iter().find(|r| r.policy == p).map(|r| r.e2e).unwrap();
        assert!((e2e(Policy::Crab) - 1.1).abs() < 1e-9, "{rows:?}");
        assert!((e2e(Policy::FaultFree) - 1.2).abs() < 1e-9, "{rows:?}");
        assert!((e2e(Policy::Bare) - 1.0).abs() < 1e-9, "{rows:?}");
    }

    #[test]
    fn phases_are_each_kinds_mean_seconds_per_task() {
        use crate::eval::driver::Event;
        let mut a = run(Policy::Crab, [10.0, 10.0], 0).tasks.remove(0);
        let ev = |kind, start, end| Event { kind, start, end };
        a.run.events = vec![
            ev(EventKind::Command(0), 0.0, 2.0),
            ev(EventKind::Turn(0), 2.0, 3.5),
            ev(EventKind::Recovery, 3.5, 3.6),
            ev(EventKind::Command(1), 3.6, 4.6),
        ];
        let b = run(Policy::Crab, [10.0, 10.0], 0).tasks.remove(1);
        let p = phases(&[&a, &b]);
        let close = |x: f64, y: f64| (x - y).abs() < 1e-9;
        assert!(
            close(p.commands, 1.5) && close(p.llm, 0.75) && close(p.recovery, 0.05),
            "{p:?}"
        );
        assert_eq!(phases(&[]), Phases::default());
    }
}
