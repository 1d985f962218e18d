//! The file snapshots crabd keeps: per sandbox, the overlay-copy store
//! `<root>/fs/<id>/` (the shim writes into it at crabd's request; every
//! copy, clone, export, import and deletion of it is here), with a store
//! per other container of its pod in `.pod-members/<name>/` whose copies
//! go with the sandbox's own of the same name, and, through
//! the shim or directly once the shim is gone, the snapshots a sandbox
//! keeps on its own filesystem (ZFS, btrfs).
//!
//! Invariant: nothing else in crabd opens, copies or deletes a path under
//! `<root>/fs`; a sandbox's store is named only by its [`SandboxId`], one
//! safe path component.

use std::path::{Path, PathBuf};

use crab_api::crabd::Registration;
use crab_api::shim::{ShimForget, ShimForgotten, POD_MEMBER_STORES};
use crab_api::{routes, BackendKind, FsSnapshot, Location, SandboxId, SnapshotName};
use crab_snapshotter::{Backend, OverlayCopyBackend};

use super::{ApiError, Daemon};
use crate::Removal;

/// The overlay-copy stores of every sandbox, under one directory.
#[derive(Debug, Clone)]
pub(super) struct Files {
    root: PathBuf,
}

// === impl Files ===

impl Files {
    /// The stores under `root` (`<crabd root>/fs`).
    pub(super) fn new(root: PathBuf) -> Self {
        Files { root }
    }

    /// Where sandbox `id`'s copies are kept.
    pub(super) fn store_dir(&self, id: &SandboxId) -> PathBuf {
        self.root.join(id.as_str())
    }

    fn copies(&self, id: &SandboxId) -> OverlayCopyBackend {
        let dir = self.store_dir(id);
        OverlayCopyBackend::new(&dir, &dir)
    }

    fn fs_error(id: &SandboxId) -> impl FnOnce(crab_snapshotter::Error) -> ApiError + '_ {
        move |source| ApiError::Fs {
            id: id.clone(),
            source,
        }
    }

    /// Makes `upper` (absent) a copy of snapshot `name` of sandbox
    /// `from`, the first snapshot of sandbox `to`'s store. Blocks.
    pub(super) fn clone_into(
        &self,
        from: &SandboxId,
        name: &SnapshotName,
        to: &SandboxId,
        upper: &Path,
    ) -> Result<(), ApiError> {
        let target = Location::OverlayCopy {
            upper: upper.to_owned(),
            store: self.store_dir(to),
        };
        self.copies(from)
            .clone_to(name, &target)
            .map(drop)
            .map_err(Self::fs_error(to))
    }

    /// Writes snapshot `name` of sandbox `id` as a stream. Blocks.
    pub(super) fn export(
        &self,
        id: &SandboxId,
        name: &SnapshotName,
        out: &mut dyn std::io::Write,
    ) -> Result<(), ApiError> {
        self.copies(id)
            .export(name, None, out)
            .map_err(Self::fs_error(id))
    }

    /// Reads a stream [`Files::export`] wrote as snapshot `name` of sandbox
    /// `id`. Blocks.
    pub(super) fn import(
        &self,
        id: &SandboxId,
        name: &SnapshotName,
        input: &mut dyn std::io::Read,
        policy: crab_snapshotter::StreamPolicy,
    ) -> Result<(), ApiError> {
        self.copies(id)
            .import_with(name, None, input, policy)
            .map_err(Self::fs_error(id))
    }

    /// The stores of the other containers of sandbox `id`'s pod, beside
    /// its own (`crab_api::shim::POD_MEMBER_STORES`): their copies are named
    /// as the sandbox's version's own.
    fn member_copies(&self, id: &SandboxId) -> Vec<OverlayCopyBackend> {
        let dir = self.store_dir(id).join(POD_MEMBER_STORES);
        let Ok(entries) = std::fs::read_dir(&dir) else {
            return Vec::new();
        };
        entries
            .flatten()
            .filter(|e| e.file_type().is_ok_and(|t| t.is_dir()))
            .map(|e| OverlayCopyBackend::new(&e.path(), &e.path()))
            .collect()
    }

    /// Deletes copy `name` of sandbox `id`, and its pod's other containers'
    /// copies of that name. Blocks.
    pub(super) fn destroy(&self, id: &SandboxId, name: &SnapshotName) -> Result<(), ApiError> {
        for member in self.member_copies(id) {
            if member.has(name).map_err(Self::fs_error(id))? {
                member.destroy(name).map_err(Self::fs_error(id))?;
            }
        }
        self.copies(id).destroy(name).map_err(Self::fs_error(id))
    }

    /// Deletes the copies of sandbox `id` that `named` does not hold, and
    /// half-made ones; answers what went. Blocks.
    pub(super) fn sweep(
        &self,
        id: &SandboxId,
        named: &[SnapshotName],
    ) -> Result<Vec<SnapshotName>, ApiError> {
        if !self.store_dir(id).exists() {
            return Ok(Vec::new());
        }
        let mut gone = Vec::new();
        for (i, copies) in std::iter::once(self.copies(id))
            .chain(self.member_copies(id))
            .enumerate()
        {
            let listed = copies.list().map_err(Self::fs_error(id))?;
            for s in listed.into_iter().filter(|s| !named.contains(&s.name)) {
                copies.destroy(&s.name).map_err(Self::fs_error(id))?;
                if i == 0 {
                    gone.push(s.name);
                }
            }
            copies.remove_partial().map_err(Self::fs_error(id))?;
        }
        Ok(gone)
    }

    /// Deletes sandbox `id`'s whole store: what a fork or an import that
    /// failed had made of it. Blocks.
    pub(super) fn remove_store(&self, id: &SandboxId) {
        let dir = self.store_dir(id);
        match std::fs::remove_dir_all(&dir) {
            Ok(()) => {}
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(e) => tracing::warn!(dir = %dir.display(), error = %e, "remove a failed copy's files"),
        }
    }

    /// Moves sandbox `id`'s whole store into `trash` (emptied later,
    /// without locks). Blocks.
    pub(super) fn trash(&self, id: &SandboxId, trash: &Path, unique: &str) {
        let dir = self.store_dir(id);
        match std::fs::rename(&dir, trash.join(unique)) {
            Ok(()) => {}
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(e) => tracing::warn!(dir = %dir.display(), error = %e, "file copies kept"),
        }
    }

    /// Deletes every snapshot in a store the shim kept on the sandbox's own
    /// filesystem, and the store (its shim is gone). Blocks.
    pub(super) fn destroy_own(location: &Location) {
        let destroyed = crab_snapshotter::open(location).and_then(|b| {
            for s in b.list()? {
                b.destroy(&s.name)?;
            }
            Ok(())
        });
        if let Err(e) = destroyed {
            tracing::warn!(?location, error = %crab_api::error_chain(&e), "snapshots kept");
            return;
        }
        if let Location::BtrfsSubvolume { store, .. } = location {
            let _ = std::fs::remove_dir(store);
            // The namespace's directory, once empty.
            let _ = store.parent().map(std::fs::remove_dir);
        }
    }
}

