//! What crabd asks of containerd: a new container and task shaped like an
//! existing one, whose init is restored from a checkpoint (a fork), a new
//! task of a container whose task died, restored the same way (a resume),
//! and the cleanup when that fails.

use std::path::{Path, PathBuf};

use containerd_client::services::v1::container::Runtime;
use containerd_client::services::v1::snapshots::{
    MountsRequest, PrepareSnapshotRequest, RemoveSnapshotRequest, StatSnapshotRequest,
};
use containerd_client::services::v1::{
    Container, CreateContainerRequest, CreateTaskRequest, DeleteContainerRequest, DeleteTaskRequest,
    GetContainerRequest, GetRequest, StartRequest, UpdateContainerRequest,
};
use containerd_client::tonic::{Request, Status};
use containerd_client::types::v1::Status as TaskStatus;
use containerd_client::types::Mount;
use containerd_client::{with_namespace, Client};

use serde::{Deserialize, Serialize};

use crab_api::shim::{ConversationAt, CONVERSATION_ANNOTATION, RESTORE_ANNOTATION, RESTORE_TOKEN_ANNOTATION};

/// What talking to containerd can fail with.
#[derive(Debug, thiserror::Error)]
pub enum ContainerdError {
    /// containerd does not answer on its socket.
    #[error("connect to containerd at {}", address.display())]
    Connect {
        /// Its socket.
        address: PathBuf,
        /// Why.
        #[source]
        source: containerd_client::tonic::transport::Error,
    },
    /// A call was refused.
    #[error("containerd {call}: {}", status.message())]
    Call {
        /// Which call.
        call: &'static str,
        /// containerd's answer.
        status: Status,
    },
    /// The source container cannot be copied.
    #[error("container {id} cannot be forked: {reason}")]
    Unforkable {
        /// The container.
        id: String,
        /// Why.
        reason: String,
    },
}

/// A client of one containerd namespace.
pub struct Containerd {
    client: Client,
    address: PathBuf,
    namespace: String,
}

/// What is copied of a container to make another like it (a fork, or an
/// import on another host); it travels in export archives.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ContainerTemplate {
    /// The container it was taken from.
    pub id: String,
    /// Its image reference.
    pub image: String,
    /// Its runtime's name.
    pub runtime: String,
    /// The snapshotter holding its layers.
    pub snapshotter: String,
    /// The parent of its writable layer (the image's top layer, by chain id,
    /// the same on every containerd that unpacked the image).
    pub parent: String,
    /// Its OCI runtime spec.
    pub spec: serde_json::Value,
    /// Its labels.
    pub labels: std::collections::BTreeMap<String, String>,
}

/// The type URL containerd stores OCI specs under.
const SPEC_TYPE_URL: &str = "types.containerd.io/opencontainers/runtime-spec/1/Spec";

/// What a container's shim restores its init from at Start.
#[derive(Debug, Clone, Copy)]
pub struct Restore<'a> {
    /// The process image.
    pub images: &'a Path,
    /// Where the restored version stands in the sandbox's conversation.
    pub conversation: Option<&'a ConversationAt>,
    /// The token of crabd's grant of this restore.
    pub token: &'a str,
}

/// The label a fork's or import's container and snapshot carry: the
/// making that made them (see crabd's `making`).
pub const MAKING_LABEL: &str = "io.crab.making";

/// What settling a making cut short did with its container.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Settled {
    /// Its task runs (or ran): kept.
    Kept,
    /// Whatever of it was made is gone.
    Removed,
    /// A container or snapshot of that id is someone else's: untouched.
    NotOurs,
}

/// A container made for a fork: its id and its writable layer.
#[derive(Debug)]
pub struct NewContainer {
    /// Its id.
    pub id: String,
    /// The snapshotter that holds its rootfs.
    pub snapshotter: String,
    /// Its rootfs mounts.
    pub mounts: Vec<Mount>,
    /// The upper directory of its overlay rootfs.
    pub upper: PathBuf,
}

// === impl Containerd ===

