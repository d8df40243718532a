//! `POST /api/plan` and `POST /api/plan/layouts`: the analytic planner's prediction for a spec of any size (a 70B model
//! on 1024 GPUs is fine): memory per rank by category, communication per collective,
//! pipeline bubble and FLOPs. Nothing is stored or run.
//!
//! `/plan`'s body is parsed exactly as `POST /api/experiments` parses it (400 when it is
//! not JSON, 422 naming the field for unknown fields and values). The server's run limits
//! do not apply; only specs that cannot exist at all (dp=0, tp not dividing heads, more
//! stages than layers, ...) are 422. `/plan/layouts` answers 400 for a body that is not a
//! search request (naming the field), 422 for one that cannot be searched.

use std::sync::Arc;
use std::time::Duration;

use axum::Json;
use distlab_common::layout_search::{self, SearchRequest, SearchResult};
use distlab_common::planner::{self, Plan};
use distlab_common::ExperimentSpec;
use tokio::sync::Semaphore;

use crate::api::error::HttpError;
use crate::api::extract::JsonBody;

#[utoipa::path(
    post, path = "/plan", operation_id = "plan", tag = "planner",
    request_body = distlab_common::ExperimentSpec,
    responses(
        (status = 200, body = distlab_common::planner::Plan),
        (status = 400, body = distlab_common::ApiError),
        (status = 422, description = "names each field that is wrong", body = distlab_common::ApiError),
    ),
)]
pub async fn plan(JsonBody(body): JsonBody<serde_json::Value>) -> Result<Json<Plan>, HttpError> {
    let spec = ExperimentSpec::from_json_value(body).map_err(HttpError::invalid_spec)?;
    let plan = planner::plan(&spec).map_err(HttpError::invalid_spec)?;
    tracing::debug!(name = %spec.name, world_size = plan.world_size, params = plan.param_count, "planned");
    Ok(Json(plan))
}

/// How long a layout search waits for the one before it (429 after).
const SEARCH_QUEUE_WAIT: Duration = Duration::from_secs(10);

/// `POST /api/plan/layouts`: the layout search ([`layout_search::search`]) for a model, a
/// cluster of `cluster.gpus` GPUs and a global batch: the ten fastest layouts that fit,
/// why each is slower than the first, and the layouts that could not run, by reason.
/// 422 names the fields of a request that cannot be searched.
#[utoipa::path(
    post, path = "/plan/layouts", operation_id = "search_layouts", tag = "planner",
    request_body = distlab_common::layout_search::SearchRequest,
    responses(
        (status = 200, body = distlab_common::layout_search::SearchResult),
        (status = 400, body = distlab_common::ApiError),
        (status = 422, description = "names each field that is wrong", body = distlab_common::ApiError),
    ),
)]
pub async fn layouts(JsonBody(request): JsonBody<SearchRequest>) -> Result<Json<SearchResult>, HttpError> {
    // One search at a time (each is bounded: `MAX_PLANNED_STAGES_PER_SEARCH`); the others
    // wait their turn a while.
    static ONE_AT_A_TIME: std::sync::OnceLock<Arc<Semaphore>> = std::sync::OnceLock::new();
    let turn = ONE_AT_A_TIME.get_or_init(|| Arc::new(Semaphore::new(1))).clone();
    let permit = tokio::time::timeout(SEARCH_QUEUE_WAIT, turn.acquire_owned())
        .await
        .map_err(|_| HttpError::too_many_requests("other layout searches are running: try again in a moment"))?
        .map_err(|e| HttpError::internal("the layout search's turn", e))?;
    // Thousands of plans: a blocking thread's work, not the async runtime's (it holds the
    // turn until it ends, even if the request gave up).
    let result = tokio::task::spawn_blocking(move || {
        let _permit = permit;
        layout_search::search(&request)
    })
    .await
    .map_err(|e| HttpError::internal("the layout search", e))?
    .map_err(HttpError::invalid_spec)?;
    tracing::debug!(examined = result.examined, fitting = result.fitting, "layouts searched");
    Ok(Json(result))
}
