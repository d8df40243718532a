//! The experiment queue as SQL: submission (within each person's quota), leasing (atomic),
//! whether a worker still holds what it reports about, lease renewal, and the reaper that
//! re-queues experiments whose worker stopped responding or fails those that ran too long
//! (the status changes are answered to the caller, which streams them). What workers report
//! about the runs they hold: `reports.rs`; runs across several workers: `parts.rs`.
//!
//! States: queued -> running (lease) -> succeeded | failed | cancelled.
//! A running experiment whose lease expires goes back to queued (attempt is kept and
//! grows with the next lease), and fails after MAX_ATTEMPTS leases.

use std::collections::HashMap;
use std::time::{Duration, SystemTime};

use distlab_common::disk::DiskPlan;
use distlab_common::{BackendKind, ExperimentSpec, ExperimentStatus, StatusChange};
use sqlx::{Any, Transaction};

use crate::store::changes::{Data, Writing};
use crate::store::disk_quota::{self, OverDisk};
use crate::store::leases::Leased;
use crate::store::{self as db, parts, Db, StoreError};
use crate::{clock, placement};

/// Leases an experiment may have before an expired lease fails it.
pub const MAX_ATTEMPTS: i64 = 3;

pub fn gave_up_message() -> String {
    format!("the worker running it stopped responding {MAX_ATTEMPTS} times (lease expired); giving up")
}

pub fn backend_name(b: BackendKind) -> &'static str {
    match b {
        BackendKind::Cpu => "cpu",
        BackendKind::Cuda => "cuda",
    }
}

/// Who asks for work, and what it can take.
#[derive(Clone, Copy, Debug)]
pub struct Asking<'a> {
    pub worker_id: i64,
    pub backends: &'a [BackendKind],
    /// The most ranks it runs at once (None: any number).
    pub ranks: Option<usize>,
}

/// How the server hands out work.
#[derive(Clone, Copy, Debug)]
pub struct LeasePolicy {
    /// Experiments of one owner that run at once (None: no limit).
    pub max_running: Option<usize>,
    pub lease: Duration,
    /// Whether a run wider than the asking worker may be placed on it and idle workers.
    pub multi_host: bool,
    /// How long the asking worker counts as idle unless it gets work now.
    pub idle_for: Duration,
}

/// Queued experiments looked at per lease, in the order they would be given out: a run
/// that cannot be placed now (waiting for idle workers) lets those behind it start.
const CANDIDATES: i64 = 32;

/// Gives `asking` work: first its part of a run across workers that was placed on it, else
/// a queued experiment whose backend it offers, fair share first (the owner with the
/// fewest experiments running now), then the oldest; an owner already running
/// `max_running` waits. A run wider than `asking` starts only when idle workers make up the
/// rest (`placement::place`): they get their parts at their next lease.
///
/// The decision holds the database's write lock (`db::begin_write`), so two leases never
/// give out the same experiment or the same idle worker; on Postgres the queued rows are
/// also read `FOR UPDATE SKIP LOCKED`.
pub async fn lease(
    db: &Db,
    asking: Asking<'_>,
    policy: LeasePolicy,
    now: SystemTime,
) -> Result<Option<Leased>, StoreError> {
    let writing = Writing::to(db, Data::Experiments);
    let (mut tx, _turn) = db::begin_write(db).await?;
    parts::mark_idle(&mut tx, asking.worker_id, now, policy.idle_for).await?;
    if let Some(joined) = parts::join(&mut tx, asking.worker_id, policy.lease, now).await? {
        tx.commit().await?;
        return Ok(Some(joined));
    }
    if asking.backends.is_empty() {
        writing.unchanged();
        return Ok(None);
    }
    let mut idle: Option<Vec<parts::IdleWorker>> = None;
    for id in queued(&mut tx, asking.backends, policy.max_running, db::is_postgres(db)).await? {
        let spec_json: String =
            sqlx::query_scalar("SELECT spec FROM experiments WHERE id = $1").bind(id).fetch_one(&mut *tx).await?;
        let Ok(spec) = serde_json::from_str::<ExperimentSpec>(&spec_json) else { continue };
        let shape = placement::Shape::of(&spec);
        let me = placement::Candidate { worker_id: asking.worker_id, ranks: asking.ranks };
        let fits_alone = asking.ranks.is_none_or(|r| r >= shape.world);
        // (a collective demo runs its ranks on one machine)
        let multi_host = policy.multi_host && spec.demo.is_none();
        let others: Vec<placement::Candidate> = if fits_alone || !multi_host {
            Vec::new()
        } else {
            if idle.is_none() {
                idle = Some(parts::idle_workers(&mut tx, asking.worker_id, now).await?);
            }
            idle.iter().flatten().filter(|w| w.backends.contains(&spec.backend)).map(|w| w.candidate).collect()
        };
        let Some(shares) = placement::place(shape, me, &others, multi_host) else { continue };
        if let Some(leased) = start(&mut tx, id, spec_json, &shares, policy.lease, now).await? {
            tx.commit().await?;
            return Ok(Some(leased));
        }
    }
    tx.commit().await?;
    writing.unchanged();
    Ok(None)
}

