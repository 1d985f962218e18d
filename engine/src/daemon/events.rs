//! What happened to each sandbox (turns, versions, holds, rollbacks,
//! recoveries, failures), for `crabctl logs` and crabd's page.
//!
//! Each event is appended to `<root>/events/<id>.jsonl` (0600, in a 0700
//! directory: turn numbers and errors are the sandbox's business), so a
//! sandbox's log outlives a crabd restart, and is broadcast to live
//! readers. A log is bounded: past [`ROTATE_BYTES`] it becomes
//! `<id>.old.jsonl` (replacing the one before), so a sandbox keeps at most
//! twice that. It goes with the sandbox's history (`gc::purge`).
//!
//! Events are diagnostics, not state: a write that fails is logged and the
//! operation it describes goes on; nothing is fsynced.

use std::collections::HashMap;
use std::io::{BufRead, Write};
use std::os::unix::fs::{DirBuilderExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::time::Instant;

use crab_api::crabd::{Event, EventKind, EventsQuery, MAX_EVENTS_TAIL};
use crab_api::SandboxId;
use parking_lot::Mutex;
use tokio::sync::broadcast;

/// A log's size at which it is rotated.
const ROTATE_BYTES: u64 = 256 * 1024;

/// Live readers' buffer: a reader this far behind is told how many it
/// missed.
const LIVE_BUFFER: usize = 1024;

/// Turns whose answer waits, per sandbox, remembered for their hold; more
/// are not timed.
const MAX_ANSWERED: usize = 256;

/// Every sandbox's events.
#[derive(Debug)]
pub(super) struct EventLog {
    dir: PathBuf,
    live: broadcast::Sender<Event>,
    /// One writer per log at a time (append and rotate).
    write: Mutex<()>,
    /// When each turn's answer began to wait on its version.
    answered: Mutex<HashMap<SandboxId, HashMap<u64, Instant>>>,
}

// === impl EventLog ===

impl EventLog {
    /// The logs under `root`.
    pub(super) fn new(root: &Path) -> Self {
        EventLog {
            dir: root.join("events"),
            live: broadcast::channel(LIVE_BUFFER).0,
            write: Mutex::new(()),
            answered: Mutex::new(HashMap::new()),
        }
    }

    /// Records `kind` for sandbox `id`, now.
    pub(super) fn record(&self, id: &SandboxId, kind: EventKind) {
        let event = Event {
            at_unix_ms: unix_ms(),
            sandbox: id.clone(),
            kind,
        };
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
    /// oldest first. A line that does not parse (a torn last write) is
    /// skipped.
    pub(super) fn recent(&self, id: &SandboxId, tail: usize) -> std::io::Result<Vec<Event>> {
        let tail = tail.min(MAX_EVENTS_TAIL);
        let mut events = Vec::new();
        for path in [self.old_path(id), self.path(id)] {
            let file = match std::fs::File::open(&path) {
                Ok(f) => f,
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => continue,
                Err(e) => return Err(e),
            };
            for line in std::io::BufReader::new(file).lines() {
                if let Ok(event) = serde_json::from_str::<Event>(&line?) {
                    events.push(event);
                }
            }
        }
        let skip = events.len().saturating_sub(tail);
        Ok(events.split_off(skip))
    }

    /// Turn `turn` of `id` has its answer waiting on its version.
    pub(super) fn answer_waits(&self, id: &SandboxId, turn: u64) {
        let mut all = self.answered.lock();
        let turns = all.entry(id.clone()).or_default();
        if turns.len() < MAX_ANSWERED {
            turns.entry(turn).or_insert_with(Instant::now);
        }
    }

    /// Turn `turn` of `id` got its answer (a version or an error): a hold
    /// is recorded if its answer waited.
    pub(super) fn answer_released(&self, id: &SandboxId, turn: u64) {
        let since = {
            let mut all = self.answered.lock();
            let since = all.get_mut(id).and_then(|t| {
                let since = t.remove(&turn);
                // The proxy tells of a waiting answer on a task of its own:
                // one that came after its turn's version would stay. Turns
                // end in order, so earlier ones are done.
                t.retain(|&n, _| n > turn);
                since
            });
            if all.get(id).is_some_and(HashMap::is_empty) {
                all.remove(id);
            }
            since
        };
        if let Some(since) = since {
            let held_ms = since.elapsed().as_secs_f64() * 1e3;
            self.record(id, EventKind::Hold { turn, held_ms });
        }
    }

    /// Forgets the answers of `id` that wait (a rollback renumbers its
    /// turns).
    pub(super) fn forget_answers(&self, id: &SandboxId) {
        self.answered.lock().remove(id);
    }

    /// Deletes sandbox `id`'s logs (its history is gone).
    pub(super) fn remove(&self, id: &SandboxId) {
        let _one_writer = self.write.lock();
        self.answered.lock().remove(id);
        for path in [self.path(id), self.old_path(id)] {
            match std::fs::remove_file(&path) {
                Ok(()) => {}
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
                Err(e) => tracing::warn!(sandbox = %id, path = %path.display(), error = %e, "event log kept"),
            }
        }
    }

    fn path(&self, id: &SandboxId) -> PathBuf {
        self.dir.join(format!("{id}.jsonl"))
    }

    fn old_path(&self, id: &SandboxId) -> PathBuf {
        self.dir.join(format!("{id}.old.jsonl"))
    }

    fn append(&self, event: &Event) -> std::io::Result<()> {
        let mut line = serde_json::to_vec(event).map_err(std::io::Error::other)?;
        line.push(b'\n');
        let _one_writer = self.write.lock();
        std::fs::DirBuilder::new()
            .recursive(true)
            .mode(0o700)
            .create(&self.dir)?;
        let path = self.path(&event.sandbox);
        let mut file = std::fs::OpenOptions::new()
            .append(true)
            .create(true)
            .mode(0o600)
            .custom_flags(nix::libc::O_NOFOLLOW)
            .open(&path)?;
        file.write_all(&line)?;
        if file.metadata()?.len() >= ROTATE_BYTES {
            std::fs::rename(&path, self.old_path(&event.sandbox))?;
        }
        Ok(())
    }
}

// === impl Daemon ===

impl super::Daemon {
    /// Sandbox `sel`'s newest events as JSON lines, then (`follow`) those
    /// that happen, until the caller hangs up.
    pub(super) async fn events_stream(
        self: &std::sync::Arc<Self>,
        sel: &crab_api::SandboxSelector,
        q: EventsQuery,
    ) -> Result<axum::response::Response, super::ApiError> {
        use axum::response::IntoResponse;
        use futures_util::StreamExt;
        let id = self.registry.resolve(sel)?.id;
        // Subscribed before the log is read: nothing that happens after is
        // missed, and what both saw is sent once.
        let live = q.follow.then(|| self.events.subscribe());
        let since = unix_ms();
        let d = self.clone();
        let sid = id.clone();
        let recent = tokio::task::spawn_blocking(move || d.events.recent(&sid, q.tail))
            .await?
            .map_err(|source| super::ApiError::Io {
                op: "read the sandbox's events",
                source,
            })?;
        let mut seen: Vec<Event> = recent.iter().filter(|e| e.at_unix_ms >= since).cloned().collect();
        let line = |e: &Event| {
            let mut line = serde_json::to_vec(e).expect("an event serializes");
            line.push(b'\n');
            Ok::<_, std::io::Error>(line)
        };
        let first: Vec<_> = recent.iter().map(line).collect();
        let first = futures_util::stream::iter(first);
        let body = match live {
            None => axum::body::Body::from_stream(first),
            Some(rx) => {
                let rest = tokio_stream::wrappers::BroadcastStream::new(rx).filter_map(move |r| {
                    let out = match r {
                        Ok(e) if e.sandbox != id => None,
                        Ok(e) => match seen.iter().position(|s| *s == e) {
                            Some(i) => {
                                seen.swap_remove(i);
                                None
                            }
                            None => Some(line(&e)),
                        },
                        // Too slow a reader misses events; it is told how many.
                        Err(tokio_stream::wrappers::errors::BroadcastStreamRecvError::Lagged(n)) => {
                            Some(Ok(format!("{{\"lagged\":{n}}}\n").into_bytes()))
                        }
                    };
                    std::future::ready(out)
                });
                axum::body::Body::from_stream(first.chain(rest))
            }
        };
        Ok(([(axum::http::header::CONTENT_TYPE, "application/x-ndjson")], body).into_response())
    }
}

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

    #[test]
    fn events_are_kept_in_order_bounded_and_removed_with_the_sandbox() {
        let root = tempfile::tempdir().unwrap();
        let log = EventLog::new(root.path());
        let a = SandboxId::new("a").unwrap();
        let b = SandboxId::new("b").unwrap();
        let mut live = log.subscribe();
        log.record(&a, turn(1));
        log.record(&b, turn(7));
        log.record(&a, turn(2));
        assert_eq!(live.try_recv().unwrap().kind, turn(1));
        let of_a = log.recent(&a, 10).unwrap();
        assert_eq!(
            of_a.iter().map(|e| e.kind.clone()).collect::<Vec<_>>(),
            [turn(1), turn(2)]
        );
        assert_eq!(log.recent(&a, 1).unwrap()[0].kind, turn(2));
        use std::os::unix::fs::PermissionsExt;
        let mode = |p: &Path| std::fs::metadata(p).unwrap().permissions().mode() & 0o777;
        assert_eq!(mode(&root.path().join("events")), 0o700);
        assert_eq!(mode(&root.path().join("events/a.jsonl")), 0o600);

        // Past the rotation size, a log keeps its newest events in two
        // files, bounded.
        let n = 2 * ROTATE_BYTES as usize / 80 + 10;
        for i in 0..n as u64 {
            log.record(&a, turn(i));
        }
        let size = |p: PathBuf| std::fs::metadata(p).map_or(0, |m| m.len());
        let total = size(root.path().join("events/a.jsonl")) + size(root.path().join("events/a.old.jsonl"));
        assert!(total <= 2 * ROTATE_BYTES + 200, "{total}");
        let newest = log.recent(&a, MAX_EVENTS_TAIL + 5).unwrap();
        assert_eq!(newest.len(), MAX_EVENTS_TAIL);
        assert_eq!(newest.last().unwrap().kind, turn(n as u64 - 1));

        // A torn last line is skipped, the rest read.
        let mut f = std::fs::OpenOptions::new()
            .append(true)
            .open(root.path().join("events/b.jsonl"))
            .unwrap();
        f.write_all(b"{\"at_unix_ms\":1,\"sand").unwrap();
        assert_eq!(log.recent(&b, 10).unwrap().len(), 1);

        log.remove(&a);
        assert!(log.recent(&a, 10).unwrap().is_empty());
        assert_eq!(log.recent(&b, 10).unwrap().len(), 1);
    }

    #[test]
    fn a_hold_is_recorded_only_for_an_answer_that_waited() {
        let root = tempfile::tempdir().unwrap();
        let log = EventLog::new(root.path());
        let a = SandboxId::new("a").unwrap();
        log.answer_released(&a, 1);
        log.answer_waits(&a, 2);
        log.answer_released(&a, 2);
        log.answer_waits(&a, 3);
        log.forget_answers(&a);
        log.answer_released(&a, 3);
        // Told after its version: dropped when a later turn is answered.
        log.answer_waits(&a, 4);
        log.answer_released(&a, 5);
        log.answer_released(&a, 4);
        assert!(log.answered.lock().is_empty());
        let kinds: Vec<_> = log.recent(&a, 10).unwrap().into_iter().map(|e| e.kind).collect();
        assert!(
            matches!(kinds.as_slice(), [EventKind::Hold { turn: 2, held_ms }] if *held_ms >= 0.0),
            "{kinds:?}"
        );
    }
}
