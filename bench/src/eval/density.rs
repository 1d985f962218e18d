//! The density study of `crab-bench eval --density 8,16,32`: the run's
//! tasks copied until there are N, all N sandboxes at once on one host,
//! under the fault-free run, `traced` (the inspector attached, nothing
//! else) and each policy that checkpoints (crab, full-ckpt), one seeded
//! crash per copy as in the main run for those. A policy's
//! end-to-end figure at N is against the fault-free run at the same N, so
//! it shows what checkpointing adds on a loaded host, not the load itself;
//! the fault-free task time says what the load is. The scaling law is a
//! least-squares line through each policy's figures over N.

use std::fmt::Write as _;

use serde_json::json;

use super::policy::Policy;
use super::report::{summarize, verdict, PolicyResult, Verdict};
use super::workload::{Mix, Task};
use crate::stats::fit;

/// Every policy's run with `sandboxes` at once.
#[derive(Debug)]
pub struct Point {
    /// Sandboxes at once.
    pub sandboxes: usize,
    /// The fault-free run first, then each policy's.
    pub results: Vec<PolicyResult>,
}

/// One policy's figures at one density.
#[derive(Debug, Clone, PartialEq)]
pub struct Row {
    /// Sandboxes at once.
    pub sandboxes: usize,
    /// The policy.
    pub policy: Policy,
    /// Mean of each task's time over its fault-free time at this density.
    pub e2e: f64,
    /// p95 over tasks of holds as a share of task time.
    pub share_p95: f64,
    /// Mean task time, seconds.
    pub task_secs: f64,
    /// Crashed tasks recovered correctly, and crashed tasks.
    pub correct: usize,
    /// See `correct`.
    pub crashed: usize,
    /// Checkpoint bytes written.
    pub bytes: u64,
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

/// The policies of the density study among `asked`: fault-free first,
/// then those that checkpoint or trace (what density can slow down).
pub fn policies(asked: &[Policy]) -> Vec<Policy> {
    let mut out = vec![Policy::FaultFree];
    out.extend(
        asked
            .iter()
            .copied()
            .filter(|p| p.checkpoints() || *p == Policy::Traced),
    );
    out
}

/// Every policy's figures at every density, in order.
pub fn rows(points: &[Point]) -> Vec<Row> {
    let mut rows = Vec::new();
    for point in points {
        let Some(reference) = point.results.iter().find(|p| p.policy == Policy::FaultFree) else {
            continue;
        };
        for p in &point.results {
            let s = summarize(p, reference);
            let times: Vec<f64> = p.tasks.iter().map(|t| t.run.time.as_secs_f64()).collect();
            rows.push(Row {
                sandboxes: point.sandboxes,
                policy: p.policy,
                e2e: s.e2e,
                share_p95: s.share[1],
                task_secs: mean(&times),
                correct: s.correct,
                crashed: s.crashed,
                bytes: p.bytes,
            });
        }
    }
    rows
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
         figure is against the fault-free run at the same N (what checkpointing adds on that load), the fault-free \
         task time shows the load itself. Target: crab ≤ 1.05x at 32 sandboxes.\n"
    );
    let _ = writeln!(
        md,
        "| sandboxes | policy | recovery correct | e2e vs fault-free | held share p95 | mean task s | checkpoint MB |"
    );
    let _ = writeln!(md, "|---|---|---|---|---|---|---|");
    for r in &rows {
        let correct = match r.crashed {
            0 => "-".to_owned(),
            n => format!("{}/{n}", r.correct),
        };
        let _ = writeln!(
            md,
            "| {} | {} | {correct} | {:.3}x | {:.3}% | {:.1} | {:.1} |",
            r.sandboxes,
            r.policy.name(),
            r.e2e,
            r.share_p95 * 100.0,
            r.task_secs,
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
                .results
                .iter()
                .filter(|p| p.policy == Policy::FaultFree)
                .flat_map(|p| &p.tasks)
                .filter(|t| t.run.failed_commands > 0)
                .map(move |t| {
                    let first = t.run.first_failure.as_deref().unwrap_or("").replace('\n', " ");
                    format!(
                        "- {} sandboxes, {}: {} commands; first: {first}",
                        point.sandboxes, t.task, t.run.failed_commands
                    )
                })
        })
        .collect();
    if !failing.is_empty() {
        let _ = writeln!(
            md,
            "\nCommands that failed in a fault-free run (a state the others are held to; on a loaded host a command can \
             outlive its limit):\n\n{}",
            failing.join("\n")
        );
    }
    let _ = writeln!(md, "\nScaling (least squares over N):\n");
    for p in policies_in(&rows) {
        let (what, line) = match p {
            Policy::FaultFree => ("mean task time", fit(&series(&rows, p, |r| r.task_secs))),
            _ => ("e2e vs fault-free", fit(&series(&rows, p, |r| r.e2e))),
        };
        let text = match (p, line) {
            (_, None) => "fewer than two densities: no line".to_owned(),
            (Policy::FaultFree, Some((a, b))) => format!("{a:.2} s + {b:.3} s per sandbox"),
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
    for point in points {
        let Some(reference) = point.results.iter().find(|p| p.policy == Policy::FaultFree) else {
            continue;
        };
        for p in &point.results {
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
                "share_p95": r.share_p95,
                "task_seconds": r.task_secs,
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
    json!({ "rows": rows, "not_correct": wrong, "errors": errors })
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
            [Policy::FaultFree, Policy::Traced, Policy::Crab, Policy::FullCkpt]
        );
    }
}
