//! Credentials for a registry, found where docker keeps them, and the two
//! ways a registry asks for them: `Basic` (RFC 7617: the user and password
//! on every request) and `Bearer` (the distribution token flow: the
//! challenge names a token service, which is asked for a token for the
//! request's scope, with the user and password when there are any).
//!
//! Where credentials come from, first found: `--authfile FILE`, else
//! `$DOCKER_CONFIG/config.json`, else `~/.docker/config.json` (what
//! `docker login` writes). In it, the registry's entry of `auths` (its
//! `auth`, base64 of `user:password`, or `username` and `password`), or a
//! credential helper (`credHelpers` for the registry, else `credsStore`):
//! `docker-credential-<name> get`, asked with the registry's host.

use std::collections::HashMap;
use std::io::{IsTerminal, Read, Write};
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use base64::Engine;
use serde::Deserialize;

/// A user name and password (or an access token used as one) for one
/// registry, and where they were found.
#[derive(Clone)]
pub struct Credentials {
    username: String,
    password: String,
    /// The file or helper they came from, for messages.
    pub source: String,
}

impl std::fmt::Debug for Credentials {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Credentials")
            .field("username", &self.username)
            .field("source", &self.source)
            .finish_non_exhaustive()
    }
}

/// Why no credentials could be read (none found is not an error).
#[derive(Debug, thiserror::Error)]
pub enum AuthError {
    /// The file cannot be read or is not a docker config.
    #[error("credentials: {}: {reason}", path.display())]
    File {
        /// The file.
        path: PathBuf,
        /// Why.
        reason: String,
    },
    /// The credential helper failed.
    #[error("credentials for {registry}: docker-credential-{helper}: {reason}")]
    Helper {
        /// The helper's name.
        helper: String,
        /// The registry.
        registry: String,
        /// Why.
        reason: String,
    },
}

/// docker's `config.json`, the parts that name credentials.
#[derive(Deserialize, Default)]
#[serde(rename_all = "camelCase")]
struct DockerConfig {
    #[serde(default)]
    auths: HashMap<String, AuthEntry>,
    #[serde(default)]
    cred_helpers: HashMap<String, String>,
    #[serde(default)]
    creds_store: Option<String>,
}

#[derive(Deserialize, Default)]
#[serde(rename_all = "lowercase")]
struct AuthEntry {
    #[serde(default)]
    auth: Option<String>,
    #[serde(default)]
    username: Option<String>,
    #[serde(default)]
    password: Option<String>,
    #[serde(default)]
    identitytoken: Option<String>,
}

/// The longest a credential helper may take to answer.
const HELPER_TIME: Duration = Duration::from_secs(30);

/// What a credential helper answers.
#[derive(Deserialize)]
#[serde(rename_all = "PascalCase")]
struct HelperAnswer {
    username: String,
    secret: String,
}

/// The file credentials are read from: `authfile` when given, else docker's
/// `config.json` (`$DOCKER_CONFIG`, else `~/.docker`).
pub fn auth_file(authfile: Option<&Path>) -> Option<PathBuf> {
    if let Some(f) = authfile {
        return Some(f.to_owned());
    }
    let dir = std::env::var_os("DOCKER_CONFIG")
        .map(PathBuf::from)
        .or_else(|| std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".docker")))?;
    Some(dir.join("config.json"))
}

