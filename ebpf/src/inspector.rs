//! `Inspector`: the host's loaded programs, the registered sandboxes, and
//! the turn-end decision.

use std::collections::{HashMap, HashSet};
use std::fs::File;
use std::os::fd::{AsFd, OwnedFd};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::Duration;

use nix::fcntl::{Flock, FlockArg};
use parking_lot::Mutex;

use crate::error::{Error, Result};
use crate::kernel::{comm_key, Ctl, Event, Stats, SLOTS, SLOT_SHARED};
use crate::ledger::{Ignore, Ledger};
use crate::loader::{self, Maps, Syscalls};
use crate::procs;

mod turn_end;

/// How the inspector is loaded and how it decides. There is no `Default`:
/// [`InspectorConfig::host`] gives the values crabd uses.
#[derive(Clone, Debug)]
pub struct InspectorConfig {
    /// bpffs directory for the pinned programs and maps
    /// (`/sys/fs/bpf/crab` on a host). One owner per directory.
    pub pin_dir: PathBuf,
    /// Ring-buffer size in bytes for a fresh load (a power of two, a
    /// multiple of the page size). Ignored when pinned programs are reused.
    pub ring_bytes: u32,
    /// Command names (as in `/proc/PID/comm`, at most 15 bytes) whose own
    /// running is not a process change, e.g. an agent's persistent shell
    /// whose heap churns on every command. Their `chdir`, `exec`, `exit`
    /// and the processes they start still count. Host-wide: the last owner
    /// to load sets them.
    pub noisy_comms: Vec<String>,
    /// How long a turn end waits for records the kernel numbered but has
    /// not yet committed to the ring; past it the turn is `full`.
    pub drain_timeout: Duration,
    /// How many reasons a report carries at most.
    pub max_reasons: usize,
    /// Whether a thread drains the ring between turn ends, every 20 ms or
    /// when the kernel finds the ring a quarter full (crabd: yes, so a long
    /// turn does not overflow it; a test that wants an overflow: no).
    pub background_drain: bool,
}

/// The inspector of one host: loads (or finds) the pinned BPF programs and
/// classifies the turns of registered sandboxes.
///
/// ```no_run
/// use crab_inspector::{cgroup_id, Inspector, InspectorConfig};
/// # fn main() -> crab_inspector::Result<()> {
/// let inspector = Inspector::load(InspectorConfig::host(vec!["bash".into()]))?;
/// let dir = crab_inspector::unified_mount()?.join("default/sandbox1");
/// inspector.register("sandbox1", &dir)?;
/// // … the agent's turn runs …
/// let report = inspector.turn_end("sandbox1")?;
/// println!("turn {} is {}", report.turn, report.class);
/// # Ok(()) }
/// ```
#[doc(alias = "bpf")]
pub struct Inspector {
    shared: Arc<Shared>,
    drainer: Option<(Arc<AtomicBool>, JoinHandle<()>)>,
    _owner: Flock<File>,
}

struct Shared {
    config: InspectorConfig,
    state: Mutex<State>,
}

struct State {
    maps: Maps,
    /// The host's mount namespaces (records from them are not sandbox files).
    host: Ignore,
    links: Vec<PathBuf>,
    /// Attached while any sandbox is registered, kernel-side (`crab_ctl`).
    syscalls: Syscalls,
    sandboxes: HashMap<u64, Sandbox>,
    names: HashMap<String, u64>,
}

/// User space's side of one registered sandbox.
struct Sandbox {
    cgroup_dir: PathBuf,
    /// Generation and turn number of the open turn.
    gen: u64,
    turn: u64,
    /// Records of the open turn, and of the next one while a turn end
    /// drains past its boundary.
    current: Ledger,
    next: Ledger,
    /// First sequence number of the open turn; the boundary while ending it.
    base_seq: u64,
    boundary: Option<u64>,
    /// Kernel counters already accounted for.
    base_dropped: u64,
    base_lost: u64,
    base_unsure: u64,
    /// The kernel had state for this sandbox before we registered it (an
    /// owner restarted mid-turn): the open turn's start is unknown.
    restarted: bool,
    /// The sandbox's init is crab-init, whose running is no change.
    quiet_init: bool,
    ignore: Option<Ignore>,
    /// The mount namespace `ignore` and `prints` were learned in (that of
    /// the sandbox's first process).
    mount_ns: Option<u64>,
    /// Deleted-file mappings already seen, (dev, ino).
    deleted_maps: HashSet<(u64, u64)>,
    /// Processes known to hold shared writable file mappings → the files.
    /// A long-lived process that runs or exits while holding one may have
    /// stored into it (no system call shows that), so the files count as
    /// changed; the knowledge outlives the turn that made the mapping.
    shared_maps: HashMap<u32, Vec<String>>,
    /// Fingerprints of the sandbox's tmpfs mounts at the last turn end
    /// (mount point → fingerprint; `None`: not comparable).
    prints: HashMap<Vec<u8>, Option<u64>>,
    /// The sandbox's child cgroups at the last turn end, whose tasks are
    /// not followed.
    children: procs::Children,
}

