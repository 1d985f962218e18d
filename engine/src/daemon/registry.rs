//! The running sandboxes that shims registered, kept on disk so that a
//! restarted crabd still knows them.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use parking_lot::Mutex;

use super::ApiError;
use crate::api::Registration;
use crate::SandboxId;

/// Registered sandboxes by id; each is also a file `<dir>/<id>.json`.
#[derive(Debug)]
pub struct Registry {
    dir: PathBuf,
    sandboxes: Mutex<BTreeMap<String, Registration>>,
}

// === impl Registry ===

impl Registry {
    /// Loads the registrations under `dir` (created if missing); unreadable
    /// files are logged and skipped.
    pub fn open(dir: &Path) -> std::io::Result<Registry> {
        std::fs::create_dir_all(dir)?;
        let mut sandboxes = BTreeMap::new();
        for entry in std::fs::read_dir(dir)? {
            let path = entry?.path();
            if path.extension().is_none_or(|e| e != "json") {
                continue;
            }
            match std::fs::read(&path)
                .map_err(|e| e.to_string())
                .and_then(|b| serde_json::from_slice::<Registration>(&b).map_err(|e| e.to_string()))
            {
                Ok(r) if SandboxId::new(&r.id).is_ok() => {
                    sandboxes.insert(r.id.clone(), r);
                }
                Ok(r) => tracing::warn!(id = r.id, "registration with an invalid id skipped"),
                Err(e) => tracing::warn!(path = %path.display(), "unreadable registration skipped: {e}"),
            }
        }
        Ok(Registry {
            dir: dir.to_owned(),
            sandboxes: Mutex::new(sandboxes),
        })
    }

    /// Records `reg` (replacing an older registration of the same id).
    pub fn insert(&self, reg: Registration) -> Result<(), ApiError> {
        SandboxId::new(&reg.id)?;
        let path = self.dir.join(format!("{}.json", reg.id));
        let tmp = self.dir.join(format!(".{}.json.tmp", reg.id));
        let bytes = serde_json::to_vec_pretty(&reg).expect("a registration always serializes");
        std::fs::write(&tmp, bytes)
            .and_then(|()| std::fs::rename(&tmp, &path))
            .map_err(|source| ApiError::Io {
                op: "record the registration",
                source,
            })?;
        self.sandboxes.lock().insert(reg.id.clone(), reg);
        Ok(())
    }

    /// Forgets sandbox `id`; true if it was registered.
    pub fn remove(&self, id: &str) -> bool {
        let known = self.sandboxes.lock().remove(id).is_some();
        if known {
            let _ = std::fs::remove_file(self.dir.join(format!("{id}.json")));
        }
        known
    }

    /// The sandbox whose id is exactly `id`.
    pub fn get(&self, id: &str) -> Option<Registration> {
        self.sandboxes.lock().get(id).cloned()
    }

    /// Every registration, by id.
    pub fn all(&self) -> Vec<Registration> {
        self.sandboxes.lock().values().cloned().collect()
    }

    /// The sandbox whose id is `sel` or, failing that, the only one whose
    /// id starts with `sel`.
    pub fn resolve(&self, sel: &str) -> Result<Registration, ApiError> {
        let sandboxes = self.sandboxes.lock();
        if let Some(r) = sandboxes.get(sel) {
            return Ok(r.clone());
        }
        let matches: Vec<&Registration> = sandboxes
            .range(sel.to_owned()..)
            .take_while(|(id, _)| id.starts_with(sel))
            .map(|(_, r)| r)
            .collect();
        match (matches.as_slice(), sel.is_empty()) {
            ([one], false) => Ok((*one).clone()),
            ([], _) | (_, true) => Err(ApiError::UnknownSandbox { sel: sel.to_owned() }),
            (many, false) => Err(ApiError::Ambiguous {
                sel: sel.to_owned(),
                matches: many.iter().map(|r| r.id.clone()).collect(),
            }),
        }
    }
}
