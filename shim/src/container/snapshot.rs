//! crabd's checkpoint and restore of a running container: a consistent
//! freeze → filesystem snapshot → CRIU dump → thaw, and the way back.

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use crab_api::shim::{FsTarget, ShimCheckpoint, ShimCheckpointed, ShimRestore};
use crab_api::FsSnapshot;
use crab_snapshotter::{BackendKind, Location, SnapshotName};

use super::btrfs::BtrfsRootfs;
use super::{Container, ExitReceiver};
use crate::error::{Error, Result};
use crate::fsop::FsOp;
use crate::io;
use crate::process::ProcessState;
use crate::runtime::{CheckpointOpts, Launch, RestoreOpts, RuntimeClient};
use crate::sandbox_proxy::SandboxProxy;

/// A restore's outcome: the init that now runs, and why the checkpoint
/// asked for is not what runs, if it is not.
pub struct Restored {
    /// The running init's pid on the host.
    pub pid: i32,
    /// Its exit, for the caller to watch.
    pub rx: ExitReceiver,
    /// How long it took, in milliseconds.
    pub restore_ms: f64,
    /// Of which the undo checkpoint.
    pub undo_ms: f64,
    /// Set when the restore failed and the sandbox was put back as it was.
    pub failure: Option<Error>,
}

/// Milliseconds since the Unix epoch.
fn unix_ms() -> u128 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap_or_default()
        .as_millis()
}

/// How long the previous processes may take to die at a restore.
const KILL_LIMIT: Duration = Duration::from_secs(10);

// === impl Container ===

impl Container {
    /// The filesystem backend that can snapshot this container's rootfs.
    pub fn fs_backend(&self) -> Option<BackendKind> {
        if self.zfs_dataset.is_some() {
            return Some(BackendKind::Zfs);
        }
        if self.btrfs.is_some() {
            return Some(BackendKind::Btrfs);
        }
        self.overlay_upper().ok().map(|_| BackendKind::OverlayCopy)
    }

    /// Where the container's own files are on the host: its btrfs
    /// subvolume, its ZFS dataset's mount point, or its overlay's upper
    /// directory. crabd keeps its history as long as that exists.
    pub fn writable_layer(&self) -> Option<PathBuf> {
        if let Some(b) = &self.btrfs {
            return Some(b.subvolume.clone());
        }
        if self.zfs_dataset.is_some() {
            return self.rootfs_mounts.first().map(|m| PathBuf::from(&m.source));
        }
        self.overlay_upper().ok()
    }

    /// The upper directory of the container's overlay rootfs.
    fn overlay_upper(&self) -> Result<PathBuf> {
        let no = |reason: String| Error::NoFsBackend {
            id: self.id.clone(),
            reason,
        };
        match self.rootfs_mounts.as_slice() {
            [m] if m.type_ == "overlay" => m
                .options
                .iter()
                .find_map(|o| o.strip_prefix("upperdir="))
                .map(PathBuf::from)
                .ok_or_else(|| no("a read-only overlay".to_owned())),
            [m] => Err(no(format!("a {} mount", m.type_))),
            [] => Err(no("a directory in the bundle".to_owned())),
            _ => Err(no("several mounts".to_owned())),
        }
    }

    /// Runs a filesystem operation: in the helper when it runs commands
    /// (the shim's reaper would take their statuses), else here.
    pub(super) async fn fs(&self, op: FsOp, runtime: &RuntimeClient) -> Result<Option<String>> {
        if op.forks() {
            return runtime.fs(&self.id, &self.bundle, &op).await;
        }
        let id = self.id.clone();
        tokio::task::spawn_blocking(move || op.run())
            .await
            .map_err(|e| Error::io("filesystem operation")(std::io::Error::other(e)))?
            .map_err(|source| Error::Snapshot { id, source })
    }

