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

/// Whether `spec` makes a new network namespace (one with no path).
pub fn creates(spec: &Spec) -> bool {
    spec.linux()
        .as_ref()
        .and_then(|l| l.namespaces().as_ref())
        .iter()
        .copied()
        .flatten()
        .any(|n| n.typ() == LinuxNamespaceType::Network && n.path().is_none())
}

/// Whether the namespace that `spec` creates may be pinned, which needs
/// all of: a new one (not joined); no user namespace (whose root would own
/// it); no hook (a runtime hook may set up interfaces in it, as CNI does);
/// no `net.*` sysctl of the spec's (set once at create: a fresh namespace
/// would not have it); `/proc/sys` read-only (root writes `net.*` there
/// without any capability); and a process without `CAP_NET_ADMIN` or
/// `CAP_SYS_ADMIN` (which remounts `/proc/sys`) in any set, a missing
/// capability list meaning every capability. An exec that could configure
/// it unpins it first ([`exec_may_configure`]).
pub fn may_pin(spec: &Spec) -> bool {
    let Some(linux) = spec.linux().as_ref() else {
        return false;
    };
    let new_net = creates(spec);
    let user = linux
        .namespaces()
        .iter()
        .flatten()
        .any(|n| n.typ() == LinuxNamespaceType::User);
    let net_sysctl = linux
        .sysctl()
        .as_ref()
        .is_some_and(|s| s.keys().any(|k| k.starts_with("net.") || k.starts_with("net/")));
    let hooks = spec.hooks().as_ref().is_some_and(|h| {
        #[allow(deprecated)]
        let prestart = h.prestart();
        [
            prestart,
            h.create_runtime(),
            h.create_container(),
            h.start_container(),
            h.poststart(),
        ]
        .into_iter()
        .any(|hooks| hooks.as_ref().is_some_and(|v| !v.is_empty()))
    });
    let listed = |paths: &Option<Vec<String>>| paths.iter().flatten().any(|p| p == "/proc/sys");
    let proc_sys_ro = listed(linux.readonly_paths()) || listed(linux.masked_paths());
    let configures = spec.process().as_ref().is_none_or(exec_may_configure);
    new_net && !user && !net_sysctl && !hooks && proc_sys_ro && !configures
}

/// Whether a process may configure the sandbox's network namespace:
/// `CAP_NET_ADMIN` or `CAP_SYS_ADMIN` in any of its capability sets, or
/// no capability list (libcontainer then drops none).
pub fn exec_may_configure(process: &oci_spec::runtime::Process) -> bool {
    may_hold(process, &[Capability::NetAdmin, Capability::SysAdmin])
}

/// Whether CRIU's network lock protects anything at a dump of the tree
/// of init `pid` (frozen), whose network namespace is kept outside the
/// image or not (`outside`).
///
/// CRIU locks a connection in its own network namespace unless it dumps
/// the tree's: for a namespace outside the image (crab's pin, docker's, a
/// pod's) the lock would drop the host's packets with the sandbox's
/// addresses and protect none of the sandbox's. In a private namespace
/// CRIU dumps, the lock matters only while a TCP socket there is
/// connected (any socket: one in flight in a unix socket's queue has no
/// descriptor to find it by). In the host's it is always kept.
/// Anything unreadable counts as needing it.
pub fn needs_lock(pid: i32, outside: bool) -> bool {
    use std::os::unix::fs::MetadataExt;

    use procfs::net::TcpState;
    use procfs::process::Process;

    if outside {
        return false;
    }
    let look = || -> procfs::ProcResult<bool> {
        let ns = |p: &str| std::fs::metadata(format!("/proc/{p}/ns/net")).map(|m| m.ino());
        if ns(&pid.to_string())? == ns("self")? {
            return Ok(true);
        }
        let p = Process::new(pid)?;
        // A host without IPv6 has no tcp6 table.
        let v6 = match p.tcp6() {
            Err(procfs::ProcError::NotFound(_)) => Vec::new(),
            other => other?,
        };
        Ok(p.tcp()?
            .into_iter()
            .chain(v6)
            .any(|e| e.inode != 0 && !matches!(e.state, TcpState::Listen | TcpState::Close)))
    };
    look().unwrap_or(true)
}

