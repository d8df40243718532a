//! Live events shared by the servers of one PostgreSQL database: whatever a server's hub
//! publishes also goes out with NOTIFY, and each server LISTENs and hands what the others
//! sent to its own streams. A browser's stream then follows a run whichever server its
//! worker reports to.
//!
//! A notification carries at most 8,000 bytes: an event whose JSON is longer (a long log
//! line) goes as a reference, which the receiving server reads back from the database
//! (where it was stored before it was published); so does every status change.

use std::time::Duration;

use std::sync::Arc;

use distlab_common::{StatusChange, StreamEvent};
use serde::{Deserialize, Serialize};
use tokio::sync::mpsc;

use crate::live::hub::{Hub, Published};
use crate::store::{self, Db, StoreError};

const CHANNEL: &str = "distlab_events";
/// The longest payload sent as it is (PostgreSQL's limit is 8,000 bytes).
const INLINE_BYTES: usize = 7_000;
/// Events waiting to go out; more are dropped (the other servers' streams miss them, this
/// server's do not), so that a database that falls behind never holds this one up.
pub const QUEUED_NOTICES: usize = 4096;

/// One notification.
#[derive(Debug, Serialize, Deserialize)]
struct Notice {
    /// The server that sent it (it skips its own).
    origin: String,
    /// The experiment.
    id: i64,
    what: What,
}

#[derive(Debug, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
enum What {
    Event(Box<Published>),
    /// The experiment's status changed: read it from the database.
    Status,
    /// Log line `log_id` was stored: read it from the database.
    Log {
        log_id: i64,
    },
}

/// Sends what `hub` publishes to the other servers of database `db` (at `url`), and
/// delivers what they send to the hub's streams. Runs until the runtime stops.
pub async fn start(hub: &Arc<Hub>, db: &Db, url: &str) -> Result<(), StoreError> {
    let origin = crate::tokens::random_hex(8);
    let mut listener = store::notify::listen(url, CHANNEL).await?;
    let (tx, mut rx) = mpsc::channel::<(i64, Published)>(QUEUED_NOTICES);
    hub.fan_out_to(tx);

    let sending = db.clone();
    let me = origin.clone();
    tokio::spawn(async move {
        while let Some((id, published)) = rx.recv().await {
            let Some(payload) = payload(&me, id, published) else {
                tracing::debug!(experiment = id, "an event too long to tell the other servers");
                continue;
            };
            if let Err(e) = store::notify::notify(&sending, CHANNEL, &payload).await {
                tracing::warn!(experiment = id, "could not tell the other servers about an event: {e}");
            }
        }
    });

    let (hub, db) = (hub.clone(), db.clone());
    tokio::spawn(async move {
        loop {
            match listener.recv().await {
                Ok(payload) => match serde_json::from_str::<Notice>(&payload) {
                    Ok(notice) if notice.origin != origin => deliver(&hub, &db, notice).await,
                    Ok(_) => {}
                    Err(e) => tracing::warn!("an unreadable notification on {CHANNEL}: {e}"),
                },
                Err(e) => {
                    // PgListener reconnects on the next call; what was sent meanwhile is lost.
                    tracing::warn!("listening for the other servers' events: {e}");
                    tokio::time::sleep(Duration::from_secs(1)).await;
                }
            }
        }
    });
    Ok(())
}

/// The notification for `published`: the event itself when it fits, else a reference to
/// where it is stored (None for an event that is neither: not sent). A status change is
/// always a reference: notifications arrive a moment late, and the receiving server then
/// reads the status as it is, never an older one.
fn payload(origin: &str, id: i64, published: Published) -> Option<String> {
    let origin = origin.to_string();
    let reference = match (&published.event, published.log_id) {
        (StreamEvent::Status(_), _) => return serde_json::to_string(&Notice { origin, id, what: What::Status }).ok(),
        (StreamEvent::Log(_), Some(log_id)) => Some(What::Log { log_id }),
        _ => None,
    };
    let notice = Notice { origin, id, what: What::Event(Box::new(published)) };
    match serde_json::to_string(&notice) {
        Ok(json) if json.len() <= INLINE_BYTES => Some(json),
        _ => serde_json::to_string(&Notice { what: reference?, ..notice }).ok(),
    }
}

/// Hands a notice from another server to this one's streams (`hub`), reading what it
/// refers to from `db`.
async fn deliver(hub: &Hub, db: &Db, notice: Notice) {
    let id = notice.id;
    let published = match notice.what {
        What::Event(published) => Some(*published),
        What::Status => match store::experiments::load(db, id).await {
            Ok(Some(view)) => Some(Published {
                event: StreamEvent::Status(StatusChange {
                    status: view.status,
                    error: view.error,
                    summary: view.summary,
                }),
                log_id: None,
            }),
            _ => None,
        },
        What::Log { log_id } => store::experiments::log_line(db, log_id)
            .await
            .ok()
            .flatten()
            .map(|line| Published { event: StreamEvent::Log(line), log_id: Some(log_id) }),
    };
    if let Some(published) = published {
        hub.deliver(id, published);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use distlab_common::{ExperimentStatus, LogLevel, LogLine};

    #[test]
    fn long_events_and_status_changes_go_as_references_short_ones_whole() {
        let short = Published {
            event: StreamEvent::Log(LogLine { level: LogLevel::Info, message: "hi".into() }),
            log_id: Some(3),
        };
        let notice: Notice = serde_json::from_str(&payload("a", 7, short).unwrap()).unwrap();
        assert!(matches!(notice.what, What::Event(p) if p.log_id == Some(3)));
        let long = LogLine { level: LogLevel::Warn, message: "x".repeat(8_000) };
        let stored = Published { event: StreamEvent::Log(long.clone()), log_id: Some(4) };
        let notice: Notice = serde_json::from_str(&payload("a", 7, stored).unwrap()).unwrap();
        assert!(matches!(notice.what, What::Log { log_id: 4 }));
        // A long line that was never stored has nothing to refer to: not sent.
        assert_eq!(payload("a", 7, Published { event: StreamEvent::Log(long), log_id: None }), None);
        let status = StreamEvent::Status(StatusChange { status: ExperimentStatus::Failed, error: None, summary: None });
        let notice: Notice =
            serde_json::from_str(&payload("a", 7, Published { event: status, log_id: None }).unwrap()).unwrap();
        assert!(matches!(notice.what, What::Status));
        assert_eq!((notice.origin.as_str(), notice.id), ("a", 7));
    }
}
