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
        Kind::File => copy_sparse(src, dst).map_err(Error::io("copy to", dst))?,
        Kind::Symlink => {
            let target = std::fs::read_link(src).map_err(Error::io("read link", src))?;
            std::os::unix::fs::symlink(&target, dst).map_err(Error::io("create symlink", dst))?;
        }
        Kind::Char | Kind::Block | Kind::Fifo | Kind::Socket => make_node(dst, meta)?,
    }
    apply_meta(dst, meta)
}

/// Copies regular file `src` to a new `dst`, its holes kept holes: a
/// sandbox's `truncate -s 500G` costs the store nothing, not 500 GB at
/// the next checkpoint. Only the data extents (`SEEK_DATA`/`SEEK_HOLE`)
/// are copied; a filesystem that cannot tell gets a plain copy.
fn copy_sparse(src: &Path, dst: &Path) -> std::io::Result<()> {
    use std::os::unix::fs::{OpenOptionsExt, PermissionsExt};
    let from = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(nix::libc::O_NOFOLLOW | nix::libc::O_NONBLOCK)
        .open(src)?;
    let md = from.metadata()?;
    if !md.is_file() {
        return Err(std::io::Error::other(format!(
            "{} is no longer a regular file",
            src.display()
        )));
    }
    // 0600 until apply_meta sets owner and mode.
    let to = std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .open(dst)?;
    copy_extents(&from, &to, md.len())?;
    // The mode as std::fs::copy left it (apply_meta sets it after chown).
    to.set_permissions(std::fs::Permissions::from_mode(md.permissions().mode() & 0o777))
}

/// Makes regular file `dst` hold what `src` holds, with `meta`, in place:
/// its inode, and so its number, stays. A process restored with the
/// version knows its files by inode number (SQLite refuses to write to a
/// database whose path names another inode than the one it opened).
/// Holes are kept, as [`copy_entry`] keeps them. `dst` is opened without
/// following a link and must still be inode `ino` with one name; answers
/// false, having written nothing, when it is not (the caller replaces it
/// instead). Not atomic: a rollback's journal redoes it after a crash.
pub fn rewrite_in_place(src: &Path, dst: &Path, ino: u64, meta: &Meta) -> Result<bool> {
    use std::os::unix::fs::OpenOptionsExt;
    let flags = nix::libc::O_NOFOLLOW | nix::libc::O_NONBLOCK | nix::libc::O_NOCTTY;
    let Ok(to) = std::fs::OpenOptions::new()
        .write(true)
        .custom_flags(flags)
        .open(dst)
    else {
        return Ok(false);
    };
    let Ok(have) = to.metadata() else {
        return Ok(false);
    };
    if !have.is_file() || have.ino() != ino || have.nlink() != 1 {
        return Ok(false);
    }
    let copy = || -> std::io::Result<()> {
        let from = std::fs::OpenOptions::new()
            .read(true)
            .custom_flags(flags)
            .open(src)?;
        let md = from.metadata()?;
        if !md.is_file() {
            return Err(std::io::Error::other(
                "the snapshot's entry is no longer a regular file",
            ));
        }
        to.set_len(0)?;
        copy_extents(&from, &to, md.len())
    };
    copy().map_err(Error::io("rewrite", dst))?;
    apply_meta_fd(&to, dst, meta)?;
    Ok(true)
}

/// [`apply_meta`] on the open regular file `file` (named `path` in errors).
fn apply_meta_fd(file: &std::fs::File, path: &Path, meta: &Meta) -> Result<()> {
    use nix::sys::stat::{fchmod, futimens};
    use nix::unistd::fchown;
    use std::os::fd::AsRawFd;
    use xattr::FileExt;
    let fd = file.as_raw_fd();
    fchown(fd, Some(Uid::from_raw(meta.uid)), Some(Gid::from_raw(meta.gid)))
        .map_err(|e| Error::io("chown", path)(e.into()))?;
    // After chown, which clears setuid/setgid bits.
    fchmod(fd, Mode::from_bits_retain(meta.mode & 0o7777)).map_err(|e| Error::io("chmod", path)(e.into()))?;
    let have = file.list_xattr().map_err(Error::io("list xattrs of", path))?;
    for name in have {
        if !meta.xattrs.iter().any(|(n, _)| *n == name) {
            file.remove_xattr(&name)
                .map_err(Error::io("remove xattr of", path))?;
        }
    }
    for (name, value) in &meta.xattrs {
        file.set_xattr(name, value)
            .map_err(Error::io("set xattr of", path))?;
    }
    let ts = |(s, ns): (i64, i64)| TimeSpec::new(s, ns);
    futimens(fd, &ts(meta.atime), &ts(meta.mtime)).map_err(|e| Error::io("set times of", path)(e.into()))
}

