//! The turn-end hook: how the proxy asks the engine whether a turn is safe.

use std::error::Error as StdError;
use std::time::Duration;

use async_trait::async_trait;

use crate::SandboxId;

/// Called once per turn end; returns when the sandbox's state at that turn
/// end is safe (its version is published, or the engine decided `none`).
///
/// The proxy calls it in a task of its own, in parallel with the upstream
/// request, and holds that request's answer until it returns (or until the
/// configured hook timeout). The call is not cancelled when the agent
/// disconnects: the turn did end.
#[async_trait]
pub trait TurnHook: Send + Sync + 'static {
    /// Turn `turn` (numbered from 1 per sandbox) of `sandbox` ended, on
    /// branch `branch` of its conversation (see [`crate::transcript`]); its
    /// answer is expected in about `expected_answer` (the proxy's running
    /// estimate of the sandbox's LLM, once it has seen an answer).
    ///
    /// # Errors
    /// Any [`HookError`]; the proxy then releases the answer anyway and
    /// records the failure (the agent is never wedged by the engine).
    async fn turn_ended(
        &self,
        sandbox: &SandboxId,
        turn: u64,
        branch: u64,
        expected_answer: Option<Duration>,
    ) -> Result<(), HookError>;

    /// Turn `turn`'s answer arrived while [`TurnHook::turn_ended`] had not
    /// returned: the answer is held now, so the engine may hurry. Called at
    /// most once per turn, in a task of its own; its failure is only
    /// logged.
    async fn answer_waiting(&self, _sandbox: &SandboxId, _turn: u64) {}
}

/// Why a [`TurnHook`] could not make a turn safe.
#[derive(Debug, thiserror::Error)]
pub enum HookError {
    /// The engine could not be reached.
    #[error("engine unavailable")]
    Unavailable {
        /// What the transport said.
        #[source]
        source: Box<dyn StdError + Send + Sync>,
    },
    /// The engine was reached but could not make the turn's version.
    #[error("checkpoint of the turn failed")]
    CheckpointFailed {
        /// What the engine said.
        #[source]
        source: Box<dyn StdError + Send + Sync>,
    },
}

/// A hook that makes every turn safe at once (no engine attached).
#[derive(Debug, Clone, Copy)]
pub struct NoopHook;

#[async_trait]
impl TurnHook for NoopHook {
    async fn turn_ended(
        &self,
        _sandbox: &SandboxId,
        _turn: u64,
        _branch: u64,
        _expected_answer: Option<Duration>,
    ) -> Result<(), HookError> {
        Ok(())
    }
}
