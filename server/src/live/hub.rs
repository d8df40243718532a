//! Live updates: the hub, a broadcast topic per experiment that handlers publish to (status
//! changes, metric points, log lines, traces) and that the live streams
//! (`GET /api/experiments/{id}/stream`, `api/stream.rs`) subscribe to; and the slots that
//! bound how many streams are open, in all and per account.

use std::collections::HashMap;
use std::future::Future;
use std::pin::Pin;
use std::sync::{Arc, Mutex};

use distlab_common::{LogLine, StatusChange, StreamEvent};
use tokio::sync::{broadcast, watch, OwnedSemaphorePermit, Semaphore};

/// Events a slow browser may fall behind by before it misses some.
pub const TOPIC_CAPACITY: usize = 1024;

/// What goes through a topic: the event, and for a stored log line its id (to skip lines
/// that a stream already replayed from the database).
#[derive(Clone, Debug, serde::Serialize, serde::Deserialize)]
pub(crate) struct Published {
    pub(crate) event: StreamEvent,
    pub(crate) log_id: Option<i64>,
}

/// Per-experiment broadcast topics, created while someone listens.
pub struct Hub {
    topics: Mutex<HashMap<i64, broadcast::Sender<Published>>>,
    connections: Arc<Semaphore>,
    max_connections: usize,
    /// Open streams per account, and the most one account may hold.
    per_account: AccountStreams,
    max_per_account: usize,
    shutdown: watch::Sender<bool>,
    /// Where what is published also goes, for the other servers of a shared database
    /// (`fanout.rs`); unset on SQLite.
    fanout: std::sync::OnceLock<tokio::sync::mpsc::Sender<(i64, Published)>>,
}

/// The streams each account holds open. Counted by account, not by address: a class
/// behind one NAT or proxy shares an address, and one person can use many.
type AccountStreams = Arc<Mutex<HashMap<String, OpenStreams>>>;

/// One account's open streams.
struct OpenStreams {
    count: usize,
    /// Sent when the account's sessions end (a new password): its open streams end with them.
    ended: watch::Sender<()>,
}

/// One open stream's place: freed (in the total and in its account's count) when dropped.
pub struct StreamSlot {
    _total: OwnedSemaphorePermit,
    account: String,
    counts: AccountStreams,
    /// Changes when the account's sessions end.
    ended: watch::Receiver<()>,
}

impl StreamSlot {
    /// Resolves when the account's sessions end (its password changed or was reset).
    pub fn sessions_ended(&self) -> Pin<Box<dyn Future<Output = ()> + Send>> {
        let mut ended = self.ended.clone();
        Box::pin(async move {
            let _ = ended.changed().await;
        })
    }
}

impl Drop for StreamSlot {
    fn drop(&mut self) {
        let mut counts = self.counts.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(open) = counts.get_mut(&self.account) {
            open.count -= 1;
            if open.count == 0 {
                counts.remove(&self.account);
            }
        }
    }
}

/// Why a stream was not opened.
#[derive(Debug, PartialEq, Eq)]
pub enum StreamRefused {
    /// The server's total is reached.
    Full(usize),
    /// This account already holds its share.
    AccountFull(usize),
}

impl Hub {
    pub fn new(max_connections: usize, max_per_account: usize) -> Self {
        Self {
            topics: Mutex::new(HashMap::new()),
            connections: Arc::new(Semaphore::new(max_connections)),
            max_connections,
            per_account: Arc::new(Mutex::new(HashMap::new())),
            max_per_account,
            shutdown: watch::Sender::new(false),
            fanout: std::sync::OnceLock::new(),
        }
    }

    /// Sends `event` to everyone watching experiment `id` (nobody: nothing happens).
    pub fn publish(&self, id: i64, event: StreamEvent) {
        self.send(id, Published { event, log_id: None });
    }

    /// Sends a log line stored with id `log_id` to everyone watching experiment `id`.
    pub fn publish_log(&self, id: i64, log_id: Option<i64>, line: LogLine) {
        self.send(id, Published { event: StreamEvent::Log(line), log_id });
    }

    fn send(&self, id: i64, published: Published) {
        if let Some(fanout) = self.fanout.get() {
            // (full: the other servers miss this event rather than this one waiting)
            let _ = fanout.try_send((id, published.clone()));
        }
        self.deliver(id, published);
    }

    /// From now on, everything published here is also sent to `fanout` (the other servers).
    pub(crate) fn fan_out_to(&self, fanout: tokio::sync::mpsc::Sender<(i64, Published)>) {
        let _ = self.fanout.set(fanout);
    }

    /// Hands `published` to this server's watchers of experiment `id` only.
    pub(crate) fn deliver(&self, id: i64, published: Published) {
        let topics = self.topics.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(tx) = topics.get(&id) {
            // An error only means that every receiver is gone; their guards remove the topic.
            let _ = tx.send(published);
        }
    }

    /// Logs a state change of experiment `id` and publishes it to its watchers.
    pub fn status_changed(&self, id: i64, change: StatusChange) {
        match &change.error {
            Some(error) => {
                tracing::info!(experiment = id, status = change.status.as_str(), %error, "experiment status changed")
            }
            None => tracing::info!(experiment = id, status = change.status.as_str(), "experiment status changed"),
        }
        self.publish(id, StreamEvent::Status(change));
    }

