//! `crab-bench proxy`: the latency the proxy adds, measured against calling
//! the same upstream directly, in one run.
//!
//! Self-contained: an in-process scripted upstream (hyper) and the proxy on
//! its host listener, one sandbox per client (each client is one sequential
//! agent), a turn-end hook that returns at once, transcripts fsynced to a
//! temporary directory. A third column is crabd's host relay: the same
//! sandboxes, each served on its own unix socket as a shim serves it, behind
//! `serve_relay` (one more hop and one unix connection per request). Every request is a turn end
//! (`POST /v1/chat/completions`): non-streaming latency, and time to first
//! byte of a streaming answer, at 1 and 64 concurrent clients. Direct and
//! proxied runs alternate per round so that machine noise hits both.

use std::collections::HashMap;
use std::convert::Infallible;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::Context;
use bytes::Bytes;
use crab_proxy::{
    serve_host, serve_relay, serve_sandbox, Limits, NoopHook, Proxy, ProxyConfig, SandboxId, SandboxSockets,
    Timeouts, ToolsConfig, TurnEndRules, Upstreams,
};
use http_body_util::{channel::Channel, combinators::BoxBody, BodyExt, Full};
use hyper::body::Incoming;
use hyper_util::client::legacy::{connect::HttpConnector, Client};
use hyper_util::rt::{TokioExecutor, TokioIo};
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;

use crate::stats::{ms, percentile};

type HttpClient = Client<HttpConnector, Full<Bytes>>;

/// Where a client sends its requests.
#[derive(Clone, Copy)]
enum Target {
    /// The upstream itself.
    Direct,
    /// The proxy's host listener, one sandbox per client.
    Proxy,
    /// crabd's host relay to each sandbox's unix socket.
    Relay,
}

/// The sandboxes' unix sockets, by id (crabd's registry in the real thing).
struct Sockets(HashMap<String, PathBuf>);

impl SandboxSockets for Sockets {
    fn proxy_socket(&self, id: &SandboxId, secret: &str) -> Option<PathBuf> {
        (secret == SECRET)
            .then(|| self.0.get(id.as_str()).cloned())
            .flatten()
    }
}

/// Every sandbox's secret on the relay (crabd's are HMACs of the id).
const SECRET: &str = "bench";

const ANSWER: &str = r#"{"id":"chatcmpl-1","object":"chat.completion","created":1,"model":"m","choices":[{"index":0,"message":{"role":"assistant","content":"hello"},"finish_reason":"stop"}]}"#;

/// Runs the benchmark and prints its table.
pub fn run(requests: usize, think: Duration) -> anyhow::Result<()> {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .context("tokio runtime")?;
    rt.block_on(bench(requests, think))
}

async fn bench(requests: usize, think: Duration) -> anyhow::Result<()> {
    let shutdown = CancellationToken::new();
    let upstream = start_upstream(shutdown.clone()).await?;
    let dir = std::env::temp_dir().join(format!("crab-bench-proxy-{}", std::process::id()));
    let config = ProxyConfig {
        upstreams: Upstreams {
            openai: upstream.parse()?,
            anthropic: upstream.parse()?,
        },
        turn_ends: TurnEndRules::main_loop(),
        limits: Limits {
            max_request_body: 1 << 20,
            transcript_body_cap: 1 << 20,
            transcript_max_bytes: u64::MAX,
            max_connections: 1024,
        },
        timeouts: Timeouts {
            client_header: Duration::from_secs(10),
            client_body: Duration::from_secs(60),
            upstream_connect: Duration::from_secs(5),
            upstream_header: Duration::from_secs(30),
            upstream_idle: Duration::from_secs(30),
            upstream_total: Duration::from_secs(120),
            hook: Duration::from_secs(30),
        },
        transcript_dir: dir.clone(),
        tools: ToolsConfig { calls_per_minute: 0 },
    };
    let proxy = Proxy::new(config, Arc::new(NoopHook))?;
    let mut sockets = HashMap::new();
    std::fs::create_dir_all(&dir)?;
    for idx in 0..64 {
        let id = format!("bench{idx}");
        let sandbox = proxy.add_sandbox(SandboxId::new(id.clone())?).await?;
        let socket = dir.join(format!("{id}.proxy.sock"));
        let unix = tokio::net::UnixListener::bind(&socket)?;
        tokio::spawn(serve_sandbox(unix, sandbox, shutdown.clone()));
        sockets.insert(id, socket);
    }
    let listener = TcpListener::bind("127.0.0.1:0").await?;
    let proxied = format!("http://{}", listener.local_addr()?);
    tokio::spawn(serve_host(listener, proxy, shutdown.clone()));
    let listener = TcpListener::bind("127.0.0.1:0").await?;
    let relayed = format!("http://{}", listener.local_addr()?);
    tokio::spawn(serve_relay(
        listener,
        Arc::new(Sockets(sockets)),
        Duration::from_secs(10),
        shutdown.clone(),
    ));

    let mut http = HttpConnector::new();
    http.set_nodelay(true);
    let client: HttpClient = Client::builder(TokioExecutor::new())
        .pool_max_idle_per_host(128)
        .build(http);

    println!(
        "proxy benchmark: {requests} requests per configuration, {} ms think time between a client's requests; \
         every request a turn end (hook returns at once, transcript fsynced to {})",
        think.as_millis(),
        dir.display()
    );
    println!(
        "{:<42} {:>10} {:>10} {:>12} {:>8} {:>10} {:>12}",
        "figure", "direct", "proxy", "added (ms)", "ratio", "relay", "added (ms)"
    );
    for clients in [1usize, 64] {
        for stream in [false, true] {
            let mut direct = Vec::new();
            let mut via = Vec::new();
            let mut relay = Vec::new();
            let per_client = (requests / clients).max(1);
            let rounds = 4;
            for round in 0..=rounds {
                let n = (per_client / rounds).max(1);
                let d = load(&client, &upstream, Target::Direct, clients, n, stream, think).await?;
                let p = load(&client, &proxied, Target::Proxy, clients, n, stream, think).await?;
                let r = load(&client, &relayed, Target::Relay, clients, n, stream, think).await?;
                // Round 0 warms connections and caches.
                if round > 0 {
                    direct.extend(d);
                    via.extend(p);
                    relay.extend(r);
                }
            }
            let what = if stream {
                "streaming TTFB"
            } else {
                "non-streaming latency"
            };
            for p in [50.0, 99.0] {
                let d = percentile(&mut direct, p);
                let v = percentile(&mut via, p);
                let r = percentile(&mut relay, p);
                println!(
                    "{:<42} {:>10} {:>10} {:>12} {:>8.2} {:>10} {:>12}",
                    format!("{what} p{p:.0}, {clients} client(s) (ms)"),
                    ms(d),
                    ms(v),
                    ms(v.saturating_sub(d)),
                    v.as_secs_f64() / d.as_secs_f64().max(1e-9),
                    ms(r),
                    ms(r.saturating_sub(d)),
                );
            }
        }
    }
    shutdown.cancel();
    let _ = std::fs::remove_dir_all(&dir);
    Ok(())
}

