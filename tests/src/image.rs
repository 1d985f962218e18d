//! The test image: busybox-static as a one-layer OCI archive, built once into
//! the target directory (no registry is reachable on the test machines).

use std::path::PathBuf;
use std::process::Command;
use std::sync::OnceLock;

/// The fixtures directory (scripts that build images, sandboxes' programs).
pub fn fixtures_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("fixtures")
}

/// The image reference tests run.
pub const BUSYBOX: &str = "docker.io/crab/busybox:test";

/// The OCI image layout archive of [`BUSYBOX`] (`ctr image import`, `docker load`).
pub fn busybox_archive() -> &'static PathBuf {
    static ARCHIVE: OnceLock<PathBuf> = OnceLock::new();
    ARCHIVE.get_or_init(|| mkimage("busybox", BUSYBOX, None))
}

/// The archive `fixtures/mkimage.sh` builds of `reference` (with `cmd` as
/// its Cmd, JSON), once per script content: `crab-test-<stem>-<hash>.tar`.
fn mkimage(stem: &str, reference: &str, cmd: Option<&str>) -> PathBuf {
    // Named by the script's content, so a changed script rebuilds it.
    let hash = {
        use std::hash::{Hash, Hasher};
        let mut h = std::collections::hash_map::DefaultHasher::new();
        include_str!("../fixtures/mkimage.sh").hash(&mut h);
        h.finish()
    };
    let path = crate::bin_dir().join(format!("crab-test-{stem}-{hash:016x}.tar"));
    if !path.exists() {
        // Concurrent test processes each build their own copy and rename
        // it into place; rename is atomic, so readers see a whole file.
        let tmp = path.with_extension(format!("tmp{}", std::process::id()));
        let mut script = Command::new(fixtures_dir().join("mkimage.sh"));
        if let Some(cmd) = cmd {
            script.env("MKIMAGE_CMD", cmd);
        }
        crate::ok(script.arg(&tmp).arg(reference).output().expect("run mkimage.sh"));
        std::fs::rename(&tmp, &path).expect("publish image archive");
    }
    path
}

/// The image reference of busybox plus Python and the official SDKs.
pub const PYTHON_SDK: &str = "docker.io/crab/python-sdk:test";

/// An image of busybox plus the host's Python and the SDK venv of
/// `packaging/install-deps.sh` (`fixtures/mkpython.sh`), built once.
pub fn python_sdk_archive() -> &'static PathBuf {
    static ARCHIVE: OnceLock<PathBuf> = OnceLock::new();
    ARCHIVE.get_or_init(|| {
        layered_archive(
            "python",
            PYTHON_SDK,
            "mkpython.sh",
            include_str!("../fixtures/mkpython.sh"),
        )
    })
}

/// Builds (once per content of the scripts) the archive of busybox plus
/// the layer that `fixtures/<script>` makes, as image `reference`.
fn layered_archive(kind: &str, reference: &str, script: &str, script_text: &str) -> PathBuf {
    let hash = {
        use std::hash::{Hash, Hasher};
        let mut h = std::collections::hash_map::DefaultHasher::new();
        include_str!("../fixtures/mkimage.sh").hash(&mut h);
        script_text.hash(&mut h);
        h.finish()
    };
    let path = crate::bin_dir().join(format!("crab-test-{kind}-{hash:016x}.tar"));
    if !path.exists() {
        let fixtures = fixtures_dir();
        let layer = path.with_extension(format!("layer{}", std::process::id()));
        crate::ok(
            Command::new(fixtures.join(script))
                .arg(&layer)
                .output()
                .unwrap_or_else(|e| panic!("run {script}: {e}")),
        );
        // Concurrent test processes each build their own copy and rename
        // it into place; rename is atomic, so readers see a whole file.
        let tmp = path.with_extension(format!("tmp{}", std::process::id()));
        let out = Command::new(fixtures.join("mkimage.sh"))
            .arg(&tmp)
            .arg(reference)
            .arg(&layer)
            .output()
            .expect("run mkimage.sh");
        let _ = std::fs::remove_dir_all(&layer);
        crate::ok(out);
        std::fs::rename(&tmp, &path).expect("publish image archive");
    }
    path
}

/// The image reference of the development sandbox: busybox plus `lib`,
/// `lib64` and `usr` mount points, for containers that bind the host's
/// `/usr` read-only (`--mount type=bind,src=/usr,dst=/usr,options=rbind:ro`)
/// and so get its git, gcc, python3, sqlite3 and coreutils.
pub const DEVBOX: &str = "docker.io/crab/devbox:test";

/// The OCI archive of [`DEVBOX`], built once (`fixtures/mkdevbox.sh`).
pub fn devbox_archive() -> &'static PathBuf {
    static ARCHIVE: OnceLock<PathBuf> = OnceLock::new();
    ARCHIVE.get_or_init(|| {
        layered_archive(
            "devbox",
            DEVBOX,
            "mkdevbox.sh",
            include_str!("../fixtures/mkdevbox.sh"),
        )
    })
}

/// The image reference of the pods' sandbox (pause) container.
pub const PAUSE: &str = "docker.io/crab/pause:test";

/// The pause image: busybox whose command sleeps for ever (containerd's
/// CRI `sandbox_image`; nothing is pulled), built once.
pub fn pause_archive() -> &'static PathBuf {
    static ARCHIVE: OnceLock<PathBuf> = OnceLock::new();
    ARCHIVE.get_or_init(|| mkimage("pause", PAUSE, Some(r#"["sleep","2147483647"]"#)))
}
