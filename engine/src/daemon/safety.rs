//! Safety rules (`[crabd.safety]`, the seed's compliance case): a turn
//! whose net effect breaks one is rolled back to the sandbox's head version
//! (its files and processes as at the previous turn end) before its answer
//! is released, and the agent is told why instead (the proxy answers the
//! notice in the provider's format).
//!
//! What is judged, once the turn's version is captured: the inspector's
//! report of the turn (changed absolute paths, processes left running or
//! exec'd) and, on an overlay or btrfs rootfs, the captured files
//! themselves: each path under a protected glob is compared with the last
//! clean version's snapshot (both static, out of the sandbox's reach), so a
//! path named relative to a working directory, or changed after the
//! inspector's look, is judged too. The target of a rollback is the last
//! version judged clean (after a crabd restart, the turn's parent), never a
//! version the rules did not see (a checkpoint by hand or by the agent's
//! tool). Fails closed: a breach that cannot be undone, or files that
//! cannot be compared, withhold the LLM's answer.

use std::path::Path;
use std::sync::Arc;

use crab_api::config::SafetyConfig;
use crab_api::crabd::{CheckpointReport, Registration, SafetyRollback, TurnReport};
use crab_api::{BackendKind, Location, VersionSel};
use crab_snapshotter::SnapshotFiles;

use super::versions::Pick;
use super::work::{blocking, blocking_io};
use super::{ApiError, Daemon};

/// Safety rollbacks in a row (no clean turn between) before crabd stops
/// rolling back and only withholds answers.
const MAX_BREACHES: u32 = 3;

