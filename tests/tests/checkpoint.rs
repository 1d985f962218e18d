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
    let out = ctd.ctr(&["task", "checkpoint", "ck"]);
    assert!(out.status.success(), "{}", stderr(&out));
    let image = String::from_utf8_lossy(&out.stdout).trim().to_owned();
    assert!(image.starts_with("containerd.io/checkpoint/ck:"), "{image}");
    assert!(ctd.ctr_ok(&["image", "ls", "-q"]).lines().any(|l| l == image));
    // Left running, and no longer paused: the counter goes on. (ctr sends
    // its --exit and --image-path only to runc runtimes, so they are not
    // exercised here.)
    assert_eq!(ctd.task_status("ck").as_deref(), Some("RUNNING"));
    assert!(wait_until(10, || (read(&crab_tests::unique("r")) > before).then_some(())).is_some());

    ctd.remove("ck");
    assert_clean(&ctd.scope(), &["ck"]);
}
