//! `POST /api/experiments/{id}/generate`: a succeeded run's model continues a prompt,
//! sampled on the server's CPU by the engine's own forward (`distlab_worker::generate`),
//! one request at a time and within a time budget. The line is fair: each account has at
//! most one request in it (a second gets 429), and it is only as long as the request
//! timeout lets the last one be served (beyond, 503 with `Retry-After`).

use std::collections::HashSet;
use std::sync::{Arc, Mutex};

use axum::extract::{Path, State};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::{Extension, Json};
use distlab_common::api::{GenerateRequest, Generated, MAX_NEW_TOKENS, MAX_PROMPT_TOKENS};
use distlab_common::FieldError;
use distlab_worker::generate::{generate as sample, load_hf, Sampling};
use distlab_worker::tokenizer::TextTokenizer;
use tokio::sync::Semaphore;

use crate::api::error::HttpError;
use crate::api::extract::JsonBody;
use crate::api::models::{read_tokenizer, stored_model, tokenizer_path};
use crate::store::accounts::Account;
use crate::AppState;

/// The sampler's line (one per server).
static LINE: std::sync::LazyLock<SamplerLine> = std::sync::LazyLock::new(SamplerLine::default);
/// A sampling stops after this long with the tokens it has (well inside the request
/// timeout, so the answer always arrives and the next request is not kept waiting).
const SAMPLING_BUDGET: std::time::Duration = std::time::Duration::from_secs(10);

/// The requests waiting for the sampler or using it: one sampling at a time (each is CPU
/// work for a while), served in order of arrival, at most one per account.
struct SamplerLine {
    turn: Arc<Semaphore>,
    accounts: Arc<Mutex<HashSet<String>>>,
}

impl Default for SamplerLine {
    fn default() -> Self {
        Self { turn: Arc::new(Semaphore::new(1)), accounts: Arc::default() }
    }
}

/// Why a request does not join the line.
#[derive(Debug, PartialEq, Eq)]
enum NotInLine {
    /// This account already has a request in the line.
    AccountHasOne,
    /// The line is as long as the request timeout allows.
    Full,
}

/// A place in the line, held until the sampling is done (or the request gives up).
struct InLine {
    account: String,
    accounts: Arc<Mutex<HashSet<String>>>,
}

impl Drop for InLine {
    fn drop(&mut self) {
        self.accounts.lock().unwrap_or_else(|e| e.into_inner()).remove(&self.account);
    }
}

impl SamplerLine {
    /// `account` joins the line unless it is in it already or `longest` are.
    fn join(&self, account: &str, longest: usize) -> Result<InLine, NotInLine> {
        let mut accounts = self.accounts.lock().unwrap_or_else(|e| e.into_inner());
        if accounts.contains(account) {
            return Err(NotInLine::AccountHasOne);
        }
        if accounts.len() >= longest {
            return Err(NotInLine::Full);
        }
        accounts.insert(account.to_string());
        Ok(InLine { account: account.to_string(), accounts: self.accounts.clone() })
    }
}

/// How many requests may be in the line: the last one's wait and its own sampling must fit
/// the request timeout (at least one).
fn longest_line(request_timeout: std::time::Duration, budget: std::time::Duration) -> usize {
    let fits = request_timeout.saturating_sub(std::time::Duration::from_secs(1)).as_secs_f64() / budget.as_secs_f64();
    (fits.floor() as usize).max(1)
}

/// The prompt's tokens (a text prompt cut by the run's tokenizer) and the sampling
/// settings, or every problem with them.
fn check_request(
    r: &GenerateRequest,
    vocab: usize,
    tokenizer: &TextTokenizer,
) -> Result<(Vec<u32>, Sampling), Vec<FieldError>> {
    let mut problems = Vec::new();
    let tokens = match (&r.prompt, &r.prompt_tokens) {
        (Some(text), None) => tokenizer.encode(text.as_bytes()).unwrap_or_else(|e| {
            problems.push(FieldError::new("prompt", e.to_string()));
            Vec::new()
        }),
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
        (status = 429, description = "this account already has a sampling waiting or running", body = distlab_common::ApiError),
        (status = 503, description = "the sampler's line is full: try again after Retry-After seconds", body = distlab_common::ApiError),
    ),
)]
pub async fn generate(
    State(state): State<AppState>,
    Extension(caller): Extension<Account>,
    Path(raw_id): Path<String>,
    JsonBody(body): JsonBody<GenerateRequest>,
) -> Result<Json<Generated>, Response> {
    sample_in_line(&state, &caller, &raw_id, body).await.map(Json)
}

