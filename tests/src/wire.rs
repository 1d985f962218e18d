//! A checking relay between a client and crabd's socket: every request and
//! answer that passes is held to `api/openapi.json` as the bytes on the
//! wire, before it goes on. The crabctl helpers run crabctl through one, so
//! each integration test checks the real traffic of the calls it makes.
//!
//! HTTP/1.1 as crabctl and crabd speak it: a request with a
//! `content-length` body (or none); an answer with a `content-length` body,
//! or a stream (watch) that is copied until crabd closes it. JSON bodies are
//! checked; archives pass unchecked.

use std::io::{BufRead, BufReader, Read, Write};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;

use serde_json::Value;

use crate::openapi;

/// A relay on a socket of its own, in front of `upstream`.
pub struct CheckedSocket {
    socket: PathBuf,
    stop: Arc<AtomicBool>,
    violations: Arc<Mutex<Vec<String>>>,
    thread: Option<JoinHandle<()>>,
}

// === impl CheckedSocket ===

impl CheckedSocket {
    /// A relay to `upstream`, listening beside it; `None` when nothing
    /// answers on `upstream` (the caller should meet crabd's absence as it
    /// is, not a relay's).
    pub fn start(upstream: &Path) -> Option<Self> {
        UnixStream::connect(upstream).ok()?;
        static N: AtomicU64 = AtomicU64::new(0);
        let n = N.fetch_add(1, Ordering::Relaxed);
        let dir = upstream.parent().unwrap_or(Path::new("/tmp"));
        let socket = dir.join(format!("checked-{}-{n}.sock", std::process::id()));
        let _ = std::fs::remove_file(&socket);
        let listener = UnixListener::bind(&socket).expect("bind the checking relay");
        let stop = Arc::new(AtomicBool::new(false));
        let violations = Arc::new(Mutex::new(Vec::new()));
        let (upstream, stop2, found) = (upstream.to_owned(), stop.clone(), violations.clone());
        let thread = std::thread::spawn(move || {
            for client in listener.incoming() {
                if stop2.load(Ordering::SeqCst) {
                    return;
                }
                let Ok(client) = client else { continue };
                if let Err(e) = relay(client, &upstream, &found) {
                    found.lock().expect("lock").push(format!("relay: {e}"));
                }
            }
        });
        Some(CheckedSocket {
            socket,
            stop,
            violations,
            thread: Some(thread),
        })
    }

    /// The socket to give the client.
    pub fn socket(&self) -> &Path {
        &self.socket
    }

    /// Stops the relay and answers every way the traffic broke the spec.
    /// Call it once the client has its answers: each was checked before
    /// the relay passed it on.
    pub fn finish(mut self) -> Vec<String> {
        self.shut();
        std::mem::take(&mut *self.violations.lock().expect("lock"))
    }

    /// Stops accepting. Not joined: a stream still being copied ends when
    /// crabd ends it, and has no verdict to wait for.
    fn shut(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
        // Wakes the accept loop, which then sees the flag.
        let _ = UnixStream::connect(&self.socket);
        let _ = std::fs::remove_file(&self.socket);
        self.thread.take();
    }
}

impl Drop for CheckedSocket {
    fn drop(&mut self) {
        self.shut();
    }
}

/// One HTTP message head: its first line and headers, as read.
struct Head {
    raw: Vec<u8>,
    first: String,
    content_length: Option<usize>,
    json: bool,
}

/// Reads a message head (up to the blank line); `None` at a clean EOF.
fn read_head(r: &mut impl BufRead) -> std::io::Result<Option<Head>> {
    let mut raw = Vec::new();
    let (mut first, mut content_length, mut json) = (String::new(), None, false);
    loop {
        let mut line = String::new();
        if r.read_line(&mut line)? == 0 {
            return match raw.is_empty() {
                true => Ok(None),
                false => Err(std::io::ErrorKind::UnexpectedEof.into()),
            };
        }
        raw.extend_from_slice(line.as_bytes());
        let text = line.trim_end();
        if text.is_empty() {
            return Ok(Some(Head {
                raw,
                first,
                content_length,
                json,
            }));
        }
        if first.is_empty() {
            first = text.to_owned();
            continue;
        }
        let Some((name, value)) = text.split_once(':') else {
            continue;
        };
        match name.trim().to_ascii_lowercase().as_str() {
            "content-length" => content_length = value.trim().parse().ok(),
            "content-type" => json = value.trim().starts_with("application/json"),
            _ => {}
        }
    }
}

/// Relays one client connection, request by request.
fn relay(client: UnixStream, upstream: &Path, found: &Mutex<Vec<String>>) -> std::io::Result<()> {
    let mut to_client = client.try_clone()?;
    let mut from_client = BufReader::new(client);
    let server = UnixStream::connect(upstream)?;
    let mut to_server = server.try_clone()?;
    let mut from_server = BufReader::new(server);
    let complain = |what: String| found.lock().expect("lock").push(what);
    while let Some(req) = read_head(&mut from_client)? {
        let mut parts = req.first.split(' ');
        let method = parts.next().unwrap_or_default().to_ascii_lowercase();
        // crab-api's client sends the absolute form (`http://crab/v1/…`).
        let target = parts.next().unwrap_or_default();
        let path = match target.split_once("://") {
            Some((_, rest)) => rest.find('/').map_or("/", |at| &rest[at..]).to_owned(),
            None => target.to_owned(),
        };
        let mut body = vec![0; req.content_length.unwrap_or(0)];
        from_client.read_exact(&mut body)?;
        if req.json && !body.is_empty() {
            let value = serde_json::from_slice::<Value>(&body).unwrap_or(Value::Null);
            if let Err(e) = openapi::check_request(&method, &path, &value) {
                complain(format!("{method} {path} request: {e}"));
            }
        }
        to_server.write_all(&req.raw)?;
        to_server.write_all(&body)?;
        let Some(answer) = read_head(&mut from_server)? else {
            return Ok(());
        };
        let Some(len) = answer.content_length else {
            // A stream: copied as it comes, until crabd ends it.
            to_client.write_all(&answer.raw)?;
            std::io::copy(&mut from_server, &mut to_client)?;
            return Ok(());
        };
        let mut body = vec![0; len];
        from_server.read_exact(&mut body)?;
        // Checked before it goes on: once the client has it, the caller
        // may ask for the verdict.
        if answer.json {
            let status = answer
                .first
                .split(' ')
                .nth(1)
                .and_then(|s| s.parse::<u16>().ok())
                .unwrap_or(0);
            let value = serde_json::from_slice::<Value>(&body).unwrap_or(Value::Null);
            if let Err(e) = openapi::check_answer(&method, &path, status, &value) {
                complain(format!("{method} {path} answered {status}: {e}"));
            }
        }
        to_client.write_all(&answer.raw)?;
        to_client.write_all(&body)?;
    }
    Ok(())
}
