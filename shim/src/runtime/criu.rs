//! CRIU dump and restore of a container's process tree, in the helper.
//!
//! libcontainer has a checkpoint but no restore, and its checkpoint cannot
//! dump a frozen container consistently (it does not hand CRIU the freezer
//! cgroup). Both directions are here, through `rust-criu`'s RPC, the way
//! runc drives CRIU:
//! - bind mounts and (v1) cgroup mounts are external: recorded by their
//!   destination at dump, mapped back to their source at restore;
//! - a network namespace the spec joins by path is external, so the restored
//!   tree joins it again (docker's sandboxes);
//! - the dump names the freezer cgroup, so a container that is already
//!   frozen stays frozen throughout and comes out frozen;
//! - stdio that was a pipe is re-wired at restore to fresh pipes of the shim
//!   (`--inherit-fd`), so output keeps reaching containerd;
//! - the restored init is the helper's child (`rst_sibling`), and becomes
//!   the shim's when the helper exits, like a created init.

use std::fs::File;
use std::os::fd::{AsRawFd, OwnedFd, RawFd};
use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicI32, Ordering};

use anyhow::{bail, Context, Result};
use libcgroups::common::CgroupSetup;
use libcontainer::container::Container;
use oci_spec::runtime::{LinuxNamespaceType, Mount, Spec};
use rust_criu::Criu;

/// File in the image directory recording where the init's stdio pointed.
pub const DESCRIPTORS: &str = "descriptors.json";

/// A file in the images saying their dump did not lock the network (see
/// `crate::netns::needs_lock`): their restore need not either.
pub const QUIET_NETWORK: &str = "crab-quiet-network";

/// CRIU's log files, in the work directory.
const DUMP_LOG: &str = "dump.log";
const RESTORE_LOG: &str = "restore.log";

/// A CRIU client of binary `path` (`[shim] criu`; a bare name is looked
/// up on `PATH`), its kernel-data cache made first if the host keeps none.
fn criu(path: &Path) -> Result<Criu> {
    super::kdat::ensure(path);
    let path = path.to_string_lossy().into_owned();
    Criu::new_with_criu_path(path.clone()).with_context(|| format!("start CRIU ({path})"))
}

/// How to dump.
pub struct DumpOpts<'a> {
    /// The CRIU binary.
    pub criu: &'a Path,
    /// Where the images go (created if missing).
    pub image_path: &'a Path,
    /// CRIU's work directory (logs), if not the image directory.
    pub work_path: Option<&'a Path>,
    /// Leave the tree running after the dump (else CRIU kills it).
    pub leave_running: bool,
    /// Dump established TCP connections.
    pub tcp_established: bool,
    /// Dump external unix sockets.
    pub ext_unix_sk: bool,
    /// Dump file locks.
    pub file_locks: bool,
    /// The init is crab-init: its report pipe (descriptor 3) is recorded
    /// with its stdio and re-wired at restore.
    pub crab_init: bool,
    /// Something may have changed the sandbox's mounts (a privileged
    /// exec, maybe gone): every tmpfs and mask stays in the images.
    pub mounts_changed: bool,
    /// CRIU was told not to lock the network (`crate::netns::needs_lock`):
    /// recorded in the images for the restore.
    pub quiet_network: bool,
    /// Where crab pins this container's network namespace (see
    /// `crate::netns`): a namespace pinned there is recorded as crab's own.
    pub own_netns: &'a Path,
}

