//! Entries of a tree with everything that makes two trees equal: type,
//! mode, owner, times, xattrs, device numbers, symlink targets. Copies
//! never follow symlinks.

use std::ffi::OsString;
use std::os::unix::fs::{FileTypeExt, MetadataExt};
use std::path::Path;

use nix::sys::stat::{utimensat, Mode, SFlag, UtimensatFlags};
use nix::sys::time::TimeSpec;
use nix::unistd::{fchownat, Gid, Uid};

use crate::{Error, Result};

/// The kind of a tree entry.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    /// Directory.
    Dir,
    /// Regular file.
    File,
    /// Symbolic link.
    Symlink,
    /// Character device (an overlayfs whiteout is 0:0).
    Char,
    /// Block device.
    Block,
    /// Named pipe.
    Fifo,
    /// Unix socket.
    Socket,
}

/// What `lstat` and the xattr calls say of one entry.
#[derive(Debug, Clone)]
pub struct Meta {
    /// Its kind.
    pub kind: Kind,
    /// Permission bits (and setuid/setgid/sticky).
    pub mode: u32,
    /// Owner.
    pub uid: u32,
    /// Group.
    pub gid: u32,
    /// Device number (devices).
    pub rdev: u64,
    /// Size in bytes.
    pub size: u64,
    /// Inode number.
    pub ino: u64,
    /// Device of the filesystem it is on.
    pub dev: u64,
    /// Link count.
    pub nlink: u64,
    /// Change time (seconds, nanoseconds): user space cannot set it, so an
    /// unchanged ctime with an unchanged inode means an untouched entry.
    pub ctime: (i64, i64),
    /// Access time.
    pub atime: (i64, i64),
    /// Modification time.
    pub mtime: (i64, i64),
    /// Extended attributes, sorted by name.
    pub xattrs: Vec<(OsString, Vec<u8>)>,
}

impl Meta {
    /// Reads `path`'s metadata without following a symlink.
    pub fn read(path: &Path) -> Result<Meta> {
        let md = std::fs::symlink_metadata(path).map_err(Error::io("stat", path))?;
        let ft = md.file_type();
        let kind = if ft.is_dir() {
            Kind::Dir
        } else if ft.is_file() {
            Kind::File
        } else if ft.is_symlink() {
            Kind::Symlink
        } else if ft.is_char_device() {
            Kind::Char
        } else if ft.is_block_device() {
            Kind::Block
        } else if ft.is_fifo() {
            Kind::Fifo
        } else {
            Kind::Socket
        };
        let mut xattrs = Vec::new();
        for name in xattr::list(path).map_err(Error::io("list xattrs of", path))? {
            if let Some(value) = xattr::get(path, &name).map_err(Error::io("read xattrs of", path))? {
                xattrs.push((name, value));
            }
        }
        xattrs.sort();
        Ok(Meta {
            kind,
            mode: md.mode() & 0o7777,
            uid: md.uid(),
            gid: md.gid(),
            rdev: md.rdev(),
            size: md.size(),
            ino: md.ino(),
            dev: md.dev(),
            nlink: md.nlink(),
            ctime: (md.ctime(), md.ctime_nsec()),
            atime: (md.atime(), md.atime_nsec()),
            mtime: (md.mtime(), md.mtime_nsec()),
            xattrs,
        })
    }

    /// Whether the content-independent metadata (kind, mode, owner, device,
    /// mtime, xattrs, size) of two entries agree.
    pub fn same_shape(&self, other: &Meta) -> bool {
        self.kind == other.kind
            && self.mode == other.mode
            && self.uid == other.uid
            && self.gid == other.gid
            && self.rdev == other.rdev
            && self.mtime == other.mtime
            && self.xattrs == other.xattrs
            && (self.kind == Kind::Dir || self.size == other.size)
    }
}

/// Creates `dst` as a copy of the entry `src` (whose metadata is `meta`):
/// content, owner, mode, xattrs and times. Directories are created empty.
pub fn copy_entry(src: &Path, dst: &Path, meta: &Meta) -> Result<()> {
    match meta.kind {
        Kind::Dir => match std::fs::create_dir(dst) {
            Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists && dst.is_dir() => {}
            r => r.map_err(Error::io("create directory", dst))?,
        },
        Kind::File => {
            std::fs::copy(src, dst).map_err(Error::io("copy to", dst))?;
        }
        Kind::Symlink => {
            let target = std::fs::read_link(src).map_err(Error::io("read link", src))?;
            std::os::unix::fs::symlink(&target, dst).map_err(Error::io("create symlink", dst))?;
        }
        Kind::Char | Kind::Block | Kind::Fifo | Kind::Socket => make_node(dst, meta)?,
    }
    apply_meta(dst, meta)
}

/// Makes a device, fifo or socket node like `meta` at `dst`.
pub fn make_node(dst: &Path, meta: &Meta) -> Result<()> {
    let kind = match meta.kind {
        Kind::Char => SFlag::S_IFCHR,
        Kind::Block => SFlag::S_IFBLK,
        Kind::Fifo => SFlag::S_IFIFO,
        _ => SFlag::S_IFSOCK,
    };
    nix::sys::stat::mknod(dst, kind, Mode::from_bits_truncate(meta.mode), meta.rdev)
        .map_err(|e| Error::io("make node", dst)(e.into()))
}

/// Sets owner, mode, xattrs (exactly: extra ones are removed) and times of
/// `path` to `meta`'s, without following a symlink.
pub fn apply_meta(path: &Path, meta: &Meta) -> Result<()> {
    fchownat(
        None,
        path,
        Some(Uid::from_raw(meta.uid)),
        Some(Gid::from_raw(meta.gid)),
        nix::fcntl::AtFlags::AT_SYMLINK_NOFOLLOW,
    )
    .map_err(|e| Error::io("chown", path)(e.into()))?;
    if meta.kind != Kind::Symlink {
        // After chown, which clears setuid/setgid bits.
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(path, std::fs::Permissions::from_mode(meta.mode))
            .map_err(Error::io("chmod", path))?;
    }
    let have = xattr::list(path).map_err(Error::io("list xattrs of", path))?;
    for name in have {
        if !meta.xattrs.iter().any(|(n, _)| *n == name) {
            xattr::remove(path, &name).map_err(Error::io("remove xattr of", path))?;
        }
    }
    for (name, value) in &meta.xattrs {
        xattr::set(path, name, value).map_err(Error::io("set xattr of", path))?;
    }
    set_times(path, meta)
}

/// Sets atime and mtime of `path` without following a symlink.
pub fn set_times(path: &Path, meta: &Meta) -> Result<()> {
    let ts = |(s, ns): (i64, i64)| TimeSpec::new(s, ns);
    utimensat(
        None,
        path,
        &ts(meta.atime),
        &ts(meta.mtime),
        UtimensatFlags::NoFollowSymlink,
    )
    .map_err(|e| Error::io("set times of", path)(e.into()))
}

/// Removes `path` whatever it is (a directory with its content).
pub fn remove_any(path: &Path) -> Result<()> {
    let md = match std::fs::symlink_metadata(path) {
        Ok(md) => md,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(()),
        Err(e) => return Err(Error::io("stat", path)(e)),
    };
    if md.is_dir() {
        std::fs::remove_dir_all(path).map_err(Error::io("remove", path))
    } else {
        std::fs::remove_file(path).map_err(Error::io("remove", path))
    }
}
