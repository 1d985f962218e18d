//! `crabctl`: the user's command for Crab sandboxes. It talks to crabd's
//! management API through `crab_api::Crabd`, over crabd's unix socket.

use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

use clap::{Parser, Subcommand};
use crab_api::crabd::{
    DrainRequest, Event, EventKind, ForkRequest, ForksRequest, ImportQuery, ResumeRequest, RollbackRequest,
    TurnReport, VersionView, WatchStarted, MAX_DRAIN_GRACE_SECS, MAX_EVENTS_TAIL, MAX_FORKS,
};
use crab_api::{Class, Crabd, SandboxId, SandboxSelector, VersionRecord, VersionSel};
use serde::Serialize;

mod checkpointctl;
mod doctor;
mod progress;
mod register;
mod registry;
mod table;
mod transfer;
mod tree;

/// Checkpoint, roll back and inspect Crab sandboxes.
#[derive(Parser)]
#[command(name = "crabctl", version)]
struct Cli {
    /// crabd's socket.
    #[arg(
        long,
        global = true,
        env = "CRAB_SOCKET",
        default_value = "/run/crab/crabd.sock"
    )]
    socket: PathBuf,
    /// Print JSON instead of tables.
    #[arg(long, global = true)]
    json: bool,
    /// Seconds to wait for crabd.
    #[arg(long, global = true, default_value_t = 300)]
    timeout: u64,
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// List the sandboxes crabd knows: running, and stopped ones whose
    /// container still exists (they keep their versions).
    Ps,
    /// Save a sandbox now: files and processes (default), or files only.
    Checkpoint {
        /// Container id, or a unique prefix of one.
        sandbox: SandboxSelector,
        /// Files only.
        #[arg(long, conflicts_with = "full")]
        fs: bool,
        /// Files and processes (the default).
        #[arg(long)]
        full: bool,
    },
    /// List a sandbox's versions, each under its parent (the version it
    /// descends from: a rollback starts a branch).
    Versions {
        /// Container id, or a unique prefix of one.
        sandbox: SandboxSelector,
    },
    /// Put a sandbox back to a version: its processes, memory and files.
    Rollback {
        /// Container id, or a unique prefix of one.
        sandbox: SandboxSelector,
        /// A version number from `crabctl versions`, or `latest`.
        version: VersionSel,
        /// Skip the undo checkpoint: faster, but a failed restore then
        /// loses the sandbox's processes instead of putting it back.
        #[arg(long)]
        no_undo: bool,
        /// Put back the version's files only, in place: the processes go
        /// on as they are (frozen meanwhile), and a new whole version
        /// records the result.
        #[arg(long, conflicts_with = "no_undo")]
        files_only: bool,
    },
    /// Start a sandbox whose task died with its host (or its shim) again,
    /// in its own container, from a version: its files, its processes
    /// and its conversation as they were then.
    Resume {
        /// Container id, or a unique prefix of one.
        sandbox: SandboxSelector,
        /// A version number, or `latest` (default: the sandbox's head).
        version: Option<VersionSel>,
    },
    /// End a sandbox's current turn by hand: make its version and print
    /// what it changed (`none`, `fs`, `proc` or `full`, and why).
    Turn {
        /// Container id, or a unique prefix of one.
        sandbox: SandboxSelector,
    },
    /// Print each turn report of a sandbox as its turns end (until Ctrl-C).
    Watch {
        /// Container id, or a unique prefix of one.
        sandbox: SandboxSelector,
    },
    /// Print what happened to a sandbox: turns (class, version), versions
    /// (size, frozen time), held answers, rollbacks, recoveries, failures.
    Logs {
        /// Container id, or a unique prefix of one.
        sandbox: SandboxSelector,
        /// How many of the newest events.
        #[arg(short = 'n', long, default_value_t = 100, value_parser = clap::value_parser!(u64).range(0..=MAX_EVENTS_TAIL as u64))]
        tail: u64,
        /// Then print events as they happen (until Ctrl-C).
        #[arg(short, long)]
        follow: bool,
    },
    /// Print the URL of crabd's page: a live timeline of every sandbox's
    /// turns, versions, holds, rollbacks and recoveries (keep it to
    /// yourself: it lets its holder watch every sandbox).
    Ui,
    /// Print crabd's metrics (Prometheus text format): turns by class,
    /// versions, bytes written, the checkpoint queue, latencies.
    Metrics,
    /// Start a new sandbox from a version; both then run independently.
    Fork {
        /// Container id, or a unique prefix of one.
        sandbox: SandboxSelector,
        /// A version number from `crabctl versions`, or `latest`.
        version: VersionSel,
        /// The new sandbox's container id; with `--count`, the prefix of
        /// theirs (`<name>-1` …).
        #[arg(long)]
        name: Option<SandboxId>,
        /// Make this many sandboxes from the version at once (1 to 64),
        /// each made or failed on its own.
        #[arg(long, value_parser = clap::value_parser!(u32).range(1..=i64::from(MAX_FORKS)))]
        count: Option<u32>,
    },
    /// The host is going away: make every running sandbox durable within
    /// the grace (the cheapest first) and export each to a directory, to
    /// import elsewhere. Exits 1 if any was missed.
    Drain {
        /// Seconds until the host goes (1 to 3600).
        #[arg(long, value_parser = clap::value_parser!(u64).range(1..=MAX_DRAIN_GRACE_SECS))]
        grace: u64,
        /// Where each sandbox's archive goes (`<id>.crab`); made 0700.
        #[arg(long)]
        export: Option<PathBuf>,
    },
    /// Write a version as one archive, to start it on another host.
    Export {
        /// Container id, or a unique prefix of one.
        sandbox: SandboxSelector,
        /// A version number from `crabctl versions`, or `latest`.
        version: VersionSel,
        /// The archive to write.
        file: PathBuf,
        /// `crab`: for `crabctl import` on another host (signed, with the
        /// files); `checkpointctl`: the container checkpoint layout that
        /// Kubernetes tooling reads (`checkpointctl show FILE`), for
        /// inspection.
        #[arg(long, value_enum, default_value = "crab")]
        format: ExportFormat,
    },
    /// Start a sandbox from an archive that `crabctl export` wrote.
    Import {
        /// The archive.
        file: PathBuf,
        #[command(flatten)]
        options: ImportOptions,
    },
    /// Push a version to an image registry as an OCI artifact, sending only
    /// what the repository lacks (a loopback registry over HTTP, any other
    /// over HTTPS; credentials as `docker login` keeps them).
    Push {
        /// Container id, or a unique prefix of one.
        sandbox: SandboxSelector,
        /// A version number from `crabctl versions`, or `latest`.
        version: VersionSel,
        /// Where: `HOST[:PORT]/REPO[:TAG]` (e.g. 127.0.0.1:5000/agents/web:v3).
        reference: String,
        /// A docker `config.json` with the registry's credentials
        /// (default: `$DOCKER_CONFIG/config.json`, else `~/.docker/config.json`).
        #[arg(long)]
        authfile: Option<PathBuf>,
    },
    /// Start a sandbox from a version that `crabctl push` put in a registry
    /// (`HOST[:PORT]/REPO[:TAG]` or `…@sha256:…`); checked as an import.
    Pull {
        /// What to pull.
        reference: String,
        /// A docker `config.json` with the registry's credentials (as push).
        #[arg(long)]
        authfile: Option<PathBuf>,
        #[command(flatten)]
        options: ImportOptions,
    },
    /// Print the key this host signs its exports with, and the keys whose
    /// exports it imports (a file per key in the directory it names).
    Keys,
    /// Say whether this host can run Crab and what it falls back to: one
    /// line per check, ok, warn or fail, with the fix. Exits 1 on a fail.
    Doctor,
    /// Print a completion script for a shell, e.g.
    /// `crabctl completions bash > /etc/bash_completion.d/crabctl`.
    Completions {
        /// The shell.
        shell: clap_complete::Shell,
    },
    /// Print the base URL of a sandbox's LLM proxy on crabd's host listener,
    /// for agents that run outside the sandbox (OpenAI SDKs add `/v1`).
    ProxyUrl {
        /// Container id, or a unique prefix of one.
        sandbox: SandboxSelector,
    },
    /// Add Crab's runtime to docker's daemon.json ("crab") or to
    /// containerd's CRI runtimes (handler "crab"); `--remove` takes out only
    /// what this command added. The engine must be reloaded after it.
    Register {
        /// The engine whose configuration to change.
        engine: register::Engine,
        /// Its configuration file (default: /etc/docker/daemon.json or
        /// /etc/containerd/config.toml).
        #[arg(long)]
        config: Option<PathBuf>,
        /// Take Crab's runtime out instead.
        #[arg(long)]
        remove: bool,
    },
    /// Remove a version (and what only it used).
    RmVersion {
        /// Container id, or a unique prefix of one.
        sandbox: SandboxSelector,
        /// A version number from `crabctl versions`.
        version: u64,
    },
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let rt = match tokio::runtime::Builder::new_current_thread().enable_all().build() {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("crabctl: {e}");
            return ExitCode::FAILURE;
        }
    };
    match rt.block_on(run(&cli)) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("crabctl: {}", crab_api::error_chain(&e));
            ExitCode::FAILURE
        }
    }
}