    /// The ZFS dataset of a bind-mounted rootfs (crabzfs's), if it is one.
    pub(super) async fn find_zfs_dataset(&self, runtime: &RuntimeClient) -> Option<String> {
        let [m] = self.rootfs_mounts.as_slice() else {
            return None;
        };
        if m.type_ != "bind" {
            return None;
        }
        let op = FsOp::ZfsDatasetAt {
            mountpoint: PathBuf::from(&m.source),
        };
        match self.fs(op, runtime).await {
            Ok(found) => found.filter(|d| !d.is_empty()),
            Err(e) => {
                tracing::debug!(error = %crab_api::error_chain(&e), "{}: no ZFS dataset for its rootfs", self.id);
                None
            }
        }
    }

    /// The subvolume of a rootfs from containerd's btrfs snapshotter, once
    /// mounted; from then on it is mounted by path (see `btrfs`).
    pub(super) fn find_btrfs(&mut self, namespace: &str) -> Option<BtrfsRootfs> {
        let [m] = self.rootfs_mounts.as_mut_slice() else {
            return None;
        };
        match BtrfsRootfs::find(&self.rootfs_target, m, namespace, &self.id) {
            Ok(found) => found,
            Err(reason) => {
                tracing::warn!("{}: its btrfs rootfs cannot be snapshotted: {reason}", self.id);
                None
            }
        }
    }

    /// Where the backend finds the container's files: its ZFS dataset (a
    /// crabzfs rootfs), its btrfs subvolume and the shim's store beside it,
    /// or its overlay upper directory and crabd's store.
    fn fs_location(&self, target: &FsTarget) -> Result<Location> {
        if let Some(own) = self.own_fs_location() {
            return Ok(own);
        }
        Ok(Location::OverlayCopy {
            upper: self.overlay_upper()?,
            store: target.store.clone(),
        })
    }

    /// Where the snapshots of a rootfs that keeps its own are: its ZFS
    /// dataset or btrfs subvolume (an overlay's copies are crabd's).
    fn own_fs_location(&self) -> Option<Location> {
        if let Some(dataset) = &self.zfs_dataset {
            return Some(Location::Zfs {
                dataset: dataset.clone(),
            });
        }
        self.btrfs.as_ref().map(BtrfsRootfs::location)
    }

    /// The btrfs store of the rootfs's snapshots, if it has one: crabd
    /// deletes it when containerd removes the container (a task that stops
    /// and starts again keeps its versions and their snapshots).
    pub fn own_snapshot_store(&self) -> Option<Location> {
        self.btrfs.as_ref().map(BtrfsRootfs::location)
    }

    /// Deletes the snapshots `names` of the rootfs's own filesystem; answers
    /// those deleted, and logs why any other is kept.
    pub async fn forget_snapshots(
        &self,
        names: &[SnapshotName],
        runtime: &RuntimeClient,
    ) -> Vec<SnapshotName> {
        let Some(location) = self.own_fs_location() else {
            tracing::warn!("{}: no snapshots of its own to forget", self.id);
            return Vec::new();
        };
        let mut destroyed = Vec::new();
        for name in names {
            let op = FsOp::Destroy {
                location: location.clone(),
                name: name.clone(),
            };
            match self.fs(op, runtime).await {
                Ok(_) => destroyed.push(name.clone()),
                Err(e) => {
                    tracing::warn!(error = %crab_api::error_chain(&e), "{}: snapshot {name} kept", self.id)
                }
            }
        }
        destroyed
    }

