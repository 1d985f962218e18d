//! The system-call programs: which hook family follows a sandbox's calls,
//! loading it, and attaching it only while a sandbox is registered.
//!
//! Two families run the same C (`syscall_enter`/`syscall_exit`):
//! - the raw tracepoints `sys_enter`/`sys_exit` (the default, and what the
//!   tests run). An enabled system-call tracepoint sends every call of
//!   every task on the host through the kernel's slow path.
//! - BPF trampolines (fentry/fexit) on the kernel's system-call dispatch
//!   (`x64_sys_call`, Linux 6.9 or newer), on its 32-bit and x32
//!   dispatch where built in (not followed: the turn is `full`, as on the
//!   tracepoint), and on the exit of `syscall_trace_enter` (a call that
//!   seccomp, a tracer or syscall user dispatch skips, which no dispatch
//!   sees). No task leaves the fast path. Loaded only when asked
//!   ([`SyscallHooks::Fentry`]), and only when the kernel loads *and*
//!   attaches every one of them; otherwise the tracepoints are loaded,
//!   and the reason is logged. Kernels under lockdown or a sandbox policy
//!   refuse trampolines (this project's CI host: `EPERM`), so this family
//!   is not run by the tests.
//!
//! A build directory holds the pins of one family; the family pinned
//! there is the one a later owner uses.

use std::path::{Path, PathBuf};

use aya::programs::{links::FdLink, FEntry, FExit, ProgramError, RawTracePoint};
use aya::{Btf, BtfError, Ebpf};

use super::pin_link;
use crate::error::{Error, Result};
pub use crab_api::config::SyscallHooks;

