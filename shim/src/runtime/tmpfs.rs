//! Small writable tmpfs mounts kept out of CRIU's images.
//!
//! A container's spec mounts a tmpfs at `/dev`, `/dev/shm` and
//! (containerd's default spec) `/run`; CRIU saves every tmpfs by running
//! `tar | gzip` over it and restores it by running them again, some
//! milliseconds of process starts each, frozen at a dump and again at a
//! restore, even when the mount holds nothing (`/dev/shm`, `/run`) or
//! only what libcontainer made (`/dev`: device nodes, links, the
//! directories other mounts sit on).
//!
//! At a dump of a frozen sandbox whose mounts are fixed (nothing in it
//! can mount or remount: see [`super::masked::mounts_are_fixed`]), a
//! tmpfs its spec mounts is marked external and recorded in the images
//! ([`RECORD`]) when it is what libcontainer made and holds no data:
//! - the only mount at its path, the root of its tmpfs, private (no peer
//!   group, no master), writable and `nosuid`, with a plain source name
//!   and options crab knows how to make again;
//! - nothing in it but directories, symbolic links, device nodes (each
//!   of one name) and the mount points of other mounts, at most
//!   [`MOST_ENTRIES`]; no extended attribute on a directory;
//! - as many inodes in use in its superblock as names found, plus its
//!   root's: nothing hidden under another mount, and no file that is
//!   unlinked but still open or mapped.
//!
//! The record keeps the mount's source name, flags and superblock
//! options, and each name's kind, mode, owner and times (a mount point's
//! own are hidden under its mount and not kept). A restore mounts a fresh
//! tmpfs of each in CRIU's work directory, makes every name again (a
//! device node only if the restored container's spec has it), and CRIU
//! binds it in its place and mounts the others on it; the helper's own
//! mount of it goes once CRIU is done. Each restore has its own: no two
//! sandboxes share one. A sandbox that is not frozen at the dump
//! (`ctr task checkpoint`, which CRIU freezes later), or runs in a user
//! namespace, keeps its tmpfs in the images as before.

use std::collections::HashSet;
use std::os::fd::OwnedFd;
use std::path::{Component, Path};

use anyhow::{bail, ensure, Context, Result};
use nix::mount::MsFlags;
use oci_spec::runtime::{LinuxDeviceType, LinuxNamespaceType, Spec};
use procfs::process::MountInfos;
use rust_criu::Criu;
use serde::{Deserialize, Serialize};

use super::masked::Source;
use make::mount;
pub(super) use walk::holds_nothing;
use walk::{keepable, Allowed};

mod make;
mod walk;

/// The file in the images naming the tmpfs mounts kept out of them.
const RECORD: &str = "crab-tmpfs.json";

/// What every key starts with.
const KEY_PREFIX: &str = "crab-tmpfs";

/// The most mounts one record may name.
const MOST: usize = 16;

/// The most names one kept-out tmpfs may hold, and how deep.
const MOST_ENTRIES: usize = 256;
const DEEPEST: usize = 8;

/// Mount flags (`mountinfo`'s per-mount options) a kept-out tmpfs may
/// have, and what makes them again.
const FLAGS: [(&str, MsFlags); 7] = [
    ("rw", MsFlags::empty()),
    ("nosuid", MsFlags::MS_NOSUID),
    ("nodev", MsFlags::MS_NODEV),
    ("noexec", MsFlags::MS_NOEXEC),
    ("noatime", MsFlags::MS_NOATIME),
    ("nodiratime", MsFlags::MS_NODIRATIME),
    ("relatime", MsFlags::MS_RELATIME),
];

/// Flags every kept-out tmpfs has (a restore makes them whatever the
/// record says): writable, and no set-id program runs from it, as every
/// spec's tmpfs.
const REQUIRED: [&str; 2] = ["rw", "nosuid"];

/// Superblock options (`mountinfo`'s last field) a kept-out tmpfs may
/// have; `rw` is its writability, the rest are given to `mount` again.
const OPTIONS: [&str; 10] = [
    "rw",
    "size",
    "nr_blocks",
    "nr_inodes",
    "mode",
    "uid",
    "gid",
    "inode64",
    "inode32",
    "noswap",
];

