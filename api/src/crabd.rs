//! The messages of crabd's management API (crabctl and shims → crabd),
//! JSON over HTTP/1.1 on crabd's root-only unix socket. The routes are
//! [`crate::routes`]'s; `openapi.json` describes them.
//!
//! Errors answer with a 4xx/5xx status and an [`ErrorBody`].

use std::path::PathBuf;

use serde::{Deserialize, Serialize};

use crate::{BackendKind, Class, Location, SandboxId, VersionRecord, VersionSel};

/// A running sandbox, as its shim registers it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Registration {
    /// The container id, as containerd knows it.
    pub id: SandboxId,
    /// The containerd namespace.
    pub namespace: String,
    /// containerd's gRPC socket (where a fork of the sandbox is created).
    pub containerd: PathBuf,
    /// The shim's control socket.
    pub control: PathBuf,
    /// The init's pid on the host.
    pub pid: i32,
    /// The init is crab-init, the shim's pid 1 (its own running, reaping
    /// the sandbox's processes, changes nothing).
    #[serde(default)]
    pub crab_init: bool,
    /// The filesystem backend that can snapshot its rootfs, if one can.
    pub fs_backend: Option<BackendKind>,
    /// The unix socket on which the shim serves the sandbox's LLM proxy on
    /// the host, if the sandbox has a proxy (crabd relays its host listener
    /// there).
    #[serde(default)]
    pub proxy: Option<PathBuf>,
    /// The transcript of its LLM proxy, if it has one: deleted with its
    /// history (and the transcripts earlier containers of its id left).
    #[serde(default)]
    pub transcript: Option<PathBuf>,
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
    /// Whether the task's init came back from a process image (a fork or
    /// an import) rather than from the spec's process: a task started
    /// afresh descends from no version, so its next version is whole.
    #[serde(default)]
    pub restored: bool,
    /// The Kubernetes pod whose sandbox this is (`namespace/name`), when
    /// containerd's CRI plugin runs it (a pod is one sandbox).
    #[serde(default)]
    pub pod: Option<String>,
}

/// What a turn of a sandbox changed, as the inspector saw it
/// (`crabctl turn`, `crabctl watch`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TurnReport {
    /// The sandbox.
    pub sandbox: SandboxId,
    /// The inspector's turn number for the sandbox, from 1.
    pub turn: u64,
    /// What recovery needs of the turn: `none`, `fs`, `proc` or `full`.
    pub class: Class,
    /// Why (a bounded sample: changed paths, started or exited processes,
    /// or why the inspector could not vouch for the turn).
    pub reasons: Vec<serde_json::Value>,
    /// How many reasons there were (more than `reasons` when the sample
    /// was cut).
    #[serde(default)]
    pub n_reasons: usize,
}

/// Something that happened to a sandbox: a line of `crabctl logs`, a mark
/// on the timeline of crabd's page.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Event {
    /// When, in milliseconds since the Unix epoch.
    pub at_unix_ms: u64,
    /// The sandbox.
    pub sandbox: SandboxId,
    /// What happened.
    #[serde(flatten)]
    pub kind: EventKind,
}

/// What happened, by kind (the JSON field `event` names it).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "event", rename_all = "snake_case")]
pub enum EventKind {
    /// A turn ended: the inspector's class and the version that covers it,
    /// or why it got none.
    Turn {
        /// The proxy's turn number.
        turn: u64,
        /// The inspector's class (none when it was not asked).
        class: Option<Class>,
        /// The version made for it.
        version: Option<u64>,
        /// Why it got no version.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        error: Option<String>,
    },
    /// A version was published.
    Checkpoint {
        /// Its number.
        version: u64,
        /// What it holds.
        class: Class,
        /// The turn it was made for (none: by hand).
        turn: Option<u64>,
        /// Bytes of process images written.
        bytes: u64,
        /// Milliseconds the sandbox was frozen.
        frozen_ms: f64,
        /// Milliseconds it took, the wait for a slot excluded.
        total_ms: f64,
    },
    /// A turn's answer waited for its version to be safe.
    Hold {
        /// The turn.
        turn: u64,
        /// Milliseconds from the answer's arrival to the version.
        held_ms: f64,
    },
    /// A version was restored in place of the running sandbox.
    Rollback {
        /// The version it runs now.
        version: u64,
        /// Milliseconds of the undo checkpoint, if one was taken.
        undo_ms: Option<f64>,
        /// Milliseconds it took.
        total_ms: f64,
        /// Why, when not asked by a person or the agent (a safety rule).
        #[serde(default, skip_serializing_if = "Option::is_none")]
        reason: Option<String>,
    },
    /// The sandbox's init died unasked and a version was restored.
    Recovery {
        /// The version restored.
        version: u64,
        /// The dead init's exit status.
        exit_status: u32,
        /// Milliseconds from the crash report to running again.
        total_ms: u64,
    },
    /// A checkpoint, rollback or recovery failed.
    Failed {
        /// What failed: `checkpoint`, `rollback` or `recovery`.
        what: String,
        /// Why.
        error: String,
    },
}

