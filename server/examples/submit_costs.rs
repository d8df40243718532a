//! Where a `POST /api/experiments` goes, on one thread: the submission through the router
//! (no sockets), then its parts one at a time: the reads every submission makes before it
//! writes (the live workers' ranks and memory) and the transaction that queues it, which
//! submissions take in turn (`store::begin_write`): its share bounds how many a second the
//! server can queue, however many cores answer the rest; and 64 submissions made at once,
//! which share transactions (`store/group_commit.rs`). A server on SQLite without
//! accounts. Run: `cargo run --release -p distlab-server --example submit_costs`.

use std::time::Instant;

use axum::body::Body;
use axum::http::{header, Request};
use distlab_common::{BackendKind, ExperimentSpec};
use distlab_server::store::{self, queue, workers};
use distlab_server::{app, clock, AppState, ServerConfig};
use http_body_util::BodyExt;
use tower::ServiceExt;

mod timing;
use timing::{per_call, ROUNDS};

const TOGETHER: usize = 64;
const SPEC: &str = r#"{"name": "load", "train": {"steps": 10}}"#;

#[tokio::main(flavor = "current_thread")]
async fn main() {
    let dir = tempfile::tempdir().expect("a temporary directory");
    let config = ServerConfig {
        data_dir: dir.path().join("data"),
        static_dir: dir.path().join("site"),
        local_workers: 0,
        worker_token: "submit-costs".into(),
        max_queued_per_user: 1_000_000,
        ..ServerConfig::default()
    };
    let alive_window = config.worker_alive_window();
    let state = AppState::new(config).await.expect("the server's state");
    let router = app(state.clone());
    let db = state.db.clone();

    let whole = per_call(|| {
        let router = router.clone();
        async move {
            let req = Request::builder()
                .uri("/api/experiments")
                .method("POST")
                .header(header::HOST, "127.0.0.1")
                .header(header::CONTENT_TYPE, "application/json")
                .body(Body::from(SPEC))
                .expect("a request");
            let resp = router.oneshot(req).await.expect("an answer");
            assert_eq!(resp.status(), 201, "a submission");
            let _ = resp.into_body().collect().await.expect("a body");
        }
    })
    .await;
    let spec = ExperimentSpec::from_json_value(serde_json::from_str(SPEC).expect("JSON")).expect("a spec");
    let spec_json = serde_json::to_string(&spec).expect("JSON");
    let reads = per_call(|| {
        let db = db.clone();
        async move {
            let since = clock::before(clock::now(), alive_window);
            workers::live_ranks(&db, BackendKind::Cpu, &since).await.expect("ranks");
            workers::live_capacities(&db, BackendKind::Cpu, &since).await.expect("capacities");
        }
    })
    .await;
    let quota = queue::Quota { max_queued: 1_000_000, max_disk_bytes: None };
    let queued = per_call(|| {
        let (db, spec, spec_json) = (db.clone(), &spec, &spec_json);
        async move {
            queue::submit(&db, "load", spec, spec_json, None, quota, clock::now()).await.expect("queued");
        }
    })
    .await;
    let count = per_call(|| {
        let db = db.clone();
        async move {
            sqlx::query("SELECT COUNT(*) FROM experiments WHERE owner = 'load' AND status = 'queued'")
                .fetch_all(&db)
                .await
                .expect("a count");
        }
    })
    .await;
    // 64 clients at once (the load test's connections): they wait for the write lock
    // together, and the transactions they are written in can hold several.
    let start = Instant::now();
    for _ in 0..ROUNDS / TOGETHER as u32 {
        let each = (0..TOGETHER).map(|_| queue::submit(&db, "load", &spec, &spec_json, None, quota, clock::now()));
        for queued in futures::future::join_all(each).await {
            queued.expect("queued");
        }
    }
    let together = start.elapsed().as_secs_f64() * 1e6 / f64::from(ROUNDS / TOGETHER as u32 * TOGETHER as u32);
    let empty_write = per_call(|| {
        let db = db.clone();
        async move {
            let (tx, _turn) = store::begin_write(&db).await.expect("a transaction");
            tx.commit().await.expect("a commit");
        }
    })
    .await;
    let one_row = per_call(|| {
        let db = db.clone();
        async move {
            sqlx::query("SELECT 1").fetch_all(&db).await.expect("a row");
        }
    })
    .await;
    let check = per_call(|| {
        let spec = spec.clone();
        async move {
            spec.validate(&Default::default()).expect("a valid spec");
            distlab_common::planner::plan(&spec).expect("a plan");
        }
    })
    .await;
    println!("microseconds per call, one thread ({ROUNDS} calls each):");
    println!("  POST /api/experiments through the router      {whole:7.1}");
    println!("  the workers' ranks and memory read            {reads:7.1}");
    println!("  store::queue::submit (the write, in turn)     {queued:7.1}");
    println!("  the owner's queued experiments counted        {count:7.1}");
    println!("  ... {TOGETHER} at once, per submission              {together:7.1}");
    println!("  an empty write transaction (BEGIN, COMMIT)    {empty_write:7.1}");
    println!("  SELECT 1                                      {one_row:7.1}");
    println!("  the spec checked and planned                  {check:7.1}");
}
