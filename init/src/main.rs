//! `crab-init`: the pid 1 of a crab sandbox, so that CRIU can dump every
//! process of it.
//!
//! CRIU dumps the tree under the container's init. A process started by
//! `ctr task exec` or `docker exec` is a child of the shim, outside that
//! tree, and a dump silently leaves it behind. crab-init closes the gap the
//! way the kernel allows: an orphan in a pid namespace is adopted by the
//! namespace's init. Two personalities, one static binary that the shim
//! bind-mounts read-only into the container (`/.crab-init`, like docker's
//! `/sbin/docker-init`) and libcontainer's executor runs instead of the
//! spec's process (the spec's own process is checked and run unchanged):
//!
//! - `crab-init init --report-fd N -- CMD…` is the container's init. It runs
//!   CMD as its child, in a session of its own with the terminal the init
//!   had; forwards to CMD the signals CMD handles (a pid 1 without a handler
//!   ignores the others, so CMD sees what it saw as pid 1); reaps every
//!   orphan; writes `exit <pid> <code>` on fd N for each reaped process that
//!   is not CMD; and when CMD ends, writes `end exited <code>` or `end
//!   signaled <N>` and exits with CMD's code (`128 + N` after signal N).
//!   CMD is pid 2 of the namespace, its first child.
//! - `crab-init exec --handshake-fd N -- CMD…` is an exec's process. It forks
//!   CMD, writes CMD's pid on fd N, waits for the shim's acknowledgement and
//!   exits; CMD, orphaned, is adopted by `crab-init init` and only then runs
//!   (in its own session, taking the terminal back). The shim learns CMD's
//!   exit from the report of the init.
//!
//! Only std and a handful of libc calls: no dependency, so that the shim's
//! build script can compile this one file with `+crt-static`.

use std::ffi::OsString;
use std::fs::File;
use std::io::{Read, Write};
use std::os::fd::{AsRawFd, FromRawFd, RawFd};
use std::os::unix::process::CommandExt;
use std::process::Command;

/// `sigset_t` of glibc on Linux: 1024 bits.
#[repr(C)]
struct SigSet([u64; 16]);

extern "C" {
    fn fork() -> i32;
    fn waitpid(pid: i32, status: *mut i32, options: i32) -> i32;
    fn sigfillset(set: *mut SigSet) -> i32;
    fn sigemptyset(set: *mut SigSet) -> i32;
    fn sigaddset(set: *mut SigSet, sig: i32) -> i32;
    fn sigtimedwait(set: *const SigSet, info: *mut u8, timeout: *const u8) -> i32;
    fn pthread_sigmask(how: i32, set: *const SigSet, old: *mut SigSet) -> i32;
    fn sigwait(set: *const SigSet, sig: *mut i32) -> i32;
    fn kill(pid: i32, sig: i32) -> i32;
    fn setsid() -> i32;
    fn getsid(pid: i32) -> i32;
    fn getpid() -> i32;
    fn getppid() -> i32;
    fn isatty(fd: i32) -> i32;
    fn ioctl(fd: i32, request: u64, ...) -> i32;
    fn fcntl(fd: i32, cmd: i32, ...) -> i32;
    fn pipe2(fds: *mut i32, flags: i32) -> i32;
    fn dup2(old: i32, new: i32) -> i32;
    fn _exit(code: i32) -> !;
}

const SIG_SETMASK: i32 = 2;
const SIGHUP: i32 = 1;
const SIGCONT: i32 = 18;
const SIGKILL: i32 = 9;
const SIGCHLD: i32 = 17;
const SIGSTOP: i32 = 19;
const WNOHANG: i32 = 1;
const TIOCSCTTY: u64 = 0x540E;
const TIOCNOTTY: u64 = 0x5422;
const F_SETFD: i32 = 2;
const FD_CLOEXEC: i32 = 1;
const O_CLOEXEC: i32 = 0o2000000;

