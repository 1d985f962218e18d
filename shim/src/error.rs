//! The shim's error type and its one mapping onto ttrpc status codes.

use std::path::PathBuf;

use containerd_shim::protos::ttrpc;

use crate::runtime::protocol::FailureKind;

/// Everything a task API call of the crab shim can fail with.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// No container or exec with this id in this shim.
    #[error("{kind} {id} not found")]
    NotFound {
        /// `container` or `exec`.
        kind: &'static str,
        /// The id asked for.
        id: String,
    },
    /// A container or exec with this id already exists.
    #[error("{kind} {id} already exists")]
    AlreadyExists {
        /// `container` or `exec`.
        kind: &'static str,
        /// The id asked for.
        id: String,
    },
    /// The id would escape its directory or is not a valid container id.
    #[error("invalid id {id:?}: use 1-76 letters, digits, '.', '_' or '-', starting with a letter or digit")]
    InvalidId {
        /// The id given.
        id: String,
    },
    /// The stdio URI names a scheme the shim does not implement.
    #[error("unsupported stdio {uri:?}: the crab shim takes fifo paths and file:// URIs")]
    UnsupportedStdio {
        /// The URI given.
        uri: String,
    },
    /// The bundle's `config.json` is missing or not an OCI runtime spec.
    #[error("invalid bundle {bundle}: {reason}")]
    InvalidBundle {
        /// The bundle directory.
        bundle: PathBuf,
        /// What is wrong with it.
        reason: String,
    },
    /// The process is not in a state that allows the call.
    #[error("{id} is {state}: cannot {op}")]
    BadState {
        /// Container or exec id.
        id: String,
        /// Its current state.
        state: &'static str,
        /// The refused operation.
        op: &'static str,
    },
    /// The signal number is not a signal of this OS.
    #[error("invalid signal {signal}")]
    InvalidSignal {
        /// The number given.
        signal: u32,
    },
    /// An Update request's resources are not an OCI `LinuxResources`.
    #[error("invalid resources: {reason}")]
    InvalidResources {
        /// What the JSON decoder said.
        reason: String,
    },
    /// A Checkpoint request's options are not runc's CheckpointOptions.
    #[error("invalid checkpoint options: {reason}")]
    InvalidCheckpointOptions {
        /// What is wrong.
        reason: String,
    },
    /// The process has already exited.
    #[error("process {id} already finished")]
    Finished {
        /// Container or exec id.
        id: String,
    },
    /// The runtime helper (libcontainer, CRIU, a filesystem backend)
    /// reported a failure.
    #[error("{op} {id}: {reason}")]
    Runtime {
        /// `create`, `start`, `exec`, `checkpoint`, `restore`, `fs`, `delete`.
        op: &'static str,
        /// Container id.
        id: String,
        /// What kind of failure (its ttrpc code).
        kind: FailureKind,
        /// The helper's error chain.
        reason: String,
    },
    /// The runtime helper exited without a reply (killed, or a bug).
    #[error("{op} {id}: the runtime helper exited with status {status} and no reply")]
    RuntimeDied {
        /// The operation.
        op: &'static str,
        /// Container id.
        id: String,
        /// Its exit status.
        status: i32,
    },
    /// An exec's process (crab-init) did not hand its command over.
    #[error("exec process {pid}: {reason}")]
    ExecHandover {
        /// The exec's process on the host.
        pid: i32,
        /// What went wrong.
        reason: String,
    },
    /// The runtime helper did not finish in time.
    #[error("{op} {id}: runtime helper did not finish within {secs}s")]
    RuntimeTimeout {
        /// The operation.
        op: &'static str,
        /// Container id.
        id: String,
        /// The deadline.
        secs: u64,
    },
    /// The container's init started dying while a helper worked on it (a
    /// dump is abandoned: CRIU is stopped, nothing is published).
    #[error("{op} {id}: the container's init was killed during the operation")]
    InitDied {
        /// The operation.
        op: &'static str,
        /// Container id.
        id: String,
    },
    /// An in-process libcontainer call failed (kill, pause, resume).
    #[error("{op} {id}")]
    Libcontainer {
        /// The operation.
        op: &'static str,
        /// Container id.
        id: String,
        /// libcontainer's error.
        #[source]
        source: Box<libcontainer::error::LibcontainerError>,
    },
    /// A cgroup read or write failed (stats, update, the unified cgroup).
    #[error("cgroup {op} of {id}")]
    Cgroup {
        /// The operation.
        op: &'static str,
        /// Container id.
        id: String,
        /// What failed.
        #[source]
        source: Box<dyn std::error::Error + Send + Sync>,
    },
    /// Mounting or unmounting the rootfs failed.
    #[error("rootfs of {id}")]
    Mount {
        /// Container id.
        id: String,
        /// What failed.
        #[source]
        source: containerd_shim::Error,
    },
    /// An OS call failed.
    #[error("{context}")]
    Io {
        /// What the shim was doing.
        context: String,
        /// What the OS said.
        #[source]
        source: std::io::Error,
    },
    /// An Exec request's process spec is not an OCI process (JSON object).
    #[error("invalid exec spec: {reason}")]
    InvalidExecSpec {
        /// What is wrong.
        reason: String,
    },
    /// The sandbox's LLM proxy could not be set up.
    #[error("llm proxy of {id}: {reason}")]
    Proxy {
        /// Container id.
        id: String,
        /// What crab-proxy said.
        reason: String,
    },
    /// A filesystem snapshot operation failed.
    #[error("filesystem snapshot of {id}")]
    Snapshot {
        /// The container.
        id: String,
        /// What the backend said.
        #[source]
        source: crab_snapshotter::Error,
    },
    /// The container's rootfs is not one a filesystem backend can snapshot.
    #[error("{id}: no filesystem backend can snapshot its rootfs ({reason})")]
    NoFsBackend {
        /// The container.
        id: String,
        /// What the rootfs is.
        reason: String,
    },
    /// A checkpoint to restore is missing or unreadable.
    #[error("checkpoint {path} cannot be restored: {reason}")]
    InvalidCheckpoint {
        /// The images directory.
        path: PathBuf,
        /// Why.
        reason: String,
    },
    /// A restore failed; the sandbox was put back as it was before.
    #[error("restore failed; the sandbox was put back as it was (pid {pid})")]
    RestoreUndone {
        /// Why the restore failed.
        #[source]
        source: Box<Error>,
        /// The init that runs now.
        pid: i32,
    },
    /// A restore failed, and so did putting the sandbox back: its processes
    /// are gone.
    #[error(
        "restore of {id} failed ({restore}), and so did putting it back ({undo}): its processes are gone"
    )]
    RestoreLost {
        /// The container.
        id: String,
        /// Why the restore failed.
        restore: String,
        /// Why the undo failed.
        undo: String,
    },
    /// A process of the container holds an io_uring, which CRIU cannot dump.
    #[error(
        "{id}: process {pid} ({comm:?}) holds an io_uring ({held}), which CRIU cannot checkpoint; \
         Node.js (libuv) stops using io_uring with UV_USE_IO_URING=0, which crab's default [shim] env sets"
    )]
    IoUring {
        /// The container.
        id: String,
        /// The process, on the host.
        pid: u32,
        /// Its command name.
        comm: String,
        /// How it holds the ring (`fd N`, `a mapping`).
        held: String,
    },
    /// The container's init is not the init of its pid namespace (a pod
    /// sharing one process namespace, or the host's), and CRIU dumps a pid
    /// namespace only with its init.
    #[error(
        "{id}: its processes share a pid namespace whose init is outside the container \
         (a pod with shareProcessNamespace, or the host's), and CRIU checkpoints a pid namespace \
         only with its init: give the container a pid namespace of its own (the kubelet's default)"
    )]
    SharedPidNs {
        /// The container.
        id: String,
    },
    /// A pod's version cannot cover one of the pod's containers, or a
    /// version's part for one cannot be taken back.
    #[error("{id}: pod version: {reason}")]
    PodMember {
        /// The pod's sandbox container.
        id: String,
        /// Why.
        reason: String,
    },
    /// The spec asks for a restore crabd did not grant.
    #[error("{id}: restore refused: {reason}")]
    RestoreNotGranted {
        /// The container.
        id: String,
        /// Why.
        reason: String,
    },
    /// The call is part of the task API but this shim does not offer it.
    #[error("{call} is not supported by the crab shim")]
    Unsupported {
        /// The call.
        call: &'static str,
    },
}

