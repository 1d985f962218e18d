//! Masked directories kept out of CRIU's images.
//!
//! libcontainer masks each directory of the spec's `maskedPaths`
//! (`/proc/acpi`, `/sys/firmware`, …) with an empty read-only tmpfs, and
//! CRIU saves every tmpfs by running `tar | gzip` over it and restores it
//! by running them again: for these empty mounts, some milliseconds of
//! process starts each, inside the sandbox's frozen time and its restore.
//!
//! When nothing in the sandbox can have changed such a mount (no process
//! of it holds `CAP_SYS_ADMIN`, even in its bounding set, so none can
//! have remounted it writable, and the mount is the one libcontainer
//! made: alone at its path, read-only in its mount and its superblock), a
//! dump marks it external and records its key in the images ([`RECORD`]).
//! A restore mounts a fresh tmpfs of its own in CRIU's work directory
//! (read-only, private, room for no file: `nr_inodes=1`) and CRIU binds it
//! in each mask's place; the helper's own mount of it goes once CRIU is
//! done. A bind keeps its source's read-only flag, so the mask is what
//! libcontainer made: empty, read-only, tmpfs; no two sandboxes share one.
//! Images without the record restore as before.

use std::path::{Path, PathBuf};

use anyhow::{bail, Context, Result};
use oci_spec::runtime::{Capability, Spec};
use rust_criu::Criu;

/// The file in the images naming the masks kept out of them.
const RECORD: &str = "crab-masked.json";

/// The masks' tmpfs during a restore, in CRIU's work directory.
const SOURCE: &str = "masked";

/// `CAP_SYS_ADMIN`'s bit in `/proc/<pid>/status`'s capability masks.
const CAP_SYS_ADMIN_BIT: u64 = 1 << 21;

/// What every key starts with.
const KEY_PREFIX: &str = "crab-masked";

/// At a dump of `pid` (the init of a container of `spec`), marks its
/// masked directories external when they may be, and records them in
/// `images` (an earlier record there is replaced).
pub fn record(spec: &Spec, pid: i32, images: &Path, criu: &mut Criu) -> Result<()> {
    let record = images.join(RECORD);
    match std::fs::remove_file(&record) {
        Err(e) if e.kind() != std::io::ErrorKind::NotFound => {
            return Err(e).with_context(|| format!("remove a stale {RECORD}"))
        }
        _ => {}
    }
    let masked: Vec<String> = spec
        .linux()
        .as_ref()
        .and_then(|l| l.masked_paths().clone())
        .unwrap_or_default();
    if masked.is_empty() || may_remount(spec) {
        return Ok(());
    }
    // A sandbox whose processes cannot be read keeps its masks in the
    // images, as before.
    if some_process_holds_sys_admin(pid).unwrap_or(true) {
        return Ok(());
    }
    let mounts = procfs::process::Process::new(pid)
        .and_then(|p| p.mountinfo())
        .context("read the init's mounts")?;
    let mut keys = Vec::new();
    for path in masked {
        // As libcontainer made it: the only mount at its path, the root of
        // a tmpfs, read-only in the mount and in the superblock.
        let mut at = mounts.iter().filter(|m| m.mount_point == Path::new(&path));
        let (Some(m), None) = (at.next(), at.next()) else {
            continue;
        };
        // A mask that receives mounts from outside is not libcontainer's
        // own (and a private source could not stand in for it).
        let slave = m
            .opt_fields
            .iter()
            .any(|f| matches!(f, procfs::process::MountOptFields::Master(_)));
        if slave
            || m.fs_type != "tmpfs"
            || m.root != "/"
            || !m.mount_options.contains_key("ro")
            || !m.super_options.contains_key("ro")
        {
            continue;
        }
        let key = format!("{KEY_PREFIX}{path}");
        criu.set_external_mount(path, key.clone());
        keys.push(key);
    }
    if keys.is_empty() {
        return Ok(());
    }
    let text = serde_json::to_vec(&keys).expect("strings encode");
    std::fs::write(&record, text).with_context(|| format!("write {}", record.display()))
}

/// The masks' tmpfs while a restore runs; unmounted (lazily, CRIU's
/// binds keep it) and its directory removed on drop.
pub struct Source(PathBuf);

impl Drop for Source {
    fn drop(&mut self) {
        unmount(&self.0);
    }
}

/// At a restore from `images` with CRIU's work directory `work`, mounts
/// a fresh empty tmpfs there and gives it as the source of each mask the
/// dump kept out; `None` when the images keep their masks.
pub fn restore(images: &Path, work: &Path, criu: &mut Criu) -> Result<Option<Source>> {
    let text = match std::fs::read(images.join(RECORD)) {
        Ok(t) => t,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(e) => return Err(e).with_context(|| format!("read {RECORD}")),
    };
    // The images may come from an imported archive: keys are only names
    // CRIU matches against the image, and every one gets the same source.
    let keys: Vec<String> = serde_json::from_slice(&text).with_context(|| format!("parse {RECORD}"))?;
    if keys.iter().any(|k| !k.starts_with(KEY_PREFIX) || k.len() > 4096) {
        bail!("{RECORD} names a mount that is not a mask");
    }
    let source = mount_empty(&work.join(SOURCE))?;
    let path = source.0.to_string_lossy().into_owned();
    for key in keys {
        criu.set_external_mount(key, path.clone());
    }
    Ok(Some(source))
}