fn main() {
    let args: Vec<OsString> = std::env::args_os().skip(1).collect();
    let usage = || -> ! {
        eprintln!(
            "usage: crab-init init --report-fd N -- CMD... | crab-init exec --handshake-fd N -- CMD..."
        );
        std::process::exit(2)
    };
    let (Some(mode), Some(flag), Some(fd), Some(dashes)) =
        (args.first(), args.get(1), args.get(2), args.get(3))
    else {
        usage()
    };
    let Some(fd) = fd
        .to_str()
        .and_then(|f| f.parse::<RawFd>().ok())
        .filter(|&f| f > 2)
    else {
        usage()
    };
    let cmd = &args[4..];
    if dashes != "--" || cmd.is_empty() {
        usage();
    }
    // SAFETY: F_SETFD on a descriptor number; an invalid one fails harmlessly.
    if unsafe { fcntl(fd, F_SETFD, FD_CLOEXEC) } != 0 {
        eprintln!("crab-init: descriptor {fd}: {}", std::io::Error::last_os_error());
        std::process::exit(2);
    }
    // SAFETY: the descriptor was given to this process for it alone, and is
    // open (fcntl succeeded).
    let channel = unsafe { File::from_raw_fd(fd) };
    match (mode.to_str(), flag.to_str()) {
        (Some("init"), Some("--report-fd")) => init(channel, cmd),
        (Some("exec"), Some("--handshake-fd")) => exec(channel, cmd),
        _ => usage(),
    }
}

/// The init personality; never returns.
fn init(mut report: File, cmd: &[OsString]) -> ! {
    let mut all = SigSet([0; 16]);
    let mut old = SigSet([0; 16]);
    // SAFETY: both sets are valid, writable sigset_t-sized buffers.
    unsafe {
        sigfillset(&mut all);
        pthread_sigmask(SIG_SETMASK, &all, &mut old);
    }
    // The terminal goes to CMD: the init gives it up (it is alone in its
    // session, so the hangup it causes reaches only itself, blocked).
    // SAFETY: plain calls on this process's own descriptors.
    let tty = unsafe { isatty(0) == 1 && getsid(0) == getpid() };
    if tty {
        // SAFETY: TIOCNOTTY takes no argument.
        unsafe { ioctl(0, TIOCNOTTY) };
        // It hung up this process's group (itself): those signals are no
        // one's to pass on.
        let mut hangup = SigSet([0; 16]);
        let zero = [0i64; 2];
        // SAFETY: valid set and timespec; sigtimedwait with a zero timeout
        // only takes signals already pending.
        unsafe {
            sigemptyset(&mut hangup);
            sigaddset(&mut hangup, SIGHUP);
            sigaddset(&mut hangup, SIGCONT);
            while sigtimedwait(&hangup, std::ptr::null_mut(), zero.as_ptr().cast()) > 0 {}
        }
    }
    // SAFETY: this process is single-threaded; the child only calls
    // async-signal-safe functions before it execs (see `run`).
    let main = unsafe { fork() };
    if main < 0 {
        eprintln!("crab-init: fork: {}", std::io::Error::last_os_error());
        std::process::exit(126);
    }
    if main == 0 {
        // CMD starts with the mask the init was started with (exec keeps
        // a blocked mask).
        // SAFETY: `old` is a valid set.
        unsafe { pthread_sigmask(SIG_SETMASK, &old, std::ptr::null_mut()) };
        run(cmd, tty);
    }
    if tty {
        // The terminal is CMD's alone, as when CMD was the init: CRIU
        // restores a terminal with the session that holds it.
        if let Ok(null) = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .open("/dev/null")
        {
            for fd in 0..3 {
                // SAFETY: dup2 onto this process's own stdio numbers.
                unsafe { dup2(null.as_raw_fd(), fd) };
            }
        }
    }
    loop {
        let mut sig = 0;
        // SAFETY: `all` is a valid set and `sig` a valid out pointer.
        if unsafe { sigwait(&all, &mut sig) } != 0 {
            continue;
        }
        if sig != SIGCHLD {
            if handles(main, sig) {
                // SAFETY: a signal to the child this init started.
                unsafe { kill(main, sig) };
            }
            continue;
        }
        let mut main_end = None;
        loop {
            let mut status = 0;
            // SAFETY: `status` is a valid out pointer.
            let pid = unsafe { waitpid(-1, &mut status, WNOHANG) };
            if pid <= 0 {
                break;
            }
            let code = exit_code(status);
            if pid == main {
                main_end = Some(status);
            } else {
                // The shim may be gone (its read end closed): the child is
                // reaped all the same.
                let _ = report.write_all(format!("exit {pid} {code}\n").as_bytes());
            }
        }
        if let Some(status) = main_end {
            // How CMD ended, which its code alone does not tell (a crash
            // and an `exit 139` look alike).
            let how = match status & 0x7f {
                0 => format!("end exited {}\n", (status >> 8) & 0xff),
                sig => format!("end signaled {sig}\n"),
            };
            let _ = report.write_all(how.as_bytes());
            std::process::exit(exit_code(status));
        }
    }
}

