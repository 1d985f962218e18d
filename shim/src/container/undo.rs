//! A rollback's undo: what puts the sandbox back as it was when the
//! restore fails.
//!
//! Where it can, the sandbox's processes are kept aside, frozen, until the
//! restore has succeeded (`crate::freezer::Aside`): no dump, and a failed
//! restore gives back the very same processes. That needs every namespace
//! of the tree to be its own (the restored tree gets new ones, so the old
//! tree's sockets and IPC objects are not in its way: not docker's pinned
//! network, not a pod's, not the host's), all its processes in its cgroup
//! itself, and room under its memory and pids limits for both trees at
//! once. Elsewhere the undo is a checkpoint of the sandbox (a dump), as
//! before.
//!
//! Nor may the restore roll the files back: that rewrites the writable
//! layer in place under the overlay the old tree still has mounted (or
//! swaps a btrfs subvolume from under it), and a file it deletes and the
//! undo makes again is a new inode, which the old tree's open files and
//! cached names would not see. Processes kept aside are put back
//! faithfully only if their files never changed; so a restore with files
//! makes the dump, until the files of a rollback go to a writable layer
//! of their own while the old one waits aside with its processes.

use std::path::{Path, PathBuf};
use std::time::Instant;

use crab_api::shim::{FsTarget, ShimCheckpoint};
use crab_api::SnapshotName;
use oci_spec::runtime::LinuxNamespaceType;

use super::Container;
use crate::error::{Error, Result};
use crate::freezer::Aside;
use crate::io::ProcessIo;
use crate::runtime::RuntimeClient;

/// How a restore in progress can be undone.
pub(super) enum Undo {
    /// None was asked for.
    Nothing,
    /// A checkpoint of the sandbox as it was: its images and files.
    Dump { images: PathBuf, fs: Option<FsTarget> },
    /// Its processes aside, frozen, and a snapshot of its files.
    Aside(Box<Kept>),
}

impl Undo {
    /// Where the processes wait aside, if they do.
    pub(super) fn aside_dir(&self) -> Option<&Path> {
        match self {
            Undo::Aside(kept) => Some(kept.aside.dir()),
            _ => None,
        }
    }
}

/// The processes kept aside and what goes back with them.
pub(super) struct Kept {
    aside: Aside,
    fs: Option<FsTarget>,
    /// Their init's pid.
    init: i32,
    /// Their init's stdio copiers (they still hold its pipes).
    io: Option<ProcessIo>,
    /// crab's network-namespace pin named theirs (a restore re-pins it).
    pinned: bool,
}

// === impl Container ===

impl Container {
    /// Makes the undo of a restore of `images` whose files are `fs`, as
    /// `undo` asks; answers it and how long it took (ms).
    pub(super) async fn make_undo(
        &mut self,
        undo: bool,
        images: &Path,
        fs: Option<&FsTarget>,
        runtime: &RuntimeClient,
    ) -> Result<(Undo, f64)> {
        if !undo {
            return Ok((Undo::Nothing, 0.0));
        }
        let started = Instant::now();
        let fs = fs.map(|t| FsTarget {
            name: SnapshotName::new(&format!("undo-{}", super::snapshot::unix_ms()))
                .expect("a valid snapshot name"),
            store: t.store.clone(),
        });
        match self.may_keep_aside(images, fs.is_some()) {
            Ok(()) => match self.keep_aside(fs.clone(), runtime).await {
                Ok(kept) => {
                    let ms = started.elapsed().as_secs_f64() * 1e3;
                    tracing::info!(
                        "{}: {} processes kept aside for the undo ({ms:.1} ms)",
                        self.id,
                        kept.aside.pids().len()
                    );
                    return Ok((Undo::Aside(Box::new(kept)), ms));
                }
                Err(e) => tracing::warn!(
                    error = %crab_api::error_chain(&e),
                    "{}: could not keep the processes aside; the undo is a checkpoint",
                    self.id
                ),
            },
            Err(why) => tracing::debug!("{}: the undo is a checkpoint: {why}", self.id),
        }
        let images = self.bundle.join(".crab-undo");
        let _ = std::fs::remove_dir_all(&images);
        let checkpoint = ShimCheckpoint {
            images_dir: Some(images.clone()),
            fs: fs.clone(),
        };
        self.engine_checkpoint(&checkpoint, runtime).await?;
        Ok((Undo::Dump { images, fs }, started.elapsed().as_secs_f64() * 1e3))
    }

