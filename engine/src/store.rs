//! The version store: a durable, versioned record of each sandbox's
//! recoverable points.
//!
//! A version is `V_i = (P_j, F_k, T_i)` (DESIGN.md): a process image, a
//! filesystem snapshot and the transcript prefix at turn i. What a version
//! did not capture itself it takes from its parent, the sandbox's head (the
//! version the running state descends from, see `head.rs`), so versions
//! form a tree: a rollback moves the head and keeps every newer version. The store keeps, per sandbox, an append-only manifest of versions and
//! the process images they hold; filesystem snapshots live in their backend
//! and are only named here.
//!
//! Layout under the root (default [`DEFAULT_ROOT`]):
//!
//! ```text
//! <root>/lock                         flock(2)ed by the one open store
//! <root>/sandboxes/<id>/versions.log  the manifest: a header line, then one
//!                                     line per version (format: record.rs)
//! <root>/sandboxes/<id>/head.json     where the head last moved other than
//!                                     by a publish (format: head.rs)
//! <root>/images/<id>/<version>/       the process image that version wrote:
//!                                     opaque files (CRIU's), any tree
//! <root>/images/<id>/.tmp-<version>-<attempt>/  a process image being written
//! <root>/trash/                       directories on their way out
//! ```
//!
//! A manifest line is `<sha256-hex of json> <json>\n`; the json is
//! `{"v":1,"kind":"header","sandbox":…,"next_version":…}` on line 1 and
//! `{"v":1,"kind":"version","sandbox":…,"version":…,"created_unix_ms":…,
//! "turn":…,"class":"none|fs|proc|full","parent":<version>|null,
//! "process_image":<version>|null,
//! "fs_snapshot":{"backend":…,"name":…}|null,"transcript_turns":…,
//! "images":[{"path":…,"bytes":…,"sha256":…}]}` after it.
//!
//! Crash safety:
//! - Invariant: a version's manifest line is appended only after the files
//!   and directories it names are fsynced and renamed into place, and
//!   [`PendingVersion::publish`] returns only after the line is fsynced.
//! - A torn last line (a crash mid-append) is cut off when the store opens
//!   and reported by [`VersionStore::recovery`]; it is never listed. Its
//!   number may be given out again: its publish never returned, so no
//!   caller can hold that number, and the images directory it would have
//!   named is removed first.
//! - A number that an intact or corrupt complete line holds is never given
//!   out again, also after compaction (the header keeps the high mark).
//! - `.tmp-*` directories, images directories no line can name, and a
//!   half-written compaction (`versions.log.tmp`) are removed at open; so
//!   are a sandbox directory without a manifest and the images of a
//!   sandbox without one (a register or [`VersionStore::forget`] cut short).
//!   Removed sandboxes go to `<root>/trash/` first (a rename), and are
//!   deleted from there without a lock ([`VersionStore::empty_trash`]).
//!
//! Calls block (file I/O, hashing): async callers run them on a blocking
//! thread. One process opens a root at a time (the lock file); within it,
//! the store may be shared by threads. Each sandbox has its own lock, held
//! for manifest reads and writes but not while image files are hashed, so
//! sandboxes do not wait for each other (except for a `register`, which
//! holds the table of sandboxes while it creates one).

mod durable;
mod error;
mod head;
mod images;
mod manifest;
mod publish;
mod query;
mod record;
mod recover;
mod retain;

