//! Experiments as the API shows them: the `experiments` table read into `ExperimentView`s
//! (with the steps done, from `metrics`), their metric points, log lines and attempts, the
//! list's pages, and a person's cancel. (Submitting, leasing and ending runs: `queue.rs`.)

use distlab_common::{
    AttemptView, ExperimentSpec, ExperimentStatus, ExperimentView, ExpertMetrics, LogLevel, LogLine, MetricPoint,
    RunSummary,
};

use crate::clock;
use crate::store::changes::{Data, Writing};
use crate::store::logs::level_from_name;
use crate::store::{corrupt, Db, StoreError};

crate::store::row! {
    struct ExperimentRow {
        id: i64,
        name: String,
        owner: String,
        status: String,
        spec: String,
        attempt: i64,
        created_at: String,
        started_at: Option<String>,
        finished_at: Option<String>,
        error: Option<String>,
        summary: Option<String>,
        steps_done: i64,
    }
}

const SELECT_VIEW: &str = "SELECT e.id, e.name, e.owner, e.status, e.spec, e.attempt, e.created_at, e.started_at, \
     e.finished_at, e.error, e.summary, \
     (SELECT COALESCE(MAX(m.step) + 1, 0) FROM metrics m WHERE m.experiment_id = e.id) AS steps_done \
     FROM experiments e";

impl ExperimentRow {
    fn into_view(self) -> Result<ExperimentView, StoreError> {
        let status = ExperimentStatus::parse(&self.status).ok_or_else(|| {
            corrupt("stored experiment", format!("experiment {} has status {:?}", self.id, self.status))
        })?;
        let spec: ExperimentSpec = serde_json::from_str(&self.spec)
            .map_err(|e| corrupt("stored experiment", format!("experiment {} has an unreadable spec: {e}", self.id)))?;
        let summary = match self.summary {
            Some(text) => Some(serde_json::from_str::<RunSummary>(&text).map_err(|e| {
                corrupt("stored experiment", format!("experiment {} has an unreadable summary: {e}", self.id))
            })?),
            None => None,
        };
        Ok(ExperimentView {
            id: self.id,
            name: self.name,
            owner: self.owner,
            status,
            spec,
            created_at: self.created_at,
            started_at: self.started_at,
            finished_at: self.finished_at,
            error: self.error,
            summary,
            attempt: self.attempt,
            steps_done: u64::try_from(self.steps_done).unwrap_or(0),
        })
    }
}

/// One experiment, or None when there is no such id.
pub async fn load(db: &Db, id: i64) -> Result<Option<ExperimentView>, StoreError> {
    let sql = format!("{SELECT_VIEW} WHERE e.id = $1");
    let row = sqlx::query_as::<_, ExperimentRow>(&sql).bind(id).fetch_optional(db).await?;
    row.map(ExperimentRow::into_view).transpose()
}

/// The newest `limit` succeeded experiments (of everyone: results are shared), newest first.
pub async fn recent_succeeded(db: &Db, limit: i64) -> Result<Vec<ExperimentView>, StoreError> {
    let sql = format!("{SELECT_VIEW} WHERE e.status = 'succeeded' ORDER BY e.id DESC LIMIT $1");
    let rows = sqlx::query_as::<_, ExperimentRow>(&sql).bind(limit).fetch_all(db).await?;
    rows.into_iter().map(ExperimentRow::into_view).collect()
}

crate::store::row! {
    struct MetricRow {
        step: i64,
        loss: f64,
        lr: f64,
        grad_norm: f64,
        tokens_per_s: f64,
        step_ms: f64,
        loss_scale: Option<f64>,
        skipped_steps: Option<i64>,
        expert_balance: Option<f64>,
        expert_assignments: Option<i64>,
        expert_dropped: Option<i64>,
        logit_grad_zero_share: Option<f64>,
        val_loss: Option<f64>,
        fp8: Option<String>,
    }
}