impl Containerd {
    /// Connects to containerd at `address`, for `namespace`.
    pub async fn connect(address: &Path, namespace: &str) -> Result<Self, ContainerdError> {
        let client = Client::from_path(address)
            .await
            .map_err(|source| ContainerdError::Connect {
                address: address.to_owned(),
                source,
            })?;
        Ok(Containerd {
            client,
            address: address.to_owned(),
            namespace: namespace.to_owned(),
        })
    }

    /// When containerd created container `id` (seconds.nanos since the
    /// epoch; empty if its record has no time), or `None` if it has no
    /// such container.
    pub async fn created_at(&self, id: &str) -> Result<Option<String>, ContainerdError> {
        let got = self
            .client
            .containers()
            .get(with_namespace!(
                GetContainerRequest { id: id.to_owned() },
                self.namespace.as_str()
            ))
            .await;
        match got {
            Ok(r) => Ok(r.into_inner().container.map(|c| {
                c.created_at
                    .map(|t| format!("{}.{:09}", t.seconds, t.nanos))
                    .unwrap_or_default()
            })),
            Err(status) if status.code() == containerd_client::tonic::Code::NotFound => Ok(None),
            Err(status) => Err(ContainerdError::Call {
                call: "get container",
                status,
            }),
        }
    }

    /// What a copy of container `source` needs: image, runtime, spec,
    /// snapshotter and the parent of its writable layer.
    pub async fn template(&self, source: &str) -> Result<ContainerTemplate, ContainerdError> {
        let ns = self.namespace.as_str();
        let call = |call| move |status| ContainerdError::Call { call, status };
        let src = self
            .client
            .containers()
            .get(with_namespace!(
                GetContainerRequest {
                    id: source.to_owned()
                },
                ns
            ))
            .await
            .map_err(call("get container"))?
            .into_inner()
            .container
            .ok_or_else(|| unforkable(source, "containerd has no record of it"))?;
        if src.snapshot_key.is_empty() {
            return Err(unforkable(
                source,
                "its rootfs is not a containerd snapshot (docker's graphdriver made it)",
            ));
        }
        let info = self
            .client
            .snapshots()
            .stat(with_namespace!(
                StatSnapshotRequest {
                    snapshotter: src.snapshotter.clone(),
                    key: src.snapshot_key.clone(),
                },
                ns
            ))
            .await
            .map_err(call("stat snapshot"))?
            .into_inner()
            .info
            .ok_or_else(|| unforkable(source, "its snapshot has no record"))?;
        let any = src.spec.ok_or_else(|| unforkable(source, "it has no spec"))?;
        let spec = serde_json::from_slice(&any.value)
            .map_err(|e| unforkable(source, &format!("its spec is not JSON: {e}")))?;
        Ok(ContainerTemplate {
            id: source.to_owned(),
            image: src.image,
            runtime: src.runtime.map(|r| r.name).unwrap_or_default(),
            snapshotter: src.snapshotter,
            parent: info.parent,
            spec,
            labels: src.labels.into_iter().collect(),
        })
    }

