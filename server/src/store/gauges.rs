//! What the operations endpoints count, each read at one moment: the queue, the leases
//! and the workers for `GET /metrics`, live workers and queue length for `GET /api/health`.

use distlab_common::ExperimentStatus;

use crate::store::{Db, StoreError};

/// What `GET /metrics` reports about the queue, read at one moment.
#[derive(Debug, Default)]
pub struct QueueGauges {
    /// Experiments per status (every status, 0 included).
    pub by_status: Vec<(String, i64)>,
    pub queued: i64,
    /// Running experiments whose lease ends after `now`.
    pub leases: i64,
    /// Workers seen since `alive_since`.
    pub workers_alive: i64,
    /// Each registered worker ("name #id") and when it was last heard from.
    pub last_seen: Vec<(String, String)>,
}

pub async fn gauges(db: &Db, now: &str, alive_since: &str) -> Result<QueueGauges, StoreError> {
    let counted: Vec<(String, i64)> =
        sqlx::query_as("SELECT status, COUNT(*) FROM experiments GROUP BY status").fetch_all(db).await?;
    let count_of = |status: &str| counted.iter().find(|(s, _)| s == status).map_or(0, |(_, n)| *n);
    let by_status: Vec<(String, i64)> =
        ExperimentStatus::ALL.iter().map(|s| (s.as_str().to_string(), count_of(s.as_str()))).collect();
    let leases: i64 =
        sqlx::query_scalar("SELECT COUNT(*) FROM experiments WHERE status = 'running' AND lease_until > $1")
            .bind(now)
            .fetch_one(db)
            .await?;
    let workers: Vec<(i64, String, String)> =
        sqlx::query_as("SELECT id, name, last_seen FROM workers ORDER BY id").fetch_all(db).await?;
    let workers_alive = workers.iter().filter(|(_, _, seen)| seen.as_str() >= alive_since).count() as i64;
    Ok(QueueGauges {
        queued: count_of("queued"),
        by_status,
        leases,
        workers_alive,
        last_seen: workers.into_iter().map(|(id, name, seen)| (format!("{name} #{id}"), seen)).collect(),
    })
}

/// What `GET /api/health` counts: the workers seen since `alive_since`, and the experiments
/// queued.
pub async fn health_counts(db: &Db, alive_since: &str) -> Result<(i64, i64), StoreError> {
    let workers: i64 = sqlx::query_scalar("SELECT COUNT(*) FROM workers WHERE last_seen >= $1")
        .bind(alive_since)
        .fetch_one(db)
        .await?;
    let queued: i64 =
        sqlx::query_scalar("SELECT COUNT(*) FROM experiments WHERE status = 'queued'").fetch_one(db).await?;
    Ok((workers, queued))
}
