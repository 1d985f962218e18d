//! Files-only rollback: a live tree made equal to a snapshot's in place,
//! through the live mount, while the sandbox's processes stay (frozen by
//! the caller). Unlike [`crate::Backend::rollback`], which swaps the
//! filesystem under an unmounted rootfs, this writes entry by entry, so the
//! processes' mount, open files and connections survive.
//!
//! An entry is rewritten when its kind, owner, mode, times, xattrs, size,
//! link target or content differ; a directory is walked only when it is in
//! the [`Scope`], so an overlay rollback visits what either upper layer
//! holds, not the image below both.
//!
//! The walk goes down from the roots and never follows a symlink: every
//! directory it enters was seen to be one (by `lstat`) in both trees, and
//! the caller keeps the sandbox frozen, so nothing swaps it meanwhile.
//! Hard links in the snapshot come back as separate copies.

use std::collections::{BTreeSet, HashSet};
use std::ffi::OsString;
use std::io::Read;
use std::path::{Path, PathBuf};

use walkdir::WalkDir;

use crate::overlay::tree::{apply_meta, copy_entry, remove_any, Kind, Meta};
use crate::{Error, Result};

/// Where a snapshot's files can be read in place.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum SnapshotFiles {
    /// A whole tree (a btrfs snapshot).
    Tree(PathBuf),
    /// An overlay upper layer (whiteouts and opaque directories included)
    /// that goes over the same lower layers as the live upper `live`.
    Layer {
        /// The snapshot's copy of the upper layer.
        dir: PathBuf,
        /// The live upper layer.
        live: PathBuf,
    },
}

/// Which paths a sync may find different.
#[derive(Debug, Clone)]
pub enum Scope {
    /// Any path.
    Whole,
    /// Only these (relative) paths; any other path holds the same entry in
    /// both trees when it is in both (the lower layers both trees share).
    Paths(HashSet<PathBuf>),
}

/// What a sync changed.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct SyncReport {
    /// Entries written (created, replaced, or given new metadata).
    pub written: u64,
    /// Entries removed (a directory counts once).
    pub removed: u64,
}

// === impl Scope ===

impl Scope {
    /// The paths any of the overlay upper layers `layers` holds.
    pub fn of_layers(layers: &[&Path]) -> Result<Scope> {
        let mut paths = HashSet::new();
        for layer in layers {
            for entry in WalkDir::new(layer).min_depth(1).follow_links(false) {
                let entry = entry.map_err(|e| Error::Io {
                    op: "walk",
                    path: layer.to_path_buf(),
                    source: e.into(),
                })?;
                let rel = entry
                    .path()
                    .strip_prefix(layer)
                    .expect("walkdir yields paths under its root");
                paths.insert(rel.to_owned());
            }
        }
        Ok(Scope::Paths(paths))
    }

    fn holds(&self, rel: &Path) -> bool {
        match self {
            Scope::Whole => true,
            Scope::Paths(paths) => paths.contains(rel),
        }
    }
}

/// Makes the tree at `live` equal to the tree at `source` within `scope`.
///
/// # Errors
/// [`Error::Io`] for the first operation that failed; what was synced by
/// then stays synced.
pub fn sync_tree(source: &Path, live: &Path, scope: &Scope) -> Result<SyncReport> {
    let mut sync = Sync {
        source,
        live,
        scope,
        report: SyncReport::default(),
    };
    for root in [source, live] {
        if Meta::read(root)?.kind != Kind::Dir {
            return Err(Error::io("sync", root)(std::io::Error::other("not a directory")));
        }
    }
    sync.dir(Path::new(""))?;
    Ok(sync.report)
}

struct Sync<'a> {
    source: &'a Path,
    live: &'a Path,
    scope: &'a Scope,
    report: SyncReport,
}

/// One step of the walk (an explicit stack: a sandbox chooses how deep its
/// tree is, and the walk must not recurse that deep).
enum Step {
    /// Compare the entry at this path and act.
    Entry(PathBuf),
    /// Queue the children of this directory (in both trees).
    Children(PathBuf),
    /// Its children are done: set this directory's own metadata.
    Finish(PathBuf),
}

