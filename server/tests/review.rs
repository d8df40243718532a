//! Flashcard review with FSRS (`/api/profiles/...`), driven through `app()` with `oneshot` on a
//! temporary SQLite database. Time passes by moving a profile's stored timestamps back.

mod store;

use std::time::{Duration, SystemTime};

use axum::body::Body;
use axum::http::{header, Method, Request, StatusCode};
use axum::Router;
use distlab_common::review::*;
use distlab_common::ApiError;
use distlab_server::clock::parse_time;
use distlab_server::{app, AppState, ServerConfig};
use http_body_util::BodyExt;
use serde_json::{json, Value};
use tower::ServiceExt;

struct TestApp {
    app: Router,
    state: AppState,
    _dir: tempfile::TempDir,
}

async fn setup() -> TestApp {
    let dir = tempfile::tempdir().expect("temp dir");
    let config = ServerConfig {
        data_dir: dir.path().join("data"),
        static_dir: dir.path().join("site"),
        local_workers: 0,
        worker_token: "test-worker-token".into(),
        database_url: store::database_url().await,
        ..ServerConfig::default()
    };
    let state = AppState::new(config).await.expect("state");
    TestApp { app: app(state.clone()), state, _dir: dir }
}

struct Answer {
    status: StatusCode,
    body: Value,
}

impl TestApp {
    async fn call(&self, method: Method, uri: &str, body: Option<String>) -> Answer {
        let req = Request::builder().method(method).uri(uri);
        let req = match body {
            Some(body) => req.header(header::CONTENT_TYPE, "application/json").body(Body::from(body)),
            None => req.body(Body::empty()),
        }
        .expect("request");
        let resp = self.app.clone().oneshot(req).await.expect("infallible");
        let status = resp.status();
        let bytes = resp.into_body().collect().await.expect("body").to_bytes();
        let body = if bytes.is_empty() {
            Value::Null
        } else {
            serde_json::from_slice(&bytes).unwrap_or_else(|_| Value::String(String::from_utf8_lossy(&bytes).into()))
        };
        Answer { status, body }
    }

    async fn get(&self, uri: &str) -> Answer {
        self.call(Method::GET, uri, None).await
    }

    async fn post(&self, uri: &str, body: Value) -> Answer {
        self.call(Method::POST, uri, Some(body.to_string())).await
    }

    async fn profile(&self, name: &str) -> Profile {
        let a = self.post("/api/profiles", json!({ "name": name })).await;
        assert_eq!(a.status, StatusCode::CREATED, "{}", a.body);
        serde_json::from_value(a.body).expect("Profile")
    }

    async fn view(&self, profile: i64) -> ReviewView {
        let a = self.get(&format!("/api/profiles/{profile}/review")).await;
        assert_eq!(a.status, StatusCode::OK, "{}", a.body);
        serde_json::from_value(a.body).expect("ReviewView")
    }

    async fn rate(&self, profile: i64, card: &str, rating: i64) -> ReviewResult {
        let a =
            self.post(&format!("/api/profiles/{profile}/reviews"), json!({"card_id": card, "rating": rating})).await;
        assert_eq!(a.status, StatusCode::OK, "{}", a.body);
        serde_json::from_value(a.body).expect("ReviewResult")
    }

    async fn export(&self, profile: i64) -> ReviewExport {
        let a = self.get(&format!("/api/profiles/{profile}/export")).await;
        assert_eq!(a.status, StatusCode::OK, "{}", a.body);
        serde_json::from_value(a.body).expect("ReviewExport")
    }

    async fn deck(&self) -> Vec<(String, u32)> {
        let a = self.get("/api/cards").await;
        assert_eq!(a.status, StatusCode::OK, "{}", a.body);
        a.body
            .as_array()
            .expect("cards")
            .iter()
            .map(|c| (c["id"].as_str().expect("id").to_string(), c["topic"].as_u64().expect("topic") as u32))
            .collect()
    }

