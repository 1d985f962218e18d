//! Turn ends: a sandbox's proxy (in its shim) reports that turn N ended and
//! holds that turn's answer until crabd answers. crabd queues the turn's
//! checkpoint in the host's queue (due when the proxy expects the answer),
//! asks the inspector for the class once the checkpoint has its slot (so
//! the class covers every change up to the capture), makes a version of
//! that class (a manifest line only for `none`), and the answer releases
//! the agent.
//!
//! Turn ends of one sandbox merge: while its checkpoint waits for a slot,
//! later turn ends join it, and the one version answers them all. A turn
//! end that a rollback overtook (it arrived before or during the rollback
//! and its checkpoint had not started) gets no version and is refused as
//! `superseded`: the state it ended on is gone.
//!
//! Invariants: a turn end names its sandbox by exact id; it is never
//! resolved as a prefix, so it cannot checkpoint another sandbox. Every
//! turn end is answered once: with a version, or with an error.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use crab_api::crabd::{CheckpointReport, Registration, TurnAnswered, TurnEnd, TurnReport};
use crab_api::SandboxId;
use parking_lot::Mutex;
use tokio::sync::oneshot;
use tokio::time::Instant;
use tracing::Instrument;

use super::metrics::Metrics;
use super::{ApiError, Daemon};

/// Turn ends of one sandbox that may wait at once; more are refused
/// (`busy`): a sandbox flooding its proxy cannot grow crabd without bound.
const MAX_WAITING: usize = 256;

/// What a turn end is answered with.
type Answer = Result<(CheckpointReport, TurnReport), Arc<ApiError>>;

/// The turn ends of every sandbox that wait for their version.
#[derive(Debug, Default)]
pub(super) struct TurnQueue {
    sandboxes: Mutex<HashMap<SandboxId, Turns>>,
}

#[derive(Debug, Default)]
struct Turns {
    waiting: Vec<Waiter>,
    /// Whether a task is making this sandbox's turn versions.
    leader: bool,
    /// Bumped by every rollback: a waiter of an older epoch is superseded.
    epoch: u64,
    /// Whether a rollback is running.
    rolling_back: bool,
}

#[derive(Debug)]
struct Waiter {
    end: TurnEnd,
    epoch: u64,
    deadline: Instant,
    tx: oneshot::Sender<Answer>,
}

// === impl TurnQueue ===

impl TurnQueue {
    /// A rollback of `id` starts: the turn ends waiting now will get no
    /// version, nor will those that arrive until [`TurnQueue::rolled_back`].
    pub(super) fn rolling_back(&self, id: &SandboxId) {
        let mut all = self.sandboxes.lock();
        let t = all.entry(id.clone()).or_default();
        t.epoch += 1;
        t.rolling_back = true;
    }

    /// How many turn ends of `id` wait.
    #[cfg(test)]
    pub(super) fn n_waiting(&self, id: &SandboxId) -> usize {
        self.sandboxes.lock().get(id).map_or(0, |t| t.waiting.len())
    }

    /// Forgets `id` (its history is gone), unless turn ends still wait.
    pub(super) fn forget(&self, id: &SandboxId) {
        let mut all = self.sandboxes.lock();
        if all.get(id).is_some_and(|t| t.waiting.is_empty() && !t.leader) {
            all.remove(id);
        }
    }

    /// The rollback of `id` ended.
    pub(super) fn rolled_back(&self, id: &SandboxId) {
        if let Some(t) = self.sandboxes.lock().get_mut(id) {
            t.rolling_back = false;
        }
    }

    /// The earliest deadline of `id`'s waiting turn ends; when none waits,
    /// the leader steps down (in the same lock: a turn end that arrives
    /// after starts a new leader).
    fn deadline_or_step_down(&self, id: &SandboxId) -> Option<Instant> {
        let mut all = self.sandboxes.lock();
        let t = all.get_mut(id)?;
        let deadline = t.waiting.iter().map(|w| w.deadline).min();
        if deadline.is_none() {
            t.leader = false;
        }
        deadline
    }

    /// Takes `id`'s waiting turn ends, split into current ones and ones a
    /// rollback superseded.
    fn take(&self, id: &SandboxId) -> (Vec<Waiter>, Vec<Waiter>) {
        let mut all = self.sandboxes.lock();
        let Some(t) = all.get_mut(id) else {
            return (Vec::new(), Vec::new());
        };
        let epoch = t.epoch;
        std::mem::take(&mut t.waiting)
            .into_iter()
            .partition(|w| w.epoch == epoch)
    }
}

// === impl Daemon ===

impl Daemon {
    /// Makes the version of turn `end` of sandbox `id`; returns once it is
    /// published (or refuses; the proxy then releases the answer anyway and
    /// records the failure).
    pub(super) async fn turn_ended(
        self: &Arc<Self>,
        id: &SandboxId,
        end: TurnEnd,
    ) -> Result<CheckpointReport, ApiError> {
        let reg = self.registry.resolve_exact(id)?;
        let expected = end
            .expected_answer_ms
            .unwrap_or(self.config.schedule.default_answer_ms);
        let (tx, rx) = oneshot::channel();
        let lead = {
            let mut all = self.turns.sandboxes.lock();
            let t = all.entry(reg.id.clone()).or_default();
            if t.waiting.len() >= MAX_WAITING {
                self.metrics.skipped_turns.inc();
                return Err(ApiError::TooManyTurns {
                    id: reg.id.clone(),
                    waiting: t.waiting.len(),
                });
            }
            if t.rolling_back {
                self.metrics.skipped_turns.inc();
                return Err(ApiError::Superseded {
                    id: reg.id.clone(),
                    turn: end.turn,
                    why: "a rollback of the sandbox is running",
                });
            }
            t.waiting.push(Waiter {
                end,
                epoch: t.epoch,
                deadline: Instant::now() + Duration::from_millis(expected),
                tx,
            });
            !std::mem::replace(&mut t.leader, true)
        };
        if lead {
            let d = self.clone();
            let span = tracing::info_span!("turns", sandbox = %reg.id);
            tokio::spawn(async move { d.lead_turns(reg).await }.instrument(span));
        }
        match rx.await {
            Ok(Ok((report, _))) => Ok(report),
            Ok(Err(e)) => Err(ApiError::Shared(e)),
            Err(_) => Err(ApiError::Io {
                op: "make the turn's version",
                source: std::io::Error::other("crabd's turn task ended without an answer"),
            }),
        }
    }