    /// Creates container `new_id` from `t` on a fresh writable layer of the
    /// same parent, with the spec annotated for `restore`.
    /// Both carry label [`MAKING_LABEL`] = `making`, so a crabd settling a
    /// making cut short removes only what this making made.
    pub async fn create_from(
        &self,
        t: &ContainerTemplate,
        new_id: &str,
        restore: &Restore<'_>,
        making: &str,
    ) -> Result<NewContainer, ContainerdError> {
        let ns = self.namespace.as_str();
        let spec = fork_spec(t, new_id, restore)?;
        let ours: std::collections::HashMap<String, String> =
            [(MAKING_LABEL.to_owned(), making.to_owned())].into();
        let mounts = self
            .client
            .snapshots()
            .prepare(with_namespace!(
                PrepareSnapshotRequest {
                    snapshotter: t.snapshotter.clone(),
                    key: new_id.to_owned(),
                    parent: t.parent.clone(),
                    labels: ours.clone(),
                },
                ns
            ))
            .await
            .map_err(|status| ContainerdError::Call {
                call: "prepare snapshot",
                status,
            })?
            .into_inner()
            .mounts;
        let Some(upper) = overlay_upper(&mounts) else {
            self.remove_snapshot(&t.snapshotter, new_id).await;
            return Err(unforkable(
                &t.id,
                "its rootfs is not an overlay (only overlayfs snapshotters are supported)",
            ));
        };
        let made = NewContainer {
            id: new_id.to_owned(),
            snapshotter: t.snapshotter.clone(),
            upper,
            mounts,
        };
        let mut labels: std::collections::HashMap<String, String> = t.labels.clone().into_iter().collect();
        labels.insert("io.crab.forked-from".to_owned(), t.id.clone());
        labels.extend(ours);
        let container = Container {
            id: new_id.to_owned(),
            labels,
            image: t.image.clone(),
            runtime: Some(Runtime {
                name: t.runtime.clone(),
                options: None,
            }),
            spec: Some(spec),
            snapshotter: t.snapshotter.clone(),
            snapshot_key: new_id.to_owned(),
            ..Default::default()
        };
        if let Err(status) = self
            .client
            .containers()
            .create(with_namespace!(
                CreateContainerRequest {
                    container: Some(container)
                },
                ns
            ))
            .await
        {
            self.remove_snapshot(&t.snapshotter, new_id).await;
            return Err(ContainerdError::Call {
                call: "create container",
                status,
            });
        }
        Ok(made)
    }

    /// Container `id` as it is after its task died (the host or its shim
    /// went): its dead task deleted, its writable layer's mounts found.
    /// Refused while its task runs.
    pub async fn resumable(&self, id: &str) -> Result<NewContainer, ContainerdError> {
        let ns = self.namespace.as_str();
        let call = |call| move |status| ContainerdError::Call { call, status };
        let container = self.container(id).await?;
        if container.snapshot_key.is_empty() {
            return Err(unforkable(id, "its rootfs is not a containerd snapshot"));
        }
        let mounts = self
            .client
            .snapshots()
            .mounts(with_namespace!(
                MountsRequest {
                    snapshotter: container.snapshotter.clone(),
                    key: container.snapshot_key.clone(),
                },
                ns
            ))
            .await
            .map_err(call("snapshot mounts"))?
            .into_inner()
            .mounts;
        let upper = overlay_upper(&mounts).ok_or_else(|| {
            unforkable(
                id,
                "its rootfs is not an overlay (only overlayfs snapshotters are supported)",
            )
        })?;
        // Only a container this can resume loses its dead task.
        if let Some(status) = self.task_status(id).await? {
            if status == TaskStatus::Running as i32 || status == TaskStatus::Paused as i32 {
                return Err(unforkable(id, "its task runs: roll it back instead"));
            }
            self.delete_task(id).await?;
        }
        Ok(NewContainer {
            id: id.to_owned(),
            snapshotter: container.snapshotter,
            mounts,
            upper,
        })
    }

    /// The namespace it works in.
    pub fn namespace(&self) -> &str {
        &self.namespace
    }

    /// containerd's socket.
    pub fn address(&self) -> &Path {
        &self.address
    }

    /// Deletes container `id`'s task (which must not run).
    async fn delete_task(&self, id: &str) -> Result<(), ContainerdError> {
        self.client
            .tasks()
            .delete(with_namespace!(
                DeleteTaskRequest {
                    container_id: id.to_owned()
                },
                self.namespace.as_str()
            ))
            .await
            .map(drop)
            .map_err(|status| ContainerdError::Call {
                call: "delete the task",
                status,
            })
    }

    /// The status of container `id`'s task (`None`: it has none).
    async fn task_status(&self, id: &str) -> Result<Option<i32>, ContainerdError> {
        let got = self
            .client
            .tasks()
            .get(with_namespace!(
                GetRequest {
                    container_id: id.to_owned(),
                    ..Default::default()
                },
                self.namespace.as_str()
            ))
            .await;
        match got {
            Ok(t) => Ok(Some(t.into_inner().process.map_or(0, |p| p.status))),
            Err(status) if status.code() == containerd_client::tonic::Code::NotFound => Ok(None),
            Err(status) => Err(ContainerdError::Call {
                call: "get task",
                status,
            }),
        }
    }

