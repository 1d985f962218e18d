//! The transcript: per sandbox, an append-only JSONL file of its turns.
//!
//! File: `<transcript_dir>/<sandbox>.jsonl`, one JSON object per line, each
//! with `"v": 1` and a `"kind"`:
//!
//! ```text
//! {"v":1,"kind":"turn","sandbox":"s1","turn":3,"api":"anthropic_messages",
//!  "method":"POST","path":"/v1/messages",
//!  "request":{"headers":[["content-type","application/json"],…],"body":{"text":"{…}"}},
//!  "response":{"status":200,"headers":[…],"body":{"text":"event: …"},
//!              "n_bytes":1234,"capped":false,"end":"complete"},   // null if none
//!  "error":null,                       // or "upstream_unreachable", "upstream_header_timeout", …
//!  "gate":"opened",                    // or hook_failed, hook_timed_out, transcript_timed_out, transcript_failed, cancelled, rolled_back, null
//!  "timing":{"started_unix_ms":…,"headers_us":…,"first_byte_us":…,"end_us":…,"hold_us":…}}
//! {"v":1,"kind":"divergence","sandbox":"s1","turn":2,"path":"/v1/messages",
//!  "expected_sha256":"…","got_sha256":"…","unix_ms":…}
//! {"v":1,"kind":"branch","sandbox":"s1","branch":1,"parent":0,"after":2,"unix_ms":…}
//! {"v":1,"kind":"tool","sandbox":"s1","tool":"rollback_files","via":"mcp","inside":true,
//!  "args":{"turn":2,"files_only":true},"after_turn":5,"result":{…},"error":null,"unix_ms":…,"took_us":…}
//! {"v":1,"kind":"safety","sandbox":"s1","turn":6,"branch":0,"rule":"protected_paths \"/etc/**\"",
//!  "what":"/etc/passwd","version":5,"unix_ms":…}
//! {"v":1,"kind":"overflow","sandbox":"s1","max_bytes":1073741824,"unix_ms":…}
//! ```
//!
//! The conversation is a tree, like the versions it belongs to. Every turn
//! record names its `branch` (0, the root, when absent); a `branch` entry
//! starts branch `branch` as turns 1..=`after` of `parent` followed by its
//! own turns. A restore that puts the agent back to turn k starts a branch
//! after k once the agent goes live again (see `replay`); nothing of the
//! old branch is rewritten. Within one branch the last line of a turn wins.
//!
//! A body is `{"text": …}` when it is UTF-8, `{"base64": …}` otherwise.
//! `authorization`, `proxy-authorization`, `x-api-key`, `api-key`, `cookie`
//! and `set-cookie` headers are never written.
//! A torn last line (crash mid-append) is ignored by [`read_entries`].
//!
//! Durability rule. Invariant: the answer to a turn is released only after
//! every record that was submitted before that turn's request arrived is
//! written and fsynced (or after the hook timeout, recorded as gate outcome
//! `transcript_timed_out`; or once one of them could not be written, as
//! `transcript_failed`: the agent is not wedged by a failing disk). A record is submitted when its exchange ends, so
//! for an agent that waits for each answer before its next request, turn N's
//! record is durable before turn N+1's answer is released.

use std::collections::{BTreeMap, HashMap};
use std::os::unix::fs::{OpenOptionsExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{mpsc, Arc};

use base64::Engine as _;
use bytes::Bytes;
use http::HeaderMap;
use serde::{Deserialize, Serialize};
use tokio::sync::watch;

use crate::outcome::GateOutcome;
use crate::route::Api;
use crate::stats::StatsCell;

/// Entries the writer takes in one batch (one write, one fsync).
const BATCH: usize = 64;

/// The bodies queued for the writer past which a new turn waits until
/// they are written (see [`Transcript::over_budget`]).
pub(crate) const QUEUE_BUDGET: u64 = 64 << 20;

/// Headers never written to a transcript (lower-case).
pub const REDACTED_HEADERS: [&str; 6] = [
    "authorization",
    "proxy-authorization",
    "x-api-key",
    "api-key",
    "cookie",
    "set-cookie",
];

/// One line of a transcript.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum Entry {
    /// A turn's exchange.
    Turn(TurnRecord),
    /// A replayed request that did not match its record.
    Divergence(DivergenceRecord),
    /// A new branch of the conversation.
    Branch(BranchRecord),
    /// A call of the agent's rollback tool (see `tools`).
    Tool(ToolRecord),
    /// A turn the engine rolled back because it broke a safety rule.
    Safety(SafetyRecord),
    /// The transcript reached its size limit: later records are dropped.
    Overflow(OverflowRecord),
}

