//! Turn counting and the hold gate, through real HTTP.

mod support;

use std::collections::HashMap;
use std::time::{Duration, Instant};

use crab_proxy::GateOutcome;
use serde_json::json;
use support::{chat_body, messages_body, Harness, HookStep};

#[tokio::test]
async fn only_main_loop_requests_count_as_turns() {
    let h = Harness::plain().await;
    let get = |p: &str| h.client.get(format!("{}{p}", h.base)).send();
    h.post("/v1/chat/completions", &chat_body("gpt-test", false))
        .send()
        .await
        .expect("send");
    get("/v1/models").await.expect("models");
    h.post("/v1/messages/count_tokens", &messages_body("claude-test", false))
        .send()
        .await
        .expect("count");
    h.post("/v1/messages", &messages_body("claude-test", true))
        .send()
        .await
        .expect("send")
        .bytes()
        .await
        .expect("body");
    h.post("/v1/embeddings", &json!({"model": "e", "input": "x"}))
        .send()
        .await
        .expect("embed");
    h.post("/v1/responses", &json!({"model": "gpt-test", "input": "hi"}))
        .send()
        .await
        .expect("send");
    get("/v1/responses/resp_1").await.expect("get response");
    let stats = h.sandbox.stats();
    assert_eq!((stats.n_turns, stats.n_aux_requests), (3, 4));
    let calls: Vec<u64> = h.hook.calls.lock().iter().map(|(_, t)| *t).collect();
    assert_eq!(calls, [1, 2, 3]);
    let turns: Vec<(u64, String)> = h.turns().await.into_iter().map(|t| (t.turn, t.path)).collect();
    assert_eq!(
        turns,
        [
            (1, "/v1/chat/completions".into()),
            (2, "/v1/messages".into()),
            (3, "/v1/responses".into())
        ]
    );
}

/// With side calls told apart, a title request beside the main loop (its
/// own, shorter conversation) gets its answer and ends no turn; the main
/// loop's requests do, and a sub-agent's once its conversation grows.
#[tokio::test]
async fn side_calls_end_no_turn() {
    let h = Harness::start(HashMap::new(), |c| {
        c.turn_ends = crab_proxy::TurnEndRules::main_loop().with_side_calls(true);
    })
    .await;
    let chat = |system: &str, n: usize| {
        let mut messages = vec![json!({"role": "system", "content": system})];
        messages.extend((1..n).map(|i| json!({"role": "user", "content": format!("step {i}")})));
        json!({"model": "gpt-test", "messages": messages})
    };
    for (body, what) in [
        (chat("you are an agent", 2), "turn 1"),
        (chat("you are an agent", 4), "turn 2"),
        (chat("write a title", 2), "side call"),
        (chat("you are an agent", 6), "turn 3"),
        (chat("a sub-agent", 2), "side call"),
        (chat("a sub-agent", 4), "turn 4"),
    ] {
        let resp = h.post("/v1/chat/completions", &body).send().await.expect("send");
        assert_eq!(resp.status(), 200, "{what}");
        resp.bytes().await.expect("answer");
    }
    let stats = h.sandbox.stats();
    assert_eq!(
        (stats.n_turns, stats.n_side_calls, stats.n_aux_requests),
        (4, 2, 2)
    );
    let calls: Vec<u64> = h.hook.calls.lock().iter().map(|(_, t)| *t).collect();
    assert_eq!(calls, [1, 2, 3, 4]);
    assert_eq!(h.turns().await.len(), 4);
    assert_eq!(h.upstream.seen().len(), 6, "every request reached the upstream");
}

