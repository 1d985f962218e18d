//! The LLM of agents inside their sandboxes (`--agent-inside`): an HTTP
//! server on the host's loopback, the proxies' upstream, that hands each
//! chat completion to the driver of the agent that asked (its request
//! names it) and answers what the driver says, when it says. A driver that
//! drops the request (it killed the sandbox meanwhile) leaves it
//! unanswered: the connection is closed.

use std::collections::HashMap;
use std::path::Path;
use std::sync::mpsc;
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime};

use anyhow::Context;
use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper::body::Incoming;
use hyper_util::rt::TokioIo;
use tokio::sync::oneshot;

/// The header that says when an agent sent its request (µs since the epoch).
const SENT_HEADER: &str = "x-crab-eval-sent-us";

/// The largest request body an agent sends.
const MAX_BODY: usize = 1 << 20;

/// The agent's program, put in every sandbox at `/opt/crab-agent`.
const AGENT_PY: &str = include_str!("../../eval/agent.py");

/// One request of an agent: its turn and the statuses of the commands it
/// ran since its last one.
pub struct Ask {
    /// The turn (1: the first request, before any command).
    pub turn: u64,
    /// Exit statuses of the step's commands, in order.
    pub statuses: Vec<i32>,
    /// When the agent sent it (its wall clock, the host's).
    pub sent: SystemTime,
    answer: oneshot::Sender<String>,
}

impl Ask {
    /// Answers with a chat completion whose message says `content`.
    pub fn answer(self, content: &str) {
        let _ = self.answer.send(content.to_owned());
    }
}

type Agents = Arc<Mutex<HashMap<String, mpsc::Sender<Ask>>>>;

/// The running server and the agent program's directory.
pub struct AgentLlm {
    /// Its port on 127.0.0.1.
    pub port: u16,
    agents: Agents,
    program: tempfile::TempDir,
    _runtime: tokio::runtime::Runtime,
}

// === impl AgentLlm ===

impl AgentLlm {
    /// Starts the server and writes the agent's program.
    pub fn start() -> anyhow::Result<AgentLlm> {
        // mkdtemp: 0700, no directory another user made first; the
        // sandboxes bind it read-only.
        let program = tempfile::Builder::new().prefix("crab-eval-agent").tempdir()?;
        std::fs::write(program.path().join("agent.py"), AGENT_PY)?;
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .enable_all()
            .build()?;
        let listener = runtime
            .block_on(tokio::net::TcpListener::bind("127.0.0.1:0"))
            .context("bind the agents' LLM")?;
        let port = listener.local_addr()?.port();
        let agents: Agents = Arc::default();
        let served = agents.clone();
        runtime.spawn(async move {
            loop {
                let Ok((stream, _)) = listener.accept().await else {
                    continue;
                };
                let agents = served.clone();
                tokio::spawn(async move {
                    let svc = hyper::service::service_fn(move |req| answer(req, agents.clone()));
                    let _ = hyper::server::conn::http1::Builder::new()
                        .serve_connection(TokioIo::new(stream), svc)
                        .await;
                });
            }
        });
        Ok(AgentLlm {
            port,
            agents,
            program,
            _runtime: runtime,
        })
    }

    /// The requests of agent `key` from now on (a new registration of the
    /// same key replaces the old one).
    pub fn register(&self, key: &str) -> mpsc::Receiver<Ask> {
        let (tx, rx) = mpsc::channel();
        self.agents.lock().expect("agents").insert(key.to_owned(), tx);
        rx
    }

    /// Forgets agent `key`: its requests are refused.
    pub fn forget(&self, key: &str) {
        self.agents.lock().expect("agents").remove(key);
    }

    /// The directory holding the agent's program (`agent.py`).
    pub fn program_dir(&self) -> &Path {
        self.program.path()
    }
}

/// What an agent's request says: its name, turn and statuses.
pub fn parse(body: &[u8]) -> Option<(String, u64, Vec<i32>)> {
    let v: serde_json::Value = serde_json::from_slice(body).ok()?;
    let said: serde_json::Value = serde_json::from_str(v["messages"][0]["content"].as_str()?).ok()?;
    let key = said["agent"].as_str()?.to_owned();
    let turn = said["turn"].as_u64().filter(|&t| t >= 1)?;
    let statuses = said["statuses"]
        .as_array()?
        .iter()
        .map(|s| s.as_i64().map(|s| s as i32))
        .collect::<Option<_>>()?;
    Some((key, turn, statuses))
}

async fn answer(
    req: http::Request<Incoming>,
    agents: Agents,
) -> std::io::Result<http::Response<Full<Bytes>>> {
    let reply = |status: u16, body: String| {
        http::Response::builder()
            .status(status)
            .header("content-type", "application/json")
            .body(Full::new(Bytes::from(body)))
            .unwrap_or_else(|_| http::Response::new(Full::new(Bytes::new())))
    };
    if req.method() != http::Method::POST {
        return Ok(reply(200, r#"{"data":[]}"#.to_owned()));
    }
    let sent = req
        .headers()
        .get(SENT_HEADER)
        .and_then(|v| v.to_str().ok()?.parse().ok())
        .map(|us| SystemTime::UNIX_EPOCH + Duration::from_micros(us));
    let body = http_body_util::Limited::new(req.into_body(), MAX_BODY)
        .collect()
        .await
        .map(|c| c.to_bytes())
        .unwrap_or_default();
    let (Some((key, turn, statuses)), Some(sent)) = (parse(&body), sent) else {
        return Ok(reply(
            400,
            r#"{"error":"not an eval agent's request"}"#.to_owned(),
        ));
    };
    let driver = agents.lock().expect("agents").get(&key).cloned();
    let (tx, rx) = oneshot::channel();
    let asked = driver.is_some_and(|d| {
        d.send(Ask {
            turn,
            statuses,
            sent,
            answer: tx,
        })
        .is_ok()
    });
    if !asked {
        return Ok(reply(404, format!(r#"{{"error":"no agent {key:?}"}}"#)));
    }
    match rx.await {
        Ok(content) => Ok(reply(200, crab_tests::llm::completion(&content))),
        // Dropped by its driver: never answered (the error closes the
        // connection).
        Err(_) => Err(std::io::Error::other("the driver dropped the request")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_agents_request_says_who_asks_which_turn_and_how_its_commands_ended() {
        let said = r#"{\"agent\": \"kv.crab\", \"statuses\": [0, 2], \"turn\": 3}"#;
        let body =
            format!(r#"{{"messages": [{{"content": "{said}", "role": "user"}}], "model": "crab-eval"}}"#);
        assert_eq!(parse(body.as_bytes()), Some(("kv.crab".into(), 3, vec![0, 2])));
        assert_eq!(parse(br#"{"messages":[{"content":"hello"}]}"#), None);
        let turn0 = body.replace(r#"\"turn\": 3"#, r#"\"turn\": 0"#);
        assert_eq!(parse(turn0.as_bytes()), None, "turns count from 1");
        assert_eq!(parse(b"not json"), None);
    }
}
