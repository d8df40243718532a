//! PostgreSQL's notifications (LISTEN / NOTIFY) on one channel, which the servers of one
//! database use to share their live events (`live/fanout.rs`). Payloads are text.

use sqlx::postgres::PgListener;

use crate::store::{Db, StoreError};

/// A connection listening on one channel.
pub struct Listener(PgListener);

/// Connects to the database at `url` and listens on `channel`.
pub async fn listen(url: &str, channel: &str) -> Result<Listener, StoreError> {
    let mut listener = PgListener::connect(url).await?;
    listener.listen(channel).await?;
    Ok(Listener(listener))
}

impl Listener {
    /// The next notification's payload. After an error the next call reconnects (what was
    /// sent meanwhile is lost).
    pub async fn recv(&mut self) -> Result<String, StoreError> {
        Ok(self.0.recv().await?.payload().to_string())
    }
}

/// Sends `payload` to every listener on `channel`.
pub async fn notify(db: &Db, channel: &str, payload: &str) -> Result<(), StoreError> {
    sqlx::query("SELECT CAST(1 AS BIGINT) FROM pg_notify($1, $2)").bind(channel).bind(payload).execute(db).await?;
    Ok(())
}
