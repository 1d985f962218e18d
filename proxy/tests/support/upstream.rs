//! A scripted LLM upstream: answers OpenAI- and Anthropic-shaped JSON and SSE
//! streams, in process, over real HTTP. The request's `model` picks faults:
//! `status-429`, `status-500`, `stall-headers`, `stall-body`, `gated` (a stream that sends
//! its first chunk, then waits for `release()`), `gated-endless` (the same,
//! then pings until its receiver goes away).

use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::Arc;

use bytes::Bytes;
use http::{Request, Response, StatusCode};
use http_body_util::{channel::Channel, combinators::BoxBody, BodyExt, Full};
use hyper::body::Incoming;
use hyper_util::rt::TokioIo;
use parking_lot::Mutex;
use serde_json::{json, Value};
use tokio::net::TcpListener;
use tokio::sync::{watch, Semaphore};
use tokio_util::task::TaskTracker;

/// One request the upstream saw.
#[derive(Debug, Clone)]
pub struct Seen {
    pub method: String,
    pub path: String,
    pub headers: http::HeaderMap,
    pub body: Bytes,
}

struct State {
    seen: Mutex<Vec<Seen>>,
    n_seen: watch::Sender<usize>,
    gate: Semaphore,
    /// Streams whose receiver went away before they finished.
    cut: Mutex<Option<watch::Sender<u64>>>,
}

/// The scripted upstream server.
pub struct ScriptedUpstream {
    pub addr: SocketAddr,
    state: Arc<State>,
    cut_rx: watch::Receiver<u64>,
    _tracker: TaskTracker,
}

type Body = BoxBody<Bytes, Infallible>;

impl ScriptedUpstream {
    pub async fn start() -> Self {
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind upstream");
        let addr = listener.local_addr().expect("addr");
        let (cut_tx, cut_rx) = watch::channel(0);
        let state = Arc::new(State {
            seen: Mutex::new(Vec::new()),
            n_seen: watch::channel(0).0,
            gate: Semaphore::new(0),
            cut: Mutex::new(Some(cut_tx)),
        });
        let tracker = TaskTracker::new();
        let st = state.clone();
        let tr = tracker.clone();
        tracker.spawn(async move {
            loop {
                let Ok((stream, _)) = listener.accept().await else {
                    continue;
                };
                let st = st.clone();
                let tr2 = tr.clone();
                tr.spawn(async move {
                    let svc = hyper::service::service_fn(move |req| handle(st.clone(), tr2.clone(), req));
                    let _ = hyper::server::conn::http1::Builder::new()
                        .serve_connection(TokioIo::new(stream), svc)
                        .await;
                });
            }
        });
        Self {
            addr,
            state,
            cut_rx,
            _tracker: tracker,
        }
    }

    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    pub fn seen(&self) -> Vec<Seen> {
        self.state.seen.lock().clone()
    }

    /// Lets one `gated` stream send the rest of its chunks.
    pub fn release(&self) {
        self.state.gate.add_permits(1);
    }

    /// Waits until the upstream has seen `n` requests.
    pub async fn wait_seen(&self, n: usize) {
        let mut rx = self.state.n_seen.subscribe();
        rx.wait_for(|c| *c >= n).await.expect("upstream alive");
    }

    /// Waits until `n` streams were cut by their receiver.
    pub async fn wait_cut(&self, n: u64) {
        let mut rx = self.cut_rx.clone();
        rx.wait_for(|c| *c >= n).await.expect("upstream alive");
    }
}

fn full(status: StatusCode, content_type: &str, body: impl Into<Bytes>) -> Response<Body> {
    Response::builder()
        .status(status)
        .header("content-type", content_type)
        .header("x-upstream", "scripted")
        .body(Full::new(body.into()).boxed())
        .expect("response")
}

fn json_resp(status: StatusCode, v: Value) -> Response<Body> {
    full(status, "application/json", v.to_string())
}