    /// Moves every stored time of `profile` (due dates, last reviews, the log) `days` into the
    /// past: as if that much time had passed.
    async fn time_passes(&self, profile: i64, days: f64) {
        let back = |text: String| {
            let t = distlab_server::clock::parse_time(&text).expect("a stored time");
            distlab_server::clock::rfc3339(t - std::time::Duration::from_secs_f64(days * 86_400.0))
        };
        let db = &self.state.db;
        let states: Vec<(String, String, String)> =
            sqlx::query_as("SELECT card_id, due, last_review FROM card_reviews WHERE profile_id = $1")
                .bind(profile)
                .fetch_all(db)
                .await
                .expect("states");
        for (card, due, last) in states {
            sqlx::query("UPDATE card_reviews SET due = $1, last_review = $2 WHERE profile_id = $3 AND card_id = $4")
                .bind(back(due))
                .bind(back(last))
                .bind(profile)
                .bind(card)
                .execute(db)
                .await
                .expect("shift states");
        }
        let log: Vec<(i64, String)> = sqlx::query_as("SELECT id, reviewed_at FROM review_log WHERE profile_id = $1")
            .bind(profile)
            .fetch_all(db)
            .await
            .expect("log");
        for (id, at) in log {
            sqlx::query("UPDATE review_log SET reviewed_at = $1 WHERE id = $2")
                .bind(back(at))
                .bind(id)
                .execute(db)
                .await
                .expect("shift log");
        }
    }

    async fn log_rows(&self, profile: i64) -> i64 {
        sqlx::query_scalar("SELECT COUNT(*) FROM review_log WHERE profile_id = $1")
            .bind(profile)
            .fetch_one(&self.state.db)
            .await
            .expect("count")
    }
}

/// Every error answer has the JSON shape `{"error": "...", "fields": [...]}`.
fn api_error(a: &Answer, status: StatusCode) -> ApiError {
    assert_eq!(a.status, status, "{}", a.body);
    serde_json::from_value::<ApiError>(a.body.clone()).unwrap_or_else(|e| panic!("not an ApiError ({e}): {}", a.body))
}

fn time(text: &str) -> SystemTime {
    parse_time(text).unwrap_or_else(|| panic!("not a time: {text}"))
}

fn days(from: &str, to: &str) -> f64 {
    match time(to).duration_since(time(from)) {
        Ok(d) => d.as_secs_f64() / 86_400.0,
        Err(e) => -e.duration().as_secs_f64() / 86_400.0,
    }
}

#[tokio::test]
async fn profiles_are_created_listed_and_unique_per_owner() {
    let t = setup().await;
    assert_eq!(t.get("/api/profiles").await.body, json!({"profiles": []}));

    let ada = t.profile("  Ada  ").await;
    assert_eq!(ada.name, "Ada", "names are trimmed");
    let bob = t.profile("Bob").await;
    let list: ProfileList = serde_json::from_value(t.get("/api/profiles").await.body).expect("list");
    assert_eq!(list.profiles, vec![ada.clone(), bob]);

    let dup = api_error(&t.post("/api/profiles", json!({"name": "Ada "})).await, StatusCode::CONFLICT);
    assert!(dup.error.contains("already a profile named 'Ada'"), "{}", dup.error);

    for bad in [json!({"name": "   "}), json!({"name": "x".repeat(65)}), json!({"name": "a\u{7}b"})] {
        let e = api_error(&t.post("/api/profiles", bad).await, StatusCode::UNPROCESSABLE_ENTITY);
        assert_eq!(e.fields[0].field, "name", "{e:?}");
    }
    assert_eq!(t.profile(&"é".repeat(64)).await.name.chars().count(), 64);
    api_error(&t.post("/api/profiles", json!({"name": "x", "colour": "red"})).await, StatusCode::BAD_REQUEST);
    api_error(&t.post("/api/profiles", json!({})).await, StatusCode::BAD_REQUEST);

    // Another owner's profile (multi-user mode, later) is invisible: 404 on every route.
    let theirs: i64 = sqlx::query_scalar(
        "INSERT INTO profiles (owner, name, created_at) VALUES ('someone', 'Ada', '2025-01-01T00:00:00.000Z') \
         RETURNING id",
    )
    .fetch_one(&t.state.db)
    .await
    .expect("insert");
    let list: ProfileList = serde_json::from_value(t.get("/api/profiles").await.body).expect("list");
    assert!(list.profiles.iter().all(|p| p.id != theirs));
    for id in [theirs.to_string(), "999".into(), "0".into(), "abc".into()] {
        for path in ["review", "export"] {
            let e = api_error(&t.get(&format!("/api/profiles/{id}/{path}")).await, StatusCode::NOT_FOUND);
            assert!(e.error.contains("no profile with id"), "{}", e.error);
        }
        let card = &t.deck().await[0].0;
        let rated = t.post(&format!("/api/profiles/{id}/reviews"), json!({"card_id": card, "rating": 4})).await;
        api_error(&rated, StatusCode::NOT_FOUND);
        let export = t.export(ada.id).await;
        let imported = t.post(&format!("/api/profiles/{id}/import"), serde_json::to_value(export).unwrap()).await;
        api_error(&imported, StatusCode::NOT_FOUND);
    }
    assert_eq!(t.log_rows(theirs).await, 0);
}

