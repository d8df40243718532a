//! The SQLite database in the data directory: WAL, foreign keys on, a busy timeout so that
//! concurrent writers wait for each other, and the migrations applied at start.

use std::path::{Path, PathBuf};
use std::time::Duration;

use sqlx::sqlite::{SqliteConnectOptions, SqliteJournalMode, SqlitePool, SqlitePoolOptions, SqliteSynchronous};

pub type Db = SqlitePool;

pub const DB_FILE: &str = "distlab.db";

#[derive(Debug, thiserror::Error)]
pub enum DbError {
    #[error("cannot create the data directory {path}: {source}")]
    DataDir { path: PathBuf, source: std::io::Error },
    #[error("cannot open the database {path}: {source}")]
    Open { path: PathBuf, source: sqlx::Error },
    #[error("cannot apply the database migrations to {path}: {source}")]
    Migrate { path: PathBuf, source: sqlx::migrate::MigrateError },
}

/// Opens (creating if needed) DATA_DIR/distlab.db and brings its schema up to date.
pub async fn open(data_dir: &Path) -> Result<Db, DbError> {
    std::fs::create_dir_all(data_dir).map_err(|source| DbError::DataDir { path: data_dir.to_path_buf(), source })?;
    let path = data_dir.join(DB_FILE);
    let options = SqliteConnectOptions::new()
        .filename(&path)
        .create_if_missing(true)
        .journal_mode(SqliteJournalMode::Wal)
        .synchronous(SqliteSynchronous::Normal)
        .foreign_keys(true)
        .busy_timeout(Duration::from_secs(10));
    let pool = SqlitePoolOptions::new()
        .max_connections(8)
        .acquire_timeout(Duration::from_secs(30))
        .connect_with(options)
        .await
        .map_err(|source| DbError::Open { path: path.clone(), source })?;
    sqlx::migrate!("../migrations").run(&pool).await.map_err(|source| DbError::Migrate { path, source })?;
    Ok(pool)
}
