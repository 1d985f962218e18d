//! "Nothing is left behind": shim processes, mounts, cgroups, bundles and
//! shim sockets of a containerd namespace, checked after a test removed its
//! containers.

use std::path::{Path, PathBuf};
use std::process::Command;

use crate::wait_until;

/// The shim's default state directory (`[shim] state_dir`).
/// The shims' default state directory (libcontainer state, sockets, pins).
pub const STATE_DIR: &str = "/run/crab/runtime";

/// Where one client's containers leave traces.
pub struct Scope {
    /// containerd's socket.
    pub address: PathBuf,
    /// containerd namespace (`moby` for docker).
    pub namespace: String,
    /// First component of the containers' cgroups path.
    pub cgroup_parent: String,
    /// containerd's v2 task bundles of the namespace.
    pub bundles: PathBuf,
}

/// Asserts that nothing of `ids` (containers already removed) remains.
///
/// # Panics
/// With a list of what was left.
#[track_caller]
pub fn assert_clean(scope: &Scope, ids: &[&str]) {
    // Shims exit on their own shortly after containerd's Shutdown call.
    let left = wait_until(10, || {
        let left = leftovers(scope, ids);
        left.is_empty().then_some(())
    });
    if left.is_none() {
        panic!("left behind:\n  {}", leftovers(scope, ids).join("\n  "));
    }
}

fn leftovers(scope: &Scope, ids: &[&str]) -> Vec<String> {
    let mut left = Vec::new();
    let addr = scope.address.to_string_lossy();
    for pid in shim_pids(&addr) {
        left.push(format!("shim process {pid}"));
    }
    let bundles = &scope.bundles;
    let mountinfo = std::fs::read_to_string("/proc/self/mountinfo").unwrap_or_default();
    for line in mountinfo.lines() {
        if line.contains(&*bundles.to_string_lossy()) {
            left.push(format!("mount {line}"));
        }
    }
    for id in ids {
        if bundles.join(id).exists() {
            left.push(format!("bundle {}", bundles.join(id).display()));
        }
        let sock = shim_socket(&addr, &scope.namespace, id);
        if sock.exists() {
            left.push(format!("shim socket {}", sock.display()));
        }
        // The control socket and the proxy's host socket, under the default
        // state directory (which tests keep).
        let ctl = Path::new(STATE_DIR).join(&scope.namespace).join(".ctl");
        for sock in [
            ctl.join(format!("{id}.sock")),
            ctl.join(format!("{id}.proxy.sock")),
        ] {
            if sock.exists() {
                left.push(format!("socket {}", sock.display()));
            }
        }
        // crab's pin of the sandbox's network namespace.
        let pin = Path::new(STATE_DIR)
            .join(&scope.namespace)
            .join(".netns")
            .join(id);
        if pin.exists() {
            left.push(format!("network namespace pin {}", pin.display()));
        }
    }
    for root in cgroup_roots() {
        let ns_dir = root.join(&scope.cgroup_parent);
        if let Ok(entries) = std::fs::read_dir(&ns_dir) {
            for e in entries.flatten() {
                if e.file_type().map(|t| t.is_dir()).unwrap_or(false) {
                    left.push(format!("cgroup {}", e.path().display()));
                }
            }
        }
    }
    left
}

/// Every cgroup hierarchy's mount point (v1 controllers and the unified one).
fn cgroup_roots() -> Vec<PathBuf> {
    mount_points(&["cgroup", "cgroup2"])
}

/// The mount points of this process's mounts of the filesystem `types`.
pub(crate) fn mount_points(types: &[&str]) -> Vec<PathBuf> {
    let mountinfo = std::fs::read_to_string("/proc/self/mountinfo").unwrap_or_default();
    mountinfo
        .lines()
        .filter_map(|line| {
            let (left, right) = line.split_once(" - ")?;
            let fstype = right.split(' ').next()?;
            types
                .contains(&fstype)
                .then(|| PathBuf::from(left.split(' ').nth(4).unwrap_or("/")))
        })
        .collect()
}

