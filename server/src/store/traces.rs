//! Per-rank traces (timeline spans and collective steps, memory reports): the `traces`
//! table, one row per (experiment, rank) holding the latest `RankTrace` that rank reported,
//! as the JSON text the server itself wrote (so the trace endpoint splices the rows without
//! decoding them: a trace can be a few MB). What a trace must fit to be stored is here too.

use std::collections::BTreeMap;

use distlab_common::memory::RankMemoryReport;
use distlab_common::trace::RankTrace;
use distlab_common::{ExperimentSpec, FieldError, RunEvent};
use serde::Deserialize;

use crate::store::{corrupt, Db, StoreError};

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

/// Stores `trace` as its rank's trace of experiment `id`, replacing an earlier one.
pub async fn upsert(tx: &mut sqlx::AnyConnection, id: i64, trace: &RankTrace, at: &str) -> Result<(), StoreError> {
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

/// Every stored rank trace of experiment `id` as stored (JSON text), in rank order.
pub async fn stored_json(db: &Db, id: i64) -> Result<Vec<String>, StoreError> {
    Ok(sqlx::query_scalar("SELECT trace FROM traces WHERE experiment_id = $1 ORDER BY rank")
        .bind(id)
        .fetch_all(db)
        .await?)
}

/// Every stored rank trace of an experiment, in rank order.
pub async fn load(db: &Db, id: i64) -> Result<Vec<RankTrace>, StoreError> {
    let rows: Vec<(i64, String)> =
        sqlx::query_as("SELECT rank, trace FROM traces WHERE experiment_id = $1 ORDER BY rank")
            .bind(id)
            .fetch_all(db)
            .await?;
    rows.into_iter()
        .map(|(rank, json)| {
            serde_json::from_str(&json).map_err(|e| {
                corrupt("stored trace", format!("experiment {id} rank {rank} has an unreadable trace: {e}"))
            })
        })
        .collect()
}

/// The part of a stored `RankTrace` [`memory_reports`] reads (serde skips the rest).
#[derive(Deserialize)]
struct MemoryOnly {
    #[serde(default)]
    memory: Option<RankMemoryReport>,
}

/// The memory report of each rank of experiment `id` whose stored trace has one, by rank.
/// The traces are decoded only as far as their `memory`.
pub async fn memory_reports(db: &Db, id: i64) -> Result<BTreeMap<i64, RankMemoryReport>, StoreError> {
    let rows: Vec<(i64, String)> =
        sqlx::query_as("SELECT rank, trace FROM traces WHERE experiment_id = $1 ORDER BY rank")
            .bind(id)
            .fetch_all(db)
            .await?;
    let mut measured = BTreeMap::new();
    for (rank, json) in rows {
        let trace: MemoryOnly = serde_json::from_str(&json).map_err(|e| {
            corrupt("stored trace", format!("experiment {id} rank {rank} has an unreadable trace: {e}"))
        })?;
        if let Some(report) = trace.memory {
            measured.insert(rank, report);
        }
    }
    Ok(measured)
}

/// The step the latest attempt of experiment `id` began from (None: from the start, or no
/// attempt yet).
pub async fn last_attempt_from_step(db: &Db, id: i64) -> Result<Option<i64>, StoreError> {
    let from: Option<Option<i64>> =
        sqlx::query_scalar("SELECT from_step FROM attempts WHERE experiment_id = $1 ORDER BY attempt DESC LIMIT 1")
            .bind(id)
            .fetch_optional(db)
            .await?;
    Ok(from.flatten())
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
