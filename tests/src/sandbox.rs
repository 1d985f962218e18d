//! A stateful sandbox for checkpoint and rollback tests
//! (`fixtures/stateful.py` in the Python image), and the ways to look at
//! its state from the host: its servers, its files, and `crabctl`.

use std::collections::BTreeMap;
use std::io::{Read, Write};
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::process::Output;

use crate::containerd::Containerd;
use crate::image::{python_sdk_archive, PYTHON_SDK};
use crate::{bin_dir, wait_until, CRAB};

/// Port of the counter (each connection gets the next value).
pub const COUNTER: u16 = 7000;
/// Port of the key-value store (`set k v`, `get k`, `exit CODE`).
pub const STORE: u16 = 7001;
/// Port of the server `spawn` starts (a process left running).
pub const SPAWNED: u16 = 7002;

/// Starts the stateful sandbox `id` with the crab runtime and waits until
/// both its servers answer; returns the init's pid.
pub fn run_stateful(ctd: &Containerd, id: &str) -> i32 {
    ctd.ctr_ok(&["image", "import", &python_sdk_archive().to_string_lossy()]);
    let fixtures = crate::image::fixtures_dir();
    let mount = format!(
        "type=bind,src={},dst=/fixtures,options=rbind:ro",
        fixtures.display()
    );
    ctd.ctr_ok(&[
        "run",
        "-d",
        "--mount",
        &mount,
        "--runtime",
        CRAB,
        PYTHON_SDK,
        id,
        "/opt/crab/sdk-venv/bin/python3",
        "/fixtures/stateful.py",
    ]);
    let pid = ctd.task_pid(id).expect("the task runs");
    wait_until(20, || try_ask(pid, STORE, "get nothing").ok())
        .unwrap_or_else(|| panic!("the store of {id} never answered"));
    wait_until(20, || try_ask(pid, COUNTER, "peek").ok().map(drop))
        .unwrap_or_else(|| panic!("the counter of {id} never answered"));
    pid
}

/// Runs `sh -c script` in sandbox `id` (an exec), asserting success;
/// returns its stdout.
#[track_caller]
pub fn exec_sh(ctd: &Containerd, id: &str, script: &str) -> String {
    ctd.ctr_ok(&[
        "task",
        "exec",
        "--exec-id",
        &crate::unique("sh"),
        id,
        "sh",
        "-c",
        script,
    ])
}

/// Sends `req` to `port` on the loopback of `pid`'s network namespace;
/// returns the answer's first line.
///
/// # Panics
/// If the server does not answer.
#[track_caller]
pub fn ask(pid: i32, port: u16, req: &str) -> String {
    try_ask(pid, port, req).unwrap_or_else(|e| panic!("port {port} in pid {pid}'s netns: {e}"))
}

/// Like [`ask`], with the failure as an error.
pub fn try_ask(pid: i32, port: u16, req: &str) -> std::io::Result<String> {
    let req = req.to_owned();
    // setns(CLONE_NEWNET) changes only the calling thread.
    std::thread::spawn(move || {
        let ns = std::fs::File::open(format!("/proc/{pid}/ns/net"))?;
        nix::sched::setns(ns, nix::sched::CloneFlags::CLONE_NEWNET).map_err(std::io::Error::from)?;
        let mut s = std::net::TcpStream::connect(("127.0.0.1", port))?;
        s.set_read_timeout(Some(std::time::Duration::from_secs(5)))?;
        s.write_all(format!("{req}\n").as_bytes())?;
        let mut answer = String::new();
        s.read_to_string(&mut answer)?;
        Ok(answer.lines().next().unwrap_or_default().to_owned())
    })
    .join()
    .expect("the client thread does not panic")
}

/// The tree under `dir` of `pid`'s root, by relative path: type, mode,
/// owner, and content or link target.
pub fn tree_digest(pid: i32, dir: &str) -> BTreeMap<String, String> {
    let root = PathBuf::from(format!("/proc/{pid}/root{dir}"));
    let mut out = BTreeMap::new();
    walk(&root, &root, &mut out);
    out
}

