//! The database the store tests run on: SQLite in each test's data directory, or, when
//! DISTLAB_TEST_POSTGRES_URL names a PostgreSQL server (`cargo xtask test` starts a
//! throwaway cluster and runs these tests again on it), a fresh database of its own.

use std::sync::atomic::{AtomicUsize, Ordering};

use sqlx::{Connection, Executor};

/// `--database-url` for a new test: None (SQLite), or a new, empty Postgres database.
pub async fn database_url() -> Option<String> {
    let admin = std::env::var("DISTLAB_TEST_POSTGRES_URL").ok().filter(|u| !u.is_empty())?;
    static NEXT: AtomicUsize = AtomicUsize::new(0);
    let name = format!("distlab_test_{}_{}", std::process::id(), NEXT.fetch_add(1, Ordering::Relaxed));
    let mut conn = sqlx::PgConnection::connect(&admin).await.expect("connect to DISTLAB_TEST_POSTGRES_URL");
    conn.execute(format!("CREATE DATABASE {name}").as_str()).await.expect("create a test database");
    let (server, _) = admin.rsplit_once('/').expect("a URL ending in /DATABASE");
    Some(format!("{server}/{name}"))
}
