//! The per-turn loop with the defaults: every turn end through the
//! sandbox's proxy becomes a version of the class the inspector chose, and
//! versions form a tree (a rollback moves the head; the next version
//! descends from it). Real containerd, CRIU and BPF (the inspector on);
//! needs root: CI runs it as root.
//!
//! The agent runs on the host (as mini-swe-agent does): it talks to its LLM
//! through `crabctl proxy-url` and runs its commands with `ctr task exec`.

use crab_tests::leftovers::assert_clean;
use crab_tests::llm::{chat_turn, ScriptedLlm};
use crab_tests::sandbox::{
    ask, crabctl_ok, exec_sh, proxy_url, run_stateful, try_ask, wait_registered, SPAWNED, STORE,
};
use crab_tests::{unique, Containerd};

/// A containerd whose crabd loads the inspector and whose proxies forward
/// to `llm`; everything else is the default `crab.toml`.
fn containerd(llm: &ScriptedLlm) -> (Containerd, std::path::PathBuf) {
    let config = std::env::temp_dir().join(unique("crab-loop"));
    std::fs::write(
        &config,
        format!(
            "[shim.proxy]\nopenai_upstream = \"http://127.0.0.1:{}\"\n[crabd]\ninspector = true\n",
            llm.port
        ),
    )
    .unwrap();
    let ctd = Containerd::start_full("", &[("CRAB_CONFIG", &config.to_string_lossy())]);
    (ctd, config)
}

/// A stateful sandbox `id` on a containerd of [`containerd`]: the
/// containerd, its config file, the init's pid and the proxy URL.
fn stateful_sandbox(llm: &ScriptedLlm, id: &str) -> (Containerd, std::path::PathBuf, i32, String) {
    let (ctd, config) = containerd(llm);
    let pid = run_stateful(&ctd, id);
    wait_registered(&ctd, id);
    let url = proxy_url(&ctd, id);
    (ctd, config, pid, url)
}

/// One turn of the host agent, answered at once.
fn turn(url: &str) {
    chat_turn(url, std::time::Duration::ZERO).expect("the turn is answered");
}

/// `(version, parent, class, process image)` of each version.
fn tree(ctd: &Containerd, id: &str) -> Vec<(u64, Option<u64>, String, Option<u64>)> {
    crabctl_ok(ctd, &["versions", id])
        .as_array()
        .expect("a list")
        .iter()
        .map(|v| {
            assert!(v["defect"].is_null(), "{v}");
            (
                v["version"].as_u64().unwrap(),
                v["parent"].as_u64(),
                v["class"].as_str().unwrap().to_owned(),
                v["process_image"].as_u64(),
            )
        })
        .collect()
}

/// The newest version's class.
fn newest_class(ctd: &Containerd, id: &str) -> String {
    tree(ctd, id).last().expect("a version").2.clone()
}

fn file(pid: i32, path: &str) -> Option<String> {
    std::fs::read_to_string(format!("/proc/{pid}/root{path}")).ok()
}