/// The exec personality; never returns.
fn exec(mut handshake: File, cmd: &[OsString]) -> ! {
    let mut release = [0i32; 2];
    // SAFETY: `release` has room for two descriptors.
    if unsafe { pipe2(release.as_mut_ptr(), O_CLOEXEC) } != 0 {
        fail(&mut handshake, "pipe");
    }
    // SAFETY: both descriptors were just made and are owned here.
    let (mut wait_end, give_end) = unsafe { (File::from_raw_fd(release[0]), File::from_raw_fd(release[1])) };
    // Closed by the child once it left this session (EOF tells it did).
    let mut ready = [0i32; 2];
    // SAFETY: `ready` has room for two descriptors.
    if unsafe { pipe2(ready.as_mut_ptr(), O_CLOEXEC) } != 0 {
        fail(&mut handshake, "pipe");
    }
    // SAFETY: both descriptors were just made and are owned here.
    let (mut left, left_done) = unsafe { (File::from_raw_fd(ready[0]), File::from_raw_fd(ready[1])) };
    // SAFETY: plain calls on this process's own descriptor and pid.
    let (tty, me) = unsafe { (isatty(0) == 1, getpid()) };
    // SAFETY: single-threaded; see `init`.
    let child = unsafe { fork() };
    if child < 0 {
        fail(&mut handshake, "fork");
    }
    if child == 0 {
        drop(give_end);
        // Out of this process's session first: its exit hangs up its own
        // process group, which must no longer hold the command.
        // SAFETY: the child is not a group leader, so setsid succeeds.
        unsafe { setsid() };
        drop(left);
        drop(left_done);
        // The parent says go once the shim watches this process; if it
        // dies first, nobody would: the command does not run.
        if !matches!(wait_end.read(&mut [0u8; 1]), Ok(1)) {
            // SAFETY: _exit ends the process without running anything inherited.
            unsafe { _exit(1) };
        }
        // Adopted once the parent is gone (its terminal is released just
        // before).
        // SAFETY: getppid cannot fail.
        while unsafe { getppid() } == me {
            std::thread::sleep(std::time::Duration::from_millis(1));
        }
        run(cmd, tty);
    }
    drop(wait_end);
    // Not before the child left this session: this process's exit hangs
    // up its group, which would kill a child still in it.
    drop(left_done);
    let _ = left.read(&mut [0u8; 1]);
    // The shim watches the command's exit before it answers. Without an
    // answer (the shim gone), the command ends without running.
    let answered = handshake.write_all(format!("{child}\n").as_bytes()).is_ok()
        && matches!(handshake.read(&mut [0u8; 1]), Ok(1));
    let mut give_end = give_end;
    if !answered || give_end.write_all(b"g").is_err() {
        std::process::exit(1);
    }
    std::process::exit(0)
}

/// Execs `cmd` in a session of its own (taking the terminal when `tty`).
fn run(cmd: &[OsString], tty: bool) -> ! {
    // SAFETY: setsid fails only for a group leader, which a fresh child of
    // `init` is not (a child of `exec` already made its session).
    unsafe { setsid() };
    if tty {
        // SAFETY: TIOCSCTTY with 0: take the terminal if it has no session.
        unsafe { ioctl(0, TIOCSCTTY, 0) };
    }
    let err = Command::new(&cmd[0]).args(&cmd[1..]).exec();
    let code = match err.kind() {
        std::io::ErrorKind::NotFound => 127,
        _ => 126,
    };
    eprintln!("crab-init: exec {}: {err}", cmd[0].to_string_lossy());
    // SAFETY: _exit ends the process without running anything inherited.
    unsafe { _exit(code) }
}

/// Reports the failure of `what` to the shim and ends the exec.
fn fail(handshake: &mut File, what: &str) -> ! {
    let err = std::io::Error::last_os_error();
    let _ = handshake.write_all(format!("error {what}: {err}\n").as_bytes());
    std::process::exit(126)
}

/// Whether `pid` has a handler for `sig` (a pid 1 gets only those). When
/// its status cannot be read, the signal is passed on.
fn handles(pid: i32, sig: i32) -> bool {
    if sig == SIGKILL || sig == SIGSTOP {
        return false;
    }
    let Ok(status) = std::fs::read_to_string(format!("/proc/{pid}/status")) else {
        return true;
    };
    status
        .lines()
        .find_map(|l| l.strip_prefix("SigCgt:"))
        .and_then(|mask| u64::from_str_radix(mask.trim(), 16).ok())
        .is_none_or(|mask| mask & (1u64 << (sig - 1)) != 0)
}

/// A wait status as a shell's exit code.
fn exit_code(status: i32) -> i32 {
    match status & 0x7f {
        0 => (status >> 8) & 0xff,
        sig => 128 + sig,
    }
}
