//! crabd's checkpoint and restore of a running container: a consistent
//! freeze → filesystem snapshot → CRIU dump → thaw, and the way back.

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use crab_api::shim::{
    ConversationAt, FsTarget, ShimCheckpoint, ShimCheckpointed, ShimFilesRestored, ShimRestore,
    ShimRestoreFiles,
};
use crab_api::FsSnapshot;
use crab_api::{BackendKind, Location, SnapshotName};

use super::{Container, ExitReceiver};
use crate::error::{Error, Result};
use crate::io;
use crate::process::ProcessState;
use crate::runtime::{CheckpointOpts, Launch, Personality, RestoreOpts, RuntimeClient};
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
    /// Where CRIU works and logs during a checkpoint of this container.
    pub(super) fn criu_work_dir(&self) -> PathBuf {
        self.bundle.join(".crab-criu")
    }

    /// The filesystem backend that can snapshot this container's rootfs.
    pub fn fs_backend(&self) -> Option<BackendKind> {
        self.rootfs.backend()
    }

    /// Where the container's own files are on the host (see
    /// [`crate::rootfs::Rootfs::writable_layer`]).
    pub fn writable_layer(&self) -> Option<PathBuf> {
        self.rootfs.writable_layer()
    }

    /// Where the rootfs keeps snapshots crabd does not (a btrfs store).
    pub fn own_snapshot_store(&self) -> Option<Location> {
        self.rootfs.own_snapshot_store()
    }

    /// Deletes the snapshots `names` of the rootfs's own filesystem; answers
    /// those deleted.
    pub async fn forget_snapshots(
        &self,
        names: &[SnapshotName],
        runtime: &RuntimeClient,
    ) -> Vec<SnapshotName> {
        self.rootfs.forget(names, &self.fs_ctx(runtime)).await
    }

    /// Freezes the container, snapshots its files and dumps its processes
    /// (as asked), and thaws it; the images' hashing is crabd's, after.
    pub async fn engine_checkpoint(
        &self,
        req: &ShimCheckpoint,
        runtime: &RuntimeClient,
    ) -> Result<ShimCheckpointed> {
        self.expect_state(&self.init, ProcessState::Running, "checkpoint")?;
        if req.fs.is_some() && self.rootfs.backend().is_none() {
            // Refused before the freeze, with the reason.
            self.rootfs.check_backend(&self.id)?;
        }
        if req.images_dir.is_some() {
            self.refuse_undumpable().await?;
        }
        let t0 = Instant::now();
        self.freeze_for_capture().await?;
        let frozen_at = Instant::now();
        let made = self.checkpoint_frozen(req, runtime).await;
        let t_thaw = Instant::now();
        let thawed = self.set_frozen(false).await;
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
        Ok(ShimCheckpointed {
            frozen_ms,
            fs,
            work_dir: Some(self.criu_work_dir()),
        })
    }

    async fn checkpoint_frozen(
        &self,
        req: &ShimCheckpoint,
        runtime: &RuntimeClient,
    ) -> Result<Option<FsSnapshot>> {
        let mut fs = None;
        if let Some(target) = &req.fs {
            fs = Some(self.rootfs.snapshot(target, &self.fs_ctx(runtime)).await?);
        }
        if let Some(images) = &req.images_dir {
            // Whether CRIU's network lock protects anything here (see
            // `netns::needs_lock`); frozen, the sandbox's connections stay
            // as they are until the thaw.
            let pin = crate::netns::pin_path(runtime.root(), &self.id);
            let outside = oci_spec::runtime::Spec::load(self.bundle.join("config.json"))
                .ok()
                .and_then(|spec| crate::runtime::netns_outside(&spec, self.init.pid, &pin))
                .is_some();
            let quiet_network = !crate::netns::needs_lock(self.init.pid, outside);
            // An agent inside the sandbox is waiting on its connection to
            // the proxy at every turn end: CRIU refuses to dump a connected
            // TCP socket unless told to keep it.
            let opts = CheckpointOpts {
                quiet_network,
                work_path: Some(self.criu_work_dir()),
                tcp_established: true,
                crab_init: self.init_is_crab_init(),
                init_pid: Some(self.init.pid),
                mounts_changed: self.mounts_changed,
                ..Default::default()
            };
            let t = Instant::now();
            runtime.checkpoint(&self.id, &self.bundle, images, &opts).await?;
            tracing::info!("{}: dump {:.1} ms", self.id, t.elapsed().as_secs_f64() * 1e3);
        }
        Ok(fs)
    }

    /// Makes the container's files snapshot `req.fs`'s in place while its
    /// processes, frozen, are kept: their mount, open files and
    /// connections survive (an agent inside that asked for it gets its
    /// answer).
    pub async fn engine_restore_files(
        &self,
        req: &ShimRestoreFiles,
        runtime: &RuntimeClient,
    ) -> Result<ShimFilesRestored> {
        self.expect_state(&self.init, ProcessState::Running, "restore files")?;
        self.rootfs.check_snapshot(&req.fs, &self.fs_ctx(runtime)).await?;
        self.freeze_for_capture().await?;
        let frozen_at = Instant::now();
        let done = self.rootfs.restore_files(&req.fs, &self.fs_ctx(runtime)).await;
        let thawed = self.set_frozen(false).await;
        let frozen_ms = frozen_at.elapsed().as_secs_f64() * 1e3;
        let (written, removed) = done?;
        thawed?;
        tracing::info!(
            "{}: files of {} restored ({written} written, {removed} removed), frozen {frozen_ms:.1} ms",
            self.id,
            req.fs.name
        );
        Ok(ShimFilesRestored {
            written,
            removed,
            frozen_ms,
        })
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
        // What the restore would refuse, refused before the undo, the
        // proxy's rewind or any kill.
        crate::runtime::restore_preflight(&self.bundle, &req.images_dir).map_err(|reason| {
            Error::InvalidBundle {
                bundle: self.bundle.clone(),
                reason,
            }
        })?;
        if let Some(target) = &req.fs {
            self.rootfs.check_snapshot(target, &self.fs_ctx(runtime)).await?;
        }

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
        let (pid, rx, failure) = match self
            .replace_processes(
                &req.images_dir,
                req.fs.as_ref(),
                (req.conversation, req.notice.as_deref()),
                runtime,
            )
            .await
        {
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
                match self
                    .replace_processes(&undo_dir, undo_fs.as_ref(), (None, None), runtime)
                    .await
                {
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
        if let Some(undo) = &undo_fs {
            if let Err(e) = self.rootfs.destroy(undo, &self.fs_ctx(runtime)).await {
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

    /// Kills the current processes, rolls the rootfs back to `fs`, restores
    /// `images`, and re-wires stdio and the proxy, which learns where the
    /// restored agent stands in the conversation (`conversation`), and
    /// what to tell it instead of the last answer it asks again (a safety
    /// rollback's notice).
    async fn replace_processes(
        &mut self,
        images: &Path,
        fs: Option<&FsTarget>,
        (conversation, notice): (Option<ConversationAt>, Option<&str>),
        runtime: &RuntimeClient,
    ) -> Result<(i32, ExitReceiver)> {
        // Docker's pin of its namespace: found now while the init lives,
        // else when it last did (a dead init's pid may be another's).
        let netns = match self.recovering {
            true => self.netns_pin.clone(),
            false => crate::runtime::pinned_netns(self.init.pid),
        };
        if !self.recovering {
            // A new init: only what is asked of it from now on counts.
            self.asked.clear();
        }
        // Before anything of the old sandbox dies: in a namespace that the
        // restore keeps (docker's, a pod's), the old listener serves the
        // restored agent at once.
        if let Some(p) = &self.proxy {
            // Bounded: a hung disk must not hang the restore.
            let limit = Duration::from_secs(crate::config::get().shim.proxy.hold_timeout);
            if tokio::time::timeout(limit, p.rewind(conversation, notice))
                .await
                .is_err()
            {
                tracing::warn!("{}: the transcript did not answer in time: no replay", self.id);
                p.rewind(None, None).await;
            }
        }
        if self.recovering {
            // A crash during a checkpoint can leave the cgroup frozen: its
            // tasks would not die, nor would restored ones run.
            if let Err(e) = self.set_frozen(false).await {
                tracing::warn!(error = %crab_api::error_chain(&e), "{}: thaw before the recovery", self.id);
            }
        }
        // What would refuse the restore, refused while the processes live.
        crate::runtime::restore_preflight(&self.bundle, images).map_err(|reason| Error::InvalidBundle {
            bundle: self.bundle.clone(),
            reason,
        })?;
        let t_kill = Instant::now();
        self.kill_every_process().await?;
        if let Some(mut io) = self.init.io.take() {
            io.drain(Duration::from_millis(200)).await;
        }
        let t_files = Instant::now();
        if let Some(target) = fs {
            self.rootfs.rollback(target, &self.fs_ctx(runtime)).await?;
        }
        let t_restore = Instant::now();
        let (child, pending) = io::prepare(&self.init.stdio, &runtime.console_dir()).await?;
        let (report, theirs) = Self::restore_report(images)?.unzip();
        let launch = Launch {
            work_dir: &self.bundle,
            stdio: child,
            unified_cgroup: self.unified_cgroup.as_deref(),
            crab_init: theirs.map(|fd| (Personality::Init, fd)),
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
        self.freezer.learn(pid);
        let t_rewire = Instant::now();
        self.init.io = Some(pending.finish().await?);
        self.follow_init(report, runtime)?;
        self.restart_proxy().await;
        let ms = |a: Instant, b: Instant| (b - a).as_secs_f64() * 1e3;
        tracing::info!(
            "{}: processes replaced (kill {:.1}, files {:.1}, restore {:.1}, rewire {:.1} ms)",
            self.id,
            ms(t_kill, t_files),
            ms(t_files, t_restore),
            ms(t_restore, t_rewire),
            ms(t_rewire, Instant::now())
        );
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
        let (report, theirs) = Self::restore_report(images)?.unzip();
        let launch = Launch {
            work_dir: &self.bundle,
            stdio: child,
            unified_cgroup: self.unified_cgroup.as_deref(),
            crab_init: theirs.map(|fd| (Personality::Init, fd)),
        };
        let opts = RestoreOpts {
            tcp_established: true,
            fresh_bundle: Some(self.bundle.clone()),
            netns: None,
        };
        let work = self.bundle.join(".crab-criu");
        let (pid, rx) = runtime.restore(&self.id, images, &work, &opts, launch).await?;
        self.init.pid = pid;
        self.freezer.learn(pid);
        self.init.io = Some(pending.finish().await?);
        self.follow_init(report, runtime)?;
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
        let mut pause = Duration::from_micros(500);
        loop {
            let pids = self.pids()?;
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
            tokio::time::sleep(pause).await;
            pause = (pause * 2).min(Duration::from_millis(5));
        }
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
        let config = &crate::config::get().shim.proxy;
        if let Some(p) = &mut self.proxy {
            if let Err(e) = p.rebind(self.init.pid, config.port).await {
                tracing::error!(error = %crab_api::error_chain(&e), "{}: no LLM proxy listener after restore", self.id);
            }
            return;
        }
        let hook = crate::sandbox_proxy::turn_hook(config, &crate::config::get().crabd);
        match SandboxProxy::start(
            &namespace,
            &self.id,
            self.init.pid,
            plan,
            config,
            hook,
            self.pending_conversation.take(),
        )
        .await
        {
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
