//! Compiles `bpf/*.bpf.c` with clang (CO-RE, `-target bpfel`) against a
//! `vmlinux.h` that bpftool writes from the running kernel's BTF into
//! `OUT_DIR`. When clang, bpftool or the kernel's BTF is missing, an empty
//! object is written instead, so `cargo check` works anywhere; the loader
//! then reports `Error::NotBuilt`.

use std::path::{Path, PathBuf};
use std::process::Command;

fn main() {
    let out = PathBuf::from(std::env::var_os("OUT_DIR").expect("cargo sets OUT_DIR"));
    let object = out.join("inspector.bpf.o");
    for f in ["bpf/inspector.bpf.c", "bpf/crab_events.h"] {
        println!("cargo:rerun-if-changed={f}");
    }
    println!("cargo:rerun-if-changed=/sys/kernel/btf/vmlinux");
    if let Err(why) = build(&out, &object) {
        println!(
            "cargo:warning=crab-inspector: BPF programs not built ({why}); the inspector will refuse to load"
        );
        std::fs::write(&object, b"").expect("write the stub object");
    }
}

fn build(out: &Path, object: &Path) -> Result<(), String> {
    let vmlinux = out.join("vmlinux.h");
    let bpftool = ["bpftool", "/usr/sbin/bpftool", "/sbin/bpftool"]
        .into_iter()
        .find(|b| {
            Command::new(b)
                .arg("version")
                .output()
                .is_ok_and(|o| o.status.success())
        })
        .ok_or("bpftool not found")?;
    let dump = Command::new(bpftool)
        .args(["btf", "dump", "file", "/sys/kernel/btf/vmlinux", "format", "c"])
        .output()
        .map_err(|e| format!("run bpftool: {e}"))?;
    if !dump.status.success() {
        return Err(format!(
            "bpftool btf dump: {}",
            String::from_utf8_lossy(&dump.stderr)
        ));
    }
    std::fs::write(&vmlinux, dump.stdout).map_err(|e| format!("write vmlinux.h: {e}"))?;
    let arch = match std::env::var("CARGO_CFG_TARGET_ARCH").as_deref() {
        Ok("x86_64") => "x86",
        Ok(other) => return Err(format!("syscall numbers are written for x86_64, not {other}")),
        Err(_) => return Err("no target arch".into()),
    };
    let cc = Command::new("clang")
        .args(["-target", "bpfel", "-mcpu=v3", "-O2", "-g", "-Wall", "-Werror"])
        .arg(format!("-D__TARGET_ARCH_{arch}"))
        .arg("-I")
        .arg(out)
        .args(["-c", "bpf/inspector.bpf.c", "-o"])
        .arg(object)
        .output()
        .map_err(|e| format!("run clang: {e}"))?;
    if !cc.status.success() {
        // A compile error in our own C is a bug, not a missing tool: fail the build.
        panic!("clang failed:\n{}", String::from_utf8_lossy(&cc.stderr));
    }
    Ok(())
}