use std::collections::BTreeMap;
use std::fs::{self, File, OpenOptions};
use std::os::unix::fs::{DirBuilderExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::sync::Arc;

use nix::fcntl::{Flock, FlockArg};
use parking_lot::Mutex;

pub(crate) use self::durable::{replace_file, sync_parent};
pub use self::error::StoreError;
pub use self::publish::{Capture, NewVersion, PendingVersion};
pub use self::query::{Version, VersionInfo};
pub use self::record::{Class, FsSnapshot, ImageFile, VersionRecord};
pub use self::recover::{Recovery, TornLine};
pub use self::retain::Removal;
pub use crab_api::SandboxId;

use self::head::Head;
use self::manifest::{Lookup, Manifest};
use self::record::Header;

/// Where the store lives unless configured otherwise.
pub const DEFAULT_ROOT: &str = "/var/lib/crab";

/// Result of a version store operation.
pub(crate) type Result<T, E = StoreError> = std::result::Result<T, E>;

/// The version store of one host.
///
/// Cloning is cheap; clones share the store.
#[derive(Debug, Clone)]
pub struct VersionStore {
    inner: Arc<Inner>,
}

/// Why a version is not valid.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Defect {
    /// Its manifest line fails its checksum or does not parse.
    CorruptLine {
        /// The line, from 1.
        line: u64,
    },
    /// Its manifest line names another sandbox.
    NotOfSandbox {
        /// The line, from 1.
        line: u64,
        /// The sandbox it names.
        found: String,
    },
    /// A file of the process image it uses is missing.
    MissingImage {
        /// The version holding the process image.
        holder: u64,
        /// The file, relative to the holder's images directory.
        file: String,
    },
    /// A file of the process image it uses differs from its record.
    CorruptImage {
        /// The version holding the process image.
        holder: u64,
        /// The file, relative to the holder's images directory.
        file: String,
    },
    /// The version holding its process image is not in the manifest.
    MissingDependency {
        /// The version that should hold the process image.
        holder: u64,
    },
}

#[derive(Debug)]
struct Inner {
    root: PathBuf,
    sandboxes: Mutex<BTreeMap<SandboxId, Arc<Mutex<SandboxState>>>>,
    /// Held for the store's life: one process per root.
    _lock: Flock<File>,
}

/// What the store keeps in memory about a sandbox.
#[derive(Debug)]
struct SandboxState {
    id: SandboxId,
    /// The number the next version gets.
    next_version: u64,
    /// The version the running sandbox descends from: what a new version
    /// reuses, and its parent.
    head: Head,
    /// The version being written, if any.
    pending: Option<Pending>,
    /// What opening the store repaired.
    recovery: Recovery,
}

/// What a pending version reuses: retention keeps it.
#[derive(Debug, Clone)]
struct Pending {
    version: u64,
    process_image: Option<u64>,
    fs_snapshot: Option<FsSnapshot>,
}

// === impl VersionStore ===

impl VersionStore {
    /// Opens (creating if needed) the store at `root`, repairs what a crash
    /// left behind (see the module doc) and loads every sandbox.
    ///
    /// # Errors
    /// [`StoreError::Locked`] if another process has it open;
    /// [`StoreError::Io`].
    ///
    /// ```no_run
    /// let store = crab_engine::VersionStore::open(crab_engine::DEFAULT_ROOT)?;
    /// # Ok::<(), crab_engine::StoreError>(())
    /// ```
    pub fn open(root: impl AsRef<Path>) -> Result<VersionStore> {
        let root = root.as_ref().to_owned();
        // The sandboxes' files, memory images and snapshots keep the modes
        // they had inside (setuid copies, device nodes): no one but root
        // may reach them, also when an older version made the root wider.
        std::fs::DirBuilder::new()
            .recursive(true)
            .mode(0o700)
            .create(&root)
            .map_err(StoreError::io("create the store", &root))?;
        std::fs::set_permissions(&root, std::fs::Permissions::from_mode(0o700))
            .map_err(StoreError::io("make the store root's alone", &root))?;
        durable::create_dir(&root.join("sandboxes"))?;
        durable::create_dir(&root.join("images"))?;
        let lock_path = root.join("lock");
        let lock_file = OpenOptions::new()
            .create(true)
            .truncate(false)
            .write(true)
            .open(&lock_path)
            .map_err(StoreError::io("open lock file", &lock_path))?;
        let lock = match Flock::lock(lock_file, FlockArg::LockExclusiveNonblock) {
            Ok(lock) => lock,
            Err((_, nix::errno::Errno::EWOULDBLOCK)) => return Err(StoreError::Locked { root }),
            Err((_, errno)) => {
                return Err(StoreError::Io {
                    op: "lock",
                    path: lock_path,
                    source: errno.into(),
                })
            }
        };
        let inner = Inner {
            root,
            sandboxes: Mutex::new(BTreeMap::new()),
            _lock: lock,
        };
        let dir = inner.root.join("sandboxes");
        for entry in fs::read_dir(&dir).map_err(StoreError::io("read directory", &dir))? {
            let entry = entry.map_err(StoreError::io("read directory", &dir))?;
            let name = entry.file_name();
            let Some(id) = name.to_str().and_then(|n| SandboxId::new(n).ok()) else {
                tracing::warn!(entry = ?name, "not a sandbox id in the store, left alone");
                continue;
            };
            if !entry.path().is_dir() {
                tracing::warn!(entry = ?name, "not a sandbox directory, left alone");
                continue;
            }
            let manifest = inner.manifest_path(&id);
            match manifest.try_exists() {
                Ok(true) => {}
                // A register or forget that a crash cut short.
                Ok(false) => {
                    tracing::warn!(sandbox = %id, "sandbox directory without a manifest removed");
                    inner.to_trash(&entry.path())?;
                    continue;
                }
                Err(e) => return Err(StoreError::io("look for", &manifest)(e)),
            }
            let state = recover::load(&inner, id.clone())?;
            inner.sandboxes.lock().insert(id, Arc::new(Mutex::new(state)));
        }
        // Images of sandboxes without a manifest: a register or forget cut
        // short. Entries that are no sandbox's name are left alone.
        let images = inner.root.join("images");
        for entry in fs::read_dir(&images).map_err(StoreError::io("read directory", &images))? {
            let entry = entry.map_err(StoreError::io("read directory", &images))?;
            let Some(id) = entry.file_name().to_str().and_then(|n| SandboxId::new(n).ok()) else {
                continue;
            };
            if entry.path().is_dir() && !inner.sandboxes.lock().contains_key(&id) {
                tracing::warn!(sandbox = %id, "images of no sandbox removed");
                inner.to_trash(&entry.path())?;
            }
        }
        let store = VersionStore {
            inner: Arc::new(inner),
        };
        store.empty_trash();
        Ok(store)
    }

