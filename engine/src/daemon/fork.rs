//! A fork: a new sandbox, in the same containerd namespace, from one of a
//! sandbox's versions (its files copied, its processes restored at Start
//! from the version's process image, read in place). `forks` makes N of
//! them from one version at once, each made or failed on its own.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Instant;

use crab_api::crabd::{
    ForkOutcome, ForkReport, ForkRequest, ForksReport, ForksRequest, Registration, MAX_FORKS,
};
use crab_api::shim::ConversationAt;
use crab_api::{SandboxId, SandboxSelector, SnapshotName, VersionRecord, VersionSel};
use crab_proxy::transcript::{conversation, read_entries, write_new, TurnRecord};
use futures_util::StreamExt;
use tracing::Instrument;

use super::making::MakingGuard;
use super::versions::movable_files;
use super::work::{blocking_io, detached, unix_ms};
use super::{ApiError, Daemon};
use crate::containerd::{ContainerTemplate, Containerd, Restore};

/// How many forks of one `forks` call are made at once: each copies files
/// and waits on containerd and CRIU, so a few overlap well even on two
/// cores.
const PARALLEL: usize = 4;

/// A fork's id, how its making went, and when it ended (ms from the start).
type Made = (SandboxId, Result<Copied, ApiError>, f64);

/// A sandbox [`Daemon::start_copy`] made.
pub(super) struct Copied {
    /// Its init's pid on the host.
    pub pid: u32,
    /// The disk its files took.
    pub bytes: u64,
    /// Its making's record: done once its restore annotations are gone
    /// (dropped instead, the next crabd settles it).
    pub making: Option<MakingGuard>,
}

/// The version a fork is made from.
struct Source<'a> {
    /// Its sandbox.
    reg: &'a Registration,
    /// Its record.
    record: &'a VersionRecord,
    /// The directory of its process image.
    images: &'a Path,
    /// Its file snapshot.
    files: &'a SnapshotName,
}

/// Where a copy's files come from: a snapshot of a sandbox's store.
pub(super) struct FilesFrom {
    /// The sandbox whose store holds it.
    pub sandbox: SandboxId,
    /// The snapshot.
    pub name: SnapshotName,
}

// === impl Daemon ===

impl Daemon {
    /// Starts a new sandbox from version `req.version` of sandbox `sel`.
    pub(super) async fn fork(
        self: &Arc<Self>,
        sel: &SandboxSelector,
        req: ForkRequest,
    ) -> Result<ForkReport, ApiError> {
        let reg = self.registry.find(sel)?.registration;
        let span = tracing::info_span!("fork", sandbox = %reg.id, version = %req.version);
        let name = req.name;
        let (version, mut made) = self
            .make_forks(reg, req.version, |default| Ok(vec![name.unwrap_or(default)]))
            .instrument(span)
            .await?;
        let (id, copied, total_ms) = made.pop().expect("one fork asked for");
        Ok(ForkReport {
            id,
            pid: copied?.pid,
            version,
            total_ms,
        })
    }

    /// Starts `req.count` new sandboxes from version `req.version` of
    /// sandbox `sel`, [`PARALLEL`] at a time; one that fails leaves nothing
    /// and does not stop the others.
    pub(super) async fn forks(
        self: &Arc<Self>,
        sel: &SandboxSelector,
        req: ForksRequest,
    ) -> Result<ForksReport, ApiError> {
        if !(1..=MAX_FORKS).contains(&req.count) {
            return Err(ApiError::BadRequest {
                reason: format!("a fork count is 1 to {MAX_FORKS}, not {}", req.count),
            });
        }
        let reg = self.registry.find(sel)?.registration;
        let span = tracing::info_span!("forks", sandbox = %reg.id, version = %req.version, count = req.count);
        let started = Instant::now();
        let (prefix, count) = (req.prefix, req.count);
        let (version, made) = self
            .make_forks(reg, req.version, move |default| {
                let prefix = prefix.unwrap_or(default);
                (1..=count)
                    .map(|i| SandboxId::new(format!("{prefix}-{i}")).map_err(ApiError::from))
                    .collect()
            })
            .instrument(span)
            .await?;
        let forks: Vec<ForkOutcome> = made
            .into_iter()
            .map(|(id, copied, total_ms)| ForkOutcome {
                id,
                pid: copied.as_ref().ok().map(|c| c.pid),
                bytes: copied.as_ref().map_or(0, |c| c.bytes),
                error: copied.err().map(|e| crab_api::error_chain(&e)),
                total_ms,
            })
            .collect();
        Ok(ForksReport {
            version,
            forks,
            total_ms: started.elapsed().as_secs_f64() * 1e3,
        })
    }