/// The mount points of this process's mounts at or below `dir`, as
/// mountinfo spells them: a name with a space or another escaped byte
/// (none of crab's or containerd's) is listed escaped, so it is never
/// taken for gone, though it cannot be unmounted by that name. Nothing
/// for a `dir` that is not an absolute path at least two levels below `/`
/// (a test's own directory), so that a wrong one cannot name the host's
/// mounts.
pub(crate) fn mounts_under(dir: &Path) -> Vec<PathBuf> {
    if !dir.is_absolute() || dir.components().count() < 3 {
        return Vec::new();
    }
    let dir = dir.canonicalize().unwrap_or_else(|_| dir.to_owned());
    let mountinfo = std::fs::read_to_string("/proc/self/mountinfo").unwrap_or_default();
    mountinfo
        .lines()
        .filter_map(|line| line.split(' ').nth(4).map(PathBuf::from))
        .filter(|point| point.starts_with(&dir))
        .collect()
}

/// Unmounts every mount at or below `dir` ([`mounts_under`]): each topmost
/// one lazily with what is below it, never through a symlink. Returns
/// whether none is left.
pub(crate) fn unmount_under(dir: &Path) -> bool {
    let points = mounts_under(dir);
    for point in &points {
        let covered = points.iter().any(|p| p != point && point.starts_with(p));
        if !covered {
            let _ = nix::mount::umount2(
                point,
                nix::mount::MntFlags::MNT_DETACH | nix::mount::MntFlags::UMOUNT_NOFOLLOW,
            );
        }
    }
    mounts_under(dir).is_empty()
}

/// Pids of crab shims serving the containerd at `address`.
pub fn shim_pids(address: &str) -> Vec<i32> {
    let mut pids = Vec::new();
    for entry in std::fs::read_dir("/proc").into_iter().flatten().flatten() {
        let Ok(pid) = entry.file_name().to_string_lossy().parse::<i32>() else {
            continue;
        };
        let Ok(cmdline) = std::fs::read(entry.path().join("cmdline")) else {
            continue;
        };
        let args: Vec<String> = cmdline
            .split(|b| *b == 0)
            .map(|a| String::from_utf8_lossy(a).into_owned())
            .collect();
        let is_shim = args
            .first()
            .is_some_and(|a| a.ends_with("containerd-shim-crab-v2"));
        if is_shim && args.iter().any(|a| a == address) {
            pids.push(pid);
        }
    }
    pids
}

/// The shim socket containerd-shim derives from containerd's address,
/// namespace and id (`/run/containerd/s/<sha256>`).
fn shim_socket(address: &str, namespace: &str, id: &str) -> PathBuf {
    let key = Path::new(address).join(namespace).join(id);
    let out = Command::new("sha256sum")
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .spawn()
        .and_then(|mut child| {
            use std::io::Write;
            child
                .stdin
                .take()
                .expect("piped stdin")
                .write_all(key.to_string_lossy().as_bytes())?;
            child.wait_with_output()
        })
        .expect("run sha256sum");
    let hex = String::from_utf8_lossy(&out.stdout);
    PathBuf::from("/run/containerd/s").join(hex.split_whitespace().next().unwrap_or_default())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn no_mounts_are_named_under_a_path_that_is_not_a_test_directory() {
        // "/" and "/tmp" hold the host's own mounts (this process has at
        // least /proc and /sys below "/"): never named.
        assert!(mounts_under(Path::new("/")).is_empty());
        assert!(mounts_under(Path::new("/tmp")).is_empty());
        assert!(mounts_under(Path::new("")).is_empty());
        assert!(mounts_under(Path::new("relative/dir/here")).is_empty());
        // A test's depth names what is mounted there (the cgroup
        // hierarchies, on this machine kind).
        assert!(!mounts_under(Path::new("/sys/fs/cgroup")).is_empty());
    }
}