/// One turn: the request that ended it and the upstream's answer.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TurnRecord {
    /// Format version, 1.
    pub v: u32,
    /// The sandbox.
    pub sandbox: String,
    /// The turn, from 1.
    pub turn: u64,
    /// The branch of the conversation it belongs to (0: the root).
    #[serde(default)]
    pub branch: u64,
    /// The API spoken.
    pub api: Api,
    /// Request method.
    pub method: String,
    /// Request path and query as forwarded.
    pub path: String,
    /// The request.
    pub request: RecordedRequest,
    /// The answer, if a response head arrived.
    pub response: Option<RecordedResponse>,
    /// Error code when the exchange failed before a response head.
    pub error: Option<String>,
    /// How the gate opened; `None` if the agent left before it did.
    pub gate: Option<GateOutcome>,
    /// Timings.
    pub timing: Timing,
}

/// A request as recorded.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RecordedRequest {
    /// Headers in order, secrets left out.
    pub headers: Vec<(String, String)>,
    /// The body, unchanged.
    pub body: RecordedBody,
}

/// A response as recorded.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RecordedResponse {
    /// HTTP status.
    pub status: u16,
    /// Headers in order, secrets left out.
    pub headers: Vec<(String, String)>,
    /// The body (for streams, the concatenated chunks), at most the cap.
    pub body: RecordedBody,
    /// Bytes the agent was sent.
    pub n_bytes: u64,
    /// Whether the body was longer than the cap (so `body` is a prefix).
    pub capped: bool,
    /// How the body ended.
    pub end: StreamEnd,
}

impl RecordedResponse {
    /// Whether `body` is the whole answer.
    pub fn is_complete(&self) -> bool {
        !self.capped && self.end == StreamEnd::Complete
    }
}

/// How a response body ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum StreamEnd {
    /// All of it reached the agent.
    Complete,
    /// The agent disconnected first.
    ClientDisconnected,
    /// The upstream connection broke.
    UpstreamError,
    /// The upstream was idle past the idle deadline.
    IdleTimeout,
    /// The exchange passed the total deadline.
    TotalTimeout,
}

/// A body: text when UTF-8, base64 otherwise.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum RecordedBody {
    /// UTF-8 text.
    Text(String),
    /// Anything else, base64 (standard alphabet).
    Base64(String),
}

/// Timings of a turn, relative to the request's arrival.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct Timing {
    /// Wall clock at arrival, ms since the Unix epoch.
    pub started_unix_ms: u64,
    /// Upstream response head arrived.
    pub headers_us: Option<u64>,
    /// First body byte arrived.
    pub first_byte_us: Option<u64>,
    /// Exchange ended (body done, failed or abandoned).
    pub end_us: u64,
    /// How long the gate held the answer after it arrived.
    pub hold_us: Option<u64>,
}

/// A replay divergence event.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct DivergenceRecord {
    /// Format version, 1.
    pub v: u32,
    /// The sandbox.
    pub sandbox: String,
    /// The turn whose request diverged.
    pub turn: u64,
    /// The request path.
    pub path: String,
    /// SHA-256 of the recorded request's canonical form.
    pub expected_sha256: String,
    /// SHA-256 of the received request's canonical form.
    pub got_sha256: String,
    /// Wall clock, ms since the Unix epoch.
    pub unix_ms: u64,
}

/// The start of a branch: the conversation of `parent` up to turn `after`,
/// then this branch's own turns.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct BranchRecord {
    /// Format version, 1.
    pub v: u32,
    /// The sandbox.
    pub sandbox: String,
    /// The new branch (from 1; 0 is the root).
    pub branch: u64,
    /// The branch it grows from.
    pub parent: u64,
    /// The last turn of `parent` it keeps.
    pub after: u64,
    /// Wall clock, ms since the Unix epoch.
    pub unix_ms: u64,
}

/// A call of the agent's rollback tool, refused ones included.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ToolRecord {
    /// Format version, 1.
    pub v: u32,
    /// The sandbox.
    pub sandbox: String,
    /// The tool (`list_versions`, `checkpoint`, `rollback_files`,
    /// `rollback_sandbox`; `invalid` for a call that did not parse).
    pub tool: String,
    /// `http` or `mcp`.
    pub via: String,
    /// Whether it came from inside the sandbox.
    pub inside: bool,
    /// Its arguments.
    pub args: serde_json::Value,
    /// The newest turn given out when it came.
    pub after_turn: u64,
    /// What it answered, if it succeeded.
    pub result: Option<serde_json::Value>,
    /// Why it failed, if it did.
    pub error: Option<String>,
    /// Wall clock, ms since the Unix epoch.
    pub unix_ms: u64,
    /// How long it took, in microseconds.
    pub took_us: u64,
    /// Calls refused by the rate limit since the previous record and not
    /// recorded (a run of refusals is one record a minute).
    #[serde(default)]
    pub unrecorded_refusals: u64,
}