async fn handle(
    state: Arc<State>,
    tracker: TaskTracker,
    req: Request<Incoming>,
) -> Result<Response<Body>, Infallible> {
    let (parts, body) = req.into_parts();
    let body = body.collect().await.map(|c| c.to_bytes()).unwrap_or_default();
    let path = parts.uri.path().to_owned();
    state.seen.lock().push(Seen {
        method: parts.method.to_string(),
        path: parts.uri.path_and_query().map_or("/".into(), |p| p.to_string()),
        headers: parts.headers.clone(),
        body: body.clone(),
    });
    state.n_seen.send_modify(|n| *n += 1);
    if parts.method == http::Method::GET {
        return Ok(match path.as_str() {
            "/v1/models" => json_resp(
                StatusCode::OK,
                json!({"object":"list","data":[{"id":"gpt-test","object":"model"}]}),
            ),
            _ => json_resp(
                StatusCode::OK,
                json!({"id": path, "object": "response", "status": "completed"}),
            ),
        });
    }
    let Ok(req_json) = serde_json::from_slice::<Value>(&body) else {
        let err = json!({"error":{"message":"We could not parse the JSON body of your request.","type":"invalid_request_error"}});
        return Ok(json_resp(StatusCode::BAD_REQUEST, err));
    };
    let model = req_json["model"].as_str().unwrap_or("").to_owned();
    let stream = req_json["stream"].as_bool().unwrap_or(false);
    let tools = req_json.get("tools").is_some();
    match model.as_str() {
        "status-429" => {
            let mut r = json_resp(
                StatusCode::TOO_MANY_REQUESTS,
                json!({"type":"error","error":{"type":"rate_limit_error","message":"slow down"}}),
            );
            r.headers_mut()
                .insert("retry-after", http::HeaderValue::from_static("7"));
            return Ok(r);
        }
        "status-500" => {
            let body = json!({"type":"error","error":{"type":"api_error","message":"upstream broke"}});
            return Ok(json_resp(StatusCode::INTERNAL_SERVER_ERROR, body));
        }
        "stall-headers" => {
            std::future::pending::<()>().await;
        }
        _ => {}
    }
    let chunks: Vec<String> = match path.as_str() {
        "/v1/chat/completions" => chat(&req_json, tools, stream),
        "/v1/responses" => responses(stream),
        "/v1/messages" => messages(tools, stream),
        "/v1/messages/count_tokens" => vec![json!({"input_tokens": body.len()}).to_string()],
        "/v1/embeddings" => vec![
            json!({"object":"list","data":[{"object":"embedding","index":0,"embedding":[0.1,0.2]}]})
                .to_string(),
        ],
        _ => {
            return Ok(json_resp(
                StatusCode::NOT_FOUND,
                json!({"error":{"message":"no such path","type":"not_found"}}),
            ))
        }
    };
    if !stream {
        return Ok(full(StatusCode::OK, "application/json", chunks.concat()));
    }
    let (mut tx, body) = Channel::<Bytes, Infallible>::new(1);
    let gated = model.starts_with("gated");
    let stall = model == "stall-body";
    let endless = model == "gated-endless";
    let chunks: Box<dyn Iterator<Item = String> + Send> = if endless {
        let first = chunks[0].clone();
        let more = sse(Some("ping"), &json!({"type": "ping"}));
        Box::new(std::iter::once(first).chain(std::iter::repeat(more)))
    } else {
        Box::new(chunks.into_iter())
    };
    tracker.spawn(async move {
        for (idx, chunk) in chunks.enumerate() {
            if idx == 1 && stall {
                std::future::pending::<()>().await;
            }
            if idx == 1 && gated {
                if let Ok(permit) = state.gate.acquire().await {
                    permit.forget();
                }
            }
            if tx.send_data(Bytes::from(chunk)).await.is_err() {
                if let Some(cut) = state.cut.lock().as_ref() {
                    cut.send_modify(|c| *c += 1);
                }
                return;
            }
        }
    });
    Ok(Response::builder()
        .status(StatusCode::OK)
        .header("content-type", "text/event-stream")
        .header("cache-control", "no-cache")
        .body(body.boxed())
        .expect("response"))
}

fn sse(event: Option<&str>, data: &Value) -> String {
    match event {
        Some(e) => format!("event: {e}\ndata: {data}\n\n"),
        None => format!("data: {data}\n\n"),
    }
}

