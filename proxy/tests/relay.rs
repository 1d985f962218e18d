//! The host relay (crabd's host listener): `/s/<sandbox>/<secret>/…`
//! reaches the sandbox served on its unix socket, turns and streams
//! included; unknown sandboxes, wrong secrets, foreign hosts, dead sockets
//! and bad paths get clear answers.

mod support;

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use crab_proxy::{SandboxId, SandboxSockets};
use support::{chat_body, Harness};
use tokio_util::sync::CancellationToken;

/// A fixed table of sockets, as crabd's registry would give them.
struct Table(HashMap<String, PathBuf>);

impl SandboxSockets for Table {
    fn proxy_socket(&self, id: &SandboxId, secret: &str) -> Option<PathBuf> {
        (secret == SECRET)
            .then(|| self.0.get(id.as_str()).cloned())
            .flatten()
    }
}

/// Every sandbox's secret in the table.
const SECRET: &str = "0123abcd";

#[tokio::test]
async fn relays_turns_and_streams_to_the_sandbox_socket() {
    let h = Harness::plain().await;
    let socket = h.dir.path().join("sb1.proxy.sock");
    let unix = tokio::net::UnixListener::bind(&socket).expect("bind unix");
    let shutdown = CancellationToken::new();
    let sandbox_server = tokio::spawn(crab_proxy::serve_sandbox(
        unix,
        h.sandbox.clone(),
        shutdown.clone(),
    ));
    let table = Table(HashMap::from([
        ("sb1".to_owned(), socket),
        ("dead".to_owned(), h.dir.path().join("nothing.sock")),
    ]));
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let host = format!("http://{}", listener.local_addr().expect("addr"));
    let relay = tokio::spawn(crab_proxy::serve_relay(
        listener,
        Arc::new(table),
        Duration::from_secs(5),
        shutdown.clone(),
    ));
    let post = |url: String, body: serde_json::Value| {
        h.client
            .post(url)
            .header("authorization", "Bearer sk-secret")
            .header("content-type", "application/json")
            .body(body.to_string())
    };

    // A non-streaming turn, an auxiliary request, a stream chunk by chunk.
    let resp = post(
        format!("{host}/s/sb1/{SECRET}/v1/chat/completions?x=1"),
        chat_body("gpt-test", false),
    )
    .send()
    .await
    .expect("send");
    assert_eq!(resp.status(), 200);
    assert_eq!(resp.headers()["x-upstream"], "scripted");
    let models = h
        .client
        .get(format!("{host}/s/sb1/{SECRET}/v1/models"))
        .send()
        .await
        .expect("send");
    assert_eq!(models.status(), 200);
    let mut stream = post(
        format!("{host}/s/sb1/{SECRET}/v1/chat/completions"),
        chat_body("gated", true),
    )
    .send()
    .await
    .expect("send");
    // The upstream holds the rest until `release`: the first chunk must
    // already have crossed both hops.
    let first = stream.chunk().await.expect("chunk").expect("first chunk");
    assert!(first.starts_with(b"data: "), "{first:?}");
    h.upstream.release();
    while stream.chunk().await.expect("chunk").is_some() {}

    let seen = h.upstream.seen();
    assert_eq!(
        seen[0].path, "/v1/chat/completions?x=1",
        "prefix stripped, query kept"
    );
    assert_eq!(seen[0].headers["authorization"], "Bearer sk-secret");
    assert_eq!(h.sandbox.last_turn(), 2, "the model list is no turn");
    assert_eq!(h.hook.calls.lock().len(), 2);
    assert_eq!(h.turns().await.len(), 2);

    for (path, status, code) in [
        (
            "/s/nope/0123abcd/v1/chat/completions",
            404,
            "crab_unknown_sandbox",
        ),
        ("/s/sb1/v1/chat/completions", 404, "crab_unknown_sandbox"),
        ("/s/sb1/0123abce/v1/chat/completions", 404, "crab_unknown_sandbox"),
        ("/s/sb1", 404, "crab_unknown_sandbox"),
        (
            "/s/dead/0123abcd/v1/chat/completions",
            502,
            "crab_sandbox_unreachable",
        ),
        ("/s/..%2f/v1/chat/completions", 400, "crab_invalid_sandbox_id"),
        ("/v1/chat/completions", 400, "crab_not_a_sandbox_path"),
    ] {
        let resp = post(format!("{host}{path}"), chat_body("gpt-test", false))
            .send()
            .await
            .expect("send");
        assert_eq!(resp.status(), status, "{path}");
        let body: serde_json::Value = resp.json().await.expect("json");
        assert_eq!(body["error"]["type"], code, "{path}");
    }
    // A web page rebound to the loopback names its own host.
    let resp = post(
        format!("{host}/s/sb1/{SECRET}/v1/chat/completions"),
        chat_body("gpt-test", false),
    )
    .header("host", "evil.example:80")
    .send()
    .await
    .expect("send");
    assert_eq!(resp.status(), 403);
    let body: serde_json::Value = resp.json().await.expect("json");
    assert_eq!(body["error"]["type"], "crab_foreign_host");
    assert_eq!(h.turns().await.len(), 2, "no refused request was a turn");
    shutdown.cancel();
    for task in [relay, sandbox_server] {
        tokio::time::timeout(Duration::from_secs(10), task)
            .await
            .expect("server stops")
            .expect("join");
    }
}

