//! The user API: submit, list, show, metrics, attempts, cancel and delete experiments
//! (traces: `traces.rs`, memory: `memory.rs`). Admission control refuses a spec the live
//! workers could not run.

use axum::extract::{Path, Query, State};
use axum::http::{header, HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::{Extension, Json};
use distlab_common::{
    Attempts, BackendKind, Created, ExperimentList, ExperimentSpec, ExperimentStatus, ExperimentView, FieldError,
    Metrics, StatusChange,
};
use serde::Deserialize;

use crate::api::error::HttpError;
use crate::api::extract::{parse_id, JsonBody};
use crate::api::{datasets, models, session};
use crate::clock;
use crate::read_cache::KeptJson;
use crate::store::accounts::Account;
use crate::store::changes::{self, Data};
use crate::store::experiments::load;
use crate::store::workers::LiveWorker;
use crate::store::{self, queue, Db};
use crate::text::truncate;
use crate::AppState;

pub const DEFAULT_PAGE: i64 = 50;
pub const MAX_PAGE: i64 = 200;

/// `POST /api/experiments`: validate (all problems at once, 422) and queue.
/// The longest `Idempotency-Key` accepted.
const MAX_IDEMPOTENCY_KEY: usize = 200;

/// `POST /api/experiments`: validates and queues a spec (201). With an `Idempotency-Key`
/// header, a retry of the same submission gets the first one's experiment (201 again, the
/// same id); the same key with another spec is refused (409).
#[utoipa::path(
    post, path = "/experiments", operation_id = "create_experiment", tag = "experiments",
    request_body = distlab_common::ExperimentSpec,
    responses(
        (status = 201, description = "queued", body = distlab_common::Created),
        (status = 422, description = "names each field that is wrong", body = distlab_common::ApiError),
        (status = 429, description = "over this account's quota", body = distlab_common::ApiError),
        (status = 503, description = "no worker can run it", body = distlab_common::ApiError),
        (status = 507, description = "its files would not fit in this account's share of the disk", body = distlab_common::ApiError),
    ),
)]
pub async fn create(
    State(state): State<AppState>,
    Extension(owner): Extension<Account>,
    headers: HeaderMap,
    JsonBody(body): JsonBody<serde_json::Value>,
) -> Result<Response, HttpError> {
    let key = idempotency_key(&headers)?;
    let spec = ExperimentSpec::from_json_value(body).map_err(HttpError::invalid_spec)?;
    let created = submit(&state, &owner, spec, key.as_deref()).await?;
    let id = created.id;
    Ok((StatusCode::CREATED, [(header::LOCATION, format!("/api/experiments/{id}"))], Json(created)).into_response())
}

/// Checks `spec` as every experiment is checked (the spec's rules, its resume source and
/// dataset, what the workers offer and hold) and queues it for `owner` within their
/// quotas: the experiment's id and status. `key`: the request's Idempotency-Key.
pub async fn submit(
    state: &AppState,
    owner: &Account,
    mut spec: ExperimentSpec,
    key: Option<&str>,
) -> Result<Created, HttpError> {
    let mut problems = resume_source_problems(&state.db, &mut spec).await?;
    problems.extend(spec.validate(&state.config.limits).err().unwrap_or_default());
    problems.extend(datasets::check_spec(&state.db, &spec).await?);
    if spec.backend == BackendKind::Cuda
        && !store::workers::backend_offered(&state.db, BackendKind::Cuda, &alive_since(state)).await?
    {
        problems.push(FieldError::new("backend", "no registered worker offers the cuda backend"));
    }
    problems.extend(distlab_common::backends::unsupported_on_backend(&spec));
    if problems.is_empty() {
        problems.extend(too_wide_for_the_workers(state, &spec).await?);
    }
    if problems.is_empty() {
        problems.extend(too_big_for_every_worker(state, &spec).await?);
    }
    if !problems.is_empty() {
        return Err(HttpError::invalid_spec(problems));
    }
    let spec_json = serde_json::to_string(&spec).map_err(|e| HttpError::internal("encoding the spec", e))?;
    let max_queued = state.config.max_queued_per_user;
    let quota = queue::Quota { max_queued, max_disk_bytes: state.config.max_disk_per_user };
    let submitted = queue::submit(&state.db, &owner.name, &spec, &spec_json, key, quota, clock::now()).await?;
    let (id, status) = match submitted {
        queue::Submitted::New(id) => {
            let backend = spec.backend.as_str();
            tracing::info!(experiment = id, name = %spec.name, world_size = spec.world_size(), backend, "experiment queued");
            let queued = StatusChange { status: ExperimentStatus::Queued, error: None, summary: None };
            state.hub.status_changed(id, queued);
            (id, ExperimentStatus::Queued)
        }
        queue::Submitted::Existing { id, same_spec: true } => {
            (id, load(&state.db, id).await?.map_or(ExperimentStatus::Queued, |v| v.status))
        }
        queue::Submitted::Existing { id, same_spec: false } => {
            return Err(HttpError::conflict(format!(
                "this Idempotency-Key was already used for experiment {id}, with another spec; use a new key"
            )))
        }
        queue::Submitted::OverQuota { queued } => {
            return Err(HttpError::too_many_requests(format!(
                "you have {queued} experiments queued, the most this server takes from one person \
                 (--max-queued-per-user={max_queued}); wait for some to run, or cancel some"
            )))
        }
        queue::Submitted::OverDisk(over) => {
            return Err(over.error(&owner.name, "this experiment's checkpoints and model"))
        }
    };
    Ok(Created { id, status })
}

