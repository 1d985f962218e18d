//! The transcript (contents, redaction, cap) and replay (answers from the
//! transcript, divergence, back to live), through real HTTP.

mod support;

use crab_proxy::transcript::{Entry, StreamEnd};
use serde_json::json;
use support::{chat_body, messages_body, Harness};

#[tokio::test]
async fn records_hold_requests_answers_and_no_secrets() {
    let h = Harness::plain().await;
    // Root's alone: the file 0600, its directory 0700.
    {
        use std::os::unix::fs::PermissionsExt;
        let path = h.sandbox.transcript_path();
        let mode = |p: &std::path::Path| std::fs::metadata(p).unwrap().permissions().mode() & 0o7777;
        assert_eq!(mode(path), 0o600);
        assert_eq!(mode(path.parent().unwrap()), 0o700);
    }
    let req1 = chat_body("gpt-test", false);
    let req2 = messages_body("claude-test", true);
    let a1 = h
        .post("/v1/chat/completions", &req1)
        .header("api-key", "azure-secret")
        .send()
        .await
        .expect("send");
    let a1 = a1.bytes().await.expect("body");
    let a2 = h
        .post("/v1/messages", &req2)
        .send()
        .await
        .expect("send")
        .bytes()
        .await
        .expect("body");
    h.client
        .get(format!("{}/v1/models", h.base))
        .header("authorization", "Bearer sk-aux")
        .send()
        .await
        .expect("aux");

    let turns = h.turns().await;
    assert_eq!(turns.len(), 2, "aux requests are not turns");
    for (record, (turn, path, req, answer, api)) in turns.iter().zip([
        (1, "/v1/chat/completions", &req1, &a1, crab_proxy::Api::OpenAiChat),
        (2, "/v1/messages", &req2, &a2, crab_proxy::Api::AnthropicMessages),
    ]) {
        assert_eq!(
            (
                record.turn,
                record.path.as_str(),
                record.api,
                record.sandbox.as_str()
            ),
            (turn, path, api, "sb1")
        );
        assert_eq!(
            record.request.body.to_bytes().expect("bytes"),
            req.to_string().as_bytes()
        );
        let response = record.response.as_ref().expect("response");
        assert_eq!(response.status, 200);
        assert_eq!(response.body.to_bytes().expect("bytes"), answer);
        assert_eq!(response.n_bytes, answer.len() as u64);
        assert!(response.is_complete());
        assert!(record.timing.headers_us.is_some() && record.timing.first_byte_us.is_some());
        assert!(record.timing.end_us >= record.timing.first_byte_us.unwrap_or(0));
        assert!(record.timing.hold_us.is_some());
        assert!(record.request.headers.iter().any(|(k, _)| k == "content-type"));
    }
    let raw = std::fs::read_to_string(h.sandbox.transcript_path()).expect("read");
    for secret in [
        "sk-secret-openai",
        "sk-ant-secret",
        "azure-secret",
        "sk-aux",
        "authorization",
        "x-api-key",
        "api-key",
    ] {
        assert!(!raw.to_lowercase().contains(secret), "transcript holds {secret}");
    }
    assert_eq!(raw.lines().count(), 2);
}

#[tokio::test]
async fn long_answers_are_capped_and_marked_incomplete() {
    let h = Harness::start(Default::default(), |c| c.limits.transcript_body_cap = 64).await;
    let answer = h
        .post("/v1/messages", &messages_body("claude-test", true))
        .send()
        .await
        .expect("send");
    let answer = answer.bytes().await.expect("body");
    assert!(answer.len() > 64, "the agent gets everything");
    let record = h.turns().await.pop().expect("record");
    let response = record.response.expect("response");
    assert!(response.capped && !response.is_complete());
    assert_eq!(response.end, StreamEnd::Complete);
    assert_eq!(response.body.to_bytes().expect("bytes"), answer.slice(..64));
    assert_eq!(response.n_bytes, answer.len() as u64);
}

