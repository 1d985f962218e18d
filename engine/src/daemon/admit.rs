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

/// Whether bind mount `m` is read-only from under one of `sources`.
fn allowed_bind(m: &Value, sources: &[PathBuf]) -> bool {
    let read_only = m["options"].as_array().into_iter().flatten().any(|o| o == "ro");
    let source = Path::new(m["source"].as_str().unwrap_or_default());
    let plain = source.is_absolute()
        && source
            .components()
            .all(|c| matches!(c, Component::RootDir | Component::Normal(_)));
    read_only && plain && sources.iter().any(|s| source.starts_with(s))
}

fn refuse(reason: String) -> Result<(), ApiError> {
    Err(ApiError::Refused { reason })
}

/// Checks `spec`, and drops the annotations that steer Crab itself.
fn check_spec(spec: &mut Value, bind_sources: &[PathBuf]) -> Result<(), String> {
    let empty = |v: &Value| {
        v.is_null()
            || v.as_object()
                .is_some_and(|o| o.values().all(|h| h.as_array().is_none_or(Vec::is_empty)))
    };
    if !empty(&spec["hooks"]) {
        return Err("its spec has OCI hooks, which would run on this host as root".into());
    }
    if let Some(path) = spec["root"]["path"].as_str() {
        if path.starts_with('/') || path.split('/').any(|p| p == "..") {
            return Err(format!("its root is {path:?}, outside its bundle"));
        }
    }
    for m in spec["mounts"].as_array().into_iter().flatten() {
        let bind = m["type"] == "bind"
            || m["options"]
                .as_array()
                .into_iter()
                .flatten()
                .any(|o| o == "bind" || o == "rbind");
        if bind && !allowed_bind(m, bind_sources) {
            return Err(format!(
                "it bind-mounts the host's {} at {} (only read-only binds from under [crabd] import_bind_sources are admitted)",
                m["source"], m["destination"]
            ));
        }
    }
    let linux = &spec["linux"];
    let namespaces = linux["namespaces"].as_array().cloned().unwrap_or_default();
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
    if linux["devices"].as_array().is_some_and(|d| !d.is_empty()) {
        return Err("its spec makes device nodes".into());
    }
    for rule in linux["resources"]["devices"].as_array().into_iter().flatten() {
        let every = rule["type"].is_null() || rule["type"] == "a";
        if rule["allow"] == true && every {
            return Err("it may use every device of this host".into());
        }
    }
    for set in ["bounding", "effective", "permitted", "inheritable", "ambient"] {
        for cap in spec["process"]["capabilities"][set]
            .as_array()
            .into_iter()
            .flatten()
        {
            let name = cap.as_str().unwrap_or_default();
            if !DEFAULT_CAPS.contains(&name) {
                return Err(format!(
                    "it holds {name} ({set}), beyond containerd's default capabilities"
                ));
            }
        }
    }
    if let Some(annotations) = spec.get_mut("annotations").and_then(Value::as_object_mut) {
        annotations.retain(|k, _| !k.starts_with("io.crab."));
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
            "process": {"args": ["sh"], "capabilities": {"bounding": ["CAP_CHOWN", "CAP_KILL"], "effective": ["CAP_KILL"]}},
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
        let mut t = template(spec());
        admit(&mut t, &[]).unwrap();
        assert_eq!(t.runtime, RUNTIME);
        assert!(t.labels.is_empty());
        assert_eq!(t.spec["annotations"], json!({"user.note": "kept"}));
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
                "every device",
                Box::new(|s| s["linux"]["resources"]["devices"] = json!([{"allow": true, "access": "rwm"}])),
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
            ("outside its bundle", Box::new(|s| s["root"]["path"] = json!("/"))),
            (
                "outside its bundle",
                Box::new(|s| s["root"]["path"] = json!("../../etc")),
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
        let allowed = [PathBuf::from("/srv/shared")];
        let with_bind = |source: &str, options: Value| {
            let mut s = spec();
            let bind = json!({"destination": "/x", "type": "bind", "source": source, "options": options});
            s["mounts"].as_array_mut().unwrap().push(bind);
            admit(&mut template(s), &allowed)
        };
        assert!(with_bind("/srv/shared/data", json!(["rbind", "ro"])).is_ok());
        assert!(with_bind("/srv/shared", json!(["rbind", "ro"])).is_ok());
        assert!(
            with_bind("/srv/shared/data", json!(["rbind", "rw"])).is_err(),
            "writable"
        );
        assert!(
            with_bind("/srv/shared/../../etc", json!(["rbind", "ro"])).is_err(),
            "dot-dot"
        );
        assert!(
            with_bind("/srv/sharedsecrets", json!(["rbind", "ro"])).is_err(),
            "a sibling prefix"
        );
        assert!(with_bind("/etc", json!(["rbind", "ro"])).is_err(), "unlisted");
    }
}
