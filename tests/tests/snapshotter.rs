//! containerd-crab-snapshotter (`crabzfs`) under a real containerd on a
//! zfs-fuse pool. Needs root: CI runs it as root.

use std::os::unix::fs::PermissionsExt;
use std::path::Path;
use std::process::Command;

use crab_tests::leftovers::assert_clean;
use crab_tests::snapshotter::Snapshotter;
use crab_tests::zfs::{Pool, ZfsFuse};
use crab_tests::{ok, stderr, wait_until, Containerd, CRAB};

const LAYERED: &str = "docker.io/crab/layered:test";

/// A zfs-fuse pool with the snapshotter and a containerd that uses it.
struct Setup {
    ctd: Containerd,
    snap: Snapshotter,
    pool: Pool,
    /// This test's turn at zfs-fuse. Dropped last.
    _zfs: ZfsFuse,
}

impl Setup {
    fn start() -> Self {
        Self::start_sized("512M")
    }

    fn start_sized(size: &str) -> Self {
        let zfs = ZfsFuse::start();
        let pool = Pool::create(size);
        let snap = Snapshotter::start(&pool);
        let ctd = Containerd::start_with(&snap.containerd_config());
        Setup {
            ctd,
            snap,
            pool,
            _zfs: zfs,
        }
    }

    /// Imports the image archive `tar` onto crabzfs.
    fn import(&self, tar: &Path) {
        self.ctd.ctr_ok(&[
            "image",
            "import",
            "--snapshotter",
            "crabzfs",
            &tar.to_string_lossy(),
        ]);
    }

    /// `ctr run -d` of `image` as `id` on crabzfs with the crab runtime,
    /// running `sh -c script`.
    fn run(&self, image: &str, id: &str, script: &str) {
        self.ctd.ctr_ok(&[
            "run",
            "-d",
            "--snapshotter",
            "crabzfs",
            "--runtime",
            CRAB,
            image,
            id,
            "sh",
            "-c",
            script,
        ]);
    }

    fn snapshots(&self, args: &[&str]) -> std::process::Output {
        let mut all = vec!["snapshots", "--snapshotter", "crabzfs"];
        all.extend_from_slice(args);
        self.ctd.ctr(&all)
    }

    /// Restarts the snapshotter (`crash_at` arms a crash point) and waits
    /// until containerd reaches it again (its gRPC client backs off after
    /// a dead peer).
    fn respawn(&mut self, crash_at: Option<&str>) {
        self.snap.stop();
        self.snap.spawn(crash_at);
        wait_until(30, || self.snapshots(&["ls"]).status.success().then_some(()))
            .expect("containerd reconnects");
    }

    /// containerd's snapshot keys for crabzfs.
    fn keys(&self) -> Vec<String> {
        let out = ok(self.snapshots(&["ls"]));
        out.lines()
            .skip(1)
            .filter_map(|l| l.split_whitespace().next().map(str::to_owned))
            .collect()
    }

    /// Datasets under the snapshotter's root (not the root itself).
    fn datasets(&self) -> Vec<String> {
        self.pool
            .datasets(&self.snap.dataset)
            .into_iter()
            .filter(|d| *d != self.snap.dataset)
            .collect()
    }

    /// containerd's view and the pool agree: one dataset per snapshot.
    #[track_caller]
    fn assert_agree(&self) {
        let (keys, datasets) = (self.keys(), self.datasets());
        assert_eq!(
            keys.len(),
            datasets.len(),
            "containerd has {keys:?}, the pool {datasets:?}"
        );
    }
}

/// An image with three layers (busybox, then files, then whiteouts and an
/// opaque directory over them).
fn import_layered(s: &Setup) {
    let dir = s.pool.dir.join("layers");
    let (l1, l2) = (dir.join("l1"), dir.join("l2"));
    for d in [
        l1.join("etc"),
        l1.join("opt/dir"),
        l2.join("etc"),
        l2.join("opt/dir"),
    ] {
        std::fs::create_dir_all(d).unwrap();
    }
    std::fs::write(l1.join("etc/victim"), "v").unwrap();
    std::fs::write(l1.join("opt/dir/a"), "a").unwrap();
    std::fs::write(l2.join("etc/.wh.victim"), "").unwrap();
    std::fs::write(l2.join("opt/dir/.wh..wh..opq"), "").unwrap();
    std::fs::write(l2.join("opt/dir/c"), "c").unwrap();
    let tar = dir.join("layered.tar");
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("fixtures/mkimage.sh");
    ok(Command::new(script)
        .arg(&tar)
        .arg(LAYERED)
        .arg(&l1)
        .arg(&l2)
        .output()
        .unwrap());
    s.import(&tar);
}

