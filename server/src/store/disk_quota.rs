//! The disk one person may fill (`--max-disk-per-user-mb`): their experiments' checkpoints
//! and models and their uploaded datasets, counted from the database in one query.
//!
//! An experiment counts what `distlab_common::disk::DiskPlan` reserves for it, recorded at
//! submission: while queued or running, three checkpoints and its model; once ended, the
//! checkpoint its worker keeps, and the model if it succeeded (the stored file's size once
//! the worker has handed it over). A dataset counts its bytes. Deleting finished
//! experiments or datasets gives the room back. The check and the insert that takes the room
//! are one write transaction, so two submissions cannot both pass it. (The 507 that says so
//! is `api/error.rs`'s.)

use distlab_common::disk::CHECKPOINTS_WHILE_RUNNING;
use sqlx::{Any, Transaction};

use crate::store::StoreError;

/// Bytes `owner`'s experiments and datasets take, or have taken from them.
pub async fn used(tx: &mut Transaction<'static, Any>, owner: &str) -> Result<u64, StoreError> {
    // (Postgres sums BIGINTs as NUMERIC: cast back.)
    let sql = format!(
        "SELECT CAST( \
           (SELECT COALESCE(SUM(CASE \
              WHEN status IN ('queued', 'running') \
                THEN {CHECKPOINTS_WHILE_RUNNING} * disk_checkpoint_bytes + disk_model_bytes \
              WHEN status = 'succeeded' THEN disk_checkpoint_bytes + disk_model_bytes \
              ELSE disk_checkpoint_bytes END), 0) \
            FROM experiments WHERE owner = $1) \
         + (SELECT COALESCE(SUM(bytes), 0) FROM datasets WHERE owner = $1 AND deleted_at IS NULL) AS BIGINT)"
    );
    let used: i64 = sqlx::query_scalar(&sql).bind(owner).fetch_one(&mut **tx).await?;
    Ok(u64::try_from(used).unwrap_or(0))
}

/// Room asked for beyond `owner`'s share.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct OverDisk {
    pub needed: u64,
    pub used: u64,
    pub limit: u64,
}

/// Whether `needed` more bytes overflow `owner`'s share, `limit` (None: no limit).
pub async fn over(
    tx: &mut Transaction<'static, Any>,
    owner: &str,
    needed: u64,
    limit: Option<u64>,
) -> Result<Option<OverDisk>, StoreError> {
    let Some(limit) = limit else { return Ok(None) };
    let used = used(tx, owner).await?;
    Ok((used.saturating_add(needed) > limit).then_some(OverDisk { needed, used, limit }))
}