/// Every stored metric point of an experiment, ordered by step.
pub async fn load_metrics(db: &Db, id: i64) -> Result<Vec<MetricPoint>, StoreError> {
    let rows = sqlx::query_as::<_, MetricRow>(
        "SELECT step, loss, lr, grad_norm, tokens_per_s, step_ms, loss_scale, skipped_steps, expert_balance, \
         expert_assignments, expert_dropped, logit_grad_zero_share, val_loss, fp8 FROM metrics \
         WHERE experiment_id = $1 ORDER BY step",
    )
    .bind(id)
    .fetch_all(db)
    .await?;
    Ok(rows
        .into_iter()
        .map(|r| MetricPoint {
            step: u64::try_from(r.step).unwrap_or(0),
            loss: r.loss,
            lr: r.lr,
            grad_norm: r.grad_norm,
            tokens_per_s: r.tokens_per_s,
            step_ms: r.step_ms,
            loss_scale: r.loss_scale,
            skipped_steps: r.skipped_steps.and_then(|n| u64::try_from(n).ok()),
            // (keyed on the count: SQLite keeps a diverged step's NaN balance as NULL)
            experts: r.expert_assignments.and_then(|n| u64::try_from(n).ok()).map(|assignments| ExpertMetrics {
                balance: r.expert_balance.unwrap_or(f64::NAN),
                assignments,
                dropped: r.expert_dropped.and_then(|n| u64::try_from(n).ok()).unwrap_or(0),
            }),
            logit_grad_zero_share: r.logit_grad_zero_share,
            val_loss: r.val_loss,
            fp8: r.fp8.and_then(|json| serde_json::from_str(&json).ok()),
        })
        .collect())
}

crate::store::row! {
    struct LogRow {
        id: i64,
        level: String,
        message: String,
    }
}

/// A stored log line and its id (ids grow in the order lines were stored).
#[derive(Clone, Debug, PartialEq)]
pub struct StoredLog {
    pub id: i64,
    pub line: LogLine,
}

/// The last `limit` stored log lines of an experiment, oldest first.
pub async fn load_recent_logs(db: &Db, id: i64, limit: i64) -> Result<Vec<StoredLog>, StoreError> {
    let rows = sqlx::query_as::<_, LogRow>(
        "SELECT id, level, message FROM \
           (SELECT id, level, message FROM logs WHERE experiment_id = $1 ORDER BY id DESC LIMIT $2) AS recent \
         ORDER BY id",
    )
    .bind(id)
    .bind(limit)
    .fetch_all(db)
    .await?;
    Ok(rows
        .into_iter()
        .map(|r| StoredLog {
            id: r.id,
            line: LogLine { level: level_from_name(&r.level).unwrap_or(LogLevel::Info), message: r.message },
        })
        .collect())
}

/// Stored log line `log_id`, if there is one.
pub async fn log_line(db: &Db, log_id: i64) -> Result<Option<LogLine>, StoreError> {
    let row: Option<(String, String)> =
        sqlx::query_as("SELECT level, message FROM logs WHERE id = $1").bind(log_id).fetch_optional(db).await?;
    Ok(row.map(|(level, message)| LogLine { level: level_from_name(&level).unwrap_or(LogLevel::Info), message }))
}

/// Whether there is an experiment `id`.
pub async fn exists(db: &Db, id: i64) -> Result<bool, StoreError> {
    let exists: Option<i64> =
        sqlx::query_scalar("SELECT id FROM experiments WHERE id = $1").bind(id).fetch_optional(db).await?;
    Ok(exists.is_some())
}

/// Experiment `id`'s spec, or None when there is no such id.
pub async fn spec(db: &Db, id: i64) -> Result<Option<ExperimentSpec>, StoreError> {
    let spec_json: Option<String> =
        sqlx::query_scalar("SELECT spec FROM experiments WHERE id = $1").bind(id).fetch_optional(db).await?;
    spec_json
        .map(|json| {
            serde_json::from_str(&json)
                .map_err(|e| corrupt("stored experiment", format!("experiment {id} has an unreadable spec: {e}")))
        })
        .transpose()
}