#[test]
fn ctr_run_on_crabzfs() {
    let s = Setup::start();
    import_layered(&s);
    s.run(LAYERED, "z", "echo data > /written; sleep 300");
    // Whiteouts of the upper layer hid what the lower ones had.
    let out = s.ctd.ctr_ok(&[
        "task",
        "exec",
        "--exec-id",
        "l",
        "z",
        "sh",
        "-c",
        "ls /etc; echo --; ls /opt/dir",
    ]);
    assert!(!out.contains("victim"), "{out}");
    assert!(out.ends_with("--\nc\n"), "{out}");
    // The write landed in the container's own dataset.
    let landed = wait_until(10, || {
        let out = crab_tests::zfs::cmd("zfs")
            .args(["list", "-H", "-o", "name,mountpoint", "-r", &s.snap.dataset])
            .output()
            .ok()?;
        let text = String::from_utf8_lossy(&out.stdout).into_owned();
        let hits: Vec<String> = text
            .lines()
            .filter_map(|l| l.split_once('\t'))
            .filter(|(_, mp)| Path::new(mp).join("written").exists())
            .map(|(n, _)| n.to_owned())
            .collect();
        (hits.len() == 1).then(|| hits[0].clone())
    })
    .expect("exactly one dataset holds the write");
    // Every dataset is mounted beneath the root's mountpoint, root's alone:
    // no other host user reaches a sandbox's files (its setuid copies).
    let out = crab_tests::zfs::cmd("zfs")
        .args(["get", "-H", "-o", "value", "mountpoint", &s.snap.dataset])
        .output()
        .unwrap();
    let root_mp = String::from_utf8_lossy(&out.stdout).trim().to_owned();
    let mode = std::fs::metadata(&root_mp).unwrap().permissions().mode() & 0o777;
    assert_eq!(mode, 0o700, "{root_mp}");
    s.assert_agree();
    s.ctd.remove("z");
    // Removing the container removes its dataset.
    let gone = wait_until(20, || (!s.datasets().contains(&landed)).then_some(()));
    assert!(gone.is_some(), "{landed} outlived its container");
    s.assert_agree();
    assert_clean(&s.ctd.scope(), &["z"]);
    // The runtime's own bundle rootfs is unmounted; the image layers stay.
    assert!(s.keys().len() >= 3);
}

#[test]
fn lost_metadata_never_destroys_the_datasets() {
    let mut s = Setup::start();
    s.import(crab_tests::image::busybox_archive());
    let before = s.datasets();
    assert!(!before.is_empty());
    s.snap.stop();
    let meta = s.snap.metadata();
    let kept = meta.with_extension("kept");
    std::fs::rename(&meta, &kept).unwrap();
    // Started without it, the snapshotter refuses, says why, and neither
    // destroys a dataset nor makes an empty database to find next time.
    let out = s.snap.command().output().unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "{err}");
    assert!(err.contains("metadata") && err.contains("missing"), "{err}");
    assert_eq!(s.datasets(), before);
    assert!(!meta.exists());
    // With its metadata back it serves them again.
    std::fs::rename(&kept, &meta).unwrap();
    s.respawn(None);
    s.assert_agree();
    assert_eq!(s.datasets(), before);
}

/// What no record names is reclaimed at start, the generations a
/// removed sandbox's rollbacks by clone retired too (a clone of one of
/// them first); what a record names is kept, generations included.
#[test]
fn orphaned_generations_are_reclaimed() {
    let mut s = Setup::start();
    s.import(crab_tests::image::busybox_archive());
    let before = s.datasets();
    let zfs = |args: &[&str]| ok(crab_tests::zfs::cmd("zfs").args(args).output().unwrap());
    let root = &s.snap.dataset;
    // A removed sandbox 900's two generations, the second a clone of the
    // first's snapshot; and a generation of a live record's dataset.
    zfs(&["create", &format!("{root}/900.gen-1")]);
    zfs(&["snapshot", &format!("{root}/900.gen-1@crab-v1")]);
    zfs(&[
        "clone",
        &format!("{root}/900.gen-1@crab-v1"),
        &format!("{root}/900.gen-2"),
    ]);
    let live = before[0].clone();
    let kept = format!("{live}.gen-1");
    zfs(&["create", &kept]);
    s.respawn(None);
    let mut want = before.clone();
    want.push(kept.clone());
    want.sort();
    let mut have = s.datasets();
    have.sort();
    assert_eq!(have, want);
}

