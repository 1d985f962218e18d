//! The sandbox's LLM proxy: the agent inside reaches it at 127.0.0.1 in its
//! own network namespace, through environment variables the shim puts into
//! the OCI spec at Create. The agent is not modified.
//!
//! An agent whose spec already sets a variable keeps its service: that value
//! becomes the sandbox's upstream. Sandboxes that share the host's network
//! namespace get no proxy (one port cannot serve them all).
//!
//! The same sandbox is also served on a root-only unix socket on the host
//! (`<runtime root>/.ctl/<id>.proxy.sock`), which crabd's host listener
//! relays to for agents that run outside the sandbox: one turn counter, one
//! transcript, one gate, whichever way the agent comes in. The gate's hook is
//! crabd (`crate::turn_hook`) when `checkpoint_on_turn` is set.

use std::net::{Ipv4Addr, SocketAddr};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use crab_api::shim::ConversationAt;
use crab_proxy::{
    Limits, NoopHook, Proxy, ProxyConfig, Sandbox, SandboxId, Timeouts, ToolsConfig, TurnEndRules, TurnHook,
    Upstreams,
};
use serde_json::Value;
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

use crate::config::ProxyShimConfig;
use crate::error::{Error, Result};

/// A sandbox's running proxy.
pub struct SandboxProxy {
    sandbox: Sandbox,
    shutdown: CancellationToken,
    /// Stops the listener in the sandbox only (a child of `shutdown`).
    netns_shutdown: CancellationToken,
    task: JoinHandle<()>,
    /// The host-side socket and its server, if it could be bound.
    host: Option<(PathBuf, JoinHandle<()>)>,
    /// The sandbox's transcript file.
    transcript: PathBuf,
    /// The inode of the network namespace the listener is in.
    netns: Option<u64>,
}

/// What Create decided before the container existed.
#[derive(Debug, Clone)]
pub struct ProxyPlan {
    upstreams: (String, String),
    /// The variables (`NAME=value`) that point SDKs at the proxy.
    pub env: Vec<String>,
    /// The spec's own values (`NAME=value`) that `env` replaced: an exec
    /// that carries one inherited it from the container's spec.
    pub replaced: Vec<String>,
    /// Where to serve the sandbox on the host (for crabd's host listener).
    pub host_socket: Option<PathBuf>,
}

/// Points the agent's SDKs at the proxy in the bundle's `config.json`
/// (atomically rewritten), when the container gets a network namespace of
/// its own. Returns the plan for [`SandboxProxy::start`].
pub fn inject(bundle: &Path, cfg: &ProxyShimConfig) -> Result<Option<ProxyPlan>> {
    let mut spec = crate::spec_env::read_spec(bundle)?;
    if !private_netns(&spec) {
        tracing::info!(
            "{}: shares a network namespace with the host: no LLM proxy",
            bundle.display()
        );
        return Ok(None);
    }
    let Some(env) = spec.pointer_mut("/process/env") else {
        return Ok(None);
    };
    let mut vars: Vec<String> = match env.as_array() {
        Some(a) => a.iter().filter_map(|v| v.as_str().map(str::to_owned)).collect(),
        None => Vec::new(),
    };
    let port = cfg.port;
    let mut openai = cfg.openai_upstream.clone();
    let mut anthropic = cfg.anthropic_upstream.clone();
    let mut injected = Vec::new();
    let mut replaced = Vec::new();
    let mut set = |name: &str, local: String, upstream: &mut String, strip_v1: bool| {
        let prefix = format!("{name}=");
        let var = format!("{prefix}{local}");
        match vars.iter().position(|v| v.starts_with(&prefix)) {
            Some(i) => {
                let theirs = vars[i][prefix.len()..].trim_end_matches('/').to_owned();
                let base = if strip_v1 {
                    theirs.strip_suffix("/v1").map(str::to_owned)
                } else {
                    Some(theirs)
                };
                match base {
                    Some(b) => {
                        *upstream = b;
                        replaced.push(std::mem::replace(&mut vars[i], var.clone()));
                        injected.push(var);
                    }
                    // An OpenAI base without /v1 cannot be fronted by a
                    // proxy that serves /v1/…: leave the agent's choice.
                    None => tracing::warn!("{name} does not end in /v1: left as the agent set it"),
                }
            }
            None => {
                vars.push(var.clone());
                injected.push(var);
            }
        }
    };
    set(
        &cfg.openai_env,
        format!("http://127.0.0.1:{port}/v1"),
        &mut openai,
        true,
    );
    set(
        &cfg.anthropic_env,
        format!("http://127.0.0.1:{port}"),
        &mut anthropic,
        false,
    );
    *env = Value::Array(vars.into_iter().map(Value::String).collect());
    crate::spec_env::write_spec(bundle, &spec)?;
    Ok(Some(ProxyPlan {
        upstreams: (openai, anthropic),
        env: injected,
        replaced,
        host_socket: None,
    }))
}

