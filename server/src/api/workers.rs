//! The worker protocol: `POST /api/workers/{register,lease,heartbeat,events,complete,fail,rendezvous}`.
//!
//! `register` is behind `Authorization: Bearer <worker token>`, the secret the server's
//! workers share, and answers the worker's own credential; every later request carries that
//! credential instead, and speaks for its worker only (403 for another worker's id), so a
//! worker cannot renew, report or fail another's lease.
//!
//! Heartbeats, event batches, complete and fail answer `WorkerAck`; `cancel: true` tells the
//! worker to stop (a person cancelled the experiment). A worker that no longer holds the
//! experiment (its lease expired and it was re-queued or leased again) gets 409.

use std::time::SystemTime;

use axum::extract::{Request, State};
use axum::http::{header, StatusCode};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use axum::{Extension, Json};
use distlab_common::{
    Complete, EventBatch, ExperimentSpec, ExperimentStatus, Fail, Heartbeat, Lease, LeaseRequest, LogLine,
    RegisterWorker, Registered, RendezvousRequest, RendezvousState, RunEvent, StatusChange, StreamEvent, WorkerAck,
    MAX_RENDEZVOUS_ENTRIES, MAX_RENDEZVOUS_NAME, MAX_RENDEZVOUS_VALUE, VERSION,
};
use subtle::ConstantTimeEq;

use crate::api::error::HttpError;
use crate::api::extract::JsonBody;
use crate::api::traces;
use crate::clock;
use crate::store::leases::{self, Ownership};
use crate::store::logs;
use crate::store::queue;
use crate::store::reports::{self, Stored};
use crate::store::workers::{NewWorker, Offer};
use crate::store::{self, parts};
use crate::text::truncate;
use crate::tokens::{random_token, token_digest};
use crate::AppState;

/// The `Authorization: Bearer` secret of a request.
fn bearer(req: &Request) -> Option<&str> {
    req.headers()
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Bearer "))
        .map(str::trim)
}

/// Middleware of `register`: 401 unless the request carries the worker token (compared in
/// constant time).
pub async fn require_token(State(state): State<AppState>, req: Request, next: Next) -> Result<Response, HttpError> {
    match bearer(&req) {
        None => Err(HttpError::unauthorized("the worker API needs the header Authorization: Bearer <worker token>")),
        Some(token) if token_matches(token, &state.config.worker_token) => Ok(next.run(req).await),
        Some(_) => {
            tracing::warn!("worker request with a wrong token");
            Err(HttpError::unauthorized("wrong worker token"))
        }
    }
}

fn token_matches(presented: &str, expected: &str) -> bool {
    !expected.is_empty() && bool::from(presented.as_bytes().ct_eq(expected.as_bytes()))
}

/// The registered worker a request comes from, known by its credential.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CallingWorker(pub i64);

impl CallingWorker {
    /// 403 unless a body's `worker_id` is this worker's own.
    fn speaks_for(self, worker_id: i64) -> Result<(), HttpError> {
        if self.0 == worker_id {
            return Ok(());
        }
        tracing::warn!(caller = self.0, claimed = worker_id, "a worker spoke for another worker");
        Err(HttpError::forbidden(format!(
            "this credential is worker {}'s; it cannot act for worker {worker_id}",
            self.0
        )))
    }
}

/// Middleware of every worker route after `register`: 401 unless the request carries the
/// credential a worker was given when it registered; the handlers get that worker as
/// `CallingWorker`. Only credentials' SHA-256 digests are stored.
pub async fn require_credential(
    State(state): State<AppState>,
    mut req: Request,
    next: Next,
) -> Result<Response, HttpError> {
    let Some(credential) = bearer(&req) else {
        return Err(HttpError::unauthorized(
            "the worker API needs the header Authorization: Bearer <the credential /api/workers/register answered>",
        ));
    };
    // A credential expires once unused for `worker_credential_idle` (a live worker uses
    // its own every few seconds): a stopped worker's credential is no key for long.
    let used_since = clock::before(clock::now(), state.config.worker_credential_idle);
    let worker = store::workers::by_credential(&state.db, &token_digest(credential), &used_since).await?;
    let Some(worker) = worker else {
        tracing::warn!("worker request with an unknown or expired credential");
        return Err(HttpError::unauthorized("unknown or expired worker credential: register again"));
    };
    req.extensions_mut().insert(CallingWorker(worker));
    Ok(next.run(req).await)
}

/// Marks the calling worker as alive and returns what it offers; 403 when the body names
/// another worker.
async fn touch(state: &AppState, caller: CallingWorker, worker_id: i64, now: SystemTime) -> Result<Offer, HttpError> {
    caller.speaks_for(worker_id)?;
    store::workers::touch(&state.db, worker_id, now)
        .await?
        .ok_or_else(|| HttpError::not_found(format!("no worker with id {worker_id}; register first")))
}

