//! `crabctl register docker|containerd`: adds Crab's runtime to docker's
//! `daemon.json` (`docker run --runtime crab`) or to containerd's CRI
//! runtimes (a Kubernetes RuntimeClass with handler `crab`), and with
//! `--remove` takes out only what it added. The .deb's maintainer scripts
//! call it when the administrator asked for it.
//!
//! A configuration that already names a different `crab` runtime, or one
//! the change would make unreadable, is left as it was with an error that
//! says why; a file is replaced whole (written beside it, synced, renamed),
//! so a crash leaves the old or the new one.

use std::io::Write;
use std::path::{Path, PathBuf};

use indexmap::IndexMap;
use serde::{Deserialize, Serialize};

/// The runtime type both engines name Crab by.
const RUNTIME_TYPE: &str = "io.containerd.crab.v2";
/// The runtime's name in docker and the handler's in CRI.
const NAME: &str = "crab";
/// The first line of the block [`containerd`] appends.
const BEGIN: &str =
    "# Added by `crabctl register containerd`; `crabctl register containerd --remove` takes it out.";
/// The last line of that block.
const END: &str = "# End of what `crabctl register containerd` added.";

/// The engine whose configuration to change.
#[derive(Clone, Copy, Debug, clap::ValueEnum, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Engine {
    /// dockerd: `runtimes.crab` in `daemon.json`.
    Docker,
    /// containerd's CRI plugin: the runtime handler `crab` in `config.toml`.
    Containerd,
}

impl Engine {
    /// Where the engine reads its configuration by default.
    pub fn default_config(self) -> &'static Path {
        Path::new(match self {
            Engine::Docker => "/etc/docker/daemon.json",
            Engine::Containerd => "/etc/containerd/config.toml",
        })
    }

    /// What the user does next for the change to take effect.
    pub fn next_step(self) -> &'static str {
        match self {
            Engine::Docker => {
                "reload dockerd to apply it (systemctl reload docker, or kill -HUP $(pidof dockerd))"
            }
            Engine::Containerd => "restart containerd to apply it (systemctl restart containerd)",
        }
    }
}

/// What a registration did.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Outcome {
    /// Crab's runtime was added.
    Added,
    /// It was there already; nothing was written.
    AlreadyThere,
    /// Crab's runtime was taken out.
    Removed,
    /// There was nothing of Crab's to take out; nothing was written.
    NotThere,
}

/// Why a configuration was left as it was.
#[derive(Debug, thiserror::Error)]
pub enum RegisterError {
    /// Reading or writing the file failed.
    #[error("cannot {what} {}", path.display())]
    Io {
        /// The step.
        what: &'static str,
        /// The file.
        path: PathBuf,
        /// Why.
        #[source]
        source: std::io::Error,
    },
    /// The file is not what the engine reads.
    #[error("{} is not valid {format}: {reason}; fix it first, nothing was changed", path.display())]
    Unreadable {
        /// The file.
        path: PathBuf,
        /// JSON or TOML.
        format: &'static str,
        /// The parser's words.
        reason: String,
    },
    /// Something else is there under Crab's name.
    #[error("{} already has a runtime {NAME:?} that is not Crab's ({found}); nothing was changed", path.display())]
    Conflict {
        /// The file.
        path: PathBuf,
        /// What the file has.
        found: String,
    },
    /// The configuration's layout is one this command does not edit.
    #[error("{} cannot be edited here: {reason}; nothing was changed", path.display())]
    Unsupported {
        /// The file.
        path: PathBuf,
        /// Why, and what to do.
        reason: String,
    },
}

/// Adds (or with `remove`, takes out) Crab's runtime in `engine`'s
/// configuration file at `path`.
pub fn register(engine: Engine, path: &Path, remove: bool) -> Result<Outcome, RegisterError> {
    let path = resolve(path)?;
    let text = match std::fs::read_to_string(&path) {
        Ok(text) => Some(text),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => None,
        Err(source) => {
            return Err(RegisterError::Io {
                what: "read",
                path,
                source,
            })
        }
    };
    let change = match engine {
        Engine::Docker => docker(&path, text.as_deref(), remove)?,
        Engine::Containerd => containerd(&path, text.as_deref(), remove)?,
    };
    match change {
        Change::Keep(outcome) => Ok(outcome),
        Change::Write(outcome, new) => {
            replace(&path, &new)?;
            Ok(outcome)
        }
    }
}

