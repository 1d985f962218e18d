//! The overlay-copy backend: snapshots are copies of an overlayfs upper
//! directory kept in a store directory; a file untouched since the previous
//! snapshot is a hard link to that snapshot's copy, so a snapshot writes
//! bytes in proportion to what changed. Works on any Linux filesystem.
//!
//! Store layout: `<store>/<name>/` (the tree), `<store>/<name>.index` (see
//! `index`), `<store>/<name>.meta` (`{"seq":N}`, written last: a snapshot
//! exists once its meta exists), `<store>/.tmp-<name>/` while being made.
//!
//! Whiteouts (0:0 character devices) and opaque directories
//! (`trusted.overlay.opaque`, `user.overlay.opaque` xattrs) are entries and
//! xattrs like any other, so they are saved and restored exactly.
//!
//! Invariant: files in the store are never written after they are created;
//! sharing them by hard link between snapshots is therefore safe, and live
//! files are always copied, never linked.
//!
//! Invariant: a rollback rewrites the upper directory in place, so it is
//! journaled: `.<upper's name>.crab-rollback` beside the upper names the
//! store and the snapshot (written whole and synced before the first
//! change; removed once the upper is synced). A journal that is there
//! means a rollback was cut short: [`finish_interrupted_rollback`] (the
//! shim, before it mounts an overlay it mounts itself; one dockerd mounted
//! is used as it is) completes it, so the upper is the old tree or the
//! snapshot's, never a mix that the shim mounts. A layer replaced whole
//! (crabd's resume) takes its journal aside with the old tree.

mod archive;

pub use archive::{read_stream, StreamEntry, StreamPolicy};
pub use tree::Kind as EntryKind;
mod copy;
mod index;
pub(crate) mod tree;

use std::io::{BufReader, Read, Write};
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};
use walkdir::WalkDir;

use self::copy::{copy_tree, restore_tree, Previous};
use self::index::Index;
use self::tree::{remove_any, Meta};
use crate::{Backend, BackendKind, Change, Error, Location, Result, Snapshot, SnapshotFiles, SnapshotName};

/// Snapshots of an overlayfs upper directory, kept as copies.
#[derive(Debug, Clone)]
pub struct OverlayCopyBackend {
    upper: PathBuf,
    store: PathBuf,
}

#[derive(Serialize, Deserialize)]
struct SnapMeta {
    seq: u64,
}

impl OverlayCopyBackend {
    /// A backend for the upper directory `upper` keeping snapshots in `store`.
    pub fn new(upper: &Path, store: &Path) -> Self {
        OverlayCopyBackend {
            upper: upper.to_owned(),
            store: store.to_owned(),
        }
    }

    /// Removes what snapshots cut short left in the store (`.tmp-*`);
    /// returns how many entries went. Only while no snapshot is being made.
    pub fn remove_partial(&self) -> Result<usize> {
        let entries = match std::fs::read_dir(&self.store) {
            Ok(e) => e,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(0),
            Err(e) => return Err(Error::io("read", &self.store)(e)),
        };
        let mut removed = 0;
        for entry in entries.flatten() {
            if !entry.file_name().to_string_lossy().starts_with(".tmp-") {
                continue;
            }
            let path = entry.path();
            let gone = if path.is_dir() {
                std::fs::remove_dir_all(&path)
            } else {
                std::fs::remove_file(&path)
            };
            gone.map_err(Error::io("remove", &path))?;
            removed += 1;
        }
        Ok(removed)
    }

    /// [`Backend::import`] of a stream from elsewhere, with what `policy`
    /// allows beyond plain files (the trait's import allows nothing more).
    pub fn import_with(
        &self,
        name: &SnapshotName,
        parent: Option<&SnapshotName>,
        input: &mut dyn Read,
        policy: StreamPolicy,
    ) -> Result<()> {
        let mut input = BufReader::new(input);
        let head = archive::read_head(&mut input)?;
        if head.parent.as_deref() != parent.map(SnapshotName::as_str) {
            return Err(Error::BadStream {
                reason: format!(
                    "the stream is relative to {:?}, the import to {:?}",
                    head.parent,
                    parent.map(SnapshotName::as_str)
                ),
            });
        }
        if let Some(p) = parent {
            self.require(p)?;
        }
        let tmp = self.begin(name)?;
        let res = (|| {
            match parent {
                Some(p) => link_tree(&self.dir(p), &tmp)?,
                None => std::fs::create_dir(&tmp).map_err(Error::io("create", &tmp))?,
            }
            archive::apply(&head, &mut input, &tmp, policy)?;
            self.publish(name, &tmp, &Index::new())
        })();
        if res.is_err() {
            let _ = remove_any(&tmp);
        }
        res?;
        // Into an empty location, a whole stream is also the live tree.
        let live_empty = std::fs::read_dir(&self.upper).map_or(true, |mut d| d.next().is_none());
        if parent.is_none() && live_empty {
            let _ = std::fs::remove_dir(&self.upper);
            copy_tree(&self.dir(name), &self.upper, None)?;
        }
        Ok(())
    }