/// How `crabctl import` and `pull` make the new sandbox.
#[derive(Debug, clap::Args)]
struct ImportOptions {
    /// The new sandbox's container id (default: the exported one's).
    #[arg(long)]
    name: Option<SandboxId>,
    /// containerd namespace (default: crabd's `[crabd] namespace`).
    #[arg(long)]
    namespace: Option<String>,
    /// containerd's socket (default: crabd's `[crabd] containerd`).
    #[arg(long)]
    containerd: Option<PathBuf>,
    /// Keep the archive's device nodes, setuid/setgid files and
    /// security/trusted xattrs (refused by default: a sandbox's root
    /// made them, and they would sit in this host's store).
    #[arg(long)]
    allow_privileged_files: bool,
    /// Import it although no key this host trusts signed it (see
    /// `crabctl keys`): its process images are restored as root with
    /// the credentials and mounts they record.
    #[arg(long)]
    insecure_unsigned: bool,
}

impl ImportOptions {
    fn query(&self) -> ImportQuery {
        ImportQuery {
            name: self.name.clone(),
            namespace: self.namespace.clone(),
            containerd: self.containerd.clone(),
            allow_privileged_files: self.allow_privileged_files,
            insecure_unsigned: self.insecure_unsigned,
        }
    }
}

/// The layout `crabctl export` writes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
enum ExportFormat {
    /// Crab's own archive.
    Crab,
    /// The container checkpoint archive layout (config.dump, spec.dump,
    /// checkpoint/).
    Checkpointctl,
}

