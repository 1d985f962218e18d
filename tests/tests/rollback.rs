//! Checkpoint and rollback of a running sandbox through crabd and crabctl,
//! with real CRIU, containerd, and overlayfs or btrfs. Needs root: CI runs it
//! as root.
//!
//! The sandbox (`fixtures/stateful.py`) keeps state in a counter process's
//! memory, in a TCP server's memory, and in files under /data.

use std::path::Path;

use crab_tests::leftovers::assert_clean;
use crab_tests::sandbox::{
    ask, crabctl_err, crabctl_ok, exec_sh, run_stateful, tree_digest, version_numbers, wait_registered,
    COUNTER, STORE,
};
use crab_tests::{wait_until, Containerd};

/// Writes the v-th state of the files under /data through an exec.
fn write_files(ctd: &Containerd, id: &str, v: u32) {
    let script = match v {
        1 => "mkdir -p /data/d && echo one > /data/f1 && echo keep > /data/f3 && ln -s f1 /data/link && chmod 600 /data/f3",
        _ => "echo two > /data/f1 && echo new > /data/f2 && rm /data/f3 && rm -r /data/d && mkdir /data/e",
    };
    crab_tests::sandbox::exec_sh(ctd, id, script);
}

#[test]
fn rollback_restores_memory_servers_and_files() {
    let ctd = Containerd::start();
    round_trip(&ctd, "rb", "overlay-copy", &ctd.crabd_root().join("fs/rb"));
    assert_clean(&ctd.scope(), &["rb"]);
}

/// The same on containerd's btrfs snapshotter: the rootfs is a subvolume,
/// snapshotted by btrfs and swapped back in at a rollback.
#[test]
fn rollback_on_btrfs() {
    let ctd = Containerd::start_on_btrfs();
    let snapshotter = ctd.dir.join("root/io.containerd.snapshotter.v1.btrfs");
    let store = snapshotter.join(".crab").join(&ctd.namespace).join("bt");
    round_trip(&ctd, "bt", "btrfs", &store);
    // Nothing is left beside containerd's subvolumes, and the sandbox's
    // snapshots went with it.
    let active: Vec<String> = std::fs::read_dir(snapshotter.join("active"))
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    assert!(active.iter().all(|n| !n.starts_with('.')), "{active:?}");
    // crabd deletes them once containerd no longer has the container.
    wait_until(15, || (!store.exists()).then_some(()))
        .unwrap_or_else(|| panic!("{} is left", store.display()));
    assert_clean(&ctd.scope(), &["bt"]);
}

/// A device node the sandbox made itself (it may: CAP_MKNOD), which its
/// spec lacks, keeps `/dev` in CRIU's images, tar and all: a restore
/// could not make it again. Rollbacks give it back.
#[test]
fn a_device_the_spec_lacks_keeps_dev_in_the_images() {
    let ctd = Containerd::start();
    let id = "mknod";
    let pid = run_stateful(&ctd, id);
    wait_registered(&ctd, id);
    exec_sh(&ctd, id, "mknod /dev/crab-tun c 10 200");
    let v1 = crabctl_ok(&ctd, &["checkpoint", id])["version"]["version"]
        .as_u64()
        .expect("a version");
    let images = ctd.crabd_root().join("images").join(id).join(v1.to_string());
    let tmpfs = std::fs::read_to_string(images.join("crab-tmpfs.json")).expect("the tmpfs record");
    assert!(!tmpfs.contains("\"/dev\""), "{tmpfs}");
    assert!(tmpfs.contains("\"/dev/shm\""), "{tmpfs}");
    exec_sh(&ctd, id, "rm /dev/crab-tun");
    for round in 0..2 {
        let r = crabctl_ok(&ctd, &["rollback", id, &v1.to_string()]);
        let pid = r["pid"].as_i64().expect("pid") as i32;
        assert_ne!(pid, 0, "round {round}");
        let out = exec_sh(&ctd, id, "stat -c '%F %t:%T' /dev/crab-tun");
        assert_eq!(out.trim(), "character special file a:c8", "round {round}");
    }
    let _ = pid;
    ctd.remove(id);
    assert_clean(&ctd.scope(), &[id]);
}