impl SandboxProxy {
    /// Opens the listener in the network namespace of `pid` and serves the
    /// sandbox `id` of containerd namespace `namespace` there and on the
    /// plan's host socket; `hook` is called at each turn end. A sandbox
    /// resumed from a version of its own (`resume`: where it stands in the
    /// conversation) goes on with its transcript; any other starts a new
    /// one, the old kept aside.
    pub async fn start(
        namespace: &str,
        id: &str,
        pid: i32,
        plan: ProxyPlan,
        cfg: &ProxyShimConfig,
        hook: Arc<dyn TurnHook>,
        resume: Option<ConversationAt>,
    ) -> Result<Self> {
        let port = cfg.port;
        let netns = netns_inode(pid);
        let listener = listen_in_sandbox(pid, port).await?;

        let dir = cfg.transcript_dir.join(namespace);
        if resume.is_none() {
            archive_transcript(&dir, id)?;
        }
        let mut resume = resume;
        let transcript = dir.join(format!("{id}.jsonl"));
        let secs = Duration::from_secs;
        let upstream = |u: &str| {
            u.parse().map_err(|_| Error::Proxy {
                id: id.to_owned(),
                reason: format!("upstream {u:?} is not a URL"),
            })
        };
        let config = ProxyConfig {
            upstreams: Upstreams {
                openai: upstream(&plan.upstreams.0)?,
                anthropic: upstream(&plan.upstreams.1)?,
            },
            turn_ends: TurnEndRules::new(cfg.turn_end_routes.clone()).with_side_calls(cfg.side_calls),
            limits: Limits {
                max_request_body: cfg.max_request_body,
                transcript_body_cap: cfg.transcript_body_cap,
                transcript_max_bytes: cfg.transcript_max_bytes,
                max_connections: cfg.max_connections,
            },
            timeouts: Timeouts {
                client_header: secs(cfg.client_header_timeout),
                client_body: secs(cfg.client_body_timeout),
                upstream_connect: secs(cfg.upstream_connect_timeout),
                upstream_header: secs(cfg.upstream_header_timeout),
                upstream_idle: secs(cfg.upstream_idle_timeout),
                upstream_total: secs(cfg.upstream_total_timeout),
                hook: secs(cfg.hold_timeout),
            },
            transcript_dir: dir.clone(),
            tools: ToolsConfig {
                calls_per_minute: cfg.tool_calls_per_minute,
            },
        };
        let proxy_error = |e: crab_proxy::Error| Error::Proxy {
            id: id.to_owned(),
            reason: e.to_string(),
        };
        let proxy = Proxy::with_tools(config, hook, agent_tools(cfg, &crate::config::get().crabd))
            .map_err(proxy_error)?;
        let sid = SandboxId::new(id).map_err(|e| Error::Proxy {
            id: id.to_owned(),
            reason: e.to_string(),
        })?;
        let mut sandbox = proxy.add_sandbox(sid.clone()).await.map_err(proxy_error)?;
        // Before the listener serves: the restored agent's first request
        // meets the replay.
        if let Some(at) = resume.take() {
            if let Err(e) = sandbox.resume(at).await {
                // Numbering from 1 over the old turns would shadow them:
                // the old transcript goes aside, whole.
                tracing::warn!(error = %crab_api::error_chain(&e), "{id}: the conversation starts over: no replay");
                sandbox.shutdown().await;
                drop(proxy.remove_sandbox(&sid));
                archive_transcript(&dir, id)?;
                sandbox = proxy.add_sandbox(sid).await.map_err(proxy_error)?;
            }
        }
        let shutdown = CancellationToken::new();
        let netns_shutdown = shutdown.child_token();
        let task = tokio::spawn(crab_proxy::serve_sandbox(
            listener,
            sandbox.clone(),
            netns_shutdown.clone(),
        ));
        tracing::info!("{id}: LLM proxy on 127.0.0.1:{port} in the sandbox");
        // The sandbox runs without the host socket if it cannot be bound:
        // only agents outside the sandbox miss it, and the log says why.
        let host = match &plan.host_socket {
            Some(path) => match bind_host_socket(path) {
                Ok(listener) => {
                    let serve = crab_proxy::serve_sandbox(listener, sandbox.clone(), shutdown.clone());
                    tracing::info!("{id}: LLM proxy on {} for crabd's host listener", path.display());
                    Some((path.clone(), tokio::spawn(serve)))
                }
                Err(e) => {
                    tracing::warn!(error = %crab_api::error_chain(&e), "{id}: no host socket {}", path.display());
                    None
                }
            },
            None => None,
        };
        Ok(SandboxProxy {
            sandbox,
            shutdown,
            netns_shutdown,
            task,
            host,
            transcript,
            netns,
        })
    }

