//! What user space reads about a sandbox's processes at a turn end: the
//! cgroup's members, a task's run state and the files a process maps.

use std::collections::HashMap;
use std::path::Path;

/// Host pids (or tids, for `cgroup.threads`) listed in a cgroup file.
/// A cgroup that is gone lists nothing.
pub(crate) fn members(cgroup_dir: &Path, file: &str) -> Vec<u32> {
    std::fs::read_to_string(cgroup_dir.join(file))
        .unwrap_or_default()
        .lines()
        .filter_map(|l| l.trim().parse().ok())
        .collect()
}

/// A child cgroup of a sandbox's, as a turn end finds it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct ChildCgroup {
    /// Its path below the sandbox's cgroup.
    pub rel: String,
    /// Whether it holds processes (or threads, when threaded).
    pub populated: bool,
}

/// Child cgroups of `cgroup_dir` at any depth, up to 8 levels and 256
/// directories; beyond, the first not looked into is named too.
pub(crate) fn children(cgroup_dir: &Path) -> (Vec<ChildCgroup>, Option<String>) {
    let mut found = Vec::new();
    // One small read answers the common case: no descendants at all.
    let stat = std::fs::read_to_string(cgroup_dir.join("cgroup.stat")).unwrap_or_default();
    if stat.lines().any(|l| l.trim() == "nr_descendants 0") {
        return (found, None);
    }
    let mut stack = vec![(cgroup_dir.to_owned(), 0)];
    let mut walked = 0;
    while let Some((dir, depth)) = stack.pop() {
        let Ok(entries) = std::fs::read_dir(&dir) else {
            continue;
        };
        for entry in entries.flatten() {
            if !entry.file_type().is_ok_and(|t| t.is_dir()) {
                continue;
            }
            walked += 1;
            let path = entry.path();
            let rel = path
                .strip_prefix(cgroup_dir)
                .unwrap_or(&path)
                .display()
                .to_string();
            if walked > 256 || depth >= 8 {
                return (found, Some(rel));
            }
            // A threaded cgroup lists its threads only.
            let populated =
                !members(&path, "cgroup.procs").is_empty() || !members(&path, "cgroup.threads").is_empty();
            found.push(ChildCgroup { rel, populated });
            stack.push((path, depth + 1));
        }
    }
    (found, None)
}

/// What a turn end found of a sandbox's child cgroups, kept for the
/// next: tasks there are not followed, and may go on into the next turn.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub(crate) struct Children {
    /// Path below the sandbox's cgroup → whether it held processes.
    pub populated: HashMap<String, bool>,
    /// There were more than the walk looks into.
    pub overflow: bool,
    /// A task of the sandbox put a task into a cgroup outside it.
    pub escaped: bool,
}

impl Children {
    /// What `walks` (of one turn end: before its boundary and after, so
    /// that a task that leaves a child in between is still counted) found,
    /// with whether a task escaped in the turn.
    pub(crate) fn found(walks: &[(Vec<ChildCgroup>, Option<String>)], escaped: bool) -> Children {
        let mut out = Children {
            escaped,
            ..Children::default()
        };
        for (children, overflow) in walks {
            out.overflow |= overflow.is_some();
            for c in children {
                *out.populated.entry(c.rel.clone()).or_default() |= c.populated;
            }
        }
        out
    }
}

