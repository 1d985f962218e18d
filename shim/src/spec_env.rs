//! Variables the shim gives every sandbox's processes (`[shim] env`): added
//! to the spec's process and to each exec's, unless that process sets the
//! name itself. libuv's `UV_USE_IO_URING=0` is the default one: CRIU cannot
//! dump an io_uring.

use std::path::Path;

use serde::Deserialize;
use serde_json::Value;

use crate::error::{Error, Result};

/// One `NAME=value`, checked when the configuration is read.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(try_from = "String")]
pub struct EnvVar {
    var: String,
    name_len: usize,
}

impl TryFrom<String> for EnvVar {
    type Error = String;

    fn try_from(var: String) -> std::result::Result<Self, String> {
        let name_len = var.find('=').unwrap_or(0);
        let name = &var[..name_len];
        let ok = !name.is_empty()
            && !name.starts_with(|c: char| c.is_ascii_digit())
            && name.chars().all(|c| c.is_ascii_alphanumeric() || c == '_')
            && !var.contains('\0');
        if !ok {
            return Err(format!("{var:?} is not NAME=value"));
        }
        Ok(EnvVar { var, name_len })
    }
}

impl EnvVar {
    fn prefix(&self) -> &str {
        &self.var[..=self.name_len]
    }
}

/// Adds each of `vars` that `process` (an OCI process object) does not set.
fn add_missing(process: &mut Value, vars: &[EnvVar]) {
    let Some(obj) = process.as_object_mut() else {
        return;
    };
    let env = obj.entry("env").or_insert_with(|| Value::Array(Vec::new()));
    let Some(list) = env.as_array_mut() else {
        return;
    };
    for var in vars {
        let set = list
            .iter()
            .any(|v| v.as_str().is_some_and(|s| s.starts_with(var.prefix())));
        if !set {
            list.push(Value::String(var.var.clone()));
        }
    }
}

/// Adds `vars` to the process of the bundle's `config.json` (rewritten
/// atomically, only when something is added).
pub fn inject(bundle: &Path, vars: &[EnvVar]) -> Result<()> {
    if vars.is_empty() {
        return Ok(());
    }
    let mut spec = read_spec(bundle)?;
    let Some(process) = spec.get_mut("process") else {
        return Ok(());
    };
    let before = process.clone();
    add_missing(process, vars);
    if *process == before {
        return Ok(());
    }
    write_spec(bundle, &spec)
}

/// The bundle's `config.json`, as JSON.
pub fn read_spec(bundle: &Path) -> Result<Value> {
    let path = bundle.join("config.json");
    let text = std::fs::read(&path).map_err(Error::io(format!("read {}", path.display())))?;
    serde_json::from_slice(&text).map_err(|e| Error::InvalidBundle {
        bundle: bundle.to_owned(),
        reason: e.to_string(),
    })
}

/// Replaces the bundle's `config.json` with `spec`, atomically.
pub fn write_spec(bundle: &Path, spec: &Value) -> Result<()> {
    let path = bundle.join("config.json");
    let bytes =
        serde_json::to_vec(spec).map_err(|e| Error::io("encode config.json")(std::io::Error::other(e)))?;
    let tmp = bundle.join(".config.json.crab");
    std::fs::write(&tmp, bytes).map_err(Error::io(format!("write {}", tmp.display())))?;
    std::fs::rename(&tmp, &path).map_err(Error::io(format!("replace {}", path.display())))
}

/// Adds `vars` to an exec's process spec (JSON).
pub fn inject_exec(spec: &[u8], vars: &[EnvVar]) -> Result<Vec<u8>> {
    let mut process: Value = serde_json::from_slice(spec).map_err(|e| Error::InvalidExecSpec {
        reason: e.to_string(),
    })?;
    add_missing(&mut process, vars);
    serde_json::to_vec(&process).map_err(|e| Error::InvalidExecSpec {
        reason: e.to_string(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn var(s: &str) -> EnvVar {
        EnvVar::try_from(s.to_owned()).unwrap()
    }

    #[test]
    fn names_are_checked() {
        for bad in ["", "=1", "NOVALUE", "1X=2", "A B=1", "A-B=1", "A=\0"] {
            assert!(EnvVar::try_from(bad.to_owned()).is_err(), "{bad:?}");
        }
        assert_eq!(var("UV_USE_IO_URING=0").prefix(), "UV_USE_IO_URING=");
        assert_eq!(var("A=").prefix(), "A=");
    }

    #[test]
    fn a_process_keeps_its_own_value() {
        let vars = [var("UV_USE_IO_URING=0"), var("B=2")];
        let out = inject_exec(
            br#"{"args":["node"],"env":["PATH=/bin","UV_USE_IO_URING=1"]}"#,
            &vars,
        )
        .unwrap();
        let env = serde_json::from_slice::<Value>(&out).unwrap()["env"].clone();
        assert_eq!(env, serde_json::json!(["PATH=/bin", "UV_USE_IO_URING=1", "B=2"]));
        let out = inject_exec(br#"{"args":["node"]}"#, &vars).unwrap();
        let env = serde_json::from_slice::<Value>(&out).unwrap()["env"].clone();
        assert_eq!(env, serde_json::json!(["UV_USE_IO_URING=0", "B=2"]));
        assert!(inject_exec(b"[1", &vars).is_err());
    }

    #[test]
    fn the_bundle_is_rewritten_only_when_needed() {
        let dir = tempfile::tempdir().unwrap();
        let spec = dir.path().join("config.json");
        std::fs::write(
            &spec,
            r#"{"process":{"env":["UV_USE_IO_URING=0"]},"root":{"path":"rootfs"}}"#,
        )
        .unwrap();
        let before = std::fs::metadata(&spec).unwrap().modified().unwrap();
        inject(dir.path(), &[var("UV_USE_IO_URING=0")]).unwrap();
        assert_eq!(std::fs::metadata(&spec).unwrap().modified().unwrap(), before);
        inject(dir.path(), &[var("X=1")]).unwrap();
        let v: Value = serde_json::from_slice(&std::fs::read(&spec).unwrap()).unwrap();
        assert_eq!(
            v["process"]["env"],
            serde_json::json!(["UV_USE_IO_URING=0", "X=1"])
        );
        assert_eq!(v["root"]["path"], "rootfs");
    }
}