    /// The sandbox's transcript file (crabd deletes it with its history).
    pub fn transcript(&self) -> &Path {
        &self.transcript
    }

    /// Serves the same sandbox (its turn numbers, transcript and gate) on
    /// a new listener in the network namespace of `pid`: after a restore,
    /// which makes a new namespace when the container had its own.
    pub async fn rebind(&mut self, pid: i32, port: u16) -> Result<()> {
        let netns = netns_inode(pid);
        if netns.is_some() && netns == self.netns {
            // The restore went back into the namespace (a pinned one):
            // the listener there serves the restored agent already.
            return Ok(());
        }
        let listener = listen_in_sandbox(pid, port).await?;
        self.netns = netns;
        self.netns_shutdown.cancel();
        let _ = (&mut self.task).await;
        self.netns_shutdown = self.shutdown.child_token();
        self.task = tokio::spawn(crab_proxy::serve_sandbox(
            listener,
            self.sandbox.clone(),
            self.netns_shutdown.clone(),
        ));
        Ok(())
    }

    /// Tells the proxy where a restore put the conversation (see
    /// `crab_proxy::Sandbox::rewind`); None: nowhere known, so what the
    /// agent asks next goes live as it would have. Before the listener in
    /// the restored namespace exists, so the restored agent's first request
    /// meets the replay.
    pub async fn rewind(&self, at: Option<ConversationAt>, notice: Option<&str>) {
        let Some(at) = at else {
            self.sandbox.cancel_replay();
            return;
        };
        if let Err(e) = self.sandbox.rewind_with_notice(at, notice).await {
            tracing::warn!(error = %crab_api::error_chain(&e), branch = at.branch, turn = at.turn, "no replay after the restore: the agent's requests go live");
            self.sandbox.cancel_replay();
        }
    }

    /// The host-side socket, if the sandbox is served there.
    pub fn host_socket(&self) -> Option<&Path> {
        self.host.as_ref().map(|(path, _)| path.as_path())
    }

    /// Stops serving (both listeners), flushes the transcript and removes
    /// the host socket.
    pub async fn stop(self) {
        self.shutdown.cancel();
        self.sandbox.shutdown().await;
        let _ = self.task.await;
        if let Some((path, task)) = self.host {
            let _ = task.await;
            let _ = std::fs::remove_file(path);
        }
    }
}

/// A listener on 127.0.0.1:`port` in the network namespace of `pid`.
/// The inode of the network namespace of `pid`, if it can be read.
fn netns_inode(pid: i32) -> Option<u64> {
    use std::os::unix::fs::MetadataExt;
    std::fs::metadata(format!("/proc/{pid}/ns/net"))
        .ok()
        .map(|m| m.ino())
}

