//! Writing a version: [`VersionStore::begin_version`], then
//! [`PendingVersion::publish`].

use std::fs;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{SystemTime, UNIX_EPOCH};

use parking_lot::Mutex;

use super::head::Head;
use super::record::{self, Class, FsSnapshot, VersionRecord};
use super::{crash_point, durable, images, manifest, Inner, Pending, SandboxId, SandboxState};
use super::{StoreError, VersionStore};

/// What a new version is made of.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NewVersion {
    /// The turn that ended at this version, if a turn did.
    pub turn: Option<u64>,
    /// The branch of the conversation that turn is on.
    pub branch: u64,
    /// How many turns of the transcript belong to it.
    pub transcript_turns: u64,
    /// What it captured anew; the rest it reuses from the sandbox's head.
    pub capture: Capture,
}

/// What a new version captured anew, by class.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Capture {
    /// Nothing (class `none`): it reuses the process image and filesystem
    /// snapshot of the head; publishing costs one manifest line.
    Nothing,
    /// A filesystem snapshot (class `fs`); it reuses the process image.
    Fs(FsSnapshot),
    /// A process image (class `proc`), written into
    /// [`PendingVersion::images_dir`]; it reuses the filesystem snapshot.
    Proc,
    /// Both (class `full`).
    Full(FsSnapshot),
}

/// A version being written: its number is reserved, its process image (if
/// its class has one) goes into [`PendingVersion::images_dir`].
///
/// Dropping it unpublished removes what was written.
#[derive(Debug)]
pub struct PendingVersion {
    inner: Arc<Inner>,
    state: Arc<Mutex<SandboxState>>,
    sandbox: SandboxId,
    version: u64,
    new: NewVersion,
    parent: Option<u64>,
    process_image: Option<u64>,
    fs_snapshot: Option<FsSnapshot>,
    tmp: Option<PathBuf>,
    published: bool,
}

// === impl Capture ===

impl Capture {
    /// The class of a version that captured this.
    pub fn class(&self) -> Class {
        match self {
            Capture::Nothing => Class::None,
            Capture::Fs(_) => Class::Fs,
            Capture::Proc => Class::Proc,
            Capture::Full(_) => Class::Full,
        }
    }
}

// === impl VersionStore ===

impl VersionStore {
    /// Starts version `next` of `sandbox`. At most one version of a sandbox
    /// is pending at a time, so versions are published in number order.
    ///
    /// # Errors
    /// [`StoreError::UnknownSandbox`]; [`StoreError::PendingExists`];
    /// [`StoreError::CannotInherit`] when `new` reuses what the head uses
    /// but the head's manifest line is corrupt.
    ///
    /// ```no_run
    /// # use crab_engine::{Capture, NewVersion, SandboxId, VersionStore};
    /// let store = VersionStore::open("/var/lib/crab")?;
    /// let sandbox = SandboxId::new("s1")?;
    /// let pending = store.begin_version(&sandbox, NewVersion { turn: Some(3), branch: 0, transcript_turns: 3, capture: Capture::Proc })?;
    /// // ... CRIU dumps into pending.images_dir() ...
    /// let record = pending.publish()?;
    /// # Ok::<(), crab_engine::StoreError>(())
    /// ```
    pub fn begin_version(&self, sandbox: &SandboxId, new: NewVersion) -> Result<PendingVersion, StoreError> {
        let state_arc = self.inner.sandbox(sandbox)?;
        // What the last open moved aside has had a checkpoint's time to
        // end: a live crabd sweeps it at its next process image too, not only
        // the next start. Only an open makes such names: no lock needed.
        if new.capture.class().needs_proc() {
            for entry in fs::read_dir(self.inner.images_root(sandbox))
                .into_iter()
                .flatten()
                .flatten()
            {
                durable::sweep_stale(&entry.path());
            }
        }
        let mut state = state_arc.lock();
        if let Some(pending) = &state.pending {
            return Err(StoreError::PendingExists {
                sandbox: sandbox.clone(),
                version: pending.version,
            });
        }
        let reuses = !matches!(new.capture, Capture::Full(_));
        let (old_image, old_fs) = match &state.head {
            Head::None => (None, None),
            Head::Intact(r) => (r.process_image, r.fs_snapshot.clone()),
            Head::Bad { line } if reuses => {
                return Err(StoreError::CannotInherit {
                    sandbox: sandbox.clone(),
                    line: *line,
                })
            }
            Head::Bad { .. } => (None, None),
        };
        let parent = state.head.version();
        let version = state.next_version;
        let (process_image, fs_snapshot) = match &new.capture {
            Capture::Nothing => (old_image, old_fs),
            Capture::Fs(snapshot) => (old_image, Some(snapshot.clone())),
            Capture::Proc => (Some(version), old_fs),
            Capture::Full(snapshot) => (Some(version), Some(snapshot.clone())),
        };
        let tmp = if new.capture.class().needs_proc() {
            // A name of this attempt's own: a checkpoint a killed crabd
            // asked for may still be writing into an earlier attempt's.
            let attempt = std::time::SystemTime::now()
                .duration_since(UNIX_EPOCH)
                .map_or(0, |d| d.as_nanos());
            let tmp = self
                .inner
                .images_root(sandbox)
                .join(format!(".tmp-{version}-{attempt}"));
            fs::create_dir(&tmp).map_err(StoreError::io("create directory", &tmp))?;
            Some(tmp)
        } else {
            None
        };
        state.pending = Some(Pending {
            version,
            process_image,
            fs_snapshot: fs_snapshot.clone(),
        });
        drop(state);
        Ok(PendingVersion {
            inner: self.inner.clone(),
            state: state_arc,
            sandbox: sandbox.clone(),
            version,
            new,
            parent,
            process_image,
            fs_snapshot,
            tmp,
            published: false,
        })
    }
}

