//! Bad input gets a clear error in ctr's output and leaves nothing behind.
//! Needs root: CI runs it as root.

use crab_tests::image::BUSYBOX;
use crab_tests::leftovers::assert_clean;
use crab_tests::{stderr, Containerd, CRAB};

#[test]
fn missing_entrypoint() {
    let ctd = Containerd::start();
    let out = ctd.ctr(&["run", "--rm", "--runtime", CRAB, BUSYBOX, "nx", "/nonexistent"]);
    assert!(!out.status.success());
    let err = stderr(&out);
    assert!(err.contains("'/nonexistent' not found"), "{err}");
    let _ = ctd.ctr(&["container", "rm", "nx"]);
    assert_clean(&ctd.scope(), &["nx"]);
}

#[test]
fn invalid_bundle() {
    let ctd = Containerd::start();
    let spec = ctd.dir.join("bad-spec.json");
    std::fs::write(
        &spec,
        r#"{"ociVersion":"1.0.2","process":{"args":["sh"],"cwd":"/","user":{"uid":0,"gid":0}},
            "root":{"path":"/nonexistent-root"},"linux":{"namespaces":[{"type":"pid"},{"type":"mount"}]}}"#,
    )
    .expect("write spec");
    let out = ctd.ctr(&[
        "run",
        "--runtime",
        CRAB,
        "--config",
        &spec.to_string_lossy(),
        "bb",
    ]);
    assert!(!out.status.success());
    let err = stderr(&out);
    assert!(
        err.contains("root /nonexistent-root is not a directory: invalid argument"),
        "{err}"
    );
    let _ = ctd.ctr(&["container", "rm", "bb"]);
    assert_clean(&ctd.scope(), &["bb"]);
}

#[test]
fn id_with_path_tricks() {
    let ctd = Containerd::start();
    for id in ["../evil", "a/../../b", ".."] {
        let out = ctd.ctr(&["run", "--rm", "--runtime", CRAB, BUSYBOX, id, "true"]);
        assert!(!out.status.success(), "{id}");
        assert!(
            stderr(&out).contains("invalid argument"),
            "{id}: {}",
            stderr(&out)
        );
    }
    assert!(!std::path::Path::new("/run/crab/evil").exists());
    assert_clean(&ctd.scope(), &[]);
}

#[test]
fn signal_to_dead_task() {
    let ctd = Containerd::start();
    ctd.run_detached(CRAB, "dead", &["true"]);
    crab_tests::wait_until(10, || {
        (ctd.task_status("dead").as_deref() == Some("STOPPED")).then_some(())
    })
    .expect("exits");
    let out = ctd.ctr(&["task", "kill", "dead"]);
    assert!(!out.status.success());
    assert!(
        stderr(&out).contains("already finished: not found"),
        "{}",
        stderr(&out)
    );
    // Nothing changed: the task can still be deleted normally.
    ctd.ctr_ok(&["task", "delete", "dead"]);
    ctd.ctr_ok(&["container", "rm", "dead"]);
    assert_clean(&ctd.scope(), &["dead"]);
}

#[test]
fn exec_id_reused() {
    let ctd = Containerd::start();
    ctd.run_detached(CRAB, "ex", &["sleep", "300"]);
    ctd.ctr_ok(&["task", "exec", "-d", "--exec-id", "same", "ex", "sleep", "300"]);
    let out = ctd.ctr(&["task", "exec", "--exec-id", "same", "ex", "true"]);
    assert!(!out.status.success());
    assert!(
        stderr(&out).contains("exec same already exists: already exists"),
        "{}",
        stderr(&out)
    );
    // The first exec is untouched: crab-init, the init's sleep and the
    // exec's, under the header.
    assert_eq!(ctd.ctr_ok(&["task", "ps", "ex"]).lines().count(), 4);
    ctd.remove("ex");
    assert_clean(&ctd.scope(), &["ex"]);
}