/// Serves `sandbox` on a fresh unix socket at `path`, counting the
/// connections it accepts; answers the server's task.
async fn serve_counting(
    path: &std::path::Path,
    sandbox: crab_proxy::Sandbox,
    accepted: Arc<std::sync::atomic::AtomicUsize>,
    shutdown: CancellationToken,
) -> tokio::task::JoinHandle<()> {
    /// A unix listener that counts what it accepts.
    struct Counting(tokio::net::UnixListener, Arc<std::sync::atomic::AtomicUsize>);
    impl crab_proxy::Listener for Counting {
        type Stream = tokio::net::UnixStream;
        const IN_SANDBOX: bool = false;
        async fn accept(&self) -> std::io::Result<(Self::Stream, String)> {
            let (stream, _) = self.0.accept().await?;
            self.1.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
            Ok((stream, "unix".to_owned()))
        }
    }
    let _ = std::fs::remove_file(path);
    let unix = tokio::net::UnixListener::bind(path).expect("bind unix");
    tokio::spawn(crab_proxy::serve_sandbox(
        Counting(unix, accepted),
        sandbox,
        shutdown,
    ))
}

#[tokio::test]
async fn kept_connections_serve_one_sandbox_each_and_a_restarted_socket_is_reached_again() {
    use std::sync::atomic::{AtomicUsize, Ordering};
    let h = Harness::plain().await;
    let other = h
        .proxy
        .add_sandbox(SandboxId::new("sb2").expect("id"))
        .await
        .expect("second sandbox");
    let (one, two) = (h.dir.path().join("sb1.sock"), h.dir.path().join("sb2.sock"));
    let (count1, count2) = (Arc::new(AtomicUsize::new(0)), Arc::new(AtomicUsize::new(0)));
    let stop1 = CancellationToken::new();
    let stop2 = CancellationToken::new();
    let server1 = serve_counting(&one, h.sandbox.clone(), count1.clone(), stop1.clone()).await;
    let server2 = serve_counting(&two, other.clone(), count2.clone(), stop2.clone()).await;
    let table = Table(HashMap::from([
        ("sb1".to_owned(), one.clone()),
        ("sb2".to_owned(), two),
    ]));
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let host = format!("http://{}", listener.local_addr().expect("addr"));
    let shutdown = CancellationToken::new();
    let relay = tokio::spawn(crab_proxy::serve_relay(
        listener,
        Arc::new(table),
        Duration::from_secs(5),
        shutdown.clone(),
    ));
    let turn = |id: &str| {
        h.client
            .post(format!("{host}/s/{id}/{SECRET}/v1/chat/completions"))
            .header("content-type", "application/json")
            .body(chat_body("gpt-test", false).to_string())
            .send()
    };

    // Sequential turns, alternating: each lands on its own sandbox, and
    // connections are kept (a connection goes back to the pool in a task
    // of its own after its answer, so a second one may be opened before
    // the first is back; never one per turn).
    for _ in 0..4 {
        for id in ["sb1", "sb2"] {
            let resp = turn(id).await.expect("send");
            assert_eq!(resp.status(), 200, "{id}");
            resp.bytes().await.expect("body");
        }
    }
    assert_eq!((h.sandbox.last_turn(), other.last_turn()), (4, 4));
    assert!(count1.load(Ordering::SeqCst) <= 2, "sb1's connections kept");
    assert!(count2.load(Ordering::SeqCst) <= 2, "sb2's connections kept");

    // The shim of sb1 restarts on the same path: its kept connection is
    // gone. A turn written on it before the relay saw it close gets a
    // 502 and is not sent again; the next reaches the new server.
    stop1.cancel();
    server1.await.expect("first server ends");
    let count3 = Arc::new(AtomicUsize::new(0));
    let stop3 = CancellationToken::new();
    let server3 = serve_counting(&one, h.sandbox.clone(), count3.clone(), stop3.clone()).await;
    let mut resp = turn("sb1").await.expect("send");
    if resp.status() == 502 {
        let body: serde_json::Value = resp.json().await.expect("json");
        assert_eq!(body["error"]["type"], "crab_sandbox_exchange_failed");
        resp = turn("sb1").await.expect("send");
    }
    assert_eq!(resp.status(), 200, "a restarted socket is reached");
    resp.bytes().await.expect("body");
    assert_eq!(count3.load(Ordering::SeqCst), 1);
    assert_eq!(h.sandbox.last_turn(), 5, "every turn counted once");

    shutdown.cancel();
    stop2.cancel();
    stop3.cancel();
    for task in [relay, server2, server3] {
        tokio::time::timeout(Duration::from_secs(10), task)
            .await
            .expect("server stops")
            .expect("join");
    }
}
