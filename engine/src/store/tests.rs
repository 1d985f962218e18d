//! The version store's tests: shared helpers and the publish, query and
//! argument checks; integrity, retention and crash tests in `tests/`.

mod crash;
mod integrity;
mod lineage;
mod retention;

use std::fs;
use std::io::{BufRead, Write};
use std::path::PathBuf;
use std::sync::Arc;

use crab_snapshotter::{BackendKind, SnapshotName};
use tempfile::TempDir;

use super::*;

/// The env var that makes [`crash_point`] stop at the point it names.
pub(super) const STOP_AT_ENV: &str = "CRAB_ENGINE_TEST_STOP_AT";
/// What a stopped test process prints before its point name.
const STOPPED: &str = "crab-engine-test-stopped-at";

/// Says that the process reached `point` and waits to be killed. stdin is a
/// pipe its parent never writes to: if it closes, the parent is gone and
/// the process exits without finishing the publish.
pub(super) fn stop_here(point: &str) {
    // On a line of its own: the test harness has written "test … ... "
    // without a newline before the test body runs.
    println!("\n{STOPPED} {point}");
    std::io::stdout().flush().unwrap();
    let mut line = String::new();
    let _ = std::io::stdin().lock().read_line(&mut line);
    std::process::exit(99);
}

/// A store in a temporary directory with sandbox `s1` registered.
struct Fixture {
    dir: TempDir,
    store: VersionStore,
    s1: SandboxId,
}

fn fixture() -> Fixture {
    let dir = tempfile::tempdir().unwrap();
    let store = VersionStore::open(dir.path()).unwrap();
    let s1 = sid("s1");
    store.register(&s1).unwrap();
    Fixture { dir, store, s1 }
}

// === impl Fixture ===

impl Fixture {
    /// Drops the store and opens it again.
    fn reopen(self) -> Fixture {
        let Fixture { dir, store, s1 } = self;
        drop(store);
        let store = VersionStore::open(dir.path()).unwrap();
        Fixture { dir, store, s1 }
    }

    fn manifest(&self) -> PathBuf {
        self.dir.path().join("sandboxes/s1/versions.log")
    }

    fn images(&self, version: u64) -> PathBuf {
        self.dir.path().join(format!("images/s1/{version}"))
    }

    /// Runs `script` on `s1` (see [`publish`]).
    fn run(&self, script: &str) -> Vec<VersionRecord> {
        script
            .split_whitespace()
            .map(|c| publish(&self.store, &self.s1, c))
            .collect()
    }

    fn summary(&self) -> String {
        summary(&self.store.versions(&self.s1).unwrap())
    }
}

fn sid(id: &str) -> SandboxId {
    SandboxId::new(id).unwrap()
}

fn snap(name: &str) -> FsSnapshot {
    FsSnapshot {
        backend: BackendKind::Zfs,
        name: SnapshotName::new(name).unwrap(),
    }
}

/// Flips a bit of byte `at` of line `line` (from 0: the header) of the
/// manifest at `path`, which then fails its checksum.
fn corrupt_line(path: &std::path::Path, line: usize, at: usize) {
    let mut bytes = fs::read(path).unwrap();
    let start = match line {
        0 => 0,
        n => {
            bytes
                .iter()
                .enumerate()
                .filter(|(_, &b)| b == b'\n')
                .nth(n - 1)
                .unwrap()
                .0
                + 1
        }
    };
    bytes[start + at] ^= 1;
    fs::write(path, bytes).unwrap();
}