    /// Where directories wait to be deleted (see [`VersionStore::empty_trash`]).
    pub fn trash_dir(&self) -> PathBuf {
        self.inner.trash_dir()
    }

    /// Deletes what is in the trash: what [`VersionStore::forget`] and the
    /// repairs at open put there, and what the caller moved there (on the
    /// same filesystem as the store). Slow for large images; holds no lock.
    pub fn empty_trash(&self) {
        let dir = self.inner.trash_dir();
        let Ok(entries) = fs::read_dir(&dir) else {
            return;
        };
        for entry in entries.flatten() {
            if let Err(e) = fs::remove_dir_all(entry.path()) {
                tracing::warn!(path = %entry.path().display(), "trash kept: {e}");
            }
        }
    }

    /// The store's root directory.
    pub fn root(&self) -> &Path {
        &self.inner.root
    }

    /// Registers a new sandbox with an empty manifest.
    ///
    /// # Errors
    /// [`StoreError::SandboxExists`].
    pub fn register(&self, sandbox: &SandboxId) -> Result<()> {
        let mut sandboxes = self.inner.sandboxes.lock();
        if sandboxes.contains_key(sandbox) {
            return Err(StoreError::SandboxExists {
                sandbox: sandbox.clone(),
            });
        }
        let inner = &self.inner;
        durable::create_dir(&inner.images_root(sandbox))?;
        durable::create_dir(&inner.sandbox_dir(sandbox))?;
        let header = Header {
            sandbox: sandbox.clone(),
            next_version: 1,
        };
        // Invariant: the manifest appears whole (renamed in), so a sandbox
        // directory with a manifest is a registered sandbox.
        manifest::rewrite(&inner.manifest_path(sandbox), &header, [])?;
        let state = recover::load(inner, sandbox.clone())?;
        sandboxes.insert(sandbox.clone(), Arc::new(Mutex::new(state)));
        tracing::info!(sandbox = %sandbox, "sandbox registered");
        Ok(())
    }

    /// The registered sandboxes, sorted.
    pub fn sandboxes(&self) -> Vec<SandboxId> {
        self.inner.sandboxes.lock().keys().cloned().collect()
    }

    /// The head of `sandbox`: the version its running state descends from,
    /// which a new version inherits from and names as its parent. None when
    /// the next version must capture everything (a new sandbox, a restarted
    /// task, a removed or corrupt head).
    pub fn head(&self, sandbox: &SandboxId) -> Result<Option<u64>> {
        Ok(self.inner.sandbox(sandbox)?.lock().head.version())
    }

