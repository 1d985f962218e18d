//! `crab-bench`: Crab's numbers, each beside its baseline from the same run.
//!
//! Run as root from a release build: `make bench` (or
//! `cargo build --release --workspace && target/release/crab-bench runtime`).
//! `crab-bench proxy` needs no root: it runs an upstream and the proxy in process.

#![forbid(unsafe_code)]

use clap::{Parser, Subcommand};

mod checkpoint;
mod cpu;
mod density;
mod eval;
mod fastforward;
mod faults;
mod fs;
mod inspector;
mod observe;
mod proxy;
mod recovery;
mod runtime;
mod stats;
mod turn;

#[derive(Parser)]
#[command(name = "crab-bench", about = "Crab's benchmarks, each beside its baseline")]
struct Cli {
    #[command(subcommand)]
    bench: Bench,
}

#[derive(Subcommand)]
enum Bench {
    /// Container create+start+exit latency and idle shim memory, crab vs runc.v2.
    Runtime {
        /// Containers per runtime.
        #[arg(long, default_value_t = 40)]
        runs: usize,
    },
    /// Filesystem snapshots per backend (zfs-fuse, btrfs, overlay-copy)
    /// against copying the whole tree.
    Fs {
        /// Size of the sandbox tree in MB.
        #[arg(long, default_value_t = 200)]
        mb: usize,
        /// Number of files in it.
        #[arg(long, default_value_t = 2000)]
        files: usize,
        /// Turns for the storage figure (each changes 1% of the files).
        #[arg(long, default_value_t = 50)]
        turns: usize,
    },
    /// Full checkpoint (wall and frozen time) and restore of a sandbox whose
    /// process holds `mb` MB, crab through crabd vs `ctr task checkpoint`
    /// with runc.v2.
    Checkpoint {
        /// Resident memory of the sandbox's process, MB; several
        /// (comma-separated) also print how frozen time grows with it.
        #[arg(long, value_delimiter = ',', default_value = "100")]
        mb: Vec<usize>,
        /// Checkpoints (and restores) per runtime.
        #[arg(long, default_value_t = 10)]
        runs: usize,
    },
    /// Crash to running again (a SIGKILLed init restored from its head
    /// version by crabd) beside a cold start of the same image, for a
    /// sandbox holding nothing and one holding `mb` MB; forks of one
    /// version, 1, 4 and 16 at once (wall time, disk).
    Recovery {
        /// Resident memory of the bigger sandbox's process, MB.
        #[arg(long, default_value_t = 100)]
        mb: usize,
        /// Crashes per size (each in a sandbox of its own).
        #[arg(long, default_value_t = 10)]
        runs: usize,
    },
    /// One turn's checkpoint in a small sandbox, per rootfs (overlayfs,
    /// btrfs): files-only, full, rollback; beside `ctr task checkpoint`
    /// with runc.v2 and the published Python implementation's figures.
    Turn {
        /// Turns per snapshotter.
        #[arg(long, default_value_t = 10)]
        runs: usize,
    },
    /// Many sandboxes replaying real agent runs (../shared/traces), every
    /// turn a version: Crab's queue vs every checkpoint at once vs one
    /// full checkpoint per turn vs none (hold, bytes, frozen time, e2e).
    Density {
        /// Sandboxes per run, comma-separated.
        #[arg(long, value_delimiter = ',', default_value = "8,16,32")]
        sandboxes: Vec<usize>,
        /// Traced turns per sandbox.
        #[arg(long, default_value_t = 12)]
        turns: usize,
        /// Scale of the traced LLM times (1.0: as traced).
        #[arg(long, default_value_t = 0.1)]
        scale: f64,
        /// The traces (mini-swe-agent steps, JSON lines).
        #[arg(long, default_value = concat!(env!("CARGO_MANIFEST_DIR"), "/../../shared/traces/mini-swe-agent.jsonl"))]
        traces: std::path::PathBuf,
    },
    /// The evaluation: real mini-swe-agent runs (../shared/traces) and
    /// terminal tasks replayed against every recovery policy (crab,
    /// full-ckpt, chat-only, chat+fs, restart, beside fault-free), one
    /// crash per task, each recovery state-verified; writes report.md,
    /// report.json and pictures to --out.
    Eval(eval::Args),
    /// Seeded faults (SIGKILL of a sandbox's init, its shim, containerd,
    /// and crabd during a checkpoint, rollback, fork or export): recovered,
    /// lost, leaked per kind.
    Faults {
        /// Faults in all.
        #[arg(long, default_value_t = 200)]
        faults: usize,
        /// The campaign's seed.
        #[arg(long, default_value_t = 0x5eed_fa17)]
        seed: u64,
    },
    /// The inspector: turn-end decision latency (p50/p99) for turns of
    /// ~10k syscalls, and the slowdown of a syscall-heavy workload in a
    /// sandbox with the programs attached vs detached.
    Inspector {
        /// Measured turns per kind.
        #[arg(long, default_value_t = 100)]
        turns: usize,
        /// Workload runs per mode (attached, detached).
        #[arg(long, default_value_t = 20)]
        reps: usize,
    },
    /// An agent put back to its head turn: its requests answered from the
    /// sandbox's transcript (the proxy's replay) beside asking the
    /// upstream again, with the LLM latencies of real runs (scaled).
    Fastforward {
        /// Traced SWE tasks (from bench/eval/swe.toml's default set).
        #[arg(long, default_value_t = 4)]
        tasks: usize,
        /// Turns per task (0: all).
        #[arg(long, default_value_t = 30)]
        turns: usize,
        /// Scale of the traced LLM times (1.0: as traced).
        #[arg(long, default_value_t = 0.05)]
        scale: f64,
        /// The traces (mini-swe-agent steps, JSON lines).
        #[arg(long, default_value = concat!(env!("CARGO_MANIFEST_DIR"), "/../../shared/traces/mini-swe-agent.jsonl"))]
        traces: std::path::PathBuf,
    },
    /// Latency the LLM proxy adds (p50/p99, non-streaming and streaming
    /// time to first byte, 1 and 64 clients) beside calling the upstream directly.
    Proxy {
        /// Requests per configuration (split across the clients).
        #[arg(long, default_value_t = 2000)]
        requests: usize,
        /// Mean pause between two requests of one client (the agent's tool
        /// calls), ms; each pause is drawn from 0.5–1.5 times it.
        #[arg(long, default_value_t = 0)]
        think_ms: u64,
        /// Concurrent clients (one sandbox each), one configuration per count.
        #[arg(long, value_delimiter = ',', default_value = "1,64")]
        clients: Vec<usize>,
    },
}

fn main() -> anyhow::Result<()> {
    match Cli::parse().bench {
        Bench::Runtime { runs } => runtime::run(runs),
        Bench::Fs { mb, files, turns } => fs::run(mb, files, turns),
        Bench::Checkpoint { mb, runs } => checkpoint::run(&mb, runs),
        Bench::Recovery { mb, runs } => recovery::run(mb, runs),
        Bench::Turn { runs } => turn::run(runs),
        Bench::Density {
            sandboxes,
            turns,
            scale,
            traces,
        } => density::run(&sandboxes, turns, scale, &traces),
        Bench::Eval(args) => eval::run(&args.quick_if_asked()),
        Bench::Inspector { turns, reps } => inspector::run(turns, reps),
        Bench::Faults { faults, seed } => faults::run(faults, seed),
        Bench::Fastforward {
            tasks,
            turns,
            scale,
            traces,
        } => fastforward::run(tasks, turns, scale, &traces),
        Bench::Proxy {
            requests,
            think_ms,
            clients,
        } => proxy::run(requests, std::time::Duration::from_millis(think_ms), &clients),
    }
}