/// Publishes one version of class `code` (`n`one, `f`s, `p`roc, `a`ll =
/// full); fs snapshots are named `crab-<version>`, process images are
/// `pages.img` and `core/core.img`.
fn publish(store: &VersionStore, sandbox: &SandboxId, code: &str) -> VersionRecord {
    // A full version never reuses anything, so it can always be begun: it
    // tells the number the real one will get.
    let version = store
        .begin_version(sandbox, new_version(Capture::Full(snap("peek"))))
        .unwrap()
        .version();
    let fs = snap(&format!("crab-{version}"));
    let capture = match code {
        "n" => Capture::Nothing,
        "f" => Capture::Fs(fs),
        "p" => Capture::Proc,
        "a" => Capture::Full(fs),
        _ => panic!("unknown class code {code:?}"),
    };
    let pending = store.begin_version(sandbox, new_version(capture)).unwrap();
    assert_eq!(pending.version(), version);
    if let Some(dir) = pending.images_dir() {
        fs::write(dir.join("pages.img"), format!("pages of {version}\n").repeat(100)).unwrap();
        fs::create_dir(dir.join("core")).unwrap();
        fs::write(dir.join("core/core.img"), format!("core {version}")).unwrap();
    }
    pending.publish().unwrap()
}

fn new_version(capture: Capture) -> NewVersion {
    NewVersion {
        turn: Some(7),
        branch: 0,
        transcript_turns: 7,
        capture,
    }
}

/// One word per line: `v<n>` (valid), `v<n>!<defect>`, `#<line>!<defect>`.
fn summary(infos: &[VersionInfo]) -> String {
    let word = |info: &VersionInfo| {
        let head = match &info.record {
            Some(r) => format!("v{}", r.version),
            None => format!("#{}", info.line),
        };
        match &info.defect {
            None => head,
            Some(d) => format!("{head}!{}", defect(d)),
        }
    };
    infos.iter().map(word).collect::<Vec<_>>().join(" ")
}

fn defect(d: &Defect) -> String {
    match d {
        Defect::CorruptLine { line } => format!("line{line}"),
        Defect::NotOfSandbox { found, .. } => format!("of-{found}"),
        Defect::MissingImage { holder, file } => format!("missing-{holder}/{file}"),
        Defect::CorruptImage { holder, file } => format!("corrupt-{holder}/{file}"),
        Defect::MissingDependency { holder } => format!("dep-{holder}"),
    }
}

/// A short, comparable form of a result's error variant and fields.
fn outcome<T>(result: Result<T, StoreError>) -> String {
    match result {
        Ok(_) => "ok".to_owned(),
        Err(e) => match e {
            StoreError::UnknownVersion { version, .. } => format!("unknown-version {version}"),
            StoreError::UnknownSandbox { sandbox } => format!("unknown-sandbox {sandbox}"),
            StoreError::SandboxExists { sandbox } => format!("exists {sandbox}"),
            StoreError::InvalidSandboxId(e) => format!("invalid-id {}", e.id),
            StoreError::NoValidVersion { .. } => "no-valid-version".to_owned(),
            StoreError::CorruptManifestLine { line, .. } => format!("corrupt-line {line}"),
            StoreError::NotOfSandbox { line, found, .. } => format!("not-of-sandbox {line} {found}"),
            StoreError::MissingImage { version, file, .. } => format!("missing-image {version} {file}"),
            StoreError::CorruptImage { version, file, .. } => format!("corrupt-image {version} {file}"),
            StoreError::MissingDependency { version, needs, .. } => format!("missing-dep {version} {needs}"),
            StoreError::PendingExists { version, .. } => format!("pending {version}"),
            StoreError::CannotInherit { line, .. } => format!("cannot-inherit {line}"),
            StoreError::VersionInUse { version, user, .. } => format!("in-use {version} by {user}"),
            StoreError::Locked { .. } => "locked".to_owned(),
            StoreError::UnsupportedImageEntry { path } => {
                format!("unsupported {}", path.file_name().unwrap().to_string_lossy())
            }
            StoreError::PartialLine { .. } => "partial-line".to_owned(),
            e @ (StoreError::Encode(_) | StoreError::Io { .. }) => panic!("unexpected error: {e}"),
        },
    }
}

