//! [`Crabd`], the typed client of crabd's management API: one method per
//! route of [`crate::routes`], each taking and answering the route's
//! messages.

use std::path::Path;
use std::time::Duration;

use super::{ClientError, UnixClient};
use crate::crabd::{
    CheckpointReport, CheckpointRequest, Crash, DrainReport, DrainRequest, Event, ForkReport, ForkRequest,
    ForksReport, ForksRequest, HostKeys, ImportQuery, ImportReport, Recovery, Registration, RemovalReport,
    ResumeReport, ResumeRequest, RollbackReport, RollbackRequest, SandboxInfo, TurnAnswered, TurnEnd,
    TurnHeld, TurnReport, UiUrl, VersionView,
};
use crate::{routes, Class, SandboxId, SandboxSelector, VersionSel};

/// A client of crabd at one socket.
#[derive(Debug, Clone)]
pub struct Crabd {
    http: UnixClient,
}

/// Sees bytes moved so far and the total when known.
pub type Progress<'a> = &'a (dyn Fn(u64, Option<u64>) + Sync);

// === impl Crabd ===

impl Crabd {
    /// A client of crabd at `socket`, each call limited to `timeout`
    /// (a watch has no limit).
    pub fn new(socket: impl AsRef<Path>, timeout: Duration) -> Self {
        Crabd {
            http: UnixClient::new(socket, "crabd", timeout),
        }
    }

    /// The socket.
    pub fn socket(&self) -> &Path {
        self.http.socket()
    }

    /// Every sandbox crabd knows.
    pub async fn list(&self) -> Result<Vec<SandboxInfo>, ClientError> {
        self.http.get(routes::SANDBOXES).await
    }

    /// The sandbox `sel` names.
    pub async fn show(&self, sel: &SandboxSelector) -> Result<SandboxInfo, ClientError> {
        self.http.get(&routes::sandbox(sel)).await
    }

    /// A shim registers its running sandbox.
    pub async fn register(&self, reg: &Registration) -> Result<SandboxInfo, ClientError> {
        self.http.post(routes::SANDBOXES, reg).await
    }

    /// A shim says its sandbox's task is gone (its versions stay).
    pub async fn unregister(&self, id: &SandboxId) -> Result<(), ClientError> {
        self.http
            .delete::<serde_json::Value>(&routes::sandbox(id))
            .await
            .map(drop)
    }

    /// Checkpoints sandbox `sel` now as `class` (`fs` or `full`).
    pub async fn checkpoint(
        &self,
        sel: &SandboxSelector,
        class: Class,
    ) -> Result<CheckpointReport, ClientError> {
        self.http
            .post(&routes::checkpoint(sel), &CheckpointRequest { class })
            .await
    }

    /// A turn of sandbox `id` ended: answers once its version is published.
    pub async fn turn_ended(&self, id: &SandboxId, end: &TurnEnd) -> Result<CheckpointReport, ClientError> {
        self.http.post(&routes::turns(id), end).await
    }

    /// Turn `turn` of sandbox `id` (exact) has its LLM answer waiting on
    /// its version: a checkpoint still queued goes first.
    pub async fn turn_answered(&self, id: &SandboxId, turn: u64) -> Result<TurnAnswered, ClientError> {
        self.http.post(&routes::answered(id, turn), &()).await
    }

    /// Turn `turn` of sandbox `id` had its answer held `held_ms` for its
    /// version.
    pub async fn turn_held(&self, id: &SandboxId, turn: u64, held_ms: f64) -> Result<(), ClientError> {
        let _: serde_json::Value = self
            .http
            .post(&routes::held(id, turn), &TurnHeld { held_ms })
            .await?;
        Ok(())
    }

    /// crabd's metrics, in the Prometheus text format.
    pub async fn metrics(&self) -> Result<String, ClientError> {
        self.http.get_text(routes::METRICS).await
    }

    /// Sandbox `sel`'s versions, one per manifest line.
    pub async fn versions(&self, sel: &SandboxSelector) -> Result<Vec<VersionView>, ClientError> {
        self.http.get(&routes::versions(sel)).await
    }

    /// Rolls sandbox `sel` back.
    pub async fn rollback(
        &self,
        sel: &SandboxSelector,
        req: &RollbackRequest,
    ) -> Result<RollbackReport, ClientError> {
        self.http.post(&routes::rollback(sel), req).await
    }

    /// Sandbox `id`'s init died without containerd asking: crabd restores
    /// its head version into it; answers what it restored.
    pub async fn recover(&self, id: &SandboxId, crash: &Crash) -> Result<Recovery, ClientError> {
        self.http.post(&routes::recover(id), crash).await
    }

