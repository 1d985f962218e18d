//! The one protocol between the shim and its runtime helper: the shim runs
//! `containerd-shim-crab-v2 runtime --reply FILE --request JSON`, the
//! helper does the [`Request`] and writes one [`Reply`] to `FILE` (JSON)
//! before it exits. The container's stdio is the helper's own stdio, so
//! neither side's messages travel there.
//!
//! ```text
//! request = {"root":"/run/crab/runtime/ns","criu":"criu","id":"s1",
//!            "op":{"op":"create","bundle":"/…","launch":{…}}}
//! reply   = {"reply":"done"} | {"reply":"launched","pid":1234}
//!         | {"reply":"answer","text":"yes"}
//!         | {"reply":"failed","kind":"no-such-container","message":"…"}
//! ```
//!
//! A helper that dies before it replies (a bug, a kill) leaves no reply;
//! the shim then reports its exit status.

use std::path::PathBuf;

use serde::{Deserialize, Serialize};

use crate::fsop::FsOp;

/// What the shim asks of one helper process.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Request {
    /// libcontainer's state root.
    pub root: PathBuf,
    /// The CRIU binary.
    pub criu: PathBuf,
    /// The container.
    pub id: String,
    /// The operation.
    pub op: Op,
}

/// The operations of the helper: libcontainer's forking calls, CRIU, and
/// filesystem backends that run commands.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(tag = "op", rename_all = "kebab-case")]
pub enum Op {
    /// Create the container from a bundle; its init waits for `start`.
    Create {
        /// The bundle.
        bundle: PathBuf,
        /// How its init is born.
        launch: Launch,
    },
    /// Let a created container's init run its process.
    Start,
    /// Run an additional process (OCI `process.json`) in the container.
    Exec {
        /// The process spec.
        process: PathBuf,
        /// How it is born.
        launch: Launch,
    },
    /// Dump the container's processes with CRIU into an image directory.
    Checkpoint(Dump),
    /// Restore the container's processes from a CRIU image directory (its
    /// previous processes must be gone).
    Restore(Restore),
    /// Run a filesystem backend operation; its answer, if it has one, is
    /// the reply's text.
    Fs {
        /// The operation.
        fs: FsOp,
    },
    /// Remove the container's state and cgroups; `force` kills it first.
    Delete {
        /// Kill it first.
        force: bool,
    },
}

/// How a launched process is born.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct Launch {
    /// libcontainer's console socket, for a process with a terminal.
    pub console_socket: Option<PathBuf>,
    /// The unified cgroup to be born in (v1-hybrid hosts).
    pub unified_cgroup: Option<PathBuf>,
    /// Run the process through crab-init, whose channel is the helper's
    /// descriptor 3 (for a restore: the restored init's report pipe).
    #[serde(default)]
    pub crab_init: Option<Personality>,
}

/// How crab-init runs a launched process (see `crate::init`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum Personality {
    /// As the container's init, reporting what it reaps.
    Init,
    /// As an exec's process, handing its command to the init.
    Exec,
}

/// A CRIU dump.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Dump {
    /// Where the images go.
    pub image_path: PathBuf,
    /// CRIU's work directory (logs), if not the image directory.
    pub work_path: Option<PathBuf>,
    /// Stop the container after the dump (default: leave it running).
    pub exit: bool,
    /// Dump established TCP connections.
    pub tcp_established: bool,
    /// Dump external unix sockets.
    pub ext_unix_sk: bool,
    /// Dump file locks.
    pub file_locks: bool,
    /// The init is crab-init: record its report pipe beside its stdio.
    #[serde(default)]
    pub crab_init: bool,
    /// Something may have changed the sandbox's mounts: every tmpfs stays
    /// in the images.
    #[serde(default)]
    pub mounts_changed: bool,
    /// CRIU's network lock would protect nothing: it is not taken, and the
    /// images say so for a restore.
    #[serde(default)]
    pub quiet_network: bool,
}

/// A CRIU restore.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Restore {
    /// The images.
    pub image_path: PathBuf,
    /// CRIU's work directory.
    pub work_path: PathBuf,
    /// Restore established TCP connections.
    pub tcp_established: bool,
    /// The sandbox's pinned network namespace now (docker's).
    pub netns: Option<PathBuf>,
    /// The first restore of a pod's containers: the pod's network first
    /// loses the connections closed but not gone.
    #[serde(default)]
    pub reap_closed: bool,
    /// How the restored init is born.
    pub launch: Launch,
    /// The container has no state yet (a sandbox forked or imported from a
    /// checkpoint): make it from this bundle, its cgroups with the spec's
    /// limits.
    pub bundle: Option<PathBuf>,
}

/// What the helper answers.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "reply", rename_all = "kebab-case")]
pub enum Reply {
    /// The operation is done.
    Done,
    /// A process was created (create, exec, restore): its pid on the host.
    Launched {
        /// The pid.
        pid: i32,
    },
    /// A filesystem operation answered.
    Answer {
        /// Its answer.
        text: Option<String>,
    },
    /// The operation failed.
    Failed(Failure),
}

/// Why an operation failed: a kind the shim maps to a ttrpc code, and the
/// whole error chain for a person.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Failure {
    /// What kind of failure.
    pub kind: FailureKind,
    /// The error chain.
    pub message: String,
}

/// The kinds of helper failures.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum FailureKind {
    /// libcontainer has no state for the container.
    NoSuchContainer,
    /// The request was malformed (a shim bug, or a different binary).
    BadRequest,
    /// CRIU failed to dump or restore.
    Criu,
    /// A filesystem backend failed.
    Fs,
    /// libcontainer or the kernel refused the operation.
    Container,
}

#[cfg(test)]
mod tests {
    use super::*;

    fn check<T: Serialize + for<'de> Deserialize<'de> + std::fmt::Debug>(value: &T, json: &str) {
        assert_eq!(serde_json::to_string(value).unwrap(), json);
        let back: T = serde_json::from_str(json).unwrap();
        assert_eq!(format!("{back:?}"), format!("{value:?}"));
    }

    #[test]
    fn replies_and_requests_on_the_wire() {
        check(&Reply::Done, r#"{"reply":"done"}"#);
        check(&Reply::Launched { pid: 7 }, r#"{"reply":"launched","pid":7}"#);
        check(
            &Reply::Failed(Failure {
                kind: FailureKind::NoSuchContainer,
                message: "load container s1".into(),
            }),
            r#"{"reply":"failed","kind":"no-such-container","message":"load container s1"}"#,
        );
        check(
            &Request {
                root: "/r".into(),
                criu: "criu".into(),
                id: "s1".into(),
                op: Op::Delete { force: true },
            },
            r#"{"root":"/r","criu":"criu","id":"s1","op":{"op":"delete","force":true}}"#,
        );
        assert!(
            serde_json::from_str::<Request>(r#"{"root":"/r","criu":"c","id":"s","op":{"op":"fly"}}"#)
                .is_err()
        );
    }
}
