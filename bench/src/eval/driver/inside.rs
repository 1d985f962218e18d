//! `--agent-inside`: the agent is the sandbox's own process (`agent.py`),
//! its memory and shell checkpointed with the sandbox. The driver plays
//! its LLM: each request (turn `t` ends step `t - 2`; turn 1 asks for the
//! first step) is answered with the next step's commands after the step's
//! think time. The driver sees where the agent is only through what it
//! asks, so it captures states while a request waits: the fault-free run
//! at every turn, the others at the first request after a recovery (the
//! state the recovered agent stands on, with nothing of it running) and
//! at the end. A request the proxy answers from the transcript (a
//! restored agent asking a turn again) never reaches the driver.

use std::sync::mpsc::Receiver;
use std::time::{Duration, Instant, SystemTime};

use anyhow::{bail, Context};
use serde_json::json;

use super::super::fault::{Fault, Phase};
use super::super::policy::{Fresh, Policy, Recovery};
use super::super::sandbox::{self, COMMAND_LIMIT};
use super::super::state::State;
use super::{Agent, EventKind, Recovered, RECOVERY_LIMIT};
use crate::eval::agent_llm::Ask;

/// A recovery whose state is captured at the agent's next request.
struct Pending {
    /// When the kill was, from the task's start.
    killed: f64,
    /// From the kill to a sandbox that runs again.
    took: Duration,
    /// The version restored (crab's policies).
    version: Option<u64>,
    /// The step the recovery claims (a fresh sandbox's); for a restore,
    /// the agent's next request says where it stands.
    claim: Option<isize>,
    /// The step whose end the restored state is.
    from: isize,
    /// The step the conversation had seen when the sandbox was killed.
    seen: isize,
}

