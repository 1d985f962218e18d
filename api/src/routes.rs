//! Route paths, defined once: crabd's router is built from the patterns
//! (`{sel}`, `{id}`, `{version}` are axum path parameters), and clients
//! build paths with the functions beside them.
//!
//! | method | pattern | body → answer |
//! |---|---|---|
//! | GET | [`SANDBOXES`] | → `[SandboxInfo]` |
//! | POST | [`SANDBOXES`] | `Registration` → `SandboxInfo` (a shim registers) |
//! | GET | [`SANDBOX`] | → `SandboxInfo` |
//! | DELETE | [`SANDBOX`] | → `{}` (a shim unregisters, by exact id; versions stay) |
//! | POST | [`CHECKPOINT`] | `CheckpointRequest` → `CheckpointReport` |
//! | POST | [`TURNS`] | `TurnEnd` → `CheckpointReport` (a shim's proxy, by exact id: a turn ended) |
//! | POST | [`ANSWERED`] | → `TurnAnswered` (a shim's proxy: the turn's answer waits on its version) |
//! | POST | [`HELD`] | `TurnHeld` → `{}` (a shim's proxy: how long the turn's answer was held) |
//! | GET | [`VERSIONS`] | → `[VersionView]` |
//! | POST | [`ROLLBACK`] | `RollbackRequest` → `RollbackReport` |
//! | POST | [`RECOVER`] | `Crash` → `Recovery` (a shim, by exact id: its init died unasked) |
//! | DELETE | [`VERSION`] | → `RemovalReport` |
//! | POST | [`FORK`] | `ForkRequest` → `ForkReport` |
//! | POST | [`FORKS`] | `ForksRequest` → `ForksReport` (N forks of one version) |
//! | POST | [`TURN`] | → `TurnReport` (ends the inspector's turn by hand) |
//! | GET | [`WATCH`] | → `TurnReport`s as JSON lines, as turns end |
//! | GET | [`EVENTS`] (`EventsQuery`) | → `Event`s as JSON lines: the newest, then (`follow`) live ones |
//! | GET | [`UI`] | → `UiUrl` (the page's URL, its secret included) |
//! | GET | [`EXPORT`] | → a tar archive |
//! | POST | [`IMPORT`] (`ImportQuery`) | a tar archive → `ImportReport` |
//! | POST | [`RESUME`] | `ResumeRequest` → `ResumeReport` (a sandbox whose task died) |
//! | POST | [`DRAIN`] | `DrainRequest` → `DrainReport` (one at a time) |
//! | GET | [`KEYS`] | → `HostKeys` (the export signing key, the trusted keys) |
//! | GET | [`METRICS`] | → Prometheus text |
//!
//! `{sel}` is what a person typed ([`crate::SandboxSelector`]: an id or a
//! unique prefix); `{id}` is an exact [`crate::SandboxId`]. Routes that
//! machines call take `{id}`, so a turn end can never land on another
//! sandbox whose id its own is a prefix of.
//!
//! crabd also serves agents that run outside their sandbox on TCP
//! `127.0.0.1:[crabd] proxy_port`: [`HOST_PROXY_PREFIX`]`<id>/<secret>/…`
//! is relayed to the sandbox's LLM proxy (the secret comes with
//! `crabctl proxy-url`).

use std::fmt::Display;

use crate::{SandboxId, VersionSel};

/// Every sandbox crabd knows; a shim registers here.
pub const SANDBOXES: &str = "/v1/sandboxes";
/// One sandbox, by selector (GET) or exact id (DELETE, a shim's).
pub const SANDBOX: &str = "/v1/sandboxes/{sel}";
/// Checkpoint a sandbox now.
pub const CHECKPOINT: &str = "/v1/sandboxes/{sel}/checkpoint";
/// A turn of a sandbox ended (its proxy, an exact id).
pub const TURNS: &str = "/v1/sandboxes/{id}/turns";
/// A turn's LLM answer arrived while its version was not yet safe (its
/// proxy, an exact id): crabd moves the checkpoint to the queue's front.
pub const ANSWERED: &str = "/v1/sandboxes/{id}/turns/{turn}/answered";
/// A turn's answer was held for its version (a shim's proxy, by exact id).
pub const HELD: &str = "/v1/sandboxes/{id}/turns/{turn}/held";
/// A sandbox's versions.
pub const VERSIONS: &str = "/v1/sandboxes/{sel}/versions";
/// Roll a sandbox back.
pub const ROLLBACK: &str = "/v1/sandboxes/{sel}/rollback";
/// A shim's sandbox crashed: restore its head version into it.
pub const RECOVER: &str = "/v1/sandboxes/{id}/recover";
/// Fork a sandbox's version into a new sandbox.
pub const FORK: &str = "/v1/sandboxes/{sel}/fork";
/// Fork a sandbox's version into N new sandboxes at once.
pub const FORKS: &str = "/v1/sandboxes/{sel}/forks";
/// End the inspector's current turn by hand.
pub const TURN: &str = "/v1/sandboxes/{sel}/turn";
/// Turn reports as they happen.
pub const WATCH: &str = "/v1/sandboxes/{sel}/watch";
/// A sandbox's events (`crabctl logs`).
pub const EVENTS: &str = "/v1/sandboxes/{sel}/events";
/// The URL of crabd's page (`crabctl ui`).
pub const UI: &str = "/v1/ui";
/// One version (DELETE removes it).
pub const VERSION: &str = "/v1/sandboxes/{sel}/versions/{version}";
/// One version as an archive.
pub const EXPORT: &str = "/v1/sandboxes/{sel}/versions/{version}/export";
/// A new sandbox from an archive.
pub const IMPORT: &str = "/v1/import";
/// Start a sandbox whose task died again, from a version.
pub const RESUME: &str = "/v1/sandboxes/{sel}/resume";
/// Make every running sandbox durable before the host goes.
pub const DRAIN: &str = "/v1/drain";
/// The host listener's prefix for a sandbox's LLM proxy.
pub const HOST_PROXY_PREFIX: &str = "/s/";
/// The key this host signs exports with, and the keys it trusts.
pub const KEYS: &str = "/v1/keys";
/// crabd's metrics, in the Prometheus text format.
pub const METRICS: &str = "/metrics";

