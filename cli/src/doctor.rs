//! `crabctl doctor`: whether this host can run Crab, and what it falls
//! back to. Each check looks, never changes anything, and answers ok, warn
//! (Crab runs, with less) or fail (Crab cannot run, or not as configured),
//! with the fix.

use std::path::{Path, PathBuf};
use std::time::Duration;

use crab_api::Crabd;
use serde::{Deserialize, Serialize};

/// How long a probed command may take.
const COMMAND_TIMEOUT: Duration = Duration::from_secs(10);
/// The oldest kernel Crab is tested on.
const MIN_KERNEL: (u32, u32) = (5, 15);
/// From this kernel on, CRIU must be 4.2 or newer to dump TCP sockets.
const KERNEL_NEEDS_CRIU_4_2: (u32, u32) = (6, 16);

/// One check's verdict.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Status {
    /// As Crab wants it.
    Ok,
    /// Crab runs, with less (a fallback is used).
    Warn,
    /// Crab cannot run, or not as configured.
    Fail,
}

/// One line of the report.
#[derive(Debug, Clone, Serialize)]
pub struct Check {
    /// What was checked.
    pub name: &'static str,
    /// The verdict.
    pub status: Status,
    /// What was found.
    pub detail: String,
    /// What to do about a warn or fail.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub fix: Option<String>,
}

impl Check {
    fn ok(name: &'static str, detail: impl Into<String>) -> Check {
        Check {
            name,
            status: Status::Ok,
            detail: detail.into(),
            fix: None,
        }
    }

    fn not(name: &'static str, status: Status, detail: impl Into<String>, fix: impl Into<String>) -> Check {
        Check {
            name,
            status,
            detail: detail.into(),
            fix: Some(fix.into()),
        }
    }
}

/// The parts of crab.toml the checks read (the embedded defaults under
/// the host's file, as crabd and the shims read it).
#[derive(Deserialize)]
struct Config {
    shim: ShimConfig,
    crabd: crab_api::config::CrabdConfig,
}

#[derive(Deserialize)]
struct ShimConfig {
    criu: PathBuf,
}

/// Runs every check; `socket` is crabd's.
pub async fn run(crabd: &Crabd) -> Vec<Check> {
    let path = crab_api::config::config_path();
    let config = match crab_api::config::load::<Config>(&path) {
        Ok(c) => c,
        Err(e) => {
            return vec![Check::not(
                "config",
                Status::Fail,
                crab_api::error_chain(&e),
                format!("fix {} (or point $CRAB_CONFIG at a valid file)", path.display()),
            )]
        }
    };
    let kernel = kernel_version();
    let config_line = match path.exists() {
        true => format!("{}", path.display()),
        false => format!("the built-in defaults ({} is absent)", path.display()),
    };
    let mut checks = vec![
        Check::ok("config", config_line),
        kernel_check(kernel),
        cgroup_check(),
        bpf_check(),
    ];
    checks.extend(criu_checks(&config.shim.criu, kernel).await);
    checks.push(time_namespace_check());
    checks.push(run_tmpfs_check());
    checks.extend(backend_checks().await);
    checks.push(containerd_check().await);
    checks.push(docker_check().await);
    checks.push(store_check(&config.crabd));
    checks.push(crabd_check(crabd, &config.crabd).await);
    checks
}

/// The kernel's (major, minor).
fn kernel_version() -> Option<(u32, u32)> {
    let release = nix::sys::utsname::uname()
        .ok()?
        .release()
        .to_string_lossy()
        .into_owned();
    let mut parts = release.split(|c: char| !c.is_ascii_digit());
    Some((parts.next()?.parse().ok()?, parts.next()?.parse().ok()?))
}

fn kernel_check(kernel: Option<(u32, u32)>) -> Check {
    match kernel {
        Some(v) if v >= MIN_KERNEL => Check::ok("kernel", format!("Linux {}.{}", v.0, v.1)),
        Some(v) => Check::not(
            "kernel",
            Status::Warn,
            format!("Linux {}.{}", v.0, v.1),
            format!(
                "Crab is tested on Linux {}.{} and newer",
                MIN_KERNEL.0, MIN_KERNEL.1
            ),
        ),
        None => Check::not("kernel", Status::Warn, "unknown release", "check `uname -r`"),
    }
}

