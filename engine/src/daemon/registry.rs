//! The sandboxes that shims registered, kept on disk so that a restarted
//! crabd still knows them. A sandbox whose task stopped stays, with its
//! versions, until containerd removes its container (see `gc`).

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use parking_lot::Mutex;
use serde::{Deserialize, Serialize};

use crab_api::crabd::Registration;
use crab_api::{SandboxId, SandboxSelector};

use super::ApiError;

/// One sandbox as crabd keeps it.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Entry {
    /// What its shim registered.
    #[serde(flatten)]
    pub registration: Registration,
    /// Whether its task runs (its shim unregisters when the task is deleted).
    #[serde(default = "yes")]
    pub running: bool,
    /// When containerd created its container, if crabd had to ask (its
    /// registration names no writable layer).
    #[serde(default)]
    pub incarnation: Option<String>,
    /// How many times its task was recovered after a crash.
    #[serde(default)]
    pub recoveries: u32,
    /// The last recovery.
    #[serde(default)]
    pub last_recovery: Option<crab_api::crabd::Recovery>,
    /// Random per history (hex): part of its host-listener secret, so a
    /// later sandbox with the same id gets another URL.
    #[serde(default)]
    pub nonce: String,
}

// === impl Entry ===

impl Entry {
    /// Whether a sandbox registering as `new` (with `incarnation`) is not
    /// this one but a later one with the same id: its writable layer is
    /// another, or (with no layer to tell) containerd made it at another
    /// time. Unknown is "the same": nothing is deleted on a guess.
    pub fn replaced_by(&self, new: &Registration, incarnation: Option<&String>) -> bool {
        match (&self.registration.layer, &new.layer) {
            (Some(old), Some(new)) => old != new,
            _ => matches!(
                (&self.incarnation, incarnation),
                (Some(old), Some(new)) if old != new
            ),
        }
    }

    /// Whether it is the same sandbox as `other` (same layer and
    /// incarnation).
    pub fn same_sandbox(&self, other: &Entry) -> bool {
        self.registration.layer == other.registration.layer && self.incarnation == other.incarnation
    }
}

fn yes() -> bool {
    true
}

/// Sandboxes by id; each is also a file `<dir>/<id>.json`.
#[derive(Debug)]
pub struct Registry {
    dir: PathBuf,
    sandboxes: Mutex<BTreeMap<SandboxId, Entry>>,
}

// === impl Registry ===

impl Registry {
    /// Loads the entries under `dir` (created if missing); unreadable files
    /// are logged and skipped.
    pub fn open(dir: &Path) -> std::io::Result<Registry> {
        std::fs::create_dir_all(dir)?;
        let mut sandboxes = BTreeMap::new();
        for entry in std::fs::read_dir(dir)? {
            let path = entry?.path();
            let name = path.file_name().and_then(|n| n.to_str()).unwrap_or_default();
            if name.ends_with(".json.tmp") {
                // A write cut short: its rename never happened.
                let _ = std::fs::remove_file(&path);
                continue;
            }
            if path.extension().is_none_or(|e| e != "json") {
                continue;
            }
            // An entry's id is checked as it is read (`SandboxId`'s serde).
            let bytes = match std::fs::read(&path) {
                Ok(b) => b,
                Err(e) => {
                    tracing::warn!(path = %path.display(), error = %e, "unreadable registration skipped");
                    continue;
                }
            };
            match serde_json::from_slice::<Entry>(&bytes) {
                // Only `<id>.json` holds `id`: what another name holds would
                // outlive its removal.
                Ok(e) if path.file_stem().and_then(|s| s.to_str()) == Some(e.registration.id.as_str()) => {
                    sandboxes.insert(e.registration.id.clone(), e);
                }
                Ok(e) => {
                    tracing::warn!(path = %path.display(), sandbox = %e.registration.id, "registration under another name skipped")
                }
                Err(e) => tracing::warn!(path = %path.display(), error = %e, "invalid registration skipped"),
            }
        }
        Ok(Registry {
            dir: dir.to_owned(),
            sandboxes: Mutex::new(sandboxes),
        })
    }

    /// Records `entry` (replacing an older one of the same id).
    pub fn insert(&self, entry: Entry) -> Result<(), ApiError> {
        let mut sandboxes = self.sandboxes.lock();
        self.write(&entry)?;
        sandboxes.insert(entry.registration.id.clone(), entry);
        Ok(())
    }

    /// Changes sandbox `id`'s entry with `f` and records it, as one step;
    /// false if it is not known.
    pub fn update(&self, id: &SandboxId, f: impl FnOnce(&mut Entry)) -> Result<bool, ApiError> {
        let mut sandboxes = self.sandboxes.lock();
        let Some(entry) = sandboxes.get_mut(id) else {
            return Ok(false);
        };
        let mut changed = entry.clone();
        f(&mut changed);
        self.write(&changed)?;
        *entry = changed;
        Ok(true)
    }

