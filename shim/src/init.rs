//! crab-init, the sandbox's pid 1 (`init/src/main.rs`), from the shim's
//! side: the embedded binary, its mount in the spec, the report of the
//! processes it adopts and the handshake that hands it an exec.
//!
//! A container whose spec makes its own pid namespace runs crab-init as
//! its init (libcontainer's executor runs it in place of the spec's
//! process, which it then runs as its only child). An exec's process forks
//! the command and exits, so the command is adopted by crab-init: it is in
//! the init's tree, which is what CRIU dumps. The shim learns each
//! command's pid at the handshake and its exit from crab-init's report,
//! and hands it to the exit router as if it had reaped it. Everything
//! written on those channels comes from inside the sandbox and is parsed
//! as untrusted: a forged line can at worst misreport an exec of that
//! sandbox, which its code could kill anyway.

use std::collections::{HashMap, VecDeque};
use std::os::fd::OwnedFd;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicI32, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use oci_spec::runtime::{LinuxNamespaceType, MountBuilder, Spec};
use tokio::io::{AsyncBufReadExt, AsyncReadExt, AsyncWriteExt, BufReader};

use crate::error::{Error, Result};
use crate::exits::{Exit, ExitRouter};

/// Where the binary is mounted in the container (read-only, like docker's
/// `/sbin/docker-init`).
pub const MOUNT_POINT: &str = "/.crab-init";

/// The descriptor number crab-init's channel has in the helper and in the
/// process libcontainer starts.
pub const CHANNEL_FD: i32 = 3;

/// The static crab-init binary (built by `build.rs`).
static BINARY: &[u8] = include_bytes!(concat!(env!("OUT_DIR"), "/crab-init"));

/// The longest line either channel carries; longer ones are dropped.
const MAX_LINE: usize = 128;

/// Writes the binary under `dir` (once per content) and answers its path.
pub fn installed(dir: &Path) -> Result<PathBuf> {
    use std::hash::{Hash, Hasher};
    use std::os::unix::fs::{DirBuilderExt, OpenOptionsExt};
    let mut h = std::collections::hash_map::DefaultHasher::new();
    BINARY.hash(&mut h);
    let dir = dir.join(".init");
    let path = dir.join(format!("crab-init-{:016x}", h.finish()));
    if std::fs::metadata(&path).is_ok_and(|m| m.len() == BINARY.len() as u64) {
        return Ok(path);
    }
    std::fs::DirBuilder::new()
        .recursive(true)
        .mode(0o700)
        .create(&dir)
        .map_err(Error::io(format!("create {}", dir.display())))?;
    let tmp = dir.join(format!(".tmp-{}", std::process::id()));
    let written = std::fs::OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(true)
        .mode(0o755)
        .open(&tmp)
        .and_then(|mut f| std::io::Write::write_all(&mut f, BINARY).and_then(|()| f.sync_all()))
        .and_then(|()| std::fs::rename(&tmp, &path));
    if let Err(e) = written {
        let _ = std::fs::remove_file(&tmp);
        return Err(Error::io(format!("install {}", path.display()))(e));
    }
    Ok(path)
}

/// Adds crab-init's mount to the bundle's spec when it can be the
/// container's pid 1 (the spec makes a pid namespace of its own and has a
/// process); answers whether it did.
pub fn inject(bundle: &Path, binary: &Path) -> Result<bool> {
    let path = bundle.join("config.json");
    let invalid = |reason: String| Error::InvalidBundle {
        bundle: bundle.to_owned(),
        reason,
    };
    let mut spec = Spec::load(&path).map_err(|e| invalid(e.to_string()))?;
    let own_pid_ns = spec
        .linux()
        .as_ref()
        .and_then(|l| l.namespaces().as_ref())
        .is_some_and(|ns| {
            ns.iter()
                .any(|n| n.typ() == LinuxNamespaceType::Pid && n.path().is_none())
        });
    let has_args = spec
        .process()
        .as_ref()
        .and_then(|p| p.args().as_ref())
        .is_some_and(|a| !a.is_empty());
    if !own_pid_ns || !has_args {
        return Ok(false);
    }
    let mut mounts = spec.mounts().clone().unwrap_or_default();
    if mounts.iter().any(|m| m.destination() == Path::new(MOUNT_POINT)) {
        return Ok(true);
    }
    let mount = MountBuilder::default()
        .destination(MOUNT_POINT)
        .typ("bind")
        .source(binary)
        .options(["bind", "ro", "nosuid", "nodev"].map(String::from).to_vec())
        .build()
        .map_err(|e| invalid(e.to_string()))?;
    mounts.push(mount);
    spec.set_mounts(Some(mounts));
    spec.save(&path).map_err(|e| invalid(e.to_string()))?;
    Ok(true)
}