    /// Settles container `id`, whose making `making` was cut short, and
    /// answers what became of it. Only what carries that making's label
    /// is touched: a container or snapshot of that id made by anyone else
    /// is [`Settled::NotOurs`]. A task still being started (created, its
    /// restore under way in the shim) is waited for, up to `patience`. A
    /// task that runs or is paused, or any task at all when `ran` (crabd
    /// knows the sandbox: its shim registered it), is kept with its
    /// restore annotations removed; otherwise task, container and
    /// snapshot are removed, each removal checked.
    pub async fn settle_made(
        &self,
        id: &str,
        making: &str,
        snapshotter: &str,
        ran: bool,
        patience: std::time::Duration,
    ) -> Result<Settled, ContainerdError> {
        let ns = self.namespace.as_str();
        let call = |call| move |status| ContainerdError::Call { call, status };
        let ours = |labels: &std::collections::HashMap<String, String>| {
            labels.get(MAKING_LABEL).map(String::as_str) == Some(making)
        };
        let container = match self.container(id).await {
            Ok(c) => Some(c),
            Err(ContainerdError::Call { status, .. })
                if status.code() == containerd_client::tonic::Code::NotFound =>
            {
                None
            }
            Err(ContainerdError::Unforkable { .. }) => None,
            Err(e) => return Err(e),
        };
        let Some(container) = container else {
            // Cut before the container: a prepared snapshot may be left.
            let stat = self
                .client
                .snapshots()
                .stat(with_namespace!(
                    StatSnapshotRequest {
                        snapshotter: snapshotter.to_owned(),
                        key: id.to_owned(),
                    },
                    ns
                ))
                .await;
            return match stat {
                Ok(info) if info.get_ref().info.as_ref().is_some_and(|i| ours(&i.labels)) => {
                    self.remove_snapshot_checked(snapshotter, id).await?;
                    Ok(Settled::Removed)
                }
                Ok(_) => Ok(Settled::NotOurs),
                Err(status) if status.code() == containerd_client::tonic::Code::NotFound => {
                    Ok(Settled::Removed)
                }
                Err(status) => Err(call("stat snapshot")(status)),
            };
        };
        if !ours(&container.labels) {
            return Ok(Settled::NotOurs);
        }
        let running = |s: i32| s == TaskStatus::Running as i32 || s == TaskStatus::Paused as i32;
        let deadline = std::time::Instant::now() + patience;
        let mut status = self.task_status(id).await?;
        // Created (or unknown): the shim may still be restoring it.
        let starting = |s: &i32| {
            *s == TaskStatus::Created as i32
                || *s == TaskStatus::Unknown as i32
                || *s == TaskStatus::Pausing as i32
        };
        while status.as_ref().is_some_and(starting) {
            if std::time::Instant::now() > deadline {
                break;
            }
            tokio::time::sleep(std::time::Duration::from_millis(200)).await;
            status = self.task_status(id).await?;
        }
        if status.is_some_and(running) || (ran && status.is_some()) {
            self.set_restore(id, None).await?;
            return Ok(Settled::Kept);
        }
        if status.is_some() {
            self.delete_task(id).await?;
        }
        self.client
            .containers()
            .delete(with_namespace!(DeleteContainerRequest { id: id.to_owned() }, ns))
            .await
            .map_err(call("delete the container"))?;
        self.remove_snapshot_checked(&container.snapshotter, &container.snapshot_key)
            .await?;
        Ok(Settled::Removed)
    }

    /// Removes snapshot `key` (gone already is removed).
    async fn remove_snapshot_checked(&self, snapshotter: &str, key: &str) -> Result<(), ContainerdError> {
        let removed = self
            .client
            .snapshots()
            .remove(with_namespace!(
                RemoveSnapshotRequest {
                    snapshotter: snapshotter.to_owned(),
                    key: key.to_owned(),
                },
                self.namespace.as_str()
            ))
            .await;
        match removed {
            Ok(_) => Ok(()),
            Err(status) if status.code() == containerd_client::tonic::Code::NotFound => Ok(()),
            Err(status) => Err(ContainerdError::Call {
                call: "remove snapshot",
                status,
            }),
        }
    }

