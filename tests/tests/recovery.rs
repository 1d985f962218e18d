//! Automatic crash recovery (`[crabd] recover = "on-crash"`, the default):
//! a sandbox whose init dies unasked is restored from its head version into
//! the same container, and containerd sees its task run on with a new pid.
//! An exit the init chose, and a stop that was asked for, are the task's
//! end; crashes in a row give up. Real containerd, crabd and CRIU; needs
//! root: CI runs it as root.

use crab_tests::leftovers::assert_clean;
use crab_tests::sandbox::{ask, crabctl_ok, listed, run_stateful, wait_registered, STORE};
use crab_tests::{wait_until, Containerd};
use nix::sys::signal::{kill, Signal};
use nix::unistd::Pid;

/// The task's pid once it is another than `old`.
fn new_pid(ctd: &Containerd, id: &str, old: i32) -> i32 {
    wait_until(30, || ctd.task_pid(id).filter(|&p| p != old))
        .unwrap_or_else(|| panic!("{id} was not recovered: {:?}", ctd.task_status(id)))
}

/// crabd's entry for `id` once it counts `n` recoveries (its bookkeeping
/// follows the restore it answered).
fn recovered(ctd: &Containerd, id: &str, n: u64) -> serde_json::Value {
    wait_until(10, || listed(ctd, id).filter(|e| e["recoveries"] == n))
        .unwrap_or_else(|| panic!("{id}: not {n} recoveries: {:?}", listed(ctd, id)))
}

/// The first child of `pid` (the spec's process, under crab-init).
fn main_process(pid: i32) -> i32 {
    let children = std::fs::read_to_string(format!("/proc/{pid}/task/{pid}/children")).unwrap();
    children
        .split_whitespace()
        .next()
        .expect("a child")
        .parse()
        .unwrap()
}

#[test]
fn a_crashed_sandbox_comes_back_from_its_head_version() {
    let ctd = Containerd::start();
    let id = "crashy";
    let pid = run_stateful(&ctd, id);
    wait_registered(&ctd, id);
    assert_eq!(ask(pid, STORE, "set a 1"), "ok");
    crabctl_ok(&ctd, &["checkpoint", id]);
    assert_eq!(ask(pid, STORE, "set a 2"), "ok");

    // Killed from outside, as the OOM killer or a stray kill -9 would.
    kill(Pid::from_raw(pid), Signal::SIGKILL).unwrap();
    let pid = new_pid(&ctd, id, pid);
    assert_eq!(ctd.task_status(id).as_deref(), Some("RUNNING"));
    assert_eq!(ask(pid, STORE, "get a"), "1", "the head version's memory");
    let info = recovered(&ctd, id, 1);
    assert_eq!(info["last_recovery"]["version"], 1, "{info}");
    assert_eq!(info["last_recovery"]["exit_status"], 137, "{info}");
    assert_eq!(info["last_recovery"]["pid"], pid, "{info}");

    // The spec's process crashing (under crab-init) is a crash too.
    assert_eq!(ask(pid, STORE, "set a 3"), "ok");
    kill(Pid::from_raw(main_process(pid)), Signal::SIGSEGV).unwrap();
    let pid = new_pid(&ctd, id, pid);
    assert_eq!(ask(pid, STORE, "get a"), "1");
    let info = recovered(&ctd, id, 2);
    assert_eq!(info["last_recovery"]["exit_status"], 139, "{info}");

    // An exit the spec's process chose is the task's end, even with the
    // status of a crash (crab-init says how it ended).
    let _ = crab_tests::sandbox::try_ask(pid, STORE, "exit 139");
    wait_until(20, || {
        (ctd.task_status(id).as_deref() == Some("STOPPED")).then_some(())
    })
    .expect("the task stops");
    assert_eq!(listed(&ctd, id).expect("listed")["recoveries"], 2);
    ctd.remove(id);
    assert_clean(&ctd.scope(), &[id]);
}

#[test]
fn crashes_in_a_row_give_up_and_a_stop_asked_for_is_no_crash() {
    let ctd = Containerd::start();
    let id = "doomed";
    let mut pid = run_stateful(&ctd, id);
    wait_registered(&ctd, id);
    crabctl_ok(&ctd, &["checkpoint", id]);
    // Three recoveries within a minute (each waits longer), then the
    // fourth crash is the task's end.
    for n in 1..=3 {
        kill(Pid::from_raw(pid), Signal::SIGKILL).unwrap();
        pid = new_pid(&ctd, id, pid);
        recovered(&ctd, id, n);
    }
    kill(Pid::from_raw(pid), Signal::SIGKILL).unwrap();
    wait_until(30, || {
        (ctd.task_status(id).as_deref() == Some("STOPPED")).then_some(())
    })
    .expect("the fourth crash stops the task");
    ctd.remove(id);

    // `ctr task kill` is asked for: never recovered.
    let id = "stopped";
    let pid = run_stateful(&ctd, id);
    wait_registered(&ctd, id);
    crabctl_ok(&ctd, &["checkpoint", id]);
    ctd.ctr_ok(&["task", "kill", "-s", "SIGKILL", id]);
    wait_until(20, || {
        (ctd.task_status(id).as_deref() == Some("STOPPED")).then_some(())
    })
    .expect("the task stops");
    assert_eq!(ctd.task_pid(id), Some(pid), "no new init");
    assert_eq!(listed(&ctd, id).expect("listed")["recoveries"], 0);
    ctd.remove(id);
    assert_clean(&ctd.scope(), &["doomed", id]);
}
