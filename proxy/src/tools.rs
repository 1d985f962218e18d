//! The agent's own rollback tool, served by the sandbox's proxy under
//! `/crab/`: list the sandbox's versions, checkpoint it now, put its files
//! back to a turn or a version (its processes, the agent among them, go
//! on), and roll the whole sandbox back when the agent runs outside it.
//!
//! ```text
//! GET  /crab/v1/versions                                 → {"versions":[{"version","turn","branch","class","age_secs","parent"}]}
//! POST /crab/v1/checkpoint {"class":"full"|"fs"}         → {"version",…,"frozen_ms"}
//! POST /crab/v1/rollback   {"turn":K | "version":N, "files_only":true}
//! POST /crab/v1/replay                                 (outside only) → {"version","until"}
//! POST /crab/mcp                                         MCP, streamable HTTP (JSON answers, no session)
//! ```
//!
//! Who reaches it: the sandbox's own listener (its loopback, so only the
//! sandbox), and crabd's host listener under the sandbox's secret URL. A
//! request from inside may only put files back: a whole rollback would
//! restore the caller too, and its answer could not arrive.
//!
//! Bounded: calls are rate-limited per sandbox (`calls_per_minute`, 0 =
//! unlimited), bodies are at most [`MAX_BODY`]. Every call, a refused one
//! too, is a `tool` entry of the transcript, durable before it is answered.

mod mcp;
mod rate;

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Instant;

use async_trait::async_trait;
use bytes::Bytes;
use crab_api::crabd::RollbackReport;
use crab_api::{Class, VersionRecord};
use http::{HeaderValue, Method, Request, Response, StatusCode};
use http_body::Body;
use http_body_util::{BodyExt, Full, Limited};
use serde::Deserialize;
use serde_json::{json, Value};
use tower::Service;

pub(crate) use rate::ToolLimits;

use crate::server::FromInside;
use crate::shared::Shared;
use crate::transcript::{Entry, ToolRecord};
use crate::{ProxyBody, SandboxId};

/// Every path of the tool starts with it.
pub const PREFIX: &str = "/crab/";

/// The MCP endpoint.
pub const MCP_PATH: &str = "/crab/mcp";

/// The largest request body of a tool call.
pub const MAX_BODY: usize = 64 << 10;

/// What the tool asks of the engine, for one sandbox.
#[async_trait]
pub trait AgentTools: Send + Sync + 'static {
    /// The sandbox's versions, oldest first.
    async fn versions(&self, sandbox: &SandboxId) -> Result<Vec<VersionRecord>, ToolError>;

    /// Checkpoints the sandbox now; answers the version and how long the
    /// sandbox was frozen, in milliseconds.
    async fn checkpoint(&self, sandbox: &SandboxId, class: Class) -> Result<(VersionRecord, f64), ToolError>;

    /// Puts the sandbox (its files only, or everything) back to `version`.
    async fn rollback(
        &self,
        sandbox: &SandboxId,
        version: u64,
        files_only: bool,
    ) -> Result<RollbackReport, ToolError>;
}

/// A tool call that failed, with the HTTP status it answers.
#[derive(Debug, Clone, thiserror::Error)]
#[error("{message}")]
pub struct ToolError {
    /// The HTTP status of the answer.
    pub status: u16,
    /// What went wrong, for the agent.
    pub message: String,
}

impl ToolError {
    /// A refusal with `status`.
    pub fn new(status: StatusCode, message: impl Into<String>) -> Self {
        ToolError {
            status: status.as_u16(),
            message: message.into(),
        }
    }

    fn bad(message: impl Into<String>) -> Self {
        Self::new(StatusCode::BAD_REQUEST, message)
    }
}

/// One call, however it came.
#[derive(Debug, Clone, PartialEq)]
pub(crate) enum Call {
    Versions,
    Checkpoint {
        class: Class,
    },
    Rollback {
        to: Target,
        files_only: bool,
    },
    /// An agent outside, started again from scratch: the sandbox back to
    /// turn 1's version (where the agent starts: its commands run again),
    /// its requests answered from the transcript.
    Replay,
}