// === impl PendingVersion ===

impl PendingVersion {
    /// The number this version will have.
    pub fn version(&self) -> u64 {
        self.version
    }

    /// The version it descends from (the sandbox's head when it began).
    pub fn parent(&self) -> Option<u64> {
        self.parent
    }

    /// The sandbox it belongs to.
    pub fn sandbox(&self) -> &SandboxId {
        &self.sandbox
    }

    /// Where to write its process image, when its class has one.
    pub fn images_dir(&self) -> Option<&Path> {
        self.tmp.as_deref()
    }

    /// Publishes the version: hashes and fsyncs its process image, renames
    /// it into place, then appends its manifest line and fsyncs it.
    ///
    /// # Errors
    /// [`StoreError::UnsupportedImageEntry`] if the images directory holds
    /// a symlink, socket or other non-regular file; [`StoreError::Io`].
    /// After an error nothing of the version remains.
    pub fn publish(mut self) -> Result<VersionRecord, StoreError> {
        let record = self.write()?;
        self.published = true;
        tracing::info!(
            sandbox = %self.sandbox,
            version = record.version,
            turn = record.turn,
            class = ?record.class,
            n_files = record.images.len(),
            bytes = record.images.iter().map(|f| f.bytes).sum::<u64>(),
            "version published"
        );
        Ok(record)
    }

    fn write(&mut self) -> Result<VersionRecord, StoreError> {
        // Hashing runs outside the sandbox's lock: the temporary directory is
        // this version's alone.
        let files = match &self.tmp {
            Some(tmp) => images::seal(tmp)?,
            None => Vec::new(),
        };
        let record = VersionRecord {
            sandbox: self.sandbox.clone(),
            version: self.version,
            created_unix_ms: SystemTime::now()
                .duration_since(UNIX_EPOCH)
                .map_or(0, |d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX)),
            turn: self.new.turn,
            branch: self.new.branch,
            class: self.new.capture.class(),
            parent: self.parent,
            process_image: self.process_image,
            fs_snapshot: self.fs_snapshot.clone(),
            transcript_turns: self.new.transcript_turns,
            images: files,
        };
        let line = record::encode_version(&record)?;
        let mut state = self.state.lock();
        crash_point("images-synced");
        // Invariant: a version's manifest line is appended only after the
        // images it names are fsynced (seal) and renamed in durably.
        let renamed = match &self.tmp {
            Some(tmp) => {
                let dir = self.inner.images_dir(&self.sandbox, self.version);
                fs::rename(tmp, &dir).map_err(StoreError::io("rename into place", &dir))?;
                self.tmp = None;
                let synced = durable::sync_parent(&dir);
                if let Err(e) = synced {
                    remove_after_failure(&dir);
                    return Err(e);
                }
                crash_point("images-renamed");
                Some(dir)
            }
            None => None,
        };
        if let Err(e) = manifest::append(&self.inner.manifest_path(&self.sandbox), &line) {
            if let Some(dir) = &renamed {
                remove_after_failure(dir);
            }
            return Err(e);
        }
        state.next_version = self.version + 1;
        state.head = Head::Intact(record.clone());
        state.pending = None;
        Ok(record)
    }
}

impl Drop for PendingVersion {
    fn drop(&mut self) {
        if self.published {
            return;
        }
        if let Some(tmp) = &self.tmp {
            remove_after_failure(tmp);
        }
        let mut state = self.state.lock();
        if state.pending.as_ref().is_some_and(|p| p.version == self.version) {
            state.pending = None;
        }
    }
}

/// Removes what an unpublished version wrote; a failure only leaves a
/// directory that the next open sweeps.
fn remove_after_failure(dir: &Path) {
    if let Err(e) = durable::remove_dir(dir) {
        tracing::warn!(dir = %dir.display(), error = %e, "cannot remove an unpublished images directory");
    }
}
