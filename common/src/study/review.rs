//! Flashcard review with spaced repetition: the bodies of the `/api/profiles` endpoints and
//! the mapping of the deck's 1..5 self-rating onto the four FSRS grades.
//!
//! The scheduling itself (FSRS-6, the `fsrs` crate) runs in the server only: `fsrs` pulls
//! ndarray, rayon and rand 0.10 (whose `getrandom` does not build for wasm32-unknown-unknown
//! without extra configuration), and the server is the authority on a card's next due date
//! anyway. The browser gets everything it shows (due dates, intervals, retrievability) in
//! these bodies.
//!
//! Times are RFC3339 UTC text with milliseconds and a fixed width
//! (`"2025-01-31T12:00:00.000Z"`), as everywhere in the API.
//!
//! ```text
//! GET  /api/profiles                  -> ProfileList
//! POST /api/profiles {"name"}         -> 201 Profile (409 when the name is taken)
//! GET  /api/profiles/{id}/review      -> ReviewView
//! POST /api/profiles/{id}/reviews     ReviewRequest -> ReviewResult
//! GET  /api/profiles/{id}/export      -> ReviewExport
//! POST /api/profiles/{id}/import      ReviewExport -> ImportResult
//! GET  /api/profiles/{id}/settings    -> ReviewSettings
//! PUT  /api/profiles/{id}/settings    NewReviewSettings -> ReviewSettings
//! POST /api/profiles/{id}/fit         -> ParameterFit (409 below MIN_REPEAT_REVIEWS)
//! ```

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use crate::spec::field_error::FieldError;

/// The `format` of an export document; an import of any other format is refused (422).
pub const EXPORT_FORMAT: &str = "distlab-review/1";
/// New cards a profile is shown per day (UTC day): today's queue holds every due card and
/// `NEW_PER_DAY` minus the new cards first reviewed today.
pub const NEW_PER_DAY: usize = 10;
/// The probability of recall at which FSRS schedules the next review, unless a profile
/// chooses another (within `RETENTION_RANGE`).
pub const DESIRED_RETENTION: f32 = 0.9;
/// The desired retentions a profile may choose: below, reviews come so late that most are
/// forgotten; above, so often that the work grows steeply for little gain.
pub const RETENTION_RANGE: std::ops::RangeInclusive<f32> = 0.70..=0.97;
/// FSRS's parameters can be fitted to a profile's log (on request) once it holds this many
/// repeat reviews (reviews of a card at least a day after the one before: each is one
/// recall the fit can be scored on).
pub const MIN_REPEAT_REVIEWS: usize = 64;
/// The longest profile name, in characters (after trimming).
pub const MAX_PROFILE_NAME: usize = 64;
/// Profiles one owner may have.
pub const MAX_PROFILES: usize = 100;
/// The lowest and highest self-rating.
pub const RATING_MIN: i64 = 1;
pub const RATING_MAX: i64 = 5;

/// The four answers FSRS knows.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(rename_all = "snake_case")]
pub enum Grade {
    Again,
    Hard,
    Good,
    Easy,
}

impl Grade {
    /// The deck asks "How well did you know this?" from 1 (Not at all) to 5 (Perfectly).
    /// The five answers map onto the four FSRS grades like this:
    ///
    /// | rating | meaning          | FSRS grade |
    /// | ------ | ---------------- | ---------- |
    /// | 1      | not at all       | Again      |
    /// | 2      | barely, wrongly  | Again      |
    /// | 3      | with effort      | Hard       |
    /// | 4      | well             | Good       |
    /// | 5      | perfectly        | Easy       |
    ///
    /// 1 and 2 are both failures to recall (the card is relearned soon, and counts as a
    /// lapse when it had been reviewed before); 3..5 are successes of rising ease.
    /// Anything outside 1..=5 is refused with a message that says so.
    pub fn from_rating(rating: i64) -> Result<Grade, FieldError> {
        match rating {
            1 | 2 => Ok(Grade::Again),
            3 => Ok(Grade::Hard),
            4 => Ok(Grade::Good),
            5 => Ok(Grade::Easy),
            other => Err(FieldError::new(
                "rating",
                format!(
                    "rating must be a whole number from {RATING_MIN} (not at all) to {RATING_MAX} (perfectly), \
                     got {other}"
                ),
            )),
        }
    }

