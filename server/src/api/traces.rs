//! Per-rank traces (timeline spans and collective steps): `GET /api/experiments/{id}/trace`,
//! and the 422 for an event batch whose traces do not fit its experiment.
//!
//! The store keeps the latest `RankTrace` of each rank as JSON text (`store/traces.rs`), so
//! the endpoint splices the rows into one `ExperimentTrace` without decoding them (a trace
//! can be a few MB).

use axum::extract::{Path, State};
use axum::http::header;
use axum::response::{IntoResponse, Response};
use distlab_common::FieldError;

use crate::api::error::HttpError;
use crate::api::extract::parse_id;
use crate::store;
use crate::AppState;

/// The 422 answer for an event batch with traces that `store::traces::check` refused.
pub fn invalid_batch(problems: Vec<FieldError>) -> HttpError {
    let error = match problems.as_slice() {
        [one] => format!("the event batch was not stored: {one}"),
        many => format!("the event batch was not stored: {} of its traces do not fit this experiment", many.len()),
    };
    HttpError::with_fields(axum::http::StatusCode::UNPROCESSABLE_ENTITY, error, problems)
}

/// `GET /api/experiments/{id}/trace`: `ExperimentTrace`, ranks in rank order (none yet: `{"ranks":[]}`).
#[utoipa::path(
    get, path = "/experiments/{id}/trace", operation_id = "experiment_trace", tag = "experiments",
    params(("id" = i64, Path, description = "the experiment's id")),
    responses(
        (status = 200, body = distlab_common::trace::ExperimentTrace),
        (status = 404, description = "no such experiment", body = distlab_common::ApiError),
    ),
)]
pub async fn trace(State(state): State<AppState>, Path(raw_id): Path<String>) -> Result<Response, HttpError> {
    let id = parse_id(&raw_id)?;
    if !store::experiments::exists(&state.db, id).await? {
        return Err(HttpError::no_experiment(id));
    }
    let rows = store::traces::stored_json(&state.db, id).await?;
    let mut body = String::with_capacity(rows.iter().map(|r| r.len() + 1).sum::<usize>() + 12);
    body.push_str("{\"ranks\":[");
    for (i, row) in rows.iter().enumerate() {
        if i > 0 {
            body.push(',');
        }
        body.push_str(row);
    }
    body.push_str("]}");
    Ok(([(header::CONTENT_TYPE, "application/json")], body).into_response())
}
