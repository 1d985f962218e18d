//! `containerd-crab-snapshotter`: a containerd snapshotter (proxy plugin) on
//! ZFS. Committed layers are dataset snapshots (`<root>/<id>@committed`),
//! active snapshots are clones of their parent's (or new datasets), views
//! are read-only clones; ZFS mounts the datasets and containerd gets bind
//! mounts of them, so it works with zfs-fuse and OpenZFS alike.
//!
//! Invariant: a dataset is created before the metadata that names it is
//! committed, and metadata is removed before its dataset is destroyed, so
//! after a crash at any point the only possible leftover is a dataset no
//! record names; [`ZfsSnapshotter::reconcile`] (at start and on Cleanup)
//! destroys those.

mod meta;

use std::collections::HashMap;
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::time::SystemTime;

use containerd_snapshots::{api, tonic, Info, Kind, Snapshotter, Usage};
use tokio_stream::Stream;

use self::meta::{MetaStore, Record, RecordKind};
use crate::command::run;
use crate::zfs::run_settled;

const ZFS: &str = "zfs";
const COMMITTED: &str = "committed";
/// Environment variable naming a crash point, for fault-injection tests.
pub const CRASH_ENV: &str = "CRAB_SNAPSHOTTER_CRASH_AT";

/// The ZFS snapshotter.
pub struct ZfsSnapshotter {
    inner: Arc<Inner>,
}

/// The datasets directly under `root` that are the snapshotter's: each
/// snapshot's `<root>/<number>`, and the generations its rollbacks by
/// clone retired, `<root>/<number>.gen-<k>` (see `ZfsBackend`), with
/// their numbers.
fn children(root: &str) -> Result<Vec<(u64, Option<u64>, String)>> {
    let out = run(
        ZFS,
        &[
            "list",
            "-H",
            "-o",
            "name",
            "-t",
            "filesystem",
            "-r",
            "-d",
            "1",
            root,
        ],
    )?;
    Ok(out
        .lines()
        .filter_map(|l| {
            let name = l.strip_prefix(&format!("{root}/"))?;
            let (id, generation) = match name.split_once(".gen-") {
                Some((id, k)) => (id.parse().ok()?, Some(k.parse().ok()?)),
                None => (name.parse().ok()?, None),
            };
            Some((id, generation, l.to_owned()))
        })
        .collect())
}

/// Destroys a removed snapshot's dataset `ds`, if it is there, then the
/// generations its rollbacks by clone retired, newest first (`ds` may be
/// a clone of one, each of an older one), then its swap lock's file.
fn destroy_with_generations(ds: &str) -> Result<()> {
    let backend = crate::ZfsBackend::new(ds)?;
    // Under the swap lock (no rollback is under way), whose file goes
    // while it is held.
    let _swap = backend.swap_lock()?;
    if run(ZFS, &["list", "-H", "-o", "name", ds]).is_ok() {
        run_settled(&["destroy", "-r", ds])?;
    }
    for (_, generation) in backend.generations()?.into_iter().rev() {
        run_settled(&["destroy", "-r", &generation])?;
    }
    let _ = std::fs::remove_file(backend.swap_lock_path());
    Ok(())
}

/// Makes the directory where `root` is mounted 0700: every dataset (and
/// its `.zfs/snapshot`) is mounted beneath it, with the sandbox's files and
/// their modes, which no other host user may reach. containerd, as root,
/// bind-mounts them all the same.
fn private_mountpoint(root: &str) -> Result<()> {
    use std::os::unix::fs::PermissionsExt;
    let mp = run(ZFS, &["get", "-H", "-o", "value", "mountpoint", root])?;
    let mp = std::path::Path::new(mp.trim());
    if mp.is_absolute() && mp.is_dir() {
        std::fs::set_permissions(mp, std::fs::Permissions::from_mode(0o700))
            .map_err(|e| SnapshotterError::meta("make the root's mountpoint 0700", e))?;
    }
    Ok(())
}

struct Inner {
    root: String,
    meta: MetaStore,
    /// Serializes mutations: each checks, then changes ZFS and metadata.
    lock: Mutex<()>,
    crash_at: Option<String>,
}

