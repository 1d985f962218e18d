//! Requests and answers pass through unchanged: JSON, SSE chunk by chunk,
//! tool-call exchanges, upstream errors, malformed bodies, the host listener.

mod support;

use std::time::Duration;

use serde_json::json;
use support::{chat_body, messages_body, Harness};
use tokio_util::sync::CancellationToken;

#[tokio::test]
async fn non_streaming_answers_are_byte_identical() {
    let h = Harness::plain().await;
    for (path, body) in [
        ("/v1/chat/completions", chat_body("gpt-test", false)),
        ("/v1/responses", json!({"model": "gpt-test", "input": "hi"})),
        ("/v1/messages", messages_body("claude-test", false)),
    ] {
        let sent = body.to_string();
        let resp = h.post(path, &body).send().await.expect("send");
        assert_eq!(resp.status(), 200, "{path}");
        assert_eq!(resp.headers()["x-upstream"], "scripted");
        let got = resp.bytes().await.expect("body");
        let seen = h.upstream.seen().pop().expect("upstream saw it");
        assert_eq!(seen.path, path);
        assert_eq!(seen.body, sent.as_bytes(), "request body unchanged");
        assert_eq!(
            seen.headers["authorization"], "Bearer sk-secret-openai",
            "auth passes through"
        );
        assert_eq!(seen.headers["x-api-key"], "sk-ant-secret");
        let record = h.turns().await.pop().expect("record");
        assert_eq!(
            record.response.expect("response").body.to_bytes().expect("bytes"),
            got
        );
    }
}

#[tokio::test]
async fn streams_pass_chunk_by_chunk() {
    let h = Harness::plain().await;
    for (path, body) in [
        ("/v1/messages", messages_body("gated", true)),
        ("/v1/chat/completions", chat_body("gated", true)),
        (
            "/v1/responses",
            json!({"model": "gated", "input": "hi", "stream": true}),
        ),
    ] {
        let mut resp = h.post(path, &body).send().await.expect("send");
        assert_eq!(resp.headers()["content-type"], "text/event-stream");
        // The upstream sends chunk 1, then waits for `release`: the proxy
        // must hand chunk 1 over before the upstream sends anything else.
        let first = resp.chunk().await.expect("chunk").expect("first chunk");
        assert!(
            first.starts_with(b"event: ") || first.starts_with(b"data: "),
            "{path}"
        );
        h.upstream.release();
        let mut all = first.to_vec();
        while let Some(c) = resp.chunk().await.expect("chunk") {
            all.extend_from_slice(&c);
        }
        let text = String::from_utf8(all).expect("utf8");
        assert!(text.contains("hello"), "{path}: {text}");
        let record = h.turns().await.pop().expect("record");
        let response = record.response.expect("response");
        assert!(response.is_complete());
        assert_eq!(
            response.body.to_bytes().expect("bytes"),
            text.as_bytes(),
            "{path}: concatenated chunks"
        );
    }
}

