//! `crab-bench checkpoint`: issue 4's numbers. A sandbox whose process holds
//! `mb` MB of resident memory is checkpointed (files and processes) by crab
//! through crabd, and restored; the baseline is `ctr task checkpoint` of the
//! same workload under runc.v2 with the same CRIU, runs interleaved. Given
//! several sizes, it also prints how frozen time grows with memory.
//!
//! Frozen time is sampled the same way for both: a thread reads the
//! container's `freezer.state` every 0.2 ms while the checkpoint runs (crab
//! also reports its own measure).

use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use crab_tests::image::{python_sdk_archive, PYTHON_SDK};
use crab_tests::sandbox::crabctl_direct;
use crab_tests::{wait_until, Containerd, CRAB, RUNC};

use crate::stats::{fit, ms, percentile};

/// Runs the benchmark for each size in `sizes` (MB), printing its table;
/// with several sizes, then how frozen time grows with resident memory.
pub fn run(sizes: &[usize], runs: usize) -> anyhow::Result<()> {
    let ctd = Containerd::start();
    ctd.ctr_ok(&["image", "import", &python_sdk_archive().to_string_lossy()]);
    let mut scaling = Vec::new();
    for &mb in sizes {
        scaling.push(one_size(&ctd, mb, runs)?);
    }
    if scaling.len() > 1 {
        print_scaling(&scaling);
    }
    Ok(())
}

/// One size's p50 figures, for the scaling summary.
struct Scaled {
    /// The crab sandbox's resident memory, MiB.
    rss: f64,
    runc_frozen: Duration,
    crab_frozen: Duration,
    crab_wall: Duration,
    crab_restore: Duration,
}

/// The table of one size, in containers started for it and removed after.
fn one_size(ctd: &Containerd, mb: usize, runs: usize) -> anyhow::Result<Scaled> {
    for (rt, id) in [(RUNC, "ck-runc"), (CRAB, "ck-crab")] {
        start_holding(ctd, rt, id, mb)?;
    }
    let rss = sandbox_rss_mib(ctd, "ck-crab");
    wait_until(30, || crabctl_direct(ctd, &["ps"]).status.success().then_some(())).context("crabd")?;

    // [runc total, runc frozen, crab total, crab frozen (sampled), crab frozen (own), crab restore,
    //  restore in the shim, of which the undo checkpoint, restore with --no-undo]
    let mut s: [Vec<Duration>; 9] = Default::default();
    for i in 0..runs {
        let (total, frozen, _) = timed_frozen(&freezer_state(ctd, "ck-runc"), || {
            ctr_task_checkpoint(ctd, "ck-runc")?;
            Ok(serde_json::Value::Null)
        })?;
        s[0].push(total);
        s[1].push(frozen);
        forget_ctr_checkpoints(ctd, "ck-runc");
        let (total, frozen, report) = timed_frozen(&freezer_state(ctd, "ck-crab"), || {
            crabctl_json(ctd, &["checkpoint", "ck-crab"])
        })?;
        s[2].push(total);
        s[3].push(frozen);
        let own = report["frozen_ms"]
            .as_f64()
            .context("frozen_ms in crabctl's report")?;
        s[4].push(Duration::from_secs_f64(own / 1e3));
        let t = Instant::now();
        let r = crabctl_json(ctd, &["rollback", "ck-crab", "latest"])?;
        s[5].push(t.elapsed());
        let ms_of = |k: &str| Duration::from_secs_f64(r[k].as_f64().unwrap_or(0.0) / 1e3);
        s[6].push(ms_of("restore_ms"));
        s[7].push(ms_of("undo_ms"));
        let t = Instant::now();
        crabctl_json(ctd, &["rollback", "--no-undo", "ck-crab", "latest"])?;
        s[8].push(t.elapsed());
        eprintln!("run {}/{runs} done", i + 1);
    }

    println!(
        "checkpoint benchmark: a process holding {mb} MB (crab's sandbox: RSS {rss:.0} MiB), {runs} runs each, interleaved"
    );
    println!(
        "{:<40} {:>12} {:>12} {:>10}",
        "figure (ms)", "runc.v2", "crab", "crab/runc"
    );
    let row = |name: &str, r: &mut Vec<Duration>, c: &mut Vec<Duration>| {
        for p in [50.0, 90.0] {
            let (a, b) = (percentile(r, p), percentile(c, p));
            println!(
                "{:<40} {:>12} {:>12} {:>10.2}",
                format!("{name} p{p:.0}"),
                ms(a),
                ms(b),
                b.as_secs_f64() / a.as_secs_f64()
            );
        }
    };
    let [mut rt, mut rf, mut ct, mut cf, mut co, mut cr, mut cs, mut cu, mut cn] = s;
    row("full checkpoint, wall", &mut rt, &mut ct);
    row("frozen (sampled freezer.state)", &mut rf, &mut cf);
    println!(
        "{:<40} {:>12} {:>12}",
        "frozen, crab's own measure p50",
        "-",
        ms(percentile(&mut co, 50.0))
    );
    println!(
        "{:<40} {:>12} {:>12}",
        "restore (crabctl rollback, wall) p50",
        "-",
        ms(percentile(&mut cr, 50.0))
    );
    println!(
        "{:<40} {:>12} {:>12}",
        "restore (crabctl rollback, wall) p90",
        "-",
        ms(percentile(&mut cr, 90.0))
    );
    println!(
        "{:<40} {:>12} {:>12}",
        "  of which in the shim p50",
        "-",
        ms(percentile(&mut cs, 50.0))
    );
    println!(
        "{:<40} {:>12} {:>12}",
        "  of which the undo checkpoint p50",
        "-",
        ms(percentile(&mut cu, 50.0))
    );
    for p in [50.0, 90.0] {
        println!(
            "{:<40} {:>12} {:>12}",
            format!("restore --no-undo (wall) p{p:.0}"),
            "-",
            ms(percentile(&mut cn, p))
        );
    }
    println!(
        "note: CRIU thaws the freezer once it has seized the tasks (they stay stopped under ptrace),\n\
         so the sampled figure undercounts crab's pause; crab's own measure (freeze to thaw in the\n\
         shim) is the time its processes could not run. runc's is containerd's pause window."
    );
    println!("targets: frozen crab/runc <= 1.2; restore < 1000 ms (runc: containerd 1.6 has no restore of a running task to compare)");
    let scaled = Scaled {
        rss,
        runc_frozen: percentile(&mut rf, 50.0),
        crab_frozen: percentile(&mut co, 50.0),
        crab_wall: percentile(&mut ct, 50.0),
        crab_restore: percentile(&mut cn, 50.0),
    };
    for id in ["ck-runc", "ck-crab"] {
        ctd.remove(id);
    }
    Ok(scaled)
}