/// What a snapshotter call can fail with.
#[derive(Debug, thiserror::Error)]
pub enum SnapshotterError {
    /// No snapshot with this key.
    #[error("snapshot {key} does not exist")]
    NotFound {
        /// The key.
        key: String,
    },
    /// The key is taken.
    #[error("snapshot {key} already exists")]
    AlreadyExists {
        /// The key.
        key: String,
    },
    /// The parent is not a committed snapshot.
    #[error("parent {parent} is not committed")]
    ParentNotCommitted {
        /// The parent key.
        parent: String,
    },
    /// Only an active snapshot can be committed.
    #[error("snapshot {key} is not active")]
    NotActive {
        /// The key.
        key: String,
    },
    /// Other snapshots are based on this one.
    #[error("snapshot {key} has children ({child} is based on it)")]
    HasChildren {
        /// The key.
        key: String,
        /// One child.
        child: String,
    },
    /// A ZFS command failed (a full or missing pool shows here).
    #[error("zfs")]
    Zfs(#[from] crate::Error),
    /// The metadata database failed.
    #[error("metadata {op}")]
    Meta {
        /// The operation.
        op: &'static str,
        /// What failed.
        #[source]
        source: Box<dyn std::error::Error + Send + Sync>,
    },
    /// The metadata database is gone while datasets it would name are
    /// there: serving would take them all for leftovers and destroy them.
    #[error(
        "metadata {} is missing but {datasets} datasets are under {root}: refusing to start \
         (put the metadata back, or destroy the datasets with `zfs destroy -r` if they are not wanted)",
        path.display()
    )]
    MetadataLost {
        /// The database file.
        path: std::path::PathBuf,
        /// The root dataset.
        root: String,
        /// How many datasets are under it.
        datasets: usize,
    },
    /// A blocking task could not finish.
    #[error("snapshotter task failed")]
    Task(#[source] tokio::task::JoinError),
}

impl SnapshotterError {
    fn meta(op: &'static str, e: impl std::error::Error + Send + Sync + 'static) -> Self {
        SnapshotterError::Meta {
            op,
            source: Box::new(e),
        }
    }
}

impl From<SnapshotterError> for tonic::Status {
    fn from(e: SnapshotterError) -> Self {
        let mut msg = e.to_string();
        let mut source = std::error::Error::source(&e);
        while let Some(s) = source {
            msg.push_str(": ");
            msg.push_str(&s.to_string());
            source = s.source();
        }
        match e {
            SnapshotterError::NotFound { .. } => tonic::Status::not_found(msg),
            SnapshotterError::AlreadyExists { .. } => tonic::Status::already_exists(msg),
            SnapshotterError::ParentNotCommitted { .. }
            | SnapshotterError::NotActive { .. }
            | SnapshotterError::HasChildren { .. } => tonic::Status::failed_precondition(msg),
            SnapshotterError::Zfs(_) => tonic::Status::unavailable(msg),
            SnapshotterError::MetadataLost { .. } => tonic::Status::failed_precondition(msg),
            SnapshotterError::Meta { .. } | SnapshotterError::Task(_) => tonic::Status::internal(msg),
        }
    }
}

type Result<T> = std::result::Result<T, SnapshotterError>;

impl ZfsSnapshotter {
    /// Serves datasets under `root` (which must exist), with metadata in
    /// the database file `meta_path`; reconciles both before returning.
    ///
    /// # Errors
    /// The root dataset is missing, or the database cannot be opened.
    pub fn open(root: &str, meta_path: &std::path::Path) -> Result<Self> {
        crate::ZfsBackend::new(root)?;
        run(ZFS, &["list", "-H", "-o", "name", root])?;
        if let Some(dir) = meta_path.parent() {
            std::fs::create_dir_all(dir).map_err(|e| SnapshotterError::meta("create directory", e))?;
        }
        if !meta_path.exists() {
            // A first start finds no datasets; one that finds some lost its
            // metadata (reconcile would destroy them all).
            let datasets = children(root)?.len();
            if datasets > 0 {
                return Err(SnapshotterError::MetadataLost {
                    path: meta_path.to_owned(),
                    root: root.to_owned(),
                    datasets,
                });
            }
        }
        private_mountpoint(root)?;
        let inner = Inner {
            root: root.to_owned(),
            meta: MetaStore::open(meta_path)?,
            lock: Mutex::new(()),
            crash_at: std::env::var(CRASH_ENV).ok(),
        };
        inner.settle_rollbacks()?;
        inner.reconcile()?;
        Ok(ZfsSnapshotter {
            inner: Arc::new(inner),
        })
    }

