//! Safety rules (`[crabd.safety]`): a turn that changes a protected path
//! or leaves a forbidden command running is rolled back to the sandbox's
//! previous version before its answer is released, and the agent gets a
//! notice in its provider's format instead; a turn that only reads is not.
//! Real containerd, crabd, CRIU and the inspector's BPF programs. Needs
//! root: CI runs it as root.

use std::path::{Path, PathBuf};

use crab_tests::http::request;
use crab_tests::image::BUSYBOX;
use crab_tests::leftovers::assert_clean;
use crab_tests::llm::{completion, ScriptedLlm};
use crab_tests::sandbox::{crabctl, exec_sh, proxy_endpoint, wait_registered};
use crab_tests::{Containerd, CRAB};
use serde_json::Value;

const RULES: &str = "[crabd]\ninspector = true\n[crabd.safety]\nprotected_paths = [\"/etc/**\"]\nforbidden_commands = [\"nc\"]\n";

/// containerd with the safety rules, whose shims write transcripts into a
/// directory of the test's.
fn containerd() -> (Containerd, PathBuf) {
    Containerd::start_with_transcripts("crabsafe", RULES)
}

fn entries(ctd: &Containerd, base: &Path, id: &str, kind: &str) -> Vec<Value> {
    let path = base
        .join("transcripts")
        .join(&ctd.namespace)
        .join(format!("{id}.jsonl"));
    std::fs::read_to_string(&path)
        .unwrap_or_else(|e| panic!("{}: {e}", path.display()))
        .lines()
        .filter_map(|l| serde_json::from_str::<Value>(l).ok())
        .filter(|v| v["kind"] == kind)
        .collect()
}

fn content(answer: &Value) -> String {
    answer["choices"][0]["message"]["content"]
        .as_str()
        .unwrap_or_else(|| panic!("not a chat completion: {answer}"))
        .to_owned()
}

