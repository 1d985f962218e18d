//! Routing of reaped exit statuses to the processes that own them.
//!
//! containerd-shim's signal loop reaps every child on `SIGCHLD` and publishes
//! `(pid, status)` on its monitor (signals already as `128 + N`). One task here
//! subscribes to all of it and hands each status to whoever watches that pid.
//! A child can exit before its pid is known (an exec of `true`, a failed
//! helper): while a spawn is in flight, statuses of unwatched pids are kept,
//! so the spawner still finds them; otherwise they are dropped, which keeps
//! the table bounded and pid reuse harmless.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::SystemTime;

use containerd_shim::asynchronous::monitor::monitor_subscribe;
use containerd_shim::monitor::{Subject, Topic};
use tokio::sync::oneshot;

/// One process's end.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Exit {
    /// Exit code; `128 + N` when killed by signal N.
    pub code: u32,
    /// When the shim reaped it.
    pub at: SystemTime,
}

/// Hands reaped statuses to their watchers.
#[derive(Default)]
pub struct ExitRouter {
    inner: Mutex<Inner>,
}

#[derive(Default)]
struct Inner {
    watchers: HashMap<i32, oneshot::Sender<Exit>>,
    unclaimed: HashMap<i32, Exit>,
    n_spawning: usize,
}

/// Keeps unclaimed exits while alive; see the module doc.
pub struct SpawnGuard {
    router: Arc<ExitRouter>,
}

// === impl ExitRouter ===

impl ExitRouter {
    /// Subscribes to containerd-shim's monitor and starts routing.
    ///
    /// Must run before the first child is spawned.
    pub async fn start() -> Arc<Self> {
        let router = Arc::new(ExitRouter::default());
        // The subscription only fails if the monitor is gone, which is a
        // containerd-shim invariant violation.
        let mut sub = monitor_subscribe(Topic::All)
            .await
            .expect("containerd-shim monitor is always available");
        let r = router.clone();
        // Owned by the shim process: it ends with the monitor's channel.
        tokio::spawn(async move {
            while let Some(ev) = sub.rx.recv().await {
                if let Subject::Pid(pid) = ev.subject {
                    r.deliver(pid, ev.exit_code);
                }
            }
        });
        router
    }

    /// Marks a spawn in flight until the guard drops.
    pub fn spawning(self: &Arc<Self>) -> SpawnGuard {
        self.inner.lock().expect("exit router lock").n_spawning += 1;
        SpawnGuard { router: self.clone() }
    }

    /// Returns a receiver of `pid`'s exit; ready at once if it already exited
    /// during a spawn.
    pub fn watch(&self, pid: i32) -> oneshot::Receiver<Exit> {
        let (tx, rx) = oneshot::channel();
        let mut inner = self.inner.lock().expect("exit router lock");
        match inner.unclaimed.remove(&pid) {
            Some(exit) => {
                let _ = tx.send(exit);
            }
            None => {
                inner.watchers.insert(pid, tx);
            }
        }
        rx
    }

    /// Hands `pid`'s exit status (`128 + N` for signal N) to its watcher.
    pub fn deliver(&self, pid: i32, code: i32) {
        let exit = Exit {
            code: code as u32,
            at: SystemTime::now(),
        };
        let mut inner = self.inner.lock().expect("exit router lock");
        if let Some(tx) = inner.watchers.remove(&pid) {
            let _ = tx.send(exit);
        } else if inner.n_spawning > 0 {
            inner.unclaimed.insert(pid, exit);
        } else {
            tracing::debug!("reaped unwatched pid {pid} (status {code})");
        }
    }
}

impl Drop for SpawnGuard {
    fn drop(&mut self) {
        let mut inner = self.router.inner.lock().expect("exit router lock");
        inner.n_spawning -= 1;
        if inner.n_spawning == 0 {
            inner.unclaimed.clear();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn exit_before_watch_is_kept_only_while_spawning() {
        let router = Arc::new(ExitRouter::default());
        let guard = router.spawning();
        router.deliver(10, 3);
        let mut rx = router.watch(10);
        assert_eq!(rx.try_recv().unwrap().code, 3);
        drop(guard);
        router.deliver(11, 0);
        let mut rx = router.watch(11);
        assert!(rx.try_recv().is_err());
        router.deliver(11, 137);
        assert_eq!(rx.try_recv().unwrap().code, 137);
    }
}
