//! Safety rules (`[crabd.safety]`, the seed's compliance case): a turn
//! whose net effect breaks one is rolled back to the sandbox's head version
//! (its files and processes as at the previous turn end) before its answer
//! is released, and the agent is told why instead (the proxy answers the
//! notice in the provider's format).
//!
//! What is judged: the inspector's report of the turn (changed paths that
//! are absolute, processes left running or exec'd) and, for a turn that
//! changed files on an overlay or btrfs rootfs, the files themselves: each
//! path under a protected glob is compared with the head version's
//! snapshot, so a path the sandbox named relative to its working directory
//! is judged too. A turn the inspector cannot vouch for (lost records) is
//! judged on what it did report.

use std::path::Path;
use std::sync::Arc;
use std::time::Instant;

use crab_api::config::SafetyConfig;
use crab_api::crabd::{CheckpointReport, Registration, SafetyRollback, TurnReport};
use crab_api::{BackendKind, Location, VersionSel};
use crab_snapshotter::SnapshotFiles;

use super::work::{blocking, blocking_io};
use super::{ApiError, Daemon};

/// A broken rule.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) struct Breach {
    /// The rule and its pattern.
    pub rule: String,
    /// What broke it.
    pub what: String,
}

// === impl Daemon ===

impl Daemon {
    /// The first rule turn `report` of `reg`'s sandbox broke, if any. The
    /// caller holds the sandbox's lock.
    pub(super) async fn judge(&self, reg: &Registration, report: &TurnReport) -> Option<Breach> {
        let rules = &self.config.safety;
        if !rules.any() {
            return None;
        }
        if let Some(b) = from_reasons(rules, report) {
            return Some(b);
        }
        if rules.protected_paths.is_empty() || !report.class.needs_fs() {
            return None;
        }
        match self.changed_protected(reg).await {
            Ok(found) => found,
            Err(e) => {
                tracing::warn!(sandbox = %reg.id, error = %crab_api::error_chain(&e), "protected paths not compared with the head version");
                None
            }
        }
    }

    /// The first protected path whose entry differs between the sandbox's
    /// live files and its head version's snapshot (overlay and btrfs).
    async fn changed_protected(&self, reg: &Registration) -> Result<Option<Breach>, ApiError> {
        let store = self.store.clone();
        let sid = reg.id.clone();
        let Some(head) = blocking(move || store.head(&sid)).await? else {
            return Ok(None);
        };
        let store = self.store.clone();
        let sid = reg.id.clone();
        let record = blocking(move || store.get(&sid, head)).await?.record;
        let (Some(fs), Some(layer)) = (record.fs_snapshot, reg.layer.clone()) else {
            return Ok(None);
        };
        let location = match fs.backend {
            BackendKind::OverlayCopy => Location::OverlayCopy {
                upper: layer.clone(),
                store: self.files.store_dir(&reg.id),
            },
            BackendKind::Btrfs => match &reg.own_snapshots {
                Some(l) => l.clone(),
                None => return Ok(None),
            },
            BackendKind::Zfs => return Ok(None),
        };
        let patterns = self.config.safety.protected_paths.clone();
        let id = reg.id.clone();
        blocking_io(move || {
            let fs_error = |source| ApiError::Fs {
                id: id.clone(),
                source,
            };
            let files = crab_snapshotter::open(&location)
                .and_then(|b| b.files(&fs.name))
                .map_err(fs_error)?;
            let (old, new) = match files {
                SnapshotFiles::Tree(dir) => (dir, layer),
                SnapshotFiles::Layer { dir, live } => (dir, live),
            };
            let keep = |rel: &Path| protected(&patterns, rel).is_some();
            let changed = crab_snapshotter::differences(&old, &new, &keep).map_err(fs_error)?;
            // The most specific: the first path no other lies under.
            let leaf = changed
                .iter()
                .enumerate()
                .find(|(i, p)| changed.get(i + 1).is_none_or(|next| !next.starts_with(p)))
                .map(|(_, p)| p);
            Ok(leaf.and_then(|rel| {
                protected(&patterns, rel).map(|pattern| Breach {
                    rule: format!("protected_paths {pattern:?}"),
                    what: format!("/{}", rel.display()),
                })
            }))
        })
        .await
    }

    /// Puts sandbox `reg` back to its head version `head` because its turn
    /// broke a rule, and answers what its turn ends get: the head's record
    /// and the rollback (whose notice the agent gets). `inside`: the agent
    /// runs in the sandbox and is restored too (it gets the notice as the
    /// answer it asks again). The caller holds the sandbox's lock.
    pub(super) async fn roll_back_turn(
        self: &Arc<Self>,
        reg: &Registration,
        head: u64,
        breach: Breach,
        inside: bool,
    ) -> Result<CheckpointReport, ApiError> {
        let started = Instant::now();
        let notice = self
            .config
            .safety
            .notice
            .replace("{rule}", &breach.rule)
            .replace("{what}", &breach.what);
        tracing::warn!(sandbox = %reg.id, rule = breach.rule, what = breach.what, version = head, "the turn broke a safety rule: rolling back");
        let done = self
            .restore_version(
                reg,
                VersionSel::Number(head),
                true,
                inside.then(|| notice.clone()),
            )
            .await?;
        self.metrics.safety_rollbacks.inc();
        let store = self.store.clone();
        let sid = reg.id.clone();
        let version = blocking(move || store.get(&sid, done.version)).await?.record;
        Ok(CheckpointReport {
            version,
            frozen_ms: 0.0,
            total_ms: started.elapsed().as_secs_f64() * 1e3,
            rolled_back: Some(SafetyRollback {
                rule: breach.rule,
                what: breach.what,
                version: done.version,
                notice,
            }),
        })
    }
}

