//! A sandbox's state as the evaluation compares it: the files under the
//! task's directories (type, mode, owner, content hash), the command lines
//! of its processes, and what its probes print (the memory of its servers).

use std::collections::BTreeMap;
use std::os::unix::fs::MetadataExt;
use std::path::Path;

use anyhow::Context;
use crab_tests::Containerd;

mod hashes;

use self::hashes::HASHES;
use super::sandbox;
use super::workload::Task;

/// What a sandbox holds at one point of a task.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct State {
    /// Each file by path from `/`: type, mode, owner, content hash.
    pub files: BTreeMap<String, String>,
    /// The command lines of its processes (crab-init's aside), sorted.
    pub procs: Vec<String>,
    /// Each probe's output.
    pub probes: Vec<String>,
}

// === impl State ===

impl State {
    /// The state of sandbox `id` of `task` now (no command of it may run).
    pub fn capture(ctd: &Containerd, id: &str, task: &Task) -> anyhow::Result<State> {
        let pid = ctd.task_pid(id).with_context(|| format!("{id} has no task"))?;
        let root = format!("/proc/{pid}/root");
        let mut state = State::default();
        for dir in &task.dirs {
            let top = Path::new(&root).join(dir.trim_start_matches('/'));
            // Under /proc/PID/root an absolute link would resolve on the
            // host: a task directory that is no real directory is only named.
            match std::fs::symlink_metadata(&top) {
                Ok(m) if m.is_dir() => walk(Path::new(&root), &top, &task.ignore, &mut state.files),
                Ok(m) => {
                    state
                        .files
                        .insert(dir.clone(), format!("not a directory ({:?})", m.file_type()));
                }
                Err(e) => {
                    state.files.insert(dir.clone(), format!("missing ({})", e.kind()));
                }
            }
        }
        state.procs = procs(&format!("{root}/proc"));
        for probe in &task.probes {
            let out = sandbox::exec(ctd, id, &task.cwd, probe, None)?;
            let mut text = String::from_utf8_lossy(&out.stdout).trim().to_owned();
            if !out.status.success() {
                text = format!("failed ({}): {text}", out.status);
            }
            state.probes.push(text);
        }
        Ok(state)
    }

    /// How `self` differs from `want`, in a line; None when equal.
    pub fn diff(&self, want: &State) -> Option<String> {
        let mut parts = Vec::new();
        let changed: Vec<&String> = want
            .files
            .iter()
            .filter(|(p, v)| self.files.get(*p) != Some(v))
            .map(|(p, _)| p)
            .chain(self.files.keys().filter(|p| !want.files.contains_key(*p)))
            .collect();
        if !changed.is_empty() {
            let shown: Vec<&str> = changed.iter().take(3).map(|s| s.as_str()).collect();
            parts.push(format!(
                "{} files differ ({}{})",
                changed.len(),
                shown.join(", "),
                if changed.len() > 3 { ", …" } else { "" }
            ));
        }
        if self.procs != want.procs {
            let missing: Vec<&String> = want.procs.iter().filter(|p| !self.procs.contains(p)).collect();
            let extra: Vec<&String> = self.procs.iter().filter(|p| !want.procs.contains(p)).collect();
            parts.push(format!("processes differ (missing {missing:?}, extra {extra:?})"));
        }
        if self.probes.len() != want.probes.len() {
            parts.push(format!(
                "{} probes answered, not {}",
                self.probes.len(),
                want.probes.len()
            ));
        }
        for (i, (got, wanted)) in self.probes.iter().zip(&want.probes).enumerate() {
            if got != wanted {
                parts.push(format!("probe {i} says {got:?}, not {wanted:?}"));
            }
        }
        (!parts.is_empty()).then(|| parts.join("; "))
    }
}

/// Whether `rel` (a path from `/`) names an ignored file or lies under one.
fn ignored(rel: &str, ignore: &[String]) -> bool {
    // Where a path part starts: the start, and after each `/`.
    let starts = || std::iter::once(0).chain(rel.match_indices('/').map(|(at, _)| at + 1));
    ignore.iter().filter(|ig| !ig.is_empty()).any(|ig| {
        starts().any(|at| {
            rel[at..].starts_with(ig.as_str())
                && matches!(rel.as_bytes().get(at + ig.len()), None | Some(b'/'))
        })
    })
}

/// Adds every entry under `dir` (of the tree at `root`) to `out`, never
/// following a symlink.
fn walk(root: &Path, dir: &Path, ignore: &[String], out: &mut BTreeMap<String, String>) {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return;
    };
    for entry in entries.flatten() {
        let path = entry.path();
        let rel = path
            .strip_prefix(root)
            .unwrap_or(&path)
            .to_string_lossy()
            .into_owned();
        if ignored(&rel, ignore) {
            continue;
        }
        let Ok(meta) = std::fs::symlink_metadata(&path) else {
            continue;
        };
        let head = format!("{:o} {}:{}", meta.mode(), meta.uid(), meta.gid());
        let value = if meta.file_type().is_symlink() {
            format!(
                "{head} -> {}",
                std::fs::read_link(&path).unwrap_or_default().display()
            )
        } else if meta.is_dir() {
            walk(root, &path, ignore, out);
            format!("{head} dir")
        } else if meta.is_file() {
            format!("{head} {}", HASHES.of(&path, &meta))
        } else {
            format!("{head} special")
        };
        out.insert(rel, value);
    }
}