impl Agent<'_> {
    /// The task with its agent inside the sandbox, until the agent is told
    /// it is done and its end state is captured.
    pub(super) fn run_inside(&mut self, asks: &Receiver<Ask>) -> anyhow::Result<()> {
        let policy = self.setup.policy;
        let steps = self.task.steps.len();
        let fault = self.setup.fault.filter(|_| policy.crashes());
        let mut crashed = false;
        let mut pending: Option<Pending> = None;
        // Where a fresh agent starts (chat-only, chat+fs, restart).
        let mut resume: Option<usize> = None;
        // When the sandbox was last killed: what its agent sent before
        // is not the restored agent's.
        let mut killed: Option<SystemTime> = None;
        // The step whose commands the agent runs now, and since when.
        let mut running: Option<(usize, f64)> = None;
        // The last step whose statuses were counted.
        let mut counted: isize = -1;
        loop {
            let ask = self.next_ask(asks, killed)?;
            let done = ask.turn as isize - 2;
            if done >= steps as isize {
                bail!("the agent asked turn {}, past the task's end", ask.turn);
            }
            if let Some((step, begun)) = running.take() {
                if step as isize == done {
                    self.event(EventKind::Command(step), begun);
                }
            }
            if done > counted {
                self.count_failures(done, &ask.statuses);
                counted = done;
            }
            if policy == Policy::FaultFree {
                self.capture_ref(done)?;
            }
            if policy == Policy::ChatFs && done >= 0 {
                self.save_files(done)?;
            }
            if let Some(p) = pending.take() {
                let t = Instant::now();
                let state = State::capture(self.setup.ctd, &self.id, self.task)?;
                self.captures += t.elapsed();
                let at = p.claim.unwrap_or(done);
                self.run.recovered = Some(Recovered {
                    at,
                    state,
                    took: p.took,
                    version: p.version,
                    replayed: (p.seen - p.claim.unwrap_or(p.from)).max(0) as usize,
                });
                self.run.events.push(super::Event {
                    kind: EventKind::Recovery,
                    start: p.killed,
                    end: p.killed + p.took.as_secs_f64(),
                });
            }
            // A crash due in this turn: while the checkpoint runs, or
            // while the LLM thinks.
            let due = fault.filter(|f| !crashed && f.step as isize == done && f.phase != Phase::Command);
            if let Some(f) = due {
                let begun = self.now();
                let init = sandbox::Init::of(self.setup.ctd, &self.id)?;
                std::thread::sleep(f.after);
                init.kill()?;
                init.wait_gone();
                killed = Some(SystemTime::now());
                drop(ask);
                self.event(EventKind::Turn(f.step), begun);
                crashed = true;
                pending = Some(self.recover_inside(f, &mut resume)?);
                continue;
            }
            // A fresh agent's first request: it goes on where the policy says.
            let next = match ask.turn {
                1 => resume.take().unwrap_or(0),
                _ => (done + 1) as usize,
            };
            if next == steps {
                ask.answer(&json!({"done": true}).to_string());
                break;
            }
            let begun = self.now();
            if done >= 0 {
                std::thread::sleep(self.task.steps[done as usize].think);
            }
            let turn = ask.turn;
            let answered_before = self.answered(turn);
            ask.answer(&json!({"step": next, "commands": self.task.steps[next].commands}).to_string());
            if done >= 0 {
                self.event(EventKind::Turn(done as usize), begun);
                (self.setup.tick)();
            }
            running = Some((next, self.now()));
            let due = fault.filter(|f| !crashed && f.step == next && f.phase == Phase::Command);
            if let Some(f) = due {
                let init = sandbox::Init::of(self.setup.ctd, &self.id)?;
                // Into the commands: once the agent has its answer (the
                // proxy may hold it), which its turn's record says.
                crab_tests::wait_until(RECOVERY_LIMIT.as_secs(), || {
                    (self.answered(turn) > answered_before).then_some(())
                })
                .context("the agent's answer was never recorded")?;
                std::thread::sleep(f.after);
                init.kill()?;
                init.wait_gone();
                killed = Some(SystemTime::now());
                crashed = true;
                pending = Some(self.recover_inside(f, &mut resume)?);
            }
        }
        self.wait_for_the_end()?;
        let t = Instant::now();
        self.run.last = Some(State::capture(self.setup.ctd, &self.id, self.task)?);
        self.captures += t.elapsed();
        Ok(())
    }

    /// How many times the agent's turn `turn` was answered whole, by the
    /// sandbox's transcript (a turn's record is written once its answer is
    /// sent). The agent's turn is the one its request names: the proxy
    /// counts a retry as a turn of its own.
    fn answered(&self, turn: u64) -> usize {
        let path = self.setup.transcripts.join(format!("{}.jsonl", self.id));
        crate::observe::turn_records(&path)
            .iter()
            .filter(|r| agents_turn(r) == Some(turn) && r["response"]["end"] == "complete")
            .count()
    }

    /// The agent's next request, within the time a step of the task may
    /// take; a request sent before the sandbox was `killed` is its dead
    /// agent's, and dropped.
    fn next_ask(&self, asks: &Receiver<Ask>, killed: Option<SystemTime>) -> anyhow::Result<Ask> {
        let most = self
            .task
            .steps
            .iter()
            .map(|s| s.commands.len())
            .max()
            .unwrap_or(0) as u32;
        let limit = COMMAND_LIMIT * (most + 1) + RECOVERY_LIMIT;
        loop {
            let ask = asks
                .recv_timeout(limit)
                .with_context(|| format!("the agent asked nothing for {limit:?}"))?;
            if killed.is_none_or(|k| ask.sent > k) {
                return Ok(ask);
            }
        }
    }

    /// Counts the commands of step `step` that exited non-zero.
    fn count_failures(&self, step: isize, statuses: &[i32]) {
        let Ok(step) = usize::try_from(step) else { return };
        let mut failed = self.failed.lock().expect("failed commands");
        for (command, status) in self.task.steps[step].commands.iter().zip(statuses) {
            if *status != 0 {
                failed.0 += 1;
                failed
                    .1
                    .get_or_insert_with(|| format!("step {step} (exit status {status}): {command:.200}"));
            }
        }
    }

    /// After the kill of `fault`: crabd's recovery (the agent goes on by
    /// itself), or a fresh sandbox whose new agent starts where the policy
    /// says (`resume`).
    fn recover_inside(&mut self, fault: Fault, resume: &mut Option<usize>) -> anyhow::Result<Pending> {
        let killed = self.now();
        let killed_at = Instant::now();
        let killed_wall = std::time::SystemTime::now();
        let seen = fault.agent_at();
        Ok(match self.setup.policy.recovery() {
            Recovery::Automatic { wrong } => {
                let (from, version, running_since) = self.recovered_by_crabd(wrong)?;
                Pending {
                    killed,
                    took: running_since
                        .and_then(|t| t.duration_since(killed_wall).ok())
                        .unwrap_or_else(|| killed_at.elapsed()),
                    version,
                    claim: None,
                    from,
                    seen,
                }
            }
            Recovery::Fresh(fresh) => {
                let at = self.fresh_sandbox(fresh, seen)?;
                // The new agent is told the conversation so far: it goes
                // on after the state the policy claims.
                *resume = Some((at + 1) as usize);
                Pending {
                    killed,
                    took: killed_at.elapsed(),
                    version: None,
                    claim: Some(at),
                    from: at,
                    seen: if fresh == Fresh::FromScratch { -1 } else { seen },
                }
            }
        })
    }

    /// Waits until the agent has its last answer (the proxy may hold it)
    /// and has marked its end.
    fn wait_for_the_end(&self) -> anyhow::Result<()> {
        let ctd = self.setup.ctd;
        crab_tests::wait_until(RECOVERY_LIMIT.as_secs(), || {
            let pid = ctd.task_pid(&self.id)?;
            // Never through a link of the sandbox's (it would resolve on
            // the host).
            let tmp = std::path::PathBuf::from(format!("/proc/{pid}/root/tmp"));
            let real_dir = std::fs::symlink_metadata(&tmp).is_ok_and(|m| m.is_dir());
            (real_dir && std::fs::symlink_metadata(tmp.join("crab-agent.done")).is_ok()).then_some(())
        })
        .context("the agent never marked its end")
    }
}

/// The turn an agent's request names, from its transcript record.
fn agents_turn(record: &serde_json::Value) -> Option<u64> {
    let body = record["request"]["body"]["text"].as_str()?;
    crate::eval::agent_llm::parse(body.as_bytes()).map(|(_, turn, _)| turn)
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    #[test]
    fn a_records_turn_is_the_one_the_agents_request_names() {
        let said = json!({"agent": "a", "turn": 4, "statuses": [0]}).to_string();
        let body = json!({"model": "m", "messages": [{"role": "user", "content": said}]}).to_string();
        // The proxy numbered it 5 (a retry came before).
        let record = json!({"kind": "turn", "turn": 5, "request": {"body": {"text": body}}});
        assert_eq!(super::agents_turn(&record), Some(4));
        assert_eq!(super::agents_turn(&json!({"kind": "turn", "turn": 5})), None);
    }
}