async fn sample_in_line(
    state: &AppState,
    caller: &Account,
    raw_id: &str,
    body: GenerateRequest,
) -> Result<Generated, Response> {
    let (id, path, spec) = stored_model(state, raw_id).await.map_err(IntoResponse::into_response)?;
    let tokenizer = if spec.data.tokenizer.is_bytes() {
        TextTokenizer::Bytes
    } else {
        let json = tokio::fs::read(tokenizer_path(state, id))
            .await
            .map_err(|e| HttpError::internal("reading a tokenizer", e).into_response())?;
        read_tokenizer(&spec, &json).map_err(|e| HttpError::internal("reading a tokenizer", e).into_response())?
    };
    let (prompt, sampling) = check_request(&body, spec.model.vocab, &tokenizer).map_err(|problems| {
        let error = format!("cannot sample: {}", problems[0]);
        HttpError::with_fields(StatusCode::UNPROCESSABLE_ENTITY, error, problems).into_response()
    })?;
    let budget = SAMPLING_BUDGET.min(state.config.request_timeout / 2);
    let longest = longest_line(state.config.request_timeout, budget);
    let in_line = LINE.join(&caller.name, longest).map_err(|why| match why {
        NotInLine::AccountHasOne => HttpError::too_many_requests(
            "you already have a sampling waiting or running: wait for its answer before asking for another",
        )
        .into_response(),
        NotInLine::Full => {
            let mut resp = HttpError::unavailable(format!(
                "the sampler is busy ({longest} requests in line); try again in a few seconds"
            ))
            .into_response();
            let retry = budget.as_secs().max(1).to_string();
            if let Ok(v) = axum::http::HeaderValue::from_str(&retry) {
                resp.headers_mut().insert(axum::http::header::RETRY_AFTER, v);
            }
            resp
        }
    })?;
    let internal = |e: &dyn std::fmt::Display| HttpError::internal("sampling", e).into_response();
    // The turn is taken before the file is read, and held by the blocking work itself (with
    // the place in line): a request that times out does not free it while its sampling
    // still runs.
    let turn = LINE.turn.clone().acquire_owned().await.map_err(|e| internal(&e))?;
    let file = tokio::fs::read(&path).await.map_err(|e| HttpError::internal("reading a model", e).into_response())?;
    let started = std::time::Instant::now();
    let model = spec.model.clone();
    let tokens = tokio::task::spawn_blocking(move || {
        let _held = (turn, in_line);
        let params = load_hf(&model, &file)?;
        sample(&model, &params, &prompt, &sampling, |_| started.elapsed() < budget)
    })
    .await
    .map_err(|e| internal(&e))?
    .map_err(|e| internal(&e))?;
    let text = tokenizer.decode(&tokens).unwrap_or_default();
    let ms = started.elapsed().as_secs_f64() * 1e3;
    let stopped_early = tokens.len() < body.max_new_tokens;
    tracing::info!(experiment = id, tokens = tokens.len(), ms, stopped_early, "sampled");
    Ok(Generated { text, tokens, ms, stopped_early })
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;

    #[test]
    fn each_account_has_one_place_in_a_line_the_timeout_can_serve() {
        let line = SamplerLine::default();
        let ada = line.join("ada", 3).expect("ada joins");
        // ada floods: her further requests are refused at once, without waiting...
        for _ in 0..11 {
            assert_eq!(line.join("ada", 3).err(), Some(NotInLine::AccountHasOne));
        }
        // ... and bob still gets his place behind her.
        let bob = line.join("bob", 3).expect("bob joins");
        let _cy = line.join("cy", 3).expect("cy joins");
        assert_eq!(line.join("dee", 3).err(), Some(NotInLine::Full));
        drop(ada);
        let _ada = line.join("ada", 3).expect("ada's sampling done, she may ask again");
        drop(bob);
        assert!(line.join("dee", 3).is_ok());
    }

    #[test]
    fn the_line_is_as_long_as_the_request_timeout_serves() {
        let ten = Duration::from_secs(10);
        assert_eq!(longest_line(Duration::from_secs(30), ten), 2);
        assert_eq!(longest_line(Duration::from_secs(31), ten), 3);
        assert_eq!(longest_line(Duration::from_secs(5), Duration::from_millis(2500)), 1);
    }
}
