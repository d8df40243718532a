//! Uploaded texts to train on (`data.dataset: "upload"`, `data.upload_id`): one token per
//! byte like the built-in text, split into training and validation by the worker.
//!
//! - `POST /api/datasets?name=NAME`: the body is the text itself (`Content-Type:
//!   text/plain`, UTF-8, at most `ServerConfig::max_dataset_bytes`) -> 201 DatasetView.
//! - `GET /api/datasets`: every uploaded text, newest first (a class shares them).
//! - `DELETE /api/datasets/{id}`: its owner or an admin, unless a queued or running
//!   experiment trains on it (409). The id is never used again.
//! - `GET /api/workers/datasets/{id}`: the text, for any registered worker (the one that
//!   runs an experiment on it fetches it).
//!
//! The rows are in the `datasets` table (`store/datasets.rs`), the texts under
//! DATA_DIR/datasets. One person keeps at most `MAX_DATASETS_PER_OWNER` texts (429 beyond),
//! within their share of the disk (`store/disk_quota.rs`, 507 beyond).

use std::path::PathBuf;

use axum::body::{Body, Bytes};
use axum::extract::{Path, Query, State};
use axum::http::{header, HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::{Extension, Json};
use distlab_common::{text_split, Dataset, DatasetList, ExperimentSpec, FieldError};
use serde::Deserialize;
use std::error::Error as _;

use crate::api::error::HttpError;
use crate::api::extract::parse_id;
use crate::api::session;
use crate::store::accounts::Account;
use crate::store::datasets::{find, max_seq_len, Refused, UPLOAD_PREFIX};
use crate::store::{self, Db};
use crate::{clock, AppState};

/// Longest name of a dataset, in characters.
const MAX_NAME_CHARS: usize = 100;

/// Where dataset `id`'s text is kept.
fn text_path(state: &AppState, id: i64) -> PathBuf {
    state.config.data_dir.join("datasets").join(format!("dataset-{id}.txt"))
}

#[derive(Deserialize)]
pub struct UploadQuery {
    name: Option<String>,
}

/// `POST /api/datasets?name=NAME`
#[utoipa::path(
    post, path = "/datasets", operation_id = "upload_dataset", tag = "datasets",
    params(("name" = String, Query, description = "what to call it (1 to 100 characters)")),
    request_body(content = String, content_type = "text/plain", description = "the text, UTF-8"),
    responses(
        (status = 201, body = distlab_common::DatasetView),
        (status = 413, description = "larger than the server takes", body = distlab_common::ApiError),
        (status = 415, description = "not text/plain", body = distlab_common::ApiError),
        (status = 422, description = "not UTF-8, empty, or no name", body = distlab_common::ApiError),
        (status = 429, description = "this account keeps the most datasets it may", body = distlab_common::ApiError),
        (status = 507, description = "the text would not fit in this account's share of the disk", body = distlab_common::ApiError),
    ),
)]
pub async fn upload(
    State(state): State<AppState>,
    Extension(owner): Extension<Account>,
    Query(query): Query<UploadQuery>,
    headers: HeaderMap,
    body: Body,
) -> Result<Response, HttpError> {
    let content_type = headers.get(header::CONTENT_TYPE).and_then(|v| v.to_str().ok()).unwrap_or("");
    if content_type.split(';').next().map(str::trim) != Some("text/plain") {
        return Err(HttpError::unsupported_media_type(format!(
            "a dataset is uploaded as its text with Content-Type: text/plain (got {:?})",
            content_type
        )));
    }
    let name = query.name.unwrap_or_default().trim().to_string();
    let limit = state.config.max_dataset_bytes;
    let bytes: Bytes = axum::body::to_bytes(body, limit).await.map_err(|e| match e.source() {
        Some(cause) if cause.is::<http_body_util::LengthLimitError>() => HttpError::too_large(limit),
        _ => HttpError::bad_request(format!("could not read the text: {e}")),
    })?;
    let mut problems = Vec::new();
    if name.is_empty() || name.chars().count() > MAX_NAME_CHARS || name.chars().any(char::is_control) {
        problems.push(FieldError::new("name", format!("give the dataset a name of 1 to {MAX_NAME_CHARS} characters")));
    }
    if let Err(e) = std::str::from_utf8(&bytes) {
        problems.push(FieldError::new(
            "body",
            format!("the text is not UTF-8: the bytes at {} are not a character", e.valid_up_to()),
        ));
    } else if max_seq_len(bytes.len() as u64) == 0 {
        problems.push(FieldError::new(
            "body",
            format!("{} bytes are too few: a text needs at least 4 (a window to train on, one held out)", bytes.len()),
        ));
    }
    if !problems.is_empty() {
        return Err(HttpError::with_fields(
            StatusCode::UNPROCESSABLE_ENTITY,
            "this text cannot be a dataset",
            problems,
        ));
    }
    let bytes_len = bytes.len() as u64;
    let max_disk = state.config.max_disk_per_user;
    // The text is written aside first, the row made, then the file renamed into place: a
    // listed dataset always has its text, a failed upload leaves neither (and one cut short
    // by a kill is removed at the next start, `remove_half_written`).
    let dir = state.config.data_dir.join("datasets");
    let aside = dir.join(format!("{UPLOAD_PREFIX}{:016x}", rand::random::<u64>()));
    let written = tokio::task::spawn_blocking({
        let (dir, aside) = (dir.clone(), aside.clone());
        move || std::fs::create_dir_all(&dir).and_then(|()| std::fs::write(&aside, &bytes))
    })
    .await
    .map_err(|e| HttpError::internal("storing a dataset", e))?;
    let placed = match written {
        Ok(()) => {
            match store::datasets::insert_within_quota(&state.db, &name, &owner.name, bytes_len, max_disk).await {
                Ok(Ok(view)) => std::fs::rename(&aside, text_path(&state, view.id))
                    .map(|()| view)
                    .map_err(|e| HttpError::internal("storing a dataset", e)),
                Ok(Err(Refused::TooMany(kept))) => Err(HttpError::too_many_requests(format!(
                    "{} keeps {kept} datasets, the most one person may: delete one first",
                    owner.name
                ))),
                Ok(Err(Refused::OverDisk(over))) => Err(over.error(&owner.name, "this text")),
                Err(e) => Err(HttpError::from(e)),
            }
        }
        Err(e) => Err(HttpError::internal("storing a dataset", e)),
    };
    let view = placed.inspect_err(|_| {
        let _ = std::fs::remove_file(&aside);
    })?;
    tracing::info!(dataset = view.id, bytes = view.bytes, owner = %owner.name, "dataset uploaded");
    Ok((StatusCode::CREATED, Json(view)).into_response())
}

