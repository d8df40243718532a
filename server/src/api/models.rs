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
//! - `PUT /api/workers/experiments/{id}/tokenizer` (a `data.tokenizer: bpe` run, before its
//!   model): the run's tokenizer.json, checked as the model is; `GET
//!   /api/experiments/{id}/model/tokenizer` serves it with the model.

use std::path::PathBuf;

use std::error::Error as _;

use axum::body::{Body, Bytes};
use axum::extract::{Path, Request, State};
use axum::http::{header, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::{Extension, Json};
use distlab_common::{export, ExperimentSpec, ExperimentStatus};
use distlab_worker::generate::load_hf;
use distlab_worker::tokenizer::TextTokenizer;
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

/// Where experiment `id`'s tokenizer.json is kept (a BPE run).
pub fn tokenizer_path(state: &AppState, id: i64) -> PathBuf {
    state.config.data_dir.join("models").join(format!("experiment-{id}.tokenizer.json"))
}

/// Removes experiment `id`'s model and tokenizer, if it has them (a deleted experiment).
pub fn remove(state: &AppState, id: i64) {
    for path in [model_path(state, id), tokenizer_path(state, id)] {
        if let Err(e) = std::fs::remove_file(&path) {
            if e.kind() != std::io::ErrorKind::NotFound {
                tracing::warn!(experiment = id, "could not remove {}: {e}", path.display());
            }
        }
    }
}

/// A file a worker hands over with a finished run.
#[derive(Clone, Copy, Debug)]
enum Handed {
    Model,
    Tokenizer,
}

impl Handed {
    fn name(self) -> &'static str {
        match self {
            Handed::Model => "model",
            Handed::Tokenizer => "tokenizer",
        }
    }

    fn path(self, state: &AppState, id: i64) -> PathBuf {
        match self {
            Handed::Model => model_path(state, id),
            Handed::Tokenizer => tokenizer_path(state, id),
        }
    }

    /// Whether `bytes` is what a worker may store for `spec`'s run: its model in its
    /// family's Hugging Face layout (every tensor there, f32, the model's shapes), or its
    /// BPE's tokenizer.json (no more tokens than the model's vocabulary).
    fn check(self, spec: &ExperimentSpec, bytes: &[u8]) -> Result<(), String> {
        if let Some(why) = export::not_exportable(spec) {
            return Err(why);
        }
        match self {
            Handed::Model => load_hf(&spec.model, bytes).map(drop),
            Handed::Tokenizer => read_tokenizer(spec, bytes).map(drop),
        }
    }
}

/// `spec`'s run's tokenizer from its tokenizer.json.
pub(crate) fn read_tokenizer(spec: &ExperimentSpec, json: &[u8]) -> Result<TextTokenizer, String> {
    if spec.data.tokenizer.is_bytes() {
        return Err("this run's tokens are its text's bytes: it has no tokenizer to keep".into());
    }
    let json = std::str::from_utf8(json).map_err(|e| format!("tokenizer.json is not UTF-8: {e}"))?;
    let tokenizer = TextTokenizer::from_json(json).map_err(|e| e.to_string())?;
    if tokenizer.vocab_size() > spec.model.vocab {
        return Err(format!(
            "the tokenizer makes {} tokens, the model's vocabulary has {}",
            tokenizer.vocab_size(),
            spec.model.vocab
        ));
    }
    Ok(tokenizer)
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
    let (id, stored_bytes) = receive(&state, caller, &raw_id, body, Handed::Model).await?;
    experiments::record_model_bytes(&state.db, id, stored_bytes).await?;
    Ok(StatusCode::NO_CONTENT)
}

/// `PUT /api/workers/experiments/{id}/tokenizer`
#[utoipa::path(
    put, path = "/workers/experiments/{id}/tokenizer", operation_id = "upload_tokenizer", tag = "workers",
    params(("id" = i64, Path, description = "the experiment's id")),
    request_body(content = Object, content_type = "application/json", description = "the run's tokenizer.json"),
    responses(
        (status = 204, description = "stored"),
        (status = 401, description = "no or a wrong worker credential", body = distlab_common::ApiError),
        (status = 409, description = "the caller does not hold the lease", body = distlab_common::ApiError),
        (status = 413, body = distlab_common::ApiError),
        (status = 422, description = "not this run's tokenizer", body = distlab_common::ApiError),
    ),
)]
pub async fn upload_tokenizer(
    State(state): State<AppState>,
    Extension(caller): Extension<CallingWorker>,
    Path(raw_id): Path<String>,
    body: Body,
) -> Result<StatusCode, HttpError> {
    receive(&state, caller, &raw_id, body, Handed::Tokenizer).await?;
    Ok(StatusCode::NO_CONTENT)
}

