use proptest::prelude::*;
use serde_json::{json, Value};

use super::*;
use crate::route::Api;
use crate::transcript::{BranchRecord, RecordedBody, RecordedRequest, StreamEnd, Timing};

fn record(turn: u64, path: &str, body: &str, complete: bool) -> Entry {
    on_branch(0, turn, path, body, complete)
}

fn on_branch(branch: u64, turn: u64, path: &str, body: &str, complete: bool) -> Entry {
    Entry::Turn(TurnRecord {
        v: 1,
        sandbox: "sb".into(),
        turn,
        branch,
        api: Api::OpenAiChat,
        method: "POST".into(),
        path: path.into(),
        request: RecordedRequest {
            headers: vec![],
            body: RecordedBody::Text(body.into()),
        },
        response: Some(RecordedResponse {
            status: 200,
            headers: vec![],
            body: RecordedBody::Text(format!("answer {branch}/{turn}")),
            n_bytes: 8,
            capped: false,
            end: if complete {
                StreamEnd::Complete
            } else {
                StreamEnd::ClientDisconnected
            },
        }),
        error: None,
        gate: None,
        timing: Timing {
            started_unix_ms: 0,
            headers_us: None,
            first_byte_us: None,
            end_us: 0,
            hold_us: None,
        },
    })
}

fn branch(branch: u64, parent: u64, after: u64) -> Entry {
    Entry::Branch(BranchRecord {
        v: 1,
        sandbox: "sb".into(),
        branch,
        parent,
        after,
        unix_ms: 0,
    })
}

#[derive(Debug, PartialEq)]
enum Got {
    /// Answered from the record of this turn.
    Answer(u64),
    /// Live as (branch, turn), after a divergence or not.
    Live(u64, u64, bool),
}

/// Sends `requests` (inside the sandbox) through `state`; returns what each
/// got, and the branches started.
fn run(state: &mut TurnState, requests: &[(&str, &str)]) -> (Vec<Got>, Vec<(u64, u64, u64)>) {
    run_from(state, true, requests)
}

fn run_from(
    state: &mut TurnState,
    inside: bool,
    requests: &[(&str, &str)],
) -> (Vec<Got>, Vec<(u64, u64, u64)>) {
    let mut branches = Vec::new();
    let got = requests
        .iter()
        .map(
            |(path, body)| match step(state, "sb", inside, path, body.as_bytes()) {
                ReplayStep::Answer { turn, response } => {
                    assert!(response.is_complete());
                    Got::Answer(turn)
                }
                ReplayStep::Live {
                    turn,
                    branch,
                    entries,
                } => {
                    let mut diverged = false;
                    for e in entries {
                        match e {
                            Entry::Divergence(d) => {
                                assert_eq!(d.turn, turn);
                                diverged = true;
                            }
                            Entry::Branch(b) => branches.push((b.branch, b.parent, b.after)),
                            Entry::Turn(_) | Entry::Tool(_) | Entry::Safety(_) | Entry::Overflow(_) => {
                                panic!("a step writes no turn or tool call")
                            }
                        }
                    }
                    Got::Live(branch, turn, diverged)
                }
            },
        )
        .collect();
    (got, branches)
}

/// A state with `last_turn` turns numbered on the root.
fn numbered(last_turn: u64) -> TurnState {
    TurnState {
        last_turn,
        tips: [(0, last_turn)].into(),
        ..Default::default()
    }
}

/// A state with `last_turn` turns on the root, replaying 1..=until.
fn from_start(entries: &[Entry], until: u64, last_turn: u64) -> TurnState {
    let mut state = numbered(last_turn);
    state.replay = Some(Replay::from_start(entries, until, &mut state).expect("replay"));
    state
}

