//! The tasks an evaluation replays: real mini-swe-agent runs (the SWE mix,
//! `bench/eval/swe.toml` over `../shared/traces`) and tasks where process
//! state matters (the terminal mix, `bench/eval/terminal.toml`).

use std::path::Path;
use std::time::Duration;

use anyhow::{bail, Context};
use serde::Deserialize;

/// Which mix a task is of.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mix {
    /// A traced SWE-bench run.
    Swe,
    /// A terminal task.
    Terminal,
}

// === impl Mix ===

impl Mix {
    /// Its name in reports.
    pub fn name(self) -> &'static str {
        match self {
            Mix::Swe => "swe",
            Mix::Terminal => "terminal",
        }
    }
}

/// What the sandbox of a task starts from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Image {
    /// A SWE testbed: `pypi`'s `release` in /testbed, `deps` beside it.
    Swe {
        pypi: String,
        release: String,
        deps: Vec<(String, String)>,
    },
    /// The terminal mix's tools on the development sandbox.
    Terminal,
}

/// One task.
#[derive(Debug, Clone)]
pub struct Task {
    /// Its name (a SWE-bench instance, or a terminal task's).
    pub name: String,
    /// Its mix.
    pub mix: Mix,
    /// What its sandbox starts from.
    pub image: Image,
    /// Where its commands run.
    pub cwd: String,
    /// Directories whose files make its state.
    pub dirs: Vec<String>,
    /// Path components never compared (see the data files).
    pub ignore: Vec<String>,
    /// Commands that print its in-memory state without changing it.
    pub probes: Vec<String>,
    /// Its steps, in order.
    pub steps: Vec<Step>,
}

