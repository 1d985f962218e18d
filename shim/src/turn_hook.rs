//! The engine's side of the proxy's gate: at each turn end the sandbox's
//! proxy asks crabd (`POST /v1/sandboxes/{id}/turns`) to make the turn's
//! version, and holds the turn's answer until crabd has published it.
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
use crab_engine::api::{CheckpointReport, TurnEnd};
use crab_engine::client::{ClientError, UnixClient};
use crab_proxy::{HookError, SandboxId, TurnHook};

/// A [`TurnHook`] that has crabd checkpoint the sandbox at each turn end.
pub struct EngineHook {
    crabd: UnixClient,
}

// === impl EngineHook ===

impl EngineHook {
    /// A hook calling crabd at `socket`, each call limited to `limit`.
    pub fn new(socket: &Path, limit: Duration) -> Self {
        EngineHook {
            crabd: UnixClient::new(socket, "crabd", limit),
        }
    }
}

#[async_trait]
impl TurnHook for EngineHook {
    async fn turn_ended(&self, sandbox: &SandboxId, turn: u64) -> Result<(), HookError> {
        // Turn N ends when request N arrives; the gate has made the records
        // of turns 1..N-1 durable before it releases N's answer, so those
        // are the conversation that belongs to this version.
        let end = TurnEnd {
            turn,
            transcript_turns: turn.saturating_sub(1),
        };
        let path = format!("/v1/sandboxes/{sandbox}/turns");
        match self.crabd.post::<_, CheckpointReport>(&path, &end).await {
            Ok(r) => {
                log::info!(
                    "{sandbox}: turn {turn} is version {} (frozen {:.1} ms, total {:.1} ms)",
                    r.version.version,
                    r.frozen_ms,
                    r.total_ms
                );
                Ok(())
            }
            Err(e) => {
                // The proxy's own tracing has no subscriber in the shim: say
                // it here, in containerd's log, once per failed turn.
                log::warn!("{sandbox}: turn {turn} has no version, its answer is released: {e}");
                match e {
                    ClientError::Connect { .. }
                    | ClientError::Transport { .. }
                    | ClientError::Timeout { .. } => Err(HookError::Unavailable { source: Box::new(e) }),
                    ClientError::Refused { .. } | ClientError::Decode { .. } | ClientError::Local { .. } => {
                        Err(HookError::CheckpointFailed { source: Box::new(e) })
                    }
                }
            }
        }
    }
}