#[test]
fn an_agent_put_back_to_its_start_is_fast_forwarded() {
    let p = "/v1/messages";
    let log = || {
        vec![
            record(1, p, r#"{"a":1}"#, true),
            record(2, p, r#"{"a":2}"#, true),
            record(3, p, "x", true),
        ]
    };
    use Got::*;
    // Turns 1 and 2 again (other spacing), then live as turn 3 of a new
    // branch after turn 2 (the old turn 3 is kept on the root).
    let mut state = from_start(&log(), 2, 3);
    let (got, branches) = run(&mut state, &[(p, r#"{"a":1}"#), (p, r#"{ "a" : 2 }"#), (p, "x")]);
    assert_eq!(got, [Answer(1), Answer(2), Live(1, 3, false)]);
    assert_eq!(branches, [(1, 0, 2)]);
    assert_eq!((state.last_turn, state.branch), (3, 1));

    // A divergence at turn 2 goes live as turn 2, on a branch after turn 1.
    let mut state = from_start(&log(), 2, 3);
    let (got, branches) = run(&mut state, &[(p, r#"{"a":1}"#), (p, r#"{"a":3}"#), (p, "y")]);
    assert_eq!(got, [Answer(1), Live(1, 2, true), Live(1, 3, false)]);
    assert_eq!(branches, [(1, 0, 1)]);

    // Another path is a divergence too.
    let mut state = from_start(&log(), 2, 3);
    let (got, _) = run(&mut state, &[("/v1/chat/completions", r#"{"a":1}"#)]);
    assert_eq!(got, [Live(1, 1, true)]);

    // The whole conversation again, then on where it was: no branch.
    let mut state = from_start(&log(), 3, 3);
    let (got, branches) = run(
        &mut state,
        &[(p, r#"{"a":1}"#), (p, r#"{"a":2}"#), (p, "x"), (p, "z")],
    );
    assert_eq!(got, [Answer(1), Answer(2), Answer(3), Live(0, 4, false)]);
    assert!(branches.is_empty());

    // Nothing to replay: turn 1 again is live, on a branch after 0.
    let mut state = from_start(&log(), 0, 3);
    let (got, branches) = run(&mut state, &[(p, r#"{"a":1}"#)]);
    assert_eq!(got, [Live(1, 1, false)]);
    assert_eq!(branches, [(1, 0, 0)]);
}

#[test]
fn the_conversation_follows_its_branches() {
    let p = "/v1/messages";
    let entries = vec![
        record(1, p, "1", true),
        record(2, p, "2", true),
        record(3, p, "3", true),
        branch(1, 0, 1),
        on_branch(1, 2, p, "2b", true),
        on_branch(1, 3, p, "3b", true),
        branch(2, 1, 2),
        on_branch(2, 3, p, "3c", true),
        // A second record of a turn on one branch: the last wins.
        on_branch(2, 3, p, "3c'", true),
    ];
    let bodies = |b: u64| -> Option<Vec<String>> {
        conversation(&entries, b).map(|c| {
            c.values()
                .map(|r| match &r.request.body {
                    RecordedBody::Text(t) => t.clone(),
                    RecordedBody::Base64(_) => unreachable!(),
                })
                .collect()
        })
    };
    assert_eq!(bodies(0).unwrap(), ["1", "2", "3"]);
    assert_eq!(bodies(1).unwrap(), ["1", "2b", "3b"]);
    assert_eq!(bodies(2).unwrap(), ["1", "2b", "3c'"]);
    assert_eq!(bodies(3), None, "a branch never started");
    assert_eq!(max_branch(&entries), 2);
    // A corrupt file whose branches form a cycle ends the walk.
    let cycle = vec![branch(1, 2, 5), branch(2, 1, 5), on_branch(1, 1, p, "x", true)];
    assert_eq!(conversation(&cycle, 2).expect("known").len(), 1);
}

/// A state after `n` turns of the root, rewound to `at`.
fn rewound(entries: &[Entry], n: u64, at: ConversationAt) -> TurnState {
    let mut state = numbered(n);
    state.replay = Some(Replay::rewind(entries, at, &mut state).expect("rewind"));
    state
}

/// Where a restore puts the conversation.
fn conv(branch: u64, turn: u64, image_turn: Option<u64>) -> ConversationAt {
    ConversationAt {
        branch,
        turn,
        image_turn,
    }
}

fn five_turns() -> Vec<Entry> {
    (1..=5)
        .map(|t| record(t, "/v1/messages", &t.to_string(), true))
        .collect()
}

#[test]
fn a_rollback_replays_from_the_image_and_branches_where_it_goes_live() {
    let p = "/v1/messages";
    use Got::*;
    // Back to turn 2 of 5, its own image: turn 2 asked again is answered,
    // turn 3 goes live on branch 1 after turn 2; the old 3..5 stay.
    let at = conv(0, 2, Some(2));
    let mut state = rewound(&five_turns(), 5, at);
    let (got, branches) = run(&mut state, &[(p, "2"), (p, "3 live"), (p, "4 live")]);
    assert_eq!(got, [Answer(2), Live(1, 3, false), Live(1, 4, false)]);
    assert_eq!(branches, [(1, 0, 2)]);

    // Version at turn 5, image of turn 2: turns 2..5 are answered.
    let at = conv(0, 5, Some(2));
    let mut state = rewound(&five_turns(), 5, at);
    let (got, branches) = run(&mut state, &[(p, "2"), (p, "3"), (p, "4"), (p, "5"), (p, "6")]);
    assert_eq!(
        got,
        [Answer(2), Answer(3), Answer(4), Answer(5), Live(0, 6, false)]
    );
    assert!(branches.is_empty(), "the conversation went on where it was");

    // A request that differs goes live, on a branch after the turn before.
    let mut state = rewound(&five_turns(), 5, at);
    let (got, branches) = run(&mut state, &[(p, "2"), (p, "3 other")]);
    assert_eq!(got, [Answer(2), Live(1, 3, true)]);
    assert_eq!(branches, [(1, 0, 2)]);
}

#[test]
fn a_recovery_goes_on_and_a_turn_without_its_answer_goes_live() {
    let p = "/v1/messages";
    use Got::*;
    // The newest turn (5) was in flight with no record: asked again, it
    // goes live as turn 5 of a branch after 4 (the record, if any, of the
    // crashed branch stays there).
    let mut entries = five_turns();
    entries.pop();
    let at = conv(0, 5, Some(5));
    let mut state = rewound(&entries, 5, at);
    let (got, branches) = run(&mut state, &[(p, "5")]);
    assert_eq!(got, [Live(1, 5, false)]);
    assert_eq!(branches, [(1, 0, 4)]);

    // An image that ended no turn: nothing is replayed; the next turn is
    // the version's next.
    let at = conv(0, 3, None);
    let mut state = rewound(&five_turns(), 5, at);
    let (got, branches) = run(&mut state, &[(p, "4 live")]);
    assert_eq!(got, [Live(1, 4, false)]);
    assert_eq!(branches, [(1, 0, 3)]);
}

/// A second restore before the agent went live: its turns past the
/// version are still the old branch's, so going live there branches.
#[test]
fn a_second_restore_before_going_live_never_numbers_a_turn_twice() {
    let p = "/v1/messages";
    use Got::*;
    let at3 = conv(0, 3, Some(3));
    let mut state = rewound(&five_turns(), 5, at3);
    let (got, _) = run(&mut state, &[(p, "3")]);
    assert_eq!(got, [Answer(3)]);
    // Crashed again: recovered to the same version, the counter at 3.
    state.replay = Some(Replay::rewind(&five_turns(), at3, &mut state).expect("rewind"));
    let (got, branches) = run(&mut state, &[(p, "3"), (p, "4 live")]);
    assert_eq!(got, [Answer(3), Live(1, 4, false)]);
    assert_eq!(branches, [(1, 0, 3)], "the old turn 4 stays turn 4 of the root");
}

#[test]
fn an_agent_outside_the_sandbox_goes_on_as_it_was() {
    let p = "/v1/messages";
    use Got::*;
    let at = conv(0, 2, Some(2));
    let mut state = rewound(&five_turns(), 5, at);
    // Its request equals turn 2's record, yet it is the outside agent's.
    let (got, branches) = run_from(&mut state, false, &[(p, "2"), (p, "7")]);
    assert_eq!(got, [Live(0, 6, false), Live(0, 7, false)]);
    assert!(branches.is_empty());
    // The restored agent inside still gets its replay.
    let (got, _) = run(&mut state, &[(p, "2")]);
    assert_eq!(got, [Answer(2)]);
}

#[test]
fn a_rewind_needs_its_branch() {
    let at = conv(3, 1, Some(1));
    let err = Replay::rewind(&five_turns(), at, &mut TurnState::default()).expect_err("no branch 3");
    assert!(matches!(err, ReplayError::UnknownBranch { branch: 3 }), "{err:?}");
}

#[test]
fn refuses_ranges_without_complete_records() {
    let p = "/v1/messages";
    let cases: [(Vec<Entry>, u64, u64); 2] = [
        (vec![record(1, p, "{}", true)], 2, 2),
        (vec![record(1, p, "{}", true), record(2, p, "{}", false)], 2, 2),
    ];
    for (entries, until, bad_turn) in cases {
        match Replay::from_start(&entries, until, &mut TurnState::default()) {
            Err(ReplayError::MissingTurn { turn } | ReplayError::IncompleteTurn { turn }) => {
                assert_eq!(turn, bad_turn)
            }
            other => panic!("expected a refusal, got {other:?}"),
        }
    }
}

fn arb_json() -> impl Strategy<Value = Value> {
    let leaf = prop_oneof![
        Just(Value::Null),
        any::<bool>().prop_map(Value::Bool),
        any::<i32>().prop_map(|n| json!(n)),
        "[a-z ]{0,8}".prop_map(Value::String),
    ];
    leaf.prop_recursive(3, 24, 4, |inner| {
        prop_oneof![
            prop::collection::vec(inner.clone(), 0..4).prop_map(Value::Array),
            prop::collection::btree_map("[a-z]{1,4}", inner, 0..4)
                .prop_map(|m| Value::Object(m.into_iter().collect())),
        ]
    })
}

/// Pretty-prints `v` with object keys in reverse order, to vary the bytes.
fn reversed_pretty(v: &Value) -> String {
    match v {
        Value::Object(m) => {
            let fields: Vec<String> = m
                .iter()
                .rev()
                .map(|(k, v)| format!("\n  {}:  {}", json!(k), reversed_pretty(v)))
                .collect();
            format!("{{{}\n}}", fields.join(","))
        }
        Value::Array(a) => format!(
            "[ {} ]",
            a.iter().map(reversed_pretty).collect::<Vec<_>>().join(" ,\n")
        ),
        other => other.to_string(),
    }
}

proptest! {
    /// Key order and whitespace never cause a divergence.
    #[test]
    fn same_json_matches(v in arb_json()) {
        prop_assert_eq!(canonical(v.to_string().as_bytes()), canonical(reversed_pretty(&v).as_bytes()));
    }

    /// Different JSON values always diverge.
    #[test]
    fn different_json_diverges(a in arb_json(), b in arb_json()) {
        prop_assume!(a != b);
        prop_assert_ne!(canonical(a.to_string().as_bytes()), canonical(b.to_string().as_bytes()));
    }

    /// The matcher answers a request exactly when it equals its record.
    #[test]
    fn step_answers_iff_equal(recorded in arb_json(), sent in arb_json(), same_path in any::<bool>()) {
        let p = "/v1/messages";
        let entries = vec![record(1, p, &recorded.to_string(), true)];
        let mut state = from_start(&entries, 1, 1);
        let path = if same_path { p } else { "/v1/responses" };
        let answered = matches!(step(&mut state, "sb", true, path, reversed_pretty(&sent).as_bytes()), ReplayStep::Answer { .. });
        prop_assert_eq!(answered, same_path && recorded == sent);
        prop_assert_eq!(state.replay.is_none(), !answered, "a divergence ends the replay");
    }

    /// Bodies that are not JSON compare byte for byte.
    #[test]
    fn raw_bodies_compare_exactly(a in prop::collection::vec(any::<u8>(), 0..32), b in prop::collection::vec(any::<u8>(), 0..32)) {
        let json_a = serde_json::from_slice::<Value>(&a).is_ok();
        let json_b = serde_json::from_slice::<Value>(&b).is_ok();
        prop_assume!(!json_a && !json_b);
        prop_assert_eq!(canonical(&a) == canonical(&b), a == b);
    }
}
