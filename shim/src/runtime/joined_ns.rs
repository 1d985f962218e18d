//! Namespaces a container's spec joins by path: a pod's network, IPC and
//! UTS namespaces, through its pause container's `/proc/<pid>/ns/…`;
//! `docker run --ipc container:…`. A restore joins them again: the network
//! namespace as CRIU's external one (`criu::external_netns`), IPC and UTS
//! through CRIU's `join-ns` ([`config`]), where CRIU would make new ones.
//!
//! A `/proc/<pid>` path names whatever process has that pid now. The dump
//! records the namespace the container's init is in for each such path,
//! with the boot ([`record`]); a restore refuses a path that now leads to
//! another namespace, or any after a reboot ([`check`]): the pause
//! container's pid may then be a host daemon's. [`preflight`] runs both
//! checks of a restore in the shim, before it kills anything.

use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};

use anyhow::{bail, Context, Result};
use oci_spec::runtime::{LinuxNamespace, LinuxNamespaceType, Spec};
use serde::{Deserialize, Serialize};

/// The record, in the image directory.
const RECORD: &str = "crab-joined-ns.json";

/// One namespace joined through a process's path, as the dump found it.
#[derive(Debug, Serialize, Deserialize, PartialEq, Eq)]
struct Joined {
    /// `net`, `ipc`, `uts`, ….
    kind: String,
    /// The spec's path.
    path: PathBuf,
    /// The namespace's device and inode, as the container's init had it.
    dev: u64,
    ino: u64,
    /// The boot it was in (`/proc/sys/kernel/random/boot_id`).
    boot: String,
}

fn boot_id() -> Result<String> {
    Ok(std::fs::read_to_string("/proc/sys/kernel/random/boot_id")
        .context("read the boot id")?
        .trim()
        .to_owned())
}

/// CRIU's name of a namespace type.
fn kind(typ: LinuxNamespaceType) -> &'static str {
    match typ {
        LinuxNamespaceType::Network => "net",
        LinuxNamespaceType::Ipc => "ipc",
        LinuxNamespaceType::Uts => "uts",
        LinuxNamespaceType::Pid => "pid",
        LinuxNamespaceType::Mount => "mnt",
        LinuxNamespaceType::User => "user",
        LinuxNamespaceType::Cgroup => "cgroup",
        LinuxNamespaceType::Time => "time",
    }
}

/// The namespace of kind `typ` that `spec` names, if it names one: a new
/// one, or (with a path) one it joins.
pub fn named(spec: &Spec, typ: LinuxNamespaceType) -> Option<&LinuxNamespace> {
    spec.linux()
        .as_ref()?
        .namespaces()
        .as_ref()?
        .iter()
        .find(|n| n.typ() == typ)
}

/// The namespaces `spec` joins by path, as (kind, path).
fn joined(spec: &Spec) -> Vec<(&'static str, PathBuf)> {
    spec.linux()
        .as_ref()
        .and_then(|l| l.namespaces().clone())
        .unwrap_or_default()
        .into_iter()
        .filter_map(|ns| {
            let path = ns.path().clone().filter(|p| !p.as_os_str().is_empty())?;
            Some((kind(ns.typ()), path))
        })
        .collect()
}

/// Whether `path` names a namespace through a process (`/proc/<pid>/…`).
fn through_a_process(path: &Path) -> bool {
    path.starts_with("/proc") && !path.starts_with("/proc/self")
}

/// CRIU configuration lines (`join-ns`) for a restore of the spec in
/// `bundle`: its IPC and UTS namespaces joined by path. A path that would
/// break a configuration line is refused, not left out (the container
/// would quietly leave its pod).
pub fn config(bundle: &Path) -> Result<String, String> {
    let spec = Spec::load(bundle.join("config.json")).map_err(|e| format!("read config.json: {e}"))?;
    let mut lines = String::new();
    for (kind, path) in joined(&spec) {
        if !matches!(kind, "ipc" | "uts") {
            continue;
        }
        let text = path
            .to_str()
            .filter(|p| !p.chars().any(|c| c.is_whitespace() || c.is_control() || c == '"'));
        let Some(text) = text else {
            return Err(format!(
                "its {kind} namespace path {path:?} cannot be handed to CRIU"
            ));
        };
        lines.push_str(&format!("join-ns {kind}:{text}\n"));
    }
    Ok(lines)
}

