//! Agents outside their sandbox: crabd's host listener relays
//! `http://127.0.0.1:PORT/s/<sandbox>/…` (`crabctl proxy-url`) to the
//! sandbox's proxy in its shim, so turns, transcript and gate are the
//! sandbox's; with `checkpoint_on_turn`, every turn end becomes a crabd
//! version before its answer is released. Needs root: CI runs it as root.
//! The last test runs the agent inside its sandbox with the same hook, and
//! rolls back to one of its turns.
//!
//! The agent is the official OpenAI SDK on the host (`fixtures/host_agent.py`,
//! from the SDK venv of `packaging/install-deps.sh`).

use std::path::{Path, PathBuf};

use crab_tests::image::BUSYBOX;
use crab_tests::leftovers::assert_clean;
use crab_tests::llm::{completion, ScriptedLlm};
use crab_tests::sandbox::{crabctl_err, crabctl_ok, version_turns, wait_registered};
use crab_tests::{Containerd, CRAB};
use serde_json::Value;

/// containerd whose shims read `extra` (a `[shim.proxy]` table body) and
/// write transcripts into a directory of the test's.
fn containerd(extra: &str) -> (Containerd, PathBuf) {
    Containerd::start_with_transcripts("crabhp", extra)
}

/// Runs busybox `sleep` as crab sandbox `id` whose agent's upstream is `llm`.
fn run_sandbox(ctd: &Containerd, llm: &ScriptedLlm, id: &str) {
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
    wait_registered(ctd, id);
}

fn sdk_python() -> PathBuf {
    let python = PathBuf::from("/opt/crab/sdk-venv/bin/python3");
    assert!(
        python.exists(),
        "{} missing: run packaging/install-deps.sh",
        python.display()
    );
    python
}

