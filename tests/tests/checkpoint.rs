//! `ctr task checkpoint` of a crab task: CRIU (4.x, from install-deps.sh)
//! dumps the processes into a containerd checkpoint image. Needs root: CI
//! runs it as root.

use crab_tests::leftovers::assert_clean;
use crab_tests::{stderr, wait_until, Containerd, CRAB};

#[test]
fn ctr_task_checkpoint_makes_an_image() {
    let ctd = Containerd::start();
    ctd.run_detached(
        CRAB,
        "ck",
        &[
            "sh",
            "-c",
            // Written through a rename: a reader never sees it half-written.
            "i=0; while true; do i=$((i+1)); echo $i > /tmp/n.new; mv /tmp/n.new /tmp/n; sleep 0.05; done",
        ],
    );
    let read = |n: &str| -> u64 {
        let out = ctd.ctr_ok(&["task", "exec", "--exec-id", n, "ck", "cat", "/tmp/n"]);
        out.trim().parse().expect("a number")
    };
    let before = read("r1");
    // On a host whose /run is not tmpfs, the shim's runtime helper gives
    // CRIU its kernel-data cache, stamped for this boot (removed here so
    // that a helper of this run makes it again).
    let plain_run =
        nix::sys::statfs::statfs("/run").is_ok_and(|s| s.filesystem_type() != nix::sys::statfs::TMPFS_MAGIC);
    if plain_run {
        let _ = std::fs::remove_file("/run/criu.kdat.crab");
        let _ = std::fs::remove_file("/run/criu.kdat");
    }
    let out = ctd.ctr(&["task", "checkpoint", "ck"]);
    assert!(out.status.success(), "{}", stderr(&out));
    let image = String::from_utf8_lossy(&out.stdout).trim().to_owned();
    assert!(image.starts_with("containerd.io/checkpoint/ck:"), "{image}");
    assert!(ctd.ctr_ok(&["image", "ls", "-q"]).lines().any(|l| l == image));
    // Left running, and no longer paused: the counter goes on. (ctr sends
    // its --exit and --image-path only to runc runtimes, so they are not
    // exercised here.)
    assert_eq!(ctd.task_status("ck").as_deref(), Some("RUNNING"));
    if plain_run {
        let boot = std::fs::read_to_string("/proc/sys/kernel/random/boot_id").expect("boot id");
        let stamp = std::fs::read_to_string("/run/criu.kdat.crab").expect("the cache's stamp");
        assert!(
            stamp.starts_with(&format!("boot {}\n", boot.trim())) && !stamp.ends_with("failed\n"),
            "{stamp}"
        );
        assert!(std::path::Path::new("/run/criu.kdat").is_file());
    }
    assert!(wait_until(10, || (read(&crab_tests::unique("r")) > before).then_some(())).is_some());

    ctd.remove("ck");
    assert_clean(&ctd.scope(), &["ck"]);
}
