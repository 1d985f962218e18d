//! Crashes: a torn manifest at every byte, and a process SIGKILLed at each
//! step of a publish.
//!
//! The kill test runs this test binary again as a child (test `child`,
//! which does nothing unless [`CHILD_ROOT_ENV`] is set). The child stops at
//! a crash point, says so on stdout, and blocks on stdin; the parent reads
//! that line, then SIGKILLs it: no timing is involved.

use std::io::BufReader;
use std::process::{Command, Stdio};

use super::*;

/// The store root the child publishes into.
const CHILD_ROOT_ENV: &str = "CRAB_ENGINE_TEST_CHILD_ROOT";

#[test]
fn torn_last_line_at_every_byte() {
    let fx = fixture();
    fx.run("a n a");
    drop(fx.store);
    let whole = fs::read(fx.dir.path().join("sandboxes/s1/versions.log")).unwrap();
    let start = whole[..whole.len() - 1]
        .iter()
        .rposition(|&b| b == b'\n')
        .unwrap()
        + 1;
    let images = fx.dir.path().join("images/s1/3");
    let saved = tempfile::tempdir().unwrap();
    copy_tree(&images, saved.path());
    for cut in start..whole.len() {
        let root = tempfile::tempdir().unwrap();
        fs::create_dir_all(root.path().join("sandboxes/s1")).unwrap();
        fs::write(root.path().join("sandboxes/s1/versions.log"), &whole[..cut]).unwrap();
        copy_tree(
            &fx.dir.path().join("images/s1/1"),
            &root.path().join("images/s1/1"),
        );
        copy_tree(saved.path(), &root.path().join("images/s1/3"));
        let store = VersionStore::open(root.path()).unwrap();
        let s1 = sid("s1");
        let recovery = store.recovery(&s1).unwrap();
        let torn = (cut > start).then_some(TornLine {
            line: 4,
            bytes: (cut - start) as u64,
        });
        assert_eq!(recovery.torn_line, torn, "cut at {cut}");
        assert_eq!(recovery.removed_images, vec![3], "cut at {cut}");
        assert_eq!(
            summary(&store.verified_versions(&s1).unwrap()),
            "v1 v2",
            "cut at {cut}"
        );
        assert_eq!(store.latest_valid(&s1).unwrap().record.version, 2);
        // The torn number is given out again (its publish never returned).
        assert_eq!(publish(&store, &s1, "a").version, 3, "cut at {cut}");
        assert_eq!(
            summary(&store.verified_versions(&s1).unwrap()),
            "v1 v2 v3",
            "cut at {cut}"
        );
    }
}

fn copy_tree(from: &Path, to: &Path) {
    fs::create_dir_all(to).unwrap();
    for entry in fs::read_dir(from).unwrap() {
        let entry = entry.unwrap();
        if entry.file_type().unwrap().is_dir() {
            copy_tree(&entry.path(), &to.join(entry.file_name()));
        } else {
            fs::copy(entry.path(), to.join(entry.file_name())).unwrap();
        }
    }
}

/// The child's side: publish one full version into the store at
/// [`CHILD_ROOT_ENV`], stopping where [`STOP_AT_ENV`] says.
#[test]
fn child() {
    let Ok(root) = std::env::var(CHILD_ROOT_ENV) else {
        return;
    };
    let store = VersionStore::open(root).unwrap();
    publish(&store, &sid("s1"), "a");
    println!("published without stopping");
}

/// Expected after killing the child at a point: the listing, the recovery
/// report, and the number the next version gets.
fn check(point: &str, listing: &str, recovery: Recovery, next: u64) {
    let fx = fixture();
    fx.run("a n");
    drop(fx.store);
    let mut child = Command::new(std::env::current_exe().unwrap())
        .args([
            "--exact",
            "store::tests::crash::child",
            "--nocapture",
            "--test-threads=1",
        ])
        .env(CHILD_ROOT_ENV, fx.dir.path())
        .env(STOP_AT_ENV, point)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .unwrap();
    let mut stdout = BufReader::new(child.stdout.take().unwrap());
    let marker = format!("{STOPPED} {point}");
    let mut line = String::new();
    loop {
        line.clear();
        let n = stdout.read_line(&mut line).unwrap();
        assert!(n > 0, "child exited before reaching {point}");
        if line.trim_end() == marker {
            break;
        }
    }
    child.kill().unwrap();
    let status = child.wait().unwrap();
    assert_eq!(
        std::os::unix::process::ExitStatusExt::signal(&status),
        Some(9),
        "{point}"
    );
    let store = VersionStore::open(fx.dir.path()).unwrap();
    let fx = Fixture { store, ..fx };
    assert_eq!(
        summary(&fx.store.verified_versions(&fx.s1).unwrap()),
        listing,
        "{point}"
    );
    assert_eq!(fx.store.recovery(&fx.s1).unwrap(), recovery, "{point}");
    assert_eq!(fx.run("a")[0].version, next, "{point}");
    assert_eq!(
        fx.store.latest_valid(&fx.s1).unwrap().record.version,
        next,
        "{point}"
    );
}

