//! Replay: answers an agent's turn ends from the transcript up to a given
//! turn (to fast-forward an agent after a rollback), and reports a request
//! that does not match its record instead of answering it wrongly.
//!
//! A request matches its record when the paths are equal and the bodies are
//! equal as canonical JSON (object keys sorted, no whitespace; bodies that
//! are not JSON compare byte for byte). A match is answered from the record
//! (status, headers, body) and counts as that turn. A mismatch is answered
//! with 409 (`crab_replay_divergence`, `x-should-retry: false`), recorded as
//! a `divergence` entry, and ends the replay: the next request goes live
//! as the same turn number. Past the last replayed turn requests go live.
//!
//! This module is the matching (the records, [`step`]); the tower layer that
//! answers with it is `replay_layer`.

use std::collections::BTreeMap;

use sha2::{Digest, Sha256};

use crate::transcript::{unix_ms, DivergenceRecord, Entry, RecordedResponse, TranscriptError, TurnRecord};

/// Why a replay could not start, or stopped.
#[derive(Debug, thiserror::Error)]
pub enum ReplayError {
    /// The transcript has no record of a turn in the replay range.
    #[error("transcript has no record of turn {turn}")]
    MissingTurn {
        /// The turn.
        turn: u64,
    },
    /// A turn's record lacks a complete answer (error, cut or capped).
    #[error("transcript record of turn {turn} has no complete answer")]
    IncompleteTurn {
        /// The turn.
        turn: u64,
    },
    /// The transcript could not be read.
    #[error("cannot load the replay transcript")]
    Transcript(#[from] TranscriptError),
    /// A replayed request did not match its record.
    #[error("request of turn {turn} does not match the transcript (expected sha256 {expected_sha256}, got {got_sha256}); replay stopped")]
    Diverged {
        /// The turn.
        turn: u64,
        /// SHA-256 of the recorded request's canonical form.
        expected_sha256: String,
        /// SHA-256 of the received request's canonical form.
        got_sha256: String,
    },
}

/// An active replay: the records of turns 1..=until.
#[derive(Debug)]
pub(crate) struct Replay {
    until: u64,
    records: BTreeMap<u64, TurnRecord>,
}

/// The turn counter and the replay, changed together under one lock.
#[derive(Debug, Default)]
pub(crate) struct TurnState {
    /// The newest turn number given out (0 before the first turn end).
    pub(crate) last_turn: u64,
    /// The active replay, if any.
    pub(crate) replay: Option<Replay>,
}

/// What the replay makes of one turn-end request.
#[derive(Debug)]
pub(crate) enum ReplayStep {
    /// Answer turn `turn` with its recorded response.
    Answer { turn: u64, response: RecordedResponse },
    /// The request does not match; replay stopped.
    Diverged(DivergenceRecord),
    /// Not replaying (or past the range): go live.
    Live,
}

/// The canonical form of a body: compact JSON with sorted keys, or the bytes
/// themselves when the body is not JSON.
pub fn canonical(body: &[u8]) -> Vec<u8> {
    // serde_json's Map is a BTreeMap (no `preserve_order`), so keys re-encode sorted.
    match serde_json::from_slice::<serde_json::Value>(body) {
        Ok(value) => serde_json::to_vec(&value).unwrap_or_else(|_| body.to_vec()),
        Err(_) => body.to_vec(),
    }
}

fn sha256_hex(bytes: &[u8]) -> String {
    Sha256::digest(bytes).iter().map(|b| format!("{b:02x}")).collect()
}

// === impl Replay ===

impl Replay {
    /// A replay of turns 1..=until from `entries` (the last record of a turn wins).
    pub(crate) fn new(entries: Vec<Entry>, until: u64) -> Result<Self, ReplayError> {
        let mut records = BTreeMap::new();
        for entry in entries {
            if let Entry::Turn(record) = entry {
                if record.turn >= 1 && record.turn <= until {
                    records.insert(record.turn, record);
                }
            }
        }
        for turn in 1..=until {
            let Some(record) = records.get(&turn) else {
                return Err(ReplayError::MissingTurn { turn });
            };
            let complete = record
                .response
                .as_ref()
                .is_some_and(RecordedResponse::is_complete);
            if !complete || record.request.body.to_bytes().is_none() {
                return Err(ReplayError::IncompleteTurn { turn });
            }
        }
        Ok(Self { until, records })
    }
}

/// Decides a turn-end request under the sandbox's turn lock.
pub(crate) fn step(state: &mut TurnState, sandbox: &str, path: &str, body: &[u8]) -> ReplayStep {
    let Some(replay) = state.replay.as_ref() else {
        return ReplayStep::Live;
    };
    let turn = state.last_turn + 1;
    let Some(record) = replay.records.get(&turn).filter(|_| turn <= replay.until) else {
        state.replay = None;
        return ReplayStep::Live;
    };
    let recorded = record.request.body.to_bytes().unwrap_or_default();
    let (expected, got) = (canonical(&recorded), canonical(body));
    if record.path == path && expected == got {
        let response = record.response.clone();
        state.last_turn = turn;
        if turn == replay.until {
            state.replay = None;
        }
        // Replay::new checked that every record in range has a response.
        return match response {
            Some(response) => ReplayStep::Answer { turn, response },
            None => ReplayStep::Live,
        };
    }
    let path_mark = if record.path == path {
        String::new()
    } else {
        format!("{}\n", record.path)
    };
    let got_mark = if record.path == path {
        String::new()
    } else {
        format!("{path}\n")
    };
    state.replay = None;
    ReplayStep::Diverged(DivergenceRecord {
        v: 1,
        sandbox: sandbox.to_owned(),
        turn,
        path: path.to_owned(),
        expected_sha256: sha256_hex(&[path_mark.as_bytes(), &expected].concat()),
        got_sha256: sha256_hex(&[got_mark.as_bytes(), &got].concat()),
        unix_ms: unix_ms(),
    })
}

#[cfg(test)]
mod tests;
