//! `crabctl resume` and `[crabd] resume_on_boot`: a sandbox whose shim and
//! processes died at once (as with its host) starts again in its own
//! containerd container from its head version, with that version's memory,
//! server state and files. Real containerd, CRIU, overlayfs; needs root: CI
//! runs it as root.

use crab_tests::leftovers::assert_clean;
use crab_tests::sandbox::{
    ask, crabctl_err, crabctl_ok, exec_sh, run_stateful, tree_digest, wait_registered, COUNTER, STORE,
};
use crab_tests::{wait_until, Containerd};
use nix::sys::signal::{kill, SIGKILL};
use nix::unistd::Pid;

/// Kills sandbox `id`'s shim, then its processes: what a host crash leaves
/// of it (containerd's container and snapshot, no task).
fn crash(ctd: &Containerd, id: &str) {
    let init = ctd.task_pid(id).expect("the task runs");
    let address = ctd.address().to_string_lossy().into_owned();
    for pid in crab_tests::leftovers::shim_pids(&address) {
        let _ = kill(Pid::from_raw(pid), SIGKILL);
    }
    // The init of a pid namespace: the kernel takes every process with it.
    let _ = kill(Pid::from_raw(init), SIGKILL);
    wait_until(30, || {
        (ctd.task_status(id).as_deref() != Some("RUNNING")).then_some(())
    })
    .expect("containerd sees the task gone");
}

/// The state a version holds: the store's value, the counter's next
/// answer, the files under /data.
fn state(pid: i32) -> (String, u64, std::collections::BTreeMap<String, String>) {
    let next = ask(pid, COUNTER, "peek").parse::<u64>().unwrap();
    (ask(pid, STORE, "get a"), next, tree_digest(pid, "/data"))
}

#[test]
fn a_sandbox_whose_host_died_resumes_from_its_head() {
    let config = std::env::temp_dir().join(crab_tests::unique("crab-resume"));
    std::fs::write(&config, "[crabd]\nresume_on_boot = true\n").unwrap();
    let mut ctd = Containerd::start_full("", &[("CRAB_CONFIG", &config.to_string_lossy())]);
    let id = "phoenix";
    let pid = run_stateful(&ctd, id);
    wait_registered(&ctd, id);
    assert_eq!(ask(pid, STORE, "set a 5"), "ok");
    exec_sh(&ctd, id, "mkdir -p /data && echo v1 > /data/f");
    crabctl_ok(&ctd, &["checkpoint", id]);
    let (a, next, files) = state(pid);
    // After the version: changes the crash takes with it.
    assert_eq!(ask(pid, STORE, "set a 6"), "ok");
    exec_sh(&ctd, id, "echo lost > /data/f; echo lost > /data/g");

    // A running sandbox is rolled back, not resumed.
    let e = crabctl_err(&ctd, &["resume", id]);
    assert!(e.contains("its task runs"), "{e}");

    crash(&ctd, id);
    let r = crabctl_ok(&ctd, &["resume", id]);
    assert_eq!(r["version"], 1, "{r}");
    let pid = r["pid"].as_i64().unwrap() as i32;
    wait_registered(&ctd, id);
    assert_eq!(ctd.task_pid(id), Some(pid));
    assert_eq!(
        state(pid),
        (a.clone(), next, files.clone()),
        "the head version's state"
    );
    // It goes on from there: its next version descends from the one
    // resumed, and the container's spec is as it was (no restore left).
    let v2 = crabctl_ok(&ctd, &["checkpoint", "--fs", id]);
    assert_eq!(v2["version"]["parent"], 1, "{v2}");
    let spec = ctd.ctr_ok(&["container", "info", id]);
    assert!(!spec.contains("io.crab.restore"), "{spec}");

    // The whole host: crabd dies too, and resumes the sandbox at its first
    // start after the boot (a boot id other than the one it kept).
    crash(&ctd, id);
    ctd.stop_crabd();
    if let Some(crabd) = ctd.crabd_pid() {
        let _ = kill(Pid::from_raw(crabd), SIGKILL);
    }
    std::fs::write(ctd.crabd_root().join("boot_id"), "an earlier boot\n").unwrap();
    ctd.start_crabd();
    let pid = wait_until(60, || {
        (ctd.task_status(id).as_deref() == Some("RUNNING"))
            .then(|| ctd.task_pid(id))
            .flatten()
    })
    .expect("crabd resumed the sandbox at its start");
    wait_registered(&ctd, id);
    // Version 2 (the head) took v1's processes and the files of then.
    let (a2, _, files2) = state(pid);
    assert_eq!((a2, files2), (a, files));

    ctd.remove(id);
    assert_clean(&ctd.scope(), &[id]);
    let _ = std::fs::remove_file(&config);
}

#[test]
fn a_sandbox_without_a_version_cannot_resume() {
    let ctd = Containerd::start();
    let id = "novers";
    run_stateful(&ctd, id);
    wait_registered(&ctd, id);
    crash(&ctd, id);
    let e = crabctl_err(&ctd, &["resume", id]);
    assert!(e.contains("version"), "{e}");
    let e = crabctl_err(&ctd, &["resume", "nosuch"]);
    assert!(e.contains("nosuch"), "{e}");
    ctd.remove(id);
    assert_clean(&ctd.scope(), &[id]);
}