/// Frozen time against resident memory, and the rate each runtime's
/// frozen time grows at (a least-squares line over the sizes).
fn print_scaling(sizes: &[Scaled]) {
    println!("\nfrozen time against resident memory (p50, ms)");
    println!(
        "{:>10} {:>14} {:>14} {:>14} {:>16}",
        "RSS MiB", "runc frozen", "crab frozen", "crab wall", "crab restore*"
    );
    for s in sizes {
        println!(
            "{:>10.0} {:>14} {:>14} {:>14} {:>16}",
            s.rss,
            ms(s.runc_frozen),
            ms(s.crab_frozen),
            ms(s.crab_wall),
            ms(s.crab_restore)
        );
    }
    let rate = |of: fn(&Scaled) -> Duration| {
        let points: Vec<(f64, f64)> = sizes
            .iter()
            .map(|s| (s.rss / 1024.0, of(s).as_secs_f64()))
            .collect();
        match fit(&points) {
            // Seconds per GiB → GiB per second.
            Some((_, b)) if b > 0.0 => format!("{:.2} GiB/s ({:.0} ms per GiB)", 1.0 / b, b * 1e3),
            _ => "-".to_owned(),
        }
    };
    println!("runc frozen grows at   {}", rate(|s| s.runc_frozen));
    println!("crab frozen grows at   {}", rate(|s| s.crab_frozen));
    println!("crab restore grows at  {}", rate(|s| s.crab_restore));
    println!("(* rollback --no-undo, wall) target: frozen grows at >= 1 GiB/s; 1 GiB frozen <= 1 s");
}

