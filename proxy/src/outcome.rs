//! How a turn's hold gate opened: the [`GateOutcome`] the gate reports, the
//! stats count and the transcript records.

use serde::{Deserialize, Serialize};

/// How a turn's gate opened.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum GateOutcome {
    /// The hook returned Ok and the transcript rule held.
    Opened,
    /// The hook returned an error.
    HookFailed,
    /// The hook did not return within the hook timeout.
    HookTimedOut,
    /// Earlier records were not durable within the hook timeout.
    TranscriptTimedOut,
    /// An earlier record could not be written (a failing or full disk):
    /// the conversation up to this turn has a hole, and every later
    /// turn's gate says so too.
    TranscriptFailed,
    /// The sandbox shut down before the gate opened.
    Cancelled,
    /// The engine rolled the turn back (a safety rule): the agent got the
    /// notice, not the answer.
    RolledBack,
}
