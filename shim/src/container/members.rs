//! A Kubernetes pod's versions cover its members too (`crate::pod`: the
//! pod's app containers beside its sandbox container, e.g. a database
//! sidecar the agent talks to).
//!
//! A member's part of a version is in two places, both crabd's:
//! - in the version's process image, `pod-members/<its CRI name>/`:
//!   `images/` (CRIU's dump of its processes), `snapshot` (the name of its
//!   files' copy) and `layers` (the image layers those files are changes
//!   to); crabd seals and verifies them with the image;
//! - in the sandbox's overlay-copy store, `.pod-members/<its CRI name>/`: a
//!   copy of its writable layer, named as the version's own file snapshot
//!   and sharing untouched files with the copy before it by hard link;
//!   crabd deletes it with that snapshot.
//!
//! A restarted member (a new container id, the same name) takes its part.
//! A checkpoint freezes the sandbox and every running member before it
//! captures any of them, and thaws them after: one cut of the whole pod. A
//! restore checks every part it will take back before anything changes;
//! it kills every process of the pod before it restores any (a connection
//! between two of them must not see one side die after the other came
//! back), then restores the members, then the sandbox. The undo checkpoint
//! covers the members too, so a failed restore puts the whole pod back. A
//! part whose member does not run now, or runs another image, is passed
//! over (logged); a member that has no part (it started after) is left as
//! it is.

use std::path::{Path, PathBuf};

use crab_api::shim::{FsTarget, POD_MEMBERS_DIR, POD_MEMBER_STORES};
use crab_api::SnapshotName;

use crate::error::{Error, Result};
use crate::process::ProcessState;
use crate::runtime::RuntimeClient;

use super::Container;

/// A member's process image in its part.
const IMAGES: &str = "images";

/// The name of a member's files' copy, in its part.
const SNAPSHOT: &str = "snapshot";

/// The image layers of a member's files, in its part.
const LAYERS: &str = "layers";

/// A member of the pod, locked for a checkpoint or a restore of the pod.
pub type Member<'a> = tokio::sync::MutexGuard<'a, Container>;

/// A member's part of process image `images`, by its name.
fn part(images: &Path, name: &str) -> PathBuf {
    images.join(POD_MEMBERS_DIR).join(name)
}

/// Where the copies of member `name`'s files are, beside the sandbox's own
/// in `store`, and the one named `snapshot`.
fn member_target(store: &Path, name: &str, snapshot: SnapshotName) -> FsTarget {
    FsTarget {
        name: snapshot,
        store: store.join(POD_MEMBER_STORES).join(name),
    }
}

/// A member's part that a restore takes back.
pub(super) struct Part {
    /// Which of the members.
    pub index: usize,
    /// Its process image.
    pub images: PathBuf,
    /// Its files' copy.
    pub files: FsTarget,
}

/// The names of the members with a part in process image `images` (none
/// when it was taken without members).
fn parts(images: &Path) -> Result<Vec<String>> {
    let dir = images.join(POD_MEMBERS_DIR);
    let bad = |reason: String| Error::InvalidCheckpoint {
        path: dir.clone(),
        reason,
    };
    let entries = match std::fs::read_dir(&dir) {
        Ok(entries) => entries,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Vec::new()),
        Err(e) => return Err(bad(e.to_string())),
    };
    let mut names = Vec::new();
    for entry in entries {
        let entry = entry.map_err(|e| bad(e.to_string()))?;
        let name = entry.file_name().to_string_lossy().into_owned();
        if !crate::pod::is_member_name(&name) {
            return Err(bad(format!("{name:?} names no pod member")));
        }
        names.push(name);
    }
    names.sort();
    Ok(names)
}

/// A small file of a part, as text.
fn read_part_file(dir: &Path, file: &str) -> Result<String> {
    let path = dir.join(file);
    std::fs::read_to_string(&path).map_err(|e| Error::InvalidCheckpoint {
        path,
        reason: e.to_string(),
    })
}

// === impl Container ===

impl Container {
    /// Whether it is a member that runs now (one a checkpoint covers).
    pub fn member_runs(&self) -> bool {
        self.init.state == ProcessState::Running && self.pod_member.is_some()
    }

    /// Why this app container of a pod (not its sandbox) cannot be in the
    /// pod's versions, if it cannot: it then runs outside them, as the
    /// pause container does, and is not counted as a member.
    pub fn unversioned_reason(&self) -> Option<String> {
        if self.pod_member.is_none() {
            return Some("its name in the pod is not a DNS label".to_owned());
        }
        if let Err(e) = self.rootfs.check_member_files(&self.id) {
            return Some(e.to_string());
        }
        let spec = match oci_spec::runtime::Spec::load(self.bundle.join("config.json")) {
            Ok(spec) => spec,
            Err(e) => return Some(format!("its spec cannot be read: {e}")),
        };
        let joins_pid_ns =
            crate::runtime::joined_ns::named(&spec, oci_spec::runtime::LinuxNamespaceType::Pid)
                .is_some_and(|n| n.path().is_some());
        joins_pid_ns.then(|| {
            "it shares another container's process namespace (kubectl debug --target, \
             shareProcessNamespace), which CRIU dumps only with its init"
                .to_owned()
        })
    }

    /// Checks, before any freeze, that this running member of a pod can be
    /// captured with it.
    pub(super) async fn check_member(&self) -> Result<()> {
        self.rootfs.check_member_files(&self.id)?;
        self.refuse_undumpable().await
    }