/// The URL of crabd's page (`crabctl ui`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct UiUrl {
    /// `http://127.0.0.1:PORT/ui/<secret>/`, or none when the page is off
    /// (`[crabd] ui_port = 0`) or its port could not be bound.
    pub url: Option<String>,
}

/// The first line of a watch: the watch is live, and every turn that ends
/// from now on is reported.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct WatchStarted {
    /// The sandbox watched.
    pub watching: SandboxId,
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
    /// (`http://127.0.0.1:PORT/s/<id>/<secret>`), when both exist.
    pub proxy_url: Option<String>,
    /// How many times its task was recovered after a crash (since its
    /// task started), and the last recovery.
    #[serde(default)]
    pub recoveries: u32,
    /// The last recovery, if any.
    #[serde(default)]
    pub last_recovery: Option<Recovery>,
}

/// `POST /v1/sandboxes/{id}/turns` (an exact id): the sandbox's proxy saw a turn end and
/// holds the turn's answer until crabd has made the turn safe.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct TurnEnd {
    /// The turn that ended (from 1, per sandbox).
    pub turn: u64,
    /// The branch of the sandbox's conversation the turn is on (0: the root).
    #[serde(default)]
    pub branch: u64,
    /// Whether the request that ended it came from inside the sandbox (its
    /// agent is then restored with it by a safety rollback).
    #[serde(default)]
    pub inside: bool,
    /// How many turns of the transcript belong to the turn's version.
    pub transcript_turns: u64,
    /// When the proxy expects the turn's answer, in milliseconds from now
    /// (its running estimate of the sandbox's LLM): the checkpoint's
    /// deadline in crabd's queue. None: crabd's default.
    #[serde(default)]
    pub expected_answer_ms: Option<u64>,
    /// How many other app containers the sandbox's Kubernetes pod has
    /// (its members): a version covers them too.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub pod_members: u32,
    /// Those of them the inspector can follow. A turn whose members are
    /// not all listed, or that one is seen in for the first time (its past
    /// is unknown), is a whole version; so is one in which a member
    /// changed anything.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub members: Vec<PodMember>,
}

/// A container of a Kubernetes pod beside its sandbox, as a turn end names
/// it for the inspector.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct PodMember {
    /// Its container id: the inspector follows it under this name.
    pub id: SandboxId,
    /// Its cgroup directory in the unified (v2) hierarchy.
    pub cgroup: PathBuf,
    /// Its init is crab-init (its reaping changes nothing).
    #[serde(default)]
    pub crab_init: bool,
}

fn is_zero(n: &u32) -> bool {
    *n == 0
}

/// The answer to `POST /v1/sandboxes/{id}/turns/{turn}/answered`: the
/// turn's LLM answer arrived while its version was not yet safe.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct TurnAnswered {
    /// Whether the sandbox's checkpoint was still queued and now goes
    /// first (false: it was already running, or done).
    pub promoted: bool,
}

/// `POST /v1/sandboxes/{id}/turns/{turn}/held`: the turn's answer was
/// held for its version this long, as the sandbox's proxy measured it.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct TurnHeld {
    /// Milliseconds from the answer's arrival to its release.
    pub held_ms: f64,
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
    /// Set when the turn broke a safety rule (`[crabd.safety]`) and was
    /// rolled back instead: `version` is then the version restored.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rolled_back: Option<SafetyRollback>,
}

/// A turn rolled back because it broke a safety rule.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct SafetyRollback {
    /// The rule (`protected_paths`, `forbidden_commands`) and its pattern.
    pub rule: String,
    /// What broke it (a path, a command).
    pub what: String,
    /// The version the sandbox was put back to.
    pub version: u64,
    /// What the agent is told instead of the LLM's answer.
    pub notice: String,
}