/// Dumps container `c`'s process tree.
pub fn dump(c: &Container, opts: &DumpOpts<'_>) -> Result<()> {
    let pid = c.pid().context("the container has no init pid")?.as_raw();
    let spec = Spec::load(c.bundle().join("config.json")).context("read config.json")?;
    std::fs::create_dir_all(opts.image_path)
        .with_context(|| format!("create {}", opts.image_path.display()))?;
    super::joined_ns::record(&spec, pid, opts.image_path)?;
    // The init's stdio targets (and crab-init's report pipe), for
    // re-wiring at restore.
    let recorded = if opts.crab_init { 4 } else { 3 };
    let descriptors: Vec<String> = (0..recorded)
        .map(|n| {
            std::fs::read_link(format!("/proc/{pid}/fd/{n}"))
                .map(|p| p.to_string_lossy().into_owned())
                .unwrap_or_else(|_| "/dev/null".to_owned())
        })
        .collect();
    std::fs::write(
        opts.image_path.join(DESCRIPTORS),
        serde_json::to_vec(&descriptors).context("encode descriptors")?,
    )
    .context("write descriptors.json")?;

    let mut criu = criu(opts.criu)?;
    let images =
        File::open(opts.image_path).with_context(|| format!("open {}", opts.image_path.display()))?;
    criu.set_images_dir_fd(images.as_raw_fd());
    let work = match opts.work_path {
        Some(w) => {
            std::fs::create_dir_all(w).with_context(|| format!("create {}", w.display()))?;
            Some(File::open(w).with_context(|| format!("open {}", w.display()))?)
        }
        None => None,
    };
    if let Some(w) = &work {
        criu.set_work_dir_fd(w.as_raw_fd());
    }
    for (dest, _) in external_mounts(&spec)? {
        criu.set_external_mount(dest.clone(), dest);
    }
    // The cgroup CRIU freezes, and whose processes the tmpfs rules read.
    let freezer = crate::freezer::cgroup_of(pid).context("the init's freezer cgroup")?;
    let mounts = procfs::process::Process::new(pid)
        .and_then(|p| p.mountinfo())
        .context("read the init's mounts")?;
    let root = rustix::fs::open(
        format!("/proc/{pid}/root"),
        rustix::fs::OFlags::PATH | rustix::fs::OFlags::DIRECTORY | rustix::fs::OFlags::CLOEXEC,
        rustix::fs::Mode::empty(),
    )
    .context("open the init's root")?;
    let fixed = !opts.mounts_changed && super::masked::mounts_are_fixed(&spec, &freezer);
    super::masked::record(&spec, &root, &mounts, fixed, opts.image_path, &mut criu)?;
    // Frozen before it is looked at: nothing writes into it after.
    let frozen = freezer.is_frozen();
    super::tmpfs::record(&spec, &root, &mounts, fixed && frozen, opts.image_path, &mut criu)?;
    let quiet = opts.image_path.join(QUIET_NETWORK);
    match opts.quiet_network {
        true => std::fs::write(&quiet, b"").context("mark the images' network quiet")?,
        false => super::remove_stale(&quiet)?,
    }
    // A network namespace that someone else made or set up (the spec joins
    // it by path, or docker pinned it for its bridge) stays outside the
    // image: the restore goes back into it, with its links and addresses.
    // Whatever an earlier dump into this directory said no longer holds.
    for stale in [NETNS_FILE, NETNS_OWN] {
        super::remove_stale(&opts.image_path.join(stale))?;
    }
    if let Some((path, own)) = netns_outside(&spec, pid, opts.own_netns) {
        let ino = std::fs::metadata(&path)
            .with_context(|| format!("stat {}", path.display()))?
            .ino();
        criu.add_external(format!("net[{ino}]:{NETNS_KEY}"));
        std::fs::write(
            opts.image_path.join(NETNS_FILE),
            path.as_os_str().as_encoded_bytes(),
        )
        .context("write the network namespace's path")?;
        if own {
            std::fs::write(opts.image_path.join(NETNS_OWN), b"")
                .context("mark the network namespace as crab's")?;
        }
    }
    criu.set_freeze_cgroup(freezer.dir().to_string_lossy().into_owned());
    criu.set_log_file(DUMP_LOG.to_owned());
    criu.set_log_level(4);
    criu.set_pid(pid);
    criu.set_leave_running(opts.leave_running);
    criu.set_ext_unix_sk(opts.ext_unix_sk);
    criu.set_tcp_established(opts.tcp_established);
    criu.set_file_locks(opts.file_locks);
    criu.set_shell_job(false);
    criu.set_orphan_pts_master(true);
    // A restore leaves the tree in the cgroups of its helper (see
    // `restore`), so the values of every controller's files, which CRIU
    // would read for the images (some milliseconds frozen), serve nothing.
    criu.set_manage_cgroups(false);
    criu.cgroups_mode(rust_criu::CgMode::IGNORE);
    criu.set_root(rootfs(c.bundle(), &spec).to_string_lossy().into_owned());
    let log = opts.work_path.unwrap_or(opts.image_path).join(DUMP_LOG);
    criu.dump()
        .map_err(|e| anyhow::anyhow!("{e}{}", log_errors(&log)))
        .with_context(|| format!("criu dump failed (log: {})", log.display()))
}

