//! A snapshot's index: for each path, the inode and ctime the live entry had
//! when it was saved, so the next snapshot can tell untouched entries
//! without reading them, and rollback can leave them alone.
//!
//! On disk: `<store>/<name>.index`, JSON `{"format":1,"entries":{path:[ino,ctime_s,ctime_ns]}}`.

use std::collections::BTreeMap;
use std::path::Path;

use serde::{Deserialize, Serialize};

use crate::{Error, Result};

/// Index of one snapshot.
#[derive(Debug, Default, Serialize, Deserialize)]
pub struct Index {
    format: u32,
    /// Live `(ino, ctime_s, ctime_ns)` by path relative to the tree root.
    pub entries: BTreeMap<String, (u64, i64, i64)>,
}

impl Index {
    /// An empty index.
    pub fn new() -> Self {
        Index {
            format: 1,
            entries: BTreeMap::new(),
        }
    }

    /// Reads the index at `path`; a missing file is an empty index (an
    /// imported snapshot has no live entries).
    pub fn load(path: &Path) -> Result<Self> {
        match std::fs::read(path) {
            Ok(bytes) => serde_json::from_slice(&bytes).map_err(|e| Error::BadStream {
                reason: format!("index {}: {e}", path.display()),
            }),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(Index::new()),
            Err(e) => Err(Error::io("read", path)(e)),
        }
    }

    /// Writes the index to `path` (the caller publishes it with a rename).
    pub fn save(&self, path: &Path) -> Result<()> {
        let bytes = serde_json::to_vec(self).map_err(|e| Error::Io {
            op: "encode index",
            path: path.to_owned(),
            source: std::io::Error::other(e),
        })?;
        std::fs::write(path, bytes).map_err(Error::io("write", path))
    }

    /// The inode number the live entry at `rel` had when it was saved.
    pub fn ino(&self, rel: &str) -> Option<u64> {
        self.entries.get(rel).map(|e| e.0)
    }

    /// Whether the live entry `(ino, ctime)` at `rel` is the one saved.
    pub fn untouched(&self, rel: &str, ino: u64, ctime: (i64, i64)) -> bool {
        self.entries.get(rel) == Some(&(ino, ctime.0, ctime.1))
    }
}