/// Records in `images` the namespaces `spec` joins through a process's
/// path, as the container's init (`pid`) is in them (or removes a stale
/// record). A path that no longer leads to the init's namespace (its
/// holder is gone, the pid reused) is refused: a restore could not go back.
pub fn record(spec: &Spec, pid: i32, images: &Path) -> Result<()> {
    let mut found = Vec::new();
    for (kind, path) in joined(spec) {
        if !through_a_process(&path) {
            continue;
        }
        let own = std::fs::metadata(format!("/proc/{pid}/ns/{kind}"))
            .with_context(|| format!("stat the init's {kind} namespace"))?;
        let there = std::fs::metadata(&path).ok();
        if there.as_ref().map(|m| (m.dev(), m.ino())) != Some((own.dev(), own.ino())) {
            bail!(
                "its {kind} namespace is no longer the one {} leads to (the process that held \
                 it is gone): a restore could not join it again",
                path.display()
            );
        }
        found.push(Joined {
            kind: kind.to_owned(),
            path,
            dev: own.dev(),
            ino: own.ino(),
            boot: boot_id()?,
        });
    }
    let file = images.join(RECORD);
    if found.is_empty() {
        return match std::fs::remove_file(&file) {
            Err(e) if e.kind() != std::io::ErrorKind::NotFound => {
                Err(e).with_context(|| format!("remove a stale {RECORD}"))
            }
            _ => Ok(()),
        };
    }
    let bytes = serde_json::to_vec(&found).expect("the record serializes");
    std::fs::write(&file, bytes).with_context(|| format!("write {}", file.display()))
}

/// Refuses a restore of `images` into `spec` when a namespace the dump
/// joined through a process's path is no longer the one that path leads to
/// (another namespace there, or another boot).
pub fn check(spec: &Spec, images: &Path) -> Result<()> {
    let bytes = match std::fs::read(images.join(RECORD)) {
        Ok(b) => b,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(()),
        Err(e) => return Err(e).context(format!("read {RECORD}")),
    };
    let recorded: Vec<Joined> = serde_json::from_slice(&bytes).with_context(|| format!("parse {RECORD}"))?;
    let now = joined(spec);
    let boot = boot_id()?;
    for r in recorded {
        if !now.iter().any(|(kind, path)| *kind == r.kind && *path == r.path) {
            continue;
        }
        let there = std::fs::metadata(&r.path).map(|m| (m.dev(), m.ino())).ok();
        if r.boot != boot || there != Some((r.dev, r.ino)) {
            bail!(
                "the {} namespace it joins through {} is not the one it was checkpointed in \
                 (the process that held it is gone: after a reboot, or its pod's pause container \
                 ended): refused, the restore would join whatever process has that pid now",
                r.kind,
                r.path.display()
            );
        }
    }
    Ok(())
}

/// Everything [`config`] and [`check`] would refuse in a restore of
/// `images` into the container of `bundle`, found before the restore
/// kills the processes it replaces.
pub fn preflight(bundle: &Path, images: &Path) -> Result<(), String> {
    config(bundle)?;
    let spec = Spec::load(bundle.join("config.json")).map_err(|e| format!("read config.json: {e}"))?;
    check(&spec, images).map_err(|e| format!("{e:#}"))
}

#[cfg(test)]
mod tests {
    use super::*;
    use oci_spec::runtime::{LinuxBuilder, LinuxNamespaceBuilder, SpecBuilder};

