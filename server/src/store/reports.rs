//! What a worker reports about a run it holds, as SQL: the batches of events (the
//! attempt's start, metric points, log lines, rank traces), stored in short transactions
//! that renew the lease, and how the run ended (complete, fail).

use std::time::{Duration, SystemTime};

use distlab_common::{ExperimentSpec, ExperimentStatus, FieldError, LogLevel, MetricPoint, RunEvent, RunSummary};

use crate::clock;
use crate::store::changes::{Data, Writing};
use crate::store::leases::{holds_part, ownership, ownership_after, renew_held, Ownership};
use crate::store::logs::{insert_log, MAX_TEXT_CHARS};
use crate::store::queue::{requeued_or_failed, MAX_ATTEMPTS};
use crate::store::{self as db, traces, Db, StoreError};
use crate::text::truncate;

/// How many of experiment `id`'s steps, from step 0 on, have their metric point stored: the
/// first step without one. A new attempt resumes no later (`Lease::stored_steps`).
pub async fn stored_steps(db: &Db, id: i64) -> Result<u64, StoreError> {
    let steps: Vec<i64> = sqlx::query_scalar("SELECT step FROM metrics WHERE experiment_id = $1 ORDER BY step")
        .bind(id)
        .fetch_all(db)
        .await?;
    let contiguous = steps.iter().zip(0i64..).take_while(|(step, expected)| **step == *expected).count();
    Ok(contiguous as u64)
}

/// An attempt of experiment `id` starts at `from_step`: the metrics an earlier attempt
/// reported from there on are deleted (this attempt reports them again) and counted as
/// lost work. Only the first report counts: a batch the worker sends again (its answer was
/// lost) must not delete the metrics this attempt has reported since.
async fn start_attempt(tx: &mut sqlx::AnyConnection, id: i64, from_step: u64) -> Result<(), StoreError> {
    let attempt: Option<i64> = sqlx::query_scalar(
        "SELECT a.attempt FROM attempts a JOIN experiments e ON e.id = a.experiment_id AND e.attempt = a.attempt \
         WHERE a.experiment_id = $1 AND a.from_step IS NULL",
    )
    .bind(id)
    .fetch_optional(&mut *tx)
    .await?;
    let Some(attempt) = attempt else { return Ok(()) };
    let from_step = i64::try_from(from_step).unwrap_or(i64::MAX);
    let lost = sqlx::query("DELETE FROM metrics WHERE experiment_id = $1 AND step >= $2")
        .bind(id)
        .bind(from_step)
        .execute(&mut *tx)
        .await?
        .rows_affected();
    sqlx::query("UPDATE attempts SET from_step = $1, lost_steps = $2 WHERE experiment_id = $3 AND attempt = $4")
        .bind(from_step)
        .bind(i64::try_from(lost).unwrap_or(i64::MAX))
        .bind(id)
        .bind(attempt)
        .execute(&mut *tx)
        .await?;
    Ok(())
}

/// What became of an event batch.
#[derive(Debug, Clone, PartialEq)]
pub enum Stored {
    /// Stored and the lease renewed; `log_ids` are the ids of the batch's log lines, in order.
    Held { log_ids: Vec<i64> },
    /// Nothing stored: the worker does not hold the lease (cancelled, lost, unknown).
    NotHeld(Ownership),
    /// Nothing stored: traces that cannot belong to this experiment (see `traces::check`).
    Invalid(Vec<FieldError>),
}

/// Events stored in one transaction at most: a worker's batch may hold 100,000 points
/// (16 MiB), and one transaction for all of them would hold SQLite's write lock for
/// seconds, with every submission and lease waiting behind it. A trace (one row, but up to
/// megabytes) counts as this many on its own.
pub const EVENTS_PER_TRANSACTION: usize = 500;