    /// Ends sandbox `sel`'s current turn by hand: makes its version, of the
    /// class the inspector chose, and answers the inspector's report.
    pub(super) async fn end_turn_by_hand(
        self: &Arc<Self>,
        sel: &crab_api::SandboxSelector,
    ) -> Result<TurnReport, ApiError> {
        let reg = self.registry.resolve(sel)?;
        if !self.inspection.loaded() {
            return Err(ApiError::NoInspector);
        }
        let d = self.clone();
        super::work::detached(async move {
            let busy = d.busy(&reg.id);
            let _one_at_a_time = busy.lock().await;
            let slot = d.scheduler.admit(&reg.id, Instant::now()).await;
            Ok(d.turn_version(&reg, None, slot).await?.1)
        })
        .await
    }

    /// Turn `turn` of sandbox `id` has its answer waiting on its version:
    /// the sandbox's queued checkpoint, if any, goes first.
    pub(super) fn turn_answered(&self, id: &SandboxId, turn: u64) -> Result<TurnAnswered, ApiError> {
        let reg = self.registry.resolve_exact(id)?;
        let promoted = self.scheduler.promote(&reg.id);
        tracing::debug!(sandbox = %reg.id, turn, promoted, "answer waits on its version");
        Ok(TurnAnswered { promoted })
    }

    /// Makes versions of `reg`'s waiting turn ends until none waits.
    async fn lead_turns(self: Arc<Self>, reg: Registration) {
        loop {
            let busy = self.busy(&reg.id);
            let _one_at_a_time = busy.lock().await;
            let Some(deadline) = self.turns.deadline_or_step_down(&reg.id) else {
                return;
            };
            let slot = self.scheduler.admit(&reg.id, deadline).await;
            // Everything that waits now is covered by this capture.
            let (current, stale) = self.turns.take(&reg.id);
            self.answer_stale(&reg.id, stale);
            let Some(newest) = current.iter().map(|w| w.end).max_by_key(|e| e.turn) else {
                drop(slot);
                continue;
            };
            if current.len() > 1 {
                self.metrics.merged_turns.inc_by(current.len() as u64 - 1);
            }
            let end = TurnEnd {
                transcript_turns: current.iter().map(|w| w.end.transcript_turns).max().unwrap_or(0),
                ..newest
            };
            let answer = self.turn_version(&reg, Some(end), slot).await.map_err(Arc::new);
            if answer.is_err() {
                self.metrics.skipped_turns.inc_by(current.len() as u64);
            }
            self.answer_all(current, answer);
        }
    }

    /// Classifies the turn that ends now and makes its version. The
    /// inspector forgets what it saw once asked: when the capture then
    /// fails, the sandbox loses its head, so its next version is whole
    /// and no change goes unsaved.
    async fn turn_version(
        self: &Arc<Self>,
        reg: &Registration,
        end: Option<TurnEnd>,
        slot: super::schedule::Slot,
    ) -> Result<(CheckpointReport, TurnReport), ApiError> {
        let report = self.classify(&reg.id).await?;
        match self.capture(reg, report.class, end, slot).await {
            Ok(version) => Ok((version, report)),
            Err(e) => {
                let store = self.store.clone();
                let sid = reg.id.clone();
                if let Err(e) = super::work::blocking(move || store.set_head(&sid, None)).await {
                    tracing::warn!(sandbox = %reg.id, error = %crab_api::error_chain(&e), "head not cleared after a failed turn version");
                }
                Err(e)
            }
        }
    }

    /// Asks the inspector what sandbox `id` changed since its last version.
    async fn classify(self: &Arc<Self>, id: &SandboxId) -> Result<TurnReport, ApiError> {
        let d = self.clone();
        let sid = id.clone();
        let started = std::time::Instant::now();
        let report = tokio::task::spawn_blocking(move || d.inspection.turn_end(&sid)).await?;
        self.metrics
            .inspector_decision
            .observe(started.elapsed().as_secs_f64());
        self.metrics
            .turns
            .get_or_create(&Metrics::class(report.class))
            .inc();
        tracing::info!(class = %report.class, reasons = report.reasons.len(), "turn classified");
        Ok(report)
    }

    fn answer_all(&self, waiters: Vec<Waiter>, answer: Answer) {
        for w in waiters {
            // The proxy may have given up (its hold timeout): nothing to tell.
            let _ = w.tx.send(answer.clone());
        }
    }

    fn answer_stale(&self, id: &SandboxId, stale: Vec<Waiter>) {
        for w in stale {
            self.metrics.skipped_turns.inc();
            let _ = w.tx.send(Err(Arc::new(ApiError::Superseded {
                id: id.clone(),
                turn: w.end.turn,
                why: "a rollback of the sandbox came first",
            })));
        }
    }
}