#[tokio::test]
async fn replay_answers_from_the_transcript_then_goes_live() {
    let h = Harness::plain().await;
    let bodies = [
        chat_body("gpt-test", false),
        messages_body("claude-test", true),
        chat_body("gpt-test", true),
    ];
    let paths = ["/v1/chat/completions", "/v1/messages", "/v1/chat/completions"];
    let mut answers = Vec::new();
    for (n, (path, body)) in paths.iter().zip(&bodies).enumerate() {
        let resp = h.post(path, body).send().await.expect("send");
        // A live answer says which turn it ends.
        assert_eq!(resp.headers()["x-crab-turn"], (n + 1).to_string());
        answers.push(resp.bytes().await.expect("body"));
    }
    h.sandbox.replay(2).await.expect("replay");
    for idx in 0..2 {
        let resp = h.post(paths[idx], &bodies[idx]).send().await.expect("send");
        assert_eq!(resp.headers()["x-crab-replayed"], (idx + 1).to_string());
        assert_eq!(resp.bytes().await.expect("body"), answers[idx]);
    }
    assert_eq!(
        h.upstream.seen().len(),
        3,
        "replayed turns never reach the upstream"
    );
    let resp = h.post(paths[2], &bodies[2]).send().await.expect("send");
    assert!(resp.headers().get("x-crab-replayed").is_none());
    assert_eq!(resp.headers()["x-crab-turn"], "3");
    resp.bytes().await.expect("body");
    assert_eq!(h.upstream.seen().len(), 4, "turn 3 went live");
    assert_eq!(h.sandbox.last_turn(), 3);
    let stats = h.sandbox.stats();
    assert_eq!((stats.n_replayed, stats.n_turns), (2, 6));
    let calls: Vec<u64> = h.hook.calls.lock().iter().map(|(_, t)| *t).collect();
    assert_eq!(calls, [1, 2, 3, 3], "replayed turns do not call the hook");
}

#[tokio::test]
async fn a_replay_divergence_goes_live_on_a_new_branch() {
    let h = Harness::plain().await;
    let first =
        json!({"model": "gpt-test", "messages": [{"role": "user", "content": "hi"}], "temperature": 0});
    for body in [&first, &chat_body("gpt-test", false)] {
        h.post("/v1/chat/completions", body)
            .send()
            .await
            .expect("send")
            .bytes()
            .await
            .expect("body");
    }
    h.sandbox.replay(2).await.expect("replay");
    // Same JSON, other key order and spacing: a match.
    let reordered = "{ \"temperature\": 0, \"messages\": [ {\"content\": \"hi\", \"role\": \"user\"} ], \"model\": \"gpt-test\" }";
    let resp = h
        .client
        .post(format!("{}/v1/chat/completions", h.base))
        .header("content-type", "application/json")
        .body(reordered)
        .send()
        .await
        .expect("send");
    assert_eq!(resp.headers()["x-crab-replayed"], "1");
    // Turn 2 with another prompt: it goes live, as turn 2 of a branch
    // after turn 1, and the divergence is recorded before it.
    let other = json!({"model": "gpt-test", "messages": [{"role": "user", "content": "something else"}]});
    let resp = h.post("/v1/chat/completions", &other).send().await.expect("send");
    assert_eq!(resp.status(), 200);
    assert!(resp.headers().get("x-crab-replayed").is_none());
    resp.bytes().await.expect("body");
    assert_eq!(h.upstream.seen().len(), 3, "the divergent request went upstream");
    assert_eq!(h.sandbox.last_turn(), 2);
    assert_eq!(h.sandbox.stats().n_divergences, 1);
    let entries = h.entries().await;
    let tail: Vec<&Entry> = entries.iter().skip(2).collect();
    let [Entry::Divergence(event), Entry::Branch(branch), Entry::Turn(turn)] = tail[..] else {
        panic!("divergence, branch, turn: {entries:?}")
    };
    assert_eq!((event.turn, event.path.as_str()), (2, "/v1/chat/completions"));
    assert_ne!(event.expected_sha256, event.got_sha256);
    assert_eq!((branch.branch, branch.parent, branch.after), (1, 0, 1));
    assert_eq!((turn.turn, turn.branch), (2, 1));
    let calls: Vec<u64> = h.hook.calls.lock().iter().map(|(_, t)| *t).collect();
    assert_eq!(calls, [1, 2, 2]);
    assert_eq!(*h.hook.branches.lock(), [0, 0, 1], "the hook hears the branch");
}

