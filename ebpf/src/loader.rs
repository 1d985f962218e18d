//! Loading the programs once per host and finding them again.
//!
//! Everything lives under `<pin_dir>/<build>/`, where `<build>` is a hash of
//! the compiled object: the maps (pinned by name, `LIBBPF_PIN_BY_NAME`),
//! one `link_<program>` per attached tracepoint, and the two system-call
//! programs themselves (`prog_<program>`). A later owner with the same
//! build finds the pins and reuses maps and programs as they are, so a
//! restart of the owner loses no kernel state. A different build replaces
//! them: its own directory is made, and older builds' directories are
//! removed, which detaches their programs.
//!
//! The system-call programs are attached only while a sandbox is
//! registered ([`Syscalls`]): an enabled `sys_enter`/`sys_exit` tracepoint
//! sends every system call of every task on the host through the kernel's
//! slow path, so a host without sandboxes must not have them.
//!
//! Invariant: pinned objects live as long as the host (or until a newer
//! build replaces them); nothing removes them when the owner exits.

use std::os::fd::AsFd;
use std::path::{Path, PathBuf};

use aya::maps::{Array, HashMap, Map, MapData, RingBuf};
use aya::pin::PinError;
use aya::programs::{links::FdLink, RawTracePoint, TracePoint};
use aya::{Ebpf, EbpfLoader};

use crate::error::{Error, Result};
use crate::kernel::{Ctl, Stats, Task, COMM_LEN};

/// The compiled programs (empty when clang was missing at build time).
static OBJECT: &[u8] = include_bytes!(concat!(env!("OUT_DIR"), "/inspector.bpf.o"));

/// (program, raw tracepoint) of the programs attached only while a sandbox
/// is registered.
const SYSCALL_PROGRAMS: [(&str, &str); 2] = [("crab_sys_enter", "sys_enter"), ("crab_sys_exit", "sys_exit")];

/// Where a program attaches.
enum Hook {
    /// A tracepoint: (category, name).
    Tracepoint(&'static str, &'static str),
    /// A raw tracepoint, whose arguments are the kernel's own pointers.
    Raw(&'static str),
}

/// (program, hook) of the programs attached for as long as they are
/// pinned.
const PROGRAMS: [(&str, Hook); 5] = [
    ("crab_fork", Hook::Raw("sched_process_fork")),
    ("crab_exec", Hook::Tracepoint("sched", "sched_process_exec")),
    ("crab_exit", Hook::Tracepoint("sched", "sched_process_exit")),
    ("crab_attach", Hook::Tracepoint("cgroup", "cgroup_attach_task")),
    ("crab_signal", Hook::Tracepoint("signal", "signal_deliver")),
];

const BPF_FS_MAGIC: i64 = 0xcafe4a11;

/// The maps user space reads and writes.
pub(crate) struct Maps {
    pub ctl: HashMap<MapData, u64, Ctl>,
    pub stats: HashMap<MapData, u64, Stats>,
    pub tasks: HashMap<MapData, u32, Task>,
    pub noisy: HashMap<MapData, [u8; COMM_LEN], u8>,
    pub slots: Array<MapData, u64>,
    pub events: RingBuf<MapData>,
}

/// Loaded (or found) programs: their maps, where the links of the programs
/// always attached are pinned, and the system-call programs.
pub(crate) struct Loaded {
    pub maps: Maps,
    pub links: Vec<PathBuf>,
    pub syscalls: Syscalls,
}

/// The system-call programs of one build, pinned, and attached on demand.
pub(crate) struct Syscalls {
    build: PathBuf,
}

/// Mounts bpffs if needed and makes `pin_dir`, so that it can be locked
/// before anything is loaded into it.
pub(crate) fn prepare(pin_dir: &Path) -> Result<()> {
    if OBJECT.is_empty() {
        return Err(Error::NotBuilt);
    }
    ensure_bpffs(pin_dir)?;
    std::fs::create_dir_all(pin_dir).map_err(|source| Error::Io {
        op: "create",
        path: pin_dir.to_owned(),
        source,
    })
}

/// Loads the programs under `pin_dir`, or reuses those a previous owner of
/// the same build pinned there. `ring_bytes` sizes the ring buffer of a new
/// load (a power of two, a multiple of the page size).
pub(crate) fn load_or_reuse(pin_dir: &Path, ring_bytes: u32) -> Result<Loaded> {
    let build = pin_dir.join(build_id());
    std::fs::create_dir_all(&build).map_err(|source| Error::Io {
        op: "create",
        path: build.clone(),
        source,
    })?;
    let links: Vec<PathBuf> = PROGRAMS
        .iter()
        .map(|(name, _)| build.join(format!("link_{name}")))
        .collect();
    let syscalls = Syscalls { build: build.clone() };
    let pinned = links.iter().chain(&syscalls.programs()).all(|p| p.exists());
    let maps = if pinned {
        log::info!("inspector: reusing pinned programs in {}", build.display());
        reuse_maps(&build)?
    } else {
        log::info!("inspector: loading programs into {}", build.display());
        load_fresh(&build, ring_bytes, &links)?
    };
    remove_other_builds(pin_dir, &build)?;
    Ok(Loaded {
        maps,
        links,
        syscalls,
    })
}

impl Syscalls {
    fn programs(&self) -> Vec<PathBuf> {
        SYSCALL_PROGRAMS
            .iter()
            .map(|(name, _)| self.build.join(format!("prog_{name}")))
            .collect()
    }

