//! The quiz, and each account's results.
//!
//! - `GET  /api/quiz`: the questions (`cards/quiz.json`, built in and checked when the server
//!   starts, against the deck too), answers included: the quiz is practice, not an exam.
//! - `POST /api/quiz/answers {"question_id", "given"? | "knew"?}`: a numeric question is
//!   graded from the number typed (`given`, within its tolerance); any other from the
//!   learner's own verdict after the reveal (`knew`). Answers the verdict and keeps it.
//! - `GET  /api/quiz/results`: the asking account's results, one per question answered.

use std::sync::LazyLock;

use axum::extract::State;
use axum::{Extension, Json};
use distlab_common::quiz::{load_quiz, Question, QuizAnswer, QuizResults, QuizVerdict};
use distlab_common::FieldError;

use crate::api::error::HttpError;
use crate::api::extract::JsonBody;
use crate::api::study::cards;
use crate::api::study::review::unprocessable;
use crate::store::accounts::Account;
use crate::text::truncate;
use crate::{clock, store, AppState};

const QUIZ_JSON: &str = include_str!("../../../../cards/quiz.json");

static QUIZ: LazyLock<Result<Vec<Question>, String>> = LazyLock::new(|| {
    let deck = cards::deck()?;
    load_quiz(QUIZ_JSON, deck).map_err(|problems| format!("the quiz is broken: {}", problems.join("; ")))
});

/// The quiz, or every problem found in it.
pub fn quiz() -> Result<&'static [Question], String> {
    QUIZ.as_deref().map_err(Clone::clone)
}

fn questions() -> Result<&'static [Question], HttpError> {
    quiz().map_err(|e| HttpError::internal("quiz", e))
}

/// `GET /api/quiz`.
#[utoipa::path(
    get, path = "/quiz", operation_id = "list_quiz_questions", tag = "flashcards",
    responses(
        (status = 200, body = Vec<distlab_common::quiz::Question>),
    ),
)]
pub async fn list() -> Result<Json<&'static [Question]>, HttpError> {
    questions().map(Json)
}

/// `POST /api/quiz/answers`: 404 for a question that does not exist, 422 for an answer of
/// the wrong kind (no number for a numeric question, a number for another, or neither).
#[utoipa::path(
    post, path = "/quiz/answers", operation_id = "answer_quiz", tag = "flashcards",
    request_body = distlab_common::quiz::QuizAnswer,
    responses(
        (status = 200, body = distlab_common::quiz::QuizVerdict),
        (status = 422, description = "names each field that is wrong", body = distlab_common::ApiError),
    ),
)]
pub async fn answer(
    State(state): State<AppState>,
    Extension(owner): Extension<Account>,
    JsonBody(body): JsonBody<QuizAnswer>,
) -> Result<Json<QuizVerdict>, HttpError> {
    let question = questions()?
        .iter()
        .find(|q| q.id == body.question_id)
        .ok_or_else(|| HttpError::not_found(format!("no quiz question '{}'", truncate(&body.question_id, 80))))?;
    let correct = match (&question.expect, body.given, body.knew) {
        (Some(expect), Some(given), None) if given.is_finite() => expect.accepts(given),
        (Some(expect), _, _) => {
            return Err(unprocessable(FieldError::new(
                "given",
                format!("question {} asks for a number (in {})", question.number, expect.unit),
            )))
        }
        (None, None, Some(knew)) => knew,
        (None, _, _) => {
            return Err(unprocessable(FieldError::new(
                "knew",
                format!("question {} is graded by you: say whether you knew it (knew: true or false)", question.number),
            )))
        }
    };
    let given = body.given.filter(|_| question.expect.is_some());
    store::quiz::record(&state.db, &owner.name, &question.id, correct, given, clock::now()).await?;
    Ok(Json(QuizVerdict {
        question_id: question.id.clone(),
        correct,
        expected: question.expect.as_ref().map(|e| e.value),
    }))
}

/// `GET /api/quiz/results`: the asking account's, in the quiz's order.
#[utoipa::path(
    get, path = "/quiz/results", operation_id = "quiz_results", tag = "flashcards",
    responses(
        (status = 200, body = distlab_common::quiz::QuizResults),
    ),
)]
pub async fn results(
    State(state): State<AppState>,
    Extension(owner): Extension<Account>,
) -> Result<Json<QuizResults>, HttpError> {
    let mut results = store::quiz::results(&state.db, &owner.name).await?;
    let order = |id: &str| questions().ok().and_then(|qs| qs.iter().position(|q| q.id == id)).unwrap_or(usize::MAX);
    results.sort_by_key(|r| order(&r.question_id));
    Ok(Json(QuizResults { results }))
}
