//! Runs across several workers, as SQL: the parts of an attempt placed on several hosts
//! (written when host 0's worker leases the experiment, taken by the other workers at their
//! next lease, renewed by their heartbeats), the workers idle enough to be given one, the
//! rendezvous through which the hosts exchange their ranks' addresses, and the release of a
//! placement whose workers did not all come (answered to the caller, which streams it).
//!
//! A worker is idle until a little after it last asked for work (`workers.idle_until`,
//! cleared when it gets a lease or a part) and while it holds nothing running.

use std::time::{Duration, SystemTime};

use distlab_common::{BackendKind, LogLevel, Placement, RendezvousEntry, RendezvousState, MAX_RENDEZVOUS_ENTRIES};
use sqlx::AnyConnection;

use crate::clock;
use crate::placement::{Candidate, Share};
use crate::store::changes::{Data, Writing};
use crate::store::leases::{renew_held, Leased};
use crate::store::logs::insert_log;
use crate::store::{self as db, Db, StoreError};

/// A worker that could be given a part now.
#[derive(Clone, Debug, PartialEq)]
pub struct IdleWorker {
    pub candidate: Candidate,
    pub backends: Vec<BackendKind>,
}

/// `worker_id` asked for work at `now`: it counts as idle for `window` (unless it gets some).
pub async fn mark_idle(
    tx: &mut AnyConnection,
    worker_id: i64,
    now: SystemTime,
    window: Duration,
) -> Result<(), StoreError> {
    sqlx::query("UPDATE workers SET idle_until = $1 WHERE id = $2")
        .bind(clock::after(now, window))
        .bind(worker_id)
        .execute(&mut *tx)
        .await?;
    Ok(())
}

/// `worker_id` was given work.
pub async fn not_idle(tx: &mut AnyConnection, worker_id: i64) -> Result<(), StoreError> {
    sqlx::query("UPDATE workers SET idle_until = NULL WHERE id = $1").bind(worker_id).execute(&mut *tx).await?;
    Ok(())
}

/// The workers other than `asking` that are idle at `now`, by id.
pub async fn idle_workers(tx: &mut AnyConnection, asking: i64, now: SystemTime) -> Result<Vec<IdleWorker>, StoreError> {
    let rows: Vec<(i64, Option<i64>, String)> = sqlx::query_as(
        "SELECT w.id, w.ranks, w.backends FROM workers w \
         WHERE w.id <> $1 AND w.idle_until >= $2 \
           AND NOT EXISTS (SELECT 1 FROM experiments e WHERE e.status = 'running' AND e.worker_id = w.id) \
           AND NOT EXISTS (SELECT 1 FROM parts p JOIN experiments e ON e.id = p.experiment_id AND e.attempt = p.attempt \
                           WHERE p.worker_id = w.id AND e.status = 'running') \
         ORDER BY w.id",
    )
    .bind(asking)
    .bind(clock::rfc3339(now))
    .fetch_all(&mut *tx)
    .await?;
    Ok(rows
        .into_iter()
        .map(|(worker_id, ranks, backends)| IdleWorker {
            candidate: Candidate { worker_id, ranks: ranks.and_then(|r| usize::try_from(r).ok()) },
            backends: serde_json::from_str(&backends).unwrap_or_default(),
        })
        .collect())
}

/// Writes the parts of attempt `attempt` of experiment `id`, one per share, with a fresh
/// secret; host 0 (the leasing worker, whose lease is the experiment's) has taken its
/// part. Answers host 0's placement.
pub async fn place(
    tx: &mut AnyConnection,
    id: i64,
    attempt: i64,
    shares: &[Share],
    now: SystemTime,
) -> Result<Placement, StoreError> {
    let secret = crate::tokens::random_hex(16);
    let mut first_rank = 0;
    for (host, share) in shares.iter().enumerate() {
        // Host 0 has joined; its lease is the experiment's own.
        let joined_at = (host == 0).then(|| clock::rfc3339(now));
        sqlx::query(
            "INSERT INTO parts (experiment_id, attempt, host, worker_id, first_rank, ranks, secret, joined_at, \
             lease_until) VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9)",
        )
        .bind(id)
        .bind(attempt)
        .bind(host as i64)
        .bind(share.worker_id)
        .bind(first_rank as i64)
        .bind(share.ranks as i64)
        .bind(&secret)
        .bind(joined_at)
        .bind(None::<String>)
        .execute(&mut *tx)
        .await?;
        not_idle(tx, share.worker_id).await?;
        first_rank += share.ranks;
    }
    sqlx::query("DELETE FROM rendezvous WHERE experiment_id = $1 AND attempt < $2")
        .bind(id)
        .bind(attempt)
        .execute(&mut *tx)
        .await?;
    Ok(Placement { host: 0, ranks_per_host: shares.iter().map(|s| s.ranks).collect(), secret })
}

