//! Compiles `init/src/main.rs` (crab-init, the sandbox's pid 1) into a
//! static binary that the shim embeds: the container's root may have no
//! libc, so it cannot be the workspace's dynamically linked build.

use std::path::PathBuf;
use std::process::Command;

fn main() {
    let source = PathBuf::from(std::env::var_os("CARGO_MANIFEST_DIR").expect("cargo sets it"))
        .join("../init/src/main.rs");
    println!("cargo:rerun-if-changed={}", source.display());
    let out = PathBuf::from(std::env::var_os("OUT_DIR").expect("cargo sets OUT_DIR")).join("crab-init");
    let rustc = std::env::var_os("RUSTC").unwrap_or_else(|| "rustc".into());
    let status = Command::new(rustc)
        .args([
            "--edition",
            "2021",
            "--crate-name",
            "crab_init",
            "--crate-type",
            "bin",
        ])
        .args(["-C", "opt-level=s", "-C", "panic=abort", "-C", "strip=symbols"])
        .args(["-C", "target-feature=+crt-static"])
        .arg("-o")
        .arg(&out)
        .arg(&source)
        .status()
        .expect("run rustc for crab-init");
    assert!(status.success(), "rustc failed to build the static crab-init");
}
