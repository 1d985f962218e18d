//! `containerd-crab-snapshotter`: the crab ZFS snapshotter, served to
//! containerd as a proxy plugin over a unix socket.
//!
//! Settings come from the `[snapshotter]` table of crab.toml
//! (`$CRAB_CONFIG`, default `/etc/crab/crab.toml`); flags override them.

use std::path::PathBuf;
use std::sync::Arc;

use anyhow::Context;
use clap::Parser;
use containerd_snapshots::tonic::transport::Server;
use crab_snapshotter::ZfsSnapshotter;
use serde::Deserialize;

#[derive(Parser)]
#[command(
    name = "containerd-crab-snapshotter",
    about = "ZFS snapshotter for containerd (proxy plugin)"
)]
struct Cli {
    /// Unix socket to serve on.
    #[arg(long)]
    address: Option<PathBuf>,
    /// Root dataset (POOL/PATH) under which snapshots are datasets.
    #[arg(long)]
    dataset: Option<String>,
    /// Directory of the metadata database.
    #[arg(long)]
    state_dir: Option<PathBuf>,
}

#[derive(Deserialize, Default)]
struct File {
    #[serde(default)]
    snapshotter: Section,
}

#[derive(Deserialize, Default)]
#[serde(deny_unknown_fields)]
struct Section {
    address: Option<PathBuf>,
    dataset: Option<String>,
    state_dir: Option<PathBuf>,
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "info".into()),
        )
        .with_writer(std::io::stderr)
        .init();
    let cli = Cli::parse();
    let path =
        std::env::var_os("CRAB_CONFIG").map_or_else(|| PathBuf::from("/etc/crab/crab.toml"), PathBuf::from);
    let file: File = match std::fs::read_to_string(&path) {
        Ok(text) => toml::from_str(&text).with_context(|| format!("invalid config {}", path.display()))?,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => File::default(),
        Err(e) => return Err(e).with_context(|| format!("cannot read config {}", path.display())),
    };
    let address = cli
        .address
        .or(file.snapshotter.address)
        .unwrap_or_else(|| PathBuf::from("/run/crab/snapshotter.sock"));
    let dataset = cli
        .dataset
        .or(file.snapshotter.dataset)
        .context("no dataset: pass --dataset POOL/PATH or set snapshotter.dataset in crab.toml")?;
    let state_dir = cli
        .state_dir
        .or(file.snapshotter.state_dir)
        .unwrap_or_else(|| PathBuf::from("/var/lib/crab/snapshotter"));

    let snapshotter = ZfsSnapshotter::open(&dataset, &state_dir.join("metadata.redb"))
        .with_context(|| format!("cannot serve dataset {dataset}"))?;
    if let Some(dir) = address.parent() {
        std::fs::create_dir_all(dir).with_context(|| format!("create {}", dir.display()))?;
    }
    match std::fs::remove_file(&address) {
        Err(e) if e.kind() != std::io::ErrorKind::NotFound => {
            return Err(e).with_context(|| format!("remove stale socket {}", address.display()))
        }
        _ => {}
    }
    let listener =
        tokio::net::UnixListener::bind(&address).with_context(|| format!("bind {}", address.display()))?;
    tracing::info!(address = %address.display(), dataset, "serving");
    let incoming = tokio_stream::wrappers::UnixListenerStream::new(listener);
    let shutdown = async {
        let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()).ok();
        tokio::select! {
            _ = tokio::signal::ctrl_c() => {}
            _ = async { match term.as_mut() { Some(t) => { t.recv().await; } None => std::future::pending().await } } => {}
        }
    };
    Server::builder()
        .add_service(containerd_snapshots::server(Arc::new(snapshotter)))
        .serve_with_incoming_shutdown(incoming, shutdown)
        .await
        .context("serve")?;
    let _ = std::fs::remove_file(&address);
    Ok(())
}