    fn dir(&self, name: &SnapshotName) -> PathBuf {
        self.store.join(name.as_str())
    }

    fn file(&self, name: &SnapshotName, ext: &str) -> PathBuf {
        self.store.join(format!("{name}.{ext}"))
    }

    /// Snapshots with their sequence numbers, oldest first.
    fn snapshots(&self) -> Result<Vec<(u64, SnapshotName)>> {
        let mut out = Vec::new();
        let entries = match std::fs::read_dir(&self.store) {
            Ok(e) => e,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(out),
            Err(e) => return Err(Error::io("read", &self.store)(e)),
        };
        for entry in entries {
            let entry = entry.map_err(Error::io("read", &self.store))?;
            let fname = entry.file_name();
            let Some(stem) = fname.to_str().and_then(|f| f.strip_suffix(".meta")) else {
                continue;
            };
            let Ok(name) = SnapshotName::new(stem) else {
                continue;
            };
            let meta: SnapMeta = serde_json::from_slice(
                &std::fs::read(entry.path()).map_err(Error::io("read", entry.path()))?,
            )
            .map_err(|e| Error::BadStream {
                reason: format!("{}: {e}", entry.path().display()),
            })?;
            out.push((meta.seq, name));
        }
        out.sort();
        Ok(out)
    }

    fn require(&self, name: &SnapshotName) -> Result<()> {
        if !self.file(name, "meta").exists() {
            return Err(Error::NoSnapshot {
                name: name.to_string(),
            });
        }
        Ok(())
    }

    /// Publishes `.tmp-<name>` as snapshot `name` with `index`.
    fn publish(&self, name: &SnapshotName, tmp: &Path, index: &Index) -> Result<()> {
        let seq = self.snapshots()?.last().map_or(1, |(s, _)| s + 1);
        let idx_tmp = self.store.join(format!(".tmp-{name}.index"));
        index.save(&idx_tmp)?;
        let meta_tmp = self.store.join(format!(".tmp-{name}.meta"));
        let bytes = serde_json::to_vec(&SnapMeta { seq }).expect("a struct of integers encodes");
        std::fs::write(&meta_tmp, bytes).map_err(Error::io("write", &meta_tmp))?;
        // Invariant: the tree and index are durable before the meta file
        // that makes the snapshot exist; a tree or index without its meta is
        // garbage that `begin` clears.
        std::fs::rename(tmp, self.dir(name)).map_err(Error::io("publish", self.dir(name)))?;
        std::fs::rename(&idx_tmp, self.file(name, "index")).map_err(Error::io("publish", &idx_tmp))?;
        sync_fs(&self.store)?;
        std::fs::rename(&meta_tmp, self.file(name, "meta")).map_err(Error::io("publish", &meta_tmp))?;
        sync_fs(&self.store)
    }

    fn begin(&self, name: &SnapshotName) -> Result<PathBuf> {
        if self.file(name, "meta").exists() {
            return Err(Error::SnapshotExists {
                name: name.to_string(),
            });
        }
        // Left by a crash before the meta file was published.
        remove_any(&self.dir(name))?;
        remove_any(&self.file(name, "index"))?;
        std::fs::create_dir_all(&self.store).map_err(Error::io("create", &self.store))?;
        let tmp = self.store.join(format!(".tmp-{name}"));
        remove_any(&tmp)?;
        Ok(tmp)
    }
}

impl Backend for OverlayCopyBackend {
    fn kind(&self) -> BackendKind {
        BackendKind::OverlayCopy
    }

    fn live_path(&self) -> Result<PathBuf> {
        Ok(self.upper.clone())
    }

    fn snapshot(&self, name: &SnapshotName) -> Result<Snapshot> {
        if !self.upper.is_dir() {
            return Err(Error::NoLive {
                location: self.upper.display().to_string(),
            });
        }
        let tmp = self.begin(name)?;
        let prev = self.snapshots()?.pop().map(|(_, n)| n);
        let prev_index = match &prev {
            Some(p) => Some(Index::load(&self.file(p, "index"))?),
            None => None,
        };
        let prev_dir = prev.as_ref().map(|p| self.dir(p));
        let previous = match (&prev_dir, &prev_index) {
            (Some(dir), Some(index)) => Some(Previous { dir, index }),
            _ => None,
        };
        let res = copy_tree(&self.upper, &tmp, previous).and_then(|index| self.publish(name, &tmp, &index));
        if res.is_err() {
            let _ = remove_any(&tmp);
        }
        res?;
        Ok(Snapshot {
            name: name.clone(),
            bytes: None,
        })
    }

