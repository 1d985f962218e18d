//! Automatic crash recovery (`[crabd] recover = "on-crash"`).
//!
//! When a sandbox's init dies without containerd having asked (no Kill or
//! Delete of the init came first) and by a signal (an exit status of 128
//! or more: killed from outside, OOM-killed, crashed), the shim asks crabd
//! to restore the sandbox's head version into the same container before
//! the exit is published: containerd and docker see the task run on, with
//! a new pid. An exit the init chose (a status below 128) is the task's
//! end (crab-init says how the spec's process ended; without it a status of
//! 128 or more counts as a signal), and so is an end by a signal that
//! containerd sent. While the recovery runs, a Kill is kept for the
//! restored init and execs are refused. Crashes back off (after one
//! recovery within a minute the next waits a second, after two, two) and
//! after three recoveries within a minute the next crash is the task's end:
//! the exit is then reported as usual, and the log says why.

use std::collections::VecDeque;
use std::sync::Arc;
use std::time::{Duration, Instant};

use crab_api::client::Crabd;
use crab_api::crabd::Crash;
use crab_api::SandboxId;
use nix::sys::signal::Signal;
use tokio::sync::Mutex;

use crate::container::Container;
use crate::exits::Exit;

/// Crashes within this window count toward giving up.
const WINDOW: Duration = Duration::from_secs(60);

/// Recoveries allowed within [`WINDOW`].
const MOST: usize = 3;

/// A registered sandbox's way back after a crash.
pub struct Recovery {
    crabd: Crabd,
    id: SandboxId,
    recent: VecDeque<Instant>,
}

// === impl Recovery ===

impl Recovery {
    /// Recovery of sandbox `id` through `crabd`.
    pub fn new(crabd: Crabd, id: SandboxId) -> Self {
        Recovery {
            crabd,
            id,
            recent: VecDeque::new(),
        }
    }

    /// How long to wait before one more recovery, or `None` when too many
    /// came within the window.
    fn backoff(&mut self, now: Instant) -> Option<Duration> {
        while self
            .recent
            .front()
            .is_some_and(|t| now.duration_since(*t) > WINDOW)
        {
            self.recent.pop_front();
        }
        if self.recent.len() >= MOST {
            return None;
        }
        let wait = match self.recent.len() {
            0 => Duration::ZERO,
            n => Duration::from_secs(1 << (n - 1)),
        };
        self.recent.push_back(now);
        Some(wait)
    }
}

/// How long crab-init's word on how the spec's process ended may take.
/// Its report ends at the latest when the pid namespace's last process
/// is gone (nothing else holds the pipe), so this bounds only a shim
/// starved on a loaded host: generous, as a wrong guess turns an
/// `exit 139` into a crash.
const HOW_IT_ENDED: Duration = Duration::from_secs(5);

/// Whether the init `pid` of `container`, which exited with `exit`, was
/// recovered (its exit is then not the task's: a restored init runs, and
/// is watched by whoever restored it).
pub async fn recovered(container: &Arc<Mutex<Container>>, pid: i32, exit: Exit) -> bool {
    let adopted = {
        let c = container.lock().await;
        // Replaced by a rollback meanwhile, or never to be recovered.
        if c.init.pid != pid || c.recovery.is_none() {
            return false;
        }
        c.adoptions()
    };
    // Died by a signal? crab-init says how the spec's process ended (an
    // `exit 139` is no crash); without its word (crab-init itself was
    // killed, or no crab-init), a status of 128 + N is signal N.
    let by_signal = match adopted {
        Some(a) => a.main_died_by_signal(HOW_IT_ENDED).await,
        None => None,
    }
    .unwrap_or(exit.code >= 128);
    let (crabd, id, wait) = {
        let mut c = container.lock().await;
        let asked = c
            .asked
            .iter()
            .any(|s| *s == Signal::SIGKILL || exit.code == 128 + *s as u32);
        if c.init.pid != pid || asked || !by_signal {
            return false;
        }
        let Some(r) = c.recovery.as_mut() else {
            return false;
        };
        let Some(wait) = r.backoff(Instant::now()) else {
            tracing::error!(
                sandbox = %r.id,
                status = exit.code,
                "the init died after {MOST} recoveries within {} s: the task exits",
                WINDOW.as_secs()
            );
            return false;
        };
        let ids = (r.crabd.clone(), r.id.clone(), wait);
        // From here a Kill is kept for the restored init, and execs wait.
        c.recovering = true;
        c.asked.clear();
        ids
    };
    tracing::warn!(sandbox = %id, status = exit.code, wait_ms = wait.as_millis() as u64, "the init died unasked: recovering");
    tokio::time::sleep(wait).await;
    // Not under the container's lock: crabd's restore takes it.
    let stop_asked = !container.lock().await.asked.is_empty();
    let answer = match stop_asked {
        // Asked to stop while waiting: the exit is the task's.
        true => None,
        false => Some(
            crabd
                .recover(
                    &id,
                    &Crash {
                        exit_status: exit.code,
                    },
                )
                .await,
        ),
    };
    let mut c = container.lock().await;
    c.recovering = false;
    match answer {
        Some(Ok(r)) => {
            tracing::warn!(sandbox = %id, version = r.version, pid = r.pid, total_ms = r.total_ms, "recovered after a crash");
            // What containerd asked meanwhile is the restored init's.
            for sig in c.asked.clone() {
                let _ = nix::sys::signal::kill(nix::unistd::Pid::from_raw(c.init.pid), sig);
            }
            true
        }
        Some(Err(e)) => {
            // crabd may have restored all the same (it answered late): then
            // a restored init runs, and this exit is not the task's.
            let restored = c.init.pid != pid;
            tracing::error!(sandbox = %id, restored, error = %crab_api::error_chain(&e), "recovery failed");
            restored
        }
        None => false,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn crashes_back_off_then_give_up_and_are_forgotten_after_a_minute() {
        let mut r = Recovery::new(
            Crabd::new("/nonexistent", Duration::from_secs(1)),
            SandboxId::new("s").unwrap(),
        );
        let t0 = Instant::now();
        assert_eq!(r.backoff(t0), Some(Duration::ZERO));
        assert_eq!(
            r.backoff(t0 + Duration::from_secs(1)),
            Some(Duration::from_secs(1))
        );
        assert_eq!(
            r.backoff(t0 + Duration::from_secs(2)),
            Some(Duration::from_secs(2))
        );
        assert_eq!(
            r.backoff(t0 + Duration::from_secs(3)),
            None,
            "the fourth in a minute"
        );
        assert_eq!(
            r.backoff(t0 + Duration::from_secs(62)),
            Some(Duration::from_secs(1))
        );
    }
}
