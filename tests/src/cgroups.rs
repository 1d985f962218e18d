//! Cgroups the tests leave: the runtime makes a container's cgroup at
//! ctr's path `/<namespace>/<id>`, parents included, in every hierarchy,
//! and (as runc) removes only the container's own; a test's namespace is
//! unique, so each run would leave hundreds of parents behind.

/// Removes cgroup `name` (a path below the root) from every mounted
/// hierarchy where it is empty; one that holds processes or children stays.
pub fn remove_empty(name: &str) {
    let name = name.trim_start_matches('/');
    if name.is_empty() || name.split('/').any(|c| c == ".." || c == ".") {
        return;
    }
    let Ok(mounts) = std::fs::read_to_string("/proc/self/mounts") else {
        return;
    };
    for line in mounts.lines() {
        let mut f = line.split_whitespace();
        let (Some(_), Some(at), Some(kind)) = (f.next(), f.next(), f.next()) else {
            continue;
        };
        if kind == "cgroup" || kind == "cgroup2" {
            let _ = std::fs::remove_dir(std::path::Path::new(at).join(name));
        }
    }
}