/// Why a command failed.
#[derive(Debug, thiserror::Error)]
enum RunError {
    /// crabd refused or could not be reached.
    #[error(transparent)]
    Crabd(#[from] crab_api::ClientError),
    /// The sandbox has no URL on the host listener.
    #[error("sandbox {sandbox} has no proxy URL: {}", if *has_proxy {
        "crabd's host listener is off ([crabd] proxy_port = 0) or could not bind its port (see crabd's log)"
    } else {
        "it has no LLM proxy (it shares the host's network, or [shim.proxy] enabled = false)"
    })]
    NoProxyUrl {
        /// The sandbox.
        sandbox: SandboxId,
        /// Whether its shim serves a proxy at all.
        has_proxy: bool,
    },
    /// A runtime registration left the configuration as it was.
    #[error(transparent)]
    Register(#[from] register::RegisterError),
    /// Not a registry reference.
    #[error(transparent)]
    Reference(#[from] registry::InvalidReference),
    /// A push or a pull failed.
    #[error(transparent)]
    Transfer(#[from] transfer::TransferError),
    /// Interrupted (SIGINT, SIGTERM): crabctl's temporary copy is removed;
    /// an import crabd had begun may still finish.
    #[error(
        "interrupted: crabctl's temporary copy of the version is removed; an import crabd had \
         begun may still finish (see crabctl ps), and blobs already pushed stay in the registry"
    )]
    Interrupted,
    /// A local step failed.
    #[error("cannot {what}")]
    Local {
        /// The step.
        what: &'static str,
        /// Why.
        #[source]
        source: std::io::Error,
    },
}

/// What `proxy-url` prints.
#[derive(Serialize)]
struct ProxyUrl {
    sandbox: SandboxId,
    url: String,
}

