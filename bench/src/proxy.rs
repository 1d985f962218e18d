//! `crab-bench proxy`: the latency the proxy adds, measured against calling
//! the same upstream directly, in one run.
//!
//! Self-contained: an in-process scripted upstream (hyper) and the proxy,
//! one sandbox per client (each client is one sequential agent), each
//! sandbox on a loopback listener of its own (as a shim serves it in the
//! sandbox's network namespace to an agent inside), a turn-end hook that
//! returns at once, transcripts fsynced to a temporary directory. A third
//! column is crabd's host relay, for agents outside: the same sandboxes,
//! each served on its own unix socket as a shim serves it, behind
//! `serve_relay` (one more hop, over connections it keeps). Every request is a turn end
//! (`POST /v1/chat/completions`): non-streaming latency, and time to first
//! byte of a streaming answer, at 1 and 64 concurrent clients. Direct and
//! proxied runs alternate per round so that machine noise hits both. The
//! process's CPU time per request (client and upstream in every column,
//! the proxy's hops in the others) shows what the proxy costs a saturated
//! host, where latency grows with it.

use std::collections::HashMap;
use std::convert::Infallible;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::Context;
use bytes::Bytes;
use crab_proxy::{
    serve_relay, serve_sandbox, Limits, NoopHook, Proxy, ProxyConfig, SandboxId, SandboxSockets, Timeouts,
    ToolsConfig, TurnEndRules, Upstreams,
};
use http_body_util::{channel::Channel, combinators::BoxBody, BodyExt, Full};
use hyper::body::Incoming;
use hyper_util::client::legacy::{connect::HttpConnector, Client};
use hyper_util::rt::{TokioExecutor, TokioIo};
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;

use crate::stats::{ms, percentile};

type HttpClient = Client<HttpConnector, Full<Bytes>>;

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
pub fn run(requests: usize, think: Duration, clients: &[usize]) -> anyhow::Result<()> {
    anyhow::ensure!(
        !clients.is_empty() && clients.iter().all(|&c| c > 0),
        "--clients takes counts above zero"
    );
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .context("tokio runtime")?;
    rt.block_on(bench(requests, think, clients))
}

/// The CPU time (user and system) this process has used so far.
fn cpu_used() -> Duration {
    use nix::sys::resource::{getrusage, UsageWho};
    getrusage(UsageWho::RUSAGE_SELF).map_or(Duration::ZERO, |u| {
        let tv = |t: nix::sys::time::TimeVal| Duration::new(t.tv_sec() as u64, t.tv_usec() as u32 * 1000);
        tv(u.user_time()) + tv(u.system_time())
    })
}

/// Latency samples of one target and the CPU time they took.
#[derive(Default)]
struct Samples {
    latency: Vec<Duration>,
    cpu: Duration,
}

impl Samples {
    /// CPU microseconds per request.
    fn cpu_us(&self) -> f64 {
        self.cpu.as_secs_f64() * 1e6 / self.latency.len().max(1) as f64
    }
}

async fn bench(requests: usize, think: Duration, clients: &[usize]) -> anyhow::Result<()> {
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
    let sandboxes = clients.iter().copied().max().unwrap_or(1);
    let mut proxied = Vec::new();
    for idx in 0..sandboxes {
        let id = format!("bench{idx}");
        let sandbox = proxy.add_sandbox(SandboxId::new(id.clone())?).await?;
        let socket = dir.join(format!("{id}.proxy.sock"));
        let unix = tokio::net::UnixListener::bind(&socket)?;
        tokio::spawn(serve_sandbox(unix, sandbox.clone(), shutdown.clone()));
        sockets.insert(id.clone(), socket);
        let listener = TcpListener::bind("127.0.0.1:0").await?;
        proxied.push(format!("http://{}/v1/chat/completions", listener.local_addr()?));
        tokio::spawn(serve_sandbox(listener, sandbox, shutdown.clone()));
    }
    let listener = TcpListener::bind("127.0.0.1:0").await?;
    let relay_base = format!("http://{}", listener.local_addr()?);
    let relayed: Vec<String> = (0..sandboxes)
        .map(|idx| format!("{relay_base}/s/bench{idx}/{SECRET}/v1/chat/completions"))
        .collect();
    let direct_urls = vec![format!("{upstream}/v1/chat/completions"); sandboxes];
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
        "figure", "direct", "proxy", "added", "ratio", "relay", "added"
    );
    for &clients in clients {
        for stream in [false, true] {
            let mut direct = Samples::default();
            let mut via = Samples::default();
            let mut relay = Samples::default();
            let per_client = (requests / clients).max(1);
            let rounds = 4;
            for round in 0..=rounds {
                let n = (per_client / rounds).max(1);
                for (urls, samples) in [
                    (&direct_urls, &mut direct),
                    (&proxied, &mut via),
                    (&relayed, &mut relay),
                ] {
                    let cpu = cpu_used();
                    let got = load(&client, urls, clients, n, stream, think).await?;
                    // Round 0 warms connections and caches.
                    if round > 0 {
                        samples.cpu += cpu_used().saturating_sub(cpu);
                        samples.latency.extend(got);
                    }
                }
            }
            let what = if stream {
                "streaming TTFB"
            } else {
                "non-streaming latency"
            };
            for p in [50.0, 99.0] {
                let d = percentile(&mut direct.latency, p);
                let v = percentile(&mut via.latency, p);
                let r = percentile(&mut relay.latency, p);
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
            let (d, v, r) = (direct.cpu_us(), via.cpu_us(), relay.cpu_us());
            println!(
                "{:<42} {:>10.0} {:>10.0} {:>12.0} {:>8.2} {:>10.0} {:>12.0}",
                format!("{what} CPU per request, {clients} client(s) (µs)"),
                d,
                v,
                v - d,
                v / d.max(1e-9),
                r,
                r - d,
            );
        }
    }
    shutdown.cancel();
    let _ = std::fs::remove_dir_all(&dir);
    Ok(())
}

/// `clients` concurrent clients each sending `n` sequential requests to
/// its own URL of `urls`, `think` apart; returns each request's latency
/// (non-streaming) or time to first byte.
async fn load(
    client: &HttpClient,
    urls: &[String],
    clients: usize,
    n: usize,
    stream: bool,
    think: Duration,
) -> anyhow::Result<Vec<Duration>> {
    let mut tasks = tokio::task::JoinSet::new();
    for (idx, url) in urls[..clients.min(urls.len())].iter().enumerate() {
        let (client, url) = (client.clone(), url.clone());
        // Seeded per client: the same pauses for every target.
        let mut rng = fastrand::Rng::with_seed(idx as u64);
        tasks.spawn(async move {
            let mut samples = Vec::with_capacity(n);
            for _ in 0..n {
                samples.push(one(&client, &url, stream).await?);
                // The agent's tool calls between two turns (part of the
                // workload): 0.5 to 1.5 times `think`, so that the
                // clients do not all ask at the same timer tick.
                if !think.is_zero() {
                    tokio::time::sleep(think.mul_f64(0.5 + rng.f64())).await;
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
