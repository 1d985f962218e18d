//! Retention and removal: what is kept, what is freed, what is refused.

use super::*;

/// Runs `script`, then `retain(keep)`, and checks the removed versions, the
/// snapshots freed, the images directories removed and the listing after
/// (also after reopening), and that numbering goes on.
fn check(script: &str, keep: usize, versions: &[u64], unused: &[&str], images: &[u64], after: &str) {
    let fx = fixture();
    let n = fx.run(script).len() as u64;
    let removal = fx.store.retain(&fx.s1, keep).unwrap();
    let names: Vec<&str> = removal.unused_snapshots.iter().map(|s| s.name.as_str()).collect();
    let ctx = format!("{script:?} keep {keep}");
    assert_eq!(removal.versions, versions, "removed versions, {ctx}");
    assert_eq!(names, unused, "unused snapshots, {ctx}");
    assert_eq!(removal.removed_images, images, "removed images, {ctx}");
    assert_eq!(
        summary(&fx.store.verified_versions(&fx.s1).unwrap()),
        after,
        "{ctx}"
    );
    for v in images {
        assert!(!fx.images(*v).exists(), "images of {v}, {ctx}");
    }
    let fx = fx.reopen();
    assert_eq!(
        summary(&fx.store.verified_versions(&fx.s1).unwrap()),
        after,
        "after reopen, {ctx}"
    );
    assert_eq!(fx.store.recovery(&fx.s1).unwrap(), Recovery::default(), "{ctx}");
    assert_eq!(fx.run("n")[0].version, n + 1, "numbering, {ctx}");
}

#[test]
fn retain_keeps_the_newest_and_their_dependencies() {
    check("a n n n", 2, &[2], &[], &[], "v1 v3 v4");
    check("a f f f", 1, &[2, 3], &["crab-2", "crab-3"], &[], "v1 v4");
    check("a a n f", 2, &[1], &["crab-1"], &[1], "v2 v3 v4");
    check("p p p", 1, &[1, 2], &[], &[1, 2], "v3");
    // The head (the newest here) and what it uses stay, whatever `keep`.
    check("a n", 0, &[], &[], &[], "v1 v2");
    check("p a", 0, &[1], &[], &[1], "v2");
    check("a n", 5, &[], &[], &[], "v1 v2");
    check("", 1, &[], &[], &[], "");
}

#[test]
fn retain_drops_old_corrupt_lines() {
    let fx = fixture();
    fx.run("a n n n");
    let path = fx.manifest();
    corrupt_line(&path, 2, 3);
    assert_eq!(fx.summary(), "v1 #3!line3 v3 v4");
    let removal = fx.store.retain(&fx.s1, 2).unwrap();
    assert_eq!((removal.versions.len(), removal.n_bad_lines), (0, 1));
    assert_eq!(fx.summary(), "v1 v3 v4");
    // A kept corrupt line stays (and is listed) after compaction.
    fx.run("n");
    let mut bytes = fs::read(&path).unwrap();
    let last = bytes.len() - 10;
    bytes[last] ^= 1;
    fs::write(&path, bytes).unwrap();
    fx.store.retain(&fx.s1, 2).unwrap();
    assert_eq!(fx.summary(), "v1 v4 #4!line4");
}

/// Runs `script`, begins a version with `pending` if given, removes
/// `version`, and checks the outcome and the listing after.
fn check_remove(script: &str, pending: Option<Capture>, version: u64, expected: &str, after: &str) {
    let fx = fixture();
    fx.run(script);
    let pending = pending.map(|c| fx.store.begin_version(&fx.s1, new_version(c)).unwrap());
    let got = match fx.store.remove_version(&fx.s1, version) {
        Ok(removal) => {
            let names: Vec<&str> = removal.unused_snapshots.iter().map(|s| s.name.as_str()).collect();
            format!("ok {:?} {names:?} {:?}", removal.versions, removal.removed_images)
        }
        Err(e) => outcome::<()>(Err(e)),
    };
    assert_eq!(got, expected, "{script:?} remove {version}");
    assert_eq!(fx.summary(), after, "{script:?} remove {version}");
    if let Some(pending) = pending {
        pending.publish().unwrap();
    }
}

