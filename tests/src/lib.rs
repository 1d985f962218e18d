//! Harness for Crab's integration tests: real containerd and dockerd
//! instances in private directories, a busybox image built locally (no
//! registry is reachable), and checks that nothing is left behind.
//!
//! Every test needs root (mounts, cgroups, namespaces); CI runs them as root.

pub mod cgroups;
pub mod containerd;
pub mod docker;
pub mod faults;
pub mod http;
pub mod image;
pub mod leftovers;
pub mod llm;
pub mod openapi;
pub mod sandbox;
pub mod snapshotter;
pub mod wire;
pub mod zfs;

use std::path::PathBuf;
use std::process::Output;

pub use containerd::Containerd;
pub use docker::Dockerd;

/// The runtime name under test.
pub const CRAB: &str = "io.containerd.crab.v2";
/// containerd's own runc shim, the baseline.
pub const RUNC: &str = "io.containerd.runc.v2";

/// The directory of the workspace's built binaries (`target/<profile>`).
///
/// # Panics
/// If `containerd-shim-crab-v2` has not been built (run `cargo test --workspace`).
pub fn bin_dir() -> PathBuf {
    let exe = std::env::current_exe().expect("test executable path");
    // A test binary lives in target/<profile>/deps, a benchmark binary in
    // target/<profile>.
    let candidates = exe.ancestors().skip(1).take(2);
    let found = candidates
        .clone()
        .find(|d| d.join("containerd-shim-crab-v2").exists());
    match found {
        Some(dir) => dir.to_owned(),
        None => panic!(
            "no containerd-shim-crab-v2 beside {}: build the workspace first (cargo test --workspace)",
            exe.display()
        ),
    }
}

/// `PATH` with the crab binaries first.
pub fn path_with_crab() -> String {
    format!(
        "{}:{}",
        bin_dir().display(),
        std::env::var("PATH").unwrap_or_default()
    )
}

/// The path of program `name` as [`path_with_crab`] finds it (`name`
/// itself when it finds none). A command given a `PATH` of its own runs
/// a program by name through fork and exec (std cannot look it up for
/// `posix_spawn` in the child's `PATH`); by its path it is spawned
/// without copying the caller's page tables, which a big harness pays
/// on every command.
pub fn program(name: &str) -> PathBuf {
    std::env::split_paths(&path_with_crab())
        .filter(|dir| dir.is_absolute())
        .map(|dir| dir.join(name))
        .find(|path| {
            use std::os::unix::fs::PermissionsExt;
            path.metadata()
                .is_ok_and(|m| m.is_file() && m.permissions().mode() & 0o111 != 0)
        })
        .unwrap_or_else(|| name.into())
}

/// Asserts `out` succeeded and returns its stdout.
#[track_caller]
pub fn ok(out: Output) -> String {
    assert!(
        out.status.success(),
        "command failed ({}):\nstdout: {}\nstderr: {}",
        out.status,
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// stderr of `out` as text.
pub fn stderr(out: &Output) -> String {
    String::from_utf8_lossy(&out.stderr).into_owned()
}

/// Polls `f` every 20 ms until it returns `Some`, for at most `secs` seconds.
///
/// For conditions owned by other processes (a daemon's socket appearing),
/// which a test cannot await any other way.
pub fn wait_until<T>(secs: u64, mut f: impl FnMut() -> Option<T>) -> Option<T> {
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(secs);
    loop {
        if let Some(v) = f() {
            return Some(v);
        }
        if std::time::Instant::now() > deadline {
            return None;
        }
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
}

/// Whether `n`, read from a counter that ticks at most once per 50 ms (a
/// shell loop with `sleep 0.05`), counts on from a checkpoint taken
/// between the reads `before` and `after` and restored after
/// `restore_began`: the checkpoint froze a value of at least `before`, and
/// since the restore it ticked at most once per 50 ms. Bounds by what the
/// loop can do, not by how fast a loaded host runs the test.
pub fn counts_on_from(n: u64, before: u64, after: u64, restore_began: std::time::Instant) -> bool {
    let ticks = restore_began.elapsed().as_millis() / 50 + 1;
    n >= before && n <= after + ticks as u64
}

/// A unique short name for this test process's resources.
pub fn unique(prefix: &str) -> String {
    use std::sync::atomic::{AtomicU32, Ordering};
    static N: AtomicU32 = AtomicU32::new(0);
    format!(
        "{prefix}{}-{}",
        std::process::id(),
        N.fetch_add(1, Ordering::Relaxed)
    )
}
