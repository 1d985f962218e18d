//! Every backend against its real filesystem: zfs-fuse on a file-backed
//! pool, btrfs on a loop device, overlayfs. Needs root: CI runs it as root.

mod common;

use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::path::PathBuf;

use common::{digest, mutate, populate, sh, unique};
use crab_snapshotter::{
    Backend, BtrfsBackend, Change, Error, Location, OverlayCopyBackend, SnapshotName, ZfsBackend,
};
use crab_tests::zfs::{Pool, ZfsFuse};

fn name(s: &str) -> SnapshotName {
    SnapshotName::new(s).unwrap()
}

/// The life of a sandbox's filesystem: snapshot, change, snapshot, roll back
/// both ways, clone, export and import, and bad input. `exact_change` says
/// whether the backend can tell a change (zfs-fuse cannot); `xattrs`
/// whether the filesystem has them (zfs-fuse has not).
fn exercise(b: &dyn Backend, clone_at: Location, fresh: &dyn Backend, exact_change: bool, xattrs: bool) {
    let live = b.live_path().unwrap();
    populate(&live, xattrs);
    let d1 = digest(&live);
    b.snapshot(&name("v1")).unwrap();
    if exact_change {
        assert_eq!(b.changed_since(&name("v1")).unwrap(), Change::Unchanged);
    }
    mutate(&live, xattrs);
    let d2 = digest(&live);
    assert_ne!(d1, d2);
    let change = b.changed_since(&name("v1")).unwrap();
    if exact_change {
        assert!(matches!(change, Change::Changed { .. }), "{change:?}");
    }
    b.snapshot(&name("v2")).unwrap();
    assert!(b.has(&name("v1")).unwrap() && b.has(&name("v2")).unwrap());
    assert!(!b.has(&name("v3")).unwrap());

    // Roll back to the older snapshot: the tree is v1's, and v2 survives.
    b.rollback(&name("v1")).unwrap();
    let live = b.live_path().unwrap();
    assert_eq!(digest(&live), d1, "rollback to v1");
    let names: Vec<String> = b
        .list()
        .unwrap()
        .into_iter()
        .map(|s| s.name.to_string())
        .collect();
    assert_eq!(names, ["v1", "v2"]);
    // Forward again to the newer one.
    b.rollback(&name("v2")).unwrap();
    assert_eq!(digest(&b.live_path().unwrap()), d2, "rollback to v2");
    // Twice in a row to the same snapshot, after a change.
    std::fs::write(b.live_path().unwrap().join("scratch"), "x").unwrap();
    b.rollback(&name("v2")).unwrap();
    assert_eq!(digest(&b.live_path().unwrap()), d2, "second rollback to v2");

    // A clone is an independent copy.
    let c = b.clone_to(&name("v1"), &clone_at).unwrap();
    let clive = c.live_path().unwrap();
    assert_eq!(digest(&clive), d1, "clone of v1");
    std::fs::write(clive.join("README"), "clone changed\n").unwrap();
    assert_eq!(digest(&b.live_path().unwrap()), d2, "the clone's change leaks");
    assert!(matches!(
        b.clone_to(&name("v1"), &clone_at),
        Err(Error::TargetExists { .. })
    ));

    // Export v1 whole and v2 relative to v1; import both elsewhere.
    let mut full = Vec::new();
    b.export(&name("v1"), None, &mut full).unwrap();
    let mut incr = Vec::new();
    b.export(&name("v2"), Some(&name("v1")), &mut incr).unwrap();
    // A truncated stream fails and leaves no snapshot behind.
    let cut = &full[..full.len() / 2];
    assert!(fresh.import(&name("v1"), None, &mut &cut[..]).is_err());
    assert!(
        fresh.list().unwrap_or_default().is_empty(),
        "a torn import is listed"
    );
    fresh.import(&name("v1"), None, &mut &full[..]).unwrap();
    assert_eq!(digest(&fresh.live_path().unwrap()), d1, "import of v1");
    fresh
        .import(&name("v2"), Some(&name("v1")), &mut &incr[..])
        .unwrap();
    fresh.rollback(&name("v2")).unwrap();
    assert_eq!(digest(&fresh.live_path().unwrap()), d2, "import of v2 on v1");

    // Bad input: clear errors, nothing changed.
    assert!(matches!(b.rollback(&name("nope")), Err(Error::NoSnapshot { .. })));
    assert!(matches!(
        b.snapshot(&name("v1")),
        Err(Error::SnapshotExists { .. })
    ));
    assert!(SnapshotName::new("../v1").is_err());
    assert_eq!(digest(&b.live_path().unwrap()), d2);

    b.snapshot(&name("v3")).unwrap();
    b.destroy(&name("v3")).unwrap();
    let names: Vec<String> = b
        .list()
        .unwrap()
        .into_iter()
        .map(|s| s.name.to_string())
        .collect();
    assert_eq!(names, ["v1", "v2"]);
    assert!(matches!(b.destroy(&name("v3")), Err(Error::NoSnapshot { .. })));
}

