//! What happened to each sandbox (turns, versions, holds, rollbacks,
//! recoveries, failures), for `crabctl logs` and crabd's page.
//!
//! Each event is appended to `<root>/events/<id>.jsonl` (0600, in a 0700
//! directory: turn numbers and errors are the sandbox's business), so a
//! sandbox's log outlives a crabd restart, and is broadcast to live
//! readers; both under one lock, so a reader that subscribes and notes the
//! logs' lengths under it gets every event exactly once. A log is bounded:
//! past [`ROTATE_BYTES`] it becomes `<id>.jsonl.1` (replacing the one
//! before), so a sandbox keeps at most twice that. It goes with the
//! sandbox's history (`gc::purge`); an event of a sandbox crabd no longer
//! knows is dropped (checked under the lock, so none comes back after the
//! purge), and logs of unknown sandboxes are swept when crabd starts.
//!
//! Events are diagnostics, not state: a write that fails is logged and the
//! operation it describes goes on; nothing is fsynced.

use std::io::{BufRead, Read, Seek, Write};
use std::os::unix::fs::{DirBuilderExt, FileExt, OpenOptionsExt};
use std::path::{Path, PathBuf};

use crab_api::crabd::{Event, EventKind, EventsQuery, TurnHeld, MAX_EVENTS_TAIL};
use crab_api::SandboxId;
use parking_lot::Mutex;
use tokio::sync::broadcast;

/// A log's size at which it is rotated.
const ROTATE_BYTES: u64 = 256 * 1024;

/// Live readers' buffer: a reader this far behind is told how many it
/// missed.
const LIVE_BUFFER: usize = 1024;

/// Every sandbox's events.
#[derive(Debug)]
pub(super) struct EventLog {
    dir: PathBuf,
    live: broadcast::Sender<Event>,
    /// Held while an event is appended and sent, and while a reader
    /// subscribes and notes where the logs end.
    write: Mutex<()>,
}

/// A log as a reader found it: the open file and its length then.
type Snapshot = Vec<(std::fs::File, u64)>;

// === impl EventLog ===

impl EventLog {
    /// The logs under `root`.
    pub(super) fn new(root: &Path) -> Self {
        EventLog {
            dir: root.join("events"),
            live: broadcast::channel(LIVE_BUFFER).0,
            write: Mutex::new(()),
        }
    }

    /// Records `kind` for sandbox `id`, now, if `known()` (asked under the
    /// lock that [`EventLog::remove`] takes) says crabd still keeps it.
    pub(super) fn record_if(&self, id: &SandboxId, kind: EventKind, known: impl FnOnce() -> bool) {
        let event = Event {
            at_unix_ms: unix_ms(),
            sandbox: id.clone(),
            kind,
        };
        let _one_writer = self.write.lock();
        if !known() {
            tracing::debug!(sandbox = %id, "event of a forgotten sandbox dropped");
            return;
        }
        if let Err(e) = self.append(&event) {
            tracing::warn!(sandbox = %id, error = %e, "event not logged");
        }
        // No reader is no error.
        let _ = self.live.send(event);
    }

    /// Events as they happen, from now on.
    pub(super) fn subscribe(&self) -> broadcast::Receiver<Event> {
        self.live.subscribe()
    }

    /// Sandbox `id`'s newest `tail` events (at most [`MAX_EVENTS_TAIL`]),
    /// oldest first.
    pub(super) fn recent(&self, id: &SandboxId, tail: usize) -> std::io::Result<Vec<Event>> {
        let snapshot = {
            let _no_writer = self.write.lock();
            self.snapshot(id)?
        };
        read(id, snapshot, tail)
    }

    /// Subscribes to events as they happen and reads sandbox `id`'s newest
    /// `tail`: every event is in one of the two, once.
    pub(super) fn recent_then_live(
        &self,
        id: &SandboxId,
        tail: usize,
    ) -> std::io::Result<(Vec<Event>, broadcast::Receiver<Event>)> {
        let (snapshot, live) = {
            let _no_writer = self.write.lock();
            (self.snapshot(id)?, self.live.subscribe())
        };
        Ok((read(id, snapshot, tail)?, live))
    }