    /// Destroys datasets no record names (leftovers of a crash).
    pub fn reconcile(&self) -> Result<()> {
        self.inner.reconcile()
    }

    async fn blocking<T, F>(&self, f: F) -> Result<T>
    where
        T: Send + 'static,
        F: FnOnce(&Inner) -> Result<T> + Send + 'static,
    {
        let inner = self.inner.clone();
        tokio::task::spawn_blocking(move || f(&inner))
            .await
            .map_err(SnapshotterError::Task)?
    }
}

// === impl Inner ===

impl Inner {
    fn dataset(&self, id: u64) -> String {
        format!("{}/{id}", self.root)
    }

    fn crash_point(&self, point: &str) {
        if self.crash_at.as_deref() == Some(point) {
            tracing::error!(point, "crash point reached: killing myself");
            let _ = nix::sys::signal::raise(nix::sys::signal::Signal::SIGKILL);
        }
    }

    fn record(&self, key: &str) -> Result<Record> {
        self.meta
            .get(key)?
            .ok_or_else(|| SnapshotterError::NotFound { key: key.to_owned() })
    }

    fn create(
        &self,
        key: &str,
        parent: &str,
        labels: HashMap<String, String>,
        kind: RecordKind,
    ) -> Result<Vec<api::types::Mount>> {
        let _g = self.lock.lock().expect("snapshotter lock");
        if self.meta.get(key)?.is_some() {
            return Err(SnapshotterError::AlreadyExists { key: key.to_owned() });
        }
        let origin = if parent.is_empty() {
            None
        } else {
            let p = self.meta.get(parent)?.ok_or_else(|| SnapshotterError::NotFound {
                key: parent.to_owned(),
            })?;
            if p.kind != RecordKind::Committed {
                return Err(SnapshotterError::ParentNotCommitted {
                    parent: parent.to_owned(),
                });
            }
            Some(format!("{}@{COMMITTED}", self.dataset(p.id)))
        };
        let id = self.meta.next_id()?;
        let ds = self.dataset(id);
        let ro = if kind == RecordKind::View {
            "readonly=on"
        } else {
            "readonly=off"
        };
        match &origin {
            Some(o) => run(ZFS, &["clone", "-o", ro, o, &ds])?,
            None => run(ZFS, &["create", "-o", ro, &ds])?,
        };
        self.crash_point("prepare-after-dataset");
        let now = SystemTime::now();
        let rec = Record {
            id,
            kind,
            parent: parent.to_owned(),
            labels,
            created_at: now,
            updated_at: now,
        };
        if let Err(e) = self.meta.apply(&[(key, Some(&rec))]) {
            let _ = run(ZFS, &["destroy", "-r", &ds]);
            return Err(e);
        }
        tracing::info!(key, dataset = %ds, "prepared");
        self.mounts_of(&rec)
    }

    fn mounts_of(&self, rec: &Record) -> Result<Vec<api::types::Mount>> {
        let ds = self.dataset(rec.id);
        let mp = run(ZFS, &["get", "-H", "-o", "value", "mountpoint", &ds])?;
        let mode = if rec.kind == RecordKind::Active {
            "rw"
        } else {
            "ro"
        };
        Ok(vec![api::types::Mount {
            r#type: "bind".to_owned(),
            source: mp.trim().to_owned(),
            target: String::new(),
            options: vec!["rbind".to_owned(), mode.to_owned()],
        }])
    }

