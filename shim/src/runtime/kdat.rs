//! CRIU's kernel-data cache on hosts whose `/run` is not tmpfs.
//!
//! Every CRIU run first probes the kernel (`kerndat`: tens of system calls,
//! test mappings, netlink sockets), unless `/run/criu.kdat` holds the
//! answers of an earlier run. CRIU writes that file only when `/run` is
//! tmpfs, so that a reboot clears it: some answers hold for one boot only
//! (the zero page's frame number moves with KASLR, and CRIU leaves out of
//! a dump every page that maps it). On a host where `/run` is a plain
//! directory every dump and restore probes again. Measured here: `criu
//! check` takes 150–160 ms without the cache and about 80 ms with it.
//!
//! [`ensure`] gives CRIU its cache the safe way: CRIU itself writes it, in
//! a private mount namespace whose `/run` is a fresh tmpfs, and the file is
//! put in the host's `/run` (written aside, renamed). Beside it,
//! `/run/criu.kdat.crab` names the boot (`boot_id`) and the CRIU binary
//! (device, inode, size, times) it was made for; the cache is remade when
//! either differs, which is what the tmpfs would have ensured (CRIU checks
//! the file's size and magic itself). Other CRIUs of the host read it as
//! they would on a host whose `/run` is tmpfs.
//!
//! The stamp is read, and the cache made and placed, under a lock
//! (`/run/criu.kdat.crab.lock`); a stale cache is removed before anything
//! else. A failed making is stamped `failed` for this boot and binary and
//! not tried again: CRIU simply probes, as it does without a cache.

use std::fs::File;
use std::io::Write;
use std::os::unix::fs::{MetadataExt, OpenOptionsExt};
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant, SystemTime};

use nix::fcntl::{Flock, FlockArg};

/// Where CRIU keeps its cache (`KDAT_RUNDIR` of Debian's build).
const CACHE: &str = "/run/criu.kdat";

/// What the cache was made for (and `failed` when making it failed).
const STAMP: &str = "/run/criu.kdat.crab";

/// Held while the stamp is read and the cache made and placed.
const LOCK: &str = "/run/criu.kdat.crab.lock";

/// The largest cache accepted (CRIU's is about 1 KiB).
const MAX_BYTES: usize = 64 << 10;

/// The longest the making may take (a `criu check` is well under a
/// second), and the longest a helper waits for another one making it.
const DEADLINE: Duration = Duration::from_secs(10);

/// Makes sure `/run/criu.kdat`, when there is one, is a cache of this boot
/// made by the CRIU at `criu`, making it if it is not; when `/run` is
/// tmpfs CRIU keeps its own. Runs in the runtime helper: the shim reaps
/// every child on `SIGCHLD` and would steal this one's status.
pub fn ensure(criu: &Path) {
    if run_is_tmpfs() {
        return;
    }
    let stamp = stamp(criu);
    let Some(_lock) = lock() else {
        // Another helper is making it, for too long: never use one that
        // may be stale.
        if read_stamp().is_none_or(|s| Some(&s) != stamp.as_ref()) {
            remove(CACHE);
        }
        return;
    };
    let Some(stamp) = stamp else {
        // Nothing to vouch for it with.
        remove(CACHE);
        return;
    };
    match read_stamp() {
        Some(s) if s == stamp && Path::new(CACHE).is_file() => return,
        Some(s) if s == format!("{stamp}failed\n") => return,
        _ => {}
    }
    // A stale cache is gone before anything else can fail.
    remove(CACHE);
    let made = make(criu).and_then(|cache| place(CACHE, &cache));
    // The stamp last: a crash before it leaves a cache that is remade.
    let stamp = match made {
        Ok(()) => stamp,
        Err(_) => format!("{stamp}failed\n"),
    };
    let _ = place(STAMP, stamp.as_bytes());
}

fn run_is_tmpfs() -> bool {
    nix::sys::statfs::statfs("/run").is_ok_and(|s| s.filesystem_type() == nix::sys::statfs::TMPFS_MAGIC)
}

fn remove(path: &str) {
    let _ = std::fs::remove_file(path);
}

fn read_stamp() -> Option<String> {
    std::fs::read_to_string(STAMP).ok()
}

/// The lock of the cache, waited for up to [`DEADLINE`].
fn lock() -> Option<Flock<File>> {
    let deadline = Instant::now() + DEADLINE;
    loop {
        let file = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .mode(0o600)
            .custom_flags(libc::O_NOFOLLOW)
            .open(LOCK)
            .ok()?;
        match Flock::lock(file, FlockArg::LockExclusiveNonblock) {
            Ok(lock) => return Some(lock),
            Err((_, nix::errno::Errno::EWOULDBLOCK)) if Instant::now() < deadline => {
                std::thread::sleep(Duration::from_millis(20));
            }
            Err(_) => return None,
        }
    }
}