    fn list(&self) -> Result<Vec<Snapshot>> {
        Ok(self
            .snapshots()?
            .into_iter()
            .map(|(_, name)| Snapshot { name, bytes: None })
            .collect())
    }

    fn rollback(&self, name: &SnapshotName) -> Result<()> {
        self.require(name)?;
        let index = Index::load(&self.file(name, "index"))?;
        let journal = rollback_journal(&self.upper);
        let entry = RollbackJournal {
            store: self.store.clone(),
            name: name.clone(),
        };
        std::fs::create_dir_all(&self.upper).map_err(Error::io("create", &self.upper))?;
        write_synced(
            &journal,
            &serde_json::to_vec(&entry).expect("a journal serializes"),
        )?;
        restore_tree(&self.dir(name), &self.upper, &index)?;
        sync_fs(&self.upper)?;
        std::fs::remove_file(&journal).map_err(Error::io("remove", &journal))?;
        sync_parent(&journal)
    }

    fn files(&self, name: &SnapshotName) -> Result<SnapshotFiles> {
        self.require(name)?;
        Ok(SnapshotFiles::Layer {
            dir: self.dir(name),
            live: self.upper.clone(),
        })
    }

    fn clone_to(&self, name: &SnapshotName, to: &Location) -> Result<Box<dyn Backend>> {
        let Location::OverlayCopy { upper, store } = to else {
            return Err(Error::WrongLocation {
                expected: BackendKind::OverlayCopy,
                given: to.kind(),
            });
        };
        self.require(name)?;
        if upper.exists() {
            return Err(Error::TargetExists {
                location: upper.display().to_string(),
            });
        }
        if let Some(parent) = upper.parent() {
            std::fs::create_dir_all(parent).map_err(Error::io("create", parent))?;
        }
        copy_tree(&self.dir(name), upper, None)?;
        Ok(Box::new(OverlayCopyBackend::new(upper, store)))
    }

    fn changed_since(&self, name: &SnapshotName) -> Result<Change> {
        self.require(name)?;
        let index = Index::load(&self.file(name, "index"))?;
        let root = Meta::read(&self.upper)?;
        let mut changed = !index.untouched("", root.ino, root.ctime);
        let mut bytes = 0u64;
        let mut n_seen = 1usize;
        for entry in WalkDir::new(&self.upper).min_depth(1).follow_links(false) {
            let entry = entry.map_err(|e| Error::Io {
                op: "walk",
                path: self.upper.clone(),
                source: e.into(),
            })?;
            n_seen += 1;
            let rel = entry
                .path()
                .strip_prefix(&self.upper)
                .expect("walkdir yields paths under its root");
            let meta = Meta::read(entry.path())?;
            let same = rel
                .to_str()
                .is_some_and(|k| index.untouched(k, meta.ino, meta.ctime));
            if !same {
                changed = true;
                if meta.kind == tree::Kind::File {
                    bytes += meta.size;
                }
            }
        }
        if n_seen != index.entries.len() {
            changed = true;
        }
        Ok(if changed {
            Change::Changed { bytes: Some(bytes) }
        } else {
            Change::Unchanged
        })
    }

    fn export(&self, name: &SnapshotName, parent: Option<&SnapshotName>, out: &mut dyn Write) -> Result<()> {
        self.require(name)?;
        let parent_dir = match parent {
            Some(p) => {
                self.require(p)?;
                Some((p, self.dir(p)))
            }
            None => None,
        };
        archive::export(
            &self.dir(name),
            name,
            parent_dir.as_ref().map(|(p, d)| (*p, d.as_path())),
            out,
        )
    }

    fn import(&self, name: &SnapshotName, parent: Option<&SnapshotName>, input: &mut dyn Read) -> Result<()> {
        self.import_with(name, parent, input, StreamPolicy::default())
    }

    fn destroy(&self, name: &SnapshotName) -> Result<()> {
        self.require(name)?;
        // Unpublish first: a crash part-way leaves no half-listed snapshot.
        let meta = self.file(name, "meta");
        std::fs::remove_file(&meta).map_err(Error::io("remove", &meta))?;
        remove_any(&self.dir(name))?;
        remove_any(&self.file(name, "index"))
    }
}

