//! A Kubernetes pod's versions cover its members too (`crate::pod`: the
//! pod's app containers beside its sandbox container, e.g. a database
//! sidecar the agent talks to).
//!
//! A member's part of a version is in the version's process image, under
//! `pod-members/<its CRI name>/`: `images/` (CRIU's dump of its processes)
//! and `files.crab` (its writable layer as one overlay-copy stream). crabd
//! therefore seals, verifies, keeps and deletes it with the image, and a
//! restarted member (a new container id, the same name) takes its part.
//!
//! A checkpoint freezes the sandbox and every running member before it
//! captures any of them, and thaws them after: one cut of the whole pod. A
//! restore checks every part it will take back before anything changes,
//! then replaces the members' processes and files, then the sandbox's;
//! the undo checkpoint covers the members too, so a failed restore puts the
//! whole pod back. A member that runs now but has no part in the version
//! (it started after) is left as it is.

use std::path::{Path, PathBuf};

use crate::error::{Error, Result};
use crate::process::ProcessState;
use crate::runtime::RuntimeClient;

use super::snapshot::FilesAt;
use super::{Container, ExitReceiver};

/// The directory of a process image holding its members' parts.
const MEMBERS: &str = crab_api::shim::POD_MEMBERS_DIR;

/// A member's files in its part.
const FILES: &str = "files.crab";

/// A member's process image in its part.
const IMAGES: &str = "images";

/// A member's part of a version's process image `images`, by its name.
fn part(images: &Path, name: &str) -> PathBuf {
    images.join(MEMBERS).join(name)
}

/// The names of the members with a part in process image `images` (none
/// when it was taken without members).
pub(super) fn parts(images: &Path) -> Result<Vec<String>> {
    let dir = images.join(MEMBERS);
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

// === impl Container ===

impl Container {
    /// Checks, before any freeze, that this member of a pod can be captured
    /// with its pod; answers its name.
    pub(super) async fn check_member(&self, pod_sandbox: &str) -> Result<&str> {
        let refuse = |reason: String| Error::PodMember {
            id: pod_sandbox.to_owned(),
            reason,
        };
        let name = self
            .pod_member
            .as_deref()
            .ok_or_else(|| refuse(format!("its container {} has no name in the pod", self.id)))?;
        self.rootfs.check_streamable(&self.id)?;
        self.refuse_undumpable().await?;
        Ok(name)
    }

    /// Whether it is a member that runs now (one a checkpoint covers).
    pub fn member_runs(&self) -> bool {
        self.init.state == ProcessState::Running
    }

    /// Captures this member, frozen, as its part of process image `images`.
    pub(super) async fn capture_member(&self, images: &Path, runtime: &RuntimeClient) -> Result<()> {
        let name = self.pod_member.as_deref().expect("checked by check_member");
        let dir = part(images, name);
        std::fs::create_dir_all(&dir).map_err(Error::io(format!("create {}", dir.display())))?;
        self.rootfs
            .export_live(&dir.join(FILES), &self.fs_ctx(runtime))
            .await?;
        self.dump_processes(&dir.join(IMAGES), runtime).await
    }

    /// Checks, before anything changes, that this member can take back
    /// its part of process image `images`.
    pub(super) fn check_member_part(&self, images: &Path, pod_sandbox: &str) -> Result<()> {
        let name = self.pod_member.as_deref().expect("matched by name");
        let dir = part(images, name);
        if !self.member_runs() {
            return Err(Error::PodMember {
                id: pod_sandbox.to_owned(),
                reason: format!("its member {name} is not running"),
            });
        }
        self.rootfs.check_streamable(&self.id)?;
        super::snapshot::check_images(&dir.join(IMAGES))?;
        if !std::fs::symlink_metadata(dir.join(FILES)).is_ok_and(|m| m.is_file()) {
            return Err(Error::InvalidCheckpoint {
                path: dir,
                reason: format!("no {FILES}"),
            });
        }
        crate::runtime::restore_preflight(&self.bundle, &dir.join(IMAGES)).map_err(|reason| {
            Error::InvalidBundle {
                bundle: self.bundle.clone(),
                reason,
            }
        })
    }

    /// Replaces this member's processes and files with its part of process
    /// image `images` (checked by [`Container::check_member_part`]).
    pub(super) async fn restore_member(
        &mut self,
        images: &Path,
        runtime: &RuntimeClient,
    ) -> Result<(i32, ExitReceiver)> {
        let name = self.pod_member.clone().expect("matched by name");
        let dir = part(images, &name);
        self.replace_processes(
            &dir.join(IMAGES),
            Some(FilesAt::Stream(&dir.join(FILES))),
            (None, None),
            runtime,
        )
        .await
    }
}

/// A member of the pod, locked for a checkpoint or a restore of the pod.
pub type Member<'a> = tokio::sync::MutexGuard<'a, Container>;

/// The members (indexes into `members`) that take back a part of process
/// image `images`, each checked; an error if a part has no running member
/// of its name. Nothing changes here.
pub(super) fn plan(images: &Path, members: &[Member<'_>], pod_sandbox: &str) -> Result<Vec<usize>> {
    let mut plan = Vec::new();
    for name in parts(images)? {
        let i = members
            .iter()
            // A restarted member is a new container of the same name, and
            // its exited predecessor may still be in the shim.
            .position(|m| m.member_runs() && m.pod_member.as_deref() == Some(name.as_str()))
            .ok_or_else(|| Error::PodMember {
                id: pod_sandbox.to_owned(),
                reason: format!(
                    "the version covers the pod's container {name}, which does not run in the pod now"
                ),
            })?;
        members[i].check_member_part(images, pod_sandbox)?;
        plan.push(i);
    }
    for (i, m) in members.iter().enumerate() {
        if m.member_runs() && !plan.contains(&i) {
            tracing::info!(
                "{pod_sandbox}: the pod's container {} started after the version: left as it is",
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
        std::fs::create_dir_all(dir.path().join(MEMBERS).join("db")).unwrap();
        std::fs::create_dir_all(dir.path().join(MEMBERS).join("cache-2")).unwrap();
        assert_eq!(parts(dir.path()).unwrap(), vec!["cache-2", "db"]);
        std::fs::create_dir_all(dir.path().join(MEMBERS).join("..x")).unwrap();
        assert!(matches!(parts(dir.path()), Err(Error::InvalidCheckpoint { .. })));
    }
}
