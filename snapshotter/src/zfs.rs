//! The ZFS backend, driving the `zfs` command (OpenZFS and zfs-fuse alike).
//!
//! A sandbox's writable layer is one dataset `D`; its snapshots are
//! `D@crab-<name>`. Rolling back to the newest snapshot of `D` is an in-place
//! `zfs rollback`. Rolling back further would need `zfs rollback -r`, which
//! destroys every newer snapshot; instead the live dataset is retired as
//! `D.gen-<k>` (unmounted, its snapshots kept) and `D` is re-made as a clone
//! of the wanted snapshot at the same mount point. The sandbox's snapshots
//! are those of `D` and of its retired generations.
//!
//! That swap is journaled in two user properties set on `D` before its
//! first step (they move with it when it is retired): the clone's origin
//! and mount point. A crash in the middle leaves either `D` unmounted with
//! the journal (the swap had not begun: undone, `D` mounted again) or no `D`
//! and a generation with the journal (finished: the clone made). See
//! [`ZfsBackend::finish_interrupted_rollback`]. A rollback and the settling
//! of one take the dataset's swap lock, so a snapshotter started again in
//! the middle of a shim's rollback waits for it rather than settling a
//! swap still under way.

use std::io::{Read, Write};
use std::path::PathBuf;

use crate::command::{run, run_from, run_to};
use crate::{Backend, BackendKind, Change, Error, Location, Result, Snapshot, SnapshotName};

const ZFS: &str = "zfs";
const PREFIX: &str = "crab-";
/// The journal of a rollback by clone: the clone's origin.
const JOURNAL_ORIGIN: &str = "crab:rollback-origin";
/// The journal of a rollback by clone: the live dataset's mount point.
const JOURNAL_MOUNT: &str = "crab:rollback-mountpoint";
/// Where a dataset's swap lock lives (see [`ZfsBackend::swap_lock`]).
const SWAP_LOCK_DIR: &str = "/run/crab/zfs-swap";

/// A sandbox's dataset and its snapshots.
#[derive(Debug, Clone)]
pub struct ZfsBackend {
    dataset: String,
}

/// One snapshot as `zfs list` shows it.
struct Listed {
    full: String,
    name: SnapshotName,
    used: Option<u64>,
}

