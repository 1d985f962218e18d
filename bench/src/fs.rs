//! `crab-bench fs`: what issue 3 promises, per backend, against copying the
//! whole tree (`cp -a`) of the same sandbox in the same run:
//!
//! - snapshot latency and bytes written for a 1-file change;
//! - rollback latency to the snapshot before that change;
//! - bytes stored after N turns that each change 1% of the files, against
//!   N full copies (one real `cp -a`, measured, times N).
//!
//! Bytes written are the growth of the space the backend's filesystem uses
//! across the operation (after a sync; for ZFS after its transaction group
//! is written out), except overlay-copy, where they are the bytes of files
//! the new snapshot does not share by hard link. Timings are wall clock of
//! one operation each, so run it on an otherwise idle machine.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use crab_snapshotter::{Backend, BtrfsBackend, OverlayCopyBackend, SnapshotName, ZfsBackend};
use crab_tests::zfs::{Pool, ZfsFuse};

use crate::stats::ms;

/// One backend's figures.
struct Figures {
    name: &'static str,
    snapshot: Duration,
    snapshot_bytes: u64,
    rollback: Duration,
    stored_after_turns: u64,
}

/// Runs the benchmark and prints its table.
pub fn run(mb: usize, files: usize, turns: usize) -> anyhow::Result<()> {
    let root = PathBuf::from(format!("/tmp/crab-bench-fs-{}", std::process::id()));
    std::fs::create_dir_all(&root)?;
    let res = run_in(&root, mb, files, turns);
    let _ = std::fs::remove_dir_all(&root);
    res
}

fn run_in(root: &Path, mb: usize, files: usize, turns: usize) -> anyhow::Result<()> {
    let file_size = mb * 1024 * 1024 / files.max(1);
    let per_turn = (files / 100).max(1);
    let mut rows = Vec::new();

    // Baseline: a full copy of the tree on the host filesystem.
    let base_tree = root.join("tree");
    std::fs::create_dir_all(&base_tree)?;
    populate(&base_tree, files, file_size)?;
    let before = free_bytes(root)?;
    let t = Instant::now();
    let out = Command::new("cp")
        .arg("-a")
        .arg(&base_tree)
        .arg(root.join("copy"))
        .status()?;
    if !out.success() {
        bail!("cp -a failed");
    }
    sync(root)?;
    let copy_time = t.elapsed();
    let copy_bytes = before.saturating_sub(free_bytes(root)?);
    std::fs::remove_dir_all(root.join("copy"))?;
    std::fs::remove_dir_all(&base_tree)?;

    // overlay-copy on the host filesystem.
    {
        let upper = root.join("ov/upper");
        std::fs::create_dir_all(&upper)?;
        populate(&upper, files, file_size)?;
        let store = root.join("ov/store");
        let b = OverlayCopyBackend::new(&upper, &store);
        rows.push(measure(
            "overlay-copy",
            &b,
            &upper,
            files,
            per_turn,
            turns,
            &|_| du_unique(&store),
        )?);
    }

    // btrfs on a loop device.
    {
        let img = root.join("btrfs.img");
        let mnt = root.join("btrfs");
        std::fs::create_dir_all(&mnt)?;
        sh(
            "truncate",
            &["-s", &format!("{}M", mb * 3 + 512), &img.to_string_lossy()],
        )?;
        sh("mkfs.btrfs", &["-q", &img.to_string_lossy()])?;
        sh(
            "mount",
            &["-o", "loop", &img.to_string_lossy(), &mnt.to_string_lossy()],
        )?;
        let res = (|| {
            let b = BtrfsBackend::create(&mnt.join("sb"))?;
            let live = b.live_path()?;
            populate(&live, files, file_size)?;
            measure("btrfs", &b, &live, files, per_turn, turns, &|_| used_bytes(&mnt))
        })();
        let _ = nix::mount::umount(&mnt);
        rows.push(res?);
    }

    // ZFS on zfs-fuse (user space: expect it to be the slowest).
    {
        let _zfs = ZfsFuse::start();
        let pool = Pool::create(&format!("{}M", mb * 3 + 512));
        let b = ZfsBackend::create(&format!("{}/sb", pool.name))?;
        let live = b.live_path()?;
        populate(&live, files, file_size)?;
        let name = pool.name.clone();
        rows.push(measure(
            "zfs (zfs-fuse)",
            &b,
            &live,
            files,
            per_turn,
            turns,
            &|_| zfs_used(&name),
        )?);
    }

    println!(
        "filesystem benchmark: a {mb} MB tree of {files} files; one turn changes 1 file (snapshot) or {per_turn} files ({turns} turns)"
    );
    println!(
        "{:<16} {:>14} {:>16} {:>14} {:>22} {:>22}",
        "backend", "snapshot (ms)", "snapshot bytes", "rollback (ms)", "stored after turns", "vs full copies"
    );
    let full = copy_bytes * turns as u64;
    println!(
        "{:<16} {:>14} {:>16} {:>14} {:>22} {:>22}",
        "cp -a (baseline)",
        ms(copy_time),
        copy_bytes,
        ms(copy_time),
        full,
        "1.000"
    );
    for r in &rows {
        println!(
            "{:<16} {:>14} {:>16} {:>14} {:>22} {:>22.4}",
            r.name,
            ms(r.snapshot),
            r.snapshot_bytes,
            ms(r.rollback),
            r.stored_after_turns,
            r.stored_after_turns as f64 / full.max(1) as f64
        );
    }
    println!("targets: snapshot of a 1-file change under 20 ms on btrfs and overlay-copy, bytes in proportion to the change");
    Ok(())
}

