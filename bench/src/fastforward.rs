//! `crab-bench fastforward`: how long an agent put back to its head turn
//! takes to get there again, answered from its sandbox's transcript (the
//! proxy's replay), beside asking the upstream again, whose answers take
//! the LLM latencies of real runs (`../shared/traces`, scaled; the factor
//! is printed).
//!
//! Self-contained and in-process: the proxy library with a hook that
//! returns at once, one sandbox per traced task on its own loopback
//! listener, a scripted upstream that answers each request after the
//! latency the request names. Each task's agent first asks its turns of
//! the upstream (the baseline: what a restored agent without Crab does
//! again), then the sandbox's replay is armed and the agent, started again,
//! sends the same requests.

use std::convert::Infallible;
use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::Context;
use bytes::Bytes;
use crab_proxy::{
    serve_sandbox, Limits, NoopHook, Proxy, ProxyConfig, Sandbox, SandboxId, Timeouts, ToolsConfig,
    TurnEndRules, Upstreams,
};
use http_body_util::{BodyExt, Full};
use hyper::body::Incoming;
use hyper_util::client::legacy::{connect::HttpConnector, Client};
use hyper_util::rt::{TokioExecutor, TokioIo};
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;

use crate::eval::workload;
use crate::stats::{ms, percentile};

type HttpClient = Client<HttpConnector, Full<Bytes>>;

/// One task's figures.
struct Figures {
    turns: usize,
    /// The LLM time of its turns, as scaled.
    llm: Duration,
    /// Asking the upstream again.
    live: Duration,
    /// Answered from the transcript.
    replayed: Duration,
    /// Each replayed turn's latency.
    per_turn: Vec<Duration>,
}

/// Runs the benchmark and prints its table.
pub fn run(tasks: usize, turns: usize, scale: f64, traces: &Path) -> anyhow::Result<()> {
    let tasks = workload::swe(workload::SWE_TOML, traces, &[], tasks, turns, scale)?;
    anyhow::ensure!(!tasks.is_empty(), "no traced task");
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .context("tokio runtime")?;
    let thinks: Vec<Vec<Duration>> = tasks
        .iter()
        .map(|t| t.steps.iter().map(|s| s.think).collect())
        .collect();
    let figures = rt.block_on(bench(&thinks))?;

    println!(
        "fast-forward benchmark: {} traced SWE tasks, up to {turns} turns each, LLM latencies scaled by {scale} \
         (answers of the upstream wait that long; the transcript answers at once)",
        figures.len()
    );
    println!(
        "{:<10} {:>6} {:>14} {:>14} {:>16} {:>9} {:>14} {:>14}",
        "task",
        "turns",
        "as traced (s)",
        "ask again (s)",
        "fast-forward (s)",
        "ratio",
        "turn p50 (ms)",
        "turn p99 (ms)"
    );
    let (mut live, mut replayed, mut traced) = (Duration::ZERO, Duration::ZERO, Duration::ZERO);
    let mut all_turns = Vec::new();
    for (i, f) in figures.iter().enumerate() {
        let mut per = f.per_turn.clone();
        println!(
            "{:<10} {:>6} {:>14.1} {:>14.2} {:>16.3} {:>9.4} {:>14} {:>14}",
            format!("task {}", i + 1),
            f.turns,
            f.llm.as_secs_f64() / scale,
            f.live.as_secs_f64(),
            f.replayed.as_secs_f64(),
            f.replayed.as_secs_f64() / f.live.as_secs_f64().max(1e-9),
            ms(percentile(&mut per, 50.0)),
            ms(percentile(&mut per, 99.0)),
        );
        live += f.live;
        replayed += f.replayed;
        traced += f.llm;
        all_turns.extend(per);
    }
    println!(
        "{:<10} {:>6} {:>14.1} {:>14.2} {:>16.3} {:>9.4} {:>14} {:>14}",
        "all",
        all_turns.len(),
        traced.as_secs_f64() / scale,
        live.as_secs_f64(),
        replayed.as_secs_f64(),
        replayed.as_secs_f64() / live.as_secs_f64().max(1e-9),
        ms(percentile(&mut all_turns, 50.0)),
        ms(percentile(&mut all_turns, 99.0)),
    );
    Ok(())
}