/// Result of a shim operation.
pub type Result<T> = std::result::Result<T, Error>;

// === impl Error ===

impl Error {
    /// An [`Error::Io`] with `context`.
    pub fn io(context: impl Into<String>) -> impl FnOnce(std::io::Error) -> Self {
        let context = context.into();
        move |source| Error::Io { context, source }
    }

    fn code(&self) -> ttrpc::Code {
        match self {
            Error::NotFound { .. } => ttrpc::Code::NOT_FOUND,
            Error::AlreadyExists { .. } => ttrpc::Code::ALREADY_EXISTS,
            Error::InvalidId { .. }
            | Error::UnsupportedStdio { .. }
            | Error::InvalidBundle { .. }
            | Error::InvalidSignal { .. }
            | Error::InvalidResources { .. }
            | Error::InvalidCheckpointOptions { .. }
            | Error::InvalidCheckpoint { .. }
            | Error::InvalidExecSpec { .. } => ttrpc::Code::INVALID_ARGUMENT,
            Error::NoFsBackend { .. }
            | Error::IoUring { .. }
            | Error::SharedPidNs { .. }
            | Error::PodMember { .. } => ttrpc::Code::FAILED_PRECONDITION,
            Error::RestoreNotGranted { .. } => ttrpc::Code::PERMISSION_DENIED,
            Error::Runtime { kind, .. } => match kind {
                FailureKind::NoSuchContainer => ttrpc::Code::NOT_FOUND,
                FailureKind::BadRequest => ttrpc::Code::INTERNAL,
                FailureKind::Criu | FailureKind::Fs | FailureKind::Container => {
                    ttrpc::Code::FAILED_PRECONDITION
                }
            },
            Error::RuntimeDied { .. } => ttrpc::Code::INTERNAL,
            Error::ExecHandover { .. } => ttrpc::Code::FAILED_PRECONDITION,
            Error::BadState { .. } => ttrpc::Code::FAILED_PRECONDITION,
            Error::Finished { .. } => ttrpc::Code::NOT_FOUND,
            Error::RuntimeTimeout { .. } => ttrpc::Code::DEADLINE_EXCEEDED,
            Error::InitDied { .. } => ttrpc::Code::ABORTED,
            Error::Unsupported { .. } => ttrpc::Code::UNIMPLEMENTED,
            Error::Proxy { .. } => ttrpc::Code::UNAVAILABLE,
            Error::Libcontainer { .. }
            | Error::Cgroup { .. }
            | Error::Mount { .. }
            | Error::Io { .. }
            | Error::Snapshot { .. }
            | Error::RestoreLost { .. }
            | Error::RestoreUndone { .. } => ttrpc::Code::UNKNOWN,
        }
    }
}

