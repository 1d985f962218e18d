//! The host's checkpoint queue: every checkpoint of every sandbox takes a
//! slot from one [`Scheduler`] before it freezes its sandbox.
//!
//! - Slots bound how many checkpoints run at once.
//! - A byte budget (a token bucket, bytes per second, a second's worth of
//!   burst) bounds what they write: a slot is given when the bucket holds
//!   what the job is expected to write (what its sandbox's last checkpoint
//!   wrote; the host's average before it has one), which is reserved; when
//!   it ends it pays what it really wrote, and the bucket may go into debt.
//! - Order: urgent jobs first (their turn's answer already arrived and
//!   waits on them), in the order they were promoted; then by deadline (the
//!   turn's predicted answer time), earliest first; then by arrival.
//!
//! Invariant: each sandbox has at most one job queued or running (its
//! turn ends merge before they reach the queue, see `turn_end.rs`), so
//! one sandbox cannot take more than one slot, and a promoted job waits
//! for at most one slot to free.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use crab_api::SandboxId;
use parking_lot::Mutex;
use tokio::sync::oneshot;
use tokio::time::Instant;

use super::metrics::Metrics;

/// How the queue is shaped.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(super) struct Shape {
    /// Checkpoints that run at once (at least 1).
    pub slots: usize,
    /// Bytes per second checkpoints may write; `None` for no budget.
    pub bytes_per_sec: Option<f64>,
}

/// The queue.
#[derive(Debug)]
pub(super) struct Scheduler {
    shape: Shape,
    state: Mutex<State>,
    metrics: Arc<Metrics>,
}

#[derive(Debug)]
struct State {
    running: usize,
    queue: Vec<Waiting>,
    seq: u64,
    tokens: f64,
    refilled: Instant,
    wake_armed: bool,
    /// What each sandbox's last checkpoint wrote.
    last_bytes: HashMap<SandboxId, u64>,
    /// The running average of what a checkpoint writes.
    avg_bytes: Option<f64>,
}

#[derive(Debug)]
struct Waiting {
    seq: u64,
    sandbox: SandboxId,
    deadline: Instant,
    /// When promoted, the promotion's number (earlier promotions first).
    urgent: Option<u64>,
    enqueued: Instant,
    tx: oneshot::Sender<Slot>,
}

/// A slot: the right to run one checkpoint. Dropping it frees the slot.
#[derive(Debug)]
pub(super) struct Slot {
    /// None once released.
    sched: Option<Arc<Scheduler>>,
    sandbox: SandboxId,
    /// Bytes reserved from the budget.
    reserved: f64,
    /// Whether the job was promoted while it waited.
    pub urgent: bool,
    /// How long it waited.
    pub waited: Duration,
}

// === impl Scheduler ===

impl Scheduler {
    /// An empty queue of `shape`.
    pub(super) fn new(shape: Shape, metrics: Arc<Metrics>) -> Arc<Self> {
        let shape = Shape {
            slots: shape.slots.max(1),
            bytes_per_sec: shape.bytes_per_sec.filter(|b| *b > 0.0),
        };
        Arc::new(Scheduler {
            state: Mutex::new(State {
                running: 0,
                queue: Vec::new(),
                seq: 0,
                tokens: shape.bytes_per_sec.unwrap_or(0.0),
                refilled: Instant::now(),
                wake_armed: false,
                last_bytes: HashMap::new(),
                avg_bytes: None,
            }),
            shape,
            metrics,
        })
    }

    /// Waits for a slot for a checkpoint of `sandbox` due at `deadline`;
    /// `urgent` when its turn's answer already waits on it.
    pub(super) async fn admit(
        self: &Arc<Self>,
        sandbox: &SandboxId,
        deadline: Instant,
        urgent: bool,
    ) -> Slot {
        let (tx, rx) = oneshot::channel();
        {
            let mut s = self.state.lock();
            s.seq += 1;
            let seq = s.seq;
            s.queue.push(Waiting {
                seq,
                sandbox: sandbox.clone(),
                deadline,
                urgent: urgent.then_some(seq),
                enqueued: Instant::now(),
                tx,
            });
            self.metrics.queue_depth.set(s.queue.len() as i64);
        }
        self.dispatch();
        // The sender lives in the queue until it is sent on: the receiver
        // never sees it dropped.
        rx.await.expect("a queued job is always given its slot")
    }

    /// How long a capture of `sandbox` should take: its last capture's
    /// bytes (else the host's average) over the byte budget (else over
    /// `fallback_rate` bytes per second).
    pub(super) fn expected_cost(&self, sandbox: &SandboxId, fallback_rate: f64) -> Duration {
        let s = self.state.lock();
        let bytes = match s.last_bytes.get(sandbox) {
            Some(b) => *b as f64,
            None => s.avg_bytes.unwrap_or(0.0),
        };
        let rate = self.shape.bytes_per_sec.unwrap_or(fallback_rate);
        Duration::from_secs_f64(bytes / rate)
    }

