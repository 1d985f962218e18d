//! Bad input and faults: 413, 502, 504 (header and total), an idle upstream
//! mid-stream, a client that leaves mid-stream, a slowloris client, a
//! trickled body (408), connections over the limit (503), a full
//! transcript.

mod support;

use std::time::Duration;

use crab_proxy::transcript::StreamEnd;
use crab_proxy::GateOutcome;
use support::{chat_body, messages_body, Harness};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

/// Asserts an error answer: status, `error.type`, JSON shape.
async fn check_error(resp: reqwest::Response, status: u16, code: &str) {
    assert_eq!(resp.status(), status, "{code}");
    assert_eq!(resp.headers()["content-type"], "application/json");
    let body: serde_json::Value = resp.json().await.expect("json");
    assert_eq!(body["type"], "error");
    assert_eq!(body["error"]["type"], code);
    assert!(!body["error"]["message"].as_str().expect("message").is_empty());
}

#[tokio::test]
async fn bodies_over_the_limit_get_413() {
    let h = Harness::start(Default::default(), |c| c.limits.max_request_body = 1024).await;
    let big =
        serde_json::json!({"model": "gpt-test", "messages": [{"role": "user", "content": "x".repeat(2000)}]});
    check_error(
        h.post("/v1/chat/completions", &big).send().await.expect("send"),
        413,
        "crab_request_too_large",
    )
    .await;
    // Chunked (no content-length): the limit holds while reading.
    let stream = futures_util::stream::iter((0..4).map(|_| Ok::<_, std::io::Error>(vec![b' '; 512])));
    let resp = h
        .client
        .post(format!("{}/v1/chat/completions", h.base))
        .body(reqwest::Body::wrap_stream(stream))
        .send()
        .await
        .expect("send");
    check_error(resp, 413, "crab_request_too_large").await;
    assert!(h.upstream.seen().is_empty());
    assert_eq!(h.sandbox.last_turn(), 0, "a refused request is no turn");
}

#[tokio::test]
async fn an_unreachable_upstream_is_a_502() {
    // A port that was just free (nothing listens), and TLS to a plain HTTP
    // server (the handshake fails).
    let free = tokio::net::TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let refused = format!("http://{}", free.local_addr().expect("addr"));
    drop(free);
    let plain = support::ScriptedUpstream::start().await;
    let bad_tls = format!("https://{}", plain.addr);
    for url in [refused, bad_tls] {
        let h = Harness::start(Default::default(), |c| {
            c.upstreams.openai = url.parse().expect("uri");
        })
        .await;
        let resp = h
            .post("/v1/chat/completions", &chat_body("gpt-test", false))
            .send()
            .await
            .expect("send");
        check_error(resp, 502, "crab_upstream_unreachable").await;
        let record = h.turns().await.pop().expect("record");
        assert_eq!(
            record.error.as_deref(),
            Some("crab_upstream_unreachable"),
            "{url}"
        );
        assert!(record.response.is_none());
    }
}

#[tokio::test]
async fn a_stalled_upstream_is_a_504_per_deadline() {
    for (header_ms, total_ms, code) in [
        (200, 60_000, "crab_upstream_header_timeout"),
        (60_000, 200, "crab_upstream_total_timeout"),
    ] {
        let h = Harness::start(Default::default(), |c| {
            c.timeouts.upstream_header = Duration::from_millis(header_ms);
            c.timeouts.upstream_total = Duration::from_millis(total_ms);
        })
        .await;
        let resp = h
            .post("/v1/messages", &messages_body("stall-headers", false))
            .send()
            .await
            .expect("send");
        check_error(resp, 504, code).await;
        assert_eq!(
            h.turns().await.pop().expect("record").error.as_deref(),
            Some(code)
        );
    }
}

#[tokio::test]
async fn an_idle_upstream_cuts_the_stream_and_the_record_says_so() {
    let h = Harness::start(Default::default(), |c| {
        c.timeouts.upstream_idle = Duration::from_millis(200)
    })
    .await;
    let mut resp = h
        .post("/v1/messages", &messages_body("stall-body", true))
        .send()
        .await
        .expect("send");
    assert_eq!(resp.status(), 200);
    let first = resp.chunk().await.expect("first chunk").expect("some");
    assert!(first.starts_with(b"event: message_start"));
    assert!(resp.chunk().await.is_err(), "the agent sees the stream cut");
    let response = h.turns().await.pop().expect("record").response.expect("response");
    assert_eq!(response.end, StreamEnd::IdleTimeout);
    assert!(!response.is_complete());
    assert_eq!(response.body.to_bytes().expect("bytes"), first);
}