    /// FSRS's own number for the grade (1 again, 2 hard, 3 good, 4 easy).
    pub fn fsrs_rating(self) -> u32 {
        match self {
            Grade::Again => 1,
            Grade::Hard => 2,
            Grade::Good => 3,
            Grade::Easy => 4,
        }
    }

    /// Again is a failure to recall; the others are successes.
    pub fn is_failure(self) -> bool {
        self == Grade::Again
    }
}

/// A profile's name trimmed, or why it cannot be used.
pub fn validate_profile_name(name: &str) -> Result<String, FieldError> {
    let name = name.trim();
    if name.is_empty() {
        return Err(FieldError::new("name", "give the profile a name"));
    }
    if name.chars().count() > MAX_PROFILE_NAME {
        return Err(FieldError::new("name", format!("a profile name is at most {MAX_PROFILE_NAME} characters")));
    }
    if name.chars().any(char::is_control) {
        return Err(FieldError::new("name", "a profile name must not contain control characters"));
    }
    Ok(name.to_string())
}

/// A person's review progress (`GET /api/profiles` items, `POST /api/profiles` -> 201).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct Profile {
    pub id: i64,
    pub name: String,
    pub created_at: String,
}

/// `POST /api/profiles`
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(deny_unknown_fields)]
pub struct NewProfile {
    /// 1..=64 characters once trimmed; unique per owner.
    pub name: String,
}

/// `GET /api/profiles`: the owner's profiles, oldest first.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct ProfileList {
    pub profiles: Vec<Profile>,
}

/// What is stored for a card a profile has reviewed at least once (FSRS memory state and
/// counters).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(deny_unknown_fields)]
pub struct CardState {
    /// FSRS stability in days: the interval after which recall has dropped to 90%.
    pub stability: f32,
    /// FSRS difficulty, 1 (easy) ..= 10 (hard).
    pub difficulty: f32,
    /// When the card is next due.
    pub due: String,
    pub last_review: String,
    /// Reviews so far (>= 1).
    pub reps: u32,
    /// Times the card was forgotten (rated 1 or 2) after it had been reviewed before.
    pub lapses: u32,
    /// The 1..5 rating of the last review.
    pub last_rating: u8,
}

/// A reviewed card as `GET /api/profiles/{id}/review` shows it.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct CardView {
    #[serde(flatten)]
    pub state: CardState,
    /// The probability of recalling the card now (FSRS forgetting curve), 0..=1.
    pub retrievability: f32,
    /// Due now (`due` <= `now`).
    pub is_due: bool,
}

/// `GET /api/profiles/{id}/review`: the queue and the progress of one profile.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct ReviewView {
    pub profile: Profile,
    /// The server's time the view was computed at.
    pub now: String,
    /// Reviewed cards due now, most overdue first (ties in deck order).
    pub due: Vec<String>,
    /// Cards never reviewed, in deck order.
    pub new: Vec<String>,
    /// Today's queue: every due card (as in `due`), then new cards (in deck order) up to
    /// `NEW_PER_DAY` minus the new cards already first reviewed today (UTC).
    pub queue: Vec<String>,
    pub counts: ReviewCounts,
    /// One entry per topic of the deck, in topic order.
    pub topics: Vec<TopicProgress>,
    /// Every reviewed card of the deck, by card id.
    pub cards: BTreeMap<String, CardView>,
}

/// `due + new + learned == total` (cards of the current deck only).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct ReviewCounts {
    /// Reviewed cards due now.
    pub due: usize,
    /// Cards never reviewed.
    pub new: usize,
    /// Reviewed cards not due yet.
    pub learned: usize,
    /// Cards in the deck.
    pub total: usize,
    /// New cards first reviewed today (UTC); at most `NEW_PER_DAY` more are queued a day.
    pub new_today: usize,
    pub new_per_day: usize,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct TopicProgress {
    pub topic: u32,
    /// Cards of the topic.
    pub cards: usize,
    /// Of them, reviewed at least once.
    pub reviewed: usize,
    /// Of them, due now.
    pub due: usize,
    /// The mean probability of recall now over the topic's reviewed cards (null when none
    /// is reviewed).
    pub mean_retrievability: Option<f32>,
}

