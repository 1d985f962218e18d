//! Shared by the backend tests: a tree with every kind of entry, the
//! changes a turn makes, and a digest that compares trees byte for byte
//! and metadata for metadata.

#![allow(dead_code)]

use std::collections::HashMap;
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::path::Path;
use std::process::Command;

use sha2::{Digest, Sha256};

/// Digest of the tree at `root`: path, kind, mode, owner, size, mtime,
/// device number, symlink target, xattrs, content and hard-link groups of
/// every entry (not atime, ctime, inode numbers or link counts).
pub fn digest(root: &Path) -> String {
    let mut h = Sha256::new();
    let mut groups: HashMap<u64, String> = HashMap::new();
    for e in walkdir::WalkDir::new(root)
        .follow_links(false)
        .sort_by_file_name()
    {
        let e = e.expect("walk");
        let rel = e
            .path()
            .strip_prefix(root)
            .unwrap()
            .to_string_lossy()
            .into_owned();
        let md = std::fs::symlink_metadata(e.path()).expect("lstat");
        let ft = md.file_type();
        h.update(format!(
            "{rel}|{:o}|{}|{}|{}|{}\n",
            md.mode(),
            md.uid(),
            md.gid(),
            md.rdev(),
            md.mtime()
        ));
        if !ft.is_dir() {
            h.update(format!("size {}\n", md.size()));
        }
        // zfs-fuse has no xattrs (EOPNOTSUPP): an empty list there.
        let mut names: Vec<_> = xattr::list(e.path()).map(|l| l.collect()).unwrap_or_default();
        names.sort();
        for n in names {
            let v = xattr::get(e.path(), &n).expect("xattr").unwrap_or_default();
            h.update(n.as_bytes());
            h.update(b"=");
            h.update(&v);
            h.update(b"\n");
        }
        if ft.is_symlink() {
            h.update(std::fs::read_link(e.path()).unwrap().as_os_str().as_bytes());
        } else if ft.is_file() {
            if md.nlink() > 1 {
                let first = groups.entry(md.ino()).or_insert_with(|| rel.clone());
                h.update(format!("group {first}\n"));
            }
            h.update(std::fs::read(e.path()).expect("read"));
        }
    }
    format!("{:x}", h.finalize())
}

/// Fills `root` with files, directories, a symlink, a hard link, a fifo,
/// xattrs, and odd modes and owners.
pub fn populate(root: &Path, xattrs: bool) {
    let w = |p: &str, s: &str| std::fs::write(root.join(p), s).expect("write");
    std::fs::create_dir_all(root.join("src/deep/er")).unwrap();
    std::fs::create_dir_all(root.join("doomed/sub")).unwrap();
    w("README", "hello\n");
    w("src/main.c", "int main(void) { return 0; }\n");
    w("src/deep/er/data.bin", &"x".repeat(100_000));
    w("doomed/sub/file", "bye\n");
    w("to-edit", "version 1\n");
    w("to-delete", "delete me\n");
    w("to-rename", "rename me\n");
    std::os::unix::fs::symlink("src/main.c", root.join("link-to-main")).unwrap();
    std::fs::hard_link(root.join("README"), root.join("README.hard")).unwrap();
    std::fs::set_permissions(root.join("to-edit"), std::fs::Permissions::from_mode(0o640)).unwrap();
    nix::unistd::chown(&root.join("src/main.c"), Some(1000.into()), Some(1000.into())).unwrap();
    nix::unistd::mkfifo(
        &root.join("fifo"),
        nix::sys::stat::Mode::from_bits_truncate(0o600),
    )
    .unwrap();
    if xattrs {
        xattr::set(root.join("README"), "user.crab", b"v1").unwrap();
    }
}

/// What a turn does: create, edit, delete, rename, chmod, a new symlink and
/// hard link, a deleted directory, xattrs.
pub fn mutate(root: &Path, xattrs: bool) {
    std::fs::write(root.join("new-file"), "created\n").unwrap();
    std::fs::write(root.join("to-edit"), "version 2, longer\n").unwrap();
    std::fs::remove_file(root.join("to-delete")).unwrap();
    std::fs::rename(root.join("to-rename"), root.join("renamed")).unwrap();
    std::fs::set_permissions(root.join("src/main.c"), std::fs::Permissions::from_mode(0o755)).unwrap();
    std::os::unix::fs::symlink("README", root.join("new-link")).unwrap();
    std::fs::hard_link(root.join("src/main.c"), root.join("main.hard")).unwrap();
    std::fs::remove_dir_all(root.join("doomed")).unwrap();
    if xattrs {
        xattr::set(root.join("README"), "user.crab", b"v2").unwrap();
        xattr::set(root.join("src"), "user.dir", b"yes").unwrap();
    }
    std::fs::write(root.join("src/deep/er/data.bin"), "y".repeat(50_000)).unwrap();
}

/// Runs a command, panicking with its stderr on failure.
pub fn sh(cmd: &str, args: &[&str]) -> String {
    let out = Command::new(cmd)
        .args(args)
        .output()
        .unwrap_or_else(|e| panic!("{cmd}: {e}"));
    assert!(
        out.status.success(),
        "{cmd} {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// A unique short name for this process's resources.
pub fn unique(prefix: &str) -> String {
    use std::sync::atomic::{AtomicU32, Ordering};
    static N: AtomicU32 = AtomicU32::new(0);
    format!(
        "{prefix}{}x{}",
        std::process::id(),
        N.fetch_add(1, Ordering::Relaxed)
    )
}