/// Every pattern of crabd's management API with its methods, for the
/// tests that hold `openapi.json` and the router to it.
#[doc(hidden)]
pub const ALL: &[(&str, &[&str])] = &[
    (SANDBOXES, &["get", "post"]),
    (SANDBOX, &["get", "delete"]),
    (CHECKPOINT, &["post"]),
    (TURNS, &["post"]),
    (ANSWERED, &["post"]),
    (HELD, &["post"]),
    (VERSIONS, &["get"]),
    (ROLLBACK, &["post"]),
    (RECOVER, &["post"]),
    (FORK, &["post"]),
    (FORKS, &["post"]),
    (TURN, &["post"]),
    (WATCH, &["get"]),
    (EVENTS, &["get"]),
    (UI, &["get"]),
    (VERSION, &["delete"]),
    (EXPORT, &["get"]),
    (IMPORT, &["post"]),
    (RESUME, &["post"]),
    (DRAIN, &["post"]),
    (KEYS, &["get"]),
    (METRICS, &["get"]),
];

/// The shim's control API.
pub mod shim {
    /// Checkpoint the sandbox.
    pub const CHECKPOINT: &str = "/checkpoint";
    /// Restore the sandbox from a checkpoint.
    pub const RESTORE: &str = "/restore";
    /// Delete file snapshots no version names any more.
    pub const FORGET: &str = "/forget";
    /// Put the sandbox's files back to a snapshot's, its processes kept.
    pub const RESTORE_FILES: &str = "/restore-files";
}

/// `pattern` with `{sel}`/`{id}` and `{version}` (or `{turn}`) filled in.
fn fill(pattern: &str, sandbox: &dyn Display, number: Option<&dyn Display>) -> String {
    let path = pattern
        .replace("{sel}", &sandbox.to_string())
        .replace("{id}", &sandbox.to_string());
    match number {
        Some(v) => path
            .replace("{version}", &v.to_string())
            .replace("{turn}", &v.to_string()),
        None => path,
    }
}

/// [`SANDBOX`] for `sel` (a selector, or an id).
pub fn sandbox(sel: &dyn Display) -> String {
    fill(SANDBOX, sel, None)
}

/// [`CHECKPOINT`] for `sel`.
pub fn checkpoint(sel: &dyn Display) -> String {
    fill(CHECKPOINT, sel, None)
}

/// [`TURNS`] for `id`.
pub fn turns(id: &SandboxId) -> String {
    fill(TURNS, id, None)
}

/// [`HELD`] for `id` and turn `turn`.
pub fn held(id: &SandboxId, turn: u64) -> String {
    fill(HELD, id, Some(&turn))
}

/// [`ANSWERED`] for `id` and turn `turn`.
pub fn answered(id: &SandboxId, turn: u64) -> String {
    fill(ANSWERED, id, Some(&turn))
}

/// [`VERSIONS`] for `sel`.
pub fn versions(sel: &dyn Display) -> String {
    fill(VERSIONS, sel, None)
}

/// [`RECOVER`] for `id`.
pub fn recover(id: &SandboxId) -> String {
    fill(RECOVER, id, None)
}

/// [`ROLLBACK`] for `sel`.
pub fn rollback(sel: &dyn Display) -> String {
    fill(ROLLBACK, sel, None)
}

/// [`FORK`] for `sel`.
pub fn fork(sel: &dyn Display) -> String {
    fill(FORK, sel, None)
}

/// [`RESUME`] for `sel`.
pub fn resume(sel: &dyn Display) -> String {
    fill(RESUME, sel, None)
}

/// [`FORKS`] for `sel`.
pub fn forks(sel: &dyn Display) -> String {
    fill(FORKS, sel, None)
}

/// [`TURN`] for `sel`.
pub fn turn(sel: &dyn Display) -> String {
    fill(TURN, sel, None)
}

/// [`WATCH`] for `sel`.
pub fn watch(sel: &dyn Display) -> String {
    fill(WATCH, sel, None)
}

/// [`EVENTS`] for `sel`: its newest `tail` events, then (`follow`) those
/// that happen.
pub fn events(sel: &dyn Display, tail: usize, follow: bool) -> String {
    format!("{}?tail={tail}&follow={follow}", fill(EVENTS, sel, None))
}

/// [`VERSION`] for `sel` and version number `n`.
pub fn version(sel: &dyn Display, n: u64) -> String {
    fill(VERSION, sel, Some(&n))
}

/// [`EXPORT`] for `sel` and `version`.
pub fn export(sel: &dyn Display, version: VersionSel) -> String {
    fill(EXPORT, sel, Some(&version))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn paths_fill_their_patterns() {
        let id = SandboxId::new("s1").unwrap();
        assert_eq!(turns(&id), "/v1/sandboxes/s1/turns");
        assert_eq!(answered(&id, 4), "/v1/sandboxes/s1/turns/4/answered");
        assert_eq!(version(&id, 3), "/v1/sandboxes/s1/versions/3");
        assert_eq!(
            export(&id, VersionSel::Latest),
            "/v1/sandboxes/s1/versions/latest/export"
        );
        for (pattern, _) in ALL {
            assert!(!fill(pattern, &id, Some(&1)).contains('{'), "{pattern}");
        }
    }
}
