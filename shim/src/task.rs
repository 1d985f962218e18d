//! The task API (ttrpc): thin translations between containerd's messages and
//! [`Container`] calls, plus the events each call publishes.

use std::sync::Arc;

use async_trait::async_trait;
use containerd_shim::api::*;
use containerd_shim::protos::events::task::{
    TaskCreate, TaskDelete, TaskExecAdded, TaskExecStarted, TaskIO, TaskPaused, TaskResumed, TaskStart,
};
use containerd_shim::protos::protobuf::MessageField;
use containerd_shim::protos::shim_async::Task;
use containerd_shim::protos::topics::*;
use containerd_shim::protos::ttrpc::r#async::TtrpcContext;
use containerd_shim::protos::ttrpc::Result as TtrpcResult;
use containerd_shim::protos::types::task::ProcessInfo;

use crab_api::crabd::PodMember;

use crate::cgroup;
use crate::container::{Container, ProxySetup};
use crate::error::Error;
use crate::process::timestamp;
use crate::service::TaskService;

/// How long State waits for a container a checkpoint holds before the
/// state the checkpoint found answers.
const STATE_WAIT: std::time::Duration = std::time::Duration::from_millis(200);

#[async_trait]
impl Task for TaskService {
    #[tracing::instrument(skip_all, fields(call = "create", sandbox = %req.id))]
    async fn create(&self, _ctx: &TtrpcContext, req: CreateTaskRequest) -> TtrpcResult<CreateTaskResponse> {
        if self
            .containers
            .lock()
            .expect("containers lock")
            .contains_key(&req.id)
        {
            return Err(Error::AlreadyExists {
                kind: "container",
                id: req.id,
            }
            .into());
        }
        let role = crate::pod::role_of(std::path::Path::new(&req.bundle));
        let sandbox = self.pods.claim(&role, &req.id);
        let proxy = ProxySetup {
            namespace: &self.namespace,
            config: &crate::config::get().shim.proxy,
            pods: (sandbox && matches!(role, crate::pod::Role::Member { .. })).then(|| self.pods.clone()),
        };
        if !sandbox {
            tracing::info!(
                "{}: {role:?} of a pod whose sandbox is another container: no proxy, no versions",
                req.id
            );
        }
        let (mut container, rx) = match Container::create(&req, &self.runtime, &proxy, sandbox).await {
            Ok(created) => created,
            Err(e) => {
                self.pods.release(&req.id);
                return Err(e.into());
            }
        };
        if !sandbox && matches!(role, crate::pod::Role::Member { .. }) {
            match container.unversioned_reason() {
                Some(why) => {
                    tracing::warn!("{}: outside its pod's versions: {why}", req.id);
                    self.pods.release(&req.id);
                    container.pod_member = None;
                }
                None => {
                    // What the inspector needs to follow it with the pod.
                    let cgroup = crate::cgroup::cgroup2_dir(&container.cgroups_path);
                    if let (Ok(id), Some(cgroup)) = (crab_api::SandboxId::new(req.id.as_str()), cgroup) {
                        let crab_init = container.init_is_crab_init();
                        self.pods.describe(
                            &req.id,
                            PodMember {
                                id,
                                cgroup,
                                crab_init,
                            },
                        );
                    }
                }
            }
        }
        self.watch_oom(&mut container);
        let pid = container.init.pid;
        self.held
            .lock()
            .expect("held lock")
            .insert(req.id.clone(), container.held.clone());
        let container = Arc::new(tokio::sync::Mutex::new(container));
        self.containers
            .lock()
            .expect("containers lock")
            .insert(req.id.clone(), container.clone());
        if let Some(rx) = rx {
            self.watch_exit(container, String::new(), pid, rx);
        }
        tracing::info!("created {} (pid {pid})", req.id);
        self.events
            .publish(
                TASK_CREATE_EVENT_TOPIC,
                Box::new(TaskCreate {
                    container_id: req.id.clone(),
                    bundle: req.bundle.clone(),
                    rootfs: req.rootfs.clone(),
                    io: MessageField::some(TaskIO {
                        stdin: req.stdin.clone(),
                        stdout: req.stdout.clone(),
                        stderr: req.stderr.clone(),
                        terminal: req.terminal,
                        ..Default::default()
                    }),
                    checkpoint: req.checkpoint.clone(),
                    pid: pid as u32,
                    ..Default::default()
                }),
            )
            .await;
        Ok(CreateTaskResponse {
            pid: pid as u32,
            ..Default::default()
        })
    }