fn chat(req: &Value, tools: bool, stream: bool) -> Vec<String> {
    let answered_tool = req["messages"]
        .as_array()
        .is_some_and(|m| m.iter().any(|m| m["role"] == "tool"));
    let message = if tools && !answered_tool {
        json!({"role":"assistant","content":null,"tool_calls":[{"id":"call_1","type":"function","function":{"name":"run","arguments":"{\"cmd\":\"ls\"}"}}]})
    } else {
        json!({"role":"assistant","content":"hello from upstream"})
    };
    let finish = if tools && !answered_tool {
        "tool_calls"
    } else {
        "stop"
    };
    if !stream {
        return vec![json!({
            "id":"chatcmpl-1","object":"chat.completion","created":1,"model":"gpt-test",
            "choices":[{"index":0,"message":message,"finish_reason":finish}],
            "usage":{"prompt_tokens":3,"completion_tokens":3,"total_tokens":6}
        })
        .to_string()];
    }
    let delta = |d: Value, f: Value| {
        sse(
            None,
            &json!({"id":"chatcmpl-1","object":"chat.completion.chunk","created":1,"model":"gpt-test","choices":[{"index":0,"delta":d,"finish_reason":f}]}),
        )
    };
    vec![
        delta(json!({"role":"assistant","content":""}), Value::Null),
        delta(json!({"content":"hello "}), Value::Null),
        delta(json!({"content":"from upstream"}), Value::Null),
        delta(json!({}), json!("stop")),
        "data: [DONE]\n\n".to_owned(),
    ]
}

fn responses(stream: bool) -> Vec<String> {
    let resp = json!({"id":"resp_1","object":"response","created_at":1,"status":"completed","model":"gpt-test",
        "output":[{"type":"message","id":"msg_1","status":"completed","role":"assistant",
                   "content":[{"type":"output_text","text":"hello from upstream","annotations":[]}]}],
        "usage":{"input_tokens":3,"output_tokens":3,"total_tokens":6}});
    if !stream {
        return vec![resp.to_string()];
    }
    vec![
        sse(
            Some("response.created"),
            &json!({"type":"response.created","sequence_number":0,"response":resp}),
        ),
        sse(
            Some("response.output_text.delta"),
            &json!({"type":"response.output_text.delta","sequence_number":1,"item_id":"msg_1","output_index":0,"content_index":0,"delta":"hello from upstream"}),
        ),
        sse(
            Some("response.completed"),
            &json!({"type":"response.completed","sequence_number":2,"response":resp}),
        ),
    ]
}

fn messages(tools: bool, stream: bool) -> Vec<String> {
    let content = if tools {
        json!([{"type":"tool_use","id":"toolu_1","name":"run","input":{"cmd":"ls"}}])
    } else {
        json!([{"type":"text","text":"hello from upstream"}])
    };
    let stop = if tools { "tool_use" } else { "end_turn" };
    let msg = json!({"id":"msg_1","type":"message","role":"assistant","model":"claude-test","content":content,
        "stop_reason":stop,"stop_sequence":null,"usage":{"input_tokens":3,"output_tokens":3}});
    if !stream {
        return vec![msg.to_string()];
    }
    let mut start = msg.clone();
    start["content"] = json!([]);
    start["stop_reason"] = Value::Null;
    vec![
        sse(
            Some("message_start"),
            &json!({"type":"message_start","message":start}),
        ),
        sse(
            Some("content_block_start"),
            &json!({"type":"content_block_start","index":0,"content_block":{"type":"text","text":""}}),
        ),
        sse(
            Some("content_block_delta"),
            &json!({"type":"content_block_delta","index":0,"delta":{"type":"text_delta","text":"hello from upstream"}}),
        ),
        sse(
            Some("content_block_stop"),
            &json!({"type":"content_block_stop","index":0}),
        ),
        sse(
            Some("message_delta"),
            &json!({"type":"message_delta","delta":{"stop_reason":"end_turn","stop_sequence":null},"usage":{"output_tokens":3}}),
        ),
        sse(Some("message_stop"), &json!({"type":"message_stop"})),
    ]
}
