//! `crabctl fork`: a new sandbox, created in containerd from a version of
//! another, runs independently of it. Real CRIU, containerd, overlayfs;
//! needs root: CI runs it as root.

use crab_tests::leftovers::assert_clean;
use crab_tests::sandbox::{
    ask, crabctl_err, crabctl_ok, run_stateful, tree_digest, wait_registered, COUNTER, STORE,
};
use crab_tests::Containerd;

#[test]
fn fork_runs_independently_of_its_source() {
    let ctd = Containerd::start();
    let (id, copy) = ("orig", "copy");
    let pid = run_stateful(&ctd, id);
    wait_registered(&ctd, id);
    assert_eq!(ask(pid, STORE, "set a 1"), "ok");
    assert_eq!(ask(pid, COUNTER, "hit"), "2");
    crab_tests::sandbox::exec_sh(&ctd, id, "mkdir -p /data/d && echo one > /data/f1");
    let files_v1 = tree_digest(pid, "/data");
    crabctl_ok(&ctd, &["checkpoint", id]);
    assert_eq!(ask(pid, STORE, "set a 2"), "ok");

    let f = crabctl_ok(&ctd, &["fork", id, "1", "--name", copy]);
    assert_eq!(f["id"], copy);
    assert_eq!(f["version"], 1);
    let fpid = f["pid"].as_i64().unwrap() as i32;
    wait_registered(&ctd, copy);
    assert_eq!(ctd.task_status(copy).as_deref(), Some("RUNNING"));
    assert_eq!(ctd.task_pid(copy), Some(fpid));
    assert!(ctd
        .ctr_ok(&["container", "ls", "-q"])
        .lines()
        .any(|l| l.trim() == copy));

    // The fork has v1's state; the source kept its own.
    assert_eq!(ask(fpid, STORE, "get a"), "1");
    assert_eq!(ask(fpid, COUNTER, "hit"), "3");
    assert_eq!(tree_digest(fpid, "/data"), files_v1);
    assert_eq!(ask(pid, STORE, "get a"), "2");
    assert_eq!(ask(pid, COUNTER, "hit"), "3");

    // They diverge: memory, files, execs.
    assert_eq!(ask(fpid, STORE, "set a 10"), "ok");
    crab_tests::sandbox::exec_sh(&ctd, copy, "echo fork > /data/f9");
    assert_eq!(ask(pid, STORE, "get a"), "2");
    assert!(!tree_digest(pid, "/data").contains_key("f9"));
    assert!(tree_digest(fpid, "/data").contains_key("f9"));

    // A fork under a taken name, or of an unknown version, is refused.
    let e = crabctl_err(&ctd, &["fork", id, "1", "--name", copy]);
    assert!(e.contains("exists already"), "{e}");
    let e = crabctl_err(&ctd, &["fork", id, "9"]);
    assert!(e.contains("has no version 9"), "{e}");

    // A files-only version forks with the process image it reuses (v1's)
    // and its own files; unnamed forks get a name.
    crab_tests::sandbox::exec_sh(&ctd, id, "echo v2 > /data/f2");
    crabctl_ok(&ctd, &["checkpoint", "--fs", id]);
    let f2 = crabctl_ok(&ctd, &["fork", id, "2"]);
    let second = f2["id"].as_str().unwrap().to_owned();
    assert!(second.starts_with("orig-fork2-"), "{second}");
    let f2pid = f2["pid"].as_i64().unwrap() as i32;
    assert_eq!(ask(f2pid, STORE, "get a"), "1");
    assert!(tree_digest(f2pid, "/data").contains_key("f2"));
    ctd.remove(&second);

    // A fork checkpoints like any sandbox; a version of another sandbox (a
    // manifest line copied from the source) is refused.
    let c1 = crabctl_ok(&ctd, &["checkpoint", copy]);
    assert_eq!(c1["version"]["version"], 1);
    // Its versions are a tree of their own: the first is whole and has no
    // parent (nothing of the source's history is the fork's).
    assert!(c1["version"]["parent"].is_null(), "{c1}");
    assert_eq!(c1["version"]["class"], "full", "{c1}");
    let manifests = ctd.crabd_root().join("sandboxes");
    let theirs = std::fs::read_to_string(manifests.join(id).join("versions.log")).unwrap();
    let foreign = theirs.lines().last().unwrap().to_owned();
    let ours = manifests.join(copy).join("versions.log");
    let mut text = std::fs::read_to_string(&ours).unwrap();
    text.push_str(&foreign);
    text.push('\n');
    std::fs::write(&ours, text).unwrap();
    let e = crabctl_err(&ctd, &["rollback", copy, "2"]);
    assert!(e.contains("belongs to sandbox orig"), "{e}");
    assert_eq!(
        ask(fpid, STORE, "get a"),
        "10",
        "the refused rollback left the fork alone"
    );

    // Removing the source leaves the fork running.
    ctd.remove(id);
    assert_eq!(ask(fpid, STORE, "get a"), "10");
    assert_eq!(ctd.task_status(copy).as_deref(), Some("RUNNING"));
    ctd.remove(copy);
    assert_clean(&ctd.scope(), &[id, copy, &second]);
}

