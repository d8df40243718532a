//! Flashcard review: the `profiles` table (each account's profiles, with their scheduling
//! settings: desired retention, fitted FSRS parameters and the fit's scores), each
//! profile's card states (`card_reviews`) and its review log (`review_log`).

use distlab_common::review::{CardState, ExportedScheduling, LogEntry, ParameterFit, Profile};

use crate::store::{corrupt, Db, StoreError};

crate::store::row! {
    struct ProfileRow {
        id: i64,
        name: String,
        created_at: String,
    }
}

impl From<ProfileRow> for Profile {
    fn from(r: ProfileRow) -> Self {
        Profile { id: r.id, name: r.name, created_at: r.created_at }
    }
}

crate::store::row! {
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

crate::store::row! {
    struct LogRow {
        card_id: String,
        rating: i64,
        reviewed_at: String,
        interval_days: f64,
    }
}

const SELECT_STATE: &str =
    "SELECT card_id, stability, difficulty, due, last_review, reps, lapses, last_rating FROM card_reviews";

/// `owner`'s profiles, oldest first.
pub async fn profiles(db: &Db, owner: &str) -> Result<Vec<Profile>, StoreError> {
    let rows =
        sqlx::query_as::<_, ProfileRow>("SELECT id, name, created_at FROM profiles WHERE owner = $1 ORDER BY id")
            .bind(owner)
            .fetch_all(db)
            .await?;
    Ok(rows.into_iter().map(Profile::from).collect())
}

/// Profile `id` if `owner` owns it.
pub async fn profile(db: &Db, id: i64, owner: &str) -> Result<Option<Profile>, StoreError> {
    let row = sqlx::query_as::<_, ProfileRow>("SELECT id, name, created_at FROM profiles WHERE id = $1 AND owner = $2")
        .bind(id)
        .bind(owner)
        .fetch_optional(db)
        .await?;
    Ok(row.map(Profile::from))
}

/// How many profiles `owner` has.
pub async fn profile_count(db: &Db, owner: &str) -> Result<i64, StoreError> {
    Ok(sqlx::query_scalar("SELECT COUNT(*) FROM profiles WHERE owner = $1").bind(owner).fetch_one(db).await?)
}

/// A new profile of `owner`'s named `name`, made at `created_at`: its id, or None when
/// `owner` already has one of that name.
pub async fn create_profile(db: &Db, owner: &str, name: &str, created_at: &str) -> Result<Option<i64>, StoreError> {
    Ok(sqlx::query_scalar(
        "INSERT INTO profiles (owner, name, created_at) VALUES ($1, $2, $3) \
         ON CONFLICT (owner, name) DO NOTHING RETURNING id",
    )
    .bind(owner)
    .bind(name)
    .bind(created_at)
    .fetch_optional(db)
    .await?)
}

/// Every stored card state of a profile, by card id.
pub async fn states(db: &Db, profile_id: i64) -> Result<Vec<(String, CardState)>, StoreError> {
    let sql = format!("{SELECT_STATE} WHERE profile_id = $1 ORDER BY card_id");
    let rows = sqlx::query_as::<_, StateRow>(&sql).bind(profile_id).fetch_all(db).await?;
    Ok(rows.into_iter().map(StateRow::into_state).collect())
}

/// The stored state of card `card_id` in a profile (None: never reviewed).
pub async fn state(db: &Db, profile_id: i64, card_id: &str) -> Result<Option<CardState>, StoreError> {
    let sql = format!("{SELECT_STATE} WHERE profile_id = $1 AND card_id = $2");
    Ok(sqlx::query_as::<_, StateRow>(&sql)
        .bind(profile_id)
        .bind(card_id)
        .fetch_optional(db)
        .await?
        .map(|row| row.into_state().1))
}

/// The cards of a profile first reviewed at or after `since`.
pub async fn first_reviewed_since(db: &Db, profile_id: i64, since: &str) -> Result<Vec<String>, StoreError> {
    Ok(sqlx::query_scalar(
        "SELECT card_id FROM review_log WHERE profile_id = $1 GROUP BY card_id HAVING MIN(reviewed_at) >= $2",
    )
    .bind(profile_id)
    .bind(since)
    .fetch_all(db)
    .await?)
}

/// One review of a card: its state before (None: a new card) and after, the rating given
/// and the interval until it is due.
pub struct Review<'a> {
    pub profile_id: i64,
    pub card_id: &'a str,
    pub prev: Option<&'a CardState>,
    pub next: &'a CardState,
    pub rating: u8,
    pub interval: f32,
}

