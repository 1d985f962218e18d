//! The test image: busybox-static as a one-layer OCI archive, built once into
//! the target directory (no registry is reachable on the test machines).

use std::path::PathBuf;
use std::process::Command;
use std::sync::OnceLock;

/// The image reference tests run.
pub const BUSYBOX: &str = "docker.io/crab/busybox:test";

/// The OCI image layout archive of [`BUSYBOX`] (`ctr image import`, `docker load`).
pub fn busybox_archive() -> &'static PathBuf {
    static ARCHIVE: OnceLock<PathBuf> = OnceLock::new();
    ARCHIVE.get_or_init(|| {
        // Named by the script's content, so a changed script rebuilds it.
        let hash = {
            use std::hash::{Hash, Hasher};
            let mut h = std::collections::hash_map::DefaultHasher::new();
            include_str!("../fixtures/mkimage.sh").hash(&mut h);
            h.finish()
        };
        let path = crate::bin_dir().join(format!("crab-test-busybox-{hash:016x}.tar"));
        if !path.exists() {
            // Concurrent test processes each build their own copy and rename
            // it into place; rename is atomic, so readers see a whole file.
            let tmp = path.with_extension(format!("tmp{}", std::process::id()));
            let script = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("fixtures/mkimage.sh");
            crate::ok(
                Command::new(script)
                    .arg(&tmp)
                    .arg(BUSYBOX)
                    .output()
                    .expect("run mkimage.sh"),
            );
            std::fs::rename(&tmp, &path).expect("publish image archive");
        }
        path
    })
}
