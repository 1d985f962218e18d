//! `crabctl push` on one containerd and `crabctl pull` on another through a
//! real image registry on the loopback (Debian's `docker-registry`, unpacked
//! by `packaging/install-deps.sh`): the
//! sandbox runs there with the same state; a second push sends only what
//! the repository lacks; a registry that serves other bytes than it names
//! is caught; a registry that asks for credentials (Basic with htpasswd,
//! Bearer with a token service) gets them from a docker config. Needs
//! root: CI runs it as root.

use std::io::{Read, Write};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};

use crab_tests::containerd::free_port;
use crab_tests::image::python_sdk_archive;
use crab_tests::leftovers::assert_clean;
use crab_tests::sandbox::{
    ask, crabctl_err, crabctl_ok, exec_sh, run_stateful, tree_digest, trust, wait_registered, COUNTER, STORE,
};
use crab_tests::{unique, wait_until, Containerd};

/// Debian's registry, as `packaging/install-deps.sh` unpacks it.
const REGISTRY_BIN: &str = "/opt/crab/registry/docker-registry";

/// A registry of its own, on a free loopback port, its storage in a
/// directory of its own.
struct Registry {
    child: Child,
    dir: PathBuf,
    port: u16,
}

impl Registry {
    /// A registry open to all.
    fn start() -> Self {
        Self::start_with("")
    }

    /// A registry whose config ends with `auth` (an `auth:` section, or
    /// nothing).
    fn start_with(auth: &str) -> Self {
        assert!(
            std::path::Path::new(REGISTRY_BIN).exists(),
            "{REGISTRY_BIN} missing: run packaging/install-deps.sh"
        );
        let mut dir = std::env::temp_dir().join(unique("crab-registry"));
        std::fs::create_dir_all(&dir).unwrap();
        // A free port is only free until someone binds it: a registry that
        // could not bind its port exits, and gets another.
        for _ in 0..5 {
            let port = free_port();
            let config = dir.join("config.yml");
            std::fs::write(
                &config,
                format!(
                    "version: 0.1\nlog:\n  level: warn\nstorage:\n  filesystem:\n    rootdirectory: {}\n\
                     http:\n  addr: 127.0.0.1:{port}\n{auth}",
                    dir.join("data").display()
                ),
            )
            .unwrap();
            // Appended: each try's words stay for the one who reads them.
            let log = std::fs::OpenOptions::new()
                .create(true)
                .append(true)
                .open(dir.join("registry.log"))
                .unwrap();
            let child = Command::new(REGISTRY_BIN)
                .arg("serve")
                .arg(&config)
                .stdin(Stdio::null())
                .stdout(log.try_clone().unwrap())
                .stderr(log)
                .spawn()
                .expect("start docker-registry");
            // Owned from here: killed and its directory removed on any panic.
            let mut r = Registry { child, dir, port };
            let up = wait_until(20, || {
                // 401: it asks for credentials, as configured.
                let answered = r
                    .get("/v2/")
                    .is_some_and(|a| a.starts_with("HTTP/1.1 200") || a.starts_with("HTTP/1.1 401"));
                // An answer counts only while ours runs: another listener
                // may hold the port ours could not bind.
                match r.child.try_wait() {
                    Ok(None) if answered => Some(true),
                    Ok(None) => None,
                    _ => Some(false),
                }
            });
            match up {
                Some(true) => return r,
                Some(false) => {
                    let log = std::fs::read_to_string(r.dir.join("registry.log")).unwrap_or_default();
                    assert!(
                        log.contains("address already in use"),
                        "the registry exited; see {}",
                        r.dir.join("registry.log").display()
                    );
                    // The next try keeps the directory (and its log).
                    dir = std::mem::take(&mut r.dir);
                }
                None => panic!(
                    "the registry never answered; see {}",
                    r.dir.join("registry.log").display()
                ),
            }
        }
        panic!(
            "the registry could not bind a port in five tries; see {}",
            dir.join("registry.log").display()
        )
    }

    /// The answer to a GET of `path` (manifests as OCI's).
    fn get(&self, path: &str) -> Option<String> {
        get(self.port, path)
    }

    fn reference(&self, repo_tag: &str) -> String {
        format!("127.0.0.1:{}/{repo_tag}", self.port)
    }

    /// The file holding blob `digest` in the registry's storage.
    fn blob_file(&self, digest: &str) -> PathBuf {
        let hex = digest.strip_prefix("sha256:").unwrap();
        self.dir
            .join("data/docker/registry/v2/blobs/sha256")
            .join(&hex[..2])
            .join(hex)
            .join("data")
    }
}

