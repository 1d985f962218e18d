//! Room for checkpoints: a sandbox whose versions reach
//! `[crabd] sandbox_store_max_bytes`, or a host whose store's filesystem
//! is under `[crabd] store_min_free_bytes`, gets no more versions, with an
//! error that names the limit; the sandbox runs on. Real containerd, crabd
//! and CRIU; needs root: CI runs it as root.

use crab_tests::leftovers::assert_clean;
use crab_tests::sandbox::{
    ask, crabctl, crabctl_ok, exec_sh, run_stateful, version_numbers, wait_registered, STORE,
};
use crab_tests::Containerd;

/// A containerd whose crabd reads `crabd_table` (a `[crabd]` table's lines).
fn containerd(crabd_table: &str) -> (Containerd, std::path::PathBuf) {
    let config = std::env::temp_dir().join(crab_tests::unique("crab-room"));
    std::fs::write(&config, format!("[crabd]\n{crabd_table}\n")).unwrap();
    let ctd = Containerd::start_full("", &[("CRAB_CONFIG", &config.to_string_lossy())]);
    (ctd, config)
}

/// `crabctl checkpoint args…` is refused for want of room; answers the
/// message (its code, `store_full`, is held to openapi.json on the wire).
fn refused(ctd: &Containerd, args: &[&str]) -> String {
    let out = crabctl(ctd, &[&["checkpoint"], args].concat());
    assert!(!out.status.success(), "a checkpoint past the limit is refused");
    let e = String::from_utf8_lossy(&out.stderr).into_owned();
    assert!(
        e.contains("gets no checkpoint") && e.contains("it runs on"),
        "{e}"
    );
    e
}

#[test]
fn a_sandbox_at_its_ceiling_gets_no_version_and_runs_on() {
    // One byte: the first version fits (the store is empty), none after it.
    let (ctd, config) = containerd("sandbox_store_max_bytes = 1");
    let id = "ceiling";
    let pid = run_stateful(&ctd, id);
    wait_registered(&ctd, id);
    assert_eq!(ask(pid, STORE, "set a 1"), "ok");
    crabctl_ok(&ctd, &["checkpoint", id]);
    assert_eq!(ask(pid, STORE, "set a 2"), "ok");
    for class in [&[][..], &["--fs"]] {
        let e = refused(&ctd, &[class, &[id]].concat());
        assert!(e.contains("sandbox_store_max_bytes"), "{e}");
    }
    // A files-only rollback (whose version would not fit) touches nothing.
    exec_sh(&ctd, id, "echo after > /kept");
    let out = crabctl(&ctd, &["rollback", id, "1", "--files-only"]);
    let e = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success() && e.contains("sandbox_store_max_bytes"),
        "{e}"
    );
    assert_eq!(exec_sh(&ctd, id, "cat /kept").trim(), "after");
    // Nothing was made, and the sandbox went on as it was.
    assert_eq!(version_numbers(&ctd, id), [1]);
    assert_eq!(ctd.task_status(id).as_deref(), Some("RUNNING"));
    assert_eq!(ctd.task_pid(id), Some(pid));
    assert_eq!(ask(pid, STORE, "get a"), "2");
    let metrics = String::from_utf8(crabctl(&ctd, &["metrics"]).stdout).unwrap();
    assert!(metrics.contains("crab_store_full_total 3"), "{metrics}");
    ctd.remove(id);
    assert_clean(&ctd.scope(), &[id]);
    let _ = std::fs::remove_file(&config);
}

#[test]
fn a_host_under_its_floor_of_free_space_takes_no_version() {
    // More free space than any disk has.
    let (ctd, config) = containerd("store_min_free_bytes = 9223372036854775807");
    let id = "floor";
    let pid = run_stateful(&ctd, id);
    wait_registered(&ctd, id);
    let e = refused(&ctd, &[id]);
    assert!(e.contains("store_min_free_bytes"), "{e}");
    assert!(version_numbers(&ctd, id).is_empty());
    assert_eq!(ask(pid, STORE, "get nothing"), ask(pid, STORE, "get nothing"));
    assert_eq!(ctd.task_pid(id), Some(pid));
    ctd.remove(id);
    assert_clean(&ctd.scope(), &[id]);
    let _ = std::fs::remove_file(&config);
}
