//! One HTTP/1.1 exchange on the loopback, written by hand (the tests see
//! exactly what goes on the wire), and the same from inside a sandbox's
//! network namespace.

use std::io::{Read, Write};

use serde_json::Value;

/// `method path` to 127.0.0.1:`port` naming `host`, with `headers` and a
/// JSON `body` (sent as `application/json` unless `headers` name another
/// content type): the status and the JSON answer (`Null` if it is none).
pub fn request(
    port: u16,
    method: &str,
    path: &str,
    host: &str,
    headers: &[(&str, &str)],
    body: Option<&str>,
) -> (u16, Value) {
    let mut s = std::net::TcpStream::connect(("127.0.0.1", port)).expect("connect");
    s.set_read_timeout(Some(std::time::Duration::from_secs(300)))
        .expect("a timeout");
    let mut head = format!("{method} {path} HTTP/1.1\r\nhost: {host}\r\nconnection: close\r\n");
    for (name, value) in headers {
        head.push_str(&format!("{name}: {value}\r\n"));
    }
    let body = body.unwrap_or_default();
    if !body.is_empty()
        && !headers
            .iter()
            .any(|(n, _)| n.eq_ignore_ascii_case("content-type"))
    {
        head.push_str("content-type: application/json\r\n");
    }
    head.push_str(&format!("content-length: {}\r\n\r\n{body}", body.len()));
    s.write_all(head.as_bytes()).expect("send");
    let mut answer = String::new();
    s.read_to_string(&mut answer).expect("read");
    let status = answer
        .split_whitespace()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .unwrap_or(0);
    let body = answer.split("\r\n\r\n").nth(1).unwrap_or_default();
    (status, serde_json::from_str(body).unwrap_or(Value::Null))
}

/// [`request`] to `127.0.0.1:port` inside the network namespace of `pid`
/// (a sandbox's own loopback: a caller inside it).
pub fn request_in(
    pid: i32,
    port: u16,
    method: &str,
    path: &str,
    headers: &[(&str, &str)],
    body: Option<&str>,
) -> (u16, Value) {
    let (method, path, body) = (method.to_owned(), path.to_owned(), body.map(str::to_owned));
    let headers: Vec<(String, String)> = headers
        .iter()
        .map(|(n, v)| ((*n).to_owned(), (*v).to_owned()))
        .collect();
    // setns(CLONE_NEWNET) changes only the calling thread.
    std::thread::spawn(move || {
        let ns = std::fs::File::open(format!("/proc/{pid}/ns/net")).expect("the sandbox's netns");
        nix::sched::setns(ns, nix::sched::CloneFlags::CLONE_NEWNET).expect("setns");
        let headers: Vec<(&str, &str)> = headers.iter().map(|(n, v)| (n.as_str(), v.as_str())).collect();
        request(
            port,
            &method,
            &path,
            &format!("127.0.0.1:{port}"),
            &headers,
            body.as_deref(),
        )
    })
    .join()
    .expect("the client thread does not panic")
}