/// The credentials `file` holds for `registry` (`host[:port]`); `None` when
/// it names none. A missing file names none, unless it was asked for
/// (`required`).
///
/// # Errors
/// The file cannot be read or parsed, an entry is malformed, or its helper
/// fails.
pub fn lookup(file: &Path, registry: &str, required: bool) -> Result<Option<Credentials>, AuthError> {
    let bad = |reason: String| AuthError::File {
        path: file.to_owned(),
        reason,
    };
    let text = match std::fs::read(file) {
        Ok(t) => t,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound && !required => return Ok(None),
        Err(e) => return Err(bad(e.to_string())),
    };
    // Where, not what: serde's message may quote the value, a secret.
    let config: DockerConfig = serde_json::from_slice(&text).map_err(|e| {
        bad(format!(
            "not a docker config.json (line {}, column {})",
            e.line(),
            e.column()
        ))
    })?;
    if let Some(helper) = config.cred_helpers.get(registry).or(config.creds_store.as_ref()) {
        if let Some(found) = from_helper(helper, registry)? {
            return Ok(Some(found));
        }
    }
    // The key spelled as the registry first, then the others in order:
    // the same file always gives the same answer.
    let mut keys: Vec<&String> = config
        .auths
        .keys()
        .filter(|k| names_registry(k, registry))
        .collect();
    keys.sort_by_key(|k| (k.as_str() != registry, k.as_str()));
    let Some(entry) = keys.first().map(|k| &config.auths[*k]) else {
        return Ok(None);
    };
    let source = file.display().to_string();
    if entry.identitytoken.is_some() {
        return Err(bad(format!(
            "the entry for {registry} holds an identity token, which crabctl cannot use: \
             log in with a user and password or an access token"
        )));
    }
    match (&entry.auth, &entry.username, &entry.password) {
        (Some(auth), _, _) => {
            let decoded = base64::engine::general_purpose::STANDARD
                .decode(auth.trim())
                .map_err(|_| bad(format!("the auth of {registry} is not base64")))?;
            let text = String::from_utf8(decoded)
                .map_err(|_| bad(format!("the auth of {registry} is not UTF-8")))?;
            let (username, password) = text
                .split_once(':')
                .ok_or_else(|| bad(format!("the auth of {registry} is not user:password")))?;
            Ok(Some(Credentials {
                username: username.to_owned(),
                password: password.to_owned(),
                source,
            }))
        }
        (None, Some(username), Some(password)) => Ok(Some(Credentials {
            username: username.clone(),
            password: password.clone(),
            source,
        })),
        _ => Ok(None),
    }
}

/// Whether a key of `auths` names `registry`: the host as docker writes
/// it, with or without a scheme and path (`https://host/v1/`); Docker
/// Hub's legacy key names `docker.io` too.
fn names_registry(key: &str, registry: &str) -> bool {
    let host = key
        .trim_start_matches("https://")
        .trim_start_matches("http://")
        .split('/')
        .next()
        .unwrap_or_default();
    host.eq_ignore_ascii_case(registry) || (is_hub(host) && is_hub(registry))
}

/// Whether `host` is Docker Hub's.
fn is_hub(host: &str) -> bool {
    matches!(host, "docker.io" | "index.docker.io" | "registry-1.docker.io")
}

/// Asks `docker-credential-<helper>` for `registry`'s credentials; `None`
/// when it has none.
fn from_helper(helper: &str, registry: &str) -> Result<Option<Credentials>, AuthError> {
    let fail = |reason: String| AuthError::Helper {
        helper: helper.to_owned(),
        registry: registry.to_owned(),
        reason,
    };
    if helper.is_empty()
        || !helper
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b"-_.".contains(&b))
    {
        return Err(fail("not a helper name".to_owned()));
    }
    let program = format!("docker-credential-{helper}");
    let mut cmd = Command::new(&program);
    if !std::io::stdin().is_terminal() {
        // Its own group, so that a hung helper goes with what it started;
        // not under a terminal, where a helper may ask on it (a background
        // group would be stopped) and Ctrl-C must reach it.
        cmd.process_group(0);
    }
    let mut child = cmd
        .arg("get")
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .map_err(|e| {
            fail(format!(
                "cannot run it ({e}); install it or remove it from the config"
            ))
        })?;
    // Docker Hub's credentials are kept under its legacy index URL, which
    // is what docker asks helpers for.
    let server = if is_hub(registry) {
        "https://index.docker.io/v1/"
    } else {
        registry
    };
    if let Some(mut stdin) = child.stdin.take() {
        // A helper that exits without reading is answered by its status.
        let _ = stdin.write_all(server.as_bytes());
    }
    let out = wait_helper(&mut child, HELPER_TIME).map_err(|e| fail(e.to_string()))?;
    let Some(out) = out else {
        return Err(fail(format!("no answer in {} s", HELPER_TIME.as_secs())));
    };
    if !out.status.success() {
        let said = String::from_utf8_lossy(&out.stdout);
        // What docker's helpers say of a registry they hold nothing for.
        if said.contains("credentials not found") {
            return Ok(None);
        }
        let why = String::from_utf8_lossy(&out.stderr);
        return Err(fail(format!("{}: {}", out.status, why.trim())));
    }
    let answer: HelperAnswer = serde_json::from_slice(&out.stdout)
        .map_err(|e| fail(format!("an answer that is not its JSON (column {})", e.column())))?;
    if answer.username == "<token>" {
        return Err(fail(
            "it holds an identity token, which crabctl cannot use: log in with a user and password or an access token"
                .to_owned(),
        ));
    }
    Ok(Some(Credentials {
        username: answer.username,
        password: answer.secret,
        source: program,
    }))
}

