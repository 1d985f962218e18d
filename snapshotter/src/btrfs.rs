//! The btrfs backend, driving `btrfs` (btrfs-progs), and making its
//! snapshots by ioctl (no command: a checkpoint's snapshot runs in the
//! shim's own process, while the sandbox is frozen).
//!
//! Two layouts. Crab's own, under the sandbox's directory `DIR` (on btrfs):
//! `DIR/live` is the writable subvolume, `DIR/.snapshots/<name>` the
//! read-only snapshots. Or a subvolume made by someone else (containerd's
//! btrfs snapshotter) and a store directory on the same filesystem.
//!
//! The snapshots' directory, and in crab's layout the sandbox's directory
//! (the live subvolume's parent), are 0700 (root's alone): they keep the
//! sandbox's files with their modes.
//!
//! Rollback makes a writable snapshot of the target beside the live
//! subvolume and swaps the two atomically (`renameat2(RENAME_EXCHANGE)`),
//! then deletes the old one: the live path keeps its name but names a new
//! subvolume (with a new id), so it must not be mounted during a rollback.

use std::io::{Read, Write};
use std::path::{Path, PathBuf};

use crate::command::{run, run_from, run_to};
use crate::{Backend, BackendKind, Change, Error, Location, Result, Snapshot, SnapshotFiles, SnapshotName};

const BTRFS: &str = "btrfs";

/// A sandbox's subvolume and its snapshots.
#[derive(Debug, Clone)]
pub struct BtrfsBackend {
    live: PathBuf,
    snapshots: PathBuf,
}

impl BtrfsBackend {
    /// A backend for the sandbox directory `dir` (which need not exist yet).
    pub fn new(dir: &Path) -> Self {
        BtrfsBackend {
            live: dir.join("live"),
            snapshots: dir.join(".snapshots"),
        }
    }

    /// A backend for the existing subvolume `subvolume`, keeping its
    /// snapshots in `store` (on the same filesystem).
    pub fn at(subvolume: &Path, store: &Path) -> Self {
        BtrfsBackend {
            live: subvolume.to_owned(),
            snapshots: store.to_owned(),
        }
    }

    /// The backend a btrfs `location` names, if it names one.
    pub fn for_location(location: &Location) -> Option<Self> {
        match location {
            Location::Btrfs { dir } => Some(BtrfsBackend::new(dir)),
            Location::BtrfsSubvolume { subvolume, store } => Some(BtrfsBackend::at(subvolume, store)),
            _ => None,
        }
    }

    /// Creates `dir` and its empty `live` subvolume.
    pub fn create(dir: &Path) -> Result<Self> {
        private_dir(dir)?;
        let b = BtrfsBackend::new(dir);
        run(BTRFS, &["subvolume", "create", &path_str(&b.live())?])?;
        Ok(b)
    }

    fn live(&self) -> PathBuf {
        self.live.clone()
    }

    fn snapshots_dir(&self) -> PathBuf {
        self.snapshots.clone()
    }

    /// Where a rollback builds the new live subvolume: beside the live one,
    /// because a rename cannot cross subvolumes.
    fn rollback_path(&self) -> PathBuf {
        let name = self.live.file_name().unwrap_or_default().to_string_lossy();
        self.live.with_file_name(format!(".{name}.crab-rollback"))
    }

    fn snap(&self, name: &SnapshotName) -> PathBuf {
        self.snapshots_dir().join(name.as_str())
    }

    fn require(&self, name: &SnapshotName) -> Result<PathBuf> {
        let p = self.snap(name);
        if !p.is_dir() {
            return Err(Error::NoSnapshot {
                name: name.to_string(),
            });
        }
        Ok(p)
    }

    /// Paths in `.snapshots/`.
    fn entries(&self) -> Result<Vec<PathBuf>> {
        let dir = self.snapshots_dir();
        let read = std::fs::read_dir(&dir).map_err(Error::io("read", &dir))?;
        Ok(read.filter_map(|e| e.ok().map(|e| e.path())).collect())
    }

    /// Creates the directory the live subvolume goes in.
    fn make_live_parent(&self) -> Result<()> {
        match self.live.parent() {
            Some(dir) => private_dir(dir),
            None => Ok(()),
        }
    }