/// The first queued experiments `backends` can run, in the order they are given out.
/// (Only their ids: the sort stays narrow.)
async fn queued(
    tx: &mut sqlx::AnyConnection,
    backends: &[BackendKind],
    max_running: Option<usize>,
    postgres: bool,
) -> Result<Vec<i64>, StoreError> {
    let placeholders: Vec<String> = (0..backends.len()).map(|i| format!("${}", i + 3)).collect();
    let sql = format!(
        "SELECT q.id FROM experiments q \
         LEFT JOIN (SELECT owner, COUNT(*) AS n FROM experiments WHERE status = 'running' GROUP BY owner) r \
           ON r.owner = q.owner \
         WHERE q.status = 'queued' AND q.backend IN ({}) AND COALESCE(r.n, 0) < $1 \
         ORDER BY COALESCE(r.n, 0), q.id LIMIT $2{}",
        placeholders.join(", "),
        if postgres { " FOR UPDATE OF q SKIP LOCKED" } else { "" }
    );
    let max_running = max_running.map_or(i64::MAX, |n| i64::try_from(n).unwrap_or(i64::MAX));
    let mut query = sqlx::query_scalar::<_, i64>(&sql).bind(max_running).bind(CANDIDATES);
    for b in backends {
        query = query.bind(backend_name(*b));
    }
    Ok(query.fetch_all(&mut *tx).await?)
}

/// Starts the next attempt of queued experiment `id` on `shares` (host 0's worker leases
/// it; with several hosts each gets a part); None when it is no longer queued.
async fn start(
    tx: &mut sqlx::AnyConnection,
    id: i64,
    spec: String,
    shares: &[placement::Share],
    lease: Duration,
    now: SystemTime,
) -> Result<Option<Leased>, StoreError> {
    let Some(first) = shares.first() else { return Ok(None) };
    let started_at = clock::rfc3339(now);
    let attempt: Option<i64> = sqlx::query_scalar(
        "UPDATE experiments \
         SET status = 'running', worker_id = $1, attempt = attempt + 1, lease_until = $2, started_at = $3, \
             cancel_requested = FALSE \
         WHERE id = $4 AND status = 'queued' RETURNING attempt",
    )
    .bind(first.worker_id)
    .bind(clock::after(now, lease))
    .bind(&started_at)
    .bind(id)
    .fetch_optional(&mut *tx)
    .await?;
    let Some(attempt) = attempt else { return Ok(None) };
    sqlx::query("INSERT INTO attempts (experiment_id, attempt, worker_id, started_at) VALUES ($1, $2, $3, $4)")
        .bind(id)
        .bind(attempt)
        .bind(first.worker_id)
        .bind(&started_at)
        .execute(&mut *tx)
        .await?;
    let placement = if shares.len() > 1 {
        Some(parts::place(tx, id, attempt, shares, now).await?)
    } else {
        parts::not_idle(tx, first.worker_id).await?;
        None
    };
    Ok(Some(Leased { id, spec, attempt, placement }))
}