    /// Makes the forks of version `which` of sandbox `reg` that `ids` names
    /// (given the default id, `<id>-fork<version>-<n>`), [`PARALLEL`] at a
    /// time, on a task of its own under the sandbox's lock; answers the
    /// version and each fork's id, outcome and time from the start.
    async fn make_forks(
        self: &Arc<Self>,
        reg: Registration,
        which: VersionSel,
        ids: impl FnOnce(SandboxId) -> Result<Vec<SandboxId>, ApiError> + Send + 'static,
    ) -> Result<(u64, Vec<Made>), ApiError> {
        let d = self.clone();
        detached(async move {
            let busy = d.busy(&reg.id);
            let _one_at_a_time = busy.lock().await;
            let started = Instant::now();
            let (version, images) = d.restorable(&reg.id, which).await?;
            let number = version.record.version;
            let fs = movable_files(&version.record)?;
            let default = SandboxId::new(format!("{}-fork{number}-{}", reg.id, unix_ms() % 100_000))?;
            let ids = ids(default)?;
            if let Some(taken) = ids.iter().find(|id| d.registry.get(id).is_some()) {
                return Err(ApiError::SandboxExists { id: taken.clone() });
            }
            let containerd = Containerd::connect(&reg.containerd, &reg.namespace).await?;
            let template = containerd.template(reg.id.as_str()).await?;
            let source = Source {
                reg: &reg,
                record: &version.record,
                images: &images,
                files: &fs.name,
            };
            let one = |new_id: SandboxId| {
                let (d, containerd, template, source) = (&d, &containerd, &template, &source);
                async move {
                    let made = d.fork_one(containerd, template, source, &new_id).await;
                    (new_id, made, started.elapsed().as_secs_f64() * 1e3)
                }
            };
            let made: Vec<Made> = futures_util::stream::iter(ids.into_iter().map(one))
                .buffered(PARALLEL)
                .collect()
                .await;
            let ok = made.iter().filter(|m| m.1.is_ok()).count();
            tracing::info!(
                made = ok,
                failed = made.len() - ok,
                elapsed_ms = started.elapsed().as_secs_f64() * 1e3,
                "forked"
            );
            Ok((number, made))
        })
        .await
    }

    /// Creates fork `new_id` of `source` in `containerd` from `template`,
    /// its conversation (the version's turns, as the fork's own transcript
    /// beside its source's) included; nothing is left if it fails.
    async fn fork_one(
        self: &Arc<Self>,
        containerd: &Containerd,
        template: &ContainerTemplate,
        source: &Source<'_>,
        new_id: &SandboxId,
    ) -> Result<Copied, ApiError> {
        // Named before anything of it is written: its transcript too.
        let mut making = self.begin_making(containerd, &template.snapshotter, new_id, false)?;
        let conversation = self.fork_conversation(source, new_id, &mut making).await;
        let from = FilesFrom {
            sandbox: source.reg.id.clone(),
            name: source.files.clone(),
        };
        let at = conversation.as_ref().map(|(at, _)| at);
        let made = self
            .start_copy(containerd, template, new_id, source.images, from, at, making)
            .await;
        match (made, &conversation) {
            (Err(e), Some((_, path))) => {
                let _ = std::fs::remove_file(path);
                Err(e)
            }
            // The restore annotations served this start only: a later
            // start of the fork runs its own state, not the version's.
            (Ok(mut copied), _) => {
                match containerd.set_restore(new_id.as_str(), None).await {
                    Ok(()) => {
                        if let Some(m) = copied.making.take() {
                            m.done();
                        }
                    }
                    // The record stays: the next crabd removes them.
                    Err(e) => {
                        tracing::warn!(fork = %new_id, error = %crab_api::error_chain(&e), "the restore annotations stay on the fork")
                    }
                }
                Ok(copied)
            }
            (Err(e), None) => Err(e),
        }
    }

    /// Writes the conversation of `source`'s version as the transcript of
    /// fork `new_id`, beside its source's, named in its `making`; answers
    /// where the fork stands in it, and the file. None (logged) when there
    /// is none (see [`Daemon::version_conversation`]) or it cannot be
    /// written (see [`MakingGuard::write_transcript`]): the fork's
    /// conversation then starts afresh.
    async fn fork_conversation(
        &self,
        source: &Source<'_>,
        new_id: &SandboxId,
        making: &mut MakingGuard,
    ) -> Option<(ConversationAt, PathBuf)> {
        let from = source.reg.transcript.clone()?;
        let (at, records) = self.version_conversation(source.reg, source.record).await?;
        let path = from.with_file_name(format!("{new_id}.jsonl"));
        making
            .write_transcript(&path, new_id, records)
            .await
            .then_some((at, path))
    }

    /// The conversation of version `record` of `reg`'s sandbox: its
    /// branch's turns up to its turn, and where the version stands in them
    /// once they are written as a new transcript (on its root branch).
    /// None (logged) when the sandbox keeps no transcript, the version
    /// ended no turn, or the transcript cannot be read.
    pub(super) async fn version_conversation(
        &self,
        reg: &Registration,
        record: &VersionRecord,
    ) -> Option<(ConversationAt, Vec<TurnRecord>)> {
        let from = reg.transcript.clone()?;
        let at = self.conversation_at(&reg.id, record).await?;
        let entries = match bounded_entries(&from).await {
            Ok(entries) => entries,
            Err(e) => {
                tracing::warn!(error = %crab_api::error_chain(&e), "the version's conversation is left behind");
                return None;
            }
        };
        let records: Vec<_> = conversation(&entries, at.branch)?
            .into_iter()
            .filter(|(turn, _)| *turn <= at.turn)
            .map(|(_, record)| record)
            .collect();
        let at = ConversationAt {
            branch: 0,
            turn: at.turn,
            image_turn: at.image_turn,
        };
        Some((at, records))
    }