/// A turn rolled back by a safety rule: the agent got a notice instead of
/// its answer (the turn's record has gate `rolled_back` and is never
/// replayed).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct SafetyRecord {
    /// Format version, 1.
    pub v: u32,
    /// The sandbox.
    pub sandbox: String,
    /// The turn rolled back.
    pub turn: u64,
    /// Its branch.
    pub branch: u64,
    /// The rule it broke.
    pub rule: String,
    /// What broke it.
    pub what: String,
    /// The version the sandbox went back to.
    pub version: u64,
    /// Wall clock, ms since the Unix epoch.
    pub unix_ms: u64,
}

/// The transcript reached its size limit (`[shim.proxy]
/// transcript_max_bytes`): the records after this line were dropped (each
/// counted in the sandbox's `n_transcript_dropped`); a turn missing from
/// the transcript is asked of the LLM again after a restore.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct OverflowRecord {
    /// Format version, 1.
    pub v: u32,
    /// The sandbox.
    pub sandbox: String,
    /// The limit, bytes.
    pub max_bytes: u64,
    /// Wall clock, ms since the Unix epoch.
    pub unix_ms: u64,
}

/// Transcript I/O failures.
#[derive(Debug, thiserror::Error)]
pub enum TranscriptError {
    /// The transcript file could not be opened or created.
    #[error("cannot open transcript {path}")]
    Open {
        /// The file.
        path: PathBuf,
        /// The OS error.
        #[source]
        source: std::io::Error,
    },
    /// The transcript file could not be read.
    #[error("cannot read transcript {path}")]
    Read {
        /// The file.
        path: PathBuf,
        /// The OS error.
        #[source]
        source: std::io::Error,
    },
}

/// The writing side of one sandbox's transcript.
#[derive(Debug)]
pub(crate) struct Transcript {
    path: PathBuf,
    tx: mpsc::Sender<Entry>,
    submitted: AtomicU64,
    durable: watch::Receiver<u64>,
    /// The body bytes queued and not yet written (shared with the writer).
    queued: Arc<AtomicU64>,
    /// The index of the first entry that could not be written, or
    /// `u64::MAX` (set by the writer before it counts the entry done).
    first_lost: Arc<AtomicU64>,
}

/// A record before the target could not be written, or the writer is gone.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Lost;

// === impl RecordedBody ===

impl RecordedBody {
    /// Records `bytes`.
    pub fn from_bytes(bytes: &[u8]) -> Self {
        match std::str::from_utf8(bytes) {
            Ok(s) => Self::Text(s.to_owned()),
            Err(_) => Self::Base64(base64::engine::general_purpose::STANDARD.encode(bytes)),
        }
    }

    /// The recorded bytes; `None` if the base64 is damaged.
    pub fn to_bytes(&self) -> Option<Bytes> {
        match self {
            Self::Text(s) => Some(Bytes::copy_from_slice(s.as_bytes())),
            Self::Base64(b) => base64::engine::general_purpose::STANDARD
                .decode(b)
                .ok()
                .map(Bytes::from),
        }
    }
}

/// Headers as recorded: in order, secrets left out, values lossily decoded.
pub(crate) fn record_headers(headers: &HeaderMap) -> Vec<(String, String)> {
    headers
        .iter()
        .filter(|(name, _)| !REDACTED_HEADERS.contains(&name.as_str()))
        .map(|(name, value)| {
            (
                name.as_str().to_owned(),
                String::from_utf8_lossy(value.as_bytes()).into_owned(),
            )
        })
        .collect()
}

/// Milliseconds since the Unix epoch.
pub(crate) fn unix_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64)
}

