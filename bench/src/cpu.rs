//! Where a run's CPU time went (an eval policy's, a `crab-bench turn`
//! operation's): crab's processes (the shims, crabd and
//! what they run outside the sandboxes: CRIU's dumps, the shims' helpers
//! until they join a container), containerd, and the harness itself (this
//! process and the `ctr`/`crabctl` it runs), measured apart from the
//! sandboxes' own work and from each other. A restore's CRIU joins the
//! container's cgroup first, so its CPU is the sandbox's, not counted here.
//!
//! containerd is moved into a cgroup of its own (below the harness's)
//! before its first shim starts, so every shim (and the crabd a shim
//! starts) is born there; the sandboxes' processes live in their
//! containers' cgroups. What the cgroup used, less what containerd itself
//! used over the same time, is crab's.

use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::Context;

/// The CPU meters of one run (an eval policy's, a benchmark's).
pub struct Meter {
    cgroup: PathBuf,
    containerd: u32,
    start: Raw,
}

/// CPU time by who used it.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct Split {
    /// crab's processes: the shims, crabd, their helpers and CRIU's dumps.
    pub crab: Duration,
    /// containerd itself.
    pub containerd: Duration,
    /// The harness: this process and the commands it ran and waited for.
    pub harness: Duration,
}

/// The counters as read at one moment.
#[derive(Debug, Clone, Copy)]
struct Raw {
    /// The cgroup's usage since it was made (containerd's share included).
    cgroup: Duration,
    /// containerd's own time since it started.
    containerd: Duration,
    harness: Duration,
}

// === impl Meter ===

impl Meter {
    /// Moves `containerd` (its pid) into a new cgroup below this process's
    /// own, named after this process and `label`, before any shim starts.
    /// None, with a warning, where that cannot be done (no cgroup2
    /// hierarchy, a read-only one): the run goes on without the split.
    pub fn adopt(containerd: u32, label: &str) -> Option<Self> {
        match Self::try_adopt(containerd, label) {
            Ok(meter) => Some(meter),
            Err(e) => {
                eprintln!("crab-bench: no CPU split for {label}: {e:#}");
                None
            }
        }
    }

    fn try_adopt(containerd: u32, label: &str) -> anyhow::Result<Self> {
        let name = format!(
            "crab-bench-{}-{}",
            std::process::id(),
            label.replace(['/', '+'], "-")
        );
        let cgroup = own_cgroup()?.join(name);
        std::fs::create_dir(&cgroup).with_context(|| format!("create {}", cgroup.display()))?;
        // Made first, so that the cgroup goes again if anything below fails.
        let mut meter = Meter {
            cgroup,
            containerd,
            start: Raw {
                cgroup: Duration::ZERO,
                containerd: Duration::ZERO,
                harness: Duration::ZERO,
            },
        };
        // Opened, never created: a directory that is no cgroup is refused.
        write_pid(&meter.cgroup, containerd)
            .with_context(|| format!("move containerd into {}", meter.cgroup.display()))?;
        meter.start = meter.read().context("read the counters")?;
        Ok(meter)
    }

    /// CPU time used since [`Meter::adopt`] or the last reset or lap, and
    /// restarts the meters from the same reading; None (meters unchanged)
    /// if a counter could not be read.
    pub fn lap(&mut self) -> Option<Split> {
        let now = self.read()?;
        let used = self.since(now);
        self.start = now;
        Some(used)
    }

    /// Restarts the meters: what was used so far is not counted.
    pub fn reset(&mut self) {
        if let Some(now) = self.read() {
            self.start = now;
        }
    }

    /// CPU time used since [`Meter::adopt`] or the last reset; None if a
    /// counter could not be read (containerd gone).
    pub fn used(&self) -> Option<Split> {
        Some(self.since(self.read()?))
    }

    fn since(&self, now: Raw) -> Split {
        let containerd = now.containerd.saturating_sub(self.start.containerd);
        Split {
            crab: now
                .cgroup
                .saturating_sub(self.start.cgroup)
                .saturating_sub(containerd),
            containerd,
            harness: now.harness.saturating_sub(self.start.harness),
        }
    }