    /// Deletes sandbox `id`'s logs (its history is gone).
    pub(super) fn remove(&self, id: &SandboxId) {
        let _one_writer = self.write.lock();
        for path in [self.path(id), self.old_path(id)] {
            match std::fs::remove_file(&path) {
                Ok(()) => {}
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
                Err(e) => tracing::warn!(sandbox = %id, path = %path.display(), error = %e, "event log kept"),
            }
        }
    }

    /// Deletes the logs of sandboxes `known` does not name (their history
    /// went while no crabd ran, or before a crash let it delete them).
    pub(super) fn sweep(&self, known: impl Fn(&SandboxId) -> bool) {
        let Ok(entries) = std::fs::read_dir(&self.dir) else {
            return;
        };
        for entry in entries.flatten() {
            let name = entry.file_name();
            let Some(name) = name.to_str() else { continue };
            let id = name
                .strip_suffix(".jsonl")
                .or_else(|| name.strip_suffix(".jsonl.1"))
                .and_then(|id| SandboxId::new(id).ok());
            if id.is_some_and(|id| !known(&id)) {
                tracing::info!(file = name, "event log of a forgotten sandbox removed");
                let _ = std::fs::remove_file(entry.path());
            }
        }
    }

    /// `<id>.jsonl`: no other id's log or rotated log has this name (a
    /// rotated one ends in `.1`).
    fn path(&self, id: &SandboxId) -> PathBuf {
        self.dir.join(format!("{id}.jsonl"))
    }

    fn old_path(&self, id: &SandboxId) -> PathBuf {
        self.dir.join(format!("{id}.jsonl.1"))
    }

    /// `id`'s logs, oldest first, open, with their lengths now. The caller
    /// holds the write lock.
    fn snapshot(&self, id: &SandboxId) -> std::io::Result<Snapshot> {
        let mut files = Vec::new();
        for path in [self.old_path(id), self.path(id)] {
            match std::fs::File::open(&path) {
                Ok(f) => {
                    let len = f.metadata()?.len();
                    files.push((f, len));
                }
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
                Err(e) => return Err(e),
            }
        }
        Ok(files)
    }

    /// The caller holds the write lock.
    fn append(&self, event: &Event) -> std::io::Result<()> {
        let mut line = serde_json::to_vec(event).map_err(std::io::Error::other)?;
        line.push(b'\n');
        std::fs::DirBuilder::new()
            .recursive(true)
            .mode(0o700)
            .create(&self.dir)?;
        let path = self.path(&event.sandbox);
        let mut file = std::fs::OpenOptions::new()
            .read(true)
            .append(true)
            .create(true)
            .mode(0o600)
            .custom_flags(nix::libc::O_NOFOLLOW)
            .open(&path)?;
        // A write cut short (a full disk, a crash) left no newline: the
        // torn line stays alone and this one is whole.
        let len = file.metadata()?.len();
        let mut last = [0u8; 1];
        if len > 0 && file.read_at(&mut last, len - 1)? == 1 && last[0] != b'\n' {
            line.insert(0, b'\n');
        }
        file.write_all(&line)?;
        if len + line.len() as u64 >= ROTATE_BYTES {
            std::fs::rename(&path, self.old_path(&event.sandbox))?;
        }
        Ok(())
    }
}

/// The newest `tail` events of `id` in `snapshot`, oldest first; a line
/// that does not parse (a torn write, cut even inside a character) or
/// names another sandbox is skipped.
fn read(id: &SandboxId, snapshot: Snapshot, tail: usize) -> std::io::Result<Vec<Event>> {
    let tail = tail.min(MAX_EVENTS_TAIL);
    let mut events = Vec::new();
    for (mut file, len) in snapshot {
        file.rewind()?;
        for line in std::io::BufReader::new(file.take(len)).split(b'\n') {
            match serde_json::from_slice::<Event>(&line?) {
                Ok(event) if event.sandbox == *id => events.push(event),
                _ => {}
            }
        }
    }
    let skip = events.len().saturating_sub(tail);
    Ok(events.split_off(skip))
}

