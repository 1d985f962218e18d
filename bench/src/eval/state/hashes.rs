//! Content hashes of a sandbox's files, remembered by the file's identity
//! so that a capture reads only the files that changed. A capture after
//! every step of 32 sandboxes hashed each sandbox's whole tree again
//! (about 130 ms of CPU each at that load), where nearly every file was
//! untouched since the last.
//!
//! A file's identity is its device, inode, size, and modification and
//! change times. The change time (ctime) is the kernel's: no call sets
//! it, and a write, a truncation, a rename onto the name or an inode
//! number used again sets it to now. Two gaps, closed here:
//! - Its clock is coarse (a tick), so a write in the tick of an earlier
//!   change leaves it as it was. As git does with its index, a hash is
//!   remembered only for a file whose ctime was at least [`SETTLED`] old
//!   when its read began and whose identity (of the open file) is the
//!   same at the read's end.
//! - A write through a shared mapping sets the ctime only at the first
//!   write after writeback cleaned the page (about 30 s of dirtiness at
//!   most, by default), and on tmpfs never: [`SETTLED`] is longer than
//!   writeback's expiry, and only files on filesystems that keep a ctime
//!   of their own (ext4, xfs, btrfs, and overlays, whose ctime is their
//!   layers') are remembered.
//!
//! The device keeps two mounted sandboxes apart (an overlay reports a
//! device of its own); a device number used again after an unmount is
//! told apart by the ctime, which is later than any remembered one.

use std::collections::BTreeMap;
use std::hash::Hasher;
use std::os::unix::fs::MetadataExt;
use std::path::Path;
use std::sync::Mutex;
use std::time::Duration;

use nix::sys::statfs::{self, FsType};

/// How old a file's ctime must be for its hash to be remembered: past
/// writeback's default dirty expiry (30 s) and its interval (5 s).
const SETTLED: Duration = Duration::from_secs(60);

/// Hashes a generation holds before it becomes the old one (and the old
/// one is forgotten): at most about 2 × 2^18 entries of 48 bytes.
const GENERATION: usize = 1 << 18;

/// Filesystems whose ctime is the kernel's own.
const KEPT_CTIME: [FsType; 4] = [
    statfs::EXT4_SUPER_MAGIC,
    statfs::XFS_SUPER_MAGIC,
    statfs::BTRFS_SUPER_MAGIC,
    statfs::OVERLAYFS_SUPER_MAGIC,
];

/// The harness's hashes, shared by every capture.
pub(super) static HASHES: Hashes = Hashes::new(SETTLED);

/// Remembered content hashes; see the module's doc.
pub(super) struct Hashes {
    settled: Duration,
    known: Mutex<Generations>,
}

/// The newer hashes and the ones before them (looked up too).
struct Generations {
    new: BTreeMap<Identity, u64>,
    old: BTreeMap<Identity, u64>,
}

/// A file as [`Hashes`] knows it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
struct Identity {
    dev: u64,
    ino: u64,
    size: u64,
    mtime_ns: i64,
    ctime_ns: i64,
}

// === impl Hashes ===

impl Hashes {
    const fn new(settled: Duration) -> Self {
        Hashes {
            settled,
            known: Mutex::new(Generations {
                new: BTreeMap::new(),
                old: BTreeMap::new(),
            }),
        }
    }

    /// The content hash of the regular file at `path` (16 hex digits),
    /// whose metadata, not following a link, is `meta`; or why it has none.
    pub(super) fn of(&self, path: &Path, meta: &std::fs::Metadata) -> String {
        let id = Identity::of(meta);
        if let Some(h) = self.known.lock().expect("hashes").get(&id) {
            return format!("{h:016x}");
        }
        let started = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| i64::try_from(d.as_nanos()).unwrap_or(i64::MAX));
        match hash_file(path, id) {
            Ok((hash, rememberable)) => {
                let settled_ns = i64::try_from(self.settled.as_nanos()).unwrap_or(i64::MAX);
                if rememberable && id.ctime_ns.saturating_add(settled_ns) <= started {
                    let forgotten = self.known.lock().expect("hashes").insert(id, hash);
                    drop(forgotten);
                }
                format!("{hash:016x}")
            }
            Err(why) => why,
        }
    }
}

// === impl Generations ===

impl Generations {
    fn get(&mut self, id: &Identity) -> Option<u64> {
        if let Some(h) = self.new.get(id) {
            return Some(*h);
        }
        let h = *self.old.get(id)?;
        // Still in use: kept into the next generation. (What it forgets
        // is dropped by the caller, after the lock.)
        drop(self.insert(*id, h));
        Some(h)
    }

    /// Remembers `hash`; answers the generation it forgets, if it starts
    /// a new one, for the caller to drop outside the lock.
    fn insert(&mut self, id: Identity, hash: u64) -> Option<BTreeMap<Identity, u64>> {
        let forgotten = (self.new.len() >= GENERATION)
            .then(|| std::mem::replace(&mut self.old, std::mem::take(&mut self.new)));
        self.new.insert(id, hash);
        forgotten
    }
}

// === impl Identity ===

