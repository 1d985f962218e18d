//! The snapshotter's metadata: one record per containerd snapshot key, in a
//! redb database (crash-safe: a transaction is durable once committed, and
//! a torn one is never seen).
//!
//! Tables: `snapshots` (key → JSON [`Record`]) and `counters`
//! (`"next_id"` → the next dataset id). A key's dataset is `<root>/<id>`.

use std::collections::HashMap;
use std::path::Path;
use std::time::SystemTime;

use redb::{Database, ReadableDatabase, ReadableTable, TableDefinition};
use serde::{Deserialize, Serialize};

use super::SnapshotterError as Error;

const SNAPSHOTS: TableDefinition<&str, &[u8]> = TableDefinition::new("snapshots");
const COUNTERS: TableDefinition<&str, u64> = TableDefinition::new("counters");

/// The kind of a snapshot, as containerd names it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum RecordKind {
    /// Read-only view of a committed parent.
    View,
    /// Writable, not yet committed.
    Active,
    /// Committed: immutable, a parent for others.
    Committed,
}

/// What the snapshotter keeps per key.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Record {
    /// The dataset id: the dataset is `<root>/<id>`.
    pub id: u64,
    /// Its kind.
    pub kind: RecordKind,
    /// The parent key (committed), or empty.
    pub parent: String,
    /// containerd's labels.
    pub labels: HashMap<String, String>,
    /// Creation time.
    pub created_at: SystemTime,
    /// Last update time.
    pub updated_at: SystemTime,
}

/// The metadata database.
pub struct MetaStore {
    db: Database,
}

impl MetaStore {
    /// Opens (or creates) the database at `path`.
    pub fn open(path: &Path) -> Result<Self, Error> {
        let db = Database::create(path).map_err(|e| Error::meta("open", e))?;
        let tx = db.begin_write().map_err(|e| Error::meta("open", e))?;
        tx.open_table(SNAPSHOTS).map_err(|e| Error::meta("open", e))?;
        tx.open_table(COUNTERS).map_err(|e| Error::meta("open", e))?;
        tx.commit().map_err(|e| Error::meta("open", e))?;
        Ok(MetaStore { db })
    }

    /// The record of `key`.
    pub fn get(&self, key: &str) -> Result<Option<Record>, Error> {
        let tx = self.db.begin_read().map_err(|e| Error::meta("read", e))?;
        let t = tx.open_table(SNAPSHOTS).map_err(|e| Error::meta("read", e))?;
        match t.get(key).map_err(|e| Error::meta("read", e))? {
            Some(v) => Ok(Some(decode(v.value())?)),
            None => Ok(None),
        }
    }

    /// Every record, by key.
    pub fn all(&self) -> Result<Vec<(String, Record)>, Error> {
        let tx = self.db.begin_read().map_err(|e| Error::meta("read", e))?;
        let t = tx.open_table(SNAPSHOTS).map_err(|e| Error::meta("read", e))?;
        let mut out = Vec::new();
        for item in t.iter().map_err(|e| Error::meta("read", e))? {
            let (k, v) = item.map_err(|e| Error::meta("read", e))?;
            out.push((k.value().to_owned(), decode(v.value())?));
        }
        Ok(out)
    }

    /// Reserves a new dataset id (durably, so it is never reused).
    pub fn next_id(&self) -> Result<u64, Error> {
        let tx = self.db.begin_write().map_err(|e| Error::meta("write", e))?;
        let id = {
            let mut t = tx.open_table(COUNTERS).map_err(|e| Error::meta("write", e))?;
            let id = t
                .get("next_id")
                .map_err(|e| Error::meta("write", e))?
                .map_or(1, |v| v.value());
            t.insert("next_id", id + 1).map_err(|e| Error::meta("write", e))?;
            id
        };
        tx.commit().map_err(|e| Error::meta("write", e))?;
        Ok(id)
    }

    /// Writes `changes` in one transaction: `Some` puts, `None` removes.
    pub fn apply(&self, changes: &[(&str, Option<&Record>)]) -> Result<(), Error> {
        let tx = self.db.begin_write().map_err(|e| Error::meta("write", e))?;
        {
            let mut t = tx.open_table(SNAPSHOTS).map_err(|e| Error::meta("write", e))?;
            for (key, rec) in changes {
                match rec {
                    Some(r) => {
                        let bytes = serde_json::to_vec(r).map_err(|e| Error::meta("encode", e))?;
                        t.insert(*key, bytes.as_slice())
                            .map_err(|e| Error::meta("write", e))?;
                    }
                    None => {
                        t.remove(*key).map_err(|e| Error::meta("write", e))?;
                    }
                }
            }
        }
        tx.commit().map_err(|e| Error::meta("write", e))
    }
}

fn decode(bytes: &[u8]) -> Result<Record, Error> {
    serde_json::from_slice(bytes).map_err(|e| Error::meta("decode", e))
}