/// Where a rollback goes.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) enum Target {
    Turn(u64),
    Version(u64),
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct CheckpointArgs {
    #[serde(default)]
    class: Option<Class>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RollbackArgs {
    #[serde(default)]
    turn: Option<u64>,
    #[serde(default)]
    version: Option<u64>,
    #[serde(default)]
    files_only: Option<bool>,
}

// === impl Call ===

impl Call {
    /// The tool `name` with arguments `args` (a JSON object, or null).
    /// `inside`: files-only is the default rollback for an agent inside.
    pub(crate) fn parse(name: &str, args: Value, inside: bool) -> Result<Call, ToolError> {
        let args = if args.is_null() { json!({}) } else { args };
        let bad_args = |e: serde_json::Error| ToolError::bad(format!("invalid arguments of {name}: {e}"));
        match name {
            "list_versions" => match args.as_object() {
                Some(o) if o.is_empty() => Ok(Call::Versions),
                _ => Err(ToolError::bad("list_versions takes no arguments")),
            },
            "checkpoint" => {
                let a: CheckpointArgs = serde_json::from_value(args).map_err(bad_args)?;
                // Files by default: cheap, and what an agent undoes.
                let class = a.class.unwrap_or(Class::Fs);
                if !matches!(class, Class::Fs | Class::Full) {
                    return Err(ToolError::bad("a checkpoint's class is \"fs\" or \"full\""));
                }
                Ok(Call::Checkpoint { class })
            }
            "rollback_files" | "rollback_sandbox" => {
                let a: RollbackArgs = serde_json::from_value(args).map_err(bad_args)?;
                let to = match (a.turn, a.version) {
                    (Some(t), None) if t > 0 => Target::Turn(t),
                    (None, Some(v)) if v > 0 => Target::Version(v),
                    _ => {
                        return Err(ToolError::bad(
                            "name exactly one of \"turn\" or \"version\" (from 1)",
                        ))
                    }
                };
                let files_only = match name {
                    "rollback_files" => true,
                    _ => a.files_only.unwrap_or(inside),
                };
                Ok(Call::Rollback { to, files_only })
            }
            "replay" => match args.as_object() {
                Some(o) if o.is_empty() => Ok(Call::Replay),
                _ => Err(ToolError::bad("replay takes no arguments: it starts at turn 1")),
            },
            other => Err(ToolError::new(
                StatusCode::NOT_FOUND,
                format!("no tool {other:?}"),
            )),
        }
    }

    fn name(&self) -> &'static str {
        match self {
            Call::Versions => "list_versions",
            Call::Checkpoint { .. } => "checkpoint",
            Call::Rollback { files_only: true, .. } => "rollback_files",
            Call::Rollback { .. } => "rollback_sandbox",
            Call::Replay => "replay",
        }
    }

    fn args(&self) -> Value {
        match self {
            Call::Versions => json!({}),
            Call::Checkpoint { class } => json!({ "class": class }),
            Call::Rollback { to, files_only } => {
                let mut v = match to {
                    Target::Turn(t) => json!({ "turn": t }),
                    Target::Version(n) => json!({ "version": n }),
                };
                v["files_only"] = json!(files_only);
                v
            }
            Call::Replay => json!({}),
        }
    }
}

