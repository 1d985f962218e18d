use proptest::prelude::*;
use serde_json::{json, Value};

use super::*;
use crate::route::Api;
use crate::transcript::{RecordedBody, RecordedRequest, StreamEnd, Timing};

fn record(turn: u64, path: &str, body: &str, complete: bool) -> Entry {
    Entry::Turn(TurnRecord {
        v: 1,
        sandbox: "sb".into(),
        turn,
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
            body: RecordedBody::Text(format!("answer {turn}")),
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

#[derive(Debug, PartialEq)]
enum Got {
    Answer(u64),
    Diverged(u64),
    Live,
}

/// Replays `until` turns of `entries` against `requests`; returns what each
/// request got and the final turn counter.
fn check(entries: Vec<Entry>, until: u64, requests: &[(&str, &str)], expected: &[Got], last_turn: u64) {
    let mut state = TurnState {
        last_turn: 0,
        replay: Some(Replay::new(entries, until).expect("replay")),
    };
    let got: Vec<Got> = requests
        .iter()
        .map(
            |(path, body)| match step(&mut state, "sb", path, body.as_bytes()) {
                ReplayStep::Answer { turn, .. } => Got::Answer(turn),
                ReplayStep::Diverged(d) => Got::Diverged(d.turn),
                ReplayStep::Live => {
                    state.last_turn += 1;
                    Got::Live
                }
            },
        )
        .collect();
    assert_eq!(got, expected);
    assert_eq!(state.last_turn, last_turn);
}

#[test]
fn steps() {
    let p = "/v1/messages";
    let log = || {
        vec![
            record(1, p, r#"{"a":1}"#, true),
            record(2, p, r#"{"a":2}"#, true),
            record(3, p, "x", true),
        ]
    };
    use Got::*;
    check(
        log(),
        2,
        &[(p, r#"{"a":1}"#), (p, r#"{ "a" : 2 }"#), (p, "x")],
        &[Answer(1), Answer(2), Live],
        3,
    );
    check(
        log(),
        2,
        &[(p, r#"{"a":1}"#), (p, r#"{"a":3}"#), (p, "y")],
        &[Answer(1), Diverged(2), Live],
        2,
    );
    check(
        log(),
        2,
        &[("/v1/chat/completions", r#"{"a":1}"#), (p, "z")],
        &[Diverged(1), Live],
        1,
    );
    check(
        log(),
        3,
        &[(p, r#"{"a":1}"#), (p, r#"{"a":2}"#), (p, "x")],
        &[Answer(1), Answer(2), Answer(3)],
        3,
    );
    check(
        log(),
        3,
        &[(p, r#"{"a":1}"#), (p, r#"{"a":2}"#), (p, "x ")],
        &[Answer(1), Answer(2), Diverged(3)],
        2,
    );
    check(log(), 0, &[(p, r#"{"a":1}"#)], &[Live], 1);
    // The last record of a turn wins (a rollback rewrote turn 2).
    let mut rewritten = log();
    rewritten.push(record(2, p, r#"{"b":2}"#, true));
    check(
        rewritten,
        2,
        &[(p, r#"{"a":1}"#), (p, r#"{"b":2}"#)],
        &[Answer(1), Answer(2)],
        2,
    );
}

#[test]
fn refuses_ranges_without_complete_records() {
    let p = "/v1/messages";
    let cases: [(Vec<Entry>, u64, u64); 2] = [
        (vec![record(1, p, "{}", true)], 2, 2),
        (vec![record(1, p, "{}", true), record(2, p, "{}", false)], 2, 2),
    ];
    for (entries, until, bad_turn) in cases {
        match Replay::new(entries, until) {
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
        let mut state = TurnState { last_turn: 0, replay: Some(Replay::new(entries, 1).expect("replay")) };
        let path = if same_path { p } else { "/v1/responses" };
        let answered = matches!(step(&mut state, "sb", path, reversed_pretty(&sent).as_bytes()), ReplayStep::Answer { .. });
        prop_assert_eq!(answered, same_path && recorded == sent);
        prop_assert!(state.replay.is_none(), "a one-turn replay is over after one step");
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