#[test]
fn crash_in_the_middle_recovers() {
    let mut s = Setup::start();
    s.import(crab_tests::image::busybox_archive());
    let base = s.keys().into_iter().next().expect("the busybox layer");
    for (point, op) in [
        ("prepare-after-dataset", vec!["prepare", "k1", base.as_str()]),
        ("commit-after-snapshot", vec!["commit", "c1", "k1"]),
        ("remove-after-meta", vec!["rm", "c1"]),
    ] {
        // Each crash needs what the previous (crashed, so undone) step
        // would have made.
        match point {
            "commit-after-snapshot" => drop(ok(s.snapshots(&["prepare", "k1", &base]))),
            "remove-after-meta" => drop(ok(s.snapshots(&["commit", "c1", "k1"]))),
            _ => {}
        }
        s.respawn(Some(point));
        let out = s.snapshots(&op);
        if point != "remove-after-meta" {
            assert!(!out.status.success(), "{point}: {op:?} succeeded through a crash");
        }
        assert!(s.snap.wait_crashed(), "{point}: the snapshotter was not killed");
        s.respawn(None);
        s.assert_agree();
    }
    // Everything still works after the crashes.
    ok(s.snapshots(&["prepare", "k2", &base]));
    ok(s.snapshots(&["commit", "c2", "k2"]));
    ok(s.snapshots(&["rm", "c2"]));
    wait_until(20, || (s.keys().len() == s.datasets().len()).then_some(())).expect("agree after GC");
}

#[test]
fn bad_input_is_refused_clearly() {
    let s = Setup::start();
    s.import(crab_tests::image::busybox_archive());
    let base = s.keys().into_iter().next().expect("the busybox layer");
    let before = s.datasets();
    let out = s.snapshots(&["info", "no-such-key"]);
    assert!(
        !out.status.success() && stderr(&out).contains("not found"),
        "{}",
        stderr(&out)
    );
    let out = s.snapshots(&["prepare", "k", "no-such-parent"]);
    assert!(
        !out.status.success() && stderr(&out).contains("not found"),
        "{}",
        stderr(&out)
    );
    ok(s.snapshots(&["prepare", "k", &base]));
    // View, labels (Update), Stat and Usage through containerd.
    ok(s.snapshots(&["view", "v", &base]));
    let mounts = ok(s.snapshots(&["mounts", "/mnt", "v"]));
    assert!(mounts.contains("rbind") && mounts.contains("ro"), "{mounts}");
    ok(s.snapshots(&["label", "k", "crab.test=yes"]));
    let info = ok(s.snapshots(&["info", "k"]));
    assert!(info.contains("\"crab.test\": \"yes\""), "{info}");
    assert!(info.contains("\"Kind\": \"Active\""), "{info}");
    let usage = ok(s.snapshots(&["usage", &base]));
    assert!(usage.lines().count() >= 2, "{usage}");
    ok(s.snapshots(&["rm", "v"]));
    let out = s.snapshots(&["prepare", "k", &base]);
    assert!(
        !out.status.success() && stderr(&out).contains("already exists"),
        "{}",
        stderr(&out)
    );
    let out = s.snapshots(&["rm", &base]);
    assert!(!out.status.success(), "removed a snapshot with children");
    ok(s.snapshots(&["rm", "k"]));
    wait_until(20, || (s.datasets() == before).then_some(())).expect("back to the image layer only");
    s.assert_agree();

    // A missing pool: a clear error at start, nothing served.
    let bin = crab_tests::bin_dir().join("containerd-crab-snapshotter");
    let out = Command::new(bin)
        .args([
            "--address",
            "/tmp/crab-nopool.sock",
            "--dataset",
            "nopool/crab",
            "--state-dir",
        ])
        .arg(s.pool.dir.join("nostate"))
        .env("CRAB_CONFIG", "/nonexistent")
        .output()
        .unwrap();
    assert!(!out.status.success());
    assert!(
        stderr(&out).contains("cannot serve dataset nopool/crab"),
        "{}",
        stderr(&out)
    );
    assert!(!Path::new("/tmp/crab-nopool.sock").exists());
}