/// One agent step: commands, then the LLM's next answer.
#[derive(Debug, Clone, PartialEq)]
pub struct Step {
    /// The shell commands, verbatim.
    pub commands: Vec<String>,
    /// How long the LLM thinks after them (scaled).
    pub think: Duration,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct SweFile {
    default: Vec<String>,
    dirs: Vec<String>,
    ignore: Vec<String>,
    project: Vec<Project>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct Project {
    prefix: String,
    pypi: String,
    releases: Vec<(u64, String)>,
    deps: Vec<(String, String)>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct TerminalFile {
    dirs: Vec<String>,
    ignore: Vec<String>,
    task: Vec<TerminalTask>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct TerminalTask {
    name: String,
    cwd: String,
    probes: Vec<String>,
    turns: Vec<Turn>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct Turn {
    think: f64,
    run: String,
}

/// The SWE mix's data file.
pub const SWE_TOML: &str = include_str!("../../eval/swe.toml");

/// Longest think time after scaling: a run must fit the machine.
const MAX_THINK: Duration = Duration::from_secs(30);

/// A traced or written think time, scaled.
fn scaled(secs: f64, scale: f64) -> Duration {
    Duration::from_secs_f64(secs * scale).clamp(Duration::from_millis(20), MAX_THINK)
}

/// The first `n` tasks of the SWE mix's default set (or those named in
/// `names`), from `swe_toml` and the trace file `traces`, each cut to its
/// first `turns` steps (0: all), think times scaled by `scale`.
pub fn swe(
    swe_toml: &str,
    traces: &Path,
    names: &[String],
    n: usize,
    turns: usize,
    scale: f64,
) -> anyhow::Result<Vec<Task>> {
    let file: SweFile = toml::from_str(swe_toml).context("swe.toml")?;
    let wanted: Vec<String> = if names.is_empty() {
        file.default.iter().take(n).cloned().collect()
    } else {
        names.to_vec()
    };
    let text = std::fs::read_to_string(traces).with_context(|| format!("read {}", traces.display()))?;
    let mut tasks = Vec::new();
    for name in &wanted {
        let image = image_of(&file.project, name)?;
        let mut steps = Vec::new();
        for line in text.lines().filter(|l| l.contains(name.as_str())) {
            let v: serde_json::Value = serde_json::from_str(line).context("a trace line")?;
            if v["task"] != name.as_str() {
                continue;
            }
            let commands = v["commands"]
                .as_array()
                .map(|a| a.iter().filter_map(|c| c.as_str().map(str::to_owned)).collect())
                .unwrap_or_default();
            let secs = v["llm_latency_s"]
                .as_f64()
                .or_else(|| v["step_wall_s"].as_f64())
                .unwrap_or(1.0);
            steps.push(Step {
                commands,
                think: scaled(secs, scale),
            });
        }
        if steps.is_empty() {
            bail!("task {name} is not in {}", traces.display());
        }
        if turns > 0 {
            steps.truncate(turns);
        }
        tasks.push(Task {
            name: name.clone(),
            mix: Mix::Swe,
            image,
            cwd: "/testbed".into(),
            dirs: file.dirs.clone(),
            ignore: file.ignore.clone(),
            probes: Vec::new(),
            steps,
        });
    }
    Ok(tasks)
}

/// The image of SWE task `name`: its project's release for its number.
fn image_of(projects: &[Project], name: &str) -> anyhow::Result<Image> {
    let project = projects
        .iter()
        .find(|p| name.starts_with(&p.prefix))
        .with_context(|| format!("no project in swe.toml for task {name}"))?;
    let number: u64 = name
        .rsplit('-')
        .next()
        .and_then(|n| n.parse().ok())
        .with_context(|| format!("task {name} ends in no instance number"))?;
    let release = project
        .releases
        .iter()
        .rev()
        .find(|(first, _)| number >= *first)
        .map(|(_, r)| r.clone())
        .with_context(|| format!("no release of {} for {name}", project.pypi))?;
    Ok(Image::Swe {
        pypi: project.pypi.clone(),
        release,
        deps: project.deps.clone(),
    })
}

/// The first `n` tasks of the terminal mix in `terminal_toml`, cut to
/// `turns` steps (0: all), think times scaled by `scale`.
/// With `names`, those tasks instead of the first `n`.
pub fn terminal(
    terminal_toml: &str,
    names: &[String],
    n: usize,
    turns: usize,
    scale: f64,
) -> anyhow::Result<Vec<Task>> {
    let file: TerminalFile = toml::from_str(terminal_toml).context("terminal.toml")?;
    for name in names {
        if !file.task.iter().any(|t| t.name == *name) {
            bail!("no terminal task {name:?} in terminal.toml");
        }
    }
    Ok(file
        .task
        .into_iter()
        .filter(|t| names.is_empty() || names.contains(&t.name))
        .take(if names.is_empty() { n } else { usize::MAX })
        .map(|t| {
            let mut steps: Vec<Step> = t
                .turns
                .into_iter()
                .map(|turn| Step {
                    commands: vec![turn.run],
                    think: scaled(turn.think, scale),
                })
                .collect();
            if turns > 0 {
                steps.truncate(turns);
            }
            Task {
                name: t.name,
                mix: Mix::Terminal,
                image: Image::Terminal,
                cwd: t.cwd,
                dirs: file.dirs.clone(),
                ignore: file.ignore.clone(),
                probes: t.probes,
                steps,
            }
        })
        .collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    const SWE: &str = include_str!("../../eval/swe.toml");
    const TERMINAL: &str = include_str!("../../eval/terminal.toml");

    #[test]
    fn every_default_swe_task_has_a_release() {
        let file: SweFile = toml::from_str(SWE).unwrap();
        for name in &file.default {
            image_of(&file.project, name).unwrap();
        }
        let release = |n| match image_of(&file.project, n).unwrap() {
            Image::Swe { release, .. } => release,
            Image::Terminal => unreachable!(),
        };
        assert_eq!(release("django__django-11163"), "3.0");
        assert_eq!(release("django__django-13410"), "3.2");
        assert_eq!(release("django__django-14765"), "4.0");
        let err = image_of(&file.project, "sympy__sympy-1").unwrap_err().to_string();
        assert!(err.contains("no project"), "{err}");
    }

    #[test]
    fn traced_steps_are_read_verbatim_and_cut() {
        let dir = std::env::temp_dir().join(format!("crab-eval-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let traces = dir.join("t.jsonl");
        let line = |step: u64, cmd: &str, wall: Option<u64>| {
            serde_json::json!({"task": "django__django-11163", "step": step, "commands": [cmd],
                               "llm_latency_s": null, "step_wall_s": wall})
            .to_string()
        };
        let text = [
            line(0, "ls -R", Some(4)),
            line(1, "cat <<'EOF' > a.py\nx\nEOF", Some(10)),
            line(2, "true", None),
        ]
        .join("\n");
        std::fs::write(&traces, text).unwrap();
        let tasks = swe(SWE, &traces, &[], 1, 2, 0.5).unwrap();
        std::fs::remove_dir_all(&dir).unwrap();
        assert_eq!(tasks.len(), 1);
        let steps = &tasks[0].steps;
        assert_eq!(steps.len(), 2);
        assert_eq!(steps[1].commands, vec!["cat <<'EOF' > a.py\nx\nEOF".to_owned()]);
        assert_eq!(steps[0].think, Duration::from_secs(2));
        assert_eq!(tasks[0].cwd, "/testbed");
    }

    #[test]
    fn every_terminal_task_leaves_state_to_lose() {
        let tasks = terminal(TERMINAL, &[], usize::MAX, 0, 1.0).unwrap();
        assert_eq!(tasks.len(), 6);
        for t in &tasks {
            assert!(t.steps.len() >= 7, "{}", t.name);
            let starts_a_process = t.steps.iter().any(|s| s.commands[0].contains(" &"));
            assert!(starts_a_process, "{} leaves no process running", t.name);
        }
        assert_eq!(terminal(TERMINAL, &[], 2, 3, 0.1).unwrap()[1].steps.len(), 3);
        let named = terminal(TERMINAL, &["local-wheel".to_owned()], 0, 0, 1.0).unwrap();
        assert_eq!(named[0].name, "local-wheel");
        assert!(terminal(TERMINAL, &["nope".to_owned()], 0, 0, 1.0).is_err());
    }
}