#[tokio::test]
async fn a_new_profile_queues_new_cards_in_deck_order_capped_per_day() {
    let t = setup().await;
    let deck = t.deck().await;
    let p = t.profile("Ada").await;
    let v = t.view(p.id).await;
    assert_eq!(v.profile, p);
    assert!(v.due.is_empty() && v.cards.is_empty());
    let ids: Vec<String> = deck.iter().map(|(id, _)| id.clone()).collect();
    assert_eq!(v.new, ids, "every card is new, in deck order");
    assert_eq!(v.queue, ids[..NEW_PER_DAY].to_vec());
    assert_eq!(
        v.counts,
        ReviewCounts { due: 0, new: deck.len(), learned: 0, total: deck.len(), new_today: 0, new_per_day: NEW_PER_DAY }
    );
    let now = time(&v.now);
    let skew = SystemTime::now().duration_since(now).unwrap_or_default();
    assert!(skew < Duration::from_secs(60), "now is the server's clock");
}

#[tokio::test]
async fn ratings_move_due_dates_and_failures_after_a_review_are_lapses() {
    let t = setup().await;
    let deck = t.deck().await;
    let p = t.profile("Ada").await;
    let (a, b) = (&deck[0].0, &deck[1].0);

    let easy = t.rate(p.id, a, 5).await;
    assert_eq!((easy.grade, easy.rating), (Grade::Easy, 5));
    assert_eq!(easy.state.state.due, {
        let due = time(&easy.reviewed_at) + Duration::from_secs_f64(f64::from(easy.interval_days) * 86_400.0);
        distlab_server::clock::rfc3339(due)
    });
    let again = t.rate(p.id, b, 1).await;
    assert_eq!(again.grade, Grade::Again);
    assert!(easy.state.state.due > again.state.state.due, "5 is due later than 1");
    assert!(easy.interval_days > 5.0, "easy on a new card: days ({})", easy.interval_days);
    let wait = days(&again.reviewed_at, &again.state.state.due);
    assert!(wait > 0.0 && wait < 1.0, "a card rated 1 comes back within a day ({wait} days)");
    assert_eq!((again.state.state.reps, again.state.state.lapses), (1, 0), "forgetting a new card is no lapse");
    assert!((again.state.retrievability - 1.0).abs() < 1e-3 && !again.state.is_due);

    // Rated 1 again (it was reviewed before: a lapse), and 2 is the same grade as 1.
    let lapse = t.rate(p.id, b, 2).await;
    assert_eq!(lapse.grade, Grade::Again);
    assert_eq!((lapse.state.state.reps, lapse.state.state.lapses, lapse.state.state.last_rating), (2, 1, 2));
    assert!(days(&lapse.reviewed_at, &lapse.state.state.due) < 1.0);

    let v = t.view(p.id).await;
    assert!(v.due.is_empty(), "nothing is due right after its review: {:?}", v.due);
    assert_eq!(v.cards.len(), 2);
    assert_eq!(v.cards[a].state, easy.state.state);
    assert_eq!(v.cards[b].state.lapses, 1);
    assert_eq!(v.counts.learned, 2);
    assert_eq!(v.counts.new, deck.len() - 2);
    assert_eq!(v.counts.new_today, 2);
    assert_eq!(v.queue.len(), NEW_PER_DAY - 2, "two new cards were introduced today");
    assert!(!v.queue.contains(a) && !v.queue.contains(b));
    assert_eq!(v.queue[0], deck[2].0);
    assert_eq!(t.log_rows(p.id).await, 3, "every review is logged");
}

