//! The routes against a crabd with no shims, containerd or inspector: what
//! is decided before any of them is called.

use std::sync::Arc;

use axum::body::Body;
use axum::http::{Request, StatusCode};
use crab_api::config::CrabdConfig;
use crab_api::crabd::Registration;
use crab_api::SandboxId;
use http_body_util::BodyExt;
use tower::ServiceExt;

use crate::daemon::registry::Entry;
use crate::daemon::Daemon;

fn daemon(root: &std::path::Path, running: &[&str]) -> Arc<Daemon> {
    let mut config = CrabdConfig::load_from(&root.join("absent.toml")).unwrap();
    config.root = root.to_owned();
    config.shim_timeout_secs = 1;
    // One slot, no byte budget (and so no disk probe).
    config.schedule.slots = 1;
    config.schedule.bytes_per_sec = -1;
    let d = Daemon::open(config).unwrap();
    for id in running {
        let id = SandboxId::new(*id).unwrap();
        d.store.register(&id).unwrap();
        d.registry
            .insert(Entry {
                registration: Registration {
                    id: id.clone(),
                    namespace: "default".into(),
                    containerd: root.join("no-containerd.sock"),
                    control: root.join(format!("{id}.sock")),
                    pid: 1,
                    crab_init: false,
                    fs_backend: Some(crab_api::BackendKind::OverlayCopy),
                    proxy: None,
                    transcript: None,
                    cgroup: None,
                    layer: None,
                    own_snapshots: None,
                    restored: false,
                    pod: None,
                },
                running: true,
                incarnation: None,
                recoveries: 0,
                last_recovery: None,
                nonce: String::new(),
            })
            .unwrap();
    }
    Arc::new(d)
}

/// Sends `method path body` and answers the status and the `error` text.
async fn check(d: &Arc<Daemon>, method: &str, path: &str, body: &str) -> (StatusCode, String) {
    let req = Request::builder()
        .method(method)
        .uri(path)
        .body(Body::from(body.to_owned()))
        .unwrap();
    let resp = d.clone().router().oneshot(req).await.unwrap();
    let status = resp.status();
    let bytes = resp.into_body().collect().await.unwrap().to_bytes();
    let json: serde_json::Value = serde_json::from_slice(&bytes).unwrap_or_default();
    // Every answer of a route is one openapi.json describes.
    if crab_tests::openapi::pattern_of(path).is_some() {
        if let Err(e) = crab_tests::openapi::check_answer(method, path, status.as_u16(), &json) {
            panic!("{method} {path} answered {status} outside openapi.json: {e}");
        }
    }
    (status, json["error"].as_str().unwrap_or_default().to_owned())
}

const TURN: &str = r#"{"turn":1,"transcript_turns":0}"#;

#[tokio::test]
async fn a_turn_end_names_its_sandbox_exactly_never_by_prefix() {
    let dir = tempfile::tempdir().unwrap();
    let d = daemon(dir.path(), &["abcdef"]);
    // "abc" is a prefix of the one registered sandbox: a person's route
    // resolves it, a turn end must not.
    let (status, _) = check(&d, "GET", "/v1/sandboxes/abc", "").await;
    assert_eq!(status, StatusCode::OK);
    let (status, error) = check(&d, "POST", "/v1/sandboxes/abc/turns", TURN).await;
    assert_eq!(status, StatusCode::NOT_FOUND, "{error}");
    assert!(d
        .store
        .versions(&SandboxId::new("abcdef").unwrap())
        .unwrap()
        .is_empty());
    // The exact id goes on to the shim (absent here: a gateway error).
    let (status, error) = check(&d, "POST", "/v1/sandboxes/abcdef/turns", TURN).await;
    assert_eq!(status, StatusCode::BAD_GATEWAY, "{error}");
}

