//! Turn classes from the inspector: crabd registers each sandbox's cgroup
//! with it, asks it at each turn end what changed, and tells watchers.
//!
//! [`TurnInspector`] is what crabd needs of an inspector; the eBPF one
//! (crate `crab-inspector`) implements it. Without one, every turn is
//! `full`, the class that never loses work, and says so.

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use axum::body::Body;
use axum::response::{IntoResponse, Response};
use crab_api::config::CrabdConfig;
use crab_api::crabd::{PodMember, TurnReport, WatchStarted};
use crab_api::{Class, SandboxId, SandboxSelector};
use futures_util::StreamExt;
use tokio::sync::broadcast;

use super::{ApiError, Daemon};

/// Why an inspector could not follow a sandbox or end its turn.
pub type InspectorError = Box<dyn std::error::Error + Send + Sync>;

/// What crabd asks of an inspector.
pub trait TurnInspector: Send + Sync {
    /// Starts following sandbox `sandbox`, whose tasks are in `cgroup`.
    fn register(&self, sandbox: &SandboxId, cgroup: &Path) -> Result<(), InspectorError>;
    /// The sandbox's init is crab-init: its running (it reaps the
    /// sandbox's processes) is no change of the sandbox.
    fn quiet_init(&self, sandbox: &SandboxId) -> Result<(), InspectorError>;
    /// Stops following sandbox `sandbox`.
    fn unregister(&self, sandbox: &SandboxId);
    /// Ends the sandbox's current turn: what it changed, and a reset.
    fn turn_end(&self, sandbox: &SandboxId) -> Result<TurnReport, InspectorError>;
    /// A checkpoint of the sandbox runs (`on`) or has ended: while one
    /// runs, a tracer outside the sandbox is its CRIU (see
    /// `crab_inspector::Inspector::capturing`).
    fn capturing(&self, sandbox: &SandboxId, on: bool) -> Result<(), InspectorError>;
    /// The sandbox's processes were just restored: its mounts are learned
    /// again and its turn starts afresh.
    fn restored(&self, sandbox: &SandboxId) -> Result<(), InspectorError>;
    /// Forgets the changes a checkpoint's helpers made in `own`, its
    /// output directories (what it made the sandbox's tasks do never
    /// counts: see `crab_inspector::Inspector::forget_own_files`).
    fn forget_own_files(&self, sandbox: &SandboxId, own: &[PathBuf]) -> Result<(), InspectorError>;
}

/// The inspector (if one is loaded) and the watchers of its reports.
pub struct Inspection {
    inspector: Option<Box<dyn TurnInspector>>,
    reports: broadcast::Sender<TurnReport>,
    /// The other containers of each pod's sandbox that the inspector
    /// follows with it, by their ids (see [`Inspection::follow_members`]).
    /// Locked before `sandboxes`.
    members: parking_lot::Mutex<HashMap<SandboxId, Vec<SandboxId>>>,
    /// The sandboxes registered and not unregistered since.
    sandboxes: parking_lot::Mutex<std::collections::HashSet<SandboxId>>,
}

// === impl Inspection ===

impl Inspection {
    /// Inspection through `inspector`, or none.
    pub fn new(inspector: Option<Box<dyn TurnInspector>>) -> Self {
        Inspection {
            inspector,
            reports: broadcast::channel(256).0,
            members: parking_lot::Mutex::default(),
            sandboxes: parking_lot::Mutex::default(),
        }
    }

