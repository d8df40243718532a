//! `GET /api/compare?ids=1,2,3`: 2 to 6 experiments side by side (`CompareView`: each
//! run's metrics and summary row, the config diff, the equivalence verdicts, seed bands).
//! `&format=csv` exports the metrics (`&table=summary`: the summary table) as a file.

use axum::extract::{Query, State};
use axum::http::header;
use axum::response::{IntoResponse, Response};
use axum::Json;
use distlab_common::compare::{self, CompareView, ComparedRun};
use distlab_common::planner;
use distlab_common::ExperimentView;
use serde::Deserialize;

use crate::api::error::HttpError;
use crate::text::truncate;
use crate::{store, AppState};

#[derive(Deserialize)]
pub struct CompareQuery {
    ids: Option<String>,
    format: Option<String>,
    table: Option<String>,
}

#[utoipa::path(
    get, path = "/compare", operation_id = "compare_experiments", tag = "experiments",
    params(("ids" = String, Query, description = "experiment ids, comma-separated"), ("format" = Option<String>, Query, description = "json (default) or csv"), ("table" = Option<String>, Query, description = "with format=csv: which table")),
    responses(
        (status = 200, body = distlab_common::compare::CompareView),
        (status = 400, body = distlab_common::ApiError),
        (status = 404, body = distlab_common::ApiError),
    ),
)]
pub async fn compare(State(state): State<AppState>, Query(q): Query<CompareQuery>) -> Result<Response, HttpError> {
    let ids = compare::parse_ids(q.ids.as_deref().unwrap_or("")).map_err(|e| HttpError::bad_field("ids", e))?;
    let export = Export::parse(q.format.as_deref(), q.table.as_deref())?;
    let view = build(&state, &ids).await?;
    let stamp = ids.iter().map(i64::to_string).collect::<Vec<_>>().join("-");
    let file = |name: &str, body: String, kind: &'static str| {
        let disposition = format!("attachment; filename=\"distlab-compare-{stamp}-{name}\"");
        ([(header::CONTENT_TYPE, kind.to_string()), (header::CONTENT_DISPOSITION, disposition)], body).into_response()
    };
    Ok(match export {
        Export::View => Json(view).into_response(),
        Export::Json => {
            let body = serde_json::to_string_pretty(&view).map_err(|e| HttpError::internal("encoding", e))?;
            file("view.json", body, "application/json")
        }
        Export::MetricsCsv => file("metrics.csv", compare::metrics_csv(&view), "text/csv; charset=utf-8"),
        Export::SummaryCsv => file("summary.csv", compare::summary_csv(&view), "text/csv; charset=utf-8"),
    })
}

enum Export {
    View,
    Json,
    MetricsCsv,
    SummaryCsv,
}

impl Export {
    fn parse(format: Option<&str>, table: Option<&str>) -> Result<Export, HttpError> {
        match (format.unwrap_or(""), table.unwrap_or("")) {
            ("", "") => Ok(Export::View),
            ("json", "") => Ok(Export::Json),
            ("csv", "" | "metrics") => Ok(Export::MetricsCsv),
            ("csv", "summary") => Ok(Export::SummaryCsv),
            ("csv", other) => Err(HttpError::bad_field(
                "table",
                format!("unknown table '{}'; use metrics or summary", truncate(other, 40)),
            )),
            (_, t) if !t.is_empty() => Err(HttpError::bad_field("table", "table goes with format=csv")),
            (other, _) => Err(HttpError::bad_field(
                "format",
                format!("unknown format '{}'; use json or csv", truncate(other, 40)),
            )),
        }
    }
}

/// Loads every run (404 naming the first missing id) and builds the view.
async fn build(state: &AppState, ids: &[i64]) -> Result<CompareView, HttpError> {
    let mut runs = Vec::with_capacity(ids.len());
    let mut plans = Vec::with_capacity(ids.len());
    for &id in ids {
        let experiment = store::experiments::load(&state.db, id).await?.ok_or_else(|| HttpError::no_experiment(id))?;
        let metrics = store::experiments::load_metrics(&state.db, id).await?;
        let ranks = store::traces::load(&state.db, id).await?;
        let plan = planner::plan(&experiment.spec).ok();
        let traced = traced_steps(state, &experiment).await?;
        let stats = compare::run_stats(&experiment, &metrics, &ranks, traced, plan.as_ref());
        runs.push(ComparedRun { experiment, metrics, stats });
        plans.push(plan);
    }
    let specs: Vec<_> = runs.iter().zip(&plans).map(|(r, p)| (&r.experiment.spec, p.as_ref())).collect();
    let config = compare::config_rows(&specs);
    let series: Vec<_> = runs.iter().map(|r| (r.experiment.id, &r.experiment.spec, r.metrics.as_slice())).collect();
    let equivalence = series[1..].iter().map(|other| compare::equivalence(series[0], *other)).collect();
    let seed_bands = compare::seed_bands(&series);
    Ok(CompareView { runs, config, equivalence, seed_bands })
}

/// Steps the ranks' traces cover: a resumed run's ranks were restarted (and their counters
/// with them) at the checkpoint the last attempt began from.
pub async fn traced_steps(state: &AppState, experiment: &ExperimentView) -> Result<u64, HttpError> {
    let from = store::traces::last_attempt_from_step(&state.db, experiment.id).await?;
    let from = from.and_then(|s| u64::try_from(s).ok()).unwrap_or(0);
    let steps = experiment.summary.as_ref().map_or(experiment.steps_done, |s| s.steps);
    Ok(steps.saturating_sub(from))
}
