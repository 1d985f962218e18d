//! A scripted upstream LLM for tests: an HTTP/1.1 server on the host's
//! loopback that answers every POST with a fixed chat completion (or the
//! next one of a script; as an SSE stream when the request asks to stream)
//! and every GET with an empty model list, and records what it was asked.
//! A request with `x-crab-think-ms: N` is answered after N ms (an LLM that
//! thinks: benchmarks replay traced think times with it).

use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpListener;
use std::sync::{Arc, Mutex};

/// The running server (it lives as long as the test process).
pub struct ScriptedLlm {
    /// Its port on 127.0.0.1.
    pub port: u16,
    seen: Arc<Mutex<Vec<String>>>,
}

/// The answers to successive POSTs; the last one repeats.
struct Script {
    answers: Vec<String>,
    n_posts: usize,
}

/// The header that makes the answer wait (milliseconds).
pub const THINK_HEADER: &str = "x-crab-think-ms";

/// The answer to every POST.
pub const ANSWER: &str = r#"{"id":"x","object":"chat.completion","choices":[{"index":0,"message":{"role":"assistant","content":"scripted answer"},"finish_reason":"stop"}]}"#;

impl ScriptedLlm {
    /// Starts the server on an ephemeral port; every POST gets [`ANSWER`].
    pub fn start() -> Self {
        Self::scripted(vec![ANSWER.to_owned()])
    }

    /// Starts the server; the k-th POST gets `answers[k]` (the last one
    /// for every POST after), each a chat completion JSON object.
    ///
    /// # Panics
    /// If `answers` is empty.
    pub fn scripted(answers: Vec<String>) -> Self {
        assert!(!answers.is_empty(), "a script needs an answer");
        let listener = TcpListener::bind("127.0.0.1:0").expect("bind scripted LLM");
        let port = listener.local_addr().expect("local addr").port();
        let seen = Arc::new(Mutex::new(Vec::new()));
        let log = seen.clone();
        let script = Arc::new(Mutex::new(Script { answers, n_posts: 0 }));
        std::thread::spawn(move || {
            for stream in listener.incoming().flatten() {
                let log = log.clone();
                let script = script.clone();
                std::thread::spawn(move || serve(stream, &log, &script));
            }
        });
        ScriptedLlm { port, seen }
    }

    /// `METHOD PATH` of every request so far.
    pub fn seen(&self) -> Vec<String> {
        self.seen.lock().expect("lock").clone()
    }
}

/// One turn of an agent outside its sandbox: a chat completion posted to
/// `url` (a `crabctl proxy-url`, `http://127.0.0.1:PORT/s/<id>/<secret>`) that the
/// scripted LLM answers after `think`; returns once the answer is released,
/// with the turn number the proxy gave it (`x-crab-turn`; none for an
/// answer replayed from the transcript).
///
/// # Errors
/// The connection failed, or the answer was not a 200.
pub fn chat_turn(url: &str, think: std::time::Duration) -> std::io::Result<Option<u64>> {
    let rest = url.strip_prefix("http://").unwrap_or(url);
    let (addr, path) = rest.split_once('/').unwrap_or((rest, ""));
    let body = r#"{"model":"m","messages":[{"role":"user","content":"next"}]}"#;
    let mut s = std::net::TcpStream::connect(addr)?;
    write!(
        s,
        "POST /{path}/v1/chat/completions HTTP/1.1\r\nhost: {addr}\r\ncontent-type: application/json\r\n\
         {THINK_HEADER}: {}\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{body}",
        think.as_millis(),
        body.len()
    )?;
    let mut answer = String::new();
    s.read_to_string(&mut answer)?;
    if !answer.starts_with("HTTP/1.1 200") {
        return Err(std::io::Error::other(
            answer.lines().next().unwrap_or("").to_owned(),
        ));
    }
    let head = answer.split("\r\n\r\n").next().unwrap_or("");
    Ok(head.lines().find_map(|l| {
        let (name, value) = l.split_once(':')?;
        name.eq_ignore_ascii_case("x-crab-turn")
            .then(|| value.trim().parse().ok())
            .flatten()
    }))
}