impl ZfsBackend {
    /// A backend for `dataset` (which need not exist yet).
    ///
    /// # Errors
    /// [`Error::InvalidDataset`] for a name that is not `pool/path`.
    pub fn new(dataset: &str) -> Result<Self> {
        let ok = !dataset.is_empty()
            && dataset.split('/').all(|c| {
                !c.is_empty()
                    && !c.starts_with('-')
                    && c.bytes()
                        .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'_' | b'.' | b':' | b'-'))
            });
        if !ok {
            return Err(Error::InvalidDataset {
                dataset: dataset.to_owned(),
            });
        }
        Ok(ZfsBackend {
            dataset: dataset.to_owned(),
        })
    }

    /// The dataset mounted at `mountpoint`, if one is (how a rootfs that
    /// a ZFS snapshotter bind-mounts is recognised). Runs `zfs list`; no
    /// `zfs` command, no pool or no daemon is no dataset.
    pub fn dataset_at(mountpoint: &std::path::Path) -> Option<String> {
        let out = run(ZFS, &["list", "-H", "-o", "name,mountpoint", "-t", "filesystem"]).ok()?;
        out.lines()
            .filter_map(|l| l.split_once('\t'))
            .find(|(_, mp)| std::path::Path::new(mp) == mountpoint)
            .map(|(name, _)| name.to_owned())
    }

    /// Creates `dataset` (and missing parents) and returns its backend.
    pub fn create(dataset: &str) -> Result<Self> {
        let b = ZfsBackend::new(dataset)?;
        run(ZFS, &["create", "-p", dataset])?;
        Ok(b)
    }

    /// The dataset holding the live tree.
    pub fn dataset(&self) -> &str {
        &self.dataset
    }

    /// Holds the dataset's swap lock until dropped. A rollback (the
    /// shim's) and the settling of one cut short (crabzfs's, at its start)
    /// never run at once on one dataset: settling a swap still under way
    /// would mount the dataset the rollback is about to rename, or make
    /// the clone it is about to make. The lock goes with its holder's
    /// death; the journal is what a crash leaves.
    ///
    /// # Errors
    /// [`Error::Io`] when the lock file cannot be made or locked.
    pub fn swap_lock(&self) -> Result<nix::fcntl::Flock<std::fs::File>> {
        crate::host_lock::lock(&self.swap_lock_path())
    }

    /// The file of [`ZfsBackend::swap_lock`]; removed with the dataset
    /// (by crabzfs), when nothing can roll it back any more.
    pub(crate) fn swap_lock_path(&self) -> PathBuf {
        // A dataset's name has no '@'; a file name has no '/'.
        std::path::Path::new(SWAP_LOCK_DIR).join(format!("{}.lock", self.dataset.replace('/', "@")))
    }

    fn exists(&self, dataset: &str) -> bool {
        run(ZFS, &["list", "-H", "-o", "name", dataset]).is_ok()
    }

    /// The parent dataset under which `D` and its generations live.
    fn parent(&self) -> Option<&str> {
        self.dataset.rsplit_once('/').map(|(p, _)| p)
    }

    /// Retired generations of the live dataset, by number.
    pub(crate) fn generations(&self) -> Result<Vec<(u64, String)>> {
        let Some(parent) = self.parent() else {
            return Ok(Vec::new());
        };
        let out = run(
            ZFS,
            &["list", "-H", "-o", "name", "-t", "filesystem", "-r", parent],
        )?;
        let prefix = format!("{}.gen-", self.dataset);
        let mut gens: Vec<(u64, String)> = out
            .lines()
            .filter_map(|l| Some((l.strip_prefix(&prefix)?.parse().ok()?, l.to_owned())))
            .collect();
        gens.sort();
        Ok(gens)
    }

    /// Every snapshot of the sandbox (live dataset and generations), oldest first.
    fn listed(&self) -> Result<Vec<Listed>> {
        let mut datasets: Vec<String> = self.generations()?.into_iter().map(|(_, d)| d).collect();
        if self.exists(&self.dataset) {
            datasets.push(self.dataset.clone());
        }
        let mut out = Vec::new();
        for ds in datasets {
            // zfs-fuse's `list` has no -p: sizes come from `get -p`.
            let order = run(
                ZFS,
                &[
                    "list", "-H", "-t", "snapshot", "-o", "name", "-s", "creation", "-r", &ds,
                ],
            )?;
            let sizes = run(ZFS, &["get", "-H", "-p", "-o", "name,value", "used", "-r", &ds])?;
            let used = |full: &str| {
                sizes
                    .lines()
                    .filter_map(|l| l.split_once('\t'))
                    .find(|(n, _)| *n == full)
                    .and_then(|(_, v)| v.trim().parse().ok())
            };
            for full in order.lines() {
                let Some((owner, snap)) = full.split_once('@') else {
                    continue;
                };
                if owner != ds {
                    continue;
                }
                let Some(name) = snap.strip_prefix(PREFIX).and_then(|n| SnapshotName::new(n).ok()) else {
                    continue;
                };
                out.push(Listed {
                    full: full.to_owned(),
                    name,
                    used: used(full),
                });
            }
        }
        Ok(out)
    }

    fn find(&self, name: &SnapshotName) -> Result<Listed> {
        self.listed()?
            .into_iter()
            .find(|l| &l.name == name)
            .ok_or_else(|| Error::NoSnapshot {
                name: name.to_string(),
            })
    }

    /// A user property set on `dataset` itself (not inherited), if any.
    fn local_property(dataset: &str, property: &str) -> Result<Option<String>> {
        let out = run(ZFS, &["get", "-H", "-o", "value,source", property, dataset])?;
        let line = out.lines().next().unwrap_or_default();
        match line.rsplit_once('\t') {
            Some((value, "local")) => Ok(Some(value.to_owned())),
            _ => Ok(None),
        }
    }

    fn clear_journal(dataset: &str) {
        for property in [JOURNAL_ORIGIN, JOURNAL_MOUNT] {
            let _ = run(ZFS, &["inherit", property, dataset]);
        }
    }

    /// Settles a rollback by clone that a crash cut short (see the
    /// module's doc): answers whether there was one. Safe to call at any
    /// time: without a journal it changes nothing, and a rollback under
    /// way is waited for (its swap lock).
    ///
    /// # Errors
    /// [`Error::Command`] when a `zfs` step fails (the journal stays, and
    /// the next call tries again).
    pub fn finish_interrupted_rollback(&self) -> Result<bool> {
        let _swap = self.swap_lock()?;
        if self.exists(&self.dataset) {
            let mut settled = false;
            // Journaled but never retired: the swap had not begun.
            if Self::local_property(&self.dataset, JOURNAL_ORIGIN)?.is_some() {
                let mounted = run(ZFS, &["get", "-H", "-o", "value", "mounted", &self.dataset])?;
                if mounted.trim() != "yes" {
                    run_settled(&["mount", &self.dataset])?;
                }
                Self::clear_journal(&self.dataset);
                settled = true;
            }
            // A generation whose clone was made: only its journal is left.
            for (_, generation) in self.generations()? {
                if Self::local_property(&generation, JOURNAL_ORIGIN)?.is_some() {
                    Self::clear_journal(&generation);
                }
            }
            return Ok(settled);
        }
        // Retired, not yet replaced: make the clone the journal names.
        let Some((_, retired)) = self.generations()?.pop() else {
            return Ok(false);
        };
        let (Some(origin), Some(mountpoint)) = (
            Self::local_property(&retired, JOURNAL_ORIGIN)?,
            Self::local_property(&retired, JOURNAL_MOUNT)?,
        ) else {
            return Ok(false);
        };
        run(ZFS, &["set", "mountpoint=none", &retired])?;
        self.clone_in_place(&origin, &mountpoint)?;
        Self::clear_journal(&retired);
        Ok(true)
    }

    /// Makes the live dataset a clone of snapshot `origin`, mounted at
    /// `mountpoint`.
    fn clone_in_place(&self, origin: &str, mountpoint: &str) -> Result<()> {
        let mountpoint = format!("mountpoint={mountpoint}");
        run(ZFS, &["clone", "-o", &mountpoint, origin, &self.dataset]).map(drop)
    }

    /// Datasets cloned from snapshot `full`.
    fn clones_of(&self, full: &str) -> Result<Vec<String>> {
        let pool = self.dataset.split('/').next().unwrap_or(&self.dataset);
        let out = run(
            ZFS,
            &["list", "-H", "-o", "name,origin", "-t", "filesystem", "-r", pool],
        )?;
        Ok(out
            .lines()
            .filter_map(|l| l.split_once('\t'))
            .filter(|(_, origin)| *origin == full)
            .map(|(n, _)| n.to_owned())
            .collect())
    }
}

