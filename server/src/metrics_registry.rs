//! What `GET /metrics` reports, registered once per server: the Prometheus registry with
//! its request counters and latencies (filled by the request middleware as requests pass)
//! and the queue's gauges (set from the store when Prometheus scrapes); `api/metrics.rs`
//! does both.

use std::sync::atomic::AtomicU64;

use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{exponential_buckets, Histogram};
use prometheus_client::registry::Registry;

/// A series' labels.
pub(crate) type Labels = Vec<(&'static str, String)>;

/// What the server counts, registered once.
pub struct ServerMetrics {
    pub(crate) registry: Registry,
    pub(crate) requests: Family<Labels, Counter>,
    pub(crate) latency: Family<Labels, Histogram>,
    pub(crate) experiments: Family<Labels, Gauge>,
    pub(crate) queue_depth: Gauge,
    pub(crate) leases: Gauge,
    pub(crate) workers_alive: Gauge,
    pub(crate) heartbeat_age: Family<Labels, Gauge<f64, AtomicU64>>,
}

impl Default for ServerMetrics {
    fn default() -> Self {
        let mut registry = Registry::with_prefix("distlab");
        let requests = Family::<Labels, Counter>::default();
        // 1 ms to about 16 s.
        let latency =
            Family::<Labels, Histogram>::new_with_constructor(|| Histogram::new(exponential_buckets(0.001, 2.0, 15)));
        let experiments = Family::<Labels, Gauge>::default();
        let (queue_depth, leases, workers_alive) = (Gauge::default(), Gauge::default(), Gauge::default());
        let heartbeat_age = Family::<Labels, Gauge<f64, AtomicU64>>::default();
        registry.register("http_requests", "HTTP requests answered, by method, route and status", requests.clone());
        registry.register(
            "http_request_duration_seconds",
            "Time to answer an HTTP request, by method and route (live streams: until the stream opens)",
            latency.clone(),
        );
        registry.register("experiments", "Experiments by status", experiments.clone());
        registry.register("queue_depth", "Experiments waiting for a worker", queue_depth.clone());
        registry.register("leases", "Running experiments whose worker's lease has not expired", leases.clone());
        registry.register("workers_alive", "Workers seen within the alive window", workers_alive.clone());
        registry.register(
            "worker_heartbeat_age_seconds",
            "Seconds since each registered worker was last heard from",
            heartbeat_age.clone(),
        );
        Self { registry, requests, latency, experiments, queue_depth, leases, workers_alive, heartbeat_age }
    }
}