/// A files-only rollback on btrfs: the snapshot's tree is synced onto the
/// running subvolume; the processes (their pid, their memory) stay.
#[test]
fn files_only_rollback_on_btrfs_keeps_the_processes() {
    let ctd = Containerd::start_on_btrfs();
    let id = "btf";
    let pid = run_stateful(&ctd, id);
    wait_registered(&ctd, id);
    write_files(&ctd, id, 1);
    let v1 = crabctl_ok(&ctd, &["checkpoint", id])["version"]["version"]
        .as_u64()
        .expect("a version");
    let at_v1 = tree_digest(pid, "/data");
    write_files(&ctd, id, 2);
    assert_eq!(ask(pid, STORE, "set k after"), "ok");
    assert_ne!(tree_digest(pid, "/data"), at_v1);

    let r = crabctl_ok(&ctd, &["rollback", id, &v1.to_string(), "--files-only"]);
    assert_eq!(r["files_from"], v1, "{r}");
    assert_eq!(tree_digest(pid, "/data"), at_v1);
    assert_eq!(ctd.task_pid(id), Some(pid), "the init was not replaced");
    assert_eq!(ask(pid, STORE, "get k"), "after", "the store's memory is kept");
    // The result is a version: a whole rollback to it gives the same files.
    let newest = r["version"].as_u64().expect("the new version");
    let back = crabctl_ok(&ctd, &["rollback", id, &newest.to_string()]);
    let pid = back["pid"].as_i64().expect("pid") as i32;
    assert_eq!(tree_digest(pid, "/data"), at_v1);
    ctd.remove(id);
    assert_clean(&ctd.scope(), &[id]);
}

/// The restored sandbox's masked directories are as libcontainer made
/// them: an empty read-only tmpfs.
fn masks_hold(ctd: &Containerd, id: &str) {
    let out = exec_sh(
        ctd,
        id,
        "grep ' /sys/firmware ' /proc/mounts; ls -A /sys/firmware | wc -l; \
         touch /sys/firmware/x 2>&1 || echo refused",
    );
    let lines: Vec<&str> = out.lines().collect();
    let mount: Vec<&str> = lines.first().map(|l| l.split(' ').collect()).unwrap_or_default();
    assert_eq!(mount.get(2), Some(&"tmpfs"), "{out}");
    assert!(
        mount.get(3).is_some_and(|o| o.split(',').any(|o| o == "ro")),
        "{out}"
    );
    assert_eq!(lines.get(1).map(|l| l.trim()), Some("0"), "{out}");
    assert!(
        out.contains("Read-only file system") && out.ends_with("refused\n"),
        "{out}"
    );
}

/// The sandbox's `/dev/shm`, `/run` and `/dev` tmpfs as it sees them:
/// their mounts, their roots' mode and owner, `/dev/shm`'s mtime (an
/// atime moves with any read), what is in each, and each name in `/dev`
/// with its kind, mode, owner and device number, and the mtimes of some
/// (devpts and mqueue are new mounts after a restore, with times of their
/// own).
fn tmpfs_state(ctd: &Containerd, id: &str) -> String {
    exec_sh(
        ctd,
        id,
        "grep -E ' /dev/shm | /run ' /proc/mounts; stat -c '%n %a %u %g' /dev/shm /run; \
         stat -c '%Y' /dev/shm; ls -A /dev/shm; cat /run/crab-marker; \
         stat -c '%n %F %a %u %g %t:%T' /dev /dev/* /dev/pts/ptmx; stat -c '%n %Y' /dev /dev/null /dev/fd",
    )
}