/// `clients` concurrent clients each sending `n` sequential requests;
/// `think` apart; returns each request's latency (non-streaming) or time to first byte.
async fn load(
    client: &HttpClient,
    base: &str,
    target: Target,
    clients: usize,
    n: usize,
    stream: bool,
    think: Duration,
) -> anyhow::Result<Vec<Duration>> {
    let mut tasks = tokio::task::JoinSet::new();
    for idx in 0..clients {
        let client = client.clone();
        let url = match target {
            Target::Proxy => format!("{base}/s/bench{idx}/v1/chat/completions"),
            Target::Relay => format!("{base}/s/bench{idx}/{SECRET}/v1/chat/completions"),
            Target::Direct => format!("{base}/v1/chat/completions"),
        };
        tasks.spawn(async move {
            let mut samples = Vec::with_capacity(n);
            for _ in 0..n {
                samples.push(one(&client, &url, stream).await?);
                // The agent's tool calls between two turns (part of the workload).
                if !think.is_zero() {
                    tokio::time::sleep(think).await;
                }
            }
            anyhow::Ok(samples)
        });
    }
    let mut all = Vec::new();
    while let Some(done) = tasks.join_next().await {
        all.extend(done??);
    }
    Ok(all)
}

async fn one(client: &HttpClient, url: &str, stream: bool) -> anyhow::Result<Duration> {
    let body = format!(r#"{{"model":"m","stream":{stream},"messages":[{{"role":"user","content":"hi"}}]}}"#);
    let req = http::Request::post(url)
        .header("content-type", "application/json")
        .header("authorization", "Bearer sk-bench")
        .body(Full::new(Bytes::from(body)))?;
    let t = Instant::now();
    let resp = client.request(req).await?;
    anyhow::ensure!(resp.status().is_success(), "status {}", resp.status());
    let mut body = resp.into_body();
    let first = body.frame().await;
    let ttfb = t.elapsed();
    anyhow::ensure!(first.is_some(), "empty answer");
    while let Some(frame) = body.frame().await {
        frame?;
    }
    Ok(if stream { ttfb } else { t.elapsed() })
}

type UpBody = BoxBody<Bytes, Infallible>;

/// The scripted upstream: a fixed chat completion, or three SSE chunks.
async fn start_upstream(shutdown: CancellationToken) -> anyhow::Result<String> {
    let listener = TcpListener::bind("127.0.0.1:0").await?;
    let url = format!("http://{}", listener.local_addr()?);
    tokio::spawn(async move {
        loop {
            let accepted = tokio::select! {
                () = shutdown.cancelled() => break,
                a = listener.accept() => a,
            };
            let Ok((stream, _)) = accepted else { continue };
            let _ = stream.set_nodelay(true);
            tokio::spawn(async move {
                let svc = hyper::service::service_fn(answer);
                let _ = hyper::server::conn::http1::Builder::new()
                    .serve_connection(TokioIo::new(stream), svc)
                    .await;
            });
        }
    });
    Ok(url)
}

async fn answer(req: http::Request<Incoming>) -> Result<http::Response<UpBody>, Infallible> {
    let body = req
        .into_body()
        .collect()
        .await
        .map(|c| c.to_bytes())
        .unwrap_or_default();
    let stream = body.windows(13).any(|w| w == b"\"stream\":true");
    let resp = if stream {
        let (mut tx, body) = Channel::<Bytes, Infallible>::new(4);
        tokio::spawn(async move {
            for chunk in [
                "data: {\"choices\":[{\"delta\":{\"content\":\"hel\"}}]}\n\n",
                "data: {\"choices\":[{\"delta\":{\"content\":\"lo\"}}]}\n\n",
                "data: [DONE]\n\n",
            ] {
                if tx.send_data(Bytes::from_static(chunk.as_bytes())).await.is_err() {
                    return;
                }
            }
        });
        http::Response::builder()
            .header("content-type", "text/event-stream")
            .body(body.boxed())
    } else {
        http::Response::builder()
            .header("content-type", "application/json")
            .body(Full::new(Bytes::from_static(ANSWER.as_bytes())).boxed())
    };
    // The builder's inputs are constants: it cannot fail.
    Ok(resp.unwrap_or_else(|_| http::Response::new(Full::new(Bytes::new()).boxed())))
}
