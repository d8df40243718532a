//! The store: every query the server makes, over one database: SQLite in the data
//! directory (the embedded default: WAL, foreign keys on, a busy timeout so that
//! concurrent writers wait for each other), or PostgreSQL
//! (`--database-url postgres://...`) for a department that runs several servers on one
//! database. Both are reached through sqlx's `Any` driver, so every query is written once:
//! `$1`-style parameters (SQLite reads them too), portable SQL, integers and text rather
//! than booleans in what a query returns (sqlx cannot hand SQLite's booleans over `Any`).
//!
//! The migrations in `migrations/` are written for SQLite and kept portable; on Postgres
//! an `INTEGER PRIMARY KEY` (SQLite's row id) becomes an identity column, the one
//! difference ([`postgres_sql`]).
//!
//! This file opens the database and holds what every part of the store shares (the write
//! lock, [`StoreError`]); each other file stores one domain: accounts, assignments, experiments, the
//! queue and its runs across workers, datasets, traces, flashcard reviews, quiz results,
//! workers, and the notifications between servers. The store answers typed values and
//! never an HTTP answer; it knows nothing of the API or the live streams.

pub mod accounts;
pub mod assignments;
pub mod changes;
pub mod datasets;
pub mod disk_quota;
pub mod experiments;
pub mod gauges;
mod group_commit;
pub mod leases;
pub mod logs;
mod migrations;
pub mod notify;
pub mod parts;
pub mod queue;
pub mod quiz;
pub mod reports;
pub mod review;
pub mod traces;
pub mod workers;

use std::borrow::Cow;
use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::{Arc, LazyLock, Mutex};
use std::time::Duration;

use sqlx::any::{AnyConnectOptions, AnyPoolOptions};
use sqlx::migrate::{Migration, Migrator};
use sqlx::sqlite::SqliteConnectOptions;
use sqlx::{Any, AnyPool, ConnectOptions, Executor, Transaction};

pub type Db = AnyPool;