impl InspectorConfig {
    /// The host's configuration: pins under `/sys/fs/bpf/crab`, an 8 MiB
    /// ring drained in the background, a 100 ms drain timeout, 16 reasons.
    pub fn host(noisy_comms: Vec<String>) -> InspectorConfig {
        InspectorConfig {
            pin_dir: PathBuf::from("/sys/fs/bpf/crab"),
            ring_bytes: 8 << 20,
            noisy_comms,
            drain_timeout: Duration::from_millis(100),
            max_reasons: 16,
            background_drain: true,
        }
    }
}

// === impl Inspector ===

impl Inspector {
    /// Loads the programs (or reuses the ones pinned by an earlier owner of
    /// the same build) and takes ownership of `config.pin_dir`.
    ///
    /// # Errors
    /// [`Error::NotBuilt`] when the crate was built without clang;
    /// [`Error::Busy`] when another process owns the pin directory; load,
    /// attach and pin failures otherwise.
    pub fn load(config: InspectorConfig) -> Result<Inspector> {
        for comm in &config.noisy_comms {
            if comm.len() > 15 {
                return Err(Error::CommTooLong { comm: comm.clone() });
            }
        }
        loader::prepare(&config.pin_dir)?;
        let owner = lock_owner(&config.pin_dir)?;
        let loaded = loader::load_or_reuse(&config.pin_dir, config.ring_bytes)?;
        let mut maps = loaded.maps;
        set_noisy(&mut maps, &config.noisy_comms)?;
        // Sandboxes an earlier owner registered are still followed.
        forget_gone_cgroups(&mut maps)?;
        if maps.ctl.keys().next().is_some() {
            loaded.syscalls.attach()?;
        } else {
            loaded.syscalls.detach()?;
        }
        let ring_fd: OwnedFd = loader::ring_fd(&maps)
            .try_clone_to_owned()
            .map_err(|source| Error::Io {
                op: "dup the ring buffer fd of",
                path: config.pin_dir.clone(),
                source,
            })?;
        let background = config.background_drain;
        let shared = Arc::new(Shared {
            config,
            state: Mutex::new(State {
                maps,
                host: Ignore {
                    host_mntns: host_mount_namespaces(),
                    ..Ignore::default()
                },
                links: loaded.links,
                syscalls: loaded.syscalls,
                sandboxes: HashMap::new(),
                names: HashMap::new(),
            }),
        });
        let drainer = background.then(|| {
            let stop = Arc::new(AtomicBool::new(false));
            let handle = {
                let (shared, stop) = (shared.clone(), stop.clone());
                std::thread::Builder::new()
                    .name("crab-inspector-drain".into())
                    .spawn(move || drain_loop(&shared, &stop, ring_fd))
            };
            handle.map(|h| (stop, h))
        });
        let drainer = match drainer {
            None => None,
            Some(Ok(d)) => Some(d),
            Some(Err(source)) => {
                return Err(Error::Io {
                    op: "spawn the drain thread for",
                    path: shared.config.pin_dir.clone(),
                    source,
                })
            }
        };
        Ok(Inspector {
            shared,
            drainer,
            _owner: owner,
        })
    }

