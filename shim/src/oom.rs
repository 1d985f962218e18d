//! OOM notifications of a container's memory cgroup, for TaskOOM events.
//!
//! cgroup v1: an eventfd registered in `cgroup.event_control` against
//! `memory.oom_control` (the kernel also signals it when the cgroup is
//! removed). cgroup v2: inotify on `memory.events`, whose `oom_kill` count
//! grows with each kill.

use std::os::fd::AsRawFd;
use std::path::{Path, PathBuf};

use nix::sys::eventfd::{EfdFlags, EventFd};
use nix::sys::inotify::{AddWatchFlags, InitFlags, Inotify};

use crate::error::{Error, Result};

/// A source of OOM notifications for one container.
pub enum OomWatch {
    /// cgroup v1 memory controller.
    V1 {
        /// Signalled per OOM, and once when the cgroup goes away.
        efd: EventFd,
        /// The memory cgroup directory.
        dir: PathBuf,
    },
    /// cgroup v2.
    V2 {
        /// Watches `memory.events`.
        inotify: Inotify,
        /// `memory.events`.
        events: PathBuf,
        /// The last `oom_kill` count seen.
        n_kills: u64,
    },
}

impl OomWatch {
    /// Starts watching the memory cgroup at `cgroups_path`; `None` when the
    /// host has no memory controller there.
    pub fn new(cgroups_path: &Path) -> Result<Option<Self>> {
        let rel = cgroups_path.to_string_lossy().trim_start_matches('/').to_owned();
        let mountinfo =
            std::fs::read_to_string("/proc/self/mountinfo").map_err(Error::io("read mountinfo"))?;
        if let Some(root) = v1_memory_mount(&mountinfo) {
            let dir = root.join(&rel);
            if !dir.join("memory.oom_control").exists() {
                return Ok(None);
            }
            let efd = EventFd::from_value_and_flags(0, EfdFlags::EFD_CLOEXEC)
                .map_err(|e| Error::io("create eventfd")(e.into()))?;
            let control = std::fs::File::open(dir.join("memory.oom_control"))
                .map_err(Error::io(format!("open {}/memory.oom_control", dir.display())))?;
            std::fs::write(
                dir.join("cgroup.event_control"),
                format!("{} {}", efd.as_raw_fd(), control.as_raw_fd()),
            )
            .map_err(Error::io(format!("register oom eventfd in {}", dir.display())))?;
            return Ok(Some(OomWatch::V1 { efd, dir }));
        }
        let Some(root) = crate::cgroup::unified_mount() else {
            return Ok(None);
        };
        let events = root.join(&rel).join("memory.events");
        if !events.exists() {
            return Ok(None);
        }
        let inotify = Inotify::init(InitFlags::IN_CLOEXEC).map_err(|e| Error::io("inotify")(e.into()))?;
        inotify
            .add_watch(&events, AddWatchFlags::IN_MODIFY)
            .map_err(|e| Error::io(format!("watch {}", events.display()))(e.into()))?;
        let n_kills = oom_kills(&events);
        Ok(Some(OomWatch::V2 {
            inotify,
            events,
            n_kills,
        }))
    }

    /// Blocks until the next OOM; `false` when the cgroup is gone (no more
    /// will come). Run it on a blocking thread.
    pub fn next_blocking(&mut self) -> bool {
        loop {
            match self {
                OomWatch::V1 { efd, dir } => {
                    return efd.read().is_ok() && dir.exists();
                }
                OomWatch::V2 {
                    inotify,
                    events,
                    n_kills,
                } => {
                    // Removing the cgroup removes the file: IN_IGNORED wakes us.
                    if inotify.read_events().is_err() || !events.exists() {
                        return false;
                    }
                    let n = oom_kills(events);
                    if n > *n_kills {
                        *n_kills = n;
                        return true;
                    }
                }
            }
        }
    }
}

fn oom_kills(events: &Path) -> u64 {
    std::fs::read_to_string(events)
        .unwrap_or_default()
        .lines()
        .find_map(|l| l.strip_prefix("oom_kill ")?.trim().parse().ok())
        .unwrap_or(0)
}

/// The v1 memory controller's mount point, if the host has one.
fn v1_memory_mount(mountinfo: &str) -> Option<PathBuf> {
    mountinfo.lines().find_map(|line| {
        let (left, right) = line.split_once(" - ")?;
        let mut f = right.split(' ');
        let (fstype, _source, opts) = (f.next()?, f.next()?, f.next()?);
        if fstype != "cgroup" || !opts.split(',').any(|o| o == "memory") {
            return None;
        }
        left.split(' ').nth(4).map(PathBuf::from)
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn finds_v1_memory_mount() {
        let info = "32 31 0:29 / /sys/fs/cgroup/cpu rw,relatime - cgroup cgroup rw,cpu\n\
                    38 31 0:35 / /sys/fs/cgroup/memory rw,relatime - cgroup cgroup rw,memory\n";
        assert_eq!(
            v1_memory_mount(info),
            Some(PathBuf::from("/sys/fs/cgroup/memory"))
        );
        assert_eq!(
            v1_memory_mount("26 25 0:23 / /sys/fs/cgroup rw - cgroup2 cgroup2 rw\n"),
            None
        );
    }
}
