//! Crab's inspector: tells, at each turn end, whether a sandbox changed in a
//! way worth saving, and how (`none`, `fs`, `proc`, `full`).
//!
//! BPF programs in C (`bpf/inspector.bpf.c`, CO-RE, tracepoints only:
//! `raw_syscalls`, `sched`, `cgroup`) follow the tasks of registered
//! sandboxes, keyed by their unified cgroup id. They aggregate per sandbox
//! in the kernel (per-task generations, per-inode write dedupe, counters)
//! and stream path-bearing records on a ring buffer with a per-sandbox
//! sequence number. User space turns one turn's records into its net
//! change (`ledger`) and adds what `/proc` says about the sandbox's
//! processes (`procs`).
//!
//! Public face: [`Inspector`] (`load`, `register`, `unregister`,
//! `turn_end`), [`InspectorConfig`], [`TurnReport`], [`Class`], [`Reason`],
//! and [`unified_mount`]/[`cgroup_id`] to name a sandbox's cgroup.
//!
//! It must never answer a class that misses a change: whenever it cannot
//! vouch for a turn, the answer is `full` with the reason.

mod cgroup;
mod error;
mod inspector;
mod kernel;
mod ledger;
mod loader;
mod mounts;
mod procs;
mod report;

pub use cgroup::{cgroup_id, unified_mount};
pub use error::{Error, Result};
pub use inspector::{Inspector, InspectorConfig};
pub use report::{Class, Reason, TurnReport};