/// The first rule the reasons of `report` show broken.
fn from_reasons(rules: &SafetyConfig, report: &TurnReport) -> Option<Breach> {
    for reason in &report.reasons {
        let kind = reason["kind"].as_str().unwrap_or_default();
        match kind {
            "changed" | "mapped_file_changed" => {
                let Some(path) = reason["path"].as_str().filter(|p| p.starts_with('/')) else {
                    continue;
                };
                if let Some(pattern) = protected(&rules.protected_paths, Path::new(path)) {
                    return Some(Breach {
                        rule: format!("protected_paths {pattern:?}"),
                        what: path.to_owned(),
                    });
                }
            }
            "started" | "execed" => {
                let Some(comm) = reason["comm"].as_str() else {
                    continue;
                };
                if rules.forbidden_commands.iter().any(|c| c == comm) {
                    return Some(Breach {
                        rule: format!("forbidden_commands {comm:?}"),
                        what: format!("{comm} (pid {})", reason["pid"]),
                    });
                }
            }
            _ => {}
        }
    }
    None
}

/// The first of `patterns` that `path` (absolute, or relative to the
/// sandbox's root) matches.
fn protected<'a>(patterns: &'a [String], path: &Path) -> Option<&'a str> {
    let path = path.to_string_lossy();
    patterns
        .iter()
        .map(String::as_str)
        .find(|pattern| glob(pattern, &path))
}

/// Whether `path` matches `pattern`, component by component: `**` any
/// number of components, `*` any run and `?` any one character within one.
fn glob(pattern: &str, path: &str) -> bool {
    let split = |s: &str| -> Vec<String> {
        s.split('/')
            .filter(|c| !c.is_empty() && *c != ".")
            .map(str::to_owned)
            .collect()
    };
    fn go(p: &[String], s: &[String]) -> bool {
        match p.split_first() {
            None => s.is_empty(),
            Some((first, rest)) if first == "**" => (0..=s.len()).any(|i| go(rest, &s[i..])),
            Some((first, rest)) => s
                .split_first()
                .is_some_and(|(c, more)| component(first.as_bytes(), c.as_bytes()) && go(rest, more)),
        }
    }
    go(&split(pattern), &split(path))
}

fn component(p: &[u8], s: &[u8]) -> bool {
    match (p.split_first(), s.split_first()) {
        (None, None) => true,
        (Some((b'*', rest)), _) => (0..=s.len()).any(|i| component(rest, &s[i..])),
        (Some((b'?', rest)), Some((_, more))) => component(rest, more),
        (Some((a, rest)), Some((b, more))) if a == b => component(rest, more),
        _ => false,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn globs() {
        for (pattern, path, want) in [
            ("/etc/**", "/etc/passwd", true),
            ("/etc/**", "/etc", true),
            ("/etc/**", "/etc/ssh/sshd_config", true),
            ("/etc/**", "/etcetera/x", false),
            ("/etc/**", "etc/passwd", true),
            ("/**/.git/**", "/testbed/.git/HEAD", true),
            ("/**/.git/**", "/testbed/src/.gitignore", false),
            ("/home/*/.ssh/*", "/home/ann/.ssh/id_rsa", true),
            ("/home/*/.ssh/*", "/home/ann/x/.ssh/id_rsa", false),
            ("/tmp/?.log", "/tmp/a.log", true),
            ("/tmp/?.log", "/tmp/ab.log", false),
            ("/usr/bin/*", "/usr/bin", false),
        ] {
            assert_eq!(glob(pattern, path), want, "{pattern} {path}");
        }
    }

    #[test]
    fn reasons_are_judged() {
        let rules = SafetyConfig {
            protected_paths: vec!["/etc/**".into()],
            forbidden_commands: vec!["nc".into()],
            notice: String::new(),
        };
        let report = |reasons: Vec<serde_json::Value>| TurnReport {
            sandbox: crab_api::SandboxId::new("s").unwrap(),
            turn: 1,
            class: crab_api::Class::Full,
            n_reasons: reasons.len(),
            reasons,
        };
        let ok = report(vec![
            serde_json::json!({"kind": "changed", "path": "/tmp/x"}),
            serde_json::json!({"kind": "changed", "path": "passwd"}),
            serde_json::json!({"kind": "started", "pid": 9, "comm": "python3"}),
        ]);
        assert_eq!(from_reasons(&rules, &ok), None);
        let bad = report(vec![
            serde_json::json!({"kind": "changed", "path": "/etc/passwd"}),
        ]);
        assert_eq!(from_reasons(&rules, &bad).unwrap().what, "/etc/passwd");
        let bad = report(vec![
            serde_json::json!({"kind": "started", "pid": 9, "comm": "nc"}),
        ]);
        assert!(from_reasons(&rules, &bad).unwrap().rule.contains("nc"));
    }
}
