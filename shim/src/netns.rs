//! The container's network namespace: bringing up its loopback interface,
//! and crab's pin of a namespace that holds nothing but the sandbox's
//! sockets.
//!
//! A pinned namespace stays out of CRIU's images (`runtime::criu`), which
//! spares CRIU saving and rebuilding links, addresses, routes, rules and
//! four firewall tables with a dozen `ip` and `iptables` runs at every
//! checkpoint and restore. That is only right for a namespace the sandbox
//! cannot configure (see [`may_pin`]): then its state is its sockets,
//! which CRIU keeps with the processes, and a fresh namespace with `lo` up
//! ([`fresh_pinned`], what every restore of such an image gets) is the
//! same namespace.

use std::fs::File;
use std::io;
use std::os::fd::AsRawFd;
use std::os::unix::fs::{DirBuilderExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

use nix::mount::{mount, umount2, MntFlags, MsFlags};
use nix::sched::{setns, unshare, CloneFlags};
use nix::sys::socket::{socket, AddressFamily, SockFlag, SockType};
use oci_spec::runtime::{Capability, LinuxNamespaceType, Spec};

/// Moves the calling thread into the network namespace of `pid` and sets
/// its `lo` interface up (what runc does for a namespace it creates).
///
/// The caller must be a thread that may stay in that namespace (the runtime
/// helper, which exits right after).
pub fn loopback_up(pid: i32) -> io::Result<()> {
    let ns = File::open(format!("/proc/{pid}/ns/net"))?;
    setns(&ns, CloneFlags::CLONE_NEWNET)?;
    lo_up_here()
}

/// Sets `lo` up in the calling thread's network namespace.
fn lo_up_here() -> io::Result<()> {
    let sock = socket(
        AddressFamily::Inet,
        SockType::Datagram,
        SockFlag::SOCK_CLOEXEC,
        None,
    )?;
    // SAFETY: `ifreq` is a C struct of integers and byte arrays, for which
    // all-zero bytes are a valid value.
    let mut req: libc::ifreq = unsafe { std::mem::zeroed() };
    for (dst, src) in req.ifr_name.iter_mut().zip(b"lo\0") {
        *dst = *src as libc::c_char;
    }
    // JUSTIFICATION: neither nix nor rustix wraps SIOC[GS]IFFLAGS.
    // SAFETY: SIOCGIFFLAGS reads the NUL-terminated name in `req` and writes
    // the flags into it; `req` is a valid, exclusively borrowed ifreq and
    // `sock` an open socket for the duration of the call.
    if unsafe { libc::ioctl(sock.as_raw_fd(), libc::SIOCGIFFLAGS, &mut req) } < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: SIOCGIFFLAGS filled the `ifru_flags` member of the union.
    unsafe {
        req.ifr_ifru.ifru_flags |= libc::IFF_UP as libc::c_short;
    }
    // SAFETY: as above; SIOCSIFFLAGS only reads `req`.
    if unsafe { libc::ioctl(sock.as_raw_fd(), libc::SIOCSIFFLAGS, &req) } < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

/// Where crab pins the network namespace of container `id` whose runtime
/// state is under `root`.
pub fn pin_path(root: &Path, id: &str) -> PathBuf {
    pins_dir(root).join(id)
}

/// The directory of crab's pins under runtime root `root`.
pub fn pins_dir(root: &Path) -> PathBuf {
    root.join(".netns")
}

/// Whether the namespace that `spec` creates may be pinned: a new one
/// (not joined), no user namespace (whose root would own it), and no
/// process given `CAP_NET_ADMIN`, without which nothing in the sandbox can
/// change a link, address, route, rule, firewall table or `net.*` sysctl.
/// An exec that brings the capability unpins it ([`exec_may_configure`]).
pub fn may_pin(spec: &Spec) -> bool {
    let namespaces = spec
        .linux()
        .as_ref()
        .and_then(|l| l.namespaces().clone())
        .unwrap_or_default();
    let new_net = namespaces
        .iter()
        .any(|n| n.typ() == LinuxNamespaceType::Network && n.path().is_none());
    let user = namespaces.iter().any(|n| n.typ() == LinuxNamespaceType::User);
    new_net && !user && !spec.process().as_ref().is_some_and(net_admin)
}

/// Whether an exec's process may configure the sandbox's network.
pub fn exec_may_configure(process: &oci_spec::runtime::Process) -> bool {
    net_admin(process)
}

/// Whether `CAP_NET_ADMIN` is in any of `process`'s capability sets.
fn net_admin(process: &oci_spec::runtime::Process) -> bool {
    let Some(caps) = process.capabilities() else {
        return false;
    };
    [
        caps.bounding(),
        caps.effective(),
        caps.permitted(),
        caps.inheritable(),
        caps.ambient(),
    ]
    .into_iter()
    .flatten()
    .any(|set| set.contains(&Capability::NetAdmin))
}

/// Pins network namespace `ns` (an nsfs path such as `/proc/<pid>/ns/net`)
/// at `at`, replacing a pin that was there.
pub fn pin(ns: &Path, at: &Path) -> io::Result<()> {
    unpin(at)?;
    if let Some(dir) = at.parent() {
        std::fs::DirBuilder::new()
            .recursive(true)
            .mode(0o700)
            .create(dir)?;
    }
    std::fs::OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(false)
        .mode(0o600)
        .open(at)?;
    mount(Some(ns), at, None::<&str>, MsFlags::MS_BIND, None::<&str>)?;
    Ok(())
}

/// Removes the pin at `at` (every mount stacked on it, then the file);
/// nothing pinned is not an error.
pub fn unpin(at: &Path) -> io::Result<()> {
    // A bounded loop: a pin is one mount, a crash between two pins two.
    for _ in 0..8 {
        match umount2(at, MntFlags::MNT_DETACH) {
            Ok(()) => continue,
            Err(nix::errno::Errno::EINVAL | nix::errno::Errno::ENOENT) => break,
            Err(e) => return Err(e.into()),
        }
    }
    match std::fs::remove_file(at) {
        Err(e) if e.kind() != io::ErrorKind::NotFound => Err(e),
        _ => Ok(()),
    }
}

/// Makes a new network namespace with `lo` up, pins it at `at`, and
/// answers it: what a pinned namespace holds apart from sockets.
pub fn fresh_pinned(at: &Path) -> io::Result<File> {
    // unshare(CLONE_NEWNET) moves only the calling thread: a thread of its
    // own, gone after, so the helper's namespace stays the host's.
    std::thread::scope(|s| {
        s.spawn(|| {
            unshare(CloneFlags::CLONE_NEWNET)?;
            lo_up_here()?;
            let ns = Path::new("/proc/thread-self/ns/net");
            pin(ns, at)?;
            File::open(at)
        })
        .join()
        .unwrap_or_else(|_| Err(io::Error::other("the namespace thread panicked")))
    })
}

/// Destroys the TCP sockets of network namespace `ns` that their owners
/// already closed (time-wait, fin-wait, closing, last-ack): the killed
/// processes' ends of connections that a restore into the same namespace
/// (docker's) brings back with the same addresses and ports, which the
/// kernel refuses while one lingers as a full socket. Open sockets (the
/// proxy's listener and its connections) are left alone.
pub fn reap_closed_tcp(ns: &Path) -> io::Result<()> {
    let ns = File::open(ns)?;
    std::thread::scope(|s| {
        s.spawn(|| {
            // The child inherits this thread's namespace.
            setns(&ns, CloneFlags::CLONE_NEWNET)?;
            let out = Command::new("ss")
                .args(["-K", "-t", "-n"])
                .args(["state", "time-wait", "state", "fin-wait-1", "state", "fin-wait-2"])
                .args(["state", "closing", "state", "last-ack"])
                .stdin(Stdio::null())
                .stdout(Stdio::null())
                .stderr(Stdio::piped())
                .output()?;
            if !out.status.success() {
                return Err(io::Error::other(format!(
                    "ss -K: {}",
                    String::from_utf8_lossy(&out.stderr).trim()
                )));
            }
            Ok(())
        })
        .join()
        .unwrap_or_else(|_| Err(io::Error::other("the namespace thread panicked")))
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use oci_spec::runtime::{
        LinuxBuilder, LinuxCapabilitiesBuilder, LinuxNamespaceBuilder, ProcessBuilder, SpecBuilder,
    };

    fn spec(namespaces: &[LinuxNamespaceType], caps: &[Capability]) -> Spec {
        let namespaces = namespaces
            .iter()
            .map(|t| LinuxNamespaceBuilder::default().typ(*t).build().unwrap())
            .collect::<Vec<_>>();
        let caps = LinuxCapabilitiesBuilder::default()
            .bounding(caps.iter().copied().collect::<std::collections::HashSet<_>>())
            .build()
            .unwrap();
        SpecBuilder::default()
            .linux(LinuxBuilder::default().namespaces(namespaces).build().unwrap())
            .process(ProcessBuilder::default().capabilities(caps).build().unwrap())
            .build()
            .unwrap()
    }

    #[test]
    fn only_a_new_namespace_nothing_can_configure_is_pinned() {
        use LinuxNamespaceType::{Mount, Network, Pid, User};
        assert!(may_pin(&spec(&[Pid, Mount, Network], &[Capability::Chown])));
        assert!(!may_pin(&spec(&[Pid, Mount], &[])), "the host's network");
        assert!(
            !may_pin(&spec(&[Pid, Network, User], &[])),
            "its own root owns it"
        );
        assert!(!may_pin(&spec(&[Pid, Network], &[Capability::NetAdmin])));
    }
}