/// One tmpfs kept out of the images, as the dump found it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
struct Kept {
    /// Where it is mounted, in the sandbox.
    path: String,
    /// Its source's name (`shm`, `tmpfs`).
    source: String,
    /// Its mount flags, by `mountinfo`'s names.
    flags: Vec<String>,
    /// Its superblock options but `rw`, as `mount` takes them.
    data: String,
    /// Its root directory's.
    root: Attrs,
    /// What is in it, each directory before what is in it.
    entries: Vec<Entry>,
}

/// A name's mode bits, owner and times (seconds and nanoseconds).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
struct Attrs {
    mode: u32,
    uid: u32,
    gid: u32,
    atime: (i64, u32),
    mtime: (i64, u32),
}

/// One name in a kept-out tmpfs.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
struct Entry {
    /// Its path below the mount's root.
    name: String,
    /// What it is.
    kind: Kind,
    /// Its own (none for a mount point: hidden under its mount).
    attrs: Option<Attrs>,
}

/// What a name in a kept-out tmpfs is.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
enum Kind {
    Dir,
    Symlink {
        target: String,
    },
    Char {
        major: u32,
        minor: u32,
    },
    Block {
        major: u32,
        minor: u32,
    },
    /// Where another mount sits: a directory, or a file for a mount of
    /// one (`/dev/console`).
    MountPoint {
        dir: bool,
    },
}

/// At a dump of a container of `spec` whose init's root is `root` and
/// whose init sees `mounts`, marks each tmpfs of the spec that holds no data external
/// when `safe` (the sandbox is frozen and its mounts are fixed), and
/// records them in `images` (an earlier record there is replaced).
pub fn record(
    spec: &Spec,
    root: &OwnedFd,
    mounts: &MountInfos,
    safe: bool,
    images: &Path,
    criu: &mut Criu,
) -> Result<()> {
    let record = images.join(RECORD);
    super::remove_stale(&record)?;
    if !safe || in_user_namespace(spec) {
        return Ok(());
    }
    let tmpfs: Vec<String> = spec
        .mounts()
        .iter()
        .flatten()
        .filter(|m| m.typ().as_deref() == Some("tmpfs"))
        .map(|m| m.destination().to_string_lossy().into_owned())
        .collect();
    if tmpfs.is_empty() {
        return Ok(());
    }
    let allowed = Allowed {
        devices: devices(spec),
        mount_points: spec
            .mounts()
            .iter()
            .flatten()
            .map(|m| m.destination().to_string_lossy().into_owned())
            .chain(["/dev/console".to_owned()])
            .collect(),
    };
    let mut kept = Vec::new();
    // No more than a restore takes.
    for path in tmpfs {
        if kept.len() == MOST {
            break;
        }
        if let Some(k) = keepable(root, mounts, &path, &allowed) {
            criu.set_external_mount(path.clone(), format!("{KEY_PREFIX}{path}"));
            kept.push(k);
        }
    }
    if kept.is_empty() {
        return Ok(());
    }
    let text = serde_json::to_vec(&kept).expect("a record encodes");
    std::fs::write(&record, text).with_context(|| format!("write {}", record.display()))
}

/// Whether a container of `spec` runs in a user namespace of its own: its
/// tmpfs belong to it, and a fresh one of the helper's would not.
fn in_user_namespace(spec: &Spec) -> bool {
    spec.linux()
        .as_ref()
        .and_then(|l| l.namespaces().as_ref())
        .is_some_and(|ns| ns.iter().any(|n| n.typ() == LinuxNamespaceType::User))
}

/// The tmpfs mounts the dump kept out of `images`, each checked against
/// a restore into a container of `spec`, with its mount flags; none when
/// the images keep theirs.
fn recorded(spec: &Spec, images: &Path) -> Result<Vec<(Kept, MsFlags)>> {
    let text = match std::fs::read(images.join(RECORD)) {
        Ok(t) => t,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Vec::new()),
        Err(e) => return Err(e).with_context(|| format!("read {RECORD}")),
    };
    // The images may come from an imported archive: everything is checked
    // before anything is mounted.
    let kept: Vec<Kept> = serde_json::from_slice(&text).with_context(|| format!("parse {RECORD}"))?;
    ensure!(kept.len() <= MOST, "{RECORD} names {} mounts", kept.len());
    ensure!(
        kept.is_empty() || !in_user_namespace(spec),
        "the images keep {} out of them, which crab cannot make again in a container with a user namespace",
        kept[0].path
    );
    let devices = devices(spec);
    kept.into_iter()
        .map(|k| {
            let flags =
                check(&k, &devices).with_context(|| format!("{RECORD}: the mount at {:?}", k.path))?;
            Ok((k, flags))
        })
        .collect()
}