/// `POST /v1/sandboxes/{sel}/rollback`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct RollbackRequest {
    /// The version to go back to.
    pub version: VersionSel,
    /// Take an undo checkpoint first (see [`ShimRestore::undo`]).
    #[serde(default = "yes")]
    pub undo: bool,
    /// Put back the version's files only: the processes go on as they
    /// are, and a new whole version records the result (`undo` does not
    /// apply).
    #[serde(default)]
    pub files_only: bool,
}

/// `POST /v1/sandboxes/{id}/recover`: how the sandbox's init died.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Crash {
    /// Its exit status (`128 + N` after signal N).
    pub exit_status: u32,
}

/// An automatic recovery: the sandbox's init died unasked and its head
/// version was restored into the same container.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Recovery {
    /// The version restored.
    pub version: u64,
    /// The restored init's pid on the host.
    pub pid: i32,
    /// The dead init's exit status.
    pub exit_status: u32,
    /// When it was restored, in milliseconds since the Unix epoch.
    pub at_unix_ms: u64,
    /// How long the recovery took, from crabd's hearing of the crash, in
    /// milliseconds.
    pub total_ms: u64,
    /// The versions passed over on the way to `version`, newest first, and
    /// why each cannot be restored (a corrupt head falls back to its
    /// parent).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub passed_over: Vec<String>,
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
    /// A files-only rollback: the version whose files were put back
    /// (`version` is then the new version that records them).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub files_from: Option<u64>,
    /// The versions passed over on the way to `version`, newest first, and
    /// why each cannot be restored (a corrupt head falls back to its
    /// parent).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub passed_over: Vec<String>,
}

/// `POST /v1/sandboxes/{sel}/fork`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ForkRequest {
    /// The version to fork from.
    pub version: VersionSel,
    /// The new sandbox's container id (default: `<id>-fork<version>-<n>`).
    pub name: Option<SandboxId>,
}

/// A new sandbox made from a version.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ForkReport {
    /// Its container id.
    pub id: SandboxId,
    /// Its init's pid on the host.
    pub pid: u32,
    /// The version it was made from.
    pub version: u64,
    /// The whole fork, in milliseconds.
    pub total_ms: f64,
}

/// The most sandboxes one `POST …/forks` makes.
pub const MAX_FORKS: u32 = 64;

/// `POST /v1/sandboxes/{sel}/forks`: N new sandboxes from one version, made
/// in parallel, each independent of the others (for tree rollouts).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ForksRequest {
    /// The version to fork from.
    pub version: VersionSel,
    /// How many, 1 to [`MAX_FORKS`].
    pub count: u32,
    /// The new sandboxes' ids are `<prefix>-<i>`, i from 1 (default
    /// prefix: `<id>-fork<version>-<n>`).
    #[serde(default)]
    pub prefix: Option<SandboxId>,
}

/// What `POST …/forks` made: one outcome per fork, in order.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ForksReport {
    /// The version they were made from.
    pub version: u64,
    /// Each fork, made or not.
    pub forks: Vec<ForkOutcome>,
    /// The whole call, in milliseconds.
    pub total_ms: f64,
}

/// One fork of a [`ForksReport`].
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ForkOutcome {
    /// Its container id.
    pub id: SandboxId,
    /// Its init's pid on the host, when it was made.
    pub pid: Option<u32>,
    /// The disk its own copy of the version's files takes (allocated
    /// blocks, each inode once).
    pub bytes: u64,
    /// From the call's start to its init running (or its failure), in
    /// milliseconds.
    pub total_ms: f64,
    /// Why it was not made (with the whole error chain).
    pub error: Option<String>,
}

/// `POST /v1/sandboxes/{sel}/resume`: start a sandbox whose task died with
/// its host (or its shim) again, in its own container, from a version.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct ResumeRequest {
    /// The version (default: its head, else its newest valid one).
    #[serde(default)]
    pub version: Option<VersionSel>,
}

/// What a resume did.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ResumeReport {
    /// The version it runs from.
    pub version: u64,
    /// Its new init's pid on the host.
    pub pid: u32,
    /// The whole resume, in milliseconds.
    pub total_ms: f64,
    /// The versions passed over on the way to `version`, newest first, and
    /// why each cannot be restored (a corrupt head falls back to its
    /// parent).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub passed_over: Vec<String>,
}