/// A configuration's edit.
#[derive(Debug)]
enum Change {
    /// Nothing to write.
    Keep(Outcome),
    /// Write this text.
    Write(Outcome, String),
}

/// The file a path names, through a symbolic link (a configuration kept
/// elsewhere by a management tool stays a link).
fn resolve(path: &Path) -> Result<PathBuf, RegisterError> {
    match std::fs::canonicalize(path) {
        Ok(real) => Ok(real),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(path.to_owned()),
        Err(source) => Err(RegisterError::Io {
            what: "resolve",
            path: path.to_owned(),
            source,
        }),
    }
}

/// A JSON document whose objects keep their keys' order (serde_json's
/// `Value` sorts them): `daemon.json` is the administrator's file.
#[derive(Clone, Debug, PartialEq, Deserialize, Serialize)]
#[serde(untagged)]
enum Json {
    Null,
    Bool(bool),
    Number(serde_json::Number),
    String(String),
    Array(Vec<Json>),
    Object(IndexMap<String, Json>),
}

/// docker's `daemon.json`: `runtimes.crab = {"runtimeType": …}`.
fn docker(path: &Path, text: Option<&str>, remove: bool) -> Result<Change, RegisterError> {
    let unreadable = |reason: String| RegisterError::Unreadable {
        path: path.to_owned(),
        format: "JSON",
        reason,
    };
    let doc = match text {
        Some(t) if !t.trim().is_empty() => serde_json::from_str(t).map_err(|e| unreadable(e.to_string()))?,
        _ => Json::Object(IndexMap::new()),
    };
    let Json::Object(mut top) = doc else {
        return Err(unreadable("the document is not an object".into()));
    };
    let ours = Json::Object(IndexMap::from([(
        "runtimeType".to_owned(),
        Json::String(RUNTIME_TYPE.to_owned()),
    )]));
    if remove && top.get("default-runtime") == Some(&Json::String(NAME.to_owned())) {
        return Err(RegisterError::Unsupported {
            path: path.to_owned(),
            reason: "\"crab\" is docker's default-runtime: dockerd would not start without it; change default-runtime first".into(),
        });
    }
    let runtimes = top
        .entry("runtimes".to_owned())
        .or_insert_with(|| Json::Object(IndexMap::new()));
    let Json::Object(runtimes) = runtimes else {
        return Err(unreadable("\"runtimes\" is not an object".into()));
    };
    let outcome = match (runtimes.get(NAME), remove) {
        (Some(found), _) if *found != ours => {
            return Err(RegisterError::Conflict {
                path: path.to_owned(),
                found: serde_json::to_string(found).expect("a JSON value serializes"),
            })
        }
        (Some(_), false) => return Ok(Change::Keep(Outcome::AlreadyThere)),
        (None, true) => return Ok(Change::Keep(Outcome::NotThere)),
        (Some(_), true) => {
            runtimes.shift_remove(NAME);
            if runtimes.is_empty() {
                top.shift_remove("runtimes");
            }
            Outcome::Removed
        }
        (None, false) => {
            runtimes.insert(NAME.into(), ours);
            Outcome::Added
        }
    };
    let mut new = serde_json::to_string_pretty(&top).expect("a JSON value serializes");
    new.push('\n');
    Ok(Change::Write(outcome, new))
}

