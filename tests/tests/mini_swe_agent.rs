//! mini-swe-agent (PyPI), unmodified, on the host: its stock docker
//! environment runs the task in a crab container (docker 26 with
//! `--runtime io.containerd.crab.v2`), and its litellm model talks to the
//! sandbox's proxy on crabd's host listener (`crabctl proxy-url`), with
//! `checkpoint_on_turn`: each turn end is a version of the docker sandbox
//! before the agent gets its answer. The upstream LLM is scripted: three
//! tool calls. Needs root and the venv of
//! `packaging/install-deps.sh` (`/opt/crab/mini-venv`): CI has both.

use std::path::PathBuf;

use crab_tests::docker::DOCKER_BUSYBOX;
use crab_tests::leftovers::assert_clean;
use crab_tests::llm::{bash_call, ScriptedLlm};
use crab_tests::{bin_dir, path_with_crab, Dockerd};
use serde_json::Value;

fn mini_python() -> PathBuf {
    let python = PathBuf::from("/opt/crab/mini-venv/bin/python3");
    assert!(
        python.exists(),
        "{} missing: run packaging/install-deps.sh (it installs mini-swe-agent)",
        python.display()
    );
    python
}

#[test]
fn mini_swe_agent_completes_a_task_through_the_host_listener() {
    let python = mini_python();
    let llm = ScriptedLlm::scripted(vec![
        bash_call(
            "call_1",
            "mkdir -p /work && echo hello from crab > /work/greeting",
        ),
        bash_call("call_2", "cat /work/greeting"),
        bash_call(
            "call_3",
            "echo COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT && cat /work/greeting",
        ),
    ]);
    let base = std::env::temp_dir().join(crab_tests::unique("crabmini"));
    std::fs::create_dir_all(&base).unwrap();
    let transcripts = base.join("transcripts");
    let config = base.join("crab.toml");
    std::fs::write(
        &config,
        format!(
            "[shim.proxy]\ntranscript_dir = \"{}\"\nopenai_upstream = \"http://127.0.0.1:{}\"\n\
             checkpoint_on_turn = true\n[crabd]\ngc_interval_secs = 3600\n",
            transcripts.display(),
            llm.port
        ),
    )
    .unwrap();
    let d = Dockerd::start_with(&[("CRAB_CONFIG", &config.to_string_lossy())]);

    let script = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("fixtures/mini_agent.py");
    let out = std::process::Command::new(python)
        .arg(script)
        .arg(bin_dir().join("crabctl"))
        .arg(d.containerd.crabd_socket())
        .arg(DOCKER_BUSYBOX)
        .arg("Write 'hello from crab' into /work/greeting, check it, and submit it.")
        .env("DOCKER_HOST", d.host())
        .env("PATH", path_with_crab())
        .env("HOME", &base)
        .env("MSWEA_GLOBAL_CONFIG_DIR", base.join("mini-config"))
        .env_remove("OPENAI_API_KEY")
        .env_remove("OPENAI_BASE_URL")
        .env_remove("http_proxy")
        .env_remove("HTTP_PROXY")
        .output()
        .expect("run mini-swe-agent");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "mini-swe-agent failed: {stderr}");
    // The agent logs to stdout too; the driver's report is the last line.
    let stdout = String::from_utf8_lossy(&out.stdout);
    let report = stdout.lines().last().unwrap_or_default();
    let got: Value = serde_json::from_str(report).unwrap_or_else(|e| panic!("{e}: {stdout}\n{stderr}"));
    assert_eq!(got["exit_status"], "Submitted", "{got}\n{stderr}");
    assert_eq!(
        got["submission"], "hello from crab\n",
        "the task ran in the crab container"
    );
    assert_eq!(got["n_calls"], 3);
    assert_eq!(llm.seen(), ["POST /v1/chat/completions"; 3]);

    // Every turn is in the sandbox's transcript; the third request carries
    // what the second command printed in the sandbox.
    let container = got["container"].as_str().expect("container id");
    let path = transcripts.join("moby").join(format!("{container}.jsonl"));
    let text = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    let turns: Vec<Value> = text
        .lines()
        .filter_map(|l| serde_json::from_str::<Value>(l).ok())
        .filter(|v| v["kind"] == "turn")
        .collect();
    let numbers: Vec<u64> = turns.iter().filter_map(|t| t["turn"].as_u64()).collect();
    assert_eq!(numbers, [1, 2, 3], "{text}");
    let third = turns[2]["request"]["body"]["text"]
        .as_str()
        .expect("request text");
    assert!(third.contains("hello from crab"), "{third}");
    assert!(
        !text.contains("sk-crab-mini-secret"),
        "the API key is never written"
    );

    // Each turn end was a version of the docker sandbox, made before the
    // agent got its answer (files by overlay-copy of docker's own overlay,
    // processes by CRIU); the agent removed its container at the end, and
    // crabd (gc at an hour here) still lists them.
    let versions = crab_tests::sandbox::crabctl_ok(&d.containerd, &["versions", container]);
    let versions = versions.as_array().expect("a list");
    let turns: Vec<u64> = versions.iter().filter_map(|v| v["turn"].as_u64()).collect();
    assert_eq!(turns, [1, 2, 3], "{versions:?}");
    for v in versions {
        assert_eq!(v["class"], "full", "{v}");
        assert_eq!(v["fs_snapshot"]["backend"], "overlay-copy", "{v}");
    }

    assert_clean(&d.scope(), &[]);
    drop(d);
    let _ = std::fs::remove_dir_all(&base);
}
