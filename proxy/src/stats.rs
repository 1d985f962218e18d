//! Per-sandbox counters and hold times, read as a [`SandboxStats`] snapshot.

use std::collections::VecDeque;
use std::time::Duration;

use parking_lot::Mutex;
use serde::Serialize;
use tokio::sync::watch;

use crate::outcome::GateOutcome;

/// How many recent turns a snapshot lists.
const RECENT_TURNS: usize = 256;

/// A snapshot of one sandbox's counters.
#[derive(Debug, Clone, Default, Serialize)]
pub struct SandboxStats {
    /// Turn ends seen (live and replayed).
    pub n_turns: u64,
    /// Requests that did not end a turn.
    pub n_aux_requests: u64,
    /// Of which requests on a turn-end route told as side calls.
    pub n_side_calls: u64,
    /// Turns answered from the transcript by a replay.
    pub n_replayed: u64,
    /// Replay divergences reported (409).
    pub n_divergences: u64,
    /// Turns whose hook returned an error.
    pub n_hook_failures: u64,
    /// Turns whose hook did not return within the hook timeout.
    pub n_hook_timeouts: u64,
    /// Turns whose predecessors' records were not durable within the timeout.
    pub n_transcript_timeouts: u64,
    /// Turns released although a record before them could not be written.
    pub n_transcript_failures: u64,
    /// Transcript entries that could not be written.
    pub n_transcript_errors: u64,
    /// Transcript entries dropped because the transcript reached its size
    /// limit.
    pub n_transcript_dropped: u64,
    /// Upstream response bodies currently streaming.
    pub n_open_streams: u64,
    /// Answers held (a hold longer than zero).
    pub n_held: u64,
    /// Sum of all hold times.
    pub hold_total: Duration,
    /// Longest hold.
    pub hold_max: Duration,
    /// The newest turns (at most 256), oldest first.
    pub recent: Vec<TurnHold>,
}

/// The gate's result for one live turn.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct TurnHold {
    /// The turn.
    pub turn: u64,
    /// How long the answer was held after it arrived from upstream.
    pub hold: Duration,
    /// How the gate opened.
    pub outcome: GateOutcome,
}

/// The live counters behind [`SandboxStats`].
#[derive(Debug)]
pub(crate) struct StatsCell {
    inner: Mutex<(SandboxStats, VecDeque<TurnHold>)>,
    open_streams: watch::Sender<u64>,
}

impl Default for StatsCell {
    fn default() -> Self {
        Self {
            inner: Mutex::new(Default::default()),
            open_streams: watch::channel(0).0,
        }
    }
}

impl StatsCell {
    pub(crate) fn snapshot(&self) -> SandboxStats {
        let guard = self.inner.lock();
        let mut s = guard.0.clone();
        s.n_open_streams = *self.open_streams.borrow();
        s.recent = guard.1.iter().copied().collect();
        s
    }

    pub(crate) fn update(&self, f: impl FnOnce(&mut SandboxStats)) {
        f(&mut self.inner.lock().0);
    }

    pub(crate) fn stream_opened(&self) {
        self.open_streams.send_modify(|n| *n += 1);
    }

    pub(crate) fn stream_closed(&self) {
        self.open_streams.send_modify(|n| *n = n.saturating_sub(1));
    }

    /// Resolves when no upstream body is open.
    pub(crate) async fn wait_streams_closed(&self) {
        let mut rx = self.open_streams.subscribe();
        // The sender lives in `self`: wait_for cannot see it closed.
        let _ = rx.wait_for(|n| *n == 0).await;
    }

    pub(crate) fn turn_released(&self, hold: TurnHold) {
        let mut guard = self.inner.lock();
        let (s, recent) = &mut *guard;
        match hold.outcome {
            GateOutcome::Opened => {}
            GateOutcome::HookFailed => s.n_hook_failures += 1,
            GateOutcome::HookTimedOut => s.n_hook_timeouts += 1,
            GateOutcome::TranscriptTimedOut => s.n_transcript_timeouts += 1,
            GateOutcome::TranscriptFailed => s.n_transcript_failures += 1,
            GateOutcome::Cancelled | GateOutcome::RolledBack => {}
        }
        if !hold.hold.is_zero() {
            s.n_held += 1;
        }
        s.hold_total += hold.hold;
        s.hold_max = s.hold_max.max(hold.hold);
        if recent.len() == RECENT_TURNS {
            recent.pop_front();
        }
        recent.push_back(hold);
    }
}
