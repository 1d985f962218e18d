//! `crab-bench eval` end to end on a tiny run: two terminal tasks (a
//! key-value server and a Python REPL, whose state lives in memory), one
//! crash each at a seeded point, recovered by crab and by a deliberately
//! broken recovery (the head's parent restored in its place). The harness
//! must find crab's recoveries state-correct and the broken ones not; and
//! again with each agent inside its sandbox (`--agent-inside`), against
//! chat-only. Real containerd, crabd, CRIU; needs root (CI runs it as root) and the
//! crab-bench binary of the workspace build.

use serde_json::Value;

fn policy<'a>(report: &'a Value, name: &str) -> &'a Value {
    report["policies"]
        .as_array()
        .expect("policies")
        .iter()
        .find(|p| p["policy"] == name)
        .unwrap_or_else(|| panic!("no {name} in {report:#}"))
}

/// Runs `crab-bench eval` on the two terminal tasks with `policies`, the
/// crashes placed by `seed` (and `extra` options), into `out`; answers its
/// report.json.
fn tiny_eval(out: &std::path::Path, policies: &str, seed: &str, extra: &[&str]) -> Value {
    let bench = crab_tests::bin_dir().join("crab-bench");
    let run = std::process::Command::new(&bench)
        .args(["eval", "--swe", "0", "--terminal-tasks", "kv-server,python-repl"])
        .args([
            "--policies",
            policies,
            "--scale",
            "0.05",
            "--parallel",
            "2",
            "--seed",
            seed,
        ])
        .args(extra)
        .arg("--out")
        .arg(out)
        .env("PATH", crab_tests::path_with_crab())
        .output()
        .unwrap_or_else(|e| panic!("run {}: {e}", bench.display()));
    let stdout = String::from_utf8_lossy(&run.stdout);
    assert!(
        run.status.success(),
        "crab-bench eval failed:\n{stdout}\n{}",
        crab_tests::stderr(&run)
    );
    serde_json::from_str(&std::fs::read_to_string(out.join("report.json")).expect("report.json"))
        .expect("report.json is JSON")
}