fn walk(root: &Path, dir: &Path, out: &mut BTreeMap<String, String>) {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return;
    };
    for entry in entries.flatten() {
        let path = entry.path();
        let rel = path
            .strip_prefix(root)
            .unwrap_or(&path)
            .to_string_lossy()
            .into_owned();
        let Ok(meta) = std::fs::symlink_metadata(&path) else {
            continue;
        };
        let head = format!("{:o} {}:{}", meta.mode(), meta.uid(), meta.gid());
        if meta.file_type().is_symlink() {
            let target = std::fs::read_link(&path).unwrap_or_default();
            out.insert(rel, format!("{head} -> {}", target.display()));
        } else if meta.is_dir() {
            out.insert(rel, format!("{head} dir"));
            walk(root, &path, out);
        } else {
            let content = std::fs::read(&path).unwrap_or_default();
            out.insert(rel, format!("{head} {}", String::from_utf8_lossy(&content)));
        }
    }
}

/// Runs `crabctl --json args…` against `ctd`'s crabd.
pub fn crabctl(ctd: &Containerd, args: &[&str]) -> Output {
    // Through a checking relay when crabd runs: every request and answer
    // of the call is held to openapi.json as it passes.
    let checked = crate::wire::CheckedSocket::start(&ctd.crabd_socket());
    let socket = checked
        .as_ref()
        .map_or_else(|| ctd.crabd_socket(), |c| c.socket().to_owned());
    let out = std::process::Command::new(bin_dir().join("crabctl"))
        .arg("--socket")
        .arg(socket)
        .arg("--json")
        .args(args)
        .output()
        .expect("run crabctl");
    let violations = checked
        .map(crate::wire::CheckedSocket::finish)
        .unwrap_or_default();
    assert!(
        violations.is_empty(),
        "crabctl {args:?} broke openapi.json: {violations:#?}"
    );
    out
}

/// Runs `crabctl --json args…` against `ctd`'s crabd directly, not
/// through the checking relay: for calls whose crabd is killed mid-answer
/// (a cut answer is then the point, not a break of the spec), and for a
/// benchmark's harness, whose checking would be CPU beside the sandboxes.
pub fn crabctl_direct(ctd: &Containerd, args: &[&str]) -> Output {
    std::process::Command::new(bin_dir().join("crabctl"))
        .arg("--socket")
        .arg(ctd.crabd_socket())
        .arg("--json")
        .args(args)
        .output()
        .expect("run crabctl")
}