/// Elastic resume: the experiment `train.resume_from` names must exist and its checkpoint
/// fit `spec`, whose grad_accum is changed when that keeps the global batch.
async fn resume_source_problems(db: &Db, spec: &mut ExperimentSpec) -> Result<Vec<FieldError>, HttpError> {
    let Some(from) = spec.train.resume_from else { return Ok(Vec::new()) };
    let Some(source) = load(db, from.experiment).await? else {
        return Ok(vec![FieldError::new("train.resume_from", format!("there is no experiment {}", from.experiment))]);
    };
    let mut problems = distlab_common::elastic::fit_to_source(spec, &source.spec).err().unwrap_or_default();
    let finished = source.status.is_finished();
    problems.extend(distlab_common::elastic::check_resume_step(from, &source.spec, source.steps_done, finished));
    Ok(problems)
}

/// Refuses a spec with more ranks than the live workers offering its backend can run:
/// than any one of them (`--ranks`) when the server keeps every run on one worker, than
/// all of them together otherwise. Workers without a limit take any run.
async fn too_wide_for_the_workers(state: &AppState, spec: &ExperimentSpec) -> Result<Option<FieldError>, HttpError> {
    let ranks = store::workers::live_ranks(&state.db, spec.backend, &alive_since(state)).await?;
    let world = spec.world_size();
    if ranks.is_empty() || ranks.iter().any(|r| r.is_none_or(|r| r >= world)) {
        return Ok(None);
    }
    let largest = ranks.iter().flatten().max().copied().unwrap_or(0);
    let together: usize = ranks.iter().flatten().sum();
    let refusal = if spec.demo.is_some() {
        format!("its {world} ranks do not fit one worker (the largest runs {largest}), and a demo runs on one")
    } else if !state.config.allow_multi_host {
        format!(
            "its {world} ranks do not fit one worker (the largest runs {largest}), and this server runs every \
             experiment on one worker (--allow-multi-host false)"
        )
    } else if together < world {
        format!("its {world} ranks need more than the live workers run together ({together})")
    } else {
        return Ok(None);
    };
    Ok(Some(FieldError::new("parallel", format!("{refusal}; use fewer ranks (dp x tp x pp)"))))
}