    fn clone(j: &Joined) -> Joined {
        Joined {
            kind: j.kind.clone(),
            path: j.path.clone(),
            dev: j.dev,
            ino: j.ino,
            boot: j.boot.clone(),
        }
    }

    fn spec_joining(kind: LinuxNamespaceType, path: &str) -> Spec {
        let ns = LinuxNamespaceBuilder::default()
            .typ(kind)
            .path(path)
            .build()
            .unwrap();
        SpecBuilder::default()
            .linux(LinuxBuilder::default().namespaces(vec![ns]).build().unwrap())
            .build()
            .unwrap()
    }

    #[test]
    fn a_restore_refuses_a_process_path_that_leads_to_another_namespace() {
        let images = tempfile::tempdir().unwrap();
        // Our own namespace through our own pid: the same at the restore.
        let me = std::process::id() as i32;
        let ours = format!("/proc/{me}/ns/ipc");
        let spec = spec_joining(LinuxNamespaceType::Ipc, &ours);
        record(&spec, me, images.path()).unwrap();
        check(&spec, images.path()).unwrap();
        // The record says another namespace, or another boot.
        let recorded: Vec<Joined> =
            serde_json::from_slice(&std::fs::read(images.path().join(RECORD)).unwrap()).unwrap();
        for stale in [
            Joined {
                ino: 1,
                ..clone(&recorded[0])
            },
            Joined {
                boot: "another boot".into(),
                ..clone(&recorded[0])
            },
        ] {
            std::fs::write(
                images.path().join(RECORD),
                serde_json::to_vec(&vec![stale]).unwrap(),
            )
            .unwrap();
            let e = check(&spec, images.path()).unwrap_err().to_string();
            assert!(e.contains("not the one it was checkpointed in"), "{e}");
        }
        // A dump whose init is not in the namespace the path leads to: a
        // process in an IPC namespace of its own (root: CI runs it so).
        let mut other = std::process::Command::new("unshare")
            .args(["--ipc", "sleep", "30"])
            .spawn()
            .expect("run unshare (util-linux)");
        let theirs = format!("/proc/{}/ns/ipc", other.id());
        let moved = (0..1000).any(|_| {
            std::thread::sleep(std::time::Duration::from_millis(10));
            std::fs::metadata(&theirs).map(|m| m.ino()).ok() != std::fs::metadata(&ours).map(|m| m.ino()).ok()
        });
        let elsewhere = spec_joining(LinuxNamespaceType::Ipc, &theirs);
        let refused = record(&elsewhere, me, images.path());
        let _ = other.kill();
        let _ = other.wait();
        assert!(moved, "unshare made no IPC namespace");
        let e = refused.unwrap_err().to_string();
        assert!(e.contains("no longer the one"), "{e}");
        // A path that is not a process's is not recorded.
        let named = spec_joining(LinuxNamespaceType::Network, "/var/run/netns/x");
        record(&named, me, images.path()).unwrap();
        assert!(!images.path().join(RECORD).exists());
        check(&named, images.path()).unwrap();
    }

    #[test]
    fn join_ns_lines_name_ipc_and_uts_and_refuse_what_would_break_a_line() {
        let bundle = tempfile::tempdir().unwrap();
        let write = |spec: &Spec| spec.save(bundle.path().join("config.json")).unwrap();
        write(&spec_joining(LinuxNamespaceType::Uts, "/proc/7/ns/uts"));
        assert_eq!(config(bundle.path()).unwrap(), "join-ns uts:/proc/7/ns/uts\n");
        write(&spec_joining(LinuxNamespaceType::Network, "/proc/7/ns/net"));
        assert_eq!(config(bundle.path()).unwrap(), "");
        write(&spec_joining(
            LinuxNamespaceType::Ipc,
            "/proc/7/ns/ipc\nlog-file /x",
        ));
        assert!(config(bundle.path()).is_err());
    }
}
