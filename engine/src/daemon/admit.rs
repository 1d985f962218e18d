//! What a container from an imported archive may be on this host. An
//! archive comes from another host and its manifest from whoever wrote
//! it: its runtime, snapshotter and labels are never taken, and a spec
//! that would reach this host is refused before anything is written:
//! OCI hooks (they run here, as root), bind mounts (a host path inside),
//! joined or missing namespaces (the host's own), device nodes or access
//! to every device, capabilities beyond containerd's defaults, a root
//! outside the bundle.

use std::path::{Component, Path, PathBuf};

use serde_json::Value;

use super::ApiError;
use crate::containerd::ContainerTemplate;

/// The runtime every imported sandbox runs on.
const RUNTIME: &str = "io.containerd.crab.v2";

/// The snapshotter an import makes its rootfs with (the copy is an
/// overlay upper directory).
const SNAPSHOTTER: &str = "overlayfs";

/// Namespaces a sandbox must have of its own.
const OWN_NAMESPACES: [&str; 5] = ["pid", "network", "mount", "ipc", "uts"];

/// containerd's default capabilities (`oci.WithDefaultSpec`).
const DEFAULT_CAPS: [&str; 14] = [
    "CAP_CHOWN",
    "CAP_DAC_OVERRIDE",
    "CAP_FSETID",
    "CAP_FOWNER",
    "CAP_MKNOD",
    "CAP_NET_RAW",
    "CAP_SETGID",
    "CAP_SETUID",
    "CAP_SETFCAP",
    "CAP_SETPCAP",
    "CAP_NET_BIND_SERVICE",
    "CAP_SYS_CHROOT",
    "CAP_KILL",
    "CAP_AUDIT_WRITE",
];

/// Makes `t` the container this host starts for an archive, or refuses it.
/// A bind mount is admitted read-only from under one of `bind_sources`.
pub(super) fn admit(t: &mut ContainerTemplate, bind_sources: &[PathBuf]) -> Result<(), ApiError> {
    t.runtime = RUNTIME.to_owned();
    if t.snapshotter != SNAPSHOTTER {
        return refuse(format!(
            "its snapshotter is {:?}, not {SNAPSHOTTER}",
            t.snapshotter
        ));
    }
    t.labels.clear();
    check_spec(&mut t.spec, bind_sources).map_err(|reason| ApiError::Refused { reason })
}

/// Whether bind mount `m` is read-only, private, and from under one of
/// `sources` (its source what it says: no symlink on the way).
fn allowed_bind(m: &Value, sources: &[PathBuf]) -> bool {
    let options = options(m);
    let read_only = options.contains(&"ro") && !options.contains(&"rw");
    let private = !options
        .iter()
        .any(|o| o.contains("shared") || o.contains("slave"));
    let source = Path::new(m["source"].as_str().unwrap_or_default());
    let plain = source.is_absolute()
        && source
            .components()
            .all(|c| matches!(c, Component::RootDir | Component::Normal(_)));
    let real = std::fs::canonicalize(source).is_ok_and(|c| c == source);
    read_only && private && plain && real && sources.iter().any(|s| source.starts_with(s))
}

