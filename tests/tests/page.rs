//! What happened to a sandbox, as `crabctl logs` prints it and as crabd's
//! page shows it live in headless Chromium (Debian's chromium and
//! chromium-driver, which packaging/install-deps.sh installs). Real
//! containerd, CRIU and BPF (the inspector on); needs root: CI runs it as
//! root.

use std::io::{Read, Write};
use std::time::Duration;

use crab_tests::containerd::free_port;
use crab_tests::leftovers::assert_clean;
use crab_tests::llm::{chat_turn, ScriptedLlm};
use crab_tests::sandbox::{
    crabctl, crabctl_ok, exec_sh, proxy_url, run_stateful, wait_forgotten, wait_registered,
};
use crab_tests::{unique, wait_until, Containerd};
use fantoccini::{ClientBuilder, Locator};
use serde_json::{json, Value};

/// A containerd whose crabd loads the inspector, serves its page on a port
/// of its own, and whose proxies forward to `llm`.
fn containerd(llm: &ScriptedLlm) -> (Containerd, std::path::PathBuf) {
    let config = std::env::temp_dir().join(unique("crab-page"));
    std::fs::write(
        &config,
        format!(
            "[shim.proxy]\nopenai_upstream = \"http://127.0.0.1:{}\"\n[crabd]\ninspector = true\nui_port = {}\n",
            llm.port,
            free_port()
        ),
    )
    .unwrap();
    let ctd = Containerd::start_full("", &[("CRAB_CONFIG", &config.to_string_lossy())]);
    (ctd, config)
}

/// One turn of the host agent, answered at once (so its answer waits for
/// its version: a hold).
fn turn(url: &str) {
    chat_turn(url, Duration::ZERO).expect("the turn is answered");
}

/// `crabctl logs --json` of `id`: one event per line.
fn logs(ctd: &Containerd, id: &str) -> Vec<Value> {
    let out = crabctl(ctd, &["logs", id, "-n", "1000"]);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("{e}: {l}")))
        .collect()
}

#[test]
fn logs_tell_turns_versions_holds_and_rollbacks_and_follow_new_ones() {
    let llm = ScriptedLlm::start();
    let id = "logs";
    let (ctd, config) = containerd(&llm);
    run_stateful(&ctd, id);
    wait_registered(&ctd, id);
    let url = proxy_url(&ctd, id);

    turn(&url);
    exec_sh(&ctd, id, "echo two > /data/f");
    turn(&url);
    crabctl_ok(&ctd, &["rollback", id, "1"]);

    let events = logs(&ctd, id);
    let kinds: Vec<(&str, Option<u64>)> = events
        .iter()
        .filter(|e| e["event"] != "hold")
        .map(|e| (e["event"].as_str().unwrap(), e["version"].as_u64()))
        .collect();
    assert_eq!(
        kinds,
        [
            ("checkpoint", Some(1)),
            ("turn", Some(1)),
            ("checkpoint", Some(2)),
            ("turn", Some(2)),
            ("rollback", Some(1)),
        ],
        "{events:#?}"
    );
    for e in &events {
        assert_eq!(e["sandbox"], id, "{e}");
    }
    let of = |kind: &str, version: u64| {
        events
            .iter()
            .find(|e| e["event"] == kind && e["version"] == version)
            .unwrap()
    };
    assert_eq!(of("checkpoint", 1)["class"], "full", "{events:#?}");
    assert!(of("checkpoint", 1)["bytes"].as_u64().unwrap() > 0, "{events:#?}");
    assert!(
        of("checkpoint", 1)["frozen_ms"].as_f64().unwrap() > 0.0,
        "{events:#?}"
    );
    assert_eq!(of("turn", 2)["class"], "fs", "{events:#?}");
    assert_eq!(of("turn", 2)["turn"], 2, "{events:#?}");
    assert!(
        of("rollback", 1)["undo_ms"].as_f64().unwrap() > 0.0,
        "{events:#?}"
    );
    // The LLM answers at once and turn 1's version is a whole CRIU dump
    // (hundreds of milliseconds): its answer waited, and the proxy tells
    // crabd how long once it released it (on a task of its own: awaited).
    let holds = || -> Vec<(u64, f64)> {
        logs(&ctd, id)
            .iter()
            .filter(|e| e["event"] == "hold")
            .map(|e| (e["turn"].as_u64().unwrap(), e["held_ms"].as_f64().unwrap()))
            .collect()
    };
    let held =
        wait_until(20, || holds().into_iter().find(|(t, _)| *t == 1)).expect("turn 1's hold is logged");
    assert!(held.1 > 0.0, "{held:?}");
    assert!(holds().iter().all(|(t, _)| [1, 2].contains(t)), "{:?}", holds());
    // The human form names them too.
    let out = std::process::Command::new(crab_tests::bin_dir().join("crabctl"))
        .arg("--socket")
        .arg(ctd.crabd_socket())
        .args(["logs", id, "-n", "1000"])
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(text.contains("rolled back to version 1 in"), "{text}");
    assert!(text.contains("turn 1: answer held"), "{text}");
    assert_eq!(text.lines().count(), logs(&ctd, id).len(), "{text}");

    // --follow: the newest, then a turn that ends while it runs. crabd
    // subscribes before it reads the log, so once the newest arrived the
    // turn cannot be missed.
    let mut follow = std::process::Command::new(crab_tests::bin_dir().join("crabctl"))
        .arg("--socket")
        .arg(ctd.crabd_socket())
        .args(["--json", "logs", id, "-n", "1", "-f"])
        .stdout(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let stdout = follow.stdout.take().unwrap();
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        use std::io::BufRead;
        for line in std::io::BufReader::new(stdout).lines().map_while(Result::ok) {
            if tx.send(line).is_err() {
                break;
            }
        }
    });
    let next = || -> Value {
        let line = rx
            .recv_timeout(Duration::from_secs(60))
            .expect("a followed event");
        serde_json::from_str(&line).unwrap_or_else(|e| panic!("{e}: {line}"))
    };
    // The newest (the rollback, or a hold told after it) says it is open.
    assert!(next()["event"].is_string());
    turn(&url);
    let followed = std::iter::repeat_with(next)
        .find(|e| e["event"] == "turn")
        .unwrap();
    let _ = follow.kill();
    let _ = follow.wait();
    // The agent outside goes on counting its turns.
    assert_eq!(followed["turn"], 3, "{followed}");
    assert_eq!(followed["version"], 3, "{followed}");

    // Unknown sandboxes and bad queries are refused.
    let out = crabctl(&ctd, &["logs", "nothing-here"]);
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("nothing-here"));

    ctd.remove(id);
    assert_clean(&ctd.scope(), &[id]);
    // The log went with the sandbox's history.
    wait_forgotten(&ctd, id);
    let left: Vec<_> = std::fs::read_dir(ctd.crabd_root().join("events"))
        .map(|d| d.flatten().map(|e| e.file_name()).collect())
        .unwrap_or_default();
    assert!(left.is_empty(), "{left:?}");
    let _ = std::fs::remove_file(&config);
}