/// Reads every entry of a transcript file. A line that is not an entry (a
/// torn last line, or one a failing disk left) is skipped and logged: what
/// it held is missing, which a replay treats as the end of what it knows.
///
/// # Errors
/// [`TranscriptError::Read`] if the file cannot be read.
pub async fn read_entries(path: &Path) -> Result<Vec<Entry>, TranscriptError> {
    let text = tokio::fs::read_to_string(path)
        .await
        .map_err(|source| TranscriptError::Read {
            path: path.to_owned(),
            source,
        })?;
    let lines: Vec<&str> = text.split_terminator('\n').collect();
    let torn_tail = !text.is_empty() && !text.ends_with('\n');
    let mut entries = Vec::with_capacity(lines.len());
    for (idx, line) in lines.iter().enumerate() {
        match serde_json::from_str(line) {
            Ok(entry) => entries.push(entry),
            Err(_) if torn_tail && idx + 1 == lines.len() => break,
            Err(error) => {
                tracing::warn!(path = %path.display(), line = idx + 1, %error, "transcript line skipped: not an entry");
            }
        }
    }
    Ok(entries)
}

/// The newest branch named in `entries` (0 when none was started).
pub fn max_branch(entries: &[Entry]) -> u64 {
    entries
        .iter()
        .map(|e| match e {
            Entry::Branch(b) => b.branch,
            Entry::Turn(t) => t.branch,
            Entry::Divergence(_) | Entry::Tool(_) | Entry::Safety(_) | Entry::Overflow(_) => 0,
        })
        .max()
        .unwrap_or(0)
}

/// The conversation of `branch`, by turn: its own records, then each
/// ancestor's up to the turn where its child grew from it (within a branch
/// the last record of a turn wins). None when `branch` was never started.
pub fn conversation(entries: &[Entry], branch: u64) -> Option<BTreeMap<u64, TurnRecord>> {
    let mut starts: HashMap<u64, (u64, u64)> = HashMap::new();
    let mut own: HashMap<u64, BTreeMap<u64, &TurnRecord>> = HashMap::new();
    for entry in entries {
        match entry {
            Entry::Branch(b) if b.branch != 0 && b.parent != b.branch => {
                starts.entry(b.branch).or_insert((b.parent, b.after));
            }
            Entry::Turn(t) => {
                own.entry(t.branch).or_default().insert(t.turn, t);
            }
            _ => {}
        }
    }
    if branch != 0 && !starts.contains_key(&branch) {
        return None;
    }
    let mut out = BTreeMap::new();
    let (mut at, mut limit) = (branch, u64::MAX);
    // Each step goes to a parent; a cycle (a corrupt file) ends the walk.
    for _ in 0..=starts.len() {
        for (&turn, &record) in own.get(&at).into_iter().flatten().filter(|(t, _)| **t <= limit) {
            out.entry(turn).or_insert_with(|| record.clone());
        }
        let Some(&(parent, after)) = starts.get(&at) else {
            break;
        };
        (at, limit) = (parent, limit.min(after));
    }
    Some(out)
}

/// Writes `records` as the transcript at `path`, which must not exist
/// (0600; written beside it, synced, linked in, so it is whole or absent):
/// the conversation a new sandbox starts from (a fork of a version). Each
/// record is rewritten as `sandbox`'s, on the root branch.
///
/// # Errors
/// [`TranscriptError::Open`] when the file exists or cannot be written.
pub fn write_new(
    path: &Path,
    sandbox: &str,
    records: impl IntoIterator<Item = TurnRecord>,
) -> Result<(), TranscriptError> {
    use std::io::Write;
    let failed = |source| TranscriptError::Open {
        path: path.to_owned(),
        source,
    };
    let mut buf = Vec::new();
    for mut record in records {
        record.sandbox = sandbox.to_owned();
        record.branch = 0;
        // Entries hold only strings, numbers and enums: encoding cannot fail.
        if let Ok(line) = serde_json::to_vec(&Entry::Turn(record)) {
            buf.extend_from_slice(&line);
            buf.push(b'\n');
        }
    }
    let tmp = path.with_extension("jsonl.tmp");
    let _ = std::fs::remove_file(&tmp);
    let mut file = std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o600)
        // With O_EXCL, a symlink is refused, never followed.
        .open(&tmp)
        .map_err(failed)?;
    let written = file
        .write_all(&buf)
        .and_then(|()| file.sync_all())
        // A hard link fails when `path` exists: never over another's.
        .and_then(|()| std::fs::hard_link(&tmp, path));
    let _ = std::fs::remove_file(&tmp);
    written.map_err(failed)?;
    if let Some(dir) = path.parent() {
        std::fs::File::open(dir)
            .and_then(|d| d.sync_all())
            .map_err(failed)?;
    }
    Ok(())
}

// === impl Transcript ===