/// Recreates `src` at `dst` with every file a hard link to `src`'s.
fn link_tree(src: &Path, dst: &Path) -> Result<()> {
    let mut dirs = Vec::new();
    for entry in WalkDir::new(src).follow_links(false).sort_by_file_name() {
        let entry = entry.map_err(|e| Error::Io {
            op: "walk",
            path: src.to_owned(),
            source: e.into(),
        })?;
        let rel = entry
            .path()
            .strip_prefix(src)
            .expect("walkdir yields paths under its root");
        let to = dst.join(rel);
        let meta = Meta::read(entry.path())?;
        match meta.kind {
            tree::Kind::Dir => {
                std::fs::create_dir(&to).map_err(Error::io("create directory", &to))?;
                dirs.push((to, meta));
            }
            tree::Kind::File => std::fs::hard_link(entry.path(), &to).map_err(Error::io("link", &to))?,
            _ => tree::copy_entry(entry.path(), &to, &meta)?,
        }
    }
    for (dir, meta) in dirs.iter().rev() {
        tree::apply_meta(dir, meta)?;
    }
    Ok(())
}

/// What a rollback under way records (see the module's invariants).
#[derive(Serialize, Deserialize)]
struct RollbackJournal {
    store: PathBuf,
    name: SnapshotName,
}

/// The journal of a rollback of `upper`: beside it, named after it.
pub fn rollback_journal(upper: &Path) -> PathBuf {
    let name = upper.file_name().unwrap_or_default().to_string_lossy();
    upper.with_file_name(format!(".{name}.crab-rollback"))
}

/// Completes a rollback of the upper directory `upper` that was cut short
/// (a crash, a killed shim), if its journal says one was under way;
/// answers the snapshot it now holds. Nothing to do: `None`.
///
/// # Errors
/// The journal cannot be read, or the rollback fails again (the journal
/// stays: the upper is not to be used as it is).
pub fn finish_interrupted_rollback(upper: &Path) -> Result<Option<SnapshotName>> {
    use std::os::unix::fs::{MetadataExt, OpenOptionsExt};
    let journal = rollback_journal(upper);
    let file = match std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(nix::libc::O_NOFOLLOW | nix::libc::O_NONBLOCK)
        .open(&journal)
    {
        Ok(f) => f,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(e) => return Err(Error::io("open", &journal)(e)),
    };
    let unfinished = |why: String| {
        Error::Refused {
        reason: format!(
            "{} names a rollback of these files that was cut short, and it cannot be finished: {why} \
             (crabctl resume puts a version's files back whole; removing that file accepts the files as they are)",
            journal.display()
        ),
    }
    };
    let md = file.metadata().map_err(Error::io("stat", &journal))?;
    if !md.is_file() || md.uid() != 0 || md.mode() & 0o022 != 0 {
        return Err(unfinished(
            "it is not a regular file that only root writes".to_owned(),
        ));
    }
    let mut bytes = Vec::new();
    (&file)
        .take(64 << 10)
        .read_to_end(&mut bytes)
        .map_err(Error::io("read", &journal))?;
    let entry: RollbackJournal =
        serde_json::from_slice(&bytes).map_err(|e| unfinished(format!("it does not parse ({e})")))?;
    if !entry.store.is_absolute() {
        return Err(unfinished("its store is not an absolute path".to_owned()));
    }
    OverlayCopyBackend::new(upper, &entry.store)
        .rollback(&entry.name)
        .map_err(|e| unfinished(e.to_string()))?;
    Ok(Some(entry.name))
}

/// Writes `bytes` to `path` whole: beside it, synced, renamed over it, its
/// directory synced.
fn write_synced(path: &Path, bytes: &[u8]) -> Result<()> {
    use std::os::unix::fs::OpenOptionsExt;
    let name = path.file_name().unwrap_or_default().to_string_lossy();
    let tmp = path.with_file_name(format!("{name}.tmp"));
    // A stale one (a crash before its rename) goes; never through a link.
    match std::fs::remove_file(&tmp) {
        Err(e) if e.kind() != std::io::ErrorKind::NotFound => return Err(Error::io("remove", &tmp)(e)),
        _ => {}
    }
    let mut f = std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .custom_flags(nix::libc::O_NOFOLLOW)
        .open(&tmp)
        .map_err(Error::io("create", &tmp))?;
    f.write_all(bytes).map_err(Error::io("write", &tmp))?;
    f.sync_all().map_err(Error::io("sync", &tmp))?;
    std::fs::rename(&tmp, path).map_err(Error::io("rename", path))?;
    sync_parent(path)
}

/// Syncs the directory holding `path`.
fn sync_parent(path: &Path) -> Result<()> {
    let dir = path.parent().unwrap_or(Path::new("/"));
    std::fs::File::open(dir)
        .and_then(|d| d.sync_all())
        .map_err(Error::io("sync", dir))
}

/// `syncfs(2)` on the filesystem holding `path`.
fn sync_fs(path: &Path) -> Result<()> {
    let f = std::fs::File::open(path).map_err(Error::io("open", path))?;
    use std::os::fd::AsRawFd;
    nix::unistd::syncfs(f.as_raw_fd()).map_err(|e| Error::io("sync", path)(e.into()))
}
