//! A run's trained model, in Hugging Face's format (GPT-2's or Llama's, by the run's
//! `model.family`: `distlab_common::export`): handed over by the
//! worker that ran it before it reports the run complete, kept under the data directory,
//! fetched by anyone who can see the experiment, removed with it.
//!
//! - `PUT /api/workers/experiments/{id}/model`: the worker holding the experiment's lease
//!   (checked again once the body is in; the upload renews the lease); the body is
//!   model.safetensors (at most `ServerConfig::max_model_bytes`, and the run's model in
//!   its family's layout, or 422).
//! - `GET /api/experiments/{id}/model`: the file, streamed, once the run has succeeded (409
//!   otherwise, saying why).
//! - `GET /api/experiments/{id}/model/config`: the `config.json` that goes with it.

use std::path::PathBuf;

use std::error::Error as _;

use axum::body::{Body, Bytes};
use axum::extract::{Path, Request, State};
use axum::http::{header, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::{Extension, Json};
use distlab_common::{export, ExperimentSpec, ExperimentStatus};
use distlab_worker::generate::load_hf;
use tower::ServiceExt;
use tower_http::services::ServeFile;

use crate::api::error::HttpError;
use crate::api::extract::parse_id;
use crate::api::workers::CallingWorker;
use crate::store::experiments::{self, load};
use crate::store::leases::{self, Ownership};
use crate::{clock, AppState};

/// Where experiment `id`'s model is kept.
pub fn model_path(state: &AppState, id: i64) -> PathBuf {
    state.config.data_dir.join("models").join(format!("experiment-{id}.safetensors"))
}

/// Removes experiment `id`'s model, if it has one (a deleted experiment).
pub fn remove(state: &AppState, id: i64) {
    if let Err(e) = std::fs::remove_file(model_path(state, id)) {
        if e.kind() != std::io::ErrorKind::NotFound {
            tracing::warn!(experiment = id, "could not remove the model: {e}");
        }
    }
}

/// Whether `bytes` is `spec`'s model in its family's Hugging Face layout (every tensor
/// there, f32, the model's shapes): what a worker may store.
fn check_model(spec: &ExperimentSpec, bytes: &[u8]) -> Result<(), String> {
    if let Some(why) = export::not_exportable(spec) {
        return Err(why);
    }
    load_hf(&spec.model, bytes).map(drop)
}

/// `PUT /api/workers/experiments/{id}/model`
#[utoipa::path(
    put, path = "/workers/experiments/{id}/model", operation_id = "upload_model", tag = "workers",
    params(("id" = i64, Path, description = "the experiment's id")),
    request_body(content = Vec<u8>, content_type = "application/octet-stream", description = "the run's safetensors"),
    responses(
        (status = 204, description = "stored"),
        (status = 401, description = "no or a wrong worker credential", body = distlab_common::ApiError),
        (status = 409, description = "the caller does not hold the lease", body = distlab_common::ApiError),
        (status = 413, body = distlab_common::ApiError),
        (status = 422, description = "names each field that is wrong", body = distlab_common::ApiError),
    ),
)]
pub async fn upload(
    State(state): State<AppState>,
    Extension(caller): Extension<CallingWorker>,
    Path(raw_id): Path<String>,
    body: Body,
) -> Result<StatusCode, HttpError> {
    let id = parse_id(&raw_id)?;
    let limit = state.config.max_model_bytes;
    let holds = |state: AppState| async move {
        match leases::ownership(&state.db, caller.0, id).await? {
            Ownership::Held => Ok(()),
            _ => Err(HttpError::conflict(format!("worker {} does not hold experiment {id}", caller.0))),
        }
    };
    holds(state.clone()).await?;
    let bytes: Bytes = axum::body::to_bytes(body, limit).await.map_err(|e| match e.source() {
        Some(cause) if cause.is::<http_body_util::LengthLimitError>() => HttpError::too_large(limit),
        _ => HttpError::bad_request(format!("could not read the model: {e}")),
    })?;
    let spec = load(&state.db, id).await?.ok_or_else(|| HttpError::no_experiment(id))?.spec;
    let checked = tokio::task::spawn_blocking({
        let bytes = bytes.clone();
        move || check_model(&spec, &bytes)
    })
    .await
    .map_err(|e| HttpError::internal("checking a model", e))?;
    checked.map_err(|why| HttpError::new(StatusCode::UNPROCESSABLE_ENTITY, format!("the model: {why}")))?;
    // Still this worker's (a long upload may have outlived its lease)?
    holds(state.clone()).await?;
    let path = model_path(&state, id);
    let stored_bytes = bytes.len() as u64;
    let written = tokio::task::spawn_blocking(move || -> std::io::Result<()> {
        let dir = path.parent().unwrap_or(std::path::Path::new("."));
        std::fs::create_dir_all(dir)?;
        // Written aside under a name of its own, then renamed: a reader never sees half a
        // file, and two uploads never share one.
        let tmp = dir.join(format!(".upload-{id}-{:016x}", rand::random::<u64>()));
        std::fs::write(&tmp, &bytes).and_then(|()| std::fs::rename(&tmp, &path)).inspect_err(|_| {
            let _ = std::fs::remove_file(&tmp);
        })
    })
    .await
    .map_err(|e| HttpError::internal("storing a model", e))?;
    written.map_err(|e| HttpError::internal("storing a model", e))?;
    experiments::record_model_bytes(&state.db, id, stored_bytes).await?;
    // The upload took the lease's time: renew it, as a heartbeat would.
    leases::renew(&state.db, caller.0, id, state.config.lease_duration(), clock::now()).await?;
    tracing::info!(experiment = id, worker = caller.0, "model stored");
    Ok(StatusCode::NO_CONTENT)
}