async fn listen_in_sandbox(pid: i32, port: u16) -> Result<tokio::net::TcpListener> {
    // setns changes only the calling thread: a thread of its own, which
    // ends right after, so no pooled thread is left in the sandbox.
    let listener = tokio::task::spawn_blocking(move || {
        std::thread::spawn(move || bind_in_netns(pid, port))
            .join()
            .unwrap_or_else(|_| Err(std::io::Error::other("listener thread panicked")))
    })
    .await
    .map_err(|e| Error::io("bind the proxy listener")(std::io::Error::other(e)))?
    .map_err(Error::io(format!("bind 127.0.0.1:{port} in the sandbox")))?;
    listener
        .set_nonblocking(true)
        .map_err(Error::io("proxy listener"))?;
    tokio::net::TcpListener::from_std(listener).map_err(Error::io("proxy listener"))
}

/// The hook of a sandbox's gate: crabd's checkpoint of each turn when
/// `checkpoint_on_turn` is set and shims register with crabd, otherwise none.
/// A pod's sandbox gives the shim's pods: each turn end tells crabd of its
/// pod's members.
pub fn turn_hook(
    cfg: &ProxyShimConfig,
    crabd: &crate::config::CrabdShimConfig,
    pods: Option<Arc<crate::pod::Pods>>,
) -> Arc<dyn TurnHook> {
    if cfg.checkpoint_on_turn && crabd.register {
        let limit = Duration::from_secs(cfg.hold_timeout);
        let autostart = crabd.autostart.then_some(crabd.binary.as_path());
        Arc::new(crate::turn_hook::EngineHook::new(
            &crabd.socket,
            limit,
            autostart,
            pods,
        ))
    } else {
        // Every turn is safe at once.
        Arc::new(NoopHook)
    }
}

/// The engine behind the agent's rollback tool: crabd when `agent_tools`
/// is set and shims register with crabd, otherwise none (the tool then
/// answers 503).
fn agent_tools(
    cfg: &ProxyShimConfig,
    crabd: &crate::config::CrabdShimConfig,
) -> Option<Arc<dyn crab_proxy::AgentTools>> {
    if !(cfg.agent_tools && crabd.register) {
        return None;
    }
    // A rollback waits for the sandbox's lock and a slot, then two shim
    // calls; crabd finishes it even if this call gives up, so the limit
    // only bounds a crabd that hangs.
    Some(Arc::new(crate::agent_tools::CrabdTools::new(
        &crabd.socket,
        Duration::from_secs(3600),
    )))
}

/// Adds the proxy variables `env` to an exec's OCI process spec (JSON), so
/// an agent started with `exec` finds the proxy too (containerd builds exec
/// specs from its own copy of the container's spec, which the shim did not
/// rewrite). A variable the exec carries with the spec's own value
/// (`replaced`: inherited, as `docker exec` and `ctr task exec` do) is
/// pointed at the proxy too, which forwards to that value; one the exec set
/// to a value of its own is left alone.
pub fn inject_exec(spec: &[u8], env: &[String], replaced: &[String]) -> Result<Vec<u8>> {
    let mut process: Value = serde_json::from_slice(spec).map_err(|e| Error::InvalidExecSpec {
        reason: e.to_string(),
    })?;
    let Some(obj) = process.as_object_mut() else {
        return Err(Error::InvalidExecSpec {
            reason: "not a JSON object".to_owned(),
        });
    };
    let vars = obj.entry("env").or_insert_with(|| Value::Array(Vec::new()));
    if let Some(list) = vars.as_array_mut() {
        for var in env {
            let name = var.split('=').next().unwrap_or_default();
            let prefix = format!("{name}=");
            match list
                .iter()
                .position(|v| v.as_str().is_some_and(|s| s.starts_with(&prefix)))
            {
                None => list.push(Value::String(var.clone())),
                Some(i) if list[i].as_str().is_some_and(|s| replaced.iter().any(|r| r == s)) => {
                    list[i] = Value::String(var.clone());
                }
                Some(_) => {}
            }
        }
    }
    serde_json::to_vec(&process).map_err(|e| Error::InvalidExecSpec {
        reason: e.to_string(),
    })
}

