//! `crabd`: the host's checkpoint engine (see `crab_engine::daemon`).

use clap::Parser;
use crab_engine::config::CrabdConfig;

/// Crab's host daemon: versions, checkpoints and rollbacks of sandboxes.
#[derive(Parser)]
#[command(name = "crabd", version)]
struct Cli {
    /// The management socket (default: `[crabd] socket` of crab.toml).
    #[arg(long)]
    socket: Option<std::path::PathBuf>,
    /// Where versions are kept (default: `[crabd] root` of crab.toml).
    #[arg(long)]
    root: Option<std::path::PathBuf>,
}

fn main() -> std::process::ExitCode {
    let cli = Cli::parse();
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_env("CRAB_LOG").unwrap_or_else(|_| "info".into()),
        )
        .with_writer(std::io::stderr)
        .init();
    let mut config = match CrabdConfig::load() {
        Ok(c) => c,
        Err(e) => {
            eprintln!("crabd: {e}");
            return std::process::ExitCode::FAILURE;
        }
    };
    if let Some(s) = cli.socket {
        config.socket = s;
    }
    if let Some(r) = cli.root {
        config.root = r;
    }
    let rt = match tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("crabd: start tokio: {e}");
            return std::process::ExitCode::FAILURE;
        }
    };
    match rt.block_on(crab_engine::daemon::serve(config)) {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("crabd: {e}");
            std::process::ExitCode::FAILURE
        }
    }
}