/// `POST /api/workers/register`
#[utoipa::path(
    post, path = "/register", operation_id = "register_worker", tag = "workers",
    request_body = distlab_common::RegisterWorker,
    responses(
        (status = 200, body = distlab_common::Registered),
        (status = 401, description = "no or a wrong worker token", body = distlab_common::ApiError),
        (status = 422, description = "names each field that is wrong", body = distlab_common::ApiError),
    ),
)]
pub async fn register(
    State(state): State<AppState>,
    JsonBody(body): JsonBody<RegisterWorker>,
) -> Result<Json<Registered>, HttpError> {
    let name = truncate(body.name.trim(), 100);
    if name.is_empty() {
        return Err(HttpError::bad_field("name", "a worker needs a name"));
    }
    let devices: Vec<String> = body.devices.iter().take(64).map(|d| truncate(d, 200)).collect();
    let now = clock::rfc3339(clock::now());
    let backends = serde_json::to_string(&body.backends).map_err(|e| HttpError::internal("encoding backends", e))?;
    let devices = serde_json::to_string(&devices).map_err(|e| HttpError::internal("encoding devices", e))?;
    let version = truncate(&body.version, 40);
    if body.ranks == Some(0) {
        return Err(HttpError::bad_field("ranks", "a worker runs at least 1 rank (leave it out for no limit)"));
    }
    let credential = random_token() + &random_token();
    let worker = NewWorker {
        name: &name,
        backends: &backends,
        devices: &devices,
        version: &version,
        capacity: body.capacity,
        ranks: body.ranks,
        credential_digest: &token_digest(&credential),
    };
    let worker_id = store::workers::register(&state.db, &worker, &now).await?;
    if version != VERSION {
        tracing::warn!(worker_id, %name, %version, server_version = VERSION, "worker version differs from the server's");
    }
    tracing::info!(worker_id, %name, %backends, %devices, ranks = ?body.ranks, "worker registered");
    Ok(Json(Registered { worker_id, credential, heartbeat_interval_s: state.config.heartbeat_seconds }))
}

/// `POST /api/workers/lease`: 200 `Lease`, or 204 when nothing this worker can run is queued.
#[utoipa::path(
    post, path = "/lease", operation_id = "worker_lease", tag = "workers",
    request_body = distlab_common::LeaseRequest,
    responses(
        (status = 200, description = "an experiment to run", body = distlab_common::Lease),
        (status = 204, description = "nothing to run"),
        (status = 401, description = "no or a wrong worker credential", body = distlab_common::ApiError),
    ),
)]
pub async fn lease(
    State(state): State<AppState>,
    Extension(caller): Extension<CallingWorker>,
    JsonBody(body): JsonBody<LeaseRequest>,
) -> Result<Response, HttpError> {
    let now = clock::now();
    let offer = touch(&state, caller, body.worker_id, now).await?;
    let lease_for = state.config.lease_duration();
    let asking = queue::Asking { worker_id: body.worker_id, backends: &offer.backends, ranks: offer.ranks };
    let policy = queue::LeasePolicy {
        max_running: state.config.max_running_per_user,
        lease: lease_for,
        multi_host: state.config.allow_multi_host,
        idle_for: idle_window(body.poll_interval_s),
    };
    let leased = {
        let _one_at_a_time = state.leasing.lock().await;
        queue::lease(&state.db, asking, policy, now).await?
    };
    let Some(leased) = leased else {
        return Ok(StatusCode::NO_CONTENT.into_response());
    };
    let spec: ExperimentSpec = serde_json::from_str(&leased.spec).map_err(|e| {
        HttpError::internal("stored experiment", format!("experiment {} has an unreadable spec: {e}", leased.id))
    })?;
    match &leased.placement {
        None => tracing::info!(
            experiment = leased.id,
            worker_id = body.worker_id,
            attempt = leased.attempt,
            "experiment leased"
        ),
        Some(p) => tracing::info!(
            experiment = leased.id,
            worker_id = body.worker_id,
            attempt = leased.attempt,
            host = p.host,
            ranks = ?p.ranks(),
            hosts = p.ranks_per_host.len(),
            "part of a run across workers leased"
        ),
    }
    if leased.placement.as_ref().is_none_or(|p| p.host == 0) {
        state
            .hub
            .status_changed(leased.id, StatusChange { status: ExperimentStatus::Running, error: None, summary: None });
    }
    let stored_steps = Some(reports::stored_steps(&state.db, leased.id).await?);
    let lease = Lease {
        experiment_id: leased.id,
        spec,
        attempt: leased.attempt,
        lease_s: lease_for.as_secs_f64(),
        placement: leased.placement,
        stored_steps,
        store: Some(state.store_id.to_string()),
    };
    Ok(Json(lease).into_response())
}

