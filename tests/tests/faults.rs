//! The fault campaign, short (issue 15.10; `crab-bench faults` runs 200):
//! each kind of fault once, in order, then three seeded ones, on two
//! stateful sandboxes under real containerd, crabd and CRIU (crabd's root on a
//! loop filesystem of its own, which the disk-full fault fills). After each, the
//! sandbox runs with an acknowledged state, nothing is torn and nothing is
//! left running or frozen; at the end every acknowledged version restores
//! state-verified and nothing remains. Needs root: CI runs it as root.

use crab_tests::faults::{self, Campaign, Kind};
use crab_tests::image::BUSYBOX;
use crab_tests::leftovers::assert_clean;
use crab_tests::{wait_until, Containerd, CRAB};

#[test]
fn every_fault_loses_nothing_acknowledged_and_leaks_nothing() {
    let mut ctd = faults::containerd();
    // Two sandboxes: crabd gives up on one that crashes a fourth time
    // within a minute (and a campaign keeps to two crashes each).
    let during = [Kind::ShimCheckpoint, Kind::ShimRollback];
    let first: Vec<Option<Kind>> = Kind::ALL
        .into_iter()
        .filter(|k| !during.contains(k))
        .map(Some)
        .chain([None, None, None])
        .collect();
    let mut outcomes = Vec::new();
    let mut lost = Vec::new();
    let mut leaked = Vec::new();
    for (id, kinds) in [("faulty", first), ("faulty2", during.map(Some).to_vec())] {
        let mut campaign = Campaign::start(&mut ctd, id, 0x0fa0_17ed);
        for kind in kinds {
            let o = campaign.round(kind);
            eprintln!(
                "{id:<8} {:<17} after {:>4} ms ({}): lost {:?}, leaked {:?}",
                o.kind.name(),
                o.delay.as_millis(),
                o.note,
                o.lost,
                o.leaked
            );
            outcomes.push(o);
        }
        let (l, k) = campaign.finish();
        lost.extend(l);
        leaked.extend(k);
    }
    let bad: Vec<_> = outcomes
        .iter()
        .filter(|o| o.lost.is_some() || o.leaked.is_some())
        .collect();
    assert!(bad.is_empty(), "faults that lost or leaked: {bad:#?}");
    assert!(lost.is_empty(), "acknowledged versions lost: {lost:#?}");
    assert!(leaked.is_empty(), "left behind: {leaked:#?}");
}

/// What a killed crabd was making is settled by the next crabd before it
/// serves: a container of that making whose task never started is removed
/// with its snapshot; one whose task runs is kept; a container of the same
/// id that the making did not make (no label of its) is left alone.
/// Deterministic: the records and labels are written as a crabd killed
/// between `begin_making` and the task's start leaves them.
#[test]
fn a_restarted_crabd_settles_what_the_killed_one_was_making() {
    let mut ctd = Containerd::start();
    ctd.start_crabd();
    let label = |id: &str| format!("io.crab.making={id}.1");
    ctd.ctr_ok(&[
        "container",
        "create",
        "--label",
        &label("half"),
        "--runtime",
        CRAB,
        BUSYBOX,
        "half",
        "sleep",
        "300",
    ]);
    ctd.ctr_ok(&[
        "container",
        "create",
        "--runtime",
        CRAB,
        BUSYBOX,
        "stranger",
        "sleep",
        "300",
    ]);
    ctd.ctr_ok(&[
        "run",
        "-d",
        "--label",
        &label("whole"),
        "--runtime",
        CRAB,
        BUSYBOX,
        "whole",
        "sleep",
        "300",
    ]);
    let making = ctd.crabd_root().join("making");
    std::fs::create_dir_all(&making).unwrap();
    for id in ["half", "stranger", "whole"] {
        let record = serde_json::json!({
            "token": format!("{id}.1"),
            "address": ctd.address(),
            "namespace": ctd.namespace,
            "snapshotter": "overlayfs",
            "id": id,
            "import_version": null,
            "transcript": null,
        });
        std::fs::write(making.join(format!("{id}.1.json")), record.to_string()).unwrap();
    }
    ctd.stop_crabd();
    ctd.start_crabd();
    let settled = wait_until(30, || {
        let left = std::fs::read_dir(&making).map_or(0, |d| d.count());
        let half = ctd.ctr(&["container", "info", "half"]).status.success();
        (left == 0 && !half).then_some(())
    });
    assert!(settled.is_some(), "the half-made container or a record stays");
    let snapshots = ctd.ctr_ok(&["snapshot", "ls"]);
    assert!(!snapshots.lines().any(|l| l.starts_with("half ")), "{snapshots}");
    assert!(ctd.ctr(&["container", "info", "stranger"]).status.success());
    assert_eq!(ctd.task_status("whole").as_deref(), Some("RUNNING"));
    ctd.remove("whole");
    ctd.ctr_ok(&["container", "rm", "stranger"]);
    assert_clean(&ctd.scope(), &["half", "stranger", "whole"]);
}

