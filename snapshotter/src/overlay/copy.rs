//! Copying trees: a snapshot of the live tree (sharing untouched files with
//! the previous snapshot by hard link), a plain copy (clone), and a restore
//! of the live tree to a snapshot that rewrites only what differs.

use std::collections::HashMap;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};

use walkdir::WalkDir;

use super::index::Index;
use super::tree::{apply_meta, copy_entry, remove_any, rewrite_in_place, Kind, Meta};
use crate::{Error, Result};

/// A previous snapshot to share untouched files with.
pub struct Previous<'a> {
    /// Its tree.
    pub dir: &'a Path,
    /// Its index.
    pub index: &'a Index,
}

/// Copies the tree `src` into the new directory `dst`: every entry with its
/// metadata, hard-link groups kept. With `prev`, a file untouched since
/// `prev` was saved is a hard link to `prev`'s copy instead of a new copy.
/// Returns the index of `src` as it was copied.
pub fn copy_tree(src: &Path, dst: &Path, prev: Option<Previous<'_>>) -> Result<Index> {
    let mut index = Index::new();
    let mut groups: HashMap<(u64, u64), PathBuf> = HashMap::new();
    let mut dirs: Vec<(PathBuf, Meta)> = Vec::new();
    let root = Meta::read(src)?;
    std::fs::create_dir(dst).map_err(Error::io("create directory", dst))?;
    index
        .entries
        .insert(String::new(), (root.ino, root.ctime.0, root.ctime.1));
    dirs.push((dst.to_owned(), root));
    for entry in WalkDir::new(src)
        .min_depth(1)
        .follow_links(false)
        .sort_by_file_name()
    {
        let entry = entry.map_err(|e| walk_error(src, e))?;
        let rel = entry
            .path()
            .strip_prefix(src)
            .expect("walkdir yields paths under its root");
        let to = dst.join(rel);
        let key = rel.to_str().map(str::to_owned);
        // The common case first, on lstat alone: a file untouched since the
        // previous snapshot becomes a link to that snapshot's copy (whose
        // xattrs and times are the same), without reading its xattrs.
        if let (Some(p), Some(k)) = (&prev, &key) {
            let md = std::fs::symlink_metadata(entry.path()).map_err(Error::io("stat", entry.path()))?;
            let (ino, ctime) = (md.ino(), (md.ctime(), md.ctime_nsec()));
            if md.is_file()
                && md.nlink() == 1
                && p.index.untouched(k, ino, ctime)
                && std::fs::hard_link(p.dir.join(rel), &to).is_ok()
            {
                index.entries.insert(k.clone(), (ino, ctime.0, ctime.1));
                continue;
            }
        }
        let meta = Meta::read(entry.path())?;
        if let Some(k) = &key {
            index
                .entries
                .insert(k.clone(), (meta.ino, meta.ctime.0, meta.ctime.1));
        }
        if meta.kind == Kind::Dir {
            copy_entry(entry.path(), &to, &meta)?;
            dirs.push((to, meta));
            continue;
        }
        if meta.kind == Kind::File {
            if let Some(first) = groups.get(&(meta.dev, meta.ino)) {
                std::fs::hard_link(first, &to).map_err(Error::io("link", &to))?;
                continue;
            }
            let shared = match (&prev, &key) {
                (Some(p), Some(k)) if p.index.untouched(k, meta.ino, meta.ctime) => Some(p.dir.join(rel)),
                _ => None,
            };
            match shared {
                Some(from) if from.is_file() => {
                    std::fs::hard_link(&from, &to).map_err(Error::io("link", &to))?;
                }
                _ => copy_entry(entry.path(), &to, &meta)?,
            }
            if meta.nlink > 1 {
                groups.insert((meta.dev, meta.ino), to);
            }
            continue;
        }
        copy_entry(entry.path(), &to, &meta)?;
    }
    // Directory times last: creating their entries changed them.
    for (dir, meta) in dirs.iter().rev() {
        apply_meta(dir, meta)?;
    }
    Ok(index)
}

