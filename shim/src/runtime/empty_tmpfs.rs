//! Empty writable tmpfs mounts kept out of CRIU's images.
//!
//! A container's spec mounts a tmpfs at `/dev/shm` and (containerd's
//! default spec) at `/run`; CRIU saves every tmpfs by running
//! `tar | gzip` over it and restores it by running them again, some
//! milliseconds of process starts each, frozen at a dump and again at a
//! restore, even when the mount holds nothing, as it mostly does.
//!
//! At a dump of a frozen sandbox whose mounts are fixed (nothing in it
//! can mount or remount: see [`super::masked::mounts_are_fixed`]), a
//! tmpfs its spec mounts is marked external and recorded in the images
//! ([`RECORD`]) when it is what libcontainer made and holds nothing:
//! - the only mount at its path, the root of its tmpfs, private (no peer
//!   group, no master), writable and `nosuid`, with a plain source name
//!   and options crab knows how to make again;
//! - one inode in use in its superblock, its root's: no name in it, and
//!   no file that is unlinked but still open or mapped;
//! - no extended attribute on its root.
//!
//! The record keeps the mount's source name, flags and superblock
//! options and its root's mode, owner and times. A restore mounts a fresh tmpfs of each
//! in CRIU's work directory, made as recorded, and CRIU binds it in its
//! place; the helper's own mount of it goes once CRIU is done. Each
//! restore has its own: no two sandboxes share one. A sandbox that is not
//! frozen at the dump (`ctr task checkpoint`, which CRIU freezes later),
//! or runs in a user namespace, keeps its tmpfs in the images as before.

use std::os::fd::OwnedFd;
use std::path::{Component, Path};

use anyhow::{bail, ensure, Context, Result};
use nix::mount::MsFlags;
use oci_spec::runtime::{LinuxNamespaceType, Spec};
use procfs::process::MountInfos;
use rust_criu::Criu;
use rustix::fs::{Mode, OFlags, ResolveFlags, StatxAttributes, StatxFlags, Timespec};
use serde::{Deserialize, Serialize};

use super::masked::{unmount, Source};

/// The file in the images naming the tmpfs mounts kept out of them.
const RECORD: &str = "crab-tmpfs.json";

/// What every key starts with.
const KEY_PREFIX: &str = "crab-tmpfs";

/// The most mounts one record may name.
const MOST: usize = 16;

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
    /// Its root directory's mode bits, owner and times (seconds and
    /// nanoseconds).
    mode: u32,
    uid: u32,
    gid: u32,
    atime: (i64, u32),
    mtime: (i64, u32),
}

