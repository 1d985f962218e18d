//! `crab-bench runtime`: what issue 2 promises, measured against runc.v2.
//!
//! - latency of `ctr run --rm IMAGE true` (create, start, exit, delete), the
//!   two runtimes interleaved run by run so that machine noise hits both;
//! - resident memory (RSS and PSS) of one idle shim of each.

use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use crab_tests::image::BUSYBOX;
use crab_tests::leftovers::shim_pids;
use crab_tests::{wait_until, Containerd, CRAB, RUNC};

use crate::stats::{ms, percentile};

/// Runs the benchmark and prints its table.
pub fn run(runs: usize) -> anyhow::Result<()> {
    let ctd = Containerd::start();
    // Warm caches (image unpack, binaries) before measuring.
    for rt in [RUNC, CRAB] {
        run_once(&ctd, rt, "warm")?;
    }
    let mut lat: [Vec<Duration>; 2] = [Vec::new(), Vec::new()];
    for i in 0..runs {
        for (k, rt) in [RUNC, CRAB].into_iter().enumerate() {
            let t = Instant::now();
            run_once(&ctd, rt, &format!("b{i}"))?;
            lat[k].push(t.elapsed());
        }
    }
    let rss = [idle_shim_memory(&ctd, RUNC)?, idle_shim_memory(&ctd, CRAB)?];

    println!("runtime benchmark: {runs} runs each, interleaved; ctr run --rm {BUSYBOX} true");
    println!(
        "{:<34} {:>14} {:>14} {:>10}",
        "figure", "runc.v2", "crab", "crab/runc"
    );
    for (name, p) in [
        ("create+start+exit p50 (ms)", 50.0),
        ("create+start+exit p90 (ms)", 90.0),
    ] {
        let r = percentile(&mut lat[0], p);
        let c = percentile(&mut lat[1], p);
        println!(
            "{:<34} {:>14} {:>14} {:>10.2}",
            name,
            ms(r),
            ms(c),
            c.as_secs_f64() / r.as_secs_f64()
        );
    }
    let mean = |v: &[Duration]| v.iter().sum::<Duration>() / v.len().max(1) as u32;
    let (r, c) = (mean(&lat[0]), mean(&lat[1]));
    println!(
        "{:<34} {:>14} {:>14} {:>10.2}",
        "create+start+exit mean (ms)",
        ms(r),
        ms(c),
        c.as_secs_f64() / r.as_secs_f64()
    );
    for (name, idx) in [("idle shim RSS (MiB)", 0), ("idle shim PSS (MiB)", 1)] {
        let (r, c) = (rss[0][idx], rss[1][idx]);
        println!(
            "{:<34} {:>14.2} {:>14.2} {:>10.2}",
            name,
            mib(r),
            mib(c),
            c as f64 / r as f64
        );
    }
    println!("targets: latency ratio <= 1.20; crab idle shim RSS <= 10 MiB");
    Ok(())
}

fn run_once(ctd: &Containerd, rt: &str, id: &str) -> anyhow::Result<()> {
    let out = ctd.ctr(&["run", "--rm", "--runtime", rt, BUSYBOX, id, "true"]);
    if !out.status.success() {
        bail!("{rt}: ctr run failed: {}", String::from_utf8_lossy(&out.stderr));
    }
    Ok(())
}

/// `[RSS, PSS]` in KiB of the shim of an idle (sleeping) container.
fn idle_shim_memory(ctd: &Containerd, rt: &str) -> anyhow::Result<[u64; 2]> {
    let id = "idle";
    ctd.run_detached(rt, id, &["sleep", "600"]);
    let addr = ctd.address();
    let pid = wait_until(10, || crate_shim_pid(rt, &addr.to_string_lossy())).context("find the shim")?;
    // Let the shim settle after Create/Start.
    std::thread::sleep(Duration::from_millis(500));
    let status = std::fs::read_to_string(format!("/proc/{pid}/status"))?;
    let rollup = std::fs::read_to_string(format!("/proc/{pid}/smaps_rollup"))?;
    let field = |text: &str, name: &str| -> u64 {
        text.lines()
            .find(|l| l.starts_with(name))
            .and_then(|l| l.split_whitespace().nth(1))
            .and_then(|v| v.parse().ok())
            .unwrap_or(0)
    };
    let mem = [field(&status, "VmRSS:"), field(&rollup, "Pss:")];
    ctd.remove(id);
    Ok(mem)
}

/// The pid of the one shim of runtime `rt` serving `address`.
fn crate_shim_pid(rt: &str, address: &str) -> Option<i32> {
    if rt == CRAB {
        return shim_pids(address).first().copied();
    }
    let procs = std::fs::read_dir("/proc").ok()?;
    procs.flatten().find_map(|e| {
        let pid: i32 = e.file_name().to_string_lossy().parse().ok()?;
        let cmd = std::fs::read(e.path().join("cmdline")).ok()?;
        let cmd = String::from_utf8_lossy(&cmd);
        (cmd.contains("containerd-shim-runc-v2") && cmd.contains(address)).then_some(pid)
    })
}

fn mib(kib: u64) -> f64 {
    kib as f64 / 1024.0
}