    /// A field of `btrfs subvolume show` (e.g. `Generation`).
    fn show_field(path: &Path, field: &str) -> Result<Option<u64>> {
        let out = run(BTRFS, &["subvolume", "show", &path_str(path)?])?;
        Ok(out.lines().find_map(|l| {
            let (k, v) = l.trim().split_once(':')?;
            (k.trim() == field).then(|| v.trim().parse().ok())?
        }))
    }
}

impl Backend for BtrfsBackend {
    fn kind(&self) -> BackendKind {
        BackendKind::Btrfs
    }

    fn live_path(&self) -> Result<PathBuf> {
        Ok(self.live())
    }

    fn snapshot(&self, name: &SnapshotName) -> Result<Snapshot> {
        if !self.live().is_dir() {
            return Err(Error::NoLive {
                location: self.live().display().to_string(),
            });
        }
        let to = self.snap(name);
        if to.exists() {
            return Err(Error::SnapshotExists {
                name: name.to_string(),
            });
        }
        private_dir(&self.snapshots_dir())?;
        // A btrfs snapshot is created atomically.
        snapshot_readonly(&self.live(), &to)?;
        Ok(Snapshot {
            name: name.clone(),
            bytes: None,
        })
    }

    fn list(&self) -> Result<Vec<Snapshot>> {
        let mut found = Vec::new();
        let entries = match std::fs::read_dir(self.snapshots_dir()) {
            Ok(e) => e,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Vec::new()),
            Err(e) => return Err(Error::io("read", self.snapshots_dir())(e)),
        };
        for entry in entries {
            let entry = entry.map_err(Error::io("read", self.snapshots_dir()))?;
            let Some(name) = entry.file_name().to_str().and_then(|n| SnapshotName::new(n).ok()) else {
                continue;
            };
            // "Gen at creation" orders snapshots as they were taken.
            let gen = Self::show_field(&entry.path(), "Gen at creation")?.unwrap_or(0);
            found.push((gen, name));
        }
        found.sort();
        Ok(found
            .into_iter()
            .map(|(_, name)| Snapshot { name, bytes: None })
            .collect())
    }

    fn has(&self, name: &SnapshotName) -> Result<bool> {
        // A snapshot is made atomically under its name: no command needed.
        Ok(self.snap(name).is_dir())
    }

    fn rollback(&self, name: &SnapshotName) -> Result<()> {
        let snap = self.require(name)?;
        let fresh = self.rollback_path();
        if fresh.exists() {
            delete_subvolume(&fresh)?;
        }
        run(
            BTRFS,
            &["subvolume", "snapshot", &path_str(&snap)?, &path_str(&fresh)?],
        )?;
        nix::fcntl::renameat2(
            None,
            &fresh,
            None,
            &self.live(),
            nix::fcntl::RenameFlags::RENAME_EXCHANGE,
        )
        .map_err(|e| Error::io("swap", self.live())(e.into()))?;
        // `fresh` now names the old live subvolume. The rollback is done;
        // a subvolume that cannot go now goes at the next rollback.
        if let Err(e) = delete_subvolume(&fresh) {
            tracing::warn!(old = %fresh.display(), error = %e, "old live subvolume kept");
        }
        Ok(())
    }

    fn files(&self, name: &SnapshotName) -> Result<SnapshotFiles> {
        self.require(name).map(SnapshotFiles::Tree)
    }

    fn clone_to(&self, name: &SnapshotName, to: &Location) -> Result<Box<dyn Backend>> {
        let target = BtrfsBackend::for_location(to).ok_or(Error::WrongLocation {
            expected: BackendKind::Btrfs,
            given: to.kind(),
        })?;
        let snap = self.require(name)?;
        if target.live().exists() {
            return Err(Error::TargetExists {
                location: target.live().display().to_string(),
            });
        }
        target.make_live_parent()?;
        run(
            BTRFS,
            &[
                "subvolume",
                "snapshot",
                &path_str(&snap)?,
                &path_str(&target.live())?,
            ],
        )?;
        Ok(Box::new(target))
    }

    fn changed_since(&self, name: &SnapshotName) -> Result<Change> {
        let snap = self.require(name)?;
        // Generations advance at transaction commit: commit first.
        run(BTRFS, &["filesystem", "sync", &path_str(&self.live())?])?;
        let live = Self::show_field(&self.live(), "Generation")?;
        let at = Self::show_field(&snap, "Gen at creation")?;
        Ok(match (live, at) {
            (Some(l), Some(a)) if l <= a => Change::Unchanged,
            (Some(_), Some(_)) => Change::Changed { bytes: None },
            _ => Change::Unknown,
        })
    }

    fn export(&self, name: &SnapshotName, parent: Option<&SnapshotName>, out: &mut dyn Write) -> Result<()> {
        let snap = path_str(&self.require(name)?)?;
        match parent {
            Some(p) => {
                let parent = path_str(&self.require(p)?)?;
                run_to(BTRFS, &["send", "-q", "-p", &parent, &snap], out)
            }
            None => run_to(BTRFS, &["send", "-q", &snap], out),
        }
    }

    fn import(&self, name: &SnapshotName, parent: Option<&SnapshotName>, input: &mut dyn Read) -> Result<()> {
        if self.snap(name).exists() {
            return Err(Error::SnapshotExists {
                name: name.to_string(),
            });
        }
        if let Some(p) = parent {
            self.require(p)?;
        }
        private_dir(&self.snapshots_dir())?;
        // The stream names its subvolume after the sender's snapshot, and a
        // received subvolume cannot be moved (it is read-only): receive
        // straight into `.snapshots/` and check the name afterwards.
        let before = self.entries()?;
        let received = run_from(
            BTRFS,
            &["receive", "-q", &path_str(&self.snapshots_dir())?],
            input,
        );
        let new: Vec<PathBuf> = self
            .entries()?
            .into_iter()
            .filter(|e| !before.contains(e))
            .collect();
        let bad_name = new.len() != 1 || new[0] != self.snap(name);
        if received.is_err() || bad_name {
            // A torn or foreign stream leaves a partial subvolume: never keep it.
            for sub in &new {
                delete_subvolume(sub)?;
            }
            received?;
            return Err(Error::BadStream {
                reason: format!("the stream does not hold snapshot {name}"),
            });
        }
        if parent.is_none() && !self.live().exists() {
            self.make_live_parent()?;
            run(
                BTRFS,
                &[
                    "subvolume",
                    "snapshot",
                    &path_str(&self.snap(name))?,
                    &path_str(&self.live())?,
                ],
            )?;
        }
        Ok(())
    }

    fn destroy(&self, name: &SnapshotName) -> Result<()> {
        let snap = self.require(name)?;
        delete_subvolume(&snap)
    }
}

