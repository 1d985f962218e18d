//! The .deb (packaging/deb): built by `packaging/deb/build.sh` from this
//! build's binaries, installed with dpkg on this machine with docker's
//! registration asked for through debconf, used by `docker run --runtime
//! crab` and the installed `crabctl ps`, then purged, leaving nothing of
//! it. Needs root, dpkg and cargo-deb (packaging/install-deps.sh installs
//! them); the host must not have the package installed (the test installs
//! and purges its own, and puts back a `/etc/docker/daemon.json` it had).
//! It is meant for a throwaway machine such as CI's: on a host that runs
//! systemd, the package's postinst would also enable and start crabd and
//! reload docker.service, as it does for a user.

use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};

use crab_tests::docker::DOCKER_BUSYBOX as BB;
use crab_tests::leftovers::assert_clean;
use crab_tests::{bin_dir, ok, unique, wait_until, Dockerd};

const BINARIES: [&str; 5] = [
    "containerd-shim-crab-v2",
    "crabd",
    "crabctl",
    "containerd-crab-snapshotter",
    "crab-bench",
];
const DAEMON_JSON: &str = "/etc/docker/daemon.json";
const CONTAINERD_TOML: &str = "/etc/containerd/config.toml";
/// A PATH without the build's own binaries: containerd finds the shim,
/// and the shim crabd, where the package put them.
const SYSTEM_PATH: &str = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin";

/// dpkg's word on the package: `install ok installed`, or empty.
fn status() -> String {
    let out = Command::new("dpkg-query")
        .args(["-W", "-f=${Status}", "crab"])
        .output()
        .expect("run dpkg-query");
    String::from_utf8_lossy(&out.stdout).trim().to_owned()
}

/// Whether dpkg has any of the package (installed, or its conffiles).
fn known() -> bool {
    let s = status();
    !s.is_empty() && !s.ends_with("not-installed")
}

fn run(cmd: &mut Command) -> Output {
    cmd.env("DEBIAN_FRONTEND", "noninteractive")
        .stdin(Stdio::null())
        .output()
        .unwrap_or_else(|e| panic!("run {cmd:?}: {e}"))
}

/// The host as it was before the test: the package purged, docker's and
/// containerd's files put back, the debconf answers forgotten.
struct Host {
    daemon_json: Option<Vec<u8>>,
    dir: PathBuf,
}

impl Host {
    fn take() -> Self {
        assert!(
            !known(),
            "the crab package is installed on this host ({}); the test installs and purges its own: dpkg --purge crab first",
            status()
        );
        let dir = std::env::temp_dir().join(unique("crabdeb"));
        std::fs::create_dir_all(&dir).unwrap();
        Host {
            daemon_json: std::fs::read(DAEMON_JSON).ok(),
            dir,
        }
    }
}

