//! Structure-aware fuzzing of what users and workers send: experiment specs, flashcard
//! imports and worker event batches, each a valid document with a few fields replaced,
//! removed or added (and, for specs, raw bytes). Whatever arrives, the server answers a
//! 2xx or a 4xx in the JSON error shape, never a 5xx (a panicking handler answers 500, so
//! a panic fails here too). About 1,000 cases per run of the suite; set
//! DISTLAB_FUZZ_CASES (per document kind) for a longer run by hand. Each run prints how
//! many answers fell in each status class.

mod store;

use std::collections::BTreeMap;
use std::sync::Mutex;

use axum::body::Body;
use axum::http::{header, Request, StatusCode};
use axum::Router;
use distlab_common::{ApiError, ExperimentSpec};
use distlab_server::{app, AppState, ServerConfig};
use http_body_util::BodyExt;
use proptest::prelude::*;
use proptest::test_runner::{Config, TestCaseError, TestRunner};
use serde_json::{json, Value};
use tower::ServiceExt;

const TOKEN: &str = "fuzz-worker-token";

struct Lab {
    app: Router,
    runtime: tokio::runtime::Runtime,
    _dir: tempfile::TempDir,
}

impl Lab {
    fn new() -> Self {
        let dir = tempfile::tempdir().expect("temp dir");
        let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build().expect("runtime");
        let config = ServerConfig {
            data_dir: dir.path().join("data"),
            static_dir: dir.path().join("site"),
            local_workers: 0,
            worker_token: TOKEN.into(),
            // Every valid spec is queued: the quota is not what is fuzzed here.
            max_queued_per_user: usize::MAX,
            database_url: runtime.block_on(store::database_url()),
            ..ServerConfig::default()
        };
        let state = runtime.block_on(AppState::new(config)).expect("state");
        Lab { app: app(state), runtime, _dir: dir }
    }

    /// POSTs `body` to `uri` (as a worker when `bearer` is its token or credential); the
    /// status and the JSON answer.
    fn post(&self, uri: &str, body: Vec<u8>, bearer: Option<&str>) -> (StatusCode, Value) {
        self.send(Request::post(uri), body, bearer)
    }

    fn put_json(&self, uri: &str, body: &Value) -> (StatusCode, Value) {
        self.send(Request::put(uri), body.to_string().into_bytes(), None)
    }

    fn send(&self, req: axum::http::request::Builder, body: Vec<u8>, bearer: Option<&str>) -> (StatusCode, Value) {
        let mut req = req.header(header::CONTENT_TYPE, "application/json");
        if let Some(secret) = bearer {
            req = req.header(header::AUTHORIZATION, format!("Bearer {secret}"));
        }
        let req = req.body(Body::from(body)).expect("request");
        self.runtime.block_on(async {
            let resp = self.app.clone().oneshot(req).await.expect("an answer");
            let status = resp.status();
            let bytes = resp.into_body().collect().await.expect("body").to_bytes();
            (status, serde_json::from_slice(&bytes).unwrap_or(Value::Null))
        })
    }

    fn post_json(&self, uri: &str, body: &Value, bearer: Option<&str>) -> (StatusCode, Value) {
        self.post(uri, body.to_string().into_bytes(), bearer)
    }
}

fn cases() -> u32 {
    std::env::var("DISTLAB_FUZZ_CASES").ok().and_then(|n| n.parse().ok()).unwrap_or(0)
}

/// Runs `check` on `count` documents from `documents` (more with DISTLAB_FUZZ_CASES), and
/// prints the status classes seen.
fn fuzz(what: &str, count: u32, documents: impl Strategy<Value = Value>, check: impl Fn(&Value) -> StatusCode) {
    let classes = Mutex::new(BTreeMap::<String, u32>::new());
    let config = Config { cases: cases().max(count), failure_persistence: None, ..Config::default() };
    let result = TestRunner::new(config).run(&documents, |doc| {
        let status = check(&doc);
        *classes.lock().unwrap().entry(format!("{}xx", status.as_u16() / 100)).or_default() += 1;
        if status.is_server_error() {
            return Err(TestCaseError::fail(format!("{status} for {doc}")));
        }
        Ok(())
    });
    eprintln!("fuzz {what}: {:?}", classes.lock().unwrap());
    if let Err(e) = result {
        panic!("fuzz {what}: {e}");
    }
}

