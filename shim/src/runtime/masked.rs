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

use std::os::fd::OwnedFd;
use std::path::{Path, PathBuf};

use anyhow::{bail, Context, Result};
use oci_spec::runtime::{Capability, Spec};
use rust_criu::Criu;

use procfs::process::MountInfos;

use crate::freezer::Cgroup;

/// The file in the images naming the masks kept out of them.
const RECORD: &str = "crab-masked.json";

/// The masks' tmpfs during a restore, in CRIU's work directory.
pub(super) const SOURCE: &str = "masked";

/// `CAP_SYS_ADMIN`'s bit in `/proc/<pid>/status`'s capability masks.
const CAP_SYS_ADMIN_BIT: u64 = 1 << 21;

/// What every key starts with.
const KEY_PREFIX: &str = "crab-masked";

/// Whether nothing in the sandbox of `spec` (its processes in its
/// freezer `cgroup`) can have mounted, unmounted or remounted anything:
/// its spec grants no `CAP_SYS_ADMIN`, and no process holds it in any set,
/// its bounding set included (what it may gain). A sandbox whose
/// processes cannot be read may have.
pub fn mounts_are_fixed(spec: &Spec, cgroup: &Cgroup) -> bool {
    !may_remount(spec) && !some_process_holds_sys_admin(cgroup).unwrap_or(true)
}

/// At a dump of a container of `spec`, whose init sees `mounts` and whose
/// mounts are fixed ([`mounts_are_fixed`]) or not, marks its masked
/// directories external when they may be, and records them in `images`
/// (an earlier record there is replaced).
pub fn record(
    spec: &Spec,
    root: &OwnedFd,
    mounts: &MountInfos,
    fixed: bool,
    images: &Path,
    criu: &mut Criu,
) -> Result<()> {
    let record = images.join(RECORD);
    super::remove_stale(&record)?;
    let masked: Vec<String> = spec
        .linux()
        .as_ref()
        .and_then(|l| l.masked_paths().clone())
        .unwrap_or_default();
    if masked.is_empty() || !fixed {
        return Ok(());
    }
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
            // And empty, whatever was done to it before (by a privileged
            // exec since gone, in another shim of this sandbox).
            || !super::tmpfs::holds_nothing(root, &path, m.mnt_id as u64)
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

/// A tmpfs of the helper's, in CRIU's work directory, while a restore
/// binds it; unmounted (lazily, CRIU's binds keep it) and its directory
/// removed on drop.
pub struct Source(pub(super) PathBuf);

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

/// Mounts a fresh empty read-only tmpfs at `dir`, with room for no file
/// even if remounted writable.
fn mount_empty(dir: &Path) -> Result<Source> {
    use nix::mount::MsFlags;
    let flags = MsFlags::MS_RDONLY | MsFlags::MS_NOSUID | MsFlags::MS_NODEV | MsFlags::MS_NOEXEC;
    mount_fresh(dir, "tmpfs", flags, "size=4k,nr_inodes=1,mode=0555")
}

/// Mounts a fresh tmpfs named `source` at `dir` (in the shim's own work
/// directory; what an earlier, killed helper left there goes first), with
/// mount flags `flags` and options `data`, private: it propagates
/// nowhere. Unmounted and removed if anything fails, or when the answer
/// is dropped.
pub(super) fn mount_fresh(
    dir: &Path,
    source: &str,
    flags: nix::mount::MsFlags,
    data: &str,
) -> Result<Source> {
    use nix::mount::MsFlags;
    unmount(dir);
    std::fs::create_dir(dir).with_context(|| format!("create {}", dir.display()))?;
    // From here on, dropped on any failure.
    let guard = Source(dir.to_owned());
    nix::mount::mount(Some(source), dir, Some("tmpfs"), flags, Some(data))
        .with_context(|| format!("mount a tmpfs ({data}) at {}", dir.display()))?;
    nix::mount::mount(None::<&str>, dir, None::<&str>, MsFlags::MS_PRIVATE, None::<&str>)
        .with_context(|| format!("make {} private", dir.display()))?;
    Ok(guard)
}

/// Unmounts (lazily) whatever is mounted at `dir` and removes it; gone
/// already is fine.
pub(super) fn unmount(dir: &Path) {
    use nix::mount::MntFlags;
    while nix::mount::umount2(dir, MntFlags::MNT_DETACH | MntFlags::UMOUNT_NOFOLLOW).is_ok() {}
    let _ = std::fs::remove_dir(dir);
}

/// Whether a thread of a process in `cgroup` (or below it) holds
/// `CAP_SYS_ADMIN` in any set, its bounding set included (what it may
/// gain): such a thread may have remounted a mask and written in it.
/// Every thread is read: a process's own status is its leader's, and
/// another thread may have kept what the leader dropped.
fn some_process_holds_sys_admin(cgroup: &Cgroup) -> Result<bool> {
    let pids = crate::freezer::procs_below(cgroup.dir()).context("the sandbox's processes")?;
    for p in pids {
        let tasks = match procfs::process::Process::new(p).and_then(|p| p.tasks()) {
            Ok(t) => t,
            // Gone: it holds nothing now, and the cgroup is frozen.
            Err(procfs::ProcError::NotFound(_)) => continue,
            // Unreadable: it may hold anything.
            Err(_) => return Ok(true),
        };
        for task in tasks {
            let status = match task.and_then(|t| t.status()) {
                Ok(s) => s,
                Err(procfs::ProcError::NotFound(_)) => continue,
                Err(_) => return Ok(true),
            };
            let sets = [
                Some(status.capinh),
                Some(status.capprm),
                Some(status.capeff),
                status.capbnd,
                status.capamb,
            ];
            if sets.into_iter().flatten().any(|set| set & CAP_SYS_ADMIN_BIT != 0) {
                return Ok(true);
            }
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

    /// A process with `CAP_SYS_ADMIN` in its cgroup keeps the masks in;
    /// one whose bounding set lacks it (so no set has it) does not. Needs
    /// root and the v1 freezer (ENVIRONMENT.md); `setpriv` is util-linux's.
    #[test]
    fn a_process_that_may_remount_keeps_the_masks_in_the_images() {
        for (name, argv) in [
            ("admin", vec!["sleep", "100"]),
            (
                "plain",
                vec!["setpriv", "--bounding-set", "-sys_admin", "sleep", "100"],
            ),
        ] {
            let dir = Path::new("/sys/fs/cgroup/freezer")
                .join(format!("crab-masked-{name}-{}", std::process::id()));
            std::fs::create_dir(&dir).expect("make a cgroup (needs root)");
            let mut child = std::process::Command::new(argv[0])
                .args(&argv[1..])
                .spawn()
                .unwrap();
            std::fs::write(dir.join("cgroup.procs"), child.id().to_string()).unwrap();
            // setpriv execs sleep: look once it has.
            let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
            while std::fs::read_to_string(format!("/proc/{}/comm", child.id())).unwrap_or_default()
                != "sleep\n"
            {
                assert!(std::time::Instant::now() < deadline, "{name}: never became sleep");
                std::thread::sleep(std::time::Duration::from_millis(10));
            }
            let held = some_process_holds_sys_admin(&Cgroup::V1(dir.clone()));
            let _ = child.kill();
            let _ = child.wait();
            std::fs::remove_dir(&dir).unwrap();
            assert_eq!(held.unwrap(), name == "admin", "{name}");
        }
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