impl Sync<'_> {
    /// Syncs the directory `rel` (in both trees): its children, then its
    /// own metadata, which their changes touched.
    fn dir(&mut self, rel: &Path) -> Result<()> {
        let mut stack = vec![Step::Finish(rel.to_owned()), Step::Children(rel.to_owned())];
        while let Some(step) = stack.pop() {
            match step {
                Step::Children(rel) => {
                    let mut children = names(&self.source.join(&rel))?;
                    children.extend(names(&self.live.join(&rel))?);
                    // Reversed: popped in name order.
                    for name in children.into_iter().rev() {
                        let child = rel.join(&name);
                        let differ = exists(&self.source.join(&child)) != exists(&self.live.join(&child));
                        if self.scope.holds(&child) || differ {
                            stack.push(Step::Entry(child));
                        }
                    }
                }
                Step::Entry(rel) => {
                    if self.entry(&rel)? {
                        stack.push(Step::Finish(rel.clone()));
                        stack.push(Step::Children(rel));
                    }
                }
                Step::Finish(rel) => {
                    let (src, dst) = (self.source.join(&rel), self.live.join(&rel));
                    let want = Meta::read(&src)?;
                    if !want.same_shape(&Meta::read(&dst)?) {
                        apply_meta(&dst, &want)?;
                        self.report.written += 1;
                    }
                }
            }
        }
        Ok(())
    }

    /// Makes the entry at `rel` the source's; true when it is a directory
    /// in both trees, whose children are still to do.
    fn entry(&mut self, rel: &Path) -> Result<bool> {
        let (src, dst) = (self.source.join(rel), self.live.join(rel));
        let want = meta_if_any(&src)?;
        let have = meta_if_any(&dst)?;
        match (want, have) {
            (None, None) => {}
            (None, Some(_)) => {
                remove_any(&dst)?;
                self.report.removed += 1;
            }
            (Some(_), None) => self.copy(&src, &dst)?,
            (Some(want), Some(have)) if want.kind != have.kind => {
                remove_any(&dst)?;
                self.copy(&src, &dst)?;
            }
            (Some(want), Some(_)) if want.kind == Kind::Dir => return Ok(true),
            (Some(want), Some(have)) => {
                // Unreadable (a lease, a swapped-in fifo): not the same.
                if !same_entry(&src, &want, &dst, &have).unwrap_or(false) {
                    remove_any(&dst)?;
                    self.copy(&src, &dst)?;
                }
            }
        }
        Ok(false)
    }

    /// Copies the entry `src` (a directory with everything below it) to
    /// `dst`, which does not exist.
    fn copy(&mut self, src: &Path, dst: &Path) -> Result<()> {
        let mut dirs = Vec::new();
        // A symlink root is copied as the link, never walked through.
        let walk = WalkDir::new(src).follow_links(false).follow_root_links(false);
        for entry in walk.sort_by_file_name() {
            let entry = entry.map_err(|e| Error::Io {
                op: "walk",
                path: src.to_owned(),
                source: e.into(),
            })?;
            let rel = entry
                .path()
                .strip_prefix(src)
                .expect("walkdir yields paths under its root");
            let to = if rel.as_os_str().is_empty() {
                dst.to_owned()
            } else {
                dst.join(rel)
            };
            let meta = Meta::read(entry.path())?;
            copy_entry(entry.path(), &to, &meta)?;
            if meta.kind == Kind::Dir {
                dirs.push((to, meta));
            }
            self.report.written += 1;
        }
        // Children first: their creation moved their parents' times.
        for (dir, meta) in dirs.iter().rev() {
            apply_meta(dir, meta)?;
        }
        Ok(())
    }
}

