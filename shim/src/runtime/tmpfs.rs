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
use rustix::fs::{
    AtFlags, FileType, Mode, OFlags, ResolveFlags, StatxAttributes, StatxFlags, Timespec, Timestamps,
};
use serde::{Deserialize, Serialize};

use super::masked::{unmount, Source};

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
struct Attrs {
    mode: u32,
    uid: u32,
    gid: u32,
    atime: (i64, u32),
    mtime: (i64, u32),
}

/// One name in a kept-out tmpfs.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
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

/// At a dump of `pid` (the init of a container of `spec`, whose init sees
/// `mounts`), marks each tmpfs of the spec that holds no data external
/// when `safe` (the sandbox is frozen and its mounts are fixed), and
/// records them in `images` (an earlier record there is replaced).
pub fn record(
    spec: &Spec,
    pid: i32,
    mounts: &MountInfos,
    safe: bool,
    images: &Path,
    criu: &mut Criu,
) -> Result<()> {
    let record = images.join(RECORD);
    match std::fs::remove_file(&record) {
        Err(e) if e.kind() != std::io::ErrorKind::NotFound => {
            return Err(e).with_context(|| format!("remove a stale {RECORD}"))
        }
        _ => {}
    }
    let user_ns = spec
        .linux()
        .as_ref()
        .and_then(|l| l.namespaces().as_ref())
        .is_some_and(|ns| ns.iter().any(|n| n.typ() == LinuxNamespaceType::User));
    if !safe || user_ns {
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
    let root = rustix::fs::open(
        format!("/proc/{pid}/root"),
        OFlags::PATH | OFlags::DIRECTORY | OFlags::CLOEXEC,
        Mode::empty(),
    )
    .context("open the init's root")?;
    let mut kept = Vec::new();
    // No more than a restore takes.
    for path in tmpfs {
        if kept.len() == MOST {
            break;
        }
        if let Some(k) = keepable(&root, mounts, &path, &allowed) {
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

/// What a kept-out tmpfs may hold besides directories and links: the
/// container's devices, and mounts where its spec (or a terminal) puts
/// them.
struct Allowed {
    devices: HashSet<(bool, i64, i64)>,
    mount_points: HashSet<String>,
}

/// The tmpfs at `path` in the sandbox whose root is `root`, if it may be
/// kept out of the images; `None` for anything else, or anything that
/// cannot be read.
fn keepable(root: &OwnedFd, mounts: &MountInfos, path: &str, allowed: &Allowed) -> Option<Kept> {
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
    // The mount itself, reached inside the sandbox's root without
    // following any link the sandbox may have put on the way.
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
    if stx.stx_mnt_id != m.mnt_id as u64
        || !stx.stx_attributes_mask.contains(StatxAttributes::MOUNT_ROOT)
        || !stx.stx_attributes.contains(StatxAttributes::MOUNT_ROOT)
    {
        return None;
    }
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
    // A fresh tmpfs belongs to the host's user namespace, not the
    // container's.
    let user_ns = spec
        .linux()
        .as_ref()
        .and_then(|l| l.namespaces().as_ref())
        .is_some_and(|ns| ns.iter().any(|n| n.typ() == LinuxNamespaceType::User));
    ensure!(
        kept.is_empty() || !user_ns,
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

/// Mounts a fresh tmpfs at `dir` (in the shim's own work directory; what
/// an earlier, killed helper left there goes first) as `k` records it,
/// with mount flags `flags`, private (it propagates nowhere), and makes
/// what it held again.
fn mount(k: &Kept, flags: MsFlags, dir: &Path) -> Result<Source> {
    unmount(dir);
    std::fs::create_dir(dir).with_context(|| format!("create {}", dir.display()))?;
    // From here on, dropped on any failure.
    let source = Source(dir.to_owned());
    nix::mount::mount(
        Some(k.source.as_str()),
        dir,
        Some("tmpfs"),
        flags,
        Some(k.data.as_str()),
    )
    .with_context(|| format!("mount a tmpfs ({}) at {}", k.data, dir.display()))?;
    nix::mount::mount(None::<&str>, dir, None::<&str>, MsFlags::MS_PRIVATE, None::<&str>)
        .with_context(|| format!("make {} private", dir.display()))?;
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

#[cfg(test)]
mod tests {
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
        let file = shm_dir.join("x");
        let open = std::fs::File::create(&file).unwrap();
        assert!(keep(&mounts, &shm_dir).is_none());
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
