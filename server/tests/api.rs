//! The HTTP API, driven through `app()` with `oneshot` on a temporary SQLite database.

mod store;

use std::collections::HashSet;
use std::time::{Duration, SystemTime};

use axum::body::Body;
use axum::http::{header, Method, Request, StatusCode};
use axum::Router;
use distlab_common::*;
use distlab_server::{app, AppState, ServerConfig};
use http_body_util::BodyExt;
use serde_json::{json, Value};
use tower::ServiceExt;

const TOKEN: &str = "test-worker-token";

struct TestApp {
    app: Router,
    state: AppState,
    dir: tempfile::TempDir,
    /// Each registered worker's credential, by worker id.
    credentials: std::sync::Mutex<std::collections::HashMap<i64, String>>,
}

async fn setup_with(edit: impl FnOnce(&mut ServerConfig)) -> TestApp {
    let dir = tempfile::tempdir().expect("temp dir");
    let mut config = ServerConfig {
        data_dir: dir.path().join("data"),
        static_dir: dir.path().join("site"),
        local_workers: 0,
        worker_token: TOKEN.into(),
        ..ServerConfig::default()
    };
    config.database_url = store::database_url().await;
    edit(&mut config);
    let state = AppState::new(config).await.expect("state");
    TestApp { app: app(state.clone()), state, dir, credentials: Default::default() }
}

async fn setup() -> TestApp {
    setup_with(|_| {}).await
}

struct Answer {
    status: StatusCode,
    headers: axum::http::HeaderMap,
    body: Value,
}

impl TestApp {
    async fn send(&self, req: Request<Body>) -> axum::response::Response {
        self.app.clone().oneshot(req).await.expect("infallible")
    }

    async fn call(&self, method: Method, uri: &str, body: Option<Value>, token: Option<&str>) -> Answer {
        let mut req = Request::builder().method(method).uri(uri);
        if let Some(token) = token {
            req = req.header(header::AUTHORIZATION, format!("Bearer {token}"));
        }
        let req = match body {
            Some(body) => req.header(header::CONTENT_TYPE, "application/json").body(Body::from(body.to_string())),
            None => req.body(Body::empty()),
        }
        .expect("request");
        answer(self.send(req).await).await
    }

    async fn get(&self, uri: &str) -> Answer {
        self.call(Method::GET, uri, None, None).await
    }

    async fn post(&self, uri: &str, body: Value) -> Answer {
        self.call(Method::POST, uri, Some(body), None).await
    }

    /// POSTs to the worker API as a worker would: `register` with the worker token (keeping
    /// the credential it answers), the rest with the credential of the body's `worker_id`.
    async fn worker(&self, path: &str, body: Value) -> Answer {
        let bearer = if path == "register" {
            TOKEN.to_string()
        } else {
            let credentials = self.credentials.lock().unwrap();
            body["worker_id"].as_i64().and_then(|id| credentials.get(&id).cloned()).unwrap_or_default()
        };
        let a = self.call(Method::POST, &format!("/api/workers/{path}"), Some(body), Some(&bearer)).await;
        if let (Some(id), Some(credential)) = (a.body["worker_id"].as_i64(), a.body["credential"].as_str()) {
            self.credentials.lock().unwrap().insert(id, credential.to_string());
        }
        a
    }

    fn credential(&self, worker: i64) -> String {
        self.credentials.lock().unwrap()[&worker].clone()
    }

    async fn register(&self, backends: &[&str]) -> i64 {
        let a = self
            .worker(
                "register",
                json!({"name": "w", "backends": backends, "devices": ["cpu: 2 cores"], "version": VERSION}),
            )
            .await;
        assert_eq!(a.status, StatusCode::OK, "{}", a.body);
        a.body["worker_id"].as_i64().expect("worker_id")
    }

    /// A worker that runs at most `ranks` ranks at once.
    async fn register_ranks(&self, ranks: u32) -> i64 {
        let body = json!({"name": "w", "backends": ["cpu"], "devices": [], "version": VERSION, "ranks": ranks});
        let a = self.worker("register", body).await;
        assert_eq!(a.status, StatusCode::OK, "{}", a.body);
        a.body["worker_id"].as_i64().expect("worker_id")
    }

    async fn create_with(&self, spec: Value) -> i64 {
        let a = self.post("/api/experiments", spec).await;
        assert_eq!(a.status, StatusCode::CREATED, "{}", a.body);
        a.body["id"].as_i64().expect("id")
    }

    async fn create(&self, name: &str) -> i64 {
        let a = self.post("/api/experiments", json!({"name": name, "train": {"steps": 10}})).await;
        assert_eq!(a.status, StatusCode::CREATED, "{}", a.body);
        a.body["id"].as_i64().expect("id")
    }

    /// Leases the next experiment for `worker`; panics on 204.
    async fn lease(&self, worker: i64) -> Lease {
        let a = self.worker("lease", json!({"worker_id": worker})).await;
        assert_eq!(a.status, StatusCode::OK, "{}", a.body);
        serde_json::from_value(a.body).expect("Lease")
    }

    async fn view(&self, id: i64) -> ExperimentView {
        let a = self.get(&format!("/api/experiments/{id}")).await;
        assert_eq!(a.status, StatusCode::OK, "{}", a.body);
        serde_json::from_value(a.body).expect("ExperimentView")
    }
}

async fn answer(resp: axum::response::Response) -> Answer {
    let status = resp.status();
    let headers = resp.headers().clone();
    let bytes = resp.into_body().collect().await.expect("body").to_bytes();
    let body = if bytes.is_empty() {
        Value::Null
    } else {
        serde_json::from_slice(&bytes).unwrap_or_else(|_| Value::String(String::from_utf8_lossy(&bytes).into()))
    };
    Answer { status, headers, body }
}

/// Every error answer has the JSON shape `{"error": "...", "fields": [...]}`.
fn assert_api_error(a: &Answer, status: StatusCode) -> ApiError {
    assert_eq!(a.status, status, "{}", a.body);
    serde_json::from_value::<ApiError>(a.body.clone()).unwrap_or_else(|e| panic!("not an ApiError ({e}): {}", a.body))
}

fn metric(step: u64, loss: f64) -> Value {
    json!({"type": "metric", "step": step, "loss": loss, "lr": 0.001, "grad_norm": 1.0, "tokens_per_s": 1000.0, "step_ms": 5.0})
}

fn summary() -> Value {
    serde_json::to_value(RunSummary {
        steps: 3,
        final_loss: 3.0,
        min_loss: 3.0,
        uniform_loss: 4.1,
        ..RunSummary::default()
    })
    .expect("summary")
}

fn in_an_hour() -> SystemTime {
    SystemTime::now() + Duration::from_secs(3600)
}

/// A small trace of one rank of a `world`-rank DP run: a forward, a backward, one
/// all-reduce with `ring_steps` recorded steps.
fn rank_trace(rank: u32, world: u32, ring_steps: u32) -> trace::RankTrace {
    use trace::*;
    let span = |kind, name: &str, lane: &str, start_us, end_us| Span {
        kind,
        name: name.into(),
        step: 0,
        lane: lane.into(),
        start_us,
        end_us,
        layer: None,
        bucket: None,
        bytes: None,
        micro: None,
        chunk: None,
    };
    let t0 = 1_700_000_000_000_000 + u64::from(rank);
    let steps: Vec<RingStep> = (0..ring_steps)
        .map(|i| RingStep {
            collective: 0,
            phase: if i % 2 == 0 { RingPhase::ReduceScatter } else { RingPhase::AllGather },
            step: i,
            chunk: (rank + i) % world,
            from: rank,
            to: (rank + 1) % world,
            bytes: 4096,
            start_us: t0 + 200 + u64::from(i),
            end_us: t0 + 201 + u64::from(i),
            values: None,
        })
        .collect();
    RankTrace {
        rank,
        world,
        memory: None,
        host: None,
        applied_gradients: Vec::new(),
        span_steps: 1,
        spans: vec![
            span(SpanKind::Forward, "forward", "compute", t0, t0 + 100),
            span(SpanKind::Backward, "backward", "compute", t0 + 100, t0 + 200),
            Span {
                bucket: Some(0),
                bytes: Some(8192),
                ..span(SpanKind::Comm, "all_reduce bucket 0", "comm", t0 + 200, t0 + 300)
            },
        ],
        comm: RankCommTrace {
            rank,
            detail_limit: 16,
            collectives: vec![CollectiveRecord {
                id: 0,
                op: CollectiveOp::AllReduce,
                group: "dp".into(),
                ranks: (0..world).collect(),
                elements: 2048,
                bytes_sent: 2 * u64::from(world - 1) * 8192 / u64::from(world),
                bytes_from_formula: false,
                start_us: t0 + 200,
                end_us: t0 + 300,
                input: Some(vec![1.0, 2.0]),
                output: Some(vec![3.0, 6.0]),
            }],
            steps,
            evaluation: vec![],
            sent_to: vec![],
            counters: vec![CollectiveCounter {
                op: CollectiveOp::AllReduce,
                calls: 1,
                elements: 2048,
                bytes_sent: 8192,
                bytes_from_formula: false,
                total_us: 100,
            }],
        },
    }
}

fn trace_event(trace: &trace::RankTrace) -> Value {
    serde_json::to_value(RunEvent::Trace(trace.clone())).expect("trace event")
}

/// Registers a worker, creates an experiment with `parallel` and leases it: (worker, id).
async fn running(t: &TestApp, parallel: Value) -> (i64, i64) {
    let worker = t.register(&["cpu"]).await;
    let a = t.post("/api/experiments", json!({"name": "traced", "parallel": parallel, "train": {"steps": 10}})).await;
    assert_eq!(a.status, StatusCode::CREATED, "{}", a.body);
    let id = a.body["id"].as_i64().expect("id");
    assert_eq!(t.lease(worker).await.experiment_id, id);
    (worker, id)
}

async fn get_trace(t: &TestApp, id: i64) -> trace::ExperimentTrace {
    let a = t.get(&format!("/api/experiments/{id}/trace")).await;
    assert_eq!(a.status, StatusCode::OK, "{}", a.body);
    serde_json::from_value(a.body).expect("ExperimentTrace")
}

async fn log_count(t: &TestApp, id: i64) -> i64 {
    sqlx::query_scalar("SELECT COUNT(*) FROM logs WHERE experiment_id = $1")
        .bind(id)
        .fetch_one(&t.state.db)
        .await
        .expect("logs")
}

// ---------------------------------------------------------------- user API

#[tokio::test]
async fn health_reports_version_workers_and_queue() {
    let t = setup().await;
    let a = t.get("/api/health").await;
    assert_eq!(a.status, StatusCode::OK);
    assert_eq!(a.body, json!({"status": "ok", "version": VERSION, "workers": 0, "queued": 0}));
    t.register(&["cpu"]).await;
    t.create("a").await;
    let h: Health = serde_json::from_value(t.get("/api/health").await.body).expect("Health");
    assert_eq!((h.workers, h.queued), (1, 1));
}