#[test]
fn full_pool_fails_clearly() {
    let s = Setup::start_sized("64M");
    s.import(crab_tests::image::busybox_archive());
    let base = s.keys().into_iter().next().expect("the busybox layer");
    ok(s.snapshots(&["prepare", "k", &base]));
    // Fill the pool through the active snapshot's mount.
    let mounts = ok(s.snapshots(&["mounts", "/mnt", "k"]));
    let source = mounts
        .split_whitespace()
        .find(|w| w.starts_with('/') && *w != "/mnt")
        .expect("a bind mount source")
        .to_owned();
    let fill = std::fs::File::create(Path::new(&source).join("fill")).unwrap();
    let mut w = std::io::BufWriter::new(fill);
    let chunk = vec![0x5a_u8; 1 << 20];
    let full = (0..200).any(|_| std::io::Write::write_all(&mut w, &chunk).is_err());
    drop(w);
    assert!(full, "a 64M pool took 200M");
    let before = s.datasets();
    let out = s.snapshots(&["prepare", "k2", &base]);
    assert!(!out.status.success(), "prepared on a full pool");
    assert!(stderr(&out).contains("out of space"), "{}", stderr(&out));
    assert_eq!(s.datasets(), before, "a half-made dataset");
    s.assert_agree();
}

/// crabctl checkpoint and rollback of a sandbox whose rootfs is a crabzfs
/// dataset: its files go back with ZFS snapshots, its shell's memory with
/// CRIU, twice (the second rollback goes past a newer snapshot, which ZFS
/// keeps).
#[test]
fn crabctl_rollback_on_crabzfs() {
    use crab_tests::sandbox::{crabctl_ok, wait_registered};
    let s = Setup::start();
    s.import(crab_tests::image::busybox_archive());
    s.run(
        crab_tests::image::BUSYBOX,
        "zr",
        "i=0; while true; do i=$((i+1)); echo $i > /n; sleep 0.05; done",
    );
    wait_registered(&s.ctd, "zr");
    let read = |f: &str| -> String {
        let id = crab_tests::unique("r");
        s.ctd
            .ctr_ok(&["task", "exec", "--exec-id", &id, "zr", "cat", f])
            .trim()
            .to_owned()
    };
    crab_tests::sandbox::exec_sh(&s.ctd, "zr", "echo one > /kept");
    // The shell may be between truncating /n and writing it.
    let count = || wait_until(5, || read("/n").parse::<u64>().ok()).expect("a count in /n");
    let before = count();
    let v1 = crabctl_ok(&s.ctd, &["checkpoint", "zr"]);
    assert_eq!(v1["version"]["fs_snapshot"]["backend"], "zfs", "{v1}");
    let at_v1 = count();
    crab_tests::sandbox::exec_sh(&s.ctd, "zr", "echo two > /kept; echo x > /extra");
    let v2 = crabctl_ok(&s.ctd, &["checkpoint", "zr"]);
    std::thread::sleep(std::time::Duration::from_millis(500));
    for round in 0..2 {
        let began = std::time::Instant::now();
        crabctl_ok(&s.ctd, &["rollback", "zr", "1"]);
        let n = count();
        // The shell counts on from v1's value (its memory and /n came back).
        assert!(
            crab_tests::counts_on_from(n, before, at_v1, began),
            "round {round}: {n} after v1's {before}..{at_v1}"
        );
        assert_eq!(read("/kept"), "one");
        let out = s.ctd.ctr(&[
            "task",
            "exec",
            "--exec-id",
            &crab_tests::unique("x"),
            "zr",
            "cat",
            "/extra",
        ]);
        assert!(!out.status.success(), "round {round}: /extra is gone");
        crab_tests::sandbox::exec_sh(&s.ctd, "zr", "echo three > /kept");
    }
    // A version removed takes its ZFS snapshot with it; v1's stays.
    let snapshots = || -> String {
        let out = crab_tests::zfs::cmd("zfs")
            .args(["list", "-H", "-t", "snapshot", "-o", "name"])
            .output()
            .unwrap();
        String::from_utf8_lossy(&out.stdout).into_owned()
    };
    let named = |v: &serde_json::Value| {
        format!(
            "@crab-{}\n",
            v["version"]["fs_snapshot"]["name"].as_str().unwrap()
        )
    };
    assert!(snapshots().contains(&named(&v2)), "{}", snapshots());
    crabctl_ok(&s.ctd, &["rm-version", "zr", "2"]);
    assert!(!snapshots().contains(&named(&v2)), "{}", snapshots());
    assert!(snapshots().contains(&named(&v1)), "{}", snapshots());
    s.ctd.remove("zr");
    // Its dataset is gone: so is its history.
    crab_tests::sandbox::wait_forgotten(&s.ctd, "zr");
    assert_clean(&s.ctd.scope(), &["zr"]);
}