/// Turn `turn` of an agent outside the sandbox, through its proxy URL
/// (`port`, `prefix`): the answer's text.
fn ask_outside(port: u16, prefix: &str, turn: u32) -> String {
    let body = format!(r#"{{"model":"m","messages":[{{"role":"user","content":"step {turn}"}}]}}"#);
    let (status, answer) = request(
        port,
        "POST",
        &format!("/{prefix}/v1/chat/completions"),
        &format!("127.0.0.1:{port}"),
        &[],
        Some(&body),
    );
    assert_eq!(status, 200, "{answer}");
    content(&answer)
}

fn metric(ctd: &Containerd, name: &str) -> f64 {
    let out = crabctl(ctd, &["metrics"]);
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .find_map(|l| l.strip_prefix(&format!("{name} ")))
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or(0.0)
}

/// An agent outside its sandbox (through its proxy URL): turns that only
/// read, or write where they may, get their answers; a turn that writes
/// under `/etc` (by an absolute path, or a relative one from a `cd`) or
/// leaves `nc` running is rolled back, and its answer is the notice.
#[test]
fn a_turn_that_breaks_a_rule_is_rolled_back_and_the_agent_told() {
    let answers = (1..=8).map(|i| completion(&format!("answer{i}"))).collect();
    let llm = ScriptedLlm::scripted(answers);
    let (ctd, base) = containerd();
    let id = "safeout";
    let upstream = format!("OPENAI_BASE_URL=http://127.0.0.1:{}/v1", llm.port);
    ctd.ctr_ok(&[
        "run",
        "-d",
        "--env",
        &upstream,
        "--runtime",
        CRAB,
        BUSYBOX,
        id,
        "sleep",
        "3600",
    ]);
    wait_registered(&ctd, id);
    let (port, prefix) = proxy_endpoint(&ctd, id);
    let mut turn = 0;
    let mut ask = || {
        turn += 1;
        ask_outside(port, &prefix, turn)
    };
    let passwd = || exec_sh(&ctd, id, "cat /etc/passwd");

    assert_eq!(ask(), "answer1");
    let before = passwd();
    exec_sh(
        &ctd,
        id,
        "cat /etc/passwd /etc/hostname > /dev/null; echo fine > /tmp/fine",
    );
    assert_eq!(ask(), "answer2", "reading /etc and writing /tmp break no rule");

    exec_sh(
        &ctd,
        id,
        "echo evil::0:0::/:/bin/sh >> /etc/passwd; echo lost > /tmp/lost",
    );
    let told = ask();
    assert!(
        told.contains("rolled back") && told.contains("/etc/passwd"),
        "{told}"
    );
    assert_eq!(passwd(), before, "the protected file is as it was");
    assert_eq!(
        exec_sh(&ctd, id, "cat /tmp/fine; ls /tmp/lost 2>&1 || true"),
        "fine\nls: /tmp/lost: No such file or directory\n"
    );

    exec_sh(&ctd, id, "cd /etc && echo x > motd2");
    let told = ask();
    assert!(
        told.contains("/etc/motd2"),
        "a relative path is judged too: {told}"
    );
    assert!(exec_sh(&ctd, id, "ls /etc/motd2 2>&1 || true").contains("No such file"));

    // A program called nc (a script: its process's command name is its
    // file's) left running.
    exec_sh(
        &ctd,
        id,
        "rm -f /tmp/nc.up; printf '#!/bin/sh\\ntouch /tmp/nc.up\\nwhile :; do sleep 1; done\\n' > /tmp/nc; \
         chmod +x /tmp/nc; (/tmp/nc > /dev/null 2>&1 &); until [ -e /tmp/nc.up ]; do sleep 0.02; done",
    );
    let told = ask();
    assert!(told.contains("nc"), "{told}");
    assert!(
        !exec_sh(&ctd, id, "ps").contains("/tmp/nc"),
        "the forbidden process is gone"
    );

    assert_eq!(ask(), "answer6", "the next turn is live again");
    let safety = entries(&ctd, &base, id, "safety");
    assert_eq!(safety.len(), 3, "{safety:?}");
    assert_eq!(safety[0]["what"], "/etc/passwd");
    assert_eq!(metric(&ctd, "crab_safety_rollbacks_total"), 3.0);
    // The rolled-back turns' records are never replayed.
    let gates: Vec<Value> = entries(&ctd, &base, id, "turn")
        .iter()
        .map(|t| t["gate"].clone())
        .collect();
    assert_eq!(
        gates.iter().filter(|g| *g == "rolled_back").count(),
        3,
        "{gates:?}"
    );
    ctd.remove(id);
    assert_clean(&ctd.scope(), &[id]);
    drop(ctd);
    let _ = std::fs::remove_dir_all(&base);
}

/// An agent inside the sandbox that writes to `/etc` after its second
/// answer: the sandbox (the agent too) goes back to turn 2's version, the
/// agent asks turn 2 again and gets the notice instead of the recorded
/// answer; told, it does not write again, and its next turns go live.
#[test]
fn an_agent_inside_is_restored_and_told() {
    let answers = (1..=8).map(|i| completion(&format!("answer{i}"))).collect();
    let llm = ScriptedLlm::scripted(answers);
    let (ctd, base) = containerd();
    let id = "safein";
    let upstream = format!("OPENAI_BASE_URL=http://127.0.0.1:{}/v1", llm.port);
    let post = "wget -qO /tmp/a --header 'Content-Type: application/json' \
                --post-data \"{\\\"model\\\":\\\"m\\\",\\\"messages\\\":[{\\\"role\\\":\\\"user\\\",\\\"content\\\":\\\"step $i\\\"}]}\" \
                $OPENAI_BASE_URL/chat/completions";
    // After its second answer the agent writes to /etc, unless that
    // answer told it not to.
    let script = format!(
        "while [ ! -e /tmp/go ]; do sleep 0.1; done; \
         for i in 1 2 3 4; do until {post}; do sleep 0.2; done; cat /tmp/a >> /tmp/answers; echo >> /tmp/answers; \
         if [ $i = 2 ] && ! grep -q 'rolled back' /tmp/a; then echo evil >> /etc/passwd; fi; done; \
         touch /tmp/done; sleep 3600"
    );
    ctd.ctr_ok(&[
        "run",
        "-d",
        "--env",
        &upstream,
        "--runtime",
        CRAB,
        BUSYBOX,
        id,
        "sh",
        "-c",
        &script,
    ]);
    wait_registered(&ctd, id);
    let pid = ctd.task_pid(id).expect("running");
    let before = exec_sh(&ctd, id, "cat /etc/passwd");
    std::fs::write(format!("/proc/{pid}/root/tmp/go"), "").unwrap();
    let done = crab_tests::wait_until(90, || {
        let pid = ctd.task_pid(id)?;
        std::path::Path::new(&format!("/proc/{pid}/root/tmp/done"))
            .exists()
            .then_some(pid)
    })
    .expect("the agent finished");
    let said: Vec<String> = std::fs::read_to_string(format!("/proc/{done}/root/tmp/answers"))
        .unwrap()
        .lines()
        .map(|l| content(&serde_json::from_str(l).expect("an answer")))
        .collect();
    assert_eq!(said.len(), 4, "{said:?}");
    assert_eq!(said[0], "answer1");
    assert!(
        said[1].contains("rolled back"),
        "turn 2 asked again gets the notice: {said:?}"
    );
    assert_eq!(
        &said[2..],
        ["answer4", "answer5"],
        "then live turns (answer3 went with the rollback)"
    );
    assert_eq!(exec_sh(&ctd, id, "cat /etc/passwd"), before);
    assert_eq!(entries(&ctd, &base, id, "safety").len(), 1);
    ctd.remove(id);
    assert_clean(&ctd.scope(), &[id]);
    drop(ctd);
    let _ = std::fs::remove_dir_all(&base);
}

/// A turn whose checkpoint fails (here: a process holds an io_uring, which
/// CRIU cannot dump) cannot be judged on its files: with rules set its
/// answer is withheld, and what the inspector saw still breaks rules (a
/// forbidden command left running is rolled back), so a sandbox cannot
/// dodge the rules by making its capture fail.
#[test]
fn a_turn_that_cannot_be_captured_is_withheld() {
    assert!(
        Path::new("/usr/bin/node").exists(),
        "/usr/bin/node missing: run packaging/install-deps.sh (it installs nodejs)"
    );
    let answers = (1..=4).map(|i| completion(&format!("answer{i}"))).collect();
    let llm = ScriptedLlm::scripted(answers);
    let (ctd, base) = containerd();
    let id = "unjudged";
    let upstream = format!("OPENAI_BASE_URL=http://127.0.0.1:{}/v1", llm.port);
    ctd.ctr_ok(&[
        "image",
        "import",
        &crab_tests::image::devbox_archive().to_string_lossy(),
    ]);
    ctd.ctr_ok(&[
        "run",
        "-d",
        "--env",
        &upstream,
        "--runtime",
        CRAB,
        "--mount",
        "type=bind,src=/usr,dst=/usr,options=rbind:ro",
        crab_tests::image::DEVBOX,
        id,
        "sleep",
        "3600",
    ]);
    wait_registered(&ctd, id);
    let (port, prefix) = proxy_endpoint(&ctd, id);
    let ask = |turn: u32| ask_outside(port, &prefix, turn);
    assert_eq!(ask(1), "answer1");

    let ring = "const fs = require('fs'); fs.writeFileSync('/tmp/uring.pid', String(process.pid)); \
                fs.readFile('/tmp/uring.pid', () => fs.writeFileSync('/tmp/uring-ready', '1')); \
                setInterval(() => {}, 1000);";
    exec_sh(
        &ctd,
        id,
        &format!(
            "cd /tmp && (UV_USE_IO_URING=1 node -e \"{ring}\" > /tmp/uring.log 2>&1 &); \
             i=0; while [ ! -e /tmp/uring-ready ] && [ $i -lt 600 ]; do sleep 0.05; i=$((i+1)); done; \
             [ -e /tmp/uring-ready ]"
        ),
    );
    let told = ask(2);
    assert!(told.contains("could not be checked"), "{told}");

    // Still uncapturable, and now also a forbidden command left running:
    // what the inspector saw is judged, and the sandbox goes back to its
    // last clean version (turn 1's: neither process).
    exec_sh(
        &ctd,
        id,
        "rm -f /tmp/nc.up; printf '#!/bin/sh\\ntouch /tmp/nc.up\\nwhile :; do sleep 1; done\\n' > /tmp/nc; \
         chmod +x /tmp/nc; (/tmp/nc > /dev/null 2>&1 &); until [ -e /tmp/nc.up ]; do sleep 0.02; done",
    );
    let told = ask(3);
    assert!(told.contains("rolled back") && told.contains("nc"), "{told}");
    let ps = exec_sh(&ctd, id, "ps");
    assert!(!ps.contains("/tmp/nc") && !ps.contains("node"), "{ps}");
    assert_eq!(ask(4), "answer4", "a turn that can be captured goes live");
    let safety = entries(&ctd, &base, id, "safety");
    assert_eq!(safety.len(), 2, "{safety:?}");
    ctd.remove(id);
    assert_clean(&ctd.scope(), &[id]);
    drop(ctd);
    let _ = std::fs::remove_dir_all(&base);
}