#[tokio::test]
async fn a_client_leaving_mid_stream_ends_the_upstream_stream() {
    // `gated`: the upstream is silent when the client leaves; `gated-endless`:
    // it keeps sending.
    for (idx, model) in ["gated", "gated-endless"].into_iter().enumerate() {
        let h = Harness::plain().await;
        let mut resp = h
            .post("/v1/messages", &messages_body(model, true))
            .send()
            .await
            .expect("send");
        resp.chunk().await.expect("first chunk").expect("some");
        assert_eq!(h.sandbox.stats().n_open_streams, 1);
        drop(resp);
        if idx == 0 {
            // Seen while the upstream is silent: hyper reads the client's EOF.
            tokio::time::timeout(Duration::from_secs(10), h.sandbox.wait_streams_closed())
                .await
                .expect("closed");
        }
        h.upstream.release();
        // The upstream's next send fails: the proxy dropped its side.
        tokio::time::timeout(Duration::from_secs(10), h.upstream.wait_cut(1))
            .await
            .expect("upstream stream cut");
        tokio::time::timeout(Duration::from_secs(10), h.sandbox.wait_streams_closed())
            .await
            .expect("closed");
        let response = h.turns().await.pop().expect("record").response.expect("response");
        assert_eq!(response.end, StreamEnd::ClientDisconnected, "{model}");
        assert_eq!(
            h.sandbox.stats().n_open_streams,
            0,
            "{model}: no stream left behind"
        );
    }
}

#[tokio::test]
async fn a_slowloris_client_is_cut_at_the_header_deadline() {
    let h = Harness::start(Default::default(), |c| {
        c.timeouts.client_header = Duration::from_millis(300)
    })
    .await;
    let addr = h.base.trim_start_matches("http://");
    let mut conn = tokio::net::TcpStream::connect(addr).await.expect("connect");
    conn.write_all(b"POST /v1/messages HTTP/1.1\r\nhost: x\r\n")
        .await
        .expect("write");
    let mut buf = Vec::new();
    let read = tokio::time::timeout(Duration::from_secs(10), conn.read_to_end(&mut buf)).await;
    assert!(read.is_ok(), "connection closed by the proxy");
    assert!(h.upstream.seen().is_empty());
}

#[tokio::test]
async fn a_transcript_that_cannot_be_opened_refuses_the_sandbox() {
    let dir = tempfile::tempdir().expect("tempdir");
    let blocker = dir.path().join("not-a-dir");
    std::fs::write(&blocker, b"").expect("write");
    let mut cfg = support::config("http://127.0.0.1:9", dir.path());
    cfg.transcript_dir = blocker;
    let proxy = crab_proxy::Proxy::new(cfg, std::sync::Arc::new(crab_proxy::NoopHook)).expect("proxy");
    let err = proxy
        .add_sandbox(crab_proxy::SandboxId::new("sb").expect("id"))
        .await
        .err()
        .expect("refused");
    assert!(
        matches!(
            err,
            crab_proxy::Error::Transcript(crab_proxy::transcript::TranscriptError::Open { .. })
        ),
        "{err:?}"
    );
    assert!(proxy
        .sandbox(&crab_proxy::SandboxId::new("sb").expect("id"))
        .is_none());
}

#[tokio::test]
async fn a_failing_transcript_disk_is_counted_and_never_wedges_the_agent() {
    let dir = tempfile::tempdir().expect("tempdir");
    let tdir = dir.path().join("transcripts");
    std::fs::create_dir_all(&tdir).expect("mkdir");
    // Every write to /dev/full fails with ENOSPC.
    std::os::unix::fs::symlink("/dev/full", tdir.join("sb1.jsonl")).expect("symlink");
    let h = Harness::start(Default::default(), |c| c.transcript_dir = tdir.clone()).await;
    for _ in 0..3 {
        let resp = h
            .post("/v1/chat/completions", &chat_body("gpt-test", false))
            .send()
            .await
            .expect("send");
        assert_eq!(resp.status(), 200);
        resp.bytes().await.expect("body");
    }
    h.sandbox.flush_transcript().await;
    let stats = h.sandbox.stats();
    assert_eq!(stats.n_transcript_errors, 3);
    assert_eq!(
        stats.n_transcript_timeouts, 0,
        "a failed write does not hold the next answer"
    );
    // The first turn had nothing before it; the others say their
    // conversation has a hole.
    let outcomes: Vec<GateOutcome> = stats.recent.iter().map(|r| r.outcome).collect();
    assert_eq!(
        outcomes,
        [
            GateOutcome::Opened,
            GateOutcome::TranscriptFailed,
            GateOutcome::TranscriptFailed
        ]
    );
    assert_eq!(stats.n_transcript_failures, 2);
}

