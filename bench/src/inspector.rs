//! `crab-bench inspector`: what issue 5 promises.
//!
//! - turn-end decision latency (p50/p99) of `Inspector::turn_end` for turns
//!   of about 10k system calls inside a crab sandbox: one file written a
//!   byte at a time (10k syscalls, one record after the kernel's dedupe),
//!   and 1000 new files (about 10k syscalls, 1000 records); beside it, the
//!   same call for an idle turn;
//! - slowdown of workloads inside the sandbox with the programs attached vs
//!   detached, runs alternating (ABBA) so that machine noise hits both: a
//!   syscall-heavy mix (untar a tree, `find /usr`, compile C), and a loop
//!   of nothing but one-byte system calls, the worst case;
//! - the same loop on the host, outside every sandbox, with a sandbox
//!   registered and with the inspector loaded but no sandbox registered
//!   (the system-call programs are then detached).

use std::path::PathBuf;
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use crab_inspector::{unified_mount, Inspector, InspectorConfig};
use crab_tests::image::DEVBOX;
use crab_tests::Containerd;

use crate::stats::{ms, percentile};

/// Runs the benchmark and prints its table.
pub fn run(turns: usize, reps: usize) -> anyhow::Result<()> {
    let ctd = Containerd::start();
    let id = "insp";
    ctd.run_devbox(id);
    let result = measure(&ctd, id, turns, reps);
    ctd.remove(id);
    result
}

fn measure(ctd: &Containerd, id: &str, turns: usize, reps: usize) -> anyhow::Result<()> {
    let sandbox = Sandbox { ctd, id };
    sandbox.sh(
        "mkdir -p /work && cd /work && tar cf linux.tar -C /usr/include/linux . \
         && printf '#include <stdio.h>\\n#include <stdlib.h>\\n#include <string.h>\\n#include <linux/bpf.h>\\nint main(void) { puts(\"hi\"); return 0; }\\n' > big.c",
    )?;
    let cgroup = sandbox.cgroup_dir()?;
    let pin_dir = PathBuf::from(format!("/sys/fs/bpf/crab-bench-{}", std::process::id()));
    let config = InspectorConfig {
        pin_dir: pin_dir.clone(),
        ..InspectorConfig::host(Vec::new())
    };

    // Turn-end latency.
    let inspector = Inspector::load(config.clone()).context("load the inspector")?;
    inspector.register(id, &cgroup)?;
    // The sandbox's init is crab-init, as crabd tells the inspector.
    inspector.quiet_init(id)?;
    inspector.turn_end(id)?;
    let mut lat: [Vec<Duration>; 3] = Default::default();
    let scripts = [
        "true",
        "dd if=/dev/zero of=/work/bytes bs=1 count=5000 2>/dev/null",
        "mkdir -p /work/many && cd /work/many && i=0; while [ $i -lt 1000 ]; do : > f$i; i=$((i+1)); done; cd .. && rm -r many && mkdir many2 && cd many2 && i=0; while [ $i -lt 1000 ]; do : > f$i; i=$((i+1)); done",
    ];
    let mut fulls = Vec::new();
    for _ in 0..turns {
        for (k, script) in scripts.iter().enumerate() {
            sandbox.sh(script)?;
            if k == 2 {
                // The second half leaves 1000 files; remove them next turn.
                sandbox.sh("rm -rf /work/many2")?;
                inspector.turn_end(id)?;
                sandbox.sh(script)?;
            }
            let t = Instant::now();
            let report = inspector.turn_end(id)?;
            lat[k].push(t.elapsed());
            if report.class == crab_inspector::Class::Full && fulls.len() < 3 {
                fulls.push(format!("{script}: {:?}", report.reasons));
            }
            sandbox.sh("rm -rf /work/many2 /work/bytes")?;
            inspector.turn_end(id)?;
        }
    }
    inspector.unregister(id)?;
    inspector.unload()?;

    // Slowdown, attached vs detached, alternating (ABBA).
    let workloads = [
        (
            "untar 1k headers + find /usr + cc -O2 (ms)",
            "cd /work && rm -rf x && mkdir x && s=$(date +%s%N) && tar xf linux.tar -C x \
             && find /usr > /dev/null && gcc -O2 -c big.c -o big.o \
             && e=$(date +%s%N) && echo $((e - s))",
        ),
        (
            "syscall loop: dd bs=1, 400k syscalls (ms)",
            "s=$(date +%s%N) && dd if=/dev/zero of=/dev/null bs=1 count=200000 2>/dev/null \
             && e=$(date +%s%N) && echo $((e - s))",
        ),
    ];
    let mut times: Vec<[Vec<Duration>; 2]> = vec![Default::default(); workloads.len()];
    let mut host: [Vec<Duration>; 2] = Default::default();
    // The host loop with the inspector loaded and no sandbox registered.
    let mut host_idle: Vec<Duration> = Vec::new();
    for (_, script) in &workloads {
        sandbox.timed(script)?; // warm the page cache
    }
    for rep in 0..reps {
        let order = if rep % 2 == 0 {
            [true, false]
        } else {
            [false, true]
        };
        for attached in order {
            let loaded = if attached {
                let inspector = Inspector::load(config.clone()).context("load the inspector")?;
                host_idle.push(host_timed(workloads[1].1)?);
                inspector.register(id, &cgroup)?;
                Some(inspector)
            } else {
                None
            };
            for (w, (_, script)) in workloads.iter().enumerate() {
                times[w][usize::from(attached)].push(sandbox.timed(script)?);
            }
            // The same loop on the host, outside every sandbox: what the
            // programs cost the rest of the machine.
            host[usize::from(attached)].push(host_timed(workloads[1].1)?);
            if let Some(inspector) = loaded {
                inspector.turn_end(id)?;
                inspector.unregister(id)?;
                inspector.unload()?;
            }
        }
    }
    let _ = std::fs::remove_dir_all(&pin_dir);

    println!("inspector benchmark: crab sandbox ({DEVBOX}), {turns} turns per kind, {reps} workload runs each way, alternating");
    println!(
        "{:<52} {:>10} {:>10}",
        "turn-end decision latency (ms)", "p50", "p99"
    );
    let names = [
        "idle turn (baseline)",
        "10k syscalls, one file written byte by byte",
        "~10k syscalls, 1000 new files",
    ];
    for (k, name) in names.iter().enumerate() {
        let p50 = percentile(&mut lat[k], 50.0);
        let p99 = percentile(&mut lat[k], 99.0);
        println!("{:<52} {:>10} {:>10}", name, ms(p50), ms(p99));
    }
    println!(
        "{:<52} {:>10} {:>10} {:>8}",
        "workload in the sandbox, median of runs", "detached", "attached", "ratio"
    );
    for (w, (name, _)) in workloads.iter().enumerate() {
        let off = percentile(&mut times[w][0], 50.0);
        let on = percentile(&mut times[w][1], 50.0);
        println!(
            "{:<52} {:>10} {:>10} {:>8.3}",
            name,
            ms(off),
            ms(on),
            on.as_secs_f64() / off.as_secs_f64()
        );
    }
    let off = percentile(&mut host[0], 50.0);
    let on = percentile(&mut host[1], 50.0);
    let idle = percentile(&mut host_idle, 50.0);
    println!(
        "{:<52} {:>10} {:>10} {:>8.3}",
        "same syscall loop on the host, outside sandboxes",
        ms(off),
        ms(on),
        on.as_secs_f64() / off.as_secs_f64()
    );
    println!(
        "{:<52} {:>10} {:>10} {:>8.3}",
        "the same, inspector loaded, no sandbox registered",
        ms(off),
        ms(idle),
        idle.as_secs_f64() / off.as_secs_f64()
    );
    println!("targets: turn-end p99 < 1 ms for 10k syscalls; attached/detached < 1.03");
    println!("the published research system decides in 31-72 ms at the median");
    for full in &fulls {
        println!("note: a measured turn was classified full: {full}");
    }
    Ok(())
}