/// Copies the data extents of `from` (`len` bytes long) into the empty
/// file `to`, whose length becomes `len`: holes stay holes.
fn copy_extents(from: &std::fs::File, to: &std::fs::File, len: u64) -> std::io::Result<()> {
    use nix::errno::Errno;
    use nix::unistd::{lseek, Whence};
    use std::os::fd::AsRawFd;
    use std::os::unix::fs::FileExt;
    let end = len as i64;
    let mut pos: i64 = 0;
    while pos < end {
        let data = match lseek(from.as_raw_fd(), pos, Whence::SeekData) {
            Ok(d) => d,
            // Nothing but a hole from here on.
            Err(Errno::ENXIO) => break,
            // A filesystem that cannot tell: all of the rest is data.
            Err(Errno::EINVAL) => pos,
            Err(e) => return Err(e.into()),
        };
        let hole = match lseek(from.as_raw_fd(), data, Whence::SeekHole) {
            Ok(h) => h.min(end),
            Err(Errno::ENXIO) => break,
            Err(Errno::EINVAL) => end,
            Err(e) => return Err(e.into()),
        };
        let (mut off_in, mut off_out) = (data, data);
        while off_in < hole {
            let want = (hole - off_in) as usize;
            match nix::fcntl::copy_file_range(from, Some(&mut off_in), to, Some(&mut off_out), want) {
                // The file shrank meanwhile: what is left is a hole.
                Ok(0) => break,
                Ok(_) => {}
                // Another filesystem, or none that copies in the kernel.
                Err(Errno::EXDEV | Errno::EOPNOTSUPP | Errno::ENOSYS | Errno::EINVAL | Errno::EPERM) => {
                    let mut buf = vec![0u8; 1 << 20];
                    while off_in < hole {
                        let n =
                            from.read_at(&mut buf[..(hole - off_in).min(1 << 20) as usize], off_in as u64)?;
                        if n == 0 {
                            break;
                        }
                        to.write_all_at(&buf[..n], off_out as u64)?;
                        off_in += n as i64;
                        off_out += n as i64;
                    }
                    break;
                }
                Err(e) => return Err(e.into()),
            }
        }
        pos = hole.max(pos + 1);
    }
    to.set_len(len)
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_copy_keeps_holes_and_content() {
        let dir = tempfile::tempdir().unwrap();
        let (src, dst) = (dir.path().join("sparse"), dir.path().join("copy"));
        {
            use std::io::{Seek, SeekFrom, Write};
            let mut f = std::fs::File::create(&src).unwrap();
            f.write_all(b"head").unwrap();
            f.seek(SeekFrom::Start(8 << 30)).unwrap();
            f.write_all(b"middle").unwrap();
            f.set_len(64 << 30).unwrap();
        }
        copy_sparse(&src, &dst).unwrap();
        let md = std::fs::metadata(&dst).unwrap();
        assert_eq!(md.len(), 64 << 30);
        assert!(
            md.blocks() * 512 < 1 << 20,
            "{} bytes allocated for a 64 GiB file of 10 bytes",
            md.blocks() * 512
        );
        use std::io::{Read, Seek, SeekFrom};
        let mut f = std::fs::File::open(&dst).unwrap();
        let mut head = [0u8; 4];
        f.read_exact(&mut head).unwrap();
        assert_eq!(&head, b"head");
        f.seek(SeekFrom::Start(8 << 30)).unwrap();
        let mut mid = [0u8; 6];
        f.read_exact(&mut mid).unwrap();
        assert_eq!(&mid, b"middle");
        // A dense file copies whole.
        std::fs::write(dir.path().join("dense"), vec![7u8; 100_000]).unwrap();
        copy_sparse(&dir.path().join("dense"), &dir.path().join("dense2")).unwrap();
        assert_eq!(
            std::fs::read(dir.path().join("dense2")).unwrap(),
            vec![7u8; 100_000]
        );
    }
}
