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

use super::members::{Member, Part};
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

/// A pod's container restored with its sandbox: its exit, for the caller
/// to watch.
pub struct RestoredMember {
    /// The container.
    pub id: String,
    /// Its running init's pid on the host.
    pub pid: i32,
    /// Its exit.
    pub rx: ExitReceiver,
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
    /// `members`: when it is a pod's sandbox, the pod's other app
    /// containers; those running are frozen with it and captured into the
    /// process image (see `members`), which a pod with running members
    /// therefore needs.
    pub async fn engine_checkpoint(
        &self,
        req: &ShimCheckpoint,
        runtime: &RuntimeClient,
        members: &[Member<'_>],
    ) -> Result<ShimCheckpointed> {
        self.expect_state(&self.init, ProcessState::Running, "checkpoint")?;
        if req.fs.is_some() && self.rootfs.backend().is_none() {
            // Refused before the freeze, with the reason.
            self.rootfs.check_backend(&self.id)?;
        }
        if req.images_dir.is_some() {
            self.refuse_undumpable().await?;
        }
        let mut members: Vec<&Container> = members.iter().map(|m| &**m).filter(|m| m.member_runs()).collect();
        if req.images_dir.is_none() && req.members_unchanged {
            // A files-only version inheriting a process image whose parts
            // of them still hold (crabd's inspector says they changed
            // nothing since).
            members.clear();
        }
        if !members.is_empty() && (req.images_dir.is_none() || req.fs.is_none()) {
            return Err(Error::PodMember {
                id: self.id.clone(),
                reason: "the pod's other containers run, and a version without both a process image and \
                         a file snapshot would leave them out: take a whole one"
                    .to_owned(),
            });
        }
        if !members.is_empty() && self.rootfs.backend() != Some(BackendKind::OverlayCopy) {
            // Their copies live beside the sandbox's in crabd's store, and
            // go with its snapshots of the same name.
            return Err(Error::PodMember {
                id: self.id.clone(),
                reason: "the pod's other containers are versioned only beside a sandbox on overlayfs"
                    .to_owned(),
            });
        }
        for m in &members {
            m.check_member().await?;
        }
        let t0 = Instant::now();
        self.freeze_for_capture().await?;
        let mut frozen: Vec<&Container> = Vec::new();
        let mut made = Ok(None);
        for m in &members {
            match m.freeze_for_capture().await {
                Ok(()) => frozen.push(m),
                Err(e) => {
                    made = Err(e);
                    break;
                }
            }
        }
        let frozen_at = Instant::now();
        if made.is_ok() {
            made = self.checkpoint_frozen(req, runtime).await;
        }
        if let (Ok(_), Some(images), Some(fs)) = (&made, &req.images_dir, &req.fs) {
            for m in &members {
                if let Err(e) = m.capture_member(images, fs, runtime).await {
                    made = Err(e);
                    break;
                }
            }
        }
        let t_thaw = Instant::now();
        let mut thawed = Ok(());
        for m in frozen {
            if let Err(e) = m.set_frozen(false).await {
                tracing::error!(error = %crab_api::error_chain(&e), "{}: thaw the pod's container {}", self.id, m.id);
                thawed = thawed.and(Err(e));
            }
        }
        let thawed = self.set_frozen(false).await.and(thawed);
        let frozen_ms = frozen_at.elapsed().as_secs_f64() * 1e3;
        let fs = made?;
        thawed?;
        tracing::info!(
            "{}: checkpoint{}, frozen {frozen_ms:.1} ms (freeze {:.1}, work {:.1}, thaw {:.1})",
            self.id,
            match members.len() {
                0 => String::new(),
                n => format!(" with {n} other containers of its pod"),
            },
            (frozen_at - t0).as_secs_f64() * 1e3,
            (t_thaw - frozen_at).as_secs_f64() * 1e3,
            t_thaw.elapsed().as_secs_f64() * 1e3
        );
        Ok(ShimCheckpointed {
            frozen_ms,
            fs,
            work_dir: Some(self.criu_work_dir()),
            member_work_dirs: members.iter().map(|m| m.criu_work_dir()).collect(),
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
            self.dump_processes(images, runtime).await?;
        }
        Ok(fs)
    }

    /// Dumps the container's processes (frozen) into `images`.
    pub(super) async fn dump_processes(&self, images: &Path, runtime: &RuntimeClient) -> Result<()> {
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
        Ok(())
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
    ///
    /// `members`: when it is a pod's sandbox, the pod's other app
    /// containers; those with a part in the checkpoint are restored with it
    /// (see `members`). Each one restored is put in `restored`, whatever
    /// the outcome, for the caller to watch.
    pub async fn engine_restore(
        &mut self,
        req: &ShimRestore,
        runtime: &RuntimeClient,
        members: &mut [Member<'_>],
        restored: &mut Vec<RestoredMember>,
    ) -> Result<Restored> {
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
        let store = req.fs.as_ref().map(|f| f.store.as_path());
        let plan = super::members::plan(&req.images_dir, store, members, &self.id, runtime).await?;

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
                members_unchanged: false,
            };
            self.engine_checkpoint(&undo, runtime, members).await?;
            undo_ms = undo_started.elapsed().as_secs_f64() * 1e3;
        }
        let asked = (req.conversation, req.notice.as_deref());
        let replaced = self
            .replace_pod(
                &req.images_dir,
                req.fs.as_ref(),
                asked,
                (members, &plan),
                restored,
                runtime,
            )
            .await;
        let (pid, rx, failure) = match replaced {
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
                let undo_store = undo_fs.as_ref().map(|f| f.store.as_path());
                let undone =
                    match super::members::plan(&undo_dir, undo_store, members, &self.id, runtime).await {
                        Ok(undo_plan) => {
                            let parts = (&mut *members, undo_plan.as_slice());
                            self.replace_pod(
                                &undo_dir,
                                undo_fs.as_ref(),
                                (None, None),
                                parts,
                                restored,
                                runtime,
                            )
                            .await
                        }
                        Err(e) => Err(e),
                    };
                match undone {
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
            for m in members.iter() {
                m.forget_member_files(&undo.store, &undo.name, runtime).await;
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

    /// Replaces the processes (and files) of the members `plan` names with
    /// their parts, and the sandbox's own with `images` and `fs`: every
    /// process of them is killed before any is restored. Answers the
    /// sandbox's new init; each restored member goes into `restored`.
    async fn replace_pod(
        &mut self,
        images: &Path,
        fs: Option<&FsTarget>,
        asked: (Option<ConversationAt>, Option<&str>),
        (members, plan): (&mut [Member<'_>], &[Part]),
        restored: &mut Vec<RestoredMember>,
        runtime: &RuntimeClient,
    ) -> Result<(i32, ExitReceiver)> {
        let netns = self.prepare_replace(images, asked).await?;
        let mut member_netns = Vec::with_capacity(plan.len());
        for p in plan {
            member_netns.push(members[p.index].prepare_replace(&p.images, (None, None)).await?);
        }
        if !plan.is_empty() {
            for p in plan {
                members[p.index].kill_every_process().await?;
            }
            self.kill_every_process().await?;
        }
        // The first restore into a pod's network clears what the kills left.
        let mut first = self.pod.is_some();
        for (p, netns) in plan.iter().zip(member_netns) {
            let m = &mut members[p.index];
            let net = (netns, std::mem::take(&mut first));
            let (pid, rx) = m.finish_replace(&p.images, Some(&p.files), net, runtime).await?;
            restored.push(RestoredMember {
                id: m.id.clone(),
                pid,
                rx,
            });
        }
        self.finish_replace(images, fs, (netns, first), runtime).await
    }

    /// What a replacement of the processes by `images` does while they
    /// still live: finds the network namespace to restore into, rewinds the
    /// proxy, which learns where the restored agent stands in the
    /// conversation (`conversation`) and what to tell it instead of the
    /// last answer it asks again (a safety rollback's notice), thaws a
    /// recovering sandbox, and checks what the restore would refuse.
    /// Answers the namespace.
    async fn prepare_replace(
        &mut self,
        images: &Path,
        (conversation, notice): (Option<ConversationAt>, Option<&str>),
    ) -> Result<Option<PathBuf>> {
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
        Ok(netns)
    }

    /// The rest of a replacement ([`Container::prepare_replace`] first):
    /// kills the processes (if they still live), rolls the files back,
    /// restores the processes and re-wires stdio and the proxy.
    /// `reap_closed`: it is the first restore of a pod's containers,
    /// all killed (see `RestoreOpts::reap_closed`).
    async fn finish_replace(
        &mut self,
        images: &Path,
        fs: Option<&FsTarget>,
        (netns, reap_closed): (Option<PathBuf>, bool),
        runtime: &RuntimeClient,
    ) -> Result<(i32, ExitReceiver)> {
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
            reap_closed,
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
            reap_closed: false,
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
    pub(super) async fn kill_every_process(&self) -> Result<()> {
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
        let hook = crate::sandbox_proxy::turn_hook(config, &crate::config::get().crabd, self.pods.clone());
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
pub(super) fn check_images(dir: &Path) -> Result<()> {
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