#[tokio::test]
async fn tool_call_exchanges_pass_through() {
    let h = Harness::plain().await;
    let tools = json!([{"type": "function", "function": {"name": "run", "parameters": {"type": "object"}}}]);
    let first = json!({"model": "gpt-test", "messages": [{"role": "user", "content": "ls"}], "tools": tools});
    let answer: serde_json::Value = h
        .post("/v1/chat/completions", &first)
        .send()
        .await
        .expect("send")
        .json()
        .await
        .expect("json");
    let call = &answer["choices"][0]["message"]["tool_calls"][0];
    assert_eq!(call["function"]["name"], "run");
    let second = json!({"model": "gpt-test", "tools": tools, "messages": [
        {"role": "user", "content": "ls"},
        answer["choices"][0]["message"].clone(),
        {"role": "tool", "tool_call_id": call["id"], "content": "a.txt"}]});
    let answer: serde_json::Value = h
        .post("/v1/chat/completions", &second)
        .send()
        .await
        .expect("send")
        .json()
        .await
        .expect("json");
    assert_eq!(answer["choices"][0]["message"]["content"], "hello from upstream");

    let atools = json!([{"name": "run", "input_schema": {"type": "object"}}]);
    let first = json!({"model": "claude-test", "max_tokens": 64, "tools": atools, "messages": [{"role": "user", "content": "ls"}]});
    let answer: serde_json::Value = h
        .post("/v1/messages", &first)
        .send()
        .await
        .expect("send")
        .json()
        .await
        .expect("json");
    assert_eq!(answer["content"][0]["type"], "tool_use");
    let second = json!({"model": "claude-test", "max_tokens": 64, "tools": atools, "messages": [
        {"role": "user", "content": "ls"},
        {"role": "assistant", "content": answer["content"].clone()},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": "a.txt"}]}]});
    let resp = h.post("/v1/messages", &second).send().await.expect("send");
    assert_eq!(resp.status(), 200);
    let seen = h.upstream.seen();
    assert_eq!(seen.len(), 4);
    assert_eq!(seen[3].body, second.to_string().as_bytes());
    assert_eq!(h.sandbox.last_turn(), 4);
}

#[tokio::test]
async fn upstream_errors_pass_through_unchanged() {
    let h = Harness::plain().await;
    for (model, status, kind) in [
        ("status-429", 429, "rate_limit_error"),
        ("status-500", 500, "api_error"),
    ] {
        let resp = h
            .post("/v1/messages", &messages_body(model, false))
            .send()
            .await
            .expect("send");
        assert_eq!(resp.status(), status);
        if status == 429 {
            assert_eq!(resp.headers()["retry-after"], "7");
        }
        assert!(
            resp.headers().get("x-crab-error").is_none(),
            "the upstream's own answer"
        );
        let body: serde_json::Value = resp.json().await.expect("json");
        assert_eq!(body["error"]["type"], kind);
        let record = h.turns().await.pop().expect("record");
        assert_eq!(record.response.expect("response").status, status);
    }
}

#[tokio::test]
async fn malformed_json_is_forwarded_unchanged_and_ends_a_turn() {
    let h = Harness::plain().await;
    let resp = h
        .client
        .post(format!("{}/v1/chat/completions", h.base))
        .header("content-type", "application/json")
        .body("{\"model\": \"gpt-test\", oops")
        .send()
        .await
        .expect("send");
    assert_eq!(resp.status(), 400, "upstream's answer");
    let body: serde_json::Value = resp.json().await.expect("json");
    assert_eq!(body["error"]["type"], "invalid_request_error");
    assert_eq!(
        h.upstream.seen()[0].body,
        "{\"model\": \"gpt-test\", oops".as_bytes()
    );
    assert_eq!(h.sandbox.last_turn(), 1);
    assert_eq!(h.hook.calls.lock().len(), 1);
}

#[tokio::test]
async fn host_listener_routes_by_sandbox_prefix() {
    let h = Harness::plain().await;
    let sb2 = h
        .proxy
        .add_sandbox(crab_proxy::SandboxId::new("sb2").expect("id"))
        .await
        .expect("sb2");
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let host = format!("http://{}", listener.local_addr().expect("addr"));
    let shutdown = CancellationToken::new();
    let server = tokio::spawn(crab_proxy::serve_host(
        listener,
        h.proxy.clone(),
        shutdown.clone(),
    ));
    let post = |url: String| {
        h.client
            .post(url)
            .header("content-type", "application/json")
            .body(chat_body("gpt-test", false).to_string())
    };
    assert_eq!(
        post(format!("{host}/s/sb1/v1/chat/completions"))
            .send()
            .await
            .expect("send")
            .status(),
        200
    );
    assert_eq!(
        post(format!("{host}/s/sb2/v1/chat/completions?x=1"))
            .send()
            .await
            .expect("send")
            .status(),
        200
    );
    assert_eq!(
        post(format!("{host}/s/sb2/v1/chat/completions"))
            .send()
            .await
            .expect("send")
            .status(),
        200
    );
    let seen = h.upstream.seen();
    assert_eq!(
        seen[1].path, "/v1/chat/completions?x=1",
        "prefix stripped, query kept"
    );
    assert_eq!((h.sandbox.last_turn(), sb2.last_turn()), (1, 2));

    for (path, status, code) in [
        ("/s/nope/v1/chat/completions", 404, "crab_unknown_sandbox"),
        ("/s/..%2f/v1/chat/completions", 400, "crab_invalid_sandbox_id"),
        ("/v1/chat/completions", 400, "crab_not_a_sandbox_path"),
    ] {
        let resp = post(format!("{host}{path}")).send().await.expect("send");
        assert_eq!(resp.status(), status, "{path}");
        let body: serde_json::Value = resp.json().await.expect("json");
        assert_eq!(body["error"]["type"], code, "{path}");
    }
    shutdown.cancel();
    tokio::time::timeout(Duration::from_secs(10), server)
        .await
        .expect("server stops")
        .expect("join");
}