/// How long after asking for work a worker polling every `poll_s` seconds counts as idle:
/// three of its intervals, between 2 and 60 s (2 s when it does not say).
fn idle_window(poll_s: Option<f64>) -> std::time::Duration {
    let seconds = poll_s.filter(|s| s.is_finite() && *s > 0.0).map_or(2.0, |s| (3.0 * s).clamp(2.0, 60.0));
    std::time::Duration::from_secs_f64(seconds)
}

/// Answer for a report about an experiment, by who holds it now.
fn ack(ownership: Ownership, worker_id: i64, experiment_id: i64) -> Result<Json<WorkerAck>, HttpError> {
    match ownership {
        Ownership::Held | Ownership::AlreadyReported => Ok(Json(WorkerAck { cancel: false })),
        Ownership::Cancelled => Ok(Json(WorkerAck { cancel: true })),
        Ownership::NotFound => Err(HttpError::not_found(format!("no experiment with id {experiment_id}"))),
        Ownership::Lost(status) => Err(HttpError::conflict(format!(
            "experiment {experiment_id} is no longer leased to worker {worker_id} (it is {}); stop working on it",
            status.as_str()
        ))),
    }
}

/// `POST /api/workers/heartbeat`: renews the lease of the experiment the worker runs.
#[utoipa::path(
    post, path = "/heartbeat", operation_id = "worker_heartbeat", tag = "workers",
    request_body = distlab_common::Heartbeat,
    responses(
        (status = 200, body = distlab_common::WorkerAck),
        (status = 401, description = "no or a wrong worker credential", body = distlab_common::ApiError),
    ),
)]
pub async fn heartbeat(
    State(state): State<AppState>,
    Extension(caller): Extension<CallingWorker>,
    JsonBody(body): JsonBody<Heartbeat>,
) -> Result<Json<WorkerAck>, HttpError> {
    let now = clock::now();
    touch(&state, caller, body.worker_id, now).await?;
    let Some(experiment_id) = body.experiment_id else {
        return Ok(Json(WorkerAck { cancel: false }));
    };
    let ownership = leases::renew(&state.db, body.worker_id, experiment_id, state.config.lease_duration(), now).await?;
    ack(ownership, body.worker_id, experiment_id)
}

/// `POST /api/workers/events`: stores metric points, log lines and rank traces, renews the
/// lease, and forwards the events to the experiment's live streams. A trace whose rank is
/// outside the experiment's world is 422, and then nothing of the batch is stored.
#[utoipa::path(
    post, path = "/events", operation_id = "worker_events", tag = "workers",
    request_body = distlab_common::EventBatch,
    responses(
        (status = 200, body = distlab_common::WorkerAck),
        (status = 401, description = "no or a wrong worker credential", body = distlab_common::ApiError),
        (status = 409, description = "the lease was lost", body = distlab_common::ApiError),
    ),
)]
pub async fn events(
    State(state): State<AppState>,
    Extension(caller): Extension<CallingWorker>,
    JsonBody(body): JsonBody<EventBatch>,
) -> Result<Json<WorkerAck>, HttpError> {
    let now = clock::now();
    touch(&state, caller, body.worker_id, now).await?;
    let stored = reports::store_events(
        &state.db,
        body.worker_id,
        body.experiment_id,
        &body.events,
        state.config.lease_duration(),
        now,
    )
    .await?;
    let log_ids = match stored {
        Stored::Held { log_ids } => log_ids,
        Stored::NotHeld(ownership) => return ack(ownership, body.worker_id, body.experiment_id),
        Stored::Invalid(problems) => {
            tracing::warn!(
                experiment = body.experiment_id,
                worker_id = body.worker_id,
                problems = problems.len(),
                "event batch refused: traces outside the experiment's world"
            );
            return Err(traces::invalid_batch(problems));
        }
    };
    let mut log_ids = log_ids.into_iter();
    for event in body.events {
        match event {
            RunEvent::Log(line) => {
                // As stored: long messages are cut the same way.
                let line = LogLine { level: line.level, message: truncate(&line.message, logs::MAX_TEXT_CHARS) };
                state.hub.publish_log(body.experiment_id, log_ids.next(), line);
            }
            RunEvent::Trace(trace) => {
                tracing::info!(experiment = body.experiment_id, rank = trace.rank, "rank trace stored");
                state.hub.publish(body.experiment_id, StreamEvent::Trace { rank: trace.rank });
            }
            other => state.hub.publish(body.experiment_id, StreamEvent::from(other)),
        }
    }
    ack(Ownership::Held, body.worker_id, body.experiment_id)
}