crate::store::row! {
    struct WaitingPart {
        experiment_id: i64,
        attempt: i64,
        host: i64,
        spec: String,
        secret: String,
    }
}

/// `worker_id`'s part of a running attempt, placed on it and not yet taken: taken now.
pub async fn join(
    tx: &mut AnyConnection,
    worker_id: i64,
    lease: Duration,
    now: SystemTime,
) -> Result<Option<Leased>, StoreError> {
    let waiting: Option<WaitingPart> = sqlx::query_as(
        "SELECT p.experiment_id, p.attempt, p.host, e.spec, p.secret FROM parts p \
         JOIN experiments e ON e.id = p.experiment_id AND e.attempt = p.attempt \
         WHERE p.worker_id = $1 AND p.joined_at IS NULL AND e.status = 'running' \
         ORDER BY p.experiment_id LIMIT 1",
    )
    .bind(worker_id)
    .fetch_optional(&mut *tx)
    .await?;
    let Some(part) = waiting else { return Ok(None) };
    let taken: Option<i64> = sqlx::query_scalar(
        "UPDATE parts SET joined_at = $1, lease_until = $2 \
         WHERE experiment_id = $3 AND attempt = $4 AND host = $5 AND joined_at IS NULL RETURNING host",
    )
    .bind(clock::rfc3339(now))
    .bind(clock::after(now, lease))
    .bind(part.experiment_id)
    .bind(part.attempt)
    .bind(part.host)
    .fetch_optional(&mut *tx)
    .await?;
    if taken.is_none() {
        return Ok(None); // (released meanwhile)
    }
    not_idle(tx, worker_id).await?;
    let ranks: Vec<i64> =
        sqlx::query_scalar("SELECT ranks FROM parts WHERE experiment_id = $1 AND attempt = $2 ORDER BY host")
            .bind(part.experiment_id)
            .bind(part.attempt)
            .fetch_all(&mut *tx)
            .await?;
    let placement = Placement {
        host: usize::try_from(part.host).unwrap_or(0),
        ranks_per_host: ranks.into_iter().map(|r| usize::try_from(r).unwrap_or(0)).collect(),
        secret: part.secret,
    };
    Ok(Some(Leased { id: part.experiment_id, spec: part.spec, attempt: part.attempt, placement: Some(placement) }))
}

/// What a host publishes in the rendezvous of one attempt.
#[derive(Clone, Copy, Debug)]
pub struct Exchange<'a> {
    pub worker_id: i64,
    pub experiment_id: i64,
    pub attempt: i64,
    pub publish: &'a [RendezvousEntry],
}