    /// Creates sandbox `new_id` in `containerd` from `template`: its files
    /// a copy of `files`, its init restored from `images` when the shim
    /// starts it. Nothing is left if it fails, nor if crabd is killed
    /// before its task runs (`making`, begun before anything of it was
    /// written; see `making`).
    #[allow(clippy::too_many_arguments)]
    pub(super) async fn start_copy(
        self: &Arc<Self>,
        containerd: &Containerd,
        template: &ContainerTemplate,
        new_id: &SandboxId,
        images: &Path,
        files: FilesFrom,
        conversation: Option<&ConversationAt>,
        making: MakingGuard,
    ) -> Result<Copied, ApiError> {
        let files_from_elsewhere = files.sandbox != *new_id;
        let grant = match self.grant_restore(new_id, containerd.namespace(), images).await {
            Ok(grant) => grant,
            Err(e) => {
                self.undo_making(making).await;
                return Err(e);
            }
        };
        let restore = Restore {
            images,
            conversation,
            token: grant.token(),
        };
        let made = match containerd
            .create_from(template, new_id.as_str(), &restore, making.token())
            .await
        {
            Ok(made) => made,
            Err(e) => {
                self.undo_making(making).await;
                return Err(e.into());
            }
        };
        let upper = made.upper.clone();
        let d = self.clone();
        let to = new_id.clone();
        let copied = blocking_io(move || {
            // containerd made the upper directory; the copy makes it anew.
            if let Err(e) = std::fs::remove_dir(&upper) {
                tracing::debug!(error = %e, "remove the new, empty upper directory");
            }
            d.files.clone_into(&files.sandbox, &files.name, &to, &upper)?;
            Ok(disk_usage(&upper))
        })
        .await;
        let started = match copied {
            Ok(bytes) => containerd
                .start(&made)
                .await
                .map(|pid| Copied {
                    pid,
                    bytes,
                    making: None,
                })
                .map_err(ApiError::from),
            Err(e) => Err(e),
        };
        drop(grant);
        match started {
            Ok(mut copied) => {
                copied.making = Some(making);
                Ok(copied)
            }
            Err(e) => {
                // Removed (checked) before the record goes, with what the
                // making wrote: a fork's new store, an import's version.
                let settled = self.undo_making(making).await;
                if files_from_elsewhere && settled == Some(crate::containerd::Settled::Removed) {
                    let (files, id) = (self.files.clone(), new_id.clone());
                    let _ = tokio::task::spawn_blocking(move || files.remove_store(&id)).await;
                }
                Err(e)
            }
        }
    }
}

/// The disk the files under `dir` take (allocated blocks, links not
/// followed, each inode once); what cannot be read counts nothing.
fn disk_usage(dir: &Path) -> u64 {
    use std::os::unix::fs::MetadataExt;
    let mut seen = std::collections::HashSet::new();
    let mut todo = vec![dir.to_owned()];
    let mut bytes = 0;
    while let Some(path) = todo.pop() {
        let Ok(meta) = std::fs::symlink_metadata(&path) else {
            continue;
        };
        if seen.insert((meta.dev(), meta.ino())) {
            bytes += meta.blocks() * 512;
        }
        if meta.is_dir() {
            todo.extend(
                std::fs::read_dir(&path)
                    .into_iter()
                    .flatten()
                    .flatten()
                    .map(|e| e.path()),
            );
        }
    }
    bytes
}

/// Writes `records` as sandbox `id`'s new transcript at `path` (see
/// `write_new`); false (logged) when it cannot: its conversation then
/// starts afresh.
pub(super) async fn write_conversation(path: &Path, id: &SandboxId, records: Vec<TurnRecord>) -> bool {
    let (to, id) = (path.to_owned(), id.to_string());
    match tokio::task::spawn_blocking(move || write_new(&to, &id, records)).await {
        Ok(Ok(())) => true,
        Ok(Err(e)) => {
            tracing::warn!(error = %crab_api::error_chain(&e), "the conversation starts afresh");
            false
        }
        Err(e) => {
            tracing::warn!(error = %e, "the conversation starts afresh");
            false
        }
    }
}

/// The entries of the transcript at `path`, refused past
/// `crab_proxy::MAX_REPLAY_BYTES` (a sandbox writes its own transcript;
/// crabd reads it whole).
pub(super) async fn bounded_entries(
    path: &Path,
) -> Result<Vec<crab_proxy::transcript::Entry>, std::io::Error> {
    let bytes = tokio::fs::metadata(path).await?.len();
    if bytes > crab_proxy::MAX_REPLAY_BYTES {
        return Err(std::io::Error::other(format!(
            "{}: {bytes} bytes, over the {} a conversation is read at",
            path.display(),
            crab_proxy::MAX_REPLAY_BYTES
        )));
    }
    read_entries(path).await.map_err(std::io::Error::other)
}