/// Checkpoints the stateful sandbox `id` with its files on `backend`
/// (snapshots in `store`),
/// changes everything, rolls back twice, and checks the exit status.
fn round_trip(ctd: &Containerd, id: &str, backend: &str, store: &Path) {
    let pid = run_stateful(ctd, id);
    wait_registered(ctd, id);

    // v1: counter at 3, store a=1, files of state 1.
    for _ in 0..2 {
        ask(pid, COUNTER, "hit");
    }
    assert_eq!(ask(pid, COUNTER, "hit"), "4", "the readiness probe took 1");
    assert_eq!(ask(pid, STORE, "set a 1"), "ok");
    write_files(ctd, id, 1);
    // An empty /dev/shm and a /run with a file in it.
    exec_sh(ctd, id, "echo v1 > /run/crab-marker");
    let files_v1 = tree_digest(pid, "/data");
    let tmpfs_v1 = tmpfs_state(ctd, id);
    let v1 = crabctl_ok(ctd, &["checkpoint", id]);
    assert_eq!(v1["version"]["version"], 1);
    assert_eq!(v1["version"]["class"], "full");
    assert_eq!(v1["version"]["fs_snapshot"]["backend"], backend, "{v1}");
    if backend != "overlay-copy" {
        // Its files stay on their filesystem: nothing to fork or export.
        let e = crabctl_err(ctd, &["fork", id, "1"]);
        assert!(e.contains("need an overlay rootfs"), "{e}");
        let e = crabctl_err(ctd, &["export", id, "1", "/tmp/crab-never-written.tar"]);
        assert!(e.contains("need an overlay rootfs"), "{e}");
        assert!(!std::path::Path::new("/tmp/crab-never-written.tar").exists());
    }
    assert!(v1["frozen_ms"].as_f64().unwrap() > 0.0);
    // The empty masks were kept out of the images (no tar of them).
    let images = ctd.crabd_root().join("images").join(id).join("1");
    let masked = std::fs::read_to_string(images.join("crab-masked.json")).expect("the masks' record");
    assert!(masked.contains("crab-masked/sys/firmware"), "{masked}");
    // So were the empty /dev/shm and /dev, which holds nothing but
    // devices, links and mount points; /run, which holds a file, was not.
    let tmpfs = std::fs::read_to_string(images.join("crab-tmpfs.json")).expect("the tmpfs record");
    assert!(tmpfs.contains("\"/dev/shm\""), "{tmpfs}");
    assert!(tmpfs.contains("\"/dev\""), "{tmpfs}");
    assert!(!tmpfs.contains("\"/run\""), "{tmpfs}");
    // Its network namespace is crab's, outside the image, where CRIU's
    // lock would only drop the host's packets: the dump did not lock, and
    // a restore will not either.
    assert!(images.join("crab-quiet-network").exists());

    // Everything changes after v1.
    assert_eq!(ask(pid, COUNTER, "hit"), "5");
    assert_eq!(ask(pid, STORE, "set a 2"), "ok");
    assert_eq!(ask(pid, STORE, "set b 3"), "ok");
    write_files(ctd, id, 2);
    assert_ne!(tree_digest(pid, "/data"), files_v1);
    exec_sh(ctd, id, "echo v2 > /run/crab-marker; echo v2 > /dev/shm/after");
    assert_ne!(tmpfs_state(ctd, id), tmpfs_v1);

    // A version removed takes its file snapshot with it; v1's stays.
    let v2 = crabctl_ok(ctd, &["checkpoint", "--fs", id]);
    let snapshot = |v: &serde_json::Value| store.join(v["version"]["fs_snapshot"]["name"].as_str().unwrap());
    assert!(snapshot(&v2).exists(), "{} after {v2}", snapshot(&v2).display());
    crabctl_ok(ctd, &["rm-version", id, "2"]);
    assert!(!snapshot(&v2).exists(), "{} is left", snapshot(&v2).display());
    assert!(snapshot(&v1).exists());

    // Twice, with an exec in between: a restored sandbox restores again.
    let mut pid = pid;
    for round in 0..2 {
        // Prefix selection works; the second round skips the undo checkpoint.
        let args: &[&str] = if round == 0 {
            &["rollback", &id[..1], "1"]
        } else {
            &["rollback", "--no-undo", &id[..1], "1"]
        };
        let r = crabctl_ok(ctd, args);
        assert_eq!(r["undo_ms"].as_f64().unwrap() > 0.0, round == 0);
        assert_eq!(r["version"], 1);
        pid = r["pid"].as_i64().unwrap() as i32;
        assert_eq!(ctd.task_pid(id), Some(pid), "containerd sees the restored init");
        assert_eq!(ctd.task_status(id).as_deref(), Some("RUNNING"));
        assert_eq!(
            ask(pid, COUNTER, "hit"),
            "5",
            "round {round}: the counter is v1's"
        );
        assert_eq!(ask(pid, STORE, "get a"), "1");
        assert_eq!(ask(pid, STORE, "get b"), "-");
        assert_eq!(
            tree_digest(pid, "/data"),
            files_v1,
            "round {round}: the files are v1's"
        );
        masks_hold(ctd, id);
        // /dev/shm is a fresh tmpfs as v1's was: same mount, mode, owner
        // and times, empty; /run holds v1's file again.
        assert_eq!(tmpfs_state(ctd, id), tmpfs_v1, "round {round}");
        // The sandbox works on: execs, writes, the servers.
        exec_sh(
            ctd,
            id,
            "echo shared > /dev/shm/after; grep -q shared /dev/shm/after",
        );
        write_files(ctd, id, 2);
        assert_eq!(ask(pid, STORE, "set b 4"), "ok");
    }

    // containerd still gets the task's exit status.
    let _ = crab_tests::sandbox::try_ask(pid, STORE, "exit 7");
    wait_until(10, || {
        (ctd.task_status(id).as_deref() == Some("STOPPED")).then_some(())
    })
    .expect("the task stops");
    let out = ctd.ctr(&["task", "delete", id]);
    assert!(
        crab_tests::stderr(&out).contains("non-zero exit code 7"),
        "ctr task delete reports the exit status: {}",
        crab_tests::stderr(&out)
    );
    ctd.ctr_ok(&["container", "rm", id]);
}