/// An import names its making before it publishes its version (the id
/// has none yet, so every version it then has is the import's): a crabd
/// killed after the publish and before the container was made leaves a
/// record the next crabd settles by forgetting the id's history, so the
/// name is free again. Deterministic: the state such a kill leaves is
/// made from a real import whose container and registration are removed
/// while crabd is stopped.
#[test]
fn a_restarted_crabd_forgets_an_import_it_never_started() {
    use crab_tests::sandbox::{crabctl, crabctl_ok, wait_registered};
    let mut ctd = Containerd::start();
    ctd.run_detached(CRAB, "orig", &["sleep", "300"]);
    wait_registered(&ctd, "orig");
    crabctl_ok(&ctd, &["checkpoint", "orig"]);
    let file = ctd.dir.join("orig.crab");
    let file = file.to_string_lossy();
    crabctl_ok(&ctd, &["export", "orig", "1", &file]);
    let address = ctd.address().to_string_lossy().into_owned();
    let namespace = ctd.namespace.clone();
    let import = [
        "import",
        &file,
        "--name",
        "ghost",
        "--namespace",
        &namespace,
        "--containerd",
        &address,
    ];
    crabctl_ok(&ctd, &import);
    wait_registered(&ctd, "ghost");
    ctd.stop_crabd();
    // What a kill after the publish leaves: a version, no container, no
    // registration, and the making's record.
    ctd.remove("ghost");
    std::fs::remove_file(ctd.crabd_root().join("registry/ghost.json")).unwrap();
    let images = ctd.crabd_root().join("images/ghost");
    assert!(images.exists());
    let making = ctd.crabd_root().join("making");
    std::fs::create_dir_all(&making).unwrap();
    let record = serde_json::json!({
        "token": "ghost.1",
        "address": ctd.address(),
        "namespace": ctd.namespace,
        "snapshotter": "overlayfs",
        "id": "ghost",
        "history": true,
        "transcript": null,
    });
    std::fs::write(making.join("ghost.1.json"), record.to_string()).unwrap();
    ctd.start_crabd();
    let settled = wait_until(30, || {
        let left = std::fs::read_dir(&making).map_or(0, |d| d.count());
        (left == 0).then_some(())
    });
    assert!(settled.is_some(), "the making's record stays");
    assert!(!images.exists(), "the import's version stays");
    let versions = crabctl(&ctd, &["versions", "ghost"]);
    assert!(
        !versions.status.success() || !String::from_utf8_lossy(&versions.stdout).contains("\"version\""),
        "{versions:?}"
    );
    // The name is free: the same import works again.
    crabctl_ok(&ctd, &import);
    wait_registered(&ctd, "ghost");
    for id in ["ghost", "orig"] {
        ctd.remove(id);
    }
    assert_clean(&ctd.scope(), &["ghost", "orig"]);
}