/// Runs `crabctl --json args…`, asserts success, parses the JSON answer.
#[track_caller]
pub fn crabctl_ok(ctd: &Containerd, args: &[&str]) -> serde_json::Value {
    let out = crabctl(ctd, args);
    assert!(
        out.status.success(),
        "crabctl {args:?} failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).expect("crabctl prints JSON")
}

/// Has `importer`'s crabd import exports that `exporter`'s crabd signs:
/// the exporter's key (`crabctl keys`) in a file of the importer's
/// trusted directory.
pub fn trust(importer: &Containerd, exporter: &Containerd) {
    let theirs = crabctl_ok(exporter, &["keys"]);
    let ours = crabctl_ok(importer, &["keys"]);
    let dir = PathBuf::from(ours["trusted_dir"].as_str().expect("a trusted directory"));
    std::fs::create_dir_all(&dir).unwrap();
    let key = theirs["export_key"].as_str().expect("an export key");
    let file = dir.join(format!("{}.pub", exporter.namespace));
    std::fs::write(&file, format!("# {}\n{key}\n", exporter.dir.display())).unwrap();
}

/// Runs `crabctl args…`, asserts failure, returns its message.
#[track_caller]
pub fn crabctl_err(ctd: &Containerd, args: &[&str]) -> String {
    let out = crabctl(ctd, args);
    assert!(
        !out.status.success(),
        "crabctl {args:?} should fail, printed {}",
        String::from_utf8_lossy(&out.stdout)
    );
    String::from_utf8_lossy(&out.stderr).into_owned()
}

/// Waits (at most `secs`) until `path` exists in the root of process
/// `pid` (a sandbox's init): how a sandbox's script says it is ready.
#[track_caller]
pub fn wait_for_file(pid: i32, path: &str, secs: u64) {
    let file = format!("/proc/{pid}/root/{}", path.trim_start_matches('/'));
    crate::wait_until(secs, || std::path::Path::new(&file).exists().then_some(()))
        .unwrap_or_else(|| panic!("{file} never appeared"));
}

/// Waits until crabd lists sandbox `id` (its shim registers it at start).
#[track_caller]
pub fn wait_registered(ctd: &Containerd, id: &str) {
    wait_until(20, || listed(ctd, id).map(drop)).unwrap_or_else(|| {
        // The harness's directory goes with it: its words go into the panic.
        let tail = |name: &str| {
            let text = std::fs::read_to_string(ctd.dir.join(name)).unwrap_or_default();
            let lines: Vec<&str> = text.lines().collect();
            lines[lines.len().saturating_sub(30)..].join("\n")
        };
        panic!(
            "crabd never listed {id}\n--- crabd.log ---\n{}\n--- containerd.log ---\n{}",
            tail("crabd.log"),
            tail("containerd.log")
        )
    });
}

/// `crabctl ps`'s entry for sandbox `id`, if it lists one.
pub fn listed(ctd: &Containerd, id: &str) -> Option<serde_json::Value> {
    listed_by(crabctl, ctd, id)
}

/// [`listed`], asked through `run` (e.g. [`crabctl_direct`]).
pub fn listed_by(
    run: fn(&Containerd, &[&str]) -> Output,
    ctd: &Containerd,
    id: &str,
) -> Option<serde_json::Value> {
    let out = run(ctd, &["ps"]);
    let list: serde_json::Value = serde_json::from_slice(&out.stdout).ok()?;
    list.as_array()?.iter().find(|s| s["id"] == id).cloned()
}

/// Waits until crabd no longer lists sandbox `id` (its history is gone).
#[track_caller]
pub fn wait_forgotten(ctd: &Containerd, id: &str) {
    wait_until(15, || listed(ctd, id).is_none().then_some(()))
        .unwrap_or_else(|| panic!("crabd still lists {id}"));
}

/// Field `field` of each version `crabctl versions` lists for sandbox
/// `id`, where it is an integer.
#[track_caller]
fn version_field(ctd: &Containerd, id: &str, field: &str) -> Vec<i64> {
    crabctl_ok(ctd, &["versions", id])
        .as_array()
        .expect("a list")
        .iter()
        .filter_map(|v| v[field].as_i64())
        .collect()
}

/// The turns of the versions `crabctl versions` lists for sandbox `id`.
#[track_caller]
pub fn version_turns(ctd: &Containerd, id: &str) -> Vec<u64> {
    version_field(ctd, id, "turn")
        .into_iter()
        .map(|t| t as u64)
        .collect()
}

/// The version numbers `crabctl versions` lists for sandbox `id`.
#[track_caller]
pub fn version_numbers(ctd: &Containerd, id: &str) -> Vec<i64> {
    version_field(ctd, id, "version")
}

/// The base URL of sandbox `id`'s proxy on crabd's host listener.
#[track_caller]
pub fn proxy_url(ctd: &Containerd, id: &str) -> String {
    crabctl_ok(ctd, &["proxy-url", id])["url"]
        .as_str()
        .expect("a proxy url")
        .to_owned()
}

/// Sandbox `id`'s proxy URL split: the host listener's port and the path
/// prefix (`s/<id>/<secret>`, no leading slash).
pub fn proxy_endpoint(ctd: &Containerd, id: &str) -> (u16, String) {
    let url = proxy_url(ctd, id);
    let (port, prefix) = url
        .strip_prefix("http://127.0.0.1:")
        .and_then(|r| r.split_once('/'))
        .expect("a loopback URL");
    (port.parse().expect("a port"), prefix.to_owned())
}