/// The longest name of what broke a rule that a notice quotes.
const MAX_WHAT: usize = 200;

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
    /// Holds turn version `made` of `reg`'s sandbox to the safety rules:
    /// answers it as it is when no rule is set or none is broken (it is
    /// then the sandbox's last clean version); else puts the sandbox back
    /// to its last clean version (the turn's parent after a crabd restart)
    /// and answers the rollback, whose notice the agent gets instead of the
    /// LLM's answer. Fails closed: a breach that cannot be undone, or a
    /// check that cannot be made, still withholds the answer (the notice
    /// says so). `inside`: the agent runs in the sandbox and is restored
    /// with it. The caller holds the sandbox's lock.
    pub(super) async fn enforce(
        self: &Arc<Self>,
        reg: &Registration,
        report: &TurnReport,
        made: CheckpointReport,
        inside: bool,
    ) -> CheckpointReport {
        if !self.config.safety.any() {
            return made;
        }
        let baseline = self.clean.lock().get(&reg.id).copied().or(made.version.parent);
        let breach = match from_reasons(&self.config.safety, report) {
            Some(b) => Some(b),
            None => self
                .changed_protected(reg, baseline, &made.version)
                .await
                .unwrap_or_else(|e| {
                    Some(Breach {
                        rule: "safety check".into(),
                        what: format!("the files could not be compared: {}", crab_api::error_chain(&e)),
                    })
                }),
        };
        let Some(breach) = breach else {
            self.clean.lock().insert(reg.id.clone(), made.version.version);
            self.breaches.lock().remove(&reg.id);
            return made;
        };
        self.undo(reg, made, breach, baseline, inside, true).await
    }

    /// Puts sandbox `reg` back to `baseline` (its last clean version)
    /// because of `breach`, and answers the rollback; withholds the answer
    /// when it cannot (no baseline, a breach in every rollback, a failed
    /// restore). `made` stands for the turn. `keep_undo`: the restore
    /// takes an undo checkpoint first (not when the turn's own capture
    /// failed: that one would fail the same way). The caller holds the
    /// lock.
    async fn undo(
        self: &Arc<Self>,
        reg: &Registration,
        made: CheckpointReport,
        breach: Breach,
        baseline: Option<u64>,
        inside: bool,
        keep_undo: bool,
    ) -> CheckpointReport {
        let streak = {
            let mut b = self.breaches.lock();
            let n = b.entry(reg.id.clone()).or_default();
            *n += 1;
            *n
        };
        // Quoted and cut: the sandbox chose the name, and the notice is
        // spoken to the agent as its own assistant's words.
        let what: String = format!("{:?}", breach.what).chars().take(MAX_WHAT).collect();
        let notice = self
            .config
            .safety
            .notice
            .replace("{rule}", &breach.rule)
            .replace("{what}", &what);
        tracing::warn!(sandbox = %reg.id, rule = breach.rule, what = breach.what, version = made.version.version, back_to = ?baseline, "the turn broke a safety rule: rolling back");
        let Some(target) = baseline else {
            tracing::error!(sandbox = %reg.id, "no version to go back to: the turn's answer is withheld");
            return withheld(made, breach, &notice, "no earlier version to go back to");
        };
        if streak > MAX_BREACHES {
            // The clean version itself leads back to the breach (a process
            // of it does it again): rolling back once more would loop.
            tracing::error!(sandbox = %reg.id, streak, "breach after breach: no more rollbacks, the turn's answer is withheld");
            return withheld(made, breach, &notice, "it happened again after every rollback");
        }
        let restored = self
            .restore_version(
                reg,
                Pick::Sel(VersionSel::Number(target)),
                keep_undo,
                Some(inside.then(|| notice.clone())),
            )
            .await;
        // What broke the rule, quoted and cut as in the notice.
        let reason = format!("safety rule {}: {what}", breach.rule);
        self.log_event(&reg.id, super::rollback::rollback_event(&restored, Some(reason)));
        match restored {
            Ok(done) => {
                self.metrics.safety_rollbacks.inc();
                self.clean.lock().insert(reg.id.clone(), done.version);
                let store = self.store.clone();
                let sid = reg.id.clone();
                let version = match blocking(move || store.get(&sid, done.version)).await {
                    Ok(v) => v.record,
                    Err(_) => made.version.clone(),
                };
                CheckpointReport {
                    version,
                    frozen_ms: 0.0,
                    total_ms: made.total_ms,
                    rolled_back: Some(SafetyRollback {
                        rule: breach.rule,
                        what: breach.what,
                        version: done.version,
                        notice,
                    }),
                }
            }
            Err(e) => {
                tracing::error!(sandbox = %reg.id, error = %crab_api::error_chain(&e), "the safety rollback failed: the turn's answer is withheld");
                withheld(made, breach, &notice, "the rollback failed")
            }
        }
    }

    /// A turn whose capture failed while rules are set (fails closed: a
    /// sandbox cannot dodge the rules by making its checkpoint fail). What
    /// the inspector saw is judged: a breach is undone as in a captured
    /// turn (back to the last clean version); else, as its files cannot be
    /// judged, the answer is withheld and the notice says so. None when no
    /// rule is set, the failure is crabd's own race or a rootfs no backend
    /// can capture (the turn end fails as before), or the sandbox has no
    /// version at all (its first turn). The error stays in crabd's log (it
    /// names host paths). The caller holds the sandbox's lock.
    pub(super) async fn unjudged(
        self: &Arc<Self>,
        reg: &Registration,
        report: &TurnReport,
        inside: bool,
        error: &ApiError,
    ) -> Option<CheckpointReport> {
        if !self.config.safety.any()
            || matches!(error, ApiError::NoFsBackend { .. } | ApiError::HeadMoved { .. })
        {
            return None;
        }
        let clean = self.clean.lock().get(&reg.id).copied();
        let store = self.store.clone();
        let sid = reg.id.clone();
        // The last clean version, else (pruned, or crabd restarted) the
        // newest one: the version the verdict names.
        let record = blocking(move || {
            let clean = match clean {
                Some(n) => store.record(&sid, n)?,
                None => None,
            };
            Ok(match clean {
                Some(r) => Some(r),
                None => store.versions(&sid)?.into_iter().rev().find_map(|v| v.record),
            })
        })
        .await
        .ok()
        .flatten()?;
        tracing::error!(sandbox = %reg.id, error = %crab_api::error_chain(error), "the turn could not be captured: judged on what the inspector saw (safety rules are set)");
        let made = CheckpointReport {
            version: record,
            frozen_ms: 0.0,
            total_ms: 0.0,
            rolled_back: None,
        };
        if let Some(breach) = from_reasons(&self.config.safety, report) {
            let baseline = Some(made.version.version);
            return Some(self.undo(reg, made, breach, baseline, inside, false).await);
        }
        let breach = Breach {
            rule: "safety check".into(),
            what: "the turn's checkpoint failed".into(),
        };
        let notice = self
            .config
            .safety
            .notice
            .replace("{rule}", &breach.rule)
            .replace("{what}", &format!("{:?}", breach.what));
        Some(withheld(
            made,
            breach,
            &notice,
            "what the turn changed could not be checked",
        ))
    }

    /// The first protected path whose entry differs between version
    /// `made`'s files and version `baseline`'s (both snapshots crabd or
    /// the backend keeps, which the sandbox cannot change; overlay and
    /// btrfs). None when the turn changed no files.
    async fn changed_protected(
        &self,
        reg: &Registration,
        baseline: Option<u64>,
        made: &crab_api::VersionRecord,
    ) -> Result<Option<Breach>, ApiError> {
        let rules = &self.config.safety;
        let (Some(base), Some(new_fs)) = (baseline, made.fs_snapshot.clone()) else {
            return Ok(None);
        };
        if rules.protected_paths.is_empty() {
            return Ok(None);
        }
        let store = self.store.clone();
        let sid = reg.id.clone();
        let Some(old_fs) = blocking(move || store.get(&sid, base)).await?.record.fs_snapshot else {
            return Ok(None);
        };
        if old_fs.name == new_fs.name {
            return Ok(None);
        }
        let location = match new_fs.backend {
            BackendKind::OverlayCopy => match reg.layer.clone() {
                Some(upper) => Location::OverlayCopy {
                    upper,
                    store: self.files.store_dir(&reg.id),
                },
                None => return Ok(None),
            },
            BackendKind::Btrfs => match &reg.own_snapshots {
                Some(l) => l.clone(),
                None => return Ok(None),
            },
            // Judged on the inspector's absolute paths alone.
            BackendKind::Zfs => return Ok(None),
        };
        let patterns = rules.protected_paths.clone();
        let id = reg.id.clone();
        blocking_io(move || {
            let fs_error = |source| ApiError::Fs {
                id: id.clone(),
                source,
            };
            let backend = crab_snapshotter::open(&location).map_err(fs_error)?;
            let dir = |name| match backend.files(name).map_err(fs_error)? {
                SnapshotFiles::Tree(dir) | SnapshotFiles::Layer { dir, .. } => Ok::<_, ApiError>(dir),
            };
            let (old, new) = (dir(&old_fs.name)?, dir(&new_fs.name)?);
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
}

/// A breach that could not be undone: the turn's version stands, and the
/// agent gets the notice (saying so) instead of the LLM's answer.
fn withheld(made: CheckpointReport, breach: Breach, notice: &str, why: &str) -> CheckpointReport {
    let version = made.version.version;
    CheckpointReport {
        rolled_back: Some(SafetyRollback {
            rule: breach.rule,
            what: breach.what,
            version,
            notice: format!("{notice} (Crab could not undo it: {why}; ask the sandbox's owner.)"),
        }),
        ..made
    }
}

/// The first rule the reasons of `report` show broken.
fn from_reasons(rules: &SafetyConfig, report: &TurnReport) -> Option<Breach> {
    for reason in &report.reasons {
        let kind = reason["kind"].as_str().unwrap_or_default();
        match kind {
            "changed" | "mapped_file_changed" => {
                // `..` cannot be resolved by name: the files themselves are
                // compared instead.
                let Some(path) = reason["path"]
                    .as_str()
                    .filter(|p| p.starts_with('/') && !p.split('/').any(|c| c == ".."))
                else {
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
                        what: comm.to_owned(),
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