impl Drop for Host {
    fn drop(&mut self) {
        if known() {
            let _ = run(Command::new("dpkg").args(["--purge", "crab"]));
        }
        match &self.daemon_json {
            Some(text) => {
                let _ = std::fs::write(DAEMON_JSON, text);
            }
            None => {
                let _ = std::fs::remove_file(DAEMON_JSON);
            }
        }
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

#[test]
fn deb_installs_registers_with_docker_runs_and_purges_clean() {
    let host = Host::take();
    let containerd_before = std::fs::read(CONTAINERD_TOML).ok();

    // Built from the binaries this test run uses.
    let top = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let out = run(Command::new(top.join("packaging/deb/build.sh"))
        .arg("--fast")
        .arg("--binaries")
        .arg(bin_dir())
        .arg("--out")
        .arg(&host.dir));
    let deb = PathBuf::from(ok(out).trim().lines().last().expect("build.sh prints the .deb"));
    assert!(deb.is_file(), "{} is no file", deb.display());

    // Asked to register with docker (and not with containerd).
    preseed("crab crab/register-docker boolean true\ncrab crab/register-containerd boolean false\n");
    ok(run(Command::new("dpkg").arg("-i").arg(&deb)));
    assert_eq!(status(), "install ok installed");

    for b in BINARIES {
        let path = Path::new("/usr/bin").join(b);
        use std::os::unix::fs::PermissionsExt;
        let mode = std::fs::metadata(&path)
            .unwrap_or_else(|e| panic!("{}: {e}", path.display()))
            .permissions()
            .mode();
        assert_eq!(mode & 0o777, 0o755, "{}", path.display());
    }
    let version = ok(run(Command::new("/usr/bin/crabctl").arg("--version")));
    assert!(version.starts_with("crabctl "), "{version}");
    let conffiles = ok(run(Command::new("dpkg-query").args([
        "-W",
        "-f=${Conffiles}",
        "crab",
    ])));
    assert!(conffiles.contains("/etc/crab/crab.toml"), "{conffiles}");
    let unit = std::fs::read_to_string("/usr/lib/systemd/system/crabd.service").expect("crabd's unit");
    assert!(unit.contains("ExecStart=/usr/bin/crabd\n"), "{unit}");
    let completion =
        std::fs::read_to_string("/usr/share/bash-completion/completions/crabctl").expect("bash completion");
    assert!(completion.contains("crabctl"), "{completion}");
    let registered: serde_json::Value =
        serde_json::from_slice(&std::fs::read(DAEMON_JSON).expect("daemon.json written")).unwrap();
    assert_eq!(
        registered["runtimes"]["crab"]["runtimeType"], "io.containerd.crab.v2",
        "{registered}"
    );
    assert_eq!(
        std::fs::read(CONTAINERD_TOML).ok(),
        containerd_before,
        "containerd's config changed though not asked"
    );

    // Reconfigured to no: the registration the package made goes; to yes
    // again: it is back.
    let docker_runtime = || {
        let now: serde_json::Value =
            serde_json::from_slice(&std::fs::read(DAEMON_JSON).unwrap_or_else(|_| b"{}".to_vec())).unwrap();
        now.get("runtimes").and_then(|r| r.get("crab")).cloned()
    };
    preseed("crab crab/register-docker boolean false\n");
    ok(run(
        Command::new("dpkg-reconfigure").args(["-fnoninteractive", "crab"])
    ));
    assert_eq!(docker_runtime(), None, "answered no, still registered");
    preseed("crab crab/register-docker boolean true\n");
    ok(run(
        Command::new("dpkg-reconfigure").args(["-fnoninteractive", "crab"])
    ));
    assert_eq!(docker_runtime(), Some(registered["runtimes"]["crab"].clone()));

    // Installed again (an upgrade's steps): the administrator's edit of the
    // conffile and docker's registration stay.
    let mut config = std::fs::read_to_string("/etc/crab/crab.toml").unwrap();
    config.push_str("# edited on this host\n");
    std::fs::write("/etc/crab/crab.toml", &config).unwrap();
    ok(run(Command::new("dpkg").arg("-i").arg(&deb)));
    assert_eq!(std::fs::read_to_string("/etc/crab/crab.toml").unwrap(), config);
    assert_eq!(
        serde_json::from_slice::<serde_json::Value>(&std::fs::read(DAEMON_JSON).unwrap()).unwrap(),
        registered
    );

    // docker reads the host's daemon.json; containerd finds the shim, and
    // the shim crabd, on the system's PATH: the package's binaries.
    {
        let d = Dockerd::start_configured(&[("PATH", SYSTEM_PATH)], Path::new(DAEMON_JSON));
        let id = d
            .docker_ok(&[
                "run",
                "-d",
                "--runtime",
                "crab",
                BB,
                "sh",
                "-c",
                "echo hi > /f; sleep 1000",
            ])
            .trim()
            .to_owned();
        let crabctl_ps = || {
            let out = run(Command::new("/usr/bin/crabctl")
                .arg("--socket")
                .arg(d.containerd.crabd_socket())
                .args(["--json", "ps"]));
            serde_json::from_slice::<serde_json::Value>(&out.stdout).ok()
        };
        let listed = wait_until(20, || {
            crabctl_ps().filter(|ps| {
                ps.as_array()
                    .is_some_and(|l| l.iter().any(|s| s["id"] == id.as_str()))
            })
        });
        assert!(
            listed.is_some(),
            "the installed crabctl ps never listed {id}: {:?}",
            crabctl_ps()
        );
        assert_eq!(
            exe_of(&id),
            Some(PathBuf::from("/usr/bin/containerd-shim-crab-v2"))
        );
        let crabd = d.containerd.crabd_pid().expect("crabd runs");
        assert_eq!(
            std::fs::read_link(format!("/proc/{crabd}/exe")).ok(),
            Some(PathBuf::from("/usr/bin/crabd"))
        );
        assert_eq!(d.docker_ok(&["exec", &id, "cat", "/f"]), "hi\n");
        d.docker_ok(&["rm", "-f", &id]);
        assert_clean(&d.scope(), &[&id]);
    }

    // Purged: its files, its conffile, docker's registration and the
    // debconf answers are gone.
    ok(run(Command::new("dpkg").args(["--purge", "crab"])));
    assert!(!known(), "{}", status());
    for b in BINARIES {
        assert!(!Path::new("/usr/bin").join(b).exists(), "/usr/bin/{b} left");
    }
    for left in [
        "/etc/crab",
        "/usr/lib/systemd/system/crabd.service",
        "/usr/share/bash-completion/completions/crabctl",
        "/usr/share/crab",
    ] {
        assert!(!Path::new(left).exists(), "{left} left");
    }
    let after: serde_json::Value =
        serde_json::from_slice(&std::fs::read(DAEMON_JSON).unwrap_or_else(|_| b"{}".to_vec())).unwrap();
    assert!(
        after.get("runtimes").and_then(|r| r.get("crab")).is_none(),
        "{after}"
    );
    let answers = ok(run(Command::new("debconf-show").arg("crab")));
    assert!(answers.trim().is_empty(), "debconf still has {answers}");
}

/// Sets debconf answers (`debconf-set-selections` lines).
fn preseed(lines: &str) {
    use std::io::Write;
    let mut set = Command::new("debconf-set-selections")
        .stdin(Stdio::piped())
        .spawn()
        .expect("run debconf-set-selections");
    set.stdin.take().unwrap().write_all(lines.as_bytes()).unwrap();
    assert!(set.wait().unwrap().success(), "debconf-set-selections {lines}");
}

/// The executable of the shim serving container `id`.
fn exe_of(id: &str) -> Option<PathBuf> {
    std::fs::read_dir("/proc").ok()?.flatten().find_map(|e| {
        let cmdline = std::fs::read(e.path().join("cmdline")).ok()?;
        let args: Vec<&[u8]> = cmdline.split(|b| *b == 0).collect();
        let shim = args.first()?.ends_with(b"containerd-shim-crab-v2");
        let ours = args.windows(2).any(|w| w[0] == b"-id" && w[1] == id.as_bytes());
        (shim && ours).then(|| std::fs::read_link(e.path().join("exe")).ok())?
    })
}