/// What [`restore`] would refuse in `images` for a container of `spec`,
/// found before a restore kills the processes it replaces.
pub fn preflight(spec: &Spec, images: &Path) -> Result<()> {
    recorded(spec, images).map(drop)
}

/// At a restore from `images` into a container of `spec`, with CRIU's
/// work directory `work`, mounts a fresh tmpfs there for each one the
/// dump kept out, made as it recorded, and gives it as that mount's
/// source; the mounts are held (and unmounted on drop) until CRIU is
/// done.
pub fn restore(spec: &Spec, images: &Path, work: &Path, criu: &mut Criu) -> Result<Vec<Source>> {
    let mut sources = Vec::new();
    for (n, (k, flags)) in recorded(spec, images)?.into_iter().enumerate() {
        let source = mount(&k, flags, &work.join(format!("{SOURCE_PREFIX}{n}")))?;
        criu.set_external_mount(
            format!("{KEY_PREFIX}{}", k.path),
            source.0.to_string_lossy().into_owned(),
        );
        sources.push(source);
    }
    Ok(sources)
}

/// What each fresh tmpfs's directory in CRIU's work directory is called,
/// before its number.
pub(super) const SOURCE_PREFIX: &str = "tmpfs-";

/// The device nodes libcontainer makes in a container of `spec`: its own
/// defaults and the spec's, by kind (block or not) and number.
fn devices(spec: &Spec) -> HashSet<(bool, i64, i64)> {
    let spec_devices = spec.linux().as_ref().and_then(|l| l.devices().clone());
    libcontainer::rootfs::utils::default_devices()
        .into_iter()
        .chain(spec_devices.into_iter().flatten())
        .filter_map(|d| match d.typ() {
            LinuxDeviceType::B => Some((true, d.major(), d.minor())),
            LinuxDeviceType::C | LinuxDeviceType::U => Some((false, d.major(), d.minor())),
            LinuxDeviceType::A | LinuxDeviceType::P => None,
        })
        .collect()
}

/// The mount flags of a recorded tmpfs, if the record is one a dump
/// writes and names no device the container lacks (`devices`).
fn check(k: &Kept, devices: &HashSet<(bool, i64, i64)>) -> Result<MsFlags> {
    ensure!(
        k.path.len() <= 4096 && Path::new(&k.path).is_absolute() && plain_path(&k.path),
        "not a plain absolute path"
    );
    ensure!(plain_name(&k.source), "source {:?}", k.source);
    let mut flags = MsFlags::empty();
    for f in &k.flags {
        match FLAGS.iter().find(|(name, _)| name == f) {
            Some((_, bits)) => flags |= *bits,
            None => bail!("unknown mount flag {f:?}"),
        }
    }
    for r in REQUIRED {
        ensure!(k.flags.iter().any(|f| f == r), "no {r} flag");
    }
    if !flags.intersects(MsFlags::MS_NOATIME | MsFlags::MS_RELATIME) {
        flags |= MsFlags::MS_STRICTATIME;
    }
    for option in k.data.split(',').filter(|o| !o.is_empty()) {
        let (name, value) = option.split_once('=').unwrap_or((option, ""));
        ensure!(
            name != "rw" && OPTIONS.contains(&name),
            "unknown tmpfs option {name:?}"
        );
        ensure!(
            value.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'%'),
            "tmpfs option {option:?}"
        );
    }
    check_attrs(&k.root)?;
    ensure!(k.entries.len() <= MOST_ENTRIES, "{} names", k.entries.len());
    let mut seen = HashSet::new();
    for e in &k.entries {
        ensure!(
            e.name.len() <= 4096 && Path::new(&e.name).is_relative() && plain_path(&e.name),
            "name {:?}",
            e.name
        );
        ensure!(
            Path::new(&e.name).components().count() <= DEEPEST,
            "name {:?} is too deep",
            e.name
        );
        // Made in order: what it is in was made before it, as a directory.
        if let Some(parent) = Path::new(&e.name).parent().filter(|p| !p.as_os_str().is_empty()) {
            ensure!(
                seen.contains(parent.to_string_lossy().as_ref()),
                "{:?} comes before its directory",
                e.name
            );
        }
        match &e.kind {
            Kind::Dir => {
                seen.insert(e.name.clone());
            }
            Kind::Symlink { target } => ensure!(
                !target.is_empty() && target.len() < 4096 && !target.contains('\0'),
                "link {:?}",
                e.name
            ),
            Kind::Char { major, minor } | Kind::Block { major, minor } => {
                let block = matches!(e.kind, Kind::Block { .. });
                ensure!(
                    devices.contains(&(block, i64::from(*major), i64::from(*minor))),
                    "device {major}:{minor} at {:?} is not the container's",
                    e.name
                );
            }
            Kind::MountPoint { .. } => {}
        }
        match (&e.kind, &e.attrs) {
            (Kind::MountPoint { .. }, None) => {}
            (Kind::MountPoint { .. }, Some(_)) => bail!("a mount point's own attributes"),
            (_, Some(a)) => check_attrs(a)?,
            (_, None) => bail!("no attributes for {:?}", e.name),
        }
    }
    Ok(flags)
}