/// Why the sandbox's child cgroups leave this turn unsure, `before` being
/// what the last turn end found. Their tasks are not followed: a child
/// that holds processes now, or held them at the last turn end (they may
/// have run, then left or ended; the CPU time a cgroup shows is charged
/// at ticks, so it cannot tell), is a doubt, as is a task that escaped in
/// the last turn (it may have run on where it went). One empty at both
/// ends is none: a task that entered it in between was cloned or moved
/// there by a followed task (a doubt of its own) or by root on the host.
pub(crate) fn child_doubts(before: &Children, now: &[ChildCgroup], overflow: Option<&str>) -> Vec<String> {
    let mut doubts = Vec::new();
    for c in now {
        if c.populated {
            doubts.push(format!(
                "processes in the sandbox's child cgroup {} are not followed",
                c.rel
            ));
        } else if before.populated.get(&c.rel) == Some(&true) {
            doubts.push(format!(
                "processes in the sandbox's child cgroup {} at the last turn end may have run since, not followed",
                c.rel
            ));
        }
    }
    let held_then = before.populated.iter().filter(|(_, populated)| **populated);
    for (gone, _) in held_then.filter(|(rel, _)| !now.iter().any(|c| &c.rel == *rel)) {
        doubts.push(format!(
            "the sandbox's child cgroup {gone}, which held processes at the last turn end, is gone; they were not followed"
        ));
    }
    if let Some(rel) = overflow {
        doubts.push(format!(
            "processes in the sandbox's child cgroup {rel} (and more, not looked into) are not followed"
        ));
    }
    if before.overflow {
        doubts
            .push("the sandbox had more child cgroups at the last turn end than are looked into".to_owned());
    }
    if before.escaped {
        doubts.push(
            "a task put into a cgroup outside the sandbox in the last turn may have run there since, not followed"
                .to_owned(),
        );
    }
    doubts.sort();
    doubts
}

/// A task's state letter and command name from `/proc/<tid>/stat`.
pub(crate) fn task_state(tid: u32) -> Option<(char, String)> {
    let stat = std::fs::read_to_string(format!("/proc/{tid}/stat")).ok()?;
    parse_stat(&stat)
}

fn parse_stat(stat: &str) -> Option<(char, String)> {
    // "pid (comm) S …": comm may hold spaces and parentheses; it ends at
    // the last ')'.
    let open = stat.find('(')?;
    let close = stat.rfind(')')?;
    let comm = stat.get(open + 1..close)?.to_owned();
    let state = stat.get(close + 1..)?.trim_start().chars().next()?;
    Some((state, comm))
}

/// Whether task `tid` is stopped or asleep outside a system call, or
/// running (`/proc/<tid>/syscall` says `-1` or `running`): it was in its
/// own code when it stopped (a page fault, a stop signal).
pub(crate) fn outside_call(tid: u32) -> bool {
    let Ok(text) = std::fs::read_to_string(format!("/proc/{tid}/syscall")) else {
        return false;
    };
    matches!(text.split_whitespace().next(), Some("-1" | "running"))
}

/// The mount namespace of `pid` (the inode of `/proc/<pid>/ns/mnt`).
pub(crate) fn mount_ns(pid: u32) -> Option<u64> {
    use std::os::unix::fs::MetadataExt;
    std::fs::metadata(format!("/proc/{pid}/ns/mnt"))
        .ok()
        .map(|m| m.ino())
}

/// Whether `pid` is the init of the sandbox's pid namespace: pid 1 there,
/// with a parent outside the sandbox (`members`). A pid 1 of a namespace
/// the sandbox made has its parent inside.
pub(crate) fn is_namespace_init(pid: u32, members: &[u32]) -> bool {
    let Ok(status) = std::fs::read_to_string(format!("/proc/{pid}/status")) else {
        return false;
    };
    let field = |name: &str| status.lines().find_map(|l| l.strip_prefix(name)).map(str::trim);
    let ns_pid = field("NSpid:").and_then(|p| p.split_whitespace().last());
    let parent = field("PPid:").and_then(|p| p.parse::<u32>().ok());
    ns_pid == Some("1") && parent.is_some_and(|p| !members.contains(&p))
}

/// A file mapping of a process.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Mapping {
    /// User-space device number.
    pub dev: u64,
    pub ino: u64,
    /// The file was unlinked or replaced since it was mapped.
    pub deleted: bool,
    /// A shared writable mapping: stores into it change the file.
    pub shared_writable: bool,
    pub path: String,
}

/// The file mappings of `pid` (empty when it is gone).
pub(crate) fn mappings(pid: u32) -> Vec<Mapping> {
    std::fs::read_to_string(format!("/proc/{pid}/maps"))
        .unwrap_or_default()
        .lines()
        .filter_map(parse_map_line)
        .collect()
}

