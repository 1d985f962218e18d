//! The inspector's errors.

use std::path::PathBuf;

/// What can go wrong loading the inspector or asking it about a sandbox.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The crate was built without clang/bpftool, so it has no programs.
    #[error("the inspector's BPF programs were not built (clang, bpftool or /sys/kernel/btf/vmlinux was missing at build time)")]
    NotBuilt,
    /// Mounting bpffs failed.
    #[error("mount bpffs at {path}")]
    MountBpffs {
        /// Where.
        path: PathBuf,
        /// Why.
        #[source]
        source: nix::Error,
    },
    /// A filesystem operation on the pin directory or a lock file failed.
    #[error("{op} {path}")]
    Io {
        /// What was being done ("create", "remove", "lock", …).
        op: &'static str,
        /// On what.
        path: PathBuf,
        /// Why.
        #[source]
        source: std::io::Error,
    },
    /// Another process owns the inspector of this pin directory.
    #[error("another process owns the inspector (lock {path} is held)")]
    Busy {
        /// The lock file.
        path: PathBuf,
    },
    /// The kernel refused the BPF object (verifier, BTF, maps).
    #[error("load the inspector's BPF object")]
    Load(#[source] aya::EbpfError),
    /// A program the object must have is missing or of the wrong type.
    #[error("the BPF object has no tracepoint program {name}")]
    MissingProgram {
        /// Program name.
        name: &'static str,
    },
    /// A map the object must have is missing.
    #[error("the BPF object has no map {name}")]
    MissingMap {
        /// Map name.
        name: &'static str,
    },
    /// Loading or attaching a program failed.
    #[error("load or attach program {name}")]
    Program {
        /// Program name.
        name: &'static str,
        /// Why.
        #[source]
        source: aya::programs::ProgramError,
    },
    /// Pinning a link failed.
    #[error("pin {path}")]
    Pin {
        /// Pin path.
        path: PathBuf,
        /// Why.
        #[source]
        source: aya::pin::PinError,
    },
    /// Opening a pinned link failed.
    #[error("open pinned link {path}")]
    PinnedLink {
        /// Pin path.
        path: PathBuf,
        /// Why.
        #[source]
        source: aya::programs::links::LinkError,
    },
    /// A map operation failed.
    #[error("map {name}")]
    Map {
        /// Map name.
        name: &'static str,
        /// Why.
        #[source]
        source: aya::maps::MapError,
    },
    /// No sandbox of that name is registered.
    #[error("sandbox {sandbox} is not registered with the inspector")]
    UnknownSandbox {
        /// The name asked for.
        sandbox: String,
    },
    /// The sandbox's name or cgroup is registered already.
    #[error("sandbox {sandbox} (or its cgroup {cgroup_id}) is registered already")]
    AlreadyRegistered {
        /// The name given.
        sandbox: String,
        /// Its cgroup id.
        cgroup_id: u64,
    },
    /// The cgroup directory cannot be read.
    #[error("read cgroup {path}")]
    Cgroup {
        /// The cgroup directory.
        path: PathBuf,
        /// Why.
        #[source]
        source: std::io::Error,
    },
    /// No cgroup2 (unified) hierarchy is mounted.
    #[error("no cgroup2 filesystem in /proc/self/mountinfo")]
    NoUnifiedCgroup,
    /// A noisy command name is too long to match a kernel `comm`.
    #[error("noisy command name {comm:?} is longer than 15 bytes; the kernel keeps 15")]
    CommTooLong {
        /// The name given.
        comm: String,
    },
}

/// The inspector's result type.
pub type Result<T, E = Error> = std::result::Result<T, E>;
