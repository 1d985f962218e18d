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

use crate::kernel::{c_bytes, c_str, kind, marks, op, unsure, user_dev, Event, NR_MMAP};
use crate::mounts::{Mount, MountKind};
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
    /// A path operation named its object so that it may have landed on any
    /// mount (through `..`, a directory that may be a symlink, a final
    /// symlink it follows, a name cut short): the sandbox's tmpfs mounts
    /// are then compared whole.
    pub uncertain: bool,
    /// Records applied.
    pub n_events: u64,
    /// A task of the sandbox put a task into a cgroup outside it: the task
    /// may go on there, unfollowed, into the next turn.
    pub escaped: bool,
}

/// What the filesystem side of a turn amounts to.
#[derive(Debug, Default, PartialEq, Eq)]
pub(crate) struct FsVerdict {
    /// Changed paths whose files the filesystem snapshot keeps, as named.
    pub changed: Vec<String>,
    /// Inodes written that existed before the turn (user-space dev, ino).
    pub written: Vec<(u64, u64)>,
    /// Changed paths on the sandbox's tmpfs mounts (`/dev`, `/dev/shm`):
    /// CRIU keeps their contents with the processes.
    pub held: Vec<String>,
}

/// Which records are not filesystem state, and where the sandbox's own
/// mounts are.
#[derive(Debug, Default, Clone)]
pub(crate) struct Ignore {
    /// Mount namespaces of the host (the inspector's own and init's):
    /// a runtime helper that joined the sandbox's cgroup but still sees
    /// the host's filesystem (writing a pid file in its bundle) changes
    /// nothing inside the sandbox. Processes of the sandbox never share
    /// the host's mount namespace.
    pub host_mntns: HashSet<u32>,
    /// User-space device numbers of the sandbox's `/dev`, `/proc`, `/sys`
    /// and similar mounts: their files are never in the file snapshot.
    pub devs: HashSet<u64>,
    /// The sandbox's mounts other than its root, as it sees them.
    pub mounts: Vec<Mount>,
    /// The sandbox's root directory (user-space dev, ino), where absolute
    /// names resolve from unless a task chrooted.
    pub root: Option<(u64, u64)>,
}

#[derive(Debug, Clone, PartialEq, Eq, Hash)]
struct PathKey {
    dev: u64,
    ino: u64,
    name: Vec<u8>,
    /// The name was cut short (or unreadable): it is only a prefix, and
    /// never the same key as a whole name.
    cut: bool,
}

#[derive(Debug, Clone, Copy, Default)]
struct PathFate {
    /// The first operation of the turn proved the key absent before it.
    pre_absent: bool,
    /// The key holds an object after the last operation.
    present: bool,
    /// The first operation made a directory there (a new, real one).
    made_dir: bool,
    /// An operation that follows a final symlink (chmod, truncate, …)
    /// named it: the object changed may be anywhere.
    follows: bool,
}

/// Where a key's object lies, as far as its spelling tells.
#[derive(Debug, PartialEq, Eq)]
enum Place {
    /// The file snapshot's (or anywhere).
    Files,
    /// A tmpfs of the sandbox, and nothing else.
    Held,
    /// A tmpfs of the sandbox, or (through a symlink in it) anywhere.
    HeldOrFiles,
    /// A kernel interface of no state (`/dev/pts`).
    Nowhere,
}

