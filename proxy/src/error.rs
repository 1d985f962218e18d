//! The crate's error type and its one mapping onto HTTP answers that the
//! agents' SDKs understand.
//!
//! Error bodies use one JSON shape that both SDK families parse:
//! `{"type":"error","error":{"type":"crab_…","message":"…"}}` (OpenAI reads
//! `error.message`, Anthropic `error.type` and `error.message`). Answers that
//! a retry cannot fix carry `x-should-retry: false`, which both SDKs honour.

use bytes::Bytes;
use http::{HeaderValue, Response, StatusCode};
use http_body_util::{BodyExt, Full};

use crate::config::ConfigError;
use crate::limit::RequestError;
use crate::replay::ReplayError;
use crate::transcript::TranscriptError;
use crate::upstream::UpstreamError;
use crate::ProxyBody;
use crab_api::InvalidSandboxId;

/// Everything the proxy can fail with.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The configuration cannot work.
    #[error(transparent)]
    Config(#[from] ConfigError),
    /// A sandbox id is not valid.
    #[error(transparent)]
    InvalidSandboxId(#[from] InvalidSandboxId),
    /// No sandbox with this id is registered (host listener).
    #[error("no sandbox {sandbox} on this proxy")]
    UnknownSandbox {
        /// The id asked for.
        sandbox: String,
    },
    /// A sandbox with this id is already registered.
    #[error("sandbox {sandbox} already registered")]
    SandboxExists {
        /// The id given.
        sandbox: String,
    },
    /// The relay could not connect to a sandbox's proxy socket (its shim
    /// is gone or not serving).
    #[error("the proxy of sandbox {sandbox} does not answer")]
    SandboxUnreachable {
        /// The sandbox.
        sandbox: String,
        /// What connect said.
        #[source]
        source: Box<hyper_util::client::legacy::Error>,
    },
    /// The relay's exchange with a sandbox's proxy socket broke before the
    /// response head.
    #[error("the exchange with the proxy of sandbox {sandbox} failed")]
    SandboxExchange {
        /// The sandbox.
        sandbox: String,
        /// What the client said.
        #[source]
        source: Box<hyper_util::client::legacy::Error>,
    },
    /// A host-listener request names a host other than the listener's own
    /// (a web page's request rebound to 127.0.0.1).
    #[error("host {host:?} is not this listener's")]
    ForeignHost {
        /// The `Host` the request named.
        host: String,
    },
    /// The listener holds as many connections as it may: this one is
    /// answered and closed.
    #[error("too many connections: at most {limit} at once")]
    TooManyConnections {
        /// The limit.
        limit: usize,
    },
    /// A host-listener path is not `/s/<sandbox>/…`.
    #[error("path {path:?} does not start with /s/<sandbox>/")]
    NotASandboxPath {
        /// The path given.
        path: String,
    },
    /// The request body could not be taken.
    #[error(transparent)]
    Request(#[from] RequestError),
    /// The upstream exchange failed before a response head.
    #[error(transparent)]
    Upstream(#[from] UpstreamError),
    /// The transcript failed.
    #[error(transparent)]
    Transcript(#[from] TranscriptError),
    /// A replay could not start.
    #[error(transparent)]
    Replay(#[from] ReplayError),
}

impl Error {
    /// A stable code for this error: the `error.type` of its HTTP answer and
    /// the `error` field of a transcript record.
    pub fn code(&self) -> &'static str {
        match self {
            Self::Config(_) => "crab_config",
            Self::InvalidSandboxId(_) => "crab_invalid_sandbox_id",
            Self::UnknownSandbox { .. } => "crab_unknown_sandbox",
            Self::SandboxExists { .. } => "crab_sandbox_exists",
            Self::NotASandboxPath { .. } => "crab_not_a_sandbox_path",
            Self::ForeignHost { .. } => "crab_foreign_host",
            Self::SandboxUnreachable { .. } => "crab_sandbox_unreachable",
            Self::SandboxExchange { .. } => "crab_sandbox_exchange_failed",
            Self::Request(RequestError::TooLarge { .. }) => "crab_request_too_large",
            Self::Request(RequestError::BodyRead { .. }) => "crab_request_body_read",
            Self::Request(RequestError::BodyTimeout { .. }) => "crab_request_body_timeout",
            Self::TooManyConnections { .. } => "crab_too_many_connections",
            Self::Upstream(UpstreamError::Unreachable { .. }) => "crab_upstream_unreachable",
            Self::Upstream(UpstreamError::Exchange { .. }) => "crab_upstream_exchange_failed",
            Self::Upstream(UpstreamError::HeaderTimeout { .. }) => "crab_upstream_header_timeout",
            Self::Upstream(UpstreamError::TotalTimeout { .. }) => "crab_upstream_total_timeout",
            Self::Upstream(UpstreamError::BadPath { .. }) => "crab_upstream_bad_path",
            Self::Transcript(_) => "crab_transcript",
            Self::Replay(_) => "crab_replay_unavailable",
        }
    }

    /// The HTTP status of this error's answer.
    pub fn status(&self) -> StatusCode {
        match self {
            Self::InvalidSandboxId(_) | Self::NotASandboxPath { .. } => StatusCode::BAD_REQUEST,
            Self::Request(RequestError::BodyRead { .. }) => StatusCode::BAD_REQUEST,
            Self::UnknownSandbox { .. } => StatusCode::NOT_FOUND,
            Self::ForeignHost { .. } => StatusCode::FORBIDDEN,
            Self::SandboxExists { .. } | Self::Replay(_) => StatusCode::CONFLICT,
            Self::Request(RequestError::TooLarge { .. }) => StatusCode::PAYLOAD_TOO_LARGE,
            Self::Request(RequestError::BodyTimeout { .. }) => StatusCode::REQUEST_TIMEOUT,
            Self::TooManyConnections { .. } => StatusCode::SERVICE_UNAVAILABLE,
            Self::Upstream(UpstreamError::HeaderTimeout { .. } | UpstreamError::TotalTimeout { .. }) => {
                StatusCode::GATEWAY_TIMEOUT
            }
            Self::Upstream(_) | Self::SandboxUnreachable { .. } | Self::SandboxExchange { .. } => {
                StatusCode::BAD_GATEWAY
            }
            Self::Config(_) | Self::Transcript(_) => StatusCode::INTERNAL_SERVER_ERROR,
        }
    }

    /// The answer the agent gets for this error.
    pub fn into_response(self) -> Response<ProxyBody> {
        let status = self.status();
        let mut message = self.to_string();
        let mut source = std::error::Error::source(&self);
        while let Some(s) = source {
            message.push_str(": ");
            message.push_str(&s.to_string());
            source = s.source();
        }
        let error = serde_json::json!({ "type": self.code(), "message": message });
        let body = serde_json::json!({ "type": "error", "error": error }).to_string();
        let mut resp = Response::new(
            Full::new(Bytes::from(body))
                .map_err(|never| match never {})
                .boxed(),
        );
        *resp.status_mut() = status;
        let headers = resp.headers_mut();
        headers.insert(
            http::header::CONTENT_TYPE,
            HeaderValue::from_static("application/json"),
        );
        headers.insert("x-crab-error", HeaderValue::from_static(self.code()));
        // A 4xx is the same answer on every retry; 502/504 may pass.
        if status.is_client_error() {
            headers.insert("x-should-retry", HeaderValue::from_static("false"));
        }
        resp
    }
}