/// Each version's class, process image holder and fs snapshot, as
/// `<version>:<class> p<holder>|p- f<snapshot version>|f-`.
fn check_publish(script: &str, expected: &str) {
    let fx = fixture();
    let records = fx.run(script);
    let got: Vec<String> = records
        .iter()
        .map(|r| {
            let p = r.process_image.map_or("p-".to_owned(), |h| format!("p{h}"));
            let f = r.fs_snapshot.as_ref().map_or("f-".to_owned(), |s| {
                format!("f{}", s.name.as_str().trim_start_matches("crab-"))
            });
            format!("{}:{:?} {p} {f}", r.version, r.class).to_lowercase()
        })
        .collect();
    assert_eq!(got.join(" | "), expected, "script {script:?}");
    // Holders list their files; reusers list none.
    for r in &records {
        assert_eq!(r.images.len(), if r.holds_images() { 2 } else { 0 }, "{r:?}");
    }
    let n = records.len();
    let valid = (1..=n).map(|v| format!("v{v}")).collect::<Vec<_>>().join(" ");
    assert_eq!(fx.summary(), valid);
    let fx = fx.reopen();
    assert_eq!(fx.summary(), valid, "after reopen");
    if n > 0 {
        assert_eq!(fx.store.latest_valid(&fx.s1).unwrap().record, records[n - 1]);
    }
}

/// The daemon moves stores and pending versions between threads.
#[test]
fn handles_are_send_and_sync() {
    fn check<T: Send + Sync>() {}
    check::<VersionStore>();
    check::<PendingVersion>();
    check::<StoreError>();
}

#[test]
fn publish_reuses_what_a_class_does_not_capture() {
    check_publish("", "");
    check_publish("n", "1:none p- f-");
    check_publish("f n", "1:fs p- f1 | 2:none p- f1");
    check_publish(
        "a n f p n a",
        "1:full p1 f1 | 2:none p1 f1 | 3:fs p1 f3 | 4:proc p4 f3 | 5:none p4 f3 | 6:full p6 f6",
    );
    check_publish("p p", "1:proc p1 f- | 2:proc p2 f-");
}

#[test]
fn get_verifies_and_locates_images() {
    let fx = fixture();
    fx.run("a n f");
    let v3 = fx.store.get(&fx.s1, 3).unwrap();
    assert_eq!(v3.images_dir, Some(fx.images(1)));
    assert_eq!(
        fs::read_to_string(fx.images(1).join("core/core.img")).unwrap(),
        "core 1"
    );
    let check = |version, expected: &str| assert_eq!(outcome(fx.store.get(&fx.s1, version)), expected);
    check(1, "ok");
    check(3, "ok");
    check(4, "unknown-version 4");
    check(0, "unknown-version 0");
    assert_eq!(outcome(fx.store.get(&sid("nope"), 1)), "unknown-sandbox nope");
}

#[test]
fn arguments_are_checked() {
    let fx = fixture();
    let check = |result: String, expected: &str| assert_eq!(result, expected);
    check(outcome(fx.store.register(&fx.s1)), "exists s1");
    check(
        outcome(SandboxId::new("../s1").map_err(StoreError::from)),
        "invalid-id ../s1",
    );
    check(
        outcome(SandboxId::new("s1/../../etc").map_err(StoreError::from)),
        "invalid-id s1/../../etc",
    );
    check(outcome(fx.store.versions(&sid("s2"))), "unknown-sandbox s2");
    check(outcome(VersionStore::open(fx.dir.path())), "locked");
    // One pending version per sandbox; dropping it frees the slot and its
    // directory.
    let pending = fx
        .store
        .begin_version(&fx.s1, new_version(Capture::Proc))
        .unwrap();
    let tmp = pending.images_dir().unwrap().to_owned();
    assert!(tmp.is_dir());
    check(
        outcome(fx.store.begin_version(&fx.s1, new_version(Capture::Nothing))),
        "pending 1",
    );
    drop(pending);
    assert!(!tmp.exists());
    check(
        outcome(fx.store.begin_version(&fx.s1, new_version(Capture::Nothing))),
        "ok",
    );
    // A symlink among the images is refused and leaves nothing behind.
    let pending = fx
        .store
        .begin_version(&fx.s1, new_version(Capture::Proc))
        .unwrap();
    std::os::unix::fs::symlink("/etc/passwd", pending.images_dir().unwrap().join("evil.img")).unwrap();
    check(outcome(pending.publish()), "unsupported evil.img");
    assert!(!tmp.exists());
    assert_eq!(fx.summary(), "");
    fx.run("a");
    assert_eq!(fx.summary(), "v1");
}