/// Whether `process` may hold one of `wanted`: in any of its capability
/// sets, or it has no capability list (libcontainer then drops none).
pub fn may_hold(process: &oci_spec::runtime::Process, wanted: &[Capability]) -> bool {
    let Some(caps) = process.capabilities() else {
        return true;
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
    .any(|set| wanted.iter().any(|c| set.contains(c)))
}

/// Whether `pin` is a pin of `pid`'s network namespace (compared by
/// device and inode, whatever path names it).
pub fn pins(pin: &Path, pid: i32) -> bool {
    use std::os::unix::fs::MetadataExt;
    let id = |m: std::fs::Metadata| (m.dev(), m.ino());
    match (
        std::fs::metadata(pin),
        std::fs::metadata(format!("/proc/{pid}/ns/net")),
    ) {
        (Ok(a), Ok(b)) => id(a) == id(b),
        _ => false,
    }
}

/// The interfaces every new namespace has: `lo`, and the fallback tunnel
/// devices of the tunnel modules the host has loaded (unless
/// `net.core.fb_tunnels_only_for_init_net`); nothing in the sandbox can
/// configure them without `CAP_NET_ADMIN`.
const EVERY_NAMESPACE_HAS: &[&str] = &[
    "lo", "tunl0", "gre0", "gretap0", "erspan0", "sit0", "ip6tnl0", "ip6gre0", "ip_vti0", "ip6_vti0",
];

/// Whether `pid`'s network namespace has no interface but those a fresh
/// one has.
pub fn only_loopback(pid: i32) -> bool {
    // Two header lines, then one line per interface: "  name: counters".
    std::fs::read_to_string(format!("/proc/{pid}/net/dev")).is_ok_and(|t| {
        t.lines().skip(2).all(|l| {
            l.split(':')
                .next()
                .is_some_and(|name| EVERY_NAMESPACE_HAS.contains(&name.trim()))
        })
    })
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
        .custom_flags(libc::O_NOFOLLOW)
        .open(at)?;
    mount(Some(ns), at, None::<&str>, MsFlags::MS_BIND, None::<&str>)?;
    Ok(())
}

/// Removes the pin at `at` (every mount stacked on it, then the file);
/// nothing pinned is not an error.
pub fn unpin(at: &Path) -> io::Result<()> {
    // A bounded loop: a pin is one mount, a crash between two pins two.
    for _ in 0..8 {
        match umount2(at, MntFlags::MNT_DETACH | MntFlags::UMOUNT_NOFOLLOW) {
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
/// (docker's, a pod's: its processes all killed) brings back with the same
/// addresses and ports, which the
/// kernel refuses while one lingers as a full socket. Open sockets (the
/// proxy's listener and its connections) are left alone.
pub fn reap_closed_tcp(ns: &Path) -> io::Result<()> {
    reap(
        ns,
        &["time-wait", "fin-wait-1", "fin-wait-2", "closing", "last-ack"],
    )
}

/// Destroys the TCP sockets of network namespace `ns` in `states`
/// (`ss`'s names).
fn reap(ns: &Path, states: &[&str]) -> io::Result<()> {
    let ns = File::open(ns)?;
    std::thread::scope(|s| {
        s.spawn(|| {
            // The child inherits this thread's namespace.
            setns(&ns, CloneFlags::CLONE_NEWNET)?;
            let out = Command::new("ss")
                .args(["-K", "-t", "-n"])
                .args(states.iter().flat_map(|s| ["state", s]))
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

    /// A process in a network namespace of its own (`unshare -rn`: a user
    /// namespace too, so no root is needed), with a listener and, if
    /// asked, a connection to it.
    fn holder(connect: bool) -> std::process::Child {
        use std::io::BufRead;
        let script = format!(
            "import socket, sys\n\
             l = socket.socket(); l.bind(('127.0.0.1', 0)); l.listen()\n\
             if {}:\n    c = socket.create_connection(l.getsockname()); a, _ = l.accept()\n\
             print('ready', flush=True); sys.stdin.read()\n",
            if connect { "True" } else { "False" }
        );
        let mut child = std::process::Command::new("unshare")
            .args([
                "-rn",
                "sh",
                "-c",
                "ip link set lo up && exec /usr/bin/python3 -c \"$0\"",
                &script,
            ])
            .stdin(std::process::Stdio::piped())
            .stdout(std::process::Stdio::piped())
            .spawn()
            .expect("unshare (util-linux) and python3 (install-deps installs them)");
        let mut line = String::new();
        std::io::BufReader::new(child.stdout.as_mut().unwrap())
            .read_line(&mut line)
            .unwrap();
        assert_eq!(line.trim(), "ready");
        child
    }

    #[test]
    fn only_a_connection_in_a_namespace_criu_dumps_wants_the_network_locked() {
        for connect in [false, true] {
            let mut child = holder(connect);
            let pid = child.id() as i32;
            let (inside, outside) = (needs_lock(pid, false), needs_lock(pid, true));
            let _ = child.kill();
            let _ = child.wait();
            assert_eq!(inside, connect, "connected: {connect}");
            assert!(!outside, "a namespace outside the image is never locked by CRIU");
        }
        // The host's own namespace is always locked; the unreadable too.
        assert!(needs_lock(std::process::id() as i32, false));
        assert!(needs_lock(i32::MAX, false));
    }
    use oci_spec::runtime::{
        LinuxBuilder, LinuxCapabilitiesBuilder, LinuxNamespaceBuilder, ProcessBuilder, SpecBuilder,
    };

    fn spec(namespaces: &[LinuxNamespaceType], caps: &[Capability]) -> Spec {
        spec_with(namespaces, caps, &[])
    }

    fn spec_with(namespaces: &[LinuxNamespaceType], caps: &[Capability], sysctl: &[(&str, &str)]) -> Spec {
        let namespaces = namespaces
            .iter()
            .map(|t| LinuxNamespaceBuilder::default().typ(*t).build().unwrap())
            .collect::<Vec<_>>();
        let caps = LinuxCapabilitiesBuilder::default()
            .bounding(caps.iter().copied().collect::<std::collections::HashSet<_>>())
            .build()
            .unwrap();
        SpecBuilder::default()
            .linux(
                LinuxBuilder::default()
                    .namespaces(namespaces)
                    .readonly_paths(vec!["/proc/sys".to_owned()])
                    .sysctl(
                        sysctl
                            .iter()
                            .map(|(k, v)| (k.to_string(), v.to_string()))
                            .collect::<std::collections::HashMap<_, _>>(),
                    )
                    .build()
                    .unwrap(),
            )
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
        assert!(!may_pin(&spec(&[Pid, Network], &[Capability::SysAdmin])));
        let sysctl = |k| spec_with(&[Pid, Network], &[], &[(k, "0")]);
        assert!(
            !may_pin(&sysctl("net.ipv4.ip_unprivileged_port_start")),
            "set once at create"
        );
        assert!(may_pin(&sysctl("kernel.shm_rmid_forced")));

        let mut no_caps = spec(&[Pid, Network], &[]);
        let mut process = ProcessBuilder::default().build().unwrap();
        process.set_capabilities(None);
        no_caps.set_process(Some(process));
        assert!(!may_pin(&no_caps), "no capability list: every capability");
        let mut writable = spec(&[Pid, Network], &[]);
        let mut linux = writable.linux().clone().unwrap();
        linux.set_readonly_paths(None);
        writable.set_linux(Some(linux));
        assert!(!may_pin(&writable), "root writes net.* in a writable /proc/sys");
        let mut hooked = spec(&[Pid, Network], &[]);
        let hook = oci_spec::runtime::HookBuilder::default()
            .path("/cni")
            .build()
            .unwrap();
        hooked.set_hooks(Some(
            oci_spec::runtime::HooksBuilder::default()
                .create_runtime(vec![hook])
                .build()
                .unwrap(),
        ));
        assert!(!may_pin(&hooked), "a hook may set up interfaces");
    }
}
