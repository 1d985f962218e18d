//! The LLM proxy injected into a crab sandbox: environment variables in the
//! spec, a listener on 127.0.0.1 in the sandbox's network namespace, turns
//! counted and kept in the transcript. Needs root: CI runs it as root.

use crab_tests::image::BUSYBOX;
use crab_tests::leftovers::assert_clean;
use crab_tests::llm::{ScriptedLlm, ANSWER};
use crab_tests::{Containerd, CRAB};

/// containerd whose shims write transcripts into a directory of the test's.
fn containerd() -> (Containerd, std::path::PathBuf) {
    let base = std::env::temp_dir().join(crab_tests::unique("crabpx"));
    std::fs::create_dir_all(&base).unwrap();
    let transcripts = base.join("transcripts");
    let config = base.join("crab.toml");
    std::fs::write(
        &config,
        format!("[shim.proxy]\ntranscript_dir = \"{}\"\n", transcripts.display()),
    )
    .unwrap();
    let ctd = Containerd::start_full("", &[("CRAB_CONFIG", &config.to_string_lossy())]);
    (ctd, base)
}

#[test]
fn injected_proxy_counts_turns_and_keeps_the_transcript() {
    let llm = ScriptedLlm::start();
    let (ctd, base) = containerd();
    let transcripts = base.join("transcripts");
    let post = "wget -qO- --header 'Content-Type: application/json' \
                --post-data '{\"model\":\"m\",\"messages\":[]}' $OPENAI_BASE_URL/chat/completions";
    let script = format!("echo $OPENAI_BASE_URL $ANTHROPIC_BASE_URL; {post}; echo; wget -qO- $OPENAI_BASE_URL/models; echo; {post}");
    let out = run_agent(&ctd, &llm, &script);
    let mut lines = out.lines();
    // The agent's SDK variables point at the proxy in its own namespace.
    assert_eq!(
        lines.next(),
        Some("http://127.0.0.1:7878/v1 http://127.0.0.1:7878"),
        "{out}"
    );
    // The agent's own upstream answered, through the proxy.
    assert_eq!(out.matches("scripted answer").count(), 2, "{out}");
    assert!(out.contains(&ANSWER[..20]));
    assert_eq!(
        llm.seen(),
        [
            "POST /v1/chat/completions",
            "GET /v1/models",
            "POST /v1/chat/completions"
        ]
    );
    // Two turns (the model list is not one), both in the transcript.
    let path = transcripts.join(&ctd.namespace).join("agent.jsonl");
    let text = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    let turns: Vec<u64> = text
        .lines()
        .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
        .filter(|v| v["kind"] == "turn")
        .filter_map(|v| v["turn"].as_u64())
        .collect();
    assert_eq!(turns, [1, 2], "{text}");
    assert_clean(&ctd.scope(), &["agent"]);
    let _ = std::fs::remove_dir_all(&base);
}

/// Runs `script` as the agent `agent` of a crab sandbox whose upstream
/// is `llm`, to its end; answers its output.
fn run_agent(ctd: &Containerd, llm: &ScriptedLlm, script: &str) -> String {
    let upstream = format!("OPENAI_BASE_URL=http://127.0.0.1:{}/v1", llm.port);
    ctd.ctr_ok(&[
        "run",
        "--rm",
        "--env",
        &upstream,
        "--runtime",
        CRAB,
        BUSYBOX,
        "agent",
        "sh",
        "-c",
        script,
    ])
}

/// A tmpfs mounted for a test, unmounted when dropped.
struct Tmpfs(std::path::PathBuf);

impl Tmpfs {
    fn mount(dir: &std::path::Path, options: &str) -> Self {
        std::fs::create_dir_all(dir).unwrap();
        let status = std::process::Command::new("mount")
            .args(["-t", "tmpfs", "-o", options, "crab-test", &dir.to_string_lossy()])
            .status()
            .unwrap();
        assert!(status.success(), "mount a tmpfs on {}", dir.display());
        Tmpfs(dir.to_owned())
    }
}

impl Drop for Tmpfs {
    fn drop(&mut self) {
        let _ = nix::mount::umount2(&self.0, nix::mount::MntFlags::MNT_DETACH);
    }
}

