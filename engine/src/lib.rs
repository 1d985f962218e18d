//! `crabd`'s library. Today it holds the version store: per sandbox, a
//! durable, checksummed record of its recoverable points (versions) and the
//! process images they hold, with integrity checks and retention.
//!
//! Public face: [`VersionStore`] (open, register, begin_version → publish,
//! versions, get, latest_valid, retain, remove_version), its records
//! ([`VersionRecord`], [`Class`], [`FsSnapshot`]), [`SandboxId`], and
//! [`Error`] / [`StoreError`].
//!
//! Must never: name in a durable manifest line anything that is not durable
//! yet, list a torn or corrupt line as a valid version, or read or write
//! outside its root (sandbox ids and image paths are checked).

#![forbid(unsafe_code)]

pub mod api;
pub mod archive;
pub mod client;
pub mod config;
pub mod containerd;
pub mod daemon;
mod error;
mod store;

pub use error::Error;
pub use store::{
    Capture, Class, Defect, FsSnapshot, ImageFile, NewVersion, PendingVersion, Recovery, Removal, SandboxId,
    StoreError, TornLine, Version, VersionInfo, VersionRecord, VersionStore, DEFAULT_ROOT,
};
