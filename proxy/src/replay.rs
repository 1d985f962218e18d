//! Replay: after a restore, answers what the restored agent asks again from
//! the transcript (the fast-forward), and starts a new branch of the
//! conversation where it goes live.
//!
//! A restore tells the proxy where the restored version stands
//! ([`ConversationAt`]: its branch, its turn, and the turn its process image
//! was taken at). The restored agent's memory is that image's: it asks that
//! turn's request again, then the next ones. Each is matched, in order,
//! against the record of the same turn on the version's branch (the branch's
//! own turns, then its ancestors' up to where it grew from; see
//! [`conversation`]). A request matches its record when the paths are equal
//! and the bodies are equal as canonical JSON (object keys sorted, no
//! whitespace; bodies that are not JSON compare byte for byte). A match is
//! answered from the record (status, headers, body byte for byte, streams
//! included) and counts as that turn; the upstream never sees it.
//!
//! The first request that does not match (a `divergence` entry is
//! recorded), or the first past the records, goes live as the next turn.
//! Its turn starts a new branch after the last replayed turn, unless that
//! branch has no later turn yet (a crash recovery of the newest turn): no
//! turn of a branch is ever numbered twice. Nothing of the old branch is rewritten.
//!
//! Only the agent that was restored takes part: after a restore, requests
//! from inside the sandbox (its own listener) replay, while an agent outside
//! the sandbox (crabd's host listener), which no restore puts back, goes on
//! with its conversation as it was. [`crate::Sandbox::replay`] is the
//! other way in: an agent put back to its very start, from anywhere.
//!
//! This module is the matching (the records, [`step`]); the tower layer that
//! answers with it is `replay_layer`.

use std::collections::{BTreeMap, HashMap};

use crab_api::shim::ConversationAt;
use sha2::{Digest, Sha256};

use crate::outcome::GateOutcome;
pub(crate) use crate::transcript::{conversation, max_branch};
use crate::transcript::{
    unix_ms, BranchRecord, DivergenceRecord, Entry, RecordedResponse, TranscriptError, TurnRecord,
};

/// Why a replay could not start.
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
    /// The transcript is too large to read for a replay.
    #[error("transcript of {bytes} bytes is over the {limit} a replay reads")]
    TooLarge {
        /// Its size.
        bytes: u64,
        /// The limit.
        limit: u64,
    },
    /// The restored version's branch is not in the transcript.
    #[error("transcript has no branch {branch}")]
    UnknownBranch {
        /// The branch.
        branch: u64,
    },
    /// The transcript could not be read.
    #[error("cannot load the replay transcript")]
    Transcript(#[from] TranscriptError),
}

/// An active replay: the records still to answer, and where the
/// conversation goes live after them.
#[derive(Debug)]
pub(crate) struct Replay {
    /// The branch the replayed turns are on (the restored version's).
    parent: u64,
    /// The next turn to answer from its record.
    next: u64,
    /// Complete records of turns `next..`, consecutive.
    records: BTreeMap<u64, TurnRecord>,
    /// Whether only requests from inside the sandbox take part (its agent
    /// was restored with it); false: any (an agent put back to its start).
    inside_only: bool,
}

/// The turn counter, the current branch and the replay, changed together
/// under one lock.
#[derive(Debug, Default)]
pub(crate) struct TurnState {
    /// The newest turn number given out (0 before the first turn end).
    pub(crate) last_turn: u64,
    /// The branch live turns are on (0: the root).
    pub(crate) branch: u64,
    /// The newest branch in the transcript.
    pub(crate) max_branch: u64,
    /// The newest turn numbered (or recorded) on each branch: a turn that
    /// goes live after turn k of a branch whose tip is past k starts a new
    /// branch, so no turn of a branch is ever numbered twice.
    pub(crate) tips: HashMap<u64, u64>,
    /// The active replay, if any.
    pub(crate) replay: Option<Replay>,
}

/// What the replay makes of one turn-end request.
#[derive(Debug)]
pub(crate) enum ReplayStep {
    /// Answer turn `turn` with its recorded response.
    Answer { turn: u64, response: RecordedResponse },
    /// Go live as turn `turn` of `branch`; `entries` (a divergence, a new
    /// branch) go to the transcript before the turn's own record.
    Live {
        turn: u64,
        branch: u64,
        entries: Vec<Entry>,
    },
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

fn complete(record: &TurnRecord) -> bool {
    record
        .response
        .as_ref()
        .is_some_and(RecordedResponse::is_complete)
        && record.request.body.to_bytes().is_some()
        // Its answer belongs to a state a safety rule rolled back.
        && record.gate != Some(GateOutcome::RolledBack)
}

// === impl Replay ===

impl Replay {
    /// The replay after a restore to `at`: turns `image_turn..` of its
    /// branch while their records are complete (none when the image ended
    /// no turn), for the agent inside the sandbox.
    ///
    /// # Errors
    /// [`ReplayError::UnknownBranch`] when the transcript lacks `at.branch`.
    pub(crate) fn rewind(
        entries: &[Entry],
        at: ConversationAt,
        state: &mut TurnState,
    ) -> Result<Self, ReplayError> {
        let path =
            conversation(entries, at.branch).ok_or(ReplayError::UnknownBranch { branch: at.branch })?;
        let next = at
            .image_turn
            .filter(|t| (1..=at.turn).contains(t))
            .unwrap_or(at.turn + 1);
        let records = (next..=at.turn)
            .map_while(|turn| path.get(&turn).filter(|r| complete(r)).map(|r| (turn, r.clone())))
            .collect();
        state.learn(entries);
        Ok(Self {
            parent: at.branch,
            next,
            records,
            inside_only: true,
        })
    }