/// Measures one backend whose live tree `live` is populated.
fn measure(
    name: &'static str,
    b: &dyn Backend,
    live: &Path,
    files: usize,
    per_turn: usize,
    turns: usize,
    stored: &dyn Fn(&Path) -> anyhow::Result<u64>,
) -> anyhow::Result<Figures> {
    let n = |s: &str| SnapshotName::new(s).context("name");
    b.snapshot(&n("base")?)?;
    let before = stored(live)?;
    std::fs::write(live.join("f0"), b"one changed file")?;
    let t = Instant::now();
    b.snapshot(&n("one")?)?;
    let snapshot = t.elapsed();
    let snapshot_bytes = stored(live)?.saturating_sub(before);
    let t = Instant::now();
    b.rollback(&n("base")?)?;
    let rollback = t.elapsed();
    // Turns that each change 1% of the files, with a snapshot after each.
    let live = b.live_path()?;
    let start = stored(&live)?;
    for turn in 0..turns {
        for k in 0..per_turn {
            let f = (turn * per_turn + k) % files;
            std::fs::write(
                live.join(format!("f{f}")),
                format!("turn {turn} file {f}").repeat(64),
            )?;
        }
        b.snapshot(&n(&format!("turn{turn}"))?)?;
    }
    let stored_after_turns = stored(&live)?.saturating_sub(start);
    Ok(Figures {
        name,
        snapshot,
        snapshot_bytes,
        rollback,
        stored_after_turns,
    })
}

/// Fills `dir` with `files` files of `size` bytes of varied content.
fn populate(dir: &Path, files: usize, size: usize) -> anyhow::Result<()> {
    let mut block = vec![0u8; size];
    for i in 0..files {
        for (j, b) in block.iter_mut().enumerate() {
            *b = ((i * 31 + j * 7) % 251) as u8;
        }
        std::fs::write(dir.join(format!("f{i}")), &block)?;
    }
    sync(dir)
}

/// Bytes of distinct inodes under `dir` (hard links counted once).
fn du_unique(dir: &Path) -> anyhow::Result<u64> {
    let out = Command::new("du").arg("-sb").arg(dir).output()?;
    let text = String::from_utf8_lossy(&out.stdout);
    Ok(text.split_whitespace().next().unwrap_or("0").parse()?)
}

/// Space the pool uses, after its open transaction group is written out
/// (every 5 s at most): zfs-fuse's accounting lags until then.
fn zfs_used(pool: &str) -> anyhow::Result<u64> {
    std::thread::sleep(Duration::from_secs(6));
    let out = crab_tests::zfs::cmd("zfs")
        .args(["get", "-H", "-p", "-o", "value", "used", pool])
        .output()?;
    Ok(String::from_utf8_lossy(&out.stdout).trim().parse()?)
}

fn used_bytes(path: &Path) -> anyhow::Result<u64> {
    sync(path)?;
    let st = nix::sys::statvfs::statvfs(path)?;
    Ok((st.blocks() - st.blocks_free()) as u64 * st.fragment_size() as u64)
}

fn free_bytes(path: &Path) -> anyhow::Result<u64> {
    let st = nix::sys::statvfs::statvfs(path)?;
    Ok(st.blocks_available() as u64 * st.fragment_size() as u64)
}

fn sync(path: &Path) -> anyhow::Result<()> {
    let f = std::fs::File::open(path)?;
    use std::os::fd::AsRawFd;
    nix::unistd::syncfs(f.as_raw_fd())?;
    Ok(())
}

fn sh(cmd: &str, args: &[&str]) -> anyhow::Result<()> {
    let out = Command::new(cmd).args(args).output()?;
    if !out.status.success() {
        bail!("{cmd} {args:?}: {}", String::from_utf8_lossy(&out.stderr));
    }
    Ok(())
}