    fn commit(&self, name: &str, key: &str, labels: HashMap<String, String>) -> Result<()> {
        let _g = self.lock.lock().expect("snapshotter lock");
        let rec = self.record(key)?;
        if rec.kind != RecordKind::Active {
            return Err(SnapshotterError::NotActive { key: key.to_owned() });
        }
        if self.meta.get(name)?.is_some() {
            return Err(SnapshotterError::AlreadyExists { key: name.to_owned() });
        }
        let ds = self.dataset(rec.id);
        let snap = format!("{ds}@{COMMITTED}");
        // A crashed commit may have taken the snapshot already.
        if run(ZFS, &["list", "-H", "-o", "name", "-t", "snapshot", &snap]).is_err() {
            run(ZFS, &["snapshot", &snap])?;
        }
        self.crash_point("commit-after-snapshot");
        run(ZFS, &["set", "readonly=on", &ds])?;
        let now = SystemTime::now();
        let committed = Record {
            id: rec.id,
            kind: RecordKind::Committed,
            parent: rec.parent.clone(),
            labels,
            created_at: now,
            updated_at: now,
        };
        self.meta.apply(&[(key, None), (name, Some(&committed))])?;
        tracing::info!(key, name, dataset = %ds, "committed");
        Ok(())
    }

    fn remove(&self, key: &str) -> Result<()> {
        let _g = self.lock.lock().expect("snapshotter lock");
        let rec = self.record(key)?;
        if let Some((child, _)) = self.meta.all()?.into_iter().find(|(_, r)| r.parent == key) {
            return Err(SnapshotterError::HasChildren {
                key: key.to_owned(),
                child,
            });
        }
        self.meta.apply(&[(key, None)])?;
        self.crash_point("remove-after-meta");
        let ds = self.dataset(rec.id);
        if let Err(e) = destroy_with_generations(&ds) {
            // The record is gone; reconcile reclaims the dataset later.
            tracing::warn!(key, dataset = %ds, error = %e, "dataset left for cleanup");
        }
        tracing::info!(key, dataset = %ds, "removed");
        Ok(())
    }

    /// Settles every record's rollback by clone that a crash cut short
    /// (at start, before `reconcile`, so no dataset of a record is
    /// missing there). One that cannot be settled is said, and stops
    /// nothing else.
    fn settle_rollbacks(&self) -> Result<()> {
        let _g = self.lock.lock().expect("snapshotter lock");
        for (key, rec) in &self.meta.all()? {
            let settled =
                crate::ZfsBackend::new(&self.dataset(rec.id)).and_then(|b| b.finish_interrupted_rollback());
            match settled {
                Ok(true) => tracing::warn!(key, id = rec.id, "settled a rollback a crash cut short"),
                Ok(false) => {}
                Err(e) => {
                    tracing::warn!(key, id = rec.id, error = %e, "a rollback a crash cut short is not settled")
                }
            }
        }
        Ok(())
    }

    fn reconcile(&self) -> Result<()> {
        let _g = self.lock.lock().expect("snapshotter lock");
        let records = self.meta.all()?;
        let known: HashMap<u64, &Record> = records.iter().map(|(_, r)| (r.id, r)).collect();
        let mut orphans: Vec<(u64, Option<u64>, String)> = children(&self.root)?
            .into_iter()
            .filter(|(id, _, _)| !known.contains_key(id))
            .collect();
        // Clones have larger ids than their origins: destroy them first;
        // of one id, the live dataset first, then its generations newest
        // first (each may be a clone of an older one).
        use std::cmp::Reverse;
        orphans
            .sort_by_key(|&(id, generation, _)| (Reverse(id), generation.map_or(Reverse(u64::MAX), Reverse)));
        for (_, _, ds) in orphans {
            tracing::warn!(dataset = %ds, "destroying a dataset no snapshot names");
            // One that cannot go yet (busy, a clone outside) stops nothing
            // else: the next reconcile tries again.
            if let Err(e) = run_settled(&["destroy", "-r", &ds]) {
                tracing::warn!(dataset = %ds, error = %e, "a dataset no snapshot names stays for now");
            }
        }
        // An active snapshot whose commit crashed after `zfs snapshot`.
        for (key, rec) in &records {
            if rec.kind == RecordKind::Active {
                let snap = format!("{}@{COMMITTED}", self.dataset(rec.id));
                if run(ZFS, &["list", "-H", "-o", "name", "-t", "snapshot", &snap]).is_ok() {
                    tracing::warn!(key, snapshot = %snap, "destroying the snapshot of an unfinished commit");
                    run(ZFS, &["destroy", &snap])?;
                }
            }
        }
        Ok(())
    }
}