#[test]
fn remove_version_refuses_what_others_use() {
    check_remove("a n f", None, 1, "in-use 1 by 2", "v1 v2 v3");
    check_remove("a n f", None, 2, "ok [2] [] []", "v1 v3");
    check_remove("a n f", None, 3, "ok [3] [\"crab-3\"] []", "v1 v2");
    check_remove("a a", None, 1, "ok [1] [\"crab-1\"] [1]", "v2");
    check_remove("a a", None, 9, "unknown-version 9", "v1 v2");
    // What a pending version reuses is in use too.
    check_remove("a", Some(Capture::Nothing), 1, "in-use 1 by 2", "v1");
    check_remove("a f", Some(Capture::Proc), 2, "ok [2] [] []", "v1");
}

#[test]
fn numbers_are_not_given_out_again_after_removal() {
    let fx = fixture();
    fx.run("a n n");
    fx.store.remove_version(&fx.s1, 3).unwrap();
    fx.store.retain(&fx.s1, 0).unwrap();
    let fx = fx.reopen();
    assert_eq!(fx.summary(), "");
    assert_eq!(fx.run("a")[0].version, 4);
}

#[test]
fn images_a_compaction_left_behind_are_removed_on_open() {
    let fx = fixture();
    fx.run("a a n");
    let saved = tempfile::tempdir().unwrap();
    fs::rename(fx.images(1), saved.path().join("1")).unwrap();
    fs::create_dir(fx.images(1)).unwrap();
    assert_eq!(fx.store.retain(&fx.s1, 2).unwrap().removed_images, vec![1]);
    // As if the process died after the compacted manifest was renamed in
    // and before the images directory was removed.
    fs::rename(saved.path().join("1"), fx.images(1)).unwrap();
    let fx = fx.reopen();
    assert_eq!(fx.store.recovery(&fx.s1).unwrap().removed_images, vec![1]);
    assert!(!fx.images(1).exists());
    assert_eq!(fx.summary(), "v2 v3");
}

#[test]
fn forget_removes_a_sandbox_and_names_its_snapshots() {
    let fx = fixture();
    let s2 = sid("s2");
    fx.store.register(&s2).unwrap();
    fx.run("a f n p a");
    publish(&fx.store, &s2, "a");
    // A version being written keeps the sandbox.
    let pending = fx
        .store
        .begin_version(&fx.s1, new_version(Capture::Proc))
        .unwrap();
    assert!(matches!(
        fx.store.forget(&fx.s1),
        Err(StoreError::PendingExists { .. })
    ));
    drop(pending);
    let removal = fx.store.forget(&fx.s1).unwrap();
    assert_eq!(removal.versions, [1, 2, 3, 4, 5]);
    let names: Vec<&str> = removal.unused_snapshots.iter().map(|s| s.name.as_str()).collect();
    assert_eq!(names, ["crab-1", "crab-2", "crab-5"]);
    assert_eq!(removal.removed_images, [1, 4, 5]);
    assert!(!fx.manifest().exists());
    assert!(!fx.dir.path().join("images/s1").exists());
    fx.store.empty_trash();
    assert_eq!(fs::read_dir(fx.store.trash_dir()).unwrap().count(), 0);
    assert!(matches!(
        fx.store.versions(&fx.s1),
        Err(StoreError::UnknownSandbox { .. })
    ));
    // The other sandbox is untouched; the id can start a new history.
    let fx = fx.reopen();
    assert_eq!(fx.store.sandboxes(), std::slice::from_ref(&s2));
    assert_eq!(summary(&fx.store.verified_versions(&s2).unwrap()), "v1");
    fx.store.register(&fx.s1).unwrap();
    assert_eq!(fx.run("n")[0].version, 1);
}

#[test]
fn open_removes_what_a_cut_short_forget_left() {
    let fx = fixture();
    fx.run("a a");
    // A crash after the manifest went: its directory and images stay.
    fs::remove_file(fx.manifest()).unwrap();
    // Names that are no sandbox's, and files, are not the store's to remove.
    fs::create_dir_all(fx.dir.path().join("images/.keep")).unwrap();
    fs::write(fx.dir.path().join("sandboxes/notes"), "mine").unwrap();
    let fx = fx.reopen();
    assert!(fx.store.sandboxes().is_empty());
    assert!(!fx.dir.path().join("sandboxes/s1").exists());
    assert!(!fx.dir.path().join("images/s1").exists());
    assert!(fx.dir.path().join("images/.keep").exists());
    assert!(fx.dir.path().join("sandboxes/notes").exists());
    assert_eq!(fs::read_dir(fx.store.trash_dir()).unwrap().count(), 0);
}