/// What a restore needs besides the images.
pub struct RestoreOpts<'a> {
    /// The CRIU binary.
    pub criu: &'a Path,
    /// The images.
    pub image_path: &'a Path,
    /// CRIU's work directory (logs).
    pub work_path: &'a Path,
    /// Restore established TCP connections.
    pub tcp_established: bool,
    /// Where the shim waits for the pty master of a container with a
    /// terminal (libcontainer's console socket protocol).
    pub console_socket: Option<&'a Path>,
    /// The container is new (a fork or an import), not the one dumped.
    pub fresh: bool,
    /// The helper's descriptor that stands in for crab-init's report pipe.
    pub report_fd: Option<RawFd>,
    /// The sandbox's network namespace as it is pinned now, for an image
    /// that keeps its namespace outside.
    pub netns: Option<&'a Path>,
    /// Where crab pins this container's network namespace.
    pub own_netns: &'a Path,
    /// Drop the closed connections of a namespace the spec joins first
    /// (the first restore of a pod's containers, all killed).
    pub reap_closed: bool,
}

/// The pid of the restored init, from CRIU's `post-restore` notification
/// (rust-criu drops the one in the final response). The helper restores
/// once per process, so a process-wide cell is enough.
static RESTORED_PID: AtomicI32 = AtomicI32::new(0);

fn notify(script: &str, msg: &rust_criu::rust_criu_protobuf::rpc::Criu_notify, _fd: Option<RawFd>) -> i32 {
    if script == "post-restore" {
        RESTORED_PID.store(msg.pid(), Ordering::SeqCst);
    }
    0
}