// === impl Daemon ===

impl super::Daemon {
    /// Records `kind` for sandbox `id`, unless crabd no longer keeps it
    /// (an operation that ends after its history went).
    pub(super) fn log_event(&self, id: &SandboxId, kind: EventKind) {
        self.events
            .record_if(id, kind, || self.registry.get(id).is_some());
    }

    /// Sandbox `sel`'s newest events as JSON lines, then (`follow`) those
    /// that happen, until the caller hangs up or crabd stops.
    pub(super) async fn events_stream(
        self: &std::sync::Arc<Self>,
        sel: &crab_api::SandboxSelector,
        q: EventsQuery,
    ) -> Result<axum::response::Response, super::ApiError> {
        use axum::response::IntoResponse;
        use futures_util::StreamExt;
        let id = self.registry.resolve(sel)?.id;
        let d = self.clone();
        let sid = id.clone();
        let (recent, live) = tokio::task::spawn_blocking(move || d.events.recent_then_live(&sid, q.tail))
            .await?
            .map_err(|source| super::ApiError::Io {
                op: "read the sandbox's events",
                source,
            })?;
        let line = |e: &Event| {
            let mut line = serde_json::to_vec(e).expect("an event serializes");
            line.push(b'\n');
            Ok::<_, std::io::Error>(line)
        };
        let first = futures_util::stream::iter(recent.iter().map(line).collect::<Vec<_>>());
        let body = match q.follow {
            false => axum::body::Body::from_stream(first),
            true => {
                let rest = tokio_stream::wrappers::BroadcastStream::new(live)
                    .filter_map(move |r| {
                        std::future::ready(match r {
                            Ok(e) if e.sandbox == id => Some(line(&e)),
                            Ok(_) => None,
                            // Too slow a reader misses events; it is told how many.
                            Err(tokio_stream::wrappers::errors::BroadcastStreamRecvError::Lagged(n)) => {
                                Some(Ok(format!("{{\"lagged\":{n}}}\n").into_bytes()))
                            }
                        })
                    })
                    .take_until(self.stopping.clone().cancelled_owned());
                axum::body::Body::from_stream(first.chain(rest))
            }
        };
        Ok(([(axum::http::header::CONTENT_TYPE, "application/x-ndjson")], body).into_response())
    }

    /// Turn `turn` of sandbox `id` had its answer held `held_ms` for its
    /// version, as its proxy measured it.
    pub(super) fn turn_held(&self, id: &SandboxId, turn: u64, held: TurnHeld) -> Result<(), super::ApiError> {
        let reg = self.registry.resolve_exact(id)?;
        if !(held.held_ms.is_finite() && (0.0..=MAX_HELD_MS).contains(&held.held_ms)) {
            return Err(super::ApiError::BadRequest {
                reason: format!("held_ms must be 0 to {MAX_HELD_MS}, not {}", held.held_ms),
            });
        }
        self.log_event(
            &reg.id,
            EventKind::Hold {
                turn,
                held_ms: held.held_ms,
            },
        );
        Ok(())
    }
}

/// The longest hold a proxy may report (a day, in milliseconds).
const MAX_HELD_MS: f64 = 86_400_000.0;