impl Transcript {
    /// Opens (creates) `path` for appending and starts its writer thread;
    /// the thread ends when this `Transcript` is dropped, once what was
    /// submitted is written.
    ///
    /// The writer is a thread of its own, not a task: an fsync blocks,
    /// and a batch's write, fsync and durability notice then cost one
    /// thread wakeup instead of three (the task, the blocking pool, the
    /// task again).
    pub(crate) async fn open(
        path: PathBuf,
        max_bytes: u64,
        stats: Arc<StatsCell>,
    ) -> Result<Self, TranscriptError> {
        let failed = |source| TranscriptError::Open {
            path: path.clone(),
            source,
        };
        // Prompts, answers and headers: root's alone (0600 in 0700), also
        // when an older version made them wider.
        if let Some(dir) = path.parent() {
            tokio::fs::create_dir_all(dir).await.map_err(failed)?;
            tokio::fs::set_permissions(dir, std::fs::Permissions::from_mode(0o700))
                .await
                .map_err(failed)?;
        }
        cut_torn_tail(&path).await.map_err(failed)?;
        let file = tokio::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .mode(0o600)
            .open(&path)
            .await
            .map_err(failed)?;
        file.set_permissions(std::fs::Permissions::from_mode(0o600))
            .await
            .map_err(failed)?;
        let (tx, rx) = mpsc::channel();
        let (durable_tx, durable) = watch::channel(0);
        let len = file.metadata().await.map_err(failed)?.len();
        let queued = Arc::new(AtomicU64::new(0));
        let first_lost = Arc::new(AtomicU64::new(u64::MAX));
        let writer = Writer {
            queued: queued.clone(),
            first_lost: first_lost.clone(),
            file: file.into_std().await,
            path: path.clone(),
            len,
            max_bytes,
            // Full already: its overflow line is there (or the limit was
            // lowered); nothing more is written.
            overflowed: len >= max_bytes,
            stats,
        };
        std::thread::Builder::new()
            .name("crab-transcript".to_owned())
            .spawn(move || writer.run(&rx, &durable_tx))
            .map_err(failed)?;
        Ok(Self {
            path,
            tx,
            submitted: AtomicU64::new(0),
            durable,
            queued,
            first_lost,
        })
    }

    pub(crate) fn path(&self) -> &Path {
        &self.path
    }

    /// Queues `entry`; never blocks. An answer waits for the records
    /// before its turn, but an agent that drops answers and asks again at
    /// once does not: new turns wait instead while the queue is over its
    /// budget (see [`Self::over_budget`]).
    pub(crate) fn submit(&self, entry: Entry) {
        self.submitted.fetch_add(1, Ordering::SeqCst);
        let size = body_bytes(&entry);
        self.queued.fetch_add(size, Ordering::SeqCst);
        if self.tx.send(entry).is_err() {
            self.queued.fetch_sub(size, Ordering::SeqCst);
            tracing::error!(path = %self.path.display(), "transcript writer gone; entry lost");
        }
    }

    /// Whether more than [`QUEUE_BUDGET`] bytes of bodies wait for the
    /// writer: a new turn then waits for [`Self::submitted`] to be durable
    /// first, which bounds what a sandbox can make the proxy hold.
    pub(crate) fn over_budget(&self) -> bool {
        self.queued.load(Ordering::SeqCst) > QUEUE_BUDGET
    }

    /// How many entries were submitted so far: a target for [`Self::wait_durable`].
    pub(crate) fn submitted(&self) -> u64 {
        self.submitted.load(Ordering::SeqCst)
    }

    /// A future that resolves once the writer is done with the first
    /// `target` entries: Ok when all of them are durable, [`Lost`] when one
    /// could not be written (or the writer is gone).
    pub(crate) fn wait_durable(
        &self,
        target: u64,
    ) -> impl std::future::Future<Output = Result<(), Lost>> + Send + 'static {
        let mut durable = self.durable.clone();
        let first_lost = self.first_lost.clone();
        async move {
            // An Err means the writer ended: nothing more will become durable.
            durable.wait_for(|d| *d >= target).await.map_err(|_| Lost)?;
            if first_lost.load(Ordering::SeqCst) < target {
                return Err(Lost);
            }
            Ok(())
        }
    }
}

