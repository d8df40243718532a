//! Uploaded texts to train on (`data.dataset: "upload"`, `data.upload_id`): one token per
//! byte like the built-in text, split into training and validation by the worker.
//!
//! - `POST /api/datasets?name=NAME`: the body is the text itself (`Content-Type:
//!   text/plain`, UTF-8, at most `ServerConfig::max_dataset_bytes`) -> 201 DatasetView.
//! - `GET /api/datasets`: every uploaded text, newest first (a class shares them).
//! - `DELETE /api/datasets/{id}`: its owner or an admin, unless a queued or running
//!   experiment trains on it (409).
//! - `GET /api/workers/datasets/{id}`: the text, for the worker that runs an experiment.
//!
//! The rows are in the `datasets` table, the texts under DATA_DIR/datasets.

use std::path::PathBuf;

use axum::body::{Body, Bytes};
use axum::extract::{Path, Query, State};
use axum::http::{header, HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::{Extension, Json};
use distlab_common::{text_split, Dataset, DatasetList, DatasetView, ExperimentSpec, FieldError};
use serde::Deserialize;
use std::error::Error as _;

use crate::accounts::Account;
use crate::db::Db;
use crate::error::HttpError;
use crate::extract::parse_id;
use crate::{clock, AppState};

/// Longest name of a dataset, in characters.
const MAX_NAME_CHARS: usize = 100;

/// Where dataset `id`'s text is kept.
fn text_path(state: &AppState, id: i64) -> PathBuf {
    state.config.data_dir.join("datasets").join(format!("dataset-{id}.txt"))
}

#[derive(sqlx::FromRow)]
struct DatasetRow {
    id: i64,
    name: String,
    owner: String,
    bytes: i64,
    created_at: String,
}

impl DatasetRow {
    fn into_view(self) -> DatasetView {
        let bytes = u64::try_from(self.bytes).unwrap_or(0);
        DatasetView {
            id: self.id,
            name: self.name,
            owner: self.owner,
            bytes,
            max_seq_len: max_seq_len(bytes),
            created_at: self.created_at,
        }
    }
}

/// The longest seq_len a text of `bytes` bytes can train with ([`text_split`] holds a
/// window on each side): 0 when none.
fn max_seq_len(bytes: u64) -> u64 {
    // A window on each side: 2 (seq_len + 1) <= bytes, and the tenth held out is at least one.
    let n = usize::try_from(bytes).unwrap_or(usize::MAX);
    let mut seq_len = (n / 2).saturating_sub(1);
    while seq_len > 0 && text_split(n, seq_len).is_none() {
        seq_len -= 1;
    }
    seq_len as u64
}

// ---------------------------------------------------------------------------------------
// The store
// ---------------------------------------------------------------------------------------

/// Dataset `id`, if there is one.
pub async fn find(db: &Db, id: i64) -> Result<Option<DatasetView>, sqlx::Error> {
    let row = sqlx::query_as::<_, DatasetRow>("SELECT id, name, owner, bytes, created_at FROM datasets WHERE id = ?1")
        .bind(id)
        .fetch_optional(db)
        .await?;
    Ok(row.map(DatasetRow::into_view))
}

async fn all(db: &Db) -> Result<Vec<DatasetView>, sqlx::Error> {
    let rows =
        sqlx::query_as::<_, DatasetRow>("SELECT id, name, owner, bytes, created_at FROM datasets ORDER BY id DESC")
            .fetch_all(db)
            .await?;
    Ok(rows.into_iter().map(DatasetRow::into_view).collect())
}

async fn insert(db: &Db, name: &str, owner: &str, bytes: u64) -> Result<DatasetView, sqlx::Error> {
    let created_at = clock::rfc3339(clock::now());
    let id: i64 = sqlx::query_scalar(
        "INSERT INTO datasets (name, owner, bytes, created_at) VALUES (?1, ?2, ?3, ?4) RETURNING id",
    )
    .bind(name)
    .bind(owner)
    .bind(i64::try_from(bytes).unwrap_or(i64::MAX))
    .bind(&created_at)
    .fetch_one(db)
    .await?;
    Ok(DatasetView { id, name: name.into(), owner: owner.into(), bytes, max_seq_len: max_seq_len(bytes), created_at })
}

/// Queued or running experiments that train on dataset `id`.
async fn experiments_using(db: &Db, id: i64) -> Result<Vec<i64>, sqlx::Error> {
    let rows: Vec<(i64, String)> =
        sqlx::query_as("SELECT id, spec FROM experiments WHERE status IN ('queued', 'running') ORDER BY id")
            .fetch_all(db)
            .await?;
    Ok(rows
        .into_iter()
        .filter(|(_, spec)| {
            serde_json::from_str::<ExperimentSpec>(spec)
                .is_ok_and(|s| s.data.dataset == Dataset::Upload && s.data.upload_id == Some(id))
        })
        .map(|(experiment, _)| experiment)
        .collect())
}

// ---------------------------------------------------------------------------------------
// Handlers
// ---------------------------------------------------------------------------------------

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
    let view = insert(&state.db, &name, &owner.name, bytes.len() as u64).await?;
    let path = text_path(&state, view.id);
    let written = tokio::task::spawn_blocking(move || -> std::io::Result<()> {
        let dir = path.parent().unwrap_or(std::path::Path::new("."));
        std::fs::create_dir_all(dir)?;
        let aside = dir.join(format!(".upload-{:016x}", rand::random::<u64>()));
        std::fs::write(&aside, &bytes).and_then(|()| std::fs::rename(&aside, &path)).inspect_err(|_| {
            let _ = std::fs::remove_file(&aside);
        })
    })
    .await
    .map_err(|e| HttpError::internal("storing a dataset", e))?;
    if let Err(e) = written {
        // Nothing half-made stays: the row goes with the file that could not be written.
        let _ = sqlx::query("DELETE FROM datasets WHERE id = ?1").bind(view.id).execute(&state.db).await;
        return Err(HttpError::internal("storing a dataset", e));
    }
    tracing::info!(dataset = view.id, bytes = view.bytes, owner = %owner.name, "dataset uploaded");
    let location = format!("/api/datasets/{}", view.id);
    Ok((StatusCode::CREATED, [(header::LOCATION, location)], Json(view)).into_response())
}

/// `GET /api/datasets`
#[utoipa::path(
    get, path = "/datasets", operation_id = "list_datasets", tag = "datasets",
    responses(
        (status = 200, body = distlab_common::DatasetList),
    ),
)]
pub async fn list(State(state): State<AppState>) -> Result<Json<DatasetList>, HttpError> {
    Ok(Json(DatasetList { datasets: all(&state.db).await? }))
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
    if !(caller.admin || caller.name == dataset.owner) {
        return Err(HttpError::forbidden(format!(
            "dataset {id} is {}'s: only its owner or an admin may delete it",
            dataset.owner
        )));
    }
    let users = experiments_using(&state.db, id).await?;
    if !users.is_empty() {
        let ids: Vec<String> = users.iter().map(i64::to_string).collect();
        return Err(HttpError::conflict(format!(
            "experiment(s) {} train on dataset {id}: let them finish or cancel them first",
            ids.join(", ")
        )));
    }
    sqlx::query("DELETE FROM datasets WHERE id = ?1").bind(id).execute(&state.db).await?;
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
    let (Dataset::Upload, Some(id)) = (spec.data.dataset, spec.data.upload_id) else { return Ok(Vec::new()) };
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
