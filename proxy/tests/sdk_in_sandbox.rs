//! The official OpenAI and Anthropic Python SDKs inside a crab sandbox with
//! no configuration at all: the shim's injected variables lead them to the
//! proxy in the sandbox's network namespace, and the variables the sandbox's
//! spec set lead the proxy to the scripted upstream. Needs root (containerd)
//! and the SDK venv of `packaging/install-deps.sh`: CI has both.

mod support;

use std::path::PathBuf;

use crab_tests::image::{python_sdk_archive, PYTHON_SDK};
use crab_tests::leftovers::assert_clean;
use crab_tests::{Containerd, CRAB};
use support::upstream::ScriptedUpstream;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn official_sdks_inside_a_crab_sandbox() {
    let upstream = ScriptedUpstream::start().await;
    let url = upstream.url();
    let report = tokio::task::spawn_blocking(move || {
        let base = std::env::temp_dir().join(crab_tests::unique("crabsdk"));
        std::fs::create_dir_all(&base).unwrap();
        let config = base.join("crab.toml");
        let transcripts = base.join("transcripts");
        std::fs::write(
            &config,
            format!("[shim.proxy]\ntranscript_dir = \"{}\"\n", transcripts.display()),
        )
        .unwrap();
        let ctd = Containerd::start_full("", &[("CRAB_CONFIG", &config.to_string_lossy())]);
        ctd.ctr_ok(&["image", "import", &python_sdk_archive().to_string_lossy()]);
        let script_dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/sdk");
        let mount = format!("type=bind,src={},dst=/sdk,options=rbind:ro", script_dir.display());
        // What an agent's deployment sets; the script itself configures nothing.
        let openai = format!("OPENAI_BASE_URL={url}/v1");
        let anthropic = format!("ANTHROPIC_BASE_URL={url}");
        let out = ctd.ctr(&[
            "run",
            "--rm",
            "--mount",
            &mount,
            "--env",
            &openai,
            "--env",
            &anthropic,
            "--runtime",
            CRAB,
            PYTHON_SDK,
            "agent",
            "/opt/crab/sdk-venv/bin/python3",
            "/sdk/sdk_check.py",
        ]);
        let transcript =
            std::fs::read_to_string(transcripts.join(&ctd.namespace).join("agent.jsonl")).unwrap_or_default();
        assert_clean(&ctd.scope(), &["agent"]);
        drop(ctd);
        let _ = std::fs::remove_dir_all(&base);
        (out, transcript)
    })
    .await
    .expect("sandbox run");
    let (out, transcript) = report;
    assert!(
        out.status.success(),
        "sdk script failed in the sandbox: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let got: serde_json::Value = serde_json::from_slice(&out.stdout).expect("script output is JSON");
    support::assert_sdk_report(&got);
    // chat, chat stream, chat tools, responses, messages, messages stream
    // and the 429: seven turns, exactly, in the sandbox's transcript.
    let turns: Vec<u64> = transcript
        .lines()
        .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
        .filter(|v| v["kind"] == "turn")
        .filter_map(|v| v["turn"].as_u64())
        .collect();
    assert_eq!(turns, [1, 2, 3, 4, 5, 6, 7], "{transcript}");
}
