//! `GET /api/health`: liveness, version, live workers and queue length.

use axum::extract::State;
use axum::Json;
use distlab_common::{Health, VERSION};

use crate::clock;
use crate::error::HttpError;
use crate::AppState;

#[utoipa::path(
    get, path = "/health", tag = "operations",
    responses(
        (status = 200, body = distlab_common::Health),
    ),
)]
pub async fn health(State(state): State<AppState>) -> Result<Json<Health>, HttpError> {
    let cutoff = clock::before(clock::now(), state.config.worker_alive_window());
    let workers: i64 = sqlx::query_scalar("SELECT COUNT(*) FROM workers WHERE last_seen >= $1")
        .bind(cutoff)
        .fetch_one(&state.db)
        .await?;
    let queued: i64 =
        sqlx::query_scalar("SELECT COUNT(*) FROM experiments WHERE status = 'queued'").fetch_one(&state.db).await?;
    Ok(Json(Health {
        status: "ok".into(),
        version: VERSION.into(),
        workers: u64::try_from(workers).unwrap_or(0),
        queued: u64::try_from(queued).unwrap_or(0),
    }))
}
