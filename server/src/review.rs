//! Flashcard review with spaced repetition (FSRS-6): profiles, today's queue, rating a
//! card, and export/import of a profile's progress. The bodies are in
//! `distlab_common::review`; this module does the scheduling (the `fsrs` crate) and storage.
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
//!
//! Scheduling: the rating maps onto an FSRS grade (`Grade::from_rating`: 1, 2 -> again,
//! 3 -> hard, 4 -> good, 5 -> easy). FSRS gets the card's memory state (none for a new card)
//! and the whole days since its last review, and gives the next memory state and interval
//! for the profile's desired retention (0.9 unless it chose another, `review_settings.rs`,
//! with the parameters fitted to its log if it asked for a fit); the interval is kept
//! fractional (again on a new card is about 5 hours), and `due` = now + interval. A lapse is a failure (rating 1 or 2) of a card that
//! had been reviewed before.

use std::collections::{BTreeMap, BTreeSet, HashMap, HashSet};
use std::sync::LazyLock;
use std::time::{Duration, SystemTime};

use axum::extract::{Path, State};
use axum::http::{header, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::{Extension, Json};
use distlab_common::cards::Card;
use distlab_common::review::*;
use distlab_common::FieldError;
use time::OffsetDateTime;

use crate::accounts::Account;
use crate::error::HttpError;
use crate::extract::{truncate, JsonBody};
use crate::{cards, clock, AppState};

/// The body limit of `POST /api/profiles/{id}/import` (a log of tens of thousands of reviews).
pub const MAX_IMPORT_BYTES: usize = 8 << 20;
/// An import answers at most this many problems (the count says how many there were).
const MAX_PROBLEMS: usize = 50;
/// FSRS keeps stability within (0, 36500] days.
const MAX_DAYS: f32 = 36_500.0;
const DAY_SECS: f64 = 86_400.0;

/// How one profile's reviews are scheduled: FSRS with its parameters (the defaults or the
/// profile's fitted ones) and its desired retention.
pub struct Scheduler {
    fsrs: fsrs::FSRS,
    desired_retention: f32,
    /// The forgetting curve's decay (parameter 20).
    decay: f32,
}

static DEFAULT_FSRS: LazyLock<fsrs::FSRS> = LazyLock::new(fsrs::FSRS::default);

impl Scheduler {
    /// `parameters` None: FSRS's defaults.
    pub fn new(parameters: Option<&[f32]>, desired_retention: f32) -> Result<Scheduler, String> {
        let parameters = parameters.unwrap_or(&fsrs::DEFAULT_PARAMETERS);
        let fsrs = fsrs::FSRS::new(parameters).map_err(|e| format!("FSRS parameters: {e}"))?;
        let decay = parameters.get(20).copied().unwrap_or(fsrs::DEFAULT_PARAMETERS[20]);
        Ok(Scheduler { fsrs, desired_retention, decay })
    }

    pub fn decay(&self) -> f32 {
        self.decay
    }
}

impl Default for Scheduler {
    fn default() -> Self {
        Scheduler {
            fsrs: DEFAULT_FSRS.clone(),
            desired_retention: DESIRED_RETENTION,
            decay: fsrs::DEFAULT_PARAMETERS[20],
        }
    }
}

// ---------------------------------------------------------------------------------------
// Scheduling (pure)

pub use crate::clock::parse_time;

/// Whole days from `from` to `to` (0 when `to` is earlier), as FSRS counts elapsed time.
pub(crate) fn whole_days_between(from: SystemTime, to: SystemTime) -> u32 {
    days_between(from, to).floor().min(f64::from(u32::MAX)) as u32
}

/// Days from `from` to `to` (0 when `to` is earlier).
fn days_between(from: SystemTime, to: SystemTime) -> f64 {
    to.duration_since(from).map_or(0.0, |d| d.as_secs_f64() / DAY_SECS)
}

/// The start (00:00 UTC) of `now`'s day: new cards first reviewed since then count against
/// today's `NEW_PER_DAY`.
pub fn utc_day_start(now: SystemTime) -> SystemTime {
    SystemTime::from(OffsetDateTime::from(now).replace_time(time::Time::MIDNIGHT))
}

/// The probability of recalling a card `days` after its last review (FSRS-6 forgetting curve
/// with the scheduler's decay).
pub fn retrievability(stability: f32, days: f64, decay: f32) -> f32 {
    let memory = fsrs::MemoryState { stability, difficulty: 1.0 };
    let r = fsrs::current_retrievability(memory, days as f32, decay);
    if r.is_finite() {
        r.clamp(0.0, 1.0)
    } else {
        0.0
    }
}

/// `t` to the millisecond (the precision of stored times), so that a stored `due` is
/// exactly the stored `last_review` plus the interval.
fn whole_ms(t: SystemTime) -> SystemTime {
    parse_time(&clock::rfc3339(t)).unwrap_or(t)
}

/// A card's state after one review at `now` (and the interval until it is due).
pub fn schedule(
    prev: Option<&CardState>,
    rating: u8,
    now: SystemTime,
    scheduler: &Scheduler,
) -> Result<(CardState, f32), String> {
    let now = whole_ms(now);
    let grade = Grade::from_rating(i64::from(rating)).map_err(|e| e.message)?;
    let (memory, days_elapsed) = match prev {
        Some(p) => {
            let last =
                parse_time(&p.last_review).ok_or_else(|| format!("unreadable last_review {:?}", p.last_review))?;
            let days = whole_days_between(last, now);
            (Some(fsrs::MemoryState { stability: p.stability, difficulty: p.difficulty }), days)
        }
        None => (None, 0),
    };
    let next = scheduler
        .fsrs
        .next_states(memory, scheduler.desired_retention, days_elapsed)
        .map_err(|e| format!("FSRS: {e}"))?;
    let item = match grade {
        Grade::Again => next.again,
        Grade::Hard => next.hard,
        Grade::Good => next.good,
        Grade::Easy => next.easy,
    };
    let interval = item.interval.clamp(0.0, MAX_DAYS);
    if !interval.is_finite() {
        return Err(format!("FSRS gave the interval {}", item.interval));
    }
    let due = now + Duration::from_secs_f64(f64::from(interval) * DAY_SECS);
    let state = CardState {
        stability: item.memory.stability,
        difficulty: item.memory.difficulty,
        due: clock::rfc3339(due),
        last_review: clock::rfc3339(now),
        reps: prev.map_or(0, |p| p.reps).saturating_add(1),
        lapses: prev.map_or(0, |p| p.lapses) + u32::from(prev.is_some() && grade.is_failure()),
        last_rating: rating,
    };
    Ok((state, interval))
}

/// A stored card as the review view shows it at `now`.
fn card_view(state: CardState, now: SystemTime, now_text: &str, decay: f32) -> CardView {
    let days = parse_time(&state.last_review).map_or(0.0, |last| days_between(last, now));
    let retrievability = retrievability(state.stability, days, decay);
    let is_due = state.due.as_str() <= now_text;
    CardView { state, retrievability, is_due }
}

/// The review view of a profile: `states` by card id, the deck, and the ids of cards first
/// reviewed today.
pub fn build_view(
    profile: Profile,
    deck: &[Card],
    mut states: HashMap<String, CardState>,
    first_reviewed_today: &HashSet<String>,
    now: SystemTime,
    decay: f32,
) -> ReviewView {
    let now_text = clock::rfc3339(now);
    let mut due: Vec<(String, usize, String)> = Vec::new();
    let mut new = Vec::new();
    let mut cards = BTreeMap::new();
    let mut topics: BTreeMap<u32, (TopicProgress, f32)> = BTreeMap::new();
    let mut new_today = 0;
    for (index, card) in deck.iter().enumerate() {
        let (topic, r_sum) = topics.entry(card.topic).or_insert_with(|| {
            (TopicProgress { topic: card.topic, cards: 0, reviewed: 0, due: 0, mean_retrievability: None }, 0.0)
        });
        topic.cards += 1;
        if first_reviewed_today.contains(&card.id) {
            new_today += 1;
        }
        match states.remove(&card.id) {
            None => new.push(card.id.clone()),
            Some(state) => {
                let view = card_view(state, now, &now_text, decay);
                topic.reviewed += 1;
                *r_sum += view.retrievability;
                if view.is_due {
                    topic.due += 1;
                    due.push((view.state.due.clone(), index, card.id.clone()));
                }
                cards.insert(card.id.clone(), view);
            }
        }
    }
    due.sort();
    let due: Vec<String> = due.into_iter().map(|(_, _, id)| id).collect();
    let fresh = NEW_PER_DAY.saturating_sub(new_today);
    let queue = due.iter().chain(new.iter().take(fresh)).cloned().collect();
    let counts = ReviewCounts {
        due: due.len(),
        new: new.len(),
        learned: cards.len() - due.len(),
        total: deck.len(),
        new_today,
        new_per_day: NEW_PER_DAY,
    };
    let topics = topics
        .into_values()
        .map(|(mut t, r_sum)| {
            if t.reviewed > 0 {
                t.mean_retrievability = Some(r_sum / t.reviewed as f32);
            }
            t
        })
        .collect();
    ReviewView { profile, now: now_text, due, new, queue, counts, topics, cards }
}

// ---------------------------------------------------------------------------------------
// Storage

#[derive(sqlx::FromRow)]
struct ProfileRow {
    id: i64,
    name: String,
    created_at: String,
}

impl From<ProfileRow> for Profile {
    fn from(r: ProfileRow) -> Self {
        Profile { id: r.id, name: r.name, created_at: r.created_at }
    }
}

#[derive(sqlx::FromRow)]
struct StateRow {
    card_id: String,
    stability: f64,
    difficulty: f64,
    due: String,
    last_review: String,
    reps: i64,
    lapses: i64,
    last_rating: i64,
}

impl StateRow {
    fn into_state(self) -> (String, CardState) {
        let state = CardState {
            stability: self.stability as f32,
            difficulty: self.difficulty as f32,
            due: self.due,
            last_review: self.last_review,
            reps: u32::try_from(self.reps).unwrap_or(0),
            lapses: u32::try_from(self.lapses).unwrap_or(0),
            last_rating: u8::try_from(self.last_rating).unwrap_or(0),
        };
        (self.card_id, state)
    }
}

#[derive(sqlx::FromRow)]
struct LogRow {
    card_id: String,
    rating: i64,
    reviewed_at: String,
    interval_days: f64,
}

const SELECT_STATE: &str =
    "SELECT card_id, stability, difficulty, due, last_review, reps, lapses, last_rating FROM card_reviews";

fn profile_not_found(raw: &str) -> HttpError {
    HttpError::not_found(format!("no profile with id '{}'", truncate(raw, 40)))
}

/// The profile's scheduler: its fitted parameters (if any) and its desired retention.
pub async fn load_scheduler(state: &AppState, profile_id: i64) -> Result<Scheduler, HttpError> {
    let row = crate::review_settings::load(state, profile_id).await?;
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
    let row = sqlx::query_as::<_, ProfileRow>("SELECT id, name, created_at FROM profiles WHERE id = $1 AND owner = $2")
        .bind(id)
        .bind(&owner.name)
        .fetch_optional(&state.db)
        .await?;
    row.map(Profile::from).ok_or_else(|| profile_not_found(raw_id))
}

async fn load_states(state: &AppState, profile_id: i64) -> Result<Vec<(String, CardState)>, HttpError> {
    let sql = format!("{SELECT_STATE} WHERE profile_id = $1 ORDER BY card_id");
    let rows = sqlx::query_as::<_, StateRow>(&sql).bind(profile_id).fetch_all(&state.db).await?;
    Ok(rows.into_iter().map(StateRow::into_state).collect())
}

fn deck() -> Result<&'static [Card], HttpError> {
    cards::deck().map_err(|e| HttpError::internal("flashcards", e))
}