/// An answer that is not a success must be the JSON error shape.
fn error_shape(status: StatusCode, body: &Value) -> Result<(), String> {
    if status.is_success() {
        return Ok(());
    }
    serde_json::from_value::<ApiError>(body.clone())
        .map(drop)
        .map_err(|e| format!("{status} without the shape ({e}): {body}"))
}

/// Values a field may be given: well-typed ones, wrong types, and the extremes.
fn any_json() -> impl Strategy<Value = Value> {
    prop_oneof![
        Just(Value::Null),
        any::<bool>().prop_map(Value::from),
        any::<i64>().prop_map(Value::from),
        any::<u64>().prop_map(Value::from),
        (-1e6f64..1e6).prop_map(Value::from),
        prop_oneof![Just(0.0), Just(-0.0), Just(1e308), Just(-1e308), Just(5e-324), Just(2f64.powi(53) + 2.0)]
            .prop_map(Value::from),
        (0u64..64).prop_map(Value::from),
        "[ -~]{0,40}".prop_map(Value::from),
        "\\PC{0,200}".prop_map(Value::from),
        Just(json!([])),
        Just(json!({})),
        Just(json!([1, "two", null])),
        Just(json!("9999-12-31T23:59:59Z")),
        Just(json!("2025-01-31T12:00:00.000Z")),
    ]
}

/// Every path to a value inside `doc` (object keys and array indices).
fn paths(doc: &Value) -> Vec<Vec<PathStep>> {
    let mut out = Vec::new();
    fn walk(v: &Value, at: &mut Vec<PathStep>, out: &mut Vec<Vec<PathStep>>) {
        match v {
            Value::Object(map) => {
                for (k, child) in map {
                    at.push(PathStep::Key(k.clone()));
                    out.push(at.clone());
                    walk(child, at, out);
                    at.pop();
                }
            }
            Value::Array(items) => {
                for (i, child) in items.iter().enumerate() {
                    at.push(PathStep::Index(i));
                    out.push(at.clone());
                    walk(child, at, out);
                    at.pop();
                }
            }
            _ => {}
        }
    }
    walk(doc, &mut Vec::new(), &mut out);
    out
}

#[derive(Clone, Debug)]
enum PathStep {
    Key(String),
    Index(usize),
}

#[derive(Clone, Debug)]
enum Edit {
    Replace(Value),
    Remove,
    AddUnknown(String, Value),
}

fn apply(doc: &mut Value, path: &[PathStep], edit: &Edit) {
    let Some((last, parents)) = path.split_last() else { return };
    let mut at = doc;
    for step in parents {
        at = match (step, at) {
            (PathStep::Key(k), Value::Object(map)) => match map.get_mut(k) {
                Some(v) => v,
                None => return,
            },
            (PathStep::Index(i), Value::Array(items)) => match items.get_mut(*i) {
                Some(v) => v,
                None => return,
            },
            _ => return,
        };
    }
    match (last, at, edit) {
        (PathStep::Key(k), Value::Object(map), Edit::Replace(v)) => {
            map.insert(k.clone(), v.clone());
        }
        (PathStep::Key(k), Value::Object(map), Edit::Remove) => {
            map.remove(k);
        }
        (_, Value::Object(map), Edit::AddUnknown(k, v)) => {
            map.insert(k.clone(), v.clone());
        }
        (PathStep::Index(i), Value::Array(items), Edit::Replace(v)) if *i < items.len() => items[*i] = v.clone(),
        (PathStep::Index(i), Value::Array(items), Edit::Remove) if *i < items.len() => {
            items.remove(*i);
        }
        _ => {}
    }
}