    /// Captures this member, frozen, as its part of process image `images`
    /// and of the version's file snapshot `fs`.
    pub(super) async fn capture_member(
        &self,
        images: &Path,
        fs: &FsTarget,
        runtime: &RuntimeClient,
    ) -> Result<()> {
        let name = self.pod_member.as_deref().expect("a running member has a name");
        let dir = part(images, name);
        let target = member_target(&fs.store, name, fs.name.clone());
        for d in [&dir, &target.store] {
            std::fs::create_dir_all(d).map_err(Error::io(format!("create {}", d.display())))?;
        }
        self.rootfs.snapshot(&target, &self.fs_ctx(runtime)).await?;
        for (file, text) in [
            (SNAPSHOT, fs.name.to_string()),
            (LAYERS, self.rootfs.lower_layers()),
        ] {
            let path = dir.join(file);
            std::fs::write(&path, text).map_err(Error::io(format!("write {}", path.display())))?;
        }
        self.dump_processes(&dir.join(IMAGES), runtime).await
    }

    /// Deletes this member's copy of its files named `name` (an undo
    /// checkpoint's, once the restore is over), if it has one.
    pub(super) async fn forget_member_files(
        &self,
        store: &Path,
        name: &SnapshotName,
        runtime: &RuntimeClient,
    ) {
        let Some(member) = &self.pod_member else {
            return;
        };
        let target = member_target(store, member, name.clone());
        let ctx = self.fs_ctx(runtime);
        if self.rootfs.check_snapshot(&target, &ctx).await.is_ok() {
            if let Err(e) = self.rootfs.destroy(&target, &ctx).await {
                tracing::warn!(error = %crab_api::error_chain(&e), "{}: remove the undo copy of its files", self.id);
            }
        }
    }
}

/// The members' parts of process image `images` that a restore takes back
/// (`store`: the sandbox's overlay-copy store), each checked; nothing
/// changes here. A part whose member does not run now, or runs another
/// image, is passed over, and a running member without a part is left as
/// it is (both logged).
pub(super) async fn plan(
    images: &Path,
    store: Option<&Path>,
    members: &[Member<'_>],
    pod_sandbox: &str,
    runtime: &RuntimeClient,
) -> Result<Vec<Part>> {
    let mut plan = Vec::new();
    for name in parts(images)? {
        let dir = part(images, &name);
        // A restarted member is a new container of the same name, and its
        // exited predecessor may still be in the shim.
        let Some(index) = members
            .iter()
            .position(|m| m.member_runs() && m.pod_member.as_deref() == Some(name.as_str()))
        else {
            tracing::warn!("{pod_sandbox}: the pod's container {name} does not run now: its part of the version is passed over");
            continue;
        };
        let m = &members[index];
        if read_part_file(&dir, LAYERS)? != m.rootfs.lower_layers() {
            tracing::warn!(
                "{pod_sandbox}: the pod's container {name} runs another image than at the version: its part is passed over"
            );
            continue;
        }
        let store = store.ok_or_else(|| Error::PodMember {
            id: pod_sandbox.to_owned(),
            reason: "the version has parts of the pod's other containers but no file snapshot".to_owned(),
        })?;
        let snapshot = read_part_file(&dir, SNAPSHOT)?;
        let snapshot = SnapshotName::new(snapshot.trim()).map_err(|e| Error::InvalidCheckpoint {
            path: dir.join(SNAPSHOT),
            reason: e.to_string(),
        })?;
        let files = member_target(store, &name, snapshot);
        let member_images = dir.join(IMAGES);
        super::snapshot::check_images(&member_images)?;
        m.rootfs.check_snapshot(&files, &m.fs_ctx(runtime)).await?;
        crate::runtime::restore_preflight(&m.bundle, &member_images).map_err(|reason| {
            Error::InvalidBundle {
                bundle: m.bundle.clone(),
                reason,
            }
        })?;
        plan.push(Part {
            index,
            images: member_images,
            files,
        });
    }
    for (i, m) in members.iter().enumerate() {
        if m.member_runs() && !plan.iter().any(|p| p.index == i) {
            tracing::info!(
                "{pod_sandbox}: the pod's container {} has no part in the version: left as it is",
                m.id
            );
        }
    }
    Ok(plan)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parts_are_named_by_dns_labels_only() {
        let dir = tempfile::tempdir().unwrap();
        assert!(parts(dir.path()).unwrap().is_empty(), "no members");
        std::fs::create_dir_all(dir.path().join(POD_MEMBERS_DIR).join("db")).unwrap();
        std::fs::create_dir_all(dir.path().join(POD_MEMBERS_DIR).join("cache-2")).unwrap();
        assert_eq!(parts(dir.path()).unwrap(), vec!["cache-2", "db"]);
        std::fs::create_dir_all(dir.path().join(POD_MEMBERS_DIR).join("..x")).unwrap();
        assert!(matches!(parts(dir.path()), Err(Error::InvalidCheckpoint { .. })));
    }

    #[test]
    fn a_members_copies_are_kept_beside_the_sandboxs_by_its_name() {
        let t = member_target(
            Path::new("/crabd/fs/agent"),
            "db",
            SnapshotName::new("c1").unwrap(),
        );
        assert_eq!(t.store, Path::new("/crabd/fs/agent/.pod-members/db"));
        assert_eq!(t.name.as_str(), "c1");
        assert!(
            SnapshotName::new(POD_MEMBER_STORES).is_err(),
            "no snapshot is named so"
        );
    }
}