impl From<Error> for ttrpc::Error {
    fn from(e: Error) -> Self {
        // containerd shows the status message to the user, so it carries the
        // whole source chain.
        ttrpc::Error::RpcStatus(ttrpc::get_status(e.code(), crab_api::error_chain(&e)))
    }
}

/// Checks a container or exec id the way containerd does
/// (`identifiers.Validate`), so no id can name a path outside its directory.
pub fn validate_id(id: &str) -> Result<()> {
    // One rule for every sandbox id in Crab: the proxy's.
    crab_proxy::SandboxId::new(id)
        .map(drop)
        .map_err(|e| Error::InvalidId { id: e.id })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn check(id: &str, valid: bool) {
        assert_eq!(validate_id(id).is_ok(), valid, "{id:?}");
    }

    #[test]
    fn ids() {
        check("abc", true);
        check("a.b_c-1", true);
        check(&"a".repeat(76), true);
        check(&"a".repeat(77), false);
        check("", false);
        check("../etc", false);
        check("a/b", false);
        check(".hidden", false);
        check("-x", false);
        check("a b", false);
    }

    #[test]
    fn codes() {
        let e = Error::NotFound {
            kind: "exec",
            id: "x".into(),
        };
        match ttrpc::Error::from(e) {
            ttrpc::Error::RpcStatus(s) => assert_eq!(s.code(), ttrpc::Code::NOT_FOUND),
            other => panic!("{other:?}"),
        }
    }
}
