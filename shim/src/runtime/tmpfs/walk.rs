//! The dump's side: whether a tmpfs of the sandbox holds only what a
//! record can make again, and the record of it.

use std::collections::HashSet;
use std::os::fd::OwnedFd;
use std::path::Path;

use procfs::process::MountInfos;
use rustix::fs::{AtFlags, FileType, Mode, OFlags, ResolveFlags, StatxAttributes, StatxFlags};

use super::{plain_name, Attrs, Entry, Kept, Kind, DEEPEST, FLAGS, MOST_ENTRIES, OPTIONS, REQUIRED};

/// What a kept-out tmpfs may hold besides directories and links: the
/// container's devices, and mounts where its spec (or a terminal) puts
/// them.
pub(super) struct Allowed {
    pub(super) devices: HashSet<(bool, i64, i64)>,
    pub(super) mount_points: HashSet<String>,
}

/// The root of mount `mnt_id` at `path` in the sandbox whose root is
/// `root`, opened (reached without following any link the sandbox may
/// have put on the way), and its status; `None` if `path` leads elsewhere.
fn mount_root(root: &OwnedFd, path: &str, mnt_id: u64) -> Option<(OwnedFd, rustix::fs::Statx)> {
    let relative = path.trim_start_matches('/');
    let dir = rustix::fs::openat2(
        root,
        if relative.is_empty() { "." } else { relative },
        OFlags::RDONLY | OFlags::DIRECTORY | OFlags::NOFOLLOW | OFlags::CLOEXEC,
        Mode::empty(),
        ResolveFlags::IN_ROOT | ResolveFlags::NO_SYMLINKS | ResolveFlags::NO_MAGICLINKS,
    )
    .ok()?;
    let stx = statx(&dir, "")?;
    let is_root = stx.stx_attributes_mask.contains(StatxAttributes::MOUNT_ROOT)
        && stx.stx_attributes.contains(StatxAttributes::MOUNT_ROOT);
    (stx.stx_mnt_id == mnt_id && is_root).then_some((dir, stx))
}

/// Whether the tmpfs mount `mnt_id` at `path` in the sandbox whose root
/// is `root` holds nothing at all: its superblock counts inodes and only
/// its root's is in use.
pub(in crate::runtime) fn holds_nothing(root: &OwnedFd, path: &str, mnt_id: u64) -> bool {
    mount_root(root, path, mnt_id)
        .and_then(|(dir, _)| rustix::fs::fstatvfs(&dir).ok())
        .is_some_and(|vfs| vfs.f_files > 0 && vfs.f_files - vfs.f_ffree == 1)
}

/// The tmpfs at `path` in the sandbox whose root is `root`, if it may be
/// kept out of the images; `None` for anything else, or anything that
/// cannot be read.
pub(super) fn keepable(root: &OwnedFd, mounts: &MountInfos, path: &str, allowed: &Allowed) -> Option<Kept> {
    let mut at = mounts.iter().filter(|m| m.mount_point == Path::new(path));
    let (Some(m), None) = (at.next(), at.next()) else {
        return None;
    };
    // Sorted: the same mount makes the same record.
    let mut flags: Vec<String> = m.mount_options.keys().cloned().collect();
    flags.sort();
    let known_flags = flags.iter().all(|f| FLAGS.iter().any(|(name, _)| name == f));
    let required = REQUIRED.iter().all(|r| m.mount_options.contains_key(*r));
    let known_options = m.super_options.keys().all(|o| OPTIONS.contains(&o.as_str()));
    if m.fs_type != "tmpfs"
        || m.root != "/"
        || !m.opt_fields.is_empty()
        || !known_flags
        || !required
        || !known_options
        || !m.super_options.contains_key("rw")
        || !plain_name(m.mount_source.as_deref().unwrap_or(""))
    {
        return None;
    }
    let (dir, stx) = mount_root(root, path, m.mnt_id as u64)?;
    let root_attrs = attrs(&stx);
    // Inodes are counted (`nr_inodes` is not 0), and not more than a
    // record holds: the walk, frozen, stays short.
    let used = |vfs: &rustix::fs::StatVfs| vfs.f_files - vfs.f_ffree;
    let vfs = rustix::fs::fstatvfs(&dir).ok()?;
    if vfs.f_files == 0
        || used(&vfs) > MOST_ENTRIES as u64 + 1
        || rustix::fs::flistxattr_query(&dir).ok()? != 0
    {
        return None;
    }
    // The mounts on it, by their path below it; each where the spec puts
    // one.
    let mut below = HashSet::new();
    for c in mounts.iter().filter(|c| c.pid == m.mnt_id) {
        if !allowed
            .mount_points
            .contains(c.mount_point.to_string_lossy().as_ref())
        {
            return None;
        }
        below.insert(
            c.mount_point
                .strip_prefix(path)
                .ok()?
                .to_string_lossy()
                .into_owned(),
        );
    }
    let mut walk = Walk {
        mnt_id: m.mnt_id as u64,
        below,
        allowed,
        entries: Vec::new(),
        dirs: Vec::new(),
    };
    walk.dir(dir, "", 0)?;
    // One inode per name found and the root's, none else (hidden under a
    // mount, or unlinked but open); and, against writers outside the
    // frozen cgroup, no directory changed meanwhile.
    let root_dir = &walk.dirs.last()?.0;
    if used(&rustix::fs::fstatvfs(root_dir).ok()?) != walk.entries.len() as u64 + 1 {
        return None;
    }
    for (dir, before) in &walk.dirs {
        if times(&rustix::fs::fstat(dir).ok()?) != *before {
            return None;
        }
    }
    let entries = walk.entries;
    let mut data: Vec<String> = m
        .super_options
        .iter()
        .filter(|(k, _)| *k != "rw")
        .map(|(k, v)| match v {
            Some(v) => format!("{k}={v}"),
            None => k.clone(),
        })
        .collect();
    data.sort();
    Some(Kept {
        path: path.to_owned(),
        source: m.mount_source.clone().unwrap_or_default(),
        flags,
        data: data.join(","),
        root: root_attrs,
        entries,
    })
}