pub(crate) fn unprocessable(problem: FieldError) -> HttpError {
    HttpError::with_fields(StatusCode::UNPROCESSABLE_ENTITY, problem.message.clone(), vec![problem])
}

// ---------------------------------------------------------------------------------------
// Handlers

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
    let rows =
        sqlx::query_as::<_, ProfileRow>("SELECT id, name, created_at FROM profiles WHERE owner = $1 ORDER BY id")
            .bind(&owner.name)
            .fetch_all(&state.db)
            .await?;
    Ok(Json(ProfileList { profiles: rows.into_iter().map(Profile::from).collect() }))
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
    let count: i64 = sqlx::query_scalar("SELECT COUNT(*) FROM profiles WHERE owner = $1")
        .bind(&owner.name)
        .fetch_one(&state.db)
        .await?;
    if count >= MAX_PROFILES as i64 {
        return Err(HttpError::conflict(format!("there are already {MAX_PROFILES} profiles, the most there can be")));
    }
    let created_at = clock::rfc3339(clock::now());
    let id: Option<i64> = sqlx::query_scalar(
        "INSERT INTO profiles (owner, name, created_at) VALUES ($1, $2, $3) \
         ON CONFLICT (owner, name) DO NOTHING RETURNING id",
    )
    .bind(&owner.name)
    .bind(&name)
    .bind(&created_at)
    .fetch_optional(&state.db)
    .await?;
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
    let states: HashMap<String, CardState> = load_states(&state, profile.id).await?.into_iter().collect();
    let first_today: Vec<String> = sqlx::query_scalar(
        "SELECT card_id FROM review_log WHERE profile_id = $1 GROUP BY card_id HAVING MIN(reviewed_at) >= $2",
    )
    .bind(profile.id)
    .bind(clock::rfc3339(utc_day_start(now)))
    .fetch_all(&state.db)
    .await?;
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
    let sql = format!("{SELECT_STATE} WHERE profile_id = $1 AND card_id = $2");
    let prev = sqlx::query_as::<_, StateRow>(&sql)
        .bind(profile.id)
        .bind(&body.card_id)
        .fetch_optional(&state.db)
        .await?
        .map(|row| row.into_state().1);
    let now = whole_ms(clock::now());
    let scheduler = load_scheduler(&state, profile.id).await?;
    let (next, interval) =
        schedule(prev.as_ref(), rating, now, &scheduler).map_err(|e| HttpError::internal("scheduling a review", e))?;

    let mut tx = state.db.begin().await?;
    // The write is conditional on the state read above, so that two reviews of the same
    // card at once cannot both apply to the same previous state.
    let written = match &prev {
        None => sqlx::query(
            "INSERT INTO card_reviews \
               (profile_id, card_id, stability, difficulty, due, last_review, reps, lapses, last_rating) \
             VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9) ON CONFLICT (profile_id, card_id) DO NOTHING",
        ),
        Some(_) => sqlx::query(
            "UPDATE card_reviews SET stability = $3, difficulty = $4, due = $5, last_review = $6, reps = $7, \
               lapses = $8, last_rating = $9 \
             WHERE profile_id = $1 AND card_id = $2 AND reps = $10 AND last_review = $11",
        ),
    }
    .bind(profile.id)
    .bind(&body.card_id)
    .bind(f64::from(next.stability))
    .bind(f64::from(next.difficulty))
    .bind(&next.due)
    .bind(&next.last_review)
    .bind(i64::from(next.reps))
    .bind(i64::from(next.lapses))
    .bind(i64::from(rating))
    .bind(prev.as_ref().map(|p| i64::from(p.reps)))
    .bind(prev.as_ref().map(|p| p.last_review.clone()))
    .execute(&mut *tx)
    .await?
    .rows_affected();
    if written != 1 {
        return Err(HttpError::conflict(format!(
            "card '{}' was reviewed by another request just now; reload the queue",
            truncate(&body.card_id, 80)
        )));
    }
    sqlx::query(
        "INSERT INTO review_log (profile_id, card_id, rating, reviewed_at, interval_days) VALUES ($1, $2, $3, $4, $5)",
    )
    .bind(profile.id)
    .bind(&body.card_id)
    .bind(i64::from(rating))
    .bind(&next.last_review)
    .bind(f64::from(interval))
    .execute(&mut *tx)
    .await?;
    tx.commit().await?;
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
    let cards =
        load_states(&state, profile.id).await?.into_iter().map(|(card_id, s)| ExportedCard::new(card_id, s)).collect();
    let log = sqlx::query_as::<_, LogRow>(
        "SELECT card_id, rating, reviewed_at, interval_days FROM review_log WHERE profile_id = $1 \
         ORDER BY reviewed_at, id",
    )
    .bind(profile.id)
    .fetch_all(&state.db)
    .await?
    .into_iter()
    .map(|r| LogEntry {
        card_id: r.card_id,
        rating: u8::try_from(r.rating).unwrap_or(0),
        reviewed_at: r.reviewed_at,
        interval_days: r.interval_days as f32,
    })
    .collect();
    let settings = crate::review_settings::load(&state, profile.id).await?;
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
            if let Err(why) = crate::review_settings::check_parameters(parameters) {
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

    let mut tx = state.db.begin().await?;
    sqlx::query("DELETE FROM card_reviews WHERE profile_id = $1").bind(profile.id).execute(&mut *tx).await?;
    sqlx::query("DELETE FROM review_log WHERE profile_id = $1").bind(profile.id).execute(&mut *tx).await?;
    for (card_id, s) in &checked.cards {
        sqlx::query(
            "INSERT INTO card_reviews \
               (profile_id, card_id, stability, difficulty, due, last_review, reps, lapses, last_rating) \
             VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9)",
        )
        .bind(profile.id)
        .bind(card_id)
        .bind(f64::from(s.stability))
        .bind(f64::from(s.difficulty))
        .bind(&s.due)
        .bind(&s.last_review)
        .bind(i64::from(s.reps))
        .bind(i64::from(s.lapses))
        .bind(i64::from(s.last_rating))
        .execute(&mut *tx)
        .await?;
    }
    for e in &checked.log {
        sqlx::query(
            "INSERT INTO review_log (profile_id, card_id, rating, reviewed_at, interval_days) \
             VALUES ($1, $2, $3, $4, $5)",
        )
        .bind(profile.id)
        .bind(&e.card_id)
        .bind(i64::from(e.rating))
        .bind(&e.reviewed_at)
        .bind(f64::from(e.interval_days))
        .execute(&mut *tx)
        .await?;
    }
    if let Some(scheduling) = &checked.scheduling {
        crate::review_settings::store(&mut tx, profile.id, scheduling).await?;
    }
    tx.commit().await?;
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

#[cfg(test)]
mod tests {
    use super::*;

    fn t(text: &str) -> SystemTime {
        parse_time(text).unwrap()
    }

    #[test]
    fn times_parse_and_days_start_at_midnight_utc() {
        let now = t("2025-03-04T15:16:17.189Z");
        assert_eq!(clock::rfc3339(now), "2025-03-04T15:16:17.189Z");
        assert_eq!(clock::rfc3339(t("2025-03-04T16:16:17+01:00")), "2025-03-04T15:16:17.000Z");
        assert_eq!(clock::rfc3339(utc_day_start(now)), "2025-03-04T00:00:00.000Z");
        assert!(parse_time("yesterday").is_none());
        assert!(parse_time("2025-03-04").is_none());
        assert!(parse_time("9999-12-31T23:59:59Z").is_none(), "year 9999 plus an interval overflows");
        assert!(parse_time("1969-12-31T23:59:59Z").is_none());
    }

    #[test]
    fn a_new_card_is_scheduled_by_its_grade() {
        let d = Scheduler::default();
        let now = t("2025-01-01T00:00:00.000Z");
        let intervals: Vec<f32> = (1..=5).map(|r| schedule(None, r, now, &d).unwrap().1).collect();
        // FSRS-6 default initial stabilities: again 0.212, hard 1.2931, good 2.3065, easy 8.2956.
        assert_eq!(intervals[0], intervals[1], "1 and 2 are both again");
        assert!(intervals[0] < 1.0 && intervals[1] < intervals[2] && intervals[2] < intervals[3]);
        assert!(intervals[3] < intervals[4]);
        let (good, interval) = schedule(None, 4, now, &d).unwrap();
        assert!((interval - 2.3065).abs() < 1e-4, "{interval}");
        assert_eq!(good.reps, 1);
        assert_eq!(good.lapses, 0, "forgetting a new card is not a lapse");
        assert_eq!(good.last_review, "2025-01-01T00:00:00.000Z");
        assert_eq!(good.due, clock::rfc3339(now + Duration::from_secs_f64(f64::from(interval) * DAY_SECS)));
        assert!(schedule(None, 0, now, &d).is_err() && schedule(None, 6, now, &d).is_err());
    }

    #[test]
    fn remembering_after_the_interval_lengthens_it_and_forgetting_is_a_lapse() {
        let d = Scheduler::default();
        let start = t("2025-01-01T00:00:00.000Z");
        let (first, i1) = schedule(None, 4, start, &d).unwrap();
        let later = parse_time(&first.due).unwrap();
        let (second, i2) = schedule(Some(&first), 4, later, &d).unwrap();
        assert!(i2 > 2.0 * i1, "{i1} -> {i2}");
        assert_eq!((second.reps, second.lapses), (2, 0));
        let (forgot, i3) = schedule(Some(&second), 1, parse_time(&second.due).unwrap(), &d).unwrap();
        assert!(i3 < i2);
        assert_eq!((forgot.reps, forgot.lapses, forgot.last_rating), (3, 1, 1));
    }

    #[test]
    fn a_lower_desired_retention_spaces_reviews_further_apart() {
        let now = t("2025-01-01T00:00:00.000Z");
        let at = |r| schedule(None, 4, now, &Scheduler::new(None, r).unwrap()).unwrap().1;
        assert!(at(0.8) > at(0.9) && at(0.9) > at(0.95), "{} {} {}", at(0.8), at(0.9), at(0.95));
        assert!(Scheduler::new(Some(&[1.0, 2.0]), 0.9).is_err(), "too few parameters");
    }

    #[test]
    fn retrievability_falls_from_one_to_ninety_percent_at_the_stability() {
        let decay = Scheduler::default().decay();
        assert!((retrievability(3.0, 0.0, decay) - 1.0).abs() < 1e-6);
        assert!((retrievability(3.0, 3.0, decay) - 0.9).abs() < 1e-3);
        assert!(retrievability(3.0, 30.0, decay) < 0.9);
    }
}
