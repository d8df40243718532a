//! `GET /metrics`: the server in Prometheus' text format (OpenMetrics), for whoever runs
//! it for a class or a department: the queue, the runs, the leases, the workers'
//! heartbeats, and every request's count and latency by route.
//!
//! Requests are counted by a middleware as they pass (route template, not the path, so
//! `/api/experiments/{id}` is one series however many experiments there are); the queue's
//! numbers are read from the store when Prometheus scrapes. (The registry itself:
//! `metrics_registry.rs`.)

use std::time::Instant;

use axum::extract::{MatchedPath, Request, State};
use axum::http::header;
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use distlab_common::AuthMode;
use prometheus_client::encoding::text::encode;
use subtle::ConstantTimeEq;

use crate::api::error::HttpError;
use crate::api::session;
use crate::store::gauges;
use crate::{clock, AppState};

/// How long after its last heartbeat a worker is still listed.
const WORKER_SHOWN_FOR_S: f64 = 3600.0;

/// A label value Prometheus' text format can carry whatever a worker named itself: the
/// encoder does not escape quotes, backslashes or line breaks.
fn label_value(text: &str) -> String {
    text.chars().map(|c| if c == '"' || c == '\\' || c.is_control() { '_' } else { c }).take(80).collect()
}

/// Middleware: counts every request and times it, by its route's template.
pub async fn record(State(state): State<AppState>, req: Request, next: Next) -> Response {
    let route = req.extensions().get::<MatchedPath>().map_or("unmatched", |p| p.as_str()).to_string();
    // A client may send any method: the label takes the standard ones (bounded series).
    let method = match req.method().as_str() {
        m @ ("GET" | "POST" | "PUT" | "DELETE" | "PATCH" | "HEAD" | "OPTIONS") => m,
        _ => "other",
    }
    .to_string();
    let started = Instant::now();
    let response = next.run(req).await;
    let m = &state.metrics;
    let labels = vec![("method", method), ("route", route)];
    m.latency.get_or_create(&labels).observe(started.elapsed().as_secs_f64());
    let mut with_status = labels;
    with_status.push(("status", response.status().as_u16().to_string()));
    m.requests.get_or_create(&with_status).inc();
    response
}

/// `GET /metrics`
#[utoipa::path(
    get, path = "/metrics", operation_id = "prometheus_metrics", tag = "operations",
    responses(
        (status = 200, description = "Prometheus text format (OpenMetrics): queue, experiments, leases, workers, requests", content_type = "application/openmetrics-text"),
    ),
)]
pub async fn metrics(State(state): State<AppState>) -> Result<Response, HttpError> {
    let now = clock::now();
    let alive_since = clock::before(now, state.config.worker_alive_window());
    let q = gauges::gauges(&state.db, &clock::rfc3339(now), &alive_since).await?;
    let m = &state.metrics;
    for (status, count) in &q.by_status {
        m.experiments.get_or_create(&vec![("status", status.clone())]).set(*count);
    }
    m.queue_depth.set(q.queued);
    m.leases.set(q.leases);
    m.workers_alive.set(q.workers_alive);
    // Workers heard from within the last hour (a worker gone for good drops out).
    m.heartbeat_age.clear();
    for (worker, last_seen) in &q.last_seen {
        let Some(seen) = clock::parse_time(last_seen) else { continue };
        let age = now.duration_since(seen).map_or(0.0, |d| d.as_secs_f64());
        if age <= WORKER_SHOWN_FOR_S {
            m.heartbeat_age.get_or_create(&vec![("worker", label_value(worker))]).set(age);
        }
    }
    let mut text = String::new();
    encode(&mut text, &m.registry).map_err(|e| HttpError::internal("encoding the metrics", e))?;
    Ok(([(header::CONTENT_TYPE, "application/openmetrics-text; version=1.0.0; charset=utf-8")], text).into_response())
}

/// Middleware on `/metrics`: with `--auth accounts` only an admin's session or a request
/// bearing the worker token (a Prometheus scraper's `bearer_token`) reads it, since it
/// names the workers and counts everyone's experiments; without accounts it is the local
/// user's, like everything else.
pub async fn require_reader(State(state): State<AppState>, req: Request, next: Next) -> Response {
    if state.config.auth == AuthMode::None {
        return next.run(req).await;
    }
    let bearer = req
        .headers()
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Bearer "))
        .map(str::trim);
    if bearer.is_some_and(|t| bool::from(t.as_bytes().ct_eq(state.config.worker_token.as_bytes()))) {
        return next.run(req).await;
    }
    let caller = session::caller(&state, req.headers()).await;
    match caller {
        Ok(Some(account)) if account.admin => next.run(req).await,
        Ok(Some(_)) => HttpError::forbidden("the server's metrics are for admins (teachers)").into_response(),
        Ok(None) => HttpError::unauthorized(
            "sign in as an admin, or send Authorization: Bearer <the worker token> (a scraper's bearer_token)",
        )
        .into_response(),
        Err(e) => e.into_response(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_workers_name_cannot_break_the_text_format() {
        assert_eq!(label_value("gpu-box #3"), "gpu-box #3");
        assert_eq!(label_value("a\"b\\c\nd"), "a_b_c_d");
        assert_eq!(label_value(&"x".repeat(200)).len(), 80);
    }
}
