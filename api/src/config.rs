//! `crab.toml`, the configuration every Crab component reads, over the
//! embedded defaults (`packaging/crab.toml`): the loader every component
//! uses, and crabd's own `[crabd]` table.

use std::path::{Path, PathBuf};
use std::time::Duration;

use serde::Deserialize;

/// Where the configuration is read from when `$CRAB_CONFIG` is unset.
pub const DEFAULT_CONFIG_PATH: &str = "/etc/crab/crab.toml";
/// Environment variable that overrides [`DEFAULT_CONFIG_PATH`].
pub const CONFIG_ENV: &str = "CRAB_CONFIG";

const EMBEDDED: &str = include_str!("../../packaging/crab.toml");

/// crabd's settings.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CrabdConfig {
    /// The management API's socket.
    pub socket: PathBuf,
    /// Versions, process images and file snapshots.
    pub root: PathBuf,
    /// How long a shim's checkpoint or restore may take, in seconds.
    pub shim_timeout_secs: u64,
    /// Versions kept per sandbox after each checkpoint (0: all).
    pub keep_versions: usize,
    /// No checkpoint is taken while the filesystem of `root` has less than
    /// this many bytes free (0: no floor).
    pub store_min_free_bytes: u64,
    /// No checkpoint of a sandbox is taken while its process images and
    /// file copies under `root` take this many bytes or more (0: no
    /// ceiling). ZFS and btrfs snapshots are their pool's to bound.
    pub sandbox_store_max_bytes: u64,
    /// Whether crabd loads the eBPF inspector to classify turns.
    pub inspector: bool,
    /// Where the inspector's programs and maps are pinned (bpffs).
    pub inspector_pin_dir: PathBuf,
    /// Processes (by comm) whose memory churn is not a change worth
    /// saving; their exec, fork, exit and cwd changes still count.
    pub noisy_comms: Vec<String>,
    /// Whether shims register (read by the shim).
    pub register: bool,
    /// Whether shims start crabd (read by the shim).
    pub autostart: bool,
    /// What a shim does when its sandbox's init dies unasked (read by the
    /// shim).
    pub recover: RecoverPolicy,
    /// The crabd binary the shim starts.
    pub binary: PathBuf,
    /// containerd's socket, where imported sandboxes are created by default.
    pub containerd: PathBuf,
    /// The containerd namespace imported sandboxes go to by default.
    pub namespace: String,
    /// Host directories an imported container may bind-mount (read-only,
    /// from under one of them).
    pub import_bind_sources: Vec<PathBuf>,
    /// Port of the host listener on 127.0.0.1 for agents outside their
    /// sandbox (`/s/<sandbox>/…`); 0 disables it.
    pub proxy_port: u16,
    /// Port of crabd's page on 127.0.0.1 (`crabctl ui` prints its URL,
    /// whose secret only root can get); 0 disables it.
    pub ui_port: u16,
    /// Seconds between two looks at stopped sandboxes, whose history goes
    /// once containerd has removed their container.
    pub gc_interval_secs: u64,
    /// At crabd's first start after the host booted, resume every sandbox
    /// it knew running whose task is gone, from its head version.
    pub resume_on_boot: bool,
    /// On SIGTERM, drain first (see `crabctl drain`) with this grace in
    /// seconds; 0: stop at once.
    pub drain_grace_secs: u64,
    /// Where that drain exports each sandbox; empty: no export.
    pub drain_export_dir: PathBuf,
    /// The host's checkpoint queue (`[crabd.schedule]`).
    pub schedule: ScheduleConfig,
    /// Rules a turn must keep (`[crabd.safety]`).
    pub safety: SafetyConfig,
}

/// `[crabd.safety]`: rules over what the inspector reports of a turn. A
/// turn that breaks one is rolled back to the sandbox's head version
/// (files and processes) before its answer is released, and the agent gets
/// `notice` instead of the LLM's answer.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SafetyConfig {
    /// Paths that must not change, as globs over the sandbox's absolute
    /// paths (`*` within a component, `**` any number of components).
    pub protected_paths: Vec<String>,
    /// Command names (`comm`) that must not be left running at a turn's
    /// end, nor be exec'd by a process that was.
    pub forbidden_commands: Vec<String>,
    /// What the agent is told; `{rule}` and `{what}` are filled in.
    pub notice: String,
}

impl SafetyConfig {
    /// Whether any rule is set.
    pub fn any(&self) -> bool {
        !self.protected_paths.is_empty() || !self.forbidden_commands.is_empty()
    }
}

/// `[crabd] recover`: what happens to a sandbox whose init dies without
/// containerd or docker having asked (killed from outside, OOM, a crash).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum RecoverPolicy {
    /// Its head version is restored into the same container (the task
    /// keeps running with a new pid); repeated crashes back off, then the
    /// exit is reported as usual.
    OnCrash,
    /// The exit is reported as usual.
    Off,
}

/// `[crabd.schedule]`: how crabd shapes the checkpoint work of every
/// sandbox on the host.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ScheduleConfig {
    /// Checkpoints that run at once; 0: four per core of the host (a capture mostly waits).
    pub slots: usize,
    /// Bytes per second checkpoints may write; 0: half of what a disk probe
    /// measured (run once, kept in `<root>/disk-probe.json`); -1: no limit.
    pub bytes_per_sec: i64,
    /// The answer time a sandbox's turn is expected to take until its
    /// proxy has seen one, in milliseconds.
    pub default_answer_ms: u64,
    /// A TCP address (`127.0.0.1:9479`) on which crabd also serves
    /// `/metrics`; empty: only on its socket.
    pub metrics_address: String,
}

