//! Workers: the `workers` table. A worker registers (its name, backends, devices, machine,
//! and the digest of the credential it was given), is known by that credential afterwards,
//! and is seen alive with each request; admission control reads what the live workers offer.

use std::time::SystemTime;

use distlab_common::{BackendKind, WorkerCapacity};

use crate::clock;
use crate::store::{corrupt, Db, StoreError};

/// The worker whose credential has digest `digest` and which used it since `used_since`.
pub async fn by_credential(db: &Db, digest: &str, used_since: &str) -> Result<Option<i64>, StoreError> {
    Ok(sqlx::query_scalar("SELECT id FROM workers WHERE credential_sha256 = $1 AND last_seen >= $2")
        .bind(digest)
        .bind(used_since)
        .fetch_optional(db)
        .await?)
}

/// Whether a worker seen since `alive_since` offers `backend`.
pub async fn backend_offered(db: &Db, backend: BackendKind, alive_since: &str) -> Result<bool, StoreError> {
    let rows: Vec<String> = sqlx::query_scalar("SELECT backends FROM workers WHERE last_seen >= $1")
        .bind(alive_since)
        .fetch_all(db)
        .await?;
    Ok(rows.iter().any(|json| serde_json::from_str::<Vec<BackendKind>>(json).is_ok_and(|list| list.contains(&backend))))
}

/// How many ranks each worker seen since `alive_since` offering `backend` runs at once
/// (None: no limit).
pub async fn live_ranks(db: &Db, backend: BackendKind, alive_since: &str) -> Result<Vec<Option<usize>>, StoreError> {
    let rows: Vec<(String, Option<i64>)> = sqlx::query_as("SELECT backends, ranks FROM workers WHERE last_seen >= $1")
        .bind(alive_since)
        .fetch_all(db)
        .await?;
    let offers = |json: &str| serde_json::from_str::<Vec<BackendKind>>(json).is_ok_and(|list| list.contains(&backend));
    Ok(rows
        .into_iter()
        .filter(|(backends, _)| offers(backends))
        .map(|(_, ranks)| ranks.and_then(|r| usize::try_from(r).ok()))
        .collect())
}

crate::store::row! {
    /// A worker's row as admission control reads it.
    struct WorkerMachine {
        backends: String,
        memory_bytes: i64,
        cores: Option<i64>,
        gpus: Option<i64>,
        gpu_memory_bytes: Option<i64>,
        ranks: Option<i64>,
    }
}

/// A live worker's machine and the most ranks it runs at once (None: no limit).
pub struct LiveWorker {
    pub capacity: WorkerCapacity,
    pub ranks: Option<usize>,
}

/// The workers seen since `alive_since` offering `backend`, with what they report about
/// their machines (those that say).
pub async fn live_capacities(db: &Db, backend: BackendKind, alive_since: &str) -> Result<Vec<LiveWorker>, StoreError> {
    let rows: Vec<WorkerMachine> = sqlx::query_as(
        "SELECT backends, memory_bytes, cores, gpus, gpu_memory_bytes, ranks FROM workers \
         WHERE last_seen >= $1 AND memory_bytes IS NOT NULL",
    )
    .bind(alive_since)
    .fetch_all(db)
    .await?;
    let offers = |json: &str| serde_json::from_str::<Vec<BackendKind>>(json).is_ok_and(|list| list.contains(&backend));
    let unsigned = |n: Option<i64>| n.unwrap_or(0).max(0) as u64;
    Ok(rows
        .iter()
        .filter(|w| offers(&w.backends))
        .map(|w| LiveWorker {
            capacity: WorkerCapacity {
                memory_bytes: unsigned(Some(w.memory_bytes)),
                cores: u32::try_from(unsigned(w.cores)).unwrap_or(u32::MAX),
                gpus: u32::try_from(unsigned(w.gpus)).unwrap_or(u32::MAX),
                gpu_memory_bytes: unsigned(w.gpu_memory_bytes),
            },
            ranks: w.ranks.and_then(|r| usize::try_from(r).ok()),
        })
        .collect())
}

/// What a worker told the server when it registered.
pub struct Offer {
    pub backends: Vec<BackendKind>,
    /// The most ranks it runs at once (None: any number).
    pub ranks: Option<usize>,
}

/// Marks worker `worker_id` as seen at `now` and answers what it offers; None when there is
/// no such worker.
pub async fn touch(db: &Db, worker_id: i64, now: SystemTime) -> Result<Option<Offer>, StoreError> {
    let row: Option<(String, Option<i64>)> =
        sqlx::query_as("UPDATE workers SET last_seen = $1 WHERE id = $2 RETURNING backends, ranks")
            .bind(clock::rfc3339(now))
            .bind(worker_id)
            .fetch_optional(db)
            .await?;
    let Some((backends, ranks)) = row else { return Ok(None) };
    let backends = serde_json::from_str(&backends)
        .map_err(|e| corrupt("stored worker", format!("worker {worker_id} backends: {e}")))?;
    Ok(Some(Offer { backends, ranks: ranks.and_then(|r| usize::try_from(r).ok()) }))
}

/// A worker registering, as it is stored (its backends and devices as JSON text).
pub struct NewWorker<'a> {
    pub name: &'a str,
    pub backends: &'a str,
    pub devices: &'a str,
    pub version: &'a str,
    pub capacity: Option<WorkerCapacity>,
    pub ranks: Option<u32>,
    /// The digest of the credential it was given (`tokens::token_digest`).
    pub credential_digest: &'a str,
}

/// Registers a worker at `now` (seen then too); answers its id.
pub async fn register(db: &Db, worker: &NewWorker<'_>, now: &str) -> Result<i64, StoreError> {
    // SQLite integers are i64: a (nonsense) memory size beyond that is stored as the largest.
    let as_i64 = |n: u64| i64::try_from(n).unwrap_or(i64::MAX);
    let capacity = worker.capacity;
    Ok(sqlx::query_scalar(
        "INSERT INTO workers (name, backends, devices, version, registered_at, last_seen, memory_bytes, cores, gpus, \
         gpu_memory_bytes, credential_sha256, ranks) VALUES ($1, $2, $3, $4, $5, $5, $6, $7, $8, $9, $10, $11) \
         RETURNING id",
    )
    .bind(worker.name)
    .bind(worker.backends)
    .bind(worker.devices)
    .bind(worker.version)
    .bind(now)
    .bind(capacity.map(|c| as_i64(c.memory_bytes)))
    .bind(capacity.map(|c| i64::from(c.cores)))
    .bind(capacity.map(|c| i64::from(c.gpus)))
    .bind(capacity.map(|c| as_i64(c.gpu_memory_bytes)))
    .bind(worker.credential_digest)
    .bind(worker.ranks.map(i64::from))
    .fetch_one(db)
    .await?)
}
