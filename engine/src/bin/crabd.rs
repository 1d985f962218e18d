//! `crabd`: the host's checkpoint engine (see `crab_engine::daemon`).

use clap::Parser;
use crab_api::config::CrabdConfig;

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
    let mut config = match CrabdConfig::load() {
        Ok(c) => c,
        Err(e) => {
            eprintln!("crabd: {}", crab_api::error_chain(&e));
            return std::process::ExitCode::FAILURE;
        }
    };
    if let Some(s) = cli.socket {
        config.socket = s;
    }
    if let Some(r) = cli.root {
        config.root = r;
    }
    init_log(&config.root);
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
            eprintln!("crabd: {}", crab_api::error_chain(&e));
            std::process::ExitCode::FAILURE
        }
    }
}

/// Logs to stderr on a terminal; otherwise (started by a shim, or by
/// systemd with no journal) also to `<root>/crabd.log`, so the reason for,
/// say, an inspector that did not load can be found.
fn init_log(root: &std::path::Path) {
    use std::io::IsTerminal;
    let filter = || tracing_subscriber::EnvFilter::try_from_env("CRAB_LOG").unwrap_or_else(|_| "info".into());
    let file = (!std::io::stderr().is_terminal())
        .then(|| {
            std::fs::create_dir_all(root).ok()?;
            std::fs::OpenOptions::new()
                .create(true)
                .append(true)
                .open(root.join("crabd.log"))
                .ok()
        })
        .flatten();
    match file {
        Some(f) => tracing_subscriber::fmt()
            .with_env_filter(filter())
            .with_ansi(false)
            .with_writer(std::sync::Mutex::new(f))
            .init(),
        None => tracing_subscriber::fmt()
            .with_env_filter(filter())
            .with_writer(std::io::stderr)
            .init(),
    }
}