/// Runs the host agent against `url` for `n_turns`; returns its answers.
fn host_agent(url: &str, n_turns: u32, extras: bool) -> Vec<Value> {
    let script = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("fixtures/host_agent.py");
    let mut cmd = std::process::Command::new(sdk_python());
    cmd.arg(script).arg(url).arg(n_turns.to_string());
    if extras {
        cmd.arg("--stream-and-models");
    }
    let out = cmd
        .env_remove("OPENAI_BASE_URL")
        .env_remove("http_proxy")
        .env_remove("HTTP_PROXY")
        .output()
        .expect("run the host agent");
    assert!(
        out.status.success(),
        "host agent failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let got: Value = serde_json::from_slice(&out.stdout).expect("the agent prints JSON");
    got["answers"].as_array().expect("answers").clone()
}

/// Removes sandbox `id`, checks it left nothing, stops containerd and
/// removes the test's directory.
fn finish(ctd: Containerd, id: &str, base: &Path) {
    ctd.remove(id);
    assert_clean(&ctd.scope(), &[id]);
    drop(ctd);
    let _ = std::fs::remove_dir_all(base);
}

/// The turn records of a transcript.
fn turn_records(path: &Path) -> Vec<Value> {
    let text = std::fs::read_to_string(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    text.lines()
        .filter_map(|l| serde_json::from_str::<Value>(l).ok())
        .filter(|v| v["kind"] == "turn")
        .collect()
}

/// The turn records at `path` once there are `n`: a turn's record is
/// written when its exchange ends, after its answer reached the agent (the
/// next turn's answer waits for it), so the agent's last turn can be
/// answered before its record is there.
fn turn_records_once(path: &Path, n: usize) -> Vec<Value> {
    crab_tests::wait_until(30, || {
        let records = path.exists().then(|| turn_records(path))?;
        (records.len() >= n).then_some(records)
    })
    .unwrap_or_else(|| panic!("{}: fewer than {n} turns", path.display()))
}

/// `GET path` on 127.0.0.1:`port` with a raw HTTP/1.1 request: the status
/// and the body.
fn raw_get(port: u16, path: &str) -> (u16, Value) {
    raw_get_as(port, path, &format!("127.0.0.1:{port}"))
}

/// `GET path` naming `host` as its `Host`.
fn raw_get_as(port: u16, path: &str, host: &str) -> (u16, Value) {
    crab_tests::http::request(port, "GET", path, host, &[], None)
}

fn port_of(url: &str) -> u16 {
    let rest = url.strip_prefix("http://127.0.0.1:").expect("a loopback URL");
    rest.split('/')
        .next()
        .and_then(|p| p.parse().ok())
        .expect("a port")
}

#[test]
fn host_agent_reaches_its_sandbox_through_crabd() {
    let llm = ScriptedLlm::scripted(vec![completion("one"), completion("two"), completion("three")]);
    let (ctd, base) = containerd("");
    let id = "hostpx";
    run_sandbox(&ctd, &llm, id);

    // The URL names the exact id, also when asked by prefix.
    let shown = crabctl_ok(&ctd, &["proxy-url", "hostp"]);
    assert_eq!(shown["sandbox"], id);
    let url = shown["url"].as_str().expect("url").to_owned();
    let port = port_of(&url);
    // The URL carries the sandbox's secret: /s/<id>/<32 hex digits>.
    let base_path = url.split_once(&format!(":{port}")).expect("a port").1.to_owned();
    let secret = base_path
        .strip_prefix(&format!("/s/{id}/"))
        .unwrap_or_else(|| panic!("{url}"));
    assert!(
        secret.len() == 32 && secret.bytes().all(|b| b.is_ascii_hexdigit()),
        "{url}"
    );

    // Non-streaming, streaming, a model list (no turn), non-streaming.
    let answers = host_agent(&url, 3, true);
    assert_eq!(
        answers,
        [
            Value::from("one"),
            Value::from("two"),
            serde_json::json!([]),
            Value::from("three")
        ]
    );
    assert_eq!(
        llm.seen(),
        [
            "POST /v1/chat/completions",
            "POST /v1/chat/completions",
            "GET /v1/models",
            "POST /v1/chat/completions"
        ]
    );
    let path = base
        .join("transcripts")
        .join(&ctd.namespace)
        .join(format!("{id}.jsonl"));
    let turns = turn_records_once(&path, 3);
    let numbers: Vec<u64> = turns.iter().filter_map(|t| t["turn"].as_u64()).collect();
    assert_eq!(numbers, [1, 2, 3], "every turn of the host agent");
    let raw = std::fs::read_to_string(&path).unwrap();
    assert!(raw.contains("go on 1"), "requests recorded");
    assert!(
        !raw.contains("sk-crab-host-secret"),
        "the API key is never written"
    );

    // Bad input gets clear answers.
    let (status, body) = raw_get(port, "/s/nope/v1/models");
    assert_eq!(
        (status, &body["error"]["type"]),
        (404, &Value::from("crab_unknown_sandbox"))
    );
    let (status, body) = raw_get(port, &format!("/s/hostp/{secret}/v1/models"));
    assert_eq!(status, 404, "no prefixes on the host listener: {body}");
    // Any local user can connect: without the secret, or with another's,
    // the sandbox is not there; a page rebound to the loopback is refused.
    for path in [
        format!("/s/{id}/v1/models"),
        format!("/s/{id}/{}/v1/models", "0".repeat(32)),
    ] {
        let (status, body) = raw_get(port, &path);
        assert_eq!(
            (status, &body["error"]["type"]),
            (404, &Value::from("crab_unknown_sandbox")),
            "{path}"
        );
    }
    let (status, body) = raw_get_as(port, &format!("{base_path}/v1/models"), "attacker.example");
    assert_eq!(
        (status, &body["error"]["type"]),
        (403, &Value::from("crab_foreign_host"))
    );
    assert_eq!(raw_get(port, &format!("{base_path}/v1/models")).0, 200);
    let (status, body) = raw_get(port, "/v1/models");
    assert_eq!(
        (status, &body["error"]["type"]),
        (400, &Value::from("crab_not_a_sandbox_path"))
    );
    let err = crabctl_err(&ctd, &["proxy-url", "nope"]);
    assert!(err.contains("nope"), "{err}");

    // Removed: the socket is gone and the sandbox unknown.
    let ps = crabctl_ok(&ctd, &["ps"]);
    let socket = ps[0]["proxy"]
        .as_str()
        .expect("a registered proxy socket")
        .to_owned();
    assert!(Path::new(&socket).exists(), "{socket}");
    // An earlier container's transcript of the same id, and another
    // sandbox's: only the first goes with this history.
    let earlier = path.with_file_name(format!("{id}.1764612345678901234.jsonl"));
    let other = path.with_file_name(format!("{id}.1.jsonl"));
    for f in [&earlier, &other] {
        std::fs::write(f, "{}\n").unwrap();
    }
    ctd.remove(id);
    assert!(!Path::new(&socket).exists(), "{socket} left behind");
    assert_eq!(raw_get(port, &format!("{base_path}/v1/models")).0, 404);
    // The removed container's history goes, its transcripts with it.
    crab_tests::wait_until(20, || (!path.exists() && !earlier.exists()).then_some(()))
        .unwrap_or_else(|| panic!("{} kept after its sandbox's history went", path.display()));
    assert!(other.exists(), "another sandbox's transcript went too");
    // A later sandbox with the same id is another one: a URL handed out
    // for the removed one does not reach it.
    run_sandbox(&ctd, &llm, id);
    let again = crabctl_ok(&ctd, &["proxy-url", id])["url"]
        .as_str()
        .expect("url")
        .to_owned();
    assert_ne!(again, url, "the same secret for a new sandbox of the same id");
    let new_path = again
        .split_once(&format!(":{port}"))
        .expect("a port")
        .1
        .to_owned();
    assert_eq!(raw_get(port, &format!("{base_path}/v1/models")).0, 404);
    assert_eq!(raw_get(port, &format!("{new_path}/v1/models")).0, 200);
    ctd.remove(id);
    let _ = std::fs::remove_file(&other);
    assert_clean(&ctd.scope(), &[id]);
    drop(ctd);
    let _ = std::fs::remove_dir_all(&base);
}

#[test]
fn each_turn_end_is_a_version_before_its_answer() {
    let llm = ScriptedLlm::scripted(vec![completion("a"), completion("b"), completion("c")]);
    let (ctd, base) = containerd("checkpoint_on_turn = true");
    let id = "turnpx";
    run_sandbox(&ctd, &llm, id);
    let url = crab_tests::sandbox::proxy_url(&ctd, id);

    let answers = host_agent(&url, 3, false);
    assert_eq!(answers, ["a", "b", "c"]);

    // One full version per turn end, numbered by its turn; the conversation
    // that belongs to turn N is turns 1..N-1.
    let versions = crabctl_ok(&ctd, &["versions", id]);
    let versions = versions.as_array().expect("a list");
    let got: Vec<(u64, u64, &str, u64)> = versions
        .iter()
        .map(|v| {
            assert!(v["defect"].is_null(), "{v}");
            assert!(v["process_image"].is_u64(), "a process image: {v}");
            (
                v["version"].as_u64().unwrap(),
                v["turn"].as_u64().unwrap(),
                v["class"].as_str().unwrap(),
                v["transcript_turns"].as_u64().unwrap(),
            )
        })
        .collect();
    assert_eq!(got, [(1, 1, "full", 0), (2, 2, "full", 1), (3, 3, "full", 2)]);

    // The gate opened for every turn, each hold recorded; the upstream
    // answers at once, so answers waited for their checkpoints.
    let path = base
        .join("transcripts")
        .join(&ctd.namespace)
        .join(format!("{id}.jsonl"));
    let turns = turn_records_once(&path, 3);
    assert_eq!(turns.len(), 3);
    let holds: Vec<u64> = turns
        .iter()
        .map(|t| {
            assert_eq!(t["gate"], "opened", "{t}");
            t["timing"]["hold_us"].as_u64().expect("hold recorded")
        })
        .collect();
    assert!(holds.iter().any(|h| *h > 0), "holds {holds:?}");
    eprintln!("holds (us): {holds:?}");

    ctd.remove(id);
    assert_clean(&ctd.scope(), &[id]);
    drop(ctd);
    let _ = std::fs::remove_dir_all(&base);
}

/// An agent inside its sandbox, rolled back to turn 2 of 5: restored
/// mid-request on a connection whose proxy end is gone, it asks turn 2
/// again and gets turn 2's recorded answer without the upstream seeing it;
/// turn 3 goes live on a new branch of the conversation, and the old turns
/// 3..5 stay in the transcript.
#[test]
fn a_rolled_back_agent_inside_is_fast_forwarded_then_branches() {
    let answers: Vec<String> = (1..=15).map(|i| completion(&format!("answer{i}"))).collect();
    let llm = ScriptedLlm::scripted(answers);
    let (ctd, base) = containerd("checkpoint_on_turn = true");
    let id = "insidepx";
    let upstream = format!("OPENAI_BASE_URL=http://127.0.0.1:{}/v1", llm.port);
    // Each step's request says its step; a failed one is asked again, as
    // an SDK retries. The answers land in a file.
    let post = "wget -qO /tmp/a --header 'Content-Type: application/json' \
                --post-data \"{\\\"model\\\":\\\"m\\\",\\\"messages\\\":[{\\\"role\\\":\\\"user\\\",\\\"content\\\":\\\"step $i\\\"}]}\" \
                $OPENAI_BASE_URL/chat/completions";
    // Waits for the shim's registration with crabd (at Start, while the
    // init already runs), then five turns.
    let script = format!(
        "while [ ! -e /tmp/go ]; do sleep 0.1; done; \
         for i in 1 2 3 4 5; do until {post}; do sleep 0.2; done; cat /tmp/a >> /tmp/answers; echo >> /tmp/answers; done; \
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
    let tmp = |pid: i32| PathBuf::from(format!("/proc/{pid}/root/tmp"));
    std::fs::write(tmp(pid).join("go"), "").unwrap();
    crab_tests::wait_until(60, || tmp(pid).join("done").exists().then_some(()))
        .expect("the agent finished its five turns");
    let said = |pid: i32| -> Vec<String> {
        std::fs::read_to_string(tmp(pid).join("answers"))
            .unwrap()
            .lines()
            .map(|l| {
                serde_json::from_str::<Value>(l).expect("an answer")["choices"][0]["message"]["content"]
                    .as_str()
                    .unwrap()
                    .to_owned()
            })
            .collect()
    };
    assert_eq!(said(pid), ["answer1", "answer2", "answer3", "answer4", "answer5"]);
    assert_eq!(llm.seen().len(), 5);

    // Each turn end is a version, taken while the agent's request to the
    // proxy was open (CRIU keeps the connection).
    assert_eq!(version_turns(&ctd, id), [1, 2, 3, 4, 5]);
    let path = base
        .join("transcripts")
        .join(&ctd.namespace)
        .join(format!("{id}.jsonl"));
    let gates: Vec<Value> = turn_records_once(&path, 5)
        .iter()
        .map(|t| t["gate"].clone())
        .collect();
    assert_eq!(gates, ["opened"; 5]);

    // Back to turn 2's end: the files hold one answer, and the agent asks
    // turn 2 again.
    let r = crabctl_ok(&ctd, &["rollback", id, "2"]);
    let pid = r["pid"].as_i64().expect("pid") as i32;
    crab_tests::wait_until(60, || tmp(pid).join("done").exists().then_some(()))
        .expect("the restored agent finished");
    assert_eq!(
        said(pid),
        ["answer1", "answer2", "answer6", "answer7", "answer8"],
        "turn 2 from the transcript, then live turns"
    );
    assert_eq!(llm.seen().len(), 8, "the upstream never saw turn 2 again");
    turn_records_once(&path, 8);

    // One transcript: the old branch whole, then a branch after turn 2.
    let entries: Vec<Value> = std::fs::read_to_string(&path)
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    let turns: Vec<(u64, u64)> = entries
        .iter()
        .filter(|e| e["kind"] == "turn")
        .map(|t| (t["branch"].as_u64().unwrap(), t["turn"].as_u64().unwrap()))
        .collect();
    assert_eq!(
        turns,
        [(0, 1), (0, 2), (0, 3), (0, 4), (0, 5), (1, 3), (1, 4), (1, 5)]
    );
    let branches: Vec<&Value> = entries.iter().filter(|e| e["kind"] == "branch").collect();
    assert_eq!(branches.len(), 1, "{branches:?}");
    assert_eq!(
        (&branches[0]["parent"], &branches[0]["after"]),
        (&Value::from(0), &Value::from(2))
    );
    // The versions follow: turns 3..5 again, on branch 1, descending from 2.
    let versions = crabctl_ok(&ctd, &["versions", id]);
    let rows: Vec<(u64, u64, Option<u64>)> = versions
        .as_array()
        .expect("versions")
        .iter()
        .map(|v| {
            (
                v["turn"].as_u64().unwrap(),
                v["branch"].as_u64().unwrap(),
                v["parent"].as_u64(),
            )
        })
        .collect();
    assert_eq!(&rows[5..], [(3, 1, Some(2)), (4, 1, Some(6)), (5, 1, Some(7))]);

    // A fork of turn 2 carries the conversation up to it: its agent asks
    // turn 2 again and gets the recorded answer, then goes on live.
    let fork = "insidefork";
    crabctl_ok(&ctd, &["fork", id, "2", "--name", fork]);
    wait_registered(&ctd, fork);
    let fpid = ctd.task_pid(fork).expect("the fork runs");
    crab_tests::wait_until(60, || tmp(fpid).join("done").exists().then_some(()))
        .expect("the fork's agent finished");
    assert_eq!(
        said(fpid),
        ["answer1", "answer2", "answer9", "answer10", "answer11"]
    );
    assert_eq!(llm.seen().len(), 11, "the fork's turn 2 came from its transcript");
    let fork_path = path.with_file_name(format!("{fork}.jsonl"));
    let fork_turns: Vec<u64> = turn_records_once(&fork_path, 5)
        .iter()
        .map(|t| t["turn"].as_u64().unwrap())
        .collect();
    assert_eq!(fork_turns, [1, 2, 3, 4, 5]);
    assert_eq!(version_turns(&ctd, fork), [3, 4, 5]);
    ctd.remove(fork);

    // An export of turn 2 carries the conversation too: imported, its
    // agent gets turn 2 from the archive's transcript, then goes live.
    let archive = base.join("turn2.crab");
    crabctl_ok(&ctd, &["export", id, "2", &archive.to_string_lossy()]);
    let imported = "insideimp";
    let address = ctd.address().to_string_lossy().into_owned();
    crabctl_ok(
        &ctd,
        &[
            "import",
            &archive.to_string_lossy(),
            "--name",
            imported,
            "--namespace",
            &ctd.namespace,
            "--containerd",
            &address,
        ],
    );
    wait_registered(&ctd, imported);
    let ipid = ctd.task_pid(imported).expect("the import runs");
    crab_tests::wait_until(60, || tmp(ipid).join("done").exists().then_some(()))
        .expect("the import's agent finished");
    assert_eq!(
        said(ipid),
        ["answer1", "answer2", "answer12", "answer13", "answer14"]
    );
    assert_eq!(
        llm.seen().len(),
        14,
        "the import's turn 2 came from its transcript"
    );
    let imported_turns: Vec<u64> = turn_records_once(&path.with_file_name(format!("{imported}.jsonl")), 5)
        .iter()
        .map(|t| t["turn"].as_u64().unwrap())
        .collect();
    assert_eq!(imported_turns, [1, 2, 3, 4, 5]);
    ctd.remove(imported);

    ctd.remove(id);
    assert_clean(&ctd.scope(), &[id, fork, imported]);
    drop(ctd);
    let _ = std::fs::remove_dir_all(&base);
}

/// An agent outside its sandbox, started again from scratch (its host
/// died): its harness asks the sandbox's tool for a replay through the
/// proxy URL; the sandbox goes back to turn 1's version, and the agent's
/// requests get the recorded answers until the conversation's last turn,
/// then live ones. The upstream sees each turn once.
#[test]
fn a_restarted_outside_agent_is_fast_forwarded_through_its_url() {
    let answers = ["one", "two", "three", "four"].map(completion).to_vec();
    let llm = ScriptedLlm::scripted(answers);
    let (ctd, base) = containerd("");
    let id = "ffwdpx";
    run_sandbox(&ctd, &llm, id);
    let url = crab_tests::sandbox::proxy_url(&ctd, id);
    assert_eq!(host_agent(&url, 3, false), ["one", "two", "three"]);
    assert_eq!(version_turns(&ctd, id), [1, 2, 3]);
    let pid = ctd.task_pid(id).expect("running");

    let port = port_of(&url);
    let path = url.split_once(&format!(":{port}")).expect("a port").1.to_owned();
    let (status, r) = raw_post(port, &format!("{path}/crab/v1/replay"), "{}");
    assert_eq!(status, 200, "{r}");
    assert_eq!(r["until"], 3, "{r}");
    assert_ne!(
        ctd.task_pid(id),
        Some(pid),
        "the sandbox went back to turn 1's version"
    );

    assert_eq!(host_agent(&url, 4, false), ["one", "two", "three", "four"]);
    assert_eq!(llm.seen().len(), 4, "turns 1..3 came from the transcript");
    // Refused: arguments (a replay starts at turn 1, where the agent does).
    let (status, r) = raw_post(port, &format!("{path}/crab/v1/replay"), r#"{"turn":3}"#);
    assert_eq!(status, 400, "{r}");
    finish(ctd, id, &base);
}

/// `POST path` with a JSON `body` to 127.0.0.1:`port`: the status and the
/// body.
fn raw_post(port: u16, path: &str, body: &str) -> (u16, Value) {
    crab_tests::http::request(port, "POST", path, &format!("127.0.0.1:{port}"), &[], Some(body))
}

/// An agent started by `ctr task exec` in a sandbox whose spec set
/// `OPENAI_BASE_URL` (as mini-swe-agent's `docker exec … python agent.py`
/// does) talks to its LLM through the sandbox's proxy: the exec inherits
/// the spec's variable, which the shim points at the proxy, and the proxy
/// forwards to the spec's upstream. Its turn is a version.
#[test]
fn an_execd_agent_reaches_its_llm_through_the_proxy() {
    let llm = ScriptedLlm::scripted(vec![completion("through the proxy")]);
    let (ctd, base) = containerd("");
    let id = "execpx";
    run_sandbox(&ctd, &llm, id);
    let out = crab_tests::sandbox::exec_sh(
        &ctd,
        id,
        "echo $OPENAI_BASE_URL; wget -qO- --header 'Content-Type: application/json' \
         --post-data '{\"model\":\"m\",\"messages\":[]}' $OPENAI_BASE_URL/chat/completions",
    );
    assert_eq!(out.lines().next(), Some("http://127.0.0.1:7878/v1"), "{out}");
    assert!(out.contains("through the proxy"), "{out}");
    let path = base
        .join("transcripts")
        .join(&ctd.namespace)
        .join(format!("{id}.jsonl"));
    crab_tests::wait_until(10, || (!turn_records(&path).is_empty()).then_some(()))
        .expect("the proxy recorded the exec's turn");
    assert_eq!(version_turns(&ctd, id), [1]);
    finish(ctd, id, &base);
}

/// crabd killed between two turns: the next turn end starts it again (the
/// shim's hook, with `[crabd] autostart`), and that turn is a version too,
/// numbered after the first; nothing is lost or made twice.
#[test]
fn a_turn_after_crabd_died_starts_it_and_is_a_version() {
    let llm = ScriptedLlm::start();
    let (ctd, base) = containerd("");
    let id = "deadpx";
    run_sandbox(&ctd, &llm, id);
    let post = "wget -qO- --header 'Content-Type: application/json' \
                --post-data '{\"model\":\"m\",\"messages\":[]}' $OPENAI_BASE_URL/chat/completions";
    crab_tests::sandbox::exec_sh(&ctd, id, post);
    let old = ctd.crabd_pid().expect("crabd runs");
    nix::sys::signal::kill(nix::unistd::Pid::from_raw(old), nix::sys::signal::Signal::SIGKILL).unwrap();
    crab_tests::wait_until(10, || {
        std::os::unix::net::UnixStream::connect(ctd.crabd_socket())
            .is_err()
            .then_some(())
    })
    .expect("crabd is gone");
    let out = crab_tests::sandbox::exec_sh(&ctd, id, post);
    assert!(out.contains("scripted answer"), "{out}");
    let new = ctd.crabd_pid().expect("crabd runs again");
    assert_ne!(new, old);
    // Versions 1 and 2, of turns 1 and 2.
    assert_eq!(crab_tests::sandbox::version_numbers(&ctd, id), [1, 2]);
    assert_eq!(version_turns(&ctd, id), [1, 2]);
    let path = base
        .join("transcripts")
        .join(&ctd.namespace)
        .join(format!("{id}.jsonl"));
    crab_tests::wait_until(10, || (turn_records(&path).len() == 2).then_some(()))
        .expect("two turns recorded");
    let gates: Vec<Value> = turn_records(&path).iter().map(|t| t["gate"].clone()).collect();
    assert_eq!(gates, ["opened"; 2]);
    finish(ctd, id, &base);
}

/// crabd killed while turn ends wait in its queue (one slot, six sandboxes
/// ending a turn at once): every agent gets its answer, and every turn is
/// either a version or recorded in its transcript as a failed hook; no
/// turn is a version twice, and the next turn of each sandbox is one.
#[test]
fn crabd_killed_with_turns_queued_loses_none_and_makes_none_twice() {
    let llm = ScriptedLlm::start();
    let (ctd, base) = containerd("[crabd.schedule]\nslots = 1\nbytes_per_sec = -1\n");
    let ids: Vec<String> = (0..6).map(|i| format!("q{i}")).collect();
    for id in &ids {
        run_sandbox(&ctd, &llm, id);
    }
    let post = "wget -qO- --header 'Content-Type: application/json' \
                --post-data '{\"model\":\"m\",\"messages\":[]}' $OPENAI_BASE_URL/chat/completions";
    let queued = || {
        let out = crab_tests::sandbox::crabctl(&ctd, &["metrics"]);
        String::from_utf8_lossy(&out.stdout)
            .lines()
            .find_map(|l| l.strip_prefix("crab_queue_depth ")?.trim().parse::<f64>().ok())
            .unwrap_or(0.0)
    };
    // A round: every sandbox ends a turn at once; crabd is killed as soon
    // as a turn end waits in its queue. A round whose queue was never seen
    // (all done first) is played again.
    let mut killed = false;
    for _round in 0..5 {
        let done = std::sync::atomic::AtomicUsize::new(0);
        std::thread::scope(|s| {
            for id in &ids {
                let (ctd, done) = (&ctd, &done);
                s.spawn(move || {
                    let out = crab_tests::sandbox::exec_sh(ctd, id, post);
                    assert!(out.contains("scripted answer"), "{id}: {out}");
                    done.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                });
            }
            while done.load(std::sync::atomic::Ordering::SeqCst) < ids.len() {
                std::thread::sleep(std::time::Duration::from_millis(20));
                if queued() >= 1.0 {
                    let pid = ctd.crabd_pid().expect("crabd runs");
                    nix::sys::signal::kill(
                        nix::unistd::Pid::from_raw(pid),
                        nix::sys::signal::Signal::SIGKILL,
                    )
                    .unwrap();
                    killed = true;
                    break;
                }
            }
        });
        if killed {
            break;
        }
    }
    assert!(killed, "no round had a turn end in crabd's queue");

    // One more turn each: it starts crabd again, and is a version.
    for id in &ids {
        crab_tests::sandbox::exec_sh(&ctd, id, post);
    }
    let mut failed = 0;
    for id in &ids {
        let turns = version_turns(&ctd, id);
        let unique: std::collections::HashSet<&u64> = turns.iter().collect();
        assert_eq!(unique.len(), turns.len(), "{id}: a turn made twice: {turns:?}");
        let path = base
            .join("transcripts")
            .join(&ctd.namespace)
            .join(format!("{id}.jsonl"));
        // The last turn's record is written after its answer came.
        let records = crab_tests::wait_until(30, || {
            let records = turn_records(&path);
            (records.last()?["turn"].as_u64() == turns.last().copied()).then_some(records)
        })
        .unwrap_or_else(|| panic!("{id}: no record of its last turn {turns:?}"));
        let last = records.last().expect("turns recorded");
        assert_eq!(last["gate"], "opened", "{id}: {last}");
        assert_eq!(
            turns.last(),
            last["turn"].as_u64().as_ref(),
            "{id}: the last turn is a version"
        );
        for r in &records {
            let turn = r["turn"].as_u64().expect("a turn number");
            match r["gate"].as_str() {
                Some("opened") => assert!(
                    turns.contains(&turn),
                    "{id}: turn {turn} answered as saved, no version"
                ),
                Some("hook_failed") => failed += 1,
                other => panic!("{id}: turn {turn}: gate {other:?}"),
            }
        }
        for t in &turns {
            assert!(
                records.iter().any(|r| r["turn"].as_u64() == Some(*t)),
                "{id}: version of unknown turn {t}"
            );
        }
    }
    assert!(
        failed >= 1,
        "a turn end in the queue when crabd died is recorded as failed"
    );
    for id in &ids[1..] {
        ctd.remove(id);
    }
    finish(ctd, &ids[0], &base);
}
