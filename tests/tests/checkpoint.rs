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

/// containerd asks State of every task for `ctr task ls` (and `docker
/// ps`, the kubelet) within a deadline (`io.containerd.timeout.task.state`,
/// 1 s here): a crabd checkpoint that holds the container longer (60 MB of
/// random data in `/dev/shm`, which CRIU saves with tar and gzip) must
/// leave the task listed, and running, all along.
#[test]
fn a_long_checkpoint_leaves_the_task_listed_running() {
    use crab_tests::sandbox::{crabctl_ok, wait_registered};
    use std::sync::atomic::{AtomicBool, Ordering};
    use std::time::Instant;

    let ctd = Containerd::start_with("[timeouts]\n  \"io.containerd.timeout.task.state\" = \"1s\"\n");
    ctd.run_detached(
        CRAB,
        "slow",
        &[
            "sh",
            "-c",
            "head -c 60000000 /dev/urandom > /dev/shm/blob && touch /tmp/ready; exec sleep 100000",
        ],
    );
    wait_registered(&ctd, "slow");
    let pid = ctd.task_pid("slow").expect("the task runs");
    // The blob is written.
    crab_tests::sandbox::wait_for_file(pid, "/tmp/ready", 60);

    let done = AtomicBool::new(false);
    let (seen, began, ended) = std::thread::scope(|s| {
        let lister = s.spawn(|| {
            let mut seen = Vec::new();
            while !done.load(Ordering::SeqCst) {
                let asked = Instant::now();
                let out = ctd.ctr_ok(&["task", "ls"]);
                let status = out
                    .lines()
                    .find(|l| l.split_whitespace().next() == Some("slow"))
                    .and_then(|l| l.split_whitespace().last())
                    .unwrap_or("missing")
                    .to_owned();
                seen.push((asked, Instant::now(), status));
            }
            seen
        });
        let began = Instant::now();
        crabctl_ok(&ctd, &["checkpoint", "slow"]);
        let ended = Instant::now();
        done.store(true, Ordering::SeqCst);
        (lister.join().expect("the lister"), began, ended)
    });
    let within = seen.iter().filter(|(a, b, _)| *a >= began && *b <= ended).count();
    assert!(
        within > 0,
        "no listing began and ended within the checkpoint ({:?})",
        ended - began
    );
    let statuses: Vec<&str> = seen.iter().map(|(_, _, s)| s.as_str()).collect();
    assert!(statuses.iter().all(|s| *s == "RUNNING"), "{statuses:?}");

    ctd.remove("slow");
    assert_clean(&ctd.scope(), &["slow"]);
}
