//! `containerd-shim-crab-v2`: the crab containerd runtime.
//!
//! A containerd shim speaking the task API v2 (`containerd-shim =0.11`) that
//! runs containers with youki's `libcontainer`. containerd and docker use it as
//! a drop-in for `io.containerd.runc.v2` under the runtime name
//! `io.containerd.crab.v2`.
//!
//! Public face: [`run`] (the binary's `main`). The binary has two personalities:
//! the shim proper (started by containerd) and the short-lived *runtime helper*
//! (`containerd-shim-crab-v2 runtime …`), which the shim spawns for every
//! operation that forks: libcontainer waits for its own intermediate processes
//! with `waitpid`, and the shim reaps every child on `SIGCHLD`, so the two must
//! not live in one process (the same split runc's shim has with `runc`).
//!
//! Must never: steal an exit status that belongs to containerd, leave mounts,
//! cgroups or sockets behind after Delete, or log process environments.

mod agent_tools;
mod cgroup;
pub mod config;
mod container;
mod control;
mod error;
mod events;
mod exits;
mod freezer;
mod fsop;
mod grant;
mod held_state;
mod init;
mod io;
mod logging;
mod metrics;
mod netns;
mod oom;
mod pod;
mod process;
mod recovery;
mod rootfs;
mod runtime;
mod sandbox_proxy;
mod service;
mod spec_env;
mod task;
mod turn_hook;
mod uring;

pub use config::Config;
pub use error::Error;

/// Runtime name containerd resolves to this binary (`containerd-shim-crab-v2`).
pub const RUNTIME_NAME: &str = "io.containerd.crab.v2";

/// Runs the binary: the runtime helper when the first argument is `runtime`,
/// the containerd shim otherwise.
pub fn run() {
    logging::init();
    let args: Vec<String> = std::env::args().collect();
    if args.get(1).map(String::as_str) == Some(runtime::SUBCOMMAND) {
        std::process::exit(runtime::helper_main(&args[2..]));
    }
    service::shim_main();
}