impl Backend for ZfsBackend {
    fn kind(&self) -> BackendKind {
        BackendKind::Zfs
    }

    fn live_path(&self) -> Result<PathBuf> {
        let out = run(ZFS, &["get", "-H", "-o", "value", "mountpoint", &self.dataset])?;
        Ok(PathBuf::from(out.trim()))
    }

    fn snapshot(&self, name: &SnapshotName) -> Result<Snapshot> {
        if !self.exists(&self.dataset) {
            return Err(Error::NoLive {
                location: self.dataset.clone(),
            });
        }
        if self.find(name).is_ok() {
            return Err(Error::SnapshotExists {
                name: name.to_string(),
            });
        }
        // `zfs snapshot` is atomic: the snapshot exists whole or not at all.
        run(ZFS, &["snapshot", &format!("{}@{PREFIX}{name}", self.dataset)])?;
        Ok(Snapshot {
            name: name.clone(),
            bytes: Some(0),
        })
    }

    fn list(&self) -> Result<Vec<Snapshot>> {
        Ok(self
            .listed()?
            .into_iter()
            .map(|l| Snapshot {
                name: l.name,
                bytes: l.used,
            })
            .collect())
    }

    fn rollback(&self, name: &SnapshotName) -> Result<()> {
        let _swap = self.swap_lock()?;
        let target = self.find(name)?;
        let own: Vec<Listed> = self
            .listed()?
            .into_iter()
            .filter(|l| l.full.starts_with(&format!("{}@", self.dataset)))
            .collect();
        if own.last().is_some_and(|l| l.full == target.full) {
            run(ZFS, &["rollback", &target.full])?;
            return Ok(());
        }
        // Retire the live dataset, keeping its snapshots, and clone the target
        // in its place at the same mount point.
        let mountpoint = run(ZFS, &["get", "-H", "-o", "value", "mountpoint", &self.dataset])?;
        let mountpoint = mountpoint.trim().to_owned();
        let gen = self.generations()?.last().map_or(1, |(g, _)| g + 1);
        let retired = format!("{}.gen-{gen}", self.dataset);
        // The target moved with the live dataset if it was one of its own.
        let origin = match target.full.strip_prefix(&format!("{}@", self.dataset)) {
            Some(snap) => format!("{retired}@{snap}"),
            None => target.full.clone(),
        };
        // The journal, before the first change (it moves with the rename).
        run(
            ZFS,
            &["set", &format!("{JOURNAL_ORIGIN}={origin}"), &self.dataset],
        )?;
        run(
            ZFS,
            &["set", &format!("{JOURNAL_MOUNT}={mountpoint}"), &self.dataset],
        )?;
        // zfs-fuse cannot rename a mounted dataset; a busy one (a process
        // still inside) fails here, before anything changed.
        if let Err(e) = run(ZFS, &["unmount", &self.dataset]) {
            Self::clear_journal(&self.dataset);
            return Err(e);
        }
        if let Err(e) = rename_when_settled(&self.dataset, &retired) {
            let _ = run(ZFS, &["mount", &self.dataset]);
            Self::clear_journal(&self.dataset);
            return Err(e);
        }
        run(ZFS, &["set", "mountpoint=none", &retired])?;
        let res = self.clone_in_place(&origin, &mountpoint);
        if let Err(e) = res {
            // Put the live dataset back as it was.
            let _ = run(ZFS, &["rename", &retired, &self.dataset]);
            let _ = run(ZFS, &["set", &format!("mountpoint={mountpoint}"), &self.dataset]);
            Self::clear_journal(&self.dataset);
            return Err(e);
        }
        Self::clear_journal(&retired);
        // A retired generation with no snapshot holds nothing worth keeping.
        if own.is_empty() && self.clones_of(&retired)?.is_empty() {
            run(ZFS, &["destroy", &retired])?;
        }
        Ok(())
    }

