//! crabd's page: per sandbox, a live timeline of its turns (coloured by
//! class), checkpoints (size, frozen time), holds, rollbacks and
//! recoveries, and the host's checkpoint queue and store room. Served on
//! `127.0.0.1:[crabd] ui_port` under `/ui/<secret>/`, with no asset from
//! anywhere else; live updates are server-sent events.
//!
//! Every local user can connect to 127.0.0.1: the secret is what makes a
//! request the page's. It is random, new at every start of crabd (a user
//! who takes the port while crabd restarts learns one that no longer
//! admits anything), and only root, who asks crabd's socket (`crabctl
//! ui`), can hand the URL out. A wrong secret or any other
//! path answers 404; a `Host` that is not `127.0.0.1:<port>` or
//! `localhost:<port>` answers 421 (a page of another origin that rebinds a
//! name to 127.0.0.1 reads nothing); a client has [`HEADER_TIMEOUT`] to
//! send its request head, and at most [`MAX_CONNECTIONS`] are served at
//! once. Answers are never cached and send no referrer.

use std::convert::Infallible;
use std::sync::Arc;
use std::time::Duration;

use axum::extract::{Path, State};
use axum::http::{header, HeaderMap, HeaderValue, StatusCode};
use axum::response::sse::{Event as SseEvent, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use axum::{Json, Router};
use crab_api::crabd::{Event, SandboxInfo};
use futures_util::StreamExt;
use hyper_util::rt::{TokioIo, TokioTimer};
use hyper_util::service::TowerToHyperService;
use serde::Serialize;
use tokio::net::TcpListener;
use tokio::sync::Semaphore;
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

use super::Daemon;

/// The page, its script and its style.
const PAGE: &str = include_str!("ui/page.html");
const SCRIPT: &str = include_str!("ui/page.js");
const STYLE: &str = include_str!("ui/page.css");

/// Connections served at once; more are closed at once.
const MAX_CONNECTIONS: usize = 64;

/// How long a client may take to send a request head.
const HEADER_TIMEOUT: Duration = Duration::from_secs(10);

/// Events per sandbox the page starts with.
const EVENTS_PER_SANDBOX: usize = 200;

/// The headers of every answer.
const CSP: &str = "default-src 'none'; script-src 'self'; style-src 'self'; connect-src 'self'; \
                   img-src 'self'; base-uri 'none'; form-action 'none'; frame-ancestors 'none'";

/// Serves the page on `listener` until `stop` is cancelled.
pub(super) fn spawn(listener: TcpListener, daemon: Arc<Daemon>, stop: CancellationToken) -> JoinHandle<()> {
    let port = listener.local_addr().map_or(0, |a| a.port());
    let app = router(daemon, port);
    let slots = Arc::new(Semaphore::new(MAX_CONNECTIONS));
    tokio::spawn(async move {
        loop {
            let (stream, _) = tokio::select! {
                () = stop.cancelled() => return,
                accepted = listener.accept() => match accepted {
                    Ok(conn) => conn,
                    Err(e) => {
                        // EMFILE and friends: back off instead of spinning.
                        tracing::warn!(error = %e, "page: accept failed");
                        tokio::time::sleep(Duration::from_millis(50)).await;
                        continue;
                    }
                },
            };
            let Ok(slot) = slots.clone().try_acquire_owned() else {
                continue;
            };
            let service = TowerToHyperService::new(app.clone());
            let stop = stop.clone();
            tokio::spawn(async move {
                let _slot = slot;
                let conn = hyper::server::conn::http1::Builder::new()
                    .timer(TokioTimer::new())
                    .header_read_timeout(HEADER_TIMEOUT)
                    .serve_connection(TokioIo::new(stream), service);
                tokio::select! {
                    _ = conn => {}
                    () = stop.cancelled() => {}
                }
            });
        }
    })
}

/// The page's routes, for requests to `127.0.0.1:port`.
fn router(daemon: Arc<Daemon>, port: u16) -> Router {
    let page = Arc::new(Page {
        daemon,
        hosts: [format!("127.0.0.1:{port}"), format!("localhost:{port}")],
    });
    Router::new()
        .route("/ui/{secret}/", get(index))
        .route("/ui/{secret}/page.js", get(script))
        .route("/ui/{secret}/page.css", get(style))
        .route("/ui/{secret}/state", get(state))
        .route("/ui/{secret}/live", get(live))
        .fallback(|| async { refused(StatusCode::NOT_FOUND) })
        .with_state(page)
}

/// What the handlers share.
struct Page {
    daemon: Arc<Daemon>,
    /// The `Host` values a request may name.
    hosts: [String; 2],
}

impl Page {
    /// Whether a request with `headers` for `secret` is the page's.
    fn admit(&self, headers: &HeaderMap, secret: &str) -> Result<(), StatusCode> {
        let host = headers
            .get(header::HOST)
            .and_then(|h| h.to_str().ok())
            .unwrap_or_default();
        if !self.hosts.iter().any(|h| h.eq_ignore_ascii_case(host)) {
            return Err(StatusCode::MISDIRECTED_REQUEST);
        }
        if !super::host_listener::same(&self.daemon.ui_secret, secret) {
            return Err(StatusCode::NOT_FOUND);
        }
        Ok(())
    }
}

/// `body` as `content_type`, with the headers every answer carries.
fn asset(content_type: &'static str, body: &'static str) -> Response {
    (guarded([(header::CONTENT_TYPE, content_type)]), body).into_response()
}

/// The headers every answer carries, and `extra`.
fn guarded<const N: usize>(extra: [(header::HeaderName, &'static str); N]) -> HeaderMap {
    let mut h = HeaderMap::new();
    for (name, value) in [
        (header::CONTENT_SECURITY_POLICY, CSP),
        (header::CACHE_CONTROL, "no-store"),
        (header::REFERRER_POLICY, "no-referrer"),
        (header::X_CONTENT_TYPE_OPTIONS, "nosniff"),
        (header::X_FRAME_OPTIONS, "DENY"),
    ]
    .into_iter()
    .chain(extra)
    {
        h.insert(name, HeaderValue::from_static(value));
    }
    h
}

/// A refusal: its connection is closed after it (a client that is not the
/// page's keeps no slot).
fn refused(status: StatusCode) -> Response {
    (status, [(header::CONNECTION, "close")]).into_response()
}

async fn index(State(p): State<Arc<Page>>, Path(secret): Path<String>, headers: HeaderMap) -> Response {
    match p.admit(&headers, &secret) {
        Ok(()) => asset("text/html; charset=utf-8", PAGE),
        Err(status) => refused(status),
    }
}

async fn script(State(p): State<Arc<Page>>, Path(secret): Path<String>, headers: HeaderMap) -> Response {
    match p.admit(&headers, &secret) {
        Ok(()) => asset("text/javascript; charset=utf-8", SCRIPT),
        Err(status) => refused(status),
    }
}

async fn style(State(p): State<Arc<Page>>, Path(secret): Path<String>, headers: HeaderMap) -> Response {
    match p.admit(&headers, &secret) {
        Ok(()) => asset("text/css; charset=utf-8", STYLE),
        Err(status) => refused(status),
    }
}

/// What the page starts from.
#[derive(Serialize)]
struct PageState {
    host: HostState,
    sandboxes: Vec<SandboxState>,
}

/// The host's checkpoint queue and store room.
#[derive(Serialize)]
struct HostState {
    /// Checkpoints waiting for a slot.
    queue_depth: i64,
    /// Slots in use.
    slots_in_use: i64,
    /// Slots.
    slots: usize,
    /// Free bytes on the store's filesystem, if measured.
    store_free_bytes: Option<u64>,
    /// The floor below which captures are refused (0: none).
    store_min_free_bytes: u64,
}

/// A sandbox and its newest events: what the page shows, and nothing
/// that grants more (no proxy URL, no socket path).
#[derive(Serialize)]
struct SandboxState {
    id: crab_api::SandboxId,
    namespace: String,
    running: bool,
    versions: usize,
    latest: Option<u64>,
    recoveries: u32,
    events: Vec<Event>,
}

impl SandboxState {
    fn new(info: SandboxInfo, events: Vec<Event>) -> Self {
        SandboxState {
            id: info.registration.id,
            namespace: info.registration.namespace,
            running: info.running,
            versions: info.versions,
            latest: info.latest,
            recoveries: info.recoveries,
            events,
        }
    }
}

async fn state(State(p): State<Arc<Page>>, Path(secret): Path<String>, headers: HeaderMap) -> Response {
    if let Err(status) = p.admit(&headers, &secret) {
        return refused(status);
    }
    let d = p.daemon.clone();
    let built = tokio::task::spawn_blocking(move || {
        let sandboxes = d
            .list()
            .into_iter()
            .map(|info| {
                let events = d
                    .events
                    .recent(&info.registration.id, EVENTS_PER_SANDBOX)
                    .unwrap_or_else(|e| {
                        tracing::warn!(sandbox = %info.registration.id, error = %e, "page: events unread");
                        Vec::new()
                    });
                SandboxState::new(info, events)
            })
            .collect();
        PageState {
            host: HostState {
                queue_depth: d.metrics.queue_depth.get(),
                slots_in_use: d.metrics.slots_in_use.get(),
                slots: super::schedule_shape(&d.config).slots,
                store_free_bytes: super::budget::free_bytes(&d.config.root).ok(),
                store_min_free_bytes: d.config.store_min_free_bytes,
            },
            sandboxes,
        }
    })
    .await;
    match built {
        Ok(state) => (guarded([]), Json(state)).into_response(),
        Err(_) => StatusCode::INTERNAL_SERVER_ERROR.into_response(),
    }
}

/// Every sandbox's events as they happen (`event: crab`), and how many a
/// slow reader missed (`event: lagged`).
async fn live(State(p): State<Arc<Page>>, Path(secret): Path<String>, headers: HeaderMap) -> Response {
    if let Err(status) = p.admit(&headers, &secret) {
        return refused(status);
    }
    let stopping = p.daemon.stopping.clone().cancelled_owned();
    let events = tokio_stream::wrappers::BroadcastStream::new(p.daemon.events.subscribe()).map(|e| {
        Ok::<_, Infallible>(match e {
            Ok(event) => SseEvent::default()
                .event("crab")
                .json_data(&event)
                .unwrap_or_else(|_| SseEvent::default().comment("unserializable event")),
            Err(tokio_stream::wrappers::errors::BroadcastStreamRecvError::Lagged(n)) => {
                SseEvent::default().event("lagged").data(n.to_string())
            }
        })
    });
    let events = events.take_until(stopping);
    (guarded([]), Sse::new(events).keep_alive(KeepAlive::default())).into_response()
}

// === impl Daemon ===

impl Daemon {
    /// The page's URL, its secret included, if it is served.
    pub(super) fn ui_url(&self) -> crab_api::crabd::UiUrl {
        crab_api::crabd::UiUrl {
            url: self
                .ui_port
                .map(|port| format!("http://127.0.0.1:{port}/ui/{}/", self.ui_secret)),
        }
    }
}
