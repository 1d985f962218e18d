//! A sandbox as the proxy sees it: its turn counter, replay, transcript,
//! stats, and the request path its listeners serve.

use std::convert::Infallible;
use std::path::Path;
use std::sync::Arc;

use http::{Request, Response};
use hyper::body::Incoming;
use tower::layer::layer_fn;
use tower::util::BoxCloneService;
use tower::{ServiceBuilder, ServiceExt};

use crab_api::shim::ConversationAt;

use crate::config::ProxyConfig;
use crate::gate::Gate;
use crate::hook::TurnHook;
use crate::limit::LimitLayer;
use crate::replay::{conversation, Replay, ReplayError};
use crate::replay_layer::ReplayService;
use crate::route::RouteLayer;
use crate::shared::Shared;
use crate::side_call::SideCalls;
use crate::stats::SandboxStats;
use crate::tee::Tee;
use crate::tools::{AgentTools, Tools};
use crate::transcript::Entry;
use crate::turn::TurnMark;
use crate::upstream::{Upstream, UpstreamClient};
use crate::{Error, ProxyBody, SandboxId};

/// The largest transcript a replay reads.
pub const MAX_REPLAY_BYTES: u64 = 128 << 20;

/// The request path of one sandbox as a cloneable tower service; errors are
/// already answers.
pub type SandboxService = BoxCloneService<Request<Incoming>, Response<ProxyBody>, Infallible>;

/// One sandbox's proxy state. Cheap to clone; clones share the state.
#[derive(Clone)]
pub struct Sandbox {
    shared: Arc<Shared>,
}

impl Sandbox {
    pub(crate) async fn open(
        id: SandboxId,
        config: Arc<ProxyConfig>,
        hook: Arc<dyn TurnHook>,
        tools: Option<Arc<dyn AgentTools>>,
        client: UpstreamClient,
    ) -> Result<Self, Error> {
        let shared = Shared::open(id, config, hook, tools, client).await?;
        tracing::info!(sandbox = %shared.id, "sandbox added to the proxy");
        Ok(Self {
            shared: Arc::new(shared),
        })
    }

    /// The sandbox's id.
    pub fn id(&self) -> &SandboxId {
        &self.shared.id
    }

    /// A snapshot of the sandbox's counters and recent hold times.
    pub fn stats(&self) -> SandboxStats {
        self.shared.stats.snapshot()
    }

    /// The newest turn number given out (0 before the first turn end).
    pub fn last_turn(&self) -> u64 {
        self.shared.with_turns(|t| t.last_turn)
    }

    /// The transcript file.
    pub fn transcript_path(&self) -> &Path {
        self.shared.transcript.path()
    }

    /// Returns once no upstream answer of this sandbox is streaming (for
    /// instance before a checkpoint, or to see a departed agent's stream end).
    pub async fn wait_streams_closed(&self) {
        self.shared.stats.wait_streams_closed().await;
    }

    /// Returns once every transcript entry submitted so far is fsynced, or
    /// could not be written (counted in [`SandboxStats`]).
    pub async fn flush_transcript(&self) {
        let target = self.shared.transcript.submitted();
        let _ = self.shared.transcript.wait_durable(target).await;
    }

    /// Starts answering turn ends 1..=`until` of the current branch from
    /// this sandbox's transcript, for an agent put back to its start (from
    /// inside the sandbox or outside it): its requests are numbered from 1
    /// again, and the first one that goes live starts a new branch.
    ///
    /// # Errors
    /// [`ReplayError`] when the transcript cannot be read or lacks a
    /// complete record of a turn in the range.
    pub async fn replay(&self, until: u64) -> Result<(), Error> {
        self.shared.replay_from_start(until).await
    }

    /// Tells the proxy that a restore put the sandbox back to `at`: the
    /// agent inside the sandbox, restored too, gets what it asks again
    /// from the transcript (turns `at.image_turn..=at.turn` of `at.branch`,
    /// while their records are complete), and its first live turn starts a
    /// new branch after the last of them. An agent outside the sandbox
    /// goes on as it was. See [`crate::transcript`] for the tree.
    ///
    /// # Errors
    /// [`ReplayError`] when the transcript cannot be read or has no branch
    /// `at.branch`; the conversation is then left as it was.
    pub async fn rewind(&self, at: ConversationAt) -> Result<(), Error> {
        self.rewind_with_notice(at, None).await
    }

    /// [`Self::rewind`] after a safety rollback: the restored agent gets
    /// `notice` (in its provider's answer format) as the answer to the
    /// last request it asks again, instead of the recorded answer whose
    /// actions were rolled back.
    ///
    /// # Errors
    /// As [`Self::rewind`].
    pub async fn rewind_with_notice(&self, at: ConversationAt, notice: Option<&str>) -> Result<(), Error> {
        let entries = self.durable_entries().await?;
        let mut replay = self
            .shared
            .with_turns(|state| Replay::rewind(&entries, at, state))?;
        if let Some(text) = notice {
            let told = replay.answer_last_with(|record| {
                let body = record.request.body.to_bytes().unwrap_or_default();
                crate::notice::response(record.api, &body, text)
            });
            if !told {
                tracing::warn!(sandbox = %self.shared.id, turn = at.turn, "the restored agent asks nothing again: the rollback's notice is not delivered");
            }
        }
        self.start(replay);
        Ok(())
    }

