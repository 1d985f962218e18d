use super::*;
use crate::kernel::{COMM_LEN, NAME_LEN};
use crate::mounts::{Mount, MountKind};

/// A record: (kind, op, name, name2); every name relative to directory 7 on
/// device 1 (kernel numbering), object inode 100 + index.
fn ev(i: usize, kind: u32, op: u32, name: &str, name2: &str) -> Event {
    let mut e = Event {
        cgroup: 1,
        seq: i as u64,
        gen: 1,
        kind,
        op,
        pid: 10,
        tid: 10,
        dev: 1 << 20,
        ino: 100 + i as u64,
        dir_dev: 1 << 20,
        dir_ino: 7,
        dir2_dev: 1 << 20,
        dir2_ino: 7,
        mode: 0o100644,
        flags: 0,
        mntns: 0,
        marks: 0,
        comm: [0; COMM_LEN],
        name: [0; NAME_LEN],
        name2: [0; NAME_LEN],
    };
    e.name[..name.len()].copy_from_slice(name.as_bytes());
    e.name2[..name2.len()].copy_from_slice(name2.as_bytes());
    e.comm[..2].copy_from_slice(b"sh");
    e
}

enum Step {
    Create(&'static str),
    /// A creation by "dir/name" whose canonical spelling is (inode 8, name).
    CreateIn(&'static str, &'static str),
    /// The same, proven by the kernel side's walk to be the file.
    CreateSpelledIn(&'static str, &'static str),
    /// A path operation relative to directory inode 8.
    PathIn(u32, &'static str),
    Trunc(&'static str),
    Write(&'static str),
    Path(u32, &'static str),
    Path2(u32, &'static str, &'static str),
}

fn check(steps: &[Step], expected: &[&str]) {
    let mut l = Ledger::default();
    for (i, s) in steps.iter().enumerate() {
        let e = match *s {
            Step::Create(n) => ev(i, kind::CREATE, 0, n, n),
            Step::CreateIn(n, base) => {
                let mut e = ev(i, kind::CREATE, 0, n, base);
                e.dir2_ino = 8;
                e
            }
            Step::CreateSpelledIn(n, base) => {
                let mut e = ev(i, kind::CREATE, 0, n, base);
                e.dir2_ino = 8;
                e.marks = marks::SPELLED;
                e
            }
            Step::PathIn(o, n) => {
                let mut e = ev(i, kind::PATH, o, n, "");
                e.dir_ino = 8;
                e
            }
            Step::Trunc(n) => ev(i, kind::TRUNC, 0, n, ""),
            Step::Write(n) => ev(i, kind::WRITE, 0, n, ""),
            Step::Path(o, n) => ev(i, kind::PATH, o, n, ""),
            Step::Path2(o, a, b) => ev(i, kind::PATH, o, a, b),
        };
        l.apply(&e, &Ignore::default());
    }
    let v = l.fs_verdict(&Ignore::default());
    assert_eq!(v.changed, expected);
}

#[test]
fn created_then_removed_is_no_change() {
    use Step::*;
    check(&[Create("t"), Path(op::UNLINK, "./t")], &[]);
    check(
        &[
            Path(op::MKDIR, "d"),
            Create("d/f"),
            Path(op::UNLINK, "d/f"),
            Path(op::RMDIR, "d/"),
        ],
        &[],
    );
    check(&[Path2(op::SYMLINK, "target", "l"), Path(op::UNLINK, "l")], &[]);
    check(
        &[
            Create("a"),
            Path2(op::RENAME_NOREPLACE, "a", "b"),
            Path(op::UNLINK, "b"),
        ],
        &[],
    );
    // Created as "d/x", removed as (d, "x") by `rm -r`, `find -delete`, rmtree.
    check(
        &[
            Path(op::MKDIR, "d"),
            CreateIn("d/x", "x"),
            PathIn(op::UNLINK, "x"),
            Path(op::RMDIR, "d"),
        ],
        &[],
    );
    // Created as "d/x", proven that file, removed by that spelling.
    check(&[CreateSpelledIn("d/x", "x"), Path(op::UNLINK, "d/x")], &[]);
    // Whatever was named directly in a directory made and removed this
    // turn. (The canonical spelling, relative to the directory's inode,
    // is not known to be that directory: reported, a false positive.)
    check(
        &[
            Path(op::MKDIR, "d"),
            CreateIn("d/x", "x"),
            Path(op::UNLINK, "d/x"),
            Path(op::RMDIR, "d"),
        ],
        &["x"],
    );
}

#[test]
fn a_write_through_a_symlink_then_removed_is_a_change() {
    use Step::*;
    // The link made this turn, the file made through it, the link removed:
    // the target stays.
    check(
        &[
            Path2(op::SYMLINK, "/tmp/target", "l"),
            CreateIn("l", "target"),
            Path(op::UNLINK, "l"),
        ],
        &["target"],
    );
    // A link from an earlier turn (not in the records), same basename in
    // another directory: removing the link does not remove the file.
    check(&[CreateIn("d/x", "x"), Path(op::UNLINK, "d/x")], &["d/x", "x"]);
    // In a directory made this turn: the file made through a link there
    // stays, and so does a file changed through a link (chmod follows).
    check(
        &[
            Path(op::MKDIR, "d"),
            Path2(op::SYMLINK, "/work/f", "d/l"),
            CreateIn("d/l", "f"),
            Path(op::ATTR, "d/m"),
            Path(op::UNLINK, "d/l"),
            Path(op::UNLINK, "d/m"),
            Path(op::RMDIR, "d"),
        ],
        &["d/m", "f"],
    );
    // Deeper than one level below the vanished directory: "d/l" may be a
    // link to a directory elsewhere.
    check(
        &[
            Path(op::MKDIR, "d"),
            Path(op::UNLINK, "d/l/x"),
            Path(op::RMDIR, "d"),
        ],
        &["d/l/x"],
    );
}

#[test]
fn names_cut_short_or_not_text_never_cancel_another() {
    let long_a = format!("{}A", "p".repeat(300));
    let long_b = format!("{}B", "p".repeat(300));
    let mut l = Ledger::default();
    let mut create = ev(0, kind::CREATE, 0, &long_a[..255], "A");
    create.marks = marks::NAME_CUT;
    create.dir2_ino = 8;
    l.apply(&create, &Ignore::default());
    let mut unlink = ev(1, kind::PATH, op::UNLINK, &long_b[..255], "");
    unlink.marks = marks::NAME_CUT;
    l.apply(&unlink, &Ignore::default());
    // The created file stays, and the cut name stands for the removal.
    let v = l.fs_verdict(&Ignore::default());
    assert_eq!(v.changed, vec!["A".to_owned(), "p".repeat(255)]);
    assert!(l.uncertain);

    // A whole name of 255 bytes is another key than a cut one.
    let mut l = Ledger::default();
    l.apply(
        &ev(0, kind::CREATE, 0, &long_a[..255], &long_a[..255]),
        &Ignore::default(),
    );
    l.apply(&unlink, &Ignore::default());
    l.apply(
        &ev(2, kind::PATH, op::UNLINK, &long_a[..255], ""),
        &Ignore::default(),
    );
    assert_eq!(l.fs_verdict(&Ignore::default()).changed, vec!["p".repeat(255)]);

    // Two names that differ only in bytes that are not UTF-8.
    let mut l = Ledger::default();
    let mut made = ev(0, kind::CREATE, 0, "", "");
    made.name[..2].copy_from_slice(b"n\xfe");
    made.name2[..2].copy_from_slice(b"n\xfe");
    let mut gone = ev(1, kind::PATH, op::UNLINK, "", "");
    gone.name[..2].copy_from_slice(b"n\xff");
    l.apply(&made, &Ignore::default());
    l.apply(&gone, &Ignore::default());
    assert_eq!(l.fs_verdict(&Ignore::default()).changed.len(), 2);
}

#[test]
fn lasting_changes_are_kept() {
    use Step::*;
    check(&[Create("new")], &["new"]);
    check(&[Path(op::UNLINK, "old")], &["old"]);
    check(&[Trunc("f")], &["f"]);
    check(&[Write("f")], &["f"]);
    check(&[Path(op::ATTR, "f")], &["f"]);
    // An atomic replace: the temporary name is gone, the target changed.
    check(&[Create("f.tmp"), Path2(op::RENAME, "f.tmp", "f")], &["f"]);
    // Removed and re-created: a pre-existing file was replaced.
    check(&[Path(op::UNLINK, "f"), Create("f")], &["f"]);
    // Renamed to a name that might have existed, then removed: a change.
    check(
        &[Create("a"), Path2(op::RENAME, "a", "b"), Path(op::UNLINK, "b")],
        &["b"],
    );
    check(&[Path2(op::LINK, "a", "b")], &["b"]);
    check(&[CreateIn("d/x", "x")], &["d/x", "x"]);
}

#[test]
fn names_are_normalized() {
    assert_eq!(normalize(b"./a//b/"), b"a/b");
    assert_eq!(normalize(b"/x/./y"), b"/x/y");
    assert_eq!(normalize(b"."), b".");
    assert_eq!(normalize(b"../a"), b"../a");
}

/// The sandbox's mounts of a container: /dev and /dev/shm tmpfs (devices
/// 2 and 3, kernel numbering 2 << 20, 3 << 20), /dev/pts, /proc.
fn container_mounts() -> Ignore {
    let mount = |dev: u32, point: &str, kind, tmpfs| Mount {
        dev: user_dev(u64::from(dev) << 20),
        point: point.as_bytes().to_vec(),
        kind,
        tmpfs,
        interface: kind != MountKind::Other || point == "/proc",
    };
    Ignore {
        devs: [2, 3, 4, 5].into_iter().map(|d: u64| user_dev(d << 20)).collect(),
        host_mntns: [99].into_iter().collect(),
        root: None,
        mounts: vec![
            mount(2, "/dev", MountKind::Held, true),
            mount(3, "/dev/shm", MountKind::Held, true),
            mount(4, "/dev/pts", MountKind::Devices, false),
            mount(5, "/proc", MountKind::Other, false),
        ],
    }
}

#[test]
fn kernel_interfaces_are_not_state() {
    let ignore = container_mounts();
    let mut l = Ledger::default();
    let mut in_dev = ev(0, kind::WRITE, 0, "held", "");
    in_dev.dev = 2 << 20;
    l.apply(&in_dev, &ignore);
    let mut pts = ev(1, kind::WRITE, 0, "0", "");
    pts.dev = 4 << 20;
    l.apply(&pts, &ignore);
    l.apply(&ev(2, kind::PATH, op::UNLINK, "/dev/pts/9", ""), &ignore);
    let mut from_host = ev(3, kind::CREATE, 0, "/run/bundle/x.pid", "");
    from_host.mntns = 99;
    l.apply(&from_host, &ignore);
    let v = l.fs_verdict(&ignore);
    assert_eq!(v.changed, Vec::<String>::new());
    assert_eq!(v.held, vec!["held".to_owned()]);
}

#[test]
fn tmpfs_changes_are_held_and_escapes_are_files() {
    let ignore = container_mounts();
    let verdict = |evs: &[Event]| {
        let mut l = Ledger::default();
        for e in evs {
            l.apply(e, &ignore);
        }
        let v = l.fs_verdict(&ignore);
        (v.changed, v.held, l.uncertain)
    };
    let s = |v: &[&str]| v.iter().map(|s| s.to_string()).collect::<Vec<_>>();
    // A file left in /dev/shm: process state, not files.
    let mut keep = ev(0, kind::CREATE, 0, "/dev/shm/keep", "keep");
    keep.dir2_dev = 3 << 20;
    assert_eq!(verdict(&[keep]), (s(&[]), s(&["/dev/shm/keep", "keep"]), true));
    assert_eq!(
        verdict(&[ev(0, kind::PATH, op::UNLINK, "/dev/shm/keep", "")]),
        (s(&[]), s(&["/dev/shm/keep"]), true)
    );
    // Spelled through /dev or /proc, it lands anywhere.
    assert_eq!(
        verdict(&[ev(0, kind::PATH, op::UNLINK, "/dev/../work/x", "")]),
        (s(&["/dev/../work/x"]), s(&[]), true)
    );
    assert_eq!(
        verdict(&[ev(0, kind::PATH, op::UNLINK, "/proc/self/cwd/x", "")]),
        (s(&["/proc/self/cwd/x"]), s(&[]), true)
    );
    // `cd /dev && rm ../x`: relative to a directory on the /dev tmpfs.
    let mut up = ev(0, kind::PATH, op::UNLINK, "../x", "");
    up.dir_dev = 2 << 20;
    assert_eq!(verdict(&[up]), (s(&["../x"]), s(&[]), true));
    // Below a tmpfs but deeper than one name: a symlink there may lead out.
    assert_eq!(
        verdict(&[ev(0, kind::PATH, op::UNLINK, "/dev/shm/link/x", "")]),
        (s(&["/dev/shm/link/x"]), s(&["/dev/shm/link/x"]), true)
    );
    // A single name in the working directory: certain.
    assert_eq!(
        verdict(&[ev(0, kind::PATH, op::UNLINK, "x", "")]),
        (s(&["x"]), s(&[]), false)
    );
}

#[test]
fn a_directory_replaced_by_a_link_does_not_vanish_what_went_through_it() {
    use Step::*;
    // mkdir v; rmdir v; ln -s /work/realdir v; rm v/important.txt; rm v
    check(
        &[
            Path(op::MKDIR, "v"),
            Path(op::RMDIR, "v"),
            Path2(op::SYMLINK, "/work/realdir", "v"),
            Path(op::UNLINK, "v/important.txt"),
            Path(op::UNLINK, "v"),
        ],
        &["v/important.txt"],
    );
}

#[test]
fn writes_on_bind_mounts_are_files_and_chroot_names_are_not_the_sandbox_s() {
    let mut ignore = container_mounts();
    ignore.mounts.push(Mount {
        dev: user_dev(6 << 20),
        point: b"/etc/hosts".to_vec(),
        kind: MountKind::Other,
        tmpfs: false,
        interface: false,
    });
    ignore.root = Some((user_dev(1 << 20), 7));
    let mut l = Ledger::default();
    let mut hosts = ev(0, kind::WRITE, 0, "hosts", "");
    hosts.dev = 6 << 20;
    l.apply(&hosts, &ignore);
    // From a chroot (base: another directory than the sandbox's root),
    // "/dev/pts/precious" is no terminal.
    let mut chrooted = ev(1, kind::PATH, op::UNLINK, "/dev/pts/precious", "");
    chrooted.dir_ino = 70;
    l.apply(&chrooted, &ignore);
    l.apply(&ev(2, kind::PATH, op::UNLINK, "/dev/pts/9", ""), &ignore);
    // A memfd (a device no path of the sandbox reaches) is no file.
    let mut memfd = ev(3, kind::WRITE, NR_MMAP, "memfd:CRIUMFD", "");
    memfd.dev = 9 << 20;
    l.apply(&memfd, &ignore);
    let v = l.fs_verdict(&ignore);
    assert_eq!(
        v.changed,
        vec!["/dev/pts/precious".to_owned(), "hosts".to_owned()]
    );
}
