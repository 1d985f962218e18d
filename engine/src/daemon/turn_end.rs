//! Turn ends: a sandbox's proxy (in its shim) reports that turn N ended and
//! holds that turn's answer until crabd answers. crabd asks the inspector
//! for the turn's class at once: a `none` turn is a manifest line, made
//! without waiting for the host's queue; any other waits for a slot (due
//! when the proxy expects the answer, at once when the proxy says the
//! answer already waits), then the sandbox is captured and the answer
//! releases the agent.
//!
//! Turn ends of one sandbox merge: those that arrive while its checkpoint
//! waits for a slot join it (the inspector is asked again, the larger class
//! wins), and the one version answers them all. A turn end that a rollback
//! overtook (it arrived before or during the rollback and its checkpoint
//! had not started) gets no version and is refused as `superseded`: the
//! state it ended on is gone. Changes made between the inspector's answer
//! and the capture are in the capture and count again in the next turn.
//!
//! Invariants: a turn end names its sandbox by exact id; it is never
//! resolved as a prefix, so it cannot checkpoint another sandbox. Every
//! turn end is answered once: with a version, or with an error.

use std::collections::HashMap;
use std::ops::RangeInclusive;
use std::sync::Arc;
use std::time::Duration;

use crab_api::crabd::{CheckpointReport, EventKind, Registration, TurnAnswered, TurnEnd, TurnReport};
use crab_api::{Class, SandboxId};
use futures_util::FutureExt;
use parking_lot::Mutex;
use tokio::sync::oneshot;
use tokio::time::Instant;
use tracing::Instrument;

use super::metrics::Metrics;
use super::{ApiError, Daemon};

/// Turn ends of one sandbox that may wait at once; more are refused
/// (`busy`): a sandbox flooding its proxy cannot grow crabd without bound.
const MAX_WAITING: usize = 256;