/// `GET /api/datasets`
#[utoipa::path(
    get, path = "/datasets", operation_id = "list_datasets", tag = "datasets",
    responses(
        (status = 200, body = distlab_common::DatasetList),
    ),
)]
pub async fn list(State(state): State<AppState>) -> Result<Json<DatasetList>, HttpError> {
    Ok(Json(DatasetList { datasets: store::datasets::all(&state.db).await? }))
}

/// `DELETE /api/datasets/{id}`
#[utoipa::path(
    delete, path = "/datasets/{id}", operation_id = "delete_dataset", tag = "datasets",
    params(("id" = i64, Path, description = "the dataset's id")),
    responses(
        (status = 204, description = "deleted"),
        (status = 403, description = "someone else's", body = distlab_common::ApiError),
        (status = 404, body = distlab_common::ApiError),
        (status = 409, description = "a queued or running experiment trains on it", body = distlab_common::ApiError),
    ),
)]
pub async fn delete(
    State(state): State<AppState>,
    Extension(caller): Extension<Account>,
    Path(raw_id): Path<String>,
) -> Result<StatusCode, HttpError> {
    let id = parse_id(&raw_id)?;
    let dataset = find(&state.db, id).await?.ok_or_else(|| not_found(id))?;
    session::may_change(&caller, &format!("dataset {id}"), &dataset.owner, "delete")?;
    let users = store::datasets::experiments_using(&state.db, id).await?;
    if !users.is_empty() {
        let ids: Vec<String> = users.iter().map(i64::to_string).collect();
        return Err(HttpError::conflict(format!(
            "experiment(s) {} train on dataset {id}: let them finish or cancel them first",
            ids.join(", ")
        )));
    }
    store::datasets::mark_deleted(&state.db, id, clock::now()).await?;
    if let Err(e) = std::fs::remove_file(text_path(&state, id)) {
        if e.kind() != std::io::ErrorKind::NotFound {
            tracing::warn!(dataset = id, "could not remove the text: {e}");
        }
    }
    Ok(StatusCode::NO_CONTENT)
}

/// `GET /api/workers/datasets/{id}`
#[utoipa::path(
    get, path = "/datasets/{id}", operation_id = "worker_dataset", tag = "workers",
    params(("id" = i64, Path, description = "the dataset's id")),
    responses(
        (status = 200, description = "the text", content_type = "text/plain"),
        (status = 401, description = "no or a wrong worker credential", body = distlab_common::ApiError),
        (status = 404, body = distlab_common::ApiError),
    ),
)]
pub async fn text(State(state): State<AppState>, Path(raw_id): Path<String>) -> Result<Response, HttpError> {
    let id = parse_id(&raw_id)?;
    find(&state.db, id).await?.ok_or_else(|| not_found(id))?;
    let bytes = tokio::fs::read(text_path(&state, id)).await.map_err(|e| match e.kind() {
        std::io::ErrorKind::NotFound => not_found(id),
        _ => HttpError::internal("reading a dataset", e),
    })?;
    Ok(([(header::CONTENT_TYPE, "text/plain; charset=utf-8")], bytes).into_response())
}

fn not_found(id: i64) -> HttpError {
    HttpError::not_found(format!("no dataset {id}"))
}

/// The problems with `spec`'s uploaded dataset, if it names one: it must exist and hold a
/// window of seq_len + 1 bytes on each side of its split.
pub async fn check_spec(db: &Db, spec: &ExperimentSpec) -> Result<Vec<FieldError>, HttpError> {
    // (an id below 1 is the spec's own error already)
    let (Dataset::Upload, Some(id @ 1..)) = (spec.data.dataset, spec.data.upload_id) else { return Ok(Vec::new()) };
    Ok(match find(db, id).await? {
        None => {
            vec![FieldError::new("data.upload_id", format!("there is no dataset {id} (GET /api/datasets lists them)"))]
        }
        Some(d) if text_split(d.bytes as usize, spec.model.seq_len).is_none() => vec![FieldError::new(
            "model.seq_len",
            format!(
                "dataset {id} has {} bytes: it trains with seq_len up to {} (a window to train on and one held out)",
                d.bytes, d.max_seq_len
            ),
        )],
        Some(_) => Vec::new(),
    })
}
