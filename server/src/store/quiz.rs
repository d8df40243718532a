//! Quiz results: the `quiz_results` table, one row per account and question (attempts,
//! how many were right, the last answer).

use std::time::SystemTime;

use distlab_common::quiz::QuestionResult;

use crate::clock;
use crate::store::{self as db, Db, StoreError};

/// Records `owner`'s answer to question `question_id` at `now`: right or not, and the number
/// given, if any.
pub async fn record(
    db: &Db,
    owner: &str,
    question_id: &str,
    correct: bool,
    given: Option<f64>,
    now: SystemTime,
) -> Result<(), StoreError> {
    db::query_with_nullable_floats(
        "INSERT INTO quiz_results (owner, question_id, attempts, correct, last_correct, last_given, answered_at) \
         VALUES ($1, $2, 1, $3, $3, $4, $5) \
         ON CONFLICT (owner, question_id) DO UPDATE SET attempts = quiz_results.attempts + 1, \
           correct = quiz_results.correct + excluded.correct, last_correct = excluded.last_correct, \
           last_given = excluded.last_given, answered_at = excluded.answered_at",
    )
    .bind(owner)
    .bind(question_id)
    .bind(i64::from(correct))
    .bind(given)
    .bind(clock::rfc3339(now))
    .execute(db)
    .await?;
    Ok(())
}

crate::store::row! {
    struct ResultRow {
        question_id: String,
        attempts: i64,
        correct: i64,
        last_correct: i64,
        last_given: Option<f64>,
        answered_at: String,
    }
}

/// `owner`'s results, one per question answered.
pub async fn results(db: &Db, owner: &str) -> Result<Vec<QuestionResult>, StoreError> {
    let rows = sqlx::query_as::<_, ResultRow>(
        "SELECT question_id, attempts, correct, last_correct, last_given, answered_at FROM quiz_results \
         WHERE owner = $1",
    )
    .bind(owner)
    .fetch_all(db)
    .await?;
    Ok(rows
        .into_iter()
        .map(|r| QuestionResult {
            question_id: r.question_id,
            attempts: u64::try_from(r.attempts).unwrap_or(0),
            correct: u64::try_from(r.correct).unwrap_or(0),
            last_correct: r.last_correct != 0,
            last_given: r.last_given,
            answered_at: r.answered_at,
        })
        .collect())
}