/// Cuts a torn last line (a crash mid-append) off the transcript at `path`,
/// if it exists, so the next append starts a line of its own.
async fn cut_torn_tail(path: &Path) -> std::io::Result<()> {
    let path = path.to_owned();
    tokio::task::spawn_blocking(move || {
        use std::os::unix::fs::FileExt;
        let file = match std::fs::OpenOptions::new().read(true).write(true).open(&path) {
            Ok(file) => file,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(()),
            Err(e) => return Err(e),
        };
        let len = file.metadata()?.len();
        let mut end = len;
        let mut buf = vec![0u8; 64 << 10];
        // Back from the end, in chunks, to the last LF.
        while end > 0 {
            let start = end.saturating_sub(buf.len() as u64);
            let chunk = &mut buf[..(end - start) as usize];
            file.read_exact_at(chunk, start)?;
            if let Some(i) = chunk.iter().rposition(|b| *b == b'\n') {
                end = start + i as u64 + 1;
                break;
            }
            end = start;
        }
        if end < len {
            tracing::warn!(cut = len - end, "transcript's torn last line cut off");
            file.set_len(end)?;
        }
        Ok(())
    })
    .await
    .map_err(std::io::Error::other)?
}

/// The bytes of bodies an entry holds (what its queueing costs).
fn body_bytes(entry: &Entry) -> u64 {
    let body = |b: &RecordedBody| match b {
        RecordedBody::Text(t) | RecordedBody::Base64(t) => t.len() as u64,
    };
    match entry {
        Entry::Turn(r) => body(&r.request.body) + r.response.as_ref().map_or(0, |resp| body(&resp.body)),
        _ => 0,
    }
}

/// The writer thread's state.
struct Writer {
    /// [`Transcript::queued`].
    queued: Arc<AtomicU64>,
    /// [`Transcript::first_lost`].
    first_lost: Arc<AtomicU64>,
    /// Written and synced once per batch.
    file: std::fs::File,
    path: PathBuf,
    /// The file's length: whole lines only.
    len: u64,
    /// The size the file may grow to.
    max_bytes: u64,
    /// Whether its overflow line is written.
    overflowed: bool,
    stats: Arc<StatsCell>,
}

impl Writer {
    /// Appends what is queued, fsyncs once per batch (group commit), then
    /// publishes the new durable count. Past the size limit entries are
    /// dropped (after one overflow line). An I/O error is counted and
    /// logged, and the first lost entry noted for [`Transcript::wait_durable`];
    /// the count still advances so that no gate waits for a write that
    /// failed.
    fn run(mut self, rx: &mpsc::Receiver<Entry>, durable: &watch::Sender<u64>) {
        let mut batch = Vec::with_capacity(BATCH);
        // Ends when the `Transcript` (the only sender) is dropped and the
        // queue is empty.
        while let Ok(first) = rx.recv() {
            batch.push(first);
            batch.extend(rx.try_iter().take(BATCH - 1));
            if !self.append(&batch) {
                // The batch's first entry: the count of those before it.
                self.first_lost.fetch_min(*durable.borrow(), Ordering::SeqCst);
            }
            let n = batch.len() as u64;
            let bytes = batch.iter().map(body_bytes).sum();
            batch.clear();
            self.queued.fetch_sub(bytes, Ordering::SeqCst);
            durable.send_modify(|d| *d += n);
        }
    }

    /// Appends `batch`; false when it could not be written.
    fn append(&mut self, batch: &[Entry]) -> bool {
        let start = self.len;
        let overflowed_before = self.overflowed;
        let mut buf = Vec::new();
        let mut dropped = 0;
        for entry in batch {
            if self.overflowed {
                // Full: not worth encoding.
                dropped += 1;
                continue;
            }
            // Entries hold only strings, numbers and enums: encoding cannot fail.
            let Ok(mut line) = serde_json::to_vec(entry) else {
                continue;
            };
            line.push(b'\n');
            let size = start + (buf.len() + line.len()) as u64;
            if self.overflowed || size > self.max_bytes {
                if !self.overflowed {
                    self.overflowed = true;
                    let overflow = Entry::Overflow(OverflowRecord {
                        v: 1,
                        sandbox: sandbox_of(entry).0.to_owned(),
                        max_bytes: self.max_bytes,
                        unix_ms: unix_ms(),
                    });
                    if let Ok(line) = serde_json::to_vec(&overflow) {
                        buf.extend_from_slice(&line);
                        buf.push(b'\n');
                    }
                    let (sandbox, turn) = sandbox_of(entry);
                    tracing::error!(sandbox, turn, path = %self.path.display(), max_bytes = self.max_bytes, "transcript full: later records are dropped");
                }
                dropped += 1;
                continue;
            }
            buf.extend_from_slice(&line);
        }
        if dropped > 0 {
            self.stats.update(|s| s.n_transcript_dropped += dropped);
        }
        if buf.is_empty() {
            return true;
        }
        let n = buf.len() as u64;
        let written = {
            use std::io::Write;
            let mut f = &self.file;
            let written = f.write_all(&buf).and_then(|()| f.sync_data());
            if written.is_err() {
                // A part of the batch may be there: cut it, so no torn
                // line sits between whole ones.
                let _ = f.set_len(start);
            }
            written
        };
        if let Err(error) = written {
            // An overflow line is lost with it: the next batch writes it.
            self.overflowed = overflowed_before;
            self.stats.update(|s| s.n_transcript_errors += batch.len() as u64);
            let (sandbox, turn) = batch.first().map_or(("", 0), sandbox_of);
            tracing::error!(sandbox, turn, path = %self.path.display(), %error, n_entries = batch.len(), "transcript append failed");
            return false;
        }
        self.len = start + n;
        true
    }
}