/// The boot and the binary a cache is made for, as one line each.
fn stamp(criu: &Path) -> Option<String> {
    let boot = std::fs::read_to_string("/proc/sys/kernel/random/boot_id").ok()?;
    let m = std::fs::metadata(which(criu)?).ok()?;
    Some(format!(
        "boot {}\ncriu {} {} {} {}.{} {}.{}\n",
        boot.trim(),
        m.dev(),
        m.ino(),
        m.size(),
        m.mtime(),
        m.mtime_nsec(),
        m.ctime(),
        m.ctime_nsec()
    ))
}

/// The binary `criu` names (a bare name is looked up on `PATH`, as the
/// shell that runs it does).
fn which(criu: &Path) -> Option<PathBuf> {
    if criu.components().count() > 1 {
        return Some(criu.to_owned());
    }
    std::env::split_paths(&std::env::var_os("PATH")?)
        .map(|dir| dir.join(criu))
        .find(|p| std::fs::metadata(p).is_ok_and(|m| m.is_file() && m.mode() & 0o111 != 0))
}

/// Has CRIU write its cache into a private tmpfs on `/run`, and returns
/// what it wrote.
fn make(criu: &Path) -> std::io::Result<Vec<u8>> {
    // `$0` is the CRIU binary; the tmpfs goes with the namespace.
    let script = r#"mount -t tmpfs -o size=1m,mode=0700,nosuid,nodev,noexec crab-kdat /run \
        && { "$0" check >/dev/null 2>&1; exec cat /run/criu.kdat; }"#;
    let mut child = Command::new("unshare")
        .args(["--mount", "--propagation", "private", "--", "sh", "-c", script])
        .arg(criu)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .process_group(0)
        .spawn()?;
    // Read while it runs: an output larger than the pipe must not stall it.
    let reader = child.stdout.take().map(|out| {
        std::thread::spawn(move || {
            use std::io::Read;
            let mut cache = Vec::new();
            out.take(MAX_BYTES as u64 + 1)
                .read_to_end(&mut cache)
                .map(|_| cache)
        })
    });
    let deadline = Instant::now() + DEADLINE;
    let status = loop {
        if let Some(status) = child.try_wait()? {
            break status;
        }
        if Instant::now() > deadline {
            // The whole group: unshare's shell, CRIU, cat.
            let _ = nix::sys::signal::killpg(
                nix::unistd::Pid::from_raw(child.id() as i32),
                nix::sys::signal::Signal::SIGKILL,
            );
            let _ = child.wait();
            return Err(std::io::Error::other(format!(
                "CRIU took over {DEADLINE:?} to make it"
            )));
        }
        std::thread::sleep(Duration::from_millis(10));
    };
    let cache = match reader.map(|r| r.join()) {
        Some(Ok(read)) => read?,
        _ => Vec::new(),
    };
    if !status.success() || cache.is_empty() || cache.len() > MAX_BYTES {
        return Err(std::io::Error::other(format!(
            "CRIU wrote no cache in a private /run ({status}, {} bytes)",
            cache.len()
        )));
    }
    Ok(cache)
}

/// Writes `bytes` beside `path` under a name of its own, then renames it
/// over `path`.
fn place(path: &str, bytes: &[u8]) -> std::io::Result<()> {
    let nanos = SystemTime::now()
        .duration_since(SystemTime::UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos());
    let aside = format!("{path}.tmp-{}-{nanos}", std::process::id());
    let mut file = std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .custom_flags(libc::O_NOFOLLOW)
        .open(&aside)?;
    // Ours from here: removed if it does not become `path`.
    let placed = file.write_all(bytes).and_then(|()| std::fs::rename(&aside, path));
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
            // A cache made for another boot is stale, whoever made it.
            // (Only the stamp says so: the cache itself stays readable for
            // the CRIU runs of tests running beside this one.)
            ensure(criu);
            std::fs::write(STAMP, "boot another\n").expect("write a stale stamp");
            let made = |what| std::fs::metadata(CACHE).and_then(|m| m.modified()).expect(what);
            let stale = made("a cache");
            ensure(criu);
            let stamp = stamp(criu).expect("a stamp");
            assert_eq!(std::fs::read_to_string(STAMP).expect("the stamp"), stamp);
            assert!(stamp.starts_with("boot ") && !stamp.starts_with("boot another"));
            assert!(made("a cache remade") > stale, "remade");
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
