//! The net change of one turn, computed from the kernel's records.
//!
//! Paths are keyed by the directory they were resolved from (device and
//! inode of the working directory, the `dirfd`, or the root for absolute
//! names) plus the name as given, normalized. Two spellings of one file make
//! two keys: that can only make a temporary file look lasting (a false
//! positive), never hide a change.
//!
//! Invariant: a key is a net change unless the first operation of the turn
//! on it proved it absent at the turn's start (the call created it: `open`
//! that reported `FMODE_CREATED`, `mkdir`, `mknod`, `symlink`, `link`,
//! `renameat2(RENAME_NOREPLACE)`) and the last one left it absent.

use std::collections::{HashMap, HashSet};

use crate::kernel::{c_str, kind, op, user_dev, Event, NR_MMAP};
use crate::report::Reason;

/// One turn's records, digested.
#[derive(Debug, Default)]
pub(crate) struct Ledger {
    paths: HashMap<PathKey, PathFate>,
    /// Other spellings of a key (the canonical parent-and-basename of an
    /// opened file): an operation on a key applies to its aliases too.
    aliases: HashMap<PathKey, Vec<PathKey>>,
    /// Inodes that existed before the turn and were written: (dev, ino) → name.
    written: HashMap<(u64, u64), String>,
    /// Process changes, one per (pid, kind).
    procs: Vec<Reason>,
    proc_seen: HashSet<(u32, u32)>,
    /// Operations the inspector cannot follow (io_uring, ptrace, …).
    unsure: Vec<String>,
    /// Shared writable file mappings made this turn: (pid, user-space
    /// device, file name).
    pub shared_mapped: Vec<(u32, u64, String)>,
    /// Long-lived noisy processes that ran (no process change by
    /// themselves, but they may store into a shared mapping).
    pub noisy_ran: HashSet<u32>,
    /// Records applied.
    pub n_events: u64,
}

/// What the filesystem side of a turn amounts to.
#[derive(Debug, Default, PartialEq, Eq)]
pub(crate) struct FsVerdict {
    /// Changed paths, as named (every one of them).
    pub changed: Vec<String>,
    /// Inodes written that existed before the turn (user-space dev, ino).
    pub written: Vec<(u64, u64)>,
}

/// Which records are not filesystem state.
#[derive(Debug, Default, Clone)]
pub(crate) struct Ignore {
    /// Mount namespaces of the host (the inspector's own and init's):
    /// a runtime helper that joined the sandbox's cgroup but still sees
    /// the host's filesystem (writing a pid file in its bundle) changes
    /// nothing inside the sandbox. Processes of the sandbox never share
    /// the host's mount namespace.
    pub host_mntns: HashSet<u32>,
    /// User-space device numbers of the sandbox's `/dev`, `/proc`, `/sys`
    /// and similar mounts.
    pub devs: HashSet<u64>,
}

#[derive(Debug, Clone, PartialEq, Eq, Hash)]
struct PathKey {
    dev: u64,
    ino: u64,
    name: String,
}

#[derive(Debug, Clone, Copy)]
struct PathFate {
    /// The first operation of the turn proved the key absent before it.
    pre_absent: bool,
    /// The key holds an object after the last operation.
    present: bool,
}

impl Ledger {
    /// Adds one record.
    pub(crate) fn apply(&mut self, ev: &Event, ignore: &Ignore) {
        self.n_events += 1;
        let fs_record = matches!(ev.kind, kind::CREATE | kind::TRUNC | kind::WRITE | kind::PATH);
        if fs_record && ignore.host_mntns.contains(&ev.mntns) {
            return;
        }
        let first = || key(ev.dir_dev, ev.dir_ino, &ev.name);
        let second = || key(ev.dir2_dev, ev.dir2_ino, &ev.name2);
        match ev.kind {
            kind::CREATE => {
                self.alias(first(), second());
                self.touch(first(), true, true);
            }
            kind::TRUNC => {
                self.alias(first(), second());
                self.touch(first(), false, true);
                let name = normalize(&c_str(&ev.name));
                self.written.insert((user_dev(ev.dev), ev.ino), name);
            }
            kind::WRITE => {
                let name = c_str(&ev.name);
                if ev.op == NR_MMAP {
                    self.shared_mapped.push((ev.pid, user_dev(ev.dev), name.clone()));
                }
                self.written.insert((user_dev(ev.dev), ev.ino), name);
            }
            kind::PATH => match ev.op {
                op::UNLINK | op::RMDIR => self.touch(first(), false, false),
                op::MKDIR | op::MKNOD => self.touch(first(), true, true),
                op::SYMLINK | op::LINK => self.touch(second(), true, true),
                op::RENAME | op::RENAME_NOREPLACE => {
                    self.touch(first(), false, false);
                    self.touch(second(), ev.op == op::RENAME_NOREPLACE, true);
                }
                op::EXCHANGE => {
                    self.touch(first(), false, true);
                    self.touch(second(), false, true);
                }
                op::ATTR | op::TRUNCATE => self.touch(first(), false, true),
                other => self.unsure.push(format!("unknown path operation {other}")),
            },
            kind::ACTIVE if ev.op == 1 => {
                self.noisy_ran.insert(ev.pid);
            }
            kind::ACTIVE => self.proc(ev, |pid, comm| Reason::Ran { pid, comm }),
            kind::CWD => self.proc(ev, |pid, comm| Reason::Chdir { pid, comm }),
            kind::EXEC => self.proc(ev, |pid, comm| Reason::Execed { pid, comm }),
            kind::EXIT => self.proc(ev, |pid, comm| Reason::Exited { pid, comm }),
            kind::UNSURE => self.unsure.push(format!(
                "{} (pid {}) made system call {}, which the inspector does not follow",
                ev.comm(),
                ev.pid,
                ev.op
            )),
            other => self.unsure.push(format!("unknown record kind {other}")),
        }
    }