    /// Removes version `n` of sandbox `sel` (and what only it used).
    pub async fn remove_version(&self, sel: &SandboxSelector, n: u64) -> Result<RemovalReport, ClientError> {
        self.http.delete(&routes::version(sel, n)).await
    }

    /// Starts a new sandbox from a version of sandbox `sel`.
    pub async fn fork(&self, sel: &SandboxSelector, req: &ForkRequest) -> Result<ForkReport, ClientError> {
        self.http.post(&routes::fork(sel), req).await
    }

    /// Starts `req.count` new sandboxes from one version of sandbox `sel`.
    pub async fn forks(&self, sel: &SandboxSelector, req: &ForksRequest) -> Result<ForksReport, ClientError> {
        self.http.post(&routes::forks(sel), req).await
    }

    /// Starts sandbox `sel`, whose task died, again from a version.
    pub async fn resume(
        &self,
        sel: &SandboxSelector,
        req: &ResumeRequest,
    ) -> Result<ResumeReport, ClientError> {
        self.http.post(&routes::resume(sel), req).await
    }

    /// Makes every running sandbox durable (and exported) within a grace.
    pub async fn drain(&self, req: &DrainRequest) -> Result<DrainReport, ClientError> {
        self.http.post(routes::DRAIN, req).await
    }

    /// The key this host signs its exports with, and those it trusts.
    pub async fn keys(&self) -> Result<HostKeys, ClientError> {
        self.http.get(routes::KEYS).await
    }

    /// Ends sandbox `sel`'s current inspector turn by hand.
    pub async fn turn(&self, sel: &SandboxSelector) -> Result<TurnReport, ClientError> {
        self.http.post(&routes::turn(sel), &()).await
    }

    /// Hands each line of sandbox `sel`'s watch to `on_line` as its turns
    /// end, as crabd sent it and, when it is one, as a turn report (crabd
    /// also says how many reports a slow watcher missed), until crabd ends
    /// the stream or `on_line` returns false.
    pub async fn watch(
        &self,
        sel: &SandboxSelector,
        mut on_line: impl FnMut(&str, Option<TurnReport>) -> bool,
    ) -> Result<(), ClientError> {
        self.http
            .lines(&routes::watch(sel), |line| {
                on_line(line, serde_json::from_str::<TurnReport>(line).ok())
            })
            .await
    }

    /// Hands sandbox `sel`'s newest `tail` events to `on_event`, oldest
    /// first, then (`follow`) each as it happens, until crabd ends the
    /// stream or `on_event` returns false. A line that is no event (crabd
    /// says how many a slow reader missed) comes as `Err(line)`.
    pub async fn events(
        &self,
        sel: &SandboxSelector,
        tail: usize,
        follow: bool,
        mut on_event: impl FnMut(Result<Event, &str>) -> bool,
    ) -> Result<(), ClientError> {
        self.http
            .lines(&routes::events(sel, tail, follow), |line| {
                on_event(serde_json::from_str::<Event>(line).map_err(|_| line))
            })
            .await
    }

    /// The URL of crabd's page, its secret included.
    pub async fn ui(&self) -> Result<UiUrl, ClientError> {
        self.http.get(routes::UI).await
    }

    /// Writes version `version` of sandbox `sel` as an archive to `dst`;
    /// answers its size.
    pub async fn export(
        &self,
        sel: &SandboxSelector,
        version: VersionSel,
        dst: &Path,
        progress: Progress<'_>,
    ) -> Result<u64, ClientError> {
        self.http
            .download(&routes::export(sel, version), dst, progress)
            .await
    }

    /// Starts a new sandbox from the archive `src`.
    pub async fn import(
        &self,
        src: &Path,
        query: &ImportQuery,
        progress: Progress<'_>,
    ) -> Result<ImportReport, ClientError> {
        let mut params = Vec::new();
        if let Some(n) = &query.name {
            params.push(format!("name={n}"));
        }
        if let Some(n) = &query.namespace {
            params.push(format!("namespace={}", escape(n)));
        }
        if let Some(c) = &query.containerd {
            params.push(format!("containerd={}", escape(&c.to_string_lossy())));
        }
        if query.allow_privileged_files {
            params.push("allow_privileged_files=true".to_owned());
        }
        if query.insecure_unsigned {
            params.push("insecure_unsigned=true".to_owned());
        }
        let path = match params.is_empty() {
            true => routes::IMPORT.to_owned(),
            false => format!("{}?{}", routes::IMPORT, params.join("&")),
        };
        self.http.upload(&path, src, progress).await
    }
}

/// `s` percent-encoded for a URL query value.
fn escape(s: &str) -> String {
    s.bytes()
        .map(|b| match b {
            b'A'..=b'Z' | b'a'..=b'z' | b'0'..=b'9' | b'-' | b'_' | b'.' => (b as char).to_string(),
            _ => format!("%{b:02X}"),
        })
        .collect()
}
