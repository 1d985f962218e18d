//! Masked directories kept out of CRIU's images.
//!
//! libcontainer masks each directory of the spec's `maskedPaths`
//! (`/proc/acpi`, `/sys/firmware`, …) with an empty read-only tmpfs, and
//! CRIU saves every tmpfs by running `tar | gzip` over it and restores it
//! by running them again: for these empty mounts, some milliseconds of
//! process starts each, inside the sandbox's frozen time and its restore.
//!
//! When nothing in the sandbox can have changed such a mount (the init
//! holds no `CAP_SYS_ADMIN`, so it cannot remount it writable), a dump
//! marks it external and records its key in the images
//! ([`RECORD`]); a restore binds one host-wide empty read-only tmpfs
//! ([`EMPTY`] under the state directory) in its place. A bind mount
//! keeps its source's read-only flag, so the mask is what libcontainer
//! made: empty, read-only, tmpfs. Images without the record restore as
//! before.

use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::path::{Path, PathBuf};

use anyhow::{bail, Context, Result};
use oci_spec::runtime::{Capability, Spec};
use rust_criu::Criu;

/// The file in the images naming the masks kept out of them.
const RECORD: &str = "crab-masked.json";

/// The host-wide empty read-only tmpfs, under the state directory.
const EMPTY: &str = ".masked";

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
    let mounts = procfs::process::Process::new(pid)
        .and_then(|p| p.mountinfo())
        .context("read the init's mounts")?;
    let mut keys = Vec::new();
    for path in masked {
        // The topmost mount there, as the sandbox sees it.
        let Some(m) = mounts.iter().rev().find(|m| m.mount_point == Path::new(&path)) else {
            continue;
        };
        if m.fs_type != "tmpfs" || !m.mount_options.contains_key("ro") {
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

/// At a restore from `images`, binds the empty tmpfs under `state_dir`
/// in place of each mask the dump kept out.
pub fn restore(images: &Path, state_dir: &Path, criu: &mut Criu) -> Result<()> {
    let text = match std::fs::read(images.join(RECORD)) {
        Ok(t) => t,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(()),
        Err(e) => return Err(e).with_context(|| format!("read {RECORD}")),
    };
    // The images may come from an imported archive: keys are only names
    // CRIU matches against the image, and every one gets the same source.
    let keys: Vec<String> = serde_json::from_slice(&text).with_context(|| format!("parse {RECORD}"))?;
    if keys.iter().any(|k| !k.starts_with(KEY_PREFIX) || k.len() > 4096) {
        bail!("{RECORD} names a mount that is not a mask");
    }
    let source = empty_tmpfs(&state_dir.join(EMPTY))?;
    let source = source.to_string_lossy().into_owned();
    for key in keys {
        criu.set_external_mount(key, source.clone());
    }
    Ok(())
}

/// Whether the init of `spec` may remount a mask writable (and so have
/// put something in it): `CAP_SYS_ADMIN` in any set, or no capability
/// list (libcontainer then drops none).
fn may_remount(spec: &Spec) -> bool {
    spec.process()
        .as_ref()
        .is_none_or(|p| crate::netns::may_hold(p, &[Capability::SysAdmin]))
}

/// The empty read-only tmpfs at `dir`, mounted if it is not yet; checked
/// (a root-owned directory, tmpfs, read-only, empty) either way.
fn empty_tmpfs(dir: &Path) -> Result<PathBuf> {
    use nix::mount::MsFlags;
    use nix::sys::statfs::{statfs, TMPFS_MAGIC};
    if let Some(parent) = dir.parent() {
        std::fs::create_dir_all(parent).with_context(|| format!("create {}", parent.display()))?;
    }
    match std::fs::create_dir(dir) {
        Ok(()) => std::fs::set_permissions(dir, std::fs::Permissions::from_mode(0o555))
            .with_context(|| format!("chmod {}", dir.display()))?,
        Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {}
        Err(e) => return Err(e).with_context(|| format!("create {}", dir.display())),
    }
    let meta = std::fs::symlink_metadata(dir).with_context(|| format!("stat {}", dir.display()))?;
    if !meta.is_dir() || meta.uid() != 0 {
        bail!("{} is not a directory of root's", dir.display());
    }
    let is_tmpfs = |d: &Path| statfs(d).is_ok_and(|s| s.filesystem_type() == TMPFS_MAGIC);
    if !is_tmpfs(dir) {
        // Two helpers at once may both mount: two empty tmpfs, stacked.
        nix::mount::mount(
            Some("tmpfs"),
            dir,
            Some("tmpfs"),
            MsFlags::MS_RDONLY | MsFlags::MS_NOSUID | MsFlags::MS_NODEV | MsFlags::MS_NOEXEC,
            Some("size=4k,mode=0555"),
        )
        .with_context(|| format!("mount an empty tmpfs at {}", dir.display()))?;
    }
    let vfs = nix::sys::statvfs::statvfs(dir).with_context(|| format!("statvfs {}", dir.display()))?;
    let empty = std::fs::read_dir(dir)
        .map(|mut d| d.next().is_none())
        .unwrap_or(false);
    if !is_tmpfs(dir) || !vfs.flags().contains(nix::sys::statvfs::FsFlags::ST_RDONLY) || !empty {
        bail!("{} is not an empty read-only tmpfs", dir.display());
    }
    Ok(dir.to_owned())
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
        let state = images.join("state");
        let e = restore(&images, &state, &mut criu).unwrap_err();
        assert!(e.to_string().contains("not a mask"), "{e}");
        assert!(!state.exists(), "nothing was made for a refused record");
        std::fs::write(images.join(RECORD), b"not json").unwrap();
        assert!(restore(&images, &state, &mut criu).is_err());
        std::fs::remove_dir_all(&images).unwrap();
    }
}