/// The longest answer time a proxy may announce (one hour).
const MAX_EXPECTED_MS: u64 = 3_600_000;

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
    /// The turns of the checkpoint queued for a slot now, if one is.
    queued: Option<RangeInclusive<u64>>,
    /// The newest turn whose answer waits, told before its checkpoint was
    /// queued: that checkpoint is urgent from the start.
    answered: u64,
    /// How many other containers the sandbox's pod had at its last turn
    /// end (for a turn ended by hand and a checkpoint asked for, which no
    /// proxy reports); none before the first.
    pod_members: Option<u32>,
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

    /// How many other containers `id`'s pod had at its last turn end, if
    /// one told.
    fn pod_members(&self, id: &SandboxId) -> Option<u32> {
        self.sandboxes.lock().get(id).and_then(|t| t.pod_members)
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
            // The turns after a restore are numbered again from where it
            // went: an old answer's number must not make them urgent.
            t.answered = 0;
        }
    }

    /// Takes `id`'s waiting turn ends, split into current ones and ones a
    /// rollback superseded; `None` when none waits, and then the leader
    /// steps down (in the same lock: a turn end that arrives after starts a
    /// new leader).
    fn take_or_step_down(&self, id: &SandboxId) -> Option<(Vec<Waiter>, Vec<Waiter>)> {
        let mut all = self.sandboxes.lock();
        let t = all.get_mut(id)?;
        if t.waiting.is_empty() {
            t.leader = false;
            return None;
        }
        let epoch = t.epoch;
        Some(
            std::mem::take(&mut t.waiting)
                .into_iter()
                .partition(|w| w.epoch == epoch),
        )
    }

    /// Takes `id`'s waiting turn ends (the leader holds the sandbox's lock,
    /// so no rollback supersedes them meanwhile).
    fn take_more(&self, id: &SandboxId) -> Vec<Waiter> {
        let mut all = self.sandboxes.lock();
        all.get_mut(id)
            .map(|t| std::mem::take(&mut t.waiting))
            .unwrap_or_default()
    }

    /// `id`'s checkpoint of `turns` waits for a slot (or no longer does,
    /// `None`); whether one of them has its answer waiting already.
    fn set_queued(&self, id: &SandboxId, turns: Option<RangeInclusive<u64>>) -> bool {
        let mut all = self.sandboxes.lock();
        let Some(t) = all.get_mut(id) else {
            return false;
        };
        let urgent = turns.as_ref().is_some_and(|r| *r.start() <= t.answered);
        t.queued = turns;
        urgent
    }

    /// Turn `turn` of `id` has its answer waiting: whether its checkpoint
    /// is queued now (else a later one starts urgent).
    fn answered(&self, id: &SandboxId, turn: u64) -> bool {
        let mut all = self.sandboxes.lock();
        let Some(t) = all.get_mut(id) else {
            return false;
        };
        t.answered = t.answered.max(turn);
        t.queued.as_ref().is_some_and(|r| r.contains(&turn))
    }

    /// `id`'s task started afresh: its turn numbers start again.
    pub(super) fn reset_answered(&self, id: &SandboxId) {
        if let Some(t) = self.sandboxes.lock().get_mut(id) {
            t.answered = 0;
        }
    }

    /// The leader of `id` died: a new turn end starts another; those that
    /// wait are answered with `why`.
    fn abandon(&self, id: &SandboxId) -> Vec<Waiter> {
        let mut all = self.sandboxes.lock();
        let Some(t) = all.get_mut(id) else {
            return Vec::new();
        };
        t.leader = false;
        t.queued = None;
        std::mem::take(&mut t.waiting)
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
            .unwrap_or(self.config.schedule.default_answer_ms)
            .min(MAX_EXPECTED_MS);
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
            t.pod_members = Some(end.pod_members);
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
            tokio::spawn(
                async move {
                    let id = reg.id.clone();
                    let led = std::panic::AssertUnwindSafe(d.clone().lead_turns(reg)).catch_unwind();
                    if led.await.is_err() {
                        tracing::error!(sandbox = %id, "the turn task died: its waiting turn ends get no version");
                        for w in d.turns.abandon(&id) {
                            d.metrics.skipped_turns.inc();
                            let _ = w.tx.send(Err(Arc::new(ApiError::Io {
                                op: "make the turn's version",
                                source: std::io::Error::other("crabd's turn task died"),
                            })));
                        }
                    }
                }
                .instrument(span),
            );
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
            let mut report = d.classify(&reg.id).await?;
            let members = d.pod_members(&reg);
            let class = pod_floor(
                &reg,
                (members, members),
                d.effective_class(&reg, report.class)?,
                &mut report,
            );
            let slot = match class {
                Class::None => None,
                _ => Some(d.scheduler.admit(&reg.id, Instant::now(), true).await),
            };
            d.turn_version(&reg, class, None, slot).await?;
            Ok(report)
        })
        .await
    }

    /// How many other containers `reg`'s pod has, as its last turn end
    /// told; a pod's sandbox whose proxy has told nothing yet (a restarted
    /// crabd, turns not checkpointed) may have some.
    pub(super) fn pod_members(&self, reg: &Registration) -> u32 {
        self.turns
            .pod_members(&reg.id)
            .unwrap_or(u32::from(reg.pod.is_some()))
    }

    /// Turn `turn` of sandbox `id` has its answer waiting on its version:
    /// the sandbox's queued checkpoint, if any, goes first.
    pub(super) fn turn_answered(&self, id: &SandboxId, turn: u64) -> Result<TurnAnswered, ApiError> {
        let reg = self.registry.resolve_exact(id)?;
        let promoted = self.turns.answered(&reg.id, turn) && self.scheduler.promote(&reg.id);
        tracing::debug!(sandbox = %reg.id, turn, promoted, "answer waits on its version");
        Ok(TurnAnswered { promoted })
    }

    /// Makes versions of `reg`'s waiting turn ends until none waits.
    async fn lead_turns(self: Arc<Self>, reg: Registration) {
        loop {
            let busy = self.busy(&reg.id);
            let _one_at_a_time = busy.lock().await;
            let Some((mut current, stale)) = self.turns.take_or_step_down(&reg.id) else {
                return;
            };
            self.answer_stale(&reg.id, stale);
            if current.is_empty() {
                continue;
            }
            let answer = self.batch_version(&reg, &mut current).await.map_err(Arc::new);
            if answer.is_err() {
                // The inspector may have been asked: what it saw must not
                // go unsaved, so the next version is whole.
                self.clear_head(&reg.id).await;
            }
            if current.len() > 1 {
                self.metrics.merged_turns.inc_by(current.len() as u64 - 1);
            }
            if answer.is_err() {
                self.metrics.skipped_turns.inc_by(current.len() as u64);
            }
            for w in &current {
                self.turn_event(&reg.id, w.end.turn, &answer);
            }
            self.answer_all(current, answer);
        }
    }

    /// The one version of the turn ends `batch`, and of those that join it
    /// while it waits for a slot. The caller holds the sandbox's lock.
    async fn batch_version(
        self: &Arc<Self>,
        reg: &Registration,
        batch: &mut Vec<Waiter>,
    ) -> Result<(CheckpointReport, TurnReport), ApiError> {
        let pod = self.follow_members(reg, batch).await?;
        let mut report = self.classify(&reg.id).await?;
        let mut class = self.effective_class(reg, report.class)?;
        class = pod_floor(reg, pod, class, &mut report);
        if !self.config.safety.protected_paths.is_empty() && reg.fs_backend.is_some() {
            // Protected paths are judged on the captured files: every turn
            // captures them, whatever the inspector saw.
            class = class.union(Class::Fs);
        }
        let slot = if class == Class::None {
            None
        } else {
            let turns = batch.iter().map(|w| w.end.turn);
            let queued = turns.clone().min().unwrap_or(0)..=turns.max().unwrap_or(0);
            let urgent = self.turns.set_queued(&reg.id, Some(queued));
            let deadline = batch
                .iter()
                .map(|w| w.deadline)
                .min()
                .unwrap_or_else(Instant::now);
            let slot = self.scheduler.admit(&reg.id, deadline, urgent).await;
            self.turns.set_queued(&reg.id, None);
            // Everything that waits now is covered by this capture.
            let more = self.turns.take_more(&reg.id);
            if !more.is_empty() {
                batch.extend(more);
                let pod = self.follow_members(reg, batch).await?;
                let again = self.classify(&reg.id).await?;
                class = class.union(again.class);
                report.class = report.class.union(again.class);
                report.reasons.extend(again.reasons);
                class = pod_floor(reg, pod, class, &mut report);
            }
            Some(slot)
        };
        if class == Class::Fs && pod.0 > 0 {
            // A files-only version leaves the pod's other containers out:
            // they are asked again now, after the wait for a slot, just
            // before the capture.
            let d = self.clone();
            let sid = reg.id.clone();
            if tokio::task::spawn_blocking(move || d.inspection.members_changed(&sid)).await? {
                class = class.union(Class::Full);
                report.reasons.push(serde_json::json!({
                    "kind": "pod_member",
                    "why": "the pod's other container changed while the version waited for a slot: it is whole",
                }));
                report.n_reasons += 1;
            }
        }
        let newest = newest_end(batch);
        let end = newest.map(|e| TurnEnd {
            transcript_turns: batch.iter().map(|w| w.end.transcript_turns).max().unwrap_or(0),
            ..e.clone()
        });
        let inside = batch.iter().any(|w| w.end.inside);
        let version = match self.turn_version(reg, class, end, slot).await {
            Ok(version) => version,
            Err(e) => match self.unjudged(reg, &report, inside, &e).await {
                Some(verdict) => return Ok((verdict, report)),
                None => return Err(e),
            },
        };
        // Judged on what was captured (static, crabd's own), not on the
        // live tree the sandbox can still change.
        let version = self.enforce(reg, &report, version, inside).await;
        Ok((version, report))
    }

    /// Makes the version of a turn the inspector classified as `class`.
    /// The inspector forgot what it saw once asked: when the capture
    /// fails, the sandbox loses its head, so its next version is whole and
    /// no change goes unsaved.
    async fn turn_version(
        self: &Arc<Self>,
        reg: &Registration,
        class: Class,
        end: Option<TurnEnd>,
        slot: Option<super::schedule::Slot>,
    ) -> Result<CheckpointReport, ApiError> {
        let version = match self.room_for_capture(&reg.id, class).await {
            Ok(()) => self.capture(reg, class, end, slot).await,
            Err(e) => Err(e),
        };
        if version.is_err() {
            self.clear_head(&reg.id).await;
        }
        version
    }

    /// Clears sandbox `id`'s head after a failed turn version (logged when
    /// it cannot). The caller holds the sandbox's lock.
    async fn clear_head(&self, id: &SandboxId) {
        let store = self.store.clone();
        let sid = id.clone();
        if let Err(e) = super::work::blocking(move || store.set_head(&sid, None)).await {
            tracing::warn!(sandbox = %id, error = %crab_api::error_chain(&e), "head not cleared after a failed turn version");
        }
    }

    /// Has the inspector follow the other containers of `reg`'s pod that
    /// the newest turn end of `batch` names; answers how many the pod has,
    /// and of how many it cannot vouch for this turn (those it cannot
    /// follow or sees for the first time: all of them then).
    async fn follow_members(
        self: &Arc<Self>,
        reg: &Registration,
        batch: &[Waiter],
    ) -> Result<(u32, u32), ApiError> {
        let Some(newest) = newest_end(batch) else {
            return Ok((0, 0));
        };
        let (count, members) = (newest.pod_members, newest.members.clone());
        let d = self.clone();
        let sid = reg.id.clone();
        let listed = members.len() == count as usize;
        let known = tokio::task::spawn_blocking(move || d.inspection.follow_members(&sid, &members)).await?;
        Ok((count, if listed && known { 0 } else { count }))
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
        tracing::debug!(reasons = ?report.reasons, "turn classified: why");
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
            let answer = Err(Arc::new(ApiError::Superseded {
                id: id.clone(),
                turn: w.end.turn,
                why: "a rollback of the sandbox came first",
            }));
            self.turn_event(id, w.end.turn, &answer);
            let _ = w.tx.send(answer);
        }
    }

    /// Records how turn `turn` of `id` was answered.
    fn turn_event(&self, id: &SandboxId, turn: u64, answer: &Answer) {
        let kind = match answer {
            Ok((made, report)) => EventKind::Turn {
                turn,
                class: Some(report.class),
                version: Some(made.version.version),
                error: None,
            },
            Err(e) => EventKind::Turn {
                turn,
                class: None,
                version: None,
                error: Some(crab_api::error_chain(&**e)),
            },
        };
        self.log_event(id, kind);
    }
}