/// A page of experiments, newest first: `limit` of them from `offset` on, of one status
/// (None: all), and how many there are of that status in all.
pub async fn page(
    db: &Db,
    status: Option<ExperimentStatus>,
    limit: i64,
    offset: i64,
) -> Result<(Vec<ExperimentView>, i64), StoreError> {
    let status_str = status.map(ExperimentStatus::as_str);
    let sql = format!("{SELECT_VIEW} WHERE ($1 IS NULL OR e.status = $1) ORDER BY e.id DESC LIMIT $2 OFFSET $3");
    let rows = sqlx::query_as::<_, ExperimentRow>(&sql).bind(status_str).bind(limit).bind(offset).fetch_all(db).await?;
    let total: i64 = sqlx::query_scalar("SELECT COUNT(*) FROM experiments WHERE $1 IS NULL OR status = $1")
        .bind(status_str)
        .fetch_one(db)
        .await?;
    let experiments = rows.into_iter().map(ExperimentRow::into_view).collect::<Result<Vec<_>, _>>()?;
    Ok((experiments, total))
}

crate::store::row! {
    struct AttemptRow {
        attempt: i64,
        worker: Option<String>,
        started_at: String,
        from_step: Option<i64>,
        lost_steps: i64,
    }
}

/// Every lease of experiment `id`, in order: where each began and the work it had to do
/// again.
pub async fn attempts(db: &Db, id: i64) -> Result<Vec<AttemptView>, StoreError> {
    let rows = sqlx::query_as::<_, AttemptRow>(
        "SELECT a.attempt, w.name AS worker, a.started_at, a.from_step, a.lost_steps \
         FROM attempts a LEFT JOIN workers w ON w.id = a.worker_id WHERE a.experiment_id = $1 ORDER BY a.attempt",
    )
    .bind(id)
    .fetch_all(db)
    .await?;
    Ok(rows
        .into_iter()
        .map(|r| AttemptView {
            attempt: r.attempt,
            worker: r.worker,
            started_at: r.started_at,
            from_step: r.from_step.and_then(|s| u64::try_from(s).ok()),
            lost_steps: u64::try_from(r.lost_steps).unwrap_or(0),
        })
        .collect())
}

/// A person cancels queued or running experiment `id` at `now`: None when it is neither,
/// else the worker that was running it (None: it was queued).
pub async fn cancel(db: &Db, id: i64, now: std::time::SystemTime) -> Result<Option<Option<i64>>, StoreError> {
    let _writing = Writing::to(db, Data::Experiments);
    Ok(sqlx::query_scalar(
        "UPDATE experiments SET status = 'cancelled', cancel_requested = TRUE, finished_at = $1, lease_until = NULL \
         WHERE id = $2 AND status IN ('queued', 'running') RETURNING worker_id",
    )
    .bind(clock::rfc3339(now))
    .bind(id)
    .fetch_optional(db)
    .await?)
}

/// The size of experiment `id`'s stored model file: what its owner's share of the disk
/// counts for it from now on, in place of the plan's.
pub async fn record_model_bytes(db: &Db, id: i64, bytes: u64) -> Result<(), StoreError> {
    sqlx::query("UPDATE experiments SET disk_model_bytes = $1 WHERE id = $2")
        .bind(i64::try_from(bytes).unwrap_or(i64::MAX))
        .bind(id)
        .execute(db)
        .await?;
    Ok(())
}

/// Deletes finished experiment `id` with everything stored of it (metrics, logs, traces,
/// attempts); false when it is not finished (or not there).
pub async fn delete_finished(db: &Db, id: i64) -> Result<bool, StoreError> {
    let _writing = Writing::to(db, Data::Experiments);
    let done = sqlx::query("DELETE FROM experiments WHERE id = $1 AND status IN ('succeeded', 'failed', 'cancelled')")
        .bind(id)
        .execute(db)
        .await?;
    Ok(done.rows_affected() == 1)
}