/// `crabctl fork --count 16`: sixteen sandboxes from one version, made in
/// parallel, each with the version's memory and files and its own future.
#[test]
fn sixteen_forks_of_one_version_each_have_its_state() {
    let ctd = Containerd::start();
    let id = "tree";
    let pid = run_stateful(&ctd, id);
    wait_registered(&ctd, id);
    assert_eq!(ask(pid, STORE, "set a 7"), "ok");
    crab_tests::sandbox::exec_sh(&ctd, id, "mkdir -p /data && echo root > /data/f1");
    let files = tree_digest(pid, "/data");
    // Each request counts: a fork's first one answers the next number.
    let next: u64 = ask(pid, COUNTER, "peek").parse::<u64>().unwrap() + 1;
    crabctl_ok(&ctd, &["checkpoint", id]);
    assert_eq!(ask(pid, STORE, "set a 8"), "ok");

    // Bad counts are refused before anything is made (crabd refuses
    // them too: its HTTP tests).
    for bad in ["0", "10000"] {
        let e = crabctl_err(&ctd, &["fork", id, "1", "--count", bad]);
        assert!(e.contains("--count"), "{e}");
    }

    let r = crabctl_ok(&ctd, &["fork", id, "1", "--count", "16", "--name", "branch"]);
    let forks = r["forks"].as_array().expect("forks");
    assert_eq!(forks.len(), 16);
    let mut bytes = 0;
    for (i, f) in forks.iter().enumerate() {
        let fid = format!("branch-{}", i + 1);
        assert_eq!(f["id"], fid.as_str());
        assert!(f["error"].is_null(), "{f}");
        let fpid = f["pid"].as_i64().expect("a pid") as i32;
        assert_eq!(ctd.task_pid(&fid), Some(fpid));
        assert_eq!(ask(fpid, STORE, "get a"), "7", "{fid}");
        assert_eq!(ask(fpid, COUNTER, "peek"), next.to_string(), "{fid}");
        assert_eq!(tree_digest(fpid, "/data"), files, "{fid}");
        bytes += f["bytes"].as_u64().unwrap();
    }
    eprintln!(
        "16 forks in {:.0} ms, {bytes} bytes of files written in all",
        r["total_ms"].as_f64().unwrap()
    );
    // Each goes its own way.
    let first = forks[0]["pid"].as_i64().unwrap() as i32;
    assert_eq!(ask(first, STORE, "set a 100"), "ok");
    let second = forks[1]["pid"].as_i64().unwrap() as i32;
    assert_eq!(ask(second, STORE, "get a"), "7");
    // Names taken: refused as a whole, nothing made.
    let e = crabctl_err(&ctd, &["fork", id, "1", "--count", "2", "--name", "branch"]);
    assert!(e.contains("exists already"), "{e}");

    let mut ids: Vec<String> = (1..=16).map(|i| format!("branch-{i}")).collect();
    for fid in &ids {
        ctd.remove(fid);
    }
    ctd.remove(id);
    ids.push(id.to_owned());
    let ids: Vec<&str> = ids.iter().map(String::as_str).collect();
    assert_clean(&ctd.scope(), &ids);
}