async fn bench(thinks: &[Vec<Duration>]) -> anyhow::Result<Vec<Figures>> {
    let shutdown = CancellationToken::new();
    let upstream = start_upstream(shutdown.clone()).await?;
    let dir = std::env::temp_dir().join(format!("crab-bench-ffwd-{}", std::process::id()));
    std::fs::create_dir_all(&dir)?;
    let config = ProxyConfig {
        upstreams: Upstreams {
            openai: upstream.parse()?,
            anthropic: upstream.parse()?,
        },
        turn_ends: TurnEndRules::main_loop(),
        limits: Limits {
            max_request_body: 32 << 20,
            transcript_body_cap: 8 << 20,
            transcript_max_bytes: u64::MAX,
            max_connections: 1024,
        },
        timeouts: Timeouts {
            client_header: Duration::from_secs(10),
            client_body: Duration::from_secs(60),
            upstream_connect: Duration::from_secs(5),
            upstream_header: Duration::from_secs(120),
            upstream_idle: Duration::from_secs(120),
            upstream_total: Duration::from_secs(600),
            hook: Duration::from_secs(30),
        },
        transcript_dir: dir.clone(),
        tools: ToolsConfig { calls_per_minute: 0 },
    };
    let proxy = Proxy::new(config, Arc::new(NoopHook))?;
    let client: HttpClient = Client::builder(TokioExecutor::new()).build(HttpConnector::new());
    let mut runs = tokio::task::JoinSet::new();
    for (i, think) in thinks.iter().enumerate() {
        let sandbox = proxy.add_sandbox(SandboxId::new(format!("ffwd{i}"))?).await?;
        let listener = TcpListener::bind("127.0.0.1:0").await?;
        let base = format!("http://{}", listener.local_addr()?);
        tokio::spawn(serve_sandbox(listener, sandbox.clone(), shutdown.clone()));
        let (client, think) = (client.clone(), think.clone());
        runs.spawn(async move { task(&client, &base, &sandbox, &think).await });
    }
    let mut figures = Vec::new();
    while let Some(done) = runs.join_next().await {
        figures.push(done??);
    }
    shutdown.cancel();
    let _ = std::fs::remove_dir_all(&dir);
    Ok(figures)
}

/// One task's agent: its turns asked of the upstream, then again after
/// the replay was armed.
async fn task(
    client: &HttpClient,
    base: &str,
    sandbox: &Sandbox,
    think: &[Duration],
) -> anyhow::Result<Figures> {
    let t = Instant::now();
    agent(client, base, think).await?;
    let live = t.elapsed();
    sandbox.flush_transcript().await;
    sandbox.replay(think.len() as u64).await?;
    let t = Instant::now();
    let per_turn = agent(client, base, think).await?;
    let replayed = t.elapsed();
    Ok(Figures {
        turns: think.len(),
        llm: think.iter().sum(),
        live,
        replayed,
        per_turn,
    })
}

/// Sends one request per turn, each carrying the conversation so far and
/// the latency its answer takes upstream; answers each turn's latency.
async fn agent(client: &HttpClient, base: &str, think: &[Duration]) -> anyhow::Result<Vec<Duration>> {
    let mut messages = vec![serde_json::json!({"role": "user", "content": "start"})];
    let mut took = Vec::with_capacity(think.len());
    for (i, d) in think.iter().enumerate() {
        messages.push(
            serde_json::json!({"role": "user", "content": format!("step {i} delay_ms {}", d.as_millis())}),
        );
        let body = serde_json::json!({"model": "m", "messages": messages}).to_string();
        let req = http::Request::post(format!("{base}/v1/chat/completions"))
            .header("content-type", "application/json")
            .body(Full::new(Bytes::from(body)))?;
        let t = Instant::now();
        let resp = client.request(req).await?;
        anyhow::ensure!(resp.status().is_success(), "turn {i}: status {}", resp.status());
        let answer = resp.into_body().collect().await?.to_bytes();
        took.push(t.elapsed());
        let v: serde_json::Value = serde_json::from_slice(&answer)?;
        messages.push(v["choices"][0]["message"].clone());
    }
    Ok(took)
}

/// The scripted upstream: a chat completion after the `delay_ms` the last
/// message names.
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

async fn answer(req: http::Request<Incoming>) -> Result<http::Response<Full<Bytes>>, Infallible> {
    let body = req
        .into_body()
        .collect()
        .await
        .map(|c| c.to_bytes())
        .unwrap_or_default();
    let text = String::from_utf8_lossy(&body);
    let delay = text
        .rsplit("delay_ms ")
        .next()
        .and_then(|rest| rest.split(|c: char| !c.is_ascii_digit()).next())
        .and_then(|n| n.parse().ok())
        .unwrap_or(0);
    tokio::time::sleep(Duration::from_millis(delay)).await;
    let answer = serde_json::json!({
        "id": "chatcmpl-ffwd", "object": "chat.completion", "created": 1, "model": "m",
        "choices": [{"index": 0, "message": {"role": "assistant", "content": format!("answer after {delay} ms")},
                     "finish_reason": "stop"}],
    });
    Ok(http::Response::builder()
        .header("content-type", "application/json")
        .body(Full::new(Bytes::from(answer.to_string())))
        .unwrap_or_else(|_| http::Response::new(Full::new(Bytes::new()))))
}