/// A filesystem's magic number (`statfs`'s `f_type`).
fn fs_magic(path: &Path) -> Option<i64> {
    nix::sys::statfs::statfs(path).ok().map(|s| s.filesystem_type().0)
}

const CGROUP2_MAGIC: i64 = 0x6367_7270;
const TMPFS_MAGIC: i64 = 0x0102_1994;
const BPF_MAGIC: i64 = 0xcafe_4a11;

fn cgroup_check() -> Check {
    let root = Path::new("/sys/fs/cgroup");
    match fs_magic(root) {
        Some(CGROUP2_MAGIC) => Check::ok("cgroups", "v2 (unified)"),
        Some(_) if root.join("freezer").is_dir() => Check::ok(
            "cgroups",
            match root.join("unified").is_dir() {
                true => "v1 with a unified hierarchy (hybrid), freezer present",
                false => "v1, freezer present",
            },
        ),
        _ => Check::not(
            "cgroups",
            Status::Fail,
            "no cgroup v2 and no v1 freezer at /sys/fs/cgroup",
            "mount cgroup2 at /sys/fs/cgroup (or the v1 freezer controller)",
        ),
    }
}

fn bpf_check() -> Check {
    let tracing = ["/sys/kernel/tracing", "/sys/kernel/debug/tracing"]
        .iter()
        .map(Path::new)
        .find(|t| t.join("events/raw_syscalls").is_dir());
    let bpffs = fs_magic(Path::new("/sys/fs/bpf")) == Some(BPF_MAGIC);
    match (tracing, bpffs) {
        (Some(t), true) => Check::ok(
            "bpf",
            format!("tracepoints at {}, bpffs at /sys/fs/bpf", t.display()),
        ),
        (None, _) => Check::not(
            "bpf",
            Status::Warn,
            "no syscall tracepoints (tracefs not mounted, or no CONFIG_FTRACE_SYSCALLS)",
            "mount tracefs at /sys/kernel/tracing; without the inspector every turn is a full checkpoint",
        ),
        (Some(_), false) => Check::not(
            "bpf",
            Status::Warn,
            "/sys/fs/bpf is not a bpffs: the inspector's programs are not pinned across crabd restarts",
            "mount -t bpf bpf /sys/fs/bpf",
        ),
    }
}

/// Runs `program args…` (bounded by [`COMMAND_TIMEOUT`]); answers its
/// success and its stdout and stderr together, or why it could not run.
async fn output(program: &Path, args: &[&str]) -> Result<(bool, String), String> {
    let mut cmd = tokio::process::Command::new(program);
    cmd.args(args)
        .kill_on_drop(true)
        .stdin(std::process::Stdio::null());
    match tokio::time::timeout(COMMAND_TIMEOUT, cmd.output()).await {
        Err(_) => Err(format!(
            "{} did not answer within {COMMAND_TIMEOUT:?}",
            program.display()
        )),
        Ok(Err(e)) => Err(format!("{}: {e}", program.display())),
        Ok(Ok(out)) => {
            let mut text = String::from_utf8_lossy(&out.stdout).into_owned();
            text.push_str(&String::from_utf8_lossy(&out.stderr));
            Ok((out.status.success(), text))
        }
    }
}

/// The first line of `text` that holds anything.
fn first_line(text: &str) -> &str {
    text.lines().map(str::trim).find(|l| !l.is_empty()).unwrap_or("")
}