#[test]
fn overlay_copy_on_a_real_overlay() {
    let root = PathBuf::from(format!("/tmp/{}", unique("crabov")));
    let (lower, upper, work, merged) = (
        root.join("lower"),
        root.join("upper"),
        root.join("work"),
        root.join("merged"),
    );
    for d in [&lower, &upper, &work, &merged] {
        std::fs::create_dir_all(d).unwrap();
    }
    // The image layer: a file to delete (whiteout) and a directory to
    // replace (opaque directory) through the overlay.
    std::fs::create_dir_all(lower.join("etc/conf.d")).unwrap();
    std::fs::write(lower.join("etc/conf.d/a"), "a").unwrap();
    std::fs::write(lower.join("etc/passwd"), "root:x:0:0\n").unwrap();
    let opts = format!(
        "lowerdir={},upperdir={},workdir={}",
        lower.display(),
        upper.display(),
        work.display()
    );
    sh(
        "mount",
        &["-t", "overlay", "overlay", "-o", &opts, merged.to_str().unwrap()],
    );
    let guard = Unmount(merged.clone());
    std::fs::remove_file(merged.join("etc/passwd")).unwrap();
    std::fs::remove_dir_all(merged.join("etc/conf.d")).unwrap();
    std::fs::create_dir(merged.join("etc/conf.d")).unwrap();
    std::fs::write(merged.join("etc/conf.d/b"), "b").unwrap();
    drop(guard);

    let b = OverlayCopyBackend::new(&upper, &root.join("store"));
    // The upper directory now has a whiteout and an opaque directory.
    let whiteout = std::fs::symlink_metadata(upper.join("etc/passwd")).unwrap();
    assert!(std::os::unix::fs::FileTypeExt::is_char_device(
        &whiteout.file_type()
    ));
    assert!(xattr::get(upper.join("etc/conf.d"), "trusted.overlay.opaque")
        .unwrap()
        .is_some());

    let clone_at = Location::OverlayCopy {
        upper: root.join("clone-upper"),
        store: root.join("clone-store"),
    };
    let fresh = OverlayCopyBackend::new(&root.join("fresh-upper"), &root.join("fresh-store"));
    exercise(&b, clone_at, &fresh, true, true);

    // The rolled-back upper still works as an overlay: v1's merged view.
    b.rollback(&name("v1")).unwrap();
    sh(
        "mount",
        &["-t", "overlay", "overlay", "-o", &opts, merged.to_str().unwrap()],
    );
    let guard = Unmount(merged.clone());
    assert!(
        !merged.join("etc/passwd").exists(),
        "the whiteout hides the lower file"
    );
    assert!(
        !merged.join("etc/conf.d/a").exists(),
        "the opaque directory hides the lower one"
    );
    assert_eq!(std::fs::read_to_string(merged.join("etc/conf.d/b")).unwrap(), "b");
    assert_eq!(
        std::fs::read_to_string(merged.join("to-edit")).unwrap(),
        "version 1\n"
    );
    drop(guard);
    std::fs::remove_dir_all(&root).unwrap();
}