#[test]
fn a_tiny_eval_finds_crab_correct_and_a_broken_recovery_incorrect() {
    let out = tempfile::tempdir().expect("a report directory");
    // And the density study with three sandboxes at once: the two tasks
    // and a copy of the first, under its own name and crash. Seed 2 puts
    // every crash in a command at step 2 or later (kv-server 4,
    // python-repl 2, kv-server-2 8), so each head has a parent for the
    // broken recovery.
    let report = tiny_eval(out.path(), "crab,crab-broken", "2", &["--density", "3"]);

    let crab = policy(&report, "crab");
    assert_eq!(
        (crab["correct"].as_u64(), crab["crashed"].as_u64()),
        (Some(2), Some(2)),
        "{crab:#}"
    );
    for task in crab["tasks"].as_array().unwrap() {
        assert!(
            task["version"].as_u64().is_some(),
            "crab restored a version: {task:#}"
        );
        assert!(
            task["failed_commands"].as_u64().unwrap_or(0) <= 1,
            "only the killed command fails: {task:#}"
        );
    }
    let broken = policy(&report, "crab-broken");
    assert_eq!(broken["crashed"].as_u64(), Some(2), "{broken:#}");
    assert_eq!(
        broken["correct"].as_u64(),
        Some(0),
        "the broken recovery went unnoticed: {broken:#}"
    );
    for task in broken["tasks"].as_array().unwrap() {
        let why = task["why"].as_str().unwrap_or_default();
        assert!(
            why.contains("after the recovery"),
            "it says where the state differs: {task:#}"
        );
    }
    // Fault-free is always run, and the checkpointing policies wrote bytes.
    assert_eq!(policy(&report, "fault-free")["crashed"].as_u64(), Some(0));
    assert!(crab["bytes"].as_u64().unwrap_or(0) > 0, "{crab:#}");

    let md = std::fs::read_to_string(out.path().join("report.md")).expect("report.md");
    assert!(md.contains("| crab | 2/2 (100%)"), "{md}");
    for picture in ["bytes.png", "e2e.png", "classes.png", "holds.png", "timeline.png"] {
        let png = std::fs::read(out.path().join(picture)).unwrap_or_else(|e| panic!("{picture}: {e}"));
        assert!(
            png.starts_with(b"\x89PNG\r\n\x1a\n") && png.len() > 1000,
            "{picture} is a picture"
        );
        assert!(md.contains(picture), "the report shows {picture}");
    }
    assert!(
        out.path().join("logs/crab/crabd.log").exists(),
        "the run's logs are kept"
    );

    let density = report["density"]["rows"].as_array().expect("density rows");
    let at = |name: &str| {
        density
            .iter()
            .find(|r| r["policy"] == name && r["sandboxes"] == 3)
            .unwrap_or_else(|| panic!("no {name} at 3 sandboxes in {density:#?}"))
    };
    assert_eq!(
        density.len(),
        4,
        "fault-free, bare, crab, crab-broken: {density:#?}"
    );
    // The bare run (no state captures) is the time reference.
    assert_eq!(at("bare")["e2e"].as_f64(), Some(1.0));
    assert!(at("fault-free")["e2e"].as_f64().is_some_and(f64::is_finite));
    let (crab, broken) = (at("crab"), at("crab-broken"));
    // crab's own processes (shims, crabd, CRIU) are metered apart.
    assert!(
        crab["crab_cpu_seconds"].as_f64().is_some_and(|s| s > 0.0),
        "{crab:#}"
    );
    assert_eq!(
        (crab["correct"].as_u64(), crab["crashed"].as_u64()),
        (Some(3), Some(3)),
        "{crab:#}"
    );
    assert_eq!(
        (broken["correct"].as_u64(), broken["crashed"].as_u64()),
        (Some(0), Some(3)),
        "{broken:#}"
    );
    assert!(crab["e2e"].as_f64().is_some_and(f64::is_finite), "{crab:#}");
    // Each wrong recovery is named with what differed.
    let wrong = report["density"]["not_correct"].as_array().expect("not_correct");
    assert_eq!(wrong.len(), 3, "{wrong:#?}");
    assert!(
        wrong.iter().all(|w| w["policy"] == "crab-broken"
            && w["why"]
                .as_str()
                .is_some_and(|y| y.contains("after the recovery"))),
        "{wrong:#?}"
    );
    assert!(md.contains("## Density"), "{md}");
    assert!(
        out.path().join("logs/crab@3/crabd.log").exists(),
        "the density runs' logs are kept apart"
    );
}

/// The same tasks with each agent inside its sandbox (its memory and shell
/// are the sandbox's): crab restores the agent with its sandbox, and the
/// agent goes on from the turn it remembers, asking again what the proxy
/// answers from the transcript; chat-only's fresh sandbox lacks the files
/// and servers its agent was told about. Each recovery is checked at the
/// agent's first request after it and at the end.
#[test]
fn an_agent_inside_is_recovered_with_its_sandbox_and_chat_only_is_not() {
    let out = tempfile::tempdir().expect("a report directory");
    // Seed 0: kv-server crashes in step 1's LLM wait, python-repl in step
    // 3's command.
    let report = tiny_eval(out.path(), "crab,chat-only", "0", &["--agent-inside"]);

    let crab = policy(&report, "crab");
    assert_eq!(
        (crab["correct"].as_u64(), crab["crashed"].as_u64()),
        (Some(2), Some(2)),
        "{crab:#}"
    );
    let mut phases: Vec<&str> = Vec::new();
    for task in crab["tasks"].as_array().unwrap() {
        assert!(
            task["version"].as_u64().is_some(),
            "crab restored a version: {task:#}"
        );
        phases.extend(task["crash"]["phase"].as_str());
    }
    phases.sort_unstable();
    assert_eq!(phases, ["command", "llm-wait"], "{crab:#}");
    let chat = policy(&report, "chat-only");
    assert_eq!(
        (chat["correct"].as_u64(), chat["crashed"].as_u64()),
        (Some(0), Some(2)),
        "{chat:#}"
    );
    let md = std::fs::read_to_string(out.path().join("report.md")).expect("report.md");
    assert!(md.contains("agents inside their sandboxes"), "{md}");
}