fn check_attrs(a: &Attrs) -> Result<()> {
    ensure!(a.mode <= 0o7777, "mode {:o}", a.mode);
    ensure!(
        a.atime.1 < 1_000_000_000 && a.mtime.1 < 1_000_000_000,
        "a time's nanoseconds"
    );
    Ok(())
}

/// Whether `path` has only plain names in it (no `.`, `..` or empty one).
fn plain_path(path: &str) -> bool {
    Path::new(path)
        .components()
        .all(|c| matches!(c, Component::RootDir | Component::Normal(_)))
        && !path.ends_with('/')
        && !path.contains("//")
}

/// Whether `name` is a plain name for a mount's source: a word of
/// letters, digits, `-`, `_` and `.`.
fn plain_name(name: &str) -> bool {
    (1..=255).contains(&name.len())
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b"-_.".contains(&b))
}

#[cfg(test)]
mod tests {
    use rustix::fs::{Mode, OFlags};

    use super::*;

    fn attrs(mode: u32) -> Attrs {
        Attrs {
            mode,
            uid: 12,
            gid: 34,
            atime: (1_700_000_000, 5),
            mtime: (1_600_000_000, 7),
        }
    }

    fn entry(name: &str, kind: Kind) -> Entry {
        let attrs = match kind {
            Kind::MountPoint { .. } => None,
            Kind::Dir => Some(attrs(0o750)),
            // A link's mode is always this.
            Kind::Symlink { .. } => Some(attrs(0o777)),
            _ => Some(attrs(0o640)),
        };
        Entry {
            name: name.to_owned(),
            kind,
            attrs,
        }
    }

    fn shm() -> Kept {
        Kept {
            path: "/dev/shm".to_owned(),
            source: "shm".to_owned(),
            flags: ["nodev", "noexec", "nosuid", "rw"].map(str::to_owned).to_vec(),
            data: "inode64,size=65536k".to_owned(),
            root: attrs(0o1770),
            entries: vec![],
        }
    }

    /// A `/dev` as libcontainer makes it, with a directory of its own.
    fn dev() -> Kept {
        Kept {
            path: "/dev".to_owned(),
            source: "tmpfs".to_owned(),
            flags: ["nosuid", "rw"].map(str::to_owned).to_vec(),
            data: "mode=755,size=65536k".to_owned(),
            root: attrs(0o755),
            entries: vec![
                entry(
                    "fd",
                    Kind::Symlink {
                        target: "/proc/self/fd".to_owned(),
                    },
                ),
                entry("net", Kind::Dir),
                entry("net/null", Kind::Char { major: 1, minor: 3 }),
                entry("null", Kind::Char { major: 1, minor: 3 }),
                entry("pts", Kind::MountPoint { dir: true }),
            ],
        }
    }

    fn no_devices() -> HashSet<(bool, i64, i64)> {
        devices(&Spec::default())
    }

