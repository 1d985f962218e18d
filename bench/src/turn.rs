//! `crab-bench turn`: what one agent turn's checkpoint costs in a small
//! sandbox (busybox: a shell loop counting into a file, and a 200-file work
//! tree of which each turn changes one file), per rootfs: containerd's
//! overlayfs snapshotter (crab's overlay-copy backend) and its btrfs
//! snapshotter (crab's btrfs backend, on a loop file).
//!
//! Measured through `crabctl` (straight to crabd's socket: the tests'
//! relay that checks each answer against `openapi.json` is no part of a
//! turn), wall clock: a files-only checkpoint, a full
//! one (and crab's own frozen time and time in crabd, which a turn's
//! checkpoint pays without crabctl's start), and a rollback to the newest version
//! with and without the undo checkpoint. The baseline, from the same run
//! and on the same snapshotter, is `ctr task checkpoint` of the same
//! sandbox under runc.v2: checkpointing the whole container each turn. The
//! published Python implementation's figures on this machine kind are
//! printed beside them for reference; they are not measured here.
//!
//! Beside each operation, the CPU time the runtime's own processes used
//! for it ([`crate::cpu`]: crab's crabd, shim, helpers and CRIU's dump;
//! runc.v2's shim, runc and CRIU), which a dense host pays; a restore's
//! CRIU joins the container's cgroup and is not counted, nor is the
//! kernel's writeback done by its own threads. Each window also holds
//! whatever else the runtimes' idle processes did (crabd's once-a-second
//! look for stopped sandboxes under the tests' configuration). For the
//! runc.v2 baseline, containerd's own part of `ctr task checkpoint`
//! (writing the checkpoint into its content store) is not counted either.

use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use crab_tests::image::BUSYBOX;
use crab_tests::sandbox::{crabctl_direct, wait_registered};
use crab_tests::{Containerd, CRAB, RUNC};

use crate::checkpoint::{ctr_task_checkpoint, forget_ctr_checkpoints};
use crate::stats::{ms, percentile};

/// The sandbox's init: counts into /n forever.
const LOOP: &str = "i=0; while true; do i=$((i+1)); echo $i > /n; sleep 0.05; done";

/// One snapshotter's samples.
#[derive(Default)]
struct Samples {
    runc_full: Vec<Duration>,
    fs_only: Vec<Duration>,
    fs_only_crabd: Vec<Duration>,
    full: Vec<Duration>,
    full_crabd: Vec<Duration>,
    frozen: Vec<Duration>,
    rollback: Vec<Duration>,
    rollback_no_undo: Vec<Duration>,
    // CPU time of the runtime's own processes (see `crate::cpu`) per
    // operation; empty where no cgroup could meter them.
    runc_full_cpu: Vec<Duration>,
    fs_only_cpu: Vec<Duration>,
    full_cpu: Vec<Duration>,
    rollback_cpu: Vec<Duration>,
    rollback_no_undo_cpu: Vec<Duration>,
}

/// Runs the benchmark and prints its table.
pub fn run(runs: usize) -> anyhow::Result<()> {
    let overlay = measure(Containerd::start(), runs, "turn-overlay").context("on overlayfs")?;
    let btrfs = measure(Containerd::start_on_btrfs(), runs, "turn-btrfs").context("on btrfs")?;
    println!("turn benchmark: a busybox sandbox, one file changed per turn, {runs} runs each, wall clock");
    println!(
        "{:<44} {:>14} {:>14} {:>16}",
        "figure (ms)", "overlayfs", "btrfs", "published (ref)"
    );
    let mut both = [overlay, btrfs];
    let mut row = |name: &str, published: &str, pick: fn(&mut Samples) -> &mut Vec<Duration>| {
        // "-" where nothing was measured (no cgroup to meter CPU with).
        let cell = |v: &mut Vec<Duration>, p| match v.is_empty() {
            true => "-".to_owned(),
            false => ms(percentile(v, p)),
        };
        for p in [50.0, 90.0] {
            let [a, b] = &mut both;
            println!(
                "{:<44} {:>14} {:>14} {:>16}",
                format!("{name} p{p:.0}"),
                cell(pick(a), p),
                cell(pick(b), p),
                if p == 50.0 { published } else { "" }
            );
        }
    };
    row("baseline: runc.v2 ctr task checkpoint", "-", |s| &mut s.runc_full);
    row("  CPU of runc.v2's shim, runc and CRIU", "-", |s| {
        &mut s.runc_full_cpu
    });
    row("crab files-only checkpoint", "59 (btrfs)", |s| &mut s.fs_only);
    row("  in crabd (crab's own measure)", "-", |s| &mut s.fs_only_crabd);
    row("  CPU of crabd, the shim and helpers", "-", |s| {
        &mut s.fs_only_cpu
    });
    row("crab full checkpoint", "203", |s| &mut s.full);
    row("  in crabd (crab's own measure)", "-", |s| &mut s.full_crabd);
    row("  of which frozen (crab's own measure)", "-", |s| &mut s.frozen);
    row("  CPU of crabd, the shim, helpers and CRIU", "-", |s| {
        &mut s.full_cpu
    });
    row("crab rollback (with undo checkpoint)", "360", |s| &mut s.rollback);
    row("  CPU, the restore's CRIU not counted", "-", |s| {
        &mut s.rollback_cpu
    });
    row("crab rollback --no-undo", "-", |s| &mut s.rollback_no_undo);
    row("  CPU, the restore's CRIU not counted", "-", |s| {
        &mut s.rollback_no_undo_cpu
    });
    println!(
        "published: the Python implementation of the research result, on this machine kind\n\
         (files-only turn on btrfs, full checkpoint, restore of a busybox sandbox); not measured here."
    );
    Ok(())
}