#[tokio::test]
async fn bad_input_is_refused_before_anything_is_done() {
    let dir = tempfile::tempdir().unwrap();
    let d = daemon(dir.path(), &["s1", "s2"]);
    for (method, path, body, expected) in [
        ("POST", "/v1/sandboxes/s1/turns", "{", StatusCode::BAD_REQUEST),
        (
            "POST",
            "/v1/sandboxes/..%2Fetc/turns",
            TURN,
            StatusCode::BAD_REQUEST,
        ),
        (
            "POST",
            "/v1/sandboxes/s/checkpoint",
            r#"{"class":"fs"}"#,
            StatusCode::CONFLICT,
        ),
        (
            "POST",
            "/v1/sandboxes/s1/checkpoint",
            r#"{"class":"most"}"#,
            StatusCode::BAD_REQUEST,
        ),
        (
            "POST",
            "/v1/sandboxes/nope/rollback",
            r#"{"version":1}"#,
            StatusCode::NOT_FOUND,
        ),
        (
            "POST",
            "/v1/sandboxes/s1/rollback",
            r#"{"version":0}"#,
            StatusCode::BAD_REQUEST,
        ),
        (
            "DELETE",
            "/v1/sandboxes/s1/versions/latest",
            "",
            StatusCode::BAD_REQUEST,
        ),
        ("DELETE", "/v1/sandboxes/s/", "", StatusCode::NOT_FOUND),
        (
            "POST",
            "/v1/sandboxes/s1/fork",
            r#"{"version":1,"name":"../x"}"#,
            StatusCode::BAD_REQUEST,
        ),
        (
            "POST",
            "/v1/sandboxes/s1/forks",
            r#"{"version":1,"count":0}"#,
            StatusCode::BAD_REQUEST,
        ),
        (
            "POST",
            "/v1/sandboxes/s1/forks",
            r#"{"version":1,"count":10000}"#,
            StatusCode::BAD_REQUEST,
        ),
        (
            "POST",
            "/v1/sandboxes/s1/forks",
            r#"{"version":1,"count":2,"prefix":"../x"}"#,
            StatusCode::BAD_REQUEST,
        ),
        (
            "POST",
            "/v1/sandboxes/s1/forks",
            r#"{"version":1}"#,
            StatusCode::BAD_REQUEST,
        ),
        (
            "POST",
            "/v1/drain",
            r#"{"grace_secs":0}"#,
            StatusCode::BAD_REQUEST,
        ),
        (
            "POST",
            "/v1/drain",
            r#"{"grace_secs":99999}"#,
            StatusCode::BAD_REQUEST,
        ),
        (
            "POST",
            "/v1/drain",
            r#"{"grace_secs":5,"export_dir":"out"}"#,
            StatusCode::BAD_REQUEST,
        ),
        (
            "POST",
            "/v1/drain",
            r#"{"grace_secs":5,"export_dir":"/tmp/../etc"}"#,
            StatusCode::BAD_REQUEST,
        ),
        ("GET", "/v1/nothing", "", StatusCode::NOT_FOUND),
    ] {
        let (status, error) = check(&d, method, path, body).await;
        assert_eq!(status, expected, "{method} {path}: {error}");
        assert!(!error.is_empty(), "{method} {path} answers why");
    }
}