    /// Starts following the sandbox whose unified cgroup is `cgroup_dir`,
    /// and returns its cgroup id. Its open turn starts now.
    ///
    /// # Errors
    /// [`Error::AlreadyRegistered`], [`Error::Cgroup`], or a map failure.
    pub fn register(&self, sandbox: &str, cgroup_dir: &Path) -> Result<u64> {
        let cg = crate::cgroup::cgroup_id(cgroup_dir)?;
        let mut guard = self.shared.state.lock();
        let state = &mut *guard;
        if state.names.contains_key(sandbox) || state.sandboxes.contains_key(&cg) {
            return Err(Error::AlreadyRegistered {
                sandbox: sandbox.to_owned(),
                cgroup_id: cg,
            });
        }
        let map_err = |name| move |source| Error::Map { name, source };
        let existing = state.maps.ctl.get(&cg, 0).ok();
        let stats = match state.maps.stats.get(&cg, 0) {
            Ok(s) => s,
            Err(_) => {
                // Counters first: the programs act once ctl names the cgroup.
                state
                    .maps
                    .stats
                    .insert(cg, Stats::default(), 0)
                    .map_err(map_err("crab_stats"))?;
                Stats::default()
            }
        };
        let ctl = existing.unwrap_or(Ctl {
            gen: first_gen(),
            turn: 0,
            capturing: 0,
        });
        // Child cgroups before the turn starts and after: a task that
        // leaves one in between is counted in it.
        let early = procs::children(cgroup_dir);
        // The programs first: the turn starts once ctl names the cgroup.
        state.syscalls.attach()?;
        if existing.is_none() {
            state.maps.ctl.insert(cg, ctl, 0).map_err(map_err("crab_ctl"))?;
        } else if ctl.capturing != 0 {
            // An owner that died mid-capture: no capture runs now.
            let ctl = Ctl { capturing: 0, ..ctl };
            state.maps.ctl.insert(cg, ctl, 0).map_err(map_err("crab_ctl"))?;
        }
        if let Err(e) = sync_slot(&mut state.maps, cg) {
            if existing.is_none() {
                let _ = state.maps.ctl.remove(&cg);
            }
            return Err(e);
        }
        log::info!(
            "inspector: sandbox {sandbox} registered (cgroup {cg}, turn {}{})",
            ctl.turn + 1,
            if existing.is_some() {
                ", kernel state reused"
            } else {
                ""
            }
        );
        state.names.insert(sandbox.to_owned(), cg);
        let members = procs::members(cgroup_dir, "cgroup.procs");
        state.sandboxes.insert(
            cg,
            Sandbox {
                cgroup_dir: cgroup_dir.to_owned(),
                gen: ctl.gen,
                turn: ctl.turn,
                current: Ledger::default(),
                next: Ledger::default(),
                base_seq: stats.seq,
                boundary: None,
                base_dropped: stats.n_dropped,
                base_lost: stats.n_lost,
                base_unsure: stats.n_unsure,
                restarted: existing.is_some(),
                quiet_init: false,
                ignore: None,
                mount_ns: members.first().and_then(|&pid| procs::mount_ns(pid)),
                deleted_maps: HashSet::new(),
                shared_maps: shared_writable_maps(&members, &Ignore::default()),
                prints: members
                    .first()
                    .map(|&pid| tmpfs_prints(pid, &crate::mounts::of(pid)))
                    .unwrap_or_default(),
                children: procs::Children::found(&[early, procs::children(cgroup_dir)], false),
            },
        );
        Ok(cg)
    }

    /// Tells that the sandbox's init is crab-init (the pid 1 of its pid
    /// namespace, whose parent is outside it): that it ran, reaping the
    /// sandbox's processes, is no process change.
    ///
    /// # Errors
    /// [`Error::UnknownSandbox`].
    pub fn quiet_init(&self, sandbox: &str) -> Result<()> {
        let mut state = self.shared.state.lock();
        let cg = *state.names.get(sandbox).ok_or_else(|| Error::UnknownSandbox {
            sandbox: sandbox.to_owned(),
        })?;
        if let Some(sb) = state.sandboxes.get_mut(&cg) {
            sb.quiet_init = true;
        }
        Ok(())
    }

    /// Stops following a sandbox and forgets its kernel state.
    ///
    /// # Errors
    /// [`Error::UnknownSandbox`].
    pub fn unregister(&self, sandbox: &str) -> Result<()> {
        let mut guard = self.shared.state.lock();
        let state = &mut *guard;
        let cg = state.names.remove(sandbox).ok_or_else(|| Error::UnknownSandbox {
            sandbox: sandbox.to_owned(),
        })?;
        state.sandboxes.remove(&cg);
        // ctl first: once it is gone the programs stop touching stats.
        let _ = state.maps.ctl.remove(&cg);
        let _ = state.maps.stats.remove(&cg);
        sync_slot(&mut state.maps, cg)?;
        if state.maps.ctl.keys().next().is_none() {
            // Tasks and calls in flight stay as they are: a call whose
            // exit goes unseen is counted off when its task next enters a
            // call or exits (the programs on the sched tracepoints stay).
            state.syscalls.detach()?;
        }
        log::info!("inspector: sandbox {sandbox} unregistered");
        Ok(())
    }

