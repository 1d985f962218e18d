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

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use crab_api::crabd::{CheckpointReport, TurnEnd};
use crab_api::{ClientError, Crabd};
use crab_proxy::{HookError, SandboxId, TurnEndCall, TurnHook, TurnVerdict};

/// A [`TurnHook`] that has crabd checkpoint the sandbox at each turn end.
pub struct EngineHook {
    crabd: Crabd,
    /// The crabd binary to start when nothing listens (`[crabd] autostart`).
    autostart: Option<PathBuf>,
    /// The shim's pods, if the sandbox is a pod's: its pod's members.
    pods: Option<Arc<crate::pod::Pods>>,
}

// === impl EngineHook ===

impl EngineHook {
    /// A hook calling crabd at `socket`, each call limited to `limit`;
    /// when nothing listens there (crabd died or the host restarted it
    /// away), it starts `autostart` and tries again for a few seconds.
    /// `pods`: the shim's pods, when the sandbox is a pod's: each turn end
    /// tells crabd of its pod's members.
    pub fn new(
        socket: &Path,
        limit: Duration,
        autostart: Option<&Path>,
        pods: Option<Arc<crate::pod::Pods>>,
    ) -> Self {
        EngineHook {
            crabd: Crabd::new(socket, limit),
            autostart: autostart.map(ToOwned::to_owned),
            pods,
        }
    }

    /// crabd's answer to `end`, starting crabd once if it is not running
    /// (its registry on disk still knows the sandbox).
    async fn send(&self, sandbox: &SandboxId, end: &TurnEnd) -> Result<CheckpointReport, ClientError> {
        let first = self.crabd.turn_ended(sandbox, end).await;
        let (Err(ClientError::Connect { .. }), Some(binary)) = (&first, &self.autostart) else {
            return first;
        };
        tracing::warn!(%sandbox, turn = end.turn, "crabd is not running: starting it");
        if let Err(e) = crate::control::spawn_crabd(binary) {
            tracing::warn!(binary = %binary.display(), error = %e, "start crabd");
            return first;
        }
        let mut last = first;
        for _ in 0..100 {
            tokio::time::sleep(Duration::from_millis(50)).await;
            last = self.crabd.turn_ended(sandbox, end).await;
            if !matches!(last, Err(ClientError::Connect { .. })) {
                break;
            }
        }
        last
    }
}

#[async_trait]
impl TurnHook for EngineHook {
    async fn turn_ended(&self, call: TurnEndCall<'_>) -> Result<TurnVerdict, HookError> {
        let TurnEndCall {
            sandbox,
            turn,
            branch,
            expected_answer,
            inside,
        } = call;
        // Turn N ends when request N arrives; the gate has made the records
        // of turns 1..N-1 durable before it releases N's answer, so those
        // are the conversation that belongs to this version.
        let (pod_members, members) = self
            .pods
            .as_ref()
            .map(|p| p.turn_view(sandbox.as_str()))
            .unwrap_or_default();
        let end = TurnEnd {
            turn,
            branch,
            inside,
            transcript_turns: turn.saturating_sub(1),
            expected_answer_ms: expected_answer.map(|d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX)),
            pod_members,
            members,
        };
        match self.send(sandbox, &end).await {
            Ok(CheckpointReport {
                rolled_back: Some(r), ..
            }) => Ok(TurnVerdict::RolledBack(r)),
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
                Ok(TurnVerdict::Safe)
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

    async fn answer_released(&self, sandbox: &SandboxId, turn: u64, held: std::time::Duration) {
        let held_ms = held.as_secs_f64() * 1e3;
        if let Err(e) = self.crabd.turn_held(sandbox, turn, held_ms).await {
            tracing::debug!(%sandbox, turn, error = %crab_api::error_chain(&e), "answer held: crabd not told");
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