impl Ledger {
    /// Adds one record.
    pub(crate) fn apply(&mut self, ev: &Event, ignore: &Ignore) {
        self.n_events += 1;
        let fs_record = matches!(ev.kind, kind::CREATE | kind::TRUNC | kind::WRITE | kind::PATH);
        if fs_record && ignore.host_mntns.contains(&ev.mntns) {
            return;
        }
        let first = || key(ev.dir_dev, ev.dir_ino, &ev.name, ev.marks & marks::NAME_CUT != 0);
        let second = || {
            key(
                ev.dir2_dev,
                ev.dir2_ino,
                &ev.name2,
                ev.marks & marks::NAME2_CUT != 0,
            )
        };
        match ev.kind {
            kind::CREATE => {
                // Not O_EXCL: the flags a racing thread leaves in memory
                // are not the ones the kernel used.
                self.create(first(), second(), ev.marks & marks::SPELLED != 0);
            }
            kind::TRUNC => {
                let spelled = first();
                self.note_place(&spelled);
                self.alias(spelled.clone(), second());
                self.touch(spelled, false, true);
                let name = display(&normalize(c_bytes(&ev.name)));
                self.written.insert((user_dev(ev.dev), ev.ino), name);
            }
            kind::WRITE => {
                let name = c_str(&ev.name);
                if ev.op == NR_MMAP {
                    self.shared_mapped.push((ev.pid, user_dev(ev.dev), name.clone()));
                }
                self.written.insert((user_dev(ev.dev), ev.ino), name);
            }
            kind::PATH => {
                let one = first();
                let two = second();
                if ev.op != op::SYMLINK {
                    self.note_place(&one);
                }
                if matches!(
                    ev.op,
                    op::RENAME | op::RENAME_NOREPLACE | op::EXCHANGE | op::LINK | op::SYMLINK
                ) {
                    self.note_place(&two);
                }
                match ev.op {
                    op::UNLINK | op::RMDIR => self.touch(one, false, false),
                    op::MKDIR => {
                        // Only a directory that is the key's first object
                        // and never anything else vanishes whole.
                        let first_op = !self.paths.contains_key(&one);
                        self.touch(one.clone(), true, true);
                        if first_op {
                            self.paths.entry(one).and_modify(|f| f.made_dir = true);
                        }
                    }
                    op::MKNOD => self.touch(one, true, true),
                    op::SYMLINK | op::LINK => self.touch(two, true, true),
                    op::RENAME | op::RENAME_NOREPLACE => {
                        self.touch(one, false, false);
                        self.touch(two, ev.op == op::RENAME_NOREPLACE, true);
                    }
                    op::EXCHANGE => {
                        self.touch(one, false, true);
                        self.touch(two, false, true);
                    }
                    op::ATTR | op::TRUNCATE => {
                        // Both follow a final symlink (lchown and friends
                        // do not, but are counted alike).
                        self.uncertain = true;
                        self.touch(one.clone(), false, true);
                        self.paths.entry(one).and_modify(|f| f.follows = true);
                    }
                    other => self.unsure.push(format!("unknown path operation {other}")),
                }
            }
            kind::ACTIVE if ev.op == 1 => {
                self.noisy_ran.insert(ev.pid);
            }
            kind::ACTIVE => self.proc(ev, |pid, comm| Reason::Ran { pid, comm }),
            kind::CWD => self.proc(ev, |pid, comm| Reason::Chdir { pid, comm }),
            kind::EXEC => self.proc(ev, |pid, comm| Reason::Execed { pid, comm }),
            kind::EXIT => self.proc(ev, |pid, comm| Reason::Exited { pid, comm }),
            kind::IPC => {
                let call = ev.op;
                self.proc(ev, |pid, comm| Reason::Ipc { pid, comm, call });
            }
            kind::UNSURE => {
                self.escaped |= ev.flags == unsure::CGROUP;
                self.unsure.push(match ev.flags {
                    unsure::COMPAT => format!(
                        "{} (pid {}) made a 32-bit system call ({}, through int 0x80 or x32), which the inspector does not follow",
                        ev.comm(),
                        ev.pid,
                        ev.op & 0x3fff_ffff
                    ),
                    unsure::TRACED => format!(
                        "{} (pid {}): task {} is stopped by a tracer outside the sandbox's cgroup (in a cgroup below it, or elsewhere while no checkpoint runs), which may run or hide its code",
                        ev.comm(),
                        ev.pid,
                        ev.op
                    ),
                    unsure::CGROUP => format!(
                        "{} (pid {}) put task {} into a cgroup outside the sandbox (moved it there, or cloned it into it), where it is not followed",
                        ev.comm(),
                        ev.pid,
                        ev.op
                    ),
                    unsure::PROC_MEM => format!(
                        "{} (pid {}) wrote into a process's memory through /proc/<pid>/mem",
                        ev.comm(),
                        ev.pid
                    ),
                    _ => format!(
                        "{} (pid {}) made system call {}, which the inspector does not follow",
                        ev.comm(),
                        ev.pid,
                        ev.op
                    ),
                });
            }
            other => self.unsure.push(format!("unknown record kind {other}")),
        }
    }