#[test]
fn files_only_checkpoint_and_bad_input() {
    let ctd = Containerd::start();
    let id = "fsonly";
    let pid = run_stateful(&ctd, id);
    wait_registered(&ctd, id);
    write_files(&ctd, id, 1);

    // A sandbox's first version is whole, even when files only are asked
    // for: there is no version for it to take processes from.
    let v1 = crabctl_ok(&ctd, &["checkpoint", "--fs", id]);
    assert_eq!(v1["version"]["class"], "full");
    assert_eq!(v1["version"]["process_image"], 1);
    assert!(v1["version"]["parent"].is_null());

    // Unknown sandbox, unknown version, malformed version.
    let e = crabctl_err(&ctd, &["rollback", "nosuch", "1"]);
    assert!(e.contains("no sandbox matches"), "{e}");
    let e = crabctl_err(&ctd, &["rollback", id, "9"]);
    assert!(e.contains("has no version 9"), "{e}");
    let e = crabctl_err(&ctd, &["rollback", id, "../1"]);
    assert!(e.contains("invalid version"), "{e}");
    let e = crabctl_err(&ctd, &["versions", "../x"]);
    assert!(e.contains("no sandbox matches"), "{e}");

    // A full version, then a corrupted process image: rollback refuses it,
    // and `latest` falls back to the newest valid version.
    let v2 = crabctl_ok(&ctd, &["checkpoint", id]);
    assert_eq!(v2["version"]["version"], 2);
    let v3 = crabctl_ok(&ctd, &["checkpoint", id]);
    assert_eq!(v3["version"]["version"], 3);
    let images = ctd.crabd_root().join("images").join(id).join("3");
    let victim = std::fs::read_dir(&images)
        .unwrap()
        .flatten()
        .map(|e| e.path())
        .find(|p| p.file_name().unwrap().to_string_lossy().starts_with("pages-"))
        .expect("a pages image");
    let mut bytes = std::fs::read(&victim).unwrap();
    bytes[0] ^= 0xff;
    std::fs::write(&victim, bytes).unwrap();
    let e = crabctl_err(&ctd, &["rollback", id, "3"]);
    assert!(e.contains("corrupt") || e.contains("differs"), "{e}");
    assert_eq!(
        ctd.task_pid(id),
        Some(pid),
        "a refused rollback leaves the sandbox alone"
    );
    assert_eq!(ask(pid, STORE, "get a"), "-");
    let r = crabctl_ok(&ctd, &["rollback", id, "latest"]);
    assert_eq!(r["version"], 2);

    // rm-version drops the version; it is gone from the list.
    let removed = crabctl_ok(&ctd, &["rm-version", id, "3"]);
    assert_eq!(removed["removed"], serde_json::json!([3]));
    assert_eq!(version_numbers(&ctd, id), [1, 2]);

    ctd.remove(id);
    assert_clean(&ctd.scope(), &[id]);
}

