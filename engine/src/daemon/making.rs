//! Sandboxes being made (a fork, an import): each is named in a file under
//! `<root>/making/` from before containerd makes its container until its
//! task runs with its restore annotations removed, or what was made is
//! removed again. A crabd killed in between finds the file at its next
//! start and settles it: a container whose task runs is kept (its restore
//! annotations removed, so a later start runs its own state); anything
//! else it made (a created task, the container, its snapshot, its files,
//! an imported version, its transcript) is removed. A fork is whole or
//! absent, never a container that does not run.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use crab_api::SandboxId;
use serde::{Deserialize, Serialize};

use super::{ApiError, Daemon};
use crate::containerd::Containerd;

/// What a making names, to undo it after a crash.
#[derive(Debug, Serialize, Deserialize)]
struct Making {
    /// containerd's socket and namespace.
    address: PathBuf,
    namespace: String,
    /// The new sandbox's container id.
    id: SandboxId,
    /// The imported version its files are, for an import; a fork's files
    /// are a store of its own.
    import_version: Option<u64>,
    /// The transcript written for it, if any.
    transcript: Option<PathBuf>,
}

/// A making in progress: its file goes when this is [`MakingGuard::done`]
/// (the sandbox runs, or nothing of it is left). Dropped otherwise (an
/// error path that cleaned up), the file goes too.
#[derive(Debug)]
pub(super) struct MakingGuard(Option<PathBuf>);

impl MakingGuard {
    /// The making is settled.
    pub(super) fn done(mut self) {
        self.remove();
    }

    fn remove(&mut self) {
        if let Some(path) = self.0.take() {
            if let Err(e) = std::fs::remove_file(&path) {
                tracing::warn!(path = %path.display(), error = %e, "a making's record stays");
            }
        }
    }
}

impl Drop for MakingGuard {
    fn drop(&mut self) {
        self.remove();
    }
}

impl Daemon {
    fn making_dir(&self) -> PathBuf {
        self.config.root.join("making")
    }

    /// Names sandbox `id`, about to be made in `containerd` at `address`,
    /// durably (the file and its directory synced) before anything of it
    /// exists.
    pub(super) fn begin_making(
        &self,
        address: &Path,
        containerd: &Containerd,
        id: &SandboxId,
        import_version: Option<u64>,
        transcript: Option<&Path>,
    ) -> Result<MakingGuard, ApiError> {
        use std::io::Write;
        use std::os::unix::fs::{DirBuilderExt, OpenOptionsExt};
        let dir = self.making_dir();
        let io = |source| ApiError::Io {
            op: "record a making",
            source,
        };
        std::fs::DirBuilder::new()
            .recursive(true)
            .mode(0o700)
            .create(&dir)
            .map_err(io)?;
        let record = Making {
            address: address.to_owned(),
            namespace: containerd.namespace().to_owned(),
            id: id.clone(),
            import_version,
            transcript: transcript.map(Path::to_owned),
        };
        // One file per making: the same id may be made in two namespaces.
        let nanos = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos());
        let path = dir.join(format!("{id}.{nanos}.json"));
        let mut file = std::fs::OpenOptions::new()
            .write(true)
            .create(true)
            .truncate(true)
            .mode(0o600)
            .open(&path)
            .map_err(io)?;
        file.write_all(&serde_json::to_vec(&record).expect("a making serializes"))
            .and_then(|()| file.sync_all())
            .map_err(io)?;
        crate::store::sync_parent(&path)?;
        Ok(MakingGuard(Some(path)))
    }

    /// Settles what a killed crabd was making (see the module's doc). A
    /// record whose containerd cannot be reached stays for the next start.
    pub(super) async fn settle_interrupted_makings(self: &Arc<Self>) {
        let Ok(entries) = std::fs::read_dir(self.making_dir()) else {
            return;
        };
        for entry in entries.flatten() {
            let path = entry.path();
            let record: Making = match std::fs::read(&path)
                .map_err(|e| e.to_string())
                .and_then(|b| serde_json::from_slice(&b).map_err(|e| e.to_string()))
            {
                Ok(r) => r,
                Err(e) => {
                    tracing::warn!(path = %path.display(), error = e, "an unreadable making's record is removed");
                    let _ = std::fs::remove_file(&path);
                    continue;
                }
            };
            match self.settle(&record).await {
                Ok(kept) => {
                    tracing::warn!(sandbox = %record.id, kept, "settled what a killed crabd was making");
                    let _ = std::fs::remove_file(&path);
                }
                Err(e) => {
                    tracing::warn!(sandbox = %record.id, error = %crab_api::error_chain(&e), "what a killed crabd was making stays for the next start");
                }
            }
        }
    }

    /// Keeps `record`'s sandbox if its task runs (answers true), or removes
    /// what of it was made.
    async fn settle(self: &Arc<Self>, record: &Making) -> Result<bool, ApiError> {
        let containerd = Containerd::connect(&record.address, &record.namespace).await?;
        if containerd.settle_made(record.id.as_str()).await? {
            return Ok(true);
        }
        let (d, id, version) = (self.clone(), record.id.clone(), record.import_version);
        super::work::blocking_io(move || {
            match version {
                Some(n) => {
                    let _ = d.store.remove_version(&id, n);
                }
                None => d.files.remove_store(&id),
            }
            Ok(())
        })
        .await?;
        if let Some(t) = &record.transcript {
            let _ = std::fs::remove_file(t);
        }
        Ok(false)
    }
}
