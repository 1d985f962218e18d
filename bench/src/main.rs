//! `crab-bench`: Crab's numbers, each beside its baseline from the same run.
//!
//! Run as root from a release build: `make bench` (or
//! `cargo build --release --workspace && target/release/crab-bench runtime`).

#![forbid(unsafe_code)]

use clap::{Parser, Subcommand};

mod runtime;
mod stats;

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
}

fn main() -> anyhow::Result<()> {
    match Cli::parse().bench {
        Bench::Runtime { runs } => runtime::run(runs),
    }
}
