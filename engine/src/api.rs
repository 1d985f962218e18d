//! The JSON messages of crabd's management API (crabctl and shims → crabd)
//! and of each shim's control API (crabd → shim), both HTTP/1.1 over
//! root-only unix sockets.
//!
//! crabd's routes, under `/v1`:
//!
//! | method | path | body → answer |
//! |---|---|---|
//! | GET | `/sandboxes` | → `[SandboxInfo]` |
//! | POST | `/sandboxes` | `Registration` → `SandboxInfo` (a shim registers) |
//! | GET | `/sandboxes/{sel}` | → `SandboxInfo` |
//! | DELETE | `/sandboxes/{id}` | → `{}` (a shim unregisters; versions stay) |
//! | POST | `/sandboxes/{sel}/checkpoint` | `CheckpointRequest` → `CheckpointReport` |
//! | POST | `/sandboxes/{sel}/turns` | `TurnEnd` → `CheckpointReport` (a shim's proxy: a turn ended) |
//! | GET | `/sandboxes/{sel}/versions` | → `[VersionView]` |
//! | POST | `/sandboxes/{sel}/rollback` | `RollbackRequest` → `RollbackReport` |
//! | DELETE | `/sandboxes/{sel}/versions/{version}` | → `RemovalReport` |
//! | POST | `/sandboxes/{sel}/fork` | `ForkRequest` → `ForkReport` |
//! | POST | `/sandboxes/{sel}/turn` | → `TurnReport` (ends the inspector's turn by hand) |
//! | GET | `/sandboxes/{sel}/watch` | → `TurnReport`s as JSON lines, as turns end |
//! | GET | `/sandboxes/{sel}/versions/{version}/export` | → a tar archive (`crate::archive`) |
//! | POST | `/import?name=&namespace=&containerd=` | a tar archive → `ImportReport` |
//!
//! `{sel}` is a sandbox id or a unique prefix of one. Errors answer with a
//! 4xx/5xx status and an [`ErrorBody`].
//!
//! crabd also serves agents that run outside their sandbox, on TCP
//! `127.0.0.1:[crabd] proxy_port`: `/s/<id>/…` is relayed to the unix socket
//! on which the sandbox's shim serves its LLM proxy
//! ([`Registration::proxy`]); [`SandboxInfo::proxy_url`] is that base URL.
//!
//! A shim's routes: `POST /checkpoint` (`ShimCheckpoint` →
//! `ShimCheckpointed`), `POST /restore` (`ShimRestore` → `ShimRestored`)
//! and `POST /forget` (`ShimForget` → `ShimForgotten`).

use std::path::PathBuf;

use crab_snapshotter::{BackendKind, Location, SnapshotName};
use serde::{Deserialize, Serialize};

use crate::{Class, FsSnapshot, VersionRecord};

/// Spec annotation with which crabd creates a sandbox from a checkpoint:
/// crab's shim restores the init at Start from the process image in this
/// directory instead of running the spec's process.
pub const RESTORE_ANNOTATION: &str = "io.crab.restore.images";

/// A running sandbox, as its shim registers it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Registration {
    /// The container id, as containerd knows it.
    pub id: String,
    /// The containerd namespace.
    pub namespace: String,
    /// containerd's gRPC socket (where a fork of the sandbox is created).
    pub containerd: PathBuf,
    /// The shim's control socket.
    pub control: PathBuf,
    /// The init's pid on the host.
    pub pid: i32,
    /// The filesystem backend that can snapshot its rootfs, if one can.
    pub fs_backend: Option<BackendKind>,
    /// The unix socket on which the shim serves the sandbox's LLM proxy on
    /// the host, if the sandbox has a proxy (crabd relays its host listener
    /// there).
    #[serde(default)]
    pub proxy: Option<PathBuf>,
    /// The sandbox's cgroup directory in the unified (v2) hierarchy, by
    /// which the inspector follows its tasks.
    #[serde(default)]
    pub cgroup: Option<PathBuf>,
    /// The sandbox's writable layer on the host (overlay upper directory,
    /// btrfs subvolume, ZFS mount point): it lives as long as the
    /// sandbox's files do (across a task's stop and start, even under
    /// docker, which makes a new containerd container each start), so it
    /// tells a sandbox from a later one with the same id, and its going
    /// tells crabd that the sandbox was removed.
    #[serde(default)]
    pub layer: Option<PathBuf>,
    /// Where the shim keeps file snapshots outside crabd's root and outside
    /// the rootfs's own dataset (a btrfs store): crabd deletes them with
    /// the sandbox's history when its container is removed.
    #[serde(default)]
    pub own_snapshots: Option<Location>,
}

/// What a turn of a sandbox changed, as the inspector saw it
/// (`crabctl turn`, `crabctl watch`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TurnReport {
    /// The sandbox.
    pub sandbox: String,
    /// The inspector's turn number for the sandbox, from 1.
    pub turn: u64,
    /// What recovery needs of the turn: `none`, `fs`, `proc` or `full`.
    pub class: Class,
    /// Why (a bounded sample: changed paths, started or exited processes,
    /// or why the inspector could not vouch for the turn).
    pub reasons: Vec<serde_json::Value>,
}