/// `POST /api/profiles/{id}/reviews`
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(deny_unknown_fields)]
pub struct ReviewRequest {
    pub card_id: String,
    /// 1 (not at all) ..= 5 (perfectly); see [`Grade::from_rating`].
    pub rating: i64,
}

/// The answer to a review: the card's new state.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct ReviewResult {
    pub card_id: String,
    pub rating: u8,
    pub grade: Grade,
    pub reviewed_at: String,
    /// Days from this review until the card is due (fractional: 0.2 is about 5 hours).
    pub interval_days: f32,
    pub state: CardView,
}

/// One review as logged (and exported): enough to replay a profile's history.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(deny_unknown_fields)]
pub struct LogEntry {
    pub card_id: String,
    pub rating: u8,
    pub reviewed_at: String,
    pub interval_days: f32,
}

/// A card's state in an export document.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(deny_unknown_fields)]
pub struct ExportedCard {
    pub card_id: String,
    pub stability: f32,
    pub difficulty: f32,
    pub due: String,
    pub last_review: String,
    pub reps: u32,
    pub lapses: u32,
    pub last_rating: u8,
}

impl ExportedCard {
    pub fn new(card_id: String, s: CardState) -> Self {
        Self {
            card_id,
            stability: s.stability,
            difficulty: s.difficulty,
            due: s.due,
            last_review: s.last_review,
            reps: s.reps,
            lapses: s.lapses,
            last_rating: s.last_rating,
        }
    }

    pub fn state(&self) -> CardState {
        CardState {
            stability: self.stability,
            difficulty: self.difficulty,
            due: self.due.clone(),
            last_review: self.last_review.clone(),
            reps: self.reps,
            lapses: self.lapses,
            last_rating: self.last_rating,
        }
    }
}

/// `GET /api/profiles/{id}/export`, and the body of `POST /api/profiles/{id}/import`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(deny_unknown_fields)]
pub struct ReviewExport {
    /// Always [`EXPORT_FORMAT`].
    pub format: String,
    /// The profile's name when exported (informational: an import keeps the target's name).
    pub profile: String,
    pub exported_at: String,
    /// Card states, in card id order.
    pub cards: Vec<ExportedCard>,
    /// Every review, oldest first.
    pub log: Vec<LogEntry>,
    /// The profile's desired retention and fitted FSRS parameters (absent in exports made
    /// before they were kept: an import of such a document leaves the target's settings).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub scheduling: Option<ExportedScheduling>,
}

/// A profile's scheduling settings in an export.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(deny_unknown_fields)]
pub struct ExportedScheduling {
    pub desired_retention: f32,
    /// FSRS's parameters fitted to the profile's log; None: the defaults.
    #[serde(default)]
    pub parameters: Option<Vec<f32>>,
    /// The fit that produced them (its before/after scores).
    #[serde(default)]
    pub fit: Option<ParameterFit>,
}

/// The answer to an import: what was stored, and what was skipped because its card is not
/// in the deck (any more).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct ImportResult {
    pub profile: Profile,
    /// Card states stored.
    pub cards: usize,
    /// Log entries stored.
    pub log: usize,
    /// Card ids (sorted, each once) of states and log entries that were skipped because the
    /// deck has no such card.
    pub skipped_card_ids: Vec<String>,
    pub skipped_cards: usize,
    pub skipped_log: usize,
}

/// `GET /api/profiles/{id}/settings`: how the profile's reviews are scheduled.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct ReviewSettings {
    pub desired_retention: f32,
    /// The FSRS parameters in use (the defaults until the profile's log has been fitted).
    pub parameters: Vec<f32>,
    /// The parameters are the profile's own, fitted to its log.
    pub fitted: bool,
    /// Repeat reviews (a day or more after the card's review before) in the profile's log,
    /// and how many a fit needs.
    pub repeat_reviews: usize,
    pub repeat_reviews_needed: usize,
    /// The latest fit, with the scores before and after it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub fit: Option<ParameterFit>,
}

