//! Flashcard review with spaced repetition (FSRS-6): profiles, today's queue, rating a
//! card, and export/import of a profile's progress. The bodies are in
//! `distlab_common::review`; the scheduling is `schedule.rs`'s (the `fsrs` crate), the
//! storage `store/review.rs`'s.
//!
//! - `GET  /api/profiles`, `POST /api/profiles {"name"}`: the owner's profiles.
//! - `GET  /api/profiles/{id}/review`: due cards, new cards, today's queue, counts, progress
//!   per topic and every reviewed card's state with its retrievability now.
//! - `POST /api/profiles/{id}/reviews {"card_id", "rating": 1..5}`: schedules the card's next
//!   review and logs this one.
//! - `GET  /api/profiles/{id}/export`, `POST /api/profiles/{id}/import`: a
//!   `distlab-review/1` document with every card state and the whole log. An import
//!   REPLACES the profile's states and log (a restore, not a merge), in one transaction and
//!   only after the whole document has been checked; states and log entries of cards that
//!   are not in the deck are skipped and reported in the answer.
//!
//! Time is always `clock::now()`: a card is due when its `due` is not after now. Tests move a
//! profile through time by moving its stored timestamps back (or importing a document whose
//! times lie in the past).

use std::collections::{BTreeSet, HashMap, HashSet};

use axum::extract::{Path, State};
use axum::http::{header, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::{Extension, Json};
use distlab_common::cards::Card;
use distlab_common::review::*;
use distlab_common::FieldError;

use crate::api::error::HttpError;
use crate::api::extract::JsonBody;
use crate::api::study::cards;
use crate::api::study::schedule::{
    build_view, card_view, check_parameters, schedule, utc_day_start, whole_ms, Scheduler, MAX_DAYS,
};
use crate::clock::{self, parse_time};
use crate::store::accounts::Account;
use crate::text::truncate;
use crate::{store, AppState};

/// The body limit of `POST /api/profiles/{id}/import` (a log of tens of thousands of reviews).
pub const MAX_IMPORT_BYTES: usize = 8 << 20;
/// An import answers at most this many problems (the count says how many there were).
const MAX_PROBLEMS: usize = 50;
fn profile_not_found(raw: &str) -> HttpError {
    HttpError::not_found(format!("no profile with id '{}'", truncate(raw, 40)))
}

/// The profile's scheduler: its fitted parameters (if any) and its desired retention.
pub async fn load_scheduler(state: &AppState, profile_id: i64) -> Result<Scheduler, HttpError> {
    let row = store::review::settings(&state.db, profile_id).await?;
    Scheduler::new(row.parameters.as_deref(), row.desired_retention)
        .map_err(|e| HttpError::internal("a profile's parameters", e))
}

/// The owner's profile with the id in the path, else 404 (also when someone else owns it).
pub(crate) async fn load_profile(state: &AppState, owner: &Account, raw_id: &str) -> Result<Profile, HttpError> {
    let id = match raw_id.parse::<i64>() {
        Ok(id) if id > 0 => id,
        _ => {
            return Err(HttpError::not_found(format!(
                "no profile with id '{}' (ids are positive integers)",
                truncate(raw_id, 40)
            )))
        }
    };
    store::review::profile(&state.db, id, &owner.name).await?.ok_or_else(|| profile_not_found(raw_id))
}

fn deck() -> Result<&'static [Card], HttpError> {
    cards::deck().map_err(|e| HttpError::internal("flashcards", e))
}

pub(crate) fn unprocessable(problem: FieldError) -> HttpError {
    HttpError::with_fields(StatusCode::UNPROCESSABLE_ENTITY, problem.message.clone(), vec![problem])
}

/// `GET /api/profiles`: the owner's profiles, oldest first.
#[utoipa::path(
    get, path = "/profiles", tag = "flashcards",
    responses(
        (status = 200, body = distlab_common::review::ProfileList),
    ),
)]
pub async fn list_profiles(
    State(state): State<AppState>,
    Extension(owner): Extension<Account>,
) -> Result<Json<ProfileList>, HttpError> {
    Ok(Json(ProfileList { profiles: store::review::profiles(&state.db, &owner.name).await? }))
}

