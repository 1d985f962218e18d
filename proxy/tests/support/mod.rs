//! Test harness: a scripted upstream, a proxy in front of it on a real
//! listener, scripted hooks, and transcript readers.

#![allow(dead_code)]

pub mod upstream;

use std::collections::HashMap;
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use crab_proxy::transcript::{read_entries, Entry, TurnRecord};
use crab_proxy::{
    HookError, Limits, Proxy, ProxyConfig, SafetyRollback, Sandbox, SandboxId, Timeouts, ToolsConfig,
    TurnEndCall, TurnEndRules, TurnHook, TurnVerdict, Upstreams,
};
use parking_lot::Mutex;
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;

pub use upstream::ScriptedUpstream;

/// What a scripted hook does for one turn.
#[derive(Debug, Clone, Copy)]
pub enum HookStep {
    Delay(Duration),
    Fail,
    Never,
    /// The engine rolled the turn back: the agent gets [`NOTICE`].
    RollBack,
}

/// What a rolled-back turn's agent is told.
pub const NOTICE: &str = "Crab rolled back your last step: \"/etc/passwd\" is protected.";

/// A hook that follows a per-turn script (default: return at once) and
/// records its calls.
#[derive(Default)]
pub struct ScriptedHook {
    pub script: HashMap<u64, HookStep>,
    pub calls: Mutex<Vec<(String, u64)>>,
    /// Each call's expected answer time.
    pub expected: Mutex<Vec<Option<Duration>>>,
    /// Turns whose answer arrived before the hook returned.
    pub waiting: Mutex<Vec<u64>>,
    /// The branch of each call.
    pub branches: Mutex<Vec<u64>>,
}

#[derive(Debug, thiserror::Error)]
#[error("scripted failure")]
struct ScriptedFailure;

#[async_trait]
impl TurnHook for ScriptedHook {
    async fn turn_ended(&self, end: TurnEndCall<'_>) -> Result<TurnVerdict, HookError> {
        let turn = end.turn;
        self.calls.lock().push((end.sandbox.to_string(), turn));
        self.branches.lock().push(end.branch);
        self.expected.lock().push(end.expected_answer);
        match self.script.get(&turn) {
            None => Ok(TurnVerdict::Safe),
            Some(HookStep::Delay(d)) => {
                tokio::time::sleep(*d).await;
                Ok(TurnVerdict::Safe)
            }
            Some(HookStep::Fail) => Err(HookError::CheckpointFailed {
                source: Box::new(ScriptedFailure),
            }),
            Some(HookStep::Never) => std::future::pending().await,
            Some(HookStep::RollBack) => Ok(TurnVerdict::RolledBack(SafetyRollback {
                rule: "protected_paths \"/etc/**\"".into(),
                what: "/etc/passwd".into(),
                version: turn,
                notice: NOTICE.into(),
            })),
        }
    }

    async fn answer_waiting(&self, _sandbox: &SandboxId, turn: u64) {
        self.waiting.lock().push(turn);
    }
}

pub struct Harness {
    pub upstream: ScriptedUpstream,
    pub proxy: Proxy,
    pub sandbox: Sandbox,
    pub hook: Arc<ScriptedHook>,
    /// `http://127.0.0.1:PORT` of the sandbox listener.
    pub base: String,
    pub client: reqwest::Client,
    pub dir: tempfile::TempDir,
    pub shutdown: CancellationToken,
}

pub fn config(upstream: &str, dir: &Path) -> ProxyConfig {
    ProxyConfig {
        upstreams: Upstreams {
            openai: upstream.parse().expect("uri"),
            anthropic: upstream.parse().expect("uri"),
        },
        turn_ends: TurnEndRules::main_loop(),
        limits: Limits {
            max_request_body: 1 << 20,
            transcript_body_cap: 1 << 20,
            transcript_max_bytes: 1 << 30,
            max_connections: 64,
        },
        timeouts: Timeouts {
            client_header: Duration::from_secs(5),
            client_body: Duration::from_secs(10),
            upstream_connect: Duration::from_secs(5),
            upstream_header: Duration::from_secs(10),
            upstream_idle: Duration::from_secs(10),
            upstream_total: Duration::from_secs(60),
            hook: Duration::from_secs(10),
        },
        transcript_dir: dir.join("transcripts"),
        tools: ToolsConfig { calls_per_minute: 0 },
    }
}