    /// Follows `members`, the other containers of pod sandbox `sandbox`,
    /// and no others of it from now on; answers whether the inspector can
    /// vouch for all of them since the last turn end: not when one is seen
    /// for the first time or cannot be followed (its past is unknown), nor
    /// when one followed is gone (it ended, and what a version holds of it
    /// no longer is its state): the version must then be whole. Each turn
    /// end of the sandbox ends theirs too. Nothing is followed for a
    /// sandbox the inspector does not follow itself (it went).
    pub fn follow_members(&self, sandbox: &SandboxId, members: &[PodMember]) -> bool {
        let Some(i) = &self.inspector else {
            return members.is_empty();
        };
        let mut all = self.members.lock();
        if !self.sandboxes.lock().contains(sandbox) {
            return members.is_empty();
        }
        let followed = all.entry(sandbox.clone()).or_default();
        let mut known = true;
        followed.retain(|m| {
            let still = members.iter().any(|n| n.id == *m);
            if !still {
                i.unregister(m);
                known = false;
            }
            still
        });
        for m in members {
            if followed.contains(&m.id) {
                continue;
            }
            known = false;
            match follow_one(i.as_ref(), &m.id, &m.cgroup, m.crab_init) {
                Ok(()) => followed.push(m.id.clone()),
                Err(e) => {
                    tracing::warn!(%sandbox, member = %m.id, error = %crab_api::error_chain(e.as_ref()), "inspector cannot follow the pod's container: the pod's versions stay whole");
                }
            }
        }
        if followed.is_empty() {
            all.remove(sandbox);
        }
        known
    }

    /// The other containers of `sandbox`'s pod that the inspector follows.
    fn members_of(&self, sandbox: &SandboxId) -> Vec<SandboxId> {
        self.members.lock().get(sandbox).cloned().unwrap_or_default()
    }

    /// Ends the turns of the other containers of `sandbox`'s pod only;
    /// answers whether one changed anything, or cannot say (a files-only
    /// version leaves them out, so they are asked again just before its
    /// capture).
    pub fn members_changed(&self, sandbox: &SandboxId) -> bool {
        let Some(i) = &self.inspector else {
            return true;
        };
        self.members_of(sandbox)
            .iter()
            .any(|m| i.turn_end(m).map_or(true, |r| r.class != Class::None))
    }

    /// Follows a registered sandbox (logged when it cannot: its turns are
    /// then `full`).
    pub fn register(&self, reg: &crab_api::crabd::Registration) {
        let (Some(i), Some(cgroup)) = (&self.inspector, reg.cgroup.as_deref()) else {
            return;
        };
        match follow_one(i.as_ref(), &reg.id, cgroup, reg.crab_init) {
            Ok(()) => {
                self.sandboxes.lock().insert(reg.id.clone());
            }
            Err(e) => {
                tracing::warn!(sandbox = %reg.id, error = %crab_api::error_chain(e.as_ref()), "inspector cannot follow it: its turns will be full")
            }
        }
    }

    /// Stops following a sandbox (and its pod's other containers).
    pub fn unregister(&self, sandbox: &SandboxId) {
        let members = {
            let mut all = self.members.lock();
            self.sandboxes.lock().remove(sandbox);
            all.remove(sandbox).unwrap_or_default()
        };
        if let Some(i) = &self.inspector {
            i.unregister(sandbox);
            for m in &members {
                i.unregister(m);
            }
        }
    }

    /// Ends the sandbox's turn, and its pod's other containers' (any
    /// change of one makes the turn whole: the shim captures them only
    /// so): its report, also sent to watchers. When no inspector can
    /// answer, the class is `full` and the reason says why.
    pub fn turn_end(&self, sandbox: &SandboxId) -> TurnReport {
        let ended = |name: &SandboxId| match &self.inspector {
            Some(i) => i.turn_end(name).unwrap_or_else(|e| {
                let why = crab_api::error_chain(e.as_ref());
                tracing::warn!(sandbox = %name, error = why, "inspector could not end the turn: it is full");
                full(name, &why)
            }),
            None => full(name, "no inspector is loaded"),
        };
        let mut report = ended(sandbox);
        for m in self.members_of(sandbox) {
            let theirs = ended(&m);
            if theirs.class != Class::None {
                report.class = report.class.union(Class::Full);
                report.reasons.push(serde_json::json!({
                    "kind": "pod_member",
                    "member": m,
                    "class": theirs.class,
                    "why": "the pod's other container changed: the version captures it whole",
                    "reasons": theirs.reasons.iter().take(8).collect::<Vec<_>>(),
                }));
                report.n_reasons += 1;
            }
        }
        if let Some(why) = report.reasons.iter().find(|r| r["kind"] == "unsure") {
            let why = why["why"].as_str().unwrap_or_default();
            tracing::warn!(%sandbox, turn = report.turn, reason = why, "the inspector cannot vouch for the turn: it is full");
        }
        let _ = self.reports.send(report.clone());
        report
    }