/// `PUT /api/profiles/{id}/settings`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(deny_unknown_fields)]
pub struct NewReviewSettings {
    pub desired_retention: f32,
    /// Back to the default parameters (the fit is forgotten).
    #[serde(default)]
    pub default_parameters: bool,
}

/// `POST /api/profiles/{id}/fit`: FSRS's parameters fitted to the profile's log (the fsrs
/// crate's `compute_parameters`), each set scored on that log.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct ParameterFit {
    pub fitted_at: String,
    pub repeat_reviews: usize,
    pub before: FitScore,
    pub after: FitScore,
}

/// A parameter set and how well it predicted the log's recalls: log loss (lower is
/// better) and the RMSE between predicted and observed recall rates over bins.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct FitScore {
    pub parameters: Vec<f32>,
    pub log_loss: f32,
    pub rmse_bins: f32,
}

/// The desired retention, if it is one a profile may choose.
pub fn validate_retention(r: f32) -> Result<f32, FieldError> {
    if RETENTION_RANGE.contains(&r) {
        Ok(r)
    } else {
        Err(FieldError::new(
            "desired_retention",
            format!(
                "desired_retention must be from {} to {} (the probability of recalling a card when it comes \
                 back), got {r}",
                RETENTION_RANGE.start(),
                RETENTION_RANGE.end()
            ),
        ))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ratings_map_onto_fsrs_grades() {
        assert_eq!(Grade::from_rating(1), Ok(Grade::Again));
        assert_eq!(Grade::from_rating(2), Ok(Grade::Again));
        assert_eq!(Grade::from_rating(3), Ok(Grade::Hard));
        assert_eq!(Grade::from_rating(4), Ok(Grade::Good));
        assert_eq!(Grade::from_rating(5), Ok(Grade::Easy));
        for bad in [0, 6, -1, i64::MAX] {
            let e = Grade::from_rating(bad).unwrap_err();
            assert_eq!(e.field, "rating");
            assert!(e.message.contains("1 (not at all) to 5 (perfectly)"), "{e}");
            assert!(e.message.contains(&bad.to_string()), "{e}");
        }
        let fsrs: Vec<u32> = (1..=5).map(|r| Grade::from_rating(r).unwrap().fsrs_rating()).collect();
        assert_eq!(fsrs, [1, 1, 2, 3, 4]);
        assert!(Grade::Again.is_failure() && !Grade::Hard.is_failure());
        assert_eq!(serde_json::to_value(Grade::Again).unwrap(), "again");
    }

    #[test]
    fn profile_names_are_trimmed_and_bounded() {
        assert_eq!(validate_profile_name("  ada  ").unwrap(), "ada");
        assert!(validate_profile_name("   ").is_err());
        assert!(validate_profile_name("").is_err());
        assert_eq!(validate_profile_name(&"é".repeat(64)).unwrap().chars().count(), 64);
        assert!(validate_profile_name(&"é".repeat(65)).unwrap_err().message.contains("64"));
        assert!(validate_profile_name("a\nb").is_err());
    }

    #[test]
    fn card_view_flattens_the_state() {
        let view = CardView {
            state: CardState {
                stability: 2.3065,
                difficulty: 2.118104,
                due: "2025-01-03T07:00:00.000Z".into(),
                last_review: "2025-01-01T00:00:00.000Z".into(),
                reps: 1,
                lapses: 0,
                last_rating: 4,
            },
            retrievability: 1.0,
            is_due: false,
        };
        let json = serde_json::to_value(&view).unwrap();
        assert!(serde_json::to_string(&view).unwrap().contains(r#""stability":2.3065,"#));
        assert_eq!(json["reps"], 1);
        let back: CardView = serde_json::from_value(json).unwrap();
        assert_eq!(back, view);
    }
}