    /// Why the processes of this sandbox cannot wait aside while `images`
    /// are restored (and its files rolled back, `files`), if they cannot.
    fn may_keep_aside(&self, images: &Path, files: bool) -> std::result::Result<(), String> {
        if files {
            return Err("its files are rolled back in place under the old processes".into());
        }
        let spec = oci_spec::runtime::Spec::load(self.bundle.join("config.json"))
            .map_err(|e| format!("read config.json: {e}"))?;
        let namespaces = spec
            .linux()
            .as_ref()
            .and_then(|l| l.namespaces().clone())
            .unwrap_or_default();
        for kind in [
            LinuxNamespaceType::Pid,
            LinuxNamespaceType::Network,
            LinuxNamespaceType::Ipc,
            LinuxNamespaceType::Mount,
        ] {
            match namespaces.iter().find(|n| n.typ() == kind) {
                None => return Err(format!("it shares the host's {kind:?} namespace")),
                Some(n) if n.path().is_some() => return Err(format!("it joins a {kind:?} namespace")),
                Some(_) => {}
            }
        }
        if !crate::runtime::restores_own_netns(images) {
            return Err("its network namespace is kept outside the checkpoint (docker's)".into());
        }
        if self.freezer.cgroup().is_none() {
            return Err("its freezer cgroup is not known".into());
        }
        crate::cgroup::room::for_twice(self.init.pid)
    }

    /// Freezes the sandbox, snapshots its files as `fs` and moves its
    /// processes aside; its cgroup is thawed, empty, for the restore.
    async fn keep_aside(&mut self, fs: Option<FsTarget>, runtime: &RuntimeClient) -> Result<Kept> {
        let cgroup = self.freezer.cgroup().cloned().ok_or_else(|| {
            Error::io("keep the processes aside")(std::io::Error::other("no freezer cgroup"))
        })?;
        let pin = crate::netns::pin_path(runtime.root(), &self.id);
        let pinned = crate::netns::pins(&pin, self.init.pid);
        self.freeze_for_capture().await?;
        let taken = async {
            if let Some(target) = &fs {
                self.rootfs.snapshot(target, &self.fs_ctx(runtime)).await?;
            }
            let aside = tokio::task::spawn_blocking(move || Aside::take(&cgroup))
                .await
                .map_err(|e| std::io::Error::other(e.to_string()))
                .and_then(|r| r)
                .map_err(Error::io("keep the processes aside"));
            if aside.is_err() {
                if let Some(target) = &fs {
                    let _ = self.rootfs.destroy(target, &self.fs_ctx(runtime)).await;
                }
            }
            aside
        }
        .await;
        let aside = match taken {
            Ok(a) => a,
            Err(e) => {
                // As they were: in their cgroup, running.
                if let Err(thaw) = self.set_frozen(false).await {
                    tracing::error!(error = %crab_api::error_chain(&thaw), "{}: thaw", self.id);
                }
                return Err(e);
            }
        };
        Ok(Kept {
            aside,
            fs,
            init: self.init.pid,
            io: self.init.io.take(),
            pinned,
        })
    }

    /// The restore failed: kills what it left, puts the files of `kept`
    /// back, then its processes, which run on. Answers their init.
    pub(super) async fn put_back(&mut self, kept: Kept, runtime: &RuntimeClient) -> Result<i32> {
        let Kept {
            aside,
            fs,
            init,
            io,
            pinned,
        } = kept;
        self.kill_every_process(Some(aside.dir())).await?;
        if let Some(target) = &fs {
            self.rootfs.rollback(target, &self.fs_ctx(runtime)).await?;
        }
        if pinned {
            let pin = crate::netns::pin_path(runtime.root(), &self.id);
            crate::netns::pin(Path::new(&format!("/proc/{init}/ns/net")), &pin)
                .map_err(Error::io("pin the network namespace again"))?;
        }
        tokio::task::spawn_blocking(move || aside.put_back())
            .await
            .map_err(|e| std::io::Error::other(e.to_string()))
            .and_then(|r| r)
            .map_err(Error::io("put the processes back"))?;
        self.init.pid = init;
        self.init.io = io;
        if let Some(p) = &self.proxy {
            p.rewind(None, None).await;
        }
        if let Some(target) = &fs {
            self.forget_undo_files(target, runtime).await;
        }
        Ok(init)
    }

    /// The restore succeeded: the processes aside die (their output
    /// drains on its own) and their files' snapshot goes.
    pub(super) async fn drop_kept(&mut self, kept: Kept, runtime: &RuntimeClient) {
        let Kept { aside, fs, io, .. } = kept;
        let dir = aside.dir().to_owned();
        let killed = tokio::task::spawn_blocking(move || aside.kill())
            .await
            .map_err(|e| std::io::Error::other(e.to_string()))
            .and_then(|r| r);
        if let Err(e) = killed {
            tracing::error!(error = %e, "{}: the processes kept aside in {}", self.id, dir.display());
        }
        if let Some(mut io) = io {
            tokio::spawn(async move { io.drain(std::time::Duration::from_millis(200)).await });
        }
        if let Some(target) = &fs {
            self.forget_undo_files(target, runtime).await;
        }
    }

    /// Removes an undo's snapshot of the files (a warning if it stays).
    pub(super) async fn forget_undo_files(&self, target: &FsTarget, runtime: &RuntimeClient) {
        if let Err(e) = self.rootfs.destroy(target, &self.fs_ctx(runtime)).await {
            tracing::warn!(error = %crab_api::error_chain(&e), "{}: remove the undo snapshot", self.id);
        }
    }
}
