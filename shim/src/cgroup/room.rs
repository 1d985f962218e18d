//! Whether a sandbox's cgroups have room for its processes twice over:
//! a rollback that keeps the old processes aside (frozen, still charged
//! where they are) while the restored ones start needs it, or the
//! restored tree could meet the sandbox's own memory or pids limit.

use std::path::{Path, PathBuf};

/// The limits checked: (v1 controller, v1 limit file, v1 usage file, v2
/// limit file, v2 usage file).
const LIMITS: [(&str, &str, &str, &str, &str); 2] = [
    (
        "memory",
        "memory.limit_in_bytes",
        "memory.usage_in_bytes",
        "memory.max",
        "memory.current",
    ),
    ("pids", "pids.max", "pids.current", "pids.max", "pids.current"),
];

/// `Ok` when every cgroup from `pid`'s up to its hierarchy's root has
/// room for what `pid`'s cgroup holds once more, for memory and pids;
/// otherwise why not. A limit that cannot be read counts as no room.
pub fn for_twice(pid: i32) -> Result<(), String> {
    let text = std::fs::read_to_string(format!("/proc/{pid}/cgroup"))
        .map_err(|e| format!("read its cgroups: {e}"))?;
    for (controller, v1_limit, v1_usage, v2_limit, v2_usage) in LIMITS {
        let (dir, mount, limit, usage) = match place(&text, controller) {
            Some((dir, mount)) => (dir, mount, v1_limit, v1_usage),
            None => {
                let mount = super::unified_mount().ok_or("no cgroup2 mount")?;
                let relative = unified_path(&text).ok_or("in no unified cgroup")?;
                (mount.join(relative), mount, v2_limit, v2_usage)
            }
        };
        if dir == mount {
            continue; // the hierarchy's root: the host's, no limit
        }
        let own = read(&dir, usage).ok_or_else(|| format!("cannot read {}", dir.join(usage).display()))?;
        let mut at = dir.as_path();
        // Up to the hierarchy's root (whose limits are the host's).
        while at != mount && at.starts_with(&mount) {
            let max = match std::fs::read_to_string(at.join(limit)) {
                Ok(t) if t.trim() == "max" => None,
                Ok(t) => Some(
                    t.trim()
                        .parse::<u64>()
                        .map_err(|_| format!("{}: {t:?}", at.join(limit).display()))?,
                ),
                // A hierarchy without the controller here limits nothing.
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => None,
                Err(e) => return Err(format!("read {}: {e}", at.join(limit).display())),
            };
            if let Some(max) = max {
                let used =
                    read(at, usage).ok_or_else(|| format!("cannot read {}", at.join(usage).display()))?;
                if used.saturating_add(own) > max {
                    return Err(format!(
                        "{controller}: {} holds {own} of a limit of {max} at {} ({used} used)",
                        dir.display(),
                        at.display()
                    ));
                }
            }
            at = at.parent().unwrap_or(&mount);
        }
    }
    Ok(())
}

/// The v1 cgroup directory of `controller` in `/proc/<pid>/cgroup`'s
/// `text`, and its hierarchy's mount point.
fn place(text: &str, controller: &str) -> Option<(PathBuf, PathBuf)> {
    let kind = match controller {
        "memory" => libcgroups::v1::ControllerType::Memory,
        _ => libcgroups::v1::ControllerType::Pids,
    };
    let path = text.lines().find_map(|l| {
        let mut parts = l.splitn(3, ':');
        let (_, controllers, path) = (parts.next()?, parts.next()?, parts.next()?);
        controllers.split(',').any(|c| c == controller).then_some(path)
    })?;
    let mount = libcgroups::v1::util::get_subsystem_mount_point(&kind).ok()?;
    Some((mount.join(path.trim_start_matches('/')), mount))
}

/// The unified cgroup's path in `/proc/<pid>/cgroup`'s `text`.
fn unified_path(text: &str) -> Option<&str> {
    text.lines()
        .find_map(|l| l.strip_prefix("0::"))
        .map(|p| p.trim_start_matches('/'))
}

/// A counter file of cgroup `dir`.
fn read(dir: &Path, file: &str) -> Option<u64> {
    std::fs::read_to_string(dir.join(file)).ok()?.trim().parse().ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A `sleep` born in a new v1 memory cgroup (so its pages are charged
    /// there), and how much it is charged.
    #[allow(clippy::zombie_processes, reason = "the caller kills and waits for it")]
    fn sleeper(name: &str) -> (std::process::Child, PathBuf, u64) {
        let dir = Path::new("/sys/fs/cgroup/memory").join(format!("crab-room-{name}-{}", std::process::id()));
        std::fs::create_dir(&dir).expect("make a memory cgroup (needs root)");
        let mut child = std::process::Command::new("sh")
            .arg("-c")
            .arg(format!(
                "echo $$ > {}/cgroup.procs && exec sleep 100",
                dir.display()
            ))
            .spawn()
            .unwrap();
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
        loop {
            let joined = std::fs::read_to_string(dir.join("cgroup.procs"))
                .is_ok_and(|t| t.lines().any(|l| l.trim() == child.id().to_string()));
            let exec = std::fs::read_to_string(format!("/proc/{}/comm", child.id()))
                .is_ok_and(|c| c.trim() == "sleep");
            let used = read(&dir, "memory.usage_in_bytes").unwrap_or(0);
            if joined && exec && used > 0 {
                return (child, dir, used);
            }
            if std::time::Instant::now() > deadline {
                let _ = child.kill();
                let _ = child.wait();
                panic!("the sleeper never settled");
            }
            std::thread::sleep(std::time::Duration::from_millis(10));
        }
    }

    #[test]
    fn a_sandbox_near_its_memory_limit_has_no_room_for_two() {
        for room in [true, false] {
            let (mut child, dir, used) = sleeper(if room { "room" } else { "tight" });
            // Room for twice what it holds, or only for half as much again.
            let limit = if room { 1 << 30 } else { used + used / 2 };
            std::fs::write(dir.join("memory.limit_in_bytes"), limit.to_string()).unwrap();
            let answer = for_twice(child.id() as i32);
            let _ = child.kill();
            let _ = child.wait();
            let _ = std::fs::remove_dir(&dir);
            match room {
                true => assert_eq!(answer, Ok(()), "{used} bytes used of {limit}"),
                false => {
                    let why = answer.unwrap_err();
                    assert!(why.starts_with("memory:"), "{why}");
                }
            }
        }
    }
}