/// Mounts a fresh empty read-only tmpfs at `dir` (in the shim's own work
/// directory; what an earlier, killed helper left there goes first), with
/// room for no file even if remounted writable, and private: it
/// propagates nowhere.
fn mount_empty(dir: &Path) -> Result<Source> {
    use nix::mount::MsFlags;
    unmount(dir);
    std::fs::create_dir(dir).with_context(|| format!("create {}", dir.display()))?;
    // From here on, dropped on any failure.
    let source = Source(dir.to_owned());
    nix::mount::mount(
        Some("tmpfs"),
        dir,
        Some("tmpfs"),
        MsFlags::MS_RDONLY | MsFlags::MS_NOSUID | MsFlags::MS_NODEV | MsFlags::MS_NOEXEC,
        Some("size=4k,nr_inodes=1,mode=0555"),
    )
    .with_context(|| format!("mount an empty tmpfs at {}", dir.display()))?;
    nix::mount::mount(None::<&str>, dir, None::<&str>, MsFlags::MS_PRIVATE, None::<&str>)
        .with_context(|| format!("make {} private", dir.display()))?;
    Ok(source)
}

/// Unmounts (lazily) whatever is mounted at `dir` and removes it; gone
/// already is fine.
fn unmount(dir: &Path) {
    use nix::mount::MntFlags;
    while nix::mount::umount2(dir, MntFlags::MNT_DETACH | MntFlags::UMOUNT_NOFOLLOW).is_ok() {}
    let _ = std::fs::remove_dir(dir);
}

/// Whether a process of the container whose init is `pid` holds
/// `CAP_SYS_ADMIN` in any set, its bounding set included (what it may
/// gain): such a process may have remounted a mask and written in it.
fn some_process_holds_sys_admin(pid: i32) -> Result<bool> {
    let cgroup = crate::freezer::cgroup_of(pid).context("the init's cgroup")?;
    let pids = crate::freezer::procs_below(cgroup.dir()).context("the sandbox's processes")?;
    for p in pids {
        let Ok(status) = std::fs::read_to_string(format!("/proc/{p}/status")) else {
            continue; // Gone: it holds nothing now, and the cgroup is frozen.
        };
        let held = status.lines().any(|l| {
            ["CapInh:", "CapPrm:", "CapEff:", "CapBnd:", "CapAmb:"]
                .iter()
                .any(|k| {
                    l.strip_prefix(k).is_some_and(|hex| {
                        u64::from_str_radix(hex.trim(), 16).map_or(true, |m| m & CAP_SYS_ADMIN_BIT != 0)
                    })
                })
        });
        if held {
            return Ok(true);
        }
    }
    Ok(false)
}

/// Whether the init of `spec` may remount a mask writable (and so have
/// put something in it): `CAP_SYS_ADMIN` in any set, or no capability
/// list (libcontainer then drops none).
fn may_remount(spec: &Spec) -> bool {
    spec.process()
        .as_ref()
        .is_none_or(|p| crate::netns::may_hold(p, &[Capability::SysAdmin]))
}

#[cfg(test)]
mod tests {
    use oci_spec::runtime::{LinuxCapabilitiesBuilder, ProcessBuilder, SpecBuilder};

    use super::*;

    fn spec(caps: Option<&[Capability]>) -> Spec {
        let mut process = ProcessBuilder::default();
        if let Some(caps) = caps {
            let set: oci_spec::runtime::Capabilities = caps.iter().copied().collect();
            process = process.capabilities(
                LinuxCapabilitiesBuilder::default()
                    .bounding(set.clone())
                    .effective(set.clone())
                    .permitted(set)
                    .build()
                    .unwrap(),
            );
        }
        SpecBuilder::default()
            .process(process.build().unwrap())
            .build()
            .unwrap()
    }

    #[test]
    fn only_a_sandbox_that_cannot_remount_keeps_its_masks_out() {
        assert!(!may_remount(&spec(Some(&[
            Capability::Chown,
            Capability::NetBindService
        ]))));
        assert!(may_remount(&spec(Some(&[
            Capability::Chown,
            Capability::SysAdmin
        ]))));
        // No list: libcontainer drops nothing.
        let mut none = spec(None);
        none.process_mut().as_mut().unwrap().set_capabilities(None);
        assert!(may_remount(&none));
    }

    #[test]
    fn a_record_naming_anything_but_masks_is_refused_before_any_mount() {
        let images = std::env::temp_dir().join(format!("crab-masked-test-{}", std::process::id()));
        std::fs::create_dir_all(&images).unwrap();
        std::fs::write(images.join(RECORD), br#"["crab-masked/sys/firmware", "/etc"]"#).unwrap();
        let mut criu = Criu::new_with_criu_path("/nonexistent".into()).unwrap();
        let work = images.join("work");
        std::fs::create_dir(&work).unwrap();
        let e = restore(&images, &work, &mut criu).err().expect("refused");
        assert!(e.to_string().contains("not a mask"), "{e}");
        assert!(
            !work.join(SOURCE).exists(),
            "nothing was mounted for a refused record"
        );
        std::fs::write(images.join(RECORD), b"not json").unwrap();
        assert!(restore(&images, &work, &mut criu).is_err());
        // A good record: a fresh empty tmpfs, read-only with room for no
        // file, gone with its guard.
        std::fs::write(images.join(RECORD), br#"["crab-masked/sys/firmware"]"#).unwrap();
        let source = restore(&images, &work, &mut criu).unwrap().expect("a source");
        let dir = work.join(SOURCE);
        let vfs = nix::sys::statvfs::statvfs(&dir).unwrap();
        assert!(vfs.flags().contains(nix::sys::statvfs::FsFlags::ST_RDONLY));
        assert_eq!(std::fs::read_dir(&dir).unwrap().count(), 0);
        assert!(std::fs::write(dir.join("x"), b"x").is_err());
        drop(source);
        assert!(!dir.exists(), "the source went with its guard");
        std::fs::remove_dir_all(&images).unwrap();
    }
}