/// Milliseconds since the Unix epoch.
fn unix_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crab_api::Class;

    fn turn(n: u64) -> EventKind {
        EventKind::Turn {
            turn: n,
            class: Some(Class::Fs),
            version: Some(n),
            error: None,
        }
    }

    fn record(log: &EventLog, id: &SandboxId, kind: EventKind) {
        log.record_if(id, kind, || true);
    }

    #[test]
    fn events_are_kept_in_order_bounded_and_removed_with_the_sandbox() {
        let root = tempfile::tempdir().unwrap();
        let log = EventLog::new(root.path());
        let a = SandboxId::new("a").unwrap();
        // Its name is `a`'s log's: the logs stay apart.
        let b = SandboxId::new("a.jsonl").unwrap();
        let mut live = log.subscribe();
        record(&log, &a, turn(1));
        record(&log, &b, turn(7));
        record(&log, &a, turn(2));
        assert_eq!(live.try_recv().unwrap().kind, turn(1));
        let of_a = log.recent(&a, 10).unwrap();
        assert_eq!(
            of_a.iter().map(|e| e.kind.clone()).collect::<Vec<_>>(),
            [turn(1), turn(2)]
        );
        assert_eq!(log.recent(&a, 1).unwrap()[0].kind, turn(2));
        assert_eq!(log.recent(&b, 10).unwrap().len(), 1);
        use std::os::unix::fs::PermissionsExt;
        let mode = |p: &Path| std::fs::metadata(p).unwrap().permissions().mode() & 0o777;
        assert_eq!(mode(&root.path().join("events")), 0o700);
        assert_eq!(mode(&root.path().join("events/a.jsonl")), 0o600);

        // Past the rotation size, a log keeps its newest events in two
        // files, bounded.
        let n = 2 * ROTATE_BYTES as usize / 80 + 10;
        for i in 0..n as u64 {
            record(&log, &a, turn(i));
        }
        let size = |p: PathBuf| std::fs::metadata(p).map_or(0, |m| m.len());
        let total = size(root.path().join("events/a.jsonl")) + size(root.path().join("events/a.jsonl.1"));
        assert!(total <= 2 * ROTATE_BYTES + 200, "{total}");
        let newest = log.recent(&a, MAX_EVENTS_TAIL + 5).unwrap();
        assert_eq!(newest.len(), MAX_EVENTS_TAIL);
        assert_eq!(newest.last().unwrap().kind, turn(n as u64 - 1));
        assert_eq!(
            log.recent(&b, 10).unwrap().len(),
            1,
            "another sandbox's log is untouched"
        );

        // A torn last line is skipped, and the next event is whole.
        let mut f = std::fs::OpenOptions::new()
            .append(true)
            .open(root.path().join("events/a.jsonl.jsonl"))
            .unwrap();
        // Cut inside a character, too.
        f.write_all(b"{\"at_unix_ms\":1,\"sand\xc3").unwrap();
        record(&log, &b, turn(8));
        let of_b: Vec<_> = log.recent(&b, 10).unwrap().into_iter().map(|e| e.kind).collect();
        assert_eq!(of_b, [turn(7), turn(8)]);

        log.remove(&a);
        assert!(log.recent(&a, 10).unwrap().is_empty());
        assert_eq!(log.recent(&b, 10).unwrap().len(), 2);
    }

    #[test]
    fn a_forgotten_sandbox_logs_nothing_and_its_leftovers_are_swept() {
        let root = tempfile::tempdir().unwrap();
        let log = EventLog::new(root.path());
        let a = SandboxId::new("a").unwrap();
        let gone = SandboxId::new("gone").unwrap();
        log.record_if(&gone, turn(1), || false);
        assert!(!root.path().join("events/gone.jsonl").exists());
        record(&log, &a, turn(1));
        record(&log, &gone, turn(1));
        log.sweep(|id| *id == a);
        assert_eq!(log.recent(&a, 10).unwrap().len(), 1);
        assert!(!root.path().join("events/gone.jsonl").exists());
    }

    #[test]
    fn a_reader_gets_each_event_once_from_the_log_or_live() {
        let root = tempfile::tempdir().unwrap();
        let log = EventLog::new(root.path());
        let a = SandboxId::new("a").unwrap();
        record(&log, &a, turn(1));
        let (recent, mut live) = log.recent_then_live(&a, 10).unwrap();
        record(&log, &a, turn(2));
        assert_eq!(recent.len(), 1);
        assert_eq!(live.try_recv().unwrap().kind, turn(2));
        assert!(live.try_recv().is_err());
    }
}
