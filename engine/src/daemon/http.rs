//! The management API over HTTP: one thin axum handler per route of
//! `crab_api::routes`. A handler parses the path and body into typed
//! values (a [`SandboxSelector`] where a person names a sandbox, an exact
//! [`SandboxId`] where a machine does), calls one operation of
//! [`Daemon`], and answers its report as JSON or its error as
//! [`ApiError`]'s status and body.

use std::sync::Arc;

use axum::body::{Body, Bytes};
use axum::extract::{Path, Query, State};
use axum::response::Response;
use axum::routing::{delete, get, post};
use axum::{Json, Router};
use crab_api::crabd::{
    CheckpointReport, CheckpointRequest, Crash, DrainReport, DrainRequest, EventsQuery, ForkReport,
    ForkRequest, ForksReport, ForksRequest, HostKeys, ImportQuery, ImportReport, Recovery, Registration,
    RemovalReport, ResumeReport, ResumeRequest, RollbackReport, RollbackRequest, SandboxInfo, TurnAnswered,
    TurnEnd, TurnReport, UiUrl, VersionView,
};
use crab_api::{routes, SandboxId, SandboxSelector, VersionSel};
use serde::de::DeserializeOwned;

use super::{ApiError, Daemon};

type Reply<T> = Result<Json<T>, ApiError>;

/// Every route of `crab_api::routes`.
pub(super) fn router(d: Arc<Daemon>) -> Router {
    Router::new()
        .route(routes::SANDBOXES, get(list).post(register))
        .route(routes::SANDBOX, get(show).delete(unregister))
        .route(routes::CHECKPOINT, post(checkpoint))
        .route(routes::TURNS, post(turn_ended))
        .route(routes::ANSWERED, post(turn_answered))
        .route(routes::HELD, post(turn_held))
        .route(routes::METRICS, get(metrics))
        .route(routes::VERSIONS, get(versions))
        .route(routes::ROLLBACK, post(rollback))
        .route(routes::RECOVER, post(recover))
        .route(routes::FORK, post(fork))
        .route(routes::FORKS, post(forks))
        .route(routes::DRAIN, post(drain))
        .route(routes::KEYS, get(keys))
        .route(routes::RESUME, post(resume))
        .route(routes::TURN, post(turn))
        .route(routes::WATCH, get(watch))
        .route(routes::EVENTS, get(events))
        .route(routes::UI, get(ui_url))
        .route(routes::EXPORT, get(export))
        .route(routes::IMPORT, post(import))
        .route(routes::VERSION, delete(remove_version))
        .fallback(not_found)
        .with_state(d)
}

/// `/metrics` alone, for the TCP metrics address: nothing else of the
/// management API is reachable there.
pub(super) fn metrics_router(d: Arc<Daemon>) -> Router {
    Router::new()
        .route(routes::METRICS, get(metrics))
        .fallback(not_found)
        .with_state(d)
}

fn parse<T: DeserializeOwned>(body: &Bytes) -> Result<T, ApiError> {
    serde_json::from_slice(body).map_err(|e| ApiError::BadRequest {
        reason: e.to_string(),
    })
}

/// What a person typed; text no id can start with selects no sandbox.
fn selector(text: &str) -> Result<SandboxSelector, ApiError> {
    SandboxSelector::new(text).map_err(|e| ApiError::UnknownSandbox { sel: e.sel })
}

fn exact(text: &str) -> Result<SandboxId, ApiError> {
    SandboxId::new(text).map_err(|e| ApiError::BadRequest {
        reason: e.to_string(),
    })
}

fn version_sel(text: &str) -> Result<VersionSel, ApiError> {
    text.parse()
        .map_err(|e: crab_api::InvalidVersionSel| ApiError::BadRequest {
            reason: e.to_string(),
        })
}

async fn list(State(d): State<Arc<Daemon>>) -> Reply<Vec<SandboxInfo>> {
    Ok(Json(d.list()))
}

async fn show(State(d): State<Arc<Daemon>>, Path(sel): Path<String>) -> Reply<SandboxInfo> {
    d.show(&selector(&sel)?).map(Json)
}

async fn register(State(d): State<Arc<Daemon>>, body: Bytes) -> Reply<SandboxInfo> {
    let reg: Registration = parse(&body)?;
    d.register(reg).await.map(Json)
}

async fn unregister(State(d): State<Arc<Daemon>>, Path(id): Path<String>) -> Reply<serde_json::Value> {
    d.unregister(&exact(&id)?)?;
    Ok(Json(serde_json::json!({})))
}

async fn checkpoint(
    State(d): State<Arc<Daemon>>,
    Path(sel): Path<String>,
    body: Bytes,
) -> Reply<CheckpointReport> {
    let req: CheckpointRequest = parse(&body)?;
    let reg = d.registry.resolve(&selector(&sel)?)?;
    d.checkpoint_detached(reg, req.class).await.map(Json)
}

async fn turn_ended(
    State(d): State<Arc<Daemon>>,
    Path(id): Path<String>,
    body: Bytes,
) -> Reply<CheckpointReport> {
    let end: TurnEnd = parse(&body)?;
    d.turn_ended(&exact(&id)?, end).await.map(Json)
}

async fn recover(State(d): State<Arc<Daemon>>, Path(id): Path<String>, body: Bytes) -> Reply<Recovery> {
    let crash: Crash = parse(&body)?;
    d.recover(&exact(&id)?, crash).await.map(Json)
}