    /// Freezes the container, snapshots its files and dumps its processes
    /// (as asked), and thaws it; the images' hashing is crabd's, after.
    pub async fn engine_checkpoint(
        &self,
        req: &ShimCheckpoint,
        runtime: &RuntimeClient,
    ) -> Result<ShimCheckpointed> {
        self.expect_state(&self.init, ProcessState::Running, "checkpoint")?;
        let location = req.fs.as_ref().map(|t| self.fs_location(t)).transpose()?;
        let t0 = Instant::now();
        self.set_frozen(true, runtime).await?;
        let frozen_at = Instant::now();
        let made = self.checkpoint_frozen(req, location, runtime).await;
        let t_thaw = Instant::now();
        let thawed = self.set_frozen(false, runtime).await;
        let frozen_ms = frozen_at.elapsed().as_secs_f64() * 1e3;
        let fs = made?;
        thawed?;
        tracing::info!(
            "{}: checkpoint, frozen {frozen_ms:.1} ms (freeze {:.1}, work {:.1}, thaw {:.1})",
            self.id,
            (frozen_at - t0).as_secs_f64() * 1e3,
            (t_thaw - frozen_at).as_secs_f64() * 1e3,
            t_thaw.elapsed().as_secs_f64() * 1e3
        );
        Ok(ShimCheckpointed { frozen_ms, fs })
    }

    async fn checkpoint_frozen(
        &self,
        req: &ShimCheckpoint,
        location: Option<Location>,
        runtime: &RuntimeClient,
    ) -> Result<Option<FsSnapshot>> {
        let mut fs = None;
        if let (Some(target), Some(location)) = (&req.fs, location) {
            let backend = location.kind();
            let name = target.name.clone();
            self.fs(
                FsOp::Snapshot {
                    location,
                    name: name.clone(),
                },
                runtime,
            )
            .await?;
            fs = Some(FsSnapshot { backend, name });
        }
        if let Some(images) = &req.images_dir {
            // An agent inside the sandbox is waiting on its connection to
            // the proxy at every turn end: CRIU refuses to dump a connected
            // TCP socket unless told to keep it.
            let opts = CheckpointOpts {
                work_path: Some(self.bundle.join(".crab-criu")),
                tcp_established: true,
                ..Default::default()
            };
            let t = Instant::now();
            runtime.checkpoint(&self.id, &self.bundle, images, &opts).await?;
            tracing::info!("{}: dump {:.1} ms", self.id, t.elapsed().as_secs_f64() * 1e3);
        }
        Ok(fs)
    }

    /// Replaces the container's processes (and files) with a checkpoint's.
    ///
    /// Everything that can be checked is checked before anything changes.
    /// Then the sandbox as it is now is saved aside (an undo checkpoint),
    /// the current processes are killed, the rootfs rolled back and the
    /// checkpoint restored with CRIU; stdio and the proxy are re-wired. If
    /// the restore fails, the undo checkpoint is restored instead, so a
    /// failed restore does not cost the sandbox; [`Restored::failure`] then
    /// says why. The caller watches the exit of [`Restored::pid`].
    pub async fn engine_restore(&mut self, req: &ShimRestore, runtime: &RuntimeClient) -> Result<Restored> {
        let started = Instant::now();
        self.expect_state(&self.init, ProcessState::Running, "restore")?;
        check_images(&req.images_dir)?;
        let target_fs = match &req.fs {
            Some(target) => Some(self.existing_snapshot(target, runtime).await?),
            None => None,
        };

        let undo_dir = self.bundle.join(".crab-undo");
        let _ = std::fs::remove_dir_all(&undo_dir);
        let undo_fs = req.fs.as_ref().filter(|_| req.undo).map(|t| FsTarget {
            name: SnapshotName::new(&format!("undo-{}", unix_ms())).expect("a valid snapshot name"),
            store: t.store.clone(),
        });
        let mut undo_ms = 0.0;
        if req.undo {
            let undo_started = Instant::now();
            let undo = ShimCheckpoint {
                images_dir: Some(undo_dir.clone()),
                fs: undo_fs.clone(),
            };
            self.engine_checkpoint(&undo, runtime).await?;
            undo_ms = undo_started.elapsed().as_secs_f64() * 1e3;
        }
        let undo_fs = match &undo_fs {
            Some(t) => Some((self.fs_location(t)?, t.name.clone())),
            None => None,
        };

        let (pid, rx, failure) = match self.replace_processes(&req.images_dir, target_fs, runtime).await {
            Ok((pid, rx)) => (pid, rx, None),
            Err(failed) if !req.undo => {
                return Err(Error::RestoreLost {
                    id: self.id.clone(),
                    restore: crab_api::error_chain(&failed),
                    undo: "no undo checkpoint was asked for".to_owned(),
                })
            }
            Err(failed) => {
                tracing::error!(error = %crab_api::error_chain(&failed), "{}: restore failed, putting the sandbox back", self.id);
                match self.replace_processes(&undo_dir, undo_fs.clone(), runtime).await {
                    Ok((pid, rx)) => (pid, rx, Some(failed)),
                    Err(undo_failed) => {
                        return Err(Error::RestoreLost {
                            id: self.id.clone(),
                            restore: crab_api::error_chain(&failed),
                            undo: crab_api::error_chain(&undo_failed),
                        })
                    }
                }
            }
        };
        let _ = std::fs::remove_dir_all(&undo_dir);
        if let Some((location, name)) = undo_fs {
            if let Err(e) = self.fs(FsOp::Destroy { location, name }, runtime).await {
                tracing::warn!(error = %crab_api::error_chain(&e), "{}: remove the undo snapshot", self.id);
            }
        }
        let restore_ms = started.elapsed().as_secs_f64() * 1e3;
        tracing::info!("{}: restored as pid {pid} in {restore_ms:.1} ms", self.id);
        Ok(Restored {
            pid,
            rx,
            restore_ms,
            undo_ms,
            failure,
        })
    }

