//! The sandboxes crabd knows: a shim registers its sandbox at Start and
//! unregisters it when its task is gone; people list and show them.

use crab_api::crabd::{Registration, SandboxInfo};
use crab_api::{SandboxId, SandboxSelector};

use super::host_listener;
use super::registry::Entry;
use super::work::blocking;
use super::{gc, ApiError, Daemon};
use crate::StoreError;

// === impl Daemon ===

impl Daemon {
    /// Every sandbox, by id.
    pub(super) fn list(&self) -> Vec<SandboxInfo> {
        self.registry.all().into_iter().map(|e| self.info(e)).collect()
    }

    /// The sandbox `sel` names.
    pub(super) fn show(&self, sel: &SandboxSelector) -> Result<SandboxInfo, ApiError> {
        Ok(self.info(self.registry.find(sel)?))
    }

    /// Records a running sandbox. A sandbox with the same id but another
    /// writable layer is a new one: the old one's history goes first.
    pub(super) async fn register(&self, reg: Registration) -> Result<SandboxInfo, ApiError> {
        // No per-sandbox lock here: crabd's own import holds it while the
        // shim it started registers.
        let _lifecycle = self.lifecycle.lock().await;
        let incarnation = gc::incarnation(&reg).await;
        // The same sandbox keeps its secret's nonce (its agents' URLs);
        // another one with its id gets a new one.
        let nonce = match self.registry.get(&reg.id) {
            Some(old) if !old.replaced_by(&reg, incarnation.as_ref()) && !old.nonce.is_empty() => old.nonce,
            _ => host_listener::nonce().map_err(|source| ApiError::Io {
                op: "read /dev/urandom",
                source,
            })?,
        };
        if let Some(old) = self.registry.get(&reg.id) {
            if old.replaced_by(&reg, incarnation.as_ref()) {
                tracing::info!(
                    sandbox = %reg.id,
                    "another sandbox took a removed one's id: the old history goes"
                );
                gc::purge(self, &old).await?;
            }
        }
        match self.store.register(&reg.id) {
            Ok(()) | Err(StoreError::SandboxExists { .. }) => {}
            Err(e) => return Err(e.into()),
        }
        if !reg.restored {
            // A task started afresh (a restart) descends from no version:
            // its next version captures everything. A restored one (an
            // import) keeps the head its restore set. Not under the
            // sandbox's lock (a queued checkpoint may hold it for long, and
            // the shim waits only seconds): a capture that raced this and
            // would inherit nothing is refused (`capture`); one still being
            // written makes the reset wait on a task of its own.
            self.turns.reset_answered(&reg.id);
            let store = self.store.clone();
            let sid = reg.id.clone();
            match blocking(move || store.set_head(&sid, None)).await {
                Ok(()) => {}
                Err(ApiError::Store(StoreError::PendingExists { .. })) => self.reset_head_later(&reg.id),
                Err(e) => return Err(e),
            }
        }
        let entry = Entry {
            registration: reg.clone(),
            running: true,
            incarnation,
            recoveries: 0,
            last_recovery: None,
            nonce,
        };
        self.registry.insert(entry.clone())?;
        self.inspection.register(&reg);
        tracing::info!(sandbox = %reg.id, namespace = reg.namespace, pid = reg.pid, "registered");
        Ok(self.info(entry))
    }

    /// Resets sandbox `id`'s head once the version being written is done
    /// (under the sandbox's lock, on a task of its own).
    fn reset_head_later(&self, id: &SandboxId) {
        let busy = self.busy(id);
        let store = self.store.clone();
        let id = id.clone();
        tokio::spawn(async move {
            let _one_at_a_time = busy.lock().await;
            let sid = id.clone();
            if let Err(e) = blocking(move || store.set_head(&sid, None)).await {
                tracing::warn!(sandbox = %id, error = %crab_api::error_chain(&e), "head not reset after a restart");
            }
        });
    }

    /// Sandbox `id`'s task is gone. Its versions stay until containerd
    /// removes its container (`gc`).
    pub(super) fn unregister(&self, id: &SandboxId) -> Result<(), ApiError> {
        if !self.registry.update(id, |e| e.running = false)? {
            return Err(ApiError::UnknownSandbox { sel: id.to_string() });
        }
        self.inspection.unregister(id);
        tracing::info!(sandbox = %id, "stopped");
        Ok(())
    }

    fn info(&self, entry: Entry) -> SandboxInfo {
        let proxy_url = entry
            .registration
            .proxy
            .as_ref()
            .and_then(|_| self.proxy_url(&entry));
        let Entry {
            registration,
            running,
            recoveries,
            last_recovery,
            ..
        } = entry;
        let versions = self.store.versions(&registration.id).unwrap_or_default();
        SandboxInfo {
            registration,
            running,
            proxy_url,
            versions: versions.len(),
            latest: versions
                .iter()
                .rev()
                .find_map(|v| v.record.as_ref().map(|r| r.version)),
            recoveries,
            last_recovery,
        }
    }
}