/// Creates `dir` (and what is missing above it) 0700, and makes it 0700 if
/// it was there: snapshots keep the sandbox's files with their modes (a
/// setuid copy, a device node made inside), which no other host user may
/// reach.
fn private_dir(dir: &Path) -> Result<()> {
    use std::os::unix::fs::{DirBuilderExt, PermissionsExt};
    std::fs::DirBuilder::new()
        .recursive(true)
        .mode(0o700)
        .create(dir)
        .map_err(Error::io("create", dir))?;
    std::fs::set_permissions(dir, std::fs::Permissions::from_mode(0o700)).map_err(Error::io("chmod", dir))
}

fn path_str(p: &Path) -> Result<String> {
    p.to_str().map(str::to_owned).ok_or_else(|| Error::Io {
        op: "use non-UTF-8 path",
        path: p.to_owned(),
        source: std::io::ErrorKind::InvalidInput.into(),
    })
}

/// `struct btrfs_ioctl_vol_args_v2` of `linux/btrfs.h` (4096 bytes).
#[repr(C)]
struct VolArgsV2 {
    fd: i64,
    transid: u64,
    flags: u64,
    unused: [u64; 4],
    name: [u8; SUBVOL_NAME_MAX + 1],
}

const _: () = assert!(std::mem::size_of::<VolArgsV2>() == 4096);

/// The longest name of a subvolume.
const SUBVOL_NAME_MAX: usize = 4039;
/// `BTRFS_SUBVOL_RDONLY`.
const SUBVOL_RDONLY: u64 = 1 << 1;

nix::ioctl_write_ptr!(btrfs_snap_create_v2, 0x94, 23, VolArgsV2);

/// `struct btrfs_ioctl_vol_args` of `linux/btrfs.h` (4096 bytes).
#[repr(C)]
struct VolArgs {
    fd: i64,
    name: [u8; PATH_NAME_MAX + 1],
}

