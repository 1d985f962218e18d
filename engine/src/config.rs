//! The `[crabd]` table of `crab.toml`, over the embedded defaults.

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
    /// Whether shims register (read by the shim).
    pub register: bool,
    /// Whether shims start crabd (read by the shim).
    pub autostart: bool,
    /// The crabd binary the shim starts.
    pub binary: PathBuf,
    /// Port of the host listener on 127.0.0.1 for agents outside their
    /// sandbox (`/s/<sandbox>/…`); 0 disables it.
    pub proxy_port: u16,
}

/// What reading the configuration can fail with.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    /// The file exists but cannot be read.
    #[error("read {}: {source}", path.display())]
    Read {
        /// The file.
        path: PathBuf,
        /// Why.
        #[source]
        source: std::io::Error,
    },
    /// The file is not valid TOML or has wrong keys in `[crabd]`.
    #[error("parse {}: {source}", path.display())]
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
        let path = std::env::var_os(CONFIG_ENV)
            .map(PathBuf::from)
            .unwrap_or_else(|| PathBuf::from(DEFAULT_CONFIG_PATH));
        Self::load_from(&path)
    }

    /// Reads `path` over the embedded defaults.
    ///
    /// # Errors
    /// The file exists but cannot be read or parsed.
    pub fn load_from(path: &Path) -> Result<Self, ConfigError> {
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
        let parse = |text: &str| -> Result<CrabdConfig, toml::de::Error> {
            let mut base: toml::Table = toml::from_str(EMBEDDED)?;
            let over: toml::Table = toml::from_str(text)?;
            if let (Some(toml::Value::Table(b)), Some(toml::Value::Table(o))) =
                (base.get_mut("crabd"), over.get("crabd"))
            {
                for (k, v) in o {
                    b.insert(k.clone(), v.clone());
                }
            }
            let file: File = toml::Value::Table(base).try_into()?;
            Ok(file.crabd)
        };
        parse(&text).map_err(|source| ConfigError::Parse {
            path: path.to_owned(),
            source,
        })
    }

    /// How long a shim's checkpoint or restore may take.
    pub fn shim_timeout(&self) -> Duration {
        Duration::from_secs(self.shim_timeout_secs)
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
        std::fs::write(&path, "[crabd]\nroot = \"/x\"\n[shim]\nlog_level = \"debug\"\n").unwrap();
        let cfg = CrabdConfig::load_from(&path).unwrap();
        assert_eq!(cfg.root, PathBuf::from("/x"));
        assert_eq!(cfg.socket, PathBuf::from("/run/crab/crabd.sock"));
        std::fs::write(&path, "[crabd]\nbogus = 1\n").unwrap();
        assert!(CrabdConfig::load_from(&path).is_err());
    }
}
