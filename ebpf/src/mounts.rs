//! The sandbox's mounts as its processes see them, and fingerprints of its
//! tmpfs mounts.
//!
//! A change on a tmpfs of the sandbox (`/dev`, `/dev/shm`) is not in the
//! file snapshot: CRIU keeps those contents with the processes, so such a
//! change is process state. A path operation spelled through a symlink or
//! `..` may land on one without its spelling saying so; comparing each
//! tmpfs whole at every turn end catches what the spelling hides.

use std::collections::hash_map::DefaultHasher;
use std::hash::{Hash, Hasher};
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};

/// Most entries a tmpfs fingerprint walks; a larger tmpfs is not compared.
const MAX_ENTRIES: usize = 4096;

/// What a mount's files are to a checkpoint.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum MountKind {
    /// tmpfs or mqueue: CRIU keeps its contents with the processes.
    Held,
    /// devpts: terminals, no state.
    Devices,
    /// Anything else (`/proc`, `/sys`, bind mounts).
    Other,
}

/// One mount of the sandbox other than its root.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Mount {
    /// User-space device number.
    pub dev: u64,
    /// Its mount point, absolute, as the sandbox sees it.
    pub point: Vec<u8>,
    pub kind: MountKind,
    /// A writable tmpfs mounted whole (fingerprinted), not an mqueue.
    pub tmpfs: bool,
    /// A kernel interface or memory filesystem (proc, sysfs, devpts,
    /// mqueue, tmpfs, devtmpfs), never a disk's.
    pub interface: bool,
}

impl Mount {
    /// The rest of absolute `name` below this mount point, if it is below
    /// (component-wise: `/devx` is not below `/dev`).
    pub(crate) fn strip<'a>(&self, name: &'a [u8]) -> Option<&'a [u8]> {
        let rest = name.strip_prefix(self.point.as_slice())?;
        match rest.first() {
            None => Some(rest),
            Some(b'/') => Some(&rest[1..]),
            Some(_) => None,
        }
    }
}

/// The mounts of `pid`'s mount namespace but its root; none if it is gone.
pub(crate) fn of(pid: u32) -> Vec<Mount> {
    std::fs::read(format!("/proc/{pid}/mountinfo"))
        .map(|text| parse(&text))
        .unwrap_or_default()
}

/// Devices of the mounts that hold no filesystem state (`/dev`,
/// `/dev/shm`, `/dev/pts`, `/dev/mqueue`, `/proc`, `/sys`). Only kernel
/// interface and memory filesystems count: a directory of a disk bound at
/// one of those points (the root's, a volume's) holds files.
pub(crate) fn interface_devs(mounts: &[Mount]) -> std::collections::HashSet<u64> {
    const POINTS: [&[u8]; 6] = [
        b"/dev",
        b"/dev/shm",
        b"/dev/pts",
        b"/dev/mqueue",
        b"/proc",
        b"/sys",
    ];
    mounts
        .iter()
        .filter(|m| m.interface && POINTS.contains(&m.point.as_slice()))
        .map(|m| m.dev)
        .collect()
}

fn parse(text: &[u8]) -> Vec<Mount> {
    text.split(|&b| b == b'\n')
        .filter_map(|line| {
            let fields: Vec<&[u8]> = line.split(|&b| b == b' ').collect();
            let sep = fields.iter().position(|f| *f == b"-")?;
            let fstype = *fields.get(sep + 1)?;
            let (major, minor) = std::str::from_utf8(fields.get(2)?).ok()?.split_once(':')?;
            let dev = libc::makedev(major.parse().ok()?, minor.parse().ok()?);
            let point = unescape(fields.get(4)?);
            let read_only = fields.get(5)?.split(|&b| b == b',').any(|o| o == b"ro");
            let whole = *fields.get(3)? == b"/";
            if point == b"/" {
                return None;
            }
            let kind = match fstype {
                b"tmpfs" | b"mqueue" => MountKind::Held,
                b"devpts" => MountKind::Devices,
                _ => MountKind::Other,
            };
            Some(Mount {
                dev,
                point,
                kind,
                // A read-only tmpfs (a masked directory) cannot change
                // from inside; a part of one bound elsewhere (`/dev/null`
                // masking `/proc/keys`) is compared where it is whole.
                tmpfs: fstype == b"tmpfs" && !read_only && whole,
                interface: matches!(
                    fstype,
                    b"proc" | b"sysfs" | b"devpts" | b"mqueue" | b"tmpfs" | b"devtmpfs"
                ),
            })
        })
        .collect()
}

/// mountinfo's octal escapes (`\040` for a space) undone.
fn unescape(field: &[u8]) -> Vec<u8> {
    let mut out = Vec::with_capacity(field.len());
    let mut i = 0;
    while i < field.len() {
        let octal = field.get(i + 1..i + 4).and_then(|d| {
            let s = std::str::from_utf8(d).ok()?;
            u8::from_str_radix(s, 8).ok()
        });
        match (field[i], octal) {
            (b'\\', Some(b)) => {
                out.push(b);
                i += 4;
            }
            (b, _) => {
                out.push(b);
                i += 1;
            }
        }
    }
    out
}

