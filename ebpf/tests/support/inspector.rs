//! Test helper: a private inspector (its own pin directory, unloaded at
//! the end, also when the test fails).

use std::path::PathBuf;
use std::time::Duration;

use crab_inspector::{Inspector, InspectorConfig};

/// A private inspector, its pins under `/sys/fs/bpf/crab-test-<unique>`,
/// unloaded (pins removed) on drop, also when the test fails.
pub struct TestInspector {
    inspector: Option<Inspector>,
    pin_dir: PathBuf,
}

impl std::ops::Deref for TestInspector {
    type Target = Inspector;
    fn deref(&self) -> &Inspector {
        self.inspector.as_ref().expect("present until drop")
    }
}

impl TestInspector {
    /// Where its programs and maps are pinned.
    #[allow(dead_code)] // not every test binary asks
    pub fn pin_dir(&self) -> &std::path::Path {
        &self.pin_dir
    }
}

impl Drop for TestInspector {
    fn drop(&mut self) {
        if let Some(i) = self.inspector.take() {
            let _ = i.unload();
        }
        let _ = std::fs::remove_dir_all(&self.pin_dir);
    }
}

/// Loads a private inspector.
pub fn inspector(noisy: &[&str], ring_bytes: u32, background: bool) -> TestInspector {
    let pin_dir = PathBuf::from(format!("/sys/fs/bpf/{}", crab_tests::unique("crab-test-")));
    let config = InspectorConfig {
        pin_dir: pin_dir.clone(),
        ring_bytes,
        noisy_comms: noisy.iter().map(|s| s.to_string()).collect(),
        drain_timeout: Duration::from_millis(200),
        max_reasons: 64,
        background_drain: background,
    };
    // The guard first: a failed load leaves a pin directory too.
    let mut guard = TestInspector {
        inspector: None,
        pin_dir,
    };
    guard.inspector = Some(Inspector::load(config).expect("load the inspector (needs root)"));
    guard
}