/// Where one system-call program attaches.
#[derive(Clone, Copy)]
enum Hook {
    /// A raw tracepoint.
    Raw(&'static str),
    /// The entry of a kernel function.
    Entry(&'static str),
    /// The return of a kernel function.
    Exit(&'static str),
}

/// One system-call program: its name in the object, its hook, and whether
/// the kernel may lack the function (an ABI not built in).
struct Program {
    name: &'static str,
    hook: Hook,
    optional: bool,
}

const TRACEPOINT: [Program; 2] = [
    Program {
        name: "crab_sys_enter",
        hook: Hook::Raw("sys_enter"),
        optional: false,
    },
    Program {
        name: "crab_sys_exit",
        hook: Hook::Raw("sys_exit"),
        optional: false,
    },
];

/// In pinning order: `crab_fentry_enter` is pinned last, so its pin says
/// that the whole family is.
const FENTRY: [Program; 5] = [
    Program {
        name: "crab_fexit_skip",
        hook: Hook::Exit("syscall_trace_enter"),
        optional: false,
    },
    Program {
        name: "crab_fentry_ia32",
        hook: Hook::Entry("ia32_sys_call"),
        optional: true,
    },
    Program {
        name: "crab_fentry_x32",
        hook: Hook::Entry("x32_sys_call"),
        optional: true,
    },
    Program {
        name: "crab_fexit_exit",
        hook: Hook::Exit("x64_sys_call"),
        optional: false,
    },
    Program {
        name: "crab_fentry_enter",
        hook: Hook::Entry("x64_sys_call"),
        optional: false,
    },
];

/// The system-call programs of one build, pinned, and attached on demand.
pub(crate) struct Syscalls {
    build: PathBuf,
    hooks: SyscallHooks,
    /// The programs pinned (an optional one the kernel lacks is not).
    programs: Vec<&'static Program>,
}

impl Syscalls {
    /// The family pinned in `build`, if a whole one is.
    pub(crate) fn pinned(build: &Path) -> Option<Syscalls> {
        let pin = |p: &Program| build.join(format!("prog_{}", p.name));
        let (hooks, family): (_, &'static [Program]) = if pin(&FENTRY[4]).exists() {
            (SyscallHooks::Fentry, &FENTRY)
        } else {
            (SyscallHooks::Tracepoint, &TRACEPOINT)
        };
        let programs: Vec<&'static Program> = family.iter().filter(|p| pin(p).exists()).collect();
        family
            .iter()
            .all(|p| p.optional || pin(p).exists())
            .then(|| Syscalls {
                build: build.to_owned(),
                hooks,
                programs,
            })
    }

    /// Loads and pins the family `want` asks for, or the tracepoints when
    /// the kernel refuses it (logged).
    pub(crate) fn load(ebpf: &mut Ebpf, build: &Path, want: SyscallHooks) -> Result<Syscalls> {
        // Stale pins of an earlier, half-finished load: neither family may
        // be taken for whole by a later owner.
        remove_pins(build, FENTRY.iter().chain(&TRACEPOINT));
        if want == SyscallHooks::Fentry {
            match load_fentry(ebpf, build) {
                Ok(programs) => {
                    return Ok(Syscalls {
                        build: build.to_owned(),
                        hooks: SyscallHooks::Fentry,
                        programs,
                    })
                }
                Err(e) => {
                    remove_pins(build, FENTRY.iter());
                    log::warn!(
                        "inspector: fentry system-call hooks refused here, using the tracepoints: {}",
                        crab_api::error_chain(&e)
                    );
                }
            }
        }
        for p in &TRACEPOINT {
            let name = p.name;
            let program: &mut RawTracePoint = program_mut(ebpf, name)?;
            program.load().map_err(|source| Error::Program { name, source })?;
            pin_program(program.pin(prog_pin(build, p)), build, p)?;
        }
        Ok(Syscalls {
            build: build.to_owned(),
            hooks: SyscallHooks::Tracepoint,
            programs: TRACEPOINT.iter().collect(),
        })
    }

    /// The family in use.
    pub(crate) fn hooks(&self) -> SyscallHooks {
        self.hooks
    }

    fn links(&self) -> impl Iterator<Item = PathBuf> + '_ {
        self.programs
            .iter()
            .map(|p| self.build.join(format!("link_{}", p.name)))
    }

    /// Whether every program is attached (its link pinned).
    pub(crate) fn attached(&self) -> bool {
        self.links().all(|l| l.exists())
    }

    /// Attaches what is not attached, from the pinned programs; the links
    /// are pinned, so they stay attached if the owner exits.
    pub(crate) fn attach(&self) -> Result<()> {
        for (p, link) in self.programs.iter().zip(self.links()) {
            if link.exists() {
                continue;
            }
            let name = p.name;
            let program_err = |source| Error::Program { name, source };
            let prog = prog_pin(&self.build, p);
            let fd_link: FdLink = match p.hook {
                Hook::Raw(tp) => {
                    let mut program = RawTracePoint::from_pin(&prog).map_err(program_err)?;
                    let id = program.attach(tp).map_err(program_err)?;
                    program.take_link(id).map_err(program_err)?.into()
                }
                Hook::Entry(_) => {
                    let mut program = FEntry::from_pin(&prog).map_err(program_err)?;
                    let id = program.attach().map_err(program_err)?;
                    program.take_link(id).map_err(program_err)?.into()
                }
                Hook::Exit(_) => {
                    let mut program = FExit::from_pin(&prog).map_err(program_err)?;
                    let id = program.attach().map_err(program_err)?;
                    program.take_link(id).map_err(program_err)?.into()
                }
            };
            pin_link(fd_link, &link)?;
            log::info!("inspector: {name} attached");
        }
        Ok(())
    }

    /// Detaches every program (removes their links' pins; the kernel
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

/// Loads the fentry family, attaches each program once and detaches it
/// again (the kernel may load a program on a function it cannot patch),
/// and pins them in order. Errors leave pins for the caller to remove.
fn load_fentry(ebpf: &mut Ebpf, build: &Path) -> Result<Vec<&'static Program>> {
    let btf = Btf::from_sys_fs().map_err(|source| Error::Program {
        name: "crab_fentry_enter",
        source: ProgramError::Btf(source),
    })?;
    let mut pinned = Vec::new();
    for p in &FENTRY {
        let name = p.name;
        let program_err = |source| Error::Program { name, source };
        let absent = |e: &ProgramError| matches!(e, ProgramError::Btf(BtfError::UnknownBtfTypeName { .. }));
        match p.hook {
            Hook::Entry(function) => {
                let program: &mut FEntry = program_mut(ebpf, name)?;
                match program.load(function, &btf) {
                    Err(e) if p.optional && absent(&e) => continue,
                    other => other.map_err(program_err)?,
                }
                let id = program.attach().map_err(program_err)?;
                program.detach(id).map_err(program_err)?;
                pin_program(program.pin(prog_pin(build, p)), build, p)?;
            }
            Hook::Exit(function) => {
                let program: &mut FExit = program_mut(ebpf, name)?;
                match program.load(function, &btf) {
                    Err(e) if p.optional && absent(&e) => continue,
                    other => other.map_err(program_err)?,
                }
                let id = program.attach().map_err(program_err)?;
                program.detach(id).map_err(program_err)?;
                pin_program(program.pin(prog_pin(build, p)), build, p)?;
            }
            Hook::Raw(_) => unreachable!("the fentry family has no tracepoint"),
        }
        pinned.push(p);
    }
    Ok(pinned)
}

fn program_mut<'a, T>(ebpf: &'a mut Ebpf, name: &'static str) -> Result<&'a mut T>
where
    &'a mut T: TryFrom<&'a mut aya::programs::Program>,
{
    let program = ebpf.program_mut(name).ok_or(Error::MissingProgram { name })?;
    program.try_into().map_err(|_| Error::MissingProgram { name })
}

fn prog_pin(build: &Path, p: &Program) -> PathBuf {
    build.join(format!("prog_{}", p.name))
}

fn pin_program(pinned: std::result::Result<(), aya::pin::PinError>, build: &Path, p: &Program) -> Result<()> {
    pinned.map_err(|source| Error::Pin {
        path: prog_pin(build, p),
        source,
    })
}

fn remove_pins<'a>(build: &Path, programs: impl Iterator<Item = &'a Program>) {
    for p in programs {
        let _ = std::fs::remove_file(prog_pin(build, p));
        let _ = std::fs::remove_file(build.join(format!("link_{}", p.name)));
    }
}