#[test]
fn crabd_killed_mid_checkpoint_and_corrupt_manifest() {
    let mut ctd = Containerd::start();
    let id = "fault";
    let pid = run_stateful(&ctd, id);
    wait_registered(&ctd, id);
    assert_eq!(ask(pid, STORE, "set a 1"), "ok");
    crabctl_ok(&ctd, &["checkpoint", id]);

    // SIGKILL crabd while a checkpoint is pending (its images directory
    // exists, nothing is published yet).
    let crabd = ctd.crabd_pid().expect("crabd runs (the shim started it)");
    let mut child = std::process::Command::new(crab_tests::bin_dir().join("crabctl"))
        .arg("--socket")
        .arg(ctd.crabd_socket())
        .args(["checkpoint", id])
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn()
        .unwrap();
    let images = ctd.crabd_root().join("images").join(id);
    let pending = || {
        std::fs::read_dir(&images)
            .ok()?
            .flatten()
            .any(|e| e.file_name().to_string_lossy().starts_with(".tmp-"))
            .then_some(())
    };
    wait_until(20, pending).expect("the checkpoint reaches the shim");
    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(crabd),
        nix::sys::signal::Signal::SIGKILL,
    )
    .unwrap();
    assert!(
        !child.wait().unwrap().success(),
        "the interrupted checkpoint fails"
    );

    // The sandbox runs on, thawed, with its state.
    wait_until(20, || {
        crab_tests::sandbox::try_ask(pid, STORE, "get a")
            .ok()
            .filter(|a| a == "1")
    })
    .expect("the sandbox answers");
    assert_eq!(ctd.task_status(id).as_deref(), Some("RUNNING"));

    // crabd comes back: no torn version, and the next checkpoint works.
    ctd.start_crabd();
    let list = crabctl_ok(&ctd, &["versions", id]);
    let versions = list.as_array().unwrap();
    assert_eq!(versions.len(), 1, "{list}");
    assert!(versions[0]["defect"].is_null());
    assert!(pending().is_none(), "the torn images are gone");
    // So is the file copy the interrupted checkpoint made (if the shim got
    // that far): one copy per version.
    let copies = ctd.crabd_root().join("fs").join(id);
    let metas = || {
        std::fs::read_dir(&copies)
            .map(|d| {
                d.flatten()
                    .filter(|e| e.file_name().to_string_lossy().ends_with(".meta"))
                    .count()
            })
            .unwrap_or(0)
    };
    wait_until(15, || (metas() == 1).then_some(()))
        .unwrap_or_else(|| panic!("{} copies for one version", metas()));
    let next = crabctl_ok(&ctd, &["checkpoint", id]);
    let n = next["version"]["version"].as_i64().unwrap();
    assert!(n > 1);
    assert_eq!(ask(pid, STORE, "set a 2"), "ok");

    // A corrupted manifest line: that version is refused, `latest` falls
    // back to the newest valid one.
    let manifest = ctd.crabd_root().join("sandboxes").join(id).join("versions.log");
    let text = std::fs::read_to_string(&manifest).unwrap();
    let last = text.lines().last().unwrap().to_owned();
    std::fs::write(
        &manifest,
        text.replace(&last, &last.replace("\"full\"", "\"fs\"")),
    )
    .unwrap();
    let e = crabctl_err(&ctd, &["rollback", id, &n.to_string()]);
    assert!(e.contains("corrupt"), "{e}");
    let r = crabctl_ok(&ctd, &["rollback", id, "latest"]);
    assert_eq!(r["version"], 1);
    let pid = r["pid"].as_i64().unwrap() as i32;
    assert_eq!(ask(pid, STORE, "get a"), "1");

    ctd.remove(id);
    assert_clean(&ctd.scope(), &[id]);
}