/// At a dump of `pid` (the init of a container of `spec`, whose init sees
/// `mounts`), marks each empty tmpfs of the spec external when `safe`
/// (the sandbox is frozen and its mounts are fixed), and records them in
/// `images` (an earlier record there is replaced).
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
    let root = rustix::fs::open(
        format!("/proc/{pid}/root"),
        OFlags::PATH | OFlags::DIRECTORY | OFlags::CLOEXEC,
        Mode::empty(),
    )
    .context("open the init's root")?;
    let mut kept = Vec::new();
    for path in tmpfs {
        if let Some(k) = keepable(&root, mounts, &path) {
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

/// The tmpfs at `path` in the sandbox whose root is `root`, if it may be
/// kept out of the images; `None` for anything else, or anything that
/// cannot be read.
fn keepable(root: &OwnedFd, mounts: &MountInfos, path: &str) -> Option<Kept> {
    let mut at = mounts.iter().filter(|m| m.mount_point == Path::new(path));
    let (Some(m), None) = (at.next(), at.next()) else {
        return None;
    };
    let flags: Vec<String> = m.mount_options.keys().cloned().collect();
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
    let stx = rustix::fs::statx(
        &dir,
        "",
        rustix::fs::AtFlags::EMPTY_PATH,
        StatxFlags::BASIC_STATS | StatxFlags::MNT_ID,
    )
    .ok()?;
    if stx.stx_mnt_id != m.mnt_id as u64
        || !stx.stx_attributes_mask.contains(StatxAttributes::MOUNT_ROOT)
        || !stx.stx_attributes.contains(StatxAttributes::MOUNT_ROOT)
    {
        return None;
    }
    let vfs = rustix::fs::fstatvfs(&dir).ok()?;
    // Inodes are counted (`nr_inodes` is not 0) and only the root's is in
    // use; with a size limit, no block is.
    let empty = vfs.f_files > 0
        && vfs.f_files - vfs.f_ffree == 1
        && (vfs.f_blocks == 0 || vfs.f_blocks == vfs.f_bfree);
    if !empty || rustix::fs::flistxattr_query(&dir).ok()? != 0 {
        return None;
    }
    let data: Vec<String> = m
        .super_options
        .iter()
        .filter(|(k, _)| *k != "rw")
        .map(|(k, v)| match v {
            Some(v) => format!("{k}={v}"),
            None => k.clone(),
        })
        .collect();
    Some(Kept {
        path: path.to_owned(),
        source: m.mount_source.clone().unwrap_or_default(),
        flags,
        data: data.join(","),
        mode: u32::from(stx.stx_mode) & 0o7777,
        uid: stx.stx_uid,
        gid: stx.stx_gid,
        atime: (stx.stx_atime.tv_sec, stx.stx_atime.tv_nsec),
        mtime: (stx.stx_mtime.tv_sec, stx.stx_mtime.tv_nsec),
    })
}

/// At a restore from `images` with CRIU's work directory `work`, mounts a
/// fresh tmpfs there for each one the dump kept out, made as it recorded,
/// and gives it as that mount's source; the mounts are held (and
/// unmounted on drop) until CRIU is done.
pub fn restore(images: &Path, work: &Path, criu: &mut Criu) -> Result<Vec<Source>> {
    let text = match std::fs::read(images.join(RECORD)) {
        Ok(t) => t,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Vec::new()),
        Err(e) => return Err(e).with_context(|| format!("read {RECORD}")),
    };
    // The images may come from an imported archive: everything is checked
    // before anything is mounted.
    let kept: Vec<Kept> = serde_json::from_slice(&text).with_context(|| format!("parse {RECORD}"))?;
    ensure!(kept.len() <= MOST, "{RECORD} names {} mounts", kept.len());
    let made = kept
        .iter()
        .map(|k| check(k).with_context(|| format!("{RECORD}: the mount at {:?}", k.path)))
        .collect::<Result<Vec<_>>>()?;
    let mut sources = Vec::new();
    for (n, (k, flags)) in kept.iter().zip(made).enumerate() {
        let source = mount(k, flags, &work.join(format!("tmpfs-{n}")))?;
        criu.set_external_mount(
            format!("{KEY_PREFIX}{}", k.path),
            source.0.to_string_lossy().into_owned(),
        );
        sources.push(source);
    }
    Ok(sources)
}

/// The mount flags of a recorded tmpfs, if the record is one a dump
/// writes.
fn check(k: &Kept) -> Result<MsFlags> {
    let path = Path::new(&k.path);
    ensure!(
        k.path.len() <= 4096
            && path.is_absolute()
            && path
                .components()
                .all(|c| matches!(c, Component::RootDir | Component::Normal(_))),
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
    ensure!(k.mode <= 0o7777, "mode {:o}", k.mode);
    ensure!(
        k.atime.1 < 1_000_000_000 && k.mtime.1 < 1_000_000_000,
        "a time's nanoseconds"
    );
    Ok(flags)
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
/// with mount flags `flags`, private: it propagates nowhere.
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
    let set = || -> rustix::io::Result<()> {
        rustix::fs::fchown(
            &root,
            Some(rustix::fs::Uid::from_raw(k.uid)),
            Some(rustix::fs::Gid::from_raw(k.gid)),
        )?;
        // After the owner: a change of owner may clear set-id bits.
        rustix::fs::fchmod(&root, Mode::from_raw_mode(k.mode))?;
        let time = |(tv_sec, tv_nsec): (i64, u32)| Timespec {
            tv_sec,
            tv_nsec: tv_nsec.into(),
        };
        rustix::fs::futimens(
            &root,
            &rustix::fs::Timestamps {
                last_access: time(k.atime),
                last_modification: time(k.mtime),
            },
        )
    };
    set().with_context(|| format!("give {} the recorded owner, mode and times", dir.display()))?;
    Ok(source)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn shm() -> Kept {
        Kept {
            path: "/dev/shm".to_owned(),
            source: "shm".to_owned(),
            flags: ["rw", "nosuid", "nodev", "noexec"].map(str::to_owned).to_vec(),
            data: "size=65536k,mode=1777,inode64".to_owned(),
            mode: 0o1770,
            uid: 12,
            gid: 34,
            atime: (1_700_000_000, 5),
            mtime: (1_600_000_000, 7),
        }
    }

    #[test]
    fn a_record_a_dump_would_not_write_is_refused() {
        assert!(check(&shm()).is_ok());
        let bad = |change: fn(&mut Kept)| {
            let mut k = shm();
            change(&mut k);
            check(&k).is_err()
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
        assert!(bad(|k| k.mode = 0o10777));
        assert!(bad(|k| k.mtime.1 = 1_000_000_000));
    }

    /// Needs root: a restore's tmpfs is a fresh one as recorded, and the
    /// dump's rule takes a tmpfs for empty exactly when nothing is in it,
    /// not even an unlinked file still open.
    #[test]
    fn a_recorded_tmpfs_is_made_again_and_only_an_empty_one_is_kept_out() {
        let work = tempfile::tempdir().unwrap();
        std::fs::write(work.path().join(RECORD), serde_json::to_vec(&[shm()]).unwrap()).unwrap();
        let mut criu = Criu::new_with_criu_path("/nonexistent".into()).unwrap();
        let sources = restore(work.path(), work.path(), &mut criu).unwrap();
        assert_eq!(sources.len(), 1);
        let dir = work.path().join("tmpfs-0");
        let mounts = procfs::process::Process::myself().unwrap().mountinfo().unwrap();
        let m = mounts.iter().find(|m| m.mount_point == dir).expect("mounted");
        assert_eq!(m.fs_type, "tmpfs");
        assert_eq!(m.mount_source.as_deref(), Some("shm"));
        assert!(m.opt_fields.is_empty(), "private: {:?}", m.opt_fields);
        for f in ["rw", "nosuid", "nodev", "noexec"] {
            assert!(m.mount_options.contains_key(f), "{f}: {:?}", m.mount_options);
        }
        assert_eq!(m.super_options.get("size"), Some(&Some("65536k".to_owned())));
        let root = rustix::fs::open("/", OFlags::PATH | OFlags::DIRECTORY, Mode::empty()).unwrap();
        let path = dir.to_str().unwrap();
        // Its root as recorded, and the dump's rule takes it for empty.
        let found = keepable(&root, &mounts, path).expect("empty: kept out");
        for f in ["nosuid", "nodev", "noexec"] {
            assert!(found.flags.iter().any(|x| x == f), "{f}: {found:?}");
        }
        assert!(found.data.split(',').any(|o| o == "size=65536k"), "{found:?}");
        assert_eq!(found.mode, 0o1770);
        assert_eq!((found.uid, found.gid), (12, 34));
        assert_eq!((found.atime, found.mtime), (shm().atime, shm().mtime));
        // Something in it, even unlinked while open, keeps it in.
        let file = dir.join("x");
        let open = std::fs::File::create(&file).unwrap();
        assert!(keepable(&root, &mounts, path).is_none());
        std::fs::remove_file(&file).unwrap();
        assert!(keepable(&root, &mounts, path).is_none());
        drop(open);
        assert!(keepable(&root, &mounts, path).is_some());
        // Not a tmpfs's root: kept in.
        assert!(keepable(&root, &mounts, "/").is_none());
        drop(sources);
        assert!(!dir.exists(), "the source went with its guard");
    }
}