#[test]
fn killed_mid_publish() {
    let none = Recovery::default();
    check(
        "images-synced",
        "v1 v2",
        Recovery {
            removed_tmp_dirs: vec![".tmp-3".to_owned()],
            ..none.clone()
        },
        3,
    );
    check(
        "images-renamed",
        "v1 v2",
        Recovery {
            removed_images: vec![3],
            ..none.clone()
        },
        3,
    );
    // The torn line's length depends on the record: only its presence and
    // line number are fixed.
    let fx_torn = |bytes| Recovery {
        torn_line: Some(TornLine { line: 4, bytes }),
        removed_images: vec![3],
        ..none.clone()
    };
    let half = half_line_len();
    check("line-half-written", "v1 v2", fx_torn(half), 3);
    // Killed after the fsync: the version is published.
    check("line-synced", "v1 v2 v3", none, 4);
}

/// How many bytes of version 3's line the child writes before stopping.
fn half_line_len() -> u64 {
    let fx = fixture();
    let records = fx.run("a n a");
    let line = record::encode_version(&records[2]).unwrap();
    // Same shape as the child's record; only created_unix_ms can differ in
    // length, and both are 13-digit millisecond times.
    (line.len() / 2) as u64
}

/// A replace that fails (here its rename: a directory holds the name;
/// on a host, a full disk) leaves what was there and no temporary file.
#[test]
fn a_failed_replace_leaves_no_temporary_file() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("head.json");
    fs::create_dir(&path).unwrap();
    fs::write(path.join("kept"), b"x").unwrap();
    assert!(durable::replace_file(&path, b"{}").is_err());
    assert!(!durable::tmp_path(&path).exists(), "the temporary file stays");
    assert!(path.join("kept").exists());
}

/// A temporary images directory that cannot be removed (a killed crabd's
/// checkpoint still writing in it, in the shim; here a directory made
/// immutable) does not stop the store from opening, again and again: it
/// is moved aside once, under a name no later sweep renames, the number
/// it held is given out again, and the next checkpoint removes it. Needs
/// root (chattr, on a filesystem that has it): CI runs it as root.
#[test]
fn a_temporary_directory_in_use_does_not_stop_the_open() {
    let fx = fixture();
    fx.run("a");
    drop(fx.store);
    let images = fx.dir.path().join("images/s1");
    let busy = images.join(".tmp-2-1/busy");
    fs::create_dir_all(&busy).unwrap();
    fs::write(busy.join("pages-1.img"), b"x").unwrap();
    let chattr = |flag: &str, dir: &Path| {
        let ok = Command::new("chattr")
            .arg(flag)
            .arg(dir)
            .status()
            .unwrap()
            .success();
        assert!(ok, "chattr {flag} {}", dir.display());
    };
    chattr("+i", &busy);
    let hidden = || -> Vec<String> {
        fs::read_dir(&images)
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .filter(|n| n.starts_with('.'))
            .collect()
    };
    let first = VersionStore::open(fx.dir.path()).map(drop);
    let after_first = hidden();
    let second = VersionStore::open(fx.dir.path());
    let after_second = hidden();
    for name in &after_second {
        chattr("-i", &images.join(name).join("busy"));
    }
    first.unwrap();
    let store = second.unwrap();
    assert_eq!(after_first.len(), 1, "{after_first:?}");
    assert!(after_first[0].starts_with(".stale.tmp-2-1-"), "{after_first:?}");
    assert_eq!(after_second, after_first, "a second sweep renamed it");
    // Its writer gone, the next checkpoint of a live store removes it.
    assert_eq!(publish(&store, &sid("s1"), "a").version, 2);
    assert_eq!(hidden(), Vec::<String>::new(), "the live store kept it");
}
