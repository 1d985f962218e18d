//! CRIU's kernel-data cache on hosts whose `/run` is not tmpfs.
//!
//! Every CRIU run first probes the kernel (`kerndat`: tens of system calls,
//! test mappings, netlink sockets), unless `/run/criu.kdat` holds the
//! answers of an earlier run. CRIU writes that file only when `/run` is
//! tmpfs, so that a reboot (maybe into another kernel) clears it; on a host
//! where `/run` is a plain directory every dump and restore probes again.
//! Measured here: `criu check` takes 150–160 ms without the cache and
//! about 80 ms with it.
//!
//! [`ensure`] gives CRIU its cache the safe way: CRIU itself writes it, in
//! a private mount namespace whose `/run` is a fresh tmpfs, and the file is
//! put in the host's `/run` (written aside, renamed). It is remade when it
//! is older than the boot or than the CRIU binary, which is what the tmpfs
//! would have ensured. CRIU reads the cache without looking at where it
//! lies, and checks its size and magic itself.
//!
//! Nothing here is needed for correctness: every failure is logged and the
//! next CRIU run simply probes.

use std::io::Write;
use std::os::unix::fs::OpenOptionsExt;
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, SystemTime};

/// Where CRIU keeps its cache (`KDAT_RUNDIR` of Debian's build).
const CACHE: &str = "/run/criu.kdat";

/// The largest cache accepted (CRIU's is about 1 KiB).
const MAX_BYTES: usize = 64 << 10;

/// Makes sure `/run/criu.kdat` holds a cache of this boot made by the
/// CRIU at `criu`, when `/run` is not tmpfs (where CRIU keeps it itself).
pub fn ensure(criu: &Path) {
    if run_is_tmpfs() || fresh(criu) {
        return;
    }
    match make(criu) {
        Ok(()) => tracing::info!(cache = CACHE, "CRIU's kernel-data cache made"),
        Err(error) => tracing::warn!(%error, "no kernel-data cache for CRIU: every run probes the kernel"),
    }
}

fn run_is_tmpfs() -> bool {
    nix::sys::statfs::statfs("/run").is_ok_and(|s| s.filesystem_type() == nix::sys::statfs::TMPFS_MAGIC)
}

/// Whether the cache exists and is newer than the boot and the binary.
fn fresh(criu: &Path) -> bool {
    let Ok(made) = std::fs::symlink_metadata(CACHE).and_then(|m| m.modified()) else {
        return false;
    };
    let binary = which(criu).and_then(|p| std::fs::metadata(p).and_then(|m| m.modified()).ok());
    matches!((boot_time(), binary), (Some(boot), Some(bin)) if made > boot && made > bin)
}

/// The binary `criu` names (a bare name is looked up on `PATH`).
fn which(criu: &Path) -> Option<std::path::PathBuf> {
    if criu.components().count() > 1 {
        return Some(criu.to_owned());
    }
    std::env::split_paths(&std::env::var_os("PATH")?)
        .map(|dir| dir.join(criu))
        .find(|p| p.is_file())
}

/// When the host booted (`btime` of `/proc/stat`, whole seconds).
fn boot_time() -> Option<SystemTime> {
    let stat = std::fs::read_to_string("/proc/stat").ok()?;
    let secs = stat
        .lines()
        .find_map(|l| l.strip_prefix("btime "))?
        .trim()
        .parse()
        .ok()?;
    Some(SystemTime::UNIX_EPOCH + Duration::from_secs(secs))
}

/// Has CRIU write its cache into a private tmpfs on `/run`, and puts what
/// it wrote in the host's `/run`.
fn make(criu: &Path) -> std::io::Result<()> {
    // `$0` is the CRIU binary; the tmpfs goes with the namespace.
    let script = r#"mount -t tmpfs -o size=1m,mode=0700,nosuid,nodev,noexec crab-kdat /run \
        && { "$0" check >/dev/null 2>&1; exec cat /run/criu.kdat; }"#;
    let out = Command::new("unshare")
        .args(["--mount", "--propagation", "private", "--", "sh", "-c", script])
        .arg(criu)
        .stdin(Stdio::null())
        .stderr(Stdio::null())
        .output()?;
    if !out.status.success() || out.stdout.is_empty() || out.stdout.len() > MAX_BYTES {
        return Err(std::io::Error::other(format!(
            "CRIU wrote no cache in a private /run ({}, {} bytes)",
            out.status,
            out.stdout.len()
        )));
    }
    let aside = format!("/run/.criu.kdat.crab-{}", std::process::id());
    let written = std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .custom_flags(libc::O_NOFOLLOW)
        .open(&aside)
        .and_then(|mut f| f.write_all(&out.stdout));
    let placed = written.and_then(|()| std::fs::rename(&aside, CACHE));
    if placed.is_err() {
        let _ = std::fs::remove_file(&aside);
    }
    placed
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Needs root and CRIU (CI runs as root; install-deps.sh installs CRIU).
    /// On a host whose `/run` is tmpfs it checks the same through CRIU's
    /// own cache.
    #[test]
    fn criu_loads_the_cache_made_for_it_and_a_stale_one_is_remade() {
        let criu = Path::new("criu");
        if run_is_tmpfs() {
            // CRIU makes its own on its first run.
            let _ = Command::new("criu").arg("check").output();
        } else {
            // A cache from before the boot is stale, whoever made it.
            let _ = std::fs::write(CACHE, b"stale");
            let before_boot = nix::sys::time::TimeSpec::new(1, 0);
            nix::sys::stat::utimensat(
                None,
                CACHE,
                &before_boot,
                &before_boot,
                nix::sys::stat::UtimensatFlags::NoFollowSymlink,
            )
            .expect("age the cache");
            assert!(!fresh(criu));
            ensure(criu);
            assert!(fresh(criu), "a cache newer than the boot and the binary");
        }
        let log = std::env::temp_dir().join(format!("crab-kdat-test-{}.log", std::process::id()));
        let status = Command::new("criu")
            .args(["check", "-v4", "-o"])
            .arg(&log)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status()
            .expect("run criu");
        let text = std::fs::read_to_string(&log).unwrap_or_default();
        let _ = std::fs::remove_file(&log);
        assert!(
            text.contains(&format!("Loaded kdat cache from {CACHE}")),
            "criu check ({status}) did not load the cache:\n{text}"
        );
    }
}
