//! Running `zfs` and `btrfs` with errors that name the command and carry
//! its stderr; on zfs-fuse, one `zfs` or `zpool` command at a time.

use std::io::{Read, Write};
use std::os::fd::AsRawFd;
use std::os::unix::process::CommandExt;
use std::path::Path;
use std::process::{Command, Stdio};

use nix::fcntl::{fcntl, FcntlArg, FdFlag, Flock};

use crate::{Error, Result};

/// The lock that makes `zfs` and `zpool` commands take turns on zfs-fuse.
const ZFS_FUSE_TURN: &str = "/run/crab/zfs-fuse.lock";

/// zfs-fuse wedges for good, every later command and mount access hanging,
/// when two commands change it at once (seen with six concurrent `zfs
/// create`s on one pool; the same loop one at a time never wedged). On a
/// host without the kernel module (no `/dev/zfs`), a `zfs` or `zpool`
/// command therefore holds a host-wide turn while it runs; the kernel
/// module needs none. A command that has to wait says so in the log, and
/// how long it waited: a `zfs send` to a slow reader holds the turn.
fn turn(program: &str) -> Result<Option<Flock<std::fs::File>>> {
    let zfs = matches!(program, "zfs" | "zpool");
    if !zfs || Path::new("/dev/zfs").exists() {
        return Ok(None);
    }
    let path = Path::new(ZFS_FUSE_TURN);
    if let Some(turn) = crate::host_lock::try_lock(path)? {
        return Ok(Some(turn));
    }
    tracing::info!(
        program,
        lock = ZFS_FUSE_TURN,
        "zfs-fuse: waiting for another zfs command to finish"
    );
    let since = std::time::Instant::now();
    let turn = crate::host_lock::lock(path)?;
    tracing::info!(
        program,
        waited_ms = since.elapsed().as_millis() as u64,
        "zfs-fuse: the other zfs command finished"
    );
    Ok(Some(turn))
}

/// `program`, holding `turn` too while it runs: the child inherits the
/// locked file (a lock lasts while any process holds it), so a caller
/// killed mid-command does not hand the turn on while its `zfs` goes on.
#[allow(unsafe_code)]
fn command(program: &str, turn: Option<&Flock<std::fs::File>>) -> Command {
    let mut cmd = Command::new(program);
    if let Some(turn) = turn {
        let fd = turn.as_raw_fd();
        // SAFETY: the closure runs in the forked child before exec and
        // only calls fcntl (async-signal-safe) on its own copy of the fd
        // table; `fd` stays open until the command is spawned (the caller
        // holds `turn` until the child has exited).
        unsafe {
            cmd.pre_exec(move || {
                fcntl(fd, FcntlArg::F_SETFD(FdFlag::empty()))
                    .map(drop)
                    .map_err(std::io::Error::from)
            });
        }
    }
    cmd
}

/// Runs `program args…`; returns stdout.
pub fn run(program: &str, args: &[&str]) -> Result<String> {
    let turn = turn(program)?;
    let out = command(program, turn.as_ref())
        .args(args)
        .stdin(Stdio::null())
        .output()
        .map_err(|source| Error::Spawn {
            program: program.to_owned(),
            source,
        })?;
    if !out.status.success() {
        return Err(failed(program, args, &out.status, &out.stderr));
    }
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

/// Runs `program args…` with its stdout copied into `out`. On zfs-fuse the
/// turn is held while copying: `out` must not wait for another `zfs`.
pub fn run_to(program: &str, args: &[&str], out: &mut dyn Write) -> Result<()> {
    let turn = turn(program)?;
    let mut child = spawn(program, args, turn.as_ref(), Stdio::null(), Stdio::piped())?;
    let mut stdout = child.stdout.take().expect("piped stdout");
    let copied = std::io::copy(&mut stdout, out);
    drop(stdout);
    finish(program, args, child, copied.map(drop))
}

/// Runs `program args…` with `input` copied into its stdin (held turn: as
/// [`run_to`]).
pub fn run_from(program: &str, args: &[&str], input: &mut dyn Read) -> Result<()> {
    let turn = turn(program)?;
    let mut child = spawn(program, args, turn.as_ref(), Stdio::piped(), Stdio::null())?;
    let mut stdin = child.stdin.take().expect("piped stdin");
    let copied = std::io::copy(input, &mut stdin).and_then(|_| stdin.flush());
    drop(stdin);
    finish(program, args, child, copied)
}

fn spawn(
    program: &str,
    args: &[&str],
    turn: Option<&Flock<std::fs::File>>,
    stdin: Stdio,
    stdout: Stdio,
) -> Result<std::process::Child> {
    command(program, turn)
        .args(args)
        .stdin(stdin)
        .stdout(stdout)
        .stderr(Stdio::piped())
        .spawn()
        .map_err(|source| Error::Spawn {
            program: program.to_owned(),
            source,
        })
}

fn finish(
    program: &str,
    args: &[&str],
    mut child: std::process::Child,
    copied: std::io::Result<()>,
) -> Result<()> {
    let mut stderr = String::new();
    if let Some(mut e) = child.stderr.take() {
        let _ = e.read_to_string(&mut stderr);
    }
    let status = child.wait().map_err(|source| Error::Spawn {
        program: program.to_owned(),
        source,
    })?;
    if !status.success() {
        return Err(failed(program, args, &status, stderr.as_bytes()));
    }
    copied.map_err(|source| Error::Io {
        op: "stream",
        path: program.into(),
        source,
    })
}

fn failed(program: &str, args: &[&str], status: &std::process::ExitStatus, stderr: &[u8]) -> Error {
    Error::Command {
        command: format!("{program} {}", args.join(" ")),
        status: status.to_string(),
        stderr: String::from_utf8_lossy(stderr).trim().to_owned(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The command holds the turn's file too (a `zfs` outliving a killed
    /// caller keeps the turn); without a turn nothing is passed on.
    #[test]
    fn a_command_inherits_its_turn() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("turn.lock");
        let lock = crate::host_lock::lock(&path).expect("lock");
        let fds = |turn| {
            let out = command("sh", turn)
                .args(["-c", "ls -l /proc/$$/fd/"])
                .output()
                .expect("sh");
            String::from_utf8_lossy(&out.stdout).into_owned()
        };
        let path = path.to_string_lossy().into_owned();
        assert!(fds(Some(&lock)).contains(&path), "the child holds the turn");
        assert!(!fds(None).contains(&path), "no turn, nothing inherited");
    }
}