    #[tracing::instrument(skip_all, fields(call = "start", sandbox = %req.id))]
    async fn start(&self, _ctx: &TtrpcContext, req: StartRequest) -> TtrpcResult<StartResponse> {
        let container = self.container(&req.id)?;
        let (pid, rx) = container.lock().await.start(&req.exec_id, &self.runtime).await?;
        let restored = rx.is_some();
        if let Some(rx) = rx {
            // An exec, or an init restored from a checkpoint.
            self.watch_exit(container.clone(), req.exec_id.clone(), pid, rx);
        }
        if !req.exec_id.is_empty() {
            self.events
                .publish(
                    TASK_EXEC_STARTED_EVENT_TOPIC,
                    Box::new(TaskExecStarted {
                        container_id: req.id.clone(),
                        exec_id: req.exec_id.clone(),
                        pid: pid as u32,
                        ..Default::default()
                    }),
                )
                .await;
        } else {
            // A pod's pause container and its sidecars are no sandboxes:
            // no control socket, no registration with crabd.
            if container.lock().await.sandbox {
                self.start_control(container.clone(), &req.id, restored).await;
            }
            self.events
                .publish(
                    TASK_START_EVENT_TOPIC,
                    Box::new(TaskStart {
                        container_id: req.id.clone(),
                        pid: pid as u32,
                        ..Default::default()
                    }),
                )
                .await;
        }
        Ok(StartResponse {
            pid: pid as u32,
            ..Default::default()
        })
    }

    #[tracing::instrument(skip_all, fields(call = "state", sandbox = %req.id))]
    async fn state(&self, _ctx: &TtrpcContext, req: StateRequest) -> TtrpcResult<StateResponse> {
        let container = self.container(&req.id)?;
        // A checkpoint holds the container for its length: past a short
        // wait, the state it found answers (see `crate::held_state`).
        let c = match tokio::time::timeout(STATE_WAIT, container.lock()).await {
            Ok(c) => c,
            Err(_) => {
                let held = self.held.lock().expect("held lock").get(&req.id).cloned();
                match held.and_then(|h| h.answer(&req.exec_id)) {
                    Some(answer) => return Ok(answer),
                    None => container.lock().await,
                }
            }
        };
        let p = c.process(&req.exec_id)?;
        Ok(p.state_response(&c.id, &c.bundle.to_string_lossy()))
    }

    #[tracing::instrument(skip_all, fields(call = "wait", sandbox = %req.id))]
    async fn wait(&self, _ctx: &TtrpcContext, req: WaitRequest) -> TtrpcResult<WaitResponse> {
        let container = self.container(&req.id)?;
        let mut rx = container.lock().await.process(&req.exec_id)?.subscribe();
        // The sender lives in the process, which outlives every waiter that
        // subscribed before it was deleted; a deleted process ends the wait.
        let exit = match rx.wait_for(Option::is_some).await {
            Ok(exit) => *exit,
            Err(_) => None,
        };
        let exit = exit.ok_or_else(|| Error::NotFound {
            kind: "exec",
            id: req.exec_id.clone(),
        })?;
        Ok(WaitResponse {
            exit_status: exit.code,
            exited_at: MessageField::some(timestamp(exit.at)),
            ..Default::default()
        })
    }

    #[tracing::instrument(skip_all, fields(call = "kill", sandbox = %req.id))]
    async fn kill(&self, _ctx: &TtrpcContext, req: KillRequest) -> TtrpcResult<Empty> {
        let container = self.container(&req.id)?;
        container
            .lock()
            .await
            .kill(&req.exec_id, req.signal, req.all)
            .await?;
        Ok(Empty::new())
    }