async fn run(cli: &Cli) -> Result<(), RunError> {
    let crabd = Crabd::new(&cli.socket, Duration::from_secs(cli.timeout));
    match &cli.command {
        Command::Ps => {
            let list = crabd.list().await?;
            print(cli.json, &list, || {
                let rows = list.iter().map(|s| {
                    vec![
                        s.registration.id.to_string(),
                        s.registration.namespace.clone(),
                        s.registration.pod.clone().unwrap_or_else(|| "-".to_owned()),
                        if s.running { "running" } else { "stopped" }.to_owned(),
                        if s.running {
                            s.registration.pid.to_string()
                        } else {
                            "-".to_owned()
                        },
                        s.versions.to_string(),
                        s.latest.map_or("-".to_owned(), |v| v.to_string()),
                        recovered(s),
                    ]
                });
                table::render(
                    &[
                        "SANDBOX",
                        "NAMESPACE",
                        "POD",
                        "STATE",
                        "PID",
                        "VERSIONS",
                        "LATEST",
                        "RECOVERED",
                    ],
                    rows,
                )
            });
        }
        Command::Checkpoint { sandbox, fs, .. } => {
            let class = if *fs { Class::Fs } else { Class::Full };
            let r = crabd.checkpoint(sandbox, class).await?;
            print(cli.json, &r, || {
                format!(
                    "version {} ({}) of {}: frozen {:.1} ms, total {:.1} ms\n",
                    r.version.version,
                    r.version.class,
                    r.version.sandbox.as_str(),
                    r.frozen_ms,
                    r.total_ms
                )
            });
        }
        Command::Versions { sandbox } => {
            let list = crabd.versions(sandbox).await?;
            print(cli.json, &list, || versions_table(&list));
        }
        Command::ProxyUrl { sandbox } => {
            let info = crabd.show(sandbox).await?;
            let Some(url) = info.proxy_url.clone() else {
                return Err(RunError::NoProxyUrl {
                    sandbox: info.registration.id,
                    has_proxy: info.registration.proxy.is_some(),
                });
            };
            let out = ProxyUrl {
                sandbox: info.registration.id,
                url,
            };
            print(cli.json, &out, || format!("{}\n", out.url));
        }
        Command::Rollback {
            sandbox,
            version,
            no_undo,
            files_only,
        } => {
            let req = RollbackRequest {
                version: *version,
                undo: !no_undo,
                files_only: *files_only,
            };
            let r = crabd.rollback(sandbox, &req).await?;
            print(cli.json, &r, || {
                match r.files_from {
                Some(from) => format!(
                    "files of version {from} put back, recorded as version {}: frozen {:.1} ms, total {:.1} ms\n",
                    r.version, r.restore_ms, r.total_ms
                ),
                None => format!(
                    "rolled back to version {}: pid {}, restore {:.1} ms, total {:.1} ms\n",
                    r.version, r.pid, r.restore_ms, r.total_ms
                ),
            }
            });
        }
        Command::Resume { sandbox, version } => {
            let r = crabd
                .resume(sandbox, &ResumeRequest { version: *version })
                .await?;
            print(cli.json, &r, || {
                format!(
                    "{}{sandbox} runs again from version {}: pid {}, {:.1} ms\n",
                    passed_over(&r.passed_over),
                    r.version,
                    r.pid,
                    r.total_ms
                )
            });
        }
        Command::Turn { sandbox } => {
            let r = crabd.turn(sandbox).await?;
            print(cli.json, &r, || turn_line(&r));
        }
        Command::Metrics => print!("{}", crabd.metrics().await?),
        Command::Logs {
            sandbox,
            tail,
            follow,
        } => {
            let json = cli.json;
            crabd
                .events(sandbox, *tail as usize, *follow, |event| {
                    match event {
                        Ok(e) if !json => println!("{}", event_line(&e)),
                        Ok(e) => println!("{}", serde_json::to_string(&e).expect("an event serializes")),
                        Err(line) => println!("{line}"),
                    }
                    true
                })
                .await?;
        }
        Command::Ui => {
            let ui = crabd.ui().await?;
            print(cli.json, &ui, || match &ui.url {
                Some(url) => format!("{url}\n"),
                None => {
                    "crabd's page is off: set [crabd] ui_port (see crabd's log if it is set)\n".to_owned()
                }
            });
            if ui.url.is_none() {
                std::process::exit(1);
            }
        }
        Command::Watch { sandbox } => {
            let json = cli.json;
            crabd
                .watch(sandbox, |line, report| {
                    match report {
                        Some(r) if !json => print!("{}", turn_line(&r)),
                        None if !json && serde_json::from_str::<WatchStarted>(line).is_ok() => {
                            eprintln!("watching {sandbox}: each turn is printed as it ends (Ctrl-C stops)")
                        }
                        _ => println!("{line}"),
                    }
                    true
                })
                .await?;
        }
        Command::Fork {
            sandbox,
            version,
            name,
            count: Some(count),
        } => {
            let req = ForksRequest {
                version: *version,
                count: *count,
                prefix: name.clone(),
            };
            let r = crabd.forks(sandbox, &req).await?;
            print(cli.json, &r, || {
                let rows = r.forks.iter().map(|f| {
                    vec![
                        f.id.to_string(),
                        f.pid.map_or("-".to_owned(), |p| p.to_string()),
                        table::size(f.bytes),
                        format!("{:.0}", f.total_ms),
                        f.error.clone().unwrap_or_default(),
                    ]
                });
                let made = r.forks.iter().filter(|f| f.error.is_none()).count();
                format!(
                    "{}{made} of {} forks of version {} in {:.0} ms\n",
                    table::render(&["SANDBOX", "PID", "FILES", "MS", "ERROR"], rows),
                    r.forks.len(),
                    r.version,
                    r.total_ms
                )
            });
            if r.forks.iter().any(|f| f.error.is_some()) {
                std::process::exit(1);
            }
        }
        Command::Fork {
            sandbox,
            version,
            name,
            count: None,
        } => {
            let req = ForkRequest {
                version: *version,
                name: name.clone(),
            };
            let r = crabd.fork(sandbox, &req).await?;
            print(cli.json, &r, || {
                format!(
                    "{} runs from version {}: pid {}, {:.1} ms\n",
                    r.id, r.version, r.pid, r.total_ms
                )
            });
        }
        Command::Drain { grace, export } => {
            let dir = match export {
                // crabd writes there: an absolute path, whatever the caller's cwd.
                Some(dir) => Some(std::path::absolute(dir).map_err(|source| RunError::Local {
                    what: "resolve the export directory",
                    source,
                })?),
                None => None,
            };
            let req = DrainRequest {
                grace_secs: *grace,
                export_dir: dir,
            };
            // The drain answers within its grace: wait that long at least.
            let wait = Duration::from_secs(cli.timeout.max(grace + 60));
            let r = Crabd::new(&cli.socket, wait).drain(&req).await?;
            print(cli.json, &r, || {
                let ms = |v: Option<f64>| v.map_or("-".to_owned(), |v| format!("{v:.0}"));
                let rows = r.sandboxes.iter().map(|s| {
                    vec![
                        s.id.to_string(),
                        if s.made { "made" } else { "MISSED" }.to_owned(),
                        s.version.map_or("-".to_owned(), |v| v.to_string()),
                        ms(s.durable_ms),
                        ms(s.exported_ms),
                        match (&s.archive, &s.error) {
                            (_, Some(e)) => e.clone(),
                            (Some(a), None) => a.display().to_string(),
                            (None, None) => String::new(),
                        },
                    ]
                });
                let made = r.sandboxes.iter().filter(|s| s.made).count();
                format!(
                    "{}{made} of {} sandboxes durable within {} s ({:.0} ms)\n",
                    table::render(
                        &["SANDBOX", "", "VERSION", "DURABLE MS", "EXPORTED MS", "ARCHIVE"],
                        rows
                    ),
                    r.sandboxes.len(),
                    r.grace_secs,
                    r.total_ms
                )
            });
            if r.sandboxes.iter().any(|s| !s.made) {
                std::process::exit(1);
            }
        }
        Command::Completions { shell } => {
            use clap::CommandFactory;
            use std::io::Write;
            let mut script = Vec::new();
            clap_complete::generate(*shell, &mut Cli::command(), "crabctl", &mut script);
            match std::io::stdout().write_all(&script) {
                // `crabctl completions bash | head`: the reader had enough.
                Err(e) if e.kind() != std::io::ErrorKind::BrokenPipe => {
                    return Err(RunError::Local {
                        what: "write the completion script",
                        source: e,
                    })
                }
                _ => {}
            }
        }
        Command::Register {
            engine,
            config,
            remove,
        } => {
            let path = config.as_deref().unwrap_or(engine.default_config());
            let outcome = register::register(*engine, path, *remove)?;
            let report = serde_json::json!({ "engine": engine, "config": path, "outcome": outcome });
            print(cli.json, &report, || {
                let what = match outcome {
                    register::Outcome::Added => format!(
                        "added Crab's runtime \"crab\" to {}; {}",
                        path.display(),
                        engine.next_step()
                    ),
                    register::Outcome::AlreadyThere => {
                        format!("{} already has Crab's runtime \"crab\"", path.display())
                    }
                    register::Outcome::Removed => format!(
                        "took Crab's runtime \"crab\" out of {}; {}",
                        path.display(),
                        engine.next_step()
                    ),
                    register::Outcome::NotThere => {
                        format!("{} has no runtime \"crab\" of Crab's", path.display())
                    }
                };
                what + "\n"
            });
        }
        Command::Doctor => {
            let checks = doctor::run(&crabd).await;
            print(cli.json, &checks, || {
                let rows = checks.iter().map(|c| {
                    let status = match c.status {
                        doctor::Status::Ok => "ok",
                        doctor::Status::Warn => "warn",
                        doctor::Status::Fail => "FAIL",
                    };
                    let detail = match &c.fix {
                        Some(fix) => format!("{} -> {fix}", c.detail),
                        None => c.detail.clone(),
                    };
                    vec![status.to_owned(), c.name.to_owned(), detail]
                });
                table::render(&["", "CHECK", "FOUND"], rows)
            });
            if checks.iter().any(|c| c.status == doctor::Status::Fail) {
                std::process::exit(1);
            }
        }
        Command::Keys => {
            let keys = crabd.keys().await?;
            print(cli.json, &keys, || {
                let mut text = format!(
                    "this host signs its exports with:\n  {}\nit imports those signed by (one file per key in {}):\n",
                    keys.export_key,
                    keys.trusted_dir.display()
                );
                for key in &keys.trusted {
                    let own = if *key == keys.export_key {
                        "  (this host)"
                    } else {
                        ""
                    };
                    text.push_str(&format!("  {key}{own}\n"));
                }
                text
            });
        }
        Command::Export {
            sandbox,
            version,
            file,
            format: ExportFormat::Checkpointctl,
        } => {
            let bar = progress::bar(cli.json, "export");
            let n = interruptible(checkpointctl::export(
                &crabd,
                sandbox,
                *version,
                file,
                &|n, total| progress::tick(&bar, n, total),
            ))
            .await?;
            bar.finish_and_clear();
            let report = serde_json::json!({ "file": file, "bytes": n });
            print(cli.json, &report, || {
                format!("wrote {} ({n} bytes, checkpoint layout)\n", file.display())
            });
        }
        Command::Export {
            sandbox,
            version,
            file,
            format: ExportFormat::Crab,
        } => {
            let bar = progress::bar(cli.json, "export");
            let n = crabd
                .export(sandbox, *version, file, &|n, total| {
                    progress::tick(&bar, n, total)
                })
                .await?;
            bar.finish_and_clear();
            let report = serde_json::json!({ "file": file, "bytes": n });
            print(cli.json, &report, || {
                format!("wrote {} ({n} bytes)\n", file.display())
            });
        }
        Command::Import { file, options } => {
            let query = options.query();
            let bar = progress::bar(cli.json, "import");
            let r = crabd
                .import(file, &query, &|n, total| progress::tick(&bar, n, total))
                .await?;
            bar.finish_and_clear();
            print(cli.json, &r, || {
                format!(
                    "{} runs from {}: pid {}, {:.1} ms\n",
                    r.id,
                    file.display(),
                    r.pid,
                    r.total_ms
                )
            });
        }
        Command::Push {
            sandbox,
            version,
            reference,
            authfile,
        } => {
            let reference = registry::Reference::parse(reference)?;
            let bar = progress::bar(cli.json, "export");
            let r = interruptible(registry::push(
                &crabd,
                sandbox,
                *version,
                &reference,
                authfile.as_deref(),
                &|phase, n, total| progress::phase(&bar, phase, n, total),
            ))
            .await?;
            bar.finish_and_clear();
            print(cli.json, &r, || {
                format!(
                    "pushed {}@{}: {} members, {} bytes; sent {} ({} bytes), the rest was there\n",
                    r.reference, r.digest, r.members, r.bytes, r.sent, r.sent_bytes
                )
            });
        }
        Command::Pull {
            reference,
            authfile,
            options,
        } => {
            let reference = registry::Reference::parse(reference)?;
            let query = options.query();
            let bar = progress::bar(cli.json, "pull");
            let r = interruptible(registry::pull(
                &crabd,
                &reference,
                authfile.as_deref(),
                &query,
                &|phase, n, total| progress::phase(&bar, phase, n, total),
            ))
            .await?;
            bar.finish_and_clear();
            print(cli.json, &r, || {
                format!(
                    "{} runs from {}@{}: pid {}, {} bytes\n",
                    r.sandbox.id, r.reference, r.digest, r.sandbox.pid, r.bytes
                )
            });
        }
        Command::RmVersion { sandbox, version } => {
            let r = crabd.remove_version(sandbox, *version).await?;
            print(cli.json, &r, || {
                let list: Vec<String> = r.removed.iter().map(u64::to_string).collect();
                format!("removed versions: {}\n", list.join(" "))
            });
        }
    }
    Ok(())
}

