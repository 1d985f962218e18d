//! `Inspector`: the host's loaded programs, the registered sandboxes, and
//! the turn-end decision.

use std::collections::{HashMap, HashSet};
use std::fs::File;
use std::os::fd::{AsFd, OwnedFd};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use nix::fcntl::{Flock, FlockArg};
use parking_lot::Mutex;

use crate::error::{Error, Result};
use crate::kernel::{comm_key, Ctl, Event, Stats, SLOTS, SLOT_SHARED};
use crate::ledger::{Ignore, Ledger};
use crate::loader::{self, Maps};
use crate::procs;
use crate::report::{Class, Reason, TurnReport};

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
    ignore: Option<Ignore>,
    /// Deleted-file mappings already seen, (dev, ino).
    deleted_maps: HashSet<(u64, u64)>,
    /// Processes known to hold shared writable file mappings → the files.
    /// A long-lived process that runs or exits while holding one may have
    /// stored into it (no system call shows that), so the files count as
    /// changed; the knowledge outlives the turn that made the mapping.
    shared_maps: HashMap<u32, Vec<String>>,
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
                    devs: HashSet::new(),
                    host_mntns: host_mount_namespaces(),
                },
                links: loaded.links,
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
        let ctl = existing.unwrap_or(Ctl { gen: 1, turn: 0 });
        if existing.is_none() {
            state.maps.ctl.insert(cg, ctl, 0).map_err(map_err("crab_ctl"))?;
        }
        sync_slot(&mut state.maps, cg)?;
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
                ignore: None,
                deleted_maps: HashSet::new(),
                shared_maps: shared_writable_maps(
                    &procs::members(cgroup_dir, "cgroup.procs"),
                    &Ignore::default(),
                ),
            },
        );
        Ok(cg)
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
        log::info!("inspector: sandbox {sandbox} unregistered");
        Ok(())
    }

    /// Ends the sandbox's open turn: classifies what it changed, and opens
    /// the next turn (the reset).
    ///
    /// When the inspector cannot vouch for the turn (records lost to a full
    /// ring, full maps, a drain timeout, detached programs, operations it
    /// does not follow, a restart mid-turn) the class is `full` and a
    /// [`Reason::Unsure`] says why.
    ///
    /// # Errors
    /// [`Error::UnknownSandbox`], or a map failure.
    pub fn turn_end(&self, sandbox: &str) -> Result<TurnReport> {
        let config = &self.shared.config;
        let mut guard = self.shared.state.lock();
        let state = &mut *guard;
        let cg = *state.names.get(sandbox).ok_or_else(|| Error::UnknownSandbox {
            sandbox: sandbox.to_owned(),
        })?;
        let map_err = |name| move |source| Error::Map { name, source };
        let mut unsure: Vec<String> = Vec::new();

        // The boundary: bump the generation, then read the sequence number.
        let (gen, turn) = {
            let sb = &state.sandboxes[&cg];
            (sb.gen, sb.turn + 1)
        };
        state
            .maps
            .ctl
            .insert(cg, Ctl { gen: gen + 1, turn }, 0)
            .map_err(map_err("crab_ctl"))?;
        let stats = state.maps.stats.get(&cg, 0).map_err(map_err("crab_stats"))?;
        let boundary = stats.seq;
        if let Some(sb) = state.sandboxes.get_mut(&cg) {
            sb.boundary = Some(boundary);
        }

        // Every record numbered before the boundary must be in, or counted
        // as dropped.
        let deadline = Instant::now() + config.drain_timeout;
        let mut lost = 0;
        loop {
            drain(state);
            let sb = &state.sandboxes[&cg];
            let missing = (boundary - sb.base_seq).saturating_sub(sb.current.n_events);
            if missing == 0 {
                break;
            }
            let now = state.maps.stats.get(&cg, 0).unwrap_or(stats);
            if now.n_dropped - sb.base_dropped >= missing {
                lost = missing;
                unsure.push(format!("{missing} records were lost: the ring buffer was full"));
                break;
            }
            if Instant::now() > deadline {
                unsure.push(format!(
                    "{missing} records did not arrive within {:?}",
                    config.drain_timeout
                ));
                break;
            }
            std::thread::sleep(Duration::from_micros(100));
        }
        if !loader::links_present(&state.links) {
            unsure.push("the inspector's programs are detached (pins removed)".into());
        }

        let sb = state.sandboxes.get_mut(&cg).expect("looked up above");
        if stats.n_lost > sb.base_lost {
            unsure.push(format!(
                "{} task or syscall entries did not fit in the kernel's maps",
                stats.n_lost - sb.base_lost
            ));
        }
        if sb.restarted {
            unsure.push("the inspector's owner restarted during this turn".into());
        }
        unsure.extend(sb.current.unsure().iter().cloned());
        let _ = sb.base_unsure; // counted through the UNSURE records themselves

        // Processes: started and still alive, or long-lived and running.
        let mut proc_reasons: Vec<Reason> = sb.current.proc_reasons().to_vec();
        let pids = procs::members(&sb.cgroup_dir, "cgroup.procs");
        let noisy = |comm: &str| config.noisy_comms.iter().any(|n| n == comm);
        for &pid in &pids {
            if let Ok(t) = state.maps.tasks.get(&pid, 0) {
                if t.born_gen == gen {
                    let comm = procs::task_state(pid).map(|s| s.1).unwrap_or_default();
                    proc_reasons.push(Reason::Started { pid, comm });
                }
            }
        }
        for tid in procs::members(&sb.cgroup_dir, "cgroup.threads") {
            let seen = state
                .maps
                .tasks
                .get(&tid, 0)
                .is_ok_and(|t| t.born_gen >= gen || t.active_gen >= gen);
            if seen {
                continue;
            }
            if let Some(('R', comm)) = procs::task_state(tid) {
                if !noisy(&comm) {
                    proc_reasons.push(Reason::Ran { pid: tid, comm });
                }
            }
        }

        // Files: the net change, outside the kernel's interfaces.
        if sb.ignore.is_none() {
            if let Some(&pid) = pids.first() {
                sb.ignore = Some(Ignore {
                    devs: procs::interface_devs(pid),
                    host_mntns: HashSet::new(),
                });
            }
        }
        let verdict = sb
            .current
            .fs_verdict(sb.ignore.as_ref().unwrap_or(&Ignore::default()));
        let fs = !verdict.changed.is_empty();

        // A changed file that a live process maps: the old image would not
        // restore against it.
        let mut mapped = Vec::new();
        if fs {
            let written: HashSet<(u64, u64)> = verdict.written.iter().copied().collect();
            for &pid in &pids {
                for m in procs::mappings(pid) {
                    let replaced = m.deleted && sb.deleted_maps.insert((m.dev, m.ino));
                    if replaced || written.contains(&(m.dev, m.ino)) {
                        mapped.push(Reason::MappedFileChanged { pid, path: m.path });
                    }
                }
            }
        }

        // A long-lived process that ran or exited may have stored into a
        // shared writable file mapping, made in this turn or an earlier one.
        let mut touched: HashSet<u32> = sb.current.noisy_ran.clone();
        for r in &proc_reasons {
            if let Reason::Ran { pid, .. } | Reason::Exited { pid, .. } = r {
                touched.insert(*pid);
            }
        }
        let no_ignore = Ignore::default();
        let ignore = sb.ignore.as_ref().unwrap_or(&no_ignore);
        for (pid, dev, name) in &sb.current.shared_mapped {
            if !ignore.devs.contains(dev) {
                sb.shared_maps.entry(*pid).or_default().push(name.clone());
            }
        }
        let mut shared = Vec::new();
        for pid in &touched {
            if let Some(paths) = sb.shared_maps.get(pid) {
                shared.extend(paths.iter().map(|p| Reason::Changed { path: p.clone() }));
            }
        }
        // What they hold now (gone for the exited ones).
        let now = shared_writable_maps(&touched.iter().copied().collect::<Vec<_>>(), ignore);
        for pid in &touched {
            match now.get(pid) {
                Some(paths) => {
                    shared.extend(paths.iter().map(|p| Reason::Changed { path: p.clone() }));
                    sb.shared_maps.insert(*pid, paths.clone());
                }
                None => {
                    sb.shared_maps.remove(pid);
                }
            }
        }
        shared.sort_by(|a, b| format!("{a:?}").cmp(&format!("{b:?}")));
        shared.dedup();
        let fs = fs || !shared.is_empty();
        let proc = !proc_reasons.is_empty() || !mapped.is_empty();
        let class = if !unsure.is_empty() || !mapped.is_empty() {
            Class::Full
        } else {
            Class::of(fs, proc)
        };
        let reasons: Vec<Reason> = unsure
            .into_iter()
            .map(|why| Reason::Unsure { why })
            .chain(mapped)
            .chain(proc_reasons)
            .chain(shared)
            .chain(verdict.changed.into_iter().map(|path| Reason::Changed { path }))
            .collect();
        if class == Class::Full && reasons.iter().any(|r| matches!(r, Reason::Unsure { .. })) {
            log::warn!(
                "inspector: sandbox {sandbox} turn {turn} is full: {:?}",
                reasons[0]
            );
        }

        // The reset: the records past the boundary open the next turn.
        sb.current = std::mem::take(&mut sb.next);
        sb.base_seq = boundary;
        sb.boundary = None;
        sb.base_dropped += lost;
        sb.base_lost = stats.n_lost;
        sb.base_unsure = stats.n_unsure;
        sb.restarted = false;
        sb.gen = gen + 1;
        sb.turn = turn;
        let n_reasons = reasons.len();
        let mut reasons = reasons;
        reasons.truncate(config.max_reasons);
        log::debug!("inspector: sandbox {sandbox} turn {turn} class {class} ({n_reasons} reasons)");
        Ok(TurnReport {
            turn,
            class,
            reasons,
            n_reasons,
        })
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
                .filter(|m| m.shared_writable && !ignore.devs.contains(&m.dev))
                .map(|m| m.path)
                .collect();
            (!paths.is_empty()).then_some((pid, paths))
        })
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