/// What a submission did.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Submitted {
    /// A new queued experiment.
    New(i64),
    /// The experiment an earlier submission with the same idempotency key made, for the
    /// same spec (`same_spec`) or another.
    Existing { id: i64, same_spec: bool },
    /// Nothing queued: `owner` already has this many queued, the most allowed.
    OverQuota { queued: usize },
    /// Nothing queued: the run's files would not fit in `owner`'s share of the disk.
    OverDisk(OverDisk),
}

/// What one person may take: experiments queued at once, and disk (None: no limit).
#[derive(Clone, Copy, Debug)]
pub struct Quota {
    pub max_queued: usize,
    pub max_disk_bytes: Option<u64>,
}

/// Queues `spec` (its JSON `spec_json`) for `owner`, unless `owner` has `quota.max_queued`
/// queued already or the run's disk plan would overflow `owner`'s share; with `key`, a
/// second submission with the same key gets the first one's experiment instead of a new one
/// (whatever the quota). Submissions that arrive together are written in one transaction
/// under the write lock, one after the other ([`group_commit`](super::group_commit)), so
/// concurrent submissions cannot pass the quota together.
pub async fn submit(
    db: &Db,
    owner: &str,
    spec: &ExperimentSpec,
    spec_json: &str,
    key: Option<&str>,
    quota: Quota,
    now: SystemTime,
) -> Result<Submitted, StoreError> {
    let submission = Submission {
        owner: owner.to_string(),
        name: spec.name.clone(),
        backend: spec.backend,
        spec_json: spec_json.to_string(),
        key: key.map(str::to_string),
        quota,
        disk: DiskPlan::of(spec),
        now,
    };
    super::group_commit::submit(db, submission).await
}

/// One submission, as [`queue_one`] writes it.
#[derive(Debug)]
pub(crate) struct Submission {
    pub owner: String,
    pub name: String,
    pub backend: BackendKind,
    pub spec_json: String,
    pub key: Option<String>,
    pub quota: Quota,
    pub disk: DiskPlan,
    pub now: SystemTime,
}

/// Writes `s` in `tx` (see [`submit`]). `queued`: how many experiments each owner has
/// queued, as counted in this transaction so far (an owner's queue is counted once per
/// transaction, however many of their submissions it writes).
pub(crate) async fn queue_one(
    tx: &mut Transaction<'static, Any>,
    s: &Submission,
    queued: &mut HashMap<String, usize>,
) -> Result<Submitted, StoreError> {
    if let Some(key) = &s.key {
        let earlier: Option<(i64, String)> =
            sqlx::query_as("SELECT id, spec FROM experiments WHERE owner = $1 AND idempotency_key = $2")
                .bind(&s.owner)
                .bind(key)
                .fetch_optional(&mut **tx)
                .await?;
        if let Some((id, earlier)) = earlier {
            return Ok(Submitted::Existing { id, same_spec: earlier == s.spec_json });
        }
    }
    let owners_queue = match queued.get(&s.owner) {
        Some(&counted) => counted,
        None => {
            let counted: i64 =
                sqlx::query_scalar("SELECT COUNT(*) FROM experiments WHERE owner = $1 AND status = 'queued'")
                    .bind(&s.owner)
                    .fetch_one(&mut **tx)
                    .await?;
            let counted = usize::try_from(counted).unwrap_or(0);
            queued.insert(s.owner.clone(), counted);
            counted
        }
    };
    if owners_queue >= s.quota.max_queued {
        return Ok(Submitted::OverQuota { queued: owners_queue });
    }
    if let Some(over) = disk_quota::over(tx, &s.owner, s.disk.while_running(), s.quota.max_disk_bytes).await? {
        return Ok(Submitted::OverDisk(over));
    }
    let id: i64 = sqlx::query_scalar(
        "INSERT INTO experiments (owner, name, spec, backend, status, attempt, created_at, idempotency_key, \
         disk_checkpoint_bytes, disk_model_bytes) \
         VALUES ($1, $2, $3, $4, 'queued', 0, $5, $6, $7, $8) RETURNING id",
    )
    .bind(&s.owner)
    .bind(&s.name)
    .bind(&s.spec_json)
    .bind(s.backend.as_str())
    .bind(clock::rfc3339(s.now))
    .bind(&s.key)
    .bind(i64::try_from(s.disk.checkpoint).unwrap_or(i64::MAX))
    .bind(i64::try_from(s.disk.model).unwrap_or(i64::MAX))
    .fetch_one(&mut **tx)
    .await?;
    queued.insert(s.owner.clone(), owners_queue + 1);
    Ok(Submitted::New(id))
}