    /// Promotes `sandbox`'s queued job, if it has one: its turn's answer
    /// arrived and waits on it. Returns whether one was queued.
    pub(super) fn promote(self: &Arc<Self>, sandbox: &SandboxId) -> bool {
        let promoted = {
            let mut s = self.state.lock();
            s.seq += 1;
            let seq = s.seq;
            match s
                .queue
                .iter_mut()
                .find(|w| w.sandbox == *sandbox && w.urgent.is_none())
            {
                Some(w) => {
                    w.urgent = Some(seq);
                    true
                }
                None => false,
            }
        };
        if promoted {
            self.metrics.urgent_promotions.inc();
            tracing::debug!(%sandbox, "queued checkpoint promoted: its answer waits");
            self.dispatch();
        }
        promoted
    }

    /// Gives free slots to the best waiting jobs, while the budget allows.
    fn dispatch(self: &Arc<Self>) {
        let mut s = self.state.lock();
        self.refill(&mut s);
        while s.running < self.shape.slots && !s.queue.is_empty() {
            let best = (0..s.queue.len())
                .min_by_key(|&i| {
                    let w = &s.queue[i];
                    (w.urgent.is_none(), w.urgent, w.deadline, w.seq)
                })
                .expect("the queue is not empty");
            let reserved = match self.shape.bytes_per_sec {
                Some(rate) => {
                    // A sandbox's first checkpoint is expected to write
                    // what others write on average (nothing before any
                    // wrote): a guess of a whole second's worth would hold
                    // every new sandbox a second.
                    let expected = match s.last_bytes.get(&s.queue[best].sandbox) {
                        Some(b) => *b as f64,
                        None => s.avg_bytes.unwrap_or(0.0),
                    };
                    // Never more than the bucket holds when full.
                    let reserve = expected.min(rate);
                    // A job expected to write nothing never waits for
                    // another's debt.
                    if reserve > 0.0 && s.tokens < reserve {
                        self.arm_wake(&mut s, reserve);
                        break;
                    }
                    s.tokens -= reserve;
                    reserve
                }
                None => 0.0,
            };
            let w = s.queue.swap_remove(best);
            s.running += 1;
            let waited = w.enqueued.elapsed();
            self.metrics.queue_wait.observe(waited.as_secs_f64());
            let slot = Slot {
                sched: Some(self.clone()),
                sandbox: w.sandbox,
                reserved,
                urgent: w.urgent.is_some(),
                waited,
            };
            // A receiver gone (its task ended): the slot was never used.
            if let Err(mut slot) = w.tx.send(slot) {
                slot.sched = None;
                s.running -= 1;
                s.tokens += slot.reserved;
            }
        }
        self.metrics.queue_depth.set(s.queue.len() as i64);
        self.metrics.slots_in_use.set(s.running as i64);
    }

    fn refill(&self, s: &mut State) {
        let Some(rate) = self.shape.bytes_per_sec else {
            return;
        };
        let now = Instant::now();
        let dt = now.saturating_duration_since(s.refilled).as_secs_f64();
        s.tokens = (s.tokens + rate * dt).min(rate);
        s.refilled = now;
    }

    /// Runs [`Scheduler::dispatch`] again when the bucket holds `want`.
    fn arm_wake(self: &Arc<Self>, s: &mut State, want: f64) {
        let Some(rate) = self.shape.bytes_per_sec else {
            return;
        };
        if s.wake_armed {
            return;
        }
        s.wake_armed = true;
        let wait = Duration::from_secs_f64(((want - s.tokens) / rate).max(0.0)) + Duration::from_millis(1);
        let sched = self.clone();
        tokio::spawn(async move {
            tokio::time::sleep(wait).await;
            sched.state.lock().wake_armed = false;
            sched.dispatch();
        });
    }

    fn release(self: &Arc<Self>, sandbox: &SandboxId, reserved: f64, bytes: Option<u64>) {
        {
            let mut s = self.state.lock();
            s.running -= 1;
            if let Some(rate) = self.shape.bytes_per_sec {
                self.refill(&mut s);
                s.tokens = (s.tokens + reserved - bytes.unwrap_or(0) as f64).min(rate);
            }
            if let Some(b) = bytes {
                s.last_bytes.insert(sandbox.clone(), b);
                s.avg_bytes = Some(match s.avg_bytes {
                    Some(avg) => 0.8 * avg + 0.2 * b as f64,
                    None => b as f64,
                });
            }
        }
        self.dispatch();
    }

    /// Forgets what `sandbox`'s checkpoints wrote (it is gone).
    pub(super) fn forget(&self, sandbox: &SandboxId) {
        self.state.lock().last_bytes.remove(sandbox);
    }
}

// === impl Slot ===

impl Slot {
    /// Frees the slot; the job wrote `bytes` (paid from the budget).
    pub(super) fn finish(mut self, bytes: u64) {
        if let Some(sched) = self.sched.take() {
            sched.release(&self.sandbox, self.reserved, Some(bytes));
        }
    }
}

