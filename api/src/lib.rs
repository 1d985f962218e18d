//! `crab-api`: the one front door to crabd. What a shim, `crabctl` or any
//! other client needs to talk to crabd, and what crabd needs to talk to a
//! shim, without linking crabd itself.
//!
//! Public face:
//! - the words every component shares: [`SandboxId`] (exact, parsed once
//!   at the edge) and [`SandboxSelector`] (a prefix a person typed),
//!   [`Class`], [`VersionSel`], [`VersionRecord`] and the file-snapshot
//!   vocabulary [`BackendKind`], [`SnapshotName`], [`Location`];
//! - the messages of crabd's management API ([`crabd`]) and of each shim's
//!   control API ([`shim`]), and their route paths, defined once
//!   ([`routes`]); `openapi.json` beside this crate describes crabd's API
//!   (the tests crate checks it against [`routes`] and checks crabd's
//!   answers against it);
//! - the typed client [`Crabd`] over [`UnixClient`], HTTP/1.1 on a unix
//!   socket;
//! - `crab.toml`'s loader ([`config`]) and crabd's table of it.
//!
//! Must never: accept a sandbox id or snapshot name that is not one safe
//! path component, or resolve a prefix where an exact id is meant (only a
//! [`SandboxSelector`] is a prefix, and only people type one).

#![forbid(unsafe_code)]

pub mod client;
pub mod config;
pub mod crabd;
pub mod export;
pub mod routes;
pub mod shim;

mod class;
mod fs;
mod id;
mod version;

pub use class::{Class, InvalidClass};
pub use client::{ClientError, Crabd, Progress, UnixClient};
pub use fs::{BackendKind, InvalidSnapshotName, Location, SnapshotName};
pub use id::{InvalidSandboxId, InvalidSelector, SandboxId, SandboxSelector};
pub use version::{FsSnapshot, ImageFile, InvalidVersionSel, VersionRecord, VersionSel};

/// `e`'s message followed by those of its sources, `: `-separated: how an
/// error is shown to a person or put in a log line. Every error of Crab
/// either prints its source or chains it, never both, so nothing repeats.
pub fn error_chain(e: &(dyn std::error::Error + 'static)) -> String {
    let mut text = e.to_string();
    let mut source = e.source();
    while let Some(s) = source {
        text.push_str(": ");
        text.push_str(&s.to_string());
        source = s.source();
    }
    text
}