/// Stores a batch of events (metrics overwrite the same step of an earlier attempt, traces
/// the same rank's earlier trace) and renews the lease, in transactions of at most
/// [`EVENTS_PER_TRANSACTION`] events, in order; nothing is stored unless the worker holds
/// the lease and every trace fits the experiment's world. (A lease that ends between two
/// transactions keeps what the earlier ones stored: the points of steps the run did.)
pub async fn store_events(
    db: &Db,
    worker_id: i64,
    id: i64,
    events: &[RunEvent],
    lease: Duration,
    now: SystemTime,
) -> Result<Stored, StoreError> {
    let at = clock::rfc3339(now);
    let mut log_ids = Vec::new();
    let mut rest = events;
    let mut first = true;
    while first || !rest.is_empty() {
        let mut weight = 0;
        let take = rest
            .iter()
            .take_while(|e| {
                weight += if matches!(e, RunEvent::Trace(_)) { EVENTS_PER_TRANSACTION } else { 1 };
                weight <= EVENTS_PER_TRANSACTION
            })
            .count()
            .max(rest.len().min(1));
        let (chunk, later) = rest.split_at(take);
        // (a turn per transaction: other writers get theirs between two)
        let _writing = Writing::to(db, Data::Experiments);
        let _turn = db::write_turn().await;
        let mut tx = db.begin().await?;
        let Some(spec) = renew_held(&mut tx, worker_id, id, lease, now).await? else {
            tx.rollback().await?;
            return Ok(Stored::NotHeld(ownership(db, worker_id, id).await?));
        };
        if first && events.iter().any(|e| matches!(e, RunEvent::Trace(_))) {
            let spec: ExperimentSpec = serde_json::from_str(&spec).map_err(|e| sqlx::Error::Decode(Box::new(e)))?;
            let problems = traces::check(events, &spec);
            if !problems.is_empty() {
                tx.rollback().await?;
                return Ok(Stored::Invalid(problems));
            }
        }
        for event in chunk {
            match event {
                RunEvent::Start { from_step } => start_attempt(&mut tx, id, *from_step).await?,
                RunEvent::Metric(m) => insert_metric(&mut tx, id, m).await?,
                RunEvent::Log(line) => log_ids.push(insert_log(&mut tx, id, line.level, &line.message, &at).await?),
                RunEvent::Trace(trace) => traces::upsert(&mut tx, id, trace, &at).await?,
            }
        }
        tx.commit().await?;
        rest = later;
        first = false;
    }
    Ok(Stored::Held { log_ids })
}

async fn insert_metric(tx: &mut sqlx::AnyConnection, id: i64, m: &MetricPoint) -> Result<(), StoreError> {
    // ON CONFLICT ... DO UPDATE is the portable spelling of INSERT OR REPLACE (SQLite and Postgres).
    db::query_with_nullable_floats(
        "INSERT INTO metrics \
           (experiment_id, step, loss, lr, grad_norm, tokens_per_s, step_ms, loss_scale, skipped_steps, \
            expert_balance, expert_assignments, expert_dropped, logit_grad_zero_share, val_loss, fp8) \
         VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12, $13, $14, $15) \
         ON CONFLICT (experiment_id, step) DO UPDATE SET loss = excluded.loss, lr = excluded.lr, \
           grad_norm = excluded.grad_norm, tokens_per_s = excluded.tokens_per_s, step_ms = excluded.step_ms, \
           loss_scale = excluded.loss_scale, skipped_steps = excluded.skipped_steps, \
           expert_balance = excluded.expert_balance, expert_assignments = excluded.expert_assignments, \
           expert_dropped = excluded.expert_dropped, logit_grad_zero_share = excluded.logit_grad_zero_share, \
           val_loss = excluded.val_loss, fp8 = excluded.fp8",
    )
    .bind(id)
    .bind(i64::try_from(m.step).unwrap_or(i64::MAX))
    .bind(m.loss)
    .bind(m.lr)
    .bind(m.grad_norm)
    .bind(m.tokens_per_s)
    .bind(m.step_ms)
    .bind(m.loss_scale)
    .bind(m.skipped_steps.map(|n| i64::try_from(n).unwrap_or(i64::MAX)))
    .bind(m.experts.map(|e| e.balance))
    .bind(m.experts.map(|e| i64::try_from(e.assignments).unwrap_or(i64::MAX)))
    .bind(m.experts.map(|e| i64::try_from(e.dropped).unwrap_or(i64::MAX)))
    .bind(m.logit_grad_zero_share.filter(|s| (0.0..=1.0).contains(s)))
    .bind(m.val_loss.filter(|v| v.is_finite()))
    .bind(m.fp8.and_then(|f| serde_json::to_string(&f).ok()))
    .execute(tx)
    .await?;
    Ok(())
}

