//! The turn-end hook: how the proxy asks the engine whether a turn is safe.

use std::error::Error as StdError;
use std::time::Duration;

use async_trait::async_trait;
pub use crab_api::crabd::SafetyRollback;

use crate::SandboxId;

/// What the engine made of a turn end.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum TurnVerdict {
    /// The turn's state is safe (its version is published, or none was
    /// needed): its answer goes to the agent.
    Safe,
    /// The turn broke a safety rule and the sandbox was put back to its
    /// previous version: the agent gets the rollback's notice instead of
    /// the answer.
    RolledBack(SafetyRollback),
}

/// Called once per turn end; returns when the sandbox's state at that turn
/// end is safe (its version is published, or the engine decided `none`).
///
/// The proxy calls it in a task of its own, in parallel with the upstream
/// request, and holds that request's answer until it returns (or until the
/// configured hook timeout). The call is not cancelled when the agent
/// disconnects: the turn did end.
#[async_trait]
pub trait TurnHook: Send + Sync + 'static {
    /// A turn of a sandbox ended (see [`TurnEndCall`]: its number from 1,
    /// its branch of the conversation, see [`crate::transcript`], when its
    /// answer is expected, where its request came from).
    ///
    /// # Errors
    /// Any [`HookError`]; the proxy then releases the answer anyway and
    /// records the failure (the agent is never wedged by the engine).
    async fn turn_ended(&self, end: TurnEndCall<'_>) -> Result<TurnVerdict, HookError>;

    /// Turn `turn`'s answer arrived while [`TurnHook::turn_ended`] had not
    /// returned: the answer is held now, so the engine may hurry. Called at
    /// most once per turn, in a task of its own; its failure is only
    /// logged.
    async fn answer_waiting(&self, _sandbox: &SandboxId, _turn: u64) {}

    /// Turn `turn`'s answer was released after waiting `held` for the
    /// gate (the exposed delay the engine's log and page show). Called
    /// only for an answer that waited, in a task of its own; its failure is
    /// only logged.
    async fn answer_released(&self, _sandbox: &SandboxId, _turn: u64, _held: std::time::Duration) {}
}

/// One turn end, as the hook is told of it.
#[derive(Debug, Clone, Copy)]
pub struct TurnEndCall<'a> {
    /// The sandbox.
    pub sandbox: &'a SandboxId,
    /// The turn (from 1 per sandbox).
    pub turn: u64,
    /// The branch of the conversation it is on.
    pub branch: u64,
    /// When its answer is expected (the proxy's running estimate).
    pub expected_answer: Option<Duration>,
    /// Whether its request came from inside the sandbox.
    pub inside: bool,
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
    async fn turn_ended(&self, _end: TurnEndCall<'_>) -> Result<TurnVerdict, HookError> {
        Ok(TurnVerdict::Safe)
    }
}
