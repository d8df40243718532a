//! A profile's scheduling settings: its desired retention, and FSRS's parameters fitted to
//! its own review log.
//!
//! - `GET  /api/profiles/{id}/settings`: the settings in use and whether a fit is possible.
//! - `PUT  /api/profiles/{id}/settings {"desired_retention", "default_parameters"?}`: 422
//!   outside `RETENTION_RANGE`; `default_parameters: true` forgets the fitted parameters.
//! - `POST /api/profiles/{id}/fit`: fits FSRS's 21 parameters to the log (the fsrs crate's
//!   `compute_parameters`), scores the parameters in use before and the fitted ones on the
//!   same log (log loss, binned RMSE), keeps the fitted ones and answers both. 409 while
//!   the log holds fewer than `MIN_REPEAT_REVIEWS` repeat reviews.
//!
//! The log becomes FSRS's training items card by card: a card reviewed n times gives n-1
//! items, each the card's reviews up to one of its repeats (FSRS grades, whole days since
//! the review before), the last one being the recall to predict.

use std::collections::BTreeMap;

use axum::extract::{Path, State};
use axum::{Extension, Json};
use distlab_common::review::*;

use crate::api::error::HttpError;
use crate::api::extract::JsonBody;
use crate::api::study::review::{load_profile, unprocessable};
use crate::api::study::schedule::whole_days_between;
use crate::clock::{self, parse_time};
use crate::store::accounts::Account;
use crate::{store, AppState};

/// A card's reviews beyond this many are left out of a fit (each review of a card makes an
/// item holding all its reviews before: the work grows with the square of their number).
pub const MAX_REVIEWS_PER_CARD: usize = 64;
/// A fit reads at most this many of the log's latest reviews.
pub const MAX_FIT_LOG: usize = 20_000;

/// The training items of a log (card id, deck rating 1..=5, review time), oldest first: for
/// each card, one item per review at least a day after the one before (FSRS predicts
/// long-term recall; a same-day repeat, such as a card rated "again" coming back hours
/// later, has nothing to predict), holding the card's reviews up to it. At most
/// `MAX_REVIEWS_PER_CARD` reviews of a card count.
pub fn training_items(log: &[(String, i64, String)]) -> Vec<fsrs::FSRSItem> {
    let mut by_card: BTreeMap<&str, Vec<fsrs::FSRSReview>> = BTreeMap::new();
    let mut last_seen: BTreeMap<&str, std::time::SystemTime> = BTreeMap::new();
    for (card, rating, at) in log {
        let (Ok(grade), Some(at)) = (Grade::from_rating(*rating), parse_time(at)) else { continue };
        let reviews = by_card.entry(card).or_default();
        if reviews.len() >= MAX_REVIEWS_PER_CARD {
            continue;
        }
        let days = last_seen.get(card.as_str()).map_or(0, |&before| whole_days_between(before, at));
        last_seen.insert(card, at);
        reviews.push(fsrs::FSRSReview { rating: grade.fsrs_rating(), delta_t: days });
    }
    by_card
        .into_values()
        .flat_map(|reviews| {
            (2..=reviews.len())
                .filter(|&n| reviews[n - 1].delta_t > 0)
                .map(|n| fsrs::FSRSItem { reviews: reviews[..n].to_vec() })
                .collect::<Vec<_>>()
        })
        .collect()
}

/// A parameter set's score on `items`.
fn score(parameters: &[f32], items: &[fsrs::FSRSItem]) -> Result<FitScore, String> {
    let model = fsrs::FSRS::new(parameters).map_err(|e| format!("FSRS parameters: {e}"))?;
    let eval = model.evaluate(items.to_vec(), |_| true).map_err(|e| format!("scoring: {e}"))?;
    Ok(FitScore { parameters: parameters.to_vec(), log_loss: eval.log_loss, rmse_bins: eval.rmse_bins })
}