#[tokio::test]
async fn due_cards_come_first_most_overdue_first_and_a_good_review_after_time_lengthens_the_interval() {
    let t = setup().await;
    let deck = t.deck().await;
    let p = t.profile("Ada").await;
    let (a, b, c) = (&deck[0].0, &deck[1].0, &deck[2].0);
    let first = t.rate(p.id, a, 4).await;
    t.rate(p.id, b, 1).await;
    t.rate(p.id, c, 5).await;
    assert!(first.interval_days > 1.0 && first.interval_days < 5.0, "{}", first.interval_days);

    // Three days later: a (good, ~2.3 days) and b (again, hours) are due, b longer overdue; c (easy) is not.
    t.time_passes(p.id, 3.0).await;
    let v = t.view(p.id).await;
    assert_eq!(v.due, vec![b.clone(), a.clone()]);
    assert_eq!(v.queue[..2], [b.clone(), a.clone()], "due cards lead the queue");
    assert_eq!(v.counts.new_today, 0, "yesterday's new cards do not count today");
    assert_eq!(v.queue.len(), 2 + NEW_PER_DAY);
    assert_eq!((v.counts.due, v.counts.learned, v.counts.new), (2, 1, deck.len() - 3));
    assert!(v.cards[a].is_due && v.cards[b].is_due && !v.cards[c].is_due);
    assert!(v.cards[a].retrievability < 0.9, "past its stability: {}", v.cards[a].retrievability);
    assert!(v.cards[c].retrievability > v.cards[a].retrievability);

    let second = t.rate(p.id, a, 4).await;
    assert!(
        second.interval_days > 2.0 * first.interval_days,
        "remembered after {} days: the interval grows ({} -> {})",
        3,
        first.interval_days,
        second.interval_days
    );
    assert_eq!((second.state.state.reps, second.state.state.lapses), (2, 0));
    assert!(second.state.state.stability > first.state.state.stability);
    let v = t.view(p.id).await;
    assert_eq!(v.due, vec![b.clone()]);
}

#[tokio::test]
async fn bad_ratings_and_unknown_cards_are_refused_and_change_nothing() {
    let t = setup().await;
    let deck = t.deck().await;
    let p = t.profile("Ada").await;
    let uri = format!("/api/profiles/{}/reviews", p.id);
    for rating in [0, 6, -3] {
        let e = api_error(
            &t.post(&uri, json!({"card_id": deck[0].0, "rating": rating})).await,
            StatusCode::UNPROCESSABLE_ENTITY,
        );
        assert_eq!(e.fields[0].field, "rating");
        assert!(e.error.contains("from 1 (not at all) to 5 (perfectly)"), "{}", e.error);
    }
    for body in [json!({"card_id": deck[0].0, "rating": "4"}), json!({"card_id": deck[0].0}), json!({"rating": 4})] {
        api_error(&t.post(&uri, body).await, StatusCode::BAD_REQUEST);
    }
    let e = api_error(
        &t.post(&uri, json!({"card_id": "no-such-card", "rating": 4})).await,
        StatusCode::UNPROCESSABLE_ENTITY,
    );
    assert_eq!(e.fields[0].field, "card_id");
    assert!(e.error.contains("no card with id 'no-such-card'"), "{}", e.error);
    assert_eq!(t.log_rows(p.id).await, 0);
    assert!(t.view(p.id).await.cards.is_empty());
}

