//! `crab-bench faults`: issue 15.10's campaign, long. Seeded faults (SIGKILL
//! of the sandbox's init, of its shim, of containerd, and of crabd in the
//! middle of a checkpoint, a rollback, a fork, an export) over scripted
//! agent runs on stateful sandboxes, ten faults per sandbox (crabd gives up
//! on a fourth crash of one sandbox within a minute, by design). Prints,
//! per kind, the faults, how many were recovered, lost and leaked, and how
//! the interrupted operations ended; the targets are 100% / 0 / 0.

use std::collections::BTreeMap;

use crab_tests::faults::{self, Campaign, Kind};
use indicatif::{ProgressBar, ProgressStyle};

/// Faults per sandbox.
const PER_SANDBOX: usize = 10;

#[derive(Default)]
struct Row {
    faults: usize,
    lost: usize,
    leaked: usize,
    notes: BTreeMap<&'static str, usize>,
}

/// Runs `faults` seeded faults and prints the table.
pub fn run(faults: usize, seed: u64) -> anyhow::Result<()> {
    let mut ctd = faults::containerd();
    let bar = ProgressBar::new(faults as u64).with_style(
        ProgressStyle::with_template("{bar:40} {pos}/{len} faults {msg}").expect("a valid template"),
    );
    let mut rows: BTreeMap<Kind, Row> = BTreeMap::new();
    let mut failures = Vec::new();
    let mut end_lost = Vec::new();
    let mut end_leaked = Vec::new();
    let mut done = 0;
    let mut n = 0;
    while done < faults {
        n += 1;
        let id = format!("faulty{n}");
        let mut campaign = Campaign::start(&mut ctd, &id, seed.wrapping_add(n as u64));
        for _ in 0..PER_SANDBOX.min(faults - done) {
            // A round that panics (crabd never came back, say) is a loss,
            // not the end of the campaign.
            let o = match std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| campaign.round(None))) {
                Ok(o) => o,
                Err(e) => {
                    let why = e
                        .downcast_ref::<String>()
                        .cloned()
                        .or_else(|| e.downcast_ref::<&str>().map(|s| (*s).to_owned()))
                        .unwrap_or_else(|| "a panic".to_owned());
                    failures.push(format!("{id}: a round panicked: {why}"));
                    done += 1;
                    bar.inc(1);
                    continue;
                }
            };
            let row = rows.entry(o.kind).or_default();
            row.faults += 1;
            row.lost += usize::from(o.lost.is_some());
            row.leaked += usize::from(o.leaked.is_some());
            if !o.note.is_empty() {
                *row.notes.entry(o.note).or_default() += 1;
            }
            if o.lost.is_some() || o.leaked.is_some() {
                failures.push(format!("{id}: {o:?}"));
            }
            done += 1;
            bar.inc(1);
            bar.set_message(format!("{} lost or leaked", failures.len()));
        }
        let (lost, leaked) = campaign.finish();
        end_lost.extend(lost.into_iter().map(|l| format!("{id}: {l}")));
        end_leaked.extend(leaked.into_iter().map(|l| format!("{id}: {l}")));
    }
    bar.finish_and_clear();

    println!("fault campaign: {faults} faults, seed {seed:#x}, {n} sandboxes of {PER_SANDBOX} faults");
    println!(
        "{:<18} {:>7} {:>10} {:>6} {:>7}  how the operation ended",
        "fault", "faults", "recovered", "lost", "leaked"
    );
    let mut total = Row::default();
    for (kind, row) in &rows {
        let notes: Vec<String> = row.notes.iter().map(|(k, v)| format!("{k} {v}")).collect();
        println!(
            "{:<18} {:>7} {:>9.1}% {:>6} {:>7}  {}",
            kind.name(),
            row.faults,
            100.0 * (row.faults - row.lost) as f64 / row.faults.max(1) as f64,
            row.lost,
            row.leaked,
            notes.join(", ")
        );
        total.faults += row.faults;
        total.lost += row.lost;
        total.leaked += row.leaked;
    }
    println!(
        "{:<18} {:>7} {:>9.1}% {:>6} {:>7}",
        "all",
        total.faults,
        100.0 * (total.faults - total.lost) as f64 / total.faults.max(1) as f64,
        total.lost,
        total.leaked
    );
    println!(
        "at the end: {} acknowledged versions did not restore as acknowledged, {} sandboxes left something behind",
        end_lost.len(),
        end_leaked.len()
    );
    println!("targets: recovered 100%, lost 0, leaked 0");
    for f in failures.iter().chain(&end_lost).chain(&end_leaked) {
        println!("  {f}");
    }
    Ok(())
}
