//! Sandboxes being made (a fork, an import): each is named in a file under
//! `<root>/making/` from before containerd makes anything of it until its
//! task runs with its restore annotations removed, or what was made is
//! confirmed removed. The container and snapshot carry the record's token
//! as a label (`containerd::MAKING_LABEL`), so settling touches only what this
//! making made. A crabd settles every record before it serves: a task
//! still starting is waited for; one that runs, or whose sandbox crabd
//! knows (its shim registered it), is kept with its restore annotations
//! removed; anything else it made (a created task, the container, its
//! snapshot, then, when crabd knows no sandbox of that id, its files, an
//! imported version, its transcript) is removed. A record whose settling
//! fails stays for the next start. A fork is whole or absent, never a
//! container that does not run.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use crab_api::SandboxId;
use serde::{Deserialize, Serialize};

use super::{ApiError, Daemon};
use crate::containerd::{Containerd, Settled};

/// How long settling waits for a task whose start a killed crabd left
/// under way (the shim restoring it).
const PATIENCE: Duration = Duration::from_secs(60);

/// What a making names, to undo it after a crash.
#[derive(Debug, Serialize, Deserialize)]
struct Making {
    /// The label value its container and snapshot carry.
    token: String,
    /// containerd's socket and namespace, and the snapshotter.
    address: PathBuf,
    namespace: String,
    snapshotter: String,
    /// The new sandbox's container id.
    id: SandboxId,
    /// The imported version its files are (records of an earlier crabd;
    /// see `history`).
    #[serde(default)]
    import_version: Option<u64>,
    /// Every version of the id is this making's: an import, which begins
    /// only for an id with none, records its making before it publishes
    /// one. A fork's files are a store of its own.
    #[serde(default)]
    history: bool,
    /// The transcript written for it, once written.
    transcript: Option<PathBuf>,
}

/// A making in progress. Its record goes only when [`MakingGuard::done`]
/// says the making is settled (it runs, or nothing of it is left);
/// dropped otherwise (a cancelled request, a cleanup that failed), the
/// record stays for the next crabd to settle.
#[derive(Debug)]
pub(super) struct MakingGuard {
    path: PathBuf,
    record: Making,
}

impl MakingGuard {
    /// The label value of what this making makes.
    pub(super) fn token(&self) -> &str {
        &self.record.token
    }

    /// Writes `records` as the sandbox's new transcript at `path`, named in
    /// the record first (replaced whole, synced), so a crash after the
    /// write removes it too. A file already there is another container's
    /// of that id: never named, never touched. True when written; false
    /// (logged) otherwise, and the conversation starts afresh.
    pub(super) async fn write_transcript(
        &mut self,
        path: &Path,
        id: &SandboxId,
        records: Vec<crab_proxy::transcript::TurnRecord>,
    ) -> bool {
        if std::fs::symlink_metadata(path).is_ok() {
            tracing::warn!(sandbox = %id, path = %path.display(), "a transcript is there already: the conversation starts afresh");
            return false;
        }
        if let Err(e) = self.name_transcript(Some(path)) {
            tracing::warn!(sandbox = %id, error = %crab_api::error_chain(&e), "the conversation starts afresh");
            return false;
        }
        if super::fork::write_conversation(path, id, records).await {
            return true;
        }
        // Not written (or another's appeared in between): not ours to name.
        if let Err(e) = self.name_transcript(None) {
            tracing::error!(sandbox = %id, error = %crab_api::error_chain(&e), "a making's record names a transcript it did not write");
        }
        false
    }

    fn name_transcript(&mut self, transcript: Option<&Path>) -> Result<(), ApiError> {
        self.record.transcript = transcript.map(Path::to_owned);
        let bytes = serde_json::to_vec(&self.record).expect("a making serializes");
        crate::store::replace_file(&self.path, &bytes).map_err(ApiError::from)
    }

    /// The making is settled: its record goes, durably.
    pub(super) fn done(self) {
        match std::fs::remove_file(&self.path) {
            Ok(()) => {
                if let Err(e) = crate::store::sync_parent(&self.path) {
                    tracing::warn!(path = %self.path.display(), error = %e, "a making's removal is not synced");
                }
            }
            Err(e) => tracing::warn!(path = %self.path.display(), error = %e, "a making's record stays"),
        }
    }
}

impl Daemon {
    fn making_dir(&self) -> PathBuf {
        self.config.root.join("making")
    }