/// Restores container `c`'s process tree from `opts.image_path`, with the
/// helper's own stdio standing in for the init's pipes; returns the
/// restored init's pid and records it, running, in libcontainer's state.
pub fn restore(c: &mut Container, opts: &RestoreOpts<'_>) -> Result<i32> {
    let spec = Spec::load(c.bundle().join("config.json")).context("read config.json")?;
    if !opts.fresh {
        // A container made for this restore has a spec of its own.
        super::joined_ns::check(&spec, opts.image_path)?;
    }
    let descriptors: Vec<String> = serde_json::from_slice(
        &std::fs::read(opts.image_path.join(DESCRIPTORS)).context("read descriptors.json")?,
    )
    .context("parse descriptors.json")?;

    let mut criu = criu(opts.criu)?;
    let images =
        File::open(opts.image_path).with_context(|| format!("open {}", opts.image_path.display()))?;
    criu.set_images_dir_fd(images.as_raw_fd());
    std::fs::create_dir_all(opts.work_path)
        .with_context(|| format!("create {}", opts.work_path.display()))?;
    // Root's alone: the fresh tmpfs sources are made in it.
    std::fs::set_permissions(opts.work_path, std::fs::Permissions::from_mode(0o700))
        .with_context(|| format!("close {}", opts.work_path.display()))?;
    let work = File::open(opts.work_path).with_context(|| format!("open {}", opts.work_path.display()))?;
    criu.set_work_dir_fd(work.as_raw_fd());
    for (dest, source) in external_mounts(&spec)? {
        criu.set_external_mount(dest, source);
    }
    // Held until CRIU is done: the masks' tmpfs and the kept-out tmpfs
    // made again, unmounted on drop.
    let _masks = super::masked::restore(opts.image_path, opts.work_path, &mut criu)?;
    let _tmpfs = super::tmpfs::restore(&spec, opts.image_path, opts.work_path, &mut criu)?;
    // Inherited descriptors must survive into CRIU: no CLOEXEC, numbers
    // above stdio. They are closed when this helper exits.
    let mut keep: Vec<OwnedFd> = Vec::new();
    for (n, target) in descriptors.iter().enumerate() {
        // A pipe is known by its inode; the host's /dev/null by its path
        // from the root, without the slash. Left to CRIU, /dev/null would
        // be reopened on a mount of CRIU's own, which the next dump cannot
        // find ("Can't lookup mount"): the restored init must hold the
        // host's, as a created one does.
        let key = match target.as_str() {
            t if t.starts_with("pipe:") => t.to_owned(),
            "/dev/null" => "dev/null".to_owned(),
            _ => continue,
        };
        let source = match n {
            0..=2 => n as RawFd,
            _ => opts
                .report_fd
                .context("the image's init is crab-init, and no report pipe was given")?,
        };
        let fd = inheritable(source)?;
        criu.add_inherit_fd(fd.as_raw_fd(), key)
            .map_err(|e| anyhow::anyhow!("{e}"))?;
        keep.push(fd);
    }
    if let Some(ns) = external_netns(&spec, opts)? {
        let fd = inheritable(ns.as_raw_fd())?;
        criu.add_inherit_fd(fd.as_raw_fd(), NETNS_KEY.to_owned())
            .map_err(|e| anyhow::anyhow!("{e}"))?;
        keep.push(fd);
    }
    criu.set_log_file(RESTORE_LOG.to_owned());
    criu.set_log_level(4);
    criu.set_tcp_established(opts.tcp_established);
    criu.set_shell_job(false);
    // The init's terminal: its master stayed with the old shim side, so
    // CRIU makes a new pair and hands the master over.
    criu.set_orphan_pts_master(opts.console_socket.is_some());
    // The tree stays in the cgroups of the helper, which joined the
    // container's: the image's paths may be another container's (a fork).
    criu.set_manage_cgroups(false);
    criu.cgroups_mode(rust_criu::CgMode::IGNORE);
    criu.set_rst_sibling(true);
    criu.set_root(rootfs(c.bundle(), &spec).to_string_lossy().into_owned());
    criu.set_notify_scripts(true);
    criu.set_notify_cb(notify);
    RESTORED_PID.store(0, Ordering::SeqCst);
    let log = opts.work_path.join(RESTORE_LOG);
    criu.restore()
        .map_err(|e| anyhow::anyhow!("{e}{}", log_errors(&log)))
        .with_context(|| format!("criu restore failed (log: {})", log.display()))?;
    drop(keep);
    if let Some(socket) = opts.console_socket {
        let master = criu
            .take_orphan_pts_master_fd()
            .context("CRIU restored the terminal without a pty master")?;
        send_console(socket, &master)?;
    }
    let pid = RESTORED_PID.load(Ordering::SeqCst);
    if pid <= 0 {
        bail!("CRIU restored without reporting the init's pid");
    }
    c.set_pid(pid)
        .set_status(libcontainer::container::ContainerStatus::Running)
        .save()
        .context("record the restored init in the container state")?;
    Ok(pid)
}

/// Sends the restored terminal's pty master to the shim's console socket,
/// as libcontainer sends a created one.
fn send_console(socket: &Path, master: &OwnedFd) -> Result<()> {
    use nix::sys::socket::{sendmsg, ControlMessage, MsgFlags};
    let stream = std::os::unix::net::UnixStream::connect(socket)
        .with_context(|| format!("connect to the console socket {}", socket.display()))?;
    let fds = [master.as_raw_fd()];
    let iov = [std::io::IoSlice::new(b"/dev/ptmx")];
    sendmsg::<()>(
        stream.as_raw_fd(),
        &iov,
        &[ControlMessage::ScmRights(&fds)],
        MsgFlags::empty(),
        None,
    )
    .context("send the pty master")?;
    Ok(())
}