/// The answer of the registry on `port` to a GET of `path` (manifests as
/// OCI's).
fn get(port: u16, path: &str) -> Option<String> {
    let addr = std::net::SocketAddr::from(([127, 0, 0, 1], port));
    let limit = std::time::Duration::from_secs(10);
    let mut s = std::net::TcpStream::connect_timeout(&addr, limit).ok()?;
    s.set_read_timeout(Some(limit)).ok()?;
    s.set_write_timeout(Some(limit)).ok()?;
    write!(
        s,
        "GET {path} HTTP/1.1\r\nhost: 127.0.0.1\r\naccept: application/vnd.oci.image.manifest.v1+json\r\n\
         connection: close\r\n\r\n"
    )
    .ok()?;
    let mut answer = String::new();
    s.read_to_string(&mut answer).ok()?;
    Some(answer)
}

impl Drop for Registry {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

#[test]
fn a_version_pushed_on_one_host_is_pulled_and_runs_on_another() {
    let registry = Registry::start();
    let a = Containerd::start();
    let id = "traveller";
    let pid = run_stateful(&a, id);
    wait_registered(&a, id);
    assert_eq!(ask(pid, STORE, "set a 7"), "ok");
    assert_eq!(ask(pid, COUNTER, "hit"), "2");
    exec_sh(&a, id, "mkdir -p /data/x && echo moved > /data/x/f");
    let files = tree_digest(pid, "/data");
    crabctl_ok(&a, &["checkpoint", id]);

    // The first push sends every member (once, whatever members share
    // their content); pushing it again sends nothing.
    let v1 = registry.reference("agents/traveller:v1");
    let first = crabctl_ok(&a, &["push", id, "1", &v1]);
    let n = |v: &serde_json::Value, k: &str| v[k].as_u64().unwrap();
    assert!(
        0 < n(&first, "sent") && n(&first, "sent") <= n(&first, "members"),
        "{first}"
    );
    assert!(n(&first, "sent_bytes") > 1 << 20, "{first}");
    let again = crabctl_ok(&a, &["push", id, "1", &v1]);
    assert_eq!(again["sent"], 0, "{again}");
    assert_eq!(again["digest"], first["digest"]);
    // A later version shares most of its members with the first: only
    // what changed is sent.
    assert_eq!(ask(pid, STORE, "set b 8"), "ok");
    crabctl_ok(&a, &["checkpoint", id]);
    let second = crabctl_ok(&a, &["push", id, "2", &registry.reference("agents/traveller:v2")]);
    eprintln!("first push {first}\nsecond push {second}");
    assert!(
        0 < n(&second, "sent") && n(&second, "sent") < n(&first, "sent"),
        "{second}"
    );
    assert!(n(&second, "sent_bytes") < n(&second, "bytes"), "{second}");

    // Another host: its own containerd, image and crabd, trusting a's key.
    let mut b = Containerd::start();
    b.ctr_ok(&["image", "import", &python_sdk_archive().to_string_lossy()]);
    b.start_crabd();
    let address = b.address().to_string_lossy().into_owned();
    let pull = |reference: &str| -> Vec<String> {
        [
            "pull",
            reference,
            "--namespace",
            &b.namespace,
            "--containerd",
            &address,
        ]
        .map(str::to_owned)
        .to_vec()
    };
    // A version signed by a key b does not trust is refused from its
    // manifest, before any other member is downloaded.
    let e = crabctl_err(&b, &strs(&pull(&v1)));
    assert!(e.contains("does not trust") && e.contains("crabctl keys"), "{e}");
    trust(&b, &a);

    // A registry that serves other bytes than a member's digest is caught
    // before anything is imported.
    let manifest: serde_json::Value = serde_json::from_str(
        registry
            .get(&format!(
                "/v2/agents/traveller/manifests/{}",
                first["digest"].as_str().unwrap()
            ))
            .unwrap()
            .split("\r\n\r\n")
            .nth(1)
            .unwrap(),
    )
    .unwrap();
    let member = manifest["layers"][0]["digest"].as_str().unwrap().to_owned();
    let stored = registry.blob_file(&member);
    let original = std::fs::read(&stored).unwrap();
    let mut tampered = original.clone();
    tampered[0] ^= 0x5a;
    std::fs::write(&stored, &tampered).unwrap();
    let e = crabctl_err(&b, &strs(&pull(&v1)));
    assert!(e.contains(&member) && e.contains("arrived"), "{e}");
    assert_eq!(crabctl_ok(&b, &["ps"]), serde_json::json!([]));
    std::fs::write(&stored, &original).unwrap();

    // What is not there, and what is no reference, say so.
    let e = crabctl_err(&b, &strs(&pull(&registry.reference("agents/traveller:v9"))));
    assert!(e.contains("404"), "{e}");
    let e = crabctl_err(&a, &["push", id, "1", "agents/traveller:v1"]);
    assert!(e.contains("invalid reference"), "{e}");

    // The version: the sandbox runs on b with a's state at v1.
    let r = crabctl_ok(&b, &strs(&pull(&v1)));
    assert_eq!(r["digest"], first["digest"]);
    assert_eq!(r["sandbox"]["id"], id);
    let bpid = r["sandbox"]["pid"].as_i64().unwrap() as i32;
    wait_registered(&b, id);
    assert_eq!(ask(bpid, STORE, "get a"), "7");
    assert_eq!(ask(bpid, STORE, "get b"), "-");
    assert_eq!(ask(bpid, COUNTER, "hit"), "3");
    assert_eq!(tree_digest(bpid, "/data"), files);

    a.remove(id);
    b.remove(id);
    assert_clean(&a.scope(), &[id]);
    assert_clean(&b.scope(), &[id]);
}

fn strs(v: &[String]) -> Vec<&str> {
    v.iter().map(String::as_str).collect()
}

/// A token service for a registry's Bearer challenge: it answers a GET
/// with a token when it carries the Basic credentials it was made with,
/// 401 otherwise, and keeps the query of every request. (The registry's
/// `silly` access controller challenges with it and takes any token: the
/// flow is the real client's against the real registry.)
struct TokenService {
    port: u16,
    asked: std::sync::Arc<std::sync::Mutex<Vec<String>>>,
}

impl TokenService {
    fn start(user: &str, password: &str) -> Self {
        use base64::Engine;
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let port = listener.local_addr().unwrap().port();
        let asked = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
        let expected = format!(
            "basic {}",
            base64::engine::general_purpose::STANDARD.encode(format!("{user}:{password}"))
        )
        .to_ascii_lowercase();
        let log = asked.clone();
        std::thread::spawn(move || {
            for stream in listener.incoming().flatten() {
                use std::io::BufRead;
                let mut reader = std::io::BufReader::new(&stream);
                let mut line = String::new();
                if reader.read_line(&mut line).is_err() {
                    continue;
                }
                let target = line.split_whitespace().nth(1).unwrap_or_default().to_owned();
                let mut authorized = false;
                loop {
                    let mut header = String::new();
                    if reader.read_line(&mut header).unwrap_or(0) == 0 || header.trim().is_empty() {
                        break;
                    }
                    let header = header.trim().to_ascii_lowercase();
                    if let Some(v) = header.strip_prefix("authorization:") {
                        authorized = v.trim() == expected;
                    }
                }
                log.lock()
                    .unwrap()
                    .push(format!("{target} authorized={authorized}"));
                let answer = if authorized {
                    let body = r#"{"token":"crab-test-token","expires_in":300}"#;
                    format!(
                        "HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\
                         connection: close\r\n\r\n{body}",
                        body.len()
                    )
                } else {
                    "HTTP/1.1 401 Unauthorized\r\ncontent-length: 0\r\nconnection: close\r\n\r\n".to_owned()
                };
                let _ = (&stream).write_all(answer.as_bytes());
            }
        });
        TokenService { port, asked }
    }

