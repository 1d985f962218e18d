//! Retention: dropping old versions, compacting the manifest, and naming
//! the filesystem snapshots no remaining version uses.

use std::collections::BTreeSet;
use std::fs;

use super::head::Head;
use super::manifest::{self, Entry, Line, Manifest};
use super::record::{FsSnapshot, Header};
use super::{durable, recover, Inner, SandboxId, SandboxState, StoreError, VersionStore};

/// What a retention call removed.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Removal {
    /// The versions removed, oldest first.
    pub versions: Vec<u64>,
    /// How many corrupt or foreign manifest lines were dropped with them.
    pub n_bad_lines: usize,
    /// Filesystem snapshots that removed versions used and no remaining
    /// (or pending) version uses: the caller destroys them in their backend.
    pub unused_snapshots: Vec<FsSnapshot>,
    /// Images directories removed (by the version that held them).
    pub removed_images: Vec<u64>,
}

// === impl VersionStore ===

impl VersionStore {
    /// Keeps the newest `keep_newest` manifest lines of `sandbox` (corrupt
    /// ones count), the head, and every version a kept or pending version
    /// takes its process image from; removes the rest.
    pub fn retain(&self, sandbox: &SandboxId, keep_newest: usize) -> Result<Removal, StoreError> {
        let state = self.inner.sandbox(sandbox)?;
        let mut state = state.lock();
        let m = self.inner.read_manifest(sandbox)?;
        let first_kept = m.lines.len().saturating_sub(keep_newest);
        let head = state.head.version();
        let mut keep: Vec<bool> = m
            .lines
            .iter()
            .enumerate()
            .map(|(idx, l)| idx >= first_kept || head.is_some_and(|h| is_version(l, h)))
            .collect();
        let mut holders: BTreeSet<u64> = state.pending.iter().filter_map(|p| p.process_image).collect();
        for (line, kept) in m.lines.iter().zip(&keep) {
            if let (Entry::Version(r), true) = (&line.entry, kept) {
                holders.extend(r.process_image);
            }
        }
        for (line, kept) in m.lines.iter().zip(keep.iter_mut()) {
            if let Entry::Version(r) = &line.entry {
                *kept |= holders.contains(&r.version);
            }
        }
        compact(&self.inner, &mut state, &m, &keep)
    }

    /// Removes version `version` of `sandbox`. Removing the head leaves the
    /// sandbox without one: its next version captures everything.
    ///
    /// # Errors
    /// [`StoreError::VersionInUse`] when another (or the pending) version
    /// takes its process image from it; [`StoreError::UnknownVersion`]
    /// when no intact line holds it.
    pub fn remove_version(&self, sandbox: &SandboxId, version: u64) -> Result<Removal, StoreError> {
        let state = self.inner.sandbox(sandbox)?;
        let mut state = state.lock();
        let m = self.inner.read_manifest(sandbox)?;
        let Some(idx) = m.lines.iter().position(|l| is_version(l, version)) else {
            return Err(StoreError::UnknownVersion {
                sandbox: sandbox.clone(),
                version,
            });
        };
        let pending_user = state
            .pending
            .as_ref()
            .filter(|p| p.process_image == Some(version))
            .map(|p| p.version);
        let user = m
            .records()
            .find(|r| r.version != version && r.process_image == Some(version))
            .map(|r| r.version)
            .or(pending_user);
        if let Some(user) = user {
            return Err(StoreError::VersionInUse {
                sandbox: sandbox.clone(),
                version,
                user,
            });
        }
        let keep: Vec<bool> = (0..m.lines.len()).map(|i| i != idx).collect();
        compact(&self.inner, &mut state, &m, &keep)
    }
}

// === impl VersionStore ===