    /// The tasks whose running is recorded (long-lived ones that ran,
    /// noisy ones included).
    pub(crate) fn ran(&self) -> HashSet<u32> {
        self.procs
            .iter()
            .filter_map(|r| match r {
                Reason::Ran { pid, .. } => Some(*pid),
                _ => None,
            })
            .chain(self.noisy_ran.iter().copied())
            .collect()
    }

    /// Forgets what a checkpoint made the sandbox's tasks do: which
    /// long-lived tasks ran, but those in `keep` (they ran before it), and
    /// every change to the files in `own` (the checkpoint's own
    /// directories and files, as (user-space dev, ino): CRIU's helpers
    /// that run in the sandbox write its log there).
    pub(crate) fn forget_checkpoint(&mut self, own: &HashSet<(u64, u64)>, keep: &HashSet<u32>) {
        self.procs
            .retain(|r| !matches!(r, Reason::Ran { pid, .. } if !keep.contains(pid)));
        self.proc_seen
            .retain(|(pid, k)| *k != kind::ACTIVE || keep.contains(pid));
        self.noisy_ran.retain(|pid| keep.contains(pid));
        let outside = |k: &PathKey| !own.contains(&(k.dev, k.ino));
        self.paths.retain(|k, _| outside(k));
        self.aliases.retain(|k, _| outside(k));
        self.written.retain(|k, _| !own.contains(k));
    }

    /// Records a process change `make(pid, comm)` once per pid and kind.
    fn proc(&mut self, ev: &Event, make: impl FnOnce(u32, String) -> Reason) {
        if self.proc_seen.insert((ev.pid, ev.kind)) {
            self.procs.push(make(ev.pid, ev.comm()));
        }
    }

    fn alias(&mut self, a: PathKey, b: PathKey) {
        if a == b || b.name.is_empty() || b.name == "." {
            return;
        }
        let list = self.aliases.entry(a.clone()).or_default();
        if !list.contains(&b) {
            list.push(b.clone());
        }
        let list = self.aliases.entry(b).or_default();
        if !list.contains(&a) {
            list.push(a);
        }
    }

    fn touch(&mut self, key: PathKey, creates: bool, present: bool) {
        let others = self.aliases.get(&key).cloned().unwrap_or_default();
        for k in std::iter::once(key).chain(others) {
            self.paths
                .entry(k)
                .and_modify(|f| f.present = present)
                .or_insert(PathFate {
                    pre_absent: creates,
                    present,
                });
        }
    }

    /// The net filesystem change, leaving out what `ignore` says is not
    /// filesystem state.
    pub(crate) fn fs_verdict(&self, ignore: &Ignore) -> FsVerdict {
        let mut changed: Vec<String> = self
            .paths
            .iter()
            .filter(|(k, f)| (!f.pre_absent || f.present) && !ignore.covers(k))
            .map(|(k, _)| k.name.clone())
            .collect();
        let mut written = Vec::new();
        for (&(dev, ino), name) in &self.written {
            if ignore.devs.contains(&dev) {
                continue;
            }
            written.push((dev, ino));
            changed.push(name.clone());
        }
        changed.sort();
        changed.dedup();
        written.sort();
        FsVerdict { changed, written }
    }

    /// Process changes seen in records.
    pub(crate) fn proc_reasons(&self) -> &[Reason] {
        &self.procs
    }

    /// Operations the inspector could not follow.
    pub(crate) fn unsure(&self) -> &[String] {
        &self.unsure
    }
}

impl Ignore {
    fn covers(&self, k: &PathKey) -> bool {
        if k.name.starts_with('/') {
            return ["/dev", "/proc", "/sys"]
                .iter()
                .any(|p| k.name == *p || k.name.starts_with(&format!("{p}/")));
        }
        self.devs.contains(&k.dev)
    }
}

fn key(dev: u64, ino: u64, name: &[u8]) -> PathKey {
    PathKey {
        dev: user_dev(dev),
        ino,
        name: normalize(&c_str(name)),
    }
}

/// `./a//b/` → `a/b`; `/x/./y` → `/x/y`. `..` is kept: resolving it needs
/// the filesystem.
fn normalize(name: &str) -> String {
    let absolute = name.starts_with('/');
    let parts: Vec<&str> = name.split('/').filter(|p| !p.is_empty() && *p != ".").collect();
    let joined = parts.join("/");
    if absolute {
        format!("/{joined}")
    } else if joined.is_empty() {
        ".".to_owned()
    } else {
        joined
    }
}

#[cfg(test)]
mod tests;