    fn url(&self) -> String {
        format!("http://127.0.0.1:{}/token", self.port)
    }

    fn asked(&self) -> Vec<String> {
        self.asked.lock().unwrap().clone()
    }
}

#[test]
fn a_registry_that_asks_for_credentials_gets_them_from_a_docker_config() {
    use base64::Engine;
    let a = Containerd::start();
    let id = "signed-in";
    let pid = run_stateful(&a, id);
    wait_registered(&a, id);
    assert_eq!(ask(pid, STORE, "set a 7"), "ok");
    crabctl_ok(&a, &["checkpoint", id]);

    // docker configs: none, wrong and right credentials for both registries.
    let dir = std::env::temp_dir().join(unique("crab-registry-auth"));
    std::fs::create_dir_all(&dir).unwrap();
    struct Remove(PathBuf);
    impl Drop for Remove {
        fn drop(&mut self) {
            let _ = std::fs::remove_dir_all(&self.0);
        }
    }
    let _dir = Remove(dir.clone());
    let htpasswd = Command::new("htpasswd")
        .args(["-nbB", "ann", "s3cret"])
        .output()
        .expect("htpasswd (apache2-utils, from install-deps.sh)");
    assert!(htpasswd.status.success(), "{htpasswd:?}");
    std::fs::write(dir.join("htpasswd"), &htpasswd.stdout).unwrap();
    let basic = Registry::start_with(&format!(
        "auth:\n  htpasswd:\n    realm: crab-test\n    path: {}\n",
        dir.join("htpasswd").display()
    ));
    let tokens = TokenService::start("ann", "s3cret");
    let bearer = Registry::start_with(&format!(
        "auth:\n  silly:\n    realm: {}\n    service: crab-test\n",
        tokens.url()
    ));
    let config = |password: &str| -> String {
        let auth = base64::engine::general_purpose::STANDARD.encode(format!("ann:{password}"));
        let file = dir.join(format!("config-{password}.json"));
        std::fs::write(
            &file,
            format!(
                r#"{{"auths":{{"127.0.0.1:{}":{{"auth":"{auth}"}},"http://127.0.0.1:{}":{{"auth":"{auth}"}}}}}}"#,
                basic.port, bearer.port
            ),
        )
        .unwrap();
        file.to_string_lossy().into_owned()
    };
    let (right, wrong) = (config("s3cret"), config("guess"));
    let address = a.address().to_string_lossy().into_owned();
    let pull = |reference: &str, name: &str| -> i32 {
        let r = crabctl_ok(
            &a,
            &[
                "pull",
                reference,
                "--authfile",
                &right,
                "--name",
                name,
                "--namespace",
                &a.namespace,
                "--containerd",
                &address,
            ],
        );
        wait_registered(&a, name);
        r["sandbox"]["pid"].as_i64().unwrap() as i32
    };
    let none = dir.join("none.json");
    std::fs::write(&none, "{}").unwrap();
    let none = none.to_string_lossy().into_owned();

    // Basic: what is missing or wrong says so and how to fix it.
    let to_basic = basic.reference("agents/signed-in:v1");
    let e = crabctl_err(&a, &["push", id, "1", &to_basic, "--authfile", &none]);
    eprintln!("no credentials: {e}");
    assert!(
        e.contains("asks for credentials") && e.contains("docker login"),
        "{e}"
    );
    let e = crabctl_err(&a, &["push", id, "1", &to_basic, "--authfile", &wrong]);
    eprintln!("wrong credentials: {e}");
    assert!(e.contains("refused the credentials") && e.contains(&wrong), "{e}");
    let missing = dir.join("missing.json");
    let e = crabctl_err(
        &a,
        &[
            "push",
            id,
            "1",
            &to_basic,
            "--authfile",
            &missing.to_string_lossy(),
        ],
    );
    assert!(e.contains("credentials") && e.contains("missing.json"), "{e}");
    crabctl_ok(&a, &["push", id, "1", &to_basic, "--authfile", &right]);
    let basic_pid = pull(&to_basic, "signed-in-basic");
    assert_eq!(ask(basic_pid, STORE, "get a"), "7");

    // Bearer: the token service is asked for the repository's scope with
    // the credentials; without them it refuses, and crabctl says so.
    let to_bearer = bearer.reference("agents/signed-in:v1");
    let e = crabctl_err(&a, &["push", id, "1", &to_bearer, "--authfile", &none]);
    eprintln!("no credentials for the token service: {e}");
    assert!(
        e.contains("token service") && e.contains("asks for credentials"),
        "{e}"
    );
    let pushed = crabctl_ok(&a, &["push", id, "1", &to_bearer, "--authfile", &right]);
    let asked = tokens.asked();
    assert!(
        asked.iter().any(|q| q.contains("service=crab-test")
            && q.contains("scope=repository%3Aagents%2Fsigned-in%3A")
            && q.ends_with("authorized=true")),
        "{asked:?}"
    );
    let by_digest = format!(
        "{}@{}",
        bearer.reference("agents/signed-in"),
        pushed["digest"].as_str().unwrap()
    );
    let bearer_pid = pull(&by_digest, "signed-in-bearer");
    assert_eq!(ask(bearer_pid, STORE, "get a"), "7");

    for sandbox in [id, "signed-in-basic", "signed-in-bearer"] {
        a.remove(sandbox);
    }
    assert_clean(&a.scope(), &[id, "signed-in-basic", "signed-in-bearer"]);
}