/// Admission control: a spec whose ranks need more memory (as the planner counts it) than
/// any live worker offering its backend has would only be killed there. On the CPU the
/// ranks of a run share the machine's memory; on CUDA they take the GPUs in turn, and the
/// busiest GPU must hold its ranks. Workers that do not report their memory are not asked.
async fn too_big_for_every_worker(state: &AppState, spec: &ExperimentSpec) -> Result<Option<FieldError>, HttpError> {
    let capacities = store::workers::live_capacities(&state.db, spec.backend, &alive_since(state)).await?;
    let Ok(plan) = distlab_common::planner::plan(spec) else { return Ok(None) };
    let gib = |b: u64| b as f64 / (1u64 << 30) as f64;
    let world = spec.world_size();
    let refusal = if spec.backend == BackendKind::Cpu {
        // A worker that runs fewer ranks than the world holds only its share of them.
        let share = |w: &LiveWorker| w.ranks.unwrap_or(world).min(world);
        let needed = |w: &LiveWorker| plan.memory_of_all_ranks() / world as u64 * share(w) as u64;
        let Some(largest) = capacities.iter().max_by_key(|w| w.capacity.memory_bytes) else { return Ok(None) };
        if capacities.iter().any(|w| needed(w) <= w.capacity.memory_bytes) {
            return Ok(None);
        }
        let ranks = share(largest);
        let which =
            if ranks == world { format!("its {world} ranks") } else { format!("its {ranks} ranks on one worker") };
        format!(
            "{which} need {:.2} GiB together (the planner's count), more than the largest worker has ({:.2} GiB)",
            gib(needed(largest)),
            gib(largest.capacity.memory_bytes)
        )
    } else {
        let capacities: Vec<&distlab_common::WorkerCapacity> = capacities.iter().map(|w| &w.capacity).collect();
        let gpu_workers = || capacities.iter().filter(|c| c.gpus > 0 && c.gpu_memory_bytes > 0);
        let Some(best) = gpu_workers().max_by_key(|c| (c.gpus, c.gpu_memory_bytes)) else { return Ok(None) };
        if gpu_workers().any(|c| plan.memory_per_gpu(c.gpus.into()) <= c.gpu_memory_bytes) {
            return Ok(None);
        }
        format!(
            "its {world} ranks need {:.2} GiB on each GPU of a worker with {} GPU(s) (the planner's count for the \
             busiest one), more than such a GPU has ({:.2} GiB)",
            gib(plan.memory_per_gpu(best.gpus.into())),
            best.gpus,
            gib(best.gpu_memory_bytes)
        )
    };
    Ok(Some(FieldError::new(
        "model",
        format!("{refusal}; use a smaller model, micro_batch or seq_len, or shard the state (zero1/zero2/fsdp)"),
    )))
}

/// Workers seen since this (see `ServerConfig::worker_alive_window`) count as live.
fn alive_since(state: &AppState) -> String {
    clock::before(clock::now(), state.config.worker_alive_window())
}

/// Whether `caller` may cancel or delete `experiment`: its owner or an admin (403 otherwise).
fn may_change(caller: &Account, experiment: &ExperimentView, what: &str) -> Result<(), HttpError> {
    session::may_change(caller, &format!("experiment {}", experiment.id), &experiment.owner, what)
}

/// `DELETE /api/experiments/{id}` (its owner or an admin): removes a finished experiment with
/// its metrics, logs, traces and checkpoints (204); a queued or running one is cancelled
/// first (409 says so).
#[utoipa::path(
    delete, path = "/experiments/{id}", operation_id = "delete_experiment", tag = "experiments",
    params(("id" = i64, Path, description = "the experiment's id")),
    responses(
        (status = 204, description = "deleted with its model, traces and logs"),
        (status = 403, body = distlab_common::ApiError),
        (status = 404, description = "no such experiment", body = distlab_common::ApiError),
        (status = 409, description = "still running", body = distlab_common::ApiError),
    ),
)]
pub async fn delete(
    State(state): State<AppState>,
    Extension(caller): Extension<Account>,
    Path(raw_id): Path<String>,
) -> Result<StatusCode, HttpError> {
    let id = parse_id(&raw_id)?;
    let experiment = load(&state.db, id).await?.ok_or_else(|| HttpError::no_experiment(id))?;
    may_change(&caller, &experiment, "delete")?;
    if !store::experiments::delete_finished(&state.db, id).await? {
        return Err(HttpError::conflict(format!(
            "experiment {id} is {}: cancel it first, then delete it",
            experiment.status.as_str()
        )));
    }
    let checkpoints = state.checkpoint_dir(id);
    if let Err(e) = std::fs::remove_dir_all(&checkpoints) {
        if e.kind() != std::io::ErrorKind::NotFound {
            tracing::warn!(experiment = id, "could not remove {}: {e}", checkpoints.display());
        }
    }
    models::remove(&state, id);
    tracing::info!(experiment = id, by = %caller.name, "experiment deleted");
    Ok(StatusCode::NO_CONTENT)
}