/// `GET path` on 127.0.0.1:`port` with `Host: host`: the status and the
/// head.
fn get(port: u16, host: &str, path: &str) -> (u16, String) {
    let mut s = std::net::TcpStream::connect(("127.0.0.1", port)).unwrap();
    write!(
        s,
        "GET {path} HTTP/1.1\r\nhost: {host}\r\nconnection: close\r\n\r\n"
    )
    .unwrap();
    let mut answer = String::new();
    let _ = s.read_to_string(&mut answer);
    let status = answer.split(' ').nth(1).and_then(|c| c.parse().ok()).unwrap_or(0);
    let head = answer.split("\r\n\r\n").next().unwrap_or_default().to_lowercase();
    (status, head)
}

/// chromedriver on a port of its own, killed on drop.
struct Chromedriver {
    child: std::process::Child,
    port: u16,
}

impl Chromedriver {
    fn start() -> Self {
        let port = free_port();
        let child = std::process::Command::new("chromedriver")
            .arg(format!("--port={port}"))
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .spawn()
            .expect("start chromedriver (packaging/install-deps.sh installs chromium-driver)");
        wait_until(20, || std::net::TcpStream::connect(("127.0.0.1", port)).ok())
            .expect("chromedriver listens");
        Chromedriver { child, port }
    }
}

