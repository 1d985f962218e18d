//! `crab-proxy`: Crab's coordinator, an HTTP reverse proxy for LLM APIs that
//! marks an agent's turn ends, holds each answer until its turn is safe, and
//! keeps a transcript it can replay.
//!
//! Speaks OpenAI Chat Completions (`POST /v1/chat/completions`), OpenAI
//! Responses (`POST /v1/responses`) and Anthropic Messages
//! (`POST /v1/messages`), streaming included; every other path passes
//! through. A main-loop request ends a turn (the rule is a list of
//! [`RoutePattern`]s); on a turn end the proxy calls the [`TurnHook`] while
//! the request goes upstream, and releases the answer once the hook returned
//! (or failed, or timed out). Each turn is appended to the sandbox's
//! transcript (see [`transcript`] for the format and the durability rule).
//!
//! Public face: [`Proxy`] (registry, [`Proxy::add_sandbox`]), [`Sandbox`]
//! (stats, replay, its tower service), [`serve_sandbox`] (on any
//! [`Listener`]: a sandbox's TCP loopback or its host-side unix socket),
//! [`serve_host`] (every sandbox of one [`Proxy`] under `/s/<sandbox>/…`),
//! [`serve_relay`] (crabd's host listener: `/s/<sandbox>/…` relayed to each
//! sandbox's unix socket, found through [`SandboxSockets`]), [`TurnHook`],
//! [`ProxyConfig`], [`AgentTools`] (the engine behind the agent's own
//! rollback tool, plain HTTP and MCP under `/crab/`), [`Error`].
//!
//! Turn rules in detail: the k-th main-loop request of a sandbox ends turn k
//! (from 1); a request refused before forwarding (413) is no turn; a
//! malformed JSON body on a main-loop path is a turn and is forwarded as-is;
//! an SDK's retry of a failed request is a new turn (it is a new request);
//! turns answered by a replay count but do not call the hook.
//!
//! A request's path through a sandbox is one tower layer per concern:
//! the agent's tool (`/crab/`) → route detect → body limit → replay → turn-end mark → hold gate →
//! transcript tee → upstream client (see [`Sandbox::service`]).
//!
//! Must never: rewrite a request or response body, add buffering to a
//! stream, log or store `Authorization`/`x-api-key`/`api-key`, or wedge an
//! agent on a failing engine.

#![forbid(unsafe_code)]

mod config;
mod error;
mod gate;
mod hook;
mod limit;
mod notice;
mod outcome;
mod proxy;
mod relay;
mod replay;
mod replay_layer;
mod route;
mod sandbox;
mod server;
mod shared;
mod side_call;
mod stats;
mod tee;
mod tools;
pub mod transcript;
mod turn;
mod upstream;

pub use config::{ConfigError, Limits, ProxyConfig, Timeouts, ToolsConfig, Upstreams};
pub use crab_api::{InvalidSandboxId, SandboxId};
pub use error::Error;
pub use hook::{HookError, NoopHook, SafetyRollback, TurnEndCall, TurnHook, TurnVerdict};
pub use limit::RequestError;
pub use outcome::GateOutcome;
pub use proxy::Proxy;
pub use relay::{serve_relay, SandboxSockets};
pub use replay::{canonical, ReplayError};
pub use route::{Api, InvalidRoutePattern, Provider, Route, RoutePattern, TurnEndRules};
pub use sandbox::{Sandbox, SandboxService, MAX_REPLAY_BYTES};
pub use server::{serve_host, serve_sandbox, split_host_path, Listener, MAX_HOST_CONNECTIONS};
pub use stats::{SandboxStats, TurnHold};
pub use tools::{AgentTools, ToolError, MCP_PATH};
pub use upstream::{StreamError, UpstreamError};

/// The body of every answer: upstream streams pass through it chunk by chunk.
pub type ProxyBody = http_body_util::combinators::BoxBody<bytes::Bytes, StreamError>;
