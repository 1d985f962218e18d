//! Where a policy's CPU time went: crab's processes (the shims, crabd and
//! what they run: CRIU, the shims' helpers), containerd, and the harness
//! itself (this process and the `ctr`/`crabctl` it runs), measured apart
//! from the sandboxes' own work and from each other.
//!
//! containerd is moved into a cgroup of its own before its first shim
//! starts, so every shim (and the crabd a shim starts) is born there; the
//! sandboxes' processes live in their containers' cgroups. The cgroup's
//! `usage_usec` less containerd's own time is crab's.

use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::Context;

/// The CPU meters of one policy's run.
pub struct Meter {
    cgroup: PathBuf,
    containerd: u32,
    start: Split,
}

/// CPU time by who used it.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct Split {
    /// crab's processes: the shims, crabd, and their helpers and CRIU.
    pub crab: Duration,
    /// containerd itself.
    pub containerd: Duration,
    /// The harness: this process and the commands it ran and waited for.
    pub harness: Duration,
}

// === impl Meter ===

impl Meter {
    /// Moves `containerd` (its pid) into a new cgroup named after this
    /// process and `label`, before any shim starts.
    pub fn adopt(containerd: u32, label: &str) -> anyhow::Result<Self> {
        let cgroup = unified_root()?.join(format!(
            "crab-bench-{}-{}",
            std::process::id(),
            label.replace(['/', '+'], "-")
        ));
        std::fs::create_dir(&cgroup).with_context(|| format!("create {}", cgroup.display()))?;
        // Made first, so that the cgroup goes again if the move fails.
        let mut meter = Meter {
            cgroup,
            containerd,
            start: Split::default(),
        };
        // Opened, never created: a directory that is no cgroup is refused.
        std::fs::OpenOptions::new()
            .write(true)
            .open(meter.cgroup.join("cgroup.procs"))
            .and_then(|mut f| std::io::Write::write_all(&mut f, containerd.to_string().as_bytes()))
            .with_context(|| format!("move containerd into {}", meter.cgroup.display()))?;
        meter.start = meter.now();
        Ok(meter)
    }

    /// Restarts the meters: what was used so far is not counted.
    pub fn reset(&mut self) {
        self.start = self.now();
    }

    /// CPU time used since [`Meter::adopt`] or the last reset.
    pub fn used(&self) -> Split {
        let now = self.now();
        Split {
            crab: now.crab.saturating_sub(self.start.crab),
            containerd: now.containerd.saturating_sub(self.start.containerd),
            harness: now.harness.saturating_sub(self.start.harness),
        }
    }

    fn now(&self) -> Split {
        let all = cgroup_usage(&self.cgroup).unwrap_or_default();
        let containerd = own_time(self.containerd).unwrap_or_default();
        Split {
            crab: all.saturating_sub(containerd),
            containerd,
            harness: harness_time(),
        }
    }
}

impl Drop for Meter {
    /// Removes the cgroup once its processes are gone (containerd is
    /// stopped before); a cgroup still in use is left, with a warning.
    fn drop(&mut self) {
        for _ in 0..50 {
            if std::fs::remove_dir(&self.cgroup).is_ok() {
                return;
            }
            std::thread::sleep(Duration::from_millis(100));
        }
        eprintln!(
            "crab-bench: {} still has processes; left in place",
            self.cgroup.display()
        );
    }
}

/// Where the unified (v2) hierarchy is mounted: `/sys/fs/cgroup` on a v2
/// host, `/sys/fs/cgroup/unified` on a v1-hybrid one.
fn unified_root() -> anyhow::Result<PathBuf> {
    let mounts = std::fs::read_to_string("/proc/self/mounts")?;
    mounts
        .lines()
        .find_map(|l| {
            let mut f = l.split_whitespace();
            let (_, at, kind) = (f.next()?, f.next()?, f.next()?);
            (kind == "cgroup2").then(|| PathBuf::from(at))
        })
        .context("no cgroup2 hierarchy is mounted: crab's CPU time cannot be told apart")
}

/// `usage_usec` of `cgroup`'s `cpu.stat`.
fn cgroup_usage(cgroup: &Path) -> Option<Duration> {
    let stat = std::fs::read_to_string(cgroup.join("cpu.stat")).ok()?;
    let usec = stat
        .lines()
        .find_map(|l| l.strip_prefix("usage_usec ")?.trim().parse().ok())?;
    Some(Duration::from_micros(usec))
}

/// User and system time of process `pid`'s own threads (not its children's).
fn own_time(pid: u32) -> Option<Duration> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    Some(Duration::from_millis(own_ticks(&stat)? * 1000 / clock_ticks()))
}

/// utime + stime, in clock ticks, of a `/proc/<pid>/stat` line: fields 14
/// and 15, counted after the command's closing parenthesis (a command may
/// hold spaces and parentheses itself).
fn own_ticks(stat: &str) -> Option<u64> {
    let rest = &stat[stat.rfind(')')? + 1..];
    let fields: Vec<&str> = rest.split_whitespace().collect();
    Some(fields.get(11)?.parse::<u64>().ok()? + fields.get(12)?.parse::<u64>().ok()?)
}

fn clock_ticks() -> u64 {
    nix::unistd::sysconf(nix::unistd::SysconfVar::CLK_TCK)
        .ok()
        .flatten()
        .filter(|t| *t > 0)
        .unwrap_or(100) as u64
}

/// This process's CPU time and its waited-for children's.
fn harness_time() -> Duration {
    use nix::sys::resource::{getrusage, UsageWho};
    [UsageWho::RUSAGE_SELF, UsageWho::RUSAGE_CHILDREN]
        .into_iter()
        .filter_map(|who| getrusage(who).ok())
        .map(|u| {
            let tv = |t: nix::sys::time::TimeVal| Duration::new(t.tv_sec() as u64, t.tv_usec() as u32 * 1000);
            tv(u.user_time()) + tv(u.system_time())
        })
        .sum()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_process_own_time_is_read_past_a_command_with_spaces_and_parentheses() {
        let line = "42 (a (b) c) S 1 42 42 0 -1 4194560 10 0 0 0 7 3 100 200 20 0 1 0 5 0 0";
        assert_eq!(own_ticks(line), Some(10));
        assert_eq!(own_ticks("42 (x) S 1"), None);
        assert!(own_time(std::process::id()).is_some());
        assert!(own_time(u32::MAX).is_none());
        assert!(harness_time() > Duration::ZERO);
    }
}
