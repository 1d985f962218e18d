//! Crab's filesystem backends: save a sandbox's writable filesystem under a
//! name in milliseconds, at a cost proportional to what changed, and put it
//! back, clone it, or move it to another host.
//!
//! Public face: the [`Backend`] trait, [`open`] (a backend for a
//! [`Location`]), the three implementations [`ZfsBackend`], [`BtrfsBackend`]
//! and [`OverlayCopyBackend`], [`sync_tree`] (a files-only rollback in place),
//! [`read_stream`] (an overlay-copy export stream read entry by entry, for
//! converting it) and [`Error`].
//!
//! Calls block (they run `zfs`/`btrfs` commands or walk trees): async
//! callers run them on a blocking thread.
//!
//! Must never: destroy a snapshot as a side effect of another operation
//! (`zfs rollback -r` is never used), follow a symlink out of the tree it
//! copies, or leave a half-made snapshot under its final name.

// Two audited exceptions: `command` hands a zfs child its turn's lock, and
// `btrfs` makes its snapshots by ioctl.
#![deny(unsafe_code)]

mod backend;
mod btrfs;
mod command;
mod error;
mod host_lock;
mod overlay;
mod sync;
mod zfs;
mod zfs_snapshotter;

pub use backend::{open, Backend, BackendKind, Change, Location, Snapshot, SnapshotName};
pub use btrfs::BtrfsBackend;
pub use error::Error;
pub use overlay::{
    finish_interrupted_rollback, read_stream, rollback_journal, EntryKind, OverlayCopyBackend, StreamEntry,
    StreamPolicy,
};
pub use sync::{differences, sync_tree, Scope, SnapshotFiles, SyncReport};
pub use zfs::ZfsBackend;
pub use zfs_snapshotter::{SnapshotterError, ZfsSnapshotter, CRASH_ENV};

/// Result of a backend operation.
pub type Result<T> = std::result::Result<T, Error>;