/// `child`'s exit and output, or `None` when it did not end within
/// `limit`: it is then killed with its process group, if it leads one
/// (unreaped, its pid is still its own, and so is a group of that id), and
/// reaped. A hung helper (a keychain waiting on a
/// prompt no one sees) must not hang a push. A helper that ended has
/// written its answer; a process it left holding its output delays the
/// read by [`HELPER_GRACE`] at most.
fn wait_helper(child: &mut Child, limit: Duration) -> std::io::Result<Option<Output>> {
    let deadline = Instant::now() + limit;
    let (stdout, stderr) = (drain(child.stdout.take()), drain(child.stderr.take()));
    let mut status = None;
    while status.is_none() && Instant::now() < deadline {
        status = child.try_wait()?;
        if status.is_none() {
            std::thread::sleep(Duration::from_millis(10));
        }
    }
    let Some(status) = status else {
        let group = nix::unistd::Pid::from_raw(child.id() as i32);
        let _ = nix::sys::signal::killpg(group, nix::sys::signal::Signal::SIGKILL);
        let _ = child.kill();
        child.wait()?;
        return Ok(None);
    };
    let until = Instant::now() + HELPER_GRACE;
    Ok(Some(Output {
        status,
        stdout: collect(&stdout, until),
        stderr: collect(&stderr, until),
    }))
}

/// How long a helper's output is read on after it ended.
const HELPER_GRACE: Duration = Duration::from_secs(1);

/// The most of a helper's output that is kept (an answer is a few
/// hundred bytes).
const HELPER_OUTPUT: usize = 1 << 20;

/// Reads `pipe` on a thread of its own, chunk by chunk, until its end.
fn drain(pipe: Option<impl Read + Send + 'static>) -> mpsc::Receiver<Vec<u8>> {
    let (tx, rx) = mpsc::channel();
    if let Some(mut pipe) = pipe {
        std::thread::spawn(move || {
            let mut buf = [0u8; 8192];
            loop {
                match pipe.read(&mut buf) {
                    Ok(0) => return,
                    Ok(n) => {
                        if tx.send(buf[..n].to_vec()).is_err() {
                            return;
                        }
                    }
                    Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                    Err(_) => return,
                }
            }
        });
    }
    rx
}

/// What `drain` read until its pipe ended or `until`, whichever is first.
fn collect(chunks: &mpsc::Receiver<Vec<u8>>, until: Instant) -> Vec<u8> {
    let mut out = Vec::new();
    while let Ok(chunk) = chunks.recv_timeout(until.saturating_duration_since(Instant::now())) {
        if out.len() < HELPER_OUTPUT {
            out.extend(chunk);
        }
    }
    out
}

impl Credentials {
    /// The `Authorization` value of Basic authentication.
    pub fn basic(&self) -> String {
        let pair = format!("{}:{}", self.username, self.password);
        format!("Basic {}", base64::engine::general_purpose::STANDARD.encode(pair))
    }

    /// The user name (a token service is told it as `account`).
    pub fn username(&self) -> &str {
        &self.username
    }
}

/// A `WWW-Authenticate` challenge: its scheme (lower case) and parameters
/// (names lower case).
#[derive(Debug, PartialEq, Eq)]
pub struct Challenge {
    /// `basic` or `bearer` (or another, which crabctl cannot answer).
    pub scheme: String,
    /// `realm`, `service`, `scope`, …
    pub params: HashMap<String, String>,
}

impl Challenge {
    /// Parses the first challenge of a `WWW-Authenticate` value:
    /// `Scheme name="quoted, with commas",name=token`.
    pub fn parse(header: &str) -> Option<Challenge> {
        let header = header.trim();
        let (scheme, mut rest) = header.split_once(char::is_whitespace).unwrap_or((header, ""));
        if scheme.is_empty() {
            return None;
        }
        let mut params = HashMap::new();
        loop {
            rest = rest.trim_start_matches([' ', '\t', ',']);
            let Some((name, after)) = rest.split_once('=') else {
                break;
            };
            let name = name.trim();
            if name.is_empty() || name.contains(char::is_whitespace) {
                // The next challenge's scheme: only the first is read.
                break;
            }
            let (value, after) = if let Some(quoted) = after.strip_prefix('"') {
                let mut value = String::new();
                let mut chars = quoted.char_indices();
                let mut end = None;
                while let Some((i, c)) = chars.next() {
                    match c {
                        '\\' => {
                            if let Some((_, escaped)) = chars.next() {
                                value.push(escaped);
                            }
                        }
                        '"' => {
                            end = Some(i + 1);
                            break;
                        }
                        c => value.push(c),
                    }
                }
                (value, &quoted[end?..])
            } else {
                let end = after.find(',').unwrap_or(after.len());
                (after[..end].trim().to_owned(), &after[end..])
            };
            params.insert(name.to_ascii_lowercase(), value);
            rest = after;
        }
        Some(Challenge {
            scheme: scheme.to_ascii_lowercase(),
            params,
        })
    }
}

