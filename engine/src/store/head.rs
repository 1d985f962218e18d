//! A sandbox's head: the version its running state descends from. A new
//! version inherits what it did not capture (process image, file snapshot)
//! from the head, never from whichever line is newest, and names the head
//! as its parent; versions form a tree.
//!
//! Publishing moves the head to the new version in memory only: the newest
//! version published since the head last moved otherwise is the head.
//! Every other move (a rollback, a restart, a removal) writes
//! `<root>/sandboxes/<id>/head.json`, atomically:
//!
//! ```text
//! {"version":3,"since":7}      head at version 3 (null: no head), written
//!                              when the next version number was 7
//! ```
//!
//! Loading: the newest intact version numbered `since` or more, if any
//! (published after the move, so descended from it); otherwise `version`.
//! Without the file (a manifest older than heads), the newest line. A line
//! after the chosen one that is not intact may be a newer head: then there
//! is no head (the next version is whole), never an older one.

use serde::{Deserialize, Serialize};

use super::manifest::{Entry, Manifest};
use super::record::VersionRecord;
use super::{durable, Inner, SandboxId, StoreError};

/// The version a sandbox's running state descends from.
#[derive(Debug, Clone)]
pub(crate) enum Head {
    /// None: the next version inherits nothing (a new sandbox, a restarted
    /// task, a removed head).
    None,
    /// This intact version.
    Intact(VersionRecord),
    /// A line that is not intact.
    Bad { line: u64 },
}

/// `head.json`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
struct HeadFile {
    version: Option<u64>,
    since: u64,
}

// === impl Head ===

impl Head {
    /// The head's version number, when it is an intact version.
    pub(crate) fn version(&self) -> Option<u64> {
        match self {
            Head::Intact(r) => Some(r.version),
            Head::None | Head::Bad { .. } => None,
        }
    }

    /// The head of `sandbox`, whose manifest is `m` (see the module doc).
    pub(crate) fn load(inner: &Inner, sandbox: &SandboxId, m: &Manifest) -> Result<Head, StoreError> {
        let path = head_path(inner, sandbox);
        let file = match std::fs::read(&path) {
            Ok(bytes) => match serde_json::from_slice::<HeadFile>(&bytes) {
                Ok(f) => Some(f),
                Err(e) => {
                    // Safe either way: no head makes the next version whole.
                    tracing::warn!(sandbox = %sandbox, error = %e, "corrupt head.json: no head");
                    Some(HeadFile {
                        version: None,
                        since: u64::MAX,
                    })
                }
            },
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => None,
            Err(e) => return Err(StoreError::io("read", &path)(e)),
        };
        let Some(file) = file else {
            return Ok(match m.last() {
                None => Head::None,
                Some(line) => match &line.entry {
                    Entry::Version(r) => Head::Intact(r.clone()),
                    Entry::Bad(_) => Head::Bad { line: line.number },
                },
            });
        };
        // The line that names the head, and whether a line after it is not
        // intact (it may be a newer head: then there is none to trust).
        let chosen = m
            .lines
            .iter()
            .rposition(|l| matches!(&l.entry, Entry::Version(r) if r.version >= file.since))
            .or_else(|| {
                let v = file.version?;
                m.lines
                    .iter()
                    .position(|l| matches!(&l.entry, Entry::Version(r) if r.version == v))
            });
        // None: the head was removed, or its line is not intact.
        let Some(at) = chosen else {
            return Ok(Head::None);
        };
        let later_bad = (at + 1..m.lines.len())
            .any(|idx| matches!(m.lines[idx].entry, Entry::Bad(_)) && m.bounds(idx).end > file.since);
        match &m.lines[at].entry {
            Entry::Version(r) if !later_bad => Ok(Head::Intact(r.clone())),
            _ => {
                tracing::warn!(sandbox = %sandbox, "a manifest line after the head is corrupt: no head");
                Ok(Head::None)
            }
        }
    }

    /// Writes `head` as `sandbox`'s head, durably, when the next version
    /// number is `next_version`.
    pub(crate) fn store(
        &self,
        inner: &Inner,
        sandbox: &SandboxId,
        next_version: u64,
    ) -> Result<(), StoreError> {
        let file = HeadFile {
            version: self.version(),
            since: next_version,
        };
        let bytes = serde_json::to_vec(&file).map_err(StoreError::Encode)?;
        durable::replace_file(&head_path(inner, sandbox), &bytes)
    }
}

fn head_path(inner: &Inner, sandbox: &SandboxId) -> std::path::PathBuf {
    inner.sandbox_dir(sandbox).join("head.json")
}
