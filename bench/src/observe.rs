//! What a benchmark reads back from a run: crabd's metrics and the holds
//! a sandbox's transcript records.

use std::path::Path;
use std::time::Duration;

use crab_tests::Containerd;

/// crabd's metrics (`crabctl metrics`), by series: `name{labels}` and value.
pub fn metrics(ctd: &Containerd) -> Vec<(String, f64)> {
    let out = crab_tests::sandbox::crabctl(ctd, &["metrics"]);
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .filter(|l| !l.starts_with('#'))
        .filter_map(|l| {
            let (k, v) = l.rsplit_once(' ')?;
            Some((k.to_owned(), v.parse().ok()?))
        })
        .collect()
}

/// The turn records of a sandbox's transcript (none if it cannot be read).
pub fn turn_records(path: &Path) -> Vec<serde_json::Value> {
    std::fs::read_to_string(path)
        .unwrap_or_default()
        .lines()
        .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
        .filter(|v| v["kind"] == "turn")
        .collect()
}

/// Each turn's hold (how long its answer waited for its version), from a
/// sandbox's transcript.
pub fn holds(path: &Path) -> Vec<Duration> {
    turn_records(path)
        .iter()
        .map(|v| Duration::from_micros(v["timing"]["hold_us"].as_u64().unwrap_or(0)))
        .collect()
}
