//! What a crabd API call can fail with, and the HTTP status of each.

use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::Json;

use crab_api::crabd::{ErrorBody, ErrorCode};
use crab_api::{BackendKind, ClientError, SandboxId};

use crate::containerd::ContainerdError;
use crate::StoreError;

/// A refused or failed API call.
#[derive(Debug, thiserror::Error)]
pub enum ApiError {
    /// A sandbox id in the request (or one crabd would make) is invalid.
    #[error(transparent)]
    InvalidId(#[from] crab_api::InvalidSandboxId),
    /// The request body is not the JSON the route takes.
    #[error("invalid request: {reason}")]
    BadRequest {
        /// What is wrong with it.
        reason: String,
    },
    /// No route of the API has this path.
    #[error("no such API route: {path}")]
    NoRoute {
        /// The path asked for.
        path: String,
    },
    /// No registered sandbox has this id (or, for a selector, id prefix).
    #[error("no sandbox matches {sel:?} (see `crabctl ps`)")]
    UnknownSandbox {
        /// What was asked for.
        sel: String,
    },
    /// Several sandboxes start with this prefix.
    #[error("{sel:?} matches several sandboxes: {}", matches.iter().map(SandboxId::as_str).collect::<Vec<_>>().join(", "))]
    Ambiguous {
        /// What was asked for.
        sel: String,
        /// The ids it matches.
        matches: Vec<SandboxId>,
    },
    /// The sandbox's task stopped: nothing runs to checkpoint or restore.
    #[error(
        "sandbox {id} is not running (its task stopped): start it again to checkpoint or roll back; \
         its versions can still be listed, exported and forked"
    )]
    NotRunning {
        /// The sandbox.
        id: SandboxId,
    },
    /// The checkpoint needs a filesystem snapshot the sandbox's rootfs cannot take.
    #[error("sandbox {id} has no filesystem backend for its rootfs: only a process checkpoint is possible")]
    NoFsBackend {
        /// The sandbox.
        id: SandboxId,
    },
    /// The checkpoint store has no room for another version.
    #[error("sandbox {id} gets no checkpoint: {why} (it runs on; free room, e.g. crabctl rm-version, or raise the limit)")]
    StoreFull {
        /// The sandbox.
        id: SandboxId,
        /// Which limit, and how far.
        why: String,
    },
    /// Fork, export and import copy files crabd keeps; a snapshot on ZFS or
    /// btrfs stays on its filesystem.
    #[error(
        "version {version} of sandbox {id} keeps its files on {backend:?}: fork, export and import \
         need an overlay rootfs (containerd's default snapshotter)"
    )]
    NotMovable {
        /// The sandbox.
        id: SandboxId,
        /// The version.
        version: u64,
        /// Where its files are.
        backend: BackendKind,
    },
    /// The version holds no process image to restore.
    #[error("version {version} of sandbox {id} has no process image: roll back to a full checkpoint")]
    NoProcessImage {
        /// The sandbox.
        id: SandboxId,
        /// The version.
        version: u64,
    },
    /// The version holds no filesystem snapshot to start a sandbox from.
    #[error("version {version} of sandbox {id} has no filesystem snapshot: fork a full checkpoint")]
    NoFsSnapshot {
        /// The sandbox.
        id: SandboxId,
        /// The version.
        version: u64,
    },
    /// A sandbox with this id exists already.
    #[error("sandbox {id} exists already")]
    SandboxExists {
        /// The id.
        id: SandboxId,
    },
    /// containerd refused or failed.
    #[error(transparent)]
    Containerd(#[from] ContainerdError),
    /// A filesystem backend operation failed.
    #[error("files of sandbox {id}")]
    Fs {
        /// The sandbox.
        id: SandboxId,
        /// What the backend said.
        #[source]
        source: crab_snapshotter::Error,
    },
    /// An archive's container would reach the host (its spec's hooks,
    /// bind mounts, host namespaces, devices or privileges).
    #[error("the archive's container is refused: {reason}")]
    Refused {
        /// What, and why.
        reason: String,
    },
    /// An archive to import is truncated, tampered with or invalid.
    #[error(transparent)]
    Archive(crate::archive::ArchiveError),
    /// No inspector is loaded (it needs BPF, root, and `[crabd] inspector`).
    #[error("no inspector is loaded in crabd (see its log): turns cannot be classified")]
    NoInspector,
    /// The version store refused or failed.
    #[error(transparent)]
    Store(#[from] StoreError),
    /// The sandbox's shim refused or failed.
    #[error("the shim of sandbox {id}")]
    Shim {
        /// The sandbox.
        id: SandboxId,
        /// What happened.
        #[source]
        source: ClientError,
    },
    /// A file operation of crabd's own failed.
    #[error("{op}")]
    Io {
        /// What crabd was doing.
        op: &'static str,
        /// Why it failed.
        #[source]
        source: std::io::Error,
    },
    /// Another drain is running.
    #[error("a drain is running already: wait for its report")]
    DrainRunning,
    /// A turn end got no version: a rollback came first.
    #[error("turn {turn} of sandbox {id} has no version: {why}")]
    Superseded {
        /// The sandbox.
        id: SandboxId,
        /// The turn.
        turn: u64,
        /// What came first.
        why: &'static str,
    },
    /// The sandbox's head went while a `none` version began (its task
    /// restarted): a line inheriting nothing would restore nothing.
    #[error("sandbox {id} started afresh while this version began: none made, the next is whole")]
    HeadMoved {
        /// The sandbox.
        id: SandboxId,
    },
    /// Too many turn ends of one sandbox wait for their version.
    #[error("sandbox {id} has {waiting} turn ends waiting for their version: this one gets none")]
    TooManyTurns {
        /// The sandbox.
        id: SandboxId,
        /// How many wait.
        waiting: usize,
    },
    /// The failure of a version that several turn ends shared.
    #[error(transparent)]
    Shared(std::sync::Arc<ApiError>),
    /// A worker task died (a bug: it panicked).
    #[error("a worker task of crabd died")]
    Worker(#[from] tokio::task::JoinError),
}

// === impl ApiError ===

impl ApiError {
    /// Its HTTP status: its code's, but a shim's refusal keeps the
    /// shim's own status.
    fn status(&self) -> StatusCode {
        let status = match self {
            ApiError::Shim {
                source: ClientError::Refused { status, .. },
                ..
            } => *status,
            ApiError::Shared(e) => return e.status(),
            _ => self.code().http_status(),
        };
        StatusCode::from_u16(status).unwrap_or(StatusCode::BAD_GATEWAY)
    }
}

impl ApiError {
    /// The kind a client classifies it by.
    fn code(&self) -> ErrorCode {
        match self {
            ApiError::BadRequest { .. } | ApiError::InvalidId(_) => ErrorCode::InvalidRequest,
            ApiError::NoRoute { .. } => ErrorCode::NoRoute,
            ApiError::UnknownSandbox { .. } => ErrorCode::UnknownSandbox,
            ApiError::Ambiguous { .. } => ErrorCode::Ambiguous,
            ApiError::NotRunning { .. } => ErrorCode::NotRunning,
            ApiError::NoFsBackend { .. } => ErrorCode::NoFsBackend,
            ApiError::StoreFull { .. } => ErrorCode::StoreFull,
            ApiError::NotMovable { .. } => ErrorCode::NotMovable,
            ApiError::NoProcessImage { .. } => ErrorCode::NoProcessImage,
            ApiError::NoFsSnapshot { .. } => ErrorCode::NoFsSnapshot,
            ApiError::SandboxExists { .. } => ErrorCode::SandboxExists,
            ApiError::Containerd(ContainerdError::Unforkable { .. }) => ErrorCode::Unsupported,
            ApiError::Containerd(_) => ErrorCode::Containerd,
            ApiError::Fs {
                source: crab_snapshotter::Error::Refused { .. },
                ..
            }
            | ApiError::Refused { .. } => ErrorCode::Refused,
            ApiError::Fs {
                source: crab_snapshotter::Error::BadStream { .. },
                ..
            } => ErrorCode::Corrupt,
            ApiError::Fs { .. } => ErrorCode::Fs,
            ApiError::Archive(crate::archive::ArchiveError::Io { .. }) => ErrorCode::Internal,
            ApiError::Archive(_) => ErrorCode::Corrupt,
            ApiError::NoInspector => ErrorCode::NoInspector,
            ApiError::Store(e) => match e {
                StoreError::InvalidSandboxId(_) => ErrorCode::InvalidRequest,
                StoreError::UnknownSandbox { .. } => ErrorCode::UnknownSandbox,
                StoreError::UnknownVersion { .. } | StoreError::NoValidVersion { .. } => {
                    ErrorCode::UnknownVersion
                }
                StoreError::PendingExists { .. } | StoreError::VersionInUse { .. } => ErrorCode::Busy,
                StoreError::CorruptManifestLine { .. }
                | StoreError::NotOfSandbox { .. }
                | StoreError::MissingImage { .. }
                | StoreError::CorruptImage { .. }
                | StoreError::MissingDependency { .. }
                | StoreError::CannotInherit { .. } => ErrorCode::Corrupt,
                _ => ErrorCode::Internal,
            },
            // The shim's own code when it said one: a restore undone is
            // one, whoever relays it.
            ApiError::Shim { source, .. } => match source {
                // What the shim says of the sandbox; not what it says of
                // crabd's own request to it.
                ClientError::Refused { code, .. }
                    if !matches!(
                        code,
                        ErrorCode::Unknown | ErrorCode::InvalidRequest | ErrorCode::NoRoute
                    ) =>
                {
                    *code
                }
                _ => ErrorCode::Shim,
            },
            ApiError::Superseded { .. } => ErrorCode::Superseded,
            ApiError::DrainRunning => ErrorCode::Busy,
            ApiError::TooManyTurns { .. } | ApiError::HeadMoved { .. } => ErrorCode::Busy,
            ApiError::Shared(e) => e.code(),
            ApiError::Io { .. } | ApiError::Worker(_) => ErrorCode::Internal,
        }
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let error = crab_api::error_chain(&self);
        tracing::info!(status = %self.status(), error, "refused");
        let body = ErrorBody {
            error,
            code: self.code(),
        };
        (self.status(), Json(body)).into_response()
    }
}
