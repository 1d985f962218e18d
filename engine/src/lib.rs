//! `crabd`'s library: the host's checkpoint engine behind crab-api.
//!
//! Public face: [`daemon`] (`serve`, [`daemon::Daemon`] and its
//! operations, served as the management API of `crab_api::routes`), the
//! version store [`VersionStore`] (open, register, begin_version →
//! publish, versions, get, latest_valid, retain, remove_version) and
//! [`Error`] / [`StoreError`]. Clients never link this crate: they use
//! `crab-api`.
//!
//! Must never: name in a durable manifest line anything that is not durable
//! yet, list a torn or corrupt line as a valid version, read or write
//! outside its root (sandbox ids are `crab_api::SandboxId`s, image paths
//! are checked), or resolve a machine's exact sandbox id as a prefix.

#![forbid(unsafe_code)]

pub mod archive;
pub mod containerd;
pub mod daemon;
mod error;
mod store;

pub use error::Error;
pub use store::{
    Capture, Class, Defect, FsSnapshot, ImageFile, NewVersion, PendingVersion, Recovery, Removal, SandboxId,
    StoreError, TornLine, Version, VersionInfo, VersionRecord, VersionStore, DEFAULT_ROOT,
};