    /// Reads the ring buffer now (crabd need not: the background thread
    /// does, and every turn end does).
    pub fn drain(&self) {
        drain(&mut self.shared.state.lock());
    }

    /// Stops the drain thread, then removes every pinned object under the
    /// pin directory, which detaches the programs (tests, uninstall).
    ///
    /// # Errors
    /// When a pin cannot be removed.
    pub fn unload(mut self) -> Result<()> {
        self.stop_drainer();
        loader::unpin_all(&self.shared.config.pin_dir)
    }

    fn stop_drainer(&mut self) {
        if let Some((stop, handle)) = self.drainer.take() {
            stop.store(true, Ordering::Relaxed);
            let _ = handle.join();
        }
    }
}

impl Drop for Inspector {
    fn drop(&mut self) {
        self.stop_drainer();
    }
}

/// Moves every committed record from the ring into its sandbox's ledger.
fn drain(state: &mut State) {
    let State {
        maps,
        sandboxes,
        host,
        ..
    } = state;
    while let Some(item) = maps.events.next() {
        let Some(ev) = Event::parse(&item) else {
            continue;
        };
        drop(item);
        let Some(sb) = sandboxes.get_mut(&ev.cgroup) else {
            continue; // a sandbox nobody registered (yet): its first turn is full anyway
        };
        if ev.seq < sb.base_seq {
            continue; // before registration, or a turn already ended as unsure
        }
        match sb.boundary {
            Some(b) if ev.seq >= b => sb.next.apply(&ev, host),
            _ => sb.current.apply(&ev, host),
        }
    }
}

fn drain_loop(shared: &Shared, stop: &AtomicBool, ring_fd: OwnedFd) {
    use nix::poll::{poll, PollFd, PollFlags, PollTimeout};
    while !stop.load(Ordering::Relaxed) {
        let mut fds = [PollFd::new(ring_fd.as_fd(), PollFlags::POLLIN)];
        match poll(&mut fds, PollTimeout::from(20u16)) {
            Ok(n) if n > 0 => drain(&mut shared.state.lock()),
            Ok(_) | Err(nix::errno::Errno::EINTR) => {}
            Err(e) => {
                log::error!("inspector: poll on the ring buffer failed ({e}); draining at turn ends only");
                return;
            }
        }
    }
}

/// The shared writable file mappings of `pids`, by pid (pids with none are
/// left out), except those on the sandbox's kernel-interface mounts
/// (`/dev/shm` is not filesystem state).
fn shared_writable_maps(pids: &[u32], ignore: &Ignore) -> HashMap<u32, Vec<String>> {
    pids.iter()
        .filter_map(|&pid| {
            let paths: Vec<String> = procs::mappings(pid)
                .into_iter()
                .filter(|m| m.shared_writable && !ignore.devs.contains(&m.dev) && ignore.reachable(m.dev))
                .map(|m| m.path)
                .collect();
            (!paths.is_empty()).then_some((pid, paths))
        })
        .collect()
}

/// Fingerprints of the writable tmpfs mounts among `mounts`, as `pid`
/// sees them, by mount point.
fn tmpfs_prints(pid: u32, mounts: &[crate::mounts::Mount]) -> HashMap<Vec<u8>, Option<u64>> {
    mounts
        .iter()
        .filter(|m| m.tmpfs)
        .map(|m| (m.point.clone(), crate::mounts::fingerprint(pid, m)))
        .collect()
}

/// The mount namespaces of this process and of the host's init.
fn host_mount_namespaces() -> HashSet<u32> {
    use std::os::unix::fs::MetadataExt;
    ["/proc/self/ns/mnt", "/proc/1/ns/mnt"]
        .iter()
        .filter_map(|p| std::fs::metadata(p).ok())
        .map(|m| m.ino() as u32)
        .collect()
}