/// The `Idempotency-Key` header, if any: printable ASCII, at most `MAX_IDEMPOTENCY_KEY` long.
fn idempotency_key(headers: &HeaderMap) -> Result<Option<String>, HttpError> {
    let Some(raw) = headers.get("idempotency-key") else { return Ok(None) };
    let key = raw.to_str().ok().map(str::trim).filter(|k| !k.is_empty() && k.len() <= MAX_IDEMPOTENCY_KEY);
    let bad = || {
        HttpError::bad_field(
            "Idempotency-Key",
            format!("Idempotency-Key must be 1 to {MAX_IDEMPOTENCY_KEY} printable ASCII characters"),
        )
    };
    key.map(|k| Some(k.to_string())).ok_or_else(bad)
}

/// Query of `GET /api/experiments`; parsed by hand for readable 400s.
#[derive(Deserialize)]
pub struct ListQuery {
    status: Option<String>,
    limit: Option<String>,
    offset: Option<String>,
}

fn parse_count(field: &str, raw: Option<&str>, default: i64) -> Result<i64, HttpError> {
    match raw.map(str::trim) {
        None | Some("") => Ok(default),
        Some(text) => text.parse::<u32>().map(i64::from).map_err(|_| {
            HttpError::bad_field(field, format!("{field} must be a whole number >= 0, got '{}'", truncate(text, 40)))
        }),
    }
}

/// `GET /api/experiments?status=&limit=&offset=`: newest first, at most MAX_PAGE per page.
#[utoipa::path(
    get, path = "/experiments", operation_id = "list_experiments", tag = "experiments",
    params(("status" = Option<String>, Query, description = "queued, running, succeeded, failed or cancelled"), ("limit" = Option<i64>, Query), ("offset" = Option<i64>, Query)),
    responses(
        (status = 200, body = distlab_common::ExperimentList),
        (status = 400, body = distlab_common::ApiError),
    ),
)]
pub async fn list(
    State(state): State<AppState>,
    headers: HeaderMap,
    Query(q): Query<ListQuery>,
) -> Result<Response, HttpError> {
    let status = match q.status.as_deref().map(str::trim) {
        None | Some("") => None,
        Some(s) => Some(ExperimentStatus::parse(s).ok_or_else(|| {
            let names: Vec<&str> = ExperimentStatus::ALL.iter().map(|s| s.as_str()).collect();
            HttpError::bad_field(
                "status",
                format!("unknown status '{}'; use one of {}", truncate(s, 40), names.join(", ")),
            )
        })?),
    };
    let limit = parse_count("limit", q.limit.as_deref(), DEFAULT_PAGE)?.min(MAX_PAGE);
    let offset = parse_count("offset", q.offset.as_deref(), 0)?;
    // A class polls the same few pages: each is read and written out once per change
    // (`read_cache.rs`).
    let page = (status.map(ExperimentStatus::as_str), limit, offset);
    let read = || async {
        // Everyone reads every experiment: sharing results is the point of a class's server.
        let (experiments, total) = store::experiments::page(&state.db, status, limit, offset).await?;
        let list = ExperimentList { experiments, total: u64::try_from(total).unwrap_or(0) };
        let json = serde_json::to_vec(&list).map_err(|e| HttpError::internal("the list's JSON", e))?;
        KeptJson::new(json).map_err(|e| HttpError::internal("the list's gzip", e))
    };
    let kept =
        state.experiment_pages.get_or_read(page, || changes::version(&state.db, Data::Experiments), read).await?;
    let json = (header::CONTENT_TYPE, "application/json");
    let vary = (header::VARY, "accept-encoding");
    Ok(if accepts_gzip(&headers) {
        ([json, vary, (header::CONTENT_ENCODING, "gzip")], kept.gzip).into_response()
    } else {
        ([json, vary], kept.plain).into_response()
    })
}

/// Whether the client takes gzip (`Accept-Encoding: gzip`, or `*`, not at q=0).
fn accepts_gzip(headers: &HeaderMap) -> bool {
    headers.get_all(header::ACCEPT_ENCODING).iter().filter_map(|v| v.to_str().ok()).flat_map(|v| v.split(',')).any(
        |coding| {
            let mut parts = coding.split(';').map(str::trim);
            let name = parts.next().unwrap_or("");
            let refused = parts.any(|p| p.strip_prefix("q=").and_then(|q| q.parse::<f32>().ok()) == Some(0.0));
            (name.eq_ignore_ascii_case("gzip") || name == "*") && !refused
        },
    )
}