    /// Starts the sandbox's ledger afresh (its state was just restored):
    /// what it did before no longer counts. Watchers are not told.
    pub fn reset(&self, sandbox: &SandboxId) {
        // The pod's other containers are followed afresh from the next turn
        // end, which is then whole: a restore may have passed one over or
        // left one as it was, whose state no version holds.
        let members = self.members.lock().remove(sandbox).unwrap_or_default();
        if let Some(i) = &self.inspector {
            for m in &members {
                i.unregister(m);
            }
            if let Err(e) = i.restored(sandbox) {
                tracing::warn!(%sandbox, error = %crab_api::error_chain(e.as_ref()), "inspector reset");
            }
        }
    }

    /// A checkpoint of the sandbox runs (`on`) or has ended (logged when
    /// the inspector cannot be told: a tracer outside the sandbox then
    /// makes turns `full`, or is taken for CRIU until the next capture).
    pub fn capturing(&self, sandbox: &SandboxId, on: bool) {
        if let Some(i) = &self.inspector {
            for name in std::iter::once(sandbox.clone()).chain(self.members_of(sandbox)) {
                if let Err(e) = i.capturing(&name, on) {
                    tracing::warn!(sandbox = %name, on, error = %crab_api::error_chain(e.as_ref()), "inspector capture window");
                }
            }
        }
    }

    /// A checkpoint of the sandbox wrote into `own`, its output
    /// directories: not the sandbox's change (logged when it cannot be
    /// forgotten: the next turn is then only bigger).
    pub fn forget_own_files(&self, sandbox: &SandboxId, own: &[PathBuf]) {
        if let Some(i) = &self.inspector {
            for name in std::iter::once(sandbox.clone()).chain(self.members_of(sandbox)) {
                if let Err(e) = i.forget_own_files(&name, own) {
                    tracing::warn!(sandbox = %name, error = %crab_api::error_chain(e.as_ref()), "inspector forget own files");
                }
            }
        }
    }

    /// Whether an inspector is loaded.
    pub fn loaded(&self) -> bool {
        self.inspector.is_some()
    }
}

impl std::fmt::Debug for Inspection {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Inspection")
            .field("loaded", &self.loaded())
            .finish()
    }
}

// The eBPF inspector (crate `crab-inspector`).
impl TurnInspector for crab_inspector::Inspector {
    fn register(&self, sandbox: &SandboxId, cgroup: &Path) -> Result<(), InspectorError> {
        Ok(crab_inspector::Inspector::register(self, sandbox.as_str(), cgroup).map(drop)?)
    }

    fn quiet_init(&self, sandbox: &SandboxId) -> Result<(), InspectorError> {
        Ok(crab_inspector::Inspector::quiet_init(self, sandbox.as_str())?)
    }

    fn unregister(&self, sandbox: &SandboxId) {
        if let Err(e) = crab_inspector::Inspector::unregister(self, sandbox.as_str()) {
            tracing::debug!(%sandbox, error = %crab_api::error_chain(&e), "inspector unregister");
        }
    }

    fn capturing(&self, sandbox: &SandboxId, on: bool) -> Result<(), InspectorError> {
        Ok(crab_inspector::Inspector::capturing(self, sandbox.as_str(), on)?)
    }

    fn restored(&self, sandbox: &SandboxId) -> Result<(), InspectorError> {
        Ok(crab_inspector::Inspector::restored(self, sandbox.as_str())?)
    }

    fn forget_own_files(&self, sandbox: &SandboxId, own: &[PathBuf]) -> Result<(), InspectorError> {
        Ok(crab_inspector::Inspector::forget_own_files(
            self,
            sandbox.as_str(),
            own,
        )?)
    }

    fn turn_end(&self, sandbox: &SandboxId) -> Result<TurnReport, InspectorError> {
        let r = crab_inspector::Inspector::turn_end(self, sandbox.as_str())?;
        Ok(TurnReport {
            sandbox: sandbox.clone(),
            turn: r.turn,
            class: r.class,
            reasons: r
                .reasons
                .iter()
                .map(|reason| serde_json::to_value(reason).expect("a reason serializes"))
                .collect(),
            n_reasons: r.n_reasons,
        })
    }
}