    /// The location of an existing snapshot `target`, or why it is not there.
    async fn existing_snapshot(
        &self,
        target: &FsTarget,
        runtime: &RuntimeClient,
    ) -> Result<(Location, SnapshotName)> {
        let location = self.fs_location(target)?;
        let op = FsOp::Has {
            location: location.clone(),
            name: target.name.clone(),
        };
        let exists = self.fs(op, runtime).await?.as_deref() == Some("yes");
        if !exists {
            return Err(Error::InvalidCheckpoint {
                path: target.store.clone(),
                reason: format!("no filesystem snapshot {}", target.name),
            });
        }
        Ok((location, target.name.clone()))
    }

    /// Kills the current processes, rolls the rootfs back to `fs`, restores
    /// `images`, and re-wires stdio and the proxy.
    async fn replace_processes(
        &mut self,
        images: &Path,
        fs: Option<(Location, SnapshotName)>,
        runtime: &RuntimeClient,
    ) -> Result<(i32, ExitReceiver)> {
        // Found while the init lives: docker's pin of its namespace.
        let netns = crate::runtime::pinned_netns(self.init.pid);
        self.kill_every_process().await?;
        if let Some(mut io) = self.init.io.take() {
            io.drain(Duration::from_millis(200)).await;
        }
        if let Some((location, name)) = fs {
            self.rollback_rootfs(location, name, runtime).await?;
        }
        let (child, pending) = io::prepare(&self.init.stdio, &runtime.console_dir()).await?;
        let launch = Launch {
            work_dir: &self.bundle,
            stdio: child,
            unified_cgroup: self.unified_cgroup.as_deref(),
        };
        let work = self.bundle.join(".crab-criu");
        // Connections were dumped (see `checkpoint_frozen`). One to the
        // proxy has no peer in the restored network namespace: the agent's
        // next read or write on it fails, and its SDK retries on a new one.
        let opts = RestoreOpts {
            tcp_established: true,
            netns,
            ..Default::default()
        };
        let (pid, rx) = runtime.restore(&self.id, images, &work, &opts, launch).await?;
        self.init.pid = pid;
        self.init.io = Some(pending.finish().await?);
        self.restart_proxy().await;
        Ok((pid, rx))
    }