/// The turn end of `batch` with the highest turn number.
fn newest_end(batch: &[Waiter]) -> Option<&TurnEnd> {
    batch.iter().map(|w| &w.end).max_by_key(|e| e.turn)
}

/// The class of a version of `reg`'s sandbox, given the inspector's
/// `class`, when its pod has `pod.0` other containers of which the
/// inspector cannot vouch for `pod.1` (see [`pod_whole`]). The reason is
/// added to `report` once.
pub(super) fn pod_floor(reg: &Registration, pod: (u32, u32), class: Class, report: &mut TurnReport) -> Class {
    let (members, unvouched) = pod;
    if unvouched > 0 && !report.reasons.iter().any(|r| r.get("pod_members").is_some()) {
        report.reasons.push(serde_json::json!({
            "pod_members": unvouched,
            "why": "the pod's other containers are not all inspected yet: the version covers them whole",
        }));
        report.n_reasons += 1;
    }
    pod_whole(reg, (members, unvouched), class)
}

/// `class`, for a pod with `pod.0` other containers of which the inspector
/// cannot vouch for `pod.1`: whole when it cannot vouch for one (what it did
/// is unknown, and the shim captures them only with a whole version). A
/// version with a process image of a pod with other containers has a file
/// snapshot too: their parts are named after it.
pub(super) fn pod_whole(reg: &Registration, (members, unvouched): (u32, u32), class: Class) -> Class {
    let whole = match reg.fs_backend {
        Some(_) => Class::Full,
        None => Class::Proc,
    };
    if unvouched > 0 || (members > 0 && class.needs_proc()) {
        return class.union(whole);
    }
    class
}

