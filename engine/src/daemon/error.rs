//! What a crabd API call can fail with, and the HTTP status of each.

use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::Json;

use crate::api::ErrorBody;
use crate::client::ClientError;
use crate::containerd::ContainerdError;
use crate::StoreError;

/// A refused or failed API call.
#[derive(Debug, thiserror::Error)]
pub enum ApiError {
    /// The request body is not the JSON the route takes.
    #[error("invalid request: {reason}")]
    BadRequest {
        /// What is wrong with it.
        reason: String,
    },
    /// No registered sandbox has this id or id prefix.
    #[error("no sandbox matches {sel:?} (see `crabctl ps`)")]
    UnknownSandbox {
        /// What was asked for.
        sel: String,
    },
    /// Several sandboxes start with this prefix.
    #[error("{sel:?} matches several sandboxes: {}", matches.join(", "))]
    Ambiguous {
        /// What was asked for.
        sel: String,
        /// The ids it matches.
        matches: Vec<String>,
    },
    /// The sandbox's task stopped: nothing runs to checkpoint or restore.
    #[error(
        "sandbox {id} is not running (its task stopped): start it again to checkpoint or roll back; \
         its versions can still be listed, exported and forked"
    )]
    NotRunning {
        /// The sandbox.
        id: String,
    },
    /// The checkpoint needs a filesystem snapshot the sandbox's rootfs cannot take.
    #[error("sandbox {id} has no filesystem backend for its rootfs: only a process checkpoint is possible")]
    NoFsBackend {
        /// The sandbox.
        id: String,
    },
    /// Fork, export and import copy files crabd keeps; a snapshot on ZFS or
    /// btrfs stays on its filesystem.
    #[error(
        "version {version} of sandbox {id} keeps its files on {backend:?}: fork, export and import \
         need an overlay rootfs (containerd's default snapshotter)"
    )]
    NotMovable {
        /// The sandbox.
        id: String,
        /// The version.
        version: u64,
        /// Where its files are.
        backend: crab_snapshotter::BackendKind,
    },
    /// The version holds no process image to restore.
    #[error("version {version} of sandbox {id} has no process image: roll back to a full checkpoint")]
    NoProcessImage {
        /// The sandbox.
        id: String,
        /// The version.
        version: u64,
    },
    /// The version holds no filesystem snapshot to start a sandbox from.
    #[error("version {version} of sandbox {id} has no filesystem snapshot: fork a full checkpoint")]
    NoFsSnapshot {
        /// The sandbox.
        id: String,
        /// The version.
        version: u64,
    },
    /// A sandbox with this id exists already.
    #[error("sandbox {id} exists already")]
    SandboxExists {
        /// The id.
        id: String,
    },
    /// containerd refused or failed.
    #[error(transparent)]
    Containerd(#[from] ContainerdError),
    /// A filesystem backend operation failed.
    #[error("files of sandbox {id}: {source}")]
    Fs {
        /// The sandbox.
        id: String,
        /// What the backend said.
        #[source]
        source: crab_snapshotter::Error,
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
    #[error("the shim of sandbox {id}: {source}")]
    Shim {
        /// The sandbox.
        id: String,
        /// What happened.
        #[source]
        source: ClientError,
    },
    /// A file operation of crabd's own failed.
    #[error("{op}: {source}")]
    Io {
        /// What crabd was doing.
        op: &'static str,
        /// Why it failed.
        #[source]
        source: std::io::Error,
    },
    /// A worker task died.
    #[error("internal error: {reason}")]
    Internal {
        /// What happened.
        reason: String,
    },
}

// === impl ApiError ===

impl ApiError {
    fn status(&self) -> StatusCode {
        match self {
            ApiError::BadRequest { .. } => StatusCode::BAD_REQUEST,
            ApiError::UnknownSandbox { .. } => StatusCode::NOT_FOUND,
            ApiError::Ambiguous { .. } => StatusCode::CONFLICT,
            ApiError::NoFsBackend { .. }
            | ApiError::NotMovable { .. }
            | ApiError::NotRunning { .. }
            | ApiError::NoProcessImage { .. }
            | ApiError::NoFsSnapshot { .. }
            | ApiError::SandboxExists { .. } => StatusCode::CONFLICT,
            ApiError::Containerd(ContainerdError::Unforkable { .. }) => StatusCode::CONFLICT,
            ApiError::Containerd(_) => StatusCode::BAD_GATEWAY,
            ApiError::Fs { .. } => StatusCode::INTERNAL_SERVER_ERROR,
            ApiError::NoInspector => StatusCode::CONFLICT,
            ApiError::Archive(crate::archive::ArchiveError::Io { .. }) => StatusCode::INTERNAL_SERVER_ERROR,
            ApiError::Archive(_) => StatusCode::UNPROCESSABLE_ENTITY,
            ApiError::Store(e) => match e {
                StoreError::InvalidSandboxId { .. } => StatusCode::BAD_REQUEST,
                StoreError::UnknownSandbox { .. }
                | StoreError::UnknownVersion { .. }
                | StoreError::NoValidVersion { .. } => StatusCode::NOT_FOUND,
                StoreError::PendingExists { .. } | StoreError::VersionInUse { .. } => StatusCode::CONFLICT,
                StoreError::CorruptManifestLine { .. }
                | StoreError::NotOfSandbox { .. }
                | StoreError::MissingImage { .. }
                | StoreError::CorruptImage { .. }
                | StoreError::MissingDependency { .. }
                | StoreError::CannotInherit { .. } => StatusCode::UNPROCESSABLE_ENTITY,
                _ => StatusCode::INTERNAL_SERVER_ERROR,
            },
            ApiError::Shim { source, .. } => match source {
                ClientError::Refused { status, .. } => {
                    StatusCode::from_u16(*status).unwrap_or(StatusCode::BAD_GATEWAY)
                }
                _ => StatusCode::BAD_GATEWAY,
            },
            ApiError::Io { .. } | ApiError::Internal { .. } => StatusCode::INTERNAL_SERVER_ERROR,
        }
    }
}

/// `e`'s message and those of its sources that it does not already say.
pub fn chain(e: &dyn std::error::Error) -> String {
    let mut text = e.to_string();
    let mut source = e.source();
    while let Some(s) = source {
        let s_text = s.to_string();
        if !text.contains(&s_text) {
            text.push_str(": ");
            text.push_str(&s_text);
        }
        source = s.source();
    }
    text
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        // The shim's message already carries its causes; others get theirs.
        let error = match self {
            ApiError::Shim { .. } => self.to_string(),
            _ => chain(&self),
        };
        tracing::info!(status = %self.status(), "refused: {error}");
        (self.status(), Json(ErrorBody { error })).into_response()
    }
}
