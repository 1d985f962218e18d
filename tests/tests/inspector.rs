//! crabd with the eBPF inspector loaded: `crabctl turn` ends a sandbox's
//! turn by hand and says what it changed; `crabctl watch` prints reports
//! as turns end. Real BPF programs on tracepoints, a real crab sandbox;
//! needs root: CI runs it as root.

use std::io::BufRead;

use crab_tests::leftovers::assert_clean;
use crab_tests::sandbox::{crabctl_ok, wait_registered};
use crab_tests::{bin_dir, unique, Containerd, CRAB};

#[test]
fn crabctl_turn_and_watch_report_what_turns_changed() {
    let config = std::env::temp_dir().join(unique("crab-inspect"));
    std::fs::write(&config, "[crabd]\ninspector = true\n").unwrap();
    let ctd = Containerd::start_full("", &[("CRAB_CONFIG", &config.to_string_lossy())]);
    let id = "inspected";
    // A timed sleep: the first turn's process checkpoint hands its
    // `nanosleep` -EINTR (CRIU), which its image holds too; the call made
    // again from the same place is no running.
    ctd.run_detached(CRAB, id, &["sleep", "600"]);
    wait_registered(&ctd, id);
    let exec = |script: &str| {
        crab_tests::sandbox::exec_sh(&ctd, id, script);
    };
    // Whatever starting the sandbox did ends with this turn.
    crabctl_ok(&ctd, &["turn", id]);

    exec("ls / >/dev/null; cat /etc/passwd >/dev/null");
    let r = crabctl_ok(&ctd, &["turn", id]);
    assert_eq!(r["class"], "none", "a read-only turn: {r}");

    exec("echo data > /kept; echo tmp > /scratch; rm /scratch");
    let r = crabctl_ok(&ctd, &["turn", id]);
    assert_eq!(r["class"], "fs", "a write: {r}");
    assert!(r.to_string().contains("kept"), "the changed path is named: {r}");
    assert!(
        !r.to_string().contains("scratch"),
        "a file made and removed is no change: {r}"
    );

    // A watcher sees the next report.
    let mut watch = std::process::Command::new(bin_dir().join("crabctl"))
        .arg("--socket")
        .arg(ctd.crabd_socket())
        .args(["--json", "watch", id])
        .stdout(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    // Its first line says the watch is live: no sleep to wait for it.
    let mut lines = std::io::BufReader::new(watch.stdout.take().unwrap());
    let mut line = String::new();
    lines.read_line(&mut line).unwrap();
    let started: serde_json::Value = serde_json::from_str(&line).expect("a JSON line");
    crab_tests::openapi::validate("WatchStarted", &started).unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(started["watching"], id, "{line}");
    exec("sleep 300 >/dev/null 2>&1 &");
    let r = crabctl_ok(&ctd, &["turn", id]);
    assert!(
        r["class"] == "proc" || r["class"] == "full",
        "a process left running: {r}"
    );
    line.clear();
    lines.read_line(&mut line).unwrap();
    let seen: serde_json::Value = serde_json::from_str(&line).expect("a JSON report");
    crab_tests::openapi::validate("WatchLine", &seen).unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(seen["turn"], r["turn"], "{line}");
    assert_eq!(seen["class"], r["class"]);
    let _ = watch.kill();
    let _ = watch.wait();

    ctd.remove(id);
    assert_clean(&ctd.scope(), &[id]);
    let _ = std::fs::remove_file(&config);
}