/// Stores a review: the card's new state and a line of the log, in one transaction; false
/// (nothing changed) when the card's state is no longer `prev` (another review of the same
/// card at the same moment).
pub async fn record(db: &Db, review: &Review<'_>) -> Result<bool, StoreError> {
    let Review { profile_id, card_id, prev, next, rating, interval } = *review;
    let mut tx = db.begin().await?;
    // The write is conditional on the state read before, so that two reviews of the same
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
    .bind(profile_id)
    .bind(card_id)
    .bind(f64::from(next.stability))
    .bind(f64::from(next.difficulty))
    .bind(&next.due)
    .bind(&next.last_review)
    .bind(i64::from(next.reps))
    .bind(i64::from(next.lapses))
    .bind(i64::from(rating))
    .bind(prev.map(|p| i64::from(p.reps)))
    .bind(prev.map(|p| p.last_review.clone()))
    .execute(&mut *tx)
    .await?
    .rows_affected();
    if written != 1 {
        return Ok(false);
    }
    sqlx::query(
        "INSERT INTO review_log (profile_id, card_id, rating, reviewed_at, interval_days) VALUES ($1, $2, $3, $4, $5)",
    )
    .bind(profile_id)
    .bind(card_id)
    .bind(i64::from(rating))
    .bind(&next.last_review)
    .bind(f64::from(interval))
    .execute(&mut *tx)
    .await?;
    tx.commit().await?;
    Ok(true)
}

/// A profile's whole review log, oldest first.
pub async fn log(db: &Db, profile_id: i64) -> Result<Vec<LogEntry>, StoreError> {
    Ok(sqlx::query_as::<_, LogRow>(
        "SELECT card_id, rating, reviewed_at, interval_days FROM review_log WHERE profile_id = $1 \
         ORDER BY reviewed_at, id",
    )
    .bind(profile_id)
    .fetch_all(db)
    .await?
    .into_iter()
    .map(|r| LogEntry {
        card_id: r.card_id,
        rating: u8::try_from(r.rating).unwrap_or(0),
        reviewed_at: r.reviewed_at,
        interval_days: r.interval_days as f32,
    })
    .collect())
}

/// The latest `limit` reviews of a profile (card id, rating, review time), oldest first.
pub async fn latest_reviews(db: &Db, profile_id: i64, limit: usize) -> Result<Vec<(String, i64, String)>, StoreError> {
    let mut log: Vec<(String, i64, String)> = sqlx::query_as(
        "SELECT card_id, rating, reviewed_at FROM review_log WHERE profile_id = $1 \
         ORDER BY reviewed_at DESC, id DESC LIMIT $2",
    )
    .bind(profile_id)
    .bind(limit as i64)
    .fetch_all(db)
    .await?;
    log.reverse();
    Ok(log)
}

