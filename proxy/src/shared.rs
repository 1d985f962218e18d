//! The state one sandbox's layers share: its id and config, the hook, the
//! transcript, the counters, its tasks, and the turn counter with the replay
//! under one lock. [`crate::Sandbox`] owns it and stacks the layers over it.

use std::sync::Arc;
use std::time::Duration;

use parking_lot::Mutex;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use crate::config::ProxyConfig;
use crate::hook::TurnHook;
use crate::replay::{Replay, ReplayError, TurnState};
use crate::stats::StatsCell;
use crate::tools::{AgentTools, ToolLimits};
use crate::transcript::Transcript;
use crate::transcript::{read_entries, Entry};
use crate::upstream::UpstreamClient;
use crate::{Error, SandboxId};

/// State shared by a sandbox's layers.
pub(crate) struct Shared {
    /// The sandbox's id.
    pub(crate) id: SandboxId,
    /// The proxy's config.
    pub(crate) config: Arc<ProxyConfig>,
    /// Called on every live turn end.
    pub(crate) hook: Arc<dyn TurnHook>,
    /// The sandbox's transcript writer.
    pub(crate) transcript: Transcript,
    /// The sandbox's live counters.
    pub(crate) stats: Arc<StatsCell>,
    /// The sandbox's tasks (hook calls).
    pub(crate) tracker: TaskTracker,
    /// Cancelled on shutdown: opens every pending gate.
    pub(crate) cancel: CancellationToken,
    /// The proxy's upstream client.
    pub(crate) client: UpstreamClient,
    turns: Mutex<TurnState>,
    /// The running estimate of the time from a turn end to its answer.
    answer_time: Mutex<Option<Duration>>,
    /// The conversations seen, to tell side calls (never across an await).
    pub(crate) conversations: Mutex<crate::side_call::Conversations>,
    /// The engine behind the agent's tool, if there is one.
    pub(crate) tools: Option<Arc<dyn AgentTools>>,
    /// The tool's rate limits and its record of refusals.
    pub(crate) tool_limits: ToolLimits,
    /// The connections the sandbox's listeners hold.
    pub(crate) connections: crate::server::Connections,
}

// === impl Shared ===

impl Shared {
    /// The state of a sandbox just added: its transcript
    /// (`<transcript_dir>/<id>.jsonl`) opened, no turn given out, no replay.
    pub(crate) async fn open(
        id: SandboxId,
        config: Arc<ProxyConfig>,
        hook: Arc<dyn TurnHook>,
        tools: Option<Arc<dyn AgentTools>>,
        client: UpstreamClient,
    ) -> Result<Self, Error> {
        let tracker = TaskTracker::new();
        let stats = Arc::new(StatsCell::default());
        let path = config.transcript_dir.join(format!("{id}.jsonl"));
        let transcript = Transcript::open(path, config.limits.transcript_max_bytes, stats.clone()).await?;
        Ok(Self {
            id,
            config: config.clone(),
            hook,
            transcript,
            stats,
            tracker,
            cancel: CancellationToken::new(),
            client,
            turns: Mutex::new(TurnState::default()),
            answer_time: Mutex::new(None),
            conversations: Mutex::new(Default::default()),
            tool_limits: ToolLimits::new(config.tools.calls_per_minute),
            connections: crate::server::Connections::new(config.limits.max_connections),
            tools,
        })
    }

    /// When a turn's answer is expected, from the answers seen so far.
    pub(crate) fn expected_answer(&self) -> Option<Duration> {
        *self.answer_time.lock()
    }

    /// A turn's answer (its response head) came `took` after its request.
    pub(crate) fn saw_answer(&self, took: Duration) {
        let mut t = self.answer_time.lock();
        *t = Some(match *t {
            // An exponential average: recent turns weigh most.
            Some(avg) => avg.mul_f64(0.7) + took.mul_f64(0.3),
            None => took,
        });
    }

    /// Gives out the next turn number on the current branch.
    pub(crate) fn next_turn(&self) -> crate::replay_layer::Numbered {
        self.with_turns(|t| {
            t.last_turn += 1;
            crate::replay_layer::Numbered {
                turn: t.last_turn,
                branch: t.branch,
            }
        })
    }

    /// Runs `f` on the turn state under its lock (never across an await).
    pub(crate) fn with_turns<R>(&self, f: impl FnOnce(&mut TurnState) -> R) -> R {
        f(&mut self.turns.lock())
    }

    /// Every entry of the transcript, once those submitted so far are on
    /// disk; refused past [`crate::sandbox::MAX_REPLAY_BYTES`] (a sandbox
    /// writes its own transcript, and the shim reads it whole, outside its
    /// memory limit).
    pub(crate) async fn durable_entries(&self) -> Result<Vec<Entry>, Error> {
        // Entries that could not be written are not in the file either way.
        let _ = self.transcript.wait_durable(self.transcript.submitted()).await;
        let path = self.transcript.path().to_owned();
        let bytes = tokio::fs::metadata(&path).await.map_or(0, |m| m.len());
        let limit = crate::sandbox::MAX_REPLAY_BYTES;
        if bytes > limit {
            return Err(ReplayError::TooLarge { bytes, limit }.into());
        }
        Ok(read_entries(&path).await.map_err(ReplayError::from)?)
    }

    /// Arms `replay`: the next requests are answered from it.
    pub(crate) fn start_replay(&self, replay: Replay) {
        let (first, last) = replay.range();
        tracing::info!(sandbox = %self.id, first, last, "replay armed");
        self.with_turns(|state| state.replay = Some(replay));
    }

    /// Answers turns 1..=`until` of the current branch from the transcript
    /// to an agent put back to its start (see `Sandbox::replay`).
    pub(crate) async fn replay_from_start(&self, until: u64) -> Result<(), Error> {
        let entries = self.durable_entries().await?;
        let replay = self.with_turns(|state| Replay::from_start(&entries, until, state))?;
        self.start_replay(replay);
        Ok(())
    }
}
