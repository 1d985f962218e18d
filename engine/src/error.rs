//! The crate's error type.

use crate::store::StoreError;

/// What a `crab-engine` call can fail with.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The version store failed.
    #[error(transparent)]
    Store(#[from] StoreError),
}