    #[tracing::instrument(skip_all, fields(call = "delete", sandbox = %req.id))]
    async fn delete(&self, _ctx: &TtrpcContext, req: DeleteRequest) -> TtrpcResult<DeleteResponse> {
        let container = self.container(&req.id)?;
        if req.exec_id.is_empty() {
            let running = matches!(
                container.lock().await.init.state,
                crate::process::ProcessState::Running | crate::process::ProcessState::Paused
            );
            if !running {
                if let Some(control) = self.controls.lock().await.remove(&req.id) {
                    control.stop().await;
                }
            }
        }
        let mut c = container.lock().await;
        let (pid, exit) = if req.exec_id.is_empty() {
            c.delete(&self.runtime).await?;
            self.containers.lock().expect("containers lock").remove(&req.id);
            self.held.lock().expect("held lock").remove(&req.id);
            self.pods.release(&req.id);
            (c.init.pid, c.init.exit())
        } else {
            let p = c.remove_exec(&req.exec_id)?;
            (p.pid, p.exit())
        };
        let exit_status = exit.map_or(0, |e| e.code);
        let exited_at = exit.map_or_else(MessageField::none, |e| MessageField::some(timestamp(e.at)));
        if req.exec_id.is_empty() {
            tracing::info!("deleted {}", req.id);
            self.events
                .publish(
                    TASK_DELETE_EVENT_TOPIC,
                    Box::new(TaskDelete {
                        container_id: req.id.clone(),
                        pid: pid.max(0) as u32,
                        exit_status,
                        exited_at: exited_at.clone(),
                        ..Default::default()
                    }),
                )
                .await;
        }
        Ok(DeleteResponse {
            pid: pid.max(0) as u32,
            exit_status,
            exited_at,
            ..Default::default()
        })
    }

    #[tracing::instrument(skip_all, fields(call = "exec", sandbox = %req.id))]
    async fn exec(&self, _ctx: &TtrpcContext, req: ExecProcessRequest) -> TtrpcResult<Empty> {
        let container = self.container(&req.id)?;
        container.lock().await.add_exec(&req)?;
        self.events
            .publish(
                TASK_EXEC_ADDED_EVENT_TOPIC,
                Box::new(TaskExecAdded {
                    container_id: req.id.clone(),
                    exec_id: req.exec_id.clone(),
                    ..Default::default()
                }),
            )
            .await;
        Ok(Empty::new())
    }

    #[tracing::instrument(skip_all, fields(call = "pids", sandbox = %req.id))]
    async fn pids(&self, _ctx: &TtrpcContext, req: PidsRequest) -> TtrpcResult<PidsResponse> {
        let container = self.container(&req.id)?;
        let (path, id) = {
            let c = container.lock().await;
            (c.cgroups_path.clone(), c.id.clone())
        };
        let pids = cgroup::pids(&path, &id)?;
        Ok(PidsResponse {
            processes: pids
                .into_iter()
                .map(|pid| ProcessInfo {
                    pid,
                    ..Default::default()
                })
                .collect(),
            ..Default::default()
        })
    }

    #[tracing::instrument(skip_all, fields(call = "pause", sandbox = %req.id))]
    async fn pause(&self, _ctx: &TtrpcContext, req: PauseRequest) -> TtrpcResult<Empty> {
        let container = self.container(&req.id)?;
        container.lock().await.freeze(true, &self.runtime).await?;
        self.events
            .publish(
                TASK_PAUSED_EVENT_TOPIC,
                Box::new(TaskPaused {
                    container_id: req.id.clone(),
                    ..Default::default()
                }),
            )
            .await;
        Ok(Empty::new())
    }

    #[tracing::instrument(skip_all, fields(call = "resume", sandbox = %req.id))]
    async fn resume(&self, _ctx: &TtrpcContext, req: ResumeRequest) -> TtrpcResult<Empty> {
        let container = self.container(&req.id)?;
        container.lock().await.freeze(false, &self.runtime).await?;
        self.events
            .publish(
                TASK_RESUMED_EVENT_TOPIC,
                Box::new(TaskResumed {
                    container_id: req.id.clone(),
                    ..Default::default()
                }),
            )
            .await;
        Ok(Empty::new())
    }

