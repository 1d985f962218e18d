//! `crabctl export --format checkpointctl`: a version in the container
//! checkpoint archive layout of Kubernetes' forensic checkpointing (what
//! containerd's and CRI-O's `CheckpointContainer` and Podman write, and
//! `checkpointctl show`, `inspect` and `memparse` read):
//!
//! ```text
//! config.dump       id, name, image, runtime, creation time
//! spec.dump         the container's OCI runtime spec (a pod's container
//!                   keeps CRI's annotations: its pod and namespace show)
//! checkpoint/…      the version's CRIU images
//! ```
//!
//! It is made from crabd's own export of the version, on this side; it is
//! for inspection by those tools, not for `crabctl import` (no signature,
//! and no file snapshot: that is in Crab's own format).

use std::fs::File;
use std::io::{self, Read};
use std::os::unix::fs::OpenOptionsExt;
use std::path::Path;

use crab_api::{Crabd, Progress, SandboxSelector, VersionSel};
use serde_json::Value;

use crate::transfer::{self, TransferError};

/// The runtime name `config.dump` gives (what `checkpointctl show` lists).
const RUNTIME: &str = "containerd-shim-crab-v2";

/// Writes version `version` of `sandbox` to the new file `file` in the
/// checkpoint archive layout (telling `progress` of the export); answers
/// its size.
pub async fn export(
    crabd: &Crabd,
    sandbox: &SandboxSelector,
    version: VersionSel,
    file: &Path,
    progress: Progress<'_>,
) -> Result<u64, TransferError> {
    let (_dir, archive) = transfer::exported(crabd, sandbox, version, progress).await?;
    let file = file.to_owned();
    tokio::task::spawn_blocking(move || {
        let out = std::fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .mode(0o600)
            .open(&file)?;
        let written = convert(&archive, out);
        if written.is_err() {
            // No half archive left behind (this one's own: it made it).
            let _ = std::fs::remove_file(&file);
        }
        written
    })
    .await
    .expect("the conversion does not panic")
    .map_err(|source| TransferError::Local {
        what: "write the checkpoint archive",
        source,
    })
}

/// Rewrites Crab's export `archive` in the checkpoint layout into `out`.
fn convert(archive: &Path, out: File) -> io::Result<u64> {
    let mut tar = tar::Builder::new(out);
    // The tools look for the directory itself.
    let mut dir = tar::Header::new_gnu();
    dir.set_entry_type(tar::EntryType::Directory);
    dir.set_mode(0o700);
    dir.set_size(0);
    tar.append_data(&mut dir, "checkpoint/", io::empty())?;
    let mut manifest = None;
    let mut crab = tar::Archive::new(File::open(archive)?);
    for entry in crab.entries()? {
        let mut entry = entry?;
        let name = entry.path()?.to_string_lossy().into_owned();
        if let Some(image) = name.strip_prefix("images/") {
            let mut header = tar::Header::new_gnu();
            header.set_size(entry.size());
            header.set_mode(0o600);
            tar.append_data(&mut header, format!("checkpoint/{image}"), &mut entry)?;
        } else if name == "crab-export.json" {
            let mut bytes = Vec::new();
            entry.read_to_end(&mut bytes)?;
            manifest = Some(serde_json::from_slice::<Value>(&bytes).map_err(io::Error::other)?);
        }
    }
    let manifest = manifest.ok_or_else(|| io::Error::other("the export has no manifest"))?;
    let (config, spec) = dumps(&manifest)?;
    for (name, json) in [("config.dump", config), ("spec.dump", spec)] {
        let bytes = serde_json::to_vec_pretty(&json).expect("JSON serializes");
        let mut header = tar::Header::new_gnu();
        header.set_size(bytes.len() as u64);
        header.set_mode(0o600);
        tar.append_data(&mut header, name, bytes.as_slice())?;
    }
    let out = tar.into_inner()?;
    out.sync_all()?;
    Ok(out.metadata()?.len())
}

/// `config.dump` and `spec.dump` from Crab's export manifest.
fn dumps(manifest: &Value) -> io::Result<(Value, Value)> {
    let missing = |what| io::Error::other(format!("the export's manifest has no {what}"));
    let container = manifest.get("container").ok_or_else(|| missing("container"))?;
    let version = manifest.get("version").ok_or_else(|| missing("version"))?;
    let spec = container.get("spec").cloned().ok_or_else(|| missing("spec"))?;
    let sandbox = version["sandbox"].as_str().ok_or_else(|| missing("sandbox"))?;
    // A pod's container is named as Kubernetes names it.
    let name = spec["annotations"]["io.kubernetes.cri.container-name"]
        .as_str()
        .unwrap_or(sandbox);
    let created = rfc3339(
        version["created_unix_ms"]
            .as_u64()
            .ok_or_else(|| missing("time"))?,
    );
    let config = serde_json::json!({
        "id": sandbox,
        "name": name,
        "rootfsImageName": container["image"],
        "runtime": RUNTIME,
        "createdTime": created,
        "checkpointedTime": created,
    });
    Ok((config, spec))
}

/// `unix_ms` as an RFC 3339 UTC time (`2026-12-03T12:20:45.123Z`).
fn rfc3339(unix_ms: u64) -> String {
    let (secs, ms) = (unix_ms / 1000, unix_ms % 1000);
    let (days, rem) = ((secs / 86_400) as i64, secs % 86_400);
    // Days to a civil date (Howard Hinnant's algorithm).
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + i64::from(month <= 2);
    format!(
        "{year:04}-{month:02}-{day:02}T{:02}:{:02}:{:02}.{ms:03}Z",
        rem / 3600,
        rem % 3600 / 60,
        rem % 60
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn times_are_rfc3339_utc() {
        assert_eq!(rfc3339(0), "1970-01-01T00:00:00.000Z");
        assert_eq!(rfc3339(951_782_400_000), "2000-02-29T00:00:00.000Z");
        assert_eq!(rfc3339(1_796_300_445_123), "2026-12-03T12:20:45.123Z");
    }

    #[test]
    fn the_dumps_name_the_container_as_its_engine_would() {
        let manifest = serde_json::json!({
            "version": {"sandbox": "abc", "created_unix_ms": 0},
            "container": {"image": "docker.io/x:1", "spec": {"annotations": {
                "io.kubernetes.cri.container-name": "agent"}}},
        });
        let (config, spec) = dumps(&manifest).unwrap();
        assert_eq!(config["id"], "abc");
        assert_eq!(config["name"], "agent");
        assert_eq!(config["rootfsImageName"], "docker.io/x:1");
        assert_eq!(spec["annotations"]["io.kubernetes.cri.container-name"], "agent");
        let plain = serde_json::json!({
            "version": {"sandbox": "abc", "created_unix_ms": 0},
            "container": {"image": "i", "spec": {}},
        });
        assert_eq!(dumps(&plain).unwrap().0["name"], "abc");
        assert!(dumps(&serde_json::json!({"version": {}})).is_err());
    }
}
