//! A process's stdio: containerd's fifos (or `file://` URIs) on one side,
//! pipes or a pty on the container's side, and the copy tasks between them.
//!
//! The shim holds the output fifos open read-write, so a containerd restart
//! (its ends closing) never hands the container `EPIPE`; a copy simply blocks
//! until a reader is back, as with runc's shim. The stdin fifo is read-only,
//! so the client closing it is the container's EOF.

use std::os::fd::{AsFd, OwnedFd};
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use tokio::net::unix::pipe;
use tokio::net::UnixListener;
use tokio::task::JoinHandle;

use crate::error::{Error, Result};

/// The stdio a task API request names.
#[derive(Debug, Clone, Default)]
pub struct StdioPaths {
    /// stdin fifo, or empty.
    pub stdin: String,
    /// stdout fifo or `file://` URI, or empty.
    pub stdout: String,
    /// stderr fifo or `file://` URI, or empty.
    pub stderr: String,
    /// Whether the process gets a pty (stdout carries both streams).
    pub terminal: bool,
}

/// What the runtime helper hands the container.
pub enum ChildStdio {
    /// Plain fds for 0, 1, 2 (`None` = `/dev/null`).
    Fds {
        /// fd 0.
        stdin: Option<OwnedFd>,
        /// fd 1.
        stdout: Option<OwnedFd>,
        /// fd 2.
        stderr: Option<OwnedFd>,
    },
    /// The container makes a pty and sends its master to this socket.
    Console {
        /// Socket path for libcontainer's `--console-socket`.
        path: PathBuf,
    },
}

// === impl ChildStdio ===

impl ChildStdio {
    /// `/dev/null` on all three (the helper's own operations).
    pub fn null() -> Self {
        ChildStdio::Fds {
            stdin: None,
            stdout: None,
            stderr: None,
        }
    }
}

/// The shim's side of a process's stdio.
#[derive(Default)]
pub struct ProcessIo {
    /// Output copies: they end when the container's side closes.
    outputs: Vec<JoinHandle<()>>,
    /// The stdin copy; aborting it closes the container's stdin.
    stdin: Option<JoinHandle<()>>,
    /// The stdin fifo, while its copy may still wait for a writer.
    stdin_fifo: Option<PathBuf>,
    /// The pty master, for resizes.
    console: Option<Arc<OwnedFd>>,
}

/// Stdio whose console (if any) has not arrived yet.
pub struct PendingIo {
    io: ProcessIo,
    console: Option<(UnixListener, PathBuf, StdioPaths)>,
}

/// Sets up both sides of `paths`; `console_dir` holds a console socket if
/// one is needed (a short path: a socket path has at most 107 bytes, and
/// bundle paths with 64-character ids are longer).
pub async fn prepare(paths: &StdioPaths, console_dir: &Path) -> Result<(ChildStdio, PendingIo)> {
    if paths.terminal {
        use std::sync::atomic::{AtomicU64, Ordering};
        static N_CONSOLES: AtomicU64 = AtomicU64::new(0);
        std::fs::create_dir_all(console_dir)
            .map_err(Error::io(format!("create {}", console_dir.display())))?;
        let n = N_CONSOLES.fetch_add(1, Ordering::Relaxed);
        let path = console_dir.join(format!("{}-{n}.sock", std::process::id()));
        let _ = std::fs::remove_file(&path);
        let listener = UnixListener::bind(&path)
            .map_err(Error::io(format!("bind console socket {}", path.display())))?;
        let child = ChildStdio::Console { path: path.clone() };
        let pending = PendingIo {
            io: ProcessIo::default(),
            console: Some((listener, path, paths.clone())),
        };
        return Ok((child, pending));
    }
    let mut io = ProcessIo::default();
    let stdin = if paths.stdin.is_empty() {
        // A pipe with no writer reads as EOF, like /dev/null (see `output`).
        let (r, _closed) = os_pipe()?;
        Some(r)
    } else {
        let (r, w) = os_pipe()?;
        let w = pipe::Sender::from_owned_fd(w).map_err(Error::io("stdin pipe"))?;
        io.start_stdin(&paths.stdin, w);
        Some(r)
    };
    let stdout = output(&paths.stdout, &mut io).await?;
    let stderr = output(&paths.stderr, &mut io).await?;
    Ok((
        ChildStdio::Fds {
            stdin,
            stdout,
            stderr,
        },
        PendingIo { io, console: None },
    ))
}

// === impl PendingIo ===