/// Mount `m`'s options.
fn options(m: &Value) -> Vec<&str> {
    m["options"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(Value::as_str)
        .collect()
}

fn refuse(reason: String) -> Result<(), ApiError> {
    Err(ApiError::Refused { reason })
}

/// The mount types a sandbox may have besides admitted binds, and whether
/// each must be read-only.
const MOUNT_TYPES: [(&str, bool); 6] = [
    ("proc", false),
    ("tmpfs", false),
    ("devpts", false),
    ("mqueue", false),
    ("sysfs", true),
    ("cgroup", true),
];

/// containerd's default masked and read-only paths: always there.
const MASKED: [&str; 10] = [
    "/proc/acpi",
    "/proc/asound",
    "/proc/kcore",
    "/proc/keys",
    "/proc/latency_stats",
    "/proc/timer_list",
    "/proc/timer_stats",
    "/proc/sched_debug",
    "/sys/firmware",
    "/proc/scsi",
];
const READ_ONLY: [&str; 5] = [
    "/proc/bus",
    "/proc/fs",
    "/proc/irq",
    "/proc/sys",
    "/proc/sysrq-trigger",
];

/// containerd's default device rules (`oci.WithDefaultSpec`): nothing but
/// the usual character devices.
fn default_device_rules() -> Value {
    let allow = |major: i64, minor: Option<i64>| serde_json::json!({"allow": true, "type": "c", "major": major, "minor": minor, "access": "rwm"});
    let mut rules = vec![serde_json::json!({"allow": false, "access": "rwm"})];
    for (major, minor) in [
        (1, Some(3)),
        (1, Some(8)),
        (1, Some(7)),
        (5, Some(0)),
        (1, Some(5)),
        (1, Some(9)),
        (5, Some(1)),
        (136, None),
        (5, Some(2)),
        (10, Some(200)),
    ] {
        let mut rule = allow(major, minor);
        if minor.is_none() {
            rule.as_object_mut().expect("an object").remove("minor");
        }
        rules.push(rule);
    }
    Value::Array(rules)
}

/// Checks `spec` against what a sandbox may be here, and sets what is
/// this host's to say: its root, masked paths, device rules, and no
/// annotation but the user's own.
fn check_spec(spec: &mut Value, bind_sources: &[PathBuf]) -> Result<(), String> {
    let empty = |v: &Value| {
        v.is_null()
            || v.as_object()
                .is_some_and(|o| o.values().all(|h| h.as_array().is_none_or(Vec::is_empty)))
    };
    if !empty(&spec["hooks"]) {
        return Err("its spec has OCI hooks, which would run on this host as root".into());
    }
    if spec["root"]["path"] != "rootfs" {
        return Err(format!(
            "its root is {}, not its bundle's rootfs",
            spec["root"]["path"]
        ));
    }
    for m in spec["mounts"].as_array().into_iter().flatten() {
        let options = options(m);
        let bind = m["type"] == "bind" || options.iter().any(|o| *o == "bind" || *o == "rbind");
        if bind {
            if !allowed_bind(m, bind_sources) {
                return Err(format!(
                    "it bind-mounts the host's {} at {} (only private, read-only binds of a real path under [crabd] import_bind_sources are admitted)",
                    m["source"], m["destination"]
                ));
            }
            continue;
        }
        let kind = m["type"].as_str().unwrap_or_default();
        match MOUNT_TYPES
            .iter()
            .find(|(t, _)| *t == kind || (*t == "cgroup" && kind == "cgroup2"))
        {
            Some((_, true)) if !options.contains(&"ro") || options.contains(&"rw") => {
                return Err(format!("it mounts {kind} at {} writable", m["destination"]));
            }
            Some(_) => {}
            None => return Err(format!("it mounts a {kind:?} filesystem at {}", m["destination"])),
        }
    }
    let process = &spec["process"];
    if process.get("scheduler").is_some_and(|s| !s.is_null()) {
        return Err("it sets a real-time scheduler".into());
    }
    if process["oomScoreAdj"].as_i64().is_some_and(|o| o < 0) {
        return Err("it shields itself from the OOM killer".into());
    }
    let caps = &process["capabilities"];
    for set in ["bounding", "effective", "permitted"] {
        if !caps[set].is_array() {
            return Err(format!(
                "its capabilities name no {set} set (it would keep every capability)"
            ));
        }
    }
    for set in ["bounding", "effective", "permitted", "inheritable", "ambient"] {
        for cap in caps[set].as_array().into_iter().flatten() {
            let name = cap.as_str().unwrap_or_default();
            if !DEFAULT_CAPS.contains(&name) {
                return Err(format!(
                    "it holds {name} ({set}), beyond containerd's default capabilities"
                ));
            }
        }
    }
    let linux = spec
        .get_mut("linux")
        .and_then(Value::as_object_mut)
        .ok_or("its spec has no linux section")?;
    let namespaces = linux
        .get("namespaces")
        .and_then(Value::as_array)
        .cloned()
        .unwrap_or_default();
    for ns in &namespaces {
        if ns.get("path").is_some_and(|p| !p.is_null()) {
            return Err(format!("it joins the {} namespace at {}", ns["type"], ns["path"]));
        }
    }
    for own in OWN_NAMESPACES {
        if !namespaces.iter().any(|ns| ns["type"] == own) {
            return Err(format!("it shares this host's {own} namespace"));
        }
    }
    if linux
        .get("devices")
        .and_then(Value::as_array)
        .is_some_and(|d| !d.is_empty())
    {
        return Err("its spec makes device nodes".into());
    }
    let set = |key: &str| linux.get(key).is_some_and(|v| !v.is_null());
    if set("netDevices") {
        return Err("it moves host network devices into it".into());
    }
    if set("intelRdt") {
        return Err("it sets Intel RDT".into());
    }
    if linux
        .get("seccomp")
        .and_then(|s| s.get("listenerPath"))
        .is_some_and(|p| !p.is_null())
    {
        return Err("its seccomp filter hands its syscalls to a host listener".into());
    }
    if linux
        .get("rootfsPropagation")
        .and_then(Value::as_str)
        .is_some_and(|p| p.contains("shared"))
    {
        return Err("its rootfs propagates mounts to this host".into());
    }
    if let Some(path) = linux.get("cgroupsPath").and_then(Value::as_str) {
        if path.split('/').any(|p| p == ".." || p == ".") {
            return Err(format!("its cgroups path {path:?} leaves its own"));
        }
    }
    // This host's to say, whatever the archive said.
    let union = |given: Option<&Value>, base: &[&str]| {
        let mut all: Vec<Value> = base.iter().map(|p| Value::from(*p)).collect();
        for p in given.and_then(Value::as_array).into_iter().flatten() {
            if !all.contains(p) {
                all.push(p.clone());
            }
        }
        Value::Array(all)
    };
    let masked = union(linux.get("maskedPaths"), &MASKED);
    let read_only = union(linux.get("readonlyPaths"), &READ_ONLY);
    linux.insert("maskedPaths".into(), masked);
    linux.insert("readonlyPaths".into(), read_only);
    let resources = linux.entry("resources").or_insert_with(|| serde_json::json!({}));
    if let Some(r) = resources.as_object_mut() {
        r.insert("devices".into(), default_device_rules());
    }
    if let Some(annotations) = spec.get_mut("annotations").and_then(Value::as_object_mut) {
        annotations.retain(|k, _| {
            !["io.crab.", "io.kubernetes.", "io.containerd.", "org.criu."]
                .iter()
                .any(|p| k.starts_with(p))
        });
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    /// A spec as `ctr run` makes it.
    fn spec() -> Value {
        json!({
            "root": {"path": "rootfs"},
            "process": {"args": ["sh"], "capabilities": {"bounding": ["CAP_CHOWN", "CAP_KILL"], "effective": ["CAP_KILL"], "permitted": ["CAP_KILL"]}},
            "mounts": [{"destination": "/proc", "type": "proc", "source": "proc"},
                       {"destination": "/dev", "type": "tmpfs", "source": "tmpfs", "options": ["nosuid"]}],
            "annotations": {"io.crab.restore.images": "/var/lib/elsewhere", "user.note": "kept"},
            "linux": {
                "namespaces": [{"type": "pid"}, {"type": "network"}, {"type": "mount"}, {"type": "ipc"}, {"type": "uts"}],
                "resources": {"devices": [{"allow": false, "access": "rwm"}, {"allow": true, "type": "c", "major": 1, "minor": 3, "access": "rwm"}]},
                "cgroupsPath": "/default/x"
            }
        })
    }

    fn template(spec: Value) -> ContainerTemplate {
        ContainerTemplate {
            id: "x".into(),
            image: "docker.io/library/busybox:latest".into(),
            runtime: "io.containerd.runc.v2".into(),
            snapshotter: "overlayfs".into(),
            parent: "sha256:abc".into(),
            spec,
            labels: [("io.crab.forked-from".to_owned(), "y".to_owned())].into(),
        }
    }

    #[test]
    fn an_ordinary_container_is_admitted_on_crab_with_nothing_of_its_own_steering() {
        let mut s = spec();
        s["linux"]["resources"]["devices"] = json!([{"allow": true, "type": "b", "access": "rwm"}]);
        s["linux"]["maskedPaths"] = json!(["/proc/mine"]);
        s["annotations"]["io.kubernetes.cri.sandbox-id"] = json!("other-pod");
        let mut t = template(s);
        admit(&mut t, &[]).unwrap();
        assert_eq!(t.runtime, RUNTIME);
        assert!(t.labels.is_empty());
        assert_eq!(t.spec["annotations"], json!({"user.note": "kept"}));
        // This host's device rules and masks, whatever the archive said.
        assert_eq!(t.spec["linux"]["resources"]["devices"], default_device_rules());
        let masked = t.spec["linux"]["maskedPaths"].as_array().unwrap();
        assert!(masked.contains(&json!("/proc/kcore")) && masked.contains(&json!("/proc/mine")));
        assert!(t.spec["linux"]["readonlyPaths"]
            .as_array()
            .unwrap()
            .contains(&json!("/proc/sysrq-trigger")));
    }

    #[test]
    fn a_spec_that_would_reach_the_host_is_refused() {
        type Change = Box<dyn Fn(&mut Value)>;
        let cases: Vec<(&str, Change)> = vec![
            (
                "hooks",
                Box::new(|s| {
                    s["hooks"] =
                        json!({"prestart": [{"path": "/bin/sh", "args": ["sh", "-c", "id > /tmp/pwned"]}]})
                }),
            ),
            (
                "bind-mounts",
                Box::new(|s| {
                    s["mounts"].as_array_mut().unwrap().push(
                        json!({"destination": "/host", "type": "bind", "source": "/", "options": ["rbind"]}),
                    )
                }),
            ),
            (
                "bind-mounts",
                Box::new(|s| {
                    s["mounts"].as_array_mut().unwrap().push(json!({"destination": "/etc/x", "type": "none", "source": "/etc/shadow", "options": ["bind", "ro"]}))
                }),
            ),
            (
                "joins the",
                Box::new(|s| {
                    s["linux"]["namespaces"][1] = json!({"type": "network", "path": "/proc/1/ns/net"})
                }),
            ),
            (
                "shares this host's pid",
                Box::new(|s| {
                    s["linux"]["namespaces"].as_array_mut().unwrap().remove(0);
                }),
            ),
            (
                "device nodes",
                Box::new(|s| {
                    s["linux"]["devices"] = json!([{"path": "/dev/sda", "type": "b", "major": 8, "minor": 0}])
                }),
            ),
            (
                "not its bundle's rootfs",
                Box::new(|s| s["root"]["path"] = json!("/")),
            ),
            (
                "not its bundle's rootfs",
                Box::new(|s| s["root"]["path"] = json!("rootfs/x")),
            ),
            (
                "not its bundle's rootfs",
                Box::new(|s| s["root"]["path"] = json!(".")),
            ),
            (
                "no bounding set",
                Box::new(|s| {
                    s["process"].as_object_mut().unwrap().remove("capabilities");
                }),
            ),
            (
                "\"overlay\" filesystem",
                Box::new(|s| {
                    s["mounts"].as_array_mut().unwrap().push(json!({"destination": "/h", "type": "overlay", "source": "overlay", "options": ["lowerdir=/"]}))
                }),
            ),
            (
                "writable",
                Box::new(|s| {
                    s["mounts"].as_array_mut().unwrap().push(
                        json!({"destination": "/sys", "type": "sysfs", "source": "sysfs", "options": ["rw"]}),
                    )
                }),
            ),
            (
                "network devices",
                Box::new(|s| s["linux"]["netDevices"] = json!({"eth0": {}})),
            ),
            (
                "leaves its own",
                Box::new(|s| s["linux"]["cgroupsPath"] = json!("/default/x/../../system.slice")),
            ),
            (
                "OOM killer",
                Box::new(|s| s["process"]["oomScoreAdj"] = json!(-1000)),
            ),
            (
                "CAP_SYS_ADMIN",
                Box::new(|s| {
                    s["process"]["capabilities"]["bounding"]
                        .as_array_mut()
                        .unwrap()
                        .push(json!("CAP_SYS_ADMIN"))
                }),
            ),
        ];
        for (want, change) in cases {
            let mut s = spec();
            change(&mut s);
            let err = admit(&mut template(s), &[PathBuf::from("/srv/shared")])
                .unwrap_err()
                .to_string();
            assert!(err.contains(want), "{want}: {err}");
        }
        let mut t = template(spec());
        t.snapshotter = "native".into();
        assert!(admit(&mut t, &[])
            .unwrap_err()
            .to_string()
            .contains("snapshotter"));
    }

    #[test]
    fn a_bind_is_admitted_read_only_from_under_a_listed_source_only() {
        let dir = tempfile::tempdir().unwrap();
        let shared = std::fs::canonicalize(dir.path()).unwrap().join("shared");
        std::fs::create_dir_all(shared.join("data")).unwrap();
        std::fs::create_dir_all(shared.with_file_name("sharedsecrets")).unwrap();
        std::os::unix::fs::symlink("/etc", shared.join("link")).unwrap();
        let allowed = [shared.clone()];
        let with_bind = |source: &Path, options: Value| {
            let mut s = spec();
            let bind = json!({"destination": "/x", "type": "bind", "source": source, "options": options});
            s["mounts"].as_array_mut().unwrap().push(bind);
            admit(&mut template(s), &allowed)
        };
        assert!(with_bind(&shared.join("data"), json!(["rbind", "ro"])).is_ok());
        assert!(with_bind(&shared, json!(["rbind", "ro"])).is_ok());
        for (source, options, why) in [
            (shared.join("data"), json!(["rbind", "rw"]), "writable"),
            (shared.join("data"), json!(["rbind", "ro", "rw"]), "ro then rw"),
            (
                shared.join("data"),
                json!(["rbind", "ro", "rshared"]),
                "shared propagation",
            ),
            (shared.join("../../etc"), json!(["rbind", "ro"]), "dot-dot"),
            (shared.join("link"), json!(["rbind", "ro"]), "a symlink out"),
            (
                shared.with_file_name("sharedsecrets"),
                json!(["rbind", "ro"]),
                "a sibling prefix",
            ),
            (PathBuf::from("/etc"), json!(["rbind", "ro"]), "unlisted"),
        ] {
            assert!(with_bind(&source, options).is_err(), "{why}");
        }
    }
}