#[tokio::test]
async fn topic_progress_counts_cards_reviews_and_retrievability() {
    let t = setup().await;
    let deck = t.deck().await;
    let p = t.profile("Ada").await;
    let (first, second) = (&deck[0], &deck[1]);
    t.rate(p.id, &first.0, 4).await;
    t.rate(p.id, &second.0, 1).await;
    t.time_passes(p.id, 1.0).await;

    let v = t.view(p.id).await;
    let mut topics: Vec<u32> = deck.iter().map(|(_, topic)| *topic).collect();
    topics.sort();
    topics.dedup();
    assert_eq!(v.topics.iter().map(|tp| tp.topic).collect::<Vec<_>>(), topics, "every topic, in order");
    assert_eq!(v.topics.iter().map(|tp| tp.cards).sum::<usize>(), deck.len());
    assert_eq!(v.topics.iter().map(|tp| tp.reviewed).sum::<usize>(), 2);
    assert_eq!(v.topics.iter().map(|tp| tp.due).sum::<usize>(), 1, "the card rated 1 is due a day later");
    for tp in &v.topics {
        let cards: Vec<&String> = deck.iter().filter(|(_, topic)| *topic == tp.topic).map(|(id, _)| id).collect();
        assert_eq!(tp.cards, cards.len());
        let reviewed: Vec<&CardView> = cards.iter().filter_map(|id| v.cards.get(*id)).collect();
        assert_eq!(tp.reviewed, reviewed.len());
        match tp.mean_retrievability {
            None => assert!(reviewed.is_empty()),
            Some(r) => {
                let mean = reviewed.iter().map(|c| c.retrievability).sum::<f32>() / reviewed.len() as f32;
                assert!((r - mean).abs() < 1e-6 && r > 0.0 && r < 1.0, "topic {}: {r}", tp.topic);
            }
        }
    }
}

#[tokio::test]
async fn export_then_import_round_trips_and_replaces() {
    let t = setup().await;
    let deck = t.deck().await;
    let ada = t.profile("Ada").await;
    t.rate(ada.id, &deck[0].0, 4).await;
    t.rate(ada.id, &deck[1].0, 1).await;
    t.time_passes(ada.id, 2.5).await;
    t.rate(ada.id, &deck[1].0, 3).await;
    t.rate(ada.id, &deck[2].0, 5).await;

    let export = t.export(ada.id).await;
    assert_eq!(export.format, EXPORT_FORMAT);
    assert_eq!(export.profile, "Ada");
    assert_eq!(export.cards.len(), 3);
    assert_eq!(export.log.len(), 4);
    assert!(export.log.windows(2).all(|w| w[0].reviewed_at <= w[1].reviewed_at), "log oldest first");
    assert_eq!(export.log[2].rating, 3);

    // Into another profile (which had progress of its own: it is replaced).
    let bob = t.profile("Bob").await;
    t.rate(bob.id, &deck[5].0, 2).await;
    let a = t.post(&format!("/api/profiles/{}/import", bob.id), serde_json::to_value(&export).unwrap()).await;
    assert_eq!(a.status, StatusCode::OK, "{}", a.body);
    let result: ImportResult = serde_json::from_value(a.body).expect("ImportResult");
    assert_eq!(result.profile, bob, "the target keeps its name");
    assert_eq!((result.cards, result.log, result.skipped_cards, result.skipped_log), (3, 4, 0, 0));
    let again = t.export(bob.id).await;
    assert_eq!(again.cards, export.cards);
    assert_eq!(again.log, export.log);
    assert_eq!(again.profile, "Bob");
    let (va, vb) = (t.view(ada.id).await, t.view(bob.id).await);
    assert_eq!((va.due, va.new, va.counts), (vb.due, vb.new, vb.counts));

    // And the text itself round-trips (what a person saves and loads back).
    let text = t.get(&format!("/api/profiles/{}/export", ada.id)).await.body;
    let a = t.call(Method::POST, &format!("/api/profiles/{}/import", ada.id), Some(text.to_string())).await;
    assert_eq!(a.status, StatusCode::OK, "{}", a.body);
    assert_eq!(t.export(ada.id).await.cards, export.cards);

    // Times in another offset are read and stored in the canonical form.
    let mut shifted = export.clone();
    shifted.cards[0].last_review = {
        // The same instant written at UTC+02:00.
        let utc = time(&export.cards[0].last_review);
        let local = distlab_server::clock::rfc3339(utc + Duration::from_secs(2 * 3600));
        format!("{}+02:00", local.trim_end_matches('Z'))
    };
    assert_ne!(shifted.cards[0].last_review, export.cards[0].last_review);
    let a = t.post(&format!("/api/profiles/{}/import", bob.id), serde_json::to_value(&shifted).unwrap()).await;
    assert_eq!(a.status, StatusCode::OK, "{}", a.body);
    assert_eq!(t.export(bob.id).await.cards, export.cards);

    // An empty document empties the profile.
    let empty =
        json!({"format": EXPORT_FORMAT, "profile": "x", "exported_at": "2025-01-01T00:00:00Z", "cards": [], "log": []});
    assert_eq!(t.post(&format!("/api/profiles/{}/import", bob.id), empty).await.status, StatusCode::OK);
    assert!(t.view(bob.id).await.cards.is_empty());
    assert_eq!(t.log_rows(bob.id).await, 0);
}

