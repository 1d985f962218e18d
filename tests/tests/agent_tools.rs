//! The agent's own rollback tool, served by its sandbox's proxy under
//! `/crab/`: through the official Python MCP SDK inside the sandbox and
//! through plain HTTP, against real containerd, crabd and CRIU. A files
//! rollback puts the files back and keeps the processes (their memory,
//! their pid); another sandbox's tool reaches only that sandbox; from
//! outside (crabd's host listener) the whole sandbox rolls back; the rate
//! limit holds; every call is in the transcript. Needs root: CI runs it
//! as root.

use std::path::{Path, PathBuf};

use crab_tests::http::{request, request_in};
use crab_tests::image::BUSYBOX;
use crab_tests::leftovers::assert_clean;
use crab_tests::sandbox::{
    ask, crabctl_ok, exec_sh, proxy_endpoint, run_stateful, tree_digest, wait_registered, STORE,
};
use crab_tests::{Containerd, CRAB};
use serde_json::{json, Value};

/// containerd whose shims read `extra` under `[shim.proxy]` and write
/// transcripts into a directory of the test's.
fn containerd(extra: &str) -> (Containerd, PathBuf) {
    Containerd::start_with_transcripts("crabtool", extra)
}

/// One exchange with the sandbox's own listener from inside it.
fn inside(pid: i32, method: &str, path: &str, body: Option<&str>) -> (u16, Value) {
    request_in(pid, 7878, method, path, &[], body)
}

/// Runs `fixtures/mcp_client.py` inside sandbox `id` with the SDK venv of
/// its image: connects to the sandbox's proxy and makes `calls`.
fn mcp_inside(ctd: &Containerd, id: &str, calls: &Value) -> Value {
    let out = ctd.ctr_ok(&[
        "task",
        "exec",
        "--exec-id",
        &crab_tests::unique("mcp"),
        id,
        "/opt/crab/sdk-venv/bin/python3",
        "/fixtures/mcp_client.py",
        "http://127.0.0.1:7878/crab/mcp",
        &calls.to_string(),
    ]);
    serde_json::from_str(out.trim()).unwrap_or_else(|e| panic!("the MCP client printed {out:?}: {e}"))
}

/// The `tool` entries of sandbox `id`'s transcript.
fn tool_entries(ctd: &Containerd, base: &Path, id: &str) -> Vec<Value> {
    let path = base
        .join("transcripts")
        .join(&ctd.namespace)
        .join(format!("{id}.jsonl"));
    let text = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    text.lines()
        .filter_map(|l| serde_json::from_str::<Value>(l).ok())
        .filter(|v| v["kind"] == "tool")
        .collect()
}

fn finish(ctd: Containerd, ids: &[&str], base: &Path) {
    for id in ids {
        ctd.remove(id);
    }
    assert_clean(&ctd.scope(), ids);
    drop(ctd);
    let _ = std::fs::remove_dir_all(base);
}