/// `base` with one to four fields replaced by any value, removed, or joined by unknown ones.
fn mutations_of(base: Value) -> impl Strategy<Value = Value> {
    let all = paths(&base);
    let edit = prop_oneof![
        6 => any_json().prop_map(Edit::Replace),
        2 => Just(Edit::Remove),
        1 => ("[a-z_]{1,12}", any_json()).prop_map(|(k, v)| Edit::AddUnknown(k, v)),
    ];
    prop::collection::vec((0..all.len(), edit), 1..5).prop_map(move |edits| {
        let mut doc = base.clone();
        for (i, edit) in &edits {
            apply(&mut doc, &all[*i], edit);
        }
        doc
    })
}

#[test]
fn no_spec_makes_the_server_fail() {
    let lab = Lab::new();
    let base = serde_json::to_value(ExperimentSpec::default()).unwrap();
    fuzz("specs", 300, mutations_of(base), |spec| {
        let (status, body) = lab.post_json("/api/experiments", spec, None);
        error_shape(status, &body).unwrap();
        assert!(
            [StatusCode::CREATED, StatusCode::BAD_REQUEST, StatusCode::UNPROCESSABLE_ENTITY].contains(&status),
            "{status} for {spec}"
        );
        let (plan, body) = lab.post_json("/api/plan", spec, None);
        error_shape(plan, &body).unwrap();
        status.max(plan)
    });
}

#[test]
fn no_bytes_make_the_server_fail() {
    let lab = Lab::new();
    let bytes = prop_oneof![
        prop::collection::vec(any::<u8>(), 0..300),
        "[{}\\[\\]\":,0-9a-z .eE+-]{0,200}".prop_map(String::into_bytes),
    ];
    fuzz("raw bodies", 100, bytes.prop_map(|b| Value::from(String::from_utf8_lossy(&b).into_owned())), |text| {
        let (status, body) = lab.post("/api/experiments", text.as_str().unwrap_or("").as_bytes().to_vec(), None);
        error_shape(status, &body).unwrap();
        status
    });
}

#[test]
fn no_import_makes_the_server_fail() {
    let lab = Lab::new();
    let (_, profile) = lab.post_json("/api/profiles", &json!({"name": "fuzz"}), None);
    let id = profile["id"].as_i64().expect("a profile");
    let (_, cards) = lab.runtime.block_on(async {
        let req = Request::get("/api/cards").body(Body::empty()).unwrap();
        let resp = lab.app.clone().oneshot(req).await.unwrap();
        let bytes = resp.into_body().collect().await.unwrap().to_bytes();
        ((), serde_json::from_slice::<Value>(&bytes).unwrap())
    });
    let card = cards["cards"][0]["id"].as_str().or_else(|| cards[0]["id"].as_str()).expect("a card id").to_string();
    let (status, _) =
        lab.post_json(&format!("/api/profiles/{id}/reviews"), &json!({"card_id": card, "rating": 4}), None);
    assert_eq!(status, StatusCode::OK);
    let base = json!({
        "format": "distlab-review/1",
        "profile": "fuzz",
        "exported_at": "2025-01-31T12:00:00.000Z",
        "cards": [{"card_id": card, "stability": 3.2, "difficulty": 5.1, "due": "2025-02-03T12:00:00.000Z",
                   "last_review": "2025-01-31T12:00:00.000Z", "reps": 1, "lapses": 0, "last_rating": 4}],
        "log": [{"card_id": card, "rating": 4, "reviewed_at": "2025-01-31T12:00:00.000Z", "interval_days": 3.0}],
    });
    let uri = format!("/api/profiles/{id}/import");
    assert_eq!(lab.post_json(&uri, &base, None).0, StatusCode::OK, "the base document imports");
    fuzz("imports", 300, mutations_of(base), |doc| {
        let (status, body) = lab.post_json(&uri, doc, None);
        error_shape(status, &body).unwrap();
        assert!(
            [StatusCode::OK, StatusCode::BAD_REQUEST, StatusCode::UNPROCESSABLE_ENTITY].contains(&status),
            "{status} for {doc}"
        );
        status
    });
}

