//! `POST /api/experiments/{id}/generate`: a succeeded run's model continues a prompt,
//! sampled on the server's CPU by the engine's own forward (`distlab_worker::generate`),
//! one request at a time and within a time budget.

use std::sync::Arc;

use axum::extract::{Path, State};
use axum::http::StatusCode;
use axum::Json;
use distlab_common::api::{GenerateRequest, Generated, MAX_NEW_TOKENS, MAX_PROMPT_TOKENS};
use distlab_common::FieldError;
use distlab_worker::generate::{generate as sample, load_gpt2, Sampling};
use tokio::sync::Semaphore;

use crate::error::HttpError;
use crate::extract::JsonBody;
use crate::models::stored_model;
use crate::AppState;

/// One sampling at a time: each is CPU work for a while.
static SAMPLING: std::sync::LazyLock<Arc<Semaphore>> = std::sync::LazyLock::new(|| Arc::new(Semaphore::new(1)));
/// A sampling stops after this long with the tokens it has (well inside the request
/// timeout, so the answer always arrives and the next request is not kept waiting).
const SAMPLING_BUDGET: std::time::Duration = std::time::Duration::from_secs(10);

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
#[utoipa::path(
    post, path = "/experiments/{id}/generate", operation_id = "generate_text", tag = "models",
    params(("id" = i64, Path, description = "the experiment's id")),
    request_body = distlab_common::GenerateRequest,
    responses(
        (status = 200, body = distlab_common::Generated),
        (status = 404, description = "no such experiment", body = distlab_common::ApiError),
        (status = 409, description = "the run has no model", body = distlab_common::ApiError),
        (status = 422, description = "names each field that is wrong", body = distlab_common::ApiError),
        (status = 429, description = "the sampler is busy", body = distlab_common::ApiError),
    ),
)]
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
    // The turn is taken before the file is read, and held by the blocking work itself: a
    // request that times out does not free it while its sampling still runs.
    let turn = SAMPLING.clone().acquire_owned().await.map_err(|e| HttpError::internal("sampling", e))?;
    let file = tokio::fs::read(&path).await.map_err(|e| HttpError::internal("reading a model", e))?;
    let started = std::time::Instant::now();
    let model = spec.model.clone();
    let budget = SAMPLING_BUDGET.min(state.config.request_timeout / 2);
    let tokens = tokio::task::spawn_blocking(move || {
        let _turn = turn;
        let params = load_gpt2(&model, &file)?;
        sample(&model, &params, &prompt, &sampling, |_| started.elapsed() < budget)
    })
    .await
    .map_err(|e| HttpError::internal("sampling", e))?
    .map_err(|e| HttpError::internal("sampling", e))?;
    let bytes: Option<Vec<u8>> = tokens.iter().map(|&t| u8::try_from(t).ok()).collect();
    let text = bytes.map_or_else(String::new, |b| String::from_utf8_lossy(&b).into_owned());
    let ms = started.elapsed().as_secs_f64() * 1e3;
    let stopped_early = tokens.len() < body.max_new_tokens;
    tracing::info!(experiment = id, tokens = tokens.len(), ms, stopped_early, "sampled");
    Ok(Json(Generated { text, tokens, ms, stopped_early }))
}