#[tokio::test]
async fn malformed_imports_are_refused_and_lose_nothing() {
    let t = setup().await;
    let deck = t.deck().await;
    let p = t.profile("Ada").await;
    t.rate(p.id, &deck[0].0, 4).await;
    t.rate(p.id, &deck[1].0, 1).await;
    let before = t.export(p.id).await;
    let uri = format!("/api/profiles/{}/import", p.id);
    let good = serde_json::to_value(&before).unwrap();
    let edit = |f: &dyn Fn(&mut Value)| {
        let mut v = good.clone();
        f(&mut v);
        v
    };

    let not_json = t.call(Method::POST, &uri, Some("{\"format\": ".into())).await;
    api_error(&not_json, StatusCode::BAD_REQUEST);
    api_error(&t.post(&uri, json!([1, 2])).await, StatusCode::BAD_REQUEST);
    let e = api_error(&t.post(&uri, edit(&|v| v["format"] = json!("anki/2"))).await, StatusCode::UNPROCESSABLE_ENTITY);
    assert!(e.error.contains("unknown export format 'anki/2'"), "{}", e.error);
    let e = api_error(
        &t.post(
            &uri,
            edit(&|v| {
                v.as_object_mut().unwrap().remove("format");
            }),
        )
        .await,
        StatusCode::UNPROCESSABLE_ENTITY,
    );
    assert_eq!(e.fields[0].field, "format");
    let e = api_error(&t.post(&uri, edit(&|v| v["cards"] = json!("none"))).await, StatusCode::BAD_REQUEST);
    assert_eq!(e.fields[0].field, "cards");
    let e = api_error(&t.post(&uri, edit(&|v| v["cards"][0]["colour"] = json!(1))).await, StatusCode::BAD_REQUEST);
    assert!(e.error.contains("colour"), "{}", e.error);

    // Values that cannot be stored: every problem is listed, and nothing is written.
    let bad = edit(&|v| {
        v["cards"][0]["due"] = json!("tomorrow");
        v["cards"][1]["stability"] = json!(-1.0);
        v["cards"][1]["last_rating"] = json!(9);
        v["log"][0]["rating"] = json!(0);
        v["log"][1]["reviewed_at"] = json!("2025-13-01T00:00:00Z");
    });
    let e = api_error(&t.post(&uri, bad).await, StatusCode::UNPROCESSABLE_ENTITY);
    let fields: Vec<&str> = e.fields.iter().map(|f| f.field.as_str()).collect();
    assert_eq!(
        fields,
        ["cards[0].due", "cards[1].stability", "cards[1].last_rating", "log[0].rating", "log[1].reviewed_at"],
        "{}",
        e.error
    );
    assert!(e.error.contains("5 problems (nothing was changed)"), "{}", e.error);
    let dup = edit(&|v| {
        let first = v["cards"][0].clone();
        v["cards"].as_array_mut().unwrap().push(first);
    });
    let e = api_error(&t.post(&uri, dup).await, StatusCode::UNPROCESSABLE_ENTITY);
    assert!(e.error.contains("appears twice"), "{}", e.error);
    // Times at the calendar's end (they used to overflow the scheduling and drop the
    // connection) are field errors like any other.
    let far = edit(&|v| {
        v["cards"][0]["last_review"] = json!("9999-12-31T23:59:59Z");
        v["cards"][0]["due"] = json!("9999-12-31T23:59:59Z");
    });
    let e = api_error(&t.post(&uri, far).await, StatusCode::UNPROCESSABLE_ENTITY);
    let fields: Vec<&str> = e.fields.iter().map(|f| f.field.as_str()).collect();
    assert_eq!(fields, ["cards[0].due", "cards[0].last_review"], "{}", e.error);
    let e = api_error(
        &t.post(&uri, edit(&|v| v["cards"][0]["due"] = json!("2000-01-01T00:00:00.000Z"))).await,
        StatusCode::UNPROCESSABLE_ENTITY,
    );
    assert!(e.error.contains("due is before last_review"), "{}", e.error);
    assert_eq!(t.export(p.id).await.cards, before.cards, "nothing lost");
    assert_eq!(t.export(p.id).await.log, before.log, "nothing lost");

    // Cards the deck does not have are skipped and reported, the rest is imported.
    let unknown = edit(&|v| {
        v["cards"][0]["card_id"] = json!("retired-card");
        v["log"][0]["card_id"] = json!("retired-card");
    });
    let a = t.post(&uri, unknown).await;
    assert_eq!(a.status, StatusCode::OK, "{}", a.body);
    let result: ImportResult = serde_json::from_value(a.body).expect("ImportResult");
    assert_eq!(result.skipped_card_ids, ["retired-card"]);
    assert_eq!((result.cards, result.log, result.skipped_cards, result.skipped_log), (1, 1, 1, 1));
    let after = t.export(p.id).await;
    assert_eq!(after.cards, before.cards[1..]);
    assert_eq!(after.log, before.log[1..]);
}

