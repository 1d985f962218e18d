//! How fast the disk under crabd's root takes durable writes: measured once
//! (32 MiB written and fsynced) and kept in `<root>/disk-probe.json`, the
//! default of the checkpoint queue's byte budget.

use std::io::Write;
use std::path::Path;
use std::time::Instant;

use serde::{Deserialize, Serialize};

const PROBE_BYTES: usize = 32 << 20;

/// What the probe measured.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub(super) struct DiskProbe {
    /// Bytes per second written and fsynced.
    pub write_bytes_per_sec: f64,
}

/// The probe kept under `root`, or a new one (then kept). `None` when the
/// disk cannot be measured (logged): no budget then.
pub(super) fn load_or_measure(root: &Path) -> Option<DiskProbe> {
    let kept = root.join("disk-probe.json");
    if let Some(p) = std::fs::read(&kept)
        .ok()
        .and_then(|b| serde_json::from_slice::<DiskProbe>(&b).ok())
        .filter(|p| p.write_bytes_per_sec.is_finite() && p.write_bytes_per_sec > 0.0)
    {
        return Some(p);
    }
    match measure(root) {
        Ok(p) => {
            tracing::info!(mb_per_sec = p.write_bytes_per_sec / 1e6, "disk probe");
            let json = serde_json::to_vec(&p).expect("a probe serializes");
            if let Err(e) = std::fs::write(&kept, json) {
                tracing::warn!(path = %kept.display(), error = %e, "disk probe not kept");
            }
            Some(p)
        }
        Err(e) => {
            tracing::warn!(error = %e, "disk probe failed: checkpoints have no byte budget");
            None
        }
    }
}

fn measure(root: &Path) -> std::io::Result<DiskProbe> {
    let path = root.join(".disk-probe");
    let chunk = vec![0x5a_u8; 1 << 20];
    let started = Instant::now();
    let result = (|| {
        let mut f = std::fs::File::create(&path)?;
        for _ in 0..PROBE_BYTES / chunk.len() {
            f.write_all(&chunk)?;
        }
        f.sync_all()
    })();
    let secs = started.elapsed().as_secs_f64().max(1e-6);
    let _ = std::fs::remove_file(&path);
    result?;
    Ok(DiskProbe {
        write_bytes_per_sec: PROBE_BYTES as f64 / secs,
    })
}