/// `POST /api/profiles {"name"}` -> 201: the name trimmed, 1..=64 characters (422 otherwise),
/// unique per owner (409; names compare exactly, case included).
#[utoipa::path(
    post, path = "/profiles", tag = "flashcards",
    request_body = distlab_common::review::NewProfile,
    responses(
        (status = 201, body = distlab_common::review::Profile),
        (status = 422, description = "names each field that is wrong", body = distlab_common::ApiError),
    ),
)]
pub async fn create_profile(
    State(state): State<AppState>,
    Extension(owner): Extension<Account>,
    JsonBody(body): JsonBody<NewProfile>,
) -> Result<Response, HttpError> {
    let name = validate_profile_name(&body.name).map_err(unprocessable)?;
    let count = store::review::profile_count(&state.db, &owner.name).await?;
    if count >= MAX_PROFILES as i64 {
        return Err(HttpError::conflict(format!("there are already {MAX_PROFILES} profiles, the most there can be")));
    }
    let created_at = clock::rfc3339(clock::now());
    let id = store::review::create_profile(&state.db, &owner.name, &name, &created_at).await?;
    let Some(id) = id else {
        return Err(HttpError::conflict(format!("there is already a profile named '{}'", truncate(&name, 64))));
    };
    tracing::info!(profile = id, %name, "profile created");
    let profile = Profile { id, name, created_at };
    Ok((StatusCode::CREATED, [(header::LOCATION, format!("/api/profiles/{id}"))], Json(profile)).into_response())
}

/// `GET /api/profiles/{id}/review`
#[utoipa::path(
    get, path = "/profiles/{id}/review", tag = "flashcards",
    params(("id" = i64, Path, description = "the profile's id")),
    responses(
        (status = 200, body = distlab_common::review::ReviewView),
        (status = 404, body = distlab_common::ApiError),
    ),
)]
pub async fn review_view(
    State(state): State<AppState>,
    Extension(owner): Extension<Account>,
    Path(raw_id): Path<String>,
) -> Result<Json<ReviewView>, HttpError> {
    let profile = load_profile(&state, &owner, &raw_id).await?;
    let deck = deck()?;
    let now = clock::now();
    let states: HashMap<String, CardState> = store::review::states(&state.db, profile.id).await?.into_iter().collect();
    let day_start = clock::rfc3339(utc_day_start(now));
    let first_today = store::review::first_reviewed_since(&state.db, profile.id, &day_start).await?;
    let first_today: HashSet<String> = first_today.into_iter().collect();
    let scheduler = load_scheduler(&state, profile.id).await?;
    Ok(Json(build_view(profile, deck, states, &first_today, now, scheduler.decay())))
}

/// `POST /api/profiles/{id}/reviews {"card_id", "rating": 1..5}`: the card's new state.
/// 422 for a rating outside 1..=5 or a card id the deck does not have; 409 when the same
/// card was reviewed by another request at the same moment (nothing is changed: retry).
#[utoipa::path(
    post, path = "/profiles/{id}/reviews", operation_id = "review_card", tag = "flashcards",
    params(("id" = i64, Path, description = "the profile's id")),
    request_body = distlab_common::review::ReviewRequest,
    responses(
        (status = 200, body = distlab_common::review::ReviewResult),
        (status = 404, body = distlab_common::ApiError),
        (status = 409, body = distlab_common::ApiError),
        (status = 422, description = "names each field that is wrong", body = distlab_common::ApiError),
    ),
)]
pub async fn review(
    State(state): State<AppState>,
    Extension(owner): Extension<Account>,
    Path(raw_id): Path<String>,
    JsonBody(body): JsonBody<ReviewRequest>,
) -> Result<Json<ReviewResult>, HttpError> {
    let profile = load_profile(&state, &owner, &raw_id).await?;
    let grade = Grade::from_rating(body.rating).map_err(unprocessable)?;
    let rating = body.rating as u8; // 1..=5 after from_rating
    if !deck()?.iter().any(|c| c.id == body.card_id) {
        return Err(unprocessable(FieldError::new(
            "card_id",
            format!("the deck has no card with id '{}' (see GET /api/cards)", truncate(&body.card_id, 80)),
        )));
    }
    let prev = store::review::state(&state.db, profile.id, &body.card_id).await?;
    let now = whole_ms(clock::now());
    let scheduler = load_scheduler(&state, profile.id).await?;
    let (next, interval) =
        schedule(prev.as_ref(), rating, now, &scheduler).map_err(|e| HttpError::internal("scheduling a review", e))?;

    let review = store::review::Review {
        profile_id: profile.id,
        card_id: &body.card_id,
        prev: prev.as_ref(),
        next: &next,
        rating,
        interval,
    };
    if !store::review::record(&state.db, &review).await? {
        return Err(HttpError::conflict(format!(
            "card '{}' was reviewed by another request just now; reload the queue",
            truncate(&body.card_id, 80)
        )));
    }
    tracing::info!(profile = profile.id, card = %body.card_id, rating, interval, due = %next.due, "card reviewed");

    let now_text = next.last_review.clone();
    Ok(Json(ReviewResult {
        card_id: body.card_id,
        rating,
        grade,
        reviewed_at: now_text.clone(),
        interval_days: interval,
        state: card_view(next, now, &now_text, scheduler.decay()),
    }))
}

