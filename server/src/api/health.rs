//! `GET /api/health`: liveness, version, live workers and queue length.

use axum::extract::State;
use axum::Json;
use distlab_common::{Health, VERSION};

use crate::api::error::HttpError;
use crate::{clock, store, AppState};

#[utoipa::path(
    get, path = "/health", tag = "operations",
    responses(
        (status = 200, body = distlab_common::Health),
    ),
)]
pub async fn health(State(state): State<AppState>) -> Result<Json<Health>, HttpError> {
    let cutoff = clock::before(clock::now(), state.config.worker_alive_window());
    let (workers, queued) = store::gauges::health_counts(&state.db, &cutoff).await?;
    Ok(Json(Health {
        status: "ok".into(),
        version: VERSION.into(),
        workers: u64::try_from(workers).unwrap_or(0),
        queued: u64::try_from(queued).unwrap_or(0),
    }))
}