/// The longest grace a drain takes, in seconds.
pub const MAX_DRAIN_GRACE_SECS: u64 = 3600;

/// `POST /v1/drain`: the host is going away (a spot instance reclaimed, a
/// node drained): make every running sandbox durable within the grace.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct DrainRequest {
    /// Seconds until the host goes, 1 to [`MAX_DRAIN_GRACE_SECS`].
    pub grace_secs: u64,
    /// An absolute directory to export each sandbox's new version to
    /// (`<id>.crab`, 0600; made 0700 if absent), to import on another host.
    #[serde(default)]
    pub export_dir: Option<PathBuf>,
}

/// What a drain made of each running sandbox.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct DrainReport {
    /// Each running sandbox, in the order their checkpoints were queued
    /// (smallest expected first, so most are made within the grace).
    pub sandboxes: Vec<DrainOutcome>,
    /// The grace it had, in seconds.
    pub grace_secs: u64,
    /// The whole drain, in milliseconds.
    pub total_ms: f64,
}

/// One sandbox of a [`DrainReport`].
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct DrainOutcome {
    /// The sandbox.
    pub id: SandboxId,
    /// Whether it was made durable (and exported, if asked) within the
    /// grace.
    pub made: bool,
    /// The version made for it.
    pub version: Option<u64>,
    /// From the drain's start to its version being durable, in ms.
    pub durable_ms: Option<f64>,
    /// The archive written for it.
    pub archive: Option<PathBuf>,
    /// From the drain's start to its archive being written, in ms.
    pub exported_ms: Option<f64>,
    /// Why it was not made (the whole error chain, or the grace ran out).
    pub error: Option<String>,
}

/// A sandbox made from an archive.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ImportReport {
    /// Its container id.
    pub id: SandboxId,
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

/// The body of every error answer (crabd's and a shim's control socket's).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ErrorBody {
    /// What went wrong, for a human: the whole error chain.
    pub error: String,
    /// What kind of failure, for a program (classify by this, never by
    /// the text); `unknown` from a server that sends none.
    #[serde(default)]
    pub code: ErrorCode,
}

/// The kinds of refusals and failures an error answer names.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ErrorCode {
    /// The request is malformed (body, path, version, id).
    InvalidRequest,
    /// No route has this path.
    NoRoute,
    /// No sandbox has this id (or, for a selector, id prefix).
    UnknownSandbox,
    /// Several sandboxes start with the prefix.
    Ambiguous,
    /// The sandbox's task is not running.
    NotRunning,
    /// The sandbox exists already.
    SandboxExists,
    /// Its rootfs has no backend that can snapshot it.
    NoFsBackend,
    /// The checkpoint store has no room: the host's floor of free space,
    /// or the sandbox's ceiling, is reached (the sandbox runs on).
    StoreFull,
    /// The version's files stay on their filesystem (ZFS, btrfs).
    NotMovable,
    /// The version has no process image.
    NoProcessImage,
    /// The version has no filesystem snapshot.
    NoFsSnapshot,
    /// No inspector is loaded.
    NoInspector,
    /// The version does not exist, or none is valid.
    UnknownVersion,
    /// The version store refused: a version is being written, or in use.
    Busy,
    /// A turn end got no version: a rollback of its sandbox came first.
    Superseded,
    /// A manifest line, a process image or an archive is corrupt.
    Corrupt,
    /// The process image to restore is not one (a shim's answer).
    InvalidCheckpoint,
    /// A restore failed and the sandbox was put back as it was.
    RestoreUndone,
    /// A restore failed and so did putting the sandbox back: its
    /// processes are gone.
    SandboxLost,
    /// The operation is not supported for this sandbox.
    Unsupported,
    /// What the request brings is refused by policy (an archive's
    /// privileged files, a spec that would reach the host).
    Refused,
    /// containerd refused or failed.
    Containerd,
    /// The sandbox's shim refused or failed.
    Shim,
    /// A filesystem backend failed.
    Fs,
    /// Anything else (a disk, a bug).
    Internal,
    /// The server sent no code, or one this client does not know (stays
    /// last: `ALL` is checked by it).
    #[default]
    #[serde(other)]
    Unknown,
}

