//! `POST /api/plan`: the analytic planner's prediction for a spec of any size (a 70B model
//! on 1024 GPUs is fine): memory per rank by category, communication per collective,
//! pipeline bubble and FLOPs. Nothing is stored or run.
//!
//! The body is parsed exactly as `POST /api/experiments` parses it (400 when it is not
//! JSON, 422 naming the field for unknown fields and values). The server's run limits do
//! not apply; only specs that cannot exist at all (dp=0, tp not dividing heads, more
//! stages than layers, ...) are 422.

use axum::Json;
use distlab_common::planner::{self, Plan};
use distlab_common::ExperimentSpec;

use crate::error::HttpError;
use crate::extract::JsonBody;

pub async fn plan(JsonBody(body): JsonBody<serde_json::Value>) -> Result<Json<Plan>, HttpError> {
    let spec = ExperimentSpec::from_json_value(body).map_err(HttpError::invalid_spec)?;
    let plan = planner::plan(&spec).map_err(HttpError::invalid_spec)?;
    tracing::debug!(name = %spec.name, world_size = plan.world_size, params = plan.param_count, "planned");
    Ok(Json(plan))
}