async fn criu_checks(criu: &Path, kernel: Option<(u32, u32)>) -> Vec<Check> {
    let version = match output(criu, &["--version"]).await {
        Ok((true, text)) => text
            .lines()
            .find_map(|l| l.trim().strip_prefix("Version:"))
            .map(|v| v.trim().to_owned()),
        _ => None,
    };
    let Some(version) = version else {
        return vec![Check::not(
            "criu",
            Status::Fail,
            format!("{} does not run", criu.display()),
            "run packaging/install-deps.sh, or set [shim] criu to a CRIU 4.2 or newer",
        )];
    };
    let mut nums = version.split('.').map(|n| n.parse::<u32>().unwrap_or(0));
    let ours = (nums.next().unwrap_or(0), nums.next().unwrap_or(0));
    let mut checks = vec![match kernel {
        Some(k) if k >= KERNEL_NEEDS_CRIU_4_2 && ours < (4, 2) => Check::not(
            "criu",
            Status::Fail,
            format!(
                "CRIU {version} on Linux {}.{}: it cannot dump TCP sockets there",
                k.0, k.1
            ),
            "install CRIU 4.2 or newer (packaging/install-deps.sh does)",
        ),
        _ => Check::ok("criu", format!("CRIU {version} ({})", criu.display())),
    }];
    if !nix::unistd::geteuid().is_root() {
        checks.push(Check::not(
            "criu check",
            Status::Warn,
            "not checked: `criu check` needs root",
            "run crabctl doctor as root",
        ));
        return checks;
    }
    checks.push(match output(criu, &["check"]).await {
        Ok((true, text)) => Check::ok("criu check", first_line(&text).to_owned()),
        Ok((false, text)) => Check::not(
            "criu check",
            Status::Fail,
            first_line(&text).to_owned(),
            "run `criu check` as root and fix what it names",
        ),
        Err(e) => Check::not("criu check", Status::Fail, e, "run `criu check` as root"),
    });
    checks
}

fn time_namespace_check() -> Check {
    match Path::new("/proc/self/ns/time").exists() {
        true => Check::ok("time namespaces", "available (restored clocks do not jump)"),
        false => Check::not(
            "time namespaces",
            Status::Warn,
            "not available",
            "Linux 5.6 or newer with CONFIG_TIME_NS: restored sandboxes see the host's monotonic clock",
        ),
    }
}

fn run_tmpfs_check() -> Check {
    match fs_magic(Path::new("/run")) {
        Some(TMPFS_MAGIC) => Check::ok("/run on tmpfs", "CRIU keeps its kernel probe cache there"),
        _ => Check::not(
            "/run on tmpfs",
            Status::Warn,
            "/run is not a tmpfs: CRIU probes the kernel again at every dump and restore (some 40 ms)",
            "mount a tmpfs on /run (as systemd does)",
        ),
    }
}

/// Whether `/proc/filesystems` lists `name`.
fn kernel_has_fs(name: &str) -> bool {
    std::fs::read_to_string("/proc/filesystems")
        .is_ok_and(|t| t.lines().any(|l| l.split_whitespace().last() == Some(name)))
}

/// The path of `program` on `$PATH`, if it is there.
fn on_path(program: &str) -> Option<PathBuf> {
    std::env::var_os("PATH").and_then(|paths| {
        std::env::split_paths(&paths)
            .map(|d| d.join(program))
            .find(|p| p.is_file())
    })
}

async fn backend_checks() -> Vec<Check> {
    let overlay = match kernel_has_fs("overlay") {
        true => Check::ok(
            "overlayfs",
            "files-only versions are copies of the writable layer",
        ),
        false => Check::not(
            "overlayfs",
            Status::Fail,
            "the kernel has no overlay filesystem",
            "modprobe overlay",
        ),
    };
    let btrfs = match kernel_has_fs("btrfs") {
        true => Check::ok("btrfs", "available: a btrfs rootfs is snapshotted in place"),
        false => Check::not(
            "btrfs",
            Status::Warn,
            "not in this kernel",
            "modprobe btrfs (optional)",
        ),
    };
    let zfs = match (Path::new("/dev/zfs").exists(), on_path("zfs-fuse")) {
        (true, _) => Check::ok("zfs", "the ZFS module (/dev/zfs)"),
        (false, Some(p)) => Check::ok("zfs", format!("zfs-fuse ({})", p.display())),
        (false, None) => Check::not(
            "zfs",
            Status::Warn,
            "no ZFS module and no zfs-fuse",
            "install zfs-dkms or zfs-fuse to use the crabzfs snapshotter (optional)",
        ),
    };
    vec![overlay, btrfs, zfs]
}