/// A complete chat completion whose message says `content`.
pub fn completion(content: &str) -> String {
    serde_json::json!({
        "id": "chatcmpl-crab", "object": "chat.completion", "created": 0, "model": "crab-scripted",
        "choices": [{"index": 0, "message": {"role": "assistant", "content": content}, "finish_reason": "stop"}],
        "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2}
    })
    .to_string()
}

/// A complete chat completion that calls the tool `bash` with `command`.
pub fn bash_call(call_id: &str, command: &str) -> String {
    let arguments = serde_json::json!({ "command": command }).to_string();
    serde_json::json!({
        "id": "chatcmpl-crab", "object": "chat.completion", "created": 0, "model": "crab-scripted",
        "choices": [{"index": 0, "message": {"role": "assistant", "content": null, "tool_calls": [
            {"id": call_id, "type": "function", "function": {"name": "bash", "arguments": arguments}}
        ]}, "finish_reason": "tool_calls"}],
        "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2}
    })
    .to_string()
}

/// `answer` (a chat completion) as an SSE stream of one chunk per choice.
fn as_stream(answer: &str) -> String {
    let v: serde_json::Value = serde_json::from_str(answer).unwrap_or_default();
    let content = v["choices"][0]["message"]["content"].clone();
    let chunk = serde_json::json!({
        "id": "chatcmpl-crab", "object": "chat.completion.chunk", "created": 0, "model": "crab-scripted",
        "choices": [{"index": 0, "delta": {"role": "assistant", "content": content}, "finish_reason": null}]
    });
    let last = serde_json::json!({
        "id": "chatcmpl-crab", "object": "chat.completion.chunk", "created": 0, "model": "crab-scripted",
        "choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]
    });
    format!("data: {chunk}\n\ndata: {last}\n\ndata: [DONE]\n\n")
}

fn serve(stream: std::net::TcpStream, log: &Mutex<Vec<String>>, script: &Mutex<Script>) {
    let mut reader = BufReader::new(stream.try_clone().expect("clone stream"));
    let mut writer = stream;
    loop {
        let mut line = String::new();
        if reader.read_line(&mut line).unwrap_or(0) == 0 {
            return;
        }
        let request = line.split_whitespace().take(2).collect::<Vec<_>>().join(" ");
        let mut length = 0usize;
        let mut think_ms = 0u64;
        loop {
            let mut h = String::new();
            if reader.read_line(&mut h).unwrap_or(0) == 0 {
                return;
            }
            if h == "\r\n" {
                break;
            }
            if let Some((k, v)) = h.split_once(':') {
                if k.eq_ignore_ascii_case("content-length") {
                    length = v.trim().parse().unwrap_or(0);
                } else if k.eq_ignore_ascii_case(THINK_HEADER) {
                    think_ms = v.trim().parse().unwrap_or(0);
                }
            }
        }
        let mut body = vec![0; length];
        if reader.read_exact(&mut body).is_err() {
            return;
        }
        std::thread::sleep(std::time::Duration::from_millis(think_ms));
        let streaming = serde_json::from_slice::<serde_json::Value>(&body)
            .is_ok_and(|v| v["stream"] == serde_json::Value::Bool(true));
        let (answer, content_type) = if request.starts_with("POST") {
            let mut script = script.lock().expect("lock");
            let idx = script.n_posts.min(script.answers.len() - 1);
            script.n_posts += 1;
            let answer = script.answers[idx].clone();
            match streaming {
                true => (as_stream(&answer), "text/event-stream"),
                false => (answer, "application/json"),
            }
        } else {
            (r#"{"data":[]}"#.to_owned(), "application/json")
        };
        log.lock().expect("lock").push(request);
        let head = format!(
            "HTTP/1.1 200 OK\r\ncontent-type: {content_type}\r\ncontent-length: {}\r\n\r\n",
            answer.len()
        );
        if writer
            .write_all(head.as_bytes())
            .and_then(|_| writer.write_all(answer.as_bytes()))
            .is_err()
        {
            return;
        }
    }
}