/// The reasons a report carries when safety rules judge them.
const SAFETY_REASONS: usize = 1 << 16;

/// Loads the eBPF inspector as `[crabd]` says; `None` (logged) when it is
/// off or cannot load here (no BPF, not root, another crabd owns the pins).
pub fn load(config: &CrabdConfig) -> Option<Box<dyn TurnInspector>> {
    if !config.inspector {
        return None;
    }
    let mut ic = crab_inspector::InspectorConfig::host(config.noisy_comms.clone());
    ic.pin_dir = config.inspector_pin_dir.clone();
    if config.safety.any() {
        // Safety rules judge every change, not a sample.
        ic.max_reasons = SAFETY_REASONS;
    }
    match crab_inspector::Inspector::load(ic) {
        Ok(i) => {
            tracing::info!(pins = %config.inspector_pin_dir.display(), "inspector loaded");
            Some(Box::new(i))
        }
        Err(e) => {
            tracing::error!(error = %crab_api::error_chain(&e), "inspector not loaded, every turn will be full");
            None
        }
    }
}

/// Registers `id` (cgroup `cgroup`) with the inspector and, when its init
/// is crab-init, quiets that init's own running. Only what this call
/// registered is undone on a failure (a name taken already may be another
/// sandbox's to end), so that a name it could not follow whole is not
/// followed at all: its turns are then `full`.
fn follow_one(
    i: &dyn TurnInspector,
    id: &SandboxId,
    cgroup: &Path,
    crab_init: bool,
) -> Result<(), InspectorError> {
    i.register(id, cgroup)?;
    if crab_init {
        i.quiet_init(id).inspect_err(|_| i.unregister(id))?;
    }
    Ok(())
}

fn full(sandbox: &SandboxId, why: &str) -> TurnReport {
    TurnReport {
        sandbox: sandbox.clone(),
        turn: 0,
        class: Class::Full,
        reasons: vec![serde_json::json!({ "kind": "unknown", "why": why })],
        n_reasons: 1,
    }
}

// === impl Daemon ===