async fn containerd_check() -> Check {
    let Some(containerd) = on_path("containerd") else {
        return Check::not(
            "containerd",
            Status::Fail,
            "not on PATH",
            "install containerd (1.6 or newer)",
        );
    };
    let version = match output(&containerd, &["--version"]).await {
        Ok((true, text)) => first_line(&text).to_owned(),
        Ok((false, text)) => first_line(&text).to_owned(),
        Err(e) => e,
    };
    match on_path("containerd-shim-crab-v2") {
        Some(shim) => Check::ok(
            "containerd",
            format!("{version}; io.containerd.crab.v2 is {}", shim.display()),
        ),
        None => Check::not(
            "containerd",
            Status::Fail,
            format!("{version}; containerd-shim-crab-v2 is not on PATH"),
            "install the shim where containerd finds it (make install puts it in /usr/local/bin)",
        ),
    }
}

async fn docker_check() -> Check {
    let Some(docker) = on_path("docker") else {
        return Check::not(
            "docker",
            Status::Warn,
            "not installed",
            "optional: docker.io 26 or newer",
        );
    };
    match output(&docker, &["info", "--format", "{{json .Runtimes}}"]).await {
        Ok((true, text)) if text.contains("\"crab\"") => {
            Check::ok("docker", "the crab runtime is registered")
        }
        Ok((true, _)) => Check::not(
            "docker",
            Status::Warn,
            "dockerd runs without a crab runtime",
            r#"add "runtimes": {"crab": {"runtimeType": "io.containerd.crab.v2"}} to /etc/docker/daemon.json and restart dockerd"#,
        ),
        _ => Check::not(
            "docker",
            Status::Warn,
            "dockerd does not answer",
            "start dockerd to use docker run --runtime crab (optional)",
        ),
    }
}

/// The nearest existing directory at or above `path`.
fn existing(path: &Path) -> &Path {
    path.ancestors().find(|p| p.exists()).unwrap_or(Path::new("/"))
}

fn store_check(crabd: &crab_api::config::CrabdConfig) -> Check {
    let at = existing(&crabd.root);
    let free = match nix::sys::statvfs::statvfs(at) {
        Ok(s) => s.blocks_available() * s.fragment_size(),
        Err(e) => {
            return Check::not(
                "store",
                Status::Fail,
                format!("{}: {e}", at.display()),
                "make [crabd] root a directory crabd can use",
            )
        }
    };
    let gib = |b: u64| format!("{:.1} GiB", b as f64 / (1u64 << 30) as f64);
    let detail = format!("{} free under {}", gib(free), crabd.root.display());
    match free < crabd.store_min_free_bytes {
        false => Check::ok("store", detail),
        true => Check::not(
            "store",
            Status::Fail,
            format!(
                "{detail}: under [crabd] store_min_free_bytes ({}), no checkpoint is taken",
                gib(crabd.store_min_free_bytes)
            ),
            "free space there, or move [crabd] root",
        ),
    }
}

async fn crabd_check(crabd: &Crabd, config: &crab_api::config::CrabdConfig) -> Check {
    let answer = match tokio::time::timeout(COMMAND_TIMEOUT, crabd.list()).await {
        Ok(answer) => answer.map_err(|e| crab_api::error_chain(&e)),
        Err(_) => Err(format!("crabd did not answer within {COMMAND_TIMEOUT:?}")),
    };
    match answer {
        Ok(list) => Check::ok("crabd", format!("answers: {} sandboxes", list.len())),
        Err(e) => Check::not(
            "crabd",
            match config.autostart {
                true => Status::Warn,
                false => Status::Fail,
            },
            e,
            match config.autostart {
                true => "the first sandbox's shim starts it ([crabd] autostart); or start crabd yourself",
                false => "start crabd ([crabd] autostart is off)",
            },
        ),
    }
}