/// Makes the tree `live` equal to the snapshot tree `snap`, whose index is
/// `index`. Entries untouched since the snapshot are left alone; a file the
/// snapshot saw, changed since, is rewritten in its own inode; everything
/// else is replaced (files by rename).
pub fn restore_tree(snap: &Path, live: &Path, index: &Index) -> Result<()> {
    // 1. Remove what the snapshot does not have, or has as another kind.
    let mut it = WalkDir::new(live)
        .min_depth(1)
        .follow_links(false)
        .sort_by_file_name()
        .into_iter();
    while let Some(entry) = it.next() {
        let entry = entry.map_err(|e| walk_error(live, e))?;
        let rel = entry
            .path()
            .strip_prefix(live)
            .expect("walkdir yields paths under its root");
        let theirs = std::fs::symlink_metadata(snap.join(rel));
        let same_kind = theirs.is_ok_and(|m| m.file_type() == entry.file_type());
        if !same_kind {
            if entry.file_type().is_dir() {
                it.skip_current_dir();
            }
            remove_any(entry.path())?;
        }
    }
    // 2. Bring in the snapshot's entries.
    let mut groups: HashMap<u64, PathBuf> = HashMap::new();
    let mut dirs: Vec<(PathBuf, Meta)> = vec![(live.to_owned(), Meta::read(snap)?)];
    for entry in WalkDir::new(snap)
        .min_depth(1)
        .follow_links(false)
        .sort_by_file_name()
    {
        let entry = entry.map_err(|e| walk_error(snap, e))?;
        let rel = entry
            .path()
            .strip_prefix(snap)
            .expect("walkdir yields paths under its root");
        let want = Meta::read(entry.path())?;
        let to = live.join(rel);
        let have = Meta::read(&to).ok();
        match want.kind {
            Kind::Dir => {
                if have.is_none() {
                    std::fs::create_dir(&to).map_err(Error::io("create directory", &to))?;
                }
                dirs.push((to, want));
            }
            Kind::File => {
                if let Some(first) = groups.get(&want.ino) {
                    replace_with(&to, |tmp| {
                        std::fs::hard_link(first, tmp).map_err(Error::io("link", tmp))
                    })?;
                    continue;
                }
                let untouched = match (&have, rel.to_str()) {
                    (Some(h), Some(k)) => h.kind == Kind::File && index.untouched(k, h.ino, h.ctime),
                    _ => false,
                };
                // The very file the version saw, changed since (one name:
                // phase 1 removed the others), keeps its inode: the
                // restored processes know it by its number.
                let same_inode = match (&have, rel.to_str()) {
                    (Some(h), Some(k)) => h.kind == Kind::File && h.nlink == 1 && index.ino(k) == Some(h.ino),
                    _ => false,
                };
                let rewritten = match (untouched, same_inode) {
                    (true, _) => true,
                    (false, true) => {
                        rewrite_in_place(entry.path(), &to, have.as_ref().map_or(0, |h| h.ino), &want)?
                    }
                    (false, false) => false,
                };
                if !rewritten {
                    replace_with(&to, |tmp| copy_entry(entry.path(), tmp, &want))?;
                }
                groups.insert(want.ino, to);
            }
            _ => {
                let same = have.as_ref().is_some_and(|h| {
                    h.same_shape(&want)
                        && (want.kind != Kind::Symlink
                            || std::fs::read_link(&to).ok() == std::fs::read_link(entry.path()).ok())
                });
                if !same {
                    remove_any(&to)?;
                    copy_entry(entry.path(), &to, &want)?;
                }
            }
        }
    }
    for (dir, meta) in dirs.iter().rev() {
        apply_meta(dir, meta)?;
    }
    Ok(())
}

/// Builds a new entry beside `to` with `make`, then renames it over `to`.
fn replace_with(to: &Path, make: impl FnOnce(&Path) -> Result<()>) -> Result<()> {
    let name = to
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    let tmp = to.with_file_name(format!(".crab-restore-{name}"));
    remove_any(&tmp)?;
    make(&tmp)?;
    std::fs::rename(&tmp, to).map_err(Error::io("rename over", to))
}

fn walk_error(root: &Path, e: walkdir::Error) -> Error {
    let path = e.path().unwrap_or(root).to_owned();
    Error::Io {
        op: "walk",
        path,
        source: e
            .into_io_error()
            .unwrap_or_else(|| std::io::Error::other("filesystem loop")),
    }
}
