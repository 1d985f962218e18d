//! containerd restarts while a crab task runs: the task keeps running and is
//! fully manageable afterwards. Needs root: CI runs it as root.

use crab_tests::leftovers::assert_clean;
use crab_tests::{stderr, wait_until, Containerd, CRAB};

#[test]
fn task_survives_containerd_restart() {
    let mut ctd = Containerd::start();
    ctd.run_detached(
        CRAB,
        "r",
        &[
            "sh",
            "-c",
            // Written through a rename: a reader never sees it half-written.
            "i=0; while true; do i=$((i+1)); echo $i > /tmp/n.new; mv /tmp/n.new /tmp/n; sleep 0.05; done",
        ],
    );
    let pid = ctd.task_pid("r").expect("task listed");
    ctd.restart();

    assert_eq!(ctd.task_pid("r"), Some(pid));
    assert_eq!(ctd.task_status("r").as_deref(), Some("RUNNING"));
    // The counter keeps counting: the container never stopped.
    let read = || -> u64 {
        let out = ctd.ctr_ok(&[
            "task",
            "exec",
            "--exec-id",
            &crab_tests::unique("n"),
            "r",
            "cat",
            "/tmp/n",
        ]);
        out.trim().parse().expect("a number")
    };
    let first = read();
    assert!(
        wait_until(10, || (read() > first).then_some(())).is_some(),
        "counter stopped"
    );

    ctd.ctr_ok(&["task", "pause", "r"]);
    assert_eq!(ctd.task_status("r").as_deref(), Some("PAUSED"));
    ctd.ctr_ok(&["task", "resume", "r"]);
    assert!(ctd.ctr_ok(&["task", "ps", "r"]).contains(&pid.to_string()));

    // Exits reach the new containerd: the status is exact.
    ctd.ctr_ok(&["task", "kill", "-s", "SIGKILL", "r"]);
    wait_until(10, || {
        (ctd.task_status("r").as_deref() == Some("STOPPED")).then_some(())
    })
    .expect("stops");
    let out = ctd.ctr(&["task", "delete", "r"]);
    assert!(stderr(&out).contains("exit code 137"), "{}", stderr(&out));
    ctd.ctr_ok(&["container", "rm", "r"]);
    assert_clean(&ctd.scope(), &["r"]);
}

/// The shim is killed (SIGKILL) under a running task: containerd cleans up
/// through `containerd-shim-crab-v2 delete`, and nothing is left behind.
#[test]
fn shim_killed_leaves_nothing() {
    let ctd = Containerd::start();
    ctd.run_detached(CRAB, "k9", &["sleep", "300"]);
    let init = ctd.task_pid("k9").expect("task listed");
    let shims = crab_tests::leftovers::shim_pids(&ctd.address().to_string_lossy());
    assert_eq!(shims.len(), 1);
    let shim = nix::unistd::Pid::from_raw(shims[0]);
    nix::sys::signal::kill(shim, nix::sys::signal::Signal::SIGKILL).expect("kill shim");
    // containerd notices and runs the shim's delete, which kills the container.
    let gone = wait_until(10, || {
        let alive = std::path::Path::new(&format!("/proc/{init}")).exists();
        (!alive && ctd.task_status("k9").is_none()).then_some(())
    });
    assert!(gone.is_some(), "container or task survived its shim");
    ctd.ctr_ok(&["container", "rm", "k9"]);
    assert_clean(&ctd.scope(), &["k9"]);
}