/// Runs the sandbox under both runtimes on `ctd` and samples each figure.
fn measure(ctd: Containerd, runs: usize, label: &str) -> anyhow::Result<Samples> {
    // Before the first shim starts: the shims (and the crabd a shim
    // starts) are born in containerd's metered cgroup.
    let mut meter = crate::cpu::Meter::adopt(ctd.pid().context("containerd runs")?, label);
    // The runtime's CPU since the meter started or the last call, into
    // `samples` if given; the meter restarts from the same reading.
    let mut cpu = move |samples: Option<&mut Vec<Duration>>| {
        let lap = meter.as_mut().and_then(crate::cpu::Meter::lap);
        if let (Some(samples), Some(used)) = (samples, lap) {
            samples.push(used.crab);
        }
    };
    for (rt, id) in [(RUNC, "tb-runc"), (CRAB, "tb-crab")] {
        ctd.ctr_ok(&["run", "-d", "--runtime", rt, BUSYBOX, id, "sh", "-c", LOOP]);
        exec(
            &ctd,
            id,
            "mkdir /w && for i in $(seq 200); do echo $i > /w/f$i; done",
        )?;
    }
    wait_registered(&ctd, "tb-crab");
    let mut s = Samples::default();
    for turn in 0..runs {
        for id in ["tb-runc", "tb-crab"] {
            exec(&ctd, id, &format!("echo turn {turn} >> /w/f{}", turn % 200 + 1))?;
        }
        cpu(None);
        let t = Instant::now();
        ctr_task_checkpoint(&ctd, "tb-runc")?;
        s.runc_full.push(t.elapsed());
        cpu(Some(&mut s.runc_full_cpu));
        forget_ctr_checkpoints(&ctd, "tb-runc");
        cpu(None);
        let (took, report) = timed(&ctd, &["checkpoint", "--fs", "tb-crab"])?;
        cpu(Some(&mut s.fs_only_cpu));
        s.fs_only.push(took);
        s.fs_only_crabd.push(reported(&report, "total_ms")?);
        let (took, report) = timed(&ctd, &["checkpoint", "tb-crab"])?;
        cpu(Some(&mut s.full_cpu));
        s.full.push(took);
        s.full_crabd.push(reported(&report, "total_ms")?);
        s.frozen.push(reported(&report, "frozen_ms")?);
        let (took, _) = timed(&ctd, &["rollback", "tb-crab", "latest"])?;
        cpu(Some(&mut s.rollback_cpu));
        s.rollback.push(took);
        let (took, _) = timed(&ctd, &["rollback", "--no-undo", "tb-crab", "latest"])?;
        cpu(Some(&mut s.rollback_no_undo_cpu));
        s.rollback_no_undo.push(took);
    }
    for id in ["tb-runc", "tb-crab"] {
        ctd.remove(id);
    }
    Ok(s)
}

/// Runs `sh -c script` in sandbox `id`.
fn exec(ctd: &Containerd, id: &str, script: &str) -> anyhow::Result<()> {
    let exec_id = crab_tests::unique("b");
    let out = ctd.ctr(&["task", "exec", "--exec-id", &exec_id, id, "sh", "-c", script]);
    if !out.status.success() {
        bail!("exec in {id}: {}", String::from_utf8_lossy(&out.stderr));
    }
    Ok(())
}

/// The duration crabd reported as `field` (milliseconds) of a checkpoint.
fn reported(report: &serde_json::Value, field: &str) -> anyhow::Result<Duration> {
    let ms = report[field]
        .as_f64()
        .with_context(|| format!("{field} in {report}"))?;
    Ok(Duration::from_secs_f64(ms / 1e3))
}

/// Runs `crabctl --json args…`; returns its wall time and answer.
fn timed(ctd: &Containerd, args: &[&str]) -> anyhow::Result<(Duration, serde_json::Value)> {
    let t = Instant::now();
    let out = crabctl_direct(ctd, args);
    let took = t.elapsed();
    if !out.status.success() {
        bail!("crabctl {args:?}: {}", String::from_utf8_lossy(&out.stderr));
    }
    Ok((took, serde_json::from_slice(&out.stdout)?))
}
