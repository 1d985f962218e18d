//! The engine's side of the proxy's gate: at each turn end the sandbox's
//! proxy asks crabd (`POST /v1/sandboxes/{id}/turns`, by exact id) to make
//! the turn's version, and holds the turn's answer until crabd has
//! published it.
//!
//! No deadlock with the checkpoint itself: crabd's checkpoint calls back
//! into this shim over the control socket, a separate connection served by
//! a separate task of the same runtime, while the hook only awaits crabd's
//! answer and holds no lock (the container's lock is taken by the control
//! handler alone). The gate bounds the wait (`hold_timeout`) and releases
//! the answer on failure: the agent is never wedged by crabd.

use std::path::Path;
use std::time::Duration;

use async_trait::async_trait;
use crab_api::crabd::TurnEnd;
use crab_api::{ClientError, Crabd};
use crab_proxy::{HookError, SandboxId, TurnHook};

/// A [`TurnHook`] that has crabd checkpoint the sandbox at each turn end.
pub struct EngineHook {
    crabd: Crabd,
}

// === impl EngineHook ===

impl EngineHook {
    /// A hook calling crabd at `socket`, each call limited to `limit`.
    pub fn new(socket: &Path, limit: Duration) -> Self {
        EngineHook {
            crabd: Crabd::new(socket, limit),
        }
    }
}

#[async_trait]
impl TurnHook for EngineHook {
    async fn turn_ended(
        &self,
        sandbox: &SandboxId,
        turn: u64,
        expected_answer: Option<Duration>,
    ) -> Result<(), HookError> {
        // Turn N ends when request N arrives; the gate has made the records
        // of turns 1..N-1 durable before it releases N's answer, so those
        // are the conversation that belongs to this version.
        let end = TurnEnd {
            turn,
            transcript_turns: turn.saturating_sub(1),
            expected_answer_ms: expected_answer.map(|d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX)),
        };
        match self.crabd.turn_ended(sandbox, &end).await {
            Ok(r) => {
                tracing::info!(
                    %sandbox,
                    turn,
                    version = r.version.version,
                    class = %r.version.class,
                    frozen_ms = r.frozen_ms,
                    elapsed_ms = r.total_ms,
                    "turn is a version"
                );
                Ok(())
            }
            // The gate logs the failure (the proxy's `turn hook failed`),
            // with the sandbox and turn, in containerd's log.
            Err(e) => match e {
                ClientError::Connect { .. } | ClientError::Transport { .. } | ClientError::Timeout { .. } => {
                    Err(HookError::Unavailable { source: Box::new(e) })
                }
                ClientError::Refused { .. }
                | ClientError::Decode { .. }
                | ClientError::Local { .. }
                | ClientError::Truncated { .. } => Err(HookError::CheckpointFailed { source: Box::new(e) }),
            },
        }
    }

    async fn answer_waiting(&self, sandbox: &SandboxId, turn: u64) {
        match self.crabd.turn_answered(sandbox, turn).await {
            Ok(r) => tracing::debug!(%sandbox, turn, promoted = r.promoted, "answer waits on its version"),
            Err(e) => {
                tracing::debug!(%sandbox, turn, error = %crab_api::error_chain(&e), "answer waits: crabd not told")
            }
        }
    }
}