/// A snapshot writes bytes in proportion to the change: untouched files are
/// shared with the previous snapshot.
#[test]
fn overlay_copy_shares_untouched_files() {
    use std::os::unix::fs::MetadataExt;
    let root = PathBuf::from(format!("/tmp/{}", unique("crabsh")));
    let upper = root.join("upper");
    std::fs::create_dir_all(&upper).unwrap();
    populate(&upper, true);
    let b = OverlayCopyBackend::new(&upper, &root.join("store"));
    b.snapshot(&name("s1")).unwrap();
    std::fs::write(upper.join("to-edit"), "changed").unwrap();
    b.snapshot(&name("s2")).unwrap();
    let ino = |s: &str, f: &str| {
        std::fs::metadata(root.join("store").join(s).join(f))
            .unwrap()
            .ino()
    };
    assert_eq!(
        ino("s1", "src/deep/er/data.bin"),
        ino("s2", "src/deep/er/data.bin")
    );
    assert_ne!(ino("s1", "to-edit"), ino("s2", "to-edit"));
    // A tree left by a crash before its meta file was published is not a
    // snapshot: it is neither listed nor in the way.
    std::fs::create_dir(root.join("store/s3")).unwrap();
    std::fs::write(root.join("store/s3/junk"), "torn").unwrap();
    assert_eq!(b.list().unwrap().len(), 2);
    b.snapshot(&name("s3")).unwrap();
    assert!(!root.join("store/s3/junk").exists());
    std::fs::remove_dir_all(&root).unwrap();
}

/// A rollback gives a file that was only changed since the snapshot its
/// content, holes and mode back in its own inode: a process restored with
/// the snapshot knows its files by inode number (SQLite refuses to write
/// to a database whose path names another inode than the one it opened).
/// A file the sandbox replaced comes back whole too.
#[test]
fn an_overlay_rollback_keeps_the_inode_of_a_changed_file() {
    use std::os::unix::fs::MetadataExt;
    let root = PathBuf::from(format!("/tmp/{}", unique("crabino")));
    let upper = root.join("upper");
    std::fs::create_dir_all(&upper).unwrap();
    let db = upper.join("app.db");
    let file = std::fs::File::create(&db).unwrap();
    file.set_len(64 << 20).unwrap();
    std::os::unix::fs::FileExt::write_all_at(&file, b"page one", 4096).unwrap();
    drop(file);
    std::fs::set_permissions(&db, std::fs::Permissions::from_mode(0o640)).unwrap();
    std::fs::write(upper.join("replaced"), "first").unwrap();
    let b = OverlayCopyBackend::new(&upper, &root.join("store"));
    b.snapshot(&name("s1")).unwrap();
    // Untouched in between: the store shares the file between s1 and s2.
    std::fs::write(upper.join("other"), "a turn's change").unwrap();
    b.snapshot(&name("s2")).unwrap();
    let ino = std::fs::metadata(&db).unwrap().ino();
    let before = digest(&upper);

    std::fs::OpenOptions::new()
        .append(true)
        .open(&db)
        .and_then(|mut f| std::io::Write::write_all(&mut f, b"a new row"))
        .unwrap();
    std::fs::set_permissions(&db, std::fs::Permissions::from_mode(0o600)).unwrap();
    std::fs::remove_file(upper.join("replaced")).unwrap();
    std::fs::write(upper.join("replaced"), "second, longer").unwrap();
    b.rollback(&name("s2")).unwrap();

    let md = std::fs::metadata(&db).unwrap();
    assert_eq!(md.ino(), ino, "the changed file keeps its inode");
    assert_eq!(md.len(), 64 << 20);
    assert!(
        md.blocks() < 1024,
        "its holes stay holes ({} blocks)",
        md.blocks()
    );
    assert_eq!(digest(&upper), before, "content and modes are the snapshot's");
    std::fs::remove_dir_all(&root).unwrap();
}