/// A token service's answer (`token`, or OAuth2's `access_token`).
#[derive(Deserialize)]
pub struct TokenAnswer {
    #[serde(default)]
    token: Option<String>,
    #[serde(default)]
    access_token: Option<String>,
}

impl TokenAnswer {
    /// The token, if the answer has one.
    pub fn token(self) -> Option<String> {
        self.token.or(self.access_token).filter(|t| !t.is_empty())
    }
}

/// `value` percent-encoded for a URL's query (RFC 3986's unreserved
/// characters kept).
pub fn query_escape(value: &str) -> String {
    value
        .bytes()
        .map(|b| match b {
            b'A'..=b'Z' | b'a'..=b'z' | b'0'..=b'9' | b'-' | b'.' | b'_' | b'~' => (b as char).to_string(),
            b => format!("%{b:02X}"),
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_bearer_challenge_with_commas_in_its_scope() {
        let c = Challenge::parse(
            r#"Bearer realm="https://auth.example/token",service="registry.example",scope="repository:a/b:pull,push""#,
        )
        .unwrap();
        assert_eq!(c.scheme, "bearer");
        assert_eq!(c.params["realm"], "https://auth.example/token");
        assert_eq!(c.params["service"], "registry.example");
        assert_eq!(c.params["scope"], "repository:a/b:pull,push");
    }

    #[test]
    fn a_basic_challenge_and_what_is_no_challenge() {
        let c = Challenge::parse(r#"Basic realm="Registry Realm""#).unwrap();
        assert_eq!(c.scheme, "basic");
        assert_eq!(c.params["realm"], "Registry Realm");
        assert_eq!(Challenge::parse("  "), None);
        // An unterminated quote is no challenge to answer.
        assert_eq!(Challenge::parse(r#"Bearer realm="https://x"#), None);
        // Only the first of two challenges is read.
        let c = Challenge::parse(r#"Basic realm="a", Bearer realm="b""#).unwrap();
        assert_eq!(c.params.len(), 1);
        assert_eq!(c.params["realm"], "a");
    }

    #[test]
    fn auths_keys_as_docker_writes_them() {
        assert!(names_registry("127.0.0.1:5000", "127.0.0.1:5000"));
        assert!(names_registry("https://ghcr.io", "ghcr.io"));
        assert!(names_registry("https://index.docker.io/v1/", "docker.io"));
        assert!(!names_registry("127.0.0.1:5001", "127.0.0.1:5000"));
        assert!(!names_registry("evil.example/127.0.0.1:5000", "127.0.0.1:5000"));
    }

    #[test]
    fn credentials_from_a_docker_config() {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("config.json");
        let auth = base64::engine::general_purpose::STANDARD.encode("ann:s3:cret");
        std::fs::write(
            &file,
            format!(r#"{{"auths":{{"https://reg.example":{{"auth":"{auth}"}},"other.example":{{"username":"bob","password":"pw"}}}}}}"#),
        )
        .unwrap();
        let c = lookup(&file, "reg.example", true).unwrap().unwrap();
        assert_eq!((c.username.as_str(), c.password.as_str()), ("ann", "s3:cret"));
        assert_eq!(
            c.basic(),
            format!(
                "Basic {}",
                base64::engine::general_purpose::STANDARD.encode("ann:s3:cret")
            )
        );
        assert!(
            !format!("{c:?}").contains("s3:cret"),
            "a secret never reaches a message"
        );
        let c = lookup(&file, "other.example", true).unwrap().unwrap();
        assert_eq!(c.username(), "bob");
        assert!(lookup(&file, "third.example", true).unwrap().is_none());
        // A missing file names nothing unless it was asked for.
        let missing = dir.path().join("none.json");
        assert!(lookup(&missing, "reg.example", false).unwrap().is_none());
        assert!(lookup(&missing, "reg.example", true).is_err());
        std::fs::write(&file, "not json").unwrap();
        let e = lookup(&file, "reg.example", false).unwrap_err().to_string();
        assert!(e.contains("not a docker config.json"), "{e}");
        // A malformed entry's value (a secret) never reaches the message.
        std::fs::write(&file, r#"{"auths":{"reg.example":"c2VjcmV0LXZhbHVl"}}"#).unwrap();
        let e = lookup(&file, "reg.example", false).unwrap_err().to_string();
        assert!(!e.contains("c2VjcmV0LXZhbHVl"), "{e}");
    }

    #[test]
    fn a_helper_that_cannot_run_says_so_and_a_bad_name_runs_nothing() {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("config.json");
        std::fs::write(&file, r#"{"credsStore":"crab-test-missing"}"#).unwrap();
        let e = lookup(&file, "reg.example", true).unwrap_err().to_string();
        assert!(
            e.contains("docker-credential-crab-test-missing") && e.contains("cannot run it"),
            "{e}"
        );
        std::fs::write(&file, r#"{"credHelpers":{"reg.example":"../../bin/sh"}}"#).unwrap();
        let e = lookup(&file, "reg.example", true).unwrap_err().to_string();
        assert!(e.contains("not a helper name"), "{e}");
    }

    fn sh(script: &str) -> Child {
        Command::new("sh")
            .process_group(0)
            .args(["-c", script])
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap()
    }

    /// The pid `sh` wrote to `file` once it started its sleep.
    fn pid_in(file: &Path) -> nix::unistd::Pid {
        let pid = (0..2000)
            .find_map(|_| {
                let pid = std::fs::read_to_string(file).unwrap_or_default();
                if !pid.ends_with('\n') {
                    std::thread::sleep(Duration::from_millis(10));
                }
                pid.ends_with('\n').then_some(pid)
            })
            .expect("the helper starts its sleep");
        nix::unistd::Pid::from_raw(pid.trim().parse().unwrap())
    }

    #[test]
    fn a_helper_is_waited_for_its_answer_and_killed_when_it_hangs() {
        let limit = Duration::from_secs(20);
        // An answer: its status and both outputs.
        let mut child = sh("echo answer; echo why >&2; exit 3");
        let out = wait_helper(&mut child, limit).unwrap().unwrap();
        assert_eq!(out.status.code(), Some(3));
        assert_eq!(
            (&out.stdout[..], &out.stderr[..]),
            (&b"answer\n"[..], &b"why\n"[..])
        );
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("pid");
        let script = |tail: &str| format!("sleep 60 & echo $! > {}; {tail}", file.display());
        // One that ends with its answer, leaving a process that holds its
        // output: the answer, at once.
        let mut child = sh(&script("echo answer"));
        let sleep = pid_in(&file);
        let t = Instant::now();
        let out = wait_helper(&mut child, limit).unwrap().unwrap();
        assert!(t.elapsed() < limit, "not waited out");
        assert_eq!((out.status.code(), &out.stdout[..]), (Some(0), &b"answer\n"[..]));
        let _ = nix::sys::signal::kill(sleep, nix::sys::signal::Signal::SIGKILL);
        // One that hangs: no answer, and it is killed and reaped.
        std::fs::remove_file(&file).unwrap();
        let mut child = sh(&script("wait"));
        let sleep = pid_in(&file);
        assert!(wait_helper(&mut child, Duration::from_millis(300))
            .unwrap()
            .is_none());
        let status = child.try_wait().unwrap().expect("reaped");
        assert_eq!(std::os::unix::process::ExitStatusExt::signal(&status), Some(9));
        // What it started went with it (gone, or a zombie until reaped).
        let dead = (0..500).any(|_| {
            let stat = std::fs::read_to_string(format!("/proc/{sleep}/stat")).unwrap_or_default();
            let state = stat.rsplit(") ").next().and_then(|rest| rest.chars().next());
            let dead = matches!(state, None | Some('Z'));
            if !dead {
                std::thread::sleep(Duration::from_millis(10));
            }
            dead
        });
        let _ = nix::sys::signal::kill(sleep, nix::sys::signal::Signal::SIGKILL);
        assert!(dead, "the hung helper's child was killed with it");
    }

    #[test]
    fn query_values_are_escaped() {
        assert_eq!(
            query_escape("repository:a/b:pull,push"),
            "repository%3Aa%2Fb%3Apull%2Cpush"
        );
    }
}