#[test]
fn no_line_is_glued_to_a_partial_one() {
    let fx = fixture();
    fx.run("a");
    // What a failed append leaves when cutting it back failed too.
    let mut file = fs::OpenOptions::new().append(true).open(fx.manifest()).unwrap();
    file.write_all(b"0123 partial").unwrap();
    drop(file);
    let pending = fx
        .store
        .begin_version(&fx.s1, new_version(Capture::Proc))
        .unwrap();
    assert_eq!(outcome(pending.publish()), "partial-line");
    assert!(!fx.images(2).exists());
    let fx = fx.reopen();
    assert_eq!(
        fx.store.recovery(&fx.s1).unwrap().torn_line,
        Some(TornLine { line: 3, bytes: 12 })
    );
    assert_eq!(fx.run("n")[0].version, 2);
    assert_eq!(fx.summary(), "v1 v2");
}

#[test]
fn leftover_tmp_dirs_are_removed_on_open() {
    let fx = fixture();
    fx.run("a");
    fs::create_dir_all(fx.dir.path().join("images/s1/.tmp-9/core")).unwrap();
    fs::write(fx.dir.path().join("images/s1/.tmp-9/core/x"), "x").unwrap();
    fs::write(
        fx.dir.path().join("sandboxes/s1/versions.log.tmp"),
        "half a compaction",
    )
    .unwrap();
    let fx = fx.reopen();
    let recovery = fx.store.recovery(&fx.s1).unwrap();
    assert_eq!(
        recovery,
        Recovery {
            torn_line: None,
            removed_tmp_dirs: vec![".tmp-9".to_owned()],
            removed_images: vec![],
            removed_compaction: true,
        }
    );
    assert!(!fx.dir.path().join("images/s1/.tmp-9").exists());
    assert_eq!(fx.summary(), "v1");
    assert_eq!(fx.run("n")[0].version, 2);
}

#[test]
fn sandboxes_publish_concurrently() {
    let fx = fixture();
    let s2 = sid("s2");
    fx.store.register(&s2).unwrap();
    let store = Arc::new(fx.store.clone());
    let threads: Vec<_> = [fx.s1.clone(), s2.clone()]
        .into_iter()
        .map(|sandbox| {
            let store = store.clone();
            std::thread::spawn(move || {
                for code in "a n f p n a f n p a".split_whitespace().cycle().take(30) {
                    publish(&store, &sandbox, code);
                }
            })
        })
        .collect();
    for t in threads {
        t.join().unwrap();
    }
    drop(store);
    let fx = fx.reopen();
    let all: String = (1..=30).map(|v| format!("v{v}")).collect::<Vec<_>>().join(" ");
    for sandbox in [&fx.s1, &s2] {
        assert_eq!(
            summary(&fx.store.verified_versions(sandbox).unwrap()),
            all,
            "{sandbox}"
        );
    }
    assert_eq!(fx.store.sandboxes(), vec![fx.s1.clone(), s2]);
}

#[test]
fn the_store_root_is_roots_alone() {
    use std::os::unix::fs::PermissionsExt;
    let dir = TempDir::new().unwrap();
    let root = dir.path().join("engine");
    fs::create_dir(&root).unwrap();
    fs::set_permissions(&root, fs::Permissions::from_mode(0o755)).unwrap();
    let store = VersionStore::open(&root).unwrap();
    assert_eq!(fs::metadata(&root).unwrap().permissions().mode() & 0o7777, 0o700);
    drop(store);
    let fresh = dir.path().join("new/engine");
    let _store = VersionStore::open(&fresh).unwrap();
    assert_eq!(fs::metadata(&fresh).unwrap().permissions().mode() & 0o7777, 0o700);
}