/// Whether two entries of the same kind, not directories, are equal.
fn same_entry(src: &Path, want: &Meta, dst: &Path, have: &Meta) -> Result<bool> {
    if !want.same_shape(have) {
        return Ok(false);
    }
    match want.kind {
        Kind::Symlink => {
            let target = |p: &Path| std::fs::read_link(p).map_err(Error::io("read link", p));
            Ok(target(src)? == target(dst)?)
        }
        Kind::File => same_content(src, dst),
        _ => Ok(true),
    }
}

fn same_content(a: &Path, b: &Path) -> Result<bool> {
    // Never through a symlink, never blocking on a fifo swapped in: only a
    // regular file is read.
    let open = |p: &Path| {
        use std::os::unix::fs::OpenOptionsExt;
        let f = std::fs::OpenOptions::new()
            .read(true)
            .custom_flags(nix::libc::O_NOFOLLOW | nix::libc::O_NONBLOCK)
            .open(p)
            .map_err(Error::io("open", p))?;
        match f.metadata() {
            Ok(m) if m.is_file() => Ok(f),
            Ok(_) => Err(Error::io("open", p)(std::io::Error::other("not a regular file"))),
            Err(e) => Err(Error::io("stat", p)(e)),
        }
    };
    let (mut fa, mut fb) = (open(a)?, open(b)?);
    let (mut ba, mut bb) = (vec![0u8; 64 << 10], vec![0u8; 64 << 10]);
    loop {
        let na = read_full(&mut fa, &mut ba).map_err(Error::io("read", a))?;
        let nb = read_full(&mut fb, &mut bb).map_err(Error::io("read", b))?;
        if ba[..na] != bb[..nb] {
            return Ok(false);
        }
        if na == 0 {
            return Ok(true);
        }
    }
}

/// Reads until `buf` is full or the file ends.
fn read_full(f: &mut std::fs::File, buf: &mut [u8]) -> std::io::Result<usize> {
    let mut n = 0;
    while n < buf.len() {
        match f.read(&mut buf[n..])? {
            0 => break,
            k => n += k,
        }
    }
    Ok(n)
}

/// The paths (relative) that `keep` selects and that differ between the
/// trees (or overlay layers) `old` and `new`: present in one only, of
/// another kind, owner, mode, xattrs, size, link target or content (a
/// directory's times and size do not count: its children's changes are
/// their own). Reads only; never follows a symlink.
pub fn differences(old: &Path, new: &Path, keep: &dyn Fn(&Path) -> bool) -> Result<Vec<PathBuf>> {
    let mut out = Vec::new();
    let mut seen = HashSet::new();
    for (root, other, first) in [(new, old, true), (old, new, false)] {
        for entry in WalkDir::new(root)
            .min_depth(1)
            .follow_links(false)
            .sort_by_file_name()
        {
            let entry = entry.map_err(|e| Error::Io {
                op: "walk",
                path: root.to_owned(),
                source: e.into(),
            })?;
            let rel = entry
                .path()
                .strip_prefix(root)
                .expect("walkdir yields paths under its root")
                .to_owned();
            if !keep(&rel) || (!first && seen.contains(&rel)) {
                continue;
            }
            if first {
                seen.insert(rel.clone());
            }
            let there = other.join(&rel);
            // overlayfs's own bookkeeping (`trusted.overlay.*`: origin,
            // impure, …) changes with copy-ups, not with content.
            let own = |m: Meta| Meta {
                xattrs: m
                    .xattrs
                    .into_iter()
                    .filter(|(n, _)| !n.to_string_lossy().starts_with("trusted.overlay."))
                    .collect(),
                ..m
            };
            let differ = match (
                Meta::read(entry.path()).map(own),
                meta_if_any(&there).map(|m| m.map(own)),
            ) {
                // Gone meanwhile (the tree is live): a change.
                (Err(_), _) | (_, Ok(None)) => true,
                (Ok(a), Ok(Some(b))) if a.kind == Kind::Dir => {
                    !(b.kind == Kind::Dir
                        && a.mode == b.mode
                        && a.uid == b.uid
                        && a.gid == b.gid
                        && a.xattrs == b.xattrs)
                }
                (Ok(a), Ok(Some(b))) => !same_entry(entry.path(), &a, &there, &b).unwrap_or(false),
                (_, Err(_)) => true,
            };
            if differ {
                out.push(rel);
            }
        }
    }
    out.sort();
    out.dedup();
    Ok(out)
}