impl Harness {
    pub async fn start(script: HashMap<u64, HookStep>, tweak: impl FnOnce(&mut ProxyConfig)) -> Self {
        let upstream = ScriptedUpstream::start().await;
        let dir = tempfile::tempdir().expect("tempdir");
        let mut cfg = config(&upstream.url(), dir.path());
        tweak(&mut cfg);
        let hook = Arc::new(ScriptedHook {
            script,
            ..Default::default()
        });
        let proxy = Proxy::new(cfg, hook.clone()).expect("proxy");
        let sandbox = proxy
            .add_sandbox(SandboxId::new("sb1").expect("id"))
            .await
            .expect("sandbox");
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let base = format!("http://{}", listener.local_addr().expect("addr"));
        let shutdown = CancellationToken::new();
        tokio::spawn(crab_proxy::serve_sandbox(
            listener,
            sandbox.clone(),
            shutdown.clone(),
        ));
        let client = reqwest::Client::builder().no_proxy().build().expect("client");
        Self {
            upstream,
            proxy,
            sandbox,
            hook,
            base,
            client,
            dir,
            shutdown,
        }
    }

    pub async fn plain() -> Self {
        Self::start(HashMap::new(), |_| {}).await
    }

    pub fn post(&self, path: &str, body: &serde_json::Value) -> reqwest::RequestBuilder {
        self.client
            .post(format!("{}{path}", self.base))
            .header("authorization", "Bearer sk-secret-openai")
            .header("x-api-key", "sk-ant-secret")
            .header("content-type", "application/json")
            .body(body.to_string())
    }

    pub async fn turns(&self) -> Vec<TurnRecord> {
        self.sandbox.flush_transcript().await;
        turns_of(&self.entries().await)
    }

    pub async fn entries(&self) -> Vec<Entry> {
        self.sandbox.flush_transcript().await;
        read_entries(self.sandbox.transcript_path())
            .await
            .expect("transcript")
    }
}

impl Drop for Harness {
    fn drop(&mut self) {
        self.shutdown.cancel();
    }
}

pub fn turns_of(entries: &[Entry]) -> Vec<TurnRecord> {
    entries
        .iter()
        .filter_map(|e| match e {
            Entry::Turn(t) => Some(t.clone()),
            Entry::Divergence(_)
            | Entry::Branch(_)
            | Entry::Tool(_)
            | Entry::Safety(_)
            | Entry::Overflow(_) => None,
        })
        .collect()
}

/// `(branch, parent, after)` of each branch entry.
pub fn branches_of(entries: &[Entry]) -> Vec<(u64, u64, u64)> {
    entries
        .iter()
        .filter_map(|e| match e {
            Entry::Branch(b) => Some((b.branch, b.parent, b.after)),
            _ => None,
        })
        .collect()
}

pub fn chat_body(model: &str, stream: bool) -> serde_json::Value {
    serde_json::json!({"model": model, "stream": stream, "messages": [{"role": "user", "content": "hi"}]})
}

pub fn messages_body(model: &str, stream: bool) -> serde_json::Value {
    serde_json::json!({"model": model, "max_tokens": 64, "stream": stream, "messages": [{"role": "user", "content": "hi"}]})
}

/// Checks what `tests/sdk/sdk_check.py` printed: every SDK call got the
/// scripted upstream's answer, and the 429 came back as such.
#[track_caller]
pub fn assert_sdk_report(got: &serde_json::Value) {
    for (key, expected) in [
        ("chat", serde_json::json!("hello from upstream")),
        ("chat_stream", serde_json::json!("hello from upstream")),
        ("chat_tool_call", serde_json::json!("run")),
        ("responses", serde_json::json!("hello from upstream")),
        ("models", serde_json::json!(["gpt-test"])),
        ("messages", serde_json::json!("hello from upstream")),
        ("messages_stream", serde_json::json!("hello from upstream")),
        ("rate_limited", serde_json::json!(429)),
    ] {
        assert_eq!(got[key], expected, "{key} (sdk output {got})");
    }
    assert!(got["count_tokens"].as_u64().is_some_and(|n| n > 0), "{got}");
}
