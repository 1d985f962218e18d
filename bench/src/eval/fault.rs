//! Where the one crash of a task falls: a seeded turn and a phase of it,
//! the same for every policy of a run.

use std::time::Duration;

/// The part of a turn the init is killed in.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Phase {
    /// While the turn's command runs.
    Command,
    /// Just after the turn ended (the agent asked its LLM): while its
    /// checkpoint runs, for the policies that make one.
    Checkpoint,
    /// Halfway through the LLM's answer.
    LlmWait,
}

/// One crash.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Fault {
    /// The step (0-based) it falls in.
    pub step: usize,
    /// Its phase.
    pub phase: Phase,
    /// How long after the phase began the init is killed.
    pub after: Duration,
}

// === impl Phase ===

impl Phase {
    /// Its name in reports.
    pub fn name(self) -> &'static str {
        match self {
            Phase::Command => "command",
            Phase::Checkpoint => "checkpoint",
            Phase::LlmWait => "llm-wait",
        }
    }
}

// === impl Fault ===

impl Fault {
    /// The crash of a task named `task` of `steps` steps whose step `i`
    /// thinks `think(i)`, for `seed`: a step after the first and before
    /// the last (so there is a state to lose and a turn to finish), and a
    /// phase, uniformly. None for a task of fewer than 3 steps.
    pub fn plan(seed: u64, task: &str, steps: usize, think: impl Fn(usize) -> Duration) -> Option<Fault> {
        if steps < 3 {
            return None;
        }
        let mut rng = fastrand::Rng::with_seed(seed ^ fnv1a(task));
        let step = rng.usize(1..steps - 1);
        let (phase, after) = match rng.u8(0..3) {
            0 => (Phase::Command, Duration::from_millis(rng.u64(5..40))),
            1 => (Phase::Checkpoint, Duration::from_millis(rng.u64(1..15))),
            _ => (Phase::LlmWait, think(step) / 2),
        };
        Some(Fault { step, phase, after })
    }

    /// The last step whose result the agent has seen when the crash hits:
    /// the step before for a crash during a command (its output never
    /// came), the step itself after it (-1: none).
    pub fn agent_at(&self) -> isize {
        match self.phase {
            Phase::Command => self.step as isize - 1,
            Phase::Checkpoint | Phase::LlmWait => self.step as isize,
        }
    }
}

/// FNV-1a of `s`: stable across builds and releases (std's hasher is
/// not), for seeds and cache names.
pub fn fnv1a(s: &str) -> u64 {
    s.bytes().fold(0xcbf2_9ce4_8422_2325, |h, b| {
        (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3)
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    const THINK: fn(usize) -> Duration = |_| Duration::from_secs(2);

    #[test]
    fn a_plan_is_the_same_for_a_seed_and_task_and_inside_the_task() {
        for seed in 0..200 {
            let a = Fault::plan(seed, "django__django-11163", 13, THINK).unwrap();
            assert_eq!(Some(a), Fault::plan(seed, "django__django-11163", 13, THINK));
            assert!((1..12).contains(&a.step), "{a:?}");
            if a.phase == Phase::LlmWait {
                assert_eq!(a.after, Duration::from_secs(1));
            }
        }
        assert_eq!(Fault::plan(1, "t", 2, THINK), None);
        assert_eq!(Fault::plan(1, "t", 3, THINK).unwrap().step, 1);
    }

    #[test]
    fn seeds_spread_the_crash_over_steps_and_phases() {
        let plans: Vec<_> = (0..300)
            .filter_map(|s| Fault::plan(s, "kv-server", 10, THINK))
            .collect();
        for phase in [Phase::Command, Phase::Checkpoint, Phase::LlmWait] {
            let n = plans.iter().filter(|f| f.phase == phase).count();
            assert!(n > 60, "{phase:?}: {n} of 300");
        }
        let steps: std::collections::BTreeSet<_> = plans.iter().map(|f| f.step).collect();
        assert_eq!(steps.len(), 8, "{steps:?}");
        let differ = (0..20).any(|s| Fault::plan(s, "a", 10, THINK) != Fault::plan(s, "b", 10, THINK));
        assert!(differ, "the task name is part of the seed");
    }

    #[test]
    fn the_agent_has_seen_the_step_only_once_its_command_ran() {
        let f = |phase| Fault {
            step: 4,
            phase,
            after: Duration::ZERO,
        };
        assert_eq!(f(Phase::Command).agent_at(), 3);
        assert_eq!(f(Phase::Checkpoint).agent_at(), 4);
        assert_eq!(f(Phase::LlmWait).agent_at(), 4);
    }

    /// The tiny eval test (tests/tests/eval.rs) relies on these: every
    /// crash in a command, at step 2 or later.
    #[test]
    fn seed_2_crashes_the_tiny_evals_tasks_in_late_commands() {
        let plan = |name, steps| {
            Fault::plan(2, name, steps, |_| Duration::from_millis(100))
                .map(|f| (f.step, f.phase))
                .unwrap()
        };
        assert_eq!(
            [
                plan("kv-server", 10),
                plan("python-repl", 9),
                plan("kv-server-2", 10)
            ],
            [(4, Phase::Command), (2, Phase::Command), (8, Phase::Command)]
        );
    }
}
