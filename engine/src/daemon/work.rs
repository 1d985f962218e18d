//! How crabd runs an operation's work: on a task of its own (a caller that
//! hangs up does not cut it short), store calls off the reactor, and calls
//! to a sandbox's shim.

use std::path::{Path, PathBuf};
use std::time::{SystemTime, UNIX_EPOCH};

use crab_api::crabd::Registration;
use crab_api::UnixClient;
use serde::de::DeserializeOwned;
use serde::Serialize;

use super::{ApiError, Daemon};
use crate::StoreError;

/// Runs `work` on its own task, so that a caller hanging up does not cut it
/// short.
pub(super) async fn detached<T: Send + 'static>(
    work: impl std::future::Future<Output = Result<T, ApiError>> + Send + 'static,
) -> Result<T, ApiError> {
    tokio::spawn(work).await.map_err(ApiError::from)?
}

/// Runs a blocking store call on a blocking thread.
pub(super) async fn blocking<T: Send + 'static>(
    f: impl FnOnce() -> Result<T, StoreError> + Send + 'static,
) -> Result<T, ApiError> {
    tokio::task::spawn_blocking(f).await?.map_err(ApiError::from)
}

/// Runs blocking work of crabd's own on a blocking thread.
pub(super) async fn blocking_io<T: Send + 'static>(
    f: impl FnOnce() -> Result<T, ApiError> + Send + 'static,
) -> Result<T, ApiError> {
    tokio::task::spawn_blocking(f).await?
}

/// A transfer's staging directory, removed (with what is in it) when the
/// guard is dropped: on success, on failure, and when the caller hangs up.
#[derive(Debug)]
pub(super) struct Staging(PathBuf);

impl Staging {
    pub(super) fn new(dir: PathBuf) -> Self {
        Staging(dir)
    }

    /// The directory.
    pub(super) fn path(&self) -> &Path {
        &self.0
    }
}

impl Drop for Staging {
    fn drop(&mut self) {
        if let Err(e) = std::fs::remove_dir_all(&self.0) {
            if e.kind() != std::io::ErrorKind::NotFound {
                tracing::warn!(dir = %self.0.display(), error = %e, "staging directory kept");
            }
        }
    }
}

/// Milliseconds since the Unix epoch (names of snapshots and staging
/// directories).
pub(super) fn unix_ms() -> u128 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap_or_default()
        .as_millis()
}

// === impl Daemon ===

impl Daemon {
    /// Calls `path` of `reg`'s shim with `body`, within `[crabd]
    /// shim_timeout_secs`.
    pub(super) async fn call_shim<B: Serialize, R: DeserializeOwned>(
        &self,
        reg: &Registration,
        path: &str,
        body: &B,
    ) -> Result<R, ApiError> {
        UnixClient::new(
            &reg.control,
            format!("the shim of {}", reg.id),
            self.config.shim_timeout(),
        )
        .post(path, body)
        .await
        .map_err(|source| ApiError::Shim {
            id: reg.id.clone(),
            source,
        })
    }
}