    /// Sets (or, with `None`, removes) the annotations with which the shim
    /// restores container `id`'s init at Start (see [`Restore`]).
    pub async fn set_restore(&self, id: &str, restore: Option<&Restore<'_>>) -> Result<(), ContainerdError> {
        let ns = self.namespace.as_str();
        let mut container = self.container(id).await?;
        let any = container
            .spec
            .as_mut()
            .ok_or_else(|| unforkable(id, "it has no spec"))?;
        let mut spec: serde_json::Value = serde_json::from_slice(&any.value)
            .map_err(|e| unforkable(id, &format!("its spec is not JSON: {e}")))?;
        let annotations = spec
            .as_object_mut()
            .ok_or_else(|| unforkable(id, "its spec is not an object"))?
            .entry("annotations")
            .or_insert_with(|| serde_json::json!({}));
        let Some(annotations) = annotations.as_object_mut() else {
            return Err(unforkable(id, "its spec's annotations are not an object"));
        };
        annotate(annotations, restore);
        any.value = serde_json::to_vec(&spec).expect("a spec always serializes");
        self.client
            .containers()
            .update(with_namespace!(
                UpdateContainerRequest {
                    container: Some(container),
                    update_mask: Some(prost_types::FieldMask {
                        paths: vec!["spec".to_owned()],
                    }),
                },
                ns
            ))
            .await
            .map_err(|status| ContainerdError::Call {
                call: "update container",
                status,
            })?;
        Ok(())
    }

    async fn container(&self, id: &str) -> Result<Container, ContainerdError> {
        self.client
            .containers()
            .get(with_namespace!(
                GetContainerRequest { id: id.to_owned() },
                self.namespace.as_str()
            ))
            .await
            .map_err(|status| ContainerdError::Call {
                call: "get container",
                status,
            })?
            .into_inner()
            .container
            .ok_or_else(|| unforkable(id, "containerd has no record of it"))
    }

    /// Creates and starts the task of `c` (no stdio, like `ctr run -d`);
    /// returns the init's pid.
    pub async fn start(&self, c: &NewContainer) -> Result<u32, ContainerdError> {
        let ns = self.namespace.as_str();
        let call = |call| move |status| ContainerdError::Call { call, status };
        let deadline = tokio::time::Instant::now() + DEAD_SHIM_PATIENCE;
        let mut waited = false;
        loop {
            let created = self
                .client
                .tasks()
                .create(with_namespace!(
                    CreateTaskRequest {
                        container_id: c.id.clone(),
                        rootfs: c.mounts.clone(),
                        ..Default::default()
                    },
                    ns
                ))
                .await;
            let status = match created {
                Ok(_) => break,
                Err(status) => status,
            };
            // The task of a shim that died stays listed until containerd
            // has run `shim delete` for it (containerd 1.6 drops it from
            // its list only after that), while asking it for its state
            // already answers NotFound: wait for it to go. A task that
            // answers is a real conflict, and so is anything past the
            // deadline.
            let dead_shims = status.code() == containerd_client::tonic::Code::AlreadyExists
                && tokio::time::Instant::now() < deadline
                && matches!(self.task_status(&c.id).await, Ok(None));
            if !dead_shims {
                return Err(call("create task")(status));
            }
            if !waited {
                tracing::info!(id = %c.id, "waiting for containerd to drop the task of a dead shim");
                waited = true;
            }
            tokio::time::sleep(std::time::Duration::from_millis(50)).await;
        }
        let pid = self
            .client
            .tasks()
            .start(with_namespace!(
                StartRequest {
                    container_id: c.id.clone(),
                    ..Default::default()
                },
                ns
            ))
            .await
            .map_err(call("start task"))?
            .into_inner()
            .pid;
        Ok(pid)
    }