/// Takes the pin directory for this process: one owner drains the ring.
fn lock_owner(pin_dir: &Path) -> Result<Flock<File>> {
    let dir = File::open(pin_dir).map_err(|source| Error::Io {
        op: "open",
        path: pin_dir.to_owned(),
        source,
    })?;
    Flock::lock(dir, FlockArg::LockExclusiveNonblock).map_err(|(_, errno)| match errno {
        nix::errno::Errno::EWOULDBLOCK => Error::Busy {
            path: pin_dir.to_owned(),
        },
        other => Error::Io {
            op: "lock",
            path: pin_dir.to_owned(),
            source: other.into(),
        },
    })
}

/// The first generation of a sandbox registered now: nanoseconds since
/// boot. Generations of one cgroup never repeat, also across an unregister
/// and a register again: the kernel's per-inode and per-task entries (an
/// LRU that outlives a registration) name generations, and an old one
/// equal to a new turn's would pass for "reported this turn". A sandbox
/// moves on by one per turn or capture, far slower than the clock.
fn first_gen() -> u64 {
    nix::time::clock_gettime(nix::time::ClockId::CLOCK_BOOTTIME)
        .map(|t| t.tv_sec() as u64 * 1_000_000_000 + t.tv_nsec() as u64)
        .unwrap_or(1)
        .max(1)
}

/// Forgets the sandboxes the kernel follows whose cgroup is gone (removed
/// while no owner ran): they would keep the system-call programs attached
/// for nothing. Cgroup ids are inode numbers of the unified hierarchy.
fn forget_gone_cgroups(maps: &mut Maps) -> Result<()> {
    let followed: Vec<u64> = maps.ctl.keys().filter_map(|k| k.ok()).collect();
    if followed.is_empty() {
        return Ok(());
    }
    // An unknown or unreadable hierarchy: keep everything (the safe side).
    let Ok(root) = crate::cgroup::unified_mount() else {
        return Ok(());
    };
    // Any error on the way (a directory removed or renamed meanwhile, one
    // it may not read) leaves every entry: not seen is not gone.
    let walk = || -> std::io::Result<HashSet<u64>> {
        use std::os::unix::fs::MetadataExt;
        let mut alive = HashSet::new();
        let mut dirs = vec![root.clone()];
        while let Some(dir) = dirs.pop() {
            alive.insert(std::fs::symlink_metadata(&dir)?.ino());
            for entry in std::fs::read_dir(&dir)? {
                let entry = entry?;
                if entry.file_type()?.is_dir() {
                    dirs.push(entry.path());
                }
            }
        }
        Ok(alive)
    };
    // A cgroup removed while it is read (containers come and go) makes
    // the walk start again, a few times.
    let mut tries = 0;
    let alive = loop {
        tries += 1;
        match walk() {
            Ok(alive) => break alive,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound && tries < 5 => continue,
            Err(_) => return Ok(()),
        }
    };
    for cg in followed.into_iter().filter(|cg| !alive.contains(cg)) {
        log::info!("inspector: cgroup {cg} is gone; no longer followed");
        let _ = maps.ctl.remove(&cg);
        let _ = maps.stats.remove(&cg);
        sync_slot(maps, cg)?;
    }
    Ok(())
}

/// Sets the prefilter slot of `cg` from the sandboxes the kernel follows:
/// their id, 0 for none, `SLOT_SHARED` for several.
fn sync_slot(maps: &mut Maps, cg: u64) -> Result<()> {
    let slot = cg & (SLOTS - 1);
    let owners: Vec<u64> = maps
        .ctl
        .keys()
        .filter_map(|k| k.ok())
        .filter(|k| k & (SLOTS - 1) == slot)
        .collect();
    let value = match owners.as_slice() {
        [] => 0,
        [one] => *one,
        _ => SLOT_SHARED,
    };
    maps.slots
        .set(slot as u32, value, 0)
        .map_err(|source| Error::Map {
            name: "crab_slots",
            source,
        })
}

fn set_noisy(maps: &mut Maps, comms: &[String]) -> Result<()> {
    let map_err = |source| Error::Map {
        name: "crab_noisy",
        source,
    };
    let old: Vec<_> = maps.noisy.keys().filter_map(|k| k.ok()).collect();
    for k in old {
        maps.noisy.remove(&k).map_err(map_err)?;
    }
    for comm in comms {
        maps.noisy.insert(comm_key(comm), 1, 0).map_err(map_err)?;
    }
    Ok(())
}
