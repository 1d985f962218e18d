//! Task events reach containerd: create, start, exec-added, exec-started,
//! paused, resumed, OOM, exit, delete. Needs root: CI runs it as root.

use std::process::Stdio;

use crab_tests::image::BUSYBOX;
use crab_tests::leftovers::assert_clean;
use crab_tests::{Containerd, CRAB};

#[test]
fn task_events() {
    let ctd = Containerd::start();
    let mut events = ctd
        .ctr_cmd(&["events"])
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .expect("ctr events");
    // ctr events subscribes asynchronously; a first container proves it is listening.
    ctd.ctr_ok(&["run", "--rm", "--runtime", CRAB, BUSYBOX, "warmup", "true"]);

    ctd.run_detached(CRAB, "ev", &["sleep", "300"]);
    ctd.ctr_ok(&["task", "exec", "--exec-id", "x", "ev", "true"]);
    ctd.ctr_ok(&["task", "pause", "ev"]);
    ctd.ctr_ok(&["task", "resume", "ev"]);
    ctd.remove("ev");
    // A shell that outgrows its 20 MB memory limit is OOM-killed.
    let out = ctd.ctr(&[
        "run",
        "--rm",
        "--memory-limit",
        "20000000",
        "--runtime",
        CRAB,
        BUSYBOX,
        "oom",
        "sh",
        "-c",
        "x=$(head -c 60000000 /dev/zero | tr '\\0' a); echo ${#x}",
    ]);
    assert_eq!(out.status.code(), Some(137));
    ctd.ctr_ok(&["run", "--rm", "--runtime", CRAB, BUSYBOX, "last", "true"]);

    let _ = events.kill();
    let out = events.wait_with_output().expect("ctr events output");
    let text = String::from_utf8_lossy(&out.stdout);
    let topics_of = |id: &str| -> Vec<String> {
        text.lines()
            .filter(|l| l.contains(&format!("\"container_id\":\"{id}\"")))
            .filter_map(|l| l.split_whitespace().nth(5).map(str::to_owned))
            .collect()
    };
    assert_eq!(
        topics_of("ev"),
        [
            "/tasks/create",
            "/tasks/start",
            "/tasks/exec-added",
            "/tasks/exec-started",
            "/tasks/exit",
            "/tasks/paused",
            "/tasks/resumed",
            "/tasks/exit",
            "/tasks/delete"
        ],
        "{text}"
    );
    let oom = topics_of("oom");
    assert!(oom.contains(&"/tasks/oom".to_owned()), "{text}");
    let exit = text
        .lines()
        .find(|l| l.contains("/tasks/exit") && l.contains("\"container_id\":\"oom\""))
        .expect("oom exit event");
    assert!(exit.contains("\"exit_status\":137"), "{exit}");
    assert_clean(&ctd.scope(), &["warmup", "ev", "oom", "last"]);
}