/// The directories of the processes under `proc_dir` (a `/proc`).
pub fn process_dirs(proc_dir: &str) -> impl Iterator<Item = std::path::PathBuf> {
    std::fs::read_dir(proc_dir)
        .into_iter()
        .flatten()
        .flatten()
        .filter(|e| {
            e.file_name()
                .to_string_lossy()
                .bytes()
                .all(|b| b.is_ascii_digit())
        })
        .map(|e| e.path())
}

/// The command lines under a procfs mount, crab-init's and kernel
/// threads' aside, sorted.
fn procs(proc_dir: &str) -> Vec<String> {
    let mut out: Vec<String> = process_dirs(proc_dir)
        .filter_map(|dir| std::fs::read(dir.join("cmdline")).ok())
        .filter(|c| !c.is_empty())
        .map(|c| {
            String::from_utf8_lossy(&c)
                .trim_end_matches('\0')
                .replace('\0', " ")
        })
        .filter(|c| {
            !c.split(' ')
                .next()
                .is_some_and(|arg0| arg0.ends_with("crab-init"))
        })
        .collect();
    out.sort();
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn state(files: &[(&str, &str)], procs: &[&str], probes: &[&str]) -> State {
        State {
            files: files
                .iter()
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect(),
            procs: procs.iter().map(|s| s.to_string()).collect(),
            probes: probes.iter().map(|s| s.to_string()).collect(),
        }
    }

    #[test]
    fn equal_states_have_no_diff_and_each_kind_of_difference_is_named() {
        let want = state(
            &[("work/a", "644 0:0 1"), ("work/b", "644 0:0 2")],
            &["sleep 1", "python3 kv"],
            &["user=alice"],
        );
        assert_eq!(want.diff(&want.clone()), None);
        let files = state(
            &[("work/a", "644 0:0 9"), ("work/c", "644 0:0 2")],
            &["sleep 1", "python3 kv"],
            &["user=alice"],
        );
        let d = files.diff(&want).unwrap();
        assert!(
            d.contains("3 files differ") && d.contains("work/a") && d.contains("work/c"),
            "{d}"
        );
        let procs = state(
            &[("work/a", "644 0:0 1"), ("work/b", "644 0:0 2")],
            &["sleep 1"],
            &["-"],
        );
        let d = procs.diff(&want).unwrap();
        assert!(
            d.contains("missing [\"python3 kv\"]") && d.contains("probe 0 says \"-\""),
            "{d}"
        );
    }

    #[test]
    fn ignored_names_match_whole_components() {
        let ig = vec![".git/index".to_owned(), "__pycache__".to_owned()];
        assert!(ignored("testbed/.git/index", &ig));
        assert!(ignored("testbed/django/__pycache__", &ig));
        assert!(ignored("testbed/django/__pycache__/x.pyc", &ig));
        assert!(!ignored("testbed/.git/index.lock2", &ig));
        assert!(!ignored("testbed/my__pycache__", &ig));
        assert!(!ignored("testbed/django/models.py", &ig));
        assert!(ignored(".git/index", &ig));
        assert!(!ignored("testbed/x.git/index", &ig));
        assert!(!ignored("testbed/a", &[String::new()]));
        assert!(
            ignored("yx/x/x", &["x/x".to_owned()]),
            "a match after an overlapping one"
        );
    }

    #[test]
    fn a_walk_sees_modes_and_contents_and_follows_no_symlink() {
        let dir = std::env::temp_dir().join(format!("crab-eval-state-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(dir.join("w/__pycache__")).unwrap();
        std::fs::write(dir.join("w/a"), "1").unwrap();
        std::fs::write(dir.join("w/__pycache__/x"), "1").unwrap();
        std::os::unix::fs::symlink("/etc", dir.join("w/etc")).unwrap();
        let mut out = BTreeMap::new();
        walk(&dir, &dir.join("w"), &["__pycache__".to_owned()], &mut out);
        let before = out.clone();
        std::fs::write(dir.join("w/a"), "2").unwrap();
        let mut after = BTreeMap::new();
        walk(&dir, &dir.join("w"), &["__pycache__".to_owned()], &mut after);
        std::fs::remove_dir_all(&dir).unwrap();
        assert_eq!(before.keys().collect::<Vec<_>>(), vec!["w/a", "w/etc"]);
        assert!(before["w/etc"].ends_with("-> /etc"));
        assert_ne!(before["w/a"], after["w/a"]);
    }
}
