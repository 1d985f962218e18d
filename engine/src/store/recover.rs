//! Loading a sandbox: repairing what a crash left in its manifest and images
//! directory, and finding the next version number.

use std::fs;

use super::head::Head;
use super::manifest::{self, Manifest};
use super::{durable, Inner, SandboxId, SandboxState, StoreError};

/// What loading a sandbox found and repaired.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Recovery {
    /// A torn last manifest line, cut off.
    pub torn_line: Option<TornLine>,
    /// Images directories of versions that were never published, removed.
    pub removed_tmp_dirs: Vec<String>,
    /// Images directories that no manifest line can name (a crash between
    /// renaming them in and appending their line, or during retention),
    /// removed.
    pub removed_images: Vec<u64>,
    /// Whether a half-written manifest compaction was removed.
    pub removed_compaction: bool,
}

/// A torn manifest line.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TornLine {
    /// The line number it would have had, from 1.
    pub line: u64,
    /// How many bytes of it were written.
    pub bytes: u64,
}

/// Loads `sandbox`, repairing it.
pub(crate) fn load(inner: &Inner, sandbox: SandboxId) -> Result<SandboxState, StoreError> {
    let mut recovery = Recovery::default();
    let path = inner.manifest_path(&sandbox);
    let tmp = durable::tmp_path(&path);
    if tmp.exists() {
        fs::remove_file(&tmp).map_err(StoreError::io("remove", &tmp))?;
        durable::sync_parent(&tmp)?;
        recovery.removed_compaction = true;
    }
    let mut m = Manifest::read(&path, &sandbox)?;
    if let Some(torn) = m.torn.take() {
        tracing::warn!(sandbox = %sandbox, line = torn.number, bytes = torn.bytes, "cutting a torn manifest line off");
        manifest::cut_torn(&path, torn)?;
        recovery.torn_line = Some(TornLine {
            line: torn.number,
            bytes: torn.bytes,
        });
    }
    let swept = sweep(inner, &sandbox, &m, None)?;
    recovery.removed_tmp_dirs = swept.tmp_dirs;
    recovery.removed_images = swept.images;
    let next_version = m.next_version().max(swept.highest_kept + 1);
    Ok(SandboxState {
        head: Head::load(inner, &sandbox, &m)?,
        id: sandbox,
        next_version,
        pending: None,
        recovery,
    })
}

/// What [`sweep`] removed and kept.
pub(crate) struct Swept {
    /// `.tmp-*` directories removed.
    pub tmp_dirs: Vec<String>,
    /// Numbered images directories removed.
    pub images: Vec<u64>,
    /// The highest numbered images directory kept, or 0.
    pub highest_kept: u64,
}

/// Removes the images directories of `sandbox` that `m` cannot name:
/// `.tmp-*` ones but the one of the `pending` version, and numbered ones
/// that no line claims.
///
/// Invariant: called with the manifest that is durable on disk, under the
/// sandbox's lock.
pub(crate) fn sweep(
    inner: &Inner,
    sandbox: &SandboxId,
    m: &Manifest,
    pending: Option<u64>,
) -> Result<Swept, StoreError> {
    let pending_tmp = pending.map(|v| format!(".tmp-{v}"));
    let root = inner.images_root(sandbox);
    let mut swept = Swept {
        tmp_dirs: Vec::new(),
        images: Vec::new(),
        highest_kept: 0,
    };
    let entries = match fs::read_dir(&root) {
        Ok(entries) => entries,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            durable::create_dir(&root)?;
            return Ok(swept);
        }
        Err(e) => {
            return Err(StoreError::Io {
                op: "read directory",
                path: root,
                source: e,
            })
        }
    };
    // Read whole first: moving a directory aside adds a name.
    let entries: Vec<fs::DirEntry> = entries
        .collect::<Result<_, _>>()
        .map_err(StoreError::io("read directory", &root))?;
    for entry in entries {
        let name = entry.file_name().to_string_lossy().into_owned();
        if pending_tmp
            .as_deref()
            .is_some_and(|p| name == p || name.starts_with(&format!("{p}-")))
        {
            continue;
        } else if let Some(rest) = name.strip_prefix(".tmp-") {
            // `.tmp-<version>-<attempt>`: reported by its version.
            if durable::clear_tmp(&entry.path())? {
                let version = rest.split('-').next().unwrap_or_default();
                swept.tmp_dirs.push(format!(".tmp-{version}"));
            }
        } else if durable::sweep_stale(&entry.path()) {
            // Moved aside by an earlier open: removed, or kept for the next.
        } else if let Ok(n) = name.parse::<u64>() {
            if m.claims_images(n) {
                swept.highest_kept = swept.highest_kept.max(n);
            } else {
                fs::remove_dir_all(entry.path()).map_err(StoreError::io("remove directory", entry.path()))?;
                swept.images.push(n);
            }
        } else {
            tracing::warn!(sandbox = %sandbox, entry = %name, "unexpected entry in the images directory, left alone");
        }
    }
    if !swept.tmp_dirs.is_empty() || !swept.images.is_empty() {
        tracing::warn!(sandbox = %sandbox, tmp_dirs = ?swept.tmp_dirs, images = ?swept.images, "removed images no version names");
        durable::sync_dir(&root)?;
    }
    swept.tmp_dirs.sort();
    swept.images.sort_unstable();
    Ok(swept)
}