    /// Records `pid` as sandbox `id`'s init after a restore: in memory
    /// always (it is what runs now), on disk if it can be written; a
    /// failure (a full disk) is logged, and the shim's next registration
    /// writes the file again.
    pub fn set_pid(&self, id: &SandboxId, pid: i32) {
        let mut sandboxes = self.sandboxes.lock();
        let Some(entry) = sandboxes.get_mut(id) else {
            return;
        };
        entry.registration.pid = pid;
        if let Err(e) = self.write(entry) {
            tracing::warn!(sandbox = %id, pid, error = %crab_api::error_chain(&e), "the restored init's pid is not recorded on disk");
        }
    }

    /// Writes `entry`'s file durably (fsynced, renamed into place, the
    /// directory fsynced: a host crash leaves the old entry or the new
    /// one). The caller holds the table's lock, so one temporary name is
    /// enough.
    fn write(&self, entry: &Entry) -> Result<(), ApiError> {
        let id = &entry.registration.id;
        let path = self.dir.join(format!("{id}.json"));
        let bytes = serde_json::to_vec_pretty(entry).expect("an entry always serializes");
        crate::store::replace_file(&path, &bytes).map_err(|e| ApiError::Io {
            op: "record the registration",
            source: std::io::Error::other(e),
        })
    }

    /// Forgets sandbox `id` if `still(entry)` holds for its entry (checked
    /// and removed as one step); true if it was removed.
    pub fn remove_if(&self, id: &SandboxId, still: impl FnOnce(&Entry) -> bool) -> bool {
        let mut sandboxes = self.sandboxes.lock();
        if !sandboxes.get(id).is_some_and(still) {
            return false;
        }
        sandboxes.remove(id);
        let _ = std::fs::remove_file(self.dir.join(format!("{id}.json")));
        true
    }

    /// The sandbox whose id is exactly `id`.
    pub fn get(&self, id: &SandboxId) -> Option<Entry> {
        self.sandboxes.lock().get(id).cloned()
    }

    /// Every entry, by id.
    pub fn all(&self) -> Vec<Entry> {
        self.sandboxes.lock().values().cloned().collect()
    }

    /// The running sandboxes' registrations, by id.
    pub fn running(&self) -> Vec<Registration> {
        self.sandboxes
            .lock()
            .values()
            .filter(|e| e.running)
            .map(|e| e.registration.clone())
            .collect()
    }

    /// The running sandbox whose id is `sel` or, failing that, the only
    /// one whose id starts with `sel`.
    ///
    /// # Errors
    /// [`ApiError::NotRunning`] for a stopped one; those of [`Registry::find`].
    pub fn resolve(&self, sel: &SandboxSelector) -> Result<Registration, ApiError> {
        running(self.find(sel)?)
    }

    /// The running sandbox whose id is exactly `id` (what machines ask for:
    /// never a prefix).
    ///
    /// # Errors
    /// [`ApiError::UnknownSandbox`], [`ApiError::NotRunning`].
    pub fn resolve_exact(&self, id: &SandboxId) -> Result<Registration, ApiError> {
        let entry = self
            .get(id)
            .ok_or_else(|| ApiError::UnknownSandbox { sel: id.to_string() })?;
        running(entry)
    }

    /// The sandbox, running or stopped, whose id is `sel` or, failing
    /// that, the only one whose id starts with `sel`.
    ///
    /// # Errors
    /// [`ApiError::UnknownSandbox`], [`ApiError::Ambiguous`].
    pub fn find(&self, sel: &SandboxSelector) -> Result<Entry, ApiError> {
        let sandboxes = self.sandboxes.lock();
        let mut matches = sandboxes.iter().filter(|(id, _)| sel.matches(id));
        let candidates: Vec<&Entry> = match matches.clone().find(|(id, _)| sel.is_exactly(id)) {
            Some((_, exact)) => vec![exact],
            None => matches.by_ref().map(|(_, e)| e).collect(),
        };
        match candidates.as_slice() {
            [one] => Ok((*one).clone()),
            [] => Err(ApiError::UnknownSandbox { sel: sel.to_string() }),
            many => Err(ApiError::Ambiguous {
                sel: sel.to_string(),
                matches: many.iter().map(|e| e.registration.id.clone()).collect(),
            }),
        }
    }
}

fn running(entry: Entry) -> Result<Registration, ApiError> {
    if !entry.running {
        return Err(ApiError::NotRunning {
            id: entry.registration.id,
        });
    }
    Ok(entry.registration)
}