/// containerd's `config.toml`: the CRI runtime handler `crab`. The block is
/// appended as text, so the file's comments and layout stay as they were.
fn containerd(path: &Path, text: Option<&str>, remove: bool) -> Result<Change, RegisterError> {
    let text = text.unwrap_or("");
    let parse = |t: &str| {
        t.parse::<toml::Table>().map_err(|e| RegisterError::Unreadable {
            path: path.to_owned(),
            format: "TOML",
            reason: e.message().to_owned(),
        })
    };
    let doc = parse(text)?;
    let empty = doc.is_empty();
    let plugin = match doc.get("version").and_then(toml::Value::as_integer) {
        Some(2) => "io.containerd.grpc.v1.cri",
        Some(3) => "io.containerd.cri.v1.runtime",
        None if empty => "io.containerd.grpc.v1.cri",
        other => {
            let cri_off = doc
                .get("disabled_plugins")
                .and_then(toml::Value::as_array)
                .is_some_and(|p| p.iter().any(|v| v.as_str() == Some("cri")));
            return Err(RegisterError::Unsupported {
                path: path.to_owned(),
                reason: format!(
                    "config version {} (this command edits versions 2 and 3; `containerd config migrate` converts it){}",
                    other.map_or("1".to_owned(), |v| v.to_string()),
                    if cri_off { "; its CRI plugin is disabled (disabled_plugins), so it has no runtime handlers" } else { "" }
                ),
            });
        }
    };
    let root = toml::Value::Table(doc);
    let found = ["plugins", plugin, "containerd", "runtimes", NAME]
        .iter()
        .try_fold(&root, |v, key| v.get(key))
        .cloned();
    let is_ours = |v: &toml::Value| v.get("runtime_type").and_then(toml::Value::as_str) == Some(RUNTIME_TYPE);
    let default = ["plugins", plugin, "containerd", "default_runtime_name"]
        .iter()
        .try_fold(&root, |v, key| v.get(key))
        .and_then(toml::Value::as_str);
    if remove && default == Some(NAME) {
        return Err(RegisterError::Unsupported {
            path: path.to_owned(),
            reason: "\"crab\" is the CRI plugin's default_runtime_name: pods would have no runtime; change it first".into(),
        });
    }
    match (found, remove) {
        (None, true) => Ok(Change::Keep(Outcome::NotThere)),
        (Some(v), _) if !is_ours(&v) => Err(RegisterError::Conflict {
            path: path.to_owned(),
            found: v.to_string().trim().to_owned(),
        }),
        (Some(_), false) => Ok(Change::Keep(Outcome::AlreadyThere)),
        (Some(_), true) => {
            let Some(new) = without_block(text) else {
                return Err(RegisterError::Unsupported {
                    path: path.to_owned(),
                    reason:
                        "its runtime \"crab\" was not added by crabctl (no marker lines); take it out by hand"
                            .into(),
                });
            };
            parse(&new)?;
            Ok(Change::Write(Outcome::Removed, new))
        }
        (None, false) => {
            let mut new = text.to_owned();
            if !new.is_empty() && !new.ends_with('\n') {
                new.push('\n');
            }
            if empty {
                // Nothing but comments: without a version line containerd
                // would read the table as version 1's.
                new.push_str("version = 2\n");
            }
            new.push_str(&format!(
                "\n{BEGIN}\n[plugins.\"{plugin}\".containerd.runtimes.{NAME}]\n  runtime_type = \"{RUNTIME_TYPE}\"\n  \
                 pod_annotations = [\"io.crab.sandbox-container\"]\n{END}\n"
            ));
            // A file that defines `runtimes` inline cannot take the table.
            parse(&new).map_err(|e| RegisterError::Unsupported {
                path: path.to_owned(),
                reason: format!("the appended table would not parse ({e}); add it by hand"),
            })?;
            Ok(Change::Write(Outcome::Added, new))
        }
    }
}

/// `text` without the block [`containerd`] appended (and the blank line
/// before it), or `None` when it has no such block.
fn without_block(text: &str) -> Option<String> {
    let lines: Vec<&str> = text.split_inclusive('\n').collect();
    let begin = lines.iter().position(|l| l.trim_end() == BEGIN)?;
    let end = begin + lines[begin..].iter().position(|l| l.trim_end() == END)?;
    let start = if begin > 0 && lines[begin - 1].trim().is_empty() {
        begin - 1
    } else {
        begin
    };
    Some(lines[..start].concat() + &lines[end + 1..].concat())
}

