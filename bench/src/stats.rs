//! Small summaries of samples.

use std::time::Duration;

/// Percentile `p` (0–100) of `samples` (sorted in place).
pub fn percentile(samples: &mut [Duration], p: f64) -> Duration {
    if samples.is_empty() {
        return Duration::ZERO;
    }
    samples.sort();
    let idx = ((p / 100.0) * (samples.len() - 1) as f64).round() as usize;
    samples[idx.min(samples.len() - 1)]
}

/// Percentile `p` (0–100) of `samples` (sorted in place); NaN when empty.
pub fn percentile_f64(samples: &mut [f64], p: f64) -> f64 {
    if samples.is_empty() {
        return f64::NAN;
    }
    samples.sort_by(f64::total_cmp);
    let idx = ((p / 100.0) * (samples.len() - 1) as f64).round() as usize;
    samples[idx.min(samples.len() - 1)]
}

/// Milliseconds with two decimals.
pub fn ms(d: Duration) -> String {
    format!("{:.2}", d.as_secs_f64() * 1000.0)
}

/// The least-squares line `y = a + b·x` through `points` (finite ones
/// only): `(a, b)`, or none for fewer than two distinct x.
pub fn fit(points: &[(f64, f64)]) -> Option<(f64, f64)> {
    let pts: Vec<(f64, f64)> = points
        .iter()
        .copied()
        .filter(|(x, y)| x.is_finite() && y.is_finite())
        .collect();
    let n = pts.len() as f64;
    let mx = pts.iter().map(|p| p.0).sum::<f64>() / n;
    let my = pts.iter().map(|p| p.1).sum::<f64>() / n;
    let sxx: f64 = pts.iter().map(|p| (p.0 - mx).powi(2)).sum();
    if pts.len() < 2 || sxx <= f64::EPSILON {
        return None;
    }
    let sxy: f64 = pts.iter().map(|p| (p.0 - mx) * (p.1 - my)).sum();
    let b = sxy / sxx;
    Some((my - b * mx, b))
}

/// CPU time the whole host has spent busy so far (user, nice, system, irq
/// and softirq of every CPU, from `/proc/stat`; idle, I/O wait and time
/// the hypervisor stole are not busy); zero when it cannot be read.
pub fn host_busy() -> Duration {
    let Ok(stat) = std::fs::read_to_string("/proc/stat") else {
        return Duration::ZERO;
    };
    let Some(line) = stat.lines().find(|l| l.starts_with("cpu ")) else {
        return Duration::ZERO;
    };
    let ticks: Vec<u64> = line
        .split_whitespace()
        .skip(1)
        .map_while(|v| v.parse().ok())
        .collect();
    // user nice system idle iowait irq softirq steal …
    let busy: u64 = [0, 1, 2, 5, 6].iter().filter_map(|&i| ticks.get(i)).sum();
    Duration::from_millis(busy * 1000 / clock_ticks())
}

/// The kernel's clock ticks per second (`/proc`'s CPU times' unit).
pub fn clock_ticks() -> u64 {
    nix::unistd::sysconf(nix::unistd::SysconfVar::CLK_TCK)
        .ok()
        .flatten()
        .filter(|t| *t > 0)
        .unwrap_or(100) as u64
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_host_is_busy_while_this_process_computes() {
        let before = host_busy();
        assert!(before > Duration::ZERO, "read /proc/stat");
        let start = std::time::Instant::now();
        let mut x = 0u64;
        while start.elapsed() < Duration::from_millis(300) {
            x = std::hint::black_box(x.wrapping_mul(31).wrapping_add(7));
        }
        assert!(host_busy() > before);
    }

    #[test]
    fn the_line_through_exact_points_is_found_and_too_few_give_none() {
        let (a, b) = fit(&[(8.0, 1.02), (16.0, 1.04), (32.0, 1.08)]).unwrap();
        assert!((a - 1.0).abs() < 1e-9 && (b - 0.0025).abs() < 1e-9, "{a} {b}");
        assert_eq!(fit(&[(8.0, 1.0)]), None);
        assert_eq!(fit(&[(8.0, 1.0), (8.0, 2.0)]), None);
        // A density whose figure is unknown does not spoil the line.
        let (_, b) = fit(&[(8.0, 1.0), (16.0, f64::NAN), (32.0, 2.0)]).unwrap();
        assert!((b - 1.0 / 24.0).abs() < 1e-9);
    }
}