#[tokio::test]
async fn one_drain_at_a_time() {
    let dir = tempfile::tempdir().unwrap();
    let d = daemon(dir.path(), &[]);
    let running = d.draining.clone().try_lock_owned().expect("no drain yet");
    let (status, error) = check(&d, "POST", "/v1/drain", r#"{"grace_secs":5}"#).await;
    assert_eq!(status, StatusCode::CONFLICT, "{error}");
    assert!(error.contains("drain is running"), "{error}");
    drop(running);
    // Nothing runs: an empty report.
    let (status, error) = check(&d, "POST", "/v1/drain", r#"{"grace_secs":5}"#).await;
    assert_eq!(status, StatusCode::OK, "{error}");
}

#[tokio::test]
async fn an_answer_that_waits_promotes_only_a_queued_checkpoint() {
    let dir = tempfile::tempdir().unwrap();
    let d = daemon(dir.path(), &["s1"]);
    // Nothing queued: nothing to promote.
    let (status, _) = check(&d, "POST", "/v1/sandboxes/s1/turns/3/answered", "").await;
    assert_eq!(status, StatusCode::OK);
    for (path, expected) in [
        ("/v1/sandboxes/s1/turns/x/answered", StatusCode::BAD_REQUEST),
        ("/v1/sandboxes/nobody/turns/3/answered", StatusCode::NOT_FOUND),
        ("/v1/sandboxes/..%2Fx/turns/3/answered", StatusCode::BAD_REQUEST),
    ] {
        let (status, error) = check(&d, "POST", path, "").await;
        assert_eq!(status, expected, "{path}: {error}");
    }
}

/// `GET path` on `router`: the status and the body as text.
async fn get_text(router: axum::Router, path: &str) -> (StatusCode, String) {
    let req = Request::builder().uri(path).body(Body::empty()).unwrap();
    let resp = router.oneshot(req).await.unwrap();
    let status = resp.status();
    let bytes = resp.into_body().collect().await.unwrap().to_bytes();
    (status, String::from_utf8_lossy(&bytes).into_owned())
}

#[tokio::test]
async fn metrics_are_prometheus_text_and_alone_on_the_metrics_address() {
    let dir = tempfile::tempdir().unwrap();
    let d = daemon(dir.path(), &["s1"]);
    let (status, text) = get_text(d.clone().router(), "/metrics").await;
    assert_eq!(status, StatusCode::OK);
    for name in [
        "crab_queue_depth",
        "crab_slots_in_use",
        "crab_urgent_promotions_total",
    ] {
        assert!(
            text.contains(&format!("# TYPE {}", name.trim_end_matches("_total"))),
            "{name}:\n{text}"
        );
    }
    assert!(text.ends_with("# EOF\n"), "{text}");
    let (status, _) = get_text(super::metrics_router(d.clone()), "/metrics").await;
    assert_eq!(status, StatusCode::OK);
    // Nothing else of the management API is reachable there.
    let (status, _) = get_text(super::metrics_router(d), "/v1/sandboxes").await;
    assert_eq!(status, StatusCode::NOT_FOUND);
}

/// Polls `f` (every 10 ms, at most 10 s) until it holds.
async fn until(mut f: impl FnMut() -> bool) {
    for _ in 0..1000 {
        if f() {
            return;
        }
        tokio::time::sleep(std::time::Duration::from_millis(10)).await;
    }
    panic!("the condition never held");
}

fn turn_body(turn: u64) -> String {
    format!(r#"{{"turn":{turn},"transcript_turns":{}}}"#, turn - 1)
}

#[tokio::test]
async fn queued_turn_ends_merge_and_each_is_answered_once() {
    let dir = tempfile::tempdir().unwrap();
    let d = daemon(dir.path(), &["s1", "s2"]);
    let s1 = SandboxId::new("s1").unwrap();
    // Another sandbox's checkpoint holds the only slot.
    let held = d
        .scheduler
        .admit(&SandboxId::new("s2").unwrap(), tokio::time::Instant::now(), false)
        .await;
    let end = |turn: u64| {
        let d = d.clone();
        tokio::spawn(async move { check(&d, "POST", "/v1/sandboxes/s1/turns", &turn_body(turn)).await })
    };
    // Turn 1's checkpoint waits for the slot; turns 2 and 3 end meanwhile.
    let mut ends = vec![end(1)];
    until(|| d.metrics.queue_depth.get() == 1).await;
    ends.extend([end(2), end(3)]);
    until(|| d.turns.n_waiting(&s1) == 2).await;
    // Its answer arrived: the queued checkpoint goes first.
    let (status, _) = check(&d, "POST", "/v1/sandboxes/s1/turns/1/answered", "").await;
    assert_eq!(status, StatusCode::OK);
    assert_eq!(d.metrics.urgent_promotions.get(), 1);
    drop(held);
    // One capture for the three (it fails here: there is no shim), and
    // each turn end hears of it once.
    for end in ends {
        let (status, error) = end.await.unwrap();
        assert_eq!(status, StatusCode::BAD_GATEWAY, "{error}");
    }
    assert_eq!(d.metrics.merged_turns.get(), 2);
    assert_eq!(d.metrics.skipped_turns.get(), 3);
    assert_eq!(d.turns.n_waiting(&s1), 0);
}

#[tokio::test]
async fn a_rollback_supersedes_the_turn_ends_it_overtakes() {
    let dir = tempfile::tempdir().unwrap();
    let d = daemon(dir.path(), &["s1"]);
    let s1 = SandboxId::new("s1").unwrap();
    // A rollback holds the sandbox; turn 1 ended just before it began.
    let busy = d.busy(&s1);
    let rolling = busy.lock().await;
    let queued = {
        let d = d.clone();
        tokio::spawn(async move { check(&d, "POST", "/v1/sandboxes/s1/turns", &turn_body(1)).await })
    };
    until(|| d.turns.n_waiting(&s1) == 1).await;
    d.turns.rolling_back(&s1);
    // A turn end while it runs is refused at once.
    let (status, error) = check(&d, "POST", "/v1/sandboxes/s1/turns", &turn_body(2)).await;
    assert_eq!(status, StatusCode::CONFLICT, "{error}");
    assert!(error.contains("a rollback of the sandbox is running"), "{error}");
    d.turns.rolled_back(&s1);
    drop(rolling);
    // The one it overtook gets no version.
    let (status, error) = queued.await.unwrap();
    assert_eq!(status, StatusCode::CONFLICT, "{error}");
    assert!(error.contains("turn 1 of sandbox s1 has no version"), "{error}");
    // After the rollback, turn ends go on (to the absent shim).
    let (status, error) = check(&d, "POST", "/v1/sandboxes/s1/turns", &turn_body(3)).await;
    assert_eq!(status, StatusCode::BAD_GATEWAY, "{error}");
}
