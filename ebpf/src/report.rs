//! What a turn end answers: the class of the turn and a bounded sample of
//! the reasons for it.

use serde::{Deserialize, Serialize};

pub use crab_api::Class;

/// Why a turn got its class. A report carries a bounded sample of these.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum Reason {
    /// A path was created, written, removed, renamed or re-permissioned and
    /// the change outlived the turn.
    Changed {
        /// The path as the sandbox's process named it.
        path: String,
    },
    /// A process started during the turn and is still running.
    Started {
        /// Host pid.
        pid: u32,
        /// Command name.
        comm: String,
    },
    /// A process that was alive at the last turn end exited.
    Exited {
        /// Host pid.
        pid: u32,
        /// Command name.
        comm: String,
    },
    /// A process that was alive at the last turn end ran (made a system
    /// call, or was running at the turn end), so its memory may differ.
    Ran {
        /// Host pid.
        pid: u32,
        /// Command name.
        comm: String,
    },
    /// A process that was alive at the last turn end executed a new program.
    Execed {
        /// Host pid.
        pid: u32,
        /// Command name after the exec.
        comm: String,
    },
    /// A process that was alive at the last turn end changed its working
    /// directory.
    Chdir {
        /// Host pid.
        pid: u32,
        /// Command name.
        comm: String,
    },
    /// A path on a tmpfs of the sandbox (`/dev`, `/dev/shm`) changed, or a
    /// tmpfs as a whole did: CRIU keeps those contents with the processes.
    TmpfsChanged {
        /// The path as named, or the tmpfs's mount point.
        path: String,
    },
    /// A System V or POSIX IPC call (shared memory, semaphores, message
    /// queues): state kept with the processes, not in files.
    Ipc {
        /// Host pid.
        pid: u32,
        /// Command name.
        comm: String,
        /// The x86_64 system call number.
        call: u32,
    },
    /// A file that a live process has mapped was written or replaced: the
    /// old process image would not restore against the new file.
    MappedFileChanged {
        /// Host pid of a process that maps it.
        pid: u32,
        /// The mapped path as the process sees it.
        path: String,
    },
    /// The inspector cannot vouch for the turn (lost records, a full map,
    /// operations it does not follow, a restart); the class is `full`.
    Unsure {
        /// What went wrong, for people.
        why: String,
    },
}

/// The answer for one ended turn.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct TurnReport {
    /// The turn's number in its sandbox, from 1.
    pub turn: u64,
    /// What the turn needs saved.
    pub class: Class,
    /// A bounded sample of why (empty for `none`).
    pub reasons: Vec<Reason>,
    /// How many reasons there were in all (`reasons` holds the first ones).
    pub n_reasons: usize,
}

#[cfg(test)]
mod tests {
    use super::*;

    fn check(fs: bool, proc: bool, json: &str) {
        let class = Class::of(fs, proc);
        assert_eq!(serde_json::to_string(&class).unwrap(), json);
        assert_eq!(json.trim_matches('"').parse::<Class>().unwrap(), class);
        assert_eq!(class.needs_fs(), fs);
        assert_eq!(class.needs_proc(), proc);
    }

    #[test]
    fn classes_serialize_lowercase_and_compose() {
        check(false, false, "\"none\"");
        check(true, false, "\"fs\"");
        check(false, true, "\"proc\"");
        check(true, true, "\"full\"");
        assert!(Class::Full.covers(Class::Fs));
        assert!(!Class::Fs.covers(Class::Proc));
    }

    #[test]
    fn reasons_are_tagged() {
        let r = Reason::Changed { path: "/a".into() };
        assert_eq!(
            serde_json::to_string(&r).unwrap(),
            r#"{"kind":"changed","path":"/a"}"#
        );
    }
}