fn parse_map_line(line: &str) -> Option<Mapping> {
    // address perms offset dev inode [path]
    let mut fields = line.splitn(6, ' ');
    let (_addr, perms, _off) = (fields.next()?, fields.next()?, fields.next()?);
    let dev = fields.next()?;
    let ino: u64 = fields.next()?.parse().ok()?;
    let path = fields.next().unwrap_or("").trim_start();
    if ino == 0 || !path.starts_with('/') || path.starts_with("/memfd:") {
        return None;
    }
    let (major, minor) = dev.split_once(':')?;
    let major = u32::from_str_radix(major, 16).ok()?;
    let minor = u32::from_str_radix(minor, 16).ok()?;
    let (path, deleted) = match path.strip_suffix(" (deleted)") {
        Some(p) => (p, true),
        None => (path, false),
    };
    Some(Mapping {
        dev: libc::makedev(major, minor),
        ino,
        deleted,
        shared_writable: perms.get(1..2) == Some("w") && perms.ends_with('s'),
        path: path.to_owned(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn child_cgroups_are_doubts_when_they_hold_processes_at_either_end() {
        let child = |rel: &str, populated| ChildCgroup {
            rel: rel.into(),
            populated,
        };
        // Before the boundary "left" held a task, after it not: held.
        let before = Children::found(
            &[
                (
                    vec![
                        child("idle", false),
                        child("left", true),
                        child("gone-idle", false),
                    ],
                    None,
                ),
                (
                    vec![
                        child("idle", false),
                        child("left", false),
                        child("held", true),
                        child("gone", true),
                    ],
                    None,
                ),
            ],
            false,
        );
        assert_eq!(before.populated.get("left"), Some(&true));
        let now = [
            child("idle", false),
            child("left", false),
            child("held", true),
            child("new", true),
            child("new-idle", false),
        ];
        let doubts = child_doubts(&before, &now, None);
        let named = |rel: &str| {
            doubts
                .iter()
                .any(|d| d.contains(&format!(" {rel} ")) || d.contains(&format!(" {rel},")))
        };
        assert!(
            named("left") && named("held") && named("gone") && named("new"),
            "{doubts:?}"
        );
        assert!(
            !named("idle") && !named("gone-idle") && !named("new-idle"),
            "{doubts:?}"
        );
        assert_eq!(doubts.len(), 4, "{doubts:?}");
        assert!(child_doubts(&before, &now, Some("deep"))
            .iter()
            .any(|d| d.contains("deep (and more")));
        // Too many to look into, or a task escaped: a doubt the turn after.
        let crowded = Children::found(&[(vec![], Some("x".into()))], false);
        assert_eq!(child_doubts(&crowded, &[], None).len(), 1);
        let escaped = Children::found(&[], true);
        assert!(child_doubts(&escaped, &[], None)[0].contains("in the last turn"));
        assert!(child_doubts(&Children::default(), &[], None).is_empty());
    }

    #[test]
    fn stat_lines_parse() {
        assert_eq!(
            parse_stat("42 (a (b) c) R 1 2 3"),
            Some(('R', "a (b) c".to_owned()))
        );
        assert_eq!(parse_stat("garbage"), None);
    }

    fn check(line: &str, expected: Option<(u64, u64, bool, bool, &str)>) {
        let got = parse_map_line(line).map(|m| (m.dev, m.ino, m.deleted, m.shared_writable, m.path));
        assert_eq!(
            got,
            expected.map(|(d, i, del, sw, p)| (d, i, del, sw, p.to_owned())),
            "{line}"
        );
    }

    #[test]
    fn map_lines_parse() {
        check(
            "7f00-7f01 r-xp 00000000 00:2f 1234                       /usr/lib/libc.so.6",
            Some((libc::makedev(0, 0x2f), 1234, false, false, "/usr/lib/libc.so.6")),
        );
        check(
            "7f00-7f01 r--p 00000000 fd:01 99 /work/lib.so (deleted)",
            Some((libc::makedev(0xfd, 1), 99, true, false, "/work/lib.so")),
        );
        check(
            "7f00-7f01 rw-s 00000000 00:2f 7 /work/db.sqlite-shm",
            Some((libc::makedev(0, 0x2f), 7, false, true, "/work/db.sqlite-shm")),
        );
        check("7f00-7f01 rw-p 00000000 00:00 0 [heap]", None);
        check("7f00-7f01 rw-s 00000000 00:01 5 /memfd:x (deleted)", None);
    }
}