// === impl Daemon ===

impl Daemon {
    /// Destroys the file snapshots of sandbox `reg` that `removal` left
    /// unused: the copies crabd keeps itself, and through the shim those on
    /// the sandbox's own filesystem (the live tree is not touched).
    pub(super) async fn destroy_unused(&self, reg: &Registration, removal: &Removal) {
        let (copies, own): (Vec<&FsSnapshot>, Vec<&FsSnapshot>) = removal
            .unused_snapshots
            .iter()
            .partition(|s| s.backend == BackendKind::OverlayCopy);
        let (files, id) = (self.files.clone(), reg.id.clone());
        let names: Vec<SnapshotName> = copies.into_iter().map(|s| s.name.clone()).collect();
        let destroyed = tokio::task::spawn_blocking(move || {
            for name in names {
                if let Err(e) = files.destroy(&id, &name) {
                    tracing::warn!(snapshot = %name, error = %crab_api::error_chain(&e), "remove unused snapshot");
                }
            }
        })
        .await;
        if let Err(e) = destroyed {
            tracing::warn!(sandbox = %reg.id, error = %e, "remove unused snapshots");
        }
        if own.is_empty() {
            return;
        }
        if !self.registry.get(&reg.id).is_some_and(|e| e.running) {
            // Its shim is gone; they go with the rest when it is removed.
            return;
        }
        let call = ShimForget {
            snapshots: own.into_iter().map(|s| s.name.clone()).collect(),
        };
        match self
            .call_shim::<_, ShimForgotten>(reg, routes::shim::FORGET, &call)
            .await
        {
            Ok(done) if done.destroyed.len() == call.snapshots.len() => {}
            Ok(done) => tracing::warn!(
                sandbox = %reg.id,
                asked = call.snapshots.len(),
                destroyed = done.destroyed.len(),
                "some unused snapshots are kept until the sandbox is deleted (see the shim's log)"
            ),
            Err(e) => tracing::warn!(
                sandbox = %reg.id,
                error = %crab_api::error_chain(&e),
                "unused snapshots are kept until the sandbox is deleted"
            ),
        }
    }
}