    /// Best-effort removal of what [`Containerd::create_like`] and
    /// [`Containerd::start`] made.
    pub async fn remove(&self, c: &NewContainer) {
        let ns = self.namespace.as_str();
        let _ = self
            .client
            .tasks()
            .delete(with_namespace!(
                DeleteTaskRequest {
                    container_id: c.id.clone()
                },
                ns
            ))
            .await;
        let _ = self
            .client
            .containers()
            .delete(with_namespace!(DeleteContainerRequest { id: c.id.clone() }, ns))
            .await;
        self.remove_snapshot(&c.snapshotter, &c.id).await;
    }

    async fn remove_snapshot(&self, snapshotter: &str, key: &str) {
        let _ = self.remove_snapshot_checked(snapshotter, key).await;
    }
}

/// How long [`Containerd::start`] waits for containerd to drop the task of
/// a shim that died (it runs `shim delete` first, which unmounts and
/// cleans the bundle).
const DEAD_SHIM_PATIENCE: std::time::Duration = std::time::Duration::from_secs(30);

fn unforkable(id: &str, reason: &str) -> ContainerdError {
    ContainerdError::Unforkable {
        id: id.to_owned(),
        reason: reason.to_owned(),
    }
}

/// The upper directory of an overlay rootfs.
fn overlay_upper(mounts: &[Mount]) -> Option<PathBuf> {
    match mounts {
        [m] if m.r#type == "overlay" => m
            .options
            .iter()
            .find_map(|o| o.strip_prefix("upperdir="))
            .map(PathBuf::from),
        _ => None,
    }
}

/// Sets `annotations` for `restore`, or removes its annotations.
fn annotate(annotations: &mut serde_json::Map<String, serde_json::Value>, restore: Option<&Restore<'_>>) {
    for key in [
        RESTORE_ANNOTATION,
        CONVERSATION_ANNOTATION,
        RESTORE_TOKEN_ANNOTATION,
    ] {
        annotations.remove(key);
    }
    let Some(r) = restore else { return };
    annotations.insert(RESTORE_ANNOTATION.into(), r.images.to_string_lossy().into());
    annotations.insert(RESTORE_TOKEN_ANNOTATION.into(), r.token.into());
    if let Some(at) = r.conversation {
        let at = serde_json::to_string(at).expect("a position always serializes");
        annotations.insert(CONVERSATION_ANNOTATION.into(), at.into());
    }
}

/// The template's spec for a new container: its own cgroup, and the
/// restore annotations.
fn fork_spec(
    t: &ContainerTemplate,
    new_id: &str,
    restore: &Restore<'_>,
) -> Result<prost_types::Any, ContainerdError> {
    let source = t.id.as_str();
    let mut spec = t.spec.clone();
    let linux = spec
        .get_mut("linux")
        .and_then(|l| l.as_object_mut())
        .ok_or_else(|| unforkable(source, "its spec has no linux section"))?;
    if let Some(path) = linux.get("cgroupsPath").and_then(|p| p.as_str()) {
        if !path.contains(source) {
            return Err(unforkable(
                source,
                &format!("its cgroups path {path} does not name it"),
            ));
        }
        let renamed = path.replace(source, new_id);
        linux.insert("cgroupsPath".to_owned(), renamed.into());
    }
    let joined_netns = linux
        .get("namespaces")
        .and_then(|n| n.as_array())
        .is_some_and(|ns| {
            ns.iter()
                .any(|n| n["type"] == "network" && n.get("path").is_some())
        });
    if joined_netns {
        return Err(unforkable(
            source,
            "it joins a network namespace by path (a docker container's, a Kubernetes pod's): the copy would share it",
        ));
    }
    let obj = spec
        .as_object_mut()
        .ok_or_else(|| unforkable(source, "its spec is not an object"))?;
    let annotations = obj
        .entry("annotations")
        .or_insert_with(|| serde_json::json!({}))
        .as_object_mut()
        .ok_or_else(|| unforkable(source, "its annotations are not an object"))?;
    annotate(annotations, Some(restore));
    Ok(prost_types::Any {
        type_url: SPEC_TYPE_URL.to_owned(),
        value: serde_json::to_vec(&spec).expect("a JSON value serializes"),
    })
}
