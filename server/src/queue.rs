//! The experiment queue as SQL: leasing (atomic), lease renewal, completion, failure,
//! and the reaper that re-queues experiments whose worker stopped responding.
//!
//! States: queued -> running (lease) -> succeeded | failed | cancelled.
//! A running experiment whose lease expires goes back to queued (attempt is kept and
//! grows with the next lease), and fails after MAX_ATTEMPTS leases.

use std::time::{Duration, SystemTime};

use distlab_common::disk::DiskPlan;
use distlab_common::{
    BackendKind, ExperimentSpec, ExperimentStatus, FieldError, LogLevel, MetricPoint, Placement, RunEvent, RunSummary,
    StatusChange,
};

use crate::db::{self, Db};
use crate::disk_quota::{self, OverDisk};
use crate::extract::truncate;
use crate::stream::Hub;
use crate::traces;
use crate::{clock, parts, placement};

/// Leases an experiment may have before an expired lease fails it.
pub const MAX_ATTEMPTS: i64 = 3;

/// Longest error or log text stored, in characters.
pub const MAX_TEXT_CHARS: usize = 8192;

pub fn gave_up_message() -> String {
    format!("the worker running it stopped responding {MAX_ATTEMPTS} times (lease expired); giving up")
}

pub fn backend_name(b: BackendKind) -> &'static str {
    match b {
        BackendKind::Cpu => "cpu",
        BackendKind::Cuda => "cuda",
    }
}

