//! A sandbox's versions: listing them, removing one (and what only it
//! used), and finding a verified one to restore, fork or export.

use std::path::PathBuf;
use std::sync::Arc;

use crab_api::crabd::{RemovalReport, VersionView};
use crab_api::{BackendKind, FsSnapshot, SandboxId, SandboxSelector, VersionRecord, VersionSel};

use super::work::{blocking, detached};
use super::{ApiError, Daemon};

// === impl Daemon ===

impl Daemon {
    /// Sandbox `sel`'s versions, one per manifest line.
    pub(super) async fn versions(&self, sel: &SandboxSelector) -> Result<Vec<VersionView>, ApiError> {
        let id = self.registry.find(sel)?.registration.id;
        let store = self.store.clone();
        let list = blocking(move || store.versions(&id)).await?;
        Ok(list
            .into_iter()
            .map(|v| VersionView {
                line: v.line,
                record: v.record,
                defect: v.defect.map(|d| format!("{d:?}")),
            })
            .collect())
    }

    /// Removes version `n` of sandbox `sel`, and the file snapshots no
    /// version uses any more.
    pub(super) async fn remove_version(
        self: &Arc<Self>,
        sel: &SandboxSelector,
        n: u64,
    ) -> Result<RemovalReport, ApiError> {
        let reg = self.registry.find(sel)?.registration;
        let d = self.clone();
        detached(async move {
            let busy = d.busy(&reg.id);
            let _one_at_a_time = busy.lock().await;
            let store = d.store.clone();
            let sid = reg.id.clone();
            let removal = blocking(move || store.remove_version(&sid, n)).await?;
            d.destroy_unused(&reg, &removal).await;
            Ok(RemovalReport {
                removed: removal.versions,
            })
        })
        .await
    }

    /// Version `which` of sandbox `id`, verified (checksums, image hashes),
    /// and the directory of the process image it restores.
    pub(super) async fn restorable(
        &self,
        id: &SandboxId,
        which: VersionSel,
    ) -> Result<(crate::Version, PathBuf), ApiError> {
        let (version, images, _) = self.pick(id, Pick::Sel(which)).await?;
        Ok((version, images))
    }

    /// Like [`Daemon::restorable`] for any [`Pick`], with why the versions
    /// passed over (a corrupt head's) could not be restored.
    pub(super) async fn pick(
        &self,
        id: &SandboxId,
        pick: Pick,
    ) -> Result<(crate::Version, PathBuf, Vec<String>), ApiError> {
        let store = self.store.clone();
        let sid = id.clone();
        let (version, passed) = blocking(move || match pick {
            Pick::Sel(VersionSel::Latest) => Ok((store.latest_valid(&sid)?, Vec::new())),
            Pick::Sel(VersionSel::Number(n)) => Ok((store.get(&sid, n)?, Vec::new())),
            Pick::Head => match store.head(&sid)? {
                Some(head) => store.nearest_valid(&sid, head),
                None => store.latest_valid_passing(&sid),
            },
        })
        .await?;
        let passed: Vec<String> = passed.iter().map(|e| crab_api::error_chain(e)).collect();
        if let Some(first) = passed.first() {
            tracing::warn!(
                sandbox = %id,
                version = version.record.version,
                head = %first,
                "the head cannot be restored: its nearest valid ancestor is"
            );
        }
        let images = version
            .images_dir
            .clone()
            .ok_or_else(|| ApiError::NoProcessImage {
                id: id.clone(),
                version: version.record.version,
            })?;
        Ok((version, images, passed))
    }
}

/// Which version a restore takes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Pick {
    /// This one (an error when it cannot be restored).
    Sel(VersionSel),
    /// The sandbox's head, or its nearest ancestor that can be restored (a
    /// corrupt head falls back to its parent); with no head, its newest
    /// valid version.
    Head,
}

/// The file snapshot of version `record`, if it is one crabd keeps and so
/// can copy (for a fork or an export).
pub(super) fn movable_files(record: &VersionRecord) -> Result<FsSnapshot, ApiError> {
    let fs = record.fs_snapshot.clone().ok_or_else(|| ApiError::NoFsSnapshot {
        id: record.sandbox.clone(),
        version: record.version,
    })?;
    if fs.backend != BackendKind::OverlayCopy {
        return Err(ApiError::NotMovable {
            id: record.sandbox.clone(),
            version: record.version,
            backend: fs.backend,
        });
    }
    Ok(fs)
}
