//! Leases of running experiments: what a lease hands a worker, whether a worker still
//! holds what it reports about (the whole run, or on a run across workers its part), and
//! renewing the lease of either. `queue.rs` hands leases out, `parts.rs` the parts of runs
//! across workers, `reports.rs` takes what workers report about what they hold.

use std::time::{Duration, SystemTime};

use distlab_common::{ExperimentStatus, Placement};
use sqlx::AnyConnection;

use crate::clock;
use crate::store::{Db, StoreError};

/// What a lease hands to a worker.
#[derive(Debug)]
pub struct Leased {
    pub id: i64,
    pub spec: String,
    pub attempt: i64,
    /// Set when the run spans several workers.
    pub placement: Option<Placement>,
}

/// Whether a worker still holds an experiment it reports about.
#[derive(Debug, Clone, PartialEq)]
pub enum Ownership {
    /// Running and leased to this worker.
    Held,
    /// A person cancelled it while this worker ran it: the worker should stop.
    Cancelled,
    /// This worker already reported that it ended so (a retried report whose first answer
    /// was lost): acknowledged again, changing nothing.
    AlreadyReported,
    /// It is no longer this worker's (re-queued after an expired lease, leased to another
    /// worker, or finished): 409.
    Lost(ExperimentStatus),
    NotFound,
}

crate::store::row! {
    struct OwnerRow {
        status: String,
        worker_id: Option<i64>,
        /// 1 when the worker holds a part of the current attempt (a run across workers).
        member: i64,
    }
}

/// Why a guarded update of experiment `id` by `worker_id` did not apply.
pub async fn ownership(db: &Db, worker_id: i64, id: i64) -> Result<Ownership, StoreError> {
    ownership_after(db, worker_id, id, None).await
}

/// [`ownership`], where `worker_id` is reporting that the experiment ended as `reported`:
/// when it did end so in that worker's hands, the report is a retry (`AlreadyReported`).
/// The worker of host 0 holds the experiment, the other hosts' workers their parts.
pub(crate) async fn ownership_after(
    db: &Db,
    worker_id: i64,
    id: i64,
    reported: Option<ExperimentStatus>,
) -> Result<Ownership, StoreError> {
    let sql = format!(
        "SELECT status, worker_id, CASE WHEN {} THEN 1 ELSE 0 END AS member FROM experiments WHERE id = $1",
        holds_part(2)
    );
    let row = sqlx::query_as::<_, OwnerRow>(&sql).bind(id).bind(worker_id).fetch_optional(db).await?;
    Ok(match row {
        None => Ownership::NotFound,
        Some(r) => {
            let mine = r.worker_id == Some(worker_id) || r.member != 0;
            let status = ExperimentStatus::parse(&r.status).unwrap_or(ExperimentStatus::Failed);
            match status {
                ExperimentStatus::Running if mine => Ownership::Held,
                ended if mine && Some(ended) == reported => Ownership::AlreadyReported,
                ExperimentStatus::Cancelled if mine => Ownership::Cancelled,
                other => Ownership::Lost(other),
            }
        }
    })
}

/// Extends the lease of a running experiment held by `worker_id` (host 0), or of the part
/// it runs.
pub async fn renew(
    db: &Db,
    worker_id: i64,
    id: i64,
    lease: Duration,
    now: SystemTime,
) -> Result<Ownership, StoreError> {
    let mut tx = db.begin().await?;
    let renewed = renew_held(&mut tx, worker_id, id, lease, now).await?.is_some();
    tx.commit().await?;
    match renewed {
        true => Ok(Ownership::Held),
        false => ownership(db, worker_id, id).await,
    }
}

/// Renews `worker_id`'s lease of running experiment `id` (or its part of it) and answers
/// the experiment's spec; None when it holds neither.
pub(crate) async fn renew_held(
    tx: &mut AnyConnection,
    worker_id: i64,
    id: i64,
    lease: Duration,
    now: SystemTime,
) -> Result<Option<String>, StoreError> {
    let renewed: Option<String> = sqlx::query_scalar(
        "UPDATE experiments SET lease_until = $1 WHERE id = $2 AND worker_id = $3 AND status = 'running' \
         RETURNING spec",
    )
    .bind(clock::after(now, lease))
    .bind(id)
    .bind(worker_id)
    .fetch_optional(&mut *tx)
    .await?;
    if renewed.is_some() || !renew_part(tx, worker_id, id, lease, now).await? {
        return Ok(renewed);
    }
    Ok(sqlx::query_scalar("SELECT spec FROM experiments WHERE id = $1").bind(id).fetch_optional(&mut *tx).await?)
}

/// The SQL condition "worker $W holds a part of the experiment's current attempt", for a
/// query on `experiments` where `$W` is parameter `param`.
pub fn holds_part(param: usize) -> String {
    format!(
        "EXISTS (SELECT 1 FROM parts p WHERE p.experiment_id = experiments.id AND p.attempt = experiments.attempt \
         AND p.worker_id = ${param})"
    )
}

/// Renews `worker_id`'s part of running experiment `id`; false when it holds none.
pub async fn renew_part(
    tx: &mut AnyConnection,
    worker_id: i64,
    id: i64,
    lease: Duration,
    now: SystemTime,
) -> Result<bool, StoreError> {
    let renewed: Option<i64> = sqlx::query_scalar(
        "UPDATE parts SET lease_until = $1 \
         WHERE worker_id = $2 AND experiment_id = $3 AND joined_at IS NOT NULL \
           AND attempt = (SELECT attempt FROM experiments WHERE id = $3 AND status = 'running') \
         RETURNING host",
    )
    .bind(clock::after(now, lease))
    .bind(worker_id)
    .bind(id)
    .fetch_optional(&mut *tx)
    .await?;
    Ok(renewed.is_some())
}
