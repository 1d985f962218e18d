//! `crabctl doctor` on this host: it passes where Crab runs (real
//! containerd, crabd, CRIU, the kernel's features), and names what fails
//! and its fix where it cannot. Needs root (`criu check`): CI runs it as
//! root.

use std::path::Path;

use crab_tests::{bin_dir, Containerd};
use serde_json::Value;

/// Every check, in order.
const CHECKS: &[&str] = &[
    "config",
    "kernel",
    "cgroups",
    "bpf",
    "criu",
    "criu check",
    "time namespaces",
    "/run on tmpfs",
    "overlayfs",
    "btrfs",
    "zfs",
    "containerd",
    "docker",
    "store",
    "crabd",
];

/// Runs `crabctl doctor --json` with crabd's socket `socket` and crab.toml
/// `config`, the build's binaries first on PATH; answers its success and
/// its checks by name.
fn doctor(socket: &Path, config: &Path) -> (bool, Vec<(String, Value)>) {
    let path = std::env::join_paths(std::iter::once(bin_dir()).chain(std::env::split_paths(
        &std::env::var_os("PATH").unwrap_or_default(),
    )))
    .unwrap();
    let out = std::process::Command::new(bin_dir().join("crabctl"))
        .args(["--json", "--timeout", "10", "--socket"])
        .arg(socket)
        .arg("doctor")
        .env("PATH", path)
        .env("CRAB_CONFIG", config)
        .output()
        .unwrap();
    let checks: Vec<Value> = serde_json::from_slice(&out.stdout).unwrap_or_else(|e| {
        panic!(
            "doctor prints JSON ({e}): {}",
            String::from_utf8_lossy(&out.stderr)
        )
    });
    let named = checks
        .into_iter()
        .map(|c| (c["name"].as_str().unwrap().to_owned(), c))
        .collect();
    (out.status.success(), named)
}

fn check<'a>(checks: &'a [(String, Value)], name: &str) -> &'a Value {
    &checks
        .iter()
        .find(|(n, _)| n == name)
        .unwrap_or_else(|| panic!("no check {name}: {checks:?}"))
        .1
}

#[test]
fn a_host_that_runs_crab_passes() {
    let mut ctd = Containerd::start();
    ctd.start_crabd();
    let (passed, checks) = doctor(&ctd.crabd_socket(), &ctd.crab_config());
    let names: Vec<&str> = checks.iter().map(|(n, _)| n.as_str()).collect();
    assert_eq!(names, CHECKS);
    assert!(passed, "{checks:#?}");
    // What this machine kind has (ENVIRONMENT.md), and the crabd it runs.
    for name in [
        "kernel",
        "cgroups",
        "bpf",
        "criu",
        "criu check",
        "overlayfs",
        "containerd",
        "store",
        "crabd",
    ] {
        assert_eq!(check(&checks, name)["status"], "ok", "{name}: {checks:#?}");
    }
    assert!(
        check(&checks, "crabd")["detail"]
            .as_str()
            .unwrap()
            .starts_with("answers"),
        "{checks:#?}"
    );
    for (name, c) in &checks {
        let has_fix = c.get("fix").is_some();
        assert_eq!(
            has_fix,
            c["status"] != "ok",
            "{name}: a warn or fail says what to do"
        );
    }
}

#[test]
fn what_fails_is_named_with_its_fix() {
    let dir = tempfile::tempdir().unwrap();
    let config = dir.path().join("crab.toml");
    std::fs::write(
        &config,
        format!(
            "[shim]\ncriu = \"{0}/no-criu\"\n[crabd]\nroot = \"{0}/store\"\nautostart = false\n\
             store_min_free_bytes = 9223372036854775807\n",
            dir.path().display()
        ),
    )
    .unwrap();
    let (passed, checks) = doctor(&dir.path().join("no-crabd.sock"), &config);
    assert!(!passed, "a fail exits 1");
    let criu = check(&checks, "criu");
    assert_eq!(criu["status"], "fail");
    assert!(criu["detail"].as_str().unwrap().contains("no-criu"), "{criu}");
    assert!(
        criu["fix"].as_str().unwrap().contains("install-deps.sh"),
        "{criu}"
    );
    let store = check(&checks, "store");
    assert_eq!(store["status"], "fail");
    assert!(
        store["detail"].as_str().unwrap().contains("store_min_free_bytes"),
        "{store}"
    );
    let crabd = check(&checks, "crabd");
    assert_eq!(crabd["status"], "fail", "autostart is off: nothing will start it");
    assert!(crabd["fix"].as_str().unwrap().contains("start crabd"), "{crabd}");
    // A config that does not parse is the one check, and a fail.
    std::fs::write(&config, "[crabd]\nno_such_key = 1\n").unwrap();
    let (passed, checks) = doctor(&dir.path().join("no-crabd.sock"), &config);
    assert!(!passed);
    assert_eq!(checks.len(), 1);
    assert_eq!(check(&checks, "config")["status"], "fail");
}