/// Runs `call` for the sandbox of `shared`, rate-limited, and records it
/// in the transcript; `via` is `http` or `mcp`.
pub(crate) async fn run(
    shared: &Shared,
    call: Result<Call, ToolError>,
    via: &str,
    inside: bool,
) -> Result<Value, ToolError> {
    let started = Instant::now();
    let unix_ms = crate::transcript::unix_ms();
    let (name, args) = match &call {
        Ok(c) => (c.name().to_owned(), c.args()),
        Err(_) => ("invalid".to_owned(), Value::Null),
    };
    // Every call counts, a malformed one too: each may cost a record.
    let limited = shared.tool_limits.take(inside);
    let result = match (limited, call) {
        (Err(wait), _) => Err(ToolError::new(
            StatusCode::TOO_MANY_REQUESTS,
            format!("rate limit: try again in {:.1} s", wait.as_secs_f64()),
        )),
        (Ok(()), Err(e)) => Err(e),
        (Ok(()), Ok(call)) => execute(shared, call, inside).await,
    };
    // A run of refusals is one record a minute (the rest are counted in
    // the next record): refused calls must not grow the transcript.
    let refused = result
        .as_ref()
        .is_err_and(|e| e.status == StatusCode::TOO_MANY_REQUESTS.as_u16());
    let Some(unrecorded_refusals) = shared.tool_limits.record(refused) else {
        return result;
    };
    let after_turn = shared.with_turns(|t| t.last_turn);
    let record = ToolRecord {
        v: 1,
        sandbox: shared.id.to_string(),
        tool: name.clone(),
        via: via.to_owned(),
        inside,
        args,
        after_turn,
        result: result.as_ref().ok().map(|v| summary(&name, v)),
        error: result.as_ref().err().map(|e| bounded(&e.message)),
        unix_ms,
        took_us: started.elapsed().as_micros() as u64,
        unrecorded_refusals,
    };
    shared.transcript.submit(Entry::Tool(record));
    // Answered once recorded, as a turn is (bounded as the hold is).
    let durable = shared.transcript.wait_durable(shared.transcript.submitted());
    match tokio::time::timeout(shared.config.timeouts.hook, durable).await {
        Ok(Ok(())) => {}
        Ok(Err(_lost)) => {
            tracing::warn!(sandbox = %shared.id, tool = name, "tool call answered though a record could not be written");
        }
        Err(_) => {
            tracing::warn!(sandbox = %shared.id, tool = name, "tool call answered before its record was durable");
        }
    }
    match &result {
        Ok(_) => tracing::info!(sandbox = %shared.id, tool = name, via, inside, "agent tool call"),
        Err(e) => {
            tracing::info!(sandbox = %shared.id, tool = name, via, inside, error = %e, "agent tool call refused")
        }
    }
    result
}

async fn execute(shared: &Shared, call: Call, inside: bool) -> Result<Value, ToolError> {
    let tools = shared.tools.as_ref().ok_or_else(|| {
        ToolError::new(
            StatusCode::SERVICE_UNAVAILABLE,
            "no engine: this sandbox keeps no versions",
        )
    })?;
    let id = &shared.id;
    match call {
        Call::Versions => {
            let now = crate::transcript::unix_ms();
            let versions: Vec<Value> = tools.versions(id).await?.iter().map(|r| view(r, now)).collect();
            Ok(json!({ "sandbox": id, "versions": versions }))
        }
        Call::Checkpoint { class } => {
            let (record, frozen_ms) = tools.checkpoint(id, class).await?;
            let mut v = view(&record, crate::transcript::unix_ms());
            v["frozen_ms"] = json!(frozen_ms);
            Ok(v)
        }
        Call::Rollback { to, files_only } => {
            if inside && !files_only {
                return Err(ToolError::new(
                    StatusCode::CONFLICT,
                    "the agent runs inside the sandbox: a whole rollback would restore the caller too; \
                     roll back its files (rollback_files), or ask from outside (crabctl proxy-url)",
                ));
            }
            let version = match to {
                Target::Version(v) => v,
                Target::Turn(turn) => {
                    let branch = shared.with_turns(|t| t.branch);
                    turn_version(&tools.versions(id).await?, turn, branch)?
                }
            };
            let r = tools.rollback(id, version, files_only).await?;
            Ok(json!({
                "version": r.version,
                "files_from": r.files_from,
                "files_only": files_only,
                "total_ms": r.total_ms,
            }))
        }
        Call::Replay => {
            let from = 1;
            if inside {
                return Err(ToolError::new(
                    StatusCode::CONFLICT,
                    "an agent inside the sandbox is restored with it and fast-forwarded on its own",
                ));
            }
            let (last, branch) = shared.with_turns(|t| (t.last_turn, t.branch));
            if from > last {
                return Err(ToolError::new(
                    StatusCode::NOT_FOUND,
                    format!("turn {from} is past the conversation's last, {last}"),
                ));
            }
            let version = turn_version(&tools.versions(id).await?, from, branch)?;
            let r = tools.rollback(id, version, false).await?;
            // The longest prefix of the conversation that has whole records
            // (a turn cut by a crash is asked of the LLM again).
            let mut until = last;
            while until > 0 {
                match shared.replay_from_start(until).await {
                    Ok(()) => break,
                    Err(crate::Error::Replay(
                        crate::ReplayError::IncompleteTurn { turn }
                        | crate::ReplayError::MissingTurn { turn },
                    )) if turn > 0 && turn <= until => until = turn - 1,
                    Err(e) => return Err(ToolError::new(StatusCode::INTERNAL_SERVER_ERROR, e.to_string())),
                }
            }
            Ok(json!({ "version": r.version, "until": until }))
        }
    }
}