#[test]
fn failed_restore_puts_the_sandbox_back() {
    let ctd = Containerd::start();
    let id = "undo";
    let pid = run_stateful(&ctd, id);
    wait_registered(&ctd, id);
    crabctl_ok(&ctd, &["checkpoint", id]);
    assert_eq!(ask(pid, STORE, "set a 5"), "ok");
    let count: u64 = ask(pid, COUNTER, "hit").parse().unwrap();

    // A process image that passes the shim's checks but that CRIU cannot
    // restore (crabd would refuse it for its checksums, so the shim's
    // control socket is called directly, as crabd calls it).
    let broken = ctd.dir.join("broken-images");
    let v1 = ctd.crabd_root().join("images").join(id).join("1");
    std::fs::create_dir_all(&broken).unwrap();
    for e in std::fs::read_dir(&v1).unwrap().flatten() {
        if e.file_name() != "pstree.img" {
            std::fs::copy(e.path(), broken.join(e.file_name())).unwrap();
        }
    }
    let ps = crabctl_ok(&ctd, &["ps"]);
    let control = ps[0]["control"].as_str().unwrap().to_owned();
    let out = std::process::Command::new("curl")
        .args([
            "-s",
            "-w",
            "\n%{http_code}",
            "--unix-socket",
            &control,
            "-X",
            "POST",
            "-d",
        ])
        .arg(format!("{{\"images_dir\":\"{}\",\"fs\":null}}", broken.display()))
        .arg("http://shim/restore")
        .output()
        .unwrap();
    let answer = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(answer.ends_with("422"), "{answer}");
    assert!(answer.contains("put back as it was"), "{answer}");

    // The sandbox runs on with the state it had, and containerd follows it.
    let now = ctd.task_pid(id).unwrap();
    assert_ne!(now, pid, "the undo checkpoint was restored");
    assert_eq!(ctd.task_status(id).as_deref(), Some("RUNNING"));
    assert_eq!(ask(now, STORE, "get a"), "5");
    assert_eq!(ask(now, COUNTER, "hit"), (count + 1).to_string());

    ctd.remove(id);
    assert_clean(&ctd.scope(), &[id]);
}

#[test]
fn retention_keeps_the_newest_versions() {
    let config = std::env::temp_dir().join(crab_tests::unique("crab-keep"));
    std::fs::write(&config, "[crabd]\nkeep_versions = 2\n").unwrap();
    let ctd = Containerd::start_full("", &[("CRAB_CONFIG", &config.to_string_lossy())]);
    let id = "keep";
    let pid = run_stateful(&ctd, id);
    wait_registered(&ctd, id);
    for v in 1..=4 {
        assert_eq!(ask(pid, STORE, &format!("set a {v}")), "ok");
        crabctl_ok(&ctd, &["checkpoint", id]);
    }
    assert_eq!(version_numbers(&ctd, id), [3, 4]);
    // Only the kept versions' file snapshots stay.
    let snapshots = std::fs::read_dir(ctd.crabd_root().join("fs").join(id))
        .unwrap()
        .flatten()
        .filter(|e| e.file_name().to_string_lossy().ends_with(".meta"))
        .count();
    assert_eq!(snapshots, 2);
    let e = crabctl_err(&ctd, &["rollback", id, "1"]);
    assert!(e.contains("has no version 1"), "{e}");
    let r = crabctl_ok(&ctd, &["rollback", id, "3"]);
    assert_eq!(ask(r["pid"].as_i64().unwrap() as i32, STORE, "get a"), "3");
    ctd.remove(id);
    assert_clean(&ctd.scope(), &[id]);
    let _ = std::fs::remove_file(&config);
}

