//! `crabctl export` on one containerd and `crabctl import` on another (its
//! own root, its own crabd): the sandbox runs there with the same state.
//! Truncated and tampered archives are refused. Needs root: CI runs it as root.

use crab_tests::image::python_sdk_archive;
use crab_tests::leftovers::assert_clean;
use crab_tests::sandbox::{
    ask, crabctl, crabctl_err, crabctl_ok, run_stateful, tree_digest, wait_registered, COUNTER, STORE,
};
use crab_tests::Containerd;

#[test]
fn export_then_import_on_another_containerd() {
    let a = Containerd::start();
    let id = "mover";
    let pid = run_stateful(&a, id);
    wait_registered(&a, id);
    assert_eq!(ask(pid, STORE, "set a 7"), "ok");
    assert_eq!(ask(pid, COUNTER, "hit"), "2");
    crab_tests::sandbox::exec_sh(&a, id, "mkdir -p /data/x && echo moved > /data/x/f");
    let files = tree_digest(pid, "/data");
    crabctl_ok(&a, &["checkpoint", id]);
    let file = a.dir.join("mover.tar");
    let out = crabctl_ok(&a, &["export", id, "1", &file.to_string_lossy()]);
    assert!(out["bytes"].as_u64().unwrap() > 1 << 20, "{out}");
    {
        // Memory images and the spec's environment: the exporter's alone;
        // crabd's root is root's alone.
        use std::os::unix::fs::PermissionsExt;
        let mode = |p: &std::path::Path| std::fs::metadata(p).unwrap().permissions().mode() & 0o7777;
        assert_eq!(mode(&file), 0o600);
        assert_eq!(mode(&a.crabd_root()), 0o700);
    }

    // A second containerd with its own root, the image, and its own crabd.
    let mut b = Containerd::start();
    b.ctr_ok(&["image", "import", &python_sdk_archive().to_string_lossy()]);
    b.start_crabd();
    let target = [
        "--namespace",
        &b.namespace,
        "--containerd",
        &b.address().to_string_lossy(),
    ]
    .map(str::to_owned);

    // Broken archives are refused and leave nothing.
    let bytes = std::fs::read(&file).unwrap();
    let truncated = a.dir.join("truncated.tar");
    std::fs::write(&truncated, &bytes[..bytes.len() / 2]).unwrap();
    let mut args = vec!["import".to_owned(), truncated.to_string_lossy().into_owned()];
    args.extend(target.iter().cloned());
    let e = crabctl_err(&b, &args.iter().map(String::as_str).collect::<Vec<_>>());
    assert!(e.contains("truncated"), "{e}");
    let mut tampered_bytes = bytes.clone();
    let mid = tampered_bytes.len() / 2;
    tampered_bytes[mid] ^= 0x5a;
    let tampered = a.dir.join("tampered.tar");
    std::fs::write(&tampered, &tampered_bytes).unwrap();
    args[1] = tampered.to_string_lossy().into_owned();
    let e = crabctl_err(&b, &args.iter().map(String::as_str).collect::<Vec<_>>());
    assert!(e.contains("tampered") || e.contains("truncated"), "{e}");

    // Signatures: b trusts only its own key until it is told of a's.
    args[1] = file.to_string_lossy().into_owned();
    let e = crabctl_err(&b, &args.iter().map(String::as_str).collect::<Vec<_>>());
    let a_key = crabctl_ok(&a, &["keys"])["export_key"]
        .as_str()
        .unwrap()
        .to_owned();
    assert!(
        e.contains(&format!("signed by key {a_key}, which this host does not trust")),
        "{e}"
    );
    // A manifest changed after signing (here: another runtime) fails its
    // signature, even for a host that trusts the signer; with the
    // signature taken away, it is unsigned.
    let forged = a.dir.join("forged.tar");
    rewrite(&file, &forged, |name, bytes| match name {
        "crab-export.json" => {
            let mut m: serde_json::Value = serde_json::from_slice(&bytes).unwrap();
            m["container"]["runtime"] = "io.containerd.runc.v2".into();
            Some(serde_json::to_vec_pretty(&m).unwrap())
        }
        _ => Some(bytes),
    });
    let unsigned = a.dir.join("unsigned.tar");
    rewrite(&file, &unsigned, |name, bytes| {
        (name != "crab-export.sig").then_some(bytes)
    });
    crab_tests::sandbox::trust(&b, &a);
    let with = |archive: &std::path::Path, extra: &[&str]| {
        let mut args = args.clone();
        args[1] = archive.to_string_lossy().into_owned();
        args.extend(extra.iter().map(|s| (*s).to_owned()));
        args
    };
    for extra in [&[][..], &["--insecure-unsigned"]] {
        let e = crabctl_err(
            &b,
            &with(&forged, extra)
                .iter()
                .map(String::as_str)
                .collect::<Vec<_>>(),
        );
        assert!(e.contains("does not match its signature"), "{e}");
    }
    let e = crabctl_err(
        &b,
        &with(&unsigned, &[])
            .iter()
            .map(String::as_str)
            .collect::<Vec<_>>(),
    );
    assert!(e.contains("not signed"), "{e}");
    assert_eq!(crabctl_ok(&b, &["ps"]), serde_json::json!([]));

    // The whole archive: the sandbox runs on b with a's state at v1.
    let out = crabctl(&b, &args.iter().map(String::as_str).collect::<Vec<_>>());
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let r: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(r["id"], id);
    let bpid = r["pid"].as_i64().unwrap() as i32;
    wait_registered(&b, id);
    assert_eq!(b.task_status(id).as_deref(), Some("RUNNING"));
    assert_eq!(ask(bpid, STORE, "get a"), "7");
    assert_eq!(ask(bpid, COUNTER, "hit"), "3");
    assert_eq!(tree_digest(bpid, "/data"), files);
    let versions = crabctl_ok(&b, &["versions", id]);
    assert_eq!(versions.as_array().unwrap().len(), 1);
    // The import's head is its version: a files-only version next descends
    // from it and pairs its files with that version's processes.
    crab_tests::sandbox::exec_sh(&b, id, "echo after > /data/y");
    let v2 = crabctl_ok(&b, &["checkpoint", "--fs", id]);
    assert_eq!(v2["version"]["parent"], 1, "{v2}");
    assert_eq!(v2["version"]["process_image"], 1, "{v2}");

    // The source runs on; a second import under the same name is refused.
    assert_eq!(ask(pid, STORE, "get a"), "7");
    let e = crabctl_err(&b, &args.iter().map(String::as_str).collect::<Vec<_>>());
    assert!(e.contains("exists already"), "{e}");

    a.remove(id);
    b.remove(id);
    assert_clean(&a.scope(), &[id]);
    assert_clean(&b.scope(), &[id]);
}