/// The snapshotter SIGKILLed (then started again, as systemd would) while
/// crabd rolls a sandbox on crabzfs back and checkpoints it: the
/// rollback's swap and the restarted snapshotter's settling never meet
/// (the swap lock), every answer is true (a rollback answered done is at
/// its version, a checkpoint answered done restores), and in the end
/// containerd and the pool agree (the generations rollbacks retired go
/// with the sandbox) and nothing is left. The kill lands at a few fixed
/// delays; what it interrupts may differ from run to run, what must hold
/// does not.
#[test]
fn a_killed_snapshotter_loses_nothing() {
    use crab_tests::sandbox::{crabctl, crabctl_ok, exec_sh, wait_registered};
    let mut s = Setup::start();
    s.import(crab_tests::image::busybox_archive());
    s.run(crab_tests::image::BUSYBOX, "zk", "sleep 100000");
    wait_registered(&s.ctd, "zk");
    let kept = |s: &Setup| exec_sh(&s.ctd, "zk", "cat /kept").trim().to_owned();
    let mut versions = std::collections::BTreeMap::new();
    for text in ["one", "two"] {
        exec_sh(&s.ctd, "zk", &format!("echo {text} > /kept"));
        let v = crabctl_ok(&s.ctd, &["checkpoint", "zk"]);
        versions.insert(v["version"]["version"].as_u64().unwrap(), text.to_owned());
    }
    for (round, delay_ms) in [0u64, 150, 400].into_iter().enumerate() {
        let (rolled, checkpoint) = std::thread::scope(|scope| {
            let ctd = &s.ctd;
            let op = scope.spawn(move || {
                let rolled = crabctl(ctd, &["rollback", "zk", "1"]).status.success();
                let out = crabctl(ctd, &["checkpoint", "zk"]);
                let checkpoint = out.status.success().then(|| {
                    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
                    v["version"]["version"].as_u64().unwrap()
                });
                (rolled, checkpoint)
            });
            std::thread::sleep(std::time::Duration::from_millis(delay_ms));
            s.snap.kill();
            s.snap.spawn(None);
            op.join().expect("the operations' thread")
        });
        eprintln!(
            "round {round}, killed after {delay_ms} ms: rollback done {rolled}, checkpoint {checkpoint:?}"
        );
        wait_until(30, || s.snapshots(&["ls"]).status.success().then_some(()))
            .expect("containerd reconnects");
        assert_eq!(
            s.ctd.task_status("zk").as_deref(),
            Some("RUNNING"),
            "round {round}"
        );
        let now = kept(&s);
        if rolled {
            assert_eq!(now, "one", "round {round}: the rollback answered done");
        }
        if let Some(v) = checkpoint {
            versions.insert(v, now);
        }
        exec_sh(&s.ctd, "zk", "echo two > /kept");
    }
    // Every version answered done restores with its files.
    for (version, want) in &versions {
        crabctl_ok(&s.ctd, &["rollback", "zk", &version.to_string()]);
        assert_eq!(&kept(&s), want, "version {version}");
    }
    s.ctd.remove("zk");
    crab_tests::sandbox::wait_forgotten(&s.ctd, "zk");
    wait_until(30, || (s.keys().len() == s.datasets().len()).then_some(()))
        .unwrap_or_else(|| s.assert_agree());
    assert_clean(&s.ctd.scope(), &["zk"]);
    // A swap lock's file goes with its dataset.
    let datasets: Vec<String> = s
        .datasets()
        .iter()
        .map(|d| format!("{}.lock", d.replace('/', "@")))
        .collect();
    let locks: Vec<_> = std::fs::read_dir("/run/crab/zfs-swap")
        .into_iter()
        .flatten()
        .flatten()
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .filter(|n| n.starts_with(&format!("{}@", s.pool.name)) && !datasets.contains(n))
        .collect();
    assert!(locks.is_empty(), "swap locks of no dataset: {locks:?}");
}