/// `ctr run -d` on `runtime` of a Python process holding `mb` MB of
/// resident memory; answers the init's pid once the memory is filled.
pub(crate) fn start_holding(ctd: &Containerd, runtime: &str, id: &str, mb: usize) -> anyhow::Result<i32> {
    let script = format!(
        "import os, time\nb = bytearray(os.urandom({mb} << 20))\nopen('/tmp/ready', 'w').close()\ntime.sleep(1e9)\n"
    );
    ctd.ctr_ok(&[
        "run",
        "-d",
        "--runtime",
        runtime,
        PYTHON_SDK,
        id,
        "/opt/crab/sdk-venv/bin/python3",
        "-c",
        &script,
    ]);
    let pid = ctd.task_pid(id).context("task pid")?;
    wait_until(120, || {
        std::path::Path::new(&format!("/proc/{pid}/root/tmp/ready"))
            .exists()
            .then_some(())
    })
    .with_context(|| format!("{id} never filled its memory"))?;
    Ok(pid)
}

/// `crabctl --json args…`'s answer, or why it failed (straight to crabd,
/// not through the tests' checking relay, whose work is no part of the
/// figures).
pub(crate) fn crabctl_json(ctd: &Containerd, args: &[&str]) -> anyhow::Result<serde_json::Value> {
    let out = crabctl_direct(ctd, args);
    if !out.status.success() {
        bail!("crabctl {args:?}: {}", String::from_utf8_lossy(&out.stderr));
    }
    Ok(serde_json::from_slice(&out.stdout)?)
}

/// Runs `f` while a thread samples `state_file`; returns the wall time and
/// how long the file said FROZEN, and `f`'s answer.
fn timed_frozen(
    state_file: &std::path::Path,
    f: impl FnOnce() -> anyhow::Result<serde_json::Value>,
) -> anyhow::Result<(Duration, Duration, serde_json::Value)> {
    let stop = Arc::new(AtomicBool::new(false));
    let sampler = {
        let stop = stop.clone();
        let file = state_file.to_owned();
        std::thread::spawn(move || {
            let mut frozen = Duration::ZERO;
            let mut last = Instant::now();
            while !stop.load(Ordering::Relaxed) {
                let state = std::fs::read_to_string(&file).unwrap_or_default();
                let now = Instant::now();
                if state.trim() != "THAWED" {
                    frozen += now - last;
                }
                last = now;
                std::thread::sleep(Duration::from_micros(200));
            }
            frozen
        })
    };
    let t = Instant::now();
    let r = f();
    let total = t.elapsed();
    stop.store(true, Ordering::Relaxed);
    let frozen = sampler.join().expect("sampler");
    Ok((total, frozen, r?))
}

/// The v1 freezer state file of a `ctr run` container (cgroups path `/<ns>/<id>`).
fn freezer_state(ctd: &Containerd, id: &str) -> PathBuf {
    PathBuf::from("/sys/fs/cgroup/freezer")
        .join(&ctd.namespace)
        .join(id)
        .join("freezer.state")
}

/// The resident memory of every process of `ctr run` container `id` (its
/// init is crab-init, the memory its child's), MiB.
fn sandbox_rss_mib(ctd: &Containerd, id: &str) -> f64 {
    let procs = freezer_state(ctd, id).with_file_name("cgroup.procs");
    std::fs::read_to_string(procs)
        .unwrap_or_default()
        .lines()
        .filter_map(|l| l.trim().parse().ok())
        .map(rss_mib)
        .sum()
}

fn rss_mib(pid: i32) -> f64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap_or_default();
    status
        .lines()
        .find(|l| l.starts_with("VmRSS:"))
        .and_then(|l| l.split_whitespace().nth(1))
        .and_then(|v| v.parse::<f64>().ok())
        .unwrap_or(0.0)
        / 1024.0
}

/// `ctr task checkpoint id`: the baseline's whole-container checkpoint.
pub(crate) fn ctr_task_checkpoint(ctd: &Containerd, id: &str) -> anyhow::Result<()> {
    let out = ctd.ctr(&["task", "checkpoint", id]);
    if !out.status.success() {
        bail!("ctr task checkpoint: {}", String::from_utf8_lossy(&out.stderr));
    }
    Ok(())
}

/// Removes the images `ctr task checkpoint id` left, and their content at
/// once (`--sync`): containerd 1.6's task service fails the next checkpoint
/// of the same container with "content …: already exists" while the
/// previous checkpoint's spec blob (the same bytes) is still in the store.
pub(crate) fn forget_ctr_checkpoints(ctd: &Containerd, id: &str) {
    let ours = format!("checkpoint/{id}:");
    for image in ctd.ctr_ok(&["image", "ls", "-q"]).lines() {
        if image.contains(&ours) {
            ctd.ctr_ok(&["image", "rm", "--sync", image.trim()]);
        }
    }
}
