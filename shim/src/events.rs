//! Task events towards containerd: the publisher, and the watchers that
//! follow a process to its exit (TaskExit) and a memory cgroup to its OOM
//! kills (TaskOOM).

use std::sync::Arc;
use std::time::Duration;

use containerd_shim::asynchronous::publisher::RemotePublisher;
use containerd_shim::protos::events::task::{TaskExit, TaskOOM};
use containerd_shim::protos::protobuf::{MessageDyn, MessageField};
use containerd_shim::protos::topics::{TASK_EXIT_EVENT_TOPIC, TASK_OOM_EVENT_TOPIC};
use containerd_shim::protos::ttrpc::context::Context;

use crate::container::{Container, ExitReceiver};
use crate::oom::OomWatch;
use crate::process::timestamp;

/// How long the shim waits for a process's output to reach containerd after
/// it exited (a daemon child may hold the pipe open forever).
const DRAIN_LIMIT: Duration = Duration::from_secs(2);

/// Publishes task events to containerd.
pub struct Events {
    publisher: RemotePublisher,
    namespace: String,
}

// === impl Events ===

impl Events {
    /// Publishes to containerd's namespace `namespace` through `publisher`.
    pub fn new(publisher: RemotePublisher, namespace: String) -> Self {
        Events { publisher, namespace }
    }

    /// Publishes `event` under `topic`; failures are logged (containerd
    /// re-reads state through the task API).
    pub async fn publish(&self, topic: &str, event: Box<dyn MessageDyn>) {
        if let Err(e) = self
            .publisher
            .publish(Context::default(), topic, &self.namespace, event)
            .await
        {
            tracing::warn!(error = %crab_api::error_chain(&e), "publish {topic}");
        }
    }
}

/// The shortest time between two OOM events of one container.
const OOM_INTERVAL: std::time::Duration = std::time::Duration::from_millis(100);

/// Publishes TaskOOM for the OOM kills in `c`'s memory cgroup until it is
/// deleted: one event per [`OOM_INTERVAL`] at most, for the kills since
/// the last.
pub fn watch_oom(events: Arc<Events>, c: &mut Container) {
    let mut watch = match OomWatch::new(&c.cgroups_path) {
        Ok(Some(w)) => w,
        Ok(None) => return,
        Err(e) => {
            tracing::warn!(error = %crab_api::error_chain(&e), "{}: no OOM events", c.id);
            return;
        }
    };
    let id = c.id.clone();
    // Owned by the container: aborted when it is deleted.
    c.oom_task = Some(tokio::spawn(async move {
        loop {
            let waited = tokio::task::spawn_blocking(move || {
                let oom = watch.next_blocking();
                (watch, oom)
            })
            .await;
            let Ok((w, true)) = waited else { break };
            watch = w;
            tracing::info!("{id}: OOM kill");
            let event = TaskOOM {
                container_id: id.clone(),
                ..Default::default()
            };
            events.publish(TASK_OOM_EVENT_TOPIC, Box::new(event)).await;
            // A burst of kills (a cgroup that keeps meeting its limit) is
            // one event per interval: thousands in a second filled
            // containerd's queue for slow subscribers, which then lost the
            // task's exit. The kills meanwhile are counted in the next.
            tokio::time::sleep(OOM_INTERVAL).await;
        }
    }));
}

/// Follows a process until it exits: drains its output, records the status
/// and publishes TaskExit. A process that is no longer `pid` when it exits
/// was replaced by a restore: its exit is not the task's.
pub fn watch_exit(
    events: Arc<Events>,
    container: Arc<tokio::sync::Mutex<Container>>,
    exec_id: String,
    pid: i32,
    rx: ExitReceiver,
) {
    // Ends when the process exits; the exit router outlives it.
    tokio::spawn(async move {
        let Ok(exit) = rx.await else { return };
        if exec_id.is_empty() && crate::recovery::recovered(&container, pid, exit).await {
            return;
        }
        let (cid, io) = {
            let mut c = container.lock().await;
            let cid = c.id.clone();
            match c.process_mut(&exec_id) {
                Ok(p) if p.pid == pid => (cid, p.io.take()),
                Ok(_) => {
                    tracing::info!("{cid} {exec_id}: replaced pid {pid} exited");
                    return;
                }
                Err(_) => (cid, None),
            }
        };
        if let Some(mut io) = io {
            io.drain(DRAIN_LIMIT).await;
        }
        if let Ok(p) = container.lock().await.process_mut(&exec_id) {
            if p.pid != pid {
                // Restored while its output drained (a late recovery).
                tracing::info!("{exec_id}: replaced pid {pid} exited");
                return;
            }
            p.set_exited(exit);
        }
        tracing::info!("{cid} {exec_id}: pid {pid} exited with status {}", exit.code);
        let id = if exec_id.is_empty() { cid.clone() } else { exec_id };
        events
            .publish(
                TASK_EXIT_EVENT_TOPIC,
                Box::new(TaskExit {
                    container_id: cid,
                    id,
                    pid: pid as u32,
                    exit_status: exit.code,
                    exited_at: MessageField::some(timestamp(exit.at)),
                    ..Default::default()
                }),
            )
            .await;
    });
}