fn meta_if_any(path: &Path) -> Result<Option<Meta>> {
    match std::fs::symlink_metadata(path) {
        Ok(_) => Meta::read(path).map(Some),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
        Err(e) => Err(Error::io("stat", path)(e)),
    }
}

fn exists(path: &Path) -> bool {
    std::fs::symlink_metadata(path).is_ok()
}

fn names(dir: &Path) -> Result<BTreeSet<OsString>> {
    let read = std::fs::read_dir(dir).map_err(Error::io("read", dir))?;
    read.map(|e| e.map(|e| e.file_name()).map_err(Error::io("read", dir)))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn write(root: &Path, rel: &str, content: &str) {
        let p = root.join(rel);
        std::fs::create_dir_all(p.parent().unwrap()).unwrap();
        std::fs::write(p, content).unwrap();
    }

    fn listing(root: &Path) -> Vec<(String, String)> {
        let mut out = Vec::new();
        for e in WalkDir::new(root).min_depth(1).sort_by_file_name() {
            let e = e.unwrap();
            let rel = e.path().strip_prefix(root).unwrap().display().to_string();
            let what = if e.file_type().is_symlink() {
                format!("-> {}", std::fs::read_link(e.path()).unwrap().display())
            } else if e.file_type().is_dir() {
                "dir".to_owned()
            } else {
                std::fs::read_to_string(e.path()).unwrap()
            };
            out.push((rel, what));
        }
        out
    }

    #[test]
    fn a_whole_sync_makes_the_trees_equal() {
        let t = tempfile::tempdir().unwrap();
        let (src, live) = (t.path().join("src"), t.path().join("live"));
        write(&src, "a/keep", "same");
        write(&src, "a/changed", "old");
        write(&src, "gone-from-live", "back");
        write(&src, "kind/x", "a directory in the source");
        std::os::unix::fs::symlink("/etc", src.join("link")).unwrap();
        write(&live, "a/keep", "same");
        write(&live, "a/changed", "new");
        write(&live, "new/deep/file", "made since");
        write(&live, "kind", "a file in the live tree");
        std::os::unix::fs::symlink("/tmp", live.join("link")).unwrap();

        let report = sync_tree(&src, &live, &Scope::Whole).unwrap();
        assert_eq!(listing(&live), listing(&src));
        assert!(report.removed >= 1 && report.written >= 4, "{report:?}");
        // Nothing left to do the second time.
        assert_eq!(
            sync_tree(&src, &live, &Scope::Whole).unwrap(),
            SyncReport::default()
        );
    }

    #[test]
    fn differences_are_listed_within_the_filter() {
        let t = tempfile::tempdir().unwrap();
        let (old, new) = (t.path().join("old"), t.path().join("new"));
        write(&old, "etc/passwd", "root");
        write(&new, "etc/passwd", "root and more");
        write(&old, "etc/same", "x");
        write(&new, "etc/same", "x");
        let m = Meta::read(&old.join("etc/same")).unwrap();
        crate::overlay::tree::set_times(&new.join("etc/same"), &m).unwrap();
        write(&old, "etc/gone", "y");
        write(&new, "etc/new", "z");
        write(&new, "tmp/scratch", "ignored: outside the filter");
        nix::unistd::mkfifo(
            &new.join("etc/fifo"),
            nix::sys::stat::Mode::from_bits_truncate(0o600),
        )
        .unwrap();
        let keep = |p: &Path| p.starts_with("etc");
        let got = differences(&old, &new, &keep).unwrap();
        let want: Vec<PathBuf> = ["etc/fifo", "etc/gone", "etc/new", "etc/passwd"]
            .iter()
            .map(PathBuf::from)
            .collect();
        assert_eq!(got, want);
    }

    #[test]
    fn a_deep_tree_is_walked_without_recursion() {
        let t = tempfile::tempdir().unwrap();
        let (src, live) = (t.path().join("src"), t.path().join("live"));
        std::fs::create_dir_all(&src).unwrap();
        std::fs::create_dir_all(&live).unwrap();
        // Deeper than a recursive walk on a small stack would go.
        let make = |root: &Path, file: &str| {
            let mut dir = std::fs::File::open(root).unwrap();
            for _ in 0..600 {
                nix::sys::stat::mkdirat(
                    Some(std::os::fd::AsRawFd::as_raw_fd(&dir)),
                    "d",
                    nix::sys::stat::Mode::from_bits_truncate(0o755),
                )
                .unwrap();
                dir = std::fs::File::open(format!(
                    "/proc/self/fd/{}/d",
                    std::os::fd::AsRawFd::as_raw_fd(&dir)
                ))
                .unwrap();
            }
            std::fs::write(
                format!("/proc/self/fd/{}/f", std::os::fd::AsRawFd::as_raw_fd(&dir)),
                file,
            )
            .unwrap();
        };
        make(&src, "old");
        make(&live, "new");
        let run = std::thread::Builder::new()
            .stack_size(256 << 10)
            .spawn(move || {
                sync_tree(&src, &live, &Scope::Whole)?;
                let deepest = (0..600).fold(live.clone(), |p, _| p.join("d")).join("f");
                assert_eq!(std::fs::read_to_string(deepest).unwrap(), "old");
                Ok::<_, Error>(())
            })
            .unwrap()
            .join()
            .expect("no stack overflow");
        run.unwrap();
    }

    #[test]
    fn same_size_and_time_with_other_bytes_is_rewritten() {
        let t = tempfile::tempdir().unwrap();
        let (src, live) = (t.path().join("src"), t.path().join("live"));
        write(&src, "f", "aaaa");
        write(&live, "f", "bbbb");
        let m = Meta::read(&src.join("f")).unwrap();
        crate::overlay::tree::set_times(&live.join("f"), &m).unwrap();
        sync_tree(&src, &live, &Scope::Whole).unwrap();
        assert_eq!(std::fs::read_to_string(live.join("f")).unwrap(), "aaaa");
    }

    #[test]
    fn a_path_scope_leaves_other_paths_alone() {
        let t = tempfile::tempdir().unwrap();
        let (src, live) = (t.path().join("src"), t.path().join("live"));
        write(&src, "in", "source");
        write(&live, "in", "live");
        write(&src, "out", "source");
        write(&live, "out", "live: not in scope, assumed equal");
        write(&live, "extra", "present in one tree only");
        let scope = Scope::Paths([PathBuf::from("in")].into_iter().collect());
        sync_tree(&src, &live, &scope).unwrap();
        assert_eq!(std::fs::read_to_string(live.join("in")).unwrap(), "source");
        assert_eq!(
            std::fs::read_to_string(live.join("out")).unwrap(),
            "live: not in scope, assumed equal"
        );
        assert!(!live.join("extra").exists(), "presence differs: synced");
    }

    #[test]
    fn a_symlinked_directory_in_the_live_tree_is_replaced_not_followed() {
        let t = tempfile::tempdir().unwrap();
        let (src, live, outside) = (
            t.path().join("src"),
            t.path().join("live"),
            t.path().join("outside"),
        );
        write(&src, "d/f", "mine");
        write(&outside, "f", "not the sandbox's");
        std::fs::create_dir_all(&live).unwrap();
        std::os::unix::fs::symlink(&outside, live.join("d")).unwrap();
        sync_tree(&src, &live, &Scope::Whole).unwrap();
        assert_eq!(
            std::fs::read_to_string(outside.join("f")).unwrap(),
            "not the sandbox's"
        );
        assert!(std::fs::symlink_metadata(live.join("d")).unwrap().is_dir());
        assert_eq!(std::fs::read_to_string(live.join("d/f")).unwrap(), "mine");
    }
}
