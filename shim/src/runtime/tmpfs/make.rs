//! The restore's side: a fresh tmpfs made as a record says.

use std::os::fd::OwnedFd;
use std::path::Path;

use anyhow::{Context, Result};
use nix::mount::MsFlags;
use rustix::fs::{AtFlags, FileType, Mode, OFlags, ResolveFlags, Timespec, Timestamps};

use super::{Attrs, Entry, Kept, Kind};
use crate::runtime::masked::{mount_fresh, Source};

/// Mounts a fresh tmpfs at `dir` (in the shim's own work directory; what
/// an earlier, killed helper left there goes first) as `k` records it,
/// with mount flags `flags`, private (it propagates nowhere), and makes
/// what it held again.
pub(super) fn mount(k: &Kept, flags: MsFlags, dir: &Path) -> Result<Source> {
    let source = mount_fresh(dir, &k.source, flags, &k.data)?;
    let root = rustix::fs::open(
        dir,
        OFlags::RDONLY | OFlags::DIRECTORY | OFlags::NOFOLLOW | OFlags::CLOEXEC,
        Mode::empty(),
    )
    .with_context(|| format!("open {}", dir.display()))?;
    // Closed to all but root while it is made; its own attributes last.
    rustix::fs::fchmod(&root, Mode::from_raw_mode(0o700))
        .with_context(|| format!("close {} while it is made", dir.display()))?;
    for e in &k.entries {
        make(&root, e).with_context(|| format!("make {:?} in {}", e.name, dir.display()))?;
    }
    // Owners, modes and times last, the deepest first: making a name
    // changes its directory's times.
    for e in k.entries.iter().rev() {
        if let Some(a) = &e.attrs {
            let (parent, leaf) = split(&root, &e.name)?;
            let symlink = matches!(e.kind, Kind::Symlink { .. });
            set_attrs(&parent, leaf, a, symlink).with_context(|| format!("set {:?}'s attributes", e.name))?;
        }
    }
    set_attrs(&root, "", &k.root, false)
        .with_context(|| format!("give {} the recorded owner, mode and times", dir.display()))?;
    Ok(source)
}

/// The directory `name` is in (below `root`, never through a link), and
/// its last component.
fn split<'a>(root: &OwnedFd, name: &'a str) -> Result<(OwnedFd, &'a str)> {
    let (parent, leaf) = name.rsplit_once('/').unwrap_or((".", name));
    let dir = rustix::fs::openat2(
        root,
        parent,
        OFlags::PATH | OFlags::DIRECTORY | OFlags::NOFOLLOW | OFlags::CLOEXEC,
        Mode::empty(),
        ResolveFlags::BENEATH
            | ResolveFlags::NO_SYMLINKS
            | ResolveFlags::NO_MAGICLINKS
            | ResolveFlags::NO_XDEV,
    )?;
    Ok((dir, leaf))
}

/// Makes entry `e` below `root`, owned by root and closed to others
/// until its attributes are set.
fn make(root: &OwnedFd, e: &Entry) -> Result<()> {
    let (parent, leaf) = split(root, &e.name)?;
    match &e.kind {
        Kind::Dir | Kind::MountPoint { dir: true } => {
            rustix::fs::mkdirat(&parent, leaf, Mode::from_raw_mode(0o755))?
        }
        Kind::MountPoint { dir: false } => {
            rustix::fs::openat(
                &parent,
                leaf,
                OFlags::CREATE | OFlags::EXCL | OFlags::WRONLY | OFlags::NOFOLLOW | OFlags::CLOEXEC,
                Mode::from_raw_mode(0o644),
            )?;
        }
        Kind::Symlink { target } => rustix::fs::symlinkat(target.as_str(), &parent, leaf)?,
        Kind::Char { major, minor } | Kind::Block { major, minor } => {
            let kind = match e.kind {
                Kind::Block { .. } => FileType::BlockDevice,
                _ => FileType::CharacterDevice,
            };
            let dev = rustix::fs::makedev(*major, *minor);
            rustix::fs::mknodat(&parent, leaf, kind, Mode::from_raw_mode(0o600), dev)?;
        }
    }
    Ok(())
}

/// Gives `leaf` in `dir` (`dir` itself for "") owner, mode and times `a`;
/// a link's mode is its own, never its target's.
fn set_attrs(dir: &OwnedFd, leaf: &str, a: &Attrs, symlink: bool) -> rustix::io::Result<()> {
    let at = match leaf {
        "" => AtFlags::EMPTY_PATH,
        _ => AtFlags::SYMLINK_NOFOLLOW,
    };
    rustix::fs::chownat(
        dir,
        leaf,
        Some(rustix::fs::Uid::from_raw(a.uid)),
        Some(rustix::fs::Gid::from_raw(a.gid)),
        at,
    )?;
    // After the owner: a change of owner may clear set-id bits.
    if !symlink {
        match leaf {
            "" => rustix::fs::fchmod(dir, Mode::from_raw_mode(a.mode))?,
            _ => rustix::fs::chmodat(dir, leaf, Mode::from_raw_mode(a.mode), AtFlags::empty())?,
        }
    }
    let time = |(tv_sec, tv_nsec): (i64, u32)| Timespec {
        tv_sec,
        tv_nsec: tv_nsec.into(),
    };
    let times = Timestamps {
        last_access: time(a.atime),
        last_modification: time(a.mtime),
    };
    match leaf {
        "" => rustix::fs::futimens(dir, &times),
        _ => rustix::fs::utimensat(dir, leaf, &times, AtFlags::SYMLINK_NOFOLLOW),
    }
}