    pub fn subscribe(self: &Arc<Self>, id: i64) -> Subscription {
        let mut topics = self.topics.lock().unwrap_or_else(|e| e.into_inner());
        let rx = topics.entry(id).or_insert_with(|| broadcast::channel(TOPIC_CAPACITY).0).subscribe();
        Subscription { hub: self.clone(), id, rx }
    }

    /// A slot for one more open stream of `account`, unless the account's share or the
    /// server's total is reached.
    pub fn try_connect(&self, account: &str) -> Result<StreamSlot, StreamRefused> {
        let mut counts = self.per_account.lock().unwrap_or_else(|e| e.into_inner());
        let open = counts
            .entry(account.to_string())
            .or_insert_with(|| OpenStreams { count: 0, ended: watch::Sender::new(()) });
        if open.count >= self.max_per_account {
            return Err(StreamRefused::AccountFull(self.max_per_account));
        }
        let total = self.connections.clone().try_acquire_owned().map_err(|_| StreamRefused::Full(self.max_connections));
        let total = match total {
            Ok(total) => total,
            Err(refused) => {
                if open.count == 0 {
                    counts.remove(account);
                }
                return Err(refused);
            }
        };
        open.count += 1;
        let ended = open.ended.subscribe();
        Ok(StreamSlot { _total: total, account: account.to_string(), counts: self.per_account.clone(), ended })
    }

    /// Ends every open stream of `account` (its sessions have ended).
    pub fn end_streams_of(&self, account: &str) {
        let counts = self.per_account.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(open) = counts.get(account) {
            open.ended.send_replace(());
        }
    }

    pub fn open_streams(&self) -> usize {
        self.max_connections - self.connections.available_permits()
    }

    /// Ends every open stream (server shutdown: graceful shutdown waits for open responses).
    pub fn shut_down(&self) {
        self.shutdown.send_replace(true);
    }

    /// Resolves when the server shuts down.
    pub fn shutdown_signal(&self) -> Pin<Box<dyn Future<Output = ()> + Send>> {
        let mut rx = self.shutdown.subscribe();
        Box::pin(async move {
            let _ = rx.wait_for(|down| *down).await;
        })
    }

    #[cfg(test)]
    fn topic_count(&self) -> usize {
        self.topics.lock().unwrap_or_else(|e| e.into_inner()).len()
    }
}

/// A receiver on one topic; the topic is removed when its last subscription is dropped.
pub struct Subscription {
    hub: Arc<Hub>,
    id: i64,
    rx: broadcast::Receiver<Published>,
}

impl Subscription {
    /// The next event published on the topic.
    pub(crate) async fn recv(&mut self) -> Result<Published, broadcast::error::RecvError> {
        self.rx.recv().await
    }
}

impl Drop for Subscription {
    fn drop(&mut self) {
        let mut topics = self.hub.topics.lock().unwrap_or_else(|e| e.into_inner());
        // This subscription's receiver is still alive here, hence `<= 1`.
        if topics.get(&self.id).is_some_and(|tx| tx.receiver_count() <= 1) {
            topics.remove(&self.id);
        }
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;
    use distlab_common::ExperimentStatus;

    fn finished(status: ExperimentStatus, error: Option<String>) -> StatusChange {
        StatusChange { status, error, summary: None }
    }

    #[tokio::test]
    async fn topics_are_removed_with_their_last_subscriber() {
        let hub = Arc::new(Hub::new(4, 4));
        let a = hub.subscribe(1);
        let b = hub.subscribe(1);
        assert_eq!(hub.topic_count(), 1);
        drop(a);
        assert_eq!(hub.topic_count(), 1);
        drop(b);
        assert_eq!(hub.topic_count(), 0);
        // Publishing with nobody listening is fine.
        hub.publish(1, StreamEvent::Status(finished(ExperimentStatus::Failed, None)));
    }

    #[test]
    fn connection_slots_are_bounded_in_total_and_per_account() {
        let hub = Hub::new(3, 2);
        let a1 = hub.try_connect("ada").unwrap();
        let _a2 = hub.try_connect("ada").unwrap();
        assert_eq!(hub.try_connect("ada").err(), Some(StreamRefused::AccountFull(2)), "ada's share is used");
        let _b1 = hub.try_connect("bob").unwrap();
        assert_eq!(hub.try_connect("bob").err(), Some(StreamRefused::Full(3)), "the server's total is used");
        assert_eq!(hub.open_streams(), 3);
        drop(a1);
        let _a3 = hub.try_connect("ada").expect("a closed stream frees its account's place and the total's");
        assert_eq!(hub.open_streams(), 3);
    }

    #[tokio::test]
    async fn an_account_s_streams_end_with_its_sessions() {
        let hub = Hub::new(8, 8);
        let ada = hub.try_connect("ada").unwrap();
        let bob = hub.try_connect("bob").unwrap();
        let (ada_ended, bob_ended) = (ada.sessions_ended(), bob.sessions_ended());
        hub.end_streams_of("ada");
        tokio::time::timeout(Duration::from_secs(1), ada_ended).await.expect("ada's stream ends");
        let still = tokio::time::timeout(Duration::from_millis(50), bob_ended).await;
        assert!(still.is_err(), "bob's stream goes on");
    }
}