/// A running experiment held by `worker_id` succeeded.
pub async fn complete(
    db: &Db,
    worker_id: i64,
    id: i64,
    summary: &RunSummary,
    now: SystemTime,
) -> Result<Ownership, StoreError> {
    let _writing = Writing::to(db, Data::Experiments);
    let summary = serde_json::to_string(summary).map_err(|e| sqlx::Error::Encode(Box::new(e)))?;
    let done: Option<i64> = sqlx::query_scalar(
        "UPDATE experiments SET status = 'succeeded', summary = $1, error = NULL, finished_at = $2, lease_until = NULL \
         WHERE id = $3 AND worker_id = $4 AND status = 'running' RETURNING id",
    )
    .bind(summary)
    .bind(clock::rfc3339(now))
    .bind(id)
    .bind(worker_id)
    .fetch_optional(db)
    .await?;
    match done {
        Some(_) => Ok(Ownership::Held),
        None => ownership_after(db, worker_id, id, Some(ExperimentStatus::Succeeded)).await,
    }
}

/// How a worker says its run ended early.
#[derive(Clone, Copy, Debug)]
pub struct Failure<'a> {
    pub error: &'a str,
    /// It stopped after a person cancelled the experiment.
    pub cancelled: bool,
    /// Its ranks failed because another host of the run went away.
    pub lost_host: bool,
    /// The attempt it reports about (None: the current one).
    pub attempt: Option<i64>,
}

/// A running experiment held by `worker_id` (or a part of it) ended early; answers the
/// status it is in now, or why the report did not apply.
///
/// A cancel ends it as cancelled, an error as failed. A lost host sends it back to the
/// queue, like a lease that expires (failed after MAX_ATTEMPTS): the next attempt resumes
/// from the latest checkpoint. Because the host that went away may have failed for a
/// reason of its own, an error from any host of that attempt still fails the experiment
/// while it waits in the queue.
pub async fn fail(
    db: &Db,
    worker_id: i64,
    id: i64,
    failure: Failure<'_>,
    now: SystemTime,
) -> Result<Result<ExperimentStatus, Ownership>, StoreError> {
    // The worker holds the experiment (host 0) or a part of it, in the attempt reported on
    // (parameter `$k`).
    let held = |k: usize| format!("(worker_id = $1 OR {}) AND attempt = COALESCE(${k}, attempt)", holds_part(1));
    let at = clock::rfc3339(now);
    let error = truncate(failure.error, MAX_TEXT_CHARS);
    let _writing = Writing::to(db, Data::Experiments);
    let mut tx = db.begin().await?;
    let ended: Option<String> = if failure.cancelled {
        let sql = format!(
            "UPDATE experiments SET status = 'cancelled', error = NULL, finished_at = $2, lease_until = NULL \
             WHERE id = $3 AND status = 'running' AND {} RETURNING status",
            held(4)
        );
        let query = sqlx::query_scalar(&sql).bind(worker_id).bind(&at).bind(id).bind(failure.attempt);
        query.fetch_optional(&mut *tx).await?
    } else if failure.lost_host {
        let sql = format!(
            "UPDATE experiments SET {} WHERE id = $5 AND status = 'running' AND {} RETURNING status",
            requeued_or_failed(2, 3, 4),
            held(6)
        );
        let gave_up = format!("{error} (a host of the run went away {MAX_ATTEMPTS} times; giving up)");
        let ended: Option<String> = sqlx::query_scalar(&sql)
            .bind(worker_id)
            .bind(MAX_ATTEMPTS)
            .bind(truncate(&gave_up, MAX_TEXT_CHARS))
            .bind(&at)
            .bind(id)
            .bind(failure.attempt)
            .fetch_optional(&mut *tx)
            .await?;
        if ended.as_deref() == Some("queued") {
            let message = format!(
                "a host of the run went away, so the attempt ended: back in the queue, to resume from the latest \
                 checkpoint (worker {worker_id}: {error})"
            );
            insert_log(&mut tx, id, LogLevel::Warn, &message, &at).await?;
        }
        ended
    } else {
        let sql = format!(
            "UPDATE experiments SET status = 'failed', error = $2, finished_at = $3, lease_until = NULL \
             WHERE id = $4 AND ((status = 'running' AND {}) OR (status = 'queued' AND {} AND attempt = $5)) \
             RETURNING status",
            held(5),
            holds_part(1)
        );
        let query = sqlx::query_scalar(&sql).bind(worker_id).bind(&error).bind(&at).bind(id).bind(failure.attempt);
        query.fetch_optional(&mut *tx).await?
    };
    tx.commit().await?;
    if let Some(status) = ended.as_deref().and_then(ExperimentStatus::parse) {
        return Ok(Ok(status));
    }
    let reported = if failure.cancelled { None } else { Some(ExperimentStatus::Failed) };
    Ok(Err(ownership_after(db, worker_id, id, reported).await?))
}