/// Runs `work` unless SIGINT or SIGTERM comes first: then `work` is
/// dropped, and with it its private directory (the version's archive and
/// memory images), before crabctl exits.
async fn interruptible<T>(
    work: impl std::future::Future<Output = Result<T, transfer::TransferError>>,
) -> Result<T, RunError> {
    use tokio::signal::unix::{signal, SignalKind};
    let mut term = signal(SignalKind::terminate()).map_err(|source| RunError::Local {
        what: "watch for SIGTERM",
        source,
    })?;
    tokio::select! {
        r = work => Ok(r?),
        _ = tokio::signal::ctrl_c() => Err(RunError::Interrupted),
        _ = term.recv() => Err(RunError::Interrupted),
    }
}

/// The versions as a tree: each under its parent (the version it
/// descends from), then the lines that are no intact version.
fn versions_table(list: &[VersionView]) -> String {
    let records: Vec<&VersionRecord> = list.iter().filter_map(|v| v.record.as_ref()).collect();
    let pairs: Vec<(u64, Option<u64>)> = records.iter().map(|r| (r.version, r.parent)).collect();
    let dash = |n: Option<u64>| n.map_or("-".to_owned(), |n| n.to_string());
    let now = table::now_ms();
    let mut rows: Vec<Vec<String>> = tree::layout(&pairs)
        .into_iter()
        .filter_map(|(n, prefix)| {
            let view = list
                .iter()
                .find(|v| v.record.as_ref().is_some_and(|r| r.version == n))?;
            let r = view.record.as_ref()?;
            Some(vec![
                format!("{prefix}{n}"),
                dash(r.parent),
                dash(r.turn),
                r.class.to_string(),
                dash(r.process_image),
                r.fs_snapshot
                    .as_ref()
                    .map_or("-".to_owned(), |f| f.name.to_string()),
                // The process image's own files (the file snapshot shares
                // blocks with others: its size is not the version's).
                match r.images.iter().map(|i| i.bytes).sum::<u64>() {
                    0 => "-".to_owned(),
                    n => table::size(n),
                },
                table::ago(r.created_unix_ms, now),
                view.defect.clone().unwrap_or_else(|| "ok".to_owned()),
            ])
        })
        .collect();
    rows.extend(list.iter().filter(|v| v.record.is_none()).map(|v| {
        let mut row = vec!["?".to_owned(), "-".to_owned(), "?".to_owned(), "?".to_owned()];
        row.extend(["-", "-", "-", "-"].map(str::to_owned));
        row.push(v.defect.clone().unwrap_or_default());
        row
    }));
    table::render(
        &[
            "VERSION",
            "PARENT",
            "TURN",
            "CLASS",
            "IMAGE",
            "FS",
            "IMAGE_SIZE",
            "CREATED",
            "STATUS",
        ],
        rows.into_iter(),
    )
}