    fn clone_to(&self, name: &SnapshotName, to: &Location) -> Result<Box<dyn Backend>> {
        let Location::Zfs { dataset } = to else {
            return Err(Error::WrongLocation {
                expected: BackendKind::Zfs,
                given: to.kind(),
            });
        };
        let target = ZfsBackend::new(dataset)?;
        let snap = self.find(name)?;
        if self.exists(dataset) {
            return Err(Error::TargetExists {
                location: dataset.clone(),
            });
        }
        run(ZFS, &["clone", "-p", &snap.full, dataset])?;
        Ok(Box::new(target))
    }

    fn changed_since(&self, name: &SnapshotName) -> Result<Change> {
        let snap = self.find(name)?;
        // OpenZFS has `written@snap`; zfs-fuse (pool version 23) does not.
        let Some((_, short)) = snap.full.split_once('@') else {
            return Ok(Change::Unknown);
        };
        if !snap.full.starts_with(&format!("{}@", self.dataset)) {
            return Ok(Change::Unknown);
        }
        match run(
            ZFS,
            &[
                "get",
                "-H",
                "-p",
                "-o",
                "value",
                &format!("written@{short}"),
                &self.dataset,
            ],
        ) {
            Ok(v) => match v.trim().parse::<u64>() {
                Ok(0) => Ok(Change::Unchanged),
                Ok(n) => Ok(Change::Changed { bytes: Some(n) }),
                Err(_) => Ok(Change::Unknown),
            },
            Err(Error::Command { .. }) => Ok(Change::Unknown),
            Err(e) => Err(e),
        }
    }

