//! An experiment's log lines: stored (cut to a length), and their levels as the table
//! names them.

use distlab_common::LogLevel;

use crate::store::StoreError;
use crate::text::truncate;

/// Longest error or log text stored, in characters.
pub const MAX_TEXT_CHARS: usize = 8192;

/// Stores a log line of experiment `id` (cut to `MAX_TEXT_CHARS`) and answers its id.
pub async fn insert_log(
    tx: &mut sqlx::AnyConnection,
    id: i64,
    level: LogLevel,
    message: &str,
    at: &str,
) -> Result<i64, StoreError> {
    Ok(sqlx::query_scalar(
        "INSERT INTO logs (experiment_id, created_at, level, message) VALUES ($1, $2, $3, $4) RETURNING id",
    )
    .bind(id)
    .bind(at)
    .bind(level_name(level))
    .bind(truncate(message, MAX_TEXT_CHARS))
    .fetch_one(&mut *tx)
    .await?)
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