    #[tracing::instrument(skip_all, fields(call = "close_io", sandbox = %req.id))]
    async fn close_io(&self, _ctx: &TtrpcContext, req: CloseIORequest) -> TtrpcResult<Empty> {
        let container = self.container(&req.id)?;
        let mut c = container.lock().await;
        if let Some(io) = c.process_mut(&req.exec_id)?.io.as_mut() {
            io.finish_stdin();
        }
        Ok(Empty::new())
    }

    #[tracing::instrument(skip_all, fields(call = "resize_pty", sandbox = %req.id))]
    async fn resize_pty(&self, _ctx: &TtrpcContext, req: ResizePtyRequest) -> TtrpcResult<Empty> {
        let container = self.container(&req.id)?;
        let c = container.lock().await;
        if let Some(io) = c.process(&req.exec_id)?.io.as_ref() {
            io.resize(req.width, req.height)?;
        }
        Ok(Empty::new())
    }

    #[tracing::instrument(skip_all, fields(call = "update", sandbox = %req.id))]
    async fn update(&self, _ctx: &TtrpcContext, req: UpdateTaskRequest) -> TtrpcResult<Empty> {
        let container = self.container(&req.id)?;
        let resources: oci_spec::runtime::LinuxResources = serde_json::from_slice(&req.resources.value)
            .map_err(|e| Error::InvalidResources {
                reason: e.to_string(),
            })?;
        let (path, id) = {
            let c = container.lock().await;
            (c.cgroups_path.clone(), c.id.clone())
        };
        tokio::task::spawn_blocking(move || cgroup::update(&path, &id, &resources))
            .await
            .map_err(|e| Error::io("update")(std::io::Error::other(e)))??;
        Ok(Empty::new())
    }

    #[tracing::instrument(skip_all, fields(call = "stats", sandbox = %req.id))]
    async fn stats(&self, _ctx: &TtrpcContext, req: StatsRequest) -> TtrpcResult<StatsResponse> {
        let container = self.container(&req.id)?;
        let (path, id) = {
            let c = container.lock().await;
            (c.cgroups_path.clone(), c.id.clone())
        };
        let stats = tokio::task::spawn_blocking(move || cgroup::metrics(&path, &id))
            .await
            .map_err(|e| Error::io("stats")(std::io::Error::other(e)))??;
        Ok(StatsResponse {
            stats: MessageField::some(stats),
            ..Default::default()
        })
    }

    #[tracing::instrument(skip_all, fields(call = "connect", sandbox = %req.id))]
    async fn connect(&self, _ctx: &TtrpcContext, req: ConnectRequest) -> TtrpcResult<ConnectResponse> {
        let task_pid = match self.container(&req.id) {
            Ok(c) => c.lock().await.init.pid.max(0) as u32,
            Err(_) => 0,
        };
        Ok(ConnectResponse {
            shim_pid: std::process::id(),
            task_pid,
            version: env!("CARGO_PKG_VERSION").to_owned(),
            ..Default::default()
        })
    }

    #[tracing::instrument(skip_all, fields(call = "shutdown"))]
    async fn shutdown(&self, _ctx: &TtrpcContext, _req: ShutdownRequest) -> TtrpcResult<Empty> {
        if self.containers.lock().expect("containers lock").is_empty() {
            self.exit.signal();
        }
        Ok(Empty::new())
    }

    #[tracing::instrument(skip_all, fields(call = "checkpoint", sandbox = %req.id))]
    async fn checkpoint(&self, _ctx: &TtrpcContext, req: CheckpointTaskRequest) -> TtrpcResult<Empty> {
        let container = self.container(&req.id)?;
        let c = container.lock().await;
        c.checkpoint(&req, &self.runtime).await?;
        Ok(Empty::new())
    }
}