/// A rollback cut short (the shim killed halfway through rewriting the
/// upper) leaves its journal; finishing it makes the upper the snapshot's
/// whole, and a finished rollback leaves no journal.
#[test]
fn an_interrupted_overlay_rollback_is_finished_from_its_journal() {
    let root = PathBuf::from(format!("/tmp/{}", unique("crabrj")));
    let upper = root.join("upper");
    std::fs::create_dir_all(&upper).unwrap();
    populate(&upper, true);
    let b = OverlayCopyBackend::new(&upper, &root.join("store"));
    b.snapshot(&name("s1")).unwrap();
    let at_s1 = digest(&upper);
    mutate(&upper, true);
    let mutated = digest(&upper);
    assert_ne!(at_s1, mutated);
    let journal = root.join(".upper.crab-rollback");
    // Nothing to finish.
    assert_eq!(
        crab_snapshotter::finish_interrupted_rollback(&upper).unwrap(),
        None
    );
    // A finished rollback: the snapshot's tree, no journal.
    b.rollback(&name("s1")).unwrap();
    assert_eq!(digest(&upper), at_s1);
    assert!(!journal.exists());
    // Cut short: the journal was written, then only part of the change
    // undone (one file back, the rest as mutated).
    mutate(&upper, true);
    let store = root.join("store").display().to_string();
    std::fs::write(&journal, format!(r#"{{"store":"{store}","name":"s1"}}"#)).unwrap();
    std::fs::write(upper.join("to-edit"), "half").unwrap();
    assert_ne!(digest(&upper), at_s1);
    let done = crab_snapshotter::finish_interrupted_rollback(&upper).unwrap();
    assert_eq!(done, Some(name("s1")));
    assert_eq!(digest(&upper), at_s1);
    assert!(!journal.exists());
    // A journal that names no snapshot there stays, and says so.
    std::fs::write(&journal, r#"{"store":"/nonexistent","name":"s1"}"#).unwrap();
    let e = crab_snapshotter::finish_interrupted_rollback(&upper).unwrap_err();
    assert!(
        e.to_string().contains("no snapshot s1") && e.to_string().contains("crabctl resume"),
        "{e}"
    );
    assert!(journal.exists());
    std::fs::write(&journal, "{torn").unwrap();
    let e = crab_snapshotter::finish_interrupted_rollback(&upper).unwrap_err();
    assert!(e.to_string().contains("crab-rollback"), "{e}");
    std::fs::remove_dir_all(&root).unwrap();
}

#[test]
fn btrfs_on_a_loop_device() {
    let root = PathBuf::from(format!("/tmp/{}", unique("crabbt")));
    std::fs::create_dir_all(root.join("mnt")).unwrap();
    let img = root.join("fs.img");
    sh("truncate", &["-s", "1G", img.to_str().unwrap()]);
    sh("mkfs.btrfs", &["-q", img.to_str().unwrap()]);
    sh(
        "mount",
        &[
            "-o",
            "loop",
            img.to_str().unwrap(),
            root.join("mnt").to_str().unwrap(),
        ],
    );
    let guard = Unmount(root.join("mnt"));
    let mnt = root.join("mnt");
    let b = BtrfsBackend::create(&mnt.join("sb")).unwrap();
    let clone_at = Location::Btrfs {
        dir: mnt.join("fork"),
    };
    let fresh = BtrfsBackend::new(&mnt.join("fresh"));
    exercise(&b, clone_at, &fresh, true, true);
    // A snapshot (made by ioctl) is a read-only subvolume of its own, as
    // `btrfs subvolume snapshot -r` makes it.
    let v1 = mnt.join("sb/.snapshots/v1");
    assert_eq!(
        std::fs::metadata(&v1).unwrap().ino(),
        256,
        "the root of a subvolume"
    );
    let e = std::fs::write(v1.join("new-file"), b"x").unwrap_err();
    assert_eq!(e.raw_os_error(), Some(nix::libc::EROFS), "{e}");
    let show = std::process::Command::new("btrfs")
        .args(["property", "get", "-ts", v1.to_str().unwrap(), "ro"])
        .output()
        .unwrap();
    assert_eq!(
        String::from_utf8_lossy(&show.stdout).trim(),
        "ro=true",
        "{show:?}"
    );

    // A plain directory on btrfs is no subvolume: snapshotting it would
    // snapshot the whole subvolume that holds it, so it is refused.
    std::fs::create_dir_all(mnt.join("plain")).unwrap();
    let plain = BtrfsBackend::at(&mnt.join("plain"), &mnt.join(".crab/plain"));
    let e = plain.snapshot(&name("p1")).unwrap_err();
    assert!(e.to_string().contains("not a btrfs subvolume"), "{e}");
    assert!(!mnt.join(".crab/plain/p1").exists());

    // A subvolume someone else made (containerd's btrfs snapshotter lays
    // out `active/<n>`), with the snapshots kept elsewhere on the fs.
    std::fs::create_dir_all(mnt.join("ctd/active")).unwrap();
    sh(
        "btrfs",
        &["subvolume", "create", mnt.join("ctd/active/7").to_str().unwrap()],
    );
    let b = BtrfsBackend::at(&mnt.join("ctd/active/7"), &mnt.join(".crab/ns/7"));
    let clone_at = Location::BtrfsSubvolume {
        subvolume: mnt.join("ctd/active/8"),
        store: mnt.join(".crab/ns/8"),
    };
    let fresh = BtrfsBackend::at(&mnt.join("ctd/active/9"), &mnt.join(".crab/ns/9"));
    exercise(&b, clone_at, &fresh, true, true);
    // The swap left nothing beside the live subvolume.
    let mut beside: Vec<_> = std::fs::read_dir(mnt.join("ctd/active"))
        .unwrap()
        .map(|e| e.unwrap().file_name().into_string().unwrap())
        .collect();
    beside.sort();
    assert_eq!(beside, ["7", "8", "9"]);
    // No other host user reaches the snapshots (setuid copies, devices).
    for store in [mnt.join(".crab/ns/7"), mnt.join("sb/.snapshots"), mnt.join("sb")] {
        let mode = std::fs::metadata(&store).unwrap().permissions().mode() & 0o777;
        assert_eq!(mode, 0o700, "{}", store.display());
    }
    drop(guard);
    std::fs::remove_dir_all(&root).unwrap();
}

#[test]
fn zfs_on_zfs_fuse() {
    let _zfs = ZfsFuse::start();
    let pool = Pool::create("512M");
    let b = ZfsBackend::create(&format!("{}/sandboxes/sb", pool.name)).unwrap();
    let clone_at = Location::Zfs {
        dataset: format!("{}/sandboxes/fork", pool.name),
    };
    let fresh = ZfsBackend::new(&format!("{}/imported/sb", pool.name)).unwrap();
    exercise(&b, clone_at, &fresh, false, false);
    // v1 is the origin of the fork, v2 of the live dataset (rolled back to
    // it by clone): ZFS cannot destroy them, and says so.
    assert!(matches!(b.destroy(&name("v1")), Err(Error::SnapshotInUse { .. })));
    assert!(matches!(b.destroy(&name("v2")), Err(Error::SnapshotInUse { .. })));
    drop(pool);
}

struct Unmount(PathBuf);

impl Drop for Unmount {
    fn drop(&mut self) {
        // Lazily: a btrfs still busy for a moment (a cleaner, a command
        // not yet gone) must not leave its read-only snapshots to
        // `remove_dir_all` on the mounted tree.
        let _ = nix::mount::umount2(&self.0, nix::mount::MntFlags::MNT_DETACH);
    }
}

/// A rollback by clone that a crash cut short is settled from its journal
/// (the two `crab:rollback-*` properties the rollback sets before its first
/// change): cut before the live dataset was retired, it is undone (mounted
/// again, as it was); cut after, it is finished (the clone made at the
/// mount point). The crash is made by running the rollback's first steps
/// with `zfs` and stopping there.
#[test]
fn an_interrupted_zfs_rollback_is_settled_from_its_journal() {
    let _zfs = ZfsFuse::start();
    let pool = Pool::create("256M");
    let ds = format!("{}/sandboxes/sb", pool.name);
    let b = ZfsBackend::create(&ds).unwrap();
    let zfs = |args: &[&str]| {
        let out = crab_tests::zfs::cmd("zfs").args(args).output().unwrap();
        assert!(
            out.status.success(),
            "zfs {args:?}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        String::from_utf8_lossy(&out.stdout).trim().to_owned()
    };
    let mnt = PathBuf::from(zfs(&["get", "-H", "-o", "value", "mountpoint", &ds]));
    let file = mnt.join("f");
    std::fs::write(&file, "v1").unwrap();
    b.snapshot(&name("v1")).unwrap();
    std::fs::write(&file, "live").unwrap();
    let journal = |on: &str| {
        zfs(&["set", &format!("crab:rollback-origin={ds}.gen-1@crab-v1"), on]);
        zfs(&["set", &format!("crab:rollback-mountpoint={}", mnt.display()), on]);
    };
    let unmount = || {
        crab_tests::wait_until(10, || {
            crab_tests::zfs::cmd("zfs")
                .args(["unmount", &ds])
                .status()
                .is_ok_and(|s| s.success())
                .then_some(())
        })
        .expect("unmount");
    };

    // Cut after the journal and the unmount: undone.
    journal(&ds);
    unmount();
    assert!(b.finish_interrupted_rollback().unwrap());
    assert_eq!(std::fs::read_to_string(&file).unwrap(), "live");
    assert_eq!(
        zfs(&["get", "-H", "-o", "source", "crab:rollback-origin", &ds]),
        "-"
    );

    // Cut after the retire, before the clone: finished.
    journal(&ds);
    unmount();
    crab_tests::wait_until(10, || {
        crab_tests::zfs::cmd("zfs")
            .args(["rename", &ds, &format!("{ds}.gen-1")])
            .status()
            .is_ok_and(|s| s.success())
            .then_some(())
    })
    .expect("rename");
    assert!(b.finish_interrupted_rollback().unwrap());
    assert_eq!(std::fs::read_to_string(&file).unwrap(), "v1");
    assert_eq!(
        zfs(&[
            "get",
            "-H",
            "-o",
            "source",
            "crab:rollback-origin",
            &format!("{ds}.gen-1")
        ]),
        "-"
    );
    // Nothing is left to settle; a rollback by clone leaves no journal.
    assert!(!b.finish_interrupted_rollback().unwrap());
    std::fs::write(&file, "again").unwrap();
    b.snapshot(&name("v2")).unwrap();
    b.snapshot(&name("v3")).unwrap();
    b.rollback(&name("v2")).unwrap();
    assert_eq!(
        zfs(&["get", "-H", "-o", "source", "crab:rollback-origin", &ds]),
        "-"
    );
    drop(b);
    drop(pool);
}

/// crabzfs, started again while a shim's rollback by clone is under way,
/// waits for it (the dataset's swap lock) rather than settling the swap
/// under its feet (mounting the dataset about to be renamed). Here the
/// test is the shim: it holds the lock in the middle of a swap (journal
/// set, dataset unmounted), sees the settling blocked on the lock (in
/// `flock`, read from /proc: no timing), finishes the swap, and then the
/// settling finds nothing to do.
#[test]
fn settling_waits_for_a_rollback_under_way() {
    let _zfs = ZfsFuse::start();
    let pool = Pool::create("256M");
    let ds = format!("{}/sandboxes/sw", pool.name);
    let b = ZfsBackend::create(&ds).unwrap();
    let zfs = |args: &[&str]| {
        crab_tests::wait_until(10, || {
            let out = crab_tests::zfs::cmd("zfs").args(args).output().unwrap();
            out.status
                .success()
                .then(|| String::from_utf8_lossy(&out.stdout).trim().to_owned())
        })
        .unwrap_or_else(|| panic!("zfs {args:?} failed"))
    };
    let mnt = PathBuf::from(zfs(&["get", "-H", "-o", "value", "mountpoint", &ds]));
    let file = mnt.join("f");
    std::fs::write(&file, "v1").unwrap();
    b.snapshot(&name("v1")).unwrap();
    std::fs::write(&file, "live").unwrap();
    b.snapshot(&name("v2")).unwrap();

    // The shim's first steps of a rollback to v1, under the lock.
    let lock = b.swap_lock().unwrap();
    let retired = format!("{ds}.gen-1");
    zfs(&["set", &format!("crab:rollback-origin={retired}@crab-v1"), &ds]);
    zfs(&["set", &format!("crab:rollback-mountpoint={}", mnt.display()), &ds]);
    zfs(&["unmount", &ds]);

    let (tid_tx, tid_rx) = std::sync::mpsc::channel();
    let settler = {
        let b = b.clone();
        std::thread::spawn(move || {
            tid_tx.send(nix::unistd::gettid().as_raw()).unwrap();
            b.finish_interrupted_rollback()
        })
    };
    assert!(
        waits_in_flock(tid_rx.recv().unwrap()),
        "the settling did not wait for the lock"
    );

    // The shim's last steps: retire, clone, clear the journal.
    zfs(&["rename", &ds, &retired]);
    zfs(&["set", "mountpoint=none", &retired]);
    zfs(&[
        "clone",
        "-o",
        &format!("mountpoint={}", mnt.display()),
        &format!("{retired}@crab-v1"),
        &ds,
    ]);
    for property in ["crab:rollback-origin", "crab:rollback-mountpoint"] {
        zfs(&["inherit", property, &retired]);
    }
    drop(lock);
    assert!(!settler.join().unwrap().unwrap(), "nothing was left to settle");
    assert_eq!(std::fs::read_to_string(&file).unwrap(), "v1");
    assert_eq!(
        zfs(&["get", "-H", "-o", "value", "origin", &ds]),
        format!("{retired}@crab-v1")
    );
}

/// On zfs-fuse (this host has no `/dev/zfs`), a backend's `zfs` command
/// waits for the host-wide turn: two commands at once wedge zfs-fuse for
/// good.
#[test]
fn zfs_fuse_commands_take_turns() {
    if std::path::Path::new("/dev/zfs").exists() {
        // The kernel module needs no turn, and crab takes none there.
        return;
    }
    let _zfs = ZfsFuse::start();
    let pool = Pool::create("256M");
    let ds = format!("{}/sandboxes/turns", pool.name);
    // `crab_tests::zfs::cmd` makes the lock file (and /run/crab) as crab does.
    drop(crab_tests::zfs::cmd("zfs"));
    let turn = std::fs::File::options()
        .write(true)
        .open("/run/crab/zfs-fuse.lock")
        .unwrap();
    let turn = nix::fcntl::Flock::lock(turn, nix::fcntl::FlockArg::LockExclusive).unwrap();

    let (tid_tx, tid_rx) = std::sync::mpsc::channel();
    let creator = {
        let ds = ds.clone();
        std::thread::spawn(move || {
            tid_tx.send(nix::unistd::gettid().as_raw()).unwrap();
            ZfsBackend::create(&ds).map(drop)
        })
    };
    assert!(
        waits_in_flock(tid_rx.recv().unwrap()),
        "zfs create did not wait for its turn"
    );
    // This test holds the turn: its own `zfs list` goes without one.
    let listed = std::process::Command::new("zfs")
        .args(["list", "-H", "-o", "name", "-r", &pool.name])
        .output()
        .unwrap();
    assert!(
        !String::from_utf8_lossy(&listed.stdout).lines().any(|d| d == ds),
        "made out of turn"
    );

    drop(turn);
    creator.join().unwrap().unwrap();
    assert!(pool.datasets(&pool.name).contains(&ds));
}

/// Whether thread `tid` of this process comes to wait in `flock` within 20 s.
fn waits_in_flock(tid: i32) -> bool {
    let syscall = format!("/proc/self/task/{tid}/syscall");
    crab_tests::wait_until(20, || {
        let text = std::fs::read_to_string(&syscall).unwrap_or_default();
        let nr: i64 = text.split_whitespace().next()?.parse().ok()?;
        (nr == nix::libc::SYS_flock).then_some(())
    })
    .is_some()
}