    /// Restores the init of a container created for it (see
    /// `crab_api::shim::RESTORE_ANNOTATION`): it has no runtime state yet.
    pub(super) async fn restore_init(
        &mut self,
        images: &Path,
        runtime: &RuntimeClient,
    ) -> Result<(i32, ExitReceiver)> {
        check_images(images)?;
        let (child, pending) = io::prepare(&self.init.stdio, &runtime.console_dir()).await?;
        let launch = Launch {
            work_dir: &self.bundle,
            stdio: child,
            unified_cgroup: self.unified_cgroup.as_deref(),
        };
        let opts = RestoreOpts {
            tcp_established: true,
            fresh_bundle: Some(self.bundle.clone()),
            netns: None,
        };
        let work = self.bundle.join(".crab-criu");
        let (pid, rx) = runtime.restore(&self.id, images, &work, &opts, launch).await?;
        self.init.pid = pid;
        self.init.io = Some(pending.finish().await?);
        self.init.state = ProcessState::Running;
        self.restart_proxy().await;
        tracing::info!(
            "{}: started from the checkpoint {} as pid {pid}",
            self.id,
            images.display()
        );
        Ok((pid, rx))
    }

    /// SIGKILLs every process of the container and waits until its cgroup
    /// is empty.
    async fn kill_every_process(&self) -> Result<()> {
        let deadline = Instant::now() + KILL_LIMIT;
        loop {
            let pids = crate::cgroup::pids(&self.cgroups_path, &self.id)?;
            if pids.is_empty() {
                return Ok(());
            }
            if Instant::now() > deadline {
                return Err(Error::BadState {
                    id: self.id.clone(),
                    state: "unkillable",
                    op: "restore",
                });
            }
            for pid in pids {
                let _ =
                    nix::sys::signal::kill(nix::unistd::Pid::from_raw(pid as i32), nix::sys::signal::SIGKILL);
            }
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    }

    /// Unmounts the rootfs, rolls its files back, and mounts it again (an
    /// overlay must not change under its mount).
    async fn rollback_rootfs(
        &mut self,
        location: Location,
        name: SnapshotName,
        runtime: &RuntimeClient,
    ) -> Result<()> {
        super::unmount(&self.rootfs_target).map_err(|source| Error::Mount {
            id: self.id.clone(),
            source,
        })?;
        let rolled = self
            .fs(FsOp::Rollback { location, name }, runtime)
            .await
            .map(drop);
        self.mount_layers().await?;
        rolled
    }

    /// Binds the LLM proxy again in the restored network namespace (CRIU
    /// made a new one when the container had its own).
    ///
    /// A running proxy keeps its sandbox (turn numbers go on, one
    /// transcript); only its listener moves. A sandbox made from a
    /// checkpoint starts its proxy here.
    async fn restart_proxy(&mut self) {
        let Some((namespace, plan)) = self.proxy_plan.clone() else {
            return;
        };
        let config = &crate::service::config().shim.proxy;
        if let Some(p) = &mut self.proxy {
            if let Err(e) = p.rebind(self.init.pid, config.port).await {
                tracing::error!(error = %crab_api::error_chain(&e), "{}: no LLM proxy listener after restore", self.id);
            }
            return;
        }
        let hook = crate::sandbox_proxy::turn_hook(config, &crate::service::config().crabd);
        match SandboxProxy::start(&namespace, &self.id, self.init.pid, plan, config, hook).await {
            Ok(p) => self.proxy = Some(p),
            Err(e) => {
                tracing::error!(error = %crab_api::error_chain(&e), "{}: no LLM proxy after restore", self.id)
            }
        }
    }
}

/// Checks that `dir` holds a CRIU dump made by this shim.
fn check_images(dir: &Path) -> Result<()> {
    let bad = |reason: &str| Error::InvalidCheckpoint {
        path: dir.to_owned(),
        reason: reason.to_owned(),
    };
    if !dir.is_dir() {
        return Err(bad("no such directory"));
    }
    if !dir.join("inventory.img").is_file() {
        return Err(bad("no CRIU inventory.img"));
    }
    if !dir.join(crate::runtime::DESCRIPTORS).is_file() {
        return Err(bad("no descriptors.json"));
    }
    Ok(())
}