#[tokio::test]
async fn a_held_turn_delays_exactly_its_answer() {
    let hold = Duration::from_millis(500);
    let h = Harness::start(HashMap::from([(3, HookStep::Delay(hold))]), |_| {}).await;
    let mut elapsed = Vec::new();
    for turn in 1..=5u64 {
        let stream = turn % 2 == 0;
        let t = Instant::now();
        let resp = h
            .post("/v1/messages", &messages_body("claude-test", stream))
            .send()
            .await
            .expect("send");
        let ttfb = t.elapsed();
        resp.bytes().await.expect("body");
        elapsed.push(ttfb);
    }
    // Real time (the hook sleeps on tokio's clock beside real sockets):
    // generous bounds, the exact hold is checked on the paused clock in gate.rs.
    assert!(elapsed[2] >= hold, "turn 3 answered after {:?}", elapsed[2]);
    for (idx, e) in elapsed.iter().enumerate().filter(|(i, _)| *i != 2) {
        assert!(*e < Duration::from_millis(400), "turn {} took {e:?}", idx + 1);
    }
    let stats = h.sandbox.stats();
    let holds: HashMap<u64, Duration> = stats.recent.iter().map(|r| (r.turn, r.hold)).collect();
    assert!(
        holds[&3] >= Duration::from_millis(400) && holds[&3] <= hold + Duration::from_millis(200),
        "turn 3 held {:?}",
        holds[&3]
    );
    for turn in [1, 2, 4, 5] {
        assert!(
            holds[&turn] < Duration::from_millis(300),
            "turn {turn} held {:?}",
            holds[&turn]
        );
    }
    assert!(stats.recent.iter().all(|r| r.outcome == GateOutcome::Opened));
    let record = h.turns().await.into_iter().find(|t| t.turn == 3).expect("turn 3");
    assert!(record.timing.hold_us.expect("hold") >= 400_000);
    assert_eq!(record.gate, Some(GateOutcome::Opened));
    // Turn 3's answer waited on its hook, and the hook was told.
    assert!(h.hook.waiting.lock().contains(&3), "{:?}", h.hook.waiting.lock());
    // The first turn end knows no answer time yet; later ones carry the
    // proxy's estimate.
    let expected = h.hook.expected.lock().clone();
    assert_eq!(expected.len(), 5);
    assert_eq!(expected[0], None);
    assert!(expected[1..].iter().all(Option::is_some), "{expected:?}");
}

#[tokio::test]
async fn failing_or_late_hooks_release_the_answer() {
    let h = Harness::start(HashMap::from([(1, HookStep::Fail), (2, HookStep::Never)]), |c| {
        c.timeouts.hook = Duration::from_millis(300);
    })
    .await;
    let resp = h
        .post("/v1/chat/completions", &chat_body("gpt-test", false))
        .send()
        .await
        .expect("send");
    assert_eq!(resp.status(), 200);
    let t = Instant::now();
    let resp = h
        .post("/v1/chat/completions", &chat_body("gpt-test", true))
        .send()
        .await
        .expect("send");
    assert_eq!(resp.status(), 200);
    assert!(
        t.elapsed() >= Duration::from_millis(300),
        "held until the hook timeout"
    );
    resp.bytes().await.expect("body");
    let resp = h
        .post("/v1/chat/completions", &chat_body("gpt-test", false))
        .send()
        .await
        .expect("send");
    assert_eq!(resp.status(), 200);

    let stats = h.sandbox.stats();
    assert_eq!((stats.n_hook_failures, stats.n_hook_timeouts), (1, 1));
    let gates: Vec<Option<GateOutcome>> = h.turns().await.iter().map(|t| t.gate).collect();
    assert_eq!(
        gates,
        [
            Some(GateOutcome::HookFailed),
            Some(GateOutcome::HookTimedOut),
            Some(GateOutcome::Opened)
        ]
    );
}

#[tokio::test]
async fn the_hook_runs_in_parallel_with_the_upstream_request() {
    // The hook of turn 1 never returns; the request must still reach the
    // upstream at once (seen before the gate opens).
    let h = Harness::start(HashMap::from([(1, HookStep::Never)]), |c| {
        c.timeouts.hook = Duration::from_secs(30);
    })
    .await;
    let req = h
        .post("/v1/chat/completions", &chat_body("gpt-test", false))
        .send();
    let pending = tokio::spawn(req);
    tokio::time::timeout(Duration::from_secs(10), h.upstream.wait_seen(1))
        .await
        .expect("request reached the upstream");
    assert!(!pending.is_finished(), "answer held while the hook runs");
    h.sandbox.shutdown().await;
    let resp = pending.await.expect("join").expect("send");
    assert_eq!(resp.status(), 200, "shutdown opens pending gates");
}
