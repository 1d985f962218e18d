//! Agents on Node.js (the runtime of Claude Code and Gemini CLI): a Node
//! process with state in memory, a timer, a listening socket and an open
//! connection checkpoints and rolls back like any process, and runs with
//! libuv's io_uring switch off (`[shim] env`), which CRIU could not dump;
//! a process that turns it on gets its checkpoint refused, clearly.
//! The host's Node through the devbox image (the host's /usr bound
//! read-only); real containerd and CRIU. Needs root: CI runs it as root.

use crab_tests::leftovers::assert_clean;
use crab_tests::sandbox::{crabctl_err, crabctl_ok, exec_sh, try_ask, wait_registered};
use crab_tests::{wait_until, Containerd};

const PORT: u16 = 7010;

/// `count ticks switch kept` of the server in `pid`'s netns, once it answers.
fn peek(pid: i32) -> (u64, u64, String, String) {
    let line = wait_until(30, || try_ask(pid, PORT, "peek").ok()).expect("the Node server answers");
    let f: Vec<&str> = line.split_whitespace().collect();
    assert_eq!(f.len(), 4, "{line}");
    (
        f[0].parse().expect("count"),
        f[1].parse().expect("ticks"),
        f[2].to_owned(),
        f[3].to_owned(),
    )
}

#[test]
fn a_node_process_with_timers_and_sockets_rolls_back() {
    assert!(
        std::path::Path::new("/usr/bin/node").exists(),
        "/usr/bin/node missing: run packaging/install-deps.sh (it installs nodejs)"
    );
    let ctd = Containerd::start();
    let id = "nodebox";
    ctd.run_devbox(id);
    wait_registered(&ctd, id);
    let script = include_str!("../fixtures/node_server.js");
    std::fs::write(
        format!("/proc/{}/root/work/server.js", ctd.task_pid(id).expect("running")),
        script,
    )
    .expect("write the server");
    exec_sh(&ctd, id, "cd /work && (node server.js > /work/node.log 2>&1 &)");
    let pid = ctd.task_pid(id).expect("running");
    let (_, _, switch, _) = peek(pid);
    assert_eq!(switch, "0", "libuv's io_uring is off by default");
    wait_until(10, || (peek(pid).3 == "open").then_some(())).expect("the kept connection opens");
    for want in 1..=3 {
        assert_eq!(try_ask(pid, PORT, "hit").expect("hit"), want.to_string());
    }
    let (_, ticks_then, _, _) = peek(pid);
    let v = crabctl_ok(&ctd, &["checkpoint", id])["version"]["version"]
        .as_u64()
        .expect("a version");
    for _ in 0..2 {
        try_ask(pid, PORT, "hit").expect("hit");
    }
    assert_eq!(peek(pid).0, 5);

    let back = crabctl_ok(&ctd, &["rollback", id, &v.to_string()]);
    let pid = back["pid"].as_i64().expect("pid") as i32;
    let (count, ticks, switch, kept) = peek(pid);
    assert_eq!(
        (count, switch.as_str(), kept.as_str()),
        (3, "0", "open"),
        "memory, env and the kept socket as at the checkpoint"
    );
    assert!(
        ticks >= ticks_then,
        "the timer's count as at the checkpoint: {ticks} < {ticks_then}"
    );
    // The timer runs on after the restore.
    wait_until(10, || (peek(pid).1 > ticks + 5).then_some(())).expect("the timer ticks after the restore");
    assert_eq!(try_ask(pid, PORT, "hit").expect("hit"), "4");

    // A Node process that turns io_uring back on holds rings CRIU cannot
    // dump: the checkpoint is refused before CRIU runs, naming it and the
    // switch, and the sandbox runs on, thawed.
    let ring = "const fs = require('fs'); fs.writeFileSync('/work/uring.pid', String(process.pid)); \
                fs.readFile('/work/server.js', () => fs.writeFileSync('/work/uring-ready', '1')); \
                setInterval(() => {}, 1000);";
    exec_sh(
        &ctd,
        id,
        &format!("cd /work && (UV_USE_IO_URING=1 node -e \"{ring}\" > /work/uring.log 2>&1 &)"),
    );
    let root = format!("/proc/{pid}/root/work");
    wait_until(30, || {
        std::path::Path::new(&format!("{root}/uring-ready"))
            .exists()
            .then_some(())
    })
    .expect("the io_uring node started");
    let versions = crabctl_ok(&ctd, &["versions", id]).as_array().map(Vec::len);
    let e = crabctl_err(&ctd, &["checkpoint", id]);
    let ring_pid = std::fs::read_to_string(format!("{root}/uring.pid")).unwrap();
    assert!(
        e.contains("io_uring") && e.contains("UV_USE_IO_URING=0") && e.contains("(\"node\")"),
        "{e}"
    );
    assert_eq!(
        crabctl_ok(&ctd, &["versions", id]).as_array().map(Vec::len),
        versions
    );
    assert_eq!(try_ask(pid, PORT, "hit").expect("thawed"), "5");
    exec_sh(&ctd, id, &format!("kill {ring_pid}"));
    wait_until(20, || {
        crab_tests::sandbox::crabctl(&ctd, &["checkpoint", id])
            .status
            .success()
            .then_some(())
    })
    .expect("a checkpoint once the ring is gone");

    ctd.remove(id);
    assert_clean(&ctd.scope(), &[id]);
}