/// Whether the init of a process image is crab-init (its report pipe was
/// recorded beside its stdio).
pub fn in_image(images: &Path) -> bool {
    std::fs::read(images.join(crate::runtime::DESCRIPTORS))
        .ok()
        .and_then(|b| serde_json::from_slice::<Vec<String>>(&b).ok())
        .is_some_and(|d| d.len() > CHANNEL_FD as usize)
}

/// The commands crab-init has adopted for the shim: their pids as the
/// sandbox sees them, to their pids on the host.
pub struct Adoptions {
    exits: Arc<ExitRouter>,
    pids: Mutex<HashMap<i32, VecDeque<i32>>>,
    /// The spec's process, as the sandbox sees its pid (0 until reported).
    main: AtomicI32,
}

// === impl Adoptions ===

impl Adoptions {
    /// Reads crab-init's report from `pipe` until the init is gone; every
    /// adopted command still known then died with it (`SIGKILL`).
    pub fn follow(exits: Arc<ExitRouter>, pipe: OwnedFd) -> Result<(Arc<Self>, tokio::task::JoinHandle<()>)> {
        let adoptions = Arc::new(Adoptions {
            exits,
            pids: Mutex::new(HashMap::new()),
            main: AtomicI32::new(0),
        });
        let rx = tokio::net::unix::pipe::Receiver::from_owned_fd(pipe)
            .map_err(Error::io("follow crab-init's report".to_owned()))?;
        let a = adoptions.clone();
        // Ends at EOF: the init and every process of the sandbox are gone.
        let task = tokio::spawn(async move {
            let mut lines = BufReader::new(rx);
            let mut line = Vec::new();
            loop {
                line.clear();
                match (&mut lines)
                    .take(MAX_LINE as u64)
                    .read_until(b'\n', &mut line)
                    .await
                {
                    Ok(0) | Err(_) => break,
                    Ok(_) if line.last() != Some(&b'\n') => {
                        // Too long: skip to the end of it.
                        let mut rest = Vec::new();
                        if !matches!(lines.read_until(b'\n', &mut rest).await, Ok(n) if n > 0) {
                            break;
                        }
                    }
                    Ok(_) => a.reported(&line),
                }
            }
            a.all_killed();
        });
        Ok((adoptions, task))
    }

    /// Whether host process `pid` is the spec's process, which crab-init
    /// runs (signals other than `SIGKILL` reach it through the init).
    pub fn is_main(&self, pid: i32) -> bool {
        let main = self.main.load(Ordering::Relaxed);
        main > 0 && ns_pid_of(pid) == Some(main)
    }

    /// One line of the report: `main <pid>` or `exit <pid> <code>`.
    fn reported(&self, line: &[u8]) {
        let text = String::from_utf8_lossy(line);
        let words: Vec<&str> = text.split_whitespace().collect();
        let (pid, code) = match words[..] {
            ["main", pid] => {
                if let Ok(pid) = pid.parse::<i32>() {
                    // Only the first: the init says it once, before
                    // anything else runs.
                    let _ = self
                        .main
                        .compare_exchange(0, pid, Ordering::Relaxed, Ordering::Relaxed);
                }
                return;
            }
            ["exit", pid, code] => match (pid.parse::<i32>(), code.parse::<u32>()) {
                (Ok(pid), Ok(code)) => (pid, code),
                _ => return,
            },
            _ => {
                tracing::debug!("crab-init: unreadable report line");
                return;
            }
        };
        let host = {
            let mut pids = self.pids.lock().expect("adoptions lock");
            let host = pids.get_mut(&pid).and_then(VecDeque::pop_front);
            if pids.get(&pid).is_some_and(VecDeque::is_empty) {
                pids.remove(&pid);
            }
            host
        };
        // Not an exec's command (an orphan of the sandbox): nobody watches.
        if let Some(host) = host {
            self.exits.deliver(host, code as i32);
        }
    }

    /// The init is gone, and the sandbox's processes with it.
    fn all_killed(&self) {
        let pids = std::mem::take(&mut *self.pids.lock().expect("adoptions lock"));
        for host in pids.into_values().flatten() {
            self.exits.deliver(host, 128 + libc::SIGKILL);
        }
    }

