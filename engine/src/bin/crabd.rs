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
    raise_open_file_limit();
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
            use std::os::unix::fs::{DirBuilderExt, OpenOptionsExt};
            // The store's root is 0700 (the store checks it again).
            std::fs::DirBuilder::new()
                .recursive(true)
                .mode(0o700)
                .create(root)
                .ok()?;
            std::fs::OpenOptions::new()
                .create(true)
                .append(true)
                .mode(0o600)
                .custom_flags(nix::libc::O_NOFOLLOW)
                .open(root.join("crabd.log"))
                .and_then(|f| {
                    // One an older crabd made may be 0644.
                    use std::os::unix::fs::PermissionsExt;
                    f.set_permissions(std::fs::Permissions::from_mode(0o600))?;
                    Ok(f)
                })
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

/// Raises the soft limit on open files to the hard one: the host relay
/// holds up to 1024 agents' connections and a kept connection per sandbox
/// socket, past the 1024 a service or a shim's child starts with.
fn raise_open_file_limit() {
    use nix::sys::resource::{getrlimit, setrlimit, Resource};
    match getrlimit(Resource::RLIMIT_NOFILE) {
        Ok((soft, hard)) if soft < hard => {
            if let Err(error) = setrlimit(Resource::RLIMIT_NOFILE, hard, hard) {
                tracing::warn!(%error, soft, hard, "cannot raise the open file limit");
            }
        }
        Ok(_) => {}
        Err(error) => tracing::warn!(%error, "cannot read the open file limit"),
    }
}