#[tokio::test]
async fn create_get_and_list_experiments() {
    let t = setup().await;
    let resp = t
        .send(
            Request::post("/api/experiments")
                .header(header::CONTENT_TYPE, "application/json")
                .body(Body::from(r#"{"name": "first"}"#))
                .expect("request"),
        )
        .await;
    assert_eq!(resp.headers().get(header::LOCATION).and_then(|v| v.to_str().ok()), Some("/api/experiments/1"));
    let a = answer(resp).await;
    assert_eq!(a.status, StatusCode::CREATED);
    assert_eq!(a.body, json!({"id": 1, "status": "queued"}));
    let second = t.create("second").await;
    let third = t.create("third").await;

    let v = t.view(1).await;
    assert_eq!(v.name, "first");
    assert_eq!(v.status, ExperimentStatus::Queued);
    assert_eq!(v.spec, ExperimentSpec { name: "first".into(), ..ExperimentSpec::default() });
    assert_eq!((v.attempt, v.steps_done), (0, 0));
    assert!(v.created_at.ends_with('Z') && v.started_at.is_none() && v.summary.is_none());

    let list: ExperimentList = serde_json::from_value(t.get("/api/experiments").await.body).expect("list");
    assert_eq!(list.total, 3);
    let ids: Vec<i64> = list.experiments.iter().map(|e| e.id).collect();
    assert_eq!(ids, vec![third, second, 1], "newest first");

    let page: ExperimentList =
        serde_json::from_value(t.get("/api/experiments?limit=1&offset=1").await.body).expect("page");
    assert_eq!((page.total, page.experiments.len(), page.experiments[0].id), (3, 1, second));

    t.post(&format!("/api/experiments/{second}/cancel"), json!({})).await;
    let cancelled: ExperimentList =
        serde_json::from_value(t.get("/api/experiments?status=cancelled").await.body).expect("filtered");
    assert_eq!(cancelled.total, 1);
    assert_eq!(cancelled.experiments[0].id, second);

    // Pages are bounded: a huge limit is clamped, not refused.
    assert_eq!(t.get("/api/experiments?limit=100000").await.status, StatusCode::OK);
    let e = assert_api_error(&t.get("/api/experiments?limit=ten").await, StatusCode::BAD_REQUEST);
    assert_eq!(e.fields[0].field, "limit");
    let e = assert_api_error(&t.get("/api/experiments?status=sleeping").await, StatusCode::BAD_REQUEST);
    assert!(e.error.contains("queued, running"), "{}", e.error);
}

/// The list is kept between requests (`read_cache.rs`), and every change the server makes
/// shows at the next request: a submission, a lease, metrics, the end of a run (each way),
/// a cancel, a run taken back by the reaper, a deletion. A change made behind the server's
/// back shows within `read_cache::MAX_AGE`.
#[tokio::test]
async fn the_list_shows_every_change_at_the_next_request() {
    let t = setup().await;
    let list = || async {
        let list: ExperimentList = serde_json::from_value(t.get("/api/experiments").await.body).expect("list");
        list.experiments.into_iter().map(|e| (e.id, e.status, e.steps_done)).collect::<Vec<_>>()
    };
    use ExperimentStatus::*;
    assert_eq!(list().await, vec![]);
    let a = t.create("a").await;
    assert_eq!(list().await, vec![(a, Queued, 0)]);
    let worker = t.register(&["cpu"]).await;
    assert_eq!(t.lease(worker).await.experiment_id, a);
    assert_eq!(list().await, vec![(a, Running, 0)]);
    let events = json!({"worker_id": worker, "experiment_id": a, "events": [metric(0, 3.5), metric(1, 3.4)]});
    assert_eq!(t.worker("events", events).await.status, StatusCode::OK);
    assert_eq!(list().await, vec![(a, Running, 2)]);
    let done = t.worker("complete", json!({"worker_id": worker, "experiment_id": a, "summary": summary()})).await;
    assert_eq!(done.status, StatusCode::OK, "{}", done.body);
    assert_eq!(list().await, vec![(a, Succeeded, 2)]);

    let b = t.create("b").await;
    assert_eq!(t.lease(worker).await.experiment_id, b);
    let failed = t.worker("fail", json!({"worker_id": worker, "experiment_id": b, "error": "boom"})).await;
    assert_eq!(failed.status, StatusCode::OK, "{}", failed.body);
    let c = t.create("c").await;
    assert_eq!(t.post(&format!("/api/experiments/{c}/cancel"), json!({})).await.status, StatusCode::OK);
    assert_eq!(list().await, vec![(c, Cancelled, 0), (b, Failed, 0), (a, Succeeded, 2)]);

    let d = t.create("d").await;
    assert_eq!(t.lease(worker).await.experiment_id, d);
    assert_eq!(list().await[0], (d, Running, 0));
    let reaped = t.state.reap_expired(in_an_hour()).await.expect("reap");
    assert_eq!(reaped.len(), 1);
    assert_eq!(list().await[0], (d, Queued, 0), "back in the queue");
    assert_eq!(
        t.call(Method::DELETE, &format!("/api/experiments/{c}"), None, None).await.status,
        StatusCode::NO_CONTENT
    );
    assert_eq!(list().await, vec![(d, Queued, 0), (b, Failed, 0), (a, Succeeded, 2)]);

    // A browser's request gets the same page gzipped; `q=0` refuses it.
    let t = &t;
    let gzipped = |accept: &'static str| async move {
        let req = Request::get("/api/experiments").header(header::ACCEPT_ENCODING, accept).body(Body::empty());
        let resp = t.send(req.expect("request")).await;
        let encoding = resp.headers().get(header::CONTENT_ENCODING).map(|v| v.to_str().unwrap().to_string());
        let bytes = resp.into_body().collect().await.expect("body").to_bytes();
        (encoding, bytes)
    };
    let plain = gzipped("identity").await;
    assert_eq!(plain.0, None);
    assert_eq!(gzipped("gzip;q=0, identity").await, plain);
    let (encoding, gz) = gzipped("gzip, deflate, br").await;
    assert_eq!(encoding.as_deref(), Some("gzip"));
    let mut json = Vec::new();
    std::io::Read::read_to_end(&mut flate2::read::GzDecoder::new(&gz[..]), &mut json).expect("gunzip");
    assert_eq!(json, plain.1);

    // Behind the server's back: the kept page until it is MAX_AGE old.
    sqlx::query("UPDATE experiments SET status = 'cancelled' WHERE id = $1")
        .bind(d)
        .execute(&t.state.db)
        .await
        .expect("an update");
    assert_eq!(list().await[0], (d, Queued, 0), "the kept page");
    tokio::time::sleep(distlab_server::read_cache::MAX_AGE).await;
    assert_eq!(list().await[0], (d, Cancelled, 0), "read anew");
}

#[tokio::test]
async fn invalid_spec_lists_every_problem_with_422() {
    let t = setup().await;
    let a = t
        .post(
            "/api/experiments",
            json!({"name": "bad", "model": {"heads": 5}, "parallel": {"tp": 2}, "train": {"steps": 0, "warmup_steps": 0}}),
        )
        .await;
    let e = assert_api_error(&a, StatusCode::UNPROCESSABLE_ENTITY);
    let fields: HashSet<&str> = e.fields.iter().map(|f| f.field.as_str()).collect();
    assert!(e.fields.len() >= 3, "{e:?}");
    assert!(
        fields.contains("model.heads") && fields.contains("parallel.tp") && fields.contains("train.steps"),
        "{e:?}"
    );

    // Unknown fields and values name their path.
    let e = assert_api_error(
        &t.post("/api/experiments", json!({"train": {"stepz": 3}})).await,
        StatusCode::UNPROCESSABLE_ENTITY,
    );
    assert_eq!(e.fields[0].field, "train.stepz");
    let e = assert_api_error(
        &t.post("/api/experiments", json!({"parallel": {"sharding": "zero4"}})).await,
        StatusCode::UNPROCESSABLE_ENTITY,
    );
    assert_eq!(e.fields[0].field, "parallel.sharding");
    assert_eq!(t.get("/api/health").await.body["queued"], 0);
}

#[tokio::test]
async fn cuda_needs_a_worker_that_offers_it() {
    let t = setup().await;
    t.register(&["cpu"]).await;
    let a = t.post("/api/experiments", json!({"name": "gpu", "backend": "cuda"})).await;
    let e = assert_api_error(&a, StatusCode::UNPROCESSABLE_ENTITY);
    assert_eq!(e.fields, vec![FieldError::new("backend", "no registered worker offers the cuda backend")]);

    let gpu_worker = t.register(&["cpu", "cuda"]).await;
    let cpu_only = t.register(&["cpu"]).await;
    let a = t.post("/api/experiments", json!({"name": "gpu", "backend": "cuda"})).await;
    assert_eq!(a.status, StatusCode::CREATED, "{}", a.body);
    // Only a worker that offers cuda leases it.
    assert_eq!(t.worker("lease", json!({"worker_id": cpu_only})).await.status, StatusCode::NO_CONTENT);
    assert_eq!(t.lease(gpu_worker).await.spec.backend, BackendKind::Cuda);
    // What the cuda backend leaves to the CPU (a collective demo) is refused at submission,
    // naming the field; every strategy is accepted.
    let demo = json!({"name": "gpu-demo", "backend": "cuda", "parallel": {"dp": 2}, "demo": {"op": "all_reduce"}});
    let e = assert_api_error(&t.post("/api/experiments", demo).await, StatusCode::UNPROCESSABLE_ENTITY);
    assert_eq!(e.fields.iter().map(|f| f.field.as_str()).collect::<Vec<_>>(), ["demo"]);
    let mesh =
        json!({"name": "gpu-3d", "backend": "cuda", "parallel": {"dp": 2, "tp": 2, "pp": 2, "sharding": "fsdp"}});
    let a = t.post("/api/experiments", mesh).await;
    assert_eq!(a.status, StatusCode::CREATED, "{}", a.body);
}

#[tokio::test]
async fn malformed_requests_get_400_in_the_json_shape() {
    let t = setup().await;
    let raw = |body: &'static str, ct: &'static str| {
        Request::post("/api/experiments").header(header::CONTENT_TYPE, ct).body(Body::from(body)).expect("request")
    };
    for req in [raw("{not json", "application/json"), raw("", "application/json")] {
        let a = answer(t.send(req).await).await;
        let e = assert_api_error(&a, StatusCode::BAD_REQUEST);
        assert!(!e.error.is_empty());
    }
    // A body not declared as JSON is refused before it is read (a form on another site can
    // send text/plain or a form without asking the browser first).
    let untyped = Request::post("/api/experiments").body(Body::from(r#"{"name": "x"}"#)).expect("request");
    for req in [raw("name=x", "application/x-www-form-urlencoded"), raw(r#"{"name": "x"}"#, "text/plain"), untyped] {
        let a = answer(t.send(req).await).await;
        let e = assert_api_error(&a, StatusCode::UNSUPPORTED_MEDIA_TYPE);
        assert!(e.error.contains("Content-Type: application/json"), "{}", e.error);
    }
    assert_eq!(t.get("/api/experiments").await.body["total"], 0, "nothing was queued");
    // Worker bodies of the wrong shape name the field.
    let worker = t.register(&["cpu"]).await;
    let seven = Some(json!({"worker_id": "seven"}));
    let a = t.call(Method::POST, "/api/workers/lease", seven, Some(&t.credential(worker))).await;
    let e = assert_api_error(&a, StatusCode::BAD_REQUEST);
    assert_eq!(e.fields[0].field, "worker_id");
}

/// A page of another origin cannot change anything through a visitor's browser: every
/// state-changing request whose Origin (or Referer) is not this server gets 403; the same
/// origin, and clients that are not pages (no Origin, no Referer), pass.
#[tokio::test]
async fn state_changes_from_another_origin_are_refused() {
    let t = setup().await;
    let body = json!({"name": "from-a-page"}).to_string();
    let from = |origin: Option<(&'static str, &'static str)>| {
        let mut req = Request::post("/api/experiments")
            .header(header::HOST, "127.0.0.1:8080")
            .header(header::CONTENT_TYPE, "application/json");
        if let Some((name, value)) = origin {
            req = req.header(name, value);
        }
        req.body(Body::from(body.clone())).expect("request")
    };
    for foreign in [
        ("origin", "http://evil.example"),
        ("origin", "http://127.0.0.1:8081"),
        ("origin", "null"),
        ("referer", "http://evil.example/page.html"),
    ] {
        let a = answer(t.send(from(Some(foreign))).await).await;
        let e = assert_api_error(&a, StatusCode::FORBIDDEN);
        assert!(e.error.contains("another origin"), "{foreign:?}: {}", e.error);
    }
    let cancel = Request::post("/api/experiments/1/cancel")
        .header(header::HOST, "127.0.0.1:8080")
        .header(header::ORIGIN, "http://evil.example")
        .body(Body::empty())
        .expect("request");
    assert_api_error(&answer(t.send(cancel).await).await, StatusCode::FORBIDDEN);
    assert_eq!(t.get("/api/experiments").await.body["total"], 0, "nothing was queued");
    for same in [Some(("origin", "http://127.0.0.1:8080")), Some(("referer", "http://127.0.0.1:8080/new")), None] {
        let a = answer(t.send(from(same)).await).await;
        assert_eq!(a.status, StatusCode::CREATED, "{same:?}: {}", a.body);
    }
    // Reading is not a state change: a GET from anywhere is answered.
    let read = Request::get("/api/experiments").header(header::ORIGIN, "http://evil.example").body(Body::empty());
    assert_eq!(answer(t.send(read.expect("request")).await).await.status, StatusCode::OK);
}

/// DNS rebinding: a page at rebind.evil.example whose name is re-pointed at 127.0.0.1 is
/// same-origin with itself. A server without accounts answers only to loopback names, so
/// neither its POST nor its reads reach the lab; this machine's own names still do.
#[tokio::test]
async fn a_lab_without_accounts_answers_only_to_loopback_names() {
    let t = setup().await;
    let page = "rebind.evil.example:8080";
    let post = Request::post("/api/experiments")
        .header(header::HOST, page)
        .header(header::ORIGIN, format!("http://{page}"))
        .header(header::CONTENT_TYPE, "application/json")
        .body(Body::from(json!({"name": "rebound"}).to_string()))
        .expect("request");
    let e = assert_api_error(&answer(t.send(post).await).await, StatusCode::FORBIDDEN);
    assert!(e.error.contains("rebind.evil.example"), "{}", e.error);
    let read = Request::get("/api/experiments").header(header::HOST, page).body(Body::empty()).expect("request");
    assert_api_error(&answer(t.send(read).await).await, StatusCode::FORBIDDEN);
    assert_eq!(t.get("/api/experiments").await.body["total"], 0, "nothing was queued");
    for host in ["localhost:8080", "127.0.0.1:8080", "[::1]:8080"] {
        let post = Request::post("/api/experiments")
            .header(header::HOST, host)
            .header(header::ORIGIN, format!("http://{host}"))
            .header(header::CONTENT_TYPE, "application/json")
            .body(Body::from(json!({"name": "local"}).to_string()))
            .expect("request");
        let a = answer(t.send(post).await).await;
        assert_eq!(a.status, StatusCode::CREATED, "{host}: {}", a.body);
    }
}

#[tokio::test]
async fn plan_of_a_tiny_spec_runs_nothing() {
    let t = setup().await;
    let body = json!({"name": "tiny", "parallel": {"dp": 2, "sharding": "zero2"}});
    let a = t.post("/api/plan", body.clone()).await;
    assert_eq!(a.status, StatusCode::OK, "{}", a.body);
    let got: planner::Plan = serde_json::from_value(a.body).expect("Plan");
    let spec = ExperimentSpec::from_json_value(body).expect("spec");
    assert_eq!(got, planner::plan(&spec).expect("plan"));
    assert_eq!((got.param_count, got.world_size, got.stages.len()), (spec.model.param_count(), 2, 1));
    let mem = &got.stages[0].memory;
    assert_eq!(mem.parameters, 4 * got.param_count);
    assert_eq!(mem.gradients, 4 * got.param_count.div_ceil(2));
    assert!(mem.activations > 0 && got.stages[0].comm.dp_reduce_scatter > 0);
    // Nothing was queued.
    assert_eq!(t.get("/api/health").await.body["queued"], 0);
    assert_eq!(t.get("/api/experiments").await.body["total"], 0);
}

#[tokio::test]
async fn plan_accepts_a_70b_model_on_1024_ranks_beyond_the_run_limits() {
    let t = setup().await;
    let body = json!({
        "name": "70b",
        "model": {"layers": 80, "d_model": 8192, "heads": 64, "seq_len": 4096, "vocab": 32000},
        "parallel": {"dp": 16, "tp": 8, "pp": 8, "sharding": "zero1"},
        "train": {"micro_batch": 1, "micro_batches": 32, "precision": "bf16", "checkpointing": "every"}
    });
    let a = t.post("/api/plan", body.clone()).await;
    assert_eq!(a.status, StatusCode::OK, "{}", a.body);
    let plan: planner::Plan = serde_json::from_value(a.body).expect("Plan");
    assert_eq!(plan.world_size, 1024);
    assert!(plan.param_count > 60_000_000_000, "{}", plan.param_count);
    assert_eq!(plan.stages.len(), 8);
    assert!(plan.stages.iter().all(|s| s.layers == 10 && s.memory.total > 0));
    assert!((plan.bubble_fraction - 7.0 / 39.0).abs() < 1e-12);
    // The same spec is far beyond what this server runs.
    let e = assert_api_error(&t.post("/api/experiments", body).await, StatusCode::UNPROCESSABLE_ENTITY);
    assert!(e.fields.iter().any(|f| f.field == "parallel"), "{e:?}");
}

#[tokio::test]
async fn plan_rejects_malformed_bodies_and_impossible_specs() {
    let t = setup().await;
    let raw = |body: &'static str| {
        Request::post("/api/plan")
            .header(header::CONTENT_TYPE, "application/json")
            .body(Body::from(body))
            .expect("request")
    };
    for body in ["{not json", "", "[1, 2"] {
        let e = assert_api_error(&answer(t.send(raw(body)).await).await, StatusCode::BAD_REQUEST);
        assert!(!e.error.is_empty());
    }
    let e =
        assert_api_error(&t.post("/api/plan", json!({"model": {"layerz": 2}})).await, StatusCode::UNPROCESSABLE_ENTITY);
    assert_eq!(e.fields[0].field, "model.layerz");
    let e = assert_api_error(
        &t.post("/api/plan", json!({"parallel": {"dp": 0, "tp": 3}})).await,
        StatusCode::UNPROCESSABLE_ENTITY,
    );
    let fields: HashSet<&str> = e.fields.iter().map(|f| f.field.as_str()).collect();
    assert_eq!(fields, HashSet::from(["parallel.dp", "parallel.tp"]), "{e:?}");
    let e =
        assert_api_error(&t.post("/api/plan", json!({"parallel": {"pp": 3}})).await, StatusCode::UNPROCESSABLE_ENTITY);
    assert!(e.fields[0].message.contains("pp=3 is more than layers=2"), "{e:?}");
}

#[tokio::test]
async fn layout_search_lists_the_fastest_layouts_that_fit_and_why_the_others_lose() {
    let t = setup().await;
    let llama3_70b = serde_json::to_value(
        distlab_common::estimate::model_presets().into_iter().find(|p| p.key == "llama3-70b").expect("preset").model,
    )
    .expect("json");
    let cluster = json!({"gpus": 64, "gpus_per_node": 8, "gpu_memory_bytes": 80_000_000_000u64});
    let body = json!({"model": llama3_70b, "cluster": cluster, "global_batch": 512});
    let a = t.post("/api/plan/layouts", body.clone()).await;
    assert_eq!(a.status, StatusCode::OK, "{}", a.body);
    let result: distlab_common::layout_search::SearchResult = serde_json::from_value(a.body).expect("SearchResult");
    assert_eq!(result.best.len(), distlab_common::layout_search::TOP);
    assert!(result.best.iter().all(|c| c.memory_per_gpu_bytes <= 80_000_000_000));
    assert!(result.best[0].loses_by.is_none() && result.best[1..].iter().all(|c| c.loses_by.is_some()));
    assert!(result.rejected.iter().any(|r| r.count > 0 && r.reason.contains("80 GB")), "{:?}", result.rejected);
    // Each layout is a spec the planner takes as it is.
    let planned = t.post("/api/plan", serde_json::to_value(&result.best[0].spec).expect("json")).await;
    assert_eq!(planned.status, StatusCode::OK, "{}", planned.body);

    // What cannot be searched is named field by field.
    let mut bad = body.clone();
    bad["cluster"]["gpus"] = json!(0);
    bad["global_batch"] = json!(0);
    bad["model"]["kv_heads"] = json!(3);
    let e = assert_api_error(&t.post("/api/plan/layouts", bad).await, StatusCode::UNPROCESSABLE_ENTITY);
    let fields: HashSet<&str> = e.fields.iter().map(|f| f.field.as_str()).collect();
    assert_eq!(fields, HashSet::from(["cluster.gpus", "global_batch", "model.kv_heads"]), "{e:?}");
    let mut unknown = body;
    unknown["gpus"] = json!(8);
    assert_api_error(&t.post("/api/plan/layouts", unknown).await, StatusCode::BAD_REQUEST);
}

/// `/api/openapi.json` describes every route, and every entry in it is a route: each is
/// answered by its own handler (an unknown route gets the API's "no API endpoint" 404).
#[tokio::test]
async fn the_openapi_document_has_every_route_and_nothing_else() {
    let t = setup().await;
    let a = t.get("/api/openapi.json").await;
    assert_eq!(a.status, StatusCode::OK, "{}", a.body);
    assert!(a.body["openapi"].as_str().is_some_and(|v| v.starts_with("3.1")), "{}", a.body["openapi"]);
    let mut documented = std::collections::BTreeSet::new();
    let mut operation_ids = HashSet::new();
    for (path, item) in a.body["paths"].as_object().expect("paths") {
        for method in ["get", "post", "put", "delete", "patch"] {
            if let Some(operation) = item.get(method) {
                assert!(!operation["responses"].as_object().expect("responses").is_empty(), "{method} {path}");
                let id = operation["operationId"].as_str().unwrap_or_default().to_string();
                assert!(operation_ids.insert(id.clone()), "{method} {path}: operationId {id} is used twice");
                documented.insert((method.to_uppercase(), path.clone()));
            }
        }
    }
    let every_route = [
        "GET /api/health",
        "POST /api/session",
        "DELETE /api/session",
        "GET /api/openapi.json",
        "GET /metrics",
        "GET /api/me",
        "PUT /api/me/password",
        "GET /api/users",
        "POST /api/users",
        "PUT /api/users/{name}/password",
        "DELETE /api/users/{name}/lock",
        "GET /api/experiments",
        "POST /api/experiments",
        "GET /api/experiments/{id}",
        "DELETE /api/experiments/{id}",
        "GET /api/experiments/{id}/metrics",
        "GET /api/experiments/{id}/attempts",
        "GET /api/experiments/{id}/trace",
        "GET /api/experiments/{id}/memory",
        "POST /api/experiments/{id}/cancel",
        "GET /api/experiments/{id}/stream",
        "GET /api/experiments/{id}/model",
        "GET /api/experiments/{id}/model/config",
        "GET /api/experiments/{id}/model/tokenizer",
        "POST /api/experiments/{id}/generate",
        "GET /api/compare",
        "POST /api/plan",
        "POST /api/plan/layouts",
        "GET /api/cards",
        "GET /api/cards/checks",
        "GET /api/profiles",
        "POST /api/profiles",
        "GET /api/profiles/{id}/review",
        "POST /api/profiles/{id}/reviews",
        "GET /api/profiles/{id}/settings",
        "PUT /api/profiles/{id}/settings",
        "POST /api/profiles/{id}/fit",
        "GET /api/profiles/{id}/export",
        "POST /api/profiles/{id}/import",
        "GET /api/quiz",
        "POST /api/quiz/answers",
        "GET /api/quiz/results",
        "GET /api/assignments",
        "POST /api/assignments",
        "GET /api/assignments/{id}",
        "POST /api/assignments/{id}/submissions",
        "PUT /api/assignments/{id}/submissions/{submission}/grade",
        "GET /api/assignments/{id}/grades.csv",
        "POST /api/workers/register",
        "POST /api/workers/lease",
        "POST /api/workers/heartbeat",
        "POST /api/workers/events",
        "POST /api/workers/complete",
        "POST /api/workers/fail",
        "POST /api/workers/rendezvous",
        "PUT /api/workers/experiments/{id}/model",
        "PUT /api/workers/experiments/{id}/tokenizer",
        "GET /api/datasets",
        "POST /api/datasets",
        "DELETE /api/datasets/{id}",
        "GET /api/workers/datasets/{id}",
    ];
    let expected: std::collections::BTreeSet<(String, String)> = every_route
        .iter()
        .map(|r| r.split_once(' ').map(|(m, p)| (m.to_string(), p.to_string())).expect("METHOD /path"))
        .collect();
    assert_eq!(documented, expected);
    for (method, path) in &documented {
        let uri = path.replace("{id}", "999999").replace("{name}", "nobody");
        let request = Request::builder().method(method.as_str()).uri(&uri).body(Body::empty()).expect("request");
        let reply = answer(t.send(request).await).await;
        let unrouted = reply.status == StatusCode::METHOD_NOT_ALLOWED
            || reply.body["error"].as_str().is_some_and(|e| e.starts_with("no API endpoint"));
        assert!(!unrouted, "{method} {path}: {} {}", reply.status, reply.body);
    }
    // Nothing is routed around the document: the app registers its routes through
    // utoipa_axum's `routes!` (with their #[utoipa::path]) and never with a bare `.route(`.
    let source = include_str!("../src/lib.rs");
    assert!(!source.contains(".route("), "server/src/lib.rs registers a route outside the OpenAPI document");
}

/// `POST /api/datasets` with a text body: listed, named in a spec, fetched by the worker
/// that runs it, and every bad upload refused with the field that is wrong.
#[tokio::test]
async fn uploaded_datasets_are_kept_listed_checked_and_served_to_workers() {
    let t = setup_with(|c| c.max_dataset_bytes = 4096).await;
    let upload = |name: &str, content_type: &str, body: Vec<u8>| {
        Request::post(format!("/api/datasets?name={name}"))
            .header(header::CONTENT_TYPE, content_type)
            .body(Body::from(body))
            .expect("request")
    };
    let text = "To be, or not to be, that is the question.\n".repeat(40); // 1,720 bytes
    let a = answer(t.send(upload("hamlet", "text/plain; charset=utf-8", text.clone().into_bytes())).await).await;
    assert_eq!(a.status, StatusCode::CREATED, "{}", a.body);
    let dataset: DatasetView = serde_json::from_value(a.body).expect("DatasetView");
    assert_eq!((dataset.name.as_str(), dataset.bytes, dataset.owner.as_str()), ("hamlet", 1720, "local"));
    // 1,720 bytes hold at most two windows of 859 + 1: one to train on, one held out.
    assert_eq!(dataset.max_seq_len, 859);
    let listed: DatasetList = serde_json::from_value(t.get("/api/datasets").await.body).expect("DatasetList");
    assert_eq!(listed.datasets, vec![dataset.clone()]);

    // Bad uploads: each says what is wrong, and nothing is kept.
    let e = assert_api_error(
        &answer(t.send(upload("latin1", "text/plain", b"caf\xe9 au lait".to_vec())).await).await,
        StatusCode::UNPROCESSABLE_ENTITY,
    );
    assert!(e.fields[0].message.contains("not UTF-8"), "{e:?}");
    let e = assert_api_error(
        &answer(t.send(upload("", "text/plain", b"some text".to_vec())).await).await,
        StatusCode::UNPROCESSABLE_ENTITY,
    );
    assert_eq!(e.fields[0].field, "name");
    assert_api_error(
        &answer(t.send(upload("big", "text/plain", vec![b'a'; 5000])).await).await,
        StatusCode::PAYLOAD_TOO_LARGE,
    );
    assert_api_error(
        &answer(t.send(upload("json", "application/json", b"{}".to_vec())).await).await,
        StatusCode::UNSUPPORTED_MEDIA_TYPE,
    );
    let e = assert_api_error(
        &answer(t.send(upload("tiny", "text/plain", b"ab".to_vec())).await).await,
        StatusCode::UNPROCESSABLE_ENTITY,
    );
    assert!(e.fields[0].message.contains("too few"), "{e:?}");
    let listed: DatasetList = serde_json::from_value(t.get("/api/datasets").await.body).expect("DatasetList");
    assert_eq!(listed.datasets.len(), 1);

    // A spec names it; a missing one, or one too short for seq_len, is refused at submission.
    let spec = |id: i64, seq_len: usize| {
        json!({"name": "own text", "data": {"dataset": "upload", "upload_id": id},
               "model": {"vocab": 256, "seq_len": seq_len}, "train": {"steps": 5}})
    };
    let e = assert_api_error(&t.post("/api/experiments", spec(99, 32)).await, StatusCode::UNPROCESSABLE_ENTITY);
    assert!(e.fields.iter().any(|f| f.field == "data.upload_id" && f.message.contains("no dataset 99")), "{e:?}");
    let e =
        assert_api_error(&t.post("/api/experiments", spec(dataset.id, 1000)).await, StatusCode::UNPROCESSABLE_ENTITY);
    assert!(e.fields.iter().any(|f| f.field == "model.seq_len" && f.message.contains("up to 859")), "{e:?}");
    let e = assert_api_error(
        &t.post("/api/experiments", json!({"name": "x", "data": {"dataset": "upload"}, "model": {"vocab": 256}})).await,
        StatusCode::UNPROCESSABLE_ENTITY,
    );
    assert_eq!(e.fields[0].field, "data.upload_id");
    let a = t.post("/api/experiments", spec(dataset.id, 32)).await;
    assert_eq!(a.status, StatusCode::CREATED, "{}", a.body);
    let experiment = a.body["id"].as_i64().expect("id");

    // The worker that leases it fetches the text, byte for byte; without a credential, 401.
    let worker = t.register(&["cpu"]).await;
    let lease = t.worker("lease", json!({"worker_id": worker})).await;
    assert_eq!(lease.body["experiment_id"].as_i64(), Some(experiment), "{}", lease.body);
    let path = format!("/api/workers/datasets/{}", dataset.id);
    let fetch = |bearer: String| {
        Request::get(path.clone())
            .header(header::AUTHORIZATION, format!("Bearer {bearer}"))
            .body(Body::empty())
            .expect("request")
    };
    let resp = t.send(fetch(t.credential(worker))).await;
    assert_eq!(resp.status(), StatusCode::OK);
    let bytes = resp.into_body().collect().await.expect("body").to_bytes();
    assert_eq!(bytes, text.as_bytes());
    assert_eq!(t.send(fetch("wrong".into())).await.status(), StatusCode::UNAUTHORIZED);

    // It cannot be deleted while an experiment trains on it; after, it can, and is gone.
    let delete = |id: i64| Request::delete(format!("/api/datasets/{id}")).body(Body::empty()).expect("request");
    let e = assert_api_error(&answer(t.send(delete(dataset.id)).await).await, StatusCode::CONFLICT);
    assert!(e.error.contains(&format!("experiment(s) {experiment}")), "{e:?}");
    let done = t
        .worker("complete", json!({"worker_id": worker, "experiment_id": experiment, "summary": RunSummary::default()}))
        .await;
    assert_eq!(done.status, StatusCode::OK, "{}", done.body);
    assert_eq!(t.send(delete(dataset.id)).await.status(), StatusCode::NO_CONTENT);
    assert_eq!(t.send(fetch(t.credential(worker))).await.status(), StatusCode::NOT_FOUND);
    assert_api_error(&answer(t.send(delete(dataset.id)).await).await, StatusCode::NOT_FOUND);
    // Its id is never handed out again (the finished run's spec still names that text).
    let a = answer(t.send(upload("again", "text/plain", text.clone().into_bytes())).await).await;
    assert_eq!(a.status, StatusCode::CREATED, "{}", a.body);
    assert!(a.body["id"].as_i64() > Some(dataset.id), "{}", a.body);
    // One person keeps at most 20.
    for i in 1..20 {
        let a = answer(t.send(upload(&format!("n{i}"), "text/plain", b"some text".to_vec())).await).await;
        assert_eq!(a.status, StatusCode::CREATED, "{}", a.body);
    }
    let e = assert_api_error(
        &answer(t.send(upload("one%20too%20many", "text/plain", b"some text".to_vec())).await).await,
        StatusCode::TOO_MANY_REQUESTS,
    );
    assert!(e.error.contains("delete one first"), "{e:?}");
}

/// Quotas hold under concurrency: the count and the insert are one transaction, so 40
/// uploads at once keep 20 datasets and 60 submissions at once queue 20 (before, 25 and 21).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn quotas_hold_when_requests_arrive_together() {
    let t = std::sync::Arc::new(setup().await);
    let uploads = (0..40).map(|i| {
        let t = t.clone();
        async move {
            let req = Request::post(format!("/api/datasets?name=d{i}"))
                .header(header::CONTENT_TYPE, "text/plain")
                .body(Body::from("some text to train on"))
                .expect("request");
            t.send(req).await.status()
        }
    });
    let statuses = futures::future::join_all(uploads.map(tokio::spawn)).await;
    let created = statuses.iter().filter(|s| matches!(s, Ok(StatusCode::CREATED))).count();
    let refused = statuses.iter().filter(|s| matches!(s, Ok(StatusCode::TOO_MANY_REQUESTS))).count();
    assert_eq!((created, refused), (20, 20), "{statuses:?}");
    let listed: DatasetList = serde_json::from_value(t.get("/api/datasets").await.body).expect("DatasetList");
    assert_eq!(listed.datasets.len(), 20);

    let submissions = (0..60).map(|i| {
        let t = t.clone();
        async move { t.post("/api/experiments", json!({"name": format!("e{i}")})).await.status }
    });
    let statuses = futures::future::join_all(submissions.map(tokio::spawn)).await;
    let created = statuses.iter().filter(|s| matches!(s, Ok(StatusCode::CREATED))).count();
    assert_eq!(created, 20, "{statuses:?}");
    assert_eq!(t.get("/api/experiments?status=queued").await.body["total"], 20);
}

/// An upload cut short by a kill (its text still under its temporary name) is removed when
/// the server starts again; finished uploads stay.
#[tokio::test]
async fn half_written_uploads_are_removed_at_start() {
    let dir = tempfile::tempdir().expect("temp dir");
    let datasets = dir.path().join("data").join("datasets");
    std::fs::create_dir_all(&datasets).expect("datasets dir");
    std::fs::write(datasets.join(".upload-00000000deadbeef"), "half a text").expect("write");
    std::fs::write(datasets.join("dataset-1.txt"), "a whole text").expect("write");
    let data_dir = dir.path().join("data");
    let _t = setup_with(move |c| c.data_dir = data_dir).await;
    let left: Vec<String> =
        std::fs::read_dir(&datasets).expect("dir").flatten().map(|e| e.file_name().to_string_lossy().into()).collect();
    assert_eq!(left, vec!["dataset-1.txt".to_string()]);
}

#[tokio::test]
async fn too_large_bodies_get_413_in_the_json_shape() {
    let t = setup().await;
    let big = format!(r#"{{"name": "{}"}}"#, "x".repeat(2 << 20));
    let a = answer(
        t.send(
            Request::post("/api/experiments")
                .header(header::CONTENT_TYPE, "application/json")
                .body(Body::from(big))
                .expect("req"),
        )
        .await,
    )
    .await;
    let e = assert_api_error(&a, StatusCode::PAYLOAD_TOO_LARGE);
    assert!(e.error.contains("1 MiB"), "{}", e.error);

    // Without a Content-Length (streamed), the limit still holds.
    let chunks = futures::stream::iter((0..40).map(|_| Ok::<_, std::io::Error>(vec![b' '; 64 * 1024])));
    let req = Request::post("/api/experiments")
        .header(header::CONTENT_TYPE, "application/json")
        .body(Body::from_stream(chunks))
        .expect("req");
    assert_api_error(&answer(t.send(req).await).await, StatusCode::PAYLOAD_TOO_LARGE);

    // Event batches may be larger than user bodies (but not unbounded).
    let worker = t.register(&["cpu"]).await;
    t.create("big-batch").await;
    let lease = t.lease(worker).await;
    let events: Vec<Value> = (0..20_000).map(|s| metric(s, 1.0)).collect();
    let a =
        t.worker("events", json!({"worker_id": worker, "experiment_id": lease.experiment_id, "events": events})).await;
    assert_eq!(a.status, StatusCode::OK, "{}", a.body);
    let huge = "y".repeat(17 << 20);
    let a = t.worker("heartbeat", json!({"worker_id": worker, "pad": huge})).await;
    assert_api_error(&a, StatusCode::PAYLOAD_TOO_LARGE);
}

#[tokio::test]
async fn unknown_things_get_404_in_the_json_shape() {
    let t = setup().await;
    assert_api_error(&t.get("/api/experiments/99").await, StatusCode::NOT_FOUND);
    assert_api_error(&t.get("/api/experiments/99/metrics").await, StatusCode::NOT_FOUND);
    assert_api_error(&t.get("/api/experiments/99/stream").await, StatusCode::NOT_FOUND);
    let e = assert_api_error(&t.get("/api/experiments/99/trace").await, StatusCode::NOT_FOUND);
    assert_eq!(e.error, "no experiment with id 99");
    assert_api_error(&t.get("/api/experiments/abc/trace").await, StatusCode::NOT_FOUND);
    assert_api_error(&t.post("/api/experiments/99/cancel", json!({})).await, StatusCode::NOT_FOUND);
    assert_api_error(&t.get("/api/experiments/abc").await, StatusCode::NOT_FOUND);
    assert_api_error(&t.get("/api/experiments/-1/metrics").await, StatusCode::NOT_FOUND);
    let e = assert_api_error(&t.get("/api/nothing/here").await, StatusCode::NOT_FOUND);
    assert!(e.error.contains("/api/nothing/here"), "{}", e.error);
    assert_api_error(&t.get("/api").await, StatusCode::NOT_FOUND);
    // A known path with the wrong method: 405, still JSON.
    let a = t.call(Method::DELETE, "/api/experiments", None, None).await;
    assert_api_error(&a, StatusCode::METHOD_NOT_ALLOWED);
    assert!(a.headers.contains_key(header::ALLOW));
}

// ---------------------------------------------------------------- worker protocol

#[tokio::test]
async fn worker_api_needs_the_token() {
    let t = setup().await;
    let body = json!({"name": "w", "backends": ["cpu"], "devices": [], "version": VERSION});
    for token in [None, Some("wrong"), Some("")] {
        let a = t.call(Method::POST, "/api/workers/register", Some(body.clone()), token).await;
        assert_api_error(&a, StatusCode::UNAUTHORIZED);
        assert!(a.headers.contains_key(header::WWW_AUTHENTICATE));
    }
    // Every worker endpoint is protected.
    for path in ["lease", "heartbeat", "events", "complete", "fail"] {
        let a = t.call(Method::POST, &format!("/api/workers/{path}"), Some(json!({})), None).await;
        assert_api_error(&a, StatusCode::UNAUTHORIZED);
    }
    let a = t.worker("register", body).await;
    assert_eq!(a.status, StatusCode::OK);
    assert_eq!(a.body["heartbeat_interval_s"], 5.0);
    let worker = a.body["worker_id"].as_i64().unwrap();
    // After registering, the shared token no longer works: only the worker's own credential.
    let lease = json!({"worker_id": worker});
    let a = t.call(Method::POST, "/api/workers/lease", Some(lease.clone()), Some(TOKEN)).await;
    assert_api_error(&a, StatusCode::UNAUTHORIZED);
    assert_eq!(t.worker("lease", lease).await.status, StatusCode::NO_CONTENT);
}

/// A worker's credential speaks for that worker only: it cannot lease, renew, report on,
/// complete or fail for another worker, even an experiment the other holds.
#[tokio::test]
async fn a_worker_cannot_act_for_another() {
    let t = setup().await;
    let (holder, intruder) = (t.register(&["cpu"]).await, t.register(&["cpu"]).await);
    let id = t.create("held").await;
    assert_eq!(t.lease(holder).await.experiment_id, id);
    let as_holder = [
        ("lease", json!({"worker_id": holder})),
        ("heartbeat", json!({"worker_id": holder, "experiment_id": id})),
        ("events", json!({"worker_id": holder, "experiment_id": id, "events": [metric(0, 1.0)]})),
        ("complete", json!({"worker_id": holder, "experiment_id": id, "summary": summary()})),
        ("fail", json!({"worker_id": holder, "experiment_id": id, "error": "taken over"})),
    ];
    let intruders_credential = t.credential(intruder);
    for (path, body) in as_holder {
        let a = t.call(Method::POST, &format!("/api/workers/{path}"), Some(body), Some(&intruders_credential)).await;
        let e = assert_api_error(&a, StatusCode::FORBIDDEN);
        assert!(e.error.contains(&format!("worker {intruder}'s")), "{path}: {}", e.error);
    }
    let v = t.view(id).await;
    assert_eq!((v.status, v.attempt), (ExperimentStatus::Running, 1), "nothing the intruder said took effect");
    assert_eq!(t.get(&format!("/api/experiments/{id}/metrics")).await.body["steps"], json!([]));
    // Unknown credentials are refused.
    let a = t.call(Method::POST, "/api/workers/lease", Some(json!({"worker_id": holder})), Some("made-up")).await;
    assert_api_error(&a, StatusCode::UNAUTHORIZED);
}

#[tokio::test]
async fn lease_runs_the_oldest_queued_experiment_or_answers_204() {
    let t = setup().await;
    let worker = t.register(&["cpu"]).await;
    let a = t.worker("lease", json!({"worker_id": worker})).await;
    assert_eq!(a.status, StatusCode::NO_CONTENT);
    assert_eq!(a.body, Value::Null);

    let first = t.create("first").await;
    t.create("second").await;
    let lease = t.lease(worker).await;
    assert_eq!((lease.experiment_id, lease.attempt, lease.lease_s), (first, 1, 30.0));
    assert_eq!(lease.spec.name, "first");
    let v = t.view(first).await;
    assert_eq!((v.status, v.attempt), (ExperimentStatus::Running, 1));
    assert!(v.started_at.is_some());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn concurrent_leases_give_each_experiment_to_exactly_one_worker() {
    let t = setup().await;
    let mut workers = Vec::new();
    for _ in 0..10 {
        workers.push(t.register(&["cpu"]).await);
    }
    let mut queued = HashSet::new();
    for i in 0..3 {
        queued.insert(t.create(&format!("e{i}")).await);
    }
    let calls = workers.iter().map(|&w| {
        let app = t.app.clone();
        let credential = t.credential(w);
        tokio::spawn(async move {
            let req = Request::post("/api/workers/lease")
                .header(header::AUTHORIZATION, format!("Bearer {credential}"))
                .header(header::CONTENT_TYPE, "application/json")
                .body(Body::from(json!({"worker_id": w}).to_string()))
                .expect("request");
            answer(app.oneshot(req).await.expect("infallible")).await
        })
    });
    let answers = futures::future::join_all(calls).await;
    let mut won = Vec::new();
    let mut empty = 0;
    for a in answers {
        let a = a.expect("task");
        match a.status {
            StatusCode::OK => won.push(a.body["experiment_id"].as_i64().expect("id")),
            StatusCode::NO_CONTENT => empty += 1,
            other => panic!("unexpected {other}: {}", a.body),
        }
    }
    let distinct: HashSet<i64> = won.iter().copied().collect();
    assert_eq!(won.len(), 3, "{won:?}");
    assert_eq!(distinct, queued);
    assert_eq!(empty, 7);
}

/// A large batch is stored in bounded transactions: a submission made while the batch is
/// being stored is answered between two of them, before the batch is done (one
/// transaction for it all held SQLite's write lock for seconds: a student's submission
/// got 503). Every point is stored, in order.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_large_event_batch_lets_other_writers_in() {
    let t = std::sync::Arc::new(setup().await);
    let worker = t.register(&["cpu"]).await;
    let id = t.create("run").await;
    t.lease(worker).await;
    const POINTS: u64 = 40 * queue_chunk();
    let events: Vec<Value> = (0..POINTS).map(|step| metric(step, 1.0 + step as f64 * 1e-6)).collect();
    let batch = {
        let t = t.clone();
        tokio::spawn(async move {
            t.worker("events", json!({"worker_id": worker, "experiment_id": id, "events": events})).await.status
        })
    };
    let stored = |t: std::sync::Arc<TestApp>| async move {
        sqlx::query_scalar::<_, i64>("SELECT COUNT(*) FROM metrics WHERE experiment_id = $1")
            .bind(id)
            .fetch_one(&t.state.db)
            .await
            .expect("count")
    };
    // Once the first transactions are in...
    let started = std::time::Instant::now();
    while stored(t.clone()).await == 0 {
        assert!(started.elapsed() < Duration::from_secs(120), "no point stored");
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
    // ... a submission gets its turn before the batch is done.
    let a = t.post("/api/experiments", json!({"name": "meanwhile"})).await;
    assert_eq!(a.status, StatusCode::CREATED, "{}", a.body);
    let when_submitted = stored(t.clone()).await;
    assert!(when_submitted < POINTS as i64, "the submission waited for the whole batch ({when_submitted} stored)");
    assert_eq!(batch.await.expect("batch"), StatusCode::OK);
    assert_eq!(stored(t.clone()).await, POINTS as i64);
    assert_eq!(t.view(id).await.steps_done, POINTS);
}

const fn queue_chunk() -> u64 {
    distlab_server::store::reports::EVENTS_PER_TRANSACTION as u64
}

/// A worker credential unused for a day (its worker stopped) no longer works; the worker
/// registers again for a new one.
#[tokio::test]
async fn an_idle_worker_credential_expires() {
    let t = setup().await;
    let worker = t.register(&["cpu"]).await;
    assert_eq!(t.worker("heartbeat", json!({"worker_id": worker})).await.status, StatusCode::OK);
    let long_ago = "2020-01-01T00:00:00.000Z";
    sqlx::query("UPDATE workers SET last_seen = $1 WHERE id = $2")
        .bind(long_ago)
        .bind(worker)
        .execute(&t.state.db)
        .await
        .expect("update");
    let a = t.worker("heartbeat", json!({"worker_id": worker})).await;
    let e = assert_api_error(&a, StatusCode::UNAUTHORIZED);
    assert!(e.error.contains("expired"), "{}", e.error);
    let again = t.register(&["cpu"]).await;
    assert_eq!(t.worker("heartbeat", json!({"worker_id": again})).await.status, StatusCode::OK);
}

#[tokio::test]
async fn events_are_stored_and_visible_in_metrics() {
    let t = setup().await;
    let worker = t.register(&["cpu"]).await;
    let id = t.create("run").await;
    t.lease(worker).await;
    let events =
        json!([metric(0, 4.0), metric(1, 3.5), {"type": "log", "level": "info", "message": "hello"}, metric(2, 3.0)]);
    let a = t.worker("events", json!({"worker_id": worker, "experiment_id": id, "events": events})).await;
    assert_eq!(a.status, StatusCode::OK);
    assert_eq!(a.body, json!({"cancel": false}));
    // A re-sent step overwrites the stored one.
    t.worker("events", json!({"worker_id": worker, "experiment_id": id, "events": [metric(1, 3.4)]})).await;

    let m: Metrics =
        serde_json::from_value(t.get(&format!("/api/experiments/{id}/metrics")).await.body).expect("metrics");
    let steps: Vec<(u64, f64)> = m.steps.iter().map(|p| (p.step, p.loss)).collect();
    assert_eq!(steps, vec![(0, 4.0), (1, 3.4), (2, 3.0)]);
    assert_eq!(t.view(id).await.steps_done, 3);
    // A loss is stored exactly as the worker measured it, to the last bit (JSON's shortest
    // decimal form read back exactly, not by the fast approximate parse).
    let measured = 3.8786377790383995_f64;
    t.worker("events", json!({"worker_id": worker, "experiment_id": id, "events": [metric(3, measured)]})).await;
    let m: Metrics =
        serde_json::from_value(t.get(&format!("/api/experiments/{id}/metrics")).await.body).expect("metrics");
    assert_eq!(m.steps[3].loss.to_bits(), measured.to_bits(), "{} stored as {}", measured, m.steps[3].loss);
    let logs: i64 = sqlx::query_scalar("SELECT COUNT(*) FROM logs WHERE experiment_id = $1")
        .bind(id)
        .fetch_one(&t.state.db)
        .await
        .expect("logs");
    assert_eq!(logs, 1);
    assert_eq!(t.view(id).await.steps_done, 4);
    // Steps with the optional measurements (a validation loss, fp16's loss scale), one batch
    // at a time after steps without them: more batches than the pool has connections, so
    // that on Postgres some connection stores a NULL first and a number after it.
    for step in 4..24 {
        let mut point = metric(step, 3.0);
        point["val_loss"] = json!(2.5);
        point["loss_scale"] = json!(1024.0);
        point["logit_grad_zero_share"] = json!(0.25);
        point["experts"] = json!({"balance": 1.5, "assignments": 8, "dropped": 1});
        let a = t.worker("events", json!({"worker_id": worker, "experiment_id": id, "events": [point]})).await;
        assert_eq!(a.status, StatusCode::OK, "{}", a.body);
    }
    let m: Metrics =
        serde_json::from_value(t.get(&format!("/api/experiments/{id}/metrics")).await.body).expect("metrics");
    let last = m.steps.last().expect("steps");
    assert_eq!((last.step, last.val_loss, last.loss_scale), (23, Some(2.5), Some(1024.0)));
    assert_eq!((last.logit_grad_zero_share, last.experts.map(|e| e.balance)), (Some(0.25), Some(1.5)));
    assert_eq!(m.steps[3].val_loss, None);

    // Complete: succeeded with the summary; later reports are refused with 409.
    let a = t.worker("complete", json!({"worker_id": worker, "experiment_id": id, "summary": summary()})).await;
    assert_eq!(a.status, StatusCode::OK, "{}", a.body);
    let v = t.view(id).await;
    assert_eq!(v.status, ExperimentStatus::Succeeded);
    assert_eq!(v.summary.map(|s| s.final_loss), Some(3.0));
    assert!(v.finished_at.is_some());
    let a = t.worker("events", json!({"worker_id": worker, "experiment_id": id, "events": [metric(4, 2.0)]})).await;
    assert_api_error(&a, StatusCode::CONFLICT);
    // The same completion again (a retry whose first answer was lost) is acknowledged and
    // changes nothing; any other ending is refused.
    let finished = t.view(id).await.finished_at;
    let a = t.worker("complete", json!({"worker_id": worker, "experiment_id": id, "summary": summary()})).await;
    assert_eq!(a.status, StatusCode::OK, "{}", a.body);
    assert_eq!(t.view(id).await.finished_at, finished);
    let failed = json!({"worker_id": worker, "experiment_id": id, "error": "late", "cancelled": false});
    assert_api_error(&t.worker("fail", failed).await, StatusCode::CONFLICT);
    let other = t.register(&["cpu"]).await;
    let a = t.worker("complete", json!({"worker_id": other, "experiment_id": id, "summary": summary()})).await;
    assert_api_error(&a, StatusCode::CONFLICT);
    assert_eq!(t.view(id).await.status, ExperimentStatus::Succeeded);
}

#[tokio::test]
async fn only_the_lease_holder_may_report() {
    let t = setup().await;
    let holder = t.register(&["cpu"]).await;
    let other = t.register(&["cpu"]).await;
    let id = t.create("run").await;
    t.lease(holder).await;
    let a = t.worker("events", json!({"worker_id": other, "experiment_id": id, "events": [metric(0, 1.0)]})).await;
    assert_api_error(&a, StatusCode::CONFLICT);
    assert_api_error(
        &t.worker("heartbeat", json!({"worker_id": other, "experiment_id": id})).await,
        StatusCode::CONFLICT,
    );
    let a = t.worker("fail", json!({"worker_id": other, "experiment_id": id, "error": "boom"})).await;
    assert_api_error(&a, StatusCode::CONFLICT);
    assert_api_error(
        &t.worker("heartbeat", json!({"worker_id": other, "experiment_id": 77})).await,
        StatusCode::NOT_FOUND,
    );
    assert_eq!(t.view(id).await.steps_done, 0);

    let a = t
        .worker("fail", json!({"worker_id": holder, "experiment_id": id, "error": "rank 1 died: out of memory"}))
        .await;
    assert_eq!(a.status, StatusCode::OK);
    let v = t.view(id).await;
    assert_eq!(v.status, ExperimentStatus::Failed);
    assert_eq!(v.error.as_deref(), Some("rank 1 died: out of memory"));
}

#[tokio::test]
async fn cancel_queued_and_running_experiments() {
    let t = setup().await;
    let worker = t.register(&["cpu"]).await;
    let running = t.create("running").await;
    let queued = t.create("queued").await;
    t.lease(worker).await;

    let a = t.post(&format!("/api/experiments/{queued}/cancel"), json!({})).await;
    assert_eq!(a.status, StatusCode::OK);
    assert_eq!(a.body["status"], "cancelled");
    // Finished: 409, and a cancelled experiment is never leased.
    assert_api_error(&t.post(&format!("/api/experiments/{queued}/cancel"), json!({})).await, StatusCode::CONFLICT);
    assert_eq!(t.worker("lease", json!({"worker_id": worker})).await.status, StatusCode::NO_CONTENT);

    let hb = json!({"worker_id": worker, "experiment_id": running});
    assert_eq!(t.worker("heartbeat", hb.clone()).await.body, json!({"cancel": false}));
    let a = t.post(&format!("/api/experiments/{running}/cancel"), json!({})).await;
    assert_eq!(a.status, StatusCode::OK);
    assert_eq!(t.view(running).await.status, ExperimentStatus::Cancelled);
    // The worker learns it from its next heartbeat or event batch; nothing more is stored.
    assert_eq!(t.worker("heartbeat", hb).await.body, json!({"cancel": true}));
    let a =
        t.worker("events", json!({"worker_id": worker, "experiment_id": running, "events": [metric(0, 1.0)]})).await;
    assert_eq!((a.status, a.body), (StatusCode::OK, json!({"cancel": true})));
    assert_eq!(t.view(running).await.steps_done, 0);
    // Its fail(cancelled) is accepted harmlessly.
    let a = t
        .worker("fail", json!({"worker_id": worker, "experiment_id": running, "error": "cancelled", "cancelled": true}))
        .await;
    assert_eq!(a.status, StatusCode::OK, "{}", a.body);
    let v = t.view(running).await;
    assert_eq!((v.status, v.error), (ExperimentStatus::Cancelled, None));
    assert_api_error(&t.post(&format!("/api/experiments/{running}/cancel"), json!({})).await, StatusCode::CONFLICT);
}

#[tokio::test]
async fn expired_leases_requeue_then_fail_after_three_attempts() {
    let t = setup().await;
    let worker = t.register(&["cpu"]).await;
    let id = t.create("flaky").await;
    for attempt in 1..=3 {
        let lease = t.lease(worker).await;
        assert_eq!((lease.experiment_id, lease.attempt), (id, attempt));
        // A fresh lease is not reaped now...
        assert!(t.state.reap_expired(SystemTime::now()).await.expect("reap").is_empty());
        // ...but it is once it has run out.
        let reaped = t.state.reap_expired(in_an_hour()).await.expect("reap");
        assert_eq!(reaped.len(), 1);
        let v = t.view(id).await;
        assert_eq!(v.attempt, attempt);
        if attempt < 3 {
            assert_eq!(v.status, ExperimentStatus::Queued);
            // The worker that lost the lease is told so.
            let a =
                t.worker("events", json!({"worker_id": worker, "experiment_id": id, "events": [metric(0, 1.0)]})).await;
            assert_api_error(&a, StatusCode::CONFLICT);
        } else {
            assert_eq!(v.status, ExperimentStatus::Failed);
            assert_eq!(
                v.error.as_deref(),
                Some("the worker running it stopped responding 3 times (lease expired); giving up")
            );
        }
    }
    assert_eq!(t.worker("lease", json!({"worker_id": worker})).await.status, StatusCode::NO_CONTENT);
}

#[tokio::test]
async fn a_resumed_attempt_replaces_the_lost_steps_once() {
    let t = setup().await;
    let worker = t.register(&["cpu"]).await;
    let id = t.create("resumed").await;
    let events = |events: Value| json!({"worker_id": worker, "experiment_id": id, "events": events});
    t.lease(worker).await;
    let first =
        json!([{"type": "start", "from_step": 0}, metric(0, 4.0), metric(1, 3.9), metric(2, 3.8), metric(3, 3.7)]);
    assert_eq!(t.worker("events", events(first)).await.status, StatusCode::OK);
    t.state.reap_expired(in_an_hour()).await.expect("reap");
    assert_eq!(t.lease(worker).await.attempt, 2);
    // The second attempt resumes from a checkpoint of step 2: steps 2 and 3 are run again.
    let second = json!([{"type": "start", "from_step": 2}, metric(2, 3.5)]);
    assert_eq!(t.worker("events", events(second.clone())).await.status, StatusCode::OK);
    assert_eq!(t.worker("events", events(json!([metric(3, 3.4)]))).await.status, StatusCode::OK);
    // The same batch sent again (its answer was lost) must not delete step 3 again.
    assert_eq!(t.worker("events", events(second)).await.status, StatusCode::OK);
    let a = t.get(&format!("/api/experiments/{id}/attempts")).await;
    let attempts: api::Attempts = serde_json::from_value(a.body).expect("attempts");
    let got: Vec<_> = attempts.attempts.iter().map(|a| (a.attempt, a.from_step, a.lost_steps)).collect();
    assert_eq!(got, vec![(1, Some(0), 0), (2, Some(2), 2)]);
    let a = t.get(&format!("/api/experiments/{id}/metrics")).await;
    let metrics: api::Metrics = serde_json::from_value(a.body).expect("metrics");
    let losses: Vec<_> = metrics.steps.iter().map(|m| (m.step, m.loss)).collect();
    assert_eq!(losses, vec![(0, 4.0), (1, 3.9), (2, 3.5), (3, 3.4)]);
}

#[tokio::test]
async fn the_flashcard_deck_covers_every_topic_with_a_demo() {
    let t = setup().await;
    let a = t.get("/api/cards").await;
    assert_eq!(a.status, StatusCode::OK, "{}", a.body);
    let cards: Vec<cards::Card> = serde_json::from_value(a.body).expect("cards");
    let topics: HashSet<u32> = cards.iter().map(|c| c.topic).collect();
    assert_eq!(topics, (1..=cards::TOPICS).collect::<HashSet<_>>());
    assert!(cards.iter().all(|c| !c.question.is_empty() && !c.answer.is_empty()));
    assert!(cards.iter().any(|c| matches!(c.demo, cards::Demo::Ring { .. })));
}

#[tokio::test]
async fn heartbeats_renew_the_lease() {
    let t = setup_with(|c| c.lease_seconds = 2.0).await;
    let worker = t.register(&["cpu"]).await;
    let id = t.create("steady").await;
    t.lease(worker).await;
    let in_3s = SystemTime::now() + Duration::from_secs(3);
    tokio::time::sleep(Duration::from_millis(1500)).await;
    let a = t.worker("heartbeat", json!({"worker_id": worker, "experiment_id": id})).await;
    assert_eq!(a.body, json!({"cancel": false}));
    // Without the heartbeat the lease would have ended before in_3s.
    assert!(t.state.reap_expired(in_3s).await.expect("reap").is_empty());
    assert_eq!(t.view(id).await.status, ExperimentStatus::Running);
}

// ---------------------------------------------------------------- traces

#[tokio::test]
async fn uploaded_traces_are_served_in_rank_order() {
    let t = setup().await;
    let (worker, id) = running(&t, json!({"dp": 2, "pp": 2})).await;
    assert_eq!(get_trace(&t, id).await, trace::ExperimentTrace { ranks: vec![] }, "none yet");

    // Ranks arrive out of order, in two batches, with other events beside them.
    let (r0, r1, r3) = (rank_trace(0, 4, 6), rank_trace(1, 4, 6), rank_trace(3, 4, 6));
    let batch = json!([metric(0, 4.0), trace_event(&r3), trace_event(&r1)]);
    let a = t.worker("events", json!({"worker_id": worker, "experiment_id": id, "events": batch})).await;
    assert_eq!((a.status, a.body), (StatusCode::OK, json!({"cancel": false})));
    let a = t.worker("events", json!({"worker_id": worker, "experiment_id": id, "events": [trace_event(&r0)]})).await;
    assert_eq!(a.status, StatusCode::OK, "{}", a.body);

    let got = get_trace(&t, id).await;
    assert_eq!(got.ranks, vec![r0, r1.clone(), r3.clone()]);
    assert_eq!(t.view(id).await.steps_done, 1);

    // A second upload for a rank replaces the first (the latest wins).
    let mut newer = rank_trace(0, 4, 2);
    newer.spans.truncate(1);
    let a =
        t.worker("events", json!({"worker_id": worker, "experiment_id": id, "events": [trace_event(&newer)]})).await;
    assert_eq!(a.status, StatusCode::OK, "{}", a.body);
    assert_eq!(get_trace(&t, id).await.ranks, vec![newer, r1, r3]);
    let rows: i64 = sqlx::query_scalar("SELECT COUNT(*) FROM traces WHERE experiment_id = $1")
        .bind(id)
        .fetch_one(&t.state.db)
        .await
        .expect("rows");
    assert_eq!(rows, 3);
}

#[tokio::test]
async fn a_trace_outside_the_world_is_422_and_nothing_of_the_batch_is_stored() {
    let t = setup().await;
    let (worker, id) = running(&t, json!({"dp": 2})).await;
    let log = json!({"type": "log", "level": "info", "message": "step 0 done"});
    let batch = json!([metric(0, 4.0), log, trace_event(&rank_trace(0, 2, 2)), trace_event(&rank_trace(2, 2, 2))]);
    let a = t.worker("events", json!({"worker_id": worker, "experiment_id": id, "events": batch})).await;
    let e = assert_api_error(&a, StatusCode::UNPROCESSABLE_ENTITY);
    assert_eq!(e.fields.len(), 1, "{e:?}");
    assert_eq!(e.fields[0].field, "events[3].rank");
    assert!(e.error.contains("rank 2") && e.error.contains("ranks are 0 to 1"), "{}", e.error);

    // Nothing of the batch: no metric, no log, no trace (not even the valid rank 0).
    assert_eq!(t.view(id).await.steps_done, 0);
    assert_eq!(log_count(&t, id).await, 0);
    assert!(get_trace(&t, id).await.ranks.is_empty());

    // A trace that claims another world size is refused too.
    let a = t
        .worker(
            "events",
            json!({"worker_id": worker, "experiment_id": id, "events": [trace_event(&rank_trace(1, 4, 2))]}),
        )
        .await;
    let e = assert_api_error(&a, StatusCode::UNPROCESSABLE_ENTITY);
    assert_eq!(e.fields[0].field, "events[0].world");
    assert!(get_trace(&t, id).await.ranks.is_empty());

    // The experiment is still the worker's: a valid batch goes through.
    let a = t
        .worker(
            "events",
            json!({"worker_id": worker, "experiment_id": id, "events": [trace_event(&rank_trace(1, 2, 2))]}),
        )
        .await;
    assert_eq!(a.status, StatusCode::OK, "{}", a.body);
    assert_eq!(get_trace(&t, id).await.ranks.len(), 1);

    // Only the lease holder may upload: another worker gets 409, not 422.
    let other = t.register(&["cpu"]).await;
    let bad = json!([trace_event(&rank_trace(5, 2, 2))]);
    let a = t.worker("events", json!({"worker_id": other, "experiment_id": id, "events": bad})).await;
    assert_api_error(&a, StatusCode::CONFLICT);
}

#[tokio::test]
async fn large_traces_fit_in_a_batch_and_are_served_gzipped() {
    let t = setup().await;
    let (worker, id) = running(&t, json!({"dp": 2})).await;
    // About 3 MB of JSON per rank.
    let big: Vec<trace::RankTrace> = (0..2).map(|rank| rank_trace(rank, 2, 25_000)).collect();
    let events: Vec<Value> = big.iter().map(trace_event).collect();
    let body = json!({"worker_id": worker, "experiment_id": id, "events": events});
    let raw_len = body.to_string().len();
    assert!(raw_len > 6 << 20, "{raw_len} bytes");
    let a = t.worker("events", body).await;
    assert_eq!(a.status, StatusCode::OK, "{}", a.body);

    let resp = t
        .send(
            Request::get(format!("/api/experiments/{id}/trace"))
                .header(header::ACCEPT_ENCODING, "gzip")
                .body(Body::empty())
                .expect("req"),
        )
        .await;
    assert_eq!(resp.status(), StatusCode::OK);
    assert_eq!(resp.headers().get(header::CONTENT_ENCODING).and_then(|v| v.to_str().ok()), Some("gzip"));
    assert!(resp
        .headers()
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|ct| ct.starts_with("application/json")));
    let gz = resp.into_body().collect().await.expect("body").to_bytes();
    let mut json = Vec::new();
    std::io::Read::read_to_end(&mut flate2::read::GzDecoder::new(&gz[..]), &mut json).expect("gunzip");
    assert!(gz.len() * 4 < json.len(), "{} gzipped vs {} bytes", gz.len(), json.len());
    let got: trace::ExperimentTrace = serde_json::from_slice(&json).expect("ExperimentTrace");
    assert_eq!(got.ranks, big);
}

// ---------------------------------------------------------------- memory

async fn get_memory(t: &TestApp, id: i64) -> memory::MemoryView {
    let a = t.get(&format!("/api/experiments/{id}/memory")).await;
    assert_eq!(a.status, StatusCode::OK, "{}", a.body);
    serde_json::from_value(a.body).expect("MemoryView")
}

/// The planner's output for `spec` through `POST /api/plan`.
async fn plan_of(t: &TestApp, spec: Value) -> planner::Plan {
    let a = t.post("/api/plan", spec).await;
    assert_eq!(a.status, StatusCode::OK, "{}", a.body);
    serde_json::from_value(a.body).expect("Plan")
}

#[tokio::test]
async fn memory_view_puts_uploaded_memory_next_to_the_planner() {
    let t = setup().await;
    let (worker, id) = running(&t, json!({"dp": 2})).await;
    let spec = t.view(id).await.spec;
    let plan = plan_of(&t, serde_json::to_value(&spec).expect("spec")).await;
    let predicted = plan.stages[0].memory.clone();

    // Rank 0 measured a little more activation memory than predicted; rank 1's trace has no memory.
    let mut peak = predicted.clone();
    peak.activations += 4096;
    peak.total += 4096;
    let sample = |t_us, event: &str, bytes: &planner::RankMemory| memory::MemorySample {
        t_us,
        step: 0,
        event: event.into(),
        bytes: bytes.clone(),
        heap: None,
        shared: 0,
    };
    let report = memory::RankMemoryReport {
        rank: 0,
        peak: peak.clone(),
        current: planner::RankMemory { activations: 0, ..peak.clone() },
        timeline: vec![sample(1_000, "forward block 0", &predicted), sample(2_000, "backward block 0", &peak)],
        shared_peak: 0,
        pipe_bytes: 0,
        booked_heap_peak: None,
        process: None,
    };
    let r0 = trace::RankTrace { memory: Some(report.clone()), ..rank_trace(0, 2, 2) };
    let r1 = rank_trace(1, 2, 2);
    let batch = json!([trace_event(&r0), trace_event(&r1)]);
    let a = t.worker("events", json!({"worker_id": worker, "experiment_id": id, "events": batch})).await;
    assert_eq!(a.status, StatusCode::OK, "{}", a.body);

    let view = get_memory(&t, id).await;
    assert_eq!(view.plan, plan, "the view carries the planner's output for the spec");
    assert_eq!(view.ranks.len(), 2);
    let (v0, v1) = (&view.ranks[0], &view.ranks[1]);
    assert_eq!((v0.rank, v0.stage, v1.rank, v1.stage), (0, 0, 1, 0));
    assert_eq!(v0.measured.as_ref(), Some(&report));
    assert_eq!(v0.predicted, predicted);
    assert_eq!(v0.differences.len(), 1, "{:?}", v0.differences);
    assert!(v0.differences[0].starts_with("activations: measured "), "{}", v0.differences[0]);
    assert!(v0.differences[0].contains("+4096 B"), "{}", v0.differences[0]);
    assert_eq!((v1.measured.as_ref(), &v1.predicted, v1.differences.len()), (None, &predicted, 0));
}

#[tokio::test]
async fn memory_view_before_any_trace_has_the_prediction_only() {
    let t = setup().await;
    let parallel = json!({"dp": 2, "pp": 2});
    let a = t.post("/api/experiments", json!({"name": "m", "parallel": parallel, "train": {"steps": 10}})).await;
    assert_eq!(a.status, StatusCode::CREATED, "{}", a.body);
    let id = a.body["id"].as_i64().expect("id");
    let plan = plan_of(&t, serde_json::to_value(t.view(id).await.spec).expect("spec")).await;

    let view = get_memory(&t, id).await;
    assert_eq!(view.ranks.len(), 4);
    for (i, r) in view.ranks.iter().enumerate() {
        assert_eq!(r.rank as usize, i);
        assert_eq!(r.stage, i % 2, "tp=1: ranks alternate between the two stages");
        assert_eq!(r.measured, None);
        assert_eq!(r.predicted, plan.stages[r.stage].memory);
        assert!(r.predicted.total > 0);
        assert!(r.differences.is_empty());
    }
}

#[tokio::test]
async fn memory_of_an_unknown_experiment_is_404() {
    let t = setup().await;
    let a = t.get("/api/experiments/999/memory").await;
    assert!(assert_api_error(&a, StatusCode::NOT_FOUND).error.contains("999"), "{}", a.body);
    assert_api_error(&t.get("/api/experiments/nope/memory").await, StatusCode::NOT_FOUND);
}

// ---------------------------------------------------------------- SSE

/// (event name, data JSON) pairs from an SSE body.
fn parse_sse(text: &str) -> Vec<(String, Value)> {
    let mut out = Vec::new();
    for block in text.split("\n\n") {
        let mut name = None;
        let mut data = String::new();
        for line in block.lines() {
            if let Some(v) = line.strip_prefix("event:") {
                name = Some(v.trim().to_string());
            } else if let Some(v) = line.strip_prefix("data:") {
                data.push_str(v.trim_start());
            }
        }
        if let Some(name) = name {
            out.push((name, serde_json::from_str(&data).expect("event data is JSON")));
        }
    }
    out
}

async fn finish_with_metrics(t: &TestApp, worker: i64, id: i64, steps: u64) {
    let events: Vec<Value> = (0..steps).map(|s| metric(s, 4.0 - s as f64 * 0.1)).collect();
    t.worker("events", json!({"worker_id": worker, "experiment_id": id, "events": events})).await;
    t.worker("complete", json!({"worker_id": worker, "experiment_id": id, "summary": summary()})).await;
}

#[tokio::test]
async fn stream_of_a_finished_experiment_replays_metrics_and_ends() {
    let t = setup().await;
    let worker = t.register(&["cpu"]).await;
    let id = t.create("done").await;
    t.lease(worker).await;
    finish_with_metrics(&t, worker, id, 3).await;

    let resp = t.send(Request::get(format!("/api/experiments/{id}/stream")).body(Body::empty()).expect("req")).await;
    assert_eq!(resp.status(), StatusCode::OK);
    assert_eq!(resp.headers().get(header::CONTENT_TYPE).and_then(|v| v.to_str().ok()), Some("text/event-stream"));
    // The body ends by itself (collect would hang otherwise).
    let bytes = tokio::time::timeout(Duration::from_secs(5), resp.into_body().collect())
        .await
        .expect("the stream ends")
        .expect("body")
        .to_bytes();
    let events = parse_sse(&String::from_utf8_lossy(&bytes));
    let names: Vec<&str> = events.iter().map(|(n, _)| n.as_str()).collect();
    assert_eq!(names, vec!["status", "metric", "metric", "metric", "status"]);
    for (name, data) in &events {
        let parsed: StreamEvent = serde_json::from_value(data.clone()).expect("StreamEvent");
        assert_eq!(parsed.name(), name);
    }
    assert_eq!(events[2].1["step"], 1);
    assert_eq!(events[4].1["status"], "succeeded");
    assert_eq!(events[4].1["summary"]["final_loss"], 3.0);
}

#[tokio::test]
async fn stream_sends_live_events_then_ends_on_finish() {
    // A short request timeout must not cut live streams.
    let t = setup_with(|c| c.request_timeout = Duration::from_millis(200)).await;
    let worker = t.register(&["cpu"]).await;
    let id = t.create("live").await;
    t.lease(worker).await;
    t.worker("events", json!({"worker_id": worker, "experiment_id": id, "events": [metric(0, 4.0)]})).await;

    let req = Request::get(format!("/api/experiments/{id}/stream")).header(header::ACCEPT_ENCODING, "gzip");
    let resp = t.send(req.body(Body::empty()).expect("req")).await;
    assert_eq!(resp.status(), StatusCode::OK);
    assert!(resp.headers().get(header::CONTENT_ENCODING).is_none(), "event streams are not compressed");
    let reader = tokio::spawn(async move {
        tokio::time::timeout(Duration::from_secs(5), resp.into_body().collect()).await.map(|b| b.map(|c| c.to_bytes()))
    });
    // Let the stream run past the request timeout, then report more and finish.
    tokio::time::sleep(Duration::from_millis(400)).await;
    let log = json!({"type": "log", "level": "warn", "message": "slow step"});
    t.worker("events", json!({"worker_id": worker, "experiment_id": id, "events": [metric(1, 3.9), log]})).await;
    t.worker("fail", json!({"worker_id": worker, "experiment_id": id, "error": "rank 0 crashed"})).await;

    let bytes = reader.await.expect("task").expect("the stream ends").expect("body");
    let events = parse_sse(&String::from_utf8_lossy(&bytes));
    let names: Vec<&str> = events.iter().map(|(n, _)| n.as_str()).collect();
    assert_eq!(names, vec!["status", "metric", "metric", "log", "status"], "{events:?}");
    assert_eq!(events[0].1["status"], "running");
    assert_eq!((events[1].1["step"].clone(), events[2].1["step"].clone()), (json!(0), json!(1)));
    assert_eq!(events[4].1, json!({"type": "status", "status": "failed", "error": "rank 0 crashed"}));
}

/// Two servers on one Postgres database: a browser watching on one sees what a worker
/// reports to the other (LISTEN/NOTIFY), a long log line included. Only on Postgres.
#[tokio::test]
async fn a_stream_on_another_server_of_the_database_follows_the_run() {
    let t = setup().await;
    let Some(url) = t.state.config.database_url.clone() else {
        eprintln!("skipped: the servers share live events only on Postgres (DISTLAB_TEST_POSTGRES_URL is not set)");
        return;
    };
    let other_config = ServerConfig { database_url: Some(url), ..(*t.state.config).clone() };
    let other = AppState::new(other_config).await.expect("a second server on the same database");
    let other_app = app(other);
    let worker = t.register(&["cpu"]).await;
    let id = t.create("watched elsewhere").await;
    t.lease(worker).await;

    let resp = other_app
        .clone()
        .oneshot(Request::get(format!("/api/experiments/{id}/stream")).body(Body::empty()).expect("req"))
        .await
        .expect("infallible");
    assert_eq!(resp.status(), StatusCode::OK);
    let reader = tokio::spawn(async move {
        tokio::time::timeout(Duration::from_secs(10), resp.into_body().collect()).await.map(|b| b.map(|c| c.to_bytes()))
    });
    // The other server's listener is up once its stream answered; give the stream a moment
    // to subscribe, then report to the first server.
    tokio::time::sleep(Duration::from_millis(300)).await;
    let long = json!({"type": "log", "level": "warn", "message": "x".repeat(9_000)});
    t.worker("events", json!({"worker_id": worker, "experiment_id": id, "events": [metric(0, 4.0), long]})).await;
    t.worker("fail", json!({"worker_id": worker, "experiment_id": id, "error": "rank 1 crashed"})).await;

    let bytes = reader.await.expect("task").expect("the stream ends").expect("body");
    let mut events = parse_sse(&String::from_utf8_lossy(&bytes));
    // (the submission's and the lease's changes may arrive after the replay: each is read
    // as the status is then, "running" again)
    events.dedup();
    let names: Vec<&str> = events.iter().map(|(n, _)| n.as_str()).collect();
    assert_eq!(names, vec!["status", "metric", "log", "status"]);
    assert_eq!(events[1].1["loss"], json!(4.0));
    let line = events[2].1["message"].as_str().unwrap_or_default();
    assert!(line.len() > 8_000 && line.ends_with('…'), "the line read back as stored (cut to 8192 characters)");
    assert_eq!(events[3].1["error"], "rank 1 crashed");
}

/// The whole body of a stream that ends by itself.
async fn read_stream(t: &TestApp, id: i64) -> Vec<(String, Value)> {
    let resp = t.send(Request::get(format!("/api/experiments/{id}/stream")).body(Body::empty()).expect("req")).await;
    assert_eq!(resp.status(), StatusCode::OK);
    let bytes = tokio::time::timeout(Duration::from_secs(5), resp.into_body().collect())
        .await
        .expect("the stream ends")
        .expect("body")
        .to_bytes();
    parse_sse(&String::from_utf8_lossy(&bytes))
}

fn log_event(i: usize) -> Value {
    json!({"type": "log", "level": if i % 2 == 0 { "info" } else { "warn" }, "message": format!("line {i}")})
}

#[tokio::test]
async fn stream_replays_the_last_stored_log_lines() {
    let t = setup().await;
    let worker = t.register(&["cpu"]).await;
    let id = t.create("chatty").await;
    t.lease(worker).await;
    let mut events: Vec<Value> = (0..150).map(log_event).collect();
    events.push(metric(0, 4.0));
    t.worker("events", json!({"worker_id": worker, "experiment_id": id, "events": events})).await;
    let events: Vec<Value> = (150..260).map(log_event).collect();
    t.worker("events", json!({"worker_id": worker, "experiment_id": id, "events": events})).await;
    finish_with_metrics(&t, worker, id, 2).await;
    assert_eq!(log_count(&t, id).await, 260);

    let events = read_stream(&t, id).await;
    let names: Vec<&str> = events.iter().map(|(n, _)| n.as_str()).collect();
    let mut expected = vec!["status"];
    expected.extend(["log"; 200]);
    expected.extend(["metric", "metric", "status"]);
    assert_eq!(names, expected);
    // The last 200, oldest first, with their levels.
    let messages: Vec<&str> = events[1..201].iter().map(|(_, d)| d["message"].as_str().expect("message")).collect();
    let want: Vec<String> = (60..260).map(|i| format!("line {i}")).collect();
    assert_eq!(messages, want);
    assert_eq!(events[1].1, json!({"type": "log", "level": "info", "message": "line 60"}));
    assert_eq!(events[2].1["level"], "warn");
    assert_eq!(events[203].1["status"], "succeeded");
}

#[tokio::test]
async fn stream_of_a_running_experiment_replays_logs_then_sends_live_logs_and_traces() {
    let t = setup().await;
    let (worker, id) = running(&t, json!({"dp": 2})).await;
    let stored = json!([log_event(0), metric(0, 4.0), log_event(1)]);
    t.worker("events", json!({"worker_id": worker, "experiment_id": id, "events": stored})).await;

    let resp = t.send(Request::get(format!("/api/experiments/{id}/stream")).body(Body::empty()).expect("req")).await;
    assert_eq!(resp.status(), StatusCode::OK);
    let reader = tokio::spawn(async move {
        tokio::time::timeout(Duration::from_secs(5), resp.into_body().collect()).await.map(|b| b.map(|c| c.to_bytes()))
    });
    // The handler subscribed before answering: everything from here on is live.
    let live = json!([log_event(2), trace_event(&rank_trace(1, 2, 2))]);
    t.worker("events", json!({"worker_id": worker, "experiment_id": id, "events": live})).await;
    t.worker("complete", json!({"worker_id": worker, "experiment_id": id, "summary": summary()})).await;

    let bytes = reader.await.expect("task").expect("the stream ends").expect("body");
    let events = parse_sse(&String::from_utf8_lossy(&bytes));
    let names: Vec<&str> = events.iter().map(|(n, _)| n.as_str()).collect();
    assert_eq!(names, vec!["status", "log", "log", "metric", "log", "trace", "status"], "{events:?}");
    let messages: Vec<&Value> = events.iter().filter(|(n, _)| n == "log").map(|(_, d)| &d["message"]).collect();
    assert_eq!(messages, vec!["line 0", "line 1", "line 2"], "each line once");
    assert_eq!(events[5].1, json!({"type": "trace", "rank": 1}));
    assert_eq!(events[6].1["status"], "succeeded");
}

#[tokio::test]
async fn open_streams_are_bounded() {
    let t = setup_with(|c| c.max_sse_connections = 1).await;
    let id = t.create("watched").await;
    let first = t.send(Request::get(format!("/api/experiments/{id}/stream")).body(Body::empty()).expect("req")).await;
    assert_eq!(first.status(), StatusCode::OK);
    let a = t.get(&format!("/api/experiments/{id}/stream")).await;
    assert_api_error(&a, StatusCode::SERVICE_UNAVAILABLE);
    drop(first);
    let again = t.send(Request::get(format!("/api/experiments/{id}/stream")).body(Body::empty()).expect("req")).await;
    assert_eq!(again.status(), StatusCode::OK);
}

// ---------------------------------------------------------------- middleware, static files

#[tokio::test]
async fn json_answers_are_gzipped_when_asked() {
    let t = setup().await;
    for i in 0..5 {
        t.create(&format!("e{i}")).await;
    }
    let resp = t
        .send(
            Request::get("/api/experiments").header(header::ACCEPT_ENCODING, "gzip").body(Body::empty()).expect("req"),
        )
        .await;
    assert_eq!(resp.status(), StatusCode::OK);
    assert_eq!(resp.headers().get(header::CONTENT_ENCODING).and_then(|v| v.to_str().ok()), Some("gzip"));
}

#[tokio::test]
async fn frontend_not_built_page() {
    let t = setup().await;
    let a = t.get("/").await;
    assert_eq!(a.status, StatusCode::OK);
    let page = a.body.as_str().expect("html");
    assert!(page.contains("not built") && page.contains("cargo xtask run"), "{page}");
}

#[tokio::test]
async fn frontend_files_and_client_side_routes() {
    let t = setup().await;
    let site = t.dir.path().join("site");
    std::fs::create_dir_all(&site).expect("site dir");
    std::fs::write(site.join("index.html"), "<!doctype html><title>distlab app</title>").expect("index");
    std::fs::write(site.join("app_bg.wasm"), b"\0asm\x01\0\0\0").expect("wasm");
    std::fs::write(site.join("app.js"), "console.log('hi')").expect("js");

    for path in ["/", "/experiments/3", "/new"] {
        let a = t.get(path).await;
        assert_eq!(a.status, StatusCode::OK, "{path}");
        assert!(a.body.as_str().is_some_and(|b| b.contains("distlab app")), "{path}: {}", a.body);
    }
    let a = t.get("/app_bg.wasm").await;
    assert_eq!(a.status, StatusCode::OK);
    assert_eq!(a.headers.get(header::CONTENT_TYPE).and_then(|v| v.to_str().ok()), Some("application/wasm"));
    let a = t.get("/app.js").await;
    assert!(a
        .headers
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|ct| ct.contains("javascript")));
    assert_eq!(t.get("/missing.js").await.status, StatusCode::NOT_FOUND);
    let cache = |a: &Answer| a.headers.get(header::CACHE_CONTROL).and_then(|v| v.to_str().ok()).map(str::to_string);
    assert_eq!(cache(&t.get("/").await).as_deref(), Some("no-cache"), "index.html is revalidated");

    // A versioned build's files are kept by browsers for good; a missing one is not.
    let assets = site.join("assets").join("0123456789abcdef");
    std::fs::create_dir_all(&assets).expect("assets dir");
    std::fs::write(assets.join("chunk_1.wasm"), b"\0asm\x01\0\0\0").expect("chunk");
    let a = t.get("/assets/0123456789abcdef/chunk_1.wasm").await;
    assert_eq!(a.status, StatusCode::OK);
    assert_eq!(a.headers.get(header::CONTENT_TYPE).and_then(|v| v.to_str().ok()), Some("application/wasm"));
    assert_eq!(cache(&a).as_deref(), Some("public, max-age=31536000, immutable"));
    let gone = t.get("/assets/fedcba9876543210/chunk_1.wasm").await;
    assert_eq!(gone.status, StatusCode::NOT_FOUND);
    assert!(!cache(&gone).is_some_and(|c| c.contains("immutable")), "{:?}", cache(&gone));
    // The API is not shadowed by the frontend.
    assert_eq!(t.get("/api/health").await.status, StatusCode::OK);
}

// ---------------------------------------------------------------- compare

#[tokio::test]
async fn compare_shows_two_runs_their_diff_verdict_and_exports() {
    let t = setup().await;
    let worker = t.register(&["cpu"]).await;
    // One rank with micro-batch 8, and DDP on 2 ranks with micro-batch 4: the same training.
    let one = t
        .post(
            "/api/experiments",
            json!({"name": "one rank", "train": {"steps": 3, "warmup_steps": 1, "micro_batch": 8}}),
        )
        .await;
    let ddp = t
        .post(
            "/api/experiments",
            json!({"name": "ddp, 2 ranks", "parallel": {"dp": 2}, "train": {"steps": 3, "warmup_steps": 1, "micro_batch": 4}}),
        )
        .await;
    assert_eq!((one.status, ddp.status), (StatusCode::CREATED, StatusCode::CREATED), "{} {}", one.body, ddp.body);
    let (one, ddp) = (one.body["id"].as_i64().expect("id"), ddp.body["id"].as_i64().expect("id"));
    for (id, losses) in [(one, [5.0, 4.0, 3.0]), (ddp, [5.0, 4.00001, 3.00002])] {
        assert_eq!(t.lease(worker).await.experiment_id, id);
        let mut events: Vec<Value> = losses.iter().enumerate().map(|(s, l)| metric(s as u64, *l)).collect();
        if id == ddp {
            events.extend([trace_event(&rank_trace(0, 2, 2)), trace_event(&rank_trace(1, 2, 2))]);
        }
        let a = t.worker("events", json!({"worker_id": worker, "experiment_id": id, "events": events})).await;
        assert_eq!(a.status, StatusCode::OK, "{}", a.body);
        let a = t.worker("complete", json!({"worker_id": worker, "experiment_id": id, "summary": summary()})).await;
        assert_eq!(a.status, StatusCode::OK, "{}", a.body);
    }

    let a = t.get(&format!("/api/compare?ids={one},{ddp}")).await;
    assert_eq!(a.status, StatusCode::OK, "{}", a.body);
    let view: compare::CompareView = serde_json::from_value(a.body).expect("CompareView");
    assert_eq!(view.runs.iter().map(|r| r.experiment.id).collect::<Vec<_>>(), vec![one, ddp]);
    assert_eq!(view.runs[1].metrics.len(), 3);
    let dp_row = view.config.iter().find(|r| r.field == "parallel.dp").expect("dp row");
    assert!(dp_row.differs && dp_row.values == ["1", "2"]);
    let world = view.config.iter().find(|r| r.field == "world size").expect("derived row");
    assert!(world.derived && world.differs);
    assert!(!view.config.iter().find(|r| r.field == "model.layers").expect("layers").differs);
    let verdict = &view.equivalence[0];
    assert_eq!((verdict.baseline, verdict.other, verdict.common_steps), (one, ddp, 3));
    assert!(verdict.not_expected_because.is_empty(), "{:?}", verdict.not_expected_because);
    assert!(verdict.equivalent, "{verdict:?}");
    // DDP's trace: 8192 bytes per rank over 3 steps; its time split comes from the spans.
    let stats = &view.runs[1].stats;
    assert!((stats.dp_comm_bytes_per_step.expect("comm") - 8192.0 / 3.0).abs() < 1e-9, "{stats:?}");
    assert!(stats.predicted_dp_comm_bytes_per_step.is_some_and(|b| b > 0));
    let split = stats.time_split.expect("split");
    assert!((split.compute_ms - 0.2).abs() < 1e-9 && (split.comm_ms - 0.1).abs() < 1e-9, "{split:?}");
    assert!(view.runs[0].stats.time_split.is_none(), "no trace, no split");

    let csv = t.get(&format!("/api/compare?ids={one},{ddp}&format=csv")).await;
    assert_eq!(csv.status, StatusCode::OK);
    assert!(csv.headers[header::CONTENT_DISPOSITION].to_str().unwrap_or("").contains("metrics.csv"));
    let text = csv.body.as_str().expect("csv text");
    assert!(text.starts_with("experiment_id,name,step,loss"), "{text}");
    assert!(text.contains(&format!("{ddp},\"ddp, 2 ranks\",1,4.00001,")), "{text}");
    assert_eq!(text.lines().count(), 7);
    let summary_csv = t.get(&format!("/api/compare?ids={one},{ddp}&format=csv&table=summary")).await;
    assert_eq!(summary_csv.body.as_str().expect("csv").lines().count(), 3);
    let json_file = t.get(&format!("/api/compare?ids={one},{ddp}&format=json")).await;
    assert!(json_file.headers[header::CONTENT_DISPOSITION].to_str().unwrap_or("").contains("view.json"));
    assert_eq!(json_file.body["runs"].as_array().map(Vec::len), Some(2));

    // Bad input: too few ids, a missing run, an unknown format.
    assert!(assert_api_error(&t.get(&format!("/api/compare?ids={one}")).await, StatusCode::BAD_REQUEST)
        .error
        .contains("pick 2 to 6"));
    assert!(assert_api_error(&t.get(&format!("/api/compare?ids={one},999")).await, StatusCode::NOT_FOUND)
        .error
        .contains("999"));
    assert_api_error(&t.get(&format!("/api/compare?ids={one},{ddp}&format=xml")).await, StatusCode::BAD_REQUEST);
    assert_api_error(&t.get("/api/compare").await, StatusCode::BAD_REQUEST);
}

#[tokio::test]
async fn card_claims_are_checked_by_the_latest_run_of_their_preset() {
    let t = setup().await;
    let a = t.get("/api/cards/checks").await;
    assert_eq!(a.status, StatusCode::OK, "{}", a.body);
    let before: claims::ClaimChecks = serde_json::from_value(a.body).expect("ClaimChecks");
    let allreduce = |c: &claims::ClaimChecks| {
        c.checks
            .iter()
            .find(|s| s.check == cards::ClaimCheck::AllreduceBytes && s.preset == "allreduce")
            .cloned()
            .expect("the all-reduce claim")
    };
    let status = allreduce(&before);
    assert!(status.measurement.is_none() && status.how.contains("run the allreduce preset"), "{status:?}");

    // A finished run of the allreduce preset, whose ranks each sent the formula's 96 bytes.
    let worker = t.register(&["cpu"]).await;
    let spec = presets::presets().into_iter().find(|p| p.key == "allreduce").expect("preset").spec;
    let created = t.post("/api/experiments", serde_json::to_value(&spec).expect("spec")).await;
    let id = created.body["id"].as_i64().expect("id");
    assert_eq!(t.lease(worker).await.experiment_id, id);
    let check =
        CollectiveCheck { world: 4, elements: 16, bytes_sent: vec![96; 4], formula_bytes: 96.0, ..Default::default() };
    let summary = RunSummary { collective: Some(check), ..RunSummary::default() };
    let a = t.worker("complete", json!({"worker_id": worker, "experiment_id": id, "summary": summary})).await;
    assert_eq!(a.status, StatusCode::OK, "{}", a.body);

    let after: claims::ClaimChecks =
        serde_json::from_value(t.get("/api/cards/checks").await.body).expect("ClaimChecks");
    let measured = allreduce(&after).measurement.expect("measured now");
    assert_eq!(measured.experiment_id, id);
    assert!(measured.agrees, "{measured:?}");
    assert_eq!(measured.predicted, "96 bytes per rank, in 2(W-1) = 6 steps");
}

/// A submission retried with the same `Idempotency-Key` (its first answer lost, say) gets the
/// first one's experiment; the same key with another spec is refused; bad keys are 400.
#[tokio::test]
async fn a_retried_submission_with_its_idempotency_key_queues_once() {
    let t = setup().await;
    let submit = |key: &str, name: &str| {
        Request::post("/api/experiments")
            .header(header::CONTENT_TYPE, "application/json")
            .header("idempotency-key", key)
            .body(Body::from(json!({"name": name, "train": {"steps": 10}}).to_string()))
            .expect("request")
    };
    let first = answer(t.send(submit("k-1", "run")).await).await;
    assert_eq!(first.status, StatusCode::CREATED, "{}", first.body);
    let again = answer(t.send(submit("k-1", "run")).await).await;
    assert_eq!(again.status, StatusCode::CREATED, "{}", again.body);
    assert_eq!(again.body["id"], first.body["id"]);
    assert_eq!(t.get("/api/experiments").await.body["total"], 1);
    let other = answer(t.send(submit("k-1", "another run")).await).await;
    let e = assert_api_error(&other, StatusCode::CONFLICT);
    assert!(e.error.contains("Idempotency-Key"), "{}", e.error);
    let second = answer(t.send(submit("k-2", "run")).await).await;
    assert_ne!(second.body["id"], first.body["id"]);
    let long = "x".repeat(201);
    assert_api_error(&answer(t.send(submit(&long, "run")).await).await, StatusCode::BAD_REQUEST);
    assert_eq!(t.get("/api/experiments").await.body["total"], 2);
}

/// `--max-run-seconds`: an attempt running longer is failed, saying why, and its worker is
/// told at its next report (409) so that it stops.
#[tokio::test]
async fn an_experiment_running_past_the_limit_is_stopped() {
    let t = setup_with(|c| c.max_run = Some(Duration::from_secs(600))).await;
    let worker = t.register(&["cpu"]).await;
    let id = t.create("long").await;
    t.lease(worker).await;
    t.state.reap_expired(SystemTime::now() + Duration::from_secs(20)).await.expect("reap");
    assert_eq!(t.view(id).await.status, ExperimentStatus::Running, "within the limit (and the lease)");
    // 11 minutes on, with the lease kept alive by heartbeats.
    let later = SystemTime::now() + Duration::from_secs(660);
    sqlx::query("UPDATE experiments SET lease_until = '9000-01-01T00:00:00.000Z' WHERE id = $1")
        .bind(id)
        .execute(&t.state.db)
        .await
        .expect("keep the lease");
    t.state.reap_expired(later).await.expect("reap");
    let v = t.view(id).await;
    assert_eq!(v.status, ExperimentStatus::Failed);
    assert!(v.error.as_deref().is_some_and(|e| e.contains("--max-run-seconds")), "{:?}", v.error);
    let a = t.worker("heartbeat", json!({"worker_id": worker, "experiment_id": id})).await;
    assert_api_error(&a, StatusCode::CONFLICT);
}

/// Admission control: with a live worker that says how much memory it has, a CPU spec whose
/// ranks together need more (the planner's count) is refused at submission, naming both
/// sizes; one that fits is queued. Without any worker saying, nothing is refused for size.
#[tokio::test]
async fn a_spec_too_big_for_every_worker_is_refused_at_submission() {
    let t = setup().await;
    let big = json!({
        "name": "big",
        "model": {"layers": 8, "d_model": 512, "heads": 8, "seq_len": 256, "vocab": 16000},
        "parallel": {"dp": 2},
        "train": {"steps": 10, "micro_batch": 8}
    });
    let spec = ExperimentSpec::from_json_value(big.clone()).expect("spec");
    let needed = planner::plan(&spec).expect("plan").memory_of_all_ranks();
    assert!(needed > 1 << 30, "the example needs more than 1 GiB ({needed})");
    assert_eq!(t.post("/api/experiments", big.clone()).await.status, StatusCode::CREATED, "no worker says its size");
    let register = |memory: u64| {
        json!({"name": "small", "backends": ["cpu"], "devices": [], "version": VERSION,
               "capacity": {"memory_bytes": memory, "cores": 2, "gpus": 0}})
    };
    assert_eq!(t.worker("register", register(1 << 30)).await.status, StatusCode::OK);
    let e = assert_api_error(&t.post("/api/experiments", big.clone()).await, StatusCode::UNPROCESSABLE_ENTITY);
    assert_eq!(e.fields[0].field, "model");
    assert!(e.error.contains("1.00 GiB") && e.error.contains("its 2 ranks need"), "{}", e.error);
    let small = json!({"name": "small", "train": {"steps": 10}});
    assert_eq!(t.post("/api/experiments", small).await.status, StatusCode::CREATED);
    // A larger worker joins: the big spec fits it.
    assert_eq!(t.worker("register", register(needed + (1 << 20))).await.status, StatusCode::OK);
    assert_eq!(t.post("/api/experiments", big).await.status, StatusCode::CREATED);
}

/// Admission control on GPUs: a CUDA run's ranks take a worker's GPUs in turn, so the
/// busiest GPU must hold the ranks that share it. Refused when no live CUDA worker's GPUs
/// can (naming the sizes); queued once a worker with enough GPUs says so.
#[tokio::test]
async fn a_cuda_spec_too_big_for_every_gpu_is_refused_at_submission() {
    let t = setup().await;
    let big = json!({
        "name": "big on a GPU",
        "backend": "cuda",
        "model": {"layers": 8, "d_model": 512, "heads": 8, "seq_len": 256, "vocab": 16000},
        "parallel": {"dp": 2},
        "train": {"steps": 10, "micro_batch": 8}
    });
    let plan = planner::plan(&ExperimentSpec::from_json_value(big.clone()).expect("spec")).expect("plan");
    let (one_gpu, own_gpus) = (plan.memory_per_gpu(1), plan.memory_per_gpu(2));
    assert_eq!(one_gpu, 2 * own_gpus, "two ranks on one GPU need twice one rank");
    let register = |gpus: u32, gpu_memory: u64| {
        json!({"name": "gpu box", "backends": ["cpu", "cuda"], "devices": [], "version": VERSION,
               "capacity": {"memory_bytes": 1u64 << 40, "cores": 16, "gpus": gpus, "gpu_memory_bytes": gpu_memory}})
    };
    // One GPU with room for one rank, not two.
    assert_eq!(t.worker("register", register(1, own_gpus + (1 << 20))).await.status, StatusCode::OK);
    let e = assert_api_error(&t.post("/api/experiments", big.clone()).await, StatusCode::UNPROCESSABLE_ENTITY);
    assert_eq!(e.fields[0].field, "model");
    assert!(e.error.contains("on each GPU of a worker with 1 GPU(s)"), "{}", e.error);
    // The CPU memory of that worker is no reason to refuse: the same spec on the CPU is taken.
    let mut on_cpu = big.clone();
    on_cpu["backend"] = json!("cpu");
    assert_eq!(t.post("/api/experiments", on_cpu).await.status, StatusCode::CREATED);
    // Two such GPUs: each rank has its own.
    assert_eq!(t.worker("register", register(2, own_gpus + (1 << 20))).await.status, StatusCode::OK);
    assert_eq!(t.post("/api/experiments", big).await.status, StatusCode::CREATED);
}

/// The worker that ran an experiment hands over its trained model (safetensors) before it
/// reports the run complete; anyone fetches it and its config.json; it goes with the
/// experiment. Another worker, a file that is not safetensors, or one over the limit is
/// refused, and an experiment without a model says why.
#[tokio::test]
async fn a_worker_hands_over_the_trained_model_and_it_is_served_and_removed() {
    let model_bytes = 1 << 20;
    let t = setup_with(|c| c.max_model_bytes = model_bytes).await;
    let worker = t.register(&["cpu"]).await;
    let other = t.register(&["cpu"]).await;
    let id = t.create("model").await;
    assert_eq!(t.lease(worker).await.experiment_id, id);
    let app = &t;
    let upload = |by: i64, bytes: Vec<u8>| {
        let req = Request::builder()
            .method(Method::PUT)
            .uri(format!("/api/workers/experiments/{id}/model"))
            .header(header::AUTHORIZATION, format!("Bearer {}", app.credential(by)))
            .header(header::CONTENT_TYPE, "application/octet-stream")
            .body(Body::from(bytes))
            .expect("request");
        async move { answer(app.send(req).await).await }
    };
    // The experiment's model (the default spec's), every value its index.
    let layout = distlab_worker::model::ParamLayout::new(&ExperimentSpec::default().model);
    let params: Vec<f32> = (0..layout.total).map(|i| i as f32).collect();
    let tensors = distlab_worker::export::tensors_of(&layout, &params);
    let file = distlab_worker::export::hf_safetensors(&layout.model, &tensors).expect("a model file");
    let values: Vec<f32> = (0..16).map(|i| i as f32).collect();
    let view = safetensors::tensor::TensorView::new(safetensors::Dtype::F32, vec![4, 4], bytemuck_bytes(&values))
        .expect("view");
    let not_this_model = safetensors::serialize([("lm_head.weight", view)], None).expect("serialize");

    let e = assert_api_error(&t.get(&format!("/api/experiments/{id}/model")).await, StatusCode::CONFLICT);
    assert!(e.error.contains("it is running"), "{}", e.error);
    assert_api_error(&upload(other, file.clone()).await, StatusCode::CONFLICT);
    let e = assert_api_error(&upload(worker, b"not a model".to_vec()).await, StatusCode::UNPROCESSABLE_ENTITY);
    assert!(e.error.contains("not a safetensors file"), "{}", e.error);
    let e = assert_api_error(&upload(worker, not_this_model).await, StatusCode::UNPROCESSABLE_ENTITY);
    assert!(e.error.contains("the file has no transformer.wte.weight"), "{}", e.error);
    assert!(file.len() < model_bytes);
    assert_api_error(&upload(worker, vec![0; model_bytes + 1]).await, StatusCode::PAYLOAD_TOO_LARGE);
    assert_eq!(upload(worker, file.clone()).await.status, StatusCode::NO_CONTENT);
    // Not served before the run has succeeded.
    assert_api_error(&t.get(&format!("/api/experiments/{id}/model")).await, StatusCode::CONFLICT);
    let a = t.worker("complete", json!({"worker_id": worker, "experiment_id": id, "summary": summary()})).await;
    assert_eq!(a.status, StatusCode::OK, "{}", a.body);

    let resp = t.send(Request::get(format!("/api/experiments/{id}/model")).body(Body::empty()).unwrap()).await;
    assert_eq!(resp.status(), StatusCode::OK);
    assert_eq!(resp.headers()[header::CONTENT_TYPE], "application/octet-stream");
    assert_eq!(resp.into_body().collect().await.expect("body").to_bytes().to_vec(), file);
    let config = t.get(&format!("/api/experiments/{id}/model/config")).await;
    assert_eq!(config.status, StatusCode::OK, "{}", config.body);
    assert_eq!(config.body["n_layer"], ExperimentSpec::default().model.layers);
    assert_eq!(config.body["tie_word_embeddings"], false);

    let stored = t.state.config.data_dir.join("models").join(format!("experiment-{id}.safetensors"));
    assert!(stored.exists());
    assert_eq!(
        t.call(Method::DELETE, &format!("/api/experiments/{id}"), None, None).await.status,
        StatusCode::NO_CONTENT
    );
    assert!(!stored.exists(), "the model goes with its experiment");
    assert_api_error(&t.get(&format!("/api/experiments/{id}/model")).await, StatusCode::NOT_FOUND);

    // A model with experts has none to give, and says so.
    let a = t
        .post(
            "/api/experiments",
            json!({"name": "moe", "model": {"experts": 2, "expert_top_k": 1}, "train": {"steps": 10}}),
        )
        .await;
    assert_eq!(a.status, StatusCode::CREATED, "{}", a.body);
    let moe = a.body["id"].as_i64().expect("id");
    let e = assert_api_error(&t.get(&format!("/api/experiments/{moe}/model/config")).await, StatusCode::CONFLICT);
    assert!(e.error.contains("Mixture-of-Experts"), "{}", e.error);
}

/// One person's share of the disk (`--max-disk-per-user-mb`): datasets count their bytes, a
/// queued experiment what its plan reserves (three checkpoints and the model), an ended one
/// its kept checkpoint and stored model; beyond the share a submission or an upload is
/// refused with 507 and loses nothing, and deleting gives the room back.
#[tokio::test]
async fn a_persons_share_of_the_disk_bounds_submissions_and_uploads_and_comes_back() {
    let spec = json!({"name": "big", "train": {"steps": 10, "checkpoint_every": 1}});
    let plan = distlab_common::disk::DiskPlan::of(&ExperimentSpec::from_json_value(spec.clone()).expect("spec"));
    assert!(plan.checkpoint > 0 && plan.model > 0, "{plan:?}");
    let limit = plan.while_running() + 3000;
    let t = setup_with(|c| c.max_disk_per_user = Some(limit)).await;
    let upload = |name: &str| {
        Request::post(format!("/api/datasets?name={name}"))
            .header(header::CONTENT_TYPE, "text/plain")
            .body(Body::from("x".repeat(2000)))
            .expect("request")
    };
    let used = || async {
        let (mut tx, _turn) = distlab_server::store::begin_write(&t.state.db).await.expect("tx");
        let used = distlab_server::store::disk_quota::used(&mut tx, "local").await.expect("used");
        tx.commit().await.expect("commit");
        used
    };
    assert_eq!(answer(t.send(upload("first")).await).await.status, StatusCode::CREATED);
    assert_eq!(used().await, 2000);
    let first = t.create_with(spec.clone()).await;
    assert_eq!(used().await, 2000 + plan.while_running());
    let e = assert_api_error(&answer(t.send(upload("second")).await).await, StatusCode::INSUFFICIENT_STORAGE);
    assert!(e.error.contains("--max-disk-per-user-mb"), "{e:?}");
    assert_eq!(t.get("/api/datasets").await.body["datasets"].as_array().map(Vec::len), Some(1));
    let e = assert_api_error(&t.post("/api/experiments", spec.clone()).await, StatusCode::INSUFFICIENT_STORAGE);
    assert!(e.error.contains("delete finished experiments"), "{e:?}");
    assert_eq!(t.get("/api/experiments").await.body["total"], 1, "the refused one is not kept");
    // Cancelled, it keeps the room of one checkpoint until it is deleted.
    assert_eq!(t.post(&format!("/api/experiments/{first}/cancel"), json!({})).await.status, StatusCode::OK);
    assert_eq!(used().await, 2000 + plan.checkpoint);
    assert_api_error(&t.post("/api/experiments", spec.clone()).await, StatusCode::INSUFFICIENT_STORAGE);
    let deleted = t.call(Method::DELETE, &format!("/api/experiments/{first}"), None, None).await;
    assert_eq!(deleted.status, StatusCode::NO_CONTENT);
    let second = t.create_with(spec.clone()).await;

    // Succeeded, it keeps its latest checkpoint and the model file its worker handed over.
    let worker = t.register(&["cpu"]).await;
    assert_eq!(t.lease(worker).await.experiment_id, second);
    let layout = distlab_worker::model::ParamLayout::new(&ExperimentSpec::default().model);
    let params: Vec<f32> = vec![0.5; layout.total];
    let file =
        distlab_worker::export::hf_safetensors(&layout.model, &distlab_worker::export::tensors_of(&layout, &params))
            .expect("a model file");
    let put = Request::builder()
        .method(Method::PUT)
        .uri(format!("/api/workers/experiments/{second}/model"))
        .header(header::AUTHORIZATION, format!("Bearer {}", t.credential(worker)))
        .header(header::CONTENT_TYPE, "application/octet-stream")
        .body(Body::from(file.clone()))
        .expect("request");
    assert_eq!(t.send(put).await.status(), StatusCode::NO_CONTENT);
    let a = t.worker("complete", json!({"worker_id": worker, "experiment_id": second, "summary": summary()})).await;
    assert_eq!(a.status, StatusCode::OK, "{}", a.body);
    assert_eq!(used().await, 2000 + plan.checkpoint + file.len() as u64);
    assert!(file.len() as u64 <= plan.model, "the plan covers the model: {} > {}", file.len(), plan.model);
}

fn bytemuck_bytes(values: &[f32]) -> &[u8] {
    // f32s as the little-endian bytes safetensors stores (this machine's order).
    unsafe { std::slice::from_raw_parts(values.as_ptr().cast::<u8>(), std::mem::size_of_val(values)) }
}

/// `GET /metrics`: Prometheus' text format with the queue, the leases, the workers'
/// heartbeats and every request by route template, each moving as the server works.
#[tokio::test]
async fn metrics_report_the_queue_the_workers_and_every_route() {
    let t = setup().await;
    let scrape = |t: &TestApp| {
        let app = t.app.clone();
        async move {
            let resp = app.oneshot(Request::get("/metrics").body(Body::empty()).unwrap()).await.expect("infallible");
            assert_eq!(resp.status(), StatusCode::OK);
            let ct = resp.headers()[header::CONTENT_TYPE].to_str().unwrap().to_string();
            assert!(ct.starts_with("application/openmetrics-text"), "{ct}");
            String::from_utf8(resp.into_body().collect().await.expect("body").to_bytes().to_vec()).expect("text")
        }
    };
    let line = |text: &str, prefix: &str| -> Option<f64> {
        text.lines().find(|l| l.starts_with(prefix)).and_then(|l| l.rsplit(' ').next()).and_then(|v| v.parse().ok())
    };
    let before = scrape(&t).await;
    assert_eq!(line(&before, "distlab_queue_depth "), Some(0.0), "{before}");
    assert_eq!(line(&before, "distlab_workers_alive "), Some(0.0));
    assert!(before.trim_end().ends_with("# EOF"));

    let first = t.create("one").await;
    t.create("two").await;
    let worker = t.register(&["cpu"]).await;
    assert_eq!(t.lease(worker).await.experiment_id, first);
    t.get(&format!("/api/experiments/{first}")).await;
    t.get("/api/experiments/999999").await;

    let after = scrape(&t).await;
    assert_eq!(line(&after, "distlab_queue_depth "), Some(1.0), "{after}");
    assert_eq!(line(&after, "distlab_leases "), Some(1.0));
    assert_eq!(line(&after, "distlab_workers_alive "), Some(1.0));
    assert_eq!(line(&after, "distlab_experiments{status=\"running\"} "), Some(1.0));
    assert_eq!(line(&after, "distlab_experiments{status=\"queued\"} "), Some(1.0));
    let age = line(&after, &format!("distlab_worker_heartbeat_age_seconds{{worker=\"w #{worker}\"}} "));
    assert!(age.is_some_and(|a| (0.0..5.0).contains(&a)), "{after}");
    let created = "distlab_http_requests_total{method=\"POST\",route=\"/api/experiments\",status=\"201\"} ";
    assert_eq!(line(&after, created), Some(2.0), "{after}");
    // One series per route template, however many ids: the found one and the missing one.
    let one = "distlab_http_requests_total{method=\"GET\",route=\"/api/experiments/{id}\",status=\"200\"} ";
    let missing = "distlab_http_requests_total{method=\"GET\",route=\"/api/experiments/{id}\",status=\"404\"} ";
    assert_eq!((line(&after, one), line(&after, missing)), (Some(1.0), Some(1.0)), "{after}");
    let timed = "distlab_http_request_duration_seconds_count{method=\"POST\",route=\"/api/workers/lease\"} ";
    assert_eq!(line(&after, timed), Some(1.0), "{after}");
    let buckets = after.lines().filter(|l| l.starts_with("distlab_http_request_duration_seconds_bucket{")).count();
    assert!(buckets >= 16, "a histogram's buckets per route: {after}");
}

// ---- runs across several workers ----

fn dp4() -> Value {
    json!({"name": "wide", "parallel": {"dp": 4}, "train": {"steps": 10}})
}

impl TestApp {
    /// Two workers of 2 ranks and a dp=4 run: b asks first (and waits), then a leases the
    /// run as host 0 with b idle. Answers (a, b, the run's id, a's lease); b has yet to
    /// take its part.
    async fn dp4_placed_on_two(&self) -> (i64, i64, i64, Lease) {
        let a = self.register_ranks(2).await;
        let b = self.register_ranks(2).await;
        let id = self.create_with(dp4()).await;
        assert_eq!(self.worker("lease", json!({"worker_id": b})).await.status, StatusCode::NO_CONTENT);
        let first = self.lease(a).await;
        assert_eq!((first.experiment_id, first.placement.as_ref().map(|p| p.host)), (id, Some(0)));
        (a, b, id, first)
    }
}

/// A dp=4 run on workers of 2 ranks waits for a second idle worker, then is placed on both:
/// host 0 (the worker that asked) leases it, the other takes its part at its next lease;
/// both get the same secret, and the rendezvous passes what each publishes to the other.
#[tokio::test]
async fn a_run_wider_than_a_worker_is_placed_on_two_and_they_meet_at_the_rendezvous() {
    let t = setup().await;
    let a = t.register_ranks(2).await;
    let b = t.register_ranks(2).await;
    let id = t.create_with(dp4()).await;
    let nothing = t.worker("lease", json!({"worker_id": a})).await;
    assert_eq!(nothing.status, StatusCode::NO_CONTENT, "no other worker is idle (b has not asked yet): it waits");
    // b asks while a (which asked a moment ago) is idle: b leases it as host 0, a is placed
    // as host 1.
    let (a, b) = (b, a);
    let first = t.lease(a).await;
    let p0 = first.placement.clone().expect("placed on several workers");
    assert_eq!((first.experiment_id, p0.host, p0.ranks_per_host.clone(), p0.ranks()), (id, 0, vec![2, 2], 0..2));
    assert_eq!(p0.secret.len(), 32);
    let second = t.lease(b).await;
    let p1 = second.placement.clone().expect("b's part");
    assert_eq!((second.experiment_id, second.attempt, p1.host, p1.ranks()), (id, first.attempt, 1, 2..4));
    assert_eq!(p1.secret, p0.secret);
    assert_eq!(t.view(id).await.status, ExperimentStatus::Running);

    let meet = |worker: i64, publish: Value| {
        let body = json!({"worker_id": worker, "experiment_id": id, "attempt": first.attempt, "publish": publish});
        t.worker("rendezvous", body)
    };
    let seen = meet(a, json!([{"name": "rank-0.addr", "value": "10.0.0.1:4000"}])).await;
    assert_eq!(seen.status, StatusCode::OK, "{}", seen.body);
    assert_eq!((seen.body["hosts"].clone(), seen.body["joined"].clone()), (json!(2), json!(2)));
    let seen =
        meet(b, json!([{"name": "rank-2.addr", "value": "10.0.0.2:4000"}, {"name": "rank-0.addr", "value": "x"}]))
            .await;
    let entries: Vec<(String, String)> = seen.body["entries"]
        .as_array()
        .expect("entries")
        .iter()
        .map(|e| (e["name"].as_str().unwrap().to_string(), e["value"].as_str().unwrap().to_string()))
        .collect();
    assert_eq!(
        entries,
        [("rank-0.addr".into(), "10.0.0.1:4000".into()), ("rank-2.addr".into(), "10.0.0.2:4000".into())],
        "each name keeps its first value"
    );
    // Nobody else reads it, nothing oversized goes in.
    let c = t.register_ranks(2).await;
    assert_eq!(meet(c, json!([])).await.status, StatusCode::CONFLICT);
    let long = meet(a, json!([{"name": "n", "value": "v".repeat(2000)}])).await;
    assert_eq!(
        (long.status, long.body["fields"][0]["field"].clone()),
        (StatusCode::BAD_REQUEST, json!("publish[0].value"))
    );

    // Both hosts report; host 0 completes the run; the other host's next heartbeat learns it ended.
    for worker in [a, b] {
        let hb = t.worker("heartbeat", json!({"worker_id": worker, "experiment_id": id})).await;
        assert_eq!((hb.status, hb.body["cancel"].clone()), (StatusCode::OK, json!(false)));
    }
    let logged = t.worker("events", json!({"worker_id": b, "experiment_id": id, "events": [{"type": "log", "level": "info", "message": "host 1 up"}]})).await;
    assert_eq!(logged.status, StatusCode::OK, "{}", logged.body);
    let done = t.worker("complete", json!({"worker_id": a, "experiment_id": id, "summary": summary()})).await;
    assert_eq!(done.status, StatusCode::OK, "{}", done.body);
    let late = t.worker("heartbeat", json!({"worker_id": b, "experiment_id": id})).await;
    assert_eq!(late.status, StatusCode::CONFLICT, "the run is over: host 1 stops");
    assert_eq!(meet(a, json!([])).await.status, StatusCode::CONFLICT, "the rendezvous closes with the attempt");
}

/// Both hosts' heartbeats keep a run across workers alive past the lease's length (host 0
/// renews the experiment's lease, the other host its part's).
#[tokio::test]
async fn heartbeats_of_both_hosts_keep_the_run_alive() {
    let t = setup_with(|c| (c.lease_seconds, c.heartbeat_seconds) = (1.0, 0.2)).await;
    let (a, b, id, _) = t.dp4_placed_on_two().await;
    t.lease(b).await;
    for _ in 0..3 {
        tokio::time::sleep(Duration::from_millis(600)).await;
        for worker in [a, b] {
            assert_eq!(
                t.worker("heartbeat", json!({"worker_id": worker, "experiment_id": id})).await.status,
                StatusCode::OK
            );
        }
        t.state.reap_expired(SystemTime::now()).await.expect("reap");
    }
    assert_eq!(t.view(id).await.status, ExperimentStatus::Running, "1.8 s into a run with 1 s leases");
}

/// Placement keeps tensor-parallel groups whole: workers of 1 rank cannot take a tp=2 run,
/// and a server with --allow-multi-host false refuses what no single worker runs.
#[tokio::test]
async fn tensor_parallel_groups_are_never_cut_and_multi_host_can_be_switched_off() {
    let t = setup().await;
    let a = t.register_ranks(1).await;
    let b = t.register_ranks(1).await;
    let c = t.register_ranks(1).await;
    let id =
        t.create_with(json!({"name": "tp", "model": {"heads": 4}, "parallel": {"tp": 2}, "train": {"steps": 5}})).await;
    for w in [b, c, a] {
        assert_eq!(t.worker("lease", json!({"worker_id": w})).await.status, StatusCode::NO_CONTENT);
    }
    assert_eq!(t.view(id).await.status, ExperimentStatus::Queued);

    let t = setup_with(|c| c.allow_multi_host = false).await;
    t.register_ranks(2).await;
    t.register_ranks(2).await;
    let refused = t.post("/api/experiments", dp4()).await;
    assert_eq!(refused.status, StatusCode::UNPROCESSABLE_ENTITY);
    assert!(
        refused.body["fields"][0]["message"].as_str().unwrap_or("").contains("--allow-multi-host false"),
        "{}",
        refused.body
    );
    // With it on, more ranks than all live workers together are refused too.
    let t = setup().await;
    t.register_ranks(2).await;
    t.register_ranks(1).await;
    let refused = t.post("/api/experiments", dp4()).await;
    assert!(
        refused.body["fields"][0]["message"].as_str().unwrap_or("").contains("run together (3)"),
        "{}",
        refused.body
    );
}

/// A placement whose second worker never takes its part is released after the gang
/// timeout: the run is queued again as if never leased, host 0 learns it (409), and the
/// worker is free to be placed again.
#[tokio::test]
async fn a_placement_whose_workers_do_not_all_come_is_released() {
    let t = setup().await;
    let (a, b, id, first) = t.dp4_placed_on_two().await;
    assert_eq!(first.attempt, 1);
    // b never comes back for its part.
    t.state.reap_expired(SystemTime::now() + Duration::from_secs(10)).await.expect("reap");
    assert_eq!(t.view(id).await.status, ExperimentStatus::Running, "within the gang timeout it waits");
    t.state.reap_expired(SystemTime::now() + Duration::from_secs(31)).await.expect("reap");
    let view = t.view(id).await;
    assert_eq!(
        (view.status, view.attempt),
        (ExperimentStatus::Queued, 0),
        "back in the queue, the attempt not counted"
    );
    let hb = t.worker("heartbeat", json!({"worker_id": a, "experiment_id": id})).await;
    assert_eq!(hb.status, StatusCode::CONFLICT);
    // Host 0 then says its wait for the others failed: about an attempt that is over.
    let late = json!({"worker_id": a, "experiment_id": id, "attempt": 1, "error": "only 1 of the run's 2 hosts took their part"});
    assert_eq!(t.worker("fail", late).await.status, StatusCode::CONFLICT);
    assert_eq!(t.view(id).await.status, ExperimentStatus::Queued);
    let logs: Vec<String> = sqlx::query_scalar("SELECT message FROM logs WHERE experiment_id = $1")
        .bind(id)
        .fetch_all(&t.state.db)
        .await
        .expect("logs");
    assert!(logs.iter().any(|l| l.contains(&format!("worker {b} did not take its part"))), "{logs:?}");
    // Both ask again: the run is placed anew, as attempt 1.
    assert_eq!(t.worker("lease", json!({"worker_id": b})).await.status, StatusCode::NO_CONTENT);
    let again = t.lease(a).await;
    assert_eq!((again.experiment_id, again.attempt), (id, 1));
    assert_eq!(t.lease(b).await.placement.map(|p| p.host), Some(1));
}

/// When a host of the run goes away, the others' ranks fail with a lost peer: the run goes
/// back to the queue to resume. If the host that went away failed for a reason of its own,
/// its report still fails the run; a host whose part's lease expires re-queues it too.
#[tokio::test]
async fn a_lost_host_requeues_the_run_and_a_real_error_still_fails_it() {
    let t = setup().await;
    let (a, b, id, _) = t.dp4_placed_on_two().await;
    t.lease(b).await;
    let lost = json!({"worker_id": a, "experiment_id": id, "error": "rank 1: rank 2 hung up", "lost_host": true});
    let answer = t.worker("fail", lost).await;
    assert_eq!(answer.status, StatusCode::OK, "{}", answer.body);
    let view = t.view(id).await;
    assert_eq!((view.status, view.attempt), (ExperimentStatus::Queued, 1));
    // A report about another attempt changes nothing; b's own error, of this attempt, fails it.
    let stale = json!({"worker_id": b, "experiment_id": id, "attempt": 7, "error": "old news"});
    assert_eq!(t.worker("fail", stale).await.status, StatusCode::CONFLICT);
    assert_eq!(t.view(id).await.status, ExperimentStatus::Queued);
    let real = json!({"worker_id": b, "experiment_id": id, "attempt": 1, "error": "rank 2 panicked: out of memory"});
    assert_eq!(t.worker("fail", real).await.status, StatusCode::OK);
    let view = t.view(id).await;
    assert_eq!(
        (view.status, view.error.as_deref()),
        (ExperimentStatus::Failed, Some("rank 2 panicked: out of memory"))
    );

    // A member whose heartbeats stop: its part's lease expires and the run is re-queued.
    let t = setup().await;
    let (_, b, id, _) = t.dp4_placed_on_two().await;
    t.lease(b).await;
    t.state.reap_expired(SystemTime::now() + Duration::from_secs(25)).await.expect("reap");
    assert_eq!(t.view(id).await.status, ExperimentStatus::Running, "both leases last 30 s");
    // Only host 1's part has expired (host 0's lease is pushed far out): re-queued all the same.
    sqlx::query("UPDATE experiments SET lease_until = '9000-01-01T00:00:00.000Z' WHERE id = $1")
        .bind(id)
        .execute(&t.state.db)
        .await
        .expect("host 0 keeps its lease");
    t.state.reap_expired(SystemTime::now() + Duration::from_secs(31)).await.expect("reap");
    assert_eq!(t.view(id).await.status, ExperimentStatus::Queued);
}