/// Fits parameters to `items` and scores `before` and the fitted set on them (the same
/// reviews the fit saw: a fit that moves the parameters scores at least as well).
pub fn fit(before: &[f32], items: Vec<fsrs::FSRSItem>) -> Result<(FitScore, FitScore), String> {
    let before = score(before, &items)?;
    let input = fsrs::ComputeParametersInput { train_set: items.clone(), ..Default::default() };
    let fitted = fsrs::compute_parameters(input).map_err(|e| format!("fitting: {e}"))?;
    Ok((before, score(&fitted, &items)?))
}

/// One fit at a time: each is CPU work for a while.
static FITTING: tokio::sync::Semaphore = tokio::sync::Semaphore::const_new(1);

// ---------------------------------------------------------------------------------------
// Handlers

/// The settings in use, and how many repeat reviews a fit would see.
async fn settings_view(state: &AppState, profile_id: i64) -> Result<ReviewSettings, HttpError> {
    let stored = store::review::settings(&state.db, profile_id).await?;
    let repeat_reviews =
        training_items(&store::review::latest_reviews(&state.db, profile_id, MAX_FIT_LOG).await?).len();
    Ok(ReviewSettings {
        desired_retention: stored.desired_retention,
        fitted: stored.parameters.is_some(),
        parameters: stored.parameters.unwrap_or_else(|| fsrs::DEFAULT_PARAMETERS.to_vec()),
        repeat_reviews,
        repeat_reviews_needed: MIN_REPEAT_REVIEWS,
        fit: stored.fit,
    })
}

/// `GET /api/profiles/{id}/settings`
#[utoipa::path(
    get, path = "/profiles/{id}/settings", operation_id = "review_settings", tag = "flashcards",
    params(("id" = i64, Path, description = "the profile's id")),
    responses(
        (status = 200, body = distlab_common::review::ReviewSettings),
        (status = 404, body = distlab_common::ApiError),
    ),
)]
pub async fn settings(
    State(state): State<AppState>,
    Extension(owner): Extension<Account>,
    Path(raw_id): Path<String>,
) -> Result<Json<ReviewSettings>, HttpError> {
    let profile = load_profile(&state, &owner, &raw_id).await?;
    Ok(Json(settings_view(&state, profile.id).await?))
}

/// `PUT /api/profiles/{id}/settings`
#[utoipa::path(
    put, path = "/profiles/{id}/settings", operation_id = "update_review_settings", tag = "flashcards",
    params(("id" = i64, Path, description = "the profile's id")),
    request_body = distlab_common::review::NewReviewSettings,
    responses(
        (status = 200, body = distlab_common::review::ReviewSettings),
        (status = 404, body = distlab_common::ApiError),
        (status = 422, description = "names each field that is wrong", body = distlab_common::ApiError),
    ),
)]
pub async fn update(
    State(state): State<AppState>,
    Extension(owner): Extension<Account>,
    Path(raw_id): Path<String>,
    JsonBody(body): JsonBody<NewReviewSettings>,
) -> Result<Json<ReviewSettings>, HttpError> {
    let profile = load_profile(&state, &owner, &raw_id).await?;
    let retention = validate_retention(body.desired_retention).map_err(unprocessable)?;
    store::review::set_retention(&state.db, profile.id, retention, body.default_parameters).await?;
    Ok(Json(settings_view(&state, profile.id).await?))
}