/// A walk of a tmpfs that may be kept out.
struct Walk<'a> {
    /// The mount walked.
    mnt_id: u64,
    /// The mount points on it, by their path below it: noted, never
    /// entered.
    below: HashSet<String>,
    allowed: &'a Allowed,
    /// What it holds, each directory before what is in it.
    entries: Vec<Entry>,
    /// Each directory walked (the root last) and its [`times`] then.
    dirs: Vec<(OwnedFd, Times)>,
}

/// A directory's modification and change times, which any name made or
/// removed in it moves.
type Times = (i64, u64, i64, u64);

fn times(st: &rustix::fs::Stat) -> Times {
    (st.st_mtime, st.st_mtime_nsec, st.st_ctime, st.st_ctime_nsec)
}

impl Walk<'_> {
    /// Adds what directory `dir` (at `prefix` below the mount) holds;
    /// `None` when it holds anything a record cannot make again.
    fn dir(&mut self, dir: OwnedFd, prefix: &str, depth: usize) -> Option<()> {
        if depth >= DEEPEST {
            return None;
        }
        let before = times(&rustix::fs::fstat(&dir).ok()?);
        let mut names = Vec::new();
        for e in rustix::fs::Dir::read_from(&dir).ok()? {
            let e = e.ok()?;
            let name = e.file_name().to_str().ok()?.to_owned();
            if name != "." && name != ".." {
                names.push(name);
            }
            if names.len() > MOST_ENTRIES {
                return None;
            }
        }
        names.sort();
        for name in names {
            let path = format!("{prefix}{name}");
            if self.entries.len() >= MOST_ENTRIES {
                return None;
            }
            let stx = statx(&dir, &name)?;
            if self.below.contains(&path) {
                // What is mounted there answers: a directory sits on one.
                let dir = FileType::from_raw_mode(stx.stx_mode.into()) == FileType::Directory;
                self.entries.push(Entry {
                    name: path,
                    kind: Kind::MountPoint { dir },
                    attrs: None,
                });
                continue;
            }
            if stx.stx_mnt_id != self.mnt_id {
                return None;
            }
            // Only devices the restore may make: the container's own.
            let (major, minor) = (stx.stx_rdev_major, stx.stx_rdev_minor);
            let ours = |block: bool| {
                self.allowed
                    .devices
                    .contains(&(block, i64::from(major), i64::from(minor)))
            };
            let kind = match FileType::from_raw_mode(stx.stx_mode.into()) {
                FileType::Directory => Kind::Dir,
                _ if stx.stx_nlink != 1 => return None,
                FileType::Symlink => {
                    let target = rustix::fs::readlinkat(&dir, name.as_str(), Vec::new()).ok()?;
                    Kind::Symlink {
                        target: target.into_string().ok()?,
                    }
                }
                FileType::CharacterDevice if ours(false) => Kind::Char { major, minor },
                FileType::BlockDevice if ours(true) => Kind::Block { major, minor },
                // Data, a fifo, a socket, another device: kept in the images.
                _ => return None,
            };
            let is_dir = kind == Kind::Dir;
            self.entries.push(Entry {
                name: path.clone(),
                kind,
                attrs: Some(attrs(&stx)),
            });
            if is_dir {
                let sub = rustix::fs::openat2(
                    &dir,
                    name.as_str(),
                    OFlags::RDONLY | OFlags::DIRECTORY | OFlags::NOFOLLOW | OFlags::CLOEXEC,
                    Mode::empty(),
                    ResolveFlags::BENEATH | ResolveFlags::NO_SYMLINKS | ResolveFlags::NO_XDEV,
                )
                .ok()?;
                if rustix::fs::flistxattr_query(&sub).ok()? != 0 {
                    return None;
                }
                self.dir(sub, &format!("{path}/"), depth + 1)?;
            }
        }
        self.dirs.push((dir, before));
        Some(())
    }
}

/// `name` in `dir` (itself for ""), not followed if a link.
fn statx(dir: &OwnedFd, name: &str) -> Option<rustix::fs::Statx> {
    // Never waiting on, nor mounting, what the sandbox may have bound in.
    let flags = AtFlags::NO_AUTOMOUNT
        | AtFlags::STATX_DONT_SYNC
        | match name {
            "" => AtFlags::EMPTY_PATH,
            _ => AtFlags::SYMLINK_NOFOLLOW,
        };
    rustix::fs::statx(dir, name, flags, StatxFlags::BASIC_STATS | StatxFlags::MNT_ID).ok()
}

fn attrs(stx: &rustix::fs::Statx) -> Attrs {
    Attrs {
        mode: u32::from(stx.stx_mode) & 0o7777,
        uid: stx.stx_uid,
        gid: stx.stx_gid,
        atime: (stx.stx_atime.tv_sec, stx.stx_atime.tv_nsec),
        mtime: (stx.stx_mtime.tv_sec, stx.stx_mtime.tv_nsec),
    }
}