impl Drop for Chromedriver {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

#[test]
fn the_page_shows_a_sandbox_and_follows_its_turns_live() {
    let llm = ScriptedLlm::start();
    let id = "page";
    let (ctd, config) = containerd(&llm);
    run_stateful(&ctd, id);
    wait_registered(&ctd, id);
    let url = proxy_url(&ctd, id);
    for _ in 0..3 {
        turn(&url);
    }
    let page = crabctl_ok(&ctd, &["ui"])["url"]
        .as_str()
        .expect("the page's URL")
        .to_owned();
    let rest = page.strip_prefix("http://127.0.0.1:").expect("on loopback");
    let (port, path) = rest.split_once('/').unwrap();
    let port: u16 = port.parse().unwrap();
    let path = format!("/{path}");

    // Only with its secret, only for its own host names.
    let (status, head) = get(port, &format!("127.0.0.1:{port}"), &path);
    assert_eq!(status, 200, "{head}");
    assert!(
        head.contains("content-security-policy: default-src 'none'"),
        "{head}"
    );
    assert!(head.contains("referrer-policy: no-referrer"), "{head}");
    assert_eq!(
        get(port, &format!("localhost:{port}"), &format!("{path}state")).0,
        200
    );
    assert_eq!(get(port, "evil.example", &path).0, 421);
    let wrong = path.replace(&path[4..8], "0000");
    assert_eq!(get(port, &format!("127.0.0.1:{port}"), &wrong).0, 404);
    assert_eq!(get(port, &format!("127.0.0.1:{port}"), "/ui/").0, 404);
    assert_eq!(get(port, &format!("127.0.0.1:{port}"), "/").0, 404);
    // The state names no proxy URL (its secret grants a sandbox's LLM).
    let (_, state) = get(port, &format!("127.0.0.1:{port}"), &format!("{path}state"));
    assert!(!state.contains("/s/"), "{state}");

    let driver = Chromedriver::start();
    let profile = tempfile::tempdir().unwrap();
    let shot = profile.path().join("page.png");
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(async {
        let mut caps = serde_json::Map::new();
        caps.insert(
            "goog:chromeOptions".into(),
            json!({
                "binary": "/usr/bin/chromium",
                "args": [
                    "--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                    "--disable-quic", "--no-first-run", "--disable-background-networking",
                    "--disable-component-update", "--disable-sync", "--window-size=1200,900",
                    format!("--user-data-dir={}", profile.path().join("profile").display()),
                ],
            }),
        );
        let connector = hyper_util::client::legacy::connect::HttpConnector::new();
        let client = ClientBuilder::new(connector)
            .capabilities(caps)
            .connect(&format!("http://127.0.0.1:{}", driver.port))
            .await
            .expect("a WebDriver session");
        let run = async {
            client.goto(&page).await?;
            let turns = format!("section[data-sandbox='{id}'] .mark.turn");
            let count = |n: usize| {
                let client = client.clone();
                let turns = turns.clone();
                async move {
                    for _ in 0..200 {
                        if client.find_all(Locator::Css(&turns)).await?.len() == n {
                            return Ok(true);
                        }
                        tokio::time::sleep(Duration::from_millis(100)).await;
                    }
                    Ok::<_, fantoccini::error::CmdError>(false)
                }
            };
            assert!(count(3).await?, "the page shows the sandbox's three turns");
            // Read in one script each: the page redraws on every event,
            // and an element found in one call can be gone by the next.
            let link = client
                .execute("return document.getElementById('link').textContent", vec![])
                .await?;
            assert_eq!(link, json!("live"));
            let classes: Vec<String> = attrs(&client, &turns, "class")
                .await?
                .into_iter()
                .map(Option::unwrap_or_default)
                .collect();
            // Coloured by the class crabd logged for each turn.
            let logged: Vec<String> = logs(&ctd, id)
                .iter()
                .filter(|e| e["event"] == "turn")
                .map(|e| format!("mark turn {}", e["class"].as_str().unwrap()))
                .collect();
            assert_eq!(classes, logged);
            let checkpoints = format!("section[data-sandbox='{id}'] .mark.checkpoint");
            assert_eq!(client.find_all(Locator::Css(&checkpoints)).await?.len(), 3);
            let png = client.screenshot().await?;
            std::fs::write(&shot, &png).unwrap();
            // To look at it: CRAB_PAGE_SCREENSHOT=/tmp/page.png.
            if let Some(keep) = std::env::var_os("CRAB_PAGE_SCREENSHOT") {
                std::fs::write(keep, &png).unwrap();
            }
            assert!(
                png.starts_with(b"\x89PNG\r\n\x1a\n") && png.len() > 10_000,
                "{} bytes",
                png.len()
            );

            // A fourth turn reaches the open page with no reload.
            let url = url.clone();
            tokio::task::spawn_blocking(move || turn(&url)).await.unwrap();
            assert!(count(4).await?, "the page shows the fourth turn live");
            let fourth = attrs(
                &client,
                &format!("section[data-sandbox='{id}'] .mark.turn[data-turn='4']"),
                "title",
            )
            .await?;
            assert!(
                matches!(fourth.as_slice(), [Some(t)] if t.starts_with("turn 4: ")),
                "{fourth:?}"
            );
            Ok::<_, fantoccini::error::CmdError>(())
        };
        let result = run.await;
        let _ = client.close().await;
        result.expect("the page behaves");
    });
    drop(driver);

    ctd.remove(id);
    assert_clean(&ctd.scope(), &[id]);
    let _ = std::fs::remove_file(&config);
}

/// Attribute `attr` of every element `css` selects, read in one script (so
/// no element can go stale between finding it and reading it).
async fn attrs(
    client: &fantoccini::Client,
    css: &str,
    attr: &str,
) -> Result<Vec<Option<String>>, fantoccini::error::CmdError> {
    let got = client
        .execute(
            "return Array.from(document.querySelectorAll(arguments[0])).map(e => e.getAttribute(arguments[1]))",
            vec![json!(css), json!(attr)],
        )
        .await?;
    Ok(got
        .as_array()
        .map(|all| all.iter().map(|v| v.as_str().map(ToOwned::to_owned)).collect())
        .unwrap_or_default())
}
