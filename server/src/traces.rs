//! Per-rank traces (timeline spans and collective steps): checked and stored from worker
//! event batches, served by `GET /api/experiments/{id}/trace`.
//!
//! One row per (experiment, rank) holds the latest `RankTrace` that rank reported, as the
//! JSON text the server itself wrote, so the endpoint splices the rows into one
//! `ExperimentTrace` without decoding them (a trace can be a few MB).

use axum::extract::{Path, State};
use axum::http::header;
use axum::response::{IntoResponse, Response};
use distlab_common::trace::RankTrace;
use distlab_common::{ExperimentSpec, FieldError, RunEvent};

use crate::error::HttpError;
use crate::experiments;
use crate::extract::parse_id;
use crate::AppState;

/// Every trace in `events` that cannot belong to an experiment of `spec`: a rank outside
/// its world, or a world size that differs from dp * tp * pp. Fields are named as in the
/// event batch body (`events[3].rank`).
pub fn check(events: &[RunEvent], spec: &ExperimentSpec) -> Vec<FieldError> {
    let world = spec.world_size();
    let p = &spec.parallel;
    let shape = format!("dp={} x tp={} x pp={}", p.dp, p.tp, p.pp);
    let mut problems = Vec::new();
    for (i, event) in events.iter().enumerate() {
        let RunEvent::Trace(trace) = event else { continue };
        let rank = trace.rank as usize;
        if rank >= world {
            problems.push(FieldError::new(
                format!("events[{i}].rank"),
                format!(
                    "a trace for rank {rank}, but this experiment has {world} rank{} ({shape}): ranks are 0 to {}",
                    if world == 1 { "" } else { "s" },
                    world.saturating_sub(1)
                ),
            ));
        }
        if trace.world as usize != world {
            problems.push(FieldError::new(
                format!("events[{i}].world"),
                format!("the trace says world={}, but this experiment's world size is {world} ({shape})", trace.world),
            ));
        }
    }
    problems
}

/// The 422 answer for an event batch with traces that `check` refused.
pub fn invalid_batch(problems: Vec<FieldError>) -> HttpError {
    let error = match problems.as_slice() {
        [one] => format!("the event batch was not stored: {one}"),
        many => format!("the event batch was not stored: {} of its traces do not fit this experiment", many.len()),
    };
    HttpError::with_fields(axum::http::StatusCode::UNPROCESSABLE_ENTITY, error, problems)
}

/// Stores `trace` as its rank's trace of experiment `id`, replacing an earlier one.
pub async fn upsert(tx: &mut sqlx::AnyConnection, id: i64, trace: &RankTrace, at: &str) -> Result<(), sqlx::Error> {
    let json = serde_json::to_string(trace).map_err(|e| sqlx::Error::Encode(Box::new(e)))?;
    sqlx::query(
        "INSERT INTO traces (experiment_id, rank, trace, updated_at) VALUES ($1, $2, $3, $4) \
         ON CONFLICT (experiment_id, rank) DO UPDATE SET trace = excluded.trace, updated_at = excluded.updated_at",
    )
    .bind(id)
    .bind(i64::from(trace.rank))
    .bind(json)
    .bind(at)
    .execute(tx)
    .await?;
    Ok(())
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
    let exists: Option<i64> =
        sqlx::query_scalar("SELECT id FROM experiments WHERE id = $1").bind(id).fetch_optional(&state.db).await?;
    if exists.is_none() {
        return Err(experiments::not_found(id));
    }
    let rows: Vec<String> = sqlx::query_scalar("SELECT trace FROM traces WHERE experiment_id = $1 ORDER BY rank")
        .bind(id)
        .fetch_all(&state.db)
        .await?;
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

#[cfg(test)]
mod tests {
    use super::*;
    use distlab_common::{LogLevel, LogLine};

    fn trace(rank: u32, world: u32) -> RunEvent {
        RunEvent::Trace(RankTrace { rank, world, ..RankTrace::default() })
    }

    #[test]
    fn ranks_must_lie_inside_the_world() {
        let mut spec = ExperimentSpec::default();
        spec.parallel.dp = 2;
        spec.parallel.tp = 1;
        spec.parallel.pp = 2;
        let log = RunEvent::Log(LogLine { level: LogLevel::Info, message: "x".into() });
        assert!(check(&[trace(0, 4), log.clone(), trace(3, 4)], &spec).is_empty());

        let problems = check(&[log, trace(4, 4), trace(1, 2)], &spec);
        let fields: Vec<&str> = problems.iter().map(|p| p.field.as_str()).collect();
        assert_eq!(fields, vec!["events[1].rank", "events[2].world"]);
        assert!(problems[0].message.contains("ranks are 0 to 3"), "{}", problems[0].message);
        assert!(problems[0].message.contains("dp=2 x tp=1 x pp=2"), "{}", problems[0].message);
    }
}