/// One line per turn report: turn, class, and the reasons in short.
fn turn_line(r: &TurnReport) -> String {
    let reasons: Vec<String> = r.reasons.iter().map(|v| v.to_string()).collect();
    format!("turn {} {}: {}\n", r.turn, r.class, reasons.join(" "))
}

/// The `RECOVERED` cell of `crabctl ps`: how many automatic recoveries,
/// and the last one's version and time (`!` when it passed over a corrupt
/// head).
fn recovered(s: &crab_api::crabd::SandboxInfo) -> String {
    match &s.last_recovery {
        None => "-".to_owned(),
        Some(r) => format!(
            "{}x, last v{}{} in {} ms",
            s.recoveries,
            r.version,
            if r.passed_over.is_empty() { "" } else { "!" },
            r.total_ms
        ),
    }
}

/// One line per version a restore passed over, and why.
fn passed_over(why: &[String]) -> String {
    why.iter().map(|e| format!("passed over: {e}\n")).collect()
}

/// `text` with its control and bidirectional-format characters escaped:
/// error strings and reasons can carry a sandbox's bytes (a path, a
/// process name), which must not reach the terminal as escape sequences
/// or reorder the line around them.
fn printable(text: &str) -> String {
    let format = |c: char| matches!(c, '\u{061c}' | '\u{200b}'..='\u{200f}' | '\u{202a}'..='\u{202e}' | '\u{2066}'..='\u{2069}' | '\u{feff}');
    text.chars()
        .map(|c| match c.is_control() || format(c) {
            true => c.escape_unicode().to_string(),
            false => c.to_string(),
        })
        .collect()
}

