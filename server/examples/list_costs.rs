//! Where a `GET /api/experiments` goes, on one thread: the request through the router (no
//! sockets), with its page kept (`read_cache.rs`) and read anew, then the parts of a read
//! one at a time. A server on SQLite with accounts on, 100
//! queued experiments, one signed-in account. Run: `cargo run --release -p distlab-server
//! --example list_costs`.

use axum::body::Body;
use axum::http::{header, Request};
use distlab_common::{AuthMode, ExperimentList, ExperimentSpec};
use distlab_server::store::{accounts, changes, experiments};
use distlab_server::{app, AppState, ServerConfig};
use http_body_util::BodyExt;
use tower::ServiceExt;

mod timing;
use timing::{per_call, ROUNDS};

#[tokio::main(flavor = "current_thread")]
async fn main() {
    let dir = tempfile::tempdir().expect("a temporary directory");
    let config = ServerConfig {
        data_dir: dir.path().join("data"),
        static_dir: dir.path().join("site"),
        local_workers: 0,
        worker_token: "list-costs".into(),
        auth: AuthMode::Accounts,
        max_queued_per_user: 1000,
        ..ServerConfig::default()
    };
    let state = AppState::new(config).await.expect("the server's state");
    let router = app(state.clone());
    let account = accounts::create(&state.db, "ada", "correct horse", false).await.expect("an account");
    let token = accounts::open_session(&state.db, &account, std::time::SystemTime::now()).await.expect("a session");
    let cookie = format!("distlab_session={token}");
    let request = |uri: &str, body: Option<&str>| {
        let builder = Request::builder().uri(uri).header(header::HOST, "127.0.0.1").header(header::COOKIE, &cookie);
        match body {
            Some(b) => {
                builder.method("POST").header(header::CONTENT_TYPE, "application/json").body(Body::from(b.to_string()))
            }
            None => builder.body(Body::empty()),
        }
        .expect("a request")
    };
    for _ in 0..100 {
        let resp = router
            .clone()
            .oneshot(request("/api/experiments", Some(r#"{"name": "load", "train": {"steps": 10}}"#)))
            .await
            .expect("an answer");
        assert_eq!(resp.status(), 201, "a submission");
    }
    let listed = router.clone().oneshot(request("/api/experiments", None)).await.expect("an answer");
    assert_eq!(listed.status(), 200);
    let body = listed.into_body().collect().await.expect("a body").to_bytes();
    let list: ExperimentList = serde_json::from_slice(&body).expect("a list");
    let spec_json = serde_json::to_string(&list.experiments[0].spec).expect("JSON");
    println!(
        "one page: {} experiments, {} bytes of JSON ({} of one spec)",
        list.experiments.len(),
        body.len(),
        spec_json.len()
    );

    // One request through the router, its answer read to the end.
    let send = |req: Request<Body>| {
        let router = router.clone();
        async move {
            let resp = router.oneshot(req).await.expect("an answer");
            let _ = resp.into_body().collect().await.expect("a body");
        }
    };
    let whole = per_call(|| send(request("/api/experiments", None))).await;
    let gzip = per_call(|| {
        let mut req = request("/api/experiments", None);
        req.headers_mut().insert(header::ACCEPT_ENCODING, header::HeaderValue::from_static("gzip, deflate, br, zstd"));
        send(req)
    })
    .await;
    let reread = per_call(|| {
        // A write counted before each request: the page is read anew every time.
        drop(changes::Writing::to(&state.db, changes::Data::Experiments));
        send(request("/api/experiments", None))
    })
    .await;
    let one = per_call(|| send(request("/api/experiments/50", None))).await;
    let health = per_call(|| send(request("/api/health", None))).await;
    let db = state.db.clone();
    let session = per_call(|| {
        let (db, token) = (db.clone(), token.clone());
        async move {
            accounts::session(&db, &token, std::time::SystemTime::now()).await.expect("a lookup");
        }
    })
    .await;
    let page = per_call(|| {
        let db = db.clone();
        async move {
            experiments::page(&db, None, 50, 0).await.expect("a page");
        }
    })
    .await;
    let raw = per_call(|| {
        let db = db.clone();
        async move {
            sqlx::query("SELECT id, spec FROM experiments ORDER BY id DESC LIMIT 50")
                .fetch_all(&db)
                .await
                .expect("rows");
        }
    })
    .await;
    let view_rows = per_call(|| {
        let db = db.clone();
        async move {
            sqlx::query(
                "SELECT e.id, e.name, e.owner, e.status, e.spec, e.attempt, e.created_at, e.started_at, \
                 e.finished_at, e.error, e.summary, \
                 (SELECT COALESCE(MAX(m.step) + 1, 0) FROM metrics m WHERE m.experiment_id = e.id) AS steps_done \
                 FROM experiments e ORDER BY e.id DESC LIMIT 50",
            )
            .fetch_all(&db)
            .await
            .expect("rows");
        }
    })
    .await;
    let count = per_call(|| {
        let db = db.clone();
        async move {
            sqlx::query("SELECT COUNT(*) FROM experiments").fetch_all(&db).await.expect("a count");
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
    let parse = per_call(|| {
        let text = spec_json.clone();
        async move {
            let _: ExperimentSpec = serde_json::from_str(&text).expect("a spec");
        }
    })
    .await;
    let render = per_call(|| {
        let list = &list;
        async move {
            let _ = serde_json::to_vec(list).expect("JSON");
        }
    })
    .await;
    println!("microseconds per call, one thread ({ROUNDS} calls each):");
    println!("  GET /api/experiments, the page kept        {whole:7.1}");
    println!("  ... as a browser asks (compressed)         {gzip:7.1}");
    println!("  GET /api/experiments, the page read anew   {reread:7.1}");
    println!("  GET /api/experiments/50 through the router {one:7.1}");
    println!("  GET /api/health through the router         {health:7.1}");
    println!("  the session's lookup                       {session:7.1}");
    println!("  store::experiments::page (50 rows + count) {page:7.1}");
    println!("  50 rows of (id, spec), fetched, no decode  {raw:7.1}");
    println!("  the page's 50 rows, fetched, no decode     {view_rows:7.1}");
    println!("  SELECT COUNT(*) FROM experiments           {count:7.1}");
    println!("  SELECT 1                                   {one_row:7.1}");
    println!("  one spec parsed (x50 = {:.1})              {parse:7.1}", parse * 50.0);
    println!("  the page's JSON written                    {render:7.1}");
}