impl PendingIo {
    /// Receives the pty master (when there is one) and starts copying.
    ///
    /// Call after the helper that created the process has finished.
    pub async fn finish(self) -> Result<ProcessIo> {
        let mut io = self.io;
        let Some((listener, path, paths)) = self.console else {
            return Ok(io);
        };
        let accepted = tokio::time::timeout(Duration::from_secs(10), listener.accept()).await;
        let _ = std::fs::remove_file(&path);
        let (stream, _) = match accepted {
            Ok(r) => r.map_err(Error::io("accept console socket"))?,
            Err(_) => {
                return Err(Error::Io {
                    context: "wait for the container's console".into(),
                    source: std::io::ErrorKind::TimedOut.into(),
                })
            }
        };
        let master = Arc::new(recv_fd(stream).await?);
        if !paths.stdout.is_empty() {
            let out = open_output(&paths.stdout).await?;
            let reader = tokio::fs::File::from_std(std::fs::File::from(clone_fd(&master)?));
            io.outputs.push(tokio::spawn(copy(reader, out)));
        }
        if !paths.stdin.is_empty() {
            let writer = tokio::fs::File::from_std(std::fs::File::from(clone_fd(&master)?));
            io.start_stdin(&paths.stdin, writer);
        }
        io.console = Some(master);
        Ok(io)
    }
}

// === impl ProcessIo ===

impl ProcessIo {
    /// Copies the stdin fifo into `to` until the fifo's writer closes it
    /// (the container then sees EOF) or CloseIO.
    ///
    /// The fifo is opened read-only, blocking until containerd's client opens
    /// its end, like containerd's fifo package does: opened read-write, it
    /// would never report EOF, and a client that closes stdin before it can
    /// call CloseIO (ctr with a short file) would hang the container.
    fn start_stdin<W>(&mut self, fifo: &str, to: W)
    where
        W: tokio::io::AsyncWrite + Send + Unpin + 'static,
    {
        let path = PathBuf::from(fifo);
        self.stdin_fifo = Some(path.clone());
        self.stdin = Some(tokio::spawn(async move {
            let opened = tokio::task::spawn_blocking(move || std::fs::File::open(path)).await;
            let Ok(Ok(file)) = opened else { return };
            match pipe::Receiver::from_file(file) {
                Ok(from) => copy(from, to).await,
                Err(e) => tracing::warn!(error = %crab_api::error_chain(&e), "stdin fifo"),
            }
        }));
    }

    /// CloseIO: the client has written all of stdin. The copy goes on
    /// until the fifo's EOF, so the process gets every byte the fifo and
    /// the pipe still hold (stopping it here lost them); a copy still
    /// waiting for the client to open the fifo is released.
    pub fn finish_stdin(&mut self) {
        if let Some(fifo) = &self.stdin_fifo {
            let _ = std::fs::OpenOptions::new()
                .write(true)
                .custom_flags(libc::O_NONBLOCK)
                .open(fifo);
        }
    }

    /// Stops the process's stdin (it exited, or is replaced).
    pub fn close_stdin(&mut self) {
        if let Some(task) = self.stdin.take() {
            task.abort();
        }
        // A copy still blocked in open(2) waits for a writer that may never
        // come: be that writer for a moment, so its thread ends.
        if let Some(fifo) = self.stdin_fifo.take() {
            let _ = std::fs::OpenOptions::new()
                .write(true)
                .custom_flags(libc::O_NONBLOCK)
                .open(fifo);
        }
    }

    /// Resizes the pty, if the process has one.
    pub fn resize(&self, width: u32, height: u32) -> Result<()> {
        let Some(master) = &self.console else {
            return Ok(());
        };
        let size = rustix::termios::Winsize {
            ws_row: height as u16,
            ws_col: width as u16,
            ws_xpixel: 0,
            ws_ypixel: 0,
        };
        rustix::termios::tcsetwinsize(master.as_fd(), size).map_err(|e| Error::io("resize pty")(e.into()))
    }

    /// Waits until all output reached containerd, at most `limit` (a daemon
    /// child can keep a pipe open forever), then stops stdin.
    pub async fn drain(&mut self, limit: Duration) {
        let outputs = std::mem::take(&mut self.outputs);
        let all = futures_join(outputs);
        if tokio::time::timeout(limit, all).await.is_err() {
            tracing::warn!(
                "stdio still open {}s after exit; not waiting longer",
                limit.as_secs()
            );
        }
        self.close_stdin();
        self.console = None;
    }
}

impl Drop for ProcessIo {
    fn drop(&mut self) {
        for t in &self.outputs {
            t.abort();
        }
        self.close_stdin();
    }
}

async fn futures_join(handles: Vec<JoinHandle<()>>) {
    for h in handles {
        let _ = h.await;
    }
}

