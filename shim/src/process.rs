//! One process of a container (its init, or an exec): state and exit.

use containerd_shim::api::{StateResponse, Status};
use containerd_shim::protos::protobuf::well_known_types::timestamp::Timestamp;
use containerd_shim::protos::protobuf::MessageField;
use tokio::sync::watch;

use crate::exits::Exit;
use crate::io::{ProcessIo, StdioPaths};

/// Lifecycle state, as containerd names it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ProcessState {
    /// Created, waiting for Start (init) or not yet started (exec).
    Created,
    /// Running.
    Running,
    /// Frozen (init only; execs follow their container).
    Paused,
    /// Exited; the status is known.
    Stopped,
}

/// An init or exec process.
pub struct Process {
    /// Exec id; empty for the init.
    pub exec_id: String,
    /// Host pid; 0 until created.
    pub pid: i32,
    /// Lifecycle state.
    pub state: ProcessState,
    /// containerd's stdio for it.
    pub stdio: StdioPaths,
    /// The shim's side of its stdio; taken while draining at exit.
    pub io: Option<ProcessIo>,
    /// Exec only: the OCI process spec (JSON) from the Exec request.
    pub spec: Option<Vec<u8>>,
    /// Exec only: the pidfd of a command crab-init adopted (it is
    /// signalled through it).
    pub pidfd: Option<std::sync::Arc<std::os::fd::OwnedFd>>,
    exit: watch::Sender<Option<Exit>>,
}

// === impl ProcessState ===

impl ProcessState {
    /// A word for error messages.
    pub fn name(self) -> &'static str {
        match self {
            ProcessState::Created => "created",
            ProcessState::Running => "running",
            ProcessState::Paused => "paused",
            ProcessState::Stopped => "stopped",
        }
    }
}

// === impl Process ===

impl Process {
    /// A process not yet created.
    pub fn new(exec_id: &str, stdio: StdioPaths) -> Self {
        Process {
            exec_id: exec_id.to_owned(),
            pid: 0,
            state: ProcessState::Created,
            stdio,
            io: None,
            spec: None,
            pidfd: None,
            exit: watch::channel(None).0,
        }
    }

    /// Its exit, once known.
    pub fn exit(&self) -> Option<Exit> {
        *self.exit.borrow()
    }

    /// A receiver that sees the exit when it happens.
    pub fn subscribe(&self) -> watch::Receiver<Option<Exit>> {
        self.exit.subscribe()
    }

    /// Records the exit and wakes every waiter.
    pub fn set_exited(&mut self, exit: Exit) {
        self.state = ProcessState::Stopped;
        self.exit.send_replace(Some(exit));
    }

    /// The State response for it.
    pub fn state_response(&self, container_id: &str, bundle: &str) -> StateResponse {
        let status = match self.state {
            ProcessState::Created => Status::CREATED,
            ProcessState::Running => Status::RUNNING,
            ProcessState::Paused => Status::PAUSED,
            ProcessState::Stopped => Status::STOPPED,
        };
        let exit = self.exit();
        StateResponse {
            id: container_id.to_owned(),
            exec_id: self.exec_id.clone(),
            bundle: bundle.to_owned(),
            pid: self.pid.max(0) as u32,
            status: status.into(),
            stdin: self.stdio.stdin.clone(),
            stdout: self.stdio.stdout.clone(),
            stderr: self.stdio.stderr.clone(),
            terminal: self.stdio.terminal,
            exit_status: exit.map_or(0, |e| e.code),
            exited_at: exit.map_or_else(MessageField::none, |e| MessageField::some(timestamp(e.at))),
            ..Default::default()
        }
    }
}

/// A protobuf timestamp of `at`.
pub fn timestamp(at: std::time::SystemTime) -> Timestamp {
    let d = at.duration_since(std::time::UNIX_EPOCH).unwrap_or_default();
    Timestamp {
        seconds: d.as_secs() as i64,
        nanos: d.subsec_nanos() as i32,
        ..Default::default()
    }
}