    /// A file created by an open spelled `spelled`, whose parent directory
    /// and last component are `canonical`. The two are one object only if
    /// the spelling's last component was not a symlink the open followed:
    /// proven by equal keys or by the kernel side's walk of the spelling
    /// up the file's dentries (`proven`). Otherwise the spelling
    /// is never proven absent before the turn (removing it may remove a
    /// link, not the file), and a spelling that already holds something
    /// this turn (a symlink made earlier in it) is not touched at all.
    fn create(&mut self, spelled: PathKey, canonical: PathKey, proven: bool) {
        self.note_place(&spelled);
        let through_link = self.paths.get(&spelled).is_some_and(|f| f.present);
        if through_link {
            self.touch(canonical, true, true);
        } else if spelled == canonical || (proven && !spelled.cut) {
            self.alias(spelled.clone(), canonical);
            self.touch(spelled, true, true);
        } else {
            self.touch(spelled, false, true);
            self.touch(canonical, true, true);
        }
    }

    /// Marks the turn uncertain when `k` may name an object on any mount:
    /// more than one component (a directory may be a symlink), `..`, or a
    /// name cut short.
    fn note_place(&mut self, k: &PathKey) {
        let inner = k.name.strip_prefix(b"/").unwrap_or(&k.name);
        if k.cut || inner.contains(&b'/') || inner == b".." {
            self.uncertain = true;
        }
    }

    /// Forgets every change to the files in `own` (a checkpoint's own
    /// directories and files, as (user-space dev, ino): CRIU's helpers
    /// that run in the sandbox write its log there).
    pub(crate) fn forget_files(&mut self, own: &HashSet<(u64, u64)>) {
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
        if a == b || b.name.is_empty() || b.name == b"." {
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
            // A name cut short may be any of several objects: never proven
            // absent.
            let creates = creates && !k.cut;
            self.paths
                .entry(k)
                .and_modify(|f| {
                    // Something other than the directory made first is
                    // there now (a link, a file, a directory moved in).
                    if present {
                        f.made_dir = false;
                    }
                    f.present = present;
                })
                .or_insert(PathFate {
                    pre_absent: creates,
                    present,
                    ..PathFate::default()
                });
        }
    }

    /// Whether key `k` lies directly in a directory made this turn and
    /// gone at its end (so nothing at `k` outlived the turn), and names
    /// no object elsewhere (no symlink followed, no `..`, whole).
    fn in_vanished_dir(&self, k: &PathKey, f: &PathFate) -> bool {
        if f.follows || k.cut {
            return false;
        }
        let Some(slash) = k.name.iter().rposition(|&b| b == b'/') else {
            return false;
        };
        let (parent, last) = (&k.name[..slash], &k.name[slash + 1..]);
        if parent.is_empty() || last == b".." || parent.split(|&b| b == b'/').any(|c| c == b"..") {
            return false;
        }
        let dir = PathKey {
            dev: k.dev,
            ino: k.ino,
            name: parent.to_vec(),
            cut: false,
        };
        self.paths.get(&dir).is_some_and(|d| d.made_dir && !d.present)
    }