/// `GET /api/profiles/{id}/export`: every stored card state (card id order) and the whole
/// log (oldest first), including cards the deck no longer has.
#[utoipa::path(
    get, path = "/profiles/{id}/export", operation_id = "export_profile", tag = "flashcards",
    params(("id" = i64, Path, description = "the profile's id")),
    responses(
        (status = 200, body = distlab_common::review::ReviewExport),
        (status = 404, body = distlab_common::ApiError),
    ),
)]
pub async fn export(
    State(state): State<AppState>,
    Extension(owner): Extension<Account>,
    Path(raw_id): Path<String>,
) -> Result<Json<ReviewExport>, HttpError> {
    let profile = load_profile(&state, &owner, &raw_id).await?;
    let cards = store::review::states(&state.db, profile.id)
        .await?
        .into_iter()
        .map(|(card_id, s)| ExportedCard::new(card_id, s))
        .collect();
    let log = store::review::log(&state.db, profile.id).await?;
    let settings = store::review::settings(&state.db, profile.id).await?;
    Ok(Json(ReviewExport {
        format: EXPORT_FORMAT.to_string(),
        profile: profile.name,
        exported_at: clock::rfc3339(clock::now()),
        cards,
        log,
        scheduling: Some(ExportedScheduling {
            desired_retention: settings.desired_retention,
            parameters: settings.parameters,
            fit: settings.fit,
        }),
    }))
}

/// An import document checked and normalised: what will be written, what is skipped.
#[derive(Debug, Default)]
pub struct CheckedImport {
    pub cards: Vec<(String, CardState)>,
    pub log: Vec<LogEntry>,
    pub skipped_card_ids: BTreeSet<String>,
    pub skipped_cards: usize,
    pub skipped_log: usize,
    /// The document's scheduling settings, checked (None: it has none).
    pub scheduling: Option<ExportedScheduling>,
}