/// Replaces `path` with `text`: written beside it with the old file's mode
/// (0644 for a new one), synced, renamed over it, the directory synced.
fn replace(path: &Path, text: &str) -> Result<(), RegisterError> {
    use std::os::unix::fs::{OpenOptionsExt, PermissionsExt};
    let io = |what: &'static str, p: &Path| {
        let p = p.to_owned();
        move |source| RegisterError::Io {
            what,
            path: p,
            source,
        }
    };
    let dir = path.parent().unwrap_or(Path::new("/"));
    std::fs::create_dir_all(dir).map_err(io("create the directory of", path))?;
    let mode = match std::fs::metadata(path) {
        Ok(m) => m.permissions().mode() & 0o7777,
        Err(_) => 0o644,
    };
    let name = path.file_name().map(|n| n.to_string_lossy()).unwrap_or_default();
    let aside = dir.join(format!(".{name}.crabctl-{}", std::process::id()));
    let mut file = std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(mode)
        .open(&aside)
        .map_err(io("create", &aside))?;
    let written = file
        .write_all(text.as_bytes())
        .and_then(|()| file.set_permissions(std::fs::Permissions::from_mode(mode)))
        .and_then(|()| file.sync_all())
        .and_then(|()| std::fs::rename(&aside, path));
    if let Err(e) = written {
        let _ = std::fs::remove_file(&aside);
        return Err(io("write", path)(e));
    }
    std::fs::File::open(dir)
        .and_then(|d| d.sync_all())
        .map_err(io("sync the directory of", path))
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::{json, Value};

    fn write(dir: &Path, name: &str, text: &str) -> PathBuf {
        let p = dir.join(name);
        std::fs::write(&p, text).unwrap();
        p
    }

    fn tempdir() -> tempfile::TempDir {
        tempfile::tempdir().unwrap()
    }

    #[test]
    fn docker_keeps_the_order_of_the_administrators_keys() {
        let tmp = tempdir();
        let p = write(
            tmp.path(),
            "daemon.json",
            r#"{"zeta": 1, "runtimes": {"runsc": {"path": "/usr/bin/runsc"}}, "alpha": {"z": null, "a": [true, 1.5]}}"#,
        );
        assert_eq!(register(Engine::Docker, &p, false).unwrap(), Outcome::Added);
        let text = std::fs::read_to_string(&p).unwrap();
        let at = |key: &str| text.find(key).unwrap_or_else(|| panic!("{key} in {text}"));
        assert!(
            at("zeta") < at("runtimes") && at("runtimes") < at("alpha"),
            "{text}"
        );
        assert!(at("runsc") < at("crab") && at("\"z\"") < at("\"a\""), "{text}");
        assert_eq!(register(Engine::Docker, &p, true).unwrap(), Outcome::Removed);
        let back: Value = serde_json::from_str(&std::fs::read_to_string(&p).unwrap()).unwrap();
        assert_eq!(
            back,
            json!({"zeta": 1, "runtimes": {"runsc": {"path": "/usr/bin/runsc"}}, "alpha": {"z": null, "a": [true, 1.5]}})
        );
    }

    #[test]
    fn docker_keeps_other_settings_and_takes_out_only_its_own() {
        let tmp = tempdir();
        let dir = tmp.path();
        let p = write(
            dir,
            "daemon.json",
            r#"{"debug": true, "runtimes": {"gvisor": {"path": "/usr/bin/runsc"}}}"#,
        );
        assert_eq!(register(Engine::Docker, &p, false).unwrap(), Outcome::Added);
        let doc: Value = serde_json::from_str(&std::fs::read_to_string(&p).unwrap()).unwrap();
        assert_eq!(doc["debug"], json!(true));
        assert_eq!(doc["runtimes"]["gvisor"]["path"], json!("/usr/bin/runsc"));
        assert_eq!(doc["runtimes"]["crab"]["runtimeType"], json!(RUNTIME_TYPE));
        assert_eq!(
            register(Engine::Docker, &p, false).unwrap(),
            Outcome::AlreadyThere
        );
        assert_eq!(register(Engine::Docker, &p, true).unwrap(), Outcome::Removed);
        let doc: Value = serde_json::from_str(&std::fs::read_to_string(&p).unwrap()).unwrap();
        assert_eq!(
            doc,
            json!({"debug": true, "runtimes": {"gvisor": {"path": "/usr/bin/runsc"}}})
        );
        assert_eq!(register(Engine::Docker, &p, true).unwrap(), Outcome::NotThere);
    }

    #[test]
    fn docker_makes_the_file_and_leaves_a_foreign_crab_and_bad_json_alone() {
        let tmp = tempdir();
        let dir = tmp.path();
        let p = dir.join("etc/docker/daemon.json");
        assert_eq!(register(Engine::Docker, &p, false).unwrap(), Outcome::Added);
        use std::os::unix::fs::PermissionsExt;
        assert_eq!(std::fs::metadata(&p).unwrap().permissions().mode() & 0o777, 0o644);
        assert_eq!(register(Engine::Docker, &p, true).unwrap(), Outcome::Removed);
        assert_eq!(std::fs::read_to_string(&p).unwrap(), "{}\n");

        let foreign = r#"{"runtimes": {"crab": {"path": "/opt/other"}}}"#;
        let p = write(dir, "foreign.json", foreign);
        for remove in [false, true] {
            let e = register(Engine::Docker, &p, remove).unwrap_err();
            assert!(matches!(e, RegisterError::Conflict { .. }), "{e}");
        }
        assert_eq!(std::fs::read_to_string(&p).unwrap(), foreign);

        let p = write(dir, "bad.json", "{\"debug\": ");
        let e = register(Engine::Docker, &p, false).unwrap_err();
        assert!(e.to_string().contains("not valid JSON"), "{e}");
        assert_eq!(std::fs::read_to_string(&p).unwrap(), "{\"debug\": ");
        let leftovers: Vec<_> = std::fs::read_dir(dir)
            .unwrap()
            .filter_map(|e| e.ok())
            .filter(|e| e.file_name().to_string_lossy().contains("crabctl-"))
            .collect();
        assert!(leftovers.is_empty(), "{leftovers:?}");
    }

    #[test]
    fn containerd_appends_a_block_and_removes_exactly_it() {
        let tmp = tempdir();
        let dir = tmp.path();
        let original = "# my settings\nversion = 2\n\n[plugins.\"io.containerd.grpc.v1.cri\".cni]\n  bin_dir = \"/usr/lib/cni\"\n";
        let p = write(dir, "config.toml", original);
        assert_eq!(register(Engine::Containerd, &p, false).unwrap(), Outcome::Added);
        let text = std::fs::read_to_string(&p).unwrap();
        assert!(text.starts_with(original), "{text}");
        let doc: toml::Table = text.parse().unwrap();
        assert_eq!(
            doc["plugins"]["io.containerd.grpc.v1.cri"]["containerd"]["runtimes"]["crab"]["runtime_type"]
                .as_str(),
            Some(RUNTIME_TYPE)
        );
        assert_eq!(
            doc["plugins"]["io.containerd.grpc.v1.cri"]["containerd"]["runtimes"]["crab"]["pod_annotations"]
                [0]
            .as_str(),
            Some("io.crab.sandbox-container"),
            "a pod's io.crab.sandbox-container reaches the shim"
        );
        assert_eq!(
            doc["plugins"]["io.containerd.grpc.v1.cri"]["cni"]["bin_dir"].as_str(),
            Some("/usr/lib/cni")
        );
        assert_eq!(
            register(Engine::Containerd, &p, false).unwrap(),
            Outcome::AlreadyThere
        );
        assert_eq!(register(Engine::Containerd, &p, true).unwrap(), Outcome::Removed);
        assert_eq!(std::fs::read_to_string(&p).unwrap(), original);
        assert_eq!(register(Engine::Containerd, &p, true).unwrap(), Outcome::NotThere);

        let v3 = write(dir, "v3.toml", "version = 3\n");
        assert_eq!(register(Engine::Containerd, &v3, false).unwrap(), Outcome::Added);
        let doc: toml::Table = std::fs::read_to_string(&v3).unwrap().parse().unwrap();
        assert!(doc["plugins"]["io.containerd.cri.v1.runtime"]["containerd"]["runtimes"]["crab"].is_table());

        let comments = write(dir, "comments.toml", "# nothing set yet\n");
        assert_eq!(
            register(Engine::Containerd, &comments, false).unwrap(),
            Outcome::Added
        );
        let doc: toml::Table = std::fs::read_to_string(&comments).unwrap().parse().unwrap();
        assert_eq!(doc["version"].as_integer(), Some(2));

        let fresh = dir.join("none/config.toml");
        assert_eq!(
            register(Engine::Containerd, &fresh, false).unwrap(),
            Outcome::Added
        );
        let doc: toml::Table = std::fs::read_to_string(&fresh).unwrap().parse().unwrap();
        assert_eq!(doc["version"].as_integer(), Some(2));
    }

    #[test]
    fn containerd_refuses_version_1_inline_runtimes_and_a_crab_it_did_not_add() {
        let tmp = tempdir();
        let dir = tmp.path();
        let cases = [
            ("v1.toml", "[plugins.cri]\n  sandbox_image = \"pause\"\n"),
            (
                "inline.toml",
                "version = 2\n[plugins.\"io.containerd.grpc.v1.cri\".containerd]\n  runtimes = { runc = { runtime_type = \"io.containerd.runc.v2\" } }\n",
            ),
            (
                "foreign.toml",
                "version = 2\n[plugins.\"io.containerd.grpc.v1.cri\".containerd.runtimes.crab]\n  runtime_type = \"io.containerd.other.v2\"\n",
            ),
        ];
        for (name, text) in cases {
            let p = write(dir, name, text);
            let e = register(Engine::Containerd, &p, false).unwrap_err();
            assert!(
                matches!(
                    e,
                    RegisterError::Unsupported { .. } | RegisterError::Conflict { .. }
                ),
                "{name}: {e}"
            );
            assert_eq!(std::fs::read_to_string(&p).unwrap(), text, "{name}");
        }
        // Not taken out while it is the engine's default runtime.
        let p = write(
            dir,
            "default.json",
            r#"{"default-runtime": "crab", "runtimes": {"crab": {"runtimeType": "io.containerd.crab.v2"}}}"#,
        );
        let e = register(Engine::Docker, &p, true).unwrap_err();
        assert!(e.to_string().contains("default-runtime"), "{e}");
        let p = write(dir, "default.toml", "version = 2\n");
        register(Engine::Containerd, &p, false).unwrap();
        let text = std::fs::read_to_string(&p).unwrap()
            + "[plugins.\"io.containerd.grpc.v1.cri\".containerd]\n  default_runtime_name = \"crab\"\n";
        std::fs::write(&p, &text).unwrap();
        let e = register(Engine::Containerd, &p, true).unwrap_err();
        assert!(e.to_string().contains("default_runtime_name"), "{e}");
        assert_eq!(std::fs::read_to_string(&p).unwrap(), text);
        // Crab's runtime written by hand: registered, but not ours to remove.
        let by_hand = "version = 2\n[plugins.\"io.containerd.grpc.v1.cri\".containerd.runtimes.crab]\n  runtime_type = \"io.containerd.crab.v2\"\n";
        let p = write(dir, "by-hand.toml", by_hand);
        assert_eq!(
            register(Engine::Containerd, &p, false).unwrap(),
            Outcome::AlreadyThere
        );
        let e = register(Engine::Containerd, &p, true).unwrap_err();
        assert!(e.to_string().contains("by hand"), "{e}");
        assert_eq!(std::fs::read_to_string(&p).unwrap(), by_hand);
    }
}