/// A sandbox as `crabctl ps` lists it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct SandboxInfo {
    /// Its registration.
    #[serde(flatten)]
    pub registration: Registration,
    /// Whether its task runs. A stopped sandbox keeps its versions (list,
    /// export, fork them) until containerd removes its container.
    pub running: bool,
    /// How many versions it has (valid or not).
    pub versions: usize,
    /// Its newest version number, if any.
    pub latest: Option<u64>,
    /// The base URL of its LLM proxy on crabd's host listener
    /// (`http://127.0.0.1:PORT/s/<id>`), when both exist.
    pub proxy_url: Option<String>,
}

/// `POST /v1/sandboxes/{sel}/turns`: the sandbox's proxy saw a turn end and
/// holds the turn's answer until crabd has made the turn safe.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct TurnEnd {
    /// The turn that ended (from 1, per sandbox).
    pub turn: u64,
    /// How many turns of the transcript belong to the turn's version.
    pub transcript_turns: u64,
}

/// `POST /v1/sandboxes/{sel}/checkpoint`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct CheckpointRequest {
    /// `fs` (files only) or `full` (files and processes).
    pub class: Class,
}

/// What a checkpoint made, and what it cost the sandbox.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct CheckpointReport {
    /// The published version.
    pub version: VersionRecord,
    /// How long the sandbox was frozen, in milliseconds.
    pub frozen_ms: f64,
    /// The whole checkpoint, hashing and publishing included, in milliseconds.
    pub total_ms: f64,
}

/// Which version: a number, or the newest valid one.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum VersionSel {
    /// The newest version that passes verification.
    Latest,
    /// This version number.
    Number(u64),
}

/// `POST /v1/sandboxes/{sel}/rollback`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct RollbackRequest {
    /// The version to go back to.
    pub version: VersionSel,
    /// Take an undo checkpoint first (see [`ShimRestore::undo`]).
    #[serde(default = "yes")]
    pub undo: bool,
}

/// What a rollback did.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RollbackReport {
    /// The version the sandbox now runs.
    pub version: u64,
    /// The restored init's pid on the host.
    pub pid: i32,
    /// The restore in the shim, in milliseconds.
    pub restore_ms: f64,
    /// Of which the undo checkpoint, in milliseconds.
    pub undo_ms: f64,
    /// The whole rollback, verification included, in milliseconds.
    pub total_ms: f64,
}

/// `POST /v1/sandboxes/{sel}/fork`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ForkRequest {
    /// The version to fork from.
    pub version: VersionSel,
    /// The new sandbox's container id (default: `<id>-fork-<version>-<n>`).
    pub name: Option<String>,
}

/// A new sandbox made from a version.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ForkReport {
    /// Its container id.
    pub id: String,
    /// Its init's pid on the host.
    pub pid: u32,
    /// The version it was made from.
    pub version: u64,
    /// The whole fork, in milliseconds.
    pub total_ms: f64,
}

/// A sandbox made from an archive.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ImportReport {
    /// Its container id.
    pub id: String,
    /// Its version holding the archive's state (1 for a new sandbox).
    pub version: u64,
    /// Its init's pid on the host.
    pub pid: u32,
    /// The whole import, in milliseconds.
    pub total_ms: f64,
}

/// One manifest line as `crabctl versions` lists it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct VersionView {
    /// The manifest line, from 1.
    pub line: u64,
    /// The version's record, unless its line is unreadable.
    #[serde(flatten)]
    pub record: Option<VersionRecord>,
    /// Why it cannot be restored, if it cannot.
    pub defect: Option<String>,
}

/// What `rm-version` removed.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct RemovalReport {
    /// Versions whose manifest lines were dropped.
    pub removed: Vec<u64>,
}

/// The body of every error answer.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ErrorBody {
    /// What went wrong, for a human.
    pub error: String,
}

/// `POST /checkpoint` to a shim: freeze, snapshot files, dump processes, thaw.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ShimCheckpoint {
    /// Where CRIU writes the process image; none for a files-only checkpoint.
    pub images_dir: Option<PathBuf>,
    /// The filesystem snapshot to take, and where its backend keeps copies.
    pub fs: Option<FsTarget>,
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
}

fn yes() -> bool {
    true
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

// === impl VersionSel ===

impl std::str::FromStr for VersionSel {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        if s == "latest" {
            return Ok(VersionSel::Latest);
        }
        s.parse::<u64>()
            .ok()
            .filter(|n| *n > 0)
            .map(VersionSel::Number)
            .ok_or_else(|| {
                format!("invalid version {s:?}: a version number from `crabctl versions`, or `latest`")
            })
    }
}

impl std::fmt::Display for VersionSel {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            VersionSel::Latest => f.write_str("latest"),
            VersionSel::Number(n) => write!(f, "{n}"),
        }
    }
}

impl Serialize for VersionSel {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        match self {
            VersionSel::Latest => s.serialize_str("latest"),
            VersionSel::Number(n) => s.serialize_u64(*n),
        }
    }
}

impl<'de> Deserialize<'de> for VersionSel {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        #[derive(Deserialize)]
        #[serde(untagged)]
        enum Raw {
            N(u64),
            S(String),
        }
        match Raw::deserialize(d)? {
            Raw::N(n) => n.to_string().parse().map_err(serde::de::Error::custom),
            Raw::S(s) => s.parse().map_err(serde::de::Error::custom),
        }
    }
}