/// Reads an import body: 400 when it is not an export document's shape, 422 for an unknown
/// format or values that cannot be stored (every problem listed, up to 50).
pub fn check_import(body: serde_json::Value, deck: &[Card]) -> Result<CheckedImport, HttpError> {
    let format = match &body {
        serde_json::Value::Object(map) => map.get("format"),
        _ => {
            return Err(HttpError::bad_request(format!(
                "expected a review export: a JSON object with \"format\": \"{EXPORT_FORMAT}\""
            )))
        }
    };
    match format {
        Some(serde_json::Value::String(f)) if f == EXPORT_FORMAT => {}
        Some(serde_json::Value::String(f)) => {
            return Err(unprocessable(FieldError::new(
                "format",
                format!("unknown export format '{}'; this server reads '{EXPORT_FORMAT}'", truncate(f, 40)),
            )))
        }
        _ => {
            return Err(unprocessable(FieldError::new(
                "format",
                format!("not a review export: \"format\" must be \"{EXPORT_FORMAT}\""),
            )))
        }
    }
    let doc: ReviewExport = serde_path_to_error::deserialize(body).map_err(|e| {
        let path = e.path().to_string();
        HttpError::bad_field(&path, format!("unexpected JSON at {path}: {}", e.into_inner()))
    })?;

    let known: HashSet<&str> = deck.iter().map(|c| c.id.as_str()).collect();
    let mut problems = Vec::new();
    let mut out = CheckedImport::default();
    let mut seen = HashSet::new();
    let time_field = |problems: &mut Vec<FieldError>, field: String, text: &str| -> Option<String> {
        match parse_time(text) {
            Some(t) => Some(clock::rfc3339(t)),
            None => {
                problems.push(FieldError::new(
                    field,
                    format!(
                        "'{}' is not an RFC3339 time between 1970 and 2999 like 2025-01-31T12:00:00.000Z",
                        truncate(text, 40)
                    ),
                ));
                None
            }
        }
    };
    let rating_ok = |problems: &mut Vec<FieldError>, field: String, rating: u8| {
        if !(1..=5).contains(&rating) {
            problems.push(FieldError::new(field, format!("a rating is 1..=5, got {rating}")));
        }
    };
    for (i, c) in doc.cards.into_iter().enumerate() {
        let at = |name: &str| format!("cards[{i}].{name}");
        if c.card_id.is_empty() {
            problems.push(FieldError::new(at("card_id"), "empty card id"));
        } else if !seen.insert(c.card_id.clone()) {
            problems.push(FieldError::new(at("card_id"), format!("card '{}' appears twice", truncate(&c.card_id, 80))));
        }
        if !(c.stability.is_finite() && c.stability > 0.0 && c.stability <= MAX_DAYS) {
            problems.push(FieldError::new(
                at("stability"),
                format!("stability must be in (0, 36500], got {}", c.stability),
            ));
        }
        if !(c.difficulty.is_finite() && (1.0..=10.0).contains(&c.difficulty)) {
            problems
                .push(FieldError::new(at("difficulty"), format!("difficulty must be in 1..=10, got {}", c.difficulty)));
        }
        let due = time_field(&mut problems, at("due"), &c.due);
        let last = time_field(&mut problems, at("last_review"), &c.last_review);
        if let (Some(due), Some(last)) = (&due, &last) {
            if due < last {
                problems.push(FieldError::new(at("due"), "due is before last_review"));
            }
        }
        if c.reps == 0 {
            problems.push(FieldError::new(at("reps"), "a reviewed card has reps >= 1"));
        }
        if c.lapses > c.reps {
            problems.push(FieldError::new(at("lapses"), format!("lapses ({}) exceed reps ({})", c.lapses, c.reps)));
        }
        rating_ok(&mut problems, at("last_rating"), c.last_rating);
        if !known.contains(c.card_id.as_str()) {
            out.skipped_cards += 1;
            out.skipped_card_ids.insert(c.card_id);
            continue;
        }
        if let (Some(due), Some(last_review)) = (due, last) {
            let state = CardState { due, last_review, ..c.state() };
            out.cards.push((c.card_id, state));
        }
    }
    for (i, e) in doc.log.into_iter().enumerate() {
        let at = |name: &str| format!("log[{i}].{name}");
        if e.card_id.is_empty() {
            problems.push(FieldError::new(at("card_id"), "empty card id"));
        }
        rating_ok(&mut problems, at("rating"), e.rating);
        if !(e.interval_days.is_finite() && (0.0..=MAX_DAYS).contains(&e.interval_days)) {
            problems.push(FieldError::new(
                at("interval_days"),
                format!("interval_days must be in 0..=36500, got {}", e.interval_days),
            ));
        }
        let reviewed_at = time_field(&mut problems, at("reviewed_at"), &e.reviewed_at);
        if !known.contains(e.card_id.as_str()) {
            out.skipped_log += 1;
            out.skipped_card_ids.insert(e.card_id);
            continue;
        }
        if let Some(reviewed_at) = reviewed_at {
            out.log.push(LogEntry { reviewed_at, ..e });
        }
    }
    if let Some(scheduling) = doc.scheduling {
        if let Err(e) = validate_retention(scheduling.desired_retention) {
            problems.push(FieldError::new("scheduling.desired_retention", e.message));
        }
        if let Some(parameters) = &scheduling.parameters {
            if let Err(why) = check_parameters(parameters) {
                problems.push(FieldError::new("scheduling.parameters", why));
            }
        }
        out.scheduling = Some(scheduling);
    }
    if !problems.is_empty() {
        let error = match problems.len() {
            1 => format!("the export cannot be imported: {}", problems[0]),
            n => format!("the export cannot be imported: {n} problems (nothing was changed)"),
        };
        problems.truncate(MAX_PROBLEMS);
        return Err(HttpError::with_fields(StatusCode::UNPROCESSABLE_ENTITY, error, problems));
    }
    Ok(out)
}

/// `POST /api/profiles/{id}/import`: replaces the profile's card states and log with the
/// document's (in one transaction, after checking all of it; a refused import changes
/// nothing). The profile keeps its own name.
#[utoipa::path(
    post, path = "/profiles/{id}/import", operation_id = "import_profile", tag = "flashcards",
    params(("id" = i64, Path, description = "the profile's id")),
    request_body = distlab_common::review::ReviewExport,
    responses(
        (status = 200, body = distlab_common::review::ImportResult),
        (status = 404, body = distlab_common::ApiError),
        (status = 422, description = "names each field that is wrong", body = distlab_common::ApiError),
    ),
)]
pub async fn import(
    State(state): State<AppState>,
    Extension(owner): Extension<Account>,
    Path(raw_id): Path<String>,
    JsonBody(body): JsonBody<serde_json::Value>,
) -> Result<Json<ImportResult>, HttpError> {
    let profile = load_profile(&state, &owner, &raw_id).await?;
    let checked = check_import(body, deck()?)?;

    store::review::replace(&state.db, profile.id, &checked.cards, &checked.log, checked.scheduling.as_ref()).await?;
    tracing::info!(
        profile = profile.id,
        cards = checked.cards.len(),
        log = checked.log.len(),
        skipped_cards = checked.skipped_cards,
        skipped_log = checked.skipped_log,
        "review progress imported"
    );
    Ok(Json(ImportResult {
        profile,
        cards: checked.cards.len(),
        log: checked.log.len(),
        skipped_card_ids: checked.skipped_card_ids.into_iter().collect(),
        skipped_cards: checked.skipped_cards,
        skipped_log: checked.skipped_log,
    }))
}