fn info(key: &str, rec: &Record) -> Info {
    Info {
        kind: match rec.kind {
            RecordKind::View => Kind::View,
            RecordKind::Active => Kind::Active,
            RecordKind::Committed => Kind::Committed,
        },
        name: key.to_owned(),
        parent: rec.parent.clone(),
        labels: rec.labels.clone(),
        created_at: rec.created_at,
        updated_at: rec.updated_at,
    }
}

#[tonic::async_trait]
impl Snapshotter for ZfsSnapshotter {
    type Error = SnapshotterError;
    type InfoStream = Pin<Box<dyn Stream<Item = Result<Info>> + Send + 'static>>;

    async fn stat(&self, key: String) -> Result<Info> {
        self.blocking(move |i| Ok(info(&key, &i.record(&key)?))).await
    }

    async fn update(&self, new: Info, fieldpaths: Option<Vec<String>>) -> Result<Info> {
        self.blocking(move |i| {
            let _g = i.lock.lock().expect("snapshotter lock");
            let mut rec = i.record(&new.name)?;
            match fieldpaths.filter(|f| !f.is_empty()) {
                // No paths: labels are replaced (containerd's semantics).
                None => rec.labels = new.labels,
                Some(paths) => {
                    for p in paths {
                        if p == "labels" {
                            rec.labels = new.labels.clone();
                        } else if let Some(l) = p.strip_prefix("labels.") {
                            match new.labels.get(l) {
                                Some(v) => rec.labels.insert(l.to_owned(), v.clone()),
                                None => rec.labels.remove(l),
                            };
                        }
                    }
                }
            }
            rec.updated_at = SystemTime::now();
            i.meta.apply(&[(&new.name, Some(&rec))])?;
            Ok(info(&new.name, &rec))
        })
        .await
    }

    async fn usage(&self, key: String) -> Result<Usage> {
        self.blocking(move |i| {
            let rec = i.record(&key)?;
            let out = run(
                ZFS,
                &["get", "-H", "-p", "-o", "value", "used", &i.dataset(rec.id)],
            )?;
            Ok(Usage {
                inodes: 0,
                size: out.trim().parse().unwrap_or(0),
            })
        })
        .await
    }

    async fn mounts(&self, key: String) -> Result<Vec<api::types::Mount>> {
        self.blocking(move |i| {
            let rec = i.record(&key)?;
            i.mounts_of(&rec)
        })
        .await
    }

    async fn prepare(
        &self,
        key: String,
        parent: String,
        labels: HashMap<String, String>,
    ) -> Result<Vec<api::types::Mount>> {
        self.blocking(move |i| i.create(&key, &parent, labels, RecordKind::Active))
            .await
    }

    async fn view(
        &self,
        key: String,
        parent: String,
        labels: HashMap<String, String>,
    ) -> Result<Vec<api::types::Mount>> {
        self.blocking(move |i| i.create(&key, &parent, labels, RecordKind::View))
            .await
    }

    async fn commit(&self, name: String, key: String, labels: HashMap<String, String>) -> Result<()> {
        self.blocking(move |i| i.commit(&name, &key, labels)).await
    }

    async fn remove(&self, key: String) -> Result<()> {
        self.blocking(move |i| i.remove(&key)).await
    }

    async fn clear(&self) -> Result<()> {
        self.blocking(|i| i.reconcile()).await
    }

    async fn list(&self, _snapshotter: String, _filters: Vec<String>) -> Result<Self::InfoStream> {
        // containerd filters in its own metadata layer; all are returned.
        let records = self.blocking(|i| i.meta.all()).await?;
        let infos: Vec<Result<Info>> = records.iter().map(|(k, r)| Ok(info(k, r))).collect();
        Ok(Box::pin(tokio_stream::iter(infos)))
    }
}