const _: () = assert!(std::mem::size_of::<VolArgs>() == 4096);

/// `BTRFS_PATH_NAME_MAX`.
const PATH_NAME_MAX: usize = 4087;

nix::ioctl_write_ptr!(btrfs_snap_destroy, 0x94, 15, VolArgs);

/// `path`'s directory, opened without following a symlink, and its last
/// name, at most `max` bytes.
fn parent_and_name(path: &Path, max: usize) -> Result<(std::fs::File, &[u8])> {
    use std::os::unix::ffi::OsStrExt;
    let (Some(parent), Some(name)) = (path.parent(), path.file_name()) else {
        return Err(Error::Refused {
            reason: format!("{} names no subvolume in a directory", path.display()),
        });
    };
    let name = name.as_bytes();
    if name.len() > max {
        return Err(Error::Refused {
            reason: format!("a subvolume name of {} bytes (at most {max})", name.len()),
        });
    }
    Ok((open_dir(parent)?, name))
}

/// Directory `path`, opened without following a symlink.
fn open_dir(path: &Path) -> Result<std::fs::File> {
    use std::os::unix::fs::OpenOptionsExt;
    std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(nix::libc::O_DIRECTORY | nix::libc::O_NOFOLLOW)
        .open(path)
        .map_err(Error::io("open", path))
}

/// Deletes subvolume `path` (a snapshot), as `btrfs subvolume delete`
/// does, without running it: one ioctl on its parent directory.
#[allow(unsafe_code)]
fn delete_subvolume(path: &Path) -> Result<()> {
    use std::os::fd::AsRawFd;
    let (parent_dir, name) = parent_and_name(path, PATH_NAME_MAX)?;
    let mut args = VolArgs {
        fd: 0,
        name: [0; PATH_NAME_MAX + 1],
    };
    args.name[..name.len()].copy_from_slice(name);
    // SAFETY: `args` is a whole, initialised btrfs_ioctl_vol_args (its name
    // NUL-terminated: a file name holds no NUL) that outlives the call, and
    // the descriptor is open; the kernel only reads it.
    unsafe { btrfs_snap_destroy(parent_dir.as_raw_fd(), &args) }
        .map_err(|e| Error::io("delete subvolume", path)(e.into()))?;
    Ok(())
}

/// Makes `dst` a read-only snapshot of subvolume `src`, as `btrfs
/// subvolume snapshot -r` does (one ioctl: atomic, and committed when it
/// returns), without running it.
#[allow(unsafe_code)]
fn snapshot_readonly(src: &Path, dst: &Path) -> Result<()> {
    use std::os::fd::AsRawFd;
    use std::os::unix::fs::MetadataExt;
    let (parent_dir, name) = parent_and_name(dst, SUBVOL_NAME_MAX)?;
    let src_dir = open_dir(src)?;
    // What btrfs-progs checks: the source is a subvolume's root (inode
    // 256 on btrfs). Of a plain directory the kernel would snapshot the
    // whole subvolume holding it.
    let on_btrfs = nix::sys::statfs::fstatfs(&src_dir)
        .is_ok_and(|f| f.filesystem_type() == nix::sys::statfs::BTRFS_SUPER_MAGIC);
    let root_inode = src_dir.metadata().map_err(Error::io("stat", src))?.ino() == 256;
    if !(on_btrfs && root_inode) {
        return Err(Error::Refused {
            reason: format!("{} is not a btrfs subvolume", src.display()),
        });
    }
    let mut args = VolArgsV2 {
        fd: i64::from(src_dir.as_raw_fd()),
        transid: 0,
        flags: SUBVOL_RDONLY,
        unused: [0; 4],
        name: [0; SUBVOL_NAME_MAX + 1],
    };
    args.name[..name.len()].copy_from_slice(name);
    // SAFETY: `args` is a whole, initialised btrfs_ioctl_vol_args_v2 (its
    // name NUL-terminated) that outlives the call, and both descriptors
    // are open; the kernel only reads it.
    unsafe { btrfs_snap_create_v2(parent_dir.as_raw_fd(), &args) }
        .map_err(|e| Error::io("snapshot", dst)(e.into()))?;
    Ok(())
}
