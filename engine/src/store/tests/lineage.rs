//! Heads and parents: a version inherits from the version the running
//! sandbox descends from, not from the newest line, across reopens.

use super::*;

/// `version:class parent process-holder fs-snapshot` of `r`.
fn shape(r: &VersionRecord) -> String {
    let parent = r.parent.map_or("^-".to_owned(), |p| format!("^{p}"));
    let p = r.process_image.map_or("p-".to_owned(), |h| format!("p{h}"));
    let f = r.fs_snapshot.as_ref().map_or("f-".to_owned(), |s| {
        format!("f{}", s.name.as_str().trim_start_matches("crab-"))
    });
    format!("{}:{:?} {parent} {p} {f}", r.version, r.class).to_lowercase()
}

/// The sequence: full, proc, back to 1, fs, back to 3: version 3
/// pairs its files with version 1's processes, not version 2's.
#[test]
fn a_version_after_a_rollback_inherits_from_the_head() {
    let fx = fixture();
    let r = fx.run("a p");
    assert_eq!(shape(&r[1]), "2:proc ^1 p2 f1");
    fx.store.set_head(&fx.s1, Some(1)).unwrap();
    assert_eq!(fx.store.head(&fx.s1).unwrap(), Some(1));
    let v3 = publish(&fx.store, &fx.s1, "f");
    assert_eq!(shape(&v3), "3:fs ^1 p1 f3");
    assert_eq!(fx.store.get(&fx.s1, 3).unwrap().images_dir, Some(fx.images(1)));
    // none and proc inherit the same way.
    fx.store.set_head(&fx.s1, Some(2)).unwrap();
    assert_eq!(shape(&publish(&fx.store, &fx.s1, "n")), "4:none ^2 p2 f1");
    fx.store.set_head(&fx.s1, Some(3)).unwrap();
    assert_eq!(shape(&publish(&fx.store, &fx.s1, "p")), "5:proc ^3 p5 f3");
    // Every version is kept.
    assert_eq!(fx.summary(), "v1 v2 v3 v4 v5");
}

#[test]
fn the_head_survives_a_reopen() {
    let fx = fixture();
    fx.run("a p a");
    fx.store.set_head(&fx.s1, Some(2)).unwrap();
    let fx = fx.reopen();
    assert_eq!(fx.store.head(&fx.s1).unwrap(), Some(2));
    // A publish after the move is the head, after a reopen too.
    assert_eq!(shape(&publish(&fx.store, &fx.s1, "n")), "4:none ^2 p2 f1");
    let fx = fx.reopen();
    assert_eq!(fx.store.head(&fx.s1).unwrap(), Some(4));
    // Back to a version the head file already named: what was published
    // after the earlier move does not count.
    fx.store.set_head(&fx.s1, Some(2)).unwrap();
    let fx = fx.reopen();
    assert_eq!(fx.store.head(&fx.s1).unwrap(), Some(2));
    // Without a head file (older stores) the newest line is the head.
    fs::remove_file(fx.dir.path().join("sandboxes/s1/head.json")).unwrap();
    let fx = fx.reopen();
    assert_eq!(fx.store.head(&fx.s1).unwrap(), Some(4));
}

#[test]
fn no_head_makes_nothing_inherited() {
    let fx = fixture();
    assert_eq!(fx.store.head(&fx.s1).unwrap(), None);
    fx.run("a");
    // A restarted task: its files and processes are no version's.
    fx.store.set_head(&fx.s1, None).unwrap();
    assert_eq!(shape(&publish(&fx.store, &fx.s1, "n")), "2:none ^- p- f-");
    fx.store.set_head(&fx.s1, None).unwrap();
    let fx = fx.reopen();
    assert_eq!(fx.store.head(&fx.s1).unwrap(), None);
    // A corrupt head file means no head, never a wrong one.
    fs::write(fx.dir.path().join("sandboxes/s1/head.json"), b"{\"version\":1,").unwrap();
    let fx = fx.reopen();
    assert_eq!(fx.store.head(&fx.s1).unwrap(), None);
}

#[test]
fn bad_heads_are_refused() {
    let fx = fixture();
    fx.run("a");
    assert_eq!(outcome(fx.store.set_head(&fx.s1, Some(9))), "unknown-version 9");
    assert_eq!(
        outcome(fx.store.set_head(&sid("nobody"), Some(1))),
        "unknown-sandbox nobody"
    );
    let pending = fx
        .store
        .begin_version(&fx.s1, new_version(Capture::Proc))
        .unwrap();
    assert_eq!(outcome(fx.store.set_head(&fx.s1, Some(1))), "pending 2");
    drop(pending);
    assert_eq!(fx.store.head(&fx.s1).unwrap(), Some(1));
}

#[test]
fn retention_keeps_the_head_and_removal_clears_it() {
    let fx = fixture();
    fx.run("a a a a");
    fx.store.set_head(&fx.s1, Some(1)).unwrap();
    let removal = fx.store.retain(&fx.s1, 1).unwrap();
    assert_eq!(removal.versions, vec![2, 3]);
    assert_eq!(fx.summary(), "v1 v4");
    assert_eq!(fx.store.head(&fx.s1).unwrap(), Some(1));
    fx.store.remove_version(&fx.s1, 1).unwrap();
    assert_eq!(fx.store.head(&fx.s1).unwrap(), None);
    let fx = fx.reopen();
    assert_eq!(fx.store.head(&fx.s1).unwrap(), None);
    assert_eq!(shape(&publish(&fx.store, &fx.s1, "n")), "5:none ^- p- f-");
}

/// A corrupt line after the head may be a newer head: no head then (the
/// next version is whole), never an older one.
#[test]
fn a_corrupt_line_after_the_head_leaves_no_head() {
    let fx = fixture();
    fx.run("a p");
    fx.store.set_head(&fx.s1, Some(1)).unwrap();
    publish(&fx.store, &fx.s1, "f");
    // Lines: the header, then versions 1, 2 and 3.
    corrupt_line(&fx.manifest(), 3, 70);
    let fx = fx.reopen();
    assert_eq!(fx.store.head(&fx.s1).unwrap(), None);
    // Corrupt lines older than the move do not matter.
    let fx = fixture();
    fx.run("a p a");
    fx.store.set_head(&fx.s1, Some(3)).unwrap();
    corrupt_line(&fx.manifest(), 2, 70);
    let fx = fx.reopen();
    assert_eq!(fx.store.head(&fx.s1).unwrap(), Some(3));
}