    /// The replay of turns 1..=until of the current branch, for an agent put
    /// back to its start, from anywhere.
    ///
    /// # Errors
    /// [`ReplayError::MissingTurn`] or [`ReplayError::IncompleteTurn`] when a
    /// turn of the range has no complete record.
    pub(crate) fn from_start(
        entries: &[Entry],
        until: u64,
        state: &mut TurnState,
    ) -> Result<Self, ReplayError> {
        let path = conversation(entries, state.branch).unwrap_or_default();
        let mut records = BTreeMap::new();
        for turn in 1..=until {
            let record = path.get(&turn).ok_or(ReplayError::MissingTurn { turn })?;
            if !complete(record) {
                return Err(ReplayError::IncompleteTurn { turn });
            }
            records.insert(turn, record.clone());
        }
        state.learn(entries);
        Ok(Self {
            parent: state.branch,
            next: 1,
            records,
            inside_only: false,
        })
    }

    /// Answers the last turn it replays with `answer(its record)` instead of
    /// the recorded answer (a safety rollback's notice); false when it
    /// replays none.
    pub(crate) fn answer_last_with(&mut self, answer: impl FnOnce(&TurnRecord) -> RecordedResponse) -> bool {
        match self.records.values_mut().next_back() {
            Some(record) => {
                record.response = Some(answer(record));
                true
            }
            None => false,
        }
    }

    /// The first turn it would answer, and the last.
    pub(crate) fn range(&self) -> (u64, u64) {
        (
            self.next,
            self.records.keys().next_back().copied().unwrap_or(self.next - 1),
        )
    }
}

// === impl TurnState ===

impl TurnState {
    /// Takes in what the transcript says: its newest branch, and each
    /// branch's newest turn.
    pub(crate) fn learn(&mut self, entries: &[Entry]) {
        self.max_branch = self.max_branch.max(max_branch(entries));
        for entry in entries {
            // A branch's conversation has its parent's turns up to `after`.
            let (branch, turn) = match entry {
                Entry::Turn(t) => (t.branch, t.turn),
                Entry::Branch(b) => (b.branch, b.after),
                Entry::Divergence(_) | Entry::Tool(_) | Entry::Safety(_) | Entry::Overflow(_) => continue,
            };
            let tip = self.tips.entry(branch).or_default();
            *tip = (*tip).max(turn);
        }
    }

    /// Starts branch `max_branch + 1` after turn `after` of `parent` and
    /// goes on there; answers its entry.
    pub(crate) fn branch_off(&mut self, sandbox: &str, parent: u64, after: u64) -> Entry {
        self.max_branch += 1;
        self.branch = self.max_branch;
        self.tips.insert(self.branch, after);
        Entry::Branch(BranchRecord {
            v: 1,
            sandbox: sandbox.to_owned(),
            branch: self.branch,
            parent,
            after,
            unix_ms: unix_ms(),
        })
    }
}

/// Decides a turn-end request under the sandbox's turn lock, and numbers
/// it; `inside`: it came from the sandbox's own listener.
pub(crate) fn step(
    state: &mut TurnState,
    sandbox: &str,
    inside: bool,
    path: &str,
    body: &[u8],
) -> ReplayStep {
    let live = |state: &mut TurnState, entries| {
        state.last_turn += 1;
        let tip = state.tips.entry(state.branch).or_default();
        *tip = (*tip).max(state.last_turn);
        ReplayStep::Live {
            turn: state.last_turn,
            branch: state.branch,
            entries,
        }
    };
    let Some(replay) = state.replay.as_mut() else {
        return live(state, Vec::new());
    };
    if replay.inside_only && !inside {
        // Not the restored agent: its conversation goes on as it was.
        return live(state, Vec::new());
    }
    let turn = replay.next;
    let mut entries = Vec::new();
    if let Some(record) = replay.records.get(&turn) {
        let recorded = record.request.body.to_bytes().unwrap_or_default();
        let (expected, got) = (canonical(&recorded), canonical(body));
        if record.path == path && expected == got {
            if let Some(response) = record.response.clone() {
                replay.next += 1;
                state.last_turn = turn;
                state.branch = replay.parent;
                return ReplayStep::Answer { turn, response };
            }
        }
        let mark = |p: &str| {
            if record.path == path {
                String::new()
            } else {
                format!("{p}\n")
            }
        };
        entries.push(Entry::Divergence(DivergenceRecord {
            v: 1,
            sandbox: sandbox.to_owned(),
            turn,
            path: path.to_owned(),
            expected_sha256: sha256_hex(&[mark(&record.path).as_bytes(), &expected].concat()),
            got_sha256: sha256_hex(&[mark(path).as_bytes(), &got].concat()),
            unix_ms: unix_ms(),
        }));
    }
    // Live from `turn` on: the conversation is the parent's up to turn - 1,
    // on the parent itself unless it has turns past that already.
    let parent = replay.parent;
    state.replay = None;
    let after = turn - 1;
    if state.tips.get(&parent).copied().unwrap_or(0) <= after {
        state.branch = parent;
    } else {
        entries.push(state.branch_off(sandbox, parent, after));
    }
    state.last_turn = after;
    live(state, entries)
}

#[cfg(test)]
mod tests;
