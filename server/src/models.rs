//! A run's trained model, in GPT-2's format (`distlab_common::export`): handed over by the
//! worker that ran it before it reports the run complete, kept under the data directory,
//! fetched by anyone who can see the experiment, removed with it.
//!
//! - `PUT /api/workers/experiments/{id}/model`: the worker holding the experiment's lease;
//!   the body is model.safetensors (at most `ServerConfig::max_model_bytes`, and a
//!   safetensors file of f32 tensors, or 422).
//! - `GET /api/experiments/{id}/model`: the file (409 when the run has none, saying why).
//! - `GET /api/experiments/{id}/model/config`: the `config.json` that goes with it.

use std::path::PathBuf;

use axum::body::{Body, Bytes};
use axum::extract::{Path, State};
use axum::http::{header, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::{Extension, Json};
use distlab_common::{export, ExperimentStatus};

use crate::error::HttpError;
use crate::experiments::{load, not_found};
use crate::extract::parse_id;
use crate::queue::{self, Ownership};
use crate::workers::CallingWorker;
use crate::AppState;

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

/// Whether `bytes` is a safetensors file of f32 tensors: what a worker may store.
fn check_safetensors(bytes: &[u8]) -> Result<usize, String> {
    let file = safetensors::SafeTensors::deserialize(bytes).map_err(|e| format!("not a safetensors file: {e}"))?;
    let tensors = file.tensors();
    if tensors.is_empty() {
        return Err("the file holds no tensors".into());
    }
    match tensors.iter().find(|(_, t)| t.dtype() != safetensors::Dtype::F32) {
        Some((name, t)) => Err(format!("tensor {name} is {:?}, not F32", t.dtype())),
        None => Ok(tensors.len()),
    }
}

/// `PUT /api/workers/experiments/{id}/model`
pub async fn upload(
    State(state): State<AppState>,
    Extension(caller): Extension<CallingWorker>,
    Path(raw_id): Path<String>,
    body: Body,
) -> Result<StatusCode, HttpError> {
    let id = parse_id(&raw_id)?;
    let limit = state.config.max_model_bytes;
    if queue::ownership(&state.db, caller.0, id).await? != Ownership::Held {
        return Err(HttpError::conflict(format!("worker {} does not hold experiment {id}", caller.0)));
    }
    let bytes: Bytes = axum::body::to_bytes(body, limit).await.map_err(|_| HttpError::too_large(limit))?;
    let tensors = check_safetensors(&bytes)
        .map_err(|why| HttpError::new(StatusCode::UNPROCESSABLE_ENTITY, format!("the model: {why}")))?;
    let path = model_path(&state, id);
    let written = tokio::task::spawn_blocking(move || -> std::io::Result<()> {
        let dir = path.parent().unwrap_or(std::path::Path::new("."));
        std::fs::create_dir_all(dir)?;
        // Written aside, then renamed: a reader never sees half a file.
        let tmp = path.with_extension("safetensors.part");
        std::fs::write(&tmp, &bytes)?;
        std::fs::rename(&tmp, &path)
    })
    .await
    .map_err(|e| HttpError::internal("storing a model", e))?;
    written.map_err(|e| HttpError::internal("storing a model", e))?;
    tracing::info!(experiment = id, worker = caller.0, tensors, "model stored");
    Ok(StatusCode::NO_CONTENT)
}

/// Experiment `id`'s model file, or why it has none (404 no such experiment, 409 no model).
async fn stored_model(
    state: &AppState,
    raw_id: &str,
) -> Result<(i64, PathBuf, distlab_common::ExperimentSpec), HttpError> {
    let id = parse_id(raw_id)?;
    let experiment = load(&state.db, id).await?.ok_or_else(|| not_found(id))?;
    let path = model_path(state, id);
    if path.exists() {
        return Ok((id, path, experiment.spec));
    }
    let why = match (experiment.status, export::not_exportable(&experiment.spec)) {
        (_, Some(why)) => why,
        (ExperimentStatus::Succeeded, None) => "its worker did not hand over a model (see the run's log)".into(),
        (status, None) => format!("it is {}: a model is kept when a run succeeds", status.as_str()),
    };
    Err(HttpError::conflict(format!("experiment {id} has no trained model: {why}")))
}

/// `GET /api/experiments/{id}/model`
pub async fn download(State(state): State<AppState>, Path(raw_id): Path<String>) -> Result<Response, HttpError> {
    let (id, path, _) = stored_model(&state, &raw_id).await?;
    let bytes = tokio::fs::read(&path).await.map_err(|e| HttpError::internal("reading a model", e))?;
    let disposition = format!("attachment; filename=\"distlab-experiment-{id}.safetensors\"");
    Ok((
        [(header::CONTENT_TYPE, "application/octet-stream".to_string()), (header::CONTENT_DISPOSITION, disposition)],
        bytes,
    )
        .into_response())
}

/// `GET /api/experiments/{id}/model/config`
pub async fn config(
    State(state): State<AppState>,
    Path(raw_id): Path<String>,
) -> Result<Json<serde_json::Value>, HttpError> {
    let (_, _, spec) = stored_model(&state, &raw_id).await?;
    Ok(Json(export::hf_gpt2_config(&spec.model)))
}