/// Whether the spec gives the container a network namespace that is not the
/// shim's (a new one, or a path to another).
fn private_netns(spec: &Value) -> bool {
    let Some(namespaces) = spec.pointer("/linux/namespaces").and_then(Value::as_array) else {
        return false;
    };
    let Some(net) = namespaces
        .iter()
        .find(|n| n.get("type").and_then(Value::as_str) == Some("network"))
    else {
        return false;
    };
    match net.get("path").and_then(Value::as_str) {
        None | Some("") => true,
        Some(p) => {
            use std::os::unix::fs::MetadataExt;
            let theirs = std::fs::metadata(p).map(|m| (m.dev(), m.ino()));
            let ours = std::fs::metadata("/proc/self/ns/net").map(|m| (m.dev(), m.ino()));
            matches!((theirs, ours), (Ok(a), Ok(b)) if a != b)
        }
    }
}

/// Binds the root-only host socket at `path` (a stale one is replaced).
fn bind_host_socket(path: &Path) -> std::io::Result<tokio::net::UnixListener> {
    use std::os::unix::fs::PermissionsExt;
    if let Some(dir) = path.parent() {
        std::fs::create_dir_all(dir)?;
    }
    match std::fs::remove_file(path) {
        Ok(()) => {}
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
        Err(e) => return Err(e),
    }
    let listener = tokio::net::UnixListener::bind(path)?;
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o600))?;
    Ok(listener)
}

fn bind_in_netns(pid: i32, port: u16) -> std::io::Result<std::net::TcpListener> {
    let ns = std::fs::File::open(format!("/proc/{pid}/ns/net"))?;
    nix::sched::setns(&ns, nix::sched::CloneFlags::CLONE_NEWNET)?;
    std::net::TcpListener::bind(SocketAddr::from((Ipv4Addr::LOCALHOST, port)))
}

/// Moves an earlier container's transcript of the same id aside, so turn
/// numbers of this sandbox start afresh without losing the old record.
fn archive_transcript(dir: &Path, id: &str) -> Result<()> {
    let path: PathBuf = dir.join(format!("{id}.jsonl"));
    if path.exists() {
        let at = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap_or_default()
            .as_nanos();
        let old = dir.join(format!("{id}.{at}.jsonl"));
        std::fs::rename(&path, &old).map_err(Error::io(format!("archive {}", path.display())))?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn check(ns: Value, private: bool) {
        let spec = serde_json::json!({ "linux": { "namespaces": ns } });
        assert_eq!(private_netns(&spec), private, "{spec}");
    }

    #[test]
    fn exec_specs_get_the_variables_they_lack() {
        let env = vec!["OPENAI_BASE_URL=http://127.0.0.1:7878/v1".to_owned()];
        let spec_own = vec!["OPENAI_BASE_URL=https://llm.example/v1".to_owned()];
        let env_of = |spec: &[u8]| {
            let out = inject_exec(spec, &env, &spec_own).unwrap();
            serde_json::from_slice::<Value>(&out).unwrap()["env"].clone()
        };
        assert_eq!(
            env_of(br#"{"args":["sh"],"env":["PATH=/bin"]}"#),
            serde_json::json!(["PATH=/bin", "OPENAI_BASE_URL=http://127.0.0.1:7878/v1"])
        );
        // Inherited from the container's spec: through the proxy too.
        assert_eq!(
            env_of(br#"{"env":["OPENAI_BASE_URL=https://llm.example/v1","A=1"]}"#),
            serde_json::json!(["OPENAI_BASE_URL=http://127.0.0.1:7878/v1", "A=1"])
        );
        // The exec's own choice stays.
        assert_eq!(
            env_of(br#"{"env":["OPENAI_BASE_URL=http://mine/v1"]}"#),
            serde_json::json!(["OPENAI_BASE_URL=http://mine/v1"])
        );
        assert!(inject_exec(b"[1]", &env, &spec_own).is_err());
        assert!(inject_exec(b"not json", &env, &spec_own).is_err());
    }

    #[test]
    fn which_namespaces_get_a_proxy() {
        check(serde_json::json!([{"type": "network"}]), true);
        check(serde_json::json!([{"type": "network", "path": ""}]), true);
        check(serde_json::json!([{"type": "pid"}]), false);
        check(
            serde_json::json!([{"type": "network", "path": "/proc/self/ns/net"}]),
            false,
        );
        check(
            serde_json::json!([{"type": "network", "path": "/proc/1/ns/net"}]),
            false,
        );
    }
}
