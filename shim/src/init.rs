//! crab-init, the sandbox's pid 1 (`init/src/main.rs`), from the shim's
//! side: the embedded binary, its mount in the spec, the report of the
//! processes it adopts and the handshake that hands it an exec.
//!
//! A container whose spec makes its own pid namespace runs crab-init as
//! its init (libcontainer's executor runs it in place of the spec's
//! process, which it then runs as its only child). An exec's process forks
//! the command and exits, so the command is adopted by crab-init: it is in
//! the init's tree, which is what CRIU dumps. The shim learns each
//! command's pid at the handshake, holds a pidfd of it (its end, and every
//! signal to it), takes its exit code from crab-init's report, and hands
//! the exit to the exit router as if it had reaped it. Everything on those
//! channels comes from inside the sandbox and is parsed as untrusted, with
//! bounded lines: a forged or stolen line can misstate an exec's code,
//! never its end, and never points the shim at another process.

use std::collections::HashMap;
use std::os::fd::OwnedFd;
use std::path::{Path, PathBuf};
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
        // Traversable by a user namespace's root, which the bind mount's
        // source is looked up as; not listable.
        .mode(0o711)
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
    let own_pid_ns =
        crate::runtime::joined_ns::named(&spec, LinuxNamespaceType::Pid).is_some_and(|n| n.path().is_none());
    let has_args = spec
        .process()
        .as_ref()
        .and_then(|p| p.args().as_ref())
        .is_some_and(|a| !a.is_empty());
    if !own_pid_ns || !has_args || opted_out(&spec) {
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

/// Annotation that keeps crab-init out of one container (`"false"`).
pub const ANNOTATION: &str = "io.crab.init";

/// Inits that must be pid 1 themselves (they refuse to run otherwise, or
/// manage the whole namespace): the spec's process is then the init, and
/// running execs are left out of checkpoints as before.
const OWN_INITS: &[&str] = &[
    "init",
    "systemd",
    "s6-svscan",
    "runit",
    "runit-init",
    "openrc-init",
];

/// Whether the spec opts out of crab-init, by annotation or by running an
/// init that must be pid 1.
fn opted_out(spec: &Spec) -> bool {
    let annotated = spec
        .annotations()
        .as_ref()
        .and_then(|a| a.get(ANNOTATION))
        .is_some_and(|v| v == "false");
    let own_init = spec
        .process()
        .as_ref()
        .and_then(|p| p.args().as_ref())
        .and_then(|a| a.first())
        .and_then(|a0| Path::new(a0).file_name())
        .is_some_and(|name| OWN_INITS.iter().any(|i| name == *i));
    annotated || own_init
}

/// Whether the init of a process image is crab-init (its report pipe was
/// recorded beside its stdio).
pub fn in_image(images: &Path) -> bool {
    std::fs::read(images.join(crate::runtime::DESCRIPTORS))
        .ok()
        .and_then(|b| serde_json::from_slice::<Vec<String>>(&b).ok())
        .is_some_and(|d| d.len() > CHANNEL_FD as usize)
}

/// The spec's process in the sandbox's pid namespace: crab-init's first
/// child in a namespace of its own (CRIU restores it with the same pid).
pub const MAIN_NS_PID: i32 = 2;

/// How long an adopted command's exit code may take to arrive after its
/// pidfd says it exited (crab-init reaps it, then reports); past that, or
/// when the report ends, it is reported killed.
const CODE_WAIT: Duration = Duration::from_secs(2);

/// The commands crab-init has adopted for the shim, and what its report
/// said about them and about the spec's process.
///
/// A command's exit is known from its pidfd (opened while it cannot have
/// been reaped, so never another process's); the report only adds its
/// code. A line forged or stolen by the sandbox's code can therefore
/// misstate an exec's code, never its end, and no host pid is ever
/// signalled after it was reaped.
pub struct Adoptions {
    exits: Arc<ExitRouter>,
    /// Codes awaited, by the command's pid in the sandbox.
    codes: Mutex<HashMap<i32, Arc<Code>>>,
    /// How the spec's process ended, once reported.
    main_end: Code,
    /// The report ended (crab-init is gone, or its pipe is).
    closed: std::sync::atomic::AtomicBool,
}

/// One awaited exit code.
#[derive(Default)]
struct Code {
    value: Mutex<Option<u32>>,
    set: tokio::sync::Notify,
}

/// An adopted command, handed over: its host pid, its exit, and the pidfd
/// through which it is signalled.
pub struct Adopted {
    /// Its pid on the host.
    pub pid: i32,
    /// Its exit, when it comes.
    pub exit: tokio::sync::oneshot::Receiver<Exit>,
    /// Its pidfd.
    pub pidfd: Arc<OwnedFd>,
}

// === impl Code ===

impl Code {
    /// Records `code`, unless one is recorded already.
    fn put(&self, code: u32) {
        let mut v = self.value.lock().expect("code lock");
        if v.is_none() {
            *v = Some(code);
            self.set.notify_waiters();
            self.set.notify_one();
        }
    }

    fn get(&self) -> Option<u32> {
        *self.value.lock().expect("code lock")
    }

    /// Waits up to `limit` for the code.
    async fn wait(&self, limit: Duration) -> Option<u32> {
        let _ = tokio::time::timeout(limit, async {
            loop {
                let notified = self.set.notified();
                if self.get().is_some() {
                    return;
                }
                notified.await;
            }
        })
        .await;
        self.get()
    }
}

// === impl Adoptions ===

impl Adoptions {
    /// Reads crab-init's report from `pipe` until it ends.
    pub fn follow(exits: Arc<ExitRouter>, pipe: OwnedFd) -> Result<(Arc<Self>, tokio::task::JoinHandle<()>)> {
        let adoptions = Arc::new(Adoptions {
            exits,
            codes: Mutex::new(HashMap::new()),
            main_end: Code::default(),
            closed: false.into(),
        });
        let rx = tokio::net::unix::pipe::Receiver::from_owned_fd(pipe)
            .map_err(Error::io("follow crab-init's report".to_owned()))?;
        let a = adoptions.clone();
        // Ends at EOF; aborted when a restore replaces the init.
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
                        // Too long: skipped, never stored.
                        if !skip_line(&mut lines).await {
                            break;
                        }
                    }
                    Ok(_) => a.reported(&line),
                }
            }
            a.close();
        });
        Ok((adoptions, task))
    }

    /// Whether host process `pid` is the spec's process, which crab-init
    /// (host pid `init`) runs: signals other than `SIGKILL` reach it
    /// through the init.
    pub fn is_main(&self, pid: i32, init: i32) -> bool {
        match (ns_pids(pid), ns_pids(init)) {
            (Some(ours), Some(its)) => ours.len() == its.len() && ours.last() == Some(&MAIN_NS_PID),
            _ => false,
        }
    }

    /// How the spec's process ended, as crab-init said just before it
    /// exited: `Some(true)` by a signal, `Some(false)` by its own exit;
    /// `None` when the report ended (or `limit` passed) without saying.
    pub async fn main_died_by_signal(&self, limit: Duration) -> Option<bool> {
        let said = tokio::time::timeout(limit, async {
            loop {
                let notified = self.main_end.set.notified();
                if let Some(v) = self.main_end.get() {
                    return Some(v != 0);
                }
                if self.closed.load(std::sync::atomic::Ordering::SeqCst) {
                    return None;
                }
                notified.await;
            }
        })
        .await;
        said.ok().flatten()
    }

    /// One line of the report: `exit <pid> <code>`, or `end signaled|exited
    /// <n>` (the spec's process, just before crab-init exits).
    fn reported(&self, line: &[u8]) {
        let text = String::from_utf8_lossy(line);
        let words: Vec<&str> = text.split_whitespace().collect();
        match words[..] {
            ["exit", pid, code] => {
                if let (Ok(pid), Ok(code)) = (pid.parse::<i32>(), code.parse::<u32>()) {
                    let awaited = self.codes.lock().expect("adoptions lock").get(&pid).cloned();
                    // Not an exec's command (an orphan of the sandbox): nobody awaits it.
                    if let Some(c) = awaited {
                        c.put(code);
                    }
                }
            }
            ["end", how @ ("signaled" | "exited"), n] if n.parse::<u32>().is_ok() => {
                self.main_end.put(u32::from(how == "signaled"));
            }
            _ => tracing::debug!("crab-init: unreadable report line"),
        }
    }

    /// The report ended: every command still awaiting its code died with
    /// the init (`SIGKILL`).
    pub fn close(&self) {
        self.closed.store(true, std::sync::atomic::Ordering::SeqCst);
        for c in self.codes.lock().expect("adoptions lock").values() {
            c.put(128 + libc::SIGKILL as u32);
        }
        self.main_end.set.notify_waiters();
    }

    /// Completes an exec's start: reads the command's pid from the exec's
    /// process `helper_pid` on `ours`, opens its pidfd and watches its exit,
    /// then lets it run.
    pub async fn hand_over(
        self: &Arc<Self>,
        ours: std::os::unix::net::UnixStream,
        helper_pid: i32,
        limit: Duration,
    ) -> Result<Adopted> {
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
        // The command is the helper process's only child, and cannot be
        // reaped before the helper exits (it waits for our answer): its
        // pidfd, once it names the pid it was told, is its for good.
        let children = std::fs::read_to_string(format!("/proc/{helper_pid}/task/{helper_pid}/children"))
            .map_err(|e| failed(format!("read its children: {e}")))?;
        let host: i32 = children
            .split_whitespace()
            .next()
            .and_then(|p| p.parse().ok())
            .ok_or_else(|| failed("it has no child".to_owned()))?;
        let pid = rustix::process::Pid::from_raw(host).ok_or_else(|| failed(format!("bad pid {host}")))?;
        let pidfd = rustix::process::pidfd_open(pid, rustix::process::PidfdFlags::empty())
            .map_err(|e| failed(format!("pidfd of {host}: {e}")))?;
        let status = procfs::process::Process::new(host).and_then(|p| p.status()).ok();
        let named = status.as_ref().is_some_and(|s| {
            s.ppid == helper_pid && s.nspid.as_ref().and_then(|n| n.last()) == Some(&ns_pid)
        });
        if !named {
            return Err(failed(format!(
                "its child {host} is not the pid {ns_pid} it named"
            )));
        }
        if self.closed.load(std::sync::atomic::Ordering::SeqCst) {
            return Err(failed("the sandbox's init is gone".to_owned()));
        }
        let pidfd = Arc::new(pidfd);
        let slot = Arc::new(Code::default());
        self.codes
            .lock()
            .expect("adoptions lock")
            .insert(ns_pid, slot.clone());
        let exit = self.exits.watch(host);
        // SAFETY: the registration holds an `Arc` of the pidfd, so the
        // descriptor stays open for as long as it is registered.
        let watched = unsafe {
            tokio::io::unix::AsyncFd::register_with_interest(pidfd.clone(), tokio::io::Interest::READABLE)
        }
        .map_err(|e| Error::io(format!("watch the exit of {host}"))(e.into()))?;
        let me = self.clone();
        // Ends when the command does.
        tokio::spawn(async move {
            let _ = watched.readable().await;
            let code = slot.wait(CODE_WAIT).await.unwrap_or(128 + libc::SIGKILL as u32);
            {
                let mut codes = me.codes.lock().expect("adoptions lock");
                if codes.get(&ns_pid).is_some_and(|c| Arc::ptr_eq(c, &slot)) {
                    codes.remove(&ns_pid);
                }
            }
            me.exits.deliver(host, code as i32);
        });
        // A lost answer is an answer too: the exec's process then kills
        // the command, whose exit is watched.
        let _ = stream.write_all(b"\n").await;
        Ok(Adopted {
            pid: host,
            exit,
            pidfd,
        })
    }
}

