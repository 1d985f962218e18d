//! `crab-bench recovery`: issue 13's numbers. Crash to running again: a
//! sandbox whose process holds 0 or `mb` MB is checkpointed, its init is
//! SIGKILLed, and crabd restores its head version by itself; the time from
//! the kill until containerd shows the new init running, beside a cold
//! start (`ctr run -d` with runc.v2 until the task runs) of the same image
//! and command in the same run. And forks of one version: 1, 4 and 16 at
//! once, wall time and the disk their files take.
//!
//! Each crash is in a sandbox of its own: crabd gives up on a fourth crash
//! of one sandbox within a minute.

use std::time::{Duration, Instant};

use anyhow::Context;
use crab_tests::image::python_sdk_archive;
use crab_tests::sandbox::crabctl_direct;
use crab_tests::{wait_until, Containerd, CRAB, RUNC};
use nix::sys::signal::{kill, Signal};
use nix::unistd::Pid;

use crate::checkpoint::{crabctl_json, start_holding};
use crate::stats::{ms, percentile};

/// Runs the benchmark and prints its tables.
pub fn run(mb: usize, runs: usize) -> anyhow::Result<()> {
    let ctd = Containerd::start();
    ctd.ctr_ok(&["image", "import", &python_sdk_archive().to_string_lossy()]);
    println!("recovery benchmark: {runs} crashes per size, each in a sandbox of its own");
    println!("{:<44} {:>10} {:>10} {:>10}", "figure (ms)", "p50", "p95", "max");
    let mut n = 0;
    for size in [0, mb] {
        // [cold start (runc), crash to running (crab), crabd's own measure]
        let mut s: [Vec<Duration>; 3] = Default::default();
        for _ in 0..runs {
            n += 1;
            let cold = format!("cold{n}");
            let t = Instant::now();
            start_holding(&ctd, RUNC, &cold, size)?;
            s[0].push(t.elapsed());
            ctd.remove(&cold);

            let id = format!("crash{n}");
            let pid = start_holding(&ctd, CRAB, &id, size)?;
            wait_until(30, || {
                crabctl_direct(&ctd, &["ps"]).status.success().then_some(())
            })
            .context("crabd")?;
            crabctl_json(&ctd, &["checkpoint", &id])?;
            let t = Instant::now();
            kill(Pid::from_raw(pid), Signal::SIGKILL)?;
            wait_until(60, || {
                (ctd.task_pid(&id).is_some_and(|p| p != pid)
                    && ctd.task_status(&id).as_deref() == Some("RUNNING"))
                .then_some(())
            })
            .with_context(|| format!("{id} was not recovered"))?;
            s[1].push(t.elapsed());
            let own = wait_until(20, || {
                let list = crabctl_json(&ctd, &["ps"]).ok()?;
                let entry = list.as_array()?.iter().find(|e| e["id"] == id.as_str())?.clone();
                entry["last_recovery"]["total_ms"].as_f64()
            })
            .context("crabd's recovery record")?;
            s[2].push(Duration::from_secs_f64(own / 1e3));
            ctd.remove(&id);
        }
        let [mut cold, mut crash, mut own] = s;
        for (name, v) in [
            (format!("cold start, runc.v2 ({size} MB)"), &mut cold),
            (format!("crash to running, crab ({size} MB)"), &mut crash),
            (format!("  of which crabd's restore ({size} MB)"), &mut own),
        ] {
            println!(
                "{name:<44} {:>10} {:>10} {:>10}",
                ms(percentile(v, 50.0)),
                ms(percentile(v, 95.0)),
                ms(percentile(v, 100.0))
            );
        }
    }

    // Forks of one version of a sandbox holding `mb` MB.
    start_holding(&ctd, CRAB, "forked", mb)?;
    crabctl_json(&ctd, &["checkpoint", "forked"])?;
    println!("\nforks of one version ({mb} MB of memory; process images read in place, files copied)");
    println!(
        "{:<10} {:>12} {:>14} {:>10}",
        "forks", "wall ms", "files bytes", "made"
    );
    for count in [1, 4, 16] {
        let prefix = format!("tree{count}");
        let t = Instant::now();
        let r = crabctl_json(
            &ctd,
            &[
                "fork",
                "forked",
                "1",
                "--count",
                &count.to_string(),
                "--name",
                &prefix,
            ],
        )?;
        let wall = t.elapsed();
        let forks = r["forks"].as_array().context("forks")?;
        let bytes: u64 = forks.iter().filter_map(|f| f["bytes"].as_u64()).sum();
        let made = forks.iter().filter(|f| f["error"].is_null()).count();
        println!("{count:<10} {:>12} {bytes:>14} {made:>10}", ms(wall));
        for i in 1..=count {
            ctd.remove(&format!("{prefix}-{i}"));
        }
    }
    ctd.remove("forked");
    println!("target: crash to running well under a cold start's time plus the work it lost");
    Ok(())
}