/// `POST /api/workers/complete`: the run succeeded.
#[utoipa::path(
    post, path = "/complete", operation_id = "worker_complete", tag = "workers",
    request_body = distlab_common::Complete,
    responses(
        (status = 200, body = distlab_common::WorkerAck),
        (status = 401, description = "no or a wrong worker credential", body = distlab_common::ApiError),
        (status = 409, body = distlab_common::ApiError),
    ),
)]
pub async fn complete(
    State(state): State<AppState>,
    Extension(caller): Extension<CallingWorker>,
    JsonBody(body): JsonBody<Complete>,
) -> Result<Json<WorkerAck>, HttpError> {
    let now = clock::now();
    touch(&state, caller, body.worker_id, now).await?;
    let ownership = reports::complete(&state.db, body.worker_id, body.experiment_id, &body.summary, now).await?;
    if ownership == Ownership::Held {
        state.hub.status_changed(
            body.experiment_id,
            StatusChange { status: ExperimentStatus::Succeeded, error: None, summary: Some(body.summary) },
        );
    }
    ack(ownership, body.worker_id, body.experiment_id)
}

/// `POST /api/workers/fail`: the run failed, or stopped after a cancel (`cancelled: true`;
/// harmless when the experiment is already cancelled).
#[utoipa::path(
    post, path = "/fail", operation_id = "worker_fail", tag = "workers",
    request_body = distlab_common::Fail,
    responses(
        (status = 200, body = distlab_common::WorkerAck),
        (status = 401, description = "no or a wrong worker credential", body = distlab_common::ApiError),
        (status = 409, body = distlab_common::ApiError),
    ),
)]
pub async fn fail(
    State(state): State<AppState>,
    Extension(caller): Extension<CallingWorker>,
    JsonBody(body): JsonBody<Fail>,
) -> Result<Json<WorkerAck>, HttpError> {
    let now = clock::now();
    touch(&state, caller, body.worker_id, now).await?;
    let failure = reports::Failure {
        error: &body.error,
        cancelled: body.cancelled,
        lost_host: body.lost_host,
        attempt: body.attempt,
    };
    let ended = reports::fail(&state.db, body.worker_id, body.experiment_id, failure, now).await?;
    let status = match ended {
        Ok(status) => status,
        Err(ownership) => return ack(ownership, body.worker_id, body.experiment_id),
    };
    let error = (status == ExperimentStatus::Failed).then(|| truncate(&body.error, logs::MAX_TEXT_CHARS));
    state.hub.status_changed(body.experiment_id, StatusChange { status, error, summary: None });
    ack(Ownership::Held, body.worker_id, body.experiment_id)
}

/// `POST /api/workers/rendezvous`: a host of a run across workers publishes what its
/// ranks need the others to know (their addresses) and reads what the others published;
/// 409 once the attempt is over. Names and values are short text.
#[utoipa::path(
    post, path = "/rendezvous", operation_id = "worker_rendezvous", tag = "workers",
    request_body = distlab_common::RendezvousRequest,
    responses(
        (status = 200, body = distlab_common::RendezvousState),
        (status = 401, description = "no or a wrong worker credential", body = distlab_common::ApiError),
        (status = 409, description = "not a host of this attempt (any more)", body = distlab_common::ApiError),
        (status = 400, description = "a name or value too long or empty", body = distlab_common::ApiError),
    ),
)]
pub async fn rendezvous(
    State(state): State<AppState>,
    Extension(caller): Extension<CallingWorker>,
    JsonBody(body): JsonBody<RendezvousRequest>,
) -> Result<Json<RendezvousState>, HttpError> {
    let now = clock::now();
    touch(&state, caller, body.worker_id, now).await?;
    if body.publish.len() > MAX_RENDEZVOUS_ENTRIES {
        return Err(HttpError::bad_field("publish", format!("at most {MAX_RENDEZVOUS_ENTRIES} entries at a time")));
    }
    for (i, entry) in body.publish.iter().enumerate() {
        if entry.name.is_empty() || entry.name.len() > MAX_RENDEZVOUS_NAME {
            return Err(HttpError::bad_field(
                &format!("publish[{i}].name"),
                format!("a name has 1 to {MAX_RENDEZVOUS_NAME} bytes"),
            ));
        }
        if entry.value.len() > MAX_RENDEZVOUS_VALUE {
            return Err(HttpError::bad_field(
                &format!("publish[{i}].value"),
                format!("a value has at most {MAX_RENDEZVOUS_VALUE} bytes"),
            ));
        }
    }
    let request = parts::Exchange {
        worker_id: body.worker_id,
        experiment_id: body.experiment_id,
        attempt: body.attempt,
        publish: &body.publish,
    };
    let exchanged = parts::exchange(&state.db, request, state.config.lease_duration(), now).await?;
    exchanged.map(Json).ok_or_else(|| {
        HttpError::conflict(format!(
            "worker {} holds no part of attempt {} of experiment {} (it ended, or never was this worker's)",
            body.worker_id, body.attempt, body.experiment_id
        ))
    })
}