/// Takes `what` for experiment `raw_id` from the worker holding its lease (checked again
/// once the body is in; the upload renews the lease): at most
/// `ServerConfig::max_model_bytes`, checked (422), then stored whole. Answers the id and
/// the bytes stored.
async fn receive(
    state: &AppState,
    caller: CallingWorker,
    raw_id: &str,
    body: Body,
    what: Handed,
) -> Result<(i64, u64), HttpError> {
    let id = parse_id(raw_id)?;
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
        _ => HttpError::bad_request(format!("could not read the {}: {e}", what.name())),
    })?;
    let spec = load(&state.db, id).await?.ok_or_else(|| HttpError::no_experiment(id))?.spec;
    let checked = tokio::task::spawn_blocking({
        let bytes = bytes.clone();
        move || what.check(&spec, &bytes)
    })
    .await
    .map_err(|e| HttpError::internal("checking an upload", e))?;
    checked.map_err(|why| HttpError::new(StatusCode::UNPROCESSABLE_ENTITY, format!("the {}: {why}", what.name())))?;
    // Still this worker's (a long upload may have outlived its lease)?
    holds(state.clone()).await?;
    let path = what.path(state, id);
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
    .map_err(|e| HttpError::internal("storing an upload", e))?;
    written.map_err(|e| HttpError::internal("storing an upload", e))?;
    // The upload took the lease's time: renew it, as a heartbeat would.
    leases::renew(&state.db, caller.0, id, state.config.lease_duration(), clock::now()).await?;
    tracing::info!(experiment = id, worker = caller.0, bytes = stored_bytes, "{} stored", what.name());
    Ok((id, stored_bytes))
}

/// Experiment `id`'s model file, or why it has none (404 no such experiment, 409 no model).
pub(crate) async fn stored_model(
    state: &AppState,
    raw_id: &str,
) -> Result<(i64, PathBuf, distlab_common::ExperimentSpec), HttpError> {
    let id = parse_id(raw_id)?;
    let experiment = load(&state.db, id).await?.ok_or_else(|| HttpError::no_experiment(id))?;
    let path = model_path(state, id);
    let tokenizer_kept = experiment.spec.data.tokenizer.is_bytes() || tokenizer_path(state, id).exists();
    if experiment.status == ExperimentStatus::Succeeded && path.exists() && tokenizer_kept {
        return Ok((id, path, experiment.spec));
    }
    let why = match (experiment.status, export::not_exportable(&experiment.spec)) {
        (_, Some(why)) => why,
        (ExperimentStatus::Succeeded, None) if !tokenizer_kept => {
            "its worker did not hand over its tokenizer.json (see the run's log)".into()
        }
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
    serve_attachment(&path, &format!("distlab-experiment-{id}.safetensors"), req).await
}

/// `GET /api/experiments/{id}/model/tokenizer`
#[utoipa::path(
    get, path = "/experiments/{id}/model/tokenizer", operation_id = "download_tokenizer", tag = "models",
    params(("id" = i64, Path, description = "the experiment's id")),
    responses(
        (status = 200, description = "the run's byte-level BPE as tokenizer.json (Hugging Face tokenizers)", body = Object),
        (status = 404, description = "no such experiment", body = distlab_common::ApiError),
        (status = 409, description = "the run has no model, or its tokens are bytes", body = distlab_common::ApiError),
    ),
)]
pub async fn download_tokenizer(
    State(state): State<AppState>,
    Path(raw_id): Path<String>,
    req: Request,
) -> Result<Response, HttpError> {
    let (id, _, spec) = stored_model(&state, &raw_id).await?;
    if spec.data.tokenizer.is_bytes() {
        return Err(HttpError::conflict(format!(
            "experiment {id} has no tokenizer.json: it ran with data.tokenizer=bytes (a text's token i is its byte \
             i; a Markov chain's tokens are ids)"
        )));
    }
    serve_attachment(&tokenizer_path(&state, id), "tokenizer.json", req).await
}

/// The file at `path`, streamed (`ServeFile`, not read whole), to be saved as `filename`.
async fn serve_attachment(path: &std::path::Path, filename: &str, req: Request) -> Result<Response, HttpError> {
    let served = ServeFile::new(path).oneshot(req).await.map_err(|e| HttpError::internal("reading a file", e))?;
    let mut response = served.map(Body::new).into_response();
    if let Ok(value) = header::HeaderValue::from_str(&format!("attachment; filename=\"{filename}\"")) {
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

#[cfg(test)]
mod tests {
    use distlab_common::{DataSpec, Dataset, ModelSpec, TokenizerKind};

    use super::*;

    /// A worker may store a BPE run's own tokenizer only: not for a byte run, not one that
    /// makes more tokens than the model knows, not something that is not a tokenizer.json.
    #[test]
    fn only_the_runs_own_kind_of_tokenizer_is_kept() {
        let mut spec = ExperimentSpec {
            data: DataSpec { dataset: Dataset::Text, tokenizer: TokenizerKind::Bpe, ..DataSpec::default() },
            model: ModelSpec { vocab: 300, ..ModelSpec::default() },
            ..ExperimentSpec::default()
        };
        let text = &distlab_worker::data::SHAKESPEARE[..20_000];
        let json = |vocab| TextTokenizer::learn(TokenizerKind::Bpe, text, vocab).unwrap().to_json().unwrap();
        assert!(Handed::Tokenizer.check(&spec, json(280).as_bytes()).is_ok());
        let too_many = Handed::Tokenizer.check(&spec, json(320).as_bytes()).unwrap_err();
        assert!(too_many.contains("the model's vocabulary has 300"), "{too_many}");
        assert!(Handed::Tokenizer.check(&spec, b"{\"model\": 1}").unwrap_err().contains("not a tokenizer.json"));
        spec.data.tokenizer = TokenizerKind::Bytes;
        assert!(Handed::Tokenizer.check(&spec, json(280).as_bytes()).unwrap_err().contains("has no tokenizer"));
    }
}