impl VersionStore {
    /// Removes `sandbox` with every version it has (its container is gone)
    /// and names the file snapshots they used, for the caller to destroy.
    ///
    /// # Errors
    /// [`StoreError::PendingExists`] while a version is being written.
    pub fn forget(&self, sandbox: &SandboxId) -> Result<Removal, StoreError> {
        let mut sandboxes = self.inner.sandboxes.lock();
        let state = sandboxes
            .get(sandbox)
            .cloned()
            .ok_or_else(|| StoreError::UnknownSandbox {
                sandbox: sandbox.clone(),
            })?;
        let state = state.lock();
        if let Some(p) = &state.pending {
            return Err(StoreError::PendingExists {
                sandbox: sandbox.clone(),
                version: p.version,
            });
        }
        let m = self.inner.read_manifest(sandbox)?;
        let mut removal = Removal::default();
        for line in &m.lines {
            match &line.entry {
                Entry::Version(r) => {
                    removal.versions.push(r.version);
                    removal
                        .removed_images
                        .extend(r.holds_images().then_some(r.version));
                    if let Some(s) = &r.fs_snapshot {
                        if !removal.unused_snapshots.contains(s) {
                            removal.unused_snapshots.push(s.clone());
                        }
                    }
                }
                Entry::Bad(_) => removal.n_bad_lines += 1,
            }
        }
        // Invariant: the manifest goes first, durably, so a crash leaves
        // only directories that no manifest names, which the next open
        // removes. The directories go to the trash (renames, quick); their
        // contents are deleted by `empty_trash`, with no lock held.
        let manifest = self.inner.manifest_path(sandbox);
        fs::remove_file(&manifest).map_err(StoreError::io("remove", &manifest))?;
        durable::sync_parent(&manifest)?;
        sandboxes.remove(sandbox);
        for dir in [self.inner.sandbox_dir(sandbox), self.inner.images_root(sandbox)] {
            self.inner.to_trash(&dir)?;
        }
        tracing::info!(sandbox = %sandbox, versions = removal.versions.len(), "sandbox forgotten");
        Ok(removal)
    }
}

fn is_version(line: &Line, version: u64) -> bool {
    matches!(&line.entry, Entry::Version(r) if r.version == version)
}

/// Rewrites the manifest with the lines marked in `keep`, then removes the
/// images directories no kept line names.
fn compact(
    inner: &Inner,
    state: &mut SandboxState,
    m: &Manifest,
    keep: &[bool],
) -> Result<Removal, StoreError> {
    let mut removal = Removal::default();
    let mut used: Vec<&FsSnapshot> = state
        .pending
        .iter()
        .filter_map(|p| p.fs_snapshot.as_ref())
        .collect();
    let mut dropped: Vec<&FsSnapshot> = Vec::new();
    for (line, &kept) in m.lines.iter().zip(keep) {
        match (&line.entry, kept) {
            (Entry::Version(r), true) => used.extend(&r.fs_snapshot),
            (Entry::Version(r), false) => {
                removal.versions.push(r.version);
                dropped.extend(&r.fs_snapshot);
            }
            (Entry::Bad(_), true) => {}
            (Entry::Bad(_), false) => removal.n_bad_lines += 1,
        }
    }
    if removal.versions.is_empty() && removal.n_bad_lines == 0 {
        return Ok(removal);
    }
    for snapshot in dropped {
        if !used.contains(&snapshot) && !removal.unused_snapshots.contains(snapshot) {
            removal.unused_snapshots.push(snapshot.clone());
        }
    }
    if let Some(h) = state.head.version().filter(|h| removal.versions.contains(h)) {
        // The running state descends from a version that goes: the next
        // version captures everything. Written before the manifest loses
        // it, so a crash in between never makes its parent the head.
        tracing::info!(sandbox = %state.id, head = h, "head removed: the next version is whole");
        Head::None.store(inner, &state.id, state.next_version)?;
        state.head = Head::None;
    }
    let header = Header {
        sandbox: state.id.clone(),
        next_version: state.next_version,
    };
    let path = inner.manifest_path(&state.id);
    manifest::rewrite(
        &path,
        &header,
        m.lines.iter().zip(keep).filter(|(_, &k)| k).map(|(l, _)| l),
    )?;
    // Invariant: images directories are removed only after the compacted
    // manifest, which no longer names them, is durable.
    let compacted = inner.read_manifest(&state.id)?;
    let swept = recover::sweep(
        inner,
        &state.id,
        &compacted,
        state.pending.as_ref().map(|p| p.version),
    )?;
    removal.removed_images = swept.images;

    tracing::info!(
        sandbox = %state.id,
        versions = ?removal.versions,
        n_bad_lines = removal.n_bad_lines,
        n_unused_snapshots = removal.unused_snapshots.len(),
        "versions removed"
    );
    Ok(removal)
}
