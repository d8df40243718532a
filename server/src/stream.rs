//! Live updates: a broadcast topic per experiment (the hub) and the SSE endpoint
//! `GET /api/experiments/{id}/stream`.
//!
//! A stream sends the current status, then the last LOG_REPLAY stored log lines (oldest
//! first) and every stored metric point (replay), then live events as workers report them.
//! It ends after a finished status (succeeded, failed, cancelled), which is always its last
//! event. To lose nothing between the replay and the live part, the handler subscribes
//! first and reads the database second; live metric points identical to replayed ones,
//! and live log lines whose stored id is not above the last replayed one, are then skipped.

use std::collections::HashMap;
use std::convert::Infallible;
use std::future::Future;
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::extract::{Path, State};
use axum::response::sse::{Event, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use axum::Extension;
use distlab_common::{LogLevel, LogLine, MetricPoint, StatusChange, StreamEvent};
use futures::stream::{self, Stream, StreamExt};
use tokio::sync::{broadcast, watch, OwnedSemaphorePermit, Semaphore};

use crate::accounts::Account;
use crate::error::HttpError;
use crate::experiments;
use crate::extract::parse_id;
use crate::AppState;

/// Events a slow browser may fall behind by before it misses some.
const TOPIC_CAPACITY: usize = 1024;
/// How many of the last replayed metric points are remembered to skip their live duplicates.
const DEDUP_WINDOW: usize = TOPIC_CAPACITY;
const KEEP_ALIVE: Duration = Duration::from_secs(15);
/// Stored log lines a new stream replays (the latest ones).
pub const LOG_REPLAY: i64 = 200;

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
    fn sessions_ended(&self) -> Pin<Box<dyn Future<Output = ()> + Send>> {
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

    fn shutdown_signal(&self) -> Pin<Box<dyn Future<Output = ()> + Send>> {
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

impl Drop for Subscription {
    fn drop(&mut self) {
        let mut topics = self.hub.topics.lock().unwrap_or_else(|e| e.into_inner());
        // This subscription's receiver is still alive here, hence `<= 1`.
        if topics.get(&self.id).is_some_and(|tx| tx.receiver_count() <= 1) {
            topics.remove(&self.id);
        }
    }
}

/// `GET /api/experiments/{id}/stream`
#[utoipa::path(
    get, path = "/experiments/{id}/stream", operation_id = "experiment_stream", tag = "experiments",
    params(("id" = i64, Path, description = "the experiment's id")),
    responses(
        (status = 200, description = "server-sent events: status, metrics, logs, traces as they arrive", content_type = "text/event-stream"),
        (status = 404, description = "no such experiment", body = distlab_common::ApiError),
        (status = 429, description = "too many streams open", body = distlab_common::ApiError),
    ),
)]
pub async fn stream(
    State(state): State<AppState>,
    Extension(caller): Extension<Account>,
    Path(raw_id): Path<String>,
) -> Result<Response, HttpError> {
    let id = parse_id(&raw_id)?;
    let permit = state.hub.try_connect(&caller.name).map_err(|refused| match refused {
        StreamRefused::Full(max) => HttpError::unavailable(format!(
            "too many live streams are open (this server allows {max}); close some tabs or try again later"
        )),
        StreamRefused::AccountFull(max) => HttpError::too_many_requests(format!(
            "you have {max} live streams open, the most one person may; close some tabs"
        )),
    })?;
    let sessions_ended = permit.sessions_ended();
    // Subscribe before reading the database, so that nothing falls between the two.
    let subscription = state.hub.subscribe(id);
    let view = experiments::load(&state.db, id).await?.ok_or_else(|| experiments::not_found(id))?;
    let logs = experiments::load_recent_logs(&state.db, id, LOG_REPLAY).await?;
    let metrics = experiments::load_metrics(&state.db, id).await?;

    let status = StatusChange { status: view.status, error: view.error.clone(), summary: view.summary.clone() };
    let finished = view.status.is_finished();
    let replayed = Replayed {
        metrics: metrics.iter().rev().take(DEDUP_WINDOW).map(|m| (m.step, m.clone())).collect(),
        last_log_id: logs.last().map(|l| l.id),
    };
    let mut replay = Vec::with_capacity(logs.len() + metrics.len() + 2);
    replay.push(StreamEvent::Status(status.clone()));
    replay.extend(logs.into_iter().map(|l| StreamEvent::Log(l.line)));
    replay.extend(metrics.into_iter().map(StreamEvent::Metric));

    let live = if finished {
        // The final status closes the stream, after the replayed logs and metrics.
        replay.push(StreamEvent::Status(status));
        stream::empty().boxed()
    } else {
        live_events(subscription, replayed).boxed()
    };
    let events =
        stream::iter(replay).chain(live).take_until(state.hub.shutdown_signal()).take_until(sessions_ended).map(
            move |event| {
                let _slot = &permit; // the connection slot is freed when the stream is dropped
                Ok::<_, Infallible>(sse_event(&event))
            },
        );
    Ok(Sse::new(events).keep_alive(KeepAlive::new().interval(KEEP_ALIVE)).into_response())
}

/// What a stream's replay sent, so that its live part skips the same things.
#[derive(Default)]
struct Replayed {
    /// Replayed points not yet matched by a live duplicate.
    metrics: HashMap<u64, MetricPoint>,
    /// The id of the newest replayed log line: live lines up to it were replayed.
    last_log_id: Option<i64>,
}

struct Live {
    subscription: Subscription,
    replayed: Replayed,
    done: bool,
}

/// Live events until a finished status (inclusive) or the topic closes.
fn live_events(subscription: Subscription, replayed: Replayed) -> impl Stream<Item = StreamEvent> + Send {
    stream::unfold(Live { subscription, replayed, done: false }, |mut live| async move {
        if live.done {
            return None;
        }
        loop {
            let (event, log_id) = match live.subscription.rx.recv().await {
                Ok(Published { event, log_id }) => (event, log_id),
                Err(broadcast::error::RecvError::Lagged(n)) => {
                    let message =
                        format!("this live view fell behind and skipped {n} events; reload the page to see all");
                    (StreamEvent::Log(LogLine { level: LogLevel::Warn, message }), None)
                }
                Err(broadcast::error::RecvError::Closed) => return None,
            };
            match &event {
                // Already sent in the replay (each replayed point is matched at most once).
                StreamEvent::Metric(m) if live.replayed.metrics.remove(&m.step).is_some_and(|seen| seen == *m) => {
                    continue
                }
                StreamEvent::Log(_) if log_id.zip(live.replayed.last_log_id).is_some_and(|(id, last)| id <= last) => {
                    continue
                }
                StreamEvent::Status(s) if s.status.is_finished() => live.done = true,
                _ => {}
            }
            return Some((event, live));
        }
    })
}

fn sse_event(event: &StreamEvent) -> Event {
    let base = Event::default().event(event.name());
    match serde_json::to_string(event) {
        Ok(json) => base.data(json),
        Err(e) => Event::default().comment(format!("could not encode an event: {e}")),
    }
}

#[cfg(test)]
mod tests {
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

    #[tokio::test]
    async fn live_skips_replayed_duplicates_and_ends_on_finish() {
        let hub = Arc::new(Hub::new(4, 4));
        let sub = hub.subscribe(7);
        let point = |step, loss| MetricPoint {
            step,
            loss,
            lr: 0.1,
            grad_norm: 1.0,
            tokens_per_s: 1.0,
            step_ms: 1.0,
            ..Default::default()
        };
        let replayed = Replayed { metrics: HashMap::from([(3, point(3, 1.0))]), last_log_id: None };
        hub.publish(7, StreamEvent::Metric(point(3, 1.0))); // duplicate of the replay
        hub.publish(7, StreamEvent::Metric(point(4, 0.9)));
        hub.publish(7, StreamEvent::Status(finished(ExperimentStatus::Succeeded, None)));
        hub.publish(7, StreamEvent::Metric(point(5, 0.8))); // after the end: not sent
        let got: Vec<StreamEvent> = live_events(sub, replayed).collect().await;
        assert_eq!(got.len(), 2, "{got:?}");
        assert_eq!(got[0], StreamEvent::Metric(point(4, 0.9)));
        assert!(matches!(&got[1], StreamEvent::Status(s) if s.status == ExperimentStatus::Succeeded));
    }

    #[tokio::test]
    async fn live_skips_log_lines_the_replay_sent() {
        let hub = Arc::new(Hub::new(4, 4));
        let sub = hub.subscribe(9);
        let line = |m: &str| LogLine { level: LogLevel::Info, message: m.into() };
        hub.publish_log(9, Some(11), line("replayed")); // stored before the replay read
        hub.publish_log(9, Some(12), line("same text, new line"));
        hub.publish_log(9, None, line("not stored"));
        hub.publish(9, StreamEvent::Status(finished(ExperimentStatus::Cancelled, None)));
        let got: Vec<StreamEvent> =
            live_events(sub, Replayed { last_log_id: Some(11), ..Replayed::default() }).collect().await;
        let logs: Vec<&str> = got
            .iter()
            .filter_map(|e| match e {
                StreamEvent::Log(l) => Some(l.message.as_str()),
                _ => None,
            })
            .collect();
        assert_eq!(logs, vec!["same text, new line", "not stored"]);
        assert_eq!(got.len(), 3, "{got:?}");
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