/// What a transcript keeps of a call's answer: a version list is counted,
/// not copied.
fn summary(tool: &str, result: &Value) -> Value {
    match (tool, result["versions"].as_array()) {
        ("list_versions", Some(list)) => json!({ "n_versions": list.len() }),
        _ => result.clone(),
    }
}

/// At most [`MAX_RECORDED_ERROR`] bytes of an error message (it may quote
/// what the caller sent).
fn bounded(message: &str) -> String {
    if message.len() <= MAX_RECORDED_ERROR {
        return message.to_owned();
    }
    let mut end = MAX_RECORDED_ERROR;
    while !message.is_char_boundary(end) {
        end -= 1;
    }
    format!("{}…", &message[..end])
}

/// The longest error message a tool record keeps.
const MAX_RECORDED_ERROR: usize = 512;

/// The version that ended `turn` in the sandbox's line of history: the
/// nearest such ancestor of the newest version on `branch` (parents are
/// older versions), else the newest that did on `branch`, else anywhere.
fn turn_version(versions: &[VersionRecord], turn: u64, branch: u64) -> Result<u64, ToolError> {
    let by_number: std::collections::HashMap<u64, &VersionRecord> =
        versions.iter().map(|r| (r.version, r)).collect();
    let newest_on_branch = versions
        .iter()
        .filter(|r| r.branch == branch)
        .map(|r| r.version)
        .max();
    let mut at = newest_on_branch.and_then(|v| by_number.get(&v).copied());
    while let Some(r) = at {
        if r.turn == Some(turn) {
            return Ok(r.version);
        }
        at = r
            .parent
            .filter(|p| *p < r.version)
            .and_then(|p| by_number.get(&p).copied());
    }
    let newest = |on_branch: bool| {
        versions
            .iter()
            .filter(|r| r.turn == Some(turn) && (!on_branch || r.branch == branch))
            .map(|r| r.version)
            .max()
    };
    newest(true)
        .or_else(|| newest(false))
        .ok_or_else(|| ToolError::new(StatusCode::NOT_FOUND, format!("no version ended turn {turn}")))
}

/// A version as the agent sees it.
fn view(r: &VersionRecord, now_ms: u64) -> Value {
    json!({
        "version": r.version,
        "turn": r.turn,
        "branch": r.branch,
        "class": r.class,
        "parent": r.parent,
        "age_secs": now_ms.saturating_sub(r.created_unix_ms) as f64 / 1e3,
    })
}

/// Serves `/crab/…` before anything else of the request path.
#[derive(Clone)]
pub(crate) struct Tools<S> {
    shared: Arc<Shared>,
    inner: S,
}

impl<S> Tools<S> {
    pub(crate) fn new(shared: Arc<Shared>, inner: S) -> Self {
        Tools { shared, inner }
    }
}