/// Desired retention and fitted parameters: a profile starts on FSRS's defaults at 0.9; a
/// lower retention spaces a new card's first interval further; a fit needs enough repeat
/// reviews (409 before), then fits the log better than the defaults did, and the reviews
/// that follow are scheduled with the fitted parameters until the profile asks for the
/// defaults back.
#[tokio::test]
async fn a_profile_chooses_its_retention_and_fits_its_parameters_to_its_log() {
    let t = setup().await;
    let p = t.profile("fit").await;
    let settings_uri = format!("/api/profiles/{}/settings", p.id);
    let fit_uri = format!("/api/profiles/{}/fit", p.id);
    let settings = |a: Answer| -> ReviewSettings {
        assert_eq!(a.status, StatusCode::OK, "{}", a.body);
        serde_json::from_value(a.body).expect("ReviewSettings")
    };
    let s = settings(t.get(&settings_uri).await);
    assert_eq!((s.desired_retention, s.fitted, s.repeat_reviews), (0.9, false, 0));
    assert_eq!(s.parameters.len(), 21);
    let deck: Vec<String> = t.deck().await.into_iter().map(|(id, _)| id).collect();

    // Retention: out of range is refused, a lower one gives a longer first interval.
    for bad in [0.5, 0.99, 1.0] {
        let a = t.call(Method::PUT, &settings_uri, Some(json!({"desired_retention": bad}).to_string())).await;
        api_error(&a, StatusCode::UNPROCESSABLE_ENTITY);
    }
    let at_default = t.rate(p.id, &deck[0], 4).await.interval_days;
    let a = t.call(Method::PUT, &settings_uri, Some(json!({"desired_retention": 0.8}).to_string())).await;
    assert_eq!(settings(a).desired_retention, 0.8);
    let at_lower = t.rate(p.id, &deck[1], 4).await.interval_days;
    assert!(at_lower > at_default, "{at_default} -> {at_lower}");
    for edge in [0.7, 0.97] {
        let a = t.call(Method::PUT, &settings_uri, Some(json!({"desired_retention": edge}).to_string())).await;
        assert_eq!(settings(a).desired_retention, edge);
    }
    t.call(Method::PUT, &settings_uri, Some(json!({"desired_retention": 0.9}).to_string())).await;

    // Too few repeat reviews to fit.
    api_error(&t.post(&fit_uri, json!({})).await, StatusCode::CONFLICT);

    // A learner who remembers most cards but forgets some, over 60 cards of 4 reviews
    // each, spaced further each time: 180 repeat reviews.
    let mut log = Vec::new();
    let start = time("2025-01-01T08:00:00.000Z");
    for (i, card) in deck.iter().take(60).enumerate() {
        let mut at = start + Duration::from_secs(60 * i as u64);
        for (k, gap_days) in [0u64, 2, 6, 15].into_iter().enumerate() {
            at += Duration::from_secs(gap_days * 86_400);
            let rating = if (i + k) % 7 == 0 {
                1
            } else if (i * k) % 5 == 1 {
                3
            } else {
                4
            };
            log.push(LogEntry {
                card_id: card.clone(),
                rating,
                reviewed_at: distlab_server::clock::rfc3339(at),
                interval_days: 1.0,
            });
        }
    }
    log.sort_by(|a, b| a.reviewed_at.cmp(&b.reviewed_at));
    let document = ReviewExport {
        format: EXPORT_FORMAT.into(),
        profile: p.name.clone(),
        exported_at: "2025-03-01T00:00:00.000Z".into(),
        cards: vec![],
        log,
        scheduling: None,
    };
    let a = t.post(&format!("/api/profiles/{}/import", p.id), serde_json::to_value(&document).unwrap()).await;
    assert_eq!(a.status, StatusCode::OK, "{}", a.body);
    assert_eq!(settings(t.get(&settings_uri).await).repeat_reviews, 180);

    let a = t.post(&fit_uri, json!({})).await;
    assert_eq!(a.status, StatusCode::OK, "{}", a.body);
    let fit: ParameterFit = serde_json::from_value(a.body).expect("ParameterFit");
    assert_eq!(fit.repeat_reviews, 180);
    assert_eq!(fit.before.parameters, fsrs_defaults(&t).await);
    assert_ne!(fit.after.parameters, fit.before.parameters, "the fit moved the parameters");
    assert!(fit.after.log_loss < fit.before.log_loss, "{} -> {}", fit.before.log_loss, fit.after.log_loss);
    let s = settings(t.get(&settings_uri).await);
    assert!(s.fitted && s.parameters == fit.after.parameters && s.fit.as_ref() == Some(&fit));

    // An export carries the retention and the fitted parameters to another profile; an
    // import whose parameters FSRS could not have fitted is refused and changes nothing.
    t.call(Method::PUT, &settings_uri, Some(json!({"desired_retention": 0.85}).to_string())).await;
    let export = t.export(p.id).await;
    let moved = t.profile("moved").await;
    let moved_settings = format!("/api/profiles/{}/settings", moved.id);
    let import_uri = format!("/api/profiles/{}/import", moved.id);
    let mut bad = serde_json::to_value(&export).unwrap();
    bad["scheduling"]["parameters"][4] = json!(50.0);
    let e = api_error(&t.post(&import_uri, bad).await, StatusCode::UNPROCESSABLE_ENTITY);
    assert!(format!("{e:?}").contains("parameter 4 must be from 1 to 10"), "{e:?}");
    let untouched = settings(t.get(&moved_settings).await);
    assert!(!untouched.fitted && untouched.desired_retention == 0.9 && untouched.repeat_reviews == 0);
    let a = t.post(&import_uri, serde_json::to_value(&export).unwrap()).await;
    assert_eq!(a.status, StatusCode::OK, "{}", a.body);
    let carried = settings(t.get(&moved_settings).await);
    assert_eq!((carried.desired_retention, carried.fitted), (0.85, true));
    assert_eq!((carried.parameters, carried.fit), (fit.after.parameters.clone(), Some(fit.clone())));
    t.call(Method::PUT, &settings_uri, Some(json!({"desired_retention": 0.9}).to_string())).await;

    // New cards are now scheduled with the fitted parameters, and again with the defaults
    // once the profile asks for them back.
    let fitted = t.rate(p.id, &deck[100], 4).await.interval_days;
    assert!((fitted - at_default).abs() > 1e-3, "fitted {fitted} vs default {at_default}");
    let a = t
        .call(
            Method::PUT,
            &settings_uri,
            Some(json!({"desired_retention": 0.9, "default_parameters": true}).to_string()),
        )
        .await;
    let s = settings(a);
    assert!(!s.fitted && s.fit.is_none());
    assert!((t.rate(p.id, &deck[101], 4).await.interval_days - at_default).abs() < 1e-4);
}

/// The parameters a profile without a fit is scheduled with (a fresh profile's).
async fn fsrs_defaults(t: &TestApp) -> Vec<f32> {
    let fresh = t.profile("defaults").await;
    let a = t.get(&format!("/api/profiles/{}/settings", fresh.id)).await;
    serde_json::from_value::<ReviewSettings>(a.body).expect("ReviewSettings").parameters
}
