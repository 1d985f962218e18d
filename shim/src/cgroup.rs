//! The container's cgroups: its own unified (v2) cgroup on v1-hybrid hosts,
//! pids, resource updates and metrics.
//!
//! On a v1-hybrid host libcontainer joins only the v1 hierarchies, which
//! leaves the container in the unified root where `bpf_get_current_cgroup_id()`
//! cannot tell it from the host. The shim gives it a cgroup of its own in the
//! unified hierarchy at the same relative path as the spec's `cgroupsPath`
//! (runc does the same), found from `/proc/self/mountinfo`, never hard-coded.

use std::path::{Path, PathBuf};

use containerd_shim::protos::protobuf::well_known_types::any::Any;
use libcgroups::common::{CgroupConfig, CgroupManager, CgroupSetup, ControllerOpt};
use oci_spec::runtime::LinuxResources;

use crate::error::{Error, Result};

/// The unified cgroup the container gets on a v1-hybrid host, or `None`
/// when the host is pure v2 (libcontainer handles it) or pure v1.
pub fn unified_cgroup(cgroups_path: &Path) -> Option<PathBuf> {
    if !matches!(libcgroups::common::get_cgroup_setup(), Ok(CgroupSetup::Hybrid)) {
        return None;
    }
    let mount = unified_mount()?;
    Some(mount.join(relative(cgroups_path)))
}

/// The container's cgroup directory in the unified (v2) hierarchy, on v2
/// and v1-hybrid hosts alike (what the inspector keys sandboxes by).
pub fn cgroup2_dir(cgroups_path: &Path) -> Option<PathBuf> {
    Some(unified_mount()?.join(relative(cgroups_path)))
}

/// Removes the container's unified cgroup; gone already is fine.
///
/// The kernel refuses while a process is inside, which cannot happen here:
/// Delete runs after the init (and with it the pid namespace) has exited.
pub fn remove_unified(path: &Path) -> std::io::Result<()> {
    match std::fs::remove_dir(path) {
        Err(e) if e.kind() != std::io::ErrorKind::NotFound => Err(e),
        _ => Ok(()),
    }
}

/// The cgroup path libcontainer uses for a spec with `cgroups_path`.
pub fn spec_cgroups_path(cgroups_path: Option<&Path>, id: &str) -> PathBuf {
    match cgroups_path {
        Some(p) if !p.as_os_str().is_empty() => p.to_owned(),
        _ => PathBuf::from(format!("/crab/{id}")),
    }
}

/// Pids of every process of the container.
pub fn pids(cgroups_path: &Path, id: &str) -> Result<Vec<u32>> {
    let pids = manager(cgroups_path, id)?
        .get_all_pids()
        .map_err(|e| cgroup_error("list pids", id, e))?;
    Ok(pids.into_iter().map(|p| p.as_raw() as u32).collect())
}

/// Applies new resource limits to a running container.
pub fn update(cgroups_path: &Path, id: &str, resources: &LinuxResources) -> Result<()> {
    let opt = ControllerOpt {
        resources,
        disable_oom_killer: false,
        oom_score_adj: None,
        freezer_state: None,
    };
    manager(cgroups_path, id)?
        .apply(&opt)
        .map_err(|e| cgroup_error("update", id, e))
}

/// Moves process `pid` into the container's cgroups (every hierarchy the
/// manager handles, creating them if needed); with `resources`, applies the
/// spec's limits too (a cgroup made anew, for a forked sandbox).
pub fn join(cgroups_path: &Path, id: &str, pid: i32, resources: Option<&LinuxResources>) -> Result<()> {
    let m = manager(cgroups_path, id)?;
    m.add_task(nix::unistd::Pid::from_raw(pid))
        .map_err(|e| cgroup_error("join", id, e))?;
    if let Some(resources) = resources {
        let opt = ControllerOpt {
            resources,
            disable_oom_killer: false,
            oom_score_adj: None,
            freezer_state: None,
        };
        m.apply(&opt).map_err(|e| cgroup_error("apply limits", id, e))?;
    }
    Ok(())
}

/// containerd's metrics of the container (see [`crate::metrics`]).
pub fn metrics(cgroups_path: &Path, id: &str) -> Result<Any> {
    let stats = manager(cgroups_path, id)?
        .stats()
        .map_err(|e| cgroup_error("read stats", id, e))?;
    let unified = matches!(libcgroups::common::get_cgroup_setup(), Ok(CgroupSetup::Unified));
    crate::metrics::to_any(&stats, unified).map_err(|e| cgroup_error("encode metrics", id, e))
}

fn manager(cgroups_path: &Path, id: &str) -> Result<libcgroups::common::AnyCgroupManager> {
    libcgroups::common::create_cgroup_manager(CgroupConfig {
        cgroup_path: cgroups_path.to_owned(),
        systemd_cgroup: false,
        container_name: id.to_owned(),
    })
    .map_err(|e| cgroup_error("open", id, e))
}

fn cgroup_error(op: &'static str, id: &str, e: impl std::error::Error + Send + Sync + 'static) -> Error {
    Error::Cgroup {
        op,
        id: id.to_owned(),
        source: Box::new(e),
    }
}

/// The path of `cgroups_path` below a hierarchy root: absolute paths are
/// taken as is; systemd's `slice:prefix:name` becomes `slice/prefix-name.scope`.
fn relative(cgroups_path: &Path) -> PathBuf {
    let s = cgroups_path.to_string_lossy();
    let parts: Vec<&str> = s.split(':').collect();
    if let [slice, prefix, name] = parts.as_slice() {
        return PathBuf::from(format!("{slice}/{prefix}-{name}.scope"));
    }
    PathBuf::from(s.trim_start_matches('/'))
}

/// The mount point of the cgroup2 filesystem, from `/proc/self/mountinfo`.
pub fn unified_mount() -> Option<PathBuf> {
    let info = std::fs::read_to_string("/proc/self/mountinfo").ok()?;
    parse_unified_mount(&info)
}

fn parse_unified_mount(mountinfo: &str) -> Option<PathBuf> {
    mountinfo.lines().find_map(|line| {
        // id parent major:minor root mountpoint opts [optional...] - fstype source superopts
        let (left, right) = line.split_once(" - ")?;
        let fstype = right.split(' ').next()?;
        if fstype != "cgroup2" {
            return None;
        }
        left.split(' ').nth(4).map(PathBuf::from)
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn check(cgroups_path: &str, expected: &str) {
        assert_eq!(relative(Path::new(cgroups_path)), PathBuf::from(expected));
    }

    #[test]
    fn relative_paths() {
        check("/default/abc", "default/abc");
        check("docker/abc", "docker/abc");
        check("system.slice:docker:abc", "system.slice/docker-abc.scope");
    }

    #[test]
    fn finds_unified_mount() {
        let info = "25 30 0:22 / /sys/fs/cgroup ro,nosuid - tmpfs tmpfs ro,mode=755\n\
                    26 25 0:23 / /sys/fs/cgroup/unified rw,nosuid shared:9 - cgroup2 cgroup2 rw\n";
        assert_eq!(
            parse_unified_mount(info),
            Some(PathBuf::from("/sys/fs/cgroup/unified"))
        );
        assert_eq!(parse_unified_mount("1 2 0:1 / / rw - ext4 /dev/vda rw\n"), None);
    }
}