#[test]
fn each_turn_is_a_version_of_its_class_and_rollbacks_branch() {
    let llm = ScriptedLlm::start();
    let id = "loop";
    let (ctd, config, pid, url) = stateful_sandbox(&llm, id);

    // Turn 1: the sandbox has no version yet, so its first is whole.
    assert_eq!(ask(pid, STORE, "set a 1"), "ok");
    turn(&url);
    assert_eq!(newest_class(&ctd, id), "full");
    // Turn 2 only read: a manifest line.
    exec_sh(&ctd, id, "cat /etc/passwd >/dev/null; ls / >/dev/null");
    turn(&url);
    assert_eq!(newest_class(&ctd, id), "none");
    // Turn 3 edited a file: a file snapshot.
    exec_sh(&ctd, id, "echo three > /data/f");
    turn(&url);
    assert_eq!(newest_class(&ctd, id), "fs");
    // Turn 4 left a server running (and changed the store's memory).
    assert_eq!(ask(pid, STORE, "set a 4"), "ok");
    assert_eq!(ask(pid, STORE, "spawn"), "ok");
    assert_eq!(ask(pid, SPAWNED, "hi"), "spawned");
    turn(&url);
    let class = newest_class(&ctd, id);
    assert!(
        class == "proc" || class == "full",
        "a process left running: {class}"
    );
    assert_eq!(
        tree(&ctd, id),
        [
            (1, None, "full".to_owned(), Some(1)),
            (2, Some(1), "none".to_owned(), Some(1)),
            (3, Some(2), "fs".to_owned(), Some(1)),
            (4, Some(3), class.clone(), Some(4)),
        ]
    );

    // Back to the fs version: its files, version 1's processes.
    let r = crabctl_ok(&ctd, &["rollback", id, "3"]);
    let pid = r["pid"].as_i64().unwrap() as i32;
    assert_eq!(ask(pid, STORE, "get a"), "1");
    assert!(try_ask(pid, SPAWNED, "hi").is_err(), "no server in version 3");
    assert_eq!(file(pid, "/data/f").as_deref(), Some("three\n"));
    // Forward to the proc version: the server is back, listening, with the
    // store's memory of then.
    let r = crabctl_ok(&ctd, &["rollback", id, "4"]);
    let pid = r["pid"].as_i64().unwrap() as i32;
    assert_eq!(ask(pid, STORE, "get a"), "4");
    assert_eq!(ask(pid, SPAWNED, "hi"), "spawned");
    assert_eq!(file(pid, "/data/f").as_deref(), Some("three\n"));
    // Back to the none version: before the edit (its processes, version
    // 1's, are asked about below: asking now would be a change).
    let r = crabctl_ok(&ctd, &["rollback", id, "2"]);
    let pid = r["pid"].as_i64().unwrap() as i32;
    assert_eq!(file(pid, "/data/f"), None);

    // The next turn is classified against the restored state (the restore
    // itself is no change) and descends from version 2; every newer
    // version is kept. Its names of more than one component make the
    // inspector compare the tmpfs mounts whole: the restored ones, with
    // new device numbers, not the ones it knew before.
    exec_sh(&ctd, id, "mkdir -p /data/a/b && rmdir /data/a/b /data/a");
    turn(&url);
    let versions = tree(&ctd, id);
    assert_eq!(versions.len(), 5, "{versions:?}");
    assert_eq!(versions[4], (5, Some(2), "none".to_owned(), Some(1)));
    assert_eq!(ask(pid, STORE, "get a"), "1");

    // The sequence by hand: a files-only version after a rollback
    // pairs its files with the processes of the version rolled back to.
    assert_eq!(ask(pid, STORE, "set a 6"), "ok");
    let v6 = crabctl_ok(&ctd, &["checkpoint", id]);
    assert_eq!(v6["version"]["parent"], 5);
    crabctl_ok(&ctd, &["rollback", id, "1"]);
    exec_sh(&ctd, id, "echo seven > /data/g");
    let v7 = crabctl_ok(&ctd, &["checkpoint", "--fs", id]);
    assert_eq!(v7["version"]["parent"], 1, "{v7}");
    assert_eq!(v7["version"]["process_image"], 1, "{v7}");
    let r = crabctl_ok(&ctd, &["rollback", id, "7"]);
    let pid = r["pid"].as_i64().unwrap() as i32;
    assert_eq!(ask(pid, STORE, "get a"), "1", "version 1's processes, not 6's");
    assert_eq!(file(pid, "/data/g").as_deref(), Some("seven\n"));

    // What the loop did is in crabd's metrics.
    let metrics = crab_tests::sandbox::crabctl(&ctd, &["metrics"]);
    let text = String::from_utf8_lossy(&metrics.stdout).into_owned();
    let value = |name: &str| -> f64 {
        text.lines()
            .find_map(|l| l.strip_prefix(name)?.trim().parse().ok())
            .unwrap_or_else(|| panic!("{name} not in:\n{text}"))
    };
    assert!(value("crab_turns_total{class=\"none\"}") >= 1.0, "{text}");
    assert!(value("crab_turns_total{class=\"fs\"}") >= 1.0, "{text}");
    assert_eq!(value("crab_versions_total{class=\"fs\"}"), 2.0, "{text}");
    assert_eq!(value("crab_slots_in_use"), 0.0, "{text}");
    // Every capture took a slot; the `none` turns took none.
    assert!(value("crab_queue_wait_seconds_count") >= 5.0, "{text}");

    ctd.remove(id);
    assert_clean(&ctd.scope(), &[id]);
    let _ = std::fs::remove_file(&config);
}

