//! The live stream of an experiment: the SSE endpoint `GET /api/experiments/{id}/stream`.
//!
//! A stream sends the current status, then the last LOG_REPLAY stored log lines (oldest
//! first) and every stored metric point (replay), then live events as workers report them
//! (from the hub, `live/hub.rs`). It ends after a finished status (succeeded, failed,
//! cancelled), which is always its last event. To lose nothing between the replay and the
//! live part, the handler subscribes first and reads the database second; live metric
//! points identical to replayed ones, and live log lines whose stored id is not above the
//! last replayed one, are then skipped.

use std::collections::HashMap;
use std::convert::Infallible;
use std::time::Duration;

use axum::extract::{Path, State};
use axum::response::sse::{Event, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use axum::Extension;
use distlab_common::{LogLevel, LogLine, MetricPoint, StatusChange, StreamEvent};
use futures::stream::{self, Stream, StreamExt};
use tokio::sync::broadcast;

use crate::api::error::HttpError;
use crate::api::extract::parse_id;
use crate::live::hub::{Published, StreamRefused, Subscription, TOPIC_CAPACITY};
use crate::store::accounts::Account;
use crate::{store, AppState};

/// How many of the last replayed metric points are remembered to skip their live duplicates.
const DEDUP_WINDOW: usize = TOPIC_CAPACITY;
const KEEP_ALIVE: Duration = Duration::from_secs(15);
/// Stored log lines a new stream replays (the latest ones).
pub const LOG_REPLAY: i64 = 200;

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
    let view = store::experiments::load(&state.db, id).await?.ok_or_else(|| HttpError::no_experiment(id))?;
    let logs = store::experiments::load_recent_logs(&state.db, id, LOG_REPLAY).await?;
    let metrics = store::experiments::load_metrics(&state.db, id).await?;

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
            let (event, log_id) = match live.subscription.recv().await {
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
    use std::sync::Arc;

    use super::*;
    use crate::live::hub::Hub;
    use distlab_common::ExperimentStatus;

    fn finished(status: ExperimentStatus, error: Option<String>) -> StatusChange {
        StatusChange { status, error, summary: None }
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
}
