//! The proxy's configuration. No `Default`: every deployment states its
//! upstreams, limits and timeouts.

use std::path::PathBuf;
use std::time::Duration;

use http::Uri;

use crate::route::TurnEndRules;

/// Everything a [`crate::Proxy`] needs to know.
#[derive(Debug, Clone)]
pub struct ProxyConfig {
    /// Where requests go.
    pub upstreams: Upstreams,
    /// Which requests end a turn.
    pub turn_ends: TurnEndRules,
    /// Size limits.
    pub limits: Limits,
    /// Deadlines.
    pub timeouts: Timeouts,
    /// Directory of the transcripts, one `<sandbox>.jsonl` each.
    pub transcript_dir: PathBuf,
    /// The agent's rollback tool (`/crab/`).
    pub tools: ToolsConfig,
}

/// The agent's rollback tool (see `tools`).
#[derive(Debug, Clone, Copy)]
pub struct ToolsConfig {
    /// Calls a sandbox may make in any minute (0: unlimited).
    pub calls_per_minute: u32,
}

/// Base URLs of the upstream APIs (`scheme://host[:port][/prefix]`); the
/// request path is appended to the base path.
#[derive(Debug, Clone)]
pub struct Upstreams {
    /// OpenAI-compatible upstream, e.g. `https://api.openai.com`.
    pub openai: Uri,
    /// Anthropic upstream, e.g. `https://api.anthropic.com`.
    pub anthropic: Uri,
}

/// Size limits.
#[derive(Debug, Clone, Copy)]
pub struct Limits {
    /// Largest request body accepted; larger ones get 413.
    pub max_request_body: usize,
    /// Bytes of one response body kept in its transcript record; the record
    /// of a longer response is marked incomplete (the agent still gets all).
    pub transcript_body_cap: usize,
    /// Bytes a sandbox's transcript may grow to; records past it are
    /// dropped (counted, and one `overflow` line says so).
    pub transcript_max_bytes: u64,
    /// Connections a sandbox's listeners hold at once; one more is
    /// answered 503 and closed.
    pub max_connections: usize,
}

/// Deadlines; each has its own error.
#[derive(Debug, Clone, Copy)]
pub struct Timeouts {
    /// A client must send its request head within this (slowloris guard).
    pub client_header: Duration,
    /// A client must send its whole request body within this (from its
    /// head; a trickled body is cut with 408).
    pub client_body: Duration,
    /// TCP (and TLS) connect to the upstream.
    pub upstream_connect: Duration,
    /// From sending the request to the upstream's response head.
    pub upstream_header: Duration,
    /// Longest silence between two chunks of an upstream body.
    pub upstream_idle: Duration,
    /// Whole upstream exchange, body included.
    pub upstream_total: Duration,
    /// Longest hold of an answer by the turn-end hook (and the transcript's
    /// durability wait); then the answer is released and the miss recorded.
    pub hook: Duration,
}

/// A configuration that cannot work.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    /// An upstream base URL lacks an `http`/`https` scheme or a host.
    #[error("upstream {uri} is not an absolute http or https URL")]
    BadUpstream {
        /// The URL given.
        uri: String,
    },
    /// A limit that would refuse everything.
    #[error("{name} must be at least 1")]
    ZeroLimit {
        /// The setting.
        name: &'static str,
    },
    /// The TLS client cannot be set up with the ring provider.
    #[error("cannot set up the TLS client")]
    Tls {
        /// What rustls said.
        #[source]
        source: rustls::Error,
    },
}

impl Limits {
    pub(crate) fn validate(&self) -> Result<(), ConfigError> {
        if self.max_connections == 0 {
            return Err(ConfigError::ZeroLimit {
                name: "max_connections",
            });
        }
        Ok(())
    }
}

impl Upstreams {
    pub(crate) fn validate(&self) -> Result<(), ConfigError> {
        for uri in [&self.openai, &self.anthropic] {
            let scheme_ok = matches!(uri.scheme_str(), Some("http" | "https"));
            if !scheme_ok || uri.authority().is_none() {
                return Err(ConfigError::BadUpstream { uri: uri.to_string() });
            }
        }
        Ok(())
    }
}