async fn output(uri: &str, io: &mut ProcessIo) -> Result<Option<OwnedFd>> {
    if uri.is_empty() {
        // No destination: a pipe the shim drains, not the host's /dev/null,
        // which CRIU cannot place in the container's mounts at a dump.
        let (r, w) = os_pipe()?;
        let r = pipe::Receiver::from_owned_fd(r).map_err(Error::io("output pipe"))?;
        io.outputs
            .push(tokio::spawn(copy(r, Box::new(tokio::io::sink()))));
        return Ok(Some(w));
    }
    if let Some(path) = uri.strip_prefix("file://") {
        return Ok(Some(open_log_file(path)?));
    }
    let (r, w) = os_pipe()?;
    let r = pipe::Receiver::from_owned_fd(r).map_err(Error::io("output pipe"))?;
    let out = open_output(uri).await?;
    io.outputs.push(tokio::spawn(copy(r, out)));
    Ok(Some(w))
}

/// Opens an output destination for the shim to write into.
async fn open_output(uri: &str) -> Result<Box<dyn tokio::io::AsyncWrite + Send + Unpin>> {
    if let Some(path) = uri.strip_prefix("file://") {
        let f = tokio::fs::File::from_std(std::fs::File::from(open_log_file(path)?));
        return Ok(Box::new(f));
    }
    if uri.contains("://") {
        return Err(Error::UnsupportedStdio { uri: uri.to_owned() });
    }
    let fifo = pipe::OpenOptions::new()
        .read_write(true)
        .open_sender(uri)
        .map_err(Error::io(format!("open output {uri}")))?;
    Ok(Box::new(fifo))
}

fn open_log_file(path: &str) -> Result<OwnedFd> {
    if let Some(dir) = Path::new(path).parent() {
        std::fs::create_dir_all(dir).map_err(Error::io(format!("create {}", dir.display())))?;
    }
    let f = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(path)
        .map_err(Error::io(format!("open log file {path}")))?;
    Ok(f.into())
}

async fn copy<R, W>(mut from: R, mut to: W)
where
    R: tokio::io::AsyncRead + Unpin,
    W: tokio::io::AsyncWrite + Unpin,
{
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    // Not tokio::io::copy: it reads ahead before writing and drops what it
    // holds when the read fails, and a pty master reports EIO as soon as the
    // container's side is gone, often right after the last output.
    let mut buf = vec![0u8; 32 * 1024];
    loop {
        let n = match from.read(&mut buf).await {
            Ok(0) => break,
            Ok(n) => n,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
            // EIO from a pty master: the end of the stream, not a failure.
            Err(_) => break,
        };
        if to.write_all(&buf[..n]).await.is_err() {
            break;
        }
    }
    let _ = to.flush().await;
}

fn os_pipe() -> Result<(OwnedFd, OwnedFd)> {
    rustix::pipe::pipe_with(rustix::pipe::PipeFlags::CLOEXEC).map_err(|e| Error::io("create pipe")(e.into()))
}

fn clone_fd(fd: &OwnedFd) -> Result<OwnedFd> {
    fd.try_clone().map_err(Error::io("dup pty master"))
}

/// Receives one fd sent with `SCM_RIGHTS` (libcontainer's console socket).
async fn recv_fd(stream: tokio::net::UnixStream) -> Result<OwnedFd> {
    let std_stream = stream.into_std().map_err(Error::io("console socket"))?;
    std_stream
        .set_nonblocking(false)
        .map_err(Error::io("console socket"))?;
    tokio::task::spawn_blocking(move || {
        use std::io::IoSliceMut;
        use std::os::fd::{AsRawFd, FromRawFd};

        use nix::sys::socket::{recvmsg, ControlMessageOwned, MsgFlags};

        let mut buf = [0u8; 4096];
        let mut iov = [IoSliceMut::new(&mut buf)];
        let mut space = nix::cmsg_space!([std::os::fd::RawFd; 1]);
        let msg = recvmsg::<()>(
            std_stream.as_raw_fd(),
            &mut iov,
            Some(&mut space),
            MsgFlags::MSG_CMSG_CLOEXEC,
        )
        .map_err(|e| Error::io("receive pty master")(e.into()))?;
        for cmsg in msg
            .cmsgs()
            .map_err(|e| Error::io("receive pty master")(e.into()))?
        {
            if let ControlMessageOwned::ScmRights(fds) = cmsg {
                if let Some(&fd) = fds.first() {
                    // SAFETY: the kernel just installed `fd` in this process
                    // for this message (SCM_RIGHTS); nothing else owns it.
                    return Ok(unsafe { OwnedFd::from_raw_fd(fd) });
                }
            }
        }
        Err(Error::Io {
            context: "receive pty master: no fd in message".into(),
            source: std::io::ErrorKind::InvalidData.into(),
        })
    })
    .await
    .map_err(|e| Error::io("receive pty master")(std::io::Error::other(e)))?
}