struct Sandbox<'a> {
    ctd: &'a Containerd,
    id: &'a str,
}

impl Sandbox<'_> {
    fn sh(&self, script: &str) -> anyhow::Result<String> {
        let out = self
            .ctd
            .ctr(&["task", "exec", "--exec-id", "b", self.id, "sh", "-c", script]);
        if !out.status.success() {
            bail!(
                "{script}: {}{}",
                String::from_utf8_lossy(&out.stdout),
                String::from_utf8_lossy(&out.stderr)
            );
        }
        Ok(String::from_utf8_lossy(&out.stdout).into_owned())
    }

    /// Runs a script that prints its own elapsed nanoseconds.
    fn timed(&self, script: &str) -> anyhow::Result<Duration> {
        let out = self.sh(script)?;
        let ns: u64 = out
            .trim()
            .parse()
            .with_context(|| format!("elapsed ns in {out:?}"))?;
        Ok(Duration::from_nanos(ns))
    }

    fn cgroup_dir(&self) -> anyhow::Result<PathBuf> {
        let pid = self.ctd.task_pid(self.id).context("task pid")?;
        let cg = std::fs::read_to_string(format!("/proc/{pid}/cgroup"))?;
        let rel = cg
            .lines()
            .find_map(|l| l.strip_prefix("0::"))
            .context("no unified cgroup line")?;
        Ok(unified_mount()?.join(rel.trim_start_matches('/')))
    }
}

/// Runs a timing script (prints its elapsed nanoseconds) on the host.
fn host_timed(script: &str) -> anyhow::Result<Duration> {
    let out = std::process::Command::new("sh").args(["-c", script]).output()?;
    let text = String::from_utf8_lossy(&out.stdout);
    let ns: u64 = text
        .trim()
        .parse()
        .with_context(|| format!("elapsed ns in {text:?}"))?;
    Ok(Duration::from_nanos(ns))
}
