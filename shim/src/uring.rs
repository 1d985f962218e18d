//! io_uring rings in a container. CRIU cannot dump one (nor its shared
//! mappings), so a checkpoint of processes is refused, before CRIU runs,
//! naming the process that holds it and the way out: libuv (Node.js)
//! stops using io_uring with `UV_USE_IO_URING=0`, which the shim's
//! default `[shim] env` puts in every sandbox.

use std::path::Path;

/// What `readlink` says of an io_uring's file, and how `maps` names its
/// mappings.
const RING: &str = "anon_inode:[io_uring]";

/// A process holding a ring.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Ring {
    /// Its pid on the host.
    pub pid: u32,
    /// Its command name.
    pub comm: String,
    /// How it holds the ring: `fd N`, or `a mapping` (the fd closed).
    pub held: String,
}

/// The first of `pids` (as `/proc` at `proc` shows them) holding an
/// io_uring, by an open file or a mapping. A process gone meanwhile holds
/// nothing.
pub fn find(proc: &Path, pids: &[u32]) -> Option<Ring> {
    pids.iter().find_map(|&pid| {
        let dir = proc.join(pid.to_string());
        let held = ring_fd(&dir)
            .map(|fd| format!("fd {fd}"))
            .or_else(|| ring_mapped(&dir).then(|| "a mapping".to_owned()))?;
        let comm = std::fs::read_to_string(dir.join("comm")).unwrap_or_default();
        Some(Ring {
            pid,
            comm: comm.trim_end().to_owned(),
            held,
        })
    })
}

/// The first open file of the process at `dir` that is a ring.
fn ring_fd(dir: &Path) -> Option<String> {
    std::fs::read_dir(dir.join("fd")).ok()?.flatten().find_map(|e| {
        let target = std::fs::read_link(e.path()).ok()?;
        (target.as_os_str() == RING).then(|| e.file_name().to_string_lossy().into_owned())
    })
}

/// Whether the process at `dir` maps a ring: a mapping whose path field
/// is exactly the ring's (a file named like it has a directory before it).
fn ring_mapped(dir: &Path) -> bool {
    std::fs::read_to_string(dir.join("maps")).is_ok_and(|maps| {
        maps.lines()
            .any(|l| l.split_whitespace().nth(5).is_some_and(|path| path == RING))
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A fake `/proc` with process 7 holding what `fd3` points at and
    /// mapping `maps`.
    fn fake(fd3: &str, maps: &str) -> tempfile::TempDir {
        let proc = tempfile::tempdir().unwrap();
        let dir = proc.path().join("7");
        std::fs::create_dir_all(dir.join("fd")).unwrap();
        std::os::unix::fs::symlink("/dev/null", dir.join("fd/0")).unwrap();
        std::os::unix::fs::symlink(fd3, dir.join("fd/3")).unwrap();
        std::fs::write(dir.join("maps"), maps).unwrap();
        std::fs::write(dir.join("comm"), "node\n").unwrap();
        proc
    }

    #[test]
    fn a_ring_is_found_by_its_fd_or_its_mapping() {
        let ring = "7f5ba4cd8000-7f5ba4cd9000 rw-s 00000000 00:10 1048847                    anon_inode:[io_uring]\n";
        let plain = "55d0c0000000-55d0c0021000 r--p 00000000 00:20 12 /usr/bin/node\n";
        let p = fake(RING, plain);
        let r = find(p.path(), &[3, 7]).unwrap();
        assert_eq!((r.pid, r.comm.as_str(), r.held.as_str()), (7, "node", "fd 3"));
        let p = fake("pipe:[12]", &format!("{plain}{ring}"));
        assert_eq!(find(p.path(), &[7]).unwrap().held, "a mapping");
        let p = fake("pipe:[12]", plain);
        assert_eq!(find(p.path(), &[7, 8]), None);
        // A file the sandbox named like a ring is no ring.
        let named = "7f5ba4cd8000-7f5ba4cd9000 rw-s 00000000 00:20 99 /tmp/anon_inode:[io_uring]\n";
        let p = fake("/tmp/anon_inode:[io_uring]", named);
        assert_eq!(find(p.path(), &[7]), None);
    }

    #[test]
    fn a_real_ring_is_found() {
        let mut params = [0u8; 120];
        // SAFETY: io_uring_setup with a zeroed params block of its size;
        // the fd it answers is closed below.
        let fd = unsafe { libc::syscall(libc::SYS_io_uring_setup, 4, params.as_mut_ptr()) };
        if fd < 0 {
            let e = std::io::Error::last_os_error();
            panic!("io_uring_setup: {e} (this test needs a kernel with io_uring enabled, as CI's)");
        }
        let me = std::process::id();
        let found = find(Path::new("/proc"), &[me]);
        // SAFETY: the fd io_uring_setup answered, not used after.
        unsafe { libc::close(fd as i32) };
        assert_eq!(found.map(|r| r.held), Some(format!("fd {fd}")));
        assert_eq!(find(Path::new("/proc"), &[me]), None);
    }
}