/// Copies tar archive `src` to `dst`, each member through `edit` (which
/// answers its new bytes, or `None` to leave it out), as an attacker would.
fn rewrite(src: &std::path::Path, dst: &std::path::Path, edit: impl Fn(&str, Vec<u8>) -> Option<Vec<u8>>) {
    use std::io::Read;
    let mut input = tar::Archive::new(std::fs::File::open(src).unwrap());
    let mut out = tar::Builder::new(std::fs::File::create(dst).unwrap());
    for entry in input.entries().unwrap() {
        let mut entry = entry.unwrap();
        let name = entry.path().unwrap().to_string_lossy().into_owned();
        let mut bytes = Vec::new();
        entry.read_to_end(&mut bytes).unwrap();
        if let Some(bytes) = edit(&name, bytes) {
            let mut header = entry.header().clone();
            header.set_size(bytes.len() as u64);
            header.set_cksum();
            out.append_data(&mut header, &name, bytes.as_slice()).unwrap();
        }
    }
    out.finish().unwrap();
}

/// An archive is another host's word: what a sandbox's root made (a setuid
/// file) is refused unless the importer allows it, and a container that
/// would reach the importing host (a bind mount of a host directory) is
/// refused, before anything is written or started.
#[test]
fn a_hostile_archive_is_refused_before_anything_is_written() {
    let a = Containerd::start();
    let host_dir = a.dir.join("shared");
    std::fs::create_dir_all(&host_dir).unwrap();
    a.ctr_ok(&[
        "run",
        "-d",
        "--runtime",
        crab_tests::CRAB,
        "--mount",
        &format!("type=bind,src={},dst=/host,options=rbind:ro", host_dir.display()),
        crab_tests::image::BUSYBOX,
        "binds",
        "sleep",
        "300",
    ]);
    a.run_detached(crab_tests::CRAB, "suid", &["sleep", "300"]);
    for id in ["binds", "suid"] {
        wait_registered(&a, id);
    }
    crab_tests::sandbox::exec_sh(&a, "suid", "cp /bin/busybox /rootshell && chmod 4755 /rootshell");
    let mut b = Containerd::start();
    b.start_crabd();
    let import = |file: &std::path::Path, extra: &[&str]| {
        let mut args = vec!["import", file.to_str().unwrap(), "--namespace", &b.namespace];
        let address = b.address().to_string_lossy().into_owned();
        args.extend(["--containerd", &address]);
        args.extend(extra);
        crabctl(&b, &args)
    };
    let export = |id: &str| {
        crabctl_ok(&a, &["checkpoint", id]);
        let file = a.dir.join(format!("{id}.tar"));
        crabctl_ok(&a, &["export", id, "1", &file.to_string_lossy()]);
        file
    };

    let suid = export("suid");
    // Unless the importer trusts the exporting host's key, no process image
    // of it is restored (CRIU would restore its credentials and mounts).
    let mut args = vec![
        "import".to_owned(),
        suid.to_string_lossy().into_owned(),
        "--namespace".to_owned(),
        b.namespace.clone(),
    ];
    args.extend([
        "--containerd".to_owned(),
        b.address().to_string_lossy().into_owned(),
    ]);
    let e = crabctl_err(&b, &args.iter().map(String::as_str).collect::<Vec<_>>());
    assert!(e.contains("does not trust"), "{e}");
    crab_tests::sandbox::trust(&b, &a);
    let refused = import(&export("binds"), &[]);
    let e = String::from_utf8_lossy(&refused.stderr);
    assert!(
        !refused.status.success() && e.contains("bind-mounts") && e.contains("refused"),
        "{e}"
    );
    let refused = import(&suid, &[]);
    let e = String::from_utf8_lossy(&refused.stderr);
    assert!(
        !refused.status.success() && e.contains("setuid") && e.contains("privileged"),
        "{e}"
    );
    assert_eq!(crabctl_ok(&b, &["ps"]), serde_json::json!([]));
    assert_eq!(
        b.ctr_ok(&["container", "ls", "-q"]).trim(),
        "",
        "nothing was created"
    );

    // Allowed by the importer, the same archive runs, its file intact.
    let out = import(&suid, &["--allow-privileged-files"]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let r: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let bpid = r["pid"].as_i64().unwrap() as i32;
    let mode = std::fs::symlink_metadata(format!("/proc/{bpid}/root/rootshell")).unwrap();
    use std::os::unix::fs::PermissionsExt;
    assert_eq!(mode.permissions().mode() & 0o7777, 0o4755);

    for id in ["binds", "suid"] {
        a.remove(id);
    }
    b.remove("suid");
    assert_clean(&a.scope(), &["binds", "suid"]);
    assert_clean(&b.scope(), &["suid"]);
}
