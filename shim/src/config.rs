//! `crab.toml`: the configuration every Crab component reads.
//!
//! containerd and docker pass no runtime options to a runtime whose name is not
//! `io.containerd.runc.*`, so everything the shim needs has a default here. The
//! file is optional; a key that is absent takes the value of the embedded
//! `packaging/crab.toml`.

use std::path::{Path, PathBuf};
use std::time::Duration;

use serde::Deserialize;

pub use crab_api::config::{CONFIG_ENV, DEFAULT_CONFIG_PATH};

/// The whole configuration file, as the shim reads it. Every component
/// reads its own table (`[snapshotter]` belongs to the snapshotter); within
/// a table, unknown keys are errors.
#[derive(Debug, Clone, Deserialize)]
pub struct Config {
    /// Settings of `containerd-shim-crab-v2`.
    pub shim: ShimConfig,
    /// How the shim finds crabd (the `[crabd]` table, shared with crabd).
    pub crabd: CrabdShimConfig,
}

/// The keys of `[crabd]` the shim reads (crabd reads the rest).
#[derive(Debug, Clone, Deserialize)]
pub struct CrabdShimConfig {
    /// crabd's management socket.
    pub socket: PathBuf,
    /// crabd's root, where its grants of restores are.
    pub root: PathBuf,
    /// Whether containers register with crabd.
    pub register: bool,
    /// Whether the shim starts crabd when it is not running.
    pub autostart: bool,
    /// What happens when the sandbox's init dies unasked.
    pub recover: crab_api::config::RecoverPolicy,
    /// How long crabd may take for a shim's checkpoint or restore (the
    /// shim waits as long for a recovery), in seconds.
    pub shim_timeout_secs: u64,
    /// The crabd binary.
    pub binary: PathBuf,
}

/// The `[shim]` table.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ShimConfig {
    /// libcontainer's state root: one directory per container id.
    pub state_dir: PathBuf,
    /// Level of the shim's log in containerd's log.
    pub log_level: String,
    /// Deadline of one forked runtime operation, in seconds.
    pub runtime_timeout_secs: u64,
    /// The CRIU binary (a bare name is looked up on `PATH`).
    pub criu: PathBuf,
    /// How CRIU keeps the sandbox's network still while it dumps or
    /// restores TCP connections.
    pub criu_network_lock: NetworkLock,
    /// Run crab-init as the pid 1 of containers with their own pid
    /// namespace (see `crate::init`).
    pub init: bool,
    /// Variables (`NAME=value`) every sandbox's processes get unless
    /// they set the name themselves (see `crate::spec_env`).
    pub env: Vec<crate::spec_env::EnvVar>,
    /// The sandbox's LLM proxy.
    pub proxy: ProxyShimConfig,
}

/// CRIU's `--network-lock` methods.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum NetworkLock {
    /// Rules loaded with `iptables-restore` (CRIU's RPC default).
    Iptables,
    /// A table made through libnftables, inside CRIU.
    Nftables,
    /// No lock: connections dumped while packets flow may be inconsistent.
    Skip,
}

// === impl NetworkLock ===

impl NetworkLock {
    /// The method's name in CRIU's options.
    pub fn as_str(self) -> &'static str {
        match self {
            NetworkLock::Iptables => "iptables",
            NetworkLock::Nftables => "nftables",
            NetworkLock::Skip => "skip",
        }
    }
}

