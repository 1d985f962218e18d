//! The tool as an MCP server: JSON-RPC 2.0 over MCP's streamable HTTP
//! transport, each `POST` answered with one JSON body (never a stream: no
//! call sends notifications), no session. Methods: `initialize`, `ping`,
//! `tools/list`, `tools/call`; notifications are accepted (202). `GET`
//! (a server-to-client stream) and `DELETE` (a session's end) answer 405,
//! which clients take as "not offered".

use http::{Method, Response, StatusCode};
use http_body_util::{BodyExt, Empty};
use serde_json::{json, Value};

use super::{json_response, run, Call, ToolError};
use crate::shared::Shared;
use crate::ProxyBody;

/// Protocol revisions spoken, newest first.
const VERSIONS: [&str; 3] = ["2025-06-18", "2025-03-26", "2024-11-05"];

const PARSE_ERROR: i64 = -32700;
const INVALID_REQUEST: i64 = -32600;
const METHOD_NOT_FOUND: i64 = -32601;
const INVALID_PARAMS: i64 = -32602;

/// Answers one HTTP request to the MCP endpoint.
pub(super) async fn serve(
    shared: &Shared,
    method: &Method,
    body: &[u8],
    inside: bool,
) -> Response<ProxyBody> {
    if method != Method::POST {
        let mut resp = json_response(
            StatusCode::METHOD_NOT_ALLOWED,
            &json!({"jsonrpc": "2.0", "id": null, "error": {"code": INVALID_REQUEST, "message": "only POST is served"}}),
        );
        resp.headers_mut()
            .insert(http::header::ALLOW, http::HeaderValue::from_static("POST"));
        return resp;
    }
    let msg: Value = match serde_json::from_slice(body) {
        Ok(v) => v,
        Err(e) => {
            return rpc_error(
                StatusCode::BAD_REQUEST,
                Value::Null,
                PARSE_ERROR,
                &format!("not JSON: {e}"),
            )
        }
    };
    let Some(obj) = msg
        .as_object()
        .filter(|o| o.get("jsonrpc") == Some(&json!("2.0")))
    else {
        return rpc_error(
            StatusCode::BAD_REQUEST,
            Value::Null,
            INVALID_REQUEST,
            "one JSON-RPC 2.0 message per request (batches are not served)",
        );
    };
    let Some(name) = obj.get("method").and_then(Value::as_str) else {
        // A response or an error from the client: nothing to answer.
        return accepted();
    };
    let Some(id) = obj.get("id").cloned() else {
        // A notification (`notifications/initialized`, a cancel).
        return accepted();
    };
    let params = obj.get("params").cloned().unwrap_or(Value::Null);
    let result = match name {
        "initialize" => Ok(initialize(&params)),
        "ping" => Ok(json!({})),
        "tools/list" => Ok(json!({ "tools": tools() })),
        "tools/call" => call(shared, &params, inside).await,
        other => Err((METHOD_NOT_FOUND, format!("no method {other:?}"))),
    };
    match result {
        Ok(result) => json_response(
            StatusCode::OK,
            &json!({"jsonrpc": "2.0", "id": id, "result": result}),
        ),
        Err((code, message)) => rpc_error(StatusCode::OK, id, code, &message),
    }
}

fn initialize(params: &Value) -> Value {
    let asked = params.get("protocolVersion").and_then(Value::as_str);
    let version = VERSIONS
        .iter()
        .find(|v| Some(**v) == asked)
        .unwrap_or(&VERSIONS[0]);
    json!({
        "protocolVersion": version,
        "capabilities": { "tools": { "listChanged": false } },
        "serverInfo": { "name": "crab", "version": env!("CARGO_PKG_VERSION") },
        "instructions": "Crab keeps a version of this sandbox at the end of each of your turns. \
            list_versions shows them; rollback_files puts the files back to a turn or version \
            (your processes keep running); checkpoint saves the sandbox now; rollback_sandbox \
            puts everything back and is only for an agent running outside the sandbox.",
    })
}

async fn call(shared: &Shared, params: &Value, inside: bool) -> Result<Value, (i64, String)> {
    let Some(name) = params.get("name").and_then(Value::as_str) else {
        return Err((INVALID_PARAMS, "tools/call needs a tool name".to_owned()));
    };
    let args = params.get("arguments").cloned().unwrap_or(Value::Null);
    let call = Call::parse(name, args, inside);
    if let Err(e @ ToolError { status: 404, .. }) = &call {
        return Err((INVALID_PARAMS, e.message.clone()));
    }
    Ok(match run(shared, call, "mcp", inside).await {
        Ok(value) => json!({
            "content": [{ "type": "text", "text": value.to_string() }],
            "structuredContent": value,
            "isError": false,
        }),
        Err(e) => json!({
            "content": [{ "type": "text", "text": e.message }],
            "isError": true,
        }),
    })
}

/// The tools, as `tools/list` describes them.
fn tools() -> Value {
    let to = json!({
        "turn": { "type": "integer", "minimum": 1, "description": "Go back to the state at the end of this turn (your request number, from 1)." },
        "version": { "type": "integer", "minimum": 1, "description": "Go back to this version (from list_versions)." },
    });
    let mut whole = to.clone();
    whole["files_only"] =
        json!({ "type": "boolean", "description": "Files only (the default from inside the sandbox)." });
    json!([
        {
            "name": "list_versions",
            "description": "The sandbox's saved versions, oldest first: version, the turn it ended, class (none, fs, proc, full) and age in seconds.",
            "inputSchema": { "type": "object", "properties": {}, "additionalProperties": false },
            "annotations": { "readOnlyHint": true },
        },
        {
            "name": "checkpoint",
            "description": "Save the sandbox now (class fs, the default: files only; full: files and processes). Answers the new version.",
            "inputSchema": {
                "type": "object",
                "properties": { "class": { "type": "string", "enum": ["full", "fs"] } },
                "additionalProperties": false,
            },
        },
        {
            "name": "rollback_files",
            "description": "Put the sandbox's files back to a turn or version; running processes (you) go on. Name exactly one of turn or version.",
            "inputSchema": { "type": "object", "properties": to, "additionalProperties": false },
            "annotations": { "destructiveHint": true },
        },
        {
            "name": "rollback_sandbox",
            "description": "Put the whole sandbox (files, processes, memory) back to a turn or version. Only for an agent outside the sandbox.",
            "inputSchema": { "type": "object", "properties": whole, "additionalProperties": false },
            "annotations": { "destructiveHint": true },
        },
    ])
}

fn accepted() -> Response<ProxyBody> {
    let mut resp = Response::new(Empty::new().map_err(|never| match never {}).boxed());
    *resp.status_mut() = StatusCode::ACCEPTED;
    resp
}

fn rpc_error(status: StatusCode, id: Value, code: i64, message: &str) -> Response<ProxyBody> {
    json_response(
        status,
        &json!({"jsonrpc": "2.0", "id": id, "error": {"code": code, "message": message}}),
    )
}
