//! The official OpenAI and Anthropic Python SDKs against the proxy (over the
//! scripted upstream). Needs the SDK venv that `packaging/install-deps.sh`
//! makes (`/opt/crab/sdk-venv`, or `CRAB_SDK_PYTHON`): fails, never skips,
//! when it is missing.

mod support;

use std::path::PathBuf;
use std::time::Duration;

use support::Harness;

fn sdk_python() -> PathBuf {
    let python = std::env::var_os("CRAB_SDK_PYTHON")
        .map_or_else(|| "/opt/crab/sdk-venv/bin/python3".into(), PathBuf::from);
    assert!(
        python.exists(),
        "{} missing: run packaging/install-deps.sh (it installs the openai and anthropic SDKs)",
        python.display()
    );
    python
}

/// Runs `tests/sdk/<script>` with `python` against the proxy at `base`;
/// answers the JSON it prints.
async fn run_script(python: &std::path::Path, script: &str, base: &str) -> serde_json::Value {
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("tests/sdk")
        .join(script);
    let run = tokio::process::Command::new(python)
        .arg(&path)
        .env("CRAB_BASE", base)
        .env_remove("OPENAI_BASE_URL")
        .env_remove("ANTHROPIC_BASE_URL")
        .kill_on_drop(true)
        .output();
    let out = tokio::time::timeout(Duration::from_secs(120), run)
        .await
        .expect("sdk script finished")
        .expect("spawn");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{script} failed: {stderr}");
    serde_json::from_slice(&out.stdout).expect("script output is JSON")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn official_python_sdks_work_through_the_proxy() {
    let python = sdk_python();
    let h = Harness::plain().await;
    let got = run_script(&python, "sdk_check.py", &h.base).await;
    support::assert_sdk_report(&got);
    // chat, chat stream, chat tools, responses, messages, messages stream, 429: 7 turns;
    // models and count_tokens are auxiliary.
    let stats = h.sandbox.stats();
    assert_eq!((stats.n_turns, stats.n_aux_requests), (7, 2), "{stats:?}");
    let seen = h.upstream.seen();
    let anthropic = seen
        .iter()
        .find(|s| s.path == "/v1/messages")
        .expect("messages request");
    assert!(anthropic.headers.contains_key("anthropic-version"));
    assert_eq!(anthropic.headers["x-api-key"], "sk-ant-test");
    h.sandbox.flush_transcript().await;
    let raw = std::fs::read_to_string(h.sandbox.transcript_path()).expect("transcript");
    assert_eq!(raw.lines().count(), 7);
    assert!(!raw.contains("sk-ant-test") && !raw.contains("sk-test-openai"));
}

/// A turn the engine rolled back: each official SDK, streaming or not, in
/// each API, reads the notice as an ordinary answer; the transcript says
/// which rule, and the turns' records are never replayed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rolled_back_turn_answers_the_notice_in_each_api() {
    let python = sdk_python();
    let script: std::collections::HashMap<_, _> = (1..=7).map(|t| (t, support::HookStep::RollBack)).collect();
    let h = Harness::start(script, |_| {}).await;
    let got = run_script(&python, "notice_check.py", &h.base).await;
    for call in [
        "chat",
        "chat_stream",
        "messages",
        "messages_stream",
        "responses",
        "responses_stream",
        "chat_stream_helper",
    ] {
        assert_eq!(got[call], support::NOTICE, "{call}: {got}");
    }
    h.sandbox.flush_transcript().await;
    let entries = h.entries().await;
    let safety = entries
        .iter()
        .filter(|e| matches!(e, crab_proxy::transcript::Entry::Safety(_)))
        .count();
    assert_eq!(safety, 7);
    let gates: Vec<_> = h.turns().await.iter().map(|t| t.gate).collect();
    assert!(
        gates
            .iter()
            .all(|g| *g == Some(crab_proxy::GateOutcome::RolledBack)),
        "{gates:?}"
    );
}