/// A fingerprint of tmpfs `mount` as `pid` sees it: every name below it
/// (on the same mount) with its inode, owner, mode, and for files and
/// links their size and change time. Directories' own times are left out,
/// so a file made and removed within a turn leaves no trace. `None` when
/// it cannot be read or holds more than [`MAX_ENTRIES`] names. Symlinks
/// are never followed.
pub(crate) fn fingerprint(pid: u32, mount: &Mount) -> Option<u64> {
    let root = PathBuf::from(format!("/proc/{pid}/root")).join(Path::new(std::ffi::OsStr::from_bytes(
        mount.point.strip_prefix(b"/")?,
    )));
    let top = std::fs::symlink_metadata(&root).ok()?;
    if top.dev() != mount.dev || !top.is_dir() {
        return None;
    }
    let mut hasher = DefaultHasher::new();
    let mut stack = vec![(root.clone(), Vec::<u8>::new())];
    let mut seen = 0usize;
    while let Some((dir, rel)) = stack.pop() {
        // Read lazily: a directory of a million names stops the walk at
        // the bound, not after reading them all.
        let mut entries = Vec::new();
        for entry in std::fs::read_dir(&dir).ok()? {
            seen += 1;
            if seen > MAX_ENTRIES {
                return None;
            }
            entries.push(entry.ok()?);
        }
        entries.sort_by_key(|e| e.file_name());
        for entry in entries {
            let name = entry.file_name();
            // lstat relative to the directory read (no walk from the root).
            let Ok(meta) = entry.metadata() else {
                continue; // gone meanwhile: the next turn end sees it
            };
            let path = entry.path();
            if meta.dev() != mount.dev {
                continue; // another mount on top (`/dev/shm` in `/dev`)
            }
            let mut r = rel.clone();
            r.push(b'/');
            r.extend_from_slice(name.as_bytes());
            r.hash(&mut hasher);
            (meta.ino(), meta.mode(), meta.uid(), meta.gid()).hash(&mut hasher);
            let ft = meta.file_type();
            if ft.is_dir() {
                stack.push((path, r));
            } else if ft.is_file() || ft.is_symlink() {
                (meta.size(), meta.ctime(), meta.ctime_nsec()).hash(&mut hasher);
            } else {
                meta.rdev().hash(&mut hasher);
            }
        }
    }
    Some(hasher.finish())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn mountinfo_lines_parse() {
        let text = b"\
600 500 0:60 / / rw,relatime - overlay overlay rw
601 600 0:61 / /proc rw - proc proc rw
602 600 0:62 / /dev rw,nosuid - tmpfs tmpfs rw,size=65536k
603 602 0:63 / /dev/pts rw - devpts devpts rw
604 602 0:64 / /dev/shm rw - tmpfs shm rw
605 602 0:65 / /dev/mqueue rw - mqueue mqueue rw
606 600 8:1 /x /etc/my\\040hosts rw - ext4 /dev/sda1 rw
607 601 0:66 / /proc/acpi ro,relatime - tmpfs tmpfs ro
608 601 0:62 /null /proc/keys rw,nosuid - tmpfs tmpfs rw
";
        let m = parse(text);
        let got: Vec<(&[u8], MountKind, bool)> =
            m.iter().map(|m| (m.point.as_slice(), m.kind, m.tmpfs)).collect();
        assert_eq!(
            got,
            vec![
                (b"/proc".as_slice(), MountKind::Other, false),
                (b"/dev", MountKind::Held, true),
                (b"/dev/pts", MountKind::Devices, false),
                (b"/dev/shm", MountKind::Held, true),
                (b"/dev/mqueue", MountKind::Held, false),
                (b"/etc/my hosts", MountKind::Other, false),
                (b"/proc/acpi", MountKind::Held, false),
                (b"/proc/keys", MountKind::Held, false),
            ]
        );
        assert_eq!(m[1].dev, libc::makedev(0, 62));
    }

    /// A disk's directory bound at an interface's mount point (a volume at
    /// `/dev/shm`, the root's own `/sys`) holds files: its device is not
    /// ignored.
    #[test]
    fn only_interface_filesystems_are_interface_devices() {
        let text = b"\
600 500 0:60 / / rw,relatime - overlay overlay rw
601 600 0:61 / /proc rw - proc proc rw
602 600 0:62 / /dev rw,nosuid - tmpfs tmpfs rw,size=65536k
603 602 0:63 / /dev/pts rw - devpts devpts rw
604 602 8:1 /vol /dev/shm rw - ext4 /dev/sda1 rw
605 600 0:60 /sys /sys rw - overlay overlay rw
";
        let devs = interface_devs(&parse(text));
        let expected: std::collections::HashSet<u64> = [61, 62, 63]
            .into_iter()
            .map(|minor| libc::makedev(0, minor))
            .collect();
        assert_eq!(devs, expected);
    }

    #[test]
    fn strip_is_component_wise() {
        let m = Mount {
            dev: 1,
            point: b"/dev".to_vec(),
            kind: MountKind::Held,
            tmpfs: true,
            interface: true,
        };
        assert_eq!(m.strip(b"/dev/shm/x"), Some(b"shm/x".as_slice()));
        assert_eq!(m.strip(b"/dev"), Some(b"".as_slice()));
        assert_eq!(m.strip(b"/devx"), None);
        assert_eq!(m.strip(b"/work"), None);
    }

    #[test]
    fn a_tmpfs_fingerprint_sees_lasting_changes_only() {
        // This process's own /dev/shm (a tmpfs on this machine kind; the
        // last of stacked mounts is the one on top) stands in for a
        // sandbox's.
        let me = std::process::id();
        let shm = of(me)
            .into_iter()
            .rev()
            .find(|m| m.point == b"/dev/shm" && m.tmpfs)
            .expect("/dev/shm is a tmpfs here");
        let before = fingerprint(me, &shm).expect("fingerprint");
        let tmp = format!("/dev/shm/crab-fp-test-{me}");
        std::fs::write(&tmp, b"x").unwrap();
        let during = fingerprint(me, &shm).expect("fingerprint");
        std::fs::remove_file(&tmp).unwrap();
        assert_eq!(fingerprint(me, &shm), Some(before));
        assert_ne!(during, before);
    }
}