/// `GET /api/experiments/{id}`
#[utoipa::path(
    get, path = "/experiments/{id}", operation_id = "get_experiment", tag = "experiments",
    params(("id" = i64, Path, description = "the experiment's id")),
    responses(
        (status = 200, body = distlab_common::ExperimentView),
        (status = 404, description = "no such experiment", body = distlab_common::ApiError),
    ),
)]
pub async fn get_one(
    State(state): State<AppState>,
    Path(raw_id): Path<String>,
) -> Result<Json<ExperimentView>, HttpError> {
    let id = parse_id(&raw_id)?;
    load(&state.db, id).await?.map(Json).ok_or_else(|| HttpError::no_experiment(id))
}

/// `GET /api/experiments/{id}/metrics`
#[utoipa::path(
    get, path = "/experiments/{id}/metrics", operation_id = "experiment_metrics", tag = "experiments",
    params(("id" = i64, Path, description = "the experiment's id")),
    responses(
        (status = 200, body = distlab_common::Metrics),
        (status = 404, description = "no such experiment", body = distlab_common::ApiError),
    ),
)]
pub async fn metrics(State(state): State<AppState>, Path(raw_id): Path<String>) -> Result<Json<Metrics>, HttpError> {
    let id = parse_id(&raw_id)?;
    if !store::experiments::exists(&state.db, id).await? {
        return Err(HttpError::no_experiment(id));
    }
    Ok(Json(Metrics { steps: store::experiments::load_metrics(&state.db, id).await? }))
}

/// `GET /api/experiments/{id}/attempts`: every lease of the experiment, where each began
/// and the work it had to do again.
#[utoipa::path(
    get, path = "/experiments/{id}/attempts", operation_id = "experiment_attempts", tag = "experiments",
    params(("id" = i64, Path, description = "the experiment's id")),
    responses(
        (status = 200, body = distlab_common::Attempts),
        (status = 404, description = "no such experiment", body = distlab_common::ApiError),
    ),
)]
pub async fn attempts(State(state): State<AppState>, Path(raw_id): Path<String>) -> Result<Json<Attempts>, HttpError> {
    let id = parse_id(&raw_id)?;
    if !store::experiments::exists(&state.db, id).await? {
        return Err(HttpError::no_experiment(id));
    }
    let attempts = store::experiments::attempts(&state.db, id).await?;
    Ok(Json(Attempts { attempts }))
}

/// `POST /api/experiments/{id}/cancel`: a queued or running experiment becomes cancelled at once;
/// the worker running it learns it from the answer to its next heartbeat or event batch.
#[utoipa::path(
    post, path = "/experiments/{id}/cancel", operation_id = "cancel_experiment", tag = "experiments",
    params(("id" = i64, Path, description = "the experiment's id")),
    responses(
        (status = 200, body = distlab_common::ExperimentView),
        (status = 403, body = distlab_common::ApiError),
        (status = 404, description = "no such experiment", body = distlab_common::ApiError),
    ),
)]
pub async fn cancel(
    State(state): State<AppState>,
    Extension(caller): Extension<Account>,
    Path(raw_id): Path<String>,
) -> Result<Json<ExperimentView>, HttpError> {
    let id = parse_id(&raw_id)?;
    let before = load(&state.db, id).await?.ok_or_else(|| HttpError::no_experiment(id))?;
    may_change(&caller, &before, "cancel")?;
    let cancelled = store::experiments::cancel(&state.db, id, clock::now()).await?;
    let view = load(&state.db, id).await?.ok_or_else(|| HttpError::no_experiment(id))?;
    match cancelled {
        None => Err(HttpError::conflict(format!(
            "experiment {id} is already {}; only queued or running experiments can be cancelled",
            view.status.as_str()
        ))),
        Some(worker) => {
            if let Some(worker) = worker {
                tracing::info!(experiment = id, worker, "cancel requested; the worker is told on its next heartbeat");
            }
            state
                .hub
                .status_changed(id, StatusChange { status: ExperimentStatus::Cancelled, error: None, summary: None });
            Ok(Json(view))
        }
    }
}
