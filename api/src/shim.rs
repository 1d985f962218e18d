//! The messages of each shim's control API (crabd → shim), JSON over
//! HTTP/1.1 on the shim's root-only control socket: `POST /checkpoint`
//! ([`ShimCheckpoint`] → [`ShimCheckpointed`]), `POST /restore`
//! ([`ShimRestore`] → [`ShimRestored`]) and `POST /forget` ([`ShimForget`]
//! → [`ShimForgotten`]); paths in [`crate::routes::shim`].

use std::path::PathBuf;

use serde::{Deserialize, Serialize};

use crate::{FsSnapshot, SnapshotName};

/// Spec annotation with which crabd creates a sandbox from a checkpoint:
/// crab's shim restores the init at Start from the process image in this
/// directory instead of running the spec's process.
pub const RESTORE_ANNOTATION: &str = "io.crab.restore.images";

/// Spec annotation beside [`RESTORE_ANNOTATION`] with which crabd resumes
/// a sandbox in its own container (`crabctl resume`): where the restored
/// version stands in the conversation ([`ConversationAt`] as JSON). The
/// shim then keeps the sandbox's transcript and fast-forwards its agent.
pub const CONVERSATION_ANNOTATION: &str = "io.crab.restore.conversation";

/// Spec annotation beside [`RESTORE_ANNOTATION`]: the token of crabd's
/// grant of this one restore ([`RestoreGrant`]). A shim restores only what
/// crabd granted: anyone who can set a container's annotations could
/// otherwise have a root shim restore any directory (another sandbox's
/// process images) into their container.
pub const RESTORE_TOKEN_ANNOTATION: &str = "io.crab.restore.token";

/// crabd's grant of one restore, in `<crabd root>/restores/<token>.json`
/// (0600 in a 0700 directory; only root reads it): the shim that creates
/// container `sandbox` in `namespace` may restore its init from `images`.
/// The shim removes it as it takes it; crabd removes it when its start is
/// over, taken or not.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RestoreGrant {
    /// The container.
    pub sandbox: String,
    /// Its containerd namespace.
    pub namespace: String,
    /// The process image it restores.
    pub images: PathBuf,
}

impl RestoreGrant {
    /// Where the grant with `token` lives under crabd's `root`; None when
    /// `token` is not one crabd makes (32 lower-case hex digits).
    pub fn path(root: &std::path::Path, token: &str) -> Option<PathBuf> {
        let ok = token.len() == 32 && token.bytes().all(|b| matches!(b, b'0'..=b'9' | b'a'..=b'f'));
        ok.then(|| root.join("restores").join(format!("{token}.json")))
    }
}

/// The directory of a pod's process image that holds its other
/// containers' parts (`pod-members/<CRI name>/`: their CRIU images, and
/// the name of their files' copy), beside the sandbox container's own CRIU
/// images.
pub const POD_MEMBERS_DIR: &str = "pod-members";

/// The directory of a sandbox's overlay-copy store ([`FsTarget::store`])
/// that holds a store per other container of its pod
/// (`.pod-members/<CRI name>/`), whose copies are named as the version's
/// own file snapshot. No snapshot can be named so.
pub const POD_MEMBER_STORES: &str = ".pod-members";

/// `POST /checkpoint` to a shim: freeze, snapshot files, dump processes, thaw.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ShimCheckpoint {
    /// Where CRIU writes the process image; none for a files-only checkpoint.
    pub images_dir: Option<PathBuf>,
    /// The filesystem snapshot to take, and where its backend keeps copies.
    pub fs: Option<FsTarget>,
    /// The inspector saw the pod's other containers change nothing since
    /// the version whose process image this one inherits: a checkpoint
    /// without a process image may leave them out (their parts there
    /// still hold). Otherwise the shim refuses one while they run.
    #[serde(default)]
    pub members_unchanged: bool,
}

/// A filesystem snapshot to take or go back to.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct FsTarget {
    /// Its name in the backend.
    pub name: SnapshotName,
    /// Where a copying backend keeps the sandbox's snapshots (crabd's).
    pub store: PathBuf,
}

/// A shim's answer to `POST /checkpoint`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ShimCheckpointed {
    /// How long the sandbox was frozen, in milliseconds.
    pub frozen_ms: f64,
    /// The snapshot taken, if one was asked for.
    pub fs: Option<FsSnapshot>,
    /// Where CRIU worked (its log): the checkpoint's own output, not a
    /// change of the sandbox's files.
    #[serde(default)]
    pub work_dir: Option<PathBuf>,
    /// Where CRIU worked for each of the pod's other containers captured
    /// with it: the same for theirs.
    #[serde(default)]
    pub member_work_dirs: Vec<PathBuf>,
}

/// `POST /restore` to a shim: replace the sandbox's processes (and files)
/// with a checkpoint's.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ShimRestore {
    /// The process image to restore.
    pub images_dir: PathBuf,
    /// The filesystem snapshot to roll back to first, if any.
    pub fs: Option<FsTarget>,
    /// Take an undo checkpoint first, so that a failed restore puts the
    /// sandbox back as it was (without it, a failed restore loses the
    /// sandbox's processes).
    #[serde(default = "yes")]
    pub undo: bool,
    /// Where the restored version stands in the sandbox's conversation:
    /// the proxy answers what the restored agent asks again from the
    /// transcript. None: the version ended no turn (the conversation goes on
    /// as it is).
    #[serde(default)]
    pub conversation: Option<ConversationAt>,
    /// A safety rollback's notice: the restored agent gets it as the answer
    /// to the request it asks again (`conversation.turn`'s) instead of the
    /// recorded one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub notice: Option<String>,
}

/// Where a version stands in its sandbox's conversation (the transcript's
/// tree of branches; see `crab_proxy::transcript`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct ConversationAt {
    /// The branch of the conversation the version's turn is on (0: the
    /// root).
    pub branch: u64,
    /// The turn whose end the version is: its request was in flight.
    pub turn: u64,
    /// The turn whose end its process image was taken at (the restored
    /// agent's memory, which asks that turn's request again first); None
    /// when that image ended no turn.
    pub image_turn: Option<u64>,
}

fn yes() -> bool {
    true
}

/// `POST /restore-files` to a shim: make the sandbox's files snapshot
/// `fs`'s in place, its processes kept (frozen meanwhile).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ShimRestoreFiles {
    /// The filesystem snapshot.
    pub fs: FsTarget,
}

/// A shim's answer to `POST /restore-files`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ShimFilesRestored {
    /// Entries written (created, replaced or given new metadata).
    pub written: u64,
    /// Entries removed.
    pub removed: u64,
    /// How long the sandbox was frozen, in milliseconds.
    pub frozen_ms: f64,
}

/// A shim's answer to `POST /restore`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ShimRestored {
    /// The restored init's pid on the host.
    pub pid: i32,
    /// How long the restore took, in milliseconds (the undo checkpoint
    /// included).
    pub restore_ms: f64,
    /// Of which the undo checkpoint (the way back if the restore failed).
    pub undo_ms: f64,
}

/// `POST /forget` to a shim: delete file snapshots that no version names
/// any more and that live on the sandbox's own filesystem (ZFS, btrfs;
/// crabd deletes the overlay copies it keeps itself).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ShimForget {
    /// The snapshots.
    pub snapshots: Vec<SnapshotName>,
}

/// A shim's answer to `POST /forget`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ShimForgotten {
    /// The snapshots deleted; the others are kept (the shim logs why: one
    /// a ZFS clone still needs, say) until the sandbox is deleted.
    pub destroyed: Vec<SnapshotName>,
}