#[test]
fn host_network_gets_no_proxy() {
    let (ctd, base) = containerd();
    let out = ctd.ctr_ok(&[
        "run",
        "--rm",
        "--net-host",
        "--runtime",
        CRAB,
        BUSYBOX,
        "hostnet",
        "sh",
        "-c",
        "echo \"[$OPENAI_BASE_URL]\"",
    ]);
    assert_eq!(out.trim(), "[]", "a host-network sandbox got proxy variables");
    assert_clean(&ctd.scope(), &["hostnet"]);
    let _ = std::fs::remove_dir_all(&base);
}

/// An agent started with `exec` finds the proxy too.
#[test]
fn exec_sees_the_proxy_variables() {
    let (ctd, base) = containerd();
    ctd.run_detached(CRAB, "box", &["sleep", "300"]);
    let out = ctd.ctr_ok(&[
        "task",
        "exec",
        "--exec-id",
        "agent",
        "box",
        "sh",
        "-c",
        "echo $OPENAI_BASE_URL $ANTHROPIC_BASE_URL",
    ]);
    assert_eq!(out.trim(), "http://127.0.0.1:7878/v1 http://127.0.0.1:7878");
    ctd.remove("box");
    assert_clean(&ctd.scope(), &["box"]);
    let _ = std::fs::remove_dir_all(&base);
}

/// Why a turn was not saved is in containerd's own log, with the sandbox
/// and the turn: the proxy's events reach the shim's log FIFO. Here each
/// transcript append fails (the transcripts are on a full tmpfs of one
/// page, and each turn's record is larger) and each turn hook fails
/// (checkpoints on, and no crabd to make them).
#[test]
fn a_failed_transcript_write_and_turn_hook_reach_containerds_log() {
    let llm = ScriptedLlm::start();
    let base = std::env::temp_dir().join(crab_tests::unique("crablog"));
    let transcripts = base.join("transcripts");
    let config = base.join("crab.toml");
    std::fs::create_dir_all(&base).unwrap();
    std::fs::write(
        &config,
        format!(
            "[shim.proxy]\ntranscript_dir = \"{}\"\ncheckpoint_on_turn = true\n\
             [crabd]\nautostart = false\n",
            transcripts.display()
        ),
    )
    .unwrap();
    let ctd = Containerd::start_full("", &[("CRAB_CONFIG", &config.to_string_lossy())]);
    let full = Tmpfs::mount(&transcripts.join(&ctd.namespace), "size=4k");
    // Each turn's record is larger than the tmpfs (one page, up to 64 KiB
    // on some kernels): its append fails.
    let post = "wget -qO- --header 'Content-Type: application/json' --post-file /tmp/body \
                $OPENAI_BASE_URL/chat/completions";
    let body = "{ printf '{\"model\":\"m\",\"messages\":[{\"role\":\"user\",\"content\":\"'; \
                head -c 70000 /dev/zero | tr '\\0' x; printf '\"}]}'; } > /tmp/body";
    // The second turn's answer waits for the first turn's record: by then
    // its append has failed.
    let out = run_agent(&ctd, &llm, &format!("{body}; {post}; echo; {post}"));
    // The agent got its answers all the same.
    assert_eq!(out.matches("scripted answer").count(), 2, "{out}");
    let log_path = ctd.dir.join("containerd.log");
    let line_of = |msg: &str| {
        std::fs::read_to_string(&log_path)
            .unwrap_or_default()
            .lines()
            .find(|l| l.contains(&format!("msg=\"{msg}")) && l.contains("sandbox=\"agent\""))
            .map(str::to_owned)
    };
    // containerd copies the shim's FIFO into its log as it comes.
    let both = crab_tests::wait_until(10, || {
        Some((line_of("turn hook failed")?, line_of("transcript append failed")?))
    });
    let Some((hook, append)) = both else {
        panic!(
            "not in containerd's log: {}",
            std::fs::read_to_string(&log_path).unwrap_or_default()
        );
    };
    assert!(
        hook.contains("level=warn") && hook.contains("turn=\"1\""),
        "{hook}"
    );
    assert!(
        hook.contains("cannot reach crabd"),
        "the cause is in the line: {hook}"
    );
    assert!(
        append.contains("level=error")
            && append.contains("turn=\"1\"")
            && append.contains("No space left on device"),
        "{append}"
    );
    assert_clean(&ctd.scope(), &["agent"]);
    drop(full);
    let _ = std::fs::remove_dir_all(&base);
}