/// Fails every experiment whose current attempt has been running longer than `max` (the
/// server's `--max-run-seconds`), saying so; its worker learns it at its next report (409)
/// and stops. Answers each failed experiment with its status change (for the caller to log
/// and stream).
pub async fn end_overdue(db: &Db, max: Duration, now: SystemTime) -> Result<Vec<(i64, StatusChange)>, StoreError> {
    let _writing = Writing::to(db, Data::Experiments);
    let error = format!(
        "stopped: it ran longer than this server allows one experiment ({} s, distlab-server --max-run-seconds)",
        max.as_secs()
    );
    let ended: Vec<i64> = sqlx::query_scalar(
        "UPDATE experiments SET status = 'failed', error = $1, finished_at = $2, lease_until = NULL \
         WHERE status = 'running' AND started_at < $3 RETURNING id",
    )
    .bind(&error)
    .bind(clock::rfc3339(now))
    .bind(clock::before(now, max))
    .fetch_all(db)
    .await?;
    Ok(ended
        .into_iter()
        .map(|id| (id, StatusChange { status: ExperimentStatus::Failed, error: Some(error.clone()), summary: None }))
        .collect())
}

/// The `SET` of an attempt that ended early without ending its run: back in the queue (its
/// worker forgotten), or, once it has had the most attempts (parameter `$max`), failed with
/// the error in `$error` at the time in `$at`.
pub(crate) fn requeued_or_failed(max: usize, error: usize, at: usize) -> String {
    format!(
        "status = CASE WHEN attempt < ${max} THEN 'queued' ELSE 'failed' END, \
         error = CASE WHEN attempt < ${max} THEN error ELSE ${error} END, \
         finished_at = CASE WHEN attempt < ${max} THEN NULL ELSE ${at} END, \
         worker_id = CASE WHEN attempt < ${max} THEN NULL ELSE worker_id END, \
         lease_until = NULL"
    )
}

crate::store::row! {
    /// An experiment the reaper took back from a silent worker.
    #[derive(Debug, Clone, PartialEq)]
    pub struct Reaped {
        pub id: i64,
        pub status: String,
        pub attempt: i64,
        pub error: Option<String>,
    }
}

/// Running experiments whose lease ended before `now` (host 0's, or any other host's part
/// of a run across workers) go back to the queue, or fail once they have been leased
/// MAX_ATTEMPTS times. Answers each (for the caller to log and stream).
pub async fn reap_expired(db: &Db, now: SystemTime) -> Result<Vec<Reaped>, StoreError> {
    let _writing = Writing::to(db, Data::Experiments);
    let now_text = clock::rfc3339(now);
    let sql = format!(
        "UPDATE experiments SET {} \
         WHERE status = 'running' AND (lease_until < $3 OR EXISTS ( \
           SELECT 1 FROM parts p WHERE p.experiment_id = experiments.id AND p.attempt = experiments.attempt \
             AND p.lease_until < $3)) \
         RETURNING id, status, attempt, error",
        requeued_or_failed(1, 2, 3)
    );
    Ok(sqlx::query_as::<_, Reaped>(&sql)
        .bind(MAX_ATTEMPTS)
        .bind(gave_up_message())
        .bind(&now_text)
        .fetch_all(db)
        .await?)
}

impl Reaped {
    /// The status it is in now (failed, should the stored one be unreadable).
    pub fn status(&self) -> ExperimentStatus {
        ExperimentStatus::parse(&self.status).unwrap_or(ExperimentStatus::Failed)
    }
}
