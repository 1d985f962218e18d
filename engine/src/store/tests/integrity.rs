//! Damage to manifests and images: what is reported, what still restores.

use super::*;

/// Something done to a store behind its back.
#[derive(Debug, Clone, Copy)]
enum Damage {
    /// Flip a bit of byte `at` of manifest line `line` (from 1).
    FlipLine { line: usize, at: usize },
    /// Replace manifest line `line` by the same line of sandbox `s2`.
    ForeignLine { line: usize },
    /// Flip a bit of the first byte of an image file.
    FlipImage { version: u64, file: &'static str },
    /// Cut an image file short by one byte.
    ShortImage { version: u64, file: &'static str },
    /// Remove an image file.
    RemoveImage { version: u64, file: &'static str },
}

/// Runs `script` on `s1` (and on `s2`), applies `damage`, reopens, and
/// checks the quick listing, the verified listing, `latest_valid`, and
/// `get` of each `(version, outcome)`.
fn check(script: &str, damage: Damage, quick: &str, verified: &str, latest: &str, gets: &[(u64, &str)]) {
    let fx = fixture();
    fx.store.register(&sid("s2")).unwrap();
    fx.run(script);
    for code in script.split_whitespace() {
        publish(&fx.store, &sid("s2"), code);
    }
    apply(&fx, damage);
    let fx = fx.reopen();
    let ctx = format!("{script:?} {damage:?}");
    assert_eq!(fx.summary(), quick, "quick listing, {ctx}");
    assert_eq!(
        summary(&fx.store.verified_versions(&fx.s1).unwrap()),
        verified,
        "verified listing, {ctx}"
    );
    let got = match fx.store.latest_valid(&fx.s1) {
        Ok(v) => format!("v{}", v.record.version),
        Err(e) => outcome::<()>(Err(e)),
    };
    assert_eq!(got, latest, "latest, {ctx}");
    for &(version, expected) in gets {
        assert_eq!(
            outcome(fx.store.get(&fx.s1, version)),
            expected,
            "get {version}, {ctx}"
        );
    }
    // The other sandbox is untouched.
    let n = script.split_whitespace().count();
    let all = (1..=n).map(|v| format!("v{v}")).collect::<Vec<_>>().join(" ");
    assert_eq!(
        summary(&fx.store.verified_versions(&sid("s2")).unwrap()),
        all,
        "s2, {ctx}"
    );
}

fn apply(fx: &Fixture, damage: Damage) {
    let path = fx.manifest();
    let mut lines: Vec<Vec<u8>> = fs::read(&path)
        .unwrap()
        .split_inclusive(|&b| b == b'\n')
        .map(<[u8]>::to_vec)
        .collect();
    let image = |version: u64, file: &str| fx.images(version).join(file);
    match damage {
        Damage::FlipLine { line, at } => lines[line - 1][at] ^= 1,
        Damage::ForeignLine { line } => {
            let other = fs::read(fx.dir.path().join("sandboxes/s2/versions.log")).unwrap();
            lines[line - 1] = other
                .split_inclusive(|&b| b == b'\n')
                .nth(line - 1)
                .unwrap()
                .to_vec();
        }
        Damage::FlipImage { version, file } => {
            let mut bytes = fs::read(image(version, file)).unwrap();
            bytes[0] ^= 1;
            fs::write(image(version, file), bytes).unwrap();
        }
        Damage::ShortImage { version, file } => {
            let bytes = fs::read(image(version, file)).unwrap();
            fs::write(image(version, file), &bytes[1..]).unwrap();
        }
        Damage::RemoveImage { version, file } => fs::remove_file(image(version, file)).unwrap(),
    }
    fs::write(&path, lines.concat()).unwrap();
}

#[test]
fn corrupt_lines_are_reported_and_skipped() {
    use Damage::FlipLine;
    // A version in the middle; its neighbours stay valid. (Line 1 is the
    // header, so version v is on line v + 1.)
    let v2_json = FlipLine { line: 3, at: 100 };
    check(
        "a n f",
        v2_json,
        "v1 #3!line3 v3",
        "v1 #3!line3 v3",
        "v3",
        &[(2, "corrupt-line 3"), (3, "ok")],
    );
    // The newest version: latest falls back.
    let v3_sum = FlipLine { line: 4, at: 0 };
    check(
        "a n f",
        v3_sum,
        "v1 v2 #4!line4",
        "v1 v2 #4!line4",
        "v2",
        &[(3, "corrupt-line 4"), (4, "unknown-version 4")],
    );
    // The version holding the process image: its users are invalid too.
    let v1 = FlipLine { line: 2, at: 80 };
    let all_bad = "#2!line2 v2!line2 v3!line2";
    check(
        "a n f",
        v1,
        all_bad,
        all_bad,
        "no-valid-version",
        &[(1, "corrupt-line 2"), (3, "corrupt-line 2")],
    );
    let v1_of_four = FlipLine { line: 2, at: 70 };
    let fallback = "#2!line2 v2!line2 v3 v4";
    check(
        "a n p n",
        v1_of_four,
        fallback,
        fallback,
        "v4",
        &[(2, "corrupt-line 2"), (4, "ok")],
    );
    // The header: versions are unaffected.
    let header = FlipLine { line: 1, at: 90 };
    check(
        "a n",
        header,
        "#1!line1 v1 v2",
        "#1!line1 v1 v2",
        "v2",
        &[(2, "ok")],
    );
    // A line copied from another sandbox's manifest.
    let foreign = Damage::ForeignLine { line: 3 };
    check(
        "a n",
        foreign,
        "v1 #3!of-s2",
        "v1 #3!of-s2",
        "v1",
        &[(2, "not-of-sandbox 3 s2"), (1, "ok")],
    );
}

#[test]
fn corrupt_images_invalidate_their_users() {
    use Damage::{FlipImage, RemoveImage, ShortImage};
    let pages = "pages.img";
    let core = "core/core.img";
    // Same size: only hashing sees it.
    let c1 = "v1!corrupt-1/pages.img v2!corrupt-1/pages.img v3!corrupt-1/pages.img";
    check(
        "a n n",
        FlipImage {
            version: 1,
            file: pages,
        },
        "v1 v2 v3",
        c1,
        "no-valid-version",
        &[(1, "corrupt-image 1 pages.img"), (3, "corrupt-image 1 pages.img")],
    );
    let c2 = "v1 v2!corrupt-2/core/core.img v3!corrupt-2/core/core.img";
    check(
        "a p n",
        FlipImage {
            version: 2,
            file: core,
        },
        "v1 v2 v3",
        c2,
        "v1",
        &[(3, "corrupt-image 2 core/core.img")],
    );
    let c3 = "v1!corrupt-1/pages.img v2!corrupt-1/pages.img v3 v4";
    check(
        "a n p n",
        FlipImage {
            version: 1,
            file: pages,
        },
        "v1 v2 v3 v4",
        c3,
        "v4",
        &[(2, "corrupt-image 1 pages.img")],
    );
    // Size changes and missing files show in the quick listing too.
    let s = "v1 v2!corrupt-2/pages.img";
    check(
        "a p",
        ShortImage {
            version: 2,
            file: pages,
        },
        s,
        s,
        "v1",
        &[(2, "corrupt-image 2 pages.img")],
    );
    let m = "v1 v2!missing-2/core/core.img v3!missing-2/core/core.img";
    check(
        "a a n",
        RemoveImage {
            version: 2,
            file: core,
        },
        m,
        m,
        "v1",
        &[(3, "missing-image 2 core/core.img")],
    );
}

#[test]
fn a_corrupt_newest_line_forces_a_full_version() {
    let fx = fixture();
    fx.run("a n");
    apply(&fx, Damage::FlipLine { line: 3, at: 5 });
    let fx = fx.reopen();
    for capture in [Capture::Nothing, Capture::Fs(snap("x")), Capture::Proc] {
        assert_eq!(
            outcome(fx.store.begin_version(&fx.s1, new_version(capture))),
            "cannot-inherit 3"
        );
    }
    // The corrupt line's number (2) is not given out again.
    assert_eq!(fx.run("a n")[0].version, 3);
    assert_eq!(fx.summary(), "v1 #3!line3 v3 v4");
}

#[test]
fn a_corrupt_version_falls_back_to_its_nearest_valid_ancestor() {
    let nearest = |script: &str, damage: Damage, from: u64| {
        let fx = fixture();
        fx.run(script);
        apply(&fx, damage);
        let fx = fx.reopen();
        match fx.store.nearest_valid(&fx.s1, from) {
            Ok((v, passed)) => {
                let passed: Vec<_> = passed.into_iter().map(|e| outcome::<()>(Err(e))).collect();
                format!("v{} past [{}]", v.record.version, passed.join(", "))
            }
            Err(e) => outcome::<()>(Err(e)),
        }
    };
    let flip = |version, file| Damage::FlipImage { version, file };
    assert_eq!(
        nearest("a p p", flip(3, "pages.img"), 3),
        "v2 past [corrupt-image 3 pages.img]"
    );
    // A version that reuses a corrupt image falls back past its holder.
    assert_eq!(
        nearest("a p n", flip(2, "pages.img"), 3),
        "v1 past [corrupt-image 2 pages.img, corrupt-image 2 pages.img]"
    );
    // An intact version is itself; another's damage does not matter.
    assert_eq!(nearest("a p p", flip(2, "pages.img"), 3), "v3 past []");
    assert_eq!(nearest("a n", flip(1, "pages.img"), 2), "no-valid-version");
    assert_eq!(nearest("a n", flip(1, "pages.img"), 9), "unknown-version 9");
}