/// A sandbox with a terminal (`ctr run -t`, `docker run -t`) rolls back
/// with a terminal: CRIU makes a new pty pair and the shim gets its master.
#[test]
fn terminal_sandbox_rolls_back() {
    let ctd = Containerd::start();
    let id = "tty";
    // ctr wants a terminal of its own for -t: script(1) gives it one.
    let ctr = format!(
        "ctr -a {} -n {} run -d -t --runtime {} {} {id} sh -c \
         'i=0; while true; do i=$((i+1)); echo $i > /n; sleep 0.05; done'",
        ctd.address().display(),
        ctd.namespace,
        crab_tests::CRAB,
        crab_tests::image::BUSYBOX,
    );
    crab_tests::ok(
        std::process::Command::new("script")
            .args(["-qec", &ctr, "/dev/null"])
            .env("PATH", crab_tests::path_with_crab())
            .stdin(std::process::Stdio::null())
            .output()
            .unwrap(),
    );
    wait_registered(&ctd, id);
    let count = || -> u64 {
        wait_until(5, || {
            crab_tests::sandbox::exec_sh(&ctd, id, "cat /n")
                .trim()
                .parse()
                .ok()
        })
        .expect("a count in /n")
    };
    let before = count();
    crabctl_ok(&ctd, &["checkpoint", id]);
    let at_v1 = count();
    std::thread::sleep(std::time::Duration::from_secs(1));
    assert!(count() > at_v1 + 5, "the loop runs");
    let began = std::time::Instant::now();
    let r = crabctl_ok(&ctd, &["rollback", id, "1"]);
    let pid = r["pid"].as_i64().unwrap();
    let back = count();
    assert!(
        crab_tests::counts_on_from(back, before, at_v1, began),
        "{back} after v1's {before}..{at_v1}"
    );
    // Its stdio is a terminal again: the spec's process's, which crab-init
    // (the init) runs as its first child.
    let children = std::fs::read_to_string(format!("/proc/{pid}/task/{pid}/children")).unwrap();
    let main = children.split_whitespace().next().expect("the init's child");
    let tty = std::fs::read_link(format!("/proc/{main}/fd/1")).unwrap();
    assert!(tty.starts_with("/dev/pts/"), "{}", tty.display());
    std::thread::sleep(std::time::Duration::from_secs(1));
    assert!(count() > back + 5, "the loop goes on");
    ctd.remove(id);
    assert_clean(&ctd.scope(), &[id]);
}

/// A connection between two processes inside: a listener on 5000 and a
/// client that writes to it ten times a second.
const CONNECTED: &str = "idle() { while true; do sleep 1; done; }; \
     idle | nc -l -p 5000 >/dev/null & \
     until netstat -ltn | grep -q ':5000 '; do sleep 0.05; done; \
     while true; do echo x; sleep 0.1; done | nc 127.0.0.1 5000";

/// The established TCP connections on `port` in `pid`'s namespace
/// (both ends count; busybox's listener is dual-stack).
fn established(pid: i32, port: u16) -> usize {
    let port = format!(":{port:04X}");
    let table = ["tcp", "tcp6"]
        .map(|t| std::fs::read_to_string(format!("/proc/{pid}/net/{t}")).unwrap_or_default())
        .concat();
    table
        .lines()
        .skip(1)
        .filter(|l| {
            let f: Vec<&str> = l.split_whitespace().collect();
            f.len() > 3 && f[3] == "01" && (f[1].ends_with(&port) || f[2].ends_with(&port))
        })
        .count()
}

/// The inode of `pid`'s network namespace.
fn netns(pid: i32) -> u64 {
    use std::os::unix::fs::MetadataExt;
    std::fs::metadata(format!("/proc/{pid}/ns/net")).unwrap().ino()
}

