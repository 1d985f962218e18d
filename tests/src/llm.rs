//! A scripted upstream LLM for tests: an HTTP/1.1 server on the host's
//! loopback that answers every POST with a fixed chat completion and every
//! GET with an empty model list, and records what it was asked.

use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpListener;
use std::sync::{Arc, Mutex};

/// The running server (it lives as long as the test process).
pub struct ScriptedLlm {
    /// Its port on 127.0.0.1.
    pub port: u16,
    seen: Arc<Mutex<Vec<String>>>,
}

/// The answer to every POST.
pub const ANSWER: &str = r#"{"id":"x","object":"chat.completion","choices":[{"index":0,"message":{"role":"assistant","content":"scripted answer"},"finish_reason":"stop"}]}"#;

impl ScriptedLlm {
    /// Starts the server on an ephemeral port.
    pub fn start() -> Self {
        let listener = TcpListener::bind("127.0.0.1:0").expect("bind scripted LLM");
        let port = listener.local_addr().expect("local addr").port();
        let seen = Arc::new(Mutex::new(Vec::new()));
        let log = seen.clone();
        std::thread::spawn(move || {
            for stream in listener.incoming().flatten() {
                let log = log.clone();
                std::thread::spawn(move || serve(stream, &log));
            }
        });
        ScriptedLlm { port, seen }
    }

    /// `METHOD PATH` of every request so far.
    pub fn seen(&self) -> Vec<String> {
        self.seen.lock().expect("lock").clone()
    }
}

fn serve(stream: std::net::TcpStream, log: &Mutex<Vec<String>>) {
    let mut reader = BufReader::new(stream.try_clone().expect("clone stream"));
    let mut writer = stream;
    loop {
        let mut line = String::new();
        if reader.read_line(&mut line).unwrap_or(0) == 0 {
            return;
        }
        let request = line.split_whitespace().take(2).collect::<Vec<_>>().join(" ");
        let mut length = 0usize;
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
                }
            }
        }
        let mut body = vec![0; length];
        if reader.read_exact(&mut body).is_err() {
            return;
        }
        let answer = if request.starts_with("POST") {
            ANSWER
        } else {
            r#"{"data":[]}"#
        };
        log.lock().expect("lock").push(request);
        let head = format!(
            "HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\r\n",
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