/// The `[shim.proxy]` table: the LLM proxy each sandbox gets.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ProxyShimConfig {
    /// Whether sandboxes get a proxy at all.
    pub enabled: bool,
    /// Port of the listener on 127.0.0.1 in the sandbox's network namespace.
    pub port: u16,
    /// Variable that points OpenAI SDKs at the proxy.
    pub openai_env: String,
    /// Variable that points Anthropic SDKs at the proxy.
    pub anthropic_env: String,
    /// Default OpenAI upstream (no `/v1`).
    pub openai_upstream: String,
    /// Default Anthropic upstream.
    pub anthropic_upstream: String,
    /// Directory of the transcripts.
    pub transcript_dir: PathBuf,
    /// Largest request body, bytes.
    pub max_request_body: usize,
    /// Bytes of a response kept in its transcript record.
    pub transcript_body_cap: usize,
    /// Bytes a sandbox's transcript may grow to (later records dropped).
    pub transcript_max_bytes: u64,
    /// Connections the sandbox's proxy listeners hold at once.
    pub max_connections: usize,
    /// Seconds a client has to send its request head.
    pub client_header_timeout: u64,
    /// Seconds a client has to send its whole request body.
    pub client_body_timeout: u64,
    /// Seconds to connect to the upstream.
    pub upstream_connect_timeout: u64,
    /// Seconds until the upstream's response head.
    pub upstream_header_timeout: u64,
    /// Longest silence within an upstream stream, seconds.
    pub upstream_idle_timeout: u64,
    /// Whole upstream exchange, seconds.
    pub upstream_total_timeout: u64,
    /// Longest hold of an answer, seconds.
    pub hold_timeout: u64,
    /// Whether each turn end asks crabd for a checkpoint (and holds the
    /// turn's answer until its version is published).
    pub checkpoint_on_turn: bool,
    /// The requests that end a turn (`METHOD /path`, or `METHOD /prefix*`).
    pub turn_end_routes: Vec<crab_proxy::RoutePattern>,
    /// Whether a request on those routes that is a side call (another,
    /// shorter conversation than the turns') ends no turn.
    pub side_calls: bool,
    /// Whether the proxy serves the agent's rollback tool (`/crab/`, plain
    /// HTTP and MCP); needs `[crabd] register = true`.
    pub agent_tools: bool,
    /// Tool calls a sandbox may make in any minute (0: unlimited).
    pub tool_calls_per_minute: u32,
}

pub use crab_api::config::ConfigError;

static CONFIG: std::sync::OnceLock<Config> = std::sync::OnceLock::new();

/// Sets the configuration the shim runs with (once, at start).
///
/// # Panics
/// When called twice.
pub fn set(config: Config) {
    assert!(
        CONFIG.set(config).is_ok(),
        "the configuration is set once, at start"
    );
}

/// The configuration, read once at start.
///
/// # Panics
/// Before [`set`].
pub fn get() -> &'static Config {
    CONFIG.get().expect("set in shim_main before anything runs")
}

// === impl Config ===

impl Config {
    /// Reads the file named by `$CRAB_CONFIG`, or [`DEFAULT_CONFIG_PATH`];
    /// a missing file gives the embedded defaults.
    ///
    /// # Errors
    /// The file exists but cannot be read or parsed.
    pub fn load() -> Result<Self, ConfigError> {
        Self::load_from(&crab_api::config::config_path())
    }

    /// Reads `path` over the embedded defaults; a missing file gives the defaults.
    ///
    /// # Errors
    /// The file exists but cannot be read or parsed.
    pub fn load_from(path: &Path) -> Result<Self, ConfigError> {
        crab_api::config::load(path)
    }

    #[cfg(test)]
    fn parse(text: &str) -> Result<Self, toml::de::Error> {
        crab_api::config::parse(text)
    }
}

impl ShimConfig {
    /// Deadline of one forked runtime operation.
    pub fn runtime_timeout(&self) -> Duration {
        Duration::from_secs(self.runtime_timeout_secs)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn check(text: &str, expected_state_dir: Option<&str>) {
        match (Config::parse(text), expected_state_dir) {
            (Ok(cfg), Some(dir)) => assert_eq!(cfg.shim.state_dir, PathBuf::from(dir)),
            (Err(_), None) => {}
            (got, want) => panic!("{text:?}: got {got:?}, want {want:?}"),
        }
    }

    #[test]
    fn defaults_and_overrides() {
        check("", Some("/run/crab/runtime"));
        check("[shim]\nstate_dir = \"/x\"\n", Some("/x"));
        check("[shim]\nlog_level = \"debug\"\n", Some("/run/crab/runtime"));
        check("[shim]\nbogus = 1\n", None);
        check("[shim]\nstate_dir = 3\n", None);
        check("not toml", None);
        check(
            "[shim.proxy]\nturn_end_routes = [\"POST /v1/agents/*\"]\n",
            Some("/run/crab/runtime"),
        );
        check("[shim.proxy]\nturn_end_routes = [\"/no-method\"]\n", None);
    }

    #[test]
    fn missing_file_gives_defaults() {
        let cfg = Config::load_from(Path::new("/nonexistent/crab.toml")).unwrap();
        assert_eq!(cfg.shim.runtime_timeout(), Duration::from_secs(60));
        assert!(
            cfg.shim.proxy.checkpoint_on_turn,
            "every turn is a version by default"
        );
    }
}