/// Whether version `v`'s process images kept the network namespace out
/// (crab's pin) or carry CRIU's image of it.
fn netns_in_images(ctd: &Containerd, id: &str, v: u64) -> (bool, bool) {
    let dir = ctd.crabd_root().join("images").join(id).join(v.to_string());
    let names: Vec<String> = std::fs::read_dir(&dir)
        .unwrap_or_else(|e| panic!("{}: {e}", dir.display()))
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    let own = names.iter().any(|n| n == "netns.own");
    // CRIU's `ip addr save` of a namespace it dumps.
    let dumped = names
        .iter()
        .any(|n| n.starts_with("ifaddr-") && n.ends_with(".img"));
    (own, dumped)
}

/// A sandbox that cannot configure its network namespace keeps it out of
/// its checkpoints (crab pins it): a rollback, twice in a row, gets a fresh
/// namespace, pinned in place of the old, with the connection inside
/// restored each time; a fork gets a namespace of its own. A sandbox with
/// `CAP_NET_ADMIN` has its namespace in its images.
#[test]
fn pinned_network_namespace_rolls_back_and_forks() {
    let ctd = Containerd::start();
    let id = "pn";
    let run = |id: &str, extra: &[&str]| {
        let mut args = vec!["run", "-d", "--runtime", crab_tests::CRAB];
        args.extend_from_slice(extra);
        args.extend_from_slice(&[crab_tests::image::BUSYBOX, id, "sh", "-c", CONNECTED]);
        ctd.ctr_ok(&args);
        let pid = ctd.task_pid(id).expect("the task runs");
        wait_until(20, || (established(pid, 5000) == 2).then_some(()))
            .unwrap_or_else(|| panic!("{id}: no connection inside"));
        wait_registered(&ctd, id);
        pid
    };
    let pid = run(id, &[]);
    let mut ns = netns(pid);
    let pin = Path::new(crab_tests::leftovers::STATE_DIR)
        .join(&ctd.namespace)
        .join(".netns")
        .join(id);
    let pinned = || {
        use std::os::unix::fs::MetadataExt;
        std::fs::metadata(&pin).unwrap().ino()
    };
    assert_eq!(pinned(), ns, "pinned at {}", pin.display());
    crabctl_ok(&ctd, &["checkpoint", id]);
    assert_eq!(netns_in_images(&ctd, id, 1), (true, false), "the pin stays out");

    for args in [&["rollback", id, "1"][..], &["rollback", "--no-undo", id, "1"]] {
        let r = crabctl_ok(&ctd, args);
        let pid = r["pid"].as_i64().unwrap() as i32;
        assert_ne!(netns(pid), ns, "{args:?}: a fresh namespace");
        ns = netns(pid);
        assert_eq!(pinned(), ns, "{args:?}: pinned in place of the old one");
        // The new pin is crab's too: the next version keeps it out.
        let v = crabctl_ok(&ctd, &["checkpoint", id]);
        let v = v["version"]["version"].as_u64().unwrap();
        assert_eq!(
            netns_in_images(&ctd, id, v),
            (true, false),
            "{args:?}: version {v}"
        );
        assert_eq!(
            established(pid, 5000),
            2,
            "{args:?}: the connection inside is restored"
        );
    }

    let f = crabctl_ok(&ctd, &["fork", id, "1", "--name", "pn-fork"]);
    let fpid = f["pid"].as_i64().unwrap() as i32;
    assert_ne!(netns(fpid), ns, "a fork has a namespace of its own");
    assert_eq!(established(fpid, 5000), 2);
    wait_registered(&ctd, "pn-fork");
    crabctl_ok(&ctd, &["checkpoint", "pn-fork"]);
    assert_eq!(
        netns_in_images(&ctd, "pn-fork", 1),
        (true, false),
        "the fork's is pinned too"
    );

    let admin = "pn-admin";
    run(admin, &["--cap-add", "CAP_NET_ADMIN"]);
    crabctl_ok(&ctd, &["checkpoint", admin]);
    assert_eq!(
        netns_in_images(&ctd, admin, 1),
        (false, true),
        "CRIU saves what it may change"
    );

    for id in [id, "pn-fork", admin] {
        ctd.remove(id);
    }
    assert_clean(&ctd.scope(), &[id, "pn-fork", admin]);
}