#[cfg(test)]
mod tests {
    use super::*;

    fn reg(fs: bool) -> Registration {
        serde_json::from_value(serde_json::json!({
            "id": "agent", "namespace": "k8s.io", "containerd": "/c.sock",
            "control": "/ctl.sock", "pid": 1,
            "fs_backend": if fs { serde_json::json!("overlay-copy") } else { serde_json::Value::Null },
        }))
        .unwrap()
    }

    #[test]
    fn a_pod_with_members_gets_whole_versions_and_says_why() {
        let mut report = TurnReport {
            sandbox: SandboxId::new("agent").unwrap(),
            turn: 1,
            class: Class::None,
            reasons: Vec::new(),
            n_reasons: 0,
        };
        let r = reg(true);
        assert_eq!(pod_floor(&r, (0, 0), Class::None, &mut report), Class::None);
        assert!(report.reasons.is_empty());
        // Members the inspector vouches for: the inspector's class, but a
        // process image has a file snapshot beside it (their parts' names).
        assert_eq!(pod_floor(&r, (2, 0), Class::None, &mut report), Class::None);
        assert_eq!(pod_floor(&r, (2, 0), Class::Fs, &mut report), Class::Fs);
        assert_eq!(pod_floor(&r, (2, 0), Class::Proc, &mut report), Class::Full);
        assert!(report.reasons.is_empty());
        // Members it cannot vouch for: whole, and the reason once.
        assert_eq!(pod_floor(&r, (2, 2), Class::None, &mut report), Class::Full);
        assert_eq!(pod_floor(&r, (2, 1), Class::Fs, &mut report), Class::Full);
        assert_eq!(report.n_reasons, 1, "the reason once: {:?}", report.reasons);
        assert_eq!(report.reasons[0]["pod_members"], 2);
        // Without a file backend, whole is the processes.
        assert_eq!(
            pod_floor(&reg(false), (1, 1), Class::None, &mut report),
            Class::Proc
        );
    }
}