/// A server started by `ctr task exec -d` and still running at a turn end
/// is in that turn's version (crab-init, the sandbox's pid 1, adopted it):
/// a rollback brings it back, listening, with its memory of then. The
/// exec itself behaves as before: its pid is the server's, a signal to the
/// exec reaches it, and an exec's exit status is its command's.
#[test]
fn an_execd_server_is_in_its_turns_version() {
    let llm = ScriptedLlm::start();
    let id = "execd";
    let (ctd, config, pid, url) = stateful_sandbox(&llm, id);
    const PORT: u16 = 7005;
    turn(&url);

    ctd.ctr_ok(&[
        "task",
        "exec",
        "-d",
        "--exec-id",
        "srv",
        id,
        "/opt/crab/sdk-venv/bin/python3",
        "/fixtures/stateful.py",
        "serve",
        &PORT.to_string(),
    ]);
    crab_tests::wait_until(20, || try_ask(pid, PORT, "get x").ok()).expect("the exec's server answers");
    assert_eq!(ask(pid, PORT, "set x 42"), "ok");
    // The exec's pid is the server's, a child of the sandbox's init.
    let ps = ctd.ctr_ok(&["task", "ps", id]);
    let server = ps
        .lines()
        .filter_map(|l| l.split_whitespace().next()?.parse::<i32>().ok())
        .find(|&p| std::fs::read_to_string(format!("/proc/{p}/cmdline")).is_ok_and(|c| c.contains("serve")))
        .expect("the server is one of the task's processes");
    let status = std::fs::read_to_string(format!("/proc/{server}/status")).unwrap();
    let ppid = status
        .lines()
        .find_map(|l| l.strip_prefix("PPid:"))
        .unwrap()
        .trim();
    assert_eq!(ppid, pid.to_string(), "adopted by the init");
    turn(&url);
    let class = newest_class(&ctd, id);
    assert!(
        class == "proc" || class == "full",
        "a server left running: {class}"
    );
    let version = tree(&ctd, id).last().unwrap().0.to_string();

    // A signal to the exec reaches the server; its exit is the exec's.
    assert_eq!(ask(pid, PORT, "set x 43"), "ok");
    ctd.ctr_ok(&["task", "kill", "--exec-id", "srv", "-s", "SIGTERM", id]);
    crab_tests::wait_until(20, || try_ask(pid, PORT, "get x").is_err().then_some(()))
        .expect("the server got the signal");

    let r = crabctl_ok(&ctd, &["rollback", id, &version]);
    let pid = r["pid"].as_i64().unwrap() as i32;
    assert_eq!(
        ask(pid, PORT, "get x"),
        "42",
        "the server of then, with its memory"
    );
    assert_eq!(ask(pid, STORE, "get nothing"), "-");
    // An exec after the restore is adopted by the restored init.
    assert_eq!(exec_sh(&ctd, id, "echo hi"), "hi\n");
    let out = ctd.ctr(&["task", "exec", "--exec-id", "seven", id, "sh", "-c", "exit 7"]);
    assert_eq!(out.status.code(), Some(7), "{out:?}");

    ctd.remove(id);
    assert_clean(&ctd.scope(), &[id]);
    let _ = std::fs::remove_file(&config);
}