#[tokio::test]
async fn a_trickled_body_is_cut_at_the_body_deadline() {
    let h = Harness::start(Default::default(), |c| {
        c.timeouts.client_body = Duration::from_millis(300)
    })
    .await;
    let addr = h.base.trim_start_matches("http://");
    let mut conn = tokio::net::TcpStream::connect(addr).await.expect("connect");
    // The head at once, then ten bytes of the hundred it promises.
    conn.write_all(
        b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\ncontent-length: 100\r\n\r\n{\"model\":",
    )
    .await
    .expect("write");
    let mut buf = Vec::new();
    let read = tokio::time::timeout(Duration::from_secs(10), conn.read_to_end(&mut buf)).await;
    assert!(read.is_ok(), "the proxy answers and closes");
    let text = String::from_utf8_lossy(&buf);
    assert!(text.starts_with("HTTP/1.1 408"), "{text}");
    assert!(text.contains("crab_request_body_timeout"), "{text}");
    assert!(h.upstream.seen().is_empty());
    assert_eq!(h.sandbox.last_turn(), 0, "a cut request is no turn");
}

#[tokio::test]
async fn connections_over_the_limit_get_503_until_one_closes() {
    let h = Harness::start(Default::default(), |c| {
        c.limits.max_connections = 2;
        // The silent connections must outlive the test, however slow it runs.
        c.timeouts.client_header = Duration::from_secs(600);
    })
    .await;
    let addr = h.base.trim_start_matches("http://").to_owned();
    // Two connections that say nothing hold both slots.
    let held = [
        tokio::net::TcpStream::connect(&addr).await.expect("connect"),
        tokio::net::TcpStream::connect(&addr).await.expect("connect"),
    ];
    let fresh = || reqwest::Client::builder().no_proxy().build().expect("client");
    let resp = fresh()
        .post(format!("{}/v1/chat/completions", h.base))
        .json(&chat_body("gpt-test", false))
        .send()
        .await
        .expect("a 503, not a broken connection");
    check_error(resp, 503, "crab_too_many_connections").await;
    assert!(h.upstream.seen().is_empty());

    // One closes: its slot serves the next connection.
    drop(held);
    let answered = async {
        loop {
            let resp = fresh()
                .post(format!("{}/v1/chat/completions", h.base))
                .json(&chat_body("gpt-test", false))
                .send()
                .await
                .expect("send");
            if resp.status() == 200 {
                return;
            }
            assert_eq!(resp.status(), 503);
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    };
    tokio::time::timeout(Duration::from_secs(20), answered)
        .await
        .expect("a freed slot serves again");
}

#[tokio::test]
async fn a_full_transcript_drops_later_records_and_says_so_once() {
    let max = 4096;
    let h = Harness::start(Default::default(), |c| c.limits.transcript_max_bytes = max).await;
    for _ in 0..12 {
        let resp = h
            .post("/v1/chat/completions", &chat_body("gpt-test", false))
            .send()
            .await
            .expect("send");
        assert_eq!(resp.status(), 200, "the agent is answered all the same");
        resp.bytes().await.expect("body");
    }
    h.sandbox.flush_transcript().await;
    let raw = std::fs::read(h.sandbox.transcript_path()).expect("read");
    let lines: Vec<serde_json::Value> = raw
        .split(|b| *b == b'\n')
        .filter(|l| !l.is_empty())
        .map(|l| serde_json::from_slice(l).expect("every line whole"))
        .collect();
    let overflows: Vec<_> = lines.iter().filter(|l| l["kind"] == "overflow").collect();
    assert_eq!(overflows.len(), 1, "{lines:?}");
    assert_eq!(overflows[0]["max_bytes"], max);
    assert_eq!(lines.last().unwrap()["kind"], "overflow", "nothing after it");
    let turns = lines.iter().filter(|l| l["kind"] == "turn").count() as u64;
    assert!((1..12).contains(&turns), "{turns} turns kept");
    let before_overflow = raw.len() - serde_json::to_vec(overflows[0]).unwrap().len() - 1;
    assert!(before_overflow as u64 <= max, "{before_overflow} bytes");
    assert_eq!(h.sandbox.stats().n_transcript_dropped, 12 - turns);
}

#[test]
fn a_connection_limit_of_zero_is_refused_at_start() {
    let dir = tempfile::tempdir().expect("tempdir");
    let mut cfg = support::config("http://127.0.0.1:9", dir.path());
    cfg.limits.max_connections = 0;
    let err = crab_proxy::Proxy::new(cfg, std::sync::Arc::new(crab_proxy::NoopHook))
        .err()
        .expect("refused");
    assert!(err.to_string().contains("max_connections"), "{err}");
}