/// `POST /api/profiles/{id}/fit`
#[utoipa::path(
    post, path = "/profiles/{id}/fit", tag = "flashcards",
    params(("id" = i64, Path, description = "the profile's id")),
    responses(
        (status = 200, body = distlab_common::review::ParameterFit),
        (status = 404, body = distlab_common::ApiError),
        (status = 409, description = "too few reviews to fit", body = distlab_common::ApiError),
    ),
)]
pub async fn fit_parameters(
    State(state): State<AppState>,
    Extension(owner): Extension<Account>,
    Path(raw_id): Path<String>,
) -> Result<Json<ParameterFit>, HttpError> {
    let profile = load_profile(&state, &owner, &raw_id).await?;
    let stored = store::review::settings(&state.db, profile.id).await?;
    let items = training_items(&store::review::latest_reviews(&state.db, profile.id, MAX_FIT_LOG).await?);
    if items.len() < MIN_REPEAT_REVIEWS {
        return Err(HttpError::conflict(format!(
            "a fit needs {MIN_REPEAT_REVIEWS} repeat reviews (reviews of a card seen before); this profile has {}",
            items.len()
        )));
    }
    let repeat_reviews = items.len();
    let before = stored.parameters.unwrap_or_else(|| fsrs::DEFAULT_PARAMETERS.to_vec());
    let _turn = FITTING.acquire().await.map_err(|e| HttpError::internal("fitting FSRS", e))?;
    // Training is CPU work for a while: off the async threads.
    let (before, after) = tokio::task::spawn_blocking(move || fit(&before, items))
        .await
        .map_err(|e| HttpError::internal("fitting FSRS", e))?
        .map_err(|e| HttpError::internal("fitting FSRS", e))?;
    let result = ParameterFit { fitted_at: clock::rfc3339(clock::now()), repeat_reviews, before, after };
    store::review::save_fit(&state.db, profile.id, &result).await?;
    tracing::info!(profile = profile.id, repeat_reviews, log_loss = result.after.log_loss, "FSRS parameters fitted");
    Ok(Json(result))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_card_reviewed_n_times_gives_n_minus_one_items_with_whole_days_between() {
        let log = vec![
            ("a".to_string(), 4, "2025-01-01T10:00:00.000Z".to_string()),
            ("b".to_string(), 1, "2025-01-01T11:00:00.000Z".to_string()),
            ("a".to_string(), 5, "2025-01-03T09:00:00.000Z".to_string()),
            ("a".to_string(), 2, "2025-01-10T10:00:00.000Z".to_string()),
            ("b".to_string(), 9, "2025-01-02T11:00:00.000Z".to_string()),
        ];
        let items = training_items(&log);
        // a: 3 reviews -> 2 items; b: its second review has no valid rating -> none.
        assert_eq!(items.len(), 2);
        let grades: Vec<(u32, u32)> = items[1].reviews.iter().map(|r| (r.rating, r.delta_t)).collect();
        // Good (4) at day 0, Easy (5) 1 day 23 h later, Again (2) 7 days 1 h after that.
        assert_eq!(grades, vec![(3, 0), (4, 1), (1, 7)]);
        assert_eq!(items[0].reviews.len(), 2);
        // A same-day repeat ("again", back hours later) is no item: nothing long-term to
        // predict (and FSRS's training needs a gap of a day or more in each item).
        let same_day = vec![
            ("c".to_string(), 1, "2025-01-01T10:00:00.000Z".to_string()),
            ("c".to_string(), 4, "2025-01-01T15:00:00.000Z".to_string()),
            ("c".to_string(), 4, "2025-01-04T15:00:00.000Z".to_string()),
        ];
        let items = training_items(&same_day);
        assert_eq!(items.len(), 1);
        assert_eq!(items[0].reviews.iter().map(|r| r.delta_t).collect::<Vec<_>>(), vec![0, 0, 3]);
        // At most MAX_REVIEWS_PER_CARD reviews of a card count.
        let many: Vec<_> = (0..200)
            .map(|d| ("d".to_string(), 4, format!("2025-{:02}-{:02}T10:00:00.000Z", 1 + d / 28, 1 + d % 28)))
            .collect();
        assert_eq!(training_items(&many).len(), MAX_REVIEWS_PER_CARD - 1);
    }

    #[test]
    fn a_log_with_same_day_repeats_fits_without_failing() {
        // 40 cards: each rated again, seen again 5 hours later, then days apart.
        let mut log = Vec::new();
        for card in 0..40 {
            let name = format!("card-{card}");
            for (day, hour, rating) in [(1, 10, 1), (1, 15, 3), (3, 10, 4), (9, 10, 4), (20, 10, 1), (22, 10, 4)] {
                log.push((name.clone(), rating, format!("2025-01-{day:02}T{hour:02}:{card:02}:00.000Z")));
            }
        }
        let items = training_items(&log);
        assert_eq!(items.len(), 40 * 4);
        let (before, after) = fit(&fsrs::DEFAULT_PARAMETERS, items).unwrap();
        assert!(after.log_loss <= before.log_loss, "{before:?} -> {after:?}");
    }
}