    /// The net filesystem change, leaving out what `ignore` says is not
    /// filesystem state.
    pub(crate) fn fs_verdict(&self, ignore: &Ignore) -> FsVerdict {
        let mut changed = Vec::new();
        let mut held = Vec::new();
        for (k, f) in &self.paths {
            if (f.pre_absent && !f.present) || self.in_vanished_dir(k, f) {
                continue;
            }
            let name = display(&k.name);
            match ignore.place(k, f) {
                Place::Files => changed.push(name),
                Place::Held => held.push(name),
                Place::HeldOrFiles => {
                    held.push(name.clone());
                    changed.push(name);
                }
                Place::Nowhere => {}
            }
        }
        let mut written = Vec::new();
        for (&(dev, ino), name) in &self.written {
            let kind = ignore.mounts.iter().find(|m| m.dev == dev).map(|m| m.kind);
            match kind {
                Some(MountKind::Held) => held.push(name.clone()),
                Some(MountKind::Devices) => {}
                _ if ignore.devs.contains(&dev) || !ignore.reachable(dev) => {}
                // The root's files, or a bind mount's (`/etc/hosts`, a
                // workspace): files.
                _ => {
                    written.push((dev, ino));
                    changed.push(name.clone());
                }
            }
        }
        changed.sort();
        changed.dedup();
        held.sort();
        held.dedup();
        written.sort();
        FsVerdict {
            changed,
            written,
            held,
        }
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
    /// Whether a file on device `dev` has a path in the sandbox: its root's
    /// or one of its mounts'. A memfd, an anonymous inode or a file of
    /// another mount namespace has none: no file state (a memfd's content
    /// is a process's, counted when that process runs). Unknown root: all.
    pub(crate) fn reachable(&self, dev: u64) -> bool {
        match self.root {
            Some((root, _)) => root == dev || self.mounts.iter().any(|m| m.dev == dev),
            None => true,
        }
    }

    /// Where the object a key names lies. A successful operation named
    /// through `/proc` or `/sys` went through a magic link (`cwd`, `root`,
    /// `fd/N`): it lies anywhere.
    fn place(&self, k: &PathKey, f: &PathFate) -> Place {
        let dotdot = k.name.split(|&b| b == b'/').any(|c| c == b"..");
        if k.cut || dotdot {
            return Place::Files;
        }
        // An absolute name is the sandbox's path only when it was resolved
        // from the sandbox's root (not a chroot's).
        if k.name.starts_with(b"/") && self.root.is_some_and(|r| r != (k.dev, k.ino)) {
            return Place::Files;
        }
        let (mount, rest): (&Mount, &[u8]) = if k.name.starts_with(b"/") {
            let Some((m, rest)) = self
                .mounts
                .iter()
                .filter_map(|m| m.strip(&k.name).map(|rest| (m, rest)))
                .max_by_key(|(m, _)| m.point.len())
            else {
                return Place::Files;
            };
            (m, rest)
        } else {
            let Some(m) = self.mounts.iter().find(|m| m.dev == k.dev) else {
                return Place::Files;
            };
            (m, &k.name[..])
        };
        let direct = !f.follows && !rest.contains(&b'/');
        match mount.kind {
            MountKind::Held if direct => Place::Held,
            MountKind::Held => Place::HeldOrFiles,
            MountKind::Devices => Place::Nowhere,
            MountKind::Other => Place::Files,
        }
    }
}

/// A name for people: as it is when it is text, escaped (`\xff`) when not.
fn display(name: &[u8]) -> String {
    match std::str::from_utf8(name) {
        Ok(text) => text.to_owned(),
        Err(_) => name.escape_ascii().to_string(),
    }
}

fn key(dev: u64, ino: u64, name: &[u8], cut: bool) -> PathKey {
    let bytes = c_bytes(name);
    PathKey {
        dev: user_dev(dev),
        ino,
        name: normalize(bytes),
        // An empty name from a call that succeeded was not readable.
        cut: cut || bytes.is_empty(),
    }
}

/// `./a//b/` → `a/b`; `/x/./y` → `/x/y`. `..` is kept: resolving it needs
/// the filesystem. Bytes, not text: two names that differ only in bytes
/// that are not UTF-8 are two names.
fn normalize(name: &[u8]) -> Vec<u8> {
    let absolute = name.starts_with(b"/");
    let parts: Vec<&[u8]> = name
        .split(|&b| b == b'/')
        .filter(|p| !p.is_empty() && *p != b".")
        .collect();
    let joined = parts.join(&b'/');
    if absolute {
        [b"/".as_slice(), &joined].concat()
    } else if joined.is_empty() {
        b".".to_vec()
    } else {
        joined
    }
}

#[cfg(test)]
mod tests;
