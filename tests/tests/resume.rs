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

/// Where a rollback journal of sandbox `id`'s writable layer goes: beside
/// the upper directory of its containerd snapshot, named after it.
fn crab_snapshotter_journal(ctd: &Containerd, id: &str) -> std::path::PathBuf {
    let mounts = ctd.ctr_ok(&["snapshots", "mounts", "/mnt", id]);
    let upper = mounts
        .split(|c: char| c == ',' || c.is_whitespace())
        .find_map(|o| o.strip_prefix("upperdir="))
        .unwrap_or_else(|| panic!("an overlay upper in {mounts}"));
    let upper = std::path::Path::new(upper);
    let name = upper.file_name().unwrap().to_string_lossy();
    upper.with_file_name(format!(".{name}.crab-rollback"))
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
    // As if the shim had died halfway through a rollback to a snapshot
    // since removed: the resume replaces the layer whole, so that journal
    // goes aside with the layer as it was (else the next mount would try
    // to finish it, and refuse).
    let journal = crab_snapshotter_journal(&ctd, id);
    std::fs::write(&journal, r#"{"store":"/nonexistent","name":"c1"}"#).unwrap();
    let r = crabctl_ok(&ctd, &["resume", id]);
    assert_eq!(r["version"], 1, "{r}");
    assert!(!journal.exists(), "the journal went with the layer set aside");
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

    // The whole host: crabd dies with the sandbox (first, so that its gc
    // never sees the shim gone and marks the sandbox stopped, as a crabd
    // that outlived it would), and resumes the sandbox at its first start
    // after the boot (a boot id other than the one it kept).
    if let Some(crabd) = ctd.crabd_pid() {
        let _ = kill(Pid::from_raw(crabd), SIGKILL);
    }
    ctd.reap_crabd();
    crash(&ctd, id);
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

/// Flips a byte in the middle of the largest file of version `v`'s process
/// image (same size: only crabd's re-hashing sees it).
fn corrupt_image(ctd: &Containerd, id: &str, v: u64) {
    let dir = ctd.crabd_root().join("images").join(id).join(v.to_string());
    let largest = walkdir(&dir)
        .into_iter()
        .max_by_key(|p| std::fs::metadata(p).map_or(0, |m| m.len()))
        .unwrap_or_else(|| panic!("no image files in {}", dir.display()));
    let mut bytes = std::fs::read(&largest).unwrap();
    let at = bytes.len() / 2;
    bytes[at] ^= 0xff;
    std::fs::write(&largest, bytes).unwrap();
}

/// The regular files under `dir`.
fn walkdir(dir: &std::path::Path) -> Vec<std::path::PathBuf> {
    let mut files = Vec::new();
    for e in std::fs::read_dir(dir).unwrap().flatten() {
        let ft = e.file_type().unwrap();
        if ft.is_dir() {
            files.extend(walkdir(&e.path()));
        } else if ft.is_file() {
            files.push(e.path());
        }
    }
    files
}

#[test]
fn a_corrupt_head_falls_back_to_its_parent_and_says_so() {
    let ctd = Containerd::start();
    let id = "rotten";
    let pid = run_stateful(&ctd, id);
    wait_registered(&ctd, id);
    assert_eq!(ask(pid, STORE, "set a 1"), "ok");
    crabctl_ok(&ctd, &["checkpoint", id]);
    assert_eq!(ask(pid, STORE, "set a 2"), "ok");
    let v2 = crabctl_ok(&ctd, &["checkpoint", id]);
    assert_eq!(v2["version"]["parent"], 1, "{v2}");
    corrupt_image(&ctd, id, 2);

    // A resume without a version takes the head's parent, and says why.
    crash(&ctd, id);
    let r = crabctl_ok(&ctd, &["resume", id]);
    assert_eq!(r["version"], 1, "{r}");
    let why = r["passed_over"].to_string();
    assert!(why.contains("version 2") && why.contains("corrupt"), "{r}");
    let pid = r["pid"].as_i64().unwrap() as i32;
    wait_registered(&ctd, id);
    assert_eq!(ask(pid, STORE, "get a"), "1", "version 1's memory");
    // Asked for by number, the corrupt version is refused, not replaced.
    crash(&ctd, id);
    let e = crabctl_err(&ctd, &["resume", id, "2"]);
    assert!(e.contains("corrupt"), "{e}");

    // An automatic recovery does the same: its head (v3) is corrupt, so
    // it comes back from v3's parent (v1, the version it resumed).
    let pid = crabctl_ok(&ctd, &["resume", id])["pid"].as_i64().unwrap() as i32;
    wait_registered(&ctd, id);
    assert_eq!(ask(pid, STORE, "set a 3"), "ok");
    let v3 = crabctl_ok(&ctd, &["checkpoint", id]);
    assert_eq!(v3["version"]["parent"], 1, "{v3}");
    let v3 = v3["version"]["version"].as_u64().unwrap();
    corrupt_image(&ctd, id, v3);
    kill(Pid::from_raw(pid), SIGKILL).unwrap();
    let pid = wait_until(30, || ctd.task_pid(id).filter(|&p| p != pid))
        .unwrap_or_else(|| panic!("not recovered: {:?}", ctd.task_status(id)));
    assert_eq!(ask(pid, STORE, "get a"), "1", "version 1's memory");
    let info = wait_until(10, || {
        crab_tests::sandbox::listed(&ctd, id).filter(|e| e["recoveries"] == 1)
    })
    .expect("crabd counts the recovery");
    let last = &info["last_recovery"];
    assert_eq!(last["version"], 1, "{info}");
    assert!(
        last["passed_over"].to_string().contains(&format!("version {v3}")),
        "{info}"
    );

    ctd.remove(id);
    assert_clean(&ctd.scope(), &[id]);
}

#[test]
fn a_restore_crabd_did_not_grant_is_refused() {
    let ctd = Containerd::start();
    let id = "victim";
    let pid = run_stateful(&ctd, id);
    wait_registered(&ctd, id);
    assert_eq!(ask(pid, STORE, "set secret 42"), "ok");
    crabctl_ok(&ctd, &["checkpoint", id]);
    let images = ctd.crabd_root().join("images").join(id).join("1");
    assert!(images.is_dir(), "{}", images.display());

    // Whoever can set a container's annotations (a docker user, a pod
    // spec) asks crab's root shim to restore the victim's process image
    // into a container of their own: without crabd's grant, or with a
    // token crabd never gave, it is refused and nothing runs.
    let restore = format!("io.crab.restore.images={}", images.display());
    for (thief, token) in [
        ("thief1", None),
        ("thief2", Some("0123456789abcdef0123456789abcdef")),
        ("thief3", Some("../../../../etc/passwd")),
    ] {
        let token = token.map(|t| format!("io.crab.restore.token={t}"));
        let mut args = vec!["run", "-d", "--annotation", &restore];
        if let Some(t) = &token {
            args.extend(["--annotation", t]);
        }
        args.extend([
            "--runtime",
            crab_tests::CRAB,
            crab_tests::image::BUSYBOX,
            thief,
            "sleep",
            "300",
        ]);
        let out = ctd.ctr(&args);
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success(), "{thief} ran");
        assert!(err.contains("restore refused"), "{thief}: {err}");
        assert_ne!(ctd.task_status(thief).as_deref(), Some("RUNNING"));
        let _ = ctd.ctr(&["container", "rm", thief]);
    }
    // The victim runs on, its own.
    assert_eq!(ask(pid, STORE, "get secret"), "42");
    ctd.remove(id);
    assert_clean(&ctd.scope(), &[id]);
}