    fn read(&self) -> Option<Raw> {
        Some(Raw {
            cgroup: cgroup_usage(&self.cgroup)?,
            containerd: own_time(self.containerd)?,
            harness: harness_time(),
        })
    }
}

impl Drop for Meter {
    /// Removes the cgroup; what still runs in it (containerd after a run
    /// that failed early) is moved to the parent first.
    fn drop(&mut self) {
        for _ in 0..50 {
            if std::fs::remove_dir(&self.cgroup).is_ok() {
                return;
            }
            let left = std::fs::read_to_string(self.cgroup.join("cgroup.procs")).unwrap_or_default();
            if let Some(parent) = self.cgroup.parent() {
                for pid in left.lines().filter_map(|l| l.trim().parse().ok()) {
                    let _ = write_pid(parent, pid);
                }
            }
            std::thread::sleep(Duration::from_millis(100));
        }
        eprintln!("crab-bench: {} could not be removed", self.cgroup.display());
    }
}

/// Moves process `pid` into `cgroup` (its `cgroup.procs` opened, never
/// created).
fn write_pid(cgroup: &Path, pid: u32) -> std::io::Result<()> {
    use std::io::Write;
    std::fs::OpenOptions::new()
        .write(true)
        .open(cgroup.join("cgroup.procs"))?
        .write_all(pid.to_string().as_bytes())
}

/// This process's cgroup in the unified (v2) hierarchy, wherever that is
/// mounted (`/sys/fs/cgroup`, or `/sys/fs/cgroup/unified` on a v1-hybrid
/// host).
fn own_cgroup() -> anyhow::Result<PathBuf> {
    let mounts = std::fs::read_to_string("/proc/self/mounts")?;
    let root = mounts
        .lines()
        .find_map(|l| {
            let mut f = l.split_whitespace();
            let (_, at, kind) = (f.next()?, f.next()?, f.next()?);
            (kind == "cgroup2").then(|| PathBuf::from(at))
        })
        .context("no cgroup2 hierarchy is mounted")?;
    let own = std::fs::read_to_string("/proc/self/cgroup")?;
    let path = own
        .lines()
        .find_map(|l| l.strip_prefix("0::"))
        .context("this process has no cgroup2 path")?;
    Ok(root.join(path.trim().trim_start_matches('/')))
}

/// `usage_usec` of `cgroup`'s `cpu.stat`.
fn cgroup_usage(cgroup: &Path) -> Option<Duration> {
    let stat = std::fs::read_to_string(cgroup.join("cpu.stat")).ok()?;
    let usec = stat
        .lines()
        .find_map(|l| l.strip_prefix("usage_usec ")?.trim().parse().ok())?;
    Some(Duration::from_micros(usec))
}

/// CPU time of process `pid`'s threads, those gone included (not its
/// children's), to the nanosecond: its process CPU-time clock. (`/proc`'s
/// utime and stime count 10 ms ticks, too coarse for one operation.)
fn own_time(pid: u32) -> Option<Duration> {
    let pid = nix::unistd::Pid::from_raw(i32::try_from(pid).ok()?);
    let clock = nix::time::clock_getcpuclockid(pid).ok()?;
    let t = nix::time::clock_gettime(clock).ok()?;
    Some(Duration::new(
        u64::try_from(t.tv_sec()).ok()?,
        u32::try_from(t.tv_nsec()).ok()?,
    ))
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
    fn a_process_own_time_grows_finely_and_an_unknown_one_has_none() {
        let before = own_time(std::process::id()).expect("this process's clock");
        let t = std::time::Instant::now();
        while t.elapsed() < Duration::from_millis(3) {
            std::hint::black_box(t.elapsed());
        }
        let after = own_time(std::process::id()).expect("this process's clock");
        // Finer than a 10 ms tick: 3 ms of spinning shows.
        assert!(
            after > before + Duration::from_millis(1),
            "{before:?} → {after:?}"
        );
        assert!(own_time(u32::MAX).is_none());
        assert!(harness_time() > Duration::ZERO);
    }
}