/// The last error lines of a CRIU log, to show with the failure (the log
/// itself may be gone by the time a user looks).
fn log_errors(log: &Path) -> String {
    let text = std::fs::read_to_string(log).unwrap_or_default();
    let errors: Vec<&str> = text.lines().filter(|l| l.contains("Error")).collect();
    let tail = &errors[errors.len().saturating_sub(3)..];
    tail.iter().map(|l| format!("; {}", l.trim())).collect()
}

/// The key CRIU knows an external network namespace by (runc's name).
const NETNS_KEY: &str = "extRootNetNS";

/// File in the image directory naming the network namespace the dump left
/// outside the image.
const NETNS_FILE: &str = "netns";

/// An empty file in the images: the namespace outside was crab's pin.
const NETNS_OWN: &str = "netns.own";

/// The network namespace a dump of init `pid` (of a container of `spec`,
/// whose namespace crab pins at `own_netns`) keeps outside its image, and
/// whether it is crab's own; `None` when CRIU dumps the namespace itself
/// (or the tree is in the host's).
pub fn netns_outside(spec: &Spec, pid: i32, own_netns: &Path) -> Option<(PathBuf, bool)> {
    // crab's pin counts as crab's only while the namespace holds nothing
    // but what a fresh one has (something outside may have added more).
    let ours = crate::netns::pins(own_netns, pid);
    let own = ours && crate::netns::only_loopback(pid);
    match joined_netns(spec) {
        Some(joined) => Some((joined, false)),
        None if own => Some((own_netns.to_owned(), true)),
        // Ours, but something outside gave it interfaces (`ctr run --cni`):
        // kept and gone back into, as docker's.
        None if ours => Some((own_netns.to_owned(), false)),
        None => pinned_netns(pid).map(|docker| (docker, false)),
    }
}

/// A bind mount that keeps `pid`'s network namespace alive outside the
/// container (docker's `…/netns/<key>`, made by its prestart hook).
pub fn pinned_netns(pid: i32) -> Option<PathBuf> {
    let ino = std::fs::metadata(format!("/proc/{pid}/ns/net")).ok()?.ino();
    let root = format!("net:[{ino}]");
    procfs::process::Process::myself()
        .ok()?
        .mountinfo()
        .ok()?
        .into_iter()
        .find(|m| m.fs_type == "nsfs" && m.root == root)
        .map(|m| m.mount_point)
}

