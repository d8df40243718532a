//! A run's trained model, in GPT-2's format (`distlab_common::export`): handed over by the
//! worker that ran it before it reports the run complete, kept under the data directory,
//! fetched by anyone who can see the experiment, removed with it.
//!
//! - `PUT /api/workers/experiments/{id}/model`: the worker holding the experiment's lease;
//!   the body is model.safetensors (at most `ServerConfig::max_model_bytes`, and a
//!   safetensors file of f32 tensors, or 422).
//! - `GET /api/experiments/{id}/model`: the file (409 when the run has none, saying why).
//! - `GET /api/experiments/{id}/model/config`: the `config.json` that goes with it.
//! - `POST /api/experiments/{id}/generate`: the prompt continued by the model, sampled on
//!   the server's CPU by the engine's own forward (`distlab_worker::generate`), one request
//!   at a time.

use std::path::PathBuf;

use axum::body::{Body, Bytes};
use axum::extract::{Path, State};
use axum::http::{header, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::{Extension, Json};
use distlab_common::api::{GenerateRequest, Generated, MAX_NEW_TOKENS, MAX_PROMPT_TOKENS};
use distlab_common::{export, ExperimentStatus, FieldError};
use distlab_worker::generate::{generate as sample, load_gpt2, Sampling};

use crate::error::HttpError;
use crate::experiments::{load, not_found};
use crate::extract::parse_id;
use crate::extract::JsonBody;
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

/// One sampling at a time: each is CPU work for a while.
static SAMPLING: tokio::sync::Semaphore = tokio::sync::Semaphore::const_new(1);

/// The prompt's tokens and the sampling settings, or every problem with them.
fn check_request(r: &GenerateRequest, vocab: usize) -> Result<(Vec<u32>, Sampling), Vec<FieldError>> {
    let mut problems = Vec::new();
    let tokens = match (&r.prompt, &r.prompt_tokens) {
        (Some(text), None) => text.bytes().map(u32::from).collect(),
        (None, Some(tokens)) => tokens.clone(),
        _ => {
            problems.push(FieldError::new("prompt", "give either prompt (text) or prompt_tokens (token ids)"));
            Vec::new()
        }
    };
    if tokens.is_empty() && problems.is_empty() {
        problems.push(FieldError::new("prompt", "the prompt is empty"));
    }
    if tokens.len() > MAX_PROMPT_TOKENS {
        problems.push(FieldError::new("prompt", format!("at most {MAX_PROMPT_TOKENS} tokens, got {}", tokens.len())));
    }
    if let Some(&bad) = tokens.iter().find(|&&t| t as usize >= vocab) {
        let why = if r.prompt.is_some() {
            format!(
                "the text holds byte {bad}, but this model's vocabulary has {vocab} tokens (it was not trained on \
                 text): give prompt_tokens below {vocab}"
            )
        } else {
            format!("token {bad} is outside this model's vocabulary of {vocab}")
        };
        problems.push(FieldError::new("prompt", why));
    }
    if !(1..=MAX_NEW_TOKENS).contains(&r.max_new_tokens) {
        problems
            .push(FieldError::new("max_new_tokens", format!("from 1 to {MAX_NEW_TOKENS}, got {}", r.max_new_tokens)));
    }
    if !(r.temperature.is_finite() && (0.0..=10.0).contains(&r.temperature)) {
        problems.push(FieldError::new("temperature", format!("from 0 (greedy) to 10, got {}", r.temperature)));
    }
    if r.top_k > vocab {
        problems.push(FieldError::new("top_k", format!("at most the vocabulary's {vocab} (0: all), got {}", r.top_k)));
    }
    let sampling =
        Sampling { max_new_tokens: r.max_new_tokens, temperature: r.temperature, top_k: r.top_k, seed: r.seed };
    if problems.is_empty() {
        Ok((tokens, sampling))
    } else {
        Err(problems)
    }
}

/// `POST /api/experiments/{id}/generate`
pub async fn generate(
    State(state): State<AppState>,
    Path(raw_id): Path<String>,
    JsonBody(body): JsonBody<GenerateRequest>,
) -> Result<Json<Generated>, HttpError> {
    let (id, path, spec) = stored_model(&state, &raw_id).await?;
    let (prompt, sampling) = check_request(&body, spec.model.vocab).map_err(|problems| {
        let error = format!("cannot sample: {}", problems[0]);
        HttpError::with_fields(StatusCode::UNPROCESSABLE_ENTITY, error, problems)
    })?;
    let file = tokio::fs::read(&path).await.map_err(|e| HttpError::internal("reading a model", e))?;
    let _turn = SAMPLING.acquire().await.map_err(|e| HttpError::internal("sampling", e))?;
    let started = std::time::Instant::now();
    let model = spec.model.clone();
    let tokens = tokio::task::spawn_blocking(move || {
        let params = load_gpt2(&model, &file)?;
        sample(&model, &params, &prompt, &sampling, |_| {})
    })
    .await
    .map_err(|e| HttpError::internal("sampling", e))?
    .map_err(|e| HttpError::internal("sampling", e))?;
    let bytes: Option<Vec<u8>> = tokens.iter().map(|&t| u8::try_from(t).ok()).collect();
    let text = bytes.map_or_else(String::new, |b| String::from_utf8_lossy(&b).into_owned());
    let ms = started.elapsed().as_secs_f64() * 1e3;
    tracing::info!(experiment = id, tokens = tokens.len(), ms, "sampled");
    Ok(Json(Generated { text, tokens, ms }))
}