/// After a restore to turn 4 whose process image is turn 2's, the agent
/// inside the sandbox asks turns 2..4 again and gets the recorded answers
/// (a stream byte for byte), the upstream seeing none of them; its next
/// turn goes live on a branch after turn 4, beside the old turn 5. An agent
/// outside the sandbox (the host-side socket) goes on as it was.
#[tokio::test]
async fn a_rewind_fast_forwards_the_agent_that_was_restored() {
    let h = Harness::plain().await;
    let body = |n: u32| json!({"model": "gpt-test", "stream": n == 2, "messages": [{"role": "user", "content": format!("step {n}")}]});
    let mut answers = Vec::new();
    for n in 1..=5 {
        let resp = h
            .post("/v1/chat/completions", &body(n))
            .send()
            .await
            .expect("send");
        answers.push(resp.bytes().await.expect("body"));
    }
    assert!(
        String::from_utf8_lossy(&answers[1]).contains("data: "),
        "turn 2 streamed"
    );
    let at = crab_api::shim::ConversationAt {
        branch: 0,
        turn: 4,
        image_turn: Some(2),
    };
    h.sandbox.rewind(at).await.expect("rewind");

    // The outside agent: over the host-side socket, its next turn is 6.
    let socket = h.dir.path().join("host.sock");
    let listener = tokio::net::UnixListener::bind(&socket).expect("bind");
    tokio::spawn(crab_proxy::serve_sandbox(
        listener,
        h.sandbox.clone(),
        h.shutdown.clone(),
    ));
    let outside = body(2).to_string();
    let (status, head) = unix_post(&socket, "/v1/chat/completions", &outside).await;
    assert_eq!(status, 200, "{head}");
    assert!(!head.contains("x-crab-replayed"), "{head}");
    assert_eq!(h.sandbox.last_turn(), 6);
    assert_eq!(h.upstream.seen().len(), 6);

    for n in 2..=4u32 {
        let resp = h
            .post("/v1/chat/completions", &body(n))
            .send()
            .await
            .expect("send");
        assert_eq!(resp.headers()["x-crab-replayed"], n.to_string());
        if n == 2 {
            assert_eq!(resp.headers()["content-type"], "text/event-stream");
        }
        assert_eq!(
            resp.bytes().await.expect("body"),
            answers[n as usize - 1],
            "turn {n}"
        );
    }
    assert_eq!(
        h.upstream.seen().len(),
        6,
        "replayed turns never reach the upstream"
    );
    let resp = h
        .post("/v1/chat/completions", &body(50))
        .send()
        .await
        .expect("send");
    assert!(resp.headers().get("x-crab-replayed").is_none());
    resp.bytes().await.expect("body");
    assert_eq!(h.upstream.seen().len(), 7);
    assert_eq!(h.sandbox.last_turn(), 5);

    let entries = h.entries().await;
    let turns: Vec<(u64, u64)> = support::turns_of(&entries)
        .iter()
        .map(|t| (t.branch, t.turn))
        .collect();
    assert_eq!(
        turns,
        [(0, 1), (0, 2), (0, 3), (0, 4), (0, 5), (0, 6), (1, 5)],
        "nothing lost"
    );
    let branches = support::branches_of(&entries);
    assert_eq!(branches, [(1, 0, 4)]);
    assert_eq!(h.hook.branches.lock().last(), Some(&1));

    // A branch the transcript never had is refused, and changes nothing.
    let at = crab_api::shim::ConversationAt {
        branch: 9,
        turn: 1,
        image_turn: Some(1),
    };
    assert!(h.sandbox.rewind(at).await.is_err());
    assert_eq!(h.sandbox.last_turn(), 5);
}

/// A POST over a unix socket: the status and the response head.
async fn unix_post(socket: &std::path::Path, path: &str, body: &str) -> (u16, String) {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut s = tokio::net::UnixStream::connect(socket).await.expect("connect");
    let req = format!(
        "POST {path} HTTP/1.1\r\nhost: localhost\r\ncontent-type: application/json\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{body}",
        body.len()
    );
    s.write_all(req.as_bytes()).await.expect("write");
    let mut answer = String::new();
    s.read_to_string(&mut answer).await.expect("read");
    let head = answer.split("\r\n\r\n").next().unwrap_or_default().to_lowercase();
    let status = head.split(' ').nth(1).and_then(|s| s.parse().ok()).unwrap_or(0);
    (status, head)
}

#[tokio::test]
async fn replay_refuses_a_range_the_transcript_lacks() {
    let h = Harness::plain().await;
    h.post("/v1/chat/completions", &chat_body("gpt-test", false))
        .send()
        .await
        .expect("send");
    let err = h.sandbox.replay(2).await.expect_err("turn 2 missing");
    assert!(
        matches!(
            err,
            crab_proxy::Error::Replay(crab_proxy::ReplayError::MissingTurn { turn: 2 })
        ),
        "{err:?}"
    );
    h.post("/v1/chat/completions", &chat_body("status-429", false))
        .send()
        .await
        .expect("send");
    let err = h.sandbox.replay(2).await;
    assert!(err.is_ok(), "a recorded 4xx is a complete answer: {err:?}");
}