    /// Names sandbox `id`, about to be made in `containerd` (at `address`,
    /// on `snapshotter`), durably (the file and its directory synced)
    /// before anything of it exists: its versions (`history`: all of the
    /// id's are this making's), files, transcript or container.
    pub(super) fn begin_making(
        &self,
        containerd: &Containerd,
        snapshotter: &str,
        id: &SandboxId,
        history: bool,
    ) -> Result<MakingGuard, ApiError> {
        use std::io::Write;
        use std::os::unix::fs::{DirBuilderExt, OpenOptionsExt, PermissionsExt};
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
        std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o700)).map_err(io)?;
        // One file per making: the same id may be made in two namespaces.
        let nanos = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos());
        let token = format!("{id}.{nanos}");
        let record = Making {
            token: token.clone(),
            address: containerd.address().to_owned(),
            namespace: containerd.namespace().to_owned(),
            snapshotter: snapshotter.to_owned(),
            id: id.clone(),
            import_version: None,
            history,
            transcript: None,
        };
        let path = dir.join(format!("{token}.json"));
        let mut file = std::fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .mode(0o600)
            .open(&path)
            .map_err(io)?;
        file.write_all(&serde_json::to_vec(&record).expect("a making serializes"))
            .and_then(|()| file.sync_all())
            .map_err(io)?;
        crate::store::sync_parent(&path)?;
        Ok(MakingGuard { path, record })
    }

    /// Settles what a killed crabd was making (see the module's doc).
    pub(super) async fn settle_interrupted_makings(self: &Arc<Self>) {
        let Ok(entries) = std::fs::read_dir(self.making_dir()) else {
            return;
        };
        for entry in entries.flatten() {
            let path = entry.path();
            // A record's rewrite cut short leaves its temporary file.
            if path.extension().is_none_or(|e| e != "json") {
                let _ = std::fs::remove_file(&path);
                continue;
            }
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
            match self.settle(&record, PATIENCE).await {
                Ok(settled) => {
                    tracing::warn!(sandbox = %record.id, ?settled, "settled what a killed crabd was making");
                    MakingGuard { path, record }.done();
                }
                Err(e) => {
                    tracing::warn!(sandbox = %record.id, error = %crab_api::error_chain(&e), "what a killed crabd was making stays for the next start");
                }
            }
        }
    }

    /// Settles one making: keeps its sandbox if it runs (or ran, waiting
    /// up to `patience` for a task still starting), or removes what of it
    /// was made.
    async fn settle(self: &Arc<Self>, record: &Making, patience: Duration) -> Result<Settled, ApiError> {
        let containerd = Containerd::connect(&record.address, &record.namespace).await?;
        let known = self.registry.get(&record.id).is_some();
        let settled = containerd
            .settle_made(
                record.id.as_str(),
                &record.token,
                &record.snapshotter,
                known,
                patience,
            )
            .await?;
        // Files, versions and transcripts are keyed by id alone: they are
        // this making's only when nothing else of that id exists.
        if settled != Settled::Removed || known {
            return Ok(settled);
        }
        let (d, id, version, history) = (
            self.clone(),
            record.id.clone(),
            record.import_version,
            record.history,
        );
        super::work::blocking_io(move || {
            if history {
                let _ = d.store.forget(&id);
            } else if let Some(n) = version {
                let _ = d.store.remove_version(&id, n);
                if d.store.versions(&id).is_ok_and(|v| v.is_empty()) {
                    let _ = d.store.forget(&id);
                }
            }
            d.files.remove_store(&id);
            Ok(())
        })
        .await?;
        if let Some(t) = &record.transcript {
            let _ = std::fs::remove_file(t);
        }
        Ok(settled)
    }

    /// Removes what the making `guard` made after a failed step (its
    /// container and snapshot, then its versions, files and transcript, as
    /// settling does), checked; the record goes only once that worked, and
    /// stays for the next crabd otherwise (`None`).
    pub(super) async fn undo_making(self: &Arc<Self>, guard: MakingGuard) -> Option<Settled> {
        match self.settle(&guard.record, Duration::ZERO).await {
            Ok(settled) => {
                if settled == Settled::Kept {
                    tracing::warn!(sandbox = %guard.record.id, "a start reported failed, but its task runs: kept");
                }
                guard.done();
                Some(settled)
            }
            Err(e) => {
                tracing::warn!(sandbox = %guard.record.id, error = %crab_api::error_chain(&e), "a failed making stays for the next start to settle");
                None
            }
        }
    }
}