/// Publishes in the rendezvous of an attempt and answers all of it; None unless the worker
/// has taken a part of that attempt and it is running. Renews the worker's lease (its
/// part's, or host 0's of the experiment): hosts that wait for each other here heartbeat
/// nothing else. A name already there keeps its first value; names and values are checked
/// by the caller. At most `MAX_RENDEZVOUS_ENTRIES` entries are kept per attempt.
pub async fn exchange(
    db: &Db,
    request: Exchange<'_>,
    lease: Duration,
    now: SystemTime,
) -> Result<Option<RendezvousState>, StoreError> {
    let Exchange { worker_id, experiment_id: id, attempt, publish } = request;
    let mut tx = db.begin().await?;
    let held: i64 = sqlx::query_scalar(
        "SELECT COUNT(*) FROM parts p JOIN experiments e ON e.id = p.experiment_id AND e.attempt = p.attempt \
         WHERE p.experiment_id = $1 AND p.attempt = $2 AND p.worker_id = $3 AND p.joined_at IS NOT NULL \
           AND e.status = 'running'",
    )
    .bind(id)
    .bind(attempt)
    .bind(worker_id)
    .fetch_one(&mut *tx)
    .await?;
    if held == 0 {
        tx.rollback().await?;
        return Ok(None);
    }
    renew_held(&mut tx, worker_id, id, lease, now).await?;
    let kept: i64 = sqlx::query_scalar("SELECT COUNT(*) FROM rendezvous WHERE experiment_id = $1 AND attempt = $2")
        .bind(id)
        .bind(attempt)
        .fetch_one(&mut *tx)
        .await?;
    let room = (MAX_RENDEZVOUS_ENTRIES as i64 - kept).max(0) as usize;
    for entry in publish.iter().take(room) {
        sqlx::query(
            "INSERT INTO rendezvous (experiment_id, attempt, name, value) VALUES ($1, $2, $3, $4) \
             ON CONFLICT (experiment_id, attempt, name) DO NOTHING",
        )
        .bind(id)
        .bind(attempt)
        .bind(&entry.name)
        .bind(&entry.value)
        .execute(&mut *tx)
        .await?;
    }
    let entries: Vec<(String, String)> =
        sqlx::query_as("SELECT name, value FROM rendezvous WHERE experiment_id = $1 AND attempt = $2 ORDER BY name")
            .bind(id)
            .bind(attempt)
            .fetch_all(&mut *tx)
            .await?;
    let (hosts, joined): (i64, i64) =
        sqlx::query_as("SELECT COUNT(*), COUNT(joined_at) FROM parts WHERE experiment_id = $1 AND attempt = $2")
            .bind(id)
            .bind(attempt)
            .fetch_one(&mut *tx)
            .await?;
    tx.commit().await?;
    Ok(Some(RendezvousState {
        entries: entries.into_iter().map(|(name, value)| RendezvousEntry { name, value }).collect(),
        hosts: usize::try_from(hosts).unwrap_or(0),
        joined: usize::try_from(joined).unwrap_or(0),
    }))
}

/// A run sent back to the queue because its workers did not all come.
#[derive(Clone, Debug, PartialEq)]
pub struct Released {
    pub id: i64,
    pub attempt: i64,
    /// Why, as logged on the experiment.
    pub message: String,
}

/// Running attempts whose parts were not all taken within `wait` of their start go back
/// to the queue as if never leased (the attempt does not count): their workers learn it at
/// their next report (409) and stop. Each is logged on the experiment and answered (for the
/// caller to log and stream).
pub async fn release_unformed(db: &Db, wait: Duration, now: SystemTime) -> Result<Vec<Released>, StoreError> {
    let unformed: Vec<(i64, i64)> = sqlx::query_as(
        "SELECT DISTINCT e.id, e.attempt FROM experiments e JOIN parts p ON p.experiment_id = e.id AND p.attempt = e.attempt \
         WHERE e.status = 'running' AND p.joined_at IS NULL AND e.started_at < $1",
    )
    .bind(clock::before(now, wait))
    .fetch_all(db)
    .await?;
    let mut released = Vec::new();
    for (id, attempt) in unformed {
        // (under the write lock, like a lease taking a part)
        let _writing = Writing::to(db, Data::Experiments);
        let (mut tx, _turn) = db::begin_write(db).await?;
        let missing: Vec<i64> = sqlx::query_scalar(
            "SELECT worker_id FROM parts WHERE experiment_id = $1 AND attempt = $2 AND joined_at IS NULL ORDER BY host",
        )
        .bind(id)
        .bind(attempt)
        .fetch_all(&mut *tx)
        .await?;
        let done = sqlx::query(
            "UPDATE experiments SET status = 'queued', attempt = attempt - 1, worker_id = NULL, lease_until = NULL \
             WHERE id = $1 AND attempt = $2 AND status = 'running'",
        )
        .bind(id)
        .bind(attempt)
        .execute(&mut *tx)
        .await?;
        if done.rows_affected() == 0 {
            tx.rollback().await?;
            continue;
        }
        for table in ["parts", "attempts", "rendezvous"] {
            sqlx::query(&format!("DELETE FROM {table} WHERE experiment_id = $1 AND attempt = $2"))
                .bind(id)
                .bind(attempt)
                .execute(&mut *tx)
                .await?;
        }
        let workers: Vec<String> = missing.iter().map(|w| format!("worker {w}")).collect();
        let message = format!(
            "placed on several workers, but {} did not take its part within {} s: back in the queue",
            workers.join(", "),
            wait.as_secs()
        );
        insert_log(&mut tx, id, LogLevel::Warn, &message, &clock::rfc3339(now)).await?;
        tx.commit().await?;
        released.push(Released { id, attempt, message });
    }
    Ok(released)
}