/// A struct read from a query's row, each field from the column of its name: what
/// `#[derive(sqlx::FromRow)]` writes, without sqlx's macros (see `migrations.rs`).
macro_rules! row {
    ($(#[$meta:meta])* $vis:vis struct $name:ident {
        $($(#[$field_meta:meta])* $field_vis:vis $field:ident: $ty:ty),* $(,)?
    }) => {
        $(#[$meta])*
        $vis struct $name {
            $($(#[$field_meta])* $field_vis $field: $ty),*
        }

        impl<'r> sqlx::FromRow<'r, sqlx::any::AnyRow> for $name {
            fn from_row(row: &'r sqlx::any::AnyRow) -> Result<Self, sqlx::Error> {
                use sqlx::Row;
                Ok(Self { $($field: row.try_get(stringify!($field))?),* })
            }
        }
    };
}
pub(crate) use row;

pub const DB_FILE: &str = "distlab.db";

/// The log filter directive that keeps the database driver's own lines (one per query) out
/// of the log unless they are warnings.
pub const QUIET_DRIVER_LOGS: &str = "sqlx=warn";

/// Why a query failed.
#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    /// A database busy past its timeout: another process holding SQLite's write lock
    /// (SQLITE_BUSY or SQLITE_LOCKED), or a pool with no free connection. Worth trying again.
    #[error(transparent)]
    Busy(sqlx::Error),
    /// Any other database error.
    #[error(transparent)]
    Database(sqlx::Error),
    /// A stored row that cannot be read back (`what`: what it is, `detail`: which and why).
    #[error("{what}: {detail}")]
    Corrupt { what: &'static str, detail: String },
}

impl From<sqlx::Error> for StoreError {
    fn from(e: sqlx::Error) -> Self {
        if database_busy(&e) {
            StoreError::Busy(e)
        } else {
            StoreError::Database(e)
        }
    }
}

/// SQLITE_BUSY (5) or SQLITE_LOCKED (6), in their extended forms too, or no free connection.
fn database_busy(e: &sqlx::Error) -> bool {
    match e {
        sqlx::Error::PoolTimedOut => true,
        sqlx::Error::Database(db) => {
            db.code().and_then(|code| code.parse::<i64>().ok()).is_some_and(|code| matches!(code & 0xff, 5 | 6))
        }
        _ => false,
    }
}

/// A stored row of `what` that cannot be read back.
pub(crate) fn corrupt(what: &'static str, detail: impl std::fmt::Display) -> StoreError {
    StoreError::Corrupt { what, detail: detail.to_string() }
}

#[derive(Debug, thiserror::Error)]
pub enum DbError {
    #[error("cannot create the data directory {path}: {source}")]
    DataDir { path: PathBuf, source: std::io::Error },
    #[error("cannot open the database {place}: {source}")]
    Open { place: String, source: StoreError },
    #[error("cannot apply the database migrations to {place}: {source}")]
    Migrate { place: String, source: sqlx::migrate::MigrateError },
    #[error("--database-url must start with postgres:// or postgresql:// (SQLite needs none: it lives in --data-dir)")]
    Url,
}

/// Where the server keeps its data.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Location<'a> {
    /// DATA_DIR/distlab.db, created if needed.
    DataDir(&'a Path),
    /// A PostgreSQL database (it must exist; the migrations create the tables).
    Postgres(&'a str),
}

/// Opens the database and brings its schema up to date.
pub async fn open(location: Location<'_>) -> Result<Db, DbError> {
    sqlx::any::install_default_drivers();
    let (url, place) = match location {
        Location::DataDir(data_dir) => {
            std::fs::create_dir_all(data_dir)
                .map_err(|source| DbError::DataDir { path: data_dir.to_path_buf(), source })?;
            let path = data_dir.join(DB_FILE);
            let url = SqliteConnectOptions::new().filename(&path).create_if_missing(true).to_url_lossy();
            (url.to_string(), path.display().to_string())
        }
        Location::Postgres(url) if url.starts_with("postgres://") || url.starts_with("postgresql://") => {
            (url.to_string(), without_password(url))
        }
        Location::Postgres(_) => return Err(DbError::Url),
    };
    let options: AnyConnectOptions =
        url.parse().map_err(|source: sqlx::Error| DbError::Open { place: place.clone(), source: source.into() })?;
    let pool = AnyPoolOptions::new()
        .max_connections(if matches!(location, Location::DataDir(_)) { 8 } else { 16 })
        .acquire_timeout(Duration::from_secs(30))
        .after_connect(|conn, _| {
            Box::pin(async move {
                if conn.backend_name() == "SQLite" {
                    // The busy timeout first: switching to WAL may wait for another writer.
                    let pragmas = "PRAGMA busy_timeout = 10000; PRAGMA journal_mode = WAL; \
                                   PRAGMA synchronous = NORMAL; PRAGMA foreign_keys = ON;";
                    conn.execute(pragmas).await?;
                }
                Ok(())
            })
        })
        .connect_with(options)
        .await
        .map_err(|source| DbError::Open { place: place.clone(), source: source.into() })?;
    migrator(is_postgres(&pool)).run(&pool).await.map_err(|source| DbError::Migrate { place, source })?;
    Ok(pool)
}

/// This database's own random id (made when it is first opened; several servers of one
/// Postgres database agree on it): 16 hex digits.
pub async fn store_id(db: &Db) -> Result<String, StoreError> {
    sqlx::query("INSERT INTO store_identity (name, value) VALUES ('id', $1) ON CONFLICT DO NOTHING")
        .bind(crate::tokens::random_hex(8))
        .execute(db)
        .await?;
    Ok(sqlx::query_scalar("SELECT value FROM store_identity WHERE name = 'id'").fetch_one(db).await?)
}

/// Whether `db` is PostgreSQL (else SQLite).
pub fn is_postgres(db: &Db) -> bool {
    db.connect_options().database_url.scheme().starts_with("postgres")
}

/// The migrations, as each database reads them.
fn migrator(postgres: bool) -> Migrator {
    let migrations = migrations::all().into_iter().map(|m| {
        if !postgres {
            return m;
        }
        let sql = Cow::Owned(postgres_sql(&m.sql));
        Migration::new(m.version, m.description.clone(), m.migration_type, sql, m.no_tx)
    });
    // (`migrations` is sqlx's own field: `migrate!` fills it the same way.)
    Migrator { migrations: migrations.collect::<Vec<_>>().into(), ..Migrator::DEFAULT }
}

/// A migration written for SQLite, for PostgreSQL: row ids become identity columns.
pub fn postgres_sql(sqlite: &str) -> String {
    sqlite.replace("INTEGER PRIMARY KEY", "BIGINT GENERATED BY DEFAULT AS IDENTITY PRIMARY KEY")
}

/// A query that binds a float that may be NULL (`Option<f64>` or `Option<f32>`). sqlx 0.8's
/// `Any` driver hands such a NULL to Postgres as the other float type (an f64's as float4),
/// and sqlx caches a connection's prepared statement by its SQL text alone, keeping the
/// parameter types of its first use: the same statement binding a number later on that
/// connection is refused ("incorrect binary data format"). Not cached, the statement is
/// typed by each call's own values, at the cost of one more round trip per call.
pub(crate) fn query_with_nullable_floats(sql: &str) -> sqlx::query::Query<'_, Any, sqlx::any::AnyArguments<'_>> {
    sqlx::query(sql).persistent(false)
}

/// A transaction that holds the database's write lock from its first statement, for a
/// decision read and then written (a lease): `BEGIN IMMEDIATE` on SQLite (a deferred
/// BEGIN could read, then fail to write after another writer), on Postgres a transaction
/// lock that every such transaction takes, so that they run one at a time. It comes with
/// this server's [`WriteTurn`], held until the transaction ends.
pub async fn begin_write(db: &Db) -> Result<(Transaction<'static, Any>, WriteTurn), StoreError> {
    let turn = write_turn().await;
    let tx = if is_postgres(db) {
        let mut tx = db.begin().await?;
        sqlx::query("SELECT CAST(1 AS BIGINT) FROM pg_advisory_xact_lock($1)")
            .bind(WRITE_LOCK)
            .execute(&mut *tx)
            .await?;
        tx
    } else {
        db.begin_with("BEGIN IMMEDIATE").await?
    };
    Ok((tx, turn))
}

/// This server's turn to write: its writers (leases, submissions, each transaction of a
/// worker's event batch) take turns in the order they asked. SQLite's own wait for its
/// write lock is no queue (a waiter sleeps up to 100 ms between tries, and one busy writer
/// can take the lock again and again before it looks): behind a large batch a submission
/// would wait for all of it.
pub type WriteTurn = tokio::sync::MutexGuard<'static, ()>;

pub async fn write_turn() -> WriteTurn {
    static TURN: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());
    TURN.lock().await
}

/// A value kept for each database this process opens, by its URL (the servers of one
/// process, as the tests start them, each have their own database).
pub(crate) struct ByDatabase<T>(LazyLock<Mutex<HashMap<String, Arc<T>>>>);

impl<T: Default> ByDatabase<T> {
    pub(crate) const fn new() -> Self {
        Self(LazyLock::new(Default::default))
    }

    /// `db`'s value (a default one the first time).
    pub(crate) fn of(&self, db: &Db) -> Arc<T> {
        let options = db.connect_options();
        let url = options.database_url.as_str();
        let mut by_database = self.0.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
        match by_database.get(url) {
            Some(value) => value.clone(),
            None => by_database.entry(url.to_owned()).or_default().clone(),
        }
    }
}

/// The key of the advisory lock [`begin_write`] takes on Postgres ("distlab" in ASCII).
const WRITE_LOCK: i64 = 0x0064_6973_746c_6162;

/// A database URL fit for a log line: its password (in the authority or as a `password`
/// query parameter) replaced.
pub fn without_password(url: &str) -> String {
    let Ok(mut parsed) = url.parse::<url::Url>() else { return "(an unreadable URL)".into() };
    if parsed.password().is_some() {
        let _ = parsed.set_password(Some("***"));
    }
    if parsed.query_pairs().any(|(k, _)| k == "password") {
        let pairs: Vec<(String, String)> = parsed
            .query_pairs()
            .map(|(k, v)| {
                let v = if k == "password" { "***".to_string() } else { v.into_owned() };
                (k.into_owned(), v)
            })
            .collect();
        parsed.query_pairs_mut().clear().extend_pairs(pairs);
    }
    parsed.to_string()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn postgres_reads_row_ids_as_identity_columns_and_nothing_else_changes() {
        let sql = "CREATE TABLE t (\n    id INTEGER PRIMARY KEY,\n    n BIGINT NOT NULL\n);";
        assert_eq!(
            postgres_sql(sql),
            "CREATE TABLE t (\n    id BIGINT GENERATED BY DEFAULT AS IDENTITY PRIMARY KEY,\n    n BIGINT NOT NULL\n);"
        );
        for m in migrations::all() {
            assert!(!m.sql.contains("AUTOINCREMENT") && !m.sql.contains("WITHOUT ROWID"), "{}", m.description);
        }
    }

    #[test]
    fn passwords_stay_out_of_logs() {
        assert_eq!(without_password("postgres://u:secret@h:5432/db"), "postgres://u:***@h:5432/db");
        assert_eq!(without_password("postgres://u@h/db"), "postgres://u@h/db");
        assert_eq!(
            without_password("postgres://u@h/db?password=x&sslmode=require"),
            "postgres://u@h/db?password=***&sslmode=require"
        );
    }
}