/// The network namespace a restore joins: the spec's, or the one the dump
/// named. A container made from another's checkpoint must not share it.
///
/// A namespace crab pinned held nothing but sockets (`crate::netns`): the
/// restore gets a fresh one, pinned in place of the sandbox's. Going back
/// into the old one would meet whatever the killed processes and a killed
/// CRIU left there (connections closing with the addresses the restore
/// needs, CRIU's network lock table after a crash mid-dump).
fn external_netns(spec: &Spec, opts: &RestoreOpts<'_>) -> Result<Option<File>> {
    let open = |path: &Path| File::open(path).with_context(|| format!("open {}", path.display()));
    if let Some(path) = joined_netns(spec) {
        if opts.reap_closed {
            // A pod's: the processes just killed in it (the agent and the
            // pod's other containers) left their ends of connections
            // closing there (time-wait, fin-wait: a killed end's peer may
            // have been killed first), with the addresses the restore
            // needs. A half-closed connection of a container outside the
            // versions is lost with them. Best effort, as below.
            let _ = crate::netns::reap_closed_tcp(&path);
        }
        return open(&path).map(Some);
    }
    let named = match std::fs::read(opts.image_path.join(NETNS_FILE)) {
        Ok(bytes) => PathBuf::from(String::from_utf8_lossy(&bytes).into_owned()),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(e) => return Err(e).context("read the network namespace's path"),
    };
    if opts.image_path.join(NETNS_OWN).exists() {
        if !crate::netns::may_pin(spec) {
            bail!(
                "the checkpoint kept its network namespace out of its images (it held only lo), \
                 and this container's spec may configure its own (user namespace, hooks, net.* \
                 sysctls, a writable /proc/sys or CAP_NET_ADMIN/CAP_SYS_ADMIN): restore it into a \
                 container like the one checkpointed"
            );
        }
        return crate::netns::fresh_pinned(opts.own_netns)
            .context("make a network namespace")
            .map(Some);
    }
    if opts.fresh {
        bail!(
            "the checkpoint's network belongs to its own sandbox ({}, set up outside it, by docker or a network plugin): \
             it cannot be restored into another",
            named.display()
        );
    }
    // The sandbox's namespace now: docker pins a new one at each start.
    let path = opts.netns.map_or(named, Path::to_owned);
    // Best effort: a restored connection meets a lingering one only when
    // the kernel cannot reuse it (its peer kept it open), and a missing
    // `ss` must not cost docker sandboxes their rollback.
    let _ = crate::netns::reap_closed_tcp(&path);
    open(&path).map(Some)
}

/// A duplicate of `fd` numbered above stdio, without `CLOEXEC`.
fn inheritable(fd: RawFd) -> Result<OwnedFd> {
    // SAFETY: fcntl(F_DUPFD) on a descriptor this process owns returns a new
    // descriptor that nothing else owns; it is wrapped at once.
    let dup = unsafe { libc::fcntl(fd, libc::F_DUPFD, 3) };
    if dup < 0 {
        return Err(std::io::Error::last_os_error()).context("dup a descriptor for CRIU");
    }
    // SAFETY: `dup` is a fresh descriptor owned by nobody else.
    Ok(unsafe { <OwnedFd as std::os::fd::FromRawFd>::from_raw_fd(dup) })
}

/// The container's root directory on the host.
fn rootfs(bundle: &Path, spec: &Spec) -> PathBuf {
    let root = spec
        .root()
        .as_ref()
        .map(|r| r.path().clone())
        .unwrap_or_else(|| PathBuf::from("rootfs"));
    bundle.join(root)
}

/// External mounts as (destination, source): every bind mount of the
/// spec, and on v1 hosts each cgroup hierarchy when the spec mounts cgroups.
fn external_mounts(spec: &Spec) -> Result<Vec<(String, String)>> {
    let mut out = Vec::new();
    for m in spec.mounts().iter().flatten() {
        let dest = m.destination().to_string_lossy().into_owned();
        if is_bind(m) {
            let source = m
                .source()
                .as_ref()
                .map(|s| s.to_string_lossy().into_owned())
                .unwrap_or_else(|| dest.clone());
            out.push((dest, source));
        } else if m.typ().as_deref() == Some("cgroup")
            && matches!(
                libcgroups::common::get_cgroup_setup().context("cgroup setup")?,
                CgroupSetup::Legacy | CgroupSetup::Hybrid
            )
        {
            for mp in libcgroups::v1::util::list_subsystem_mount_points().context("cgroup mount points")? {
                let mp = mp.to_string_lossy().into_owned();
                if mp.starts_with("/sys/fs/cgroup") {
                    out.push((mp.clone(), mp));
                }
            }
        }
    }
    Ok(out)
}

fn is_bind(m: &Mount) -> bool {
    m.typ().as_deref() == Some("bind") || m.options().iter().flatten().any(|o| o == "bind" || o == "rbind")
}

/// The network namespace the spec joins by path, if any.
fn joined_netns(spec: &Spec) -> Option<PathBuf> {
    super::joined_ns::named(spec, LinuxNamespaceType::Network)?
        .path()
        .clone()
}