#[tokio::test]
async fn a_turns_record_is_on_disk_before_the_next_answer_is_released() {
    let h = Harness::plain().await;
    for turn in 1..=5u64 {
        let stream = turn % 2 == 0;
        let resp = h
            .post("/v1/messages", &messages_body("claude-test", stream))
            .send()
            .await
            .expect("send");
        // Read the file as soon as the answer's head arrived, without a
        // flush: every earlier turn must already be there.
        let raw = std::fs::read_to_string(h.sandbox.transcript_path()).expect("read");
        let on_disk: Vec<u64> = raw
            .lines()
            .map(|l| serde_json::from_str::<Entry>(l).expect("entry"))
            .filter_map(|e| match e {
                Entry::Turn(t) => Some(t.turn),
                Entry::Divergence(_)
                | Entry::Branch(_)
                | Entry::Tool(_)
                | Entry::Safety(_)
                | Entry::Overflow(_) => None,
            })
            .collect();
        // Turn `turn`'s own record may be there too (its body can end
        // before the client sees the head); earlier ones must be.
        let earlier: Vec<u64> = on_disk.iter().copied().filter(|t| *t < turn).collect();
        assert_eq!(
            earlier,
            (1..turn).collect::<Vec<_>>(),
            "answer of turn {turn}: on disk {on_disk:?}"
        );
        resp.bytes().await.expect("body");
    }
}

/// A sandbox started again over its old transcript (a resume after its
/// host died) from turn 3 of 5: the restored agent's turn 3 is answered
/// from the record, and live turns go on as turn 4 on a branch after 3
/// (the old 4 and 5 stay); an agent outside numbers on from there too.
#[tokio::test]
async fn a_resumed_sandbox_goes_on_with_its_transcript() {
    let h = Harness::plain().await;
    let body =
        |n: u32| json!({"model": "gpt-test", "messages": [{"role": "user", "content": format!("step {n}")}]});
    let mut answers = Vec::new();
    for n in 1..=5 {
        let resp = h
            .post("/v1/chat/completions", &body(n))
            .send()
            .await
            .expect("send");
        answers.push(resp.bytes().await.expect("body"));
    }
    h.sandbox.flush_transcript().await;

    // A new proxy (a new shim) over the same transcript.
    let cfg = support::config(&h.upstream.url(), h.dir.path());
    let proxy = crab_proxy::Proxy::new(cfg, h.hook.clone()).expect("proxy");
    let sandbox = proxy
        .add_sandbox(crab_proxy::SandboxId::new("sb1").expect("id"))
        .await
        .expect("sandbox");
    let at = crab_api::shim::ConversationAt {
        branch: 0,
        turn: 3,
        image_turn: Some(3),
    };
    sandbox.resume(at).await.expect("resume");
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let base = format!("http://{}", listener.local_addr().expect("addr"));
    tokio::spawn(crab_proxy::serve_sandbox(
        listener,
        sandbox.clone(),
        h.shutdown.clone(),
    ));
    let post = |n: u32| {
        h.client
            .post(format!("{base}/v1/chat/completions"))
            .header("content-type", "application/json")
            .body(body(n).to_string())
    };
    let resp = post(3).send().await.expect("send");
    assert_eq!(resp.headers()["x-crab-replayed"], "3");
    assert_eq!(resp.bytes().await.expect("body"), answers[2]);
    let resp = post(40).send().await.expect("send");
    assert!(resp.headers().get("x-crab-replayed").is_none());
    resp.bytes().await.expect("body");
    assert_eq!(sandbox.last_turn(), 4);
    assert_eq!(h.upstream.seen().len(), 6, "only the live turn went upstream");

    sandbox.flush_transcript().await;
    let entries = crab_proxy::transcript::read_entries(sandbox.transcript_path())
        .await
        .expect("transcript");
    let turns: Vec<(u64, u64)> = support::turns_of(&entries)
        .iter()
        .map(|t| (t.branch, t.turn))
        .collect();
    assert_eq!(
        turns,
        [(0, 1), (0, 2), (0, 3), (0, 4), (0, 5), (1, 4)],
        "nothing lost"
    );
    let branches = support::branches_of(&entries);
    assert_eq!(branches, [(1, 0, 3)]);
}