    fn links(&self) -> Vec<PathBuf> {
        SYSCALL_PROGRAMS
            .iter()
            .map(|(name, _)| self.build.join(format!("link_{name}")))
            .collect()
    }

    /// Whether both programs are attached (their links pinned).
    pub(crate) fn attached(&self) -> bool {
        links_present(&self.links())
    }

    /// Attaches what is not attached, from the pinned programs; the links
    /// are pinned, so they stay attached if the owner exits.
    pub(crate) fn attach(&self) -> Result<()> {
        for (((name, tp), prog), link) in SYSCALL_PROGRAMS.iter().zip(self.programs()).zip(self.links()) {
            if link.exists() {
                continue;
            }
            let program_err = |source| Error::Program { name, source };
            let mut program = RawTracePoint::from_pin(&prog).map_err(program_err)?;
            let id = program.attach(tp).map_err(program_err)?;
            let fd_link: FdLink = program.take_link(id).map_err(program_err)?.into();
            pin_link(fd_link, &link)?;
            log::info!("inspector: {name} attached");
        }
        Ok(())
    }

    /// Detaches both programs (removes their links' pins; the kernel
    /// detaches a link when its last reference goes).
    pub(crate) fn detach(&self) -> Result<()> {
        for link in self.links() {
            match std::fs::remove_file(&link) {
                Err(e) if e.kind() != std::io::ErrorKind::NotFound => {
                    return Err(Error::Io {
                        op: "remove",
                        path: link,
                        source: e,
                    })
                }
                _ => {}
            }
        }
        Ok(())
    }
}

/// Removes everything pinned under `pin_dir`, which detaches the programs.
pub(crate) fn unpin_all(pin_dir: &Path) -> Result<()> {
    match std::fs::remove_dir_all(pin_dir) {
        Err(e) if e.kind() != std::io::ErrorKind::NotFound => Err(Error::Io {
            op: "remove",
            path: pin_dir.to_owned(),
            source: e,
        }),
        _ => Ok(()),
    }
}

fn build_id() -> String {
    use std::hash::{Hash, Hasher};
    let mut h = std::collections::hash_map::DefaultHasher::new();
    OBJECT.hash(&mut h);
    format!("{:016x}", h.finish())
}

/// Mounts bpffs on the pin directory's bpffs root (`/sys/fs/bpf`) when the
/// host has not.
fn ensure_bpffs(pin_dir: &Path) -> Result<()> {
    let root = pin_dir
        .ancestors()
        .find(|a| a.ends_with("bpf") || a.parent().is_none())
        .unwrap_or(Path::new("/sys/fs/bpf"));
    let mounted = nix::sys::statfs::statfs(root)
        .map(|s| s.filesystem_type().0 == BPF_FS_MAGIC)
        .unwrap_or(false);
    if mounted {
        return Ok(());
    }
    std::fs::create_dir_all(root).map_err(|source| Error::Io {
        op: "create",
        path: root.to_owned(),
        source,
    })?;
    nix::mount::mount(
        Some("bpf"),
        root,
        Some("bpf"),
        nix::mount::MsFlags::empty(),
        None::<&str>,
    )
    .map_err(|source| Error::MountBpffs {
        path: root.to_owned(),
        source,
    })
}

fn load_fresh(build: &Path, ring_bytes: u32, links: &[PathBuf]) -> Result<Maps> {
    let mut ebpf = EbpfLoader::new()
        .default_map_pin_directory(build)
        .map_max_entries("crab_events", ring_bytes)
        .load(OBJECT)
        .map_err(Error::Load)?;
    for ((name, hook), pin) in PROGRAMS.iter().zip(links) {
        attach(&mut ebpf, name, hook, pin)?;
    }
    for (name, _) in SYSCALL_PROGRAMS {
        let program_err = |source| Error::Program { name, source };
        let program = ebpf.program_mut(name).ok_or(Error::MissingProgram { name })?;
        let program: &mut RawTracePoint = program.try_into().map_err(|_| Error::MissingProgram { name })?;
        program.load().map_err(program_err)?;
        let pin = build.join(format!("prog_{name}"));
        // A stale pin of a half-finished earlier load: this one replaces it.
        let _ = std::fs::remove_file(&pin);
        program
            .pin(&pin)
            .map_err(|source| Error::Pin { path: pin, source })?;
    }
    Ok(Maps {
        ctl: take(&mut ebpf, "crab_ctl")?,
        stats: take(&mut ebpf, "crab_stats")?,
        tasks: take(&mut ebpf, "crab_tasks")?,
        noisy: take(&mut ebpf, "crab_noisy")?,
        slots: take(&mut ebpf, "crab_slots")?,
        events: take(&mut ebpf, "crab_events")?,
    })
}

fn attach(ebpf: &mut Ebpf, name: &'static str, hook: &Hook, pin: &Path) -> Result<()> {
    let program_err = |source| Error::Program { name, source };
    let program = ebpf.program_mut(name).ok_or(Error::MissingProgram { name })?;
    let fd_link: FdLink = match *hook {
        Hook::Tracepoint(category, tp) => {
            let program: &mut TracePoint = program.try_into().map_err(|_| Error::MissingProgram { name })?;
            program.load().map_err(program_err)?;
            let id = program.attach(category, tp).map_err(program_err)?;
            let link = program.take_link(id).map_err(program_err)?;
            FdLink::try_from(link).map_err(|source| Error::PinnedLink {
                path: pin.to_owned(),
                source,
            })?
        }
        Hook::Raw(tp) => {
            let program: &mut RawTracePoint =
                program.try_into().map_err(|_| Error::MissingProgram { name })?;
            program.load().map_err(program_err)?;
            let id = program.attach(tp).map_err(program_err)?;
            program.take_link(id).map_err(program_err)?.into()
        }
    };
    pin_link(fd_link, pin)
}

fn pin_link(fd_link: FdLink, pin: &Path) -> Result<()> {
    // A stale pin of a half-finished earlier load: the new link replaces it.
    let _ = std::fs::remove_file(pin);
    let pinned = fd_link.pin(pin).map_err(|source: PinError| Error::Pin {
        path: pin.to_owned(),
        source,
    })?;
    // Dropping the handle closes our fd; the pin keeps the link attached.
    drop(pinned);
    Ok(())
}

fn take<T>(ebpf: &mut Ebpf, name: &'static str) -> Result<T>
where
    T: TryFrom<Map, Error = aya::maps::MapError>,
{
    let map = ebpf.take_map(name).ok_or(Error::MissingMap { name })?;
    T::try_from(map).map_err(|source| Error::Map { name, source })
}

fn reuse_maps(build: &Path) -> Result<Maps> {
    fn open<T>(build: &Path, name: &'static str) -> Result<T>
    where
        T: TryFrom<Map, Error = aya::maps::MapError>,
    {
        let err = |source| Error::Map { name, source };
        let data = MapData::from_pin(build.join(name)).map_err(err)?;
        T::try_from(Map::from_map_data(data).map_err(err)?).map_err(err)
    }
    Ok(Maps {
        ctl: open(build, "crab_ctl")?,
        stats: open(build, "crab_stats")?,
        tasks: open(build, "crab_tasks")?,
        noisy: open(build, "crab_noisy")?,
        slots: open(build, "crab_slots")?,
        events: open(build, "crab_events")?,
    })
}

fn remove_other_builds(pin_dir: &Path, keep: &Path) -> Result<()> {
    let entries = std::fs::read_dir(pin_dir).map_err(|source| Error::Io {
        op: "list",
        path: pin_dir.to_owned(),
        source,
    })?;
    for entry in entries.flatten() {
        let path = entry.path();
        if path != keep {
            log::info!(
                "inspector: removing programs of another build, {}",
                path.display()
            );
            unpin_all(&path)?;
        }
    }
    Ok(())
}

/// Whether every pinned link is still there (someone may have removed the
/// pins, detaching the programs).
pub(crate) fn links_present(links: &[PathBuf]) -> bool {
    links.iter().all(|l| l.exists())
}

/// The ring buffer's fd, for poll(2).
pub(crate) fn ring_fd(maps: &Maps) -> std::os::fd::BorrowedFd<'_> {
    maps.events.as_fd()
}
