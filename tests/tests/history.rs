//! A sandbox's history over its container's life, through crabd, crabctl,
//! real containerd and CRIU (needs root: CI runs it as root):
//!
//! - a stopped task keeps its versions: they are listed, a rollback or a
//!   checkpoint is refused clearly, and a restarted task goes on from them;
//! - removing the container deletes its versions, process images and file
//!   copies;
//! - a new container with a removed one's id starts with no history, also
//!   before crabd's periodic look at stopped sandboxes.

use std::path::Path;

use crab_tests::leftovers::assert_clean;
use crab_tests::sandbox::{
    crabctl_err, crabctl_ok, exec_sh, listed, version_numbers, wait_forgotten, wait_registered,
};
use crab_tests::{wait_until, Containerd, CRAB};

const LOOP: &[&str] = &["sh", "-c", "while true; do sleep 0.05; done"];

fn read(ctd: &Containerd, id: &str, file: &str) -> String {
    exec_sh(ctd, id, &format!("cat {file}")).trim().to_owned()
}

#[test]
fn history_follows_the_container() {
    let ctd = Containerd::start();
    let id = "hist";
    ctd.run_detached(CRAB, id, LOOP);
    wait_registered(&ctd, id);
    exec_sh(&ctd, id, "echo one > /kept");
    let v1 = crabctl_ok(&ctd, &["checkpoint", id]);
    assert_eq!(v1["version"]["version"], 1);

    // The task stops: the versions stay, nothing runs to restore into.
    let _ = ctd.ctr(&["task", "kill", "-s", "SIGKILL", id]);
    wait_until(10, || {
        (ctd.task_status(id).as_deref() == Some("STOPPED")).then_some(())
    })
    .expect("the task stops");
    ctd.ctr_ok(&["task", "delete", id]);
    let entry = wait_until(10, || listed(&ctd, id).filter(|e| e["running"] == false))
        .expect("crabctl ps lists the stopped sandbox");
    assert_eq!(entry["versions"], 1, "{entry}");
    assert_eq!(version_numbers(&ctd, id), [1]);
    let e = crabctl_err(&ctd, &["rollback", id, "1"]);
    assert!(e.contains("is not running"), "{e}");
    let e = crabctl_err(&ctd, &["checkpoint", id]);
    assert!(e.contains("is not running"), "{e}");

    // Started again, it goes on from its history.
    ctd.ctr_ok(&["task", "start", "-d", id]);
    wait_until(20, || listed(&ctd, id).filter(|e| e["running"] == true))
        .expect("the restarted task registers");
    exec_sh(&ctd, id, "echo two > /kept");
    let v2 = crabctl_ok(&ctd, &["checkpoint", id]);
    assert_eq!(v2["version"]["version"], 2);
    crabctl_ok(&ctd, &["rollback", id, "1"]);
    assert_eq!(read(&ctd, id, "/kept"), "one");

    // The container goes: so does everything crabd kept of it.
    let root = ctd.crabd_root();
    for dir in ["images", "sandboxes", "fs"] {
        assert!(root.join(dir).join(id).exists(), "{dir} before removal");
    }
    ctd.remove(id);
    wait_forgotten(&ctd, id);
    for dir in ["images", "sandboxes", "fs"] {
        assert!(!root.join(dir).join(id).exists(), "{dir} is left");
    }

    // A new container with the same id starts from nothing.
    ctd.run_detached(CRAB, id, LOOP);
    wait_registered(&ctd, id);
    assert!(version_numbers(&ctd, id).is_empty());
    assert_eq!(crabctl_ok(&ctd, &["checkpoint", id])["version"]["version"], 1);
    ctd.remove(id);
    assert_clean(&ctd.scope(), &[id]);
}

/// crabd has not looked at stopped sandboxes yet (its interval is an hour)
/// when the id comes back: the registration itself tells the containers
/// apart by when containerd made them.
#[test]
fn a_reused_id_does_not_inherit_history() {
    let dir = std::env::temp_dir().join(crab_tests::unique("crabgc"));
    std::fs::create_dir_all(&dir).unwrap();
    let toml = dir.join("crab.toml");
    std::fs::write(&toml, "[crabd]\ngc_interval_secs = 3600\n").unwrap();
    let ctd = Containerd::start_full("", &[("CRAB_CONFIG", toml.to_str().unwrap())]);
    let id = "again";
    ctd.run_detached(CRAB, id, LOOP);
    wait_registered(&ctd, id);
    crabctl_ok(&ctd, &["checkpoint", id]);
    let old_images = ctd.crabd_root().join("images").join(id).join("1");
    assert!(old_images.exists());
    ctd.remove(id);
    assert!(
        listed(&ctd, id).is_some_and(|e| e["running"] == false),
        "the stopped sandbox is still listed"
    );
    ctd.run_detached(CRAB, id, LOOP);
    wait_until(20, || listed(&ctd, id).filter(|e| e["running"] == true))
        .expect("the new container registers");
    assert!(version_numbers(&ctd, id).is_empty());
    assert!(!Path::new(&old_images).exists(), "the old process image is left");
    ctd.remove(id);
    assert_clean(&ctd.scope(), &[id]);
    let _ = std::fs::remove_dir_all(&dir);
}

/// A shim that dies without unregistering (SIGKILL) leaves its sandbox
/// marked stopped, not running forever; removing the container then drops
/// the history as usual.
#[test]
fn a_dead_shim_leaves_its_sandbox_stopped() {
    let ctd = Containerd::start();
    let id = "orphan";
    ctd.run_detached(CRAB, id, LOOP);
    wait_registered(&ctd, id);
    crabctl_ok(&ctd, &["checkpoint", "--fs", id]);
    let address = ctd.address().to_string_lossy().into_owned();
    for pid in crab_tests::leftovers::shim_pids(&address) {
        let _ = nix::sys::signal::kill(nix::unistd::Pid::from_raw(pid), nix::sys::signal::SIGKILL);
    }
    let entry = wait_until(15, || listed(&ctd, id).filter(|e| e["running"] == false))
        .expect("the sandbox of a dead shim is marked stopped");
    assert_eq!(entry["versions"], 1, "{entry}");
    let e = crabctl_err(&ctd, &["checkpoint", id]);
    assert!(e.contains("is not running"), "{e}");
    ctd.remove(id);
    wait_forgotten(&ctd, id);
}