/// The sandbox and turn an entry names, for logs.
fn sandbox_of(entry: &Entry) -> (&str, u64) {
    match entry {
        Entry::Turn(r) => (r.sandbox.as_str(), r.turn),
        Entry::Divergence(r) => (r.sandbox.as_str(), r.turn),
        Entry::Branch(r) => (r.sandbox.as_str(), r.after),
        Entry::Tool(r) => (r.sandbox.as_str(), r.after_turn),
        Entry::Safety(r) => (r.sandbox.as_str(), r.turn),
        Entry::Overflow(r) => (r.sandbox.as_str(), 0),
    }
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    /// An entry encodes to `expected` and decodes back to itself.
    fn check(entry: Entry, expected: serde_json::Value) {
        let encoded = serde_json::to_value(&entry).expect("encode");
        assert_eq!(encoded, expected);
        let decoded: Entry = serde_json::from_value(encoded).expect("decode");
        assert_eq!(decoded, entry);
    }

    #[test]
    fn format() {
        let timing = Timing {
            started_unix_ms: 5,
            headers_us: Some(1),
            first_byte_us: None,
            end_us: 9,
            hold_us: Some(0),
        };
        let turn = TurnRecord {
            v: 1,
            sandbox: "sb".into(),
            turn: 3,
            branch: 1,
            api: Api::OpenAiChat,
            method: "POST".into(),
            path: "/v1/chat/completions".into(),
            request: RecordedRequest {
                headers: vec![("a".into(), "b".into())],
                body: RecordedBody::from_bytes(b"{}"),
            },
            response: Some(RecordedResponse {
                status: 200,
                headers: vec![],
                body: RecordedBody::from_bytes(&[0xff, 0x00]),
                n_bytes: 2,
                capped: false,
                end: StreamEnd::ClientDisconnected,
            }),
            error: None,
            gate: Some(GateOutcome::HookTimedOut),
            timing,
        };
        check(
            Entry::Turn(turn),
            json!({"kind": "turn", "v": 1, "sandbox": "sb", "turn": 3, "branch": 1, "api": "openai_chat", "method": "POST",
                "path": "/v1/chat/completions",
                "request": {"headers": [["a", "b"]], "body": {"text": "{}"}},
                "response": {"status": 200, "headers": [], "body": {"base64": "/wA="}, "n_bytes": 2,
                             "capped": false, "end": "client_disconnected"},
                "error": null, "gate": "hook_timed_out",
                "timing": {"started_unix_ms": 5, "headers_us": 1, "first_byte_us": null, "end_us": 9, "hold_us": 0}}),
        );
        let divergence = DivergenceRecord {
            v: 1,
            sandbox: "sb".into(),
            turn: 2,
            path: "/v1/messages".into(),
            expected_sha256: "aa".into(),
            got_sha256: "bb".into(),
            unix_ms: 7,
        };
        check(
            Entry::Divergence(divergence),
            json!({"kind": "divergence", "v": 1, "sandbox": "sb", "turn": 2, "path": "/v1/messages",
                "expected_sha256": "aa", "got_sha256": "bb", "unix_ms": 7}),
        );
        let branch = BranchRecord {
            v: 1,
            sandbox: "sb".into(),
            branch: 2,
            parent: 1,
            after: 4,
            unix_ms: 8,
        };
        check(
            Entry::Branch(branch),
            json!({"kind": "branch", "v": 1, "sandbox": "sb", "branch": 2, "parent": 1, "after": 4, "unix_ms": 8}),
        );
        // A turn line written before branches existed is on the root.
        let old = r#"{"kind":"turn","v":1,"sandbox":"sb","turn":1,"api":"openai_chat","method":"POST","path":"/",
            "request":{"headers":[],"body":{"text":""}},"response":null,"error":null,"gate":null,
            "timing":{"started_unix_ms":0,"headers_us":null,"first_byte_us":null,"end_us":0,"hold_us":null}}"#;
        match serde_json::from_str::<Entry>(old).expect("an old line decodes") {
            Entry::Turn(t) => assert_eq!(t.branch, 0),
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn redaction() {
        let mut headers = HeaderMap::new();
        for (k, v) in [
            ("Authorization", "Bearer s"),
            ("x-api-key", "s"),
            ("api-key", "s"),
            ("cookie", "s"),
            ("proxy-authorization", "s"),
            ("content-type", "application/json"),
            ("anthropic-version", "2023-06-01"),
        ] {
            headers.insert(
                http::HeaderName::from_bytes(k.as_bytes()).expect("name"),
                v.parse().expect("value"),
            );
        }
        let kept: Vec<String> = record_headers(&headers).into_iter().map(|(k, _)| k).collect();
        assert_eq!(kept, ["content-type", "anthropic-version"]);
    }

    const LINE: &str = r#"{"kind":"divergence","v":1,"sandbox":"s","turn":1,"path":"/","expected_sha256":"a","got_sha256":"b","unix_ms":1}"#;

    #[tokio::test]
    async fn lines_that_are_no_entries_are_skipped() {
        let dir = tempfile::tempdir().expect("tempdir");
        for (text, n_entries) in [
            (format!("{LINE}\n{LINE}\n"), 2),
            (format!("{LINE}\n{{\"kind\":\"tu"), 1),
            (format!("{{\"kind\":\"tu\n{LINE}\n"), 1),
            (String::new(), 0),
        ] {
            let path = dir.path().join("t.jsonl");
            std::fs::write(&path, &text).expect("write");
            let entries = read_entries(&path).await.expect("read");
            assert_eq!(entries.len(), n_entries, "{text:?}");
        }
    }

    /// A torn last line (a crash mid-append) is cut off when the transcript
    /// is opened again: the next entry starts a line of its own.
    #[tokio::test]
    async fn a_torn_tail_is_cut_off_at_open() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("t.jsonl");
        std::fs::write(&path, format!("{LINE}\n{{\"kind\":\"tu")).expect("write");
        let t = Transcript::open(path.clone(), u64::MAX, Arc::new(StatsCell::default()))
            .await
            .expect("open");
        let entry: Entry = serde_json::from_str(LINE).expect("an entry");
        t.submit(entry);
        t.wait_durable(1).await.expect("written");
        let text = std::fs::read_to_string(&path).expect("read");
        assert_eq!(text, format!("{LINE}\n{LINE}\n"));
    }

    /// Bodies count against the queue's budget until written: two of half
    /// the budget each are over it, and nothing is once they are durable.
    #[tokio::test]
    async fn queued_bodies_count_until_written() {
        let dir = tempfile::tempdir().expect("tempdir");
        let t = Transcript::open(
            dir.path().join("t.jsonl"),
            u64::MAX,
            Arc::new(StatsCell::default()),
        )
        .await
        .expect("open");
        let half = "x".repeat((QUEUE_BUDGET / 2) as usize);
        let turn = Entry::Turn(TurnRecord {
            v: 1,
            sandbox: "sb".into(),
            turn: 1,
            branch: 0,
            api: Api::OpenAiChat,
            method: "POST".into(),
            path: "/v1/chat/completions".into(),
            request: RecordedRequest {
                headers: vec![],
                body: RecordedBody::Text(half.clone()),
            },
            response: Some(RecordedResponse {
                status: 200,
                headers: vec![],
                body: RecordedBody::Text("y".into()),
                n_bytes: 1,
                capped: false,
                end: StreamEnd::Complete,
            }),
            error: None,
            gate: None,
            timing: Timing {
                started_unix_ms: 0,
                headers_us: None,
                first_byte_us: None,
                end_us: 0,
                hold_us: None,
            },
        });
        assert_eq!(body_bytes(&turn), QUEUE_BUDGET / 2 + 1);
        let divergence: Entry = serde_json::from_str(LINE).expect("an entry");
        assert_eq!(body_bytes(&divergence), 0);
        t.submit(turn.clone());
        t.submit(turn);
        t.wait_durable(2).await.expect("written");
        assert!(!t.over_budget(), "written bodies are no longer queued");
        assert_eq!(t.queued.load(Ordering::SeqCst), 0);
    }
}
