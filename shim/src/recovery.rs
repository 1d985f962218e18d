//! Automatic crash recovery (`[crabd] recover = "on-crash"`).
//!
//! When a sandbox's init dies without containerd having asked (no Kill or
//! Delete of the init came first) and by a signal (an exit status of 128
//! or more: killed from outside, OOM-killed, crashed), the shim asks crabd
//! to restore the sandbox's head version into the same container before
//! the exit is published: containerd and docker see the task run on, with
//! a new pid. An exit the init chose (a status below 128) is the task's
//! end. Crashes back off (a second within a minute waits a second, a third
//! two) and the fourth within a minute gives up: the exit is then reported
//! as usual, and the log says why.

use std::collections::VecDeque;
use std::sync::Arc;
use std::time::{Duration, Instant};

use crab_api::client::Crabd;
use crab_api::crabd::Crash;
use crab_api::SandboxId;
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

/// Whether the init `pid` of `container`, which exited with `exit`, was
/// recovered (its exit is then not the task's: a restored init runs, and
/// is watched by whoever restored it).
pub async fn recovered(container: &Arc<Mutex<Container>>, pid: i32, exit: Exit) -> bool {
    let (crabd, id, wait) = {
        let mut c = container.lock().await;
        // Replaced by a rollback meanwhile, asked to stop, or its own end.
        if c.init.pid != pid || c.stop_requested || exit.code < 128 {
            return false;
        }
        let Some(r) = c.recovery.as_mut() else {
            return false;
        };
        let Some(wait) = r.backoff(Instant::now()) else {
            tracing::error!(
                sandbox = %r.id,
                status = exit.code,
                "the init died {MOST} times within {} s: no more recoveries, the task exits",
                WINDOW.as_secs()
            );
            return false;
        };
        (r.crabd.clone(), r.id.clone(), wait)
    };
    tracing::warn!(sandbox = %id, status = exit.code, wait_ms = wait.as_millis() as u64, "the init died unasked: recovering");
    tokio::time::sleep(wait).await;
    // Asked to stop while waiting: the exit is the task's.
    if container.lock().await.stop_requested {
        return false;
    }
    match crabd
        .recover(
            &id,
            &Crash {
                exit_status: exit.code,
            },
        )
        .await
    {
        Ok(r) => {
            tracing::warn!(sandbox = %id, version = r.version, pid = r.pid, total_ms = r.total_ms, "recovered after a crash");
            true
        }
        Err(e) => {
            tracing::error!(sandbox = %id, error = %crab_api::error_chain(&e), "recovery failed: the task exits");
            false
        }
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