    #[test]
    fn a_record_a_dump_would_not_write_is_refused() {
        assert!(check(&shm(), &no_devices()).is_ok());
        assert!(check(&dev(), &no_devices()).is_ok());
        let bad = |change: fn(&mut Kept)| {
            let mut k = dev();
            change(&mut k);
            check(&k, &no_devices()).is_err()
        };
        assert!(bad(|k| k.path = "/dev/../etc".to_owned()));
        assert!(bad(|k| k.path = "dev/shm".to_owned()));
        assert!(bad(|k| k.flags.push("bind".to_owned())));
        assert!(bad(|k| k.flags.retain(|f| f != "nosuid")));
        assert!(bad(|k| k.source = "a b".to_owned()));
        assert!(bad(|k| k.source = String::new()));
        assert!(bad(|k| k.data = "size=1k,mpol=bind:0".to_owned()));
        assert!(bad(|k| k.data = "size=1k,rw".to_owned()));
        assert!(bad(|k| k.data = "uid=0\nx".to_owned()));
        assert!(bad(|k| k.root.mode = 0o10777));
        assert!(bad(|k| k.root.mtime.1 = 1_000_000_000));
        // Names: plain, below the root, after their directory.
        assert!(bad(|k| k.entries[1].name = "../net".to_owned()));
        assert!(bad(|k| k.entries[1].name = "/net".to_owned()));
        assert!(bad(|k| k.entries[1].name = "net/".to_owned()));
        assert!(bad(|k| k.entries.swap(1, 2)));
        assert!(bad(|k| k.entries[0].name = "net/x/y".to_owned()));
        assert!(bad(|k| k.entries.push(entry("a/b/c/d/e/f/g/h/i", Kind::Dir))));
        // A link's directory is no directory.
        assert!(bad(|k| k.entries.push(entry("fd/x", Kind::Dir))));
        // Only devices the container has, of their kind.
        assert!(bad(|k| k
            .entries
            .push(entry("sda", Kind::Block { major: 8, minor: 0 }))));
        assert!(bad(|k| k
            .entries
            .push(entry("mem", Kind::Char { major: 1, minor: 1 }))));
        assert!(bad(|k| k
            .entries
            .push(entry("b", Kind::Block { major: 1, minor: 3 }))));
        assert!(bad(|k| k.entries[4].attrs = Some(attrs(0o755))));
        assert!(bad(|k| k.entries[0].attrs = None));
        // A device the spec gives is fine.
        let mut spec = Spec::default();
        let sda = oci_spec::runtime::LinuxDeviceBuilder::default()
            .path("/dev/sda")
            .typ(LinuxDeviceType::B)
            .major(8)
            .minor(0)
            .build()
            .unwrap();
        spec.linux_mut().as_mut().unwrap().set_devices(Some(vec![sda]));
        let mut k = dev();
        k.entries.push(entry("sda", Kind::Block { major: 8, minor: 0 }));
        assert!(check(&k, &devices(&spec)).is_ok());
        // A restore checks it all before anything is killed: a device of
        // another spec, a user namespace.
        let images = tempfile::tempdir().unwrap();
        std::fs::write(images.path().join(RECORD), serde_json::to_vec(&[k]).unwrap()).unwrap();
        assert!(preflight(&spec, images.path()).is_ok());
        let e = preflight(&Spec::default(), images.path()).unwrap_err();
        assert!(format!("{e:#}").contains("is not the container's"), "{e:#}");
        let user = oci_spec::runtime::LinuxNamespaceBuilder::default()
            .typ(LinuxNamespaceType::User)
            .build()
            .unwrap();
        let linux = spec.linux_mut().as_mut().unwrap();
        let mut namespaces = linux.namespaces().clone().unwrap_or_default();
        namespaces.push(user);
        linux.set_namespaces(Some(namespaces));
        let e = preflight(&spec, images.path()).unwrap_err();
        assert!(e.to_string().contains("user namespace"), "{e:#}");
        assert!(
            preflight(&spec, Path::new("/nonexistent")).is_ok(),
            "no record: nothing to make"
        );
    }