impl Identity {
    fn of(meta: &std::fs::Metadata) -> Self {
        let ns = |secs: i64, nsec: i64| secs.saturating_mul(1_000_000_000).saturating_add(nsec);
        Identity {
            dev: meta.dev(),
            ino: meta.ino(),
            size: meta.size(),
            mtime_ns: ns(meta.mtime(), meta.mtime_nsec()),
            ctime_ns: ns(meta.ctime(), meta.ctime_nsec()),
        }
    }
}

/// A 64-bit hash of a file's content (equality, not security), and
/// whether it may be remembered as `id`'s: the open file was `id` before
/// and after the read, on a filesystem that keeps its ctime. Opened
/// without following a link and without blocking (a fifo swapped in),
/// streamed; an error is a value of its own, never an empty file's.
fn hash_file(path: &Path, id: Identity) -> Result<(u64, bool), String> {
    use std::io::Read;
    use std::os::unix::fs::OpenOptionsExt;
    let opened = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(nix::libc::O_NOFOLLOW | nix::libc::O_NONBLOCK)
        .open(path);
    let mut file = match opened {
        Ok(f) => f,
        Err(e) => return Err(format!("unreadable ({})", e.kind())),
    };
    let is = |file: &std::fs::File| {
        file.metadata()
            .ok()
            .filter(|m| m.is_file())
            .map(|m| Identity::of(&m))
    };
    let Some(before) = is(&file) else {
        return Err("no longer a regular file".into());
    };
    let mut h = std::collections::hash_map::DefaultHasher::new();
    let mut buf = vec![0u8; 1 << 16];
    loop {
        match file.read(&mut buf) {
            Ok(0) => break,
            Ok(n) => h.write(&buf[..n]),
            Err(e) => return Err(format!("unreadable ({})", e.kind())),
        }
    }
    let kept_ctime = statfs::fstatfs(&file).is_ok_and(|s| KEPT_CTIME.contains(&s.filesystem_type()));
    let rememberable = kept_ctime && before == id && is(&file) == Some(id);
    Ok((h.finish(), rememberable))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn meta(p: &Path) -> std::fs::Metadata {
        std::fs::symlink_metadata(p).unwrap()
    }

    /// A new directory `name` under /var/tmp (tmpfs keeps no ctime of its
    /// own, so nothing is remembered there, and /tmp may be one) holding
    /// file `f` with "1"; answers both.
    fn scratch(name: &str) -> (std::path::PathBuf, std::path::PathBuf) {
        let dir = Path::new("/var/tmp").join(format!("crab-eval-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        let file = dir.join("f");
        std::fs::write(&file, "1").unwrap();
        (dir, file)
    }

    #[test]
    fn a_hash_is_remembered_only_for_a_file_settled_before_its_read() {
        let (dir, file) = scratch("hashes");
        let on_kept_fs = statfs::statfs(&dir).is_ok_and(|s| KEPT_CTIME.contains(&s.filesystem_type()));
        assert!(on_kept_fs, "/var/tmp is on ext4, xfs, btrfs or overlay here");

        // Changed within the last hour: hashed, not remembered.
        let hour = Hashes::new(Duration::from_secs(3600));
        let first = hour.of(&file, &meta(&file));
        assert_eq!(first.len(), 16, "{first}");
        assert!(hour.known.lock().unwrap().new.is_empty());

        // Settled (no wait asked): remembered, and given back for the same
        // identity without a read.
        let now = Hashes::new(Duration::ZERO);
        let then = meta(&file);
        assert_eq!(now.of(&file, &then), first);
        assert_eq!(now.known.lock().unwrap().new.len(), 1);
        std::fs::write(&file, "22").unwrap();
        assert_eq!(now.of(&file, &then), first, "the remembered identity answers");
        // The file changed: a new identity (its size here; its ctime in
        // general), read again.
        assert_ne!(now.of(&file, &meta(&file)), first);
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn an_identity_that_changed_during_the_read_is_not_remembered() {
        let (dir, file) = scratch("hashes-moved");
        let stale = meta(&file);
        std::fs::write(&file, "22").unwrap();
        // The walk's metadata says "1"-sized; the open file is not that.
        let hashes = Hashes::new(Duration::ZERO);
        let _ = hashes.of(&file, &stale);
        assert!(hashes.known.lock().unwrap().new.is_empty());
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn generations_keep_what_is_in_use_and_forget_the_rest() {
        let id = |n: u64| Identity {
            dev: 1,
            ino: n,
            size: 0,
            mtime_ns: 0,
            ctime_ns: 0,
        };
        let mut g = Generations {
            new: BTreeMap::new(),
            old: BTreeMap::new(),
        };
        for n in 0..GENERATION as u64 {
            assert!(g.insert(id(n), n).is_none());
        }
        // The next starts a generation: nothing is forgotten yet.
        assert_eq!(g.insert(id(u64::MAX), 7).map(|f| f.len()), Some(0));
        assert_eq!(g.get(&id(3)), Some(3), "the old generation answers");
        assert_eq!(g.new.len(), 2, "and what it answered moves to the new one");
        for n in 0..GENERATION as u64 {
            g.insert(id(1 << 40 | n), n);
        }
        assert_eq!(g.get(&id(4)), None, "forgotten after two generations");
        assert_eq!(g.get(&id(3)), Some(3), "kept because it was in use");
    }
}