/// What a lease hands to a worker.
#[derive(Debug)]
pub struct Leased {
    pub id: i64,
    pub spec: String,
    pub attempt: i64,
    /// Set when the run spans several workers.
    pub placement: Option<Placement>,
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
) -> Result<Option<Leased>, sqlx::Error> {
    let (mut tx, _turn) = db::begin_write(db).await?;
    parts::mark_idle(&mut tx, asking.worker_id, now, policy.idle_for).await?;
    if let Some(joined) = parts::join(&mut tx, asking.worker_id, policy.lease, now).await? {
        tx.commit().await?;
        return Ok(Some(joined));
    }
    if asking.backends.is_empty() {
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
    Ok(None)
}

/// The first queued experiments `backends` can run, in the order they are given out.
/// (Only their ids: the sort stays narrow.)
async fn queued(
    tx: &mut sqlx::AnyConnection,
    backends: &[BackendKind],
    max_running: Option<usize>,
    postgres: bool,
) -> Result<Vec<i64>, sqlx::Error> {
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
    query.fetch_all(&mut *tx).await
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
) -> Result<Option<Leased>, sqlx::Error> {
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

/// How many of experiment `id`'s steps, from step 0 on, have their metric point stored: the
/// first step without one. A new attempt resumes no later (`Lease::stored_steps`).
pub async fn stored_steps(db: &Db, id: i64) -> Result<u64, sqlx::Error> {
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
async fn start_attempt(tx: &mut sqlx::AnyConnection, id: i64, from_step: u64) -> Result<(), sqlx::Error> {
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

#[derive(sqlx::FromRow)]
struct OwnerRow {
    status: String,
    worker_id: Option<i64>,
    /// 1 when the worker holds a part of the current attempt (a run across workers).
    member: i64,
}

/// Why a guarded update of experiment `id` by `worker_id` did not apply.
pub async fn ownership(db: &Db, worker_id: i64, id: i64) -> Result<Ownership, sqlx::Error> {
    ownership_after(db, worker_id, id, None).await
}

/// [`ownership`], where `worker_id` is reporting that the experiment ended as `reported`:
/// when it did end so in that worker's hands, the report is a retry (`AlreadyReported`).
/// The worker of host 0 holds the experiment, the other hosts' workers their parts.
async fn ownership_after(
    db: &Db,
    worker_id: i64,
    id: i64,
    reported: Option<ExperimentStatus>,
) -> Result<Ownership, sqlx::Error> {
    let sql = format!(
        "SELECT status, worker_id, CASE WHEN {} THEN 1 ELSE 0 END AS member FROM experiments WHERE id = $1",
        parts::holds_part(2)
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
) -> Result<Ownership, sqlx::Error> {
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
    tx: &mut sqlx::AnyConnection,
    worker_id: i64,
    id: i64,
    lease: Duration,
    now: SystemTime,
) -> Result<Option<String>, sqlx::Error> {
    let renewed: Option<String> = sqlx::query_scalar(
        "UPDATE experiments SET lease_until = $1 WHERE id = $2 AND worker_id = $3 AND status = 'running' \
         RETURNING spec",
    )
    .bind(clock::after(now, lease))
    .bind(id)
    .bind(worker_id)
    .fetch_optional(&mut *tx)
    .await?;
    if renewed.is_some() || !parts::renew(tx, worker_id, id, lease, now).await? {
        return Ok(renewed);
    }
    sqlx::query_scalar("SELECT spec FROM experiments WHERE id = $1").bind(id).fetch_optional(&mut *tx).await
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
) -> Result<Stored, sqlx::Error> {
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

async fn insert_metric(tx: &mut sqlx::AnyConnection, id: i64, m: &MetricPoint) -> Result<(), sqlx::Error> {
    // ON CONFLICT ... DO UPDATE is the portable spelling of INSERT OR REPLACE (SQLite and Postgres).
    db::query_with_nullable_floats(
        "INSERT INTO metrics \
           (experiment_id, step, loss, lr, grad_norm, tokens_per_s, step_ms, loss_scale, skipped_steps, \
            expert_balance, expert_assignments, expert_dropped, logit_grad_zero_share, val_loss) \
         VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12, $13, $14) \
         ON CONFLICT (experiment_id, step) DO UPDATE SET loss = excluded.loss, lr = excluded.lr, \
           grad_norm = excluded.grad_norm, tokens_per_s = excluded.tokens_per_s, step_ms = excluded.step_ms, \
           loss_scale = excluded.loss_scale, skipped_steps = excluded.skipped_steps, \
           expert_balance = excluded.expert_balance, expert_assignments = excluded.expert_assignments, \
           expert_dropped = excluded.expert_dropped, logit_grad_zero_share = excluded.logit_grad_zero_share, \
           val_loss = excluded.val_loss",
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
    .execute(tx)
    .await?;
    Ok(())
}

/// Stores a log line of experiment `id` (cut to `MAX_TEXT_CHARS`) and answers its id.
pub async fn insert_log(
    tx: &mut sqlx::AnyConnection,
    id: i64,
    level: LogLevel,
    message: &str,
    at: &str,
) -> Result<i64, sqlx::Error> {
    sqlx::query_scalar(
        "INSERT INTO logs (experiment_id, created_at, level, message) VALUES ($1, $2, $3, $4) RETURNING id",
    )
    .bind(id)
    .bind(at)
    .bind(level_name(level))
    .bind(truncate(message, MAX_TEXT_CHARS))
    .fetch_one(&mut *tx)
    .await
}

fn level_name(level: LogLevel) -> &'static str {
    match level {
        LogLevel::Info => "info",
        LogLevel::Warn => "warn",
        LogLevel::Error => "error",
    }
}

/// The level of a stored log line (the table's CHECK allows only the three names).
pub fn level_from_name(name: &str) -> Option<LogLevel> {
    match name {
        "info" => Some(LogLevel::Info),
        "warn" => Some(LogLevel::Warn),
        "error" => Some(LogLevel::Error),
        _ => None,
    }
}

/// A running experiment held by `worker_id` succeeded.
pub async fn complete(
    db: &Db,
    worker_id: i64,
    id: i64,
    summary: &RunSummary,
    now: SystemTime,
) -> Result<Ownership, sqlx::Error> {
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
) -> Result<Result<ExperimentStatus, Ownership>, sqlx::Error> {
    // The worker holds the experiment (host 0) or a part of it, in the attempt reported on
    // (parameter `$k`).
    let held = |k: usize| format!("(worker_id = $1 OR {}) AND attempt = COALESCE(${k}, attempt)", parts::holds_part(1));
    let at = clock::rfc3339(now);
    let error = truncate(failure.error, MAX_TEXT_CHARS);
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
            parts::holds_part(1)
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
/// (whatever the quota). The checks and the insert are one transaction under the write
/// lock, so concurrent submissions cannot pass the quota together.
pub async fn submit(
    db: &Db,
    owner: &str,
    spec: &ExperimentSpec,
    spec_json: &str,
    key: Option<&str>,
    quota: Quota,
    now: SystemTime,
) -> Result<Submitted, sqlx::Error> {
    let (mut tx, _turn) = db::begin_write(db).await?;
    if let Some(key) = key {
        let earlier: Option<(i64, String)> =
            sqlx::query_as("SELECT id, spec FROM experiments WHERE owner = $1 AND idempotency_key = $2")
                .bind(owner)
                .bind(key)
                .fetch_optional(&mut *tx)
                .await?;
        if let Some((id, earlier)) = earlier {
            tx.commit().await?;
            return Ok(Submitted::Existing { id, same_spec: earlier == spec_json });
        }
    }
    let queued: i64 = sqlx::query_scalar("SELECT COUNT(*) FROM experiments WHERE owner = $1 AND status = 'queued'")
        .bind(owner)
        .fetch_one(&mut *tx)
        .await?;
    let queued = usize::try_from(queued).unwrap_or(0);
    if queued >= quota.max_queued {
        tx.commit().await?;
        return Ok(Submitted::OverQuota { queued });
    }
    let disk = DiskPlan::of(spec);
    if let Some(over) = disk_quota::over(&mut tx, owner, disk.while_running(), quota.max_disk_bytes).await? {
        tx.commit().await?;
        return Ok(Submitted::OverDisk(over));
    }
    let id: i64 = sqlx::query_scalar(
        "INSERT INTO experiments (owner, name, spec, backend, status, attempt, created_at, idempotency_key, \
         disk_checkpoint_bytes, disk_model_bytes) \
         VALUES ($1, $2, $3, $4, 'queued', 0, $5, $6, $7, $8) RETURNING id",
    )
    .bind(owner)
    .bind(&spec.name)
    .bind(spec_json)
    .bind(spec.backend.as_str())
    .bind(clock::rfc3339(now))
    .bind(key)
    .bind(i64::try_from(disk.checkpoint).unwrap_or(i64::MAX))
    .bind(i64::try_from(disk.model).unwrap_or(i64::MAX))
    .fetch_one(&mut *tx)
    .await?;
    tx.commit().await?;
    Ok(Submitted::New(id))
}

/// The size of experiment `id`'s stored model file: what its owner's share of the disk
/// counts for it from now on, in place of the plan's.
pub async fn record_model_bytes(db: &Db, id: i64, bytes: u64) -> Result<(), sqlx::Error> {
    sqlx::query("UPDATE experiments SET disk_model_bytes = $1 WHERE id = $2")
        .bind(i64::try_from(bytes).unwrap_or(i64::MAX))
        .bind(id)
        .execute(db)
        .await?;
    Ok(())
}

/// Deletes finished experiment `id` with everything stored of it (metrics, logs, traces,
/// attempts); false when it is not finished (or not there).
pub async fn delete_finished(db: &Db, id: i64) -> Result<bool, sqlx::Error> {
    let done = sqlx::query("DELETE FROM experiments WHERE id = $1 AND status IN ('succeeded', 'failed', 'cancelled')")
        .bind(id)
        .execute(db)
        .await?;
    Ok(done.rows_affected() == 1)
}

/// Fails every experiment whose current attempt has been running longer than `max` (the
/// server's `--max-run-seconds`), saying so; its worker learns it at its next report (409)
/// and stops.
pub async fn end_overdue(db: &Db, hub: &Hub, max: Duration, now: SystemTime) -> Result<Vec<i64>, sqlx::Error> {
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
    for &id in &ended {
        tracing::warn!(experiment = id, "{error}");
        let change = StatusChange { status: ExperimentStatus::Failed, error: Some(error.clone()), summary: None };
        hub.status_changed(id, change);
    }
    Ok(ended)
}

/// The `SET` of an attempt that ended early without ending its run: back in the queue (its
/// worker forgotten), or, once it has had the most attempts (parameter `$max`), failed with
/// the error in `$error` at the time in `$at`.
fn requeued_or_failed(max: usize, error: usize, at: usize) -> String {
    format!(
        "status = CASE WHEN attempt < ${max} THEN 'queued' ELSE 'failed' END, \
         error = CASE WHEN attempt < ${max} THEN error ELSE ${error} END, \
         finished_at = CASE WHEN attempt < ${max} THEN NULL ELSE ${at} END, \
         worker_id = CASE WHEN attempt < ${max} THEN NULL ELSE worker_id END, \
         lease_until = NULL"
    )
}

/// An experiment the reaper took back from a silent worker.
#[derive(Debug, Clone, PartialEq, sqlx::FromRow)]
pub struct Reaped {
    pub id: i64,
    pub status: String,
    pub attempt: i64,
    pub error: Option<String>,
}

/// Running experiments whose lease ended before `now` (host 0's, or any other host's part
/// of a run across workers) go back to the queue, or fail once they have been leased
/// MAX_ATTEMPTS times. Each change is logged and streamed.
pub async fn reap_expired(db: &Db, hub: &Hub, now: SystemTime) -> Result<Vec<Reaped>, sqlx::Error> {
    let now_text = clock::rfc3339(now);
    let sql = format!(
        "UPDATE experiments SET {} \
         WHERE status = 'running' AND (lease_until < $3 OR EXISTS ( \
           SELECT 1 FROM parts p WHERE p.experiment_id = experiments.id AND p.attempt = experiments.attempt \
             AND p.lease_until < $3)) \
         RETURNING id, status, attempt, error",
        requeued_or_failed(1, 2, 3)
    );
    let reaped = sqlx::query_as::<_, Reaped>(&sql)
        .bind(MAX_ATTEMPTS)
        .bind(gave_up_message())
        .bind(&now_text)
        .fetch_all(db)
        .await?;
    for r in &reaped {
        let status = ExperimentStatus::parse(&r.status).unwrap_or(ExperimentStatus::Failed);
        tracing::warn!(
            experiment = r.id,
            attempt = r.attempt,
            status = status.as_str(),
            "lease expired: the worker stopped responding"
        );
        hub.status_changed(r.id, StatusChange { status, error: r.error.clone(), summary: None });
    }
    Ok(reaped)
}

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

pub async fn gauges(db: &Db, now: &str, alive_since: &str) -> Result<QueueGauges, sqlx::Error> {
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