impl<S, B> Service<Request<B>> for Tools<S>
where
    S: Service<Request<B>, Response = Response<ProxyBody>>,
    S::Future: Send + 'static,
    S::Error: Send + 'static,
    B: Body + Send + 'static,
    B::Data: Send,
    B::Error: std::error::Error + Send + Sync + 'static,
{
    type Response = Response<ProxyBody>;
    type Error = S::Error;
    type Future = Pin<Box<dyn Future<Output = Result<Self::Response, S::Error>> + Send>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), S::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, req: Request<B>) -> Self::Future {
        if !req.uri().path().starts_with(PREFIX) {
            return Box::pin(self.inner.call(req));
        }
        let shared = self.shared.clone();
        Box::pin(async move { Ok(serve(&shared, req).await) })
    }
}

async fn serve<B>(shared: &Shared, req: Request<B>) -> Response<ProxyBody>
where
    B: Body + Send + 'static,
    B::Data: Send,
    B::Error: std::error::Error + Send + Sync + 'static,
{
    let inside = req.extensions().get::<FromInside>().is_some();
    let (parts, body) = req.into_parts();
    // A web page (a browser in the sandbox, a DNS rebinding) sends an
    // Origin; a tool client does not. Posts are JSON, which a page cannot
    // send without asking first.
    if parts.headers.contains_key(http::header::ORIGIN) {
        return answer(Err(ToolError::new(
            StatusCode::FORBIDDEN,
            "requests from web pages (with an Origin) are refused",
        )));
    }
    let json = parts
        .headers
        .get(http::header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|v| {
            v.trim_start()
                .to_ascii_lowercase()
                .starts_with("application/json")
        });
    if parts.method == Method::POST && !json {
        return answer(Err(ToolError::new(
            StatusCode::UNSUPPORTED_MEDIA_TYPE,
            "a tool call's body is application/json",
        )));
    }
    let path = parts.uri.path().trim_end_matches('/');
    let deadline = shared.config.timeouts.client_body;
    let collected = match tokio::time::timeout(deadline, Limited::new(body, MAX_BODY).collect()).await {
        Ok(collected) => collected,
        Err(_) => {
            return answer(Err(ToolError::new(
                StatusCode::REQUEST_TIMEOUT,
                format!("the body did not arrive within {} s", deadline.as_secs()),
            )))
        }
    };
    let body = match collected {
        Ok(b) => b.to_bytes(),
        Err(e) => {
            return answer(Err(ToolError::new(
                StatusCode::PAYLOAD_TOO_LARGE,
                format!("the body could not be read (at most {MAX_BODY} bytes): {e}"),
            )))
        }
    };
    if path == MCP_PATH.trim_end_matches('/') {
        return mcp::serve(shared, &parts.method, &body, inside).await;
    }
    let name = match (&parts.method, path) {
        (&Method::GET, "/crab/v1/versions") => "list_versions",
        (&Method::POST, "/crab/v1/checkpoint") => "checkpoint",
        (&Method::POST, "/crab/v1/rollback") => "rollback_sandbox",
        (&Method::POST, "/crab/v1/replay") => "replay",
        (_, "/crab/v1/versions" | "/crab/v1/checkpoint" | "/crab/v1/rollback" | "/crab/v1/replay") => {
            return answer(Err(ToolError::new(
                StatusCode::METHOD_NOT_ALLOWED,
                "method not allowed",
            )))
        }
        _ => {
            return answer(Err(ToolError::new(
                StatusCode::NOT_FOUND,
                format!("no tool at {path}"),
            )))
        }
    };
    let args = match body.is_empty() {
        true => Ok(Value::Null),
        false => serde_json::from_slice::<Value>(&body)
            .map_err(|e| ToolError::bad(format!("the body is not JSON: {e}"))),
    };
    let call = args.and_then(|a| Call::parse(name, a, inside));
    answer(run(shared, call, "http", inside).await)
}

