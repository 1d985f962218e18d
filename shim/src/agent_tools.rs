//! The engine behind the agent's own rollback tool (`crab_proxy`'s
//! `/crab/` routes): crabd, by the sandbox's exact id, over its socket.

use std::path::Path;
use std::time::Duration;

use async_trait::async_trait;
use crab_api::crabd::{RollbackReport, RollbackRequest};
use crab_api::{Class, ClientError, Crabd, SandboxSelector, VersionRecord, VersionSel};
use crab_proxy::{AgentTools, SandboxId, ToolError};

/// [`AgentTools`] through crabd.
pub struct CrabdTools {
    crabd: Crabd,
}

impl CrabdTools {
    /// Tools calling crabd at `socket`, each call limited to `limit`.
    pub fn new(socket: &Path, limit: Duration) -> Self {
        CrabdTools {
            crabd: Crabd::new(socket, limit),
        }
    }
}

/// Never a prefix: a sandbox crabd forgot must not reach another.
fn exact(sandbox: &SandboxId) -> SandboxSelector {
    SandboxSelector::exact(sandbox)
}

/// crabd's refusal as the agent's: its status and message; a crabd that
/// does not answer is 503.
fn tool_error(e: ClientError) -> ToolError {
    match &e {
        ClientError::Refused { status, message, .. } => ToolError {
            status: *status,
            message: message.clone(),
        },
        _ => ToolError {
            status: 503,
            message: format!("crabd: {}", crab_api::error_chain(&e)),
        },
    }
}

#[async_trait]
impl AgentTools for CrabdTools {
    async fn versions(&self, sandbox: &SandboxId) -> Result<Vec<VersionRecord>, ToolError> {
        let views = self.crabd.versions(&exact(sandbox)).await.map_err(tool_error)?;
        // Only those a rollback can use.
        Ok(views
            .into_iter()
            .filter(|v| v.defect.is_none())
            .filter_map(|v| v.record)
            .collect())
    }

    async fn checkpoint(&self, sandbox: &SandboxId, class: Class) -> Result<(VersionRecord, f64), ToolError> {
        let r = self
            .crabd
            .checkpoint(&exact(sandbox), class)
            .await
            .map_err(tool_error)?;
        Ok((r.version, r.frozen_ms))
    }

    async fn rollback(
        &self,
        sandbox: &SandboxId,
        version: u64,
        files_only: bool,
    ) -> Result<RollbackReport, ToolError> {
        let req = RollbackRequest {
            version: VersionSel::Number(version),
            undo: true,
            files_only,
        };
        self.crabd
            .rollback(&exact(sandbox), &req)
            .await
            .map_err(tool_error)
    }
}