    fn export(&self, name: &SnapshotName, parent: Option<&SnapshotName>, out: &mut dyn Write) -> Result<()> {
        let snap = self.find(name)?;
        match parent {
            Some(p) => {
                let parent = self.find(p)?;
                run_to(ZFS, &["send", "-i", &parent.full, &snap.full], out)
            }
            None => run_to(ZFS, &["send", &snap.full], out),
        }
    }

    fn import(&self, name: &SnapshotName, parent: Option<&SnapshotName>, input: &mut dyn Read) -> Result<()> {
        let target = format!("{}@{PREFIX}{name}", self.dataset);
        match parent {
            None => {
                if self.exists(&self.dataset) {
                    return Err(Error::TargetExists {
                        location: self.dataset.clone(),
                    });
                }
                if let Some(parent) = self.parent() {
                    run(ZFS, &["create", "-p", parent])?;
                }
                run_from(ZFS, &["receive", &target], input)
            }
            Some(p) => {
                self.find(p)?;
                // -F: discard live changes since the parent, which must be
                // the newest snapshot of the live dataset.
                run_from(ZFS, &["receive", "-F", &target], input)
            }
        }
    }

    fn destroy(&self, name: &SnapshotName) -> Result<()> {
        let snap = self.find(name)?;
        if let Some(user) = self.clones_of(&snap.full)?.into_iter().next() {
            return Err(Error::SnapshotInUse {
                name: name.to_string(),
                user,
            });
        }
        run(ZFS, &["destroy", &snap.full])?;
        // A retired generation left with no snapshot and no clone goes too.
        let owner = snap.full.split('@').next().unwrap_or_default().to_owned();
        if owner != self.dataset {
            let left = run(ZFS, &["list", "-H", "-t", "snapshot", "-o", "name", "-r", &owner])?;
            let has_snapshots = left.lines().any(|l| l.starts_with(&format!("{owner}@")));
            if !has_snapshots && self.clones_of(&owner)?.is_empty() {
                run(ZFS, &["destroy", &owner])?;
            }
        }
        Ok(())
    }
}

/// `zfs rename`, retried until the dataset settles (see [`run_settled`]).
fn rename_when_settled(from: &str, to: &str) -> Result<()> {
    run_settled(&["rename", from, to])
}

/// A `zfs` command retried for up to two seconds: zfs-fuse reports a
/// dataset busy for a moment after an unmount while its last transaction
/// group (atime updates included) is written out.
pub(crate) fn run_settled(args: &[&str]) -> Result<()> {
    let mut last = None;
    for _ in 0..20 {
        match run(ZFS, args) {
            Ok(_) => return Ok(()),
            Err(e @ Error::Command { .. }) => last = Some(e),
            Err(e) => return Err(e),
        }
        std::thread::sleep(std::time::Duration::from_millis(100));
    }
    Err(last.expect("the loop ran at least once"))
}