impl Drop for Slot {
    fn drop(&mut self) {
        // The job failed before it published: its reservation goes back.
        if let Some(sched) = self.sched.take() {
            sched.release(&self.sandbox, self.reserved, None);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sched(slots: usize, bytes_per_sec: Option<f64>) -> Arc<Scheduler> {
        Scheduler::new(Shape { slots, bytes_per_sec }, Arc::new(Metrics::new()))
    }

    fn id(s: &str) -> SandboxId {
        SandboxId::new(s).unwrap()
    }

    /// Queues a job of `name` due in `due_ms`; it records its start in
    /// `order`, holds its slot for `hold_ms` and writes `bytes`.
    fn job(
        sched: &Arc<Scheduler>,
        order: &Arc<Mutex<Vec<String>>>,
        name: &str,
        due_ms: u64,
        hold_ms: u64,
        bytes: u64,
    ) -> tokio::task::JoinHandle<()> {
        let (sched, order, name) = (sched.clone(), order.clone(), name.to_owned());
        tokio::spawn(async move {
            let deadline = Instant::now() + Duration::from_millis(due_ms);
            let slot = sched.admit(&id(&name), deadline, false).await;
            order.lock().push(name);
            tokio::time::sleep(Duration::from_millis(hold_ms)).await;
            slot.finish(bytes);
        })
    }

    /// Lets spawned tasks run until they all wait on something.
    async fn settle() {
        for _ in 0..20 {
            tokio::task::yield_now().await;
        }
    }

    #[tokio::test(start_paused = true)]
    async fn deadlines_order_the_queue_and_the_urgent_go_first() {
        let s = sched(1, None);
        let order = Arc::new(Mutex::new(Vec::new()));
        // `a` takes the one slot; the rest queue behind it.
        let mut jobs = vec![job(&s, &order, "a", 0, 100, 0)];
        settle().await;
        for (name, due) in [
            ("late", 9_000),
            ("soon", 1_000),
            ("mid", 5_000),
            ("urgent", 20_000),
        ] {
            jobs.push(job(&s, &order, name, due, 100, 0));
        }
        settle().await;
        assert!(s.promote(&id("urgent")));
        assert!(!s.promote(&id("nobody")));
        for j in jobs {
            j.await.unwrap();
        }
        assert_eq!(*order.lock(), ["a", "urgent", "soon", "mid", "late"]);
        assert_eq!(s.metrics.urgent_promotions.get(), 1);
        assert_eq!(s.metrics.slots_in_use.get(), 0);
        assert_eq!(s.metrics.queue_depth.get(), 0);
    }

    #[tokio::test(start_paused = true)]
    async fn slots_bound_concurrency() {
        let s = sched(2, None);
        let order = Arc::new(Mutex::new(Vec::new()));
        let jobs: Vec<_> = (0..5)
            .map(|i| job(&s, &order, &format!("s{i}"), i, 1_000, 0))
            .collect();
        settle().await;
        assert_eq!(order.lock().len(), 2);
        assert_eq!(s.metrics.slots_in_use.get(), 2);
        let start = Instant::now();
        for j in jobs {
            j.await.unwrap();
        }
        // Five one-second jobs, two at a time: three rounds.
        assert_eq!(start.elapsed().as_secs(), 3);
        assert_eq!(order.lock().len(), 5);
    }

    #[tokio::test(start_paused = true)]
    async fn the_byte_budget_holds_over_a_run() {
        // 1 MB/s and four slots; three sandboxes, ten checkpoints of 1 MB
        // each, instant: the budget, not the slots, sets the pace.
        let s = sched(4, Some(1e6));
        let order = Arc::new(Mutex::new(Vec::new()));
        let start = Instant::now();
        let mut written = 0;
        for round in 0..10 {
            let jobs: Vec<_> = (0..3)
                .map(|i| job(&s, &order, &format!("s{i}"), round, 0, 1_000_000))
                .collect();
            for j in jobs {
                j.await.unwrap();
            }
            written += 3_000_000;
        }
        let secs = start.elapsed().as_secs_f64();
        let rate = written as f64 / secs;
        // A second's burst over a 29 s run: within 10% of the budget.
        assert!(rate <= 1.1e6, "{rate} B/s over {secs} s against 1 MB/s");
        assert!(rate >= 0.9e6, "{rate} B/s over {secs} s: the budget wastes time");
    }

    #[tokio::test(start_paused = true)]
    async fn a_dropped_slot_is_freed() {
        let s = sched(1, None);
        let a = s.admit(&id("a"), Instant::now(), false).await;
        assert_eq!(s.metrics.slots_in_use.get(), 1);
        drop(a);
        assert_eq!(s.metrics.slots_in_use.get(), 0);
        let b = s.admit(&id("b"), Instant::now(), true).await;
        b.finish(0);
    }
}
