//! A sandbox's state as the evaluation compares it: the files under the
//! task's directories (type, mode, owner, content hash), the command lines
//! of its processes, and what its probes print (the memory of its servers).

use std::collections::BTreeMap;
use std::hash::Hasher;
use std::os::unix::fs::MetadataExt;
use std::path::Path;

use anyhow::Context;
use crab_tests::Containerd;

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
    ignore.iter().filter(|ig| !ig.is_empty()).any(|ig| {
        rel.match_indices(ig.as_str()).any(|(at, _)| {
            (at == 0 || rel.as_bytes()[at - 1] == b'/')
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

/// Content hashes of files that cannot have changed since they were
/// hashed, by the file's identity: device, inode, size, modification and
/// change times. A capture after every step of 32 sandboxes hashed each
/// sandbox's whole tree again (about 130 ms of CPU at that load), where
/// nearly every file was untouched since the last.
///
/// The change time (ctime) is the kernel's: no call sets it, and every
/// change of content or of the inode (a write, a rename onto, a reused
/// inode number) sets it to now. Its clock is coarse (a tick), so as git
/// does with its index, only a file whose ctime was at least [`SETTLED`]
/// old when its read began, and that is unchanged at its end, is
/// remembered: a later write moves its ctime past the remembered one. The
/// device keeps sandboxes apart: an overlay reports its own device, or
/// the real file's device and inode, so two sandboxes' copies of a file,
/// written in the same tick to the same size, are never one identity.
struct Hashes(std::sync::Mutex<BTreeMap<Identity, u64>>);

/// A file as [`Hashes`] knows it: device, inode, size, mtime and ctime (ns).
type Identity = (u64, u64, u64, i128, i128);

/// How old a file's ctime must be for its hash to be remembered.
const SETTLED: std::time::Duration = std::time::Duration::from_secs(2);

/// The most hashes remembered; past it they are forgotten at once.
const MAX_HASHES: usize = 1 << 20;

static HASHES: Hashes = Hashes(std::sync::Mutex::new(BTreeMap::new()));

impl Hashes {
    /// The content hash of the file at `path`, whose metadata (not
    /// following a link) is `meta`.
    fn of(&self, path: &Path, meta: &std::fs::Metadata) -> String {
        let id = identity(meta);
        if let Some(h) = self.0.lock().expect("hashes").get(&id) {
            return format!("{h:016x}");
        }
        let started = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos() as i128);
        let hash = hash_file(path);
        // Settled before the read began, and unchanged by its end.
        let settled = id.4 + SETTLED.as_nanos() as i128 <= started
            && std::fs::symlink_metadata(path).is_ok_and(|m| identity(&m) == id);
        if let (true, Ok(h)) = (settled, &hash) {
            let mut known = self.0.lock().expect("hashes");
            if known.len() >= MAX_HASHES {
                known.clear();
            }
            known.insert(id, *h);
        }
        match hash {
            Ok(h) => format!("{h:016x}"),
            Err(what) => what,
        }
    }
}

/// A file's [`Identity`].
fn identity(meta: &std::fs::Metadata) -> Identity {
    let ns = |secs: i64, nsec: i64| i128::from(secs) * 1_000_000_000 + i128::from(nsec);
    (
        meta.dev(),
        meta.ino(),
        meta.size(),
        ns(meta.mtime(), meta.mtime_nsec()),
        ns(meta.ctime(), meta.ctime_nsec()),
    )
}

/// A 64-bit hash of a file's content (equality, not security).
/// Opened without following a link and without blocking (a fifo swapped
/// in), streamed; an error is a value of its own, never an empty file's.
fn hash_file(path: &Path) -> Result<u64, String> {
    use std::io::Read;
    use std::os::unix::fs::OpenOptionsExt;
    let opened = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(nix::libc::O_NOFOLLOW | nix::libc::O_NONBLOCK)
        .open(path);
    let mut file = match opened {
        Ok(f) if f.metadata().is_ok_and(|m| m.is_file()) => f,
        Ok(_) => return Err("no longer a regular file".into()),
        Err(e) => return Err(format!("unreadable ({})", e.kind())),
    };
    let mut h = std::collections::hash_map::DefaultHasher::new();
    let mut buf = vec![0u8; 1 << 16];
    loop {
        match file.read(&mut buf) {
            Ok(0) => return Ok(h.finish()),
            Ok(n) => h.write(&buf[..n]),
            Err(e) => return Err(format!("unreadable ({})", e.kind())),
        }
    }
}

/// The command lines under a procfs mount, crab-init's and kernel
/// threads' aside, sorted.
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
    }

    #[test]
    fn a_remembered_hash_serves_only_a_file_unchanged_since_it_settled() {
        let dir = std::env::temp_dir().join(format!("crab-eval-hashes-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        let (fresh, old) = (dir.join("fresh"), dir.join("old"));
        std::fs::write(&fresh, "1").unwrap();
        std::fs::write(&old, "1").unwrap();
        let hashes = Hashes(std::sync::Mutex::new(BTreeMap::new()));
        let meta = |p: &Path| std::fs::symlink_metadata(p).unwrap();
        // Just written: hashed, not remembered (a write in the same tick
        // would not move its ctime).
        let first = hashes.of(&fresh, &meta(&fresh));
        assert!(hashes.0.lock().unwrap().is_empty());
        // A file whose ctime is old is remembered, and its hash is given
        // back for the same identity without reading it.
        let settled = meta(&old);
        std::thread::sleep(SETTLED + std::time::Duration::from_millis(50));
        assert_eq!(hashes.of(&old, &settled), first);
        assert_eq!(hashes.0.lock().unwrap().len(), 1);
        // Changed: a new ctime, so a new identity, read again.
        std::fs::write(&old, "2").unwrap();
        let changed = hashes.of(&old, &meta(&old));
        assert_ne!(changed, first);
        // The remembered identity still answers what the file held then.
        assert_eq!(hashes.of(&old, &settled), first);
        std::fs::remove_dir_all(&dir).unwrap();
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