/// Reads past the rest of a line without keeping it; false at EOF.
async fn skip_line<R: tokio::io::AsyncBufRead + Unpin>(r: &mut R) -> bool {
    loop {
        let (done, n) = match r.fill_buf().await {
            Ok([]) | Err(_) => return false,
            Ok(buf) => match buf.iter().position(|&b| b == b'\n') {
                Some(i) => (true, i + 1),
                None => (false, buf.len()),
            },
        };
        r.consume(n);
        if done {
            return true;
        }
    }
}

/// `pid`'s pids, from the host's namespace to its innermost.
fn ns_pids(pid: i32) -> Option<Vec<i32>> {
    procfs::process::Process::new(pid)
        .and_then(|p| p.status())
        .ok()?
        .nspid
}

#[cfg(test)]
mod tests {
    use super::*;

    fn adoptions() -> Adoptions {
        Adoptions {
            exits: Arc::new(ExitRouter::default()),
            codes: Mutex::new(HashMap::new()),
            main_end: Code::default(),
            closed: false.into(),
        }
    }

    #[tokio::test]
    async fn report_lines_give_codes_to_the_commands_awaiting_them_only() {
        let a = adoptions();
        let awaited = Arc::new(Code::default());
        a.codes.lock().unwrap().insert(7, awaited.clone());
        for junk in [
            &b"exit 7\n"[..],
            b"exit x 1\n",
            b"exit 7 1 2\n",
            b"hello\n",
            b"exit 8 3\n",
            b"end killed 9\n",
        ] {
            a.reported(junk);
        }
        assert_eq!(awaited.get(), None);
        a.reported(b"exit 7 3\n");
        a.reported(b"exit 7 4\n");
        assert_eq!(
            awaited.wait(Duration::ZERO).await,
            Some(3),
            "the first code counts"
        );
        assert_eq!(a.main_died_by_signal(Duration::ZERO).await, None);
        a.reported(b"end signaled 9\n");
        assert_eq!(a.main_died_by_signal(Duration::ZERO).await, Some(true));
    }

    #[tokio::test]
    async fn the_end_of_the_report_is_every_awaited_command_killed() {
        let a = adoptions();
        let awaited = Arc::new(Code::default());
        a.codes.lock().unwrap().insert(7, awaited.clone());
        a.close();
        assert_eq!(awaited.wait(Duration::from_secs(1)).await, Some(137));
    }

    #[tokio::test]
    async fn an_endless_line_is_skipped_without_being_kept() {
        let endless = tokio::io::repeat(b'x').take(64 << 20).chain(&b"\nexit 1 2\n"[..]);
        let mut r = BufReader::with_capacity(4096, endless);
        assert!(skip_line(&mut r).await);
        let mut rest = String::new();
        r.read_line(&mut rest).await.unwrap();
        assert_eq!(rest, "exit 1 2\n");
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
