//! Uploaded texts to train on: the `datasets` table (a row per text, marked deleted rather
//! than removed, so that an id is never used again), the quota checks an upload passes,
//! and the half-written texts a killed server left under DATA_DIR/datasets.

use distlab_common::{Dataset, DatasetView, ExperimentSpec};

use crate::clock;
use crate::store::disk_quota::{self, OverDisk};
use crate::store::{self, Db, StoreError};

/// Texts one person may keep at once.
pub const MAX_DATASETS_PER_OWNER: i64 = 20;

crate::store::row! {
    struct DatasetRow {
        id: i64,
        name: String,
        owner: String,
        bytes: i64,
        created_at: String,
    }
}

impl DatasetRow {
    fn into_view(self) -> DatasetView {
        let bytes = u64::try_from(self.bytes).unwrap_or(0);
        DatasetView {
            id: self.id,
            name: self.name,
            owner: self.owner,
            bytes,
            max_seq_len: max_seq_len(bytes),
            created_at: self.created_at,
        }
    }
}

/// The longest seq_len a text of `bytes` bytes can train with: [`text_split`] needs a
/// window of seq_len + 1 bytes on each side (the tenth held out is never more than half).
pub fn max_seq_len(bytes: u64) -> u64 {
    (bytes / 2).saturating_sub(1)
}

/// Dataset `id`, if there is one.
pub async fn find(db: &Db, id: i64) -> Result<Option<DatasetView>, StoreError> {
    let row = sqlx::query_as::<_, DatasetRow>(
        "SELECT id, name, owner, bytes, created_at FROM datasets WHERE id = $1 AND deleted_at IS NULL",
    )
    .bind(id)
    .fetch_optional(db)
    .await?;
    Ok(row.map(DatasetRow::into_view))
}

/// Every dataset, newest first.
pub async fn all(db: &Db) -> Result<Vec<DatasetView>, StoreError> {
    let rows = sqlx::query_as::<_, DatasetRow>(
        "SELECT id, name, owner, bytes, created_at FROM datasets WHERE deleted_at IS NULL ORDER BY id DESC",
    )
    .fetch_all(db)
    .await?;
    Ok(rows.into_iter().map(DatasetRow::into_view).collect())
}

/// Why an upload was not kept.
pub enum Refused {
    /// `owner` keeps this many texts, `MAX_DATASETS_PER_OWNER`.
    TooMany(i64),
    /// The text would not fit in `owner`'s share of the disk.
    OverDisk(OverDisk),
}

/// Records a dataset of `owner`'s, unless `owner` keeps `MAX_DATASETS_PER_OWNER` already or
/// its bytes overflow `owner`'s share of the disk (`max_disk`). The checks and the insert
/// are one transaction under the write lock, so concurrent uploads cannot pass them together.
pub async fn insert_within_quota(
    db: &Db,
    name: &str,
    owner: &str,
    bytes: u64,
    max_disk: Option<u64>,
) -> Result<Result<DatasetView, Refused>, StoreError> {
    let (mut tx, _turn) = store::begin_write(db).await?;
    let kept: i64 = sqlx::query_scalar("SELECT COUNT(*) FROM datasets WHERE owner = $1 AND deleted_at IS NULL")
        .bind(owner)
        .fetch_one(&mut *tx)
        .await?;
    if kept >= MAX_DATASETS_PER_OWNER {
        tx.commit().await?;
        return Ok(Err(Refused::TooMany(kept)));
    }
    if let Some(over) = disk_quota::over(&mut tx, owner, bytes, max_disk).await? {
        tx.commit().await?;
        return Ok(Err(Refused::OverDisk(over)));
    }
    let created_at = clock::rfc3339(clock::now());
    let id: i64 = sqlx::query_scalar(
        "INSERT INTO datasets (name, owner, bytes, created_at) VALUES ($1, $2, $3, $4) RETURNING id",
    )
    .bind(name)
    .bind(owner)
    .bind(i64::try_from(bytes).unwrap_or(i64::MAX))
    .bind(&created_at)
    .fetch_one(&mut *tx)
    .await?;
    tx.commit().await?;
    let view =
        DatasetView { id, name: name.into(), owner: owner.into(), bytes, max_seq_len: max_seq_len(bytes), created_at };
    Ok(Ok(view))
}

/// Files an upload left half-written (its server killed between writing the text aside
/// and renaming it into place) are removed when the server starts.
pub fn remove_half_written(data_dir: &std::path::Path) {
    let Ok(entries) = std::fs::read_dir(data_dir.join("datasets")) else { return };
    for entry in entries.flatten() {
        if entry.file_name().to_string_lossy().starts_with(UPLOAD_PREFIX) {
            match std::fs::remove_file(entry.path()) {
                Ok(()) => tracing::info!(file = %entry.path().display(), "removed a half-written upload"),
                Err(e) => tracing::warn!(file = %entry.path().display(), "cannot remove a half-written upload: {e}"),
            }
        }
    }
}

/// The name an upload's text has while it is being written.
pub const UPLOAD_PREFIX: &str = ".upload-";

/// Queued or running experiments that train on dataset `id`.
pub async fn experiments_using(db: &Db, id: i64) -> Result<Vec<i64>, StoreError> {
    let rows: Vec<(i64, String)> =
        sqlx::query_as("SELECT id, spec FROM experiments WHERE status IN ('queued', 'running') ORDER BY id")
            .fetch_all(db)
            .await?;
    Ok(rows
        .into_iter()
        .filter(|(_, spec)| {
            serde_json::from_str::<ExperimentSpec>(spec)
                .is_ok_and(|s| s.data.dataset == Dataset::Upload && s.data.upload_id == Some(id))
        })
        .map(|(experiment, _)| experiment)
        .collect())
}

/// Marks dataset `id` deleted at `now` (its id is never used again).
pub async fn mark_deleted(db: &Db, id: i64, now: std::time::SystemTime) -> Result<(), StoreError> {
    sqlx::query("UPDATE datasets SET deleted_at = $2 WHERE id = $1")
        .bind(id)
        .bind(clock::rfc3339(now))
        .execute(db)
        .await?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use distlab_common::text_split;

    /// The longest seq_len the API reports is the longest the split takes.
    #[test]
    fn max_seq_len_is_the_split_s_limit() {
        for n in (0..5000u64).chain([16 << 20, (16 << 20) + 1]) {
            let max = max_seq_len(n);
            let split = |seq_len: u64| text_split(n as usize, seq_len as usize);
            assert!(max == 0 || split(max).is_some(), "{n} bytes, seq_len {max}");
            assert!(split(max + 1).is_none(), "{n} bytes, seq_len {}", max + 1);
        }
    }
}