// === impl ErrorCode ===

impl ErrorCode {
    /// Every code, in declaration order.
    pub const ALL: [ErrorCode; 26] = [
        ErrorCode::InvalidRequest,
        ErrorCode::NoRoute,
        ErrorCode::UnknownSandbox,
        ErrorCode::Ambiguous,
        ErrorCode::NotRunning,
        ErrorCode::SandboxExists,
        ErrorCode::NoFsBackend,
        ErrorCode::StoreFull,
        ErrorCode::NotMovable,
        ErrorCode::NoProcessImage,
        ErrorCode::NoFsSnapshot,
        ErrorCode::NoInspector,
        ErrorCode::UnknownVersion,
        ErrorCode::Busy,
        ErrorCode::Superseded,
        ErrorCode::Corrupt,
        ErrorCode::InvalidCheckpoint,
        ErrorCode::RestoreUndone,
        ErrorCode::SandboxLost,
        ErrorCode::Unsupported,
        ErrorCode::Refused,
        ErrorCode::Containerd,
        ErrorCode::Shim,
        ErrorCode::Fs,
        ErrorCode::Internal,
        ErrorCode::Unknown,
    ];

    /// The HTTP status an answer with this code has: one mapping for
    /// crabd and the shims.
    pub fn http_status(self) -> u16 {
        use ErrorCode::*;
        match self {
            InvalidRequest | InvalidCheckpoint => 400,
            NoRoute | UnknownSandbox | UnknownVersion => 404,
            Ambiguous | NotRunning | SandboxExists | NoFsBackend | StoreFull | NotMovable
            | NoProcessImage | NoFsSnapshot | NoInspector | Busy | Superseded | Unsupported => 409,
            Refused => 403,
            Corrupt | RestoreUndone => 422,
            Containerd | Shim => 502,
            Fs | Internal | SandboxLost | Unknown => 500,
        }
    }
}

/// `GET` [`crate::routes::EVENTS`]'s query.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct EventsQuery {
    /// How many of the newest events to send first (at most
    /// [`MAX_EVENTS_TAIL`]).
    #[serde(default = "default_tail")]
    pub tail: usize,
    /// Then keep the stream open and send events as they happen.
    #[serde(default)]
    pub follow: bool,
}

/// The most events a sandbox keeps, and a query's largest `tail`.
pub const MAX_EVENTS_TAIL: usize = 1000;

fn default_tail() -> usize {
    100
}

/// `POST /v1/import`'s query: where the archive's sandbox goes.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct ImportQuery {
    /// Its container id (default: the exported one's).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub name: Option<SandboxId>,
    /// The containerd namespace (default: `[crabd] namespace`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub namespace: Option<String>,
    /// containerd's socket (default: `[crabd] containerd`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub containerd: Option<PathBuf>,
    /// Keep the archive's device nodes, setuid/setgid files and
    /// `security.*`/`trusted.*` xattrs (refused by default).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub allow_privileged_files: bool,
    /// Import an archive that no trusted key signed (unsigned, or signed
    /// by a host this one does not trust): its process images are restored
    /// by CRIU as root, with the credentials and mounts they record.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub insecure_unsigned: bool,
}

/// `GET /v1/keys`: the key this host signs its exports with, and those
/// whose exports it imports.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct HostKeys {
    /// This host's Ed25519 public key, lower-case hex (put it in a file in
    /// another host's trusted directory to have that host import this
    /// one's exports).
    pub export_key: String,
    /// The directory of trusted keys (one file per key).
    pub trusted_dir: PathBuf,
    /// Every key whose exports this host imports, its own first.
    pub trusted: Vec<String>,
}

fn yes() -> bool {
    true
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn all_holds_every_error_code_once_in_order() {
        // `Unknown` is declared last: ALL misses none if it ends there and
        // each code stands at its own index.
        assert_eq!(ErrorCode::ALL.len(), ErrorCode::Unknown as usize + 1);
        for (i, code) in ErrorCode::ALL.into_iter().enumerate() {
            assert_eq!(code as usize, i, "{code:?}");
        }
        let unknown: ErrorBody = serde_json::from_str(r#"{"error":"x","code":"from_the_future"}"#).unwrap();
        assert_eq!(unknown.code, ErrorCode::Unknown);
    }
}