async fn turn_answered(
    State(d): State<Arc<Daemon>>,
    Path((id, turn)): Path<(String, String)>,
) -> Reply<TurnAnswered> {
    let turn = turn.parse::<u64>().map_err(|_| ApiError::BadRequest {
        reason: format!("invalid turn {turn:?}: a turn number"),
    })?;
    d.turn_answered(&exact(&id)?, turn).map(Json)
}

async fn turn_held(
    State(d): State<Arc<Daemon>>,
    Path((id, turn)): Path<(String, String)>,
    body: Bytes,
) -> Reply<serde_json::Value> {
    let turn = turn.parse::<u64>().map_err(|_| ApiError::BadRequest {
        reason: format!("invalid turn {turn:?}: a turn number"),
    })?;
    d.turn_held(&exact(&id)?, turn, parse(&body)?)?;
    Ok(Json(serde_json::json!({})))
}

async fn metrics(State(d): State<Arc<Daemon>>) -> Response {
    let text = d.metrics.render();
    Response::builder()
        .header(
            axum::http::header::CONTENT_TYPE,
            "text/plain; version=0.0.4; charset=utf-8",
        )
        .body(Body::from(text))
        .expect("a well-formed response")
}

async fn versions(State(d): State<Arc<Daemon>>, Path(sel): Path<String>) -> Reply<Vec<VersionView>> {
    d.versions(&selector(&sel)?).await.map(Json)
}

async fn rollback(
    State(d): State<Arc<Daemon>>,
    Path(sel): Path<String>,
    body: Bytes,
) -> Reply<RollbackReport> {
    let req: RollbackRequest = parse(&body)?;
    d.rollback(&selector(&sel)?, req).await.map(Json)
}

async fn remove_version(
    State(d): State<Arc<Daemon>>,
    Path((sel, version)): Path<(String, String)>,
) -> Reply<RemovalReport> {
    let n = match version_sel(&version)? {
        VersionSel::Number(n) => n,
        VersionSel::Latest => {
            return Err(ApiError::BadRequest {
                reason: "rm-version takes a version number, not `latest`".to_owned(),
            })
        }
    };
    d.remove_version(&selector(&sel)?, n).await.map(Json)
}

async fn fork(State(d): State<Arc<Daemon>>, Path(sel): Path<String>, body: Bytes) -> Reply<ForkReport> {
    let req: ForkRequest = parse(&body)?;
    d.fork(&selector(&sel)?, req).await.map(Json)
}

async fn forks(State(d): State<Arc<Daemon>>, Path(sel): Path<String>, body: Bytes) -> Reply<ForksReport> {
    let req: ForksRequest = parse(&body)?;
    d.forks(&selector(&sel)?, req).await.map(Json)
}

async fn resume(State(d): State<Arc<Daemon>>, Path(sel): Path<String>, body: Bytes) -> Reply<ResumeReport> {
    let req: ResumeRequest = parse(&body)?;
    d.resume(&selector(&sel)?, req).await.map(Json)
}

async fn drain(State(d): State<Arc<Daemon>>, body: Bytes) -> Reply<DrainReport> {
    let req: DrainRequest = parse(&body)?;
    d.drain(req).await.map(Json)
}

async fn keys(State(d): State<Arc<Daemon>>) -> Reply<HostKeys> {
    let d2 = d.clone();
    let trusted =
        tokio::task::spawn_blocking(move || super::keys::trusted(&d2.config.root, &d2.signing_key)).await?;
    Ok(Json(HostKeys {
        export_key: d.signing_key.public(),
        trusted_dir: super::keys::trusted_dir(&d.config.root),
        trusted,
    }))
}

async fn turn(State(d): State<Arc<Daemon>>, Path(sel): Path<String>) -> Reply<TurnReport> {
    d.end_turn_by_hand(&selector(&sel)?).await.map(Json)
}

async fn watch(State(d): State<Arc<Daemon>>, Path(sel): Path<String>) -> Result<Response, ApiError> {
    d.watch(&selector(&sel)?)
}

async fn events(
    State(d): State<Arc<Daemon>>,
    Path(sel): Path<String>,
    query: Result<Query<EventsQuery>, axum::extract::rejection::QueryRejection>,
) -> Result<Response, ApiError> {
    let Query(q) = query.map_err(|e| ApiError::BadRequest {
        reason: e.body_text(),
    })?;
    d.events_stream(&selector(&sel)?, q).await
}

async fn ui_url(State(d): State<Arc<Daemon>>) -> Reply<UiUrl> {
    Ok(Json(d.ui_url()))
}

async fn export(
    State(d): State<Arc<Daemon>>,
    Path((sel, version)): Path<(String, String)>,
) -> Result<Response, ApiError> {
    d.export(&selector(&sel)?, version_sel(&version)?).await
}

async fn import(
    State(d): State<Arc<Daemon>>,
    query: Result<Query<ImportQuery>, axum::extract::rejection::QueryRejection>,
    body: Body,
) -> Reply<ImportReport> {
    let Query(q) = query.map_err(|e| ApiError::BadRequest {
        reason: e.body_text(),
    })?;
    d.import(q, body).await.map(Json)
}

/// Any other path.
async fn not_found(uri: axum::http::Uri) -> ApiError {
    ApiError::NoRoute {
        path: uri.path().to_owned(),
    }
}

#[cfg(test)]
mod tests;