/// Experiment `id`'s model file, or why it has none (404 no such experiment, 409 no model).
pub(crate) async fn stored_model(
    state: &AppState,
    raw_id: &str,
) -> Result<(i64, PathBuf, distlab_common::ExperimentSpec), HttpError> {
    let id = parse_id(raw_id)?;
    let experiment = load(&state.db, id).await?.ok_or_else(|| HttpError::no_experiment(id))?;
    let path = model_path(state, id);
    if experiment.status == ExperimentStatus::Succeeded && path.exists() {
        return Ok((id, path, experiment.spec));
    }
    let why = match (experiment.status, export::not_exportable(&experiment.spec)) {
        (_, Some(why)) => why,
        (ExperimentStatus::Succeeded, None) => "its worker did not hand over a model (see the run's log)".into(),
        (status, None) => format!("it is {}: a model is kept when a run succeeds", status.as_str()),
    };
    Err(HttpError::conflict(format!("experiment {id} has no trained model: {why}")))
}

/// `GET /api/experiments/{id}/model`: streamed from the file (`ServeFile`), not read whole.
#[utoipa::path(
    get, path = "/experiments/{id}/model", operation_id = "download_model", tag = "models",
    params(("id" = i64, Path, description = "the experiment's id")),
    responses(
        (status = 200, description = "the trained weights as safetensors (Hugging Face GPT-2 or Llama names)", content_type = "application/octet-stream"),
        (status = 404, description = "no such experiment", body = distlab_common::ApiError),
        (status = 409, description = "the run has no model (not succeeded, or MoE)", body = distlab_common::ApiError),
    ),
)]
pub async fn download(
    State(state): State<AppState>,
    Path(raw_id): Path<String>,
    req: Request,
) -> Result<Response, HttpError> {
    let (id, path, _) = stored_model(&state, &raw_id).await?;
    let served = ServeFile::new(&path).oneshot(req).await.map_err(|e| HttpError::internal("reading a model", e))?;
    let disposition = format!("attachment; filename=\"distlab-experiment-{id}.safetensors\"");
    let mut response = served.map(Body::new).into_response();
    if let Ok(value) = header::HeaderValue::from_str(&disposition) {
        response.headers_mut().insert(header::CONTENT_DISPOSITION, value);
    }
    Ok(response)
}

/// `GET /api/experiments/{id}/model/config`
#[utoipa::path(
    get, path = "/experiments/{id}/model/config", operation_id = "model_config", tag = "models",
    params(("id" = i64, Path, description = "the experiment's id")),
    responses(
        (status = 200, description = "config.json for GPT2LMHeadModel or LlamaForCausalLM", body = Object),
        (status = 404, description = "no such experiment", body = distlab_common::ApiError),
        (status = 409, body = distlab_common::ApiError),
    ),
)]
pub async fn config(
    State(state): State<AppState>,
    Path(raw_id): Path<String>,
) -> Result<Json<serde_json::Value>, HttpError> {
    let (_, _, spec) = stored_model(&state, &raw_id).await?;
    Ok(Json(export::hf_config(&spec.model)))
}
