//! What user space reads about a sandbox's processes at a turn end: the
//! cgroup's members, a task's run state and the files a process maps.

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

/// Child cgroups of `cgroup_dir` (at any depth, up to 8 levels and 256
/// directories) that hold processes, relative to it.
pub(crate) fn populated_children(cgroup_dir: &Path) -> Vec<String> {
    let mut found = Vec::new();
    // One small read answers the common case: no descendants at all.
    let stat = std::fs::read_to_string(cgroup_dir.join("cgroup.stat")).unwrap_or_default();
    if stat.lines().any(|l| l.trim() == "nr_descendants 0") {
        return found;
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
            let rel = path.strip_prefix(cgroup_dir).unwrap_or(&path);
            if walked > 256 || depth >= 8 {
                found.push(format!("{} (and more, not looked into)", rel.display()));
                return found;
            }
            // A threaded cgroup lists its threads only.
            if !members(&path, "cgroup.procs").is_empty() || !members(&path, "cgroup.threads").is_empty() {
                found.push(rel.display().to_string());
            }
            stack.push((path, depth + 1));
        }
    }
    found
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