/// Replaces a profile's card states and log (and, when given, its scheduling settings), in
/// one transaction.
pub async fn replace(
    db: &Db,
    profile_id: i64,
    cards: &[(String, CardState)],
    log: &[LogEntry],
    scheduling: Option<&ExportedScheduling>,
) -> Result<(), StoreError> {
    let mut tx = db.begin().await?;
    sqlx::query("DELETE FROM card_reviews WHERE profile_id = $1").bind(profile_id).execute(&mut *tx).await?;
    sqlx::query("DELETE FROM review_log WHERE profile_id = $1").bind(profile_id).execute(&mut *tx).await?;
    for (card_id, s) in cards {
        sqlx::query(
            "INSERT INTO card_reviews \
               (profile_id, card_id, stability, difficulty, due, last_review, reps, lapses, last_rating) \
             VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9)",
        )
        .bind(profile_id)
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
    for e in log {
        sqlx::query(
            "INSERT INTO review_log (profile_id, card_id, rating, reviewed_at, interval_days) \
             VALUES ($1, $2, $3, $4, $5)",
        )
        .bind(profile_id)
        .bind(&e.card_id)
        .bind(i64::from(e.rating))
        .bind(&e.reviewed_at)
        .bind(f64::from(e.interval_days))
        .execute(&mut *tx)
        .await?;
    }
    if let Some(scheduling) = scheduling {
        store_settings(&mut tx, profile_id, scheduling).await?;
    }
    tx.commit().await?;
    Ok(())
}

/// A profile's scheduling columns.
pub struct ProfileSettings {
    pub desired_retention: f32,
    pub parameters: Option<Vec<f32>>,
    pub fit: Option<ParameterFit>,
}

/// Profile `profile_id`'s scheduling settings.
pub async fn settings(db: &Db, profile_id: i64) -> Result<ProfileSettings, StoreError> {
    let (retention, parameters, fit): (f64, Option<String>, Option<String>) =
        sqlx::query_as("SELECT desired_retention, parameters, fit FROM profiles WHERE id = $1")
            .bind(profile_id)
            .fetch_one(db)
            .await?;
    let corrupt = |e: serde_json::Error| corrupt("a profile's settings", e);
    Ok(ProfileSettings {
        desired_retention: retention as f32,
        parameters: parameters.map(|t| serde_json::from_str(&t)).transpose().map_err(corrupt)?,
        fit: fit.map(|t| serde_json::from_str(&t)).transpose().map_err(corrupt)?,
    })
}

/// An import's scheduling settings, in the import's transaction (parameters without a
/// fit are kept; a fit without parameters is not).
async fn store_settings(
    tx: &mut sqlx::Transaction<'_, sqlx::Any>,
    profile_id: i64,
    settings: &ExportedScheduling,
) -> Result<(), StoreError> {
    let corrupt = |e: serde_json::Error| corrupt("imported settings", e);
    let parameters = settings.parameters.as_ref().map(serde_json::to_string).transpose().map_err(corrupt)?;
    let fit = match &parameters {
        Some(_) => settings.fit.as_ref().map(serde_json::to_string).transpose().map_err(corrupt)?,
        None => None,
    };
    sqlx::query("UPDATE profiles SET desired_retention = $2, parameters = $3, fit = $4 WHERE id = $1")
        .bind(profile_id)
        .bind(stored_retention(settings.desired_retention))
        .bind(parameters)
        .bind(fit)
        .execute(&mut **tx)
        .await?;
    Ok(())
}

/// Sets a profile's desired retention; with `default_parameters`, forgets its fitted
/// parameters (and their fit) too.
pub async fn set_retention(
    db: &Db,
    profile_id: i64,
    retention: f32,
    default_parameters: bool,
) -> Result<(), StoreError> {
    let sql = if default_parameters {
        "UPDATE profiles SET desired_retention = $2, parameters = NULL, fit = NULL WHERE id = $1"
    } else {
        "UPDATE profiles SET desired_retention = $2 WHERE id = $1"
    };
    sqlx::query(sql).bind(profile_id).bind(stored_retention(retention)).execute(db).await?;
    Ok(())
}

/// Keeps a fit: its fitted parameters become the profile's.
pub async fn save_fit(db: &Db, profile_id: i64, fit: &ParameterFit) -> Result<(), StoreError> {
    let parameters = serde_json::to_string(&fit.after.parameters).map_err(|e| corrupt("fit", e))?;
    let fit_json = serde_json::to_string(fit).map_err(|e| corrupt("fit", e))?;
    sqlx::query("UPDATE profiles SET parameters = $2, fit = $3 WHERE id = $1")
        .bind(profile_id)
        .bind(parameters)
        .bind(fit_json)
        .execute(db)
        .await?;
    Ok(())
}

/// Stored to 4 decimals: the f32 0.97 is a little above 0.97 as a double, which the
/// table's check would refuse.
fn stored_retention(r: f32) -> f64 {
    (f64::from(r) * 1e4).round() / 1e4
}