    /// Moves the head of `sandbox` to `version` (a rollback restored it) or
    /// to none (its task started afresh), durably.
    ///
    /// # Errors
    /// [`StoreError::UnknownVersion`] when no intact line holds `version`;
    /// [`StoreError::PendingExists`] while a version is being written.
    pub fn set_head(&self, sandbox: &SandboxId, version: Option<u64>) -> Result<()> {
        let state = self.inner.sandbox(sandbox)?;
        let mut state = state.lock();
        if let Some(p) = &state.pending {
            return Err(StoreError::PendingExists {
                sandbox: sandbox.clone(),
                version: p.version,
            });
        }
        let head = match version {
            None => Head::None,
            Some(v) => match self.inner.read_manifest(sandbox)?.lookup(v) {
                Lookup::Found(r) => Head::Intact(r.clone()),
                Lookup::Bad { .. } | Lookup::Unknown => {
                    return Err(StoreError::UnknownVersion {
                        sandbox: sandbox.clone(),
                        version: v,
                    })
                }
            },
        };
        head.store(&self.inner, sandbox, state.next_version)?;
        tracing::info!(sandbox = %sandbox, head = ?version, "head moved");
        state.head = head;
        Ok(())
    }

    /// What opening the store found and repaired for `sandbox`.
    pub fn recovery(&self, sandbox: &SandboxId) -> Result<Recovery> {
        Ok(self.inner.sandbox(sandbox)?.lock().recovery.clone())
    }

    /// The directory holding every process image of `sandbox`.
    pub fn images_of(&self, sandbox: &SandboxId) -> PathBuf {
        self.inner.images_root(sandbox)
    }
}

// === impl Inner ===

impl Inner {
    fn sandbox(&self, sandbox: &SandboxId) -> Result<Arc<Mutex<SandboxState>>> {
        match self.sandboxes.lock().get(sandbox) {
            Some(state) => Ok(state.clone()),
            None => Err(StoreError::UnknownSandbox {
                sandbox: sandbox.clone(),
            }),
        }
    }

    fn sandbox_dir(&self, sandbox: &SandboxId) -> PathBuf {
        self.root.join("sandboxes").join(sandbox.as_str())
    }

    fn trash_dir(&self) -> PathBuf {
        self.root.join("trash")
    }

    /// Moves `dir` into the trash under a name of its own.
    fn to_trash(&self, dir: &Path) -> Result<()> {
        let trash = self.trash_dir();
        durable::create_dir(&trash)?;
        let name = dir.file_name().unwrap_or_default().to_string_lossy();
        let unique = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap_or_default()
            .as_nanos();
        let to = trash.join(format!("{name}-{unique}"));
        match fs::rename(dir, &to) {
            Ok(()) => durable::sync_parent(dir),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(()),
            Err(e) => Err(StoreError::io("move to the trash", dir)(e)),
        }
    }

    fn manifest_path(&self, sandbox: &SandboxId) -> PathBuf {
        self.sandbox_dir(sandbox).join("versions.log")
    }

    fn images_root(&self, sandbox: &SandboxId) -> PathBuf {
        self.root.join("images").join(sandbox.as_str())
    }

    fn images_dir(&self, sandbox: &SandboxId, version: u64) -> PathBuf {
        self.images_root(sandbox).join(version.to_string())
    }

    fn read_manifest(&self, sandbox: &SandboxId) -> Result<Manifest> {
        Manifest::read(&self.manifest_path(sandbox), sandbox)
    }
}

/// Whether the test run stops at crash point `point` (see [`crash_point`]).
#[cfg(test)]
fn stops_at(point: &str) -> bool {
    std::env::var(tests::STOP_AT_ENV).is_ok_and(|p| p == point)
}

/// A point in a publish where crash tests kill the process: when the test
/// run asks to stop here, says so on stdout and waits to be SIGKILLed.
fn crash_point(point: &str) {
    #[cfg(test)]
    if stops_at(point) {
        tests::stop_here(point);
    }
    #[cfg(not(test))]
    let _ = point;
}

#[cfg(test)]
mod tests;