/// What reading the configuration can fail with.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    /// The file exists but cannot be read.
    #[error("cannot read config {}", path.display())]
    Read {
        /// The file.
        path: PathBuf,
        /// Why.
        #[source]
        source: std::io::Error,
    },
    /// The file is not valid TOML, or a table has unknown keys or wrong types.
    #[error("invalid config {}", path.display())]
    Parse {
        /// The file.
        path: PathBuf,
        /// Why.
        #[source]
        source: toml::de::Error,
    },
}

#[derive(Deserialize)]
struct File {
    crabd: CrabdConfig,
}

// === impl CrabdConfig ===

impl CrabdConfig {
    /// Reads `$CRAB_CONFIG` or [`DEFAULT_CONFIG_PATH`]; a missing file
    /// gives the embedded defaults.
    ///
    /// # Errors
    /// The file exists but cannot be read or parsed.
    pub fn load() -> Result<Self, ConfigError> {
        Self::load_from(&config_path())
    }

    /// Reads `path` over the embedded defaults.
    ///
    /// # Errors
    /// The file exists but cannot be read or parsed.
    pub fn load_from(path: &Path) -> Result<Self, ConfigError> {
        load::<File>(path).map(|f| f.crabd)
    }

    /// How long a shim's checkpoint or restore may take.
    pub fn shim_timeout(&self) -> Duration {
        Duration::from_secs(self.shim_timeout_secs)
    }

    /// How often stopped sandboxes are looked at (at least once a second).
    pub fn gc_interval(&self) -> Duration {
        Duration::from_secs(self.gc_interval_secs.max(1))
    }
}

/// The configuration file's path: `$CRAB_CONFIG`, or [`DEFAULT_CONFIG_PATH`].
pub fn config_path() -> PathBuf {
    std::env::var_os(CONFIG_ENV)
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(DEFAULT_CONFIG_PATH))
}

/// The directory of the transcripts (`[shim.proxy] transcript_dir` of
/// `path` over the embedded defaults): crabd writes an imported sandbox's
/// conversation where its shim will keep it.
///
/// # Errors
/// As [`load`].
pub fn transcript_dir(path: &Path) -> Result<PathBuf, ConfigError> {
    #[derive(serde::Deserialize)]
    struct File {
        shim: Shim,
    }
    #[derive(serde::Deserialize)]
    struct Shim {
        proxy: Proxy,
    }
    #[derive(serde::Deserialize)]
    struct Proxy {
        transcript_dir: PathBuf,
    }
    load::<File>(path).map(|f| f.shim.proxy.transcript_dir)
}

/// Reads `path` (a missing file is an empty one) over the embedded
/// `packaging/crab.toml` and deserializes the merged whole as `T`, each
/// component taking the tables it knows.
///
/// # Errors
/// The file exists but cannot be read, or the merge does not parse as `T`.
pub fn load<T: serde::de::DeserializeOwned>(path: &Path) -> Result<T, ConfigError> {
    let text = match std::fs::read_to_string(path) {
        Ok(t) => t,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => String::new(),
        Err(source) => {
            return Err(ConfigError::Read {
                path: path.to_owned(),
                source,
            })
        }
    };
    parse(&text).map_err(|source| ConfigError::Parse {
        path: path.to_owned(),
        source,
    })
}

/// Parses `text` as overrides of the embedded defaults, as `T`.
///
/// # Errors
/// `text` is not TOML, or the merge does not parse as `T`.
pub fn parse<T: serde::de::DeserializeOwned>(text: &str) -> Result<T, toml::de::Error> {
    let mut merged: toml::Table = toml::from_str(EMBEDDED)?;
    let overrides: toml::Table = toml::from_str(text)?;
    merge(&mut merged, overrides);
    toml::Value::Table(merged).try_into()
}

/// Deep-merges `over` into `base`: tables merge key by key, values replace.
fn merge(base: &mut toml::Table, over: toml::Table) {
    for (key, value) in over {
        match (base.get_mut(&key), value) {
            (Some(toml::Value::Table(b)), toml::Value::Table(o)) => merge(b, o),
            (_, value) => {
                base.insert(key, value);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn defaults_and_overrides() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("crab.toml");
        let cfg = CrabdConfig::load_from(&path).unwrap();
        assert_eq!(cfg.socket, PathBuf::from("/run/crab/crabd.sock"));
        assert_eq!(cfg.proxy_port, 7879);
        assert_eq!(cfg.ui_port, 7880);
        std::fs::write(&path, "[crabd]\nroot = \"/x\"\n[shim]\nlog_level = \"debug\"\n").unwrap();
        let cfg = CrabdConfig::load_from(&path).unwrap();
        assert_eq!(cfg.root, PathBuf::from("/x"));
        assert_eq!(cfg.socket, PathBuf::from("/run/crab/crabd.sock"));
        std::fs::write(&path, "[crabd]\nbogus = 1\n").unwrap();
        assert!(CrabdConfig::load_from(&path).is_err());
    }
}