#[test]
fn no_event_batch_makes_the_server_fail() {
    let lab = Lab::new();
    let register = json!({"name": "fuzz", "backends": ["cpu"], "devices": [], "version": env!("CARGO_PKG_VERSION")});
    let (_, registered) = lab.post_json("/api/workers/register", &register, Some(TOKEN));
    let worker = registered["worker_id"].as_i64().expect("a worker id");
    let credential = Some(registered["credential"].as_str().expect("a credential"));
    let (_, created) = lab.post_json("/api/experiments", &json!({"name": "fuzzed", "train": {"steps": 50}}), None);
    let id = created["id"].as_i64().expect("an experiment");
    let (status, _) = lab.post_json("/api/workers/lease", &json!({"worker_id": worker}), credential);
    assert_eq!(status, StatusCode::OK);
    let base = json!({
        "worker_id": worker,
        "experiment_id": id,
        "events": [
            {"type": "start", "from_step": 0},
            {"type": "metric", "step": 1, "loss": 3.87, "lr": 0.001, "grad_norm": 1.0, "tokens_per_s": 1000.0, "step_ms": 5.0},
            {"type": "log", "level": "info", "message": "hello"},
        ],
    });
    assert_eq!(lab.post_json("/api/workers/events", &base, credential).0, StatusCode::OK, "the base batch is taken");
    fuzz("event batches", 300, mutations_of(base), |batch| {
        let (status, body) = lab.post_json("/api/workers/events", batch, credential);
        error_shape(status, &body).unwrap();
        status
    });
}

#[test]
fn no_assignment_or_submission_makes_the_server_fail() {
    let lab = Lab::new();
    let base = json!({
        "title": "fuzzed",
        "instructions": "# Fuzz\nsome *text*",
        "spec": {"name": "fuzzed", "train": {"steps": 5}},
        "editable": ["parallel.dp", "train"],
        "due": "2026-12-24T18:00:00Z",
        "questions": [
            {"prompt": "n", "answer": {"kind": "number", "quantity": "peak_memory_mib", "tolerance": 0.05}},
            {"prompt": "c", "answer": {"kind": "choice", "quantity": "final_loss",
                "options": [{"label": "a", "value": 1.0}, {"label": "b", "value": 2.0}]}},
            {"prompt": "t", "answer": {"kind": "text"}}
        ]
    });
    let (status, created) = lab.post_json("/api/assignments", &base, None);
    assert_eq!(status, StatusCode::CREATED, "{created}");
    fuzz("assignments", 200, mutations_of(base), |doc| {
        let (status, body) = lab.post_json("/api/assignments", doc, None);
        error_shape(status, &body).unwrap();
        assert!(
            [StatusCode::CREATED, StatusCode::BAD_REQUEST, StatusCode::UNPROCESSABLE_ENTITY].contains(&status),
            "{status} for {doc}"
        );
        status
    });
    let uri = format!("/api/assignments/{}/submissions", created["id"]);
    let submission = json!({
        "spec": {"name": "fuzzed", "parallel": {"dp": 2}, "train": {"steps": 5}},
        "answers": [{"question": 0, "number": 3.0}, {"question": 1, "option": 1}, {"question": 2, "text": "t"}]
    });
    let (status, submitted) = lab.post_json(&uri, &submission, None);
    assert_eq!(status, StatusCode::CREATED, "{submitted}");
    let grade_uri = format!("{uri}/{}/grade", submitted["id"]);
    fuzz("grades", 100, mutations_of(json!({"question": 2, "right": true})), |doc| {
        let (status, body) = lab.put_json(&grade_uri, doc);
        error_shape(status, &body).unwrap();
        assert!(
            [StatusCode::OK, StatusCode::BAD_REQUEST, StatusCode::UNPROCESSABLE_ENTITY].contains(&status),
            "{status} for {doc}"
        );
        status
    });
    fuzz("submissions", 200, mutations_of(submission), |doc| {
        let (status, body) = lab.post_json(&uri, doc, None);
        error_shape(status, &body).unwrap();
        assert!(
            [
                StatusCode::CREATED,
                StatusCode::BAD_REQUEST,
                StatusCode::UNPROCESSABLE_ENTITY,
                StatusCode::TOO_MANY_REQUESTS
            ]
            .contains(&status),
            "{status} for {doc}"
        );
        status
    });
}
