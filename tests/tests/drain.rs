//! `crabctl drain`: the host is going away, so every running sandbox gets a
//! version within the grace and an archive; each archive imported on
//! another containerd (its own root and crabd) runs with the state the
//! sandbox had. Real containerd, CRIU, overlayfs; needs root: CI runs it as
//! root.

use std::os::unix::fs::PermissionsExt;

use crab_tests::image::python_sdk_archive;
use crab_tests::leftovers::assert_clean;
use crab_tests::sandbox::{
    ask, crabctl, crabctl_err, crabctl_ok, run_stateful, tree_digest, wait_registered, COUNTER, STORE,
};
use crab_tests::Containerd;

const SANDBOXES: usize = 8;

#[test]
fn a_drained_host_moves_every_sandbox_to_another() {
    let a = Containerd::start();
    let ids: Vec<String> = (1..=SANDBOXES).map(|i| format!("spot{i}")).collect();
    let mut states = Vec::new();
    for (i, id) in ids.iter().enumerate() {
        let pid = run_stateful(&a, id);
        wait_registered(&a, id);
        assert_eq!(ask(pid, STORE, &format!("set a {i}")), "ok");
        crab_tests::sandbox::exec_sh(&a, id, &format!("mkdir -p /data && echo {i} > /data/f"));
        let next: u64 = ask(pid, COUNTER, "peek").parse::<u64>().unwrap() + 1;
        states.push((tree_digest(pid, "/data"), next));
    }

    // Bad input is refused before anything is done.
    let e = crabctl_err(&a, &["drain", "--grace", "0"]);
    assert!(e.contains("--grace"), "{e}");

    // The grace is generous: a loaded CI machine must not miss one.
    let out = a.dir.join("drained");
    let r = crabctl_ok(
        &a,
        &["drain", "--grace", "120", "--export", &out.to_string_lossy()],
    );
    let outcomes = r["sandboxes"].as_array().expect("sandboxes");
    assert_eq!(outcomes.len(), SANDBOXES, "{r}");
    for o in outcomes {
        assert_eq!(o["made"], true, "{o}");
        assert!(o["error"].is_null(), "{o}");
        assert!(
            o["durable_ms"].as_f64().unwrap() <= o["exported_ms"].as_f64().unwrap(),
            "{o}"
        );
    }
    eprintln!(
        "drained {SANDBOXES} sandboxes in {:.0} ms; durable at (ms): {:?}",
        r["total_ms"].as_f64().unwrap(),
        outcomes
            .iter()
            .map(|o| o["durable_ms"].as_f64().unwrap().round())
            .collect::<Vec<_>>()
    );
    // Memory images and environments: root's alone.
    let mode = |p: &std::path::Path| std::fs::metadata(p).unwrap().permissions().mode() & 0o7777;
    assert_eq!(mode(&out), 0o700);

    // Another host: each archive runs there with the state it had.
    let mut b = Containerd::start();
    b.ctr_ok(&["image", "import", &python_sdk_archive().to_string_lossy()]);
    b.start_crabd();
    crab_tests::sandbox::trust(&b, &a);
    let (namespace, address) = (b.namespace.clone(), b.address().to_string_lossy().into_owned());
    for (id, (files, next)) in ids.iter().zip(&states) {
        let archive = out.join(format!("{id}.crab"));
        assert_eq!(mode(&archive), 0o600, "{id}");
        let archive = archive.to_string_lossy().into_owned();
        let args = [
            "import",
            &archive,
            "--namespace",
            &namespace,
            "--containerd",
            &address,
        ];
        let imported = crabctl(&b, &args);
        assert!(
            imported.status.success(),
            "{id}: {}",
            String::from_utf8_lossy(&imported.stderr)
        );
        let r: serde_json::Value = serde_json::from_slice(&imported.stdout).unwrap();
        let pid = r["pid"].as_i64().unwrap() as i32;
        wait_registered(&b, id);
        let i = id.trim_start_matches("spot").parse::<usize>().unwrap() - 1;
        assert_eq!(ask(pid, STORE, "get a"), i.to_string(), "{id}");
        assert_eq!(ask(pid, COUNTER, "peek"), next.to_string(), "{id}");
        assert_eq!(&tree_digest(pid, "/data"), files, "{id}");
    }

    let ids: Vec<&str> = ids.iter().map(String::as_str).collect();
    for id in &ids {
        b.remove(id);
        a.remove(id);
    }
    assert_clean(&b.scope(), &ids);
    assert_clean(&a.scope(), &ids);
}
