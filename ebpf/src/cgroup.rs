//! Naming a sandbox's cgroup: the unified (cgroup2) mount and the cgroup id
//! that `bpf_get_current_cgroup_id()` returns, which is the inode number of
//! the cgroup's directory.

use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};

use crate::error::{Error, Result};

/// Where the unified (cgroup2) hierarchy is mounted: `/sys/fs/cgroup` on a
/// cgroup2 host, `/sys/fs/cgroup/unified` on a v1-hybrid one. Read from
/// `/proc/self/mountinfo`, never assumed.
///
/// # Errors
/// [`Error::NoUnifiedCgroup`] when no cgroup2 filesystem is mounted.
pub fn unified_mount() -> Result<PathBuf> {
    let info = std::fs::read_to_string("/proc/self/mountinfo").map_err(|source| Error::Io {
        op: "read",
        path: "/proc/self/mountinfo".into(),
        source,
    })?;
    info.lines()
        .find_map(|line| {
            // "... mount_point options ... - fstype source options"
            let (left, right) = line.split_once(" - ")?;
            (right.split_whitespace().next()? == "cgroup2")
                .then(|| left.split_whitespace().nth(4).map(PathBuf::from))?
        })
        .ok_or(Error::NoUnifiedCgroup)
}

/// The cgroup id of the unified cgroup directory `dir`.
///
/// # Errors
/// [`Error::Cgroup`] when `dir` cannot be stat'ed.
pub fn cgroup_id(dir: &Path) -> Result<u64> {
    std::fs::metadata(dir)
        .map(|m| m.ino())
        .map_err(|source| Error::Cgroup {
            path: dir.to_owned(),
            source,
        })
}