    /// Needs root: a restore's tmpfs is made as recorded, and the dump's
    /// rule reads back the same record from it; anything it cannot make
    /// again (data, even unlinked while open; a name hidden under a mount)
    /// keeps it in the images.
    #[test]
    fn a_recorded_tmpfs_is_made_again_and_read_back_the_same() {
        let work = tempfile::tempdir().unwrap();
        std::fs::write(
            work.path().join(RECORD),
            serde_json::to_vec(&[shm(), dev()]).unwrap(),
        )
        .unwrap();
        let mut criu = Criu::new_with_criu_path("/nonexistent".into()).unwrap();
        let sources = restore(&Spec::default(), work.path(), work.path(), &mut criu).unwrap();
        assert_eq!(sources.len(), 2);
        let (shm_dir, dev_dir) = (work.path().join("tmpfs-0"), work.path().join("tmpfs-1"));
        let small = |at: &Path| {
            nix::mount::mount(
                Some("tmpfs"),
                at,
                Some("tmpfs"),
                MsFlags::empty(),
                Some("size=4k"),
            )
            .unwrap()
        };
        let mountinfo = || procfs::process::Process::myself().unwrap().mountinfo().unwrap();
        // Something on the mount point, as devpts is on /dev/pts.
        let pts = dev_dir.join("pts");
        small(&pts);
        let mounts = mountinfo();
        let m = mounts.iter().find(|m| m.mount_point == shm_dir).expect("mounted");
        assert_eq!(m.fs_type, "tmpfs");
        assert_eq!(m.mount_source.as_deref(), Some("shm"));
        assert!(m.opt_fields.is_empty(), "private: {:?}", m.opt_fields);
        for f in ["rw", "nosuid", "nodev", "noexec"] {
            assert!(m.mount_options.contains_key(f), "{f}: {:?}", m.mount_options);
        }
        assert_eq!(m.super_options.get("size"), Some(&Some("65536k".to_owned())));
        let root = rustix::fs::open("/", OFlags::PATH | OFlags::DIRECTORY, Mode::empty()).unwrap();
        let allowed = Allowed {
            devices: no_devices(),
            mount_points: [pts.to_string_lossy().into_owned()].into(),
        };
        let keep = |mounts: &MountInfos, dir: &Path| keepable(&root, mounts, dir.to_str().unwrap(), &allowed);
        // As the kernel shows it (some show `inode64` on every tmpfs).
        let plain = |k: Kept| Kept {
            data: k
                .data
                .split(',')
                .filter(|o| *o != "inode64")
                .collect::<Vec<_>>()
                .join(","),
            ..k
        };
        let back = |k: Kept, dir: &Path| {
            plain(Kept {
                path: dir.to_string_lossy().into_owned(),
                ..k
            })
        };
        // Read back as recorded (the first read: reading moves atimes).
        assert_eq!(keep(&mounts, &shm_dir).map(plain), Some(back(shm(), &shm_dir)));
        assert_eq!(keep(&mounts, &dev_dir).map(plain), Some(back(dev(), &dev_dir)));
        // Data, even unlinked while open, keeps it in.
        let shm_id = m.mnt_id as u64;
        let shm_path = shm_dir.to_str().unwrap();
        assert!(holds_nothing(&root, shm_path, shm_id));
        assert!(!holds_nothing(&root, shm_path, shm_id + 1), "another mount");
        let file = shm_dir.join("x");
        let open = std::fs::File::create(&file).unwrap();
        assert!(keep(&mounts, &shm_dir).is_none());
        assert!(!holds_nothing(&root, shm_path, shm_id));
        std::fs::remove_file(&file).unwrap();
        assert!(keep(&mounts, &shm_dir).is_none());
        drop(open);
        assert!(keep(&mounts, &shm_dir).is_some());
        // So does a name hidden under a mount, and a second link to a name.
        nix::mount::umount(&pts).unwrap();
        std::fs::write(pts.join("hidden"), b"").unwrap();
        small(&pts);
        assert!(keep(&mountinfo(), &dev_dir).is_none());
        nix::mount::umount(&pts).unwrap();
        std::fs::remove_file(pts.join("hidden")).unwrap();
        small(&pts);
        let mounts = mountinfo();
        assert!(keep(&mounts, &dev_dir).is_some());
        std::fs::hard_link(dev_dir.join("null"), dev_dir.join("null2")).unwrap();
        assert!(keep(&mounts, &dev_dir).is_none());
        std::fs::remove_file(dev_dir.join("null2")).unwrap();
        assert!(keep(&mounts, &dev_dir).is_some());
        // A device the container lacks (a restore could not make it).
        let mem = dev_dir.join("mem");
        nix::sys::stat::mknod(
            &mem,
            nix::sys::stat::SFlag::S_IFCHR,
            nix::sys::stat::Mode::from_bits_truncate(0o600),
            nix::sys::stat::makedev(1, 1),
        )
        .unwrap();
        assert!(keep(&mounts, &dev_dir).is_none());
        std::fs::remove_file(&mem).unwrap();
        // A mount where the spec puts none.
        let net = dev_dir.join("net");
        small(&net);
        assert!(keep(&mountinfo(), &dev_dir).is_none());
        nix::mount::umount(&net).unwrap();
        assert!(keep(&mounts, &dev_dir).is_some());
        // Not a tmpfs's root: kept in.
        assert!(keep(&mounts, Path::new("/")).is_none());
        nix::mount::umount(&pts).unwrap();
        drop(sources);
        assert!(
            !shm_dir.exists() && !dev_dir.exists(),
            "the sources went with their guards"
        );
    }
}
