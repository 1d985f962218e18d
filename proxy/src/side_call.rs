//! Side calls: requests on a turn-end route that are not the agent's turn.
//!
//! Agents make calls beside their main loop on the same routes (a title or
//! a summary of the conversation, a sub-agent's first question). Such a
//! call is a conversation of its own: a different start (system prompt and
//! first message) with fewer messages than the conversation the sandbox's
//! turns follow. It gets its answer as any request, and ends no turn: no
//! checkpoint, no hold, no turn number. The rule errs toward turn ends: a
//! conversation seen again with more messages is a conversation in
//! progress (a sub-agent, a conversation after compaction) and its
//! requests end turns from then on; a request that is not a JSON
//! conversation ends a turn.
//!
//! Off by default (`[shim.proxy] side_calls`): an agent whose requests each
//! start differently (one that trims its history from the front) and are
//! no longer than the last turn's would have every request taken for a side
//! call, and its turns would go unsaved.

use std::collections::VecDeque;
use std::hash::{Hash, Hasher};
use std::sync::Arc;
use std::task::{Context, Poll};

use bytes::Bytes;
use http::Request;
use serde::Deserialize;
use serde_json::value::RawValue;
use tower::Service;

use crate::route::Route;
use crate::shared::Shared;

/// How many conversations are remembered.
const REMEMBERED: usize = 16;

/// The conversations one sandbox's requests carried, least recent first.
#[derive(Debug, Default)]
pub(crate) struct Conversations {
    seen: VecDeque<Seen>,
    /// Messages of the latest request that ended a turn.
    current: Option<usize>,
}

/// One conversation: its start, its last length, whether it ends turns.
#[derive(Debug, Clone, Copy)]
struct Seen {
    start: u64,
    len: usize,
    turns: bool,
}

/// What of a request's body the rule reads (borrowed, not parsed further).
#[derive(Deserialize)]
struct Shape<'a> {
    #[serde(borrow, default)]
    system: Option<&'a RawValue>,
    #[serde(borrow, default)]
    instructions: Option<&'a RawValue>,
    #[serde(borrow, default)]
    messages: Option<Vec<&'a RawValue>>,
}

/// A conversation's start and length, if `body` is one.
pub(crate) fn conversation(body: &[u8]) -> Option<(u64, usize)> {
    let shape: Shape<'_> = serde_json::from_slice(body).ok()?;
    let messages = shape.messages?;
    let first = messages.first()?;
    let mut h = std::collections::hash_map::DefaultHasher::new();
    for part in [shape.system, shape.instructions, Some(*first)] {
        part.map(RawValue::get).unwrap_or_default().hash(&mut h);
    }
    Some((h.finish(), messages.len()))
}

// === impl Conversations ===

impl Conversations {
    /// Whether a request of conversation `(start, len)` is a side call;
    /// remembers what it saw.
    pub(crate) fn is_side_call(&mut self, start: u64, len: usize) -> bool {
        let current = self.current;
        let known = self
            .seen
            .iter()
            .position(|c| c.start == start)
            .and_then(|i| self.seen.remove(i));
        let turns = match (known, current) {
            // A conversation whose requests end turns, or the first one.
            (Some(Seen { turns: true, .. }), _) | (_, None) => true,
            // It grows: a conversation in progress (a sub-agent).
            (Some(c), _) if len > c.len => true,
            // As long as the one the turns follow now: a new main loop.
            (_, Some(current)) => len >= current,
        };
        if turns {
            self.current = Some(len);
        }
        if self.seen.len() == REMEMBERED {
            // Side conversations are forgotten first.
            let i = self.seen.iter().position(|c| !c.turns).unwrap_or(0);
            self.seen.remove(i);
        }
        self.seen.push_back(Seen { start, len, turns });
        !turns
    }
}

/// The tower service that tells side calls from turn ends (stacked in
/// `Sandbox::service`, after the body is read, before replay and turns).
#[derive(Clone)]
pub(crate) struct SideCalls<S> {
    shared: Arc<Shared>,
    inner: S,
}

impl<S> SideCalls<S> {
    pub(crate) fn new(shared: Arc<Shared>, inner: S) -> Self {
        Self { shared, inner }
    }
}

impl<S> Service<Request<Bytes>> for SideCalls<S>
where
    S: Service<Request<Bytes>>,
{
    type Response = S::Response;
    type Error = S::Error;
    type Future = S::Future;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, mut req: Request<Bytes>) -> Self::Future {
        let turn_end = req.extensions().get::<Route>().is_some_and(|r| r.turn_end);
        if turn_end && self.shared.config.turn_ends.side_calls() {
            let side = conversation(req.body())
                .is_some_and(|(start, len)| self.shared.conversations.lock().is_side_call(start, len));
            if side {
                if let Some(route) = req.extensions_mut().get_mut::<Route>() {
                    route.turn_end = false;
                }
                self.shared.stats.update(|s| s.n_side_calls += 1);
            }
        }
        self.inner.call(req)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn chat(system: &str, n: usize) -> Vec<u8> {
        let mut messages = vec![serde_json::json!({"role": "system", "content": system})];
        messages.extend((1..n).map(|i| serde_json::json!({"role": "user", "content": format!("m{i}")})));
        serde_json::to_vec(&serde_json::json!({"model": "m", "messages": messages})).unwrap()
    }

    fn side(c: &mut Conversations, body: &[u8]) -> bool {
        let (start, len) = conversation(body).expect("a conversation");
        c.is_side_call(start, len)
    }

    #[test]
    fn a_short_other_conversation_is_a_side_call_until_it_grows() {
        let mut c = Conversations::default();
        assert!(!side(&mut c, &chat("agent", 2)), "the first request is a turn");
        assert!(!side(&mut c, &chat("agent", 4)));
        assert!(side(&mut c, &chat("write a title", 2)), "a title");
        assert!(side(&mut c, &chat("write a title", 2)), "asked again: still one");
        assert!(!side(&mut c, &chat("agent", 6)), "the main loop goes on");
        // A sub-agent: side at first, a conversation once it grows.
        assert!(side(&mut c, &chat("sub-agent", 2)));
        assert!(!side(&mut c, &chat("sub-agent", 4)));
        assert!(!side(&mut c, &chat("agent", 8)), "longer than the sub-agent's");
        assert!(!side(&mut c, &chat("sub-agent", 6)), "the sub-agent goes on");
        // Same start, fewer messages (compaction kept the prompt): a turn.
        assert!(!side(&mut c, &chat("agent", 3)));
    }

    #[test]
    fn many_titles_never_push_out_the_main_loop() {
        let mut c = Conversations::default();
        assert!(!side(&mut c, &chat("agent", 6)));
        for i in 0..100 {
            assert!(side(&mut c, &chat(&format!("title {i}"), 2)));
        }
        assert!(!side(&mut c, &chat("agent", 5)), "still known");
    }

    #[test]
    fn only_json_conversations_are_judged() {
        assert_eq!(conversation(b"not json"), None);
        assert_eq!(conversation(br#"{"model":"m","input":"hi"}"#), None);
        assert_eq!(conversation(br#"{"model":"m","messages":[]}"#), None);
        let a = conversation(br#"{"system":"s1","messages":[{"role":"user","content":"x"}]}"#).unwrap();
        let b = conversation(br#"{"system":"s2","messages":[{"role":"user","content":"x"}]}"#).unwrap();
        assert_ne!(a.0, b.0, "Anthropic's system prompt is part of the start");
        assert_eq!(a.1, 1);
    }
}
