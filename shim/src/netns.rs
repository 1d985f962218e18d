//! The container's network namespace: bringing up its loopback interface.

use std::fs::File;
use std::os::fd::AsRawFd;

use nix::sched::{setns, CloneFlags};
use nix::sys::socket::{socket, AddressFamily, SockFlag, SockType};

/// Moves the calling thread into the network namespace of `pid` and sets
/// its `lo` interface up (what runc does for a namespace it creates).
///
/// The caller must be a thread that may stay in that namespace (the runtime
/// helper, which exits right after).
pub fn loopback_up(pid: i32) -> std::io::Result<()> {
    let ns = File::open(format!("/proc/{pid}/ns/net"))?;
    setns(&ns, CloneFlags::CLONE_NEWNET)?;
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
        return Err(std::io::Error::last_os_error());
    }
    // SAFETY: SIOCGIFFLAGS filled the `ifru_flags` member of the union.
    unsafe {
        req.ifr_ifru.ifru_flags |= libc::IFF_UP as libc::c_short;
    }
    // SAFETY: as above; SIOCSIFFLAGS only reads `req`.
    if unsafe { libc::ioctl(sock.as_raw_fd(), libc::SIOCSIFFLAGS, &req) } < 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(())
}