    /// Completes an exec's start: reads the command's pid from the exec's
    /// process `helper_pid` on `ours`, watches its exit, then lets it run.
    /// Answers the command's host pid and its exit.
    pub async fn hand_over(
        &self,
        ours: std::os::unix::net::UnixStream,
        helper_pid: i32,
        limit: Duration,
    ) -> Result<(i32, tokio::sync::oneshot::Receiver<Exit>)> {
        let failed = |reason: String| Error::ExecHandover {
            pid: helper_pid,
            reason,
        };
        ours.set_nonblocking(true)
            .map_err(Error::io("set up the exec handshake".to_owned()))?;
        let mut stream = tokio::net::UnixStream::from_std(ours)
            .map_err(Error::io("set up the exec handshake".to_owned()))?;
        let mut line = Vec::new();
        let read = tokio::time::timeout(limit, async {
            let mut r = BufReader::new(&mut stream).take(MAX_LINE as u64);
            r.read_until(b'\n', &mut line).await
        })
        .await;
        match read {
            Err(_) => return Err(failed(format!("no answer in {} s", limit.as_secs()))),
            Ok(Err(e)) => return Err(failed(e.to_string())),
            Ok(Ok(0)) => return Err(failed("it ended before it started the command".to_owned())),
            Ok(Ok(_)) => {}
        }
        let text = String::from_utf8_lossy(&line).trim().to_owned();
        if let Some(reason) = text.strip_prefix("error ") {
            return Err(failed(reason.to_owned()));
        }
        let ns_pid: i32 = text
            .parse()
            .map_err(|_| failed(format!("unreadable answer {text:?}")))?;
        // The command is the helper process's only child until it exits.
        let children = std::fs::read_to_string(format!("/proc/{helper_pid}/task/{helper_pid}/children"))
            .map_err(|e| failed(format!("read its children: {e}")))?;
        let host: i32 = children
            .split_whitespace()
            .next()
            .and_then(|p| p.parse().ok())
            .ok_or_else(|| failed("it has no child".to_owned()))?;
        if ns_pid_of(host) != Some(ns_pid) {
            return Err(failed(format!(
                "its child {host} is not the pid {ns_pid} it named"
            )));
        }
        let exit = self.exits.watch(host);
        self.pids
            .lock()
            .expect("adoptions lock")
            .entry(ns_pid)
            .or_default()
            .push_back(host);
        // A lost answer is an answer too: the exec's process then exits.
        let _ = stream.write_all(b"\n").await;
        Ok((host, exit))
    }
}

/// `pid`'s pid in its innermost pid namespace.
fn ns_pid_of(pid: i32) -> Option<i32> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    status
        .lines()
        .find_map(|l| l.strip_prefix("NSpid:"))?
        .split_whitespace()
        .last()?
        .parse()
        .ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn report_lines_reach_the_watchers_of_their_commands_only() {
        let exits = Arc::new(ExitRouter::default());
        let a = Adoptions {
            exits: exits.clone(),
            pids: Mutex::new(HashMap::new()),
            main: AtomicI32::new(0),
        };
        a.reported(b"main 2\n");
        a.reported(b"main 9\n");
        assert_eq!(a.main.load(Ordering::Relaxed), 2);
        a.pids.lock().unwrap().entry(7).or_default().extend([1007, 2007]);
        let mut first = exits.watch(1007);
        let mut second = exits.watch(2007);
        for junk in [
            &b"exit 7\n"[..],
            b"exit x 1\n",
            b"exit 7 1 2\n",
            b"hello\n",
            b"exit 8 3\n",
        ] {
            a.reported(junk);
        }
        assert!(first.try_recv().is_err());
        a.reported(b"exit 7 3\n");
        assert_eq!(first.try_recv().unwrap().code, 3);
        assert!(second.try_recv().is_err(), "the older command of pid 7 first");
        a.all_killed();
        assert_eq!(second.try_recv().unwrap().code, 137);
    }

    #[test]
    fn the_embedded_binary_is_static() {
        assert_eq!(&BINARY[..4], b"\x7fELF");
        // A dynamic executable has a PT_INTERP program header.
        let u16_at = |o: usize| u16::from_le_bytes([BINARY[o], BINARY[o + 1]]) as usize;
        let phoff = u64::from_le_bytes(BINARY[0x20..0x28].try_into().unwrap()) as usize;
        let (size, count) = (u16_at(0x36), u16_at(0x38));
        assert!(count > 0);
        for i in 0..count {
            let at = phoff + i * size;
            let kind = u32::from_le_bytes(BINARY[at..at + 4].try_into().unwrap());
            assert_ne!(kind, 3, "program header {i} names an interpreter");
        }
    }
}