impl Daemon {
    /// Sandbox `sel`'s turn reports as JSON lines, as its turns end, until
    /// the caller hangs up.
    pub(super) fn watch(&self, sel: &SandboxSelector) -> Result<Response, ApiError> {
        let id = self.registry.resolve(sel)?.id;
        // Subscribed before the first line goes: a caller that has read it
        // misses no turn that ends after.
        let mut started =
            serde_json::to_vec(&WatchStarted { watching: id.clone() }).expect("a line serializes");
        started.push(b'\n');
        let first = futures_util::stream::once(std::future::ready(Ok::<_, std::io::Error>(started)));
        let reports = tokio_stream::wrappers::BroadcastStream::new(self.inspection.reports.subscribe())
            .filter_map(move |r| {
                let line = match r {
                    Ok(report) if report.sandbox == id => {
                        let mut line = serde_json::to_vec(&report).expect("a report serializes");
                        line.push(b'\n');
                        Some(Ok::<_, std::io::Error>(line))
                    }
                    // Too slow a watcher misses reports; it is told how many.
                    Err(tokio_stream::wrappers::errors::BroadcastStreamRecvError::Lagged(n)) => {
                        Some(Ok(format!("{{\"lagged\":{n}}}\n").into_bytes()))
                    }
                    Ok(_) => None,
                };
                std::future::ready(line)
            })
            .take_until(self.stopping.clone().cancelled_owned());
        Ok((
            [(axum::http::header::CONTENT_TYPE, "application/x-ndjson")],
            Body::from_stream(first.chain(reports)),
        )
            .into_response())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// An inspector that keeps names only: what `Inspection` tells it.
    #[derive(Default)]
    struct Names(parking_lot::Mutex<std::collections::BTreeSet<String>>);

    impl TurnInspector for std::sync::Arc<Names> {
        fn register(&self, sandbox: &SandboxId, _cgroup: &Path) -> Result<(), InspectorError> {
            match self.0.lock().insert(sandbox.to_string()) {
                true => Ok(()),
                false => Err("already registered".into()),
            }
        }
        fn quiet_init(&self, sandbox: &SandboxId) -> Result<(), InspectorError> {
            match sandbox.as_str() {
                "unquiet" => Err("its init cannot be quieted".into()),
                _ => Ok(()),
            }
        }
        fn unregister(&self, sandbox: &SandboxId) {
            self.0.lock().remove(sandbox.as_str());
        }
        fn turn_end(&self, sandbox: &SandboxId) -> Result<TurnReport, InspectorError> {
            Ok(TurnReport {
                sandbox: sandbox.clone(),
                turn: 1,
                class: Class::None,
                reasons: Vec::new(),
                n_reasons: 0,
            })
        }
        fn capturing(&self, _: &SandboxId, _: bool) -> Result<(), InspectorError> {
            Ok(())
        }
        fn restored(&self, _: &SandboxId) -> Result<(), InspectorError> {
            Ok(())
        }
        fn forget_own_files(&self, _: &SandboxId, _: &[PathBuf]) -> Result<(), InspectorError> {
            Ok(())
        }
    }

    fn member(id: &str) -> PodMember {
        PodMember {
            id: SandboxId::new(id).unwrap(),
            cgroup: PathBuf::from("/sys/fs/cgroup/x"),
            crab_init: false,
        }
    }

    #[test]
    fn a_sandbox_whose_init_cannot_be_quieted_is_not_followed() {
        let names = std::sync::Arc::new(Names::default());
        let inspection = Inspection::new(Some(Box::new(names.clone())));
        let reg: crab_api::crabd::Registration = serde_json::from_value(serde_json::json!({
            "id": "unquiet", "namespace": "k8s.io", "containerd": "/c.sock",
            "control": "/ctl.sock", "pid": 1, "fs_backend": null, "cgroup": "/sys/fs/cgroup/u",
            "crab_init": true,
        }))
        .unwrap();
        inspection.register(&reg);
        assert!(names.0.lock().is_empty(), "{:?}", names.0.lock());
        let unquiet = SandboxId::new("unquiet").unwrap();
        assert!(
            !inspection.follow_members(&unquiet, &[member("db")]),
            "nor its pod"
        );
        assert!(names.0.lock().is_empty());
    }

    #[test]
    fn a_members_arrival_or_departure_is_no_turn_to_vouch_for() {
        let names = std::sync::Arc::new(Names::default());
        let inspection = Inspection::new(Some(Box::new(names.clone())));
        let agent = SandboxId::new("agent").unwrap();
        let reg: crab_api::crabd::Registration = serde_json::from_value(serde_json::json!({
            "id": "agent", "namespace": "k8s.io", "containerd": "/c.sock",
            "control": "/ctl.sock", "pid": 1, "fs_backend": null, "cgroup": "/sys/fs/cgroup/agent",
        }))
        .unwrap();
        let (db, cache) = (member("db"), member("cache"));
        // Not followed itself: nothing of its pod is.
        assert!(!inspection.follow_members(&agent, std::slice::from_ref(&db)));
        assert!(!names.0.lock().contains("db"));
        inspection.register(&reg);
        assert!(inspection.follow_members(&agent, &[]), "no members");
        assert!(
            !inspection.follow_members(&agent, std::slice::from_ref(&db)),
            "db is new"
        );
        assert!(
            inspection.follow_members(&agent, std::slice::from_ref(&db)),
            "db followed since"
        );
        assert!(!inspection.members_changed(&agent));
        assert!(
            !inspection.follow_members(&agent, &[db.clone(), cache.clone()]),
            "cache is new"
        );
        assert!(
            !inspection.follow_members(&agent, std::slice::from_ref(&cache)),
            "db went"
        );
        assert!(!names.0.lock().contains("db"), "and is no longer followed");
        // A name registered by another is not undone by a failure here.
        names.0.lock().insert("other".into());
        assert!(!inspection.follow_members(&agent, &[cache.clone(), member("other")]));
        assert!(names.0.lock().contains("other"));
        // A rollback: followed afresh.
        inspection.reset(&agent);
        assert!(!inspection.follow_members(&agent, std::slice::from_ref(&cache)));
        inspection.unregister(&agent);
        assert_eq!(
            names.0.lock().len(),
            1,
            "only the other's name is left: {:?}",
            names.0.lock()
        );
    }
}
