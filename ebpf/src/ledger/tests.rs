use super::*;
use crate::kernel::{COMM_LEN, NAME_LEN};

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
        pad: 0,
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
    assert_eq!(normalize("./a//b/"), "a/b");
    assert_eq!(normalize("/x/./y"), "/x/y");
    assert_eq!(normalize("."), ".");
    assert_eq!(normalize("../a"), "../a");
}

#[test]
fn kernel_interfaces_are_not_state() {
    let mut l = Ledger::default();
    let ignore = Ignore {
        devs: [user_dev(1 << 20)].into_iter().collect(),
        host_mntns: [99].into_iter().collect(),
    };
    l.apply(&ev(0, kind::PATH, op::ATTR, "/proc/self/attr", ""), &ignore);
    l.apply(&ev(1, kind::CREATE, 0, "/dev/shm/x", ""), &ignore);
    l.apply(&ev(2, kind::WRITE, 0, "null", ""), &ignore);
    let mut from_host = ev(3, kind::CREATE, 0, "/run/bundle/x.pid", "");
    from_host.mntns = 99;
    l.apply(&from_host, &ignore);
    assert_eq!(l.fs_verdict(&ignore), FsVerdict::default());
}