#[test]
fn an_agent_rolls_its_files_back_and_keeps_running() {
    let (ctd, base) = containerd("");
    let id = "tools1";
    let pid = run_stateful(&ctd, id);
    exec_sh(
        &ctd,
        id,
        "mkdir -p /data/keep && echo one > /data/a && echo kept > /data/keep/f",
    );
    let v1 = crabctl_ok(&ctd, &["checkpoint", id])["version"]["version"]
        .as_u64()
        .expect("a version");
    let at_v1 = tree_digest(pid, "/data");

    // The turn goes wrong: files changed, made and removed.
    exec_sh(
        &ctd,
        id,
        "echo two > /data/a && echo new > /data/b && rm -r /data/keep && ln -s /etc /data/keep",
    );
    ask(pid, STORE, "set mood sorry");
    assert_ne!(tree_digest(pid, "/data"), at_v1);

    // The agent, inside, through the official MCP client.
    let calls = json!([["list_versions", {}], ["rollback_files", {"version": v1}]]);
    let got = mcp_inside(&ctd, id, &calls);
    assert_eq!(got["server"], "crab");
    assert_eq!(
        got["tools"],
        json!([
            "checkpoint",
            "list_versions",
            "rollback_files",
            "rollback_sandbox"
        ])
    );
    let listed = &got["calls"][0];
    assert_eq!(listed["is_error"], false, "{listed}");
    assert!(
        listed["result"]["versions"]
            .as_array()
            .expect("versions")
            .iter()
            .any(|v| v["version"] == v1),
        "{listed}"
    );
    let rolled = &got["calls"][1];
    assert_eq!(rolled["is_error"], false, "{rolled}");
    assert_eq!(rolled["result"]["files_from"], v1);

    // The files are v1's; the processes are the same ones, memory and all.
    assert_eq!(tree_digest(pid, "/data"), at_v1);
    assert_eq!(ctd.task_pid(id), Some(pid), "the init was not replaced");
    assert_eq!(ask(pid, STORE, "get mood"), "sorry", "the store's memory is kept");
    // Recorded as a new version of class fs.
    let newest = rolled["result"]["version"].as_u64().expect("the new version");
    let versions = crabctl_ok(&ctd, &["versions", id]);
    let record = versions
        .as_array()
        .expect("versions")
        .iter()
        .find(|v| v["version"] == newest)
        .unwrap_or_else(|| panic!("no version {newest} in {versions}"));
    assert_eq!(
        record["class"], "full",
        "a whole version: files and the processes as they run"
    );

    // Plain HTTP, from inside.
    let (status, listed) = inside(pid, "GET", "/crab/v1/versions", None);
    assert_eq!(status, 200, "{listed}");
    assert_eq!(listed["sandbox"], id);
    let (status, made) = inside(pid, "POST", "/crab/v1/checkpoint", Some(r#"{"class":"fs"}"#));
    assert_eq!((status, &made["class"]), (200, &json!("fs")), "{made}");
    // A whole rollback would restore the caller: refused from inside.
    let whole = format!(r#"{{"version":{v1},"files_only":false}}"#);
    let (status, refused) = inside(pid, "POST", "/crab/v1/rollback", Some(&whole));
    assert_eq!(status, 409, "{refused}");
    assert_eq!(ctd.task_pid(id), Some(pid));
    // Bad input: clear errors, nothing changed.
    let files_v1 = format!(r#"{{"version":{v1}}}"#);
    for (method, path, body, want) in [
        ("POST", "/crab/v1/rollback", Some(r#"{"turn":99}"#), 404),
        ("POST", "/crab/v1/rollback", Some("{not json"), 400),
        (
            "POST",
            "/crab/v1/rollback",
            Some(r#"{"version":1,"turn":1}"#),
            400,
        ),
        ("POST", "/crab/v1/rollback", Some(r#"{"version":9999}"#), 404),
        ("GET", "/crab/v1/../../v1/sandboxes", None, 404),
        ("DELETE", "/crab/v1/versions", None, 405),
        ("POST", "/crab/mcp", Some("[]"), 400),
    ] {
        let (status, answer) = inside(pid, method, path, body);
        assert_eq!(status, want, "{method} {path} {body:?}: {answer}");
    }
    // Not from a web page, not in another content type.
    let page = [("origin", "http://evil.example")];
    let (status, _) = request_in(pid, 7878, "POST", "/crab/v1/rollback", &page, Some(&files_v1));
    assert_eq!(status, 403);
    let form = [("content-type", "text/plain")];
    let (status, _) = request_in(pid, 7878, "POST", "/crab/v1/rollback", &form, Some(&files_v1));
    assert_eq!(status, 415);
    assert_eq!(tree_digest(pid, "/data"), at_v1);

    // Another sandbox's tool reaches that sandbox only.
    let other = "tools2";
    ctd.ctr_ok(&["run", "-d", "--runtime", CRAB, BUSYBOX, other, "sleep", "3600"]);
    wait_registered(&ctd, other);
    let other_pid = ctd.task_pid(other).expect("the other task runs");
    let (status, theirs) = inside(other_pid, "GET", "/crab/v1/versions", None);
    assert_eq!(status, 200, "{theirs}");
    assert_eq!(theirs["sandbox"], other);
    assert_eq!(theirs["versions"], json!([]), "no version of {id} shows there");
    let files = format!(r#"{{"version":{v1}}}"#);
    let (status, _) = inside(other_pid, "POST", "/crab/v1/rollback", Some(&files));
    assert_eq!(status, 404, "{other} has no version {v1}");

    // From outside, through crabd's host listener, the whole sandbox goes
    // back: the store forgets what it learnt after v1.
    let (port, prefix) = proxy_endpoint(&ctd, id);
    let (status, whole) = request(
        port,
        "POST",
        &format!("/{prefix}/crab/v1/rollback"),
        &format!("127.0.0.1:{port}"),
        &[],
        Some(&format!(r#"{{"version":{v1}}}"#)),
    );
    assert_eq!(status, 200, "{whole}");
    assert_eq!(whole["files_only"], false);
    let new_pid = ctd.task_pid(id).expect("the task runs");
    assert_ne!(new_pid, pid, "a whole rollback restores new processes");
    assert_eq!(
        ask(new_pid, STORE, "get mood"),
        "-",
        "the store is as it was at v1"
    );
    assert_eq!(tree_digest(new_pid, "/data"), at_v1);

    // Every call is in the transcript, refused ones too.
    let tools = tool_entries(&ctd, &base, id);
    let by = |tool: &str, via: &str| {
        tools
            .iter()
            .filter(|t| t["tool"] == tool && t["via"] == via)
            .count()
    };
    assert_eq!(by("list_versions", "mcp"), 1, "{tools:?}");
    assert_eq!(by("rollback_files", "mcp"), 1, "{tools:?}");
    assert!(tools
        .iter()
        .any(|t| t["tool"] == "rollback_sandbox" && t["inside"] == false && t["error"].is_null()));
    assert!(tools
        .iter()
        .any(|t| t["inside"] == true && t["error"].is_string()));
    // MCP 2, HTTP inside 3 and 4 refused (paths and methods no tool has
    // are not calls), outside 1.
    assert_eq!(tools.len(), 10, "{tools:?}");
    finish(ctd, &[id, other], &base);
}

#[test]
fn tool_calls_are_rate_limited_and_recorded() {
    let (ctd, base) = containerd("tool_calls_per_minute = 1");
    let id = "toolrate";
    ctd.ctr_ok(&["run", "-d", "--runtime", CRAB, BUSYBOX, id, "sleep", "3600"]);
    wait_registered(&ctd, id);
    let pid = ctd.task_pid(id).expect("the task runs");
    let statuses: Vec<u16> = (0..2)
        .map(|_| inside(pid, "GET", "/crab/v1/versions", None).0)
        .collect();
    assert_eq!(statuses, [200, 429]);
    let tools = tool_entries(&ctd, &base, id);
    assert_eq!(tools.len(), 2, "{tools:?}");
    assert!(
        tools[1]["error"]
            .as_str()
            .is_some_and(|e| e.contains("rate limit")),
        "{:?}",
        tools[1]
    );
    finish(ctd, &[id], &base);
}