    /// Opens the conversation of a sandbox started again from version `at`
    /// over its old transcript (a resume after the host or its shim died):
    /// live turns go on after `at.turn` (on a new branch when the
    /// transcript has later turns there), and the agent inside, restored
    /// too, is fast-forwarded as after [`Self::rewind`].
    ///
    /// # Errors
    /// As [`Self::rewind`]; the conversation is then left as it was.
    pub async fn resume(&self, at: ConversationAt) -> Result<(), Error> {
        let mut entries = self.durable_entries().await?;
        conversation(&entries, at.branch).ok_or(ReplayError::UnknownBranch { branch: at.branch })?;
        let id = self.shared.id.to_string();
        let (replay, branch) = self.shared.with_turns(|state| {
            state.learn(&entries);
            let mut here = at;
            let mut branch = None;
            // Later turns there: live ones go on a branch of their own.
            if state.tips.get(&at.branch).copied().unwrap_or(0) > at.turn {
                let entry = state.branch_off(&id, at.branch, at.turn);
                here.branch = state.branch;
                entries.push(entry.clone());
                branch = Some(entry);
            }
            state.branch = here.branch;
            state.last_turn = at.turn;
            (Replay::rewind(&entries, here, state), branch)
        });
        if let Some(entry) = branch {
            self.shared.transcript.submit(entry);
        }
        self.start(replay?);
        Ok(())
    }

    /// Drops an armed replay (a restore to a state whose place in the
    /// conversation is unknown): the conversation goes on as it is.
    pub fn cancel_replay(&self) {
        if self.shared.with_turns(|state| state.replay.take()).is_some() {
            tracing::info!(sandbox = %self.shared.id, "replay dropped");
        }
    }

    async fn durable_entries(&self) -> Result<Vec<Entry>, Error> {
        self.shared.durable_entries().await
    }

    fn start(&self, replay: Replay) {
        self.shared.start_replay(replay);
    }

    /// The request path: the agent's tool (`/crab/`) → route detect → body limit → side calls → replay →
    /// turn-end mark → hold gate → transcript tee → upstream client; errors
    /// become answers.
    pub fn service(&self) -> SandboxService {
        let shared = &self.shared;
        let config = &shared.config;
        let upstream = Upstream::new(
            shared.client.clone(),
            config.upstreams.clone(),
            config.timeouts,
            shared.stats.clone(),
        );
        let stack = ServiceBuilder::new()
            .layer(layer_fn(with_shared(shared, Tools::new)))
            .layer(RouteLayer::new(config.turn_ends.clone()))
            .layer(LimitLayer::new(
                config.limits.max_request_body,
                config.timeouts.client_body,
            ))
            .layer(layer_fn(with_shared(shared, SideCalls::new)))
            .layer(layer_fn(with_shared(shared, ReplayService::new)))
            .layer(layer_fn(with_shared(shared, TurnMark::new)))
            .layer(layer_fn(with_shared(shared, Gate::new)))
            .layer(layer_fn(with_shared(shared, Tee::new)))
            .service(upstream);
        // The protocol edge: every error becomes its HTTP answer here.
        let answer = tower::service_fn(move |req: Request<Incoming>| {
            let stack = stack.clone();
            async move { Ok::<_, Infallible>(stack.oneshot(req).await.unwrap_or_else(Error::into_response)) }
        });
        BoxCloneService::new(answer)
    }

    /// Opens every pending gate (outcome `cancelled`: hook calls in flight
    /// are dropped) and waits until the transcript entries submitted so far
    /// are durable. The transcript writer itself ends when the last clone of
    /// this sandbox (and of its services) is dropped.
    pub async fn shutdown(&self) {
        self.shared.cancel.cancel();
        self.flush_transcript().await;
    }
}

impl Sandbox {
    pub(crate) fn shared_header_timeout(&self) -> std::time::Duration {
        self.shared.config.timeouts.client_header
    }

    /// The connections its listeners hold, shared by all of them.
    pub(crate) fn connections(&self) -> crate::server::Connections {
        self.shared.connections.clone()
    }
}

/// What `layer_fn` needs for a service that takes only the sandbox's shared
/// state besides its inner service.
fn with_shared<S, T>(shared: &Arc<Shared>, make: fn(Arc<Shared>, S) -> T) -> impl Fn(S) -> T {
    let shared = shared.clone();
    move |inner| make(shared.clone(), inner)
}
