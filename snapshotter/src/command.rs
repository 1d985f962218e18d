//! Running `zfs` and `btrfs` with errors that name the command and carry
//! its stderr; on zfs-fuse, one `zfs` or `zpool` command at a time.

use std::io::{Read, Write};
use std::path::Path;
use std::process::{Command, Stdio};

use crate::{Error, Result};

/// The lock that makes `zfs` and `zpool` commands take turns on zfs-fuse.
const ZFS_FUSE_TURN: &str = "/run/crab/zfs-fuse.lock";

/// zfs-fuse wedges for good, every later command and mount access hanging,
/// when two commands change it at once (seen with six concurrent `zfs
/// create`s on one pool; the same loop one at a time never wedged). On a
/// host without the kernel module (no `/dev/zfs`), a `zfs` or `zpool`
/// command therefore holds a host-wide turn while it runs; the kernel
/// module needs none.
fn turn(program: &str) -> Result<Option<nix::fcntl::Flock<std::fs::File>>> {
    let zfs = matches!(program, "zfs" | "zpool");
    if !zfs || Path::new("/dev/zfs").exists() {
        return Ok(None);
    }
    crate::host_lock::lock(Path::new(ZFS_FUSE_TURN)).map(Some)
}

/// Runs `program args…`; returns stdout.
pub fn run(program: &str, args: &[&str]) -> Result<String> {
    let _turn = turn(program)?;
    let out = Command::new(program)
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

/// Runs `program args…` with its stdout copied into `out`.
pub fn run_to(program: &str, args: &[&str], out: &mut dyn Write) -> Result<()> {
    let _turn = turn(program)?;
    let mut child = spawn(program, args, Stdio::null(), Stdio::piped())?;
    let mut stdout = child.stdout.take().expect("piped stdout");
    let copied = std::io::copy(&mut stdout, out);
    drop(stdout);
    finish(program, args, child, copied.map(drop))
}

/// Runs `program args…` with `input` copied into its stdin.
pub fn run_from(program: &str, args: &[&str], input: &mut dyn Read) -> Result<()> {
    let _turn = turn(program)?;
    let mut child = spawn(program, args, Stdio::piped(), Stdio::null())?;
    let mut stdin = child.stdin.take().expect("piped stdin");
    let copied = std::io::copy(input, &mut stdin).and_then(|_| stdin.flush());
    drop(stdin);
    finish(program, args, child, copied)
}

fn spawn(program: &str, args: &[&str], stdin: Stdio, stdout: Stdio) -> Result<std::process::Child> {
    Command::new(program)
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