/// A plain HTTP tool answer: the result, or the error in the proxy's
/// error shape.
fn answer(result: Result<Value, ToolError>) -> Response<ProxyBody> {
    let (status, body) = match result {
        Ok(v) => (StatusCode::OK, v),
        Err(e) => (
            StatusCode::from_u16(e.status).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR),
            json!({ "type": "error", "error": { "type": "crab_tool", "message": e.message } }),
        ),
    };
    json_response(status, &body)
}

pub(crate) fn json_response(status: StatusCode, body: &Value) -> Response<ProxyBody> {
    let mut resp = Response::new(
        Full::new(Bytes::from(body.to_string()))
            .map_err(|never| match never {})
            .boxed(),
    );
    *resp.status_mut() = status;
    resp.headers_mut().insert(
        http::header::CONTENT_TYPE,
        HeaderValue::from_static("application/json"),
    );
    resp
}

#[cfg(test)]
mod tests {
    use super::*;

    fn record(version: u64, turn: Option<u64>, branch: u64) -> VersionRecord {
        VersionRecord {
            sandbox: SandboxId::new("s").unwrap(),
            version,
            created_unix_ms: 0,
            turn,
            branch,
            class: Class::Fs,
            parent: None,
            process_image: None,
            fs_snapshot: None,
            transcript_turns: 0,
            images: Vec::new(),
        }
    }

    #[test]
    fn arguments_are_checked() {
        assert_eq!(
            Call::parse("list_versions", Value::Null, true).unwrap(),
            Call::Versions
        );
        assert!(Call::parse("list_versions", json!({"x": 1}), true).is_err());
        assert_eq!(
            Call::parse("checkpoint", json!({}), true).unwrap(),
            Call::Checkpoint { class: Class::Fs }
        );
        assert!(Call::parse("checkpoint", json!({"class": "none"}), true).is_err());
        assert!(Call::parse("checkpoint", json!({"class": "fs", "extra": true}), true).is_err());
        assert_eq!(
            Call::parse("rollback_files", json!({"turn": 2}), false).unwrap(),
            Call::Rollback {
                to: Target::Turn(2),
                files_only: true
            }
        );
        // From inside, a rollback is of the files unless said otherwise.
        assert_eq!(
            Call::parse("rollback_sandbox", json!({"version": 3}), true).unwrap(),
            Call::Rollback {
                to: Target::Version(3),
                files_only: true
            }
        );
        for bad in [
            json!({}),
            json!({"turn": 0}),
            json!({"turn": 1, "version": 1}),
            json!({"turn": -1}),
            json!("2"),
        ] {
            assert!(Call::parse("rollback_files", bad.clone(), true).is_err(), "{bad}");
        }
        assert_eq!(Call::parse("rm_rf", Value::Null, true).unwrap_err().status, 404);
    }

    #[test]
    fn a_turn_is_its_newest_version_on_the_branch() {
        let vs = [
            record(1, Some(1), 0),
            record(2, Some(2), 0),
            record(3, None, 0),
            record(4, Some(2), 0),
            record(5, Some(2), 1),
        ];
        assert_eq!(turn_version(&vs, 2, 0).unwrap(), 4);
        assert_eq!(turn_version(&vs, 2, 1).unwrap(), 5);
        // Along the parents: branch 1 grew from version 2 (turn 2 of branch
        // 0), not from version 4, a later try of turn 2.
        let mut tree = vec![
            record(1, Some(1), 0),
            record(2, Some(2), 0),
            record(3, Some(3), 0),
            record(4, Some(2), 0),
        ];
        tree.push(VersionRecord {
            parent: Some(2),
            ..record(5, Some(3), 1)
        });
        for (i, r) in tree.iter_mut().enumerate().skip(1).take(3) {
            r.parent = Some(i as u64);
        }
        assert_eq!(turn_version(&tree, 2, 1).unwrap(), 2);
        assert_eq!(turn_version(&tree, 2, 0).unwrap(), 4);
        // Not on this branch: the newest anywhere.
        assert_eq!(turn_version(&vs, 1, 1).unwrap(), 1);
        assert_eq!(turn_version(&vs, 9, 0).unwrap_err().status, 404);
    }
}