/// One line of `crabctl logs`: when, what, and the figures.
fn event_line(e: &Event) -> String {
    let when = table::ago(e.at_unix_ms, table::now_ms());
    let what = match &e.kind {
        EventKind::Turn {
            turn,
            class,
            version,
            error,
        } => match (class, version, error) {
            (Some(class), Some(v), _) => format!("turn {turn}: {class}, version {v}"),
            (_, _, Some(error)) => format!("turn {turn}: no version: {error}"),
            _ => format!("turn {turn}: no version"),
        },
        EventKind::Checkpoint {
            version,
            class,
            turn,
            bytes,
            frozen_ms,
            total_ms,
        } => format!(
            "version {version} ({class}, {}): {}, frozen {frozen_ms:.0} ms, {total_ms:.0} ms in all",
            turn.map_or("by hand".to_owned(), |t| format!("turn {t}")),
            table::size(*bytes)
        ),
        EventKind::Hold { turn, held_ms } => {
            format!("turn {turn}: answer held {held_ms:.0} ms for its version")
        }
        EventKind::Rollback {
            version,
            undo_ms,
            total_ms,
            reason,
        } => format!(
            "rolled back to version {version} in {total_ms:.0} ms{}{}",
            undo_ms.map_or(String::new(), |u| format!(" (undo {u:.0} ms)")),
            reason.as_ref().map_or(String::new(), |r| format!(": {r}"))
        ),
        EventKind::Recovery {
            version,
            exit_status,
            total_ms,
        } => format!("crashed (exit status {exit_status}): recovered to version {version} in {total_ms} ms"),
        EventKind::Failed { what, error } => format!("{what} failed: {error}"),
    };
    format!("{when:>12}  {}", printable(&what))
}

fn print<T: Serialize>(json: bool, value: &T, human: impl FnOnce() -> String) {
    if json {
        println!(
            "{}",
            serde_json::to_string_pretty(value).expect("API types always serialize")
        );
    } else {
        print!("{}", human());
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_sandboxs_bytes_reach_the_terminal_escaped() {
        assert_eq!(
            printable("a\u{1b}]0;owned\u{7}b\u{202e}c\nd é"),
            "a\\u{1b}]0;owned\\u{7}b\\u{202e}c\\u{a}d é"
        );
        let line = event_line(&Event {
            at_unix_ms: 0,
            sandbox: SandboxId::new("s").unwrap(),
            kind: EventKind::Failed {
                what: "rollback".into(),
                error: "bad \u{1b}[2J name".into(),
            },
        });
        assert!(line.ends_with("rollback failed: bad \\u{1b}[2J name"), "{line}");
    }
}
