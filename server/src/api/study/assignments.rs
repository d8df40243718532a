//! Assignments: a teacher's exercises whose answers the students' own runs check
//! (`distlab_common::assignments`).
//!
//! - `POST /api/assignments` (admins): a new assignment; 201 with it.
//! - `GET  /api/assignments`: every assignment, newest first.
//! - `GET  /api/assignments/{id}`: one, its instructions as safe HTML (`markdown.rs`), with
//!   the submissions the caller may see (their own; an admin every one, and the students who
//!   have none), each answer with its verdict.
//! - `POST /api/assignments/{id}/submissions`: a run of the assignment's spec (only its
//!   editable fields changed) and the answers; the run is queued as the caller's experiment
//!   under the same checks and quotas as any other. Every submission is kept.
//! - `PUT  /api/assignments/{id}/submissions/{submission}/grade` (admins): the teacher's
//!   verdict on a text answer.
//! - `GET  /api/assignments/{id}/grades.csv` (admins): the gradebook, one line per student.

use axum::extract::{Path, State};
use axum::http::{header, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::{Extension, Json};
use distlab_common::assignments::{
    answer_problems, disallowed_changes, grade_problems, verdicts, Assignment, AssignmentView, NewAssignment,
    NewSubmission, Quantity, QuestionKind, Submission, TextGrade, VerdictState,
};
use distlab_common::{compare, planner, ExperimentStatus, FieldError};

use crate::api::compare::traced_steps;
use crate::api::error::HttpError;
use crate::api::experiments;
use crate::api::extract::JsonBody;
use crate::store::accounts::Account;
use crate::store::assignments::StoredSubmission;
use crate::text::truncate;
use crate::{clock, markdown, store, AppState};

fn require_teacher(caller: &Account, what: &str) -> Result<(), HttpError> {
    if caller.admin {
        Ok(())
    } else {
        Err(HttpError::forbidden(format!("only an admin (a teacher) may {what}")))
    }
}

fn parse_assignment_id(raw: &str) -> Result<i64, HttpError> {
    match raw.parse::<i64>() {
        Ok(id) if id > 0 => Ok(id),
        _ => Err(HttpError::not_found(format!(
            "no assignment with id '{}' (ids are positive integers)",
            truncate(raw, 40)
        ))),
    }
}

async fn load(state: &AppState, raw_id: &str) -> Result<Assignment, HttpError> {
    let id = parse_assignment_id(raw_id)?;
    store::assignments::load(&state.db, id).await?.ok_or_else(|| HttpError::not_found(format!("no assignment {id}")))
}

fn unprocessable(problems: Vec<FieldError>) -> HttpError {
    let error = match problems.len() {
        1 => format!("the request is invalid: {}", problems[0]),
        n => format!("the request has {n} problems"),
    };
    HttpError::with_fields(StatusCode::UNPROCESSABLE_ENTITY, error, problems)
}

/// `POST /api/assignments`: 403 for a student, 422 naming every problem.
#[utoipa::path(
    post, path = "/assignments", operation_id = "create_assignment", tag = "assignments",
    request_body = distlab_common::assignments::NewAssignment,
    responses(
        (status = 201, body = distlab_common::assignments::Assignment),
        (status = 403, description = "not an admin", body = distlab_common::ApiError),
        (status = 422, description = "names each field that is wrong", body = distlab_common::ApiError),
    ),
)]
pub async fn create(
    State(state): State<AppState>,
    Extension(caller): Extension<Account>,
    JsonBody(body): JsonBody<NewAssignment>,
) -> Result<Response, HttpError> {
    require_teacher(&caller, "write an assignment")?;
    let mut problems = body.problems();
    if body.due.as_deref().is_some_and(|due| clock::parse_time(due).is_none())
        && problems.iter().all(|p| p.field != "due")
    {
        problems.push(FieldError::new("due", "an RFC3339 time between 1970 and 2999"));
    }
    let spec_problems = body.spec.validate(&state.config.limits).err().unwrap_or_default();
    problems.extend(spec_problems.into_iter().map(|e| FieldError::new(format!("spec.{}", e.field), e.message)));
    if !problems.is_empty() {
        return Err(unprocessable(problems));
    }
    let now = clock::now();
    let id = store::assignments::create(&state.db, &caller.name, &body, now).await?;
    tracing::info!(assignment = id, by = %caller.name, "assignment created");
    let created = Assignment { id, created_by: caller.name, created_at: clock::rfc3339(now), content: body };
    Ok((StatusCode::CREATED, [(header::LOCATION, format!("/api/assignments/{id}"))], Json(created)).into_response())
}

/// `GET /api/assignments`.
#[utoipa::path(
    get, path = "/assignments", operation_id = "list_assignments", tag = "assignments",
    responses((status = 200, body = Vec<distlab_common::assignments::Assignment>)),
)]
pub async fn list(State(state): State<AppState>) -> Result<Json<Vec<Assignment>>, HttpError> {
    Ok(Json(store::assignments::list(&state.db).await?))
}

/// `GET /api/assignments/{id}`.
#[utoipa::path(
    get, path = "/assignments/{id}", operation_id = "get_assignment", tag = "assignments",
    params(("id" = i64, Path, description = "the assignment's id")),
    responses(
        (status = 200, body = distlab_common::assignments::AssignmentView),
        (status = 404, body = distlab_common::ApiError),
    ),
)]
pub async fn get_one(
    State(state): State<AppState>,
    Extension(caller): Extension<Account>,
    Path(raw_id): Path<String>,
) -> Result<Json<AssignmentView>, HttpError> {
    let assignment = load(&state, &raw_id).await?;
    let whose = (!caller.admin).then_some(caller.name.as_str());
    let stored = store::assignments::submissions(&state.db, assignment.id, whose).await?;
    let mut submissions = Vec::with_capacity(stored.len());
    for s in stored {
        submissions.push(judge(&state, &assignment, s).await?);
    }
    let not_submitted = if caller.admin { not_submitted(&state, &submissions).await? } else { Vec::new() };
    let instructions_html = markdown::to_safe_html(&assignment.content.instructions);
    Ok(Json(AssignmentView { assignment, instructions_html, submissions, not_submitted }))
}

/// The accounts that are not admins and have submitted nothing.
async fn not_submitted(state: &AppState, submissions: &[Submission]) -> Result<Vec<String>, HttpError> {
    let accounts = store::accounts::list(&state.db).await?;
    Ok(accounts
        .into_iter()
        .filter(|a| !a.admin && submissions.iter().all(|s| s.student != a.name))
        .map(|a| a.name)
        .collect())
}

/// A stored submission with its run's status and each answer's verdict.
async fn judge(state: &AppState, assignment: &Assignment, s: StoredSubmission) -> Result<Submission, HttpError> {
    let experiment = store::experiments::load(&state.db, s.experiment_id).await?;
    let questions = &assignment.content.questions;
    let (status, verdicts) = match &experiment {
        // The run was deleted: nothing left to measure.
        None => (
            ExperimentStatus::Cancelled,
            verdicts(questions, &s.answers, &s.grades, ExperimentStatus::Cancelled, |_| None),
        ),
        Some(view) if !view.status.is_finished() => {
            (view.status, verdicts(questions, &s.answers, &s.grades, view.status, |_| None))
        }
        Some(view) => {
            let metrics = store::experiments::load_metrics(&state.db, view.id).await?;
            let ranks = store::traces::load(&state.db, view.id).await?;
            let traced = traced_steps(state, view).await?;
            let plan = planner::plan(&view.spec).ok();
            let stats = compare::run_stats(view, &metrics, &ranks, traced, plan.as_ref());
            let val_loss = metrics.iter().rev().find_map(|p| p.val_loss);
            let measure = |q: Quantity| q.of(&stats, val_loss);
            (view.status, verdicts(questions, &s.answers, &s.grades, view.status, measure))
        }
    };
    Ok(Submission {
        id: s.id,
        assignment_id: assignment.id,
        student: s.student,
        experiment_id: s.experiment_id,
        submitted_at: s.submitted_at,
        late: s.late,
        status,
        answers: s.answers,
        verdicts,
    })
}

/// `POST /api/assignments/{id}/submissions`: 422 for a run that changes a fixed field or an
/// answer that does not fit its question; the experiment's own checks and quotas as
/// `POST /api/experiments` (422, 429, 507).
#[utoipa::path(
    post, path = "/assignments/{id}/submissions", operation_id = "submit_assignment", tag = "assignments",
    params(("id" = i64, Path, description = "the assignment's id")),
    request_body = distlab_common::assignments::NewSubmission,
    responses(
        (status = 201, body = distlab_common::assignments::Submission),
        (status = 404, body = distlab_common::ApiError),
        (status = 422, description = "names each field that is wrong", body = distlab_common::ApiError),
    ),
)]
pub async fn submit(
    State(state): State<AppState>,
    Extension(caller): Extension<Account>,
    Path(raw_id): Path<String>,
    JsonBody(body): JsonBody<NewSubmission>,
) -> Result<Response, HttpError> {
    let assignment = load(&state, &raw_id).await?;
    let content = &assignment.content;
    let mut problems = disallowed_changes(&content.spec, &body.spec, &content.editable);
    problems.extend(answer_problems(&content.questions, &body.answers));
    if !problems.is_empty() {
        return Err(unprocessable(problems));
    }
    let created = experiments::submit(&state, &caller, body.spec, None).await?;
    let now = clock::now();
    let late = content.due.as_deref().and_then(clock::parse_time).is_some_and(|due| now > due);
    let stored =
        store::assignments::submit(&state.db, assignment.id, &caller.name, created.id, &body.answers, late, now)
            .await?;
    tracing::info!(assignment = assignment.id, student = %caller.name, experiment = created.id, "assignment submitted");
    let submission = judge(&state, &assignment, stored).await?;
    let location = format!("/api/assignments/{}", assignment.id);
    Ok((StatusCode::CREATED, [(header::LOCATION, location)], Json(submission)).into_response())
}

/// `PUT /api/assignments/{id}/submissions/{submission}/grade` (admins): 200 with the
/// submission as judged now; 422 for a question a run checks or one not answered.
#[utoipa::path(
    put, path = "/assignments/{id}/submissions/{submission}/grade", operation_id = "grade_answer", tag = "assignments",
    params(
        ("id" = i64, Path, description = "the assignment's id"),
        ("submission" = i64, Path, description = "the submission's id"),
    ),
    request_body = distlab_common::assignments::TextGrade,
    responses(
        (status = 200, body = distlab_common::assignments::Submission),
        (status = 403, description = "not an admin", body = distlab_common::ApiError),
        (status = 404, body = distlab_common::ApiError),
        (status = 422, description = "not a text answer", body = distlab_common::ApiError),
    ),
)]
pub async fn grade(
    State(state): State<AppState>,
    Extension(caller): Extension<Account>,
    Path((raw_id, raw_submission)): Path<(String, String)>,
    JsonBody(body): JsonBody<TextGrade>,
) -> Result<Json<Submission>, HttpError> {
    require_teacher(&caller, "grade an answer")?;
    let assignment = load(&state, &raw_id).await?;
    let not_found = || {
        HttpError::not_found(format!(
            "assignment {} has no submission '{}'",
            assignment.id,
            truncate(&raw_submission, 40)
        ))
    };
    let submission_id = raw_submission.parse::<i64>().ok().filter(|id| *id > 0).ok_or_else(not_found)?;
    let mut stored =
        store::assignments::submission(&state.db, assignment.id, submission_id).await?.ok_or_else(not_found)?;
    let problems = grade_problems(&assignment.content.questions, &stored.answers, &body);
    if !problems.is_empty() {
        return Err(unprocessable(problems));
    }
    store::assignments::grade(&state.db, submission_id, body, &caller.name, clock::now()).await?;
    tracing::info!(assignment = assignment.id, submission = submission_id, by = %caller.name, "answer graded");
    // As stored now: this grade replaces an earlier one of the same answer.
    stored.grades.retain(|g| g.question != body.question);
    stored.grades.push(body);
    Ok(Json(judge(&state, &assignment, stored).await?))
}

/// `GET /api/assignments/{id}/grades.csv` (admins): per student, their latest submission's
/// run, status and each answer's verdict (right, wrong, pending, missing, not_measured,
/// to_grade), the score (answers right, over the questions a run checks and the text
/// answers the teacher has graded), and a line
/// with empty cells for each student without a submission.
#[utoipa::path(
    get, path = "/assignments/{id}/grades.csv", operation_id = "assignment_grades", tag = "assignments",
    params(("id" = i64, Path, description = "the assignment's id")),
    responses(
        (status = 200, description = "text/csv", body = String),
        (status = 403, body = distlab_common::ApiError),
        (status = 404, body = distlab_common::ApiError),
    ),
)]
pub async fn grades(
    State(state): State<AppState>,
    Extension(caller): Extension<Account>,
    Path(raw_id): Path<String>,
) -> Result<Response, HttpError> {
    require_teacher(&caller, "download the grades")?;
    let assignment = load(&state, &raw_id).await?;
    let stored = store::assignments::submissions(&state.db, assignment.id, None).await?;
    let mut latest: Vec<Submission> = Vec::new();
    for s in stored {
        // Newest first: the first seen of each student is their latest.
        if latest.iter().all(|l| l.student != s.student) {
            latest.push(judge(&state, &assignment, s).await?);
        }
    }
    latest.sort_by(|a, b| a.student.cmp(&b.student));
    let missing = not_submitted(&state, &latest).await?;
    let body = grades_csv(&assignment, &latest, &missing);
    let disposition = format!("attachment; filename=\"distlab-assignment-{}-grades.csv\"", assignment.id);
    Ok((
        [(header::CONTENT_TYPE, "text/csv; charset=utf-8".to_string()), (header::CONTENT_DISPOSITION, disposition)],
        body,
    )
        .into_response())
}

/// A CSV field: quoted when it holds a comma, a quote or a line break; a leading `=`, `+`,
/// `-` or `@` is prefixed with a quote so that a spreadsheet does not run it as a formula.
fn csv_field(text: &str) -> String {
    let text = if text.starts_with(['=', '+', '-', '@']) { format!("'{text}") } else { text.to_string() };
    if text.contains([',', '"', '\n', '\r']) {
        format!("\"{}\"", text.replace('"', "\"\""))
    } else {
        text
    }
}

fn grades_csv(assignment: &Assignment, latest: &[Submission], missing: &[String]) -> String {
    let questions = assignment.content.questions.len();
    let checked = assignment.content.questions.iter().filter(|q| !matches!(q.answer, QuestionKind::Text)).count();
    let mut out = String::from("student,submitted_at,late,experiment_id,status");
    for i in 0..questions {
        out.push_str(&format!(",q{}", i + 1));
    }
    out.push_str(",right,checked\n");
    for s in latest {
        out.push_str(&format!(
            "{},{},{},{},{}",
            csv_field(&s.student),
            s.submitted_at,
            s.late,
            s.experiment_id,
            s.status.as_str()
        ));
        for v in &s.verdicts {
            out.push(',');
            out.push_str(v.state.as_str());
        }
        let right = s.verdicts.iter().filter(|v| v.state == VerdictState::Right).count();
        let graded = s.verdicts.iter().zip(&assignment.content.questions).filter(|(v, q)| {
            matches!(q.answer, QuestionKind::Text) && matches!(v.state, VerdictState::Right | VerdictState::Wrong)
        });
        out.push_str(&format!(",{right},{}\n", checked + graded.count()));
    }
    for name in missing {
        out.push_str(&csv_field(name));
        out.push_str(&",".repeat(4 + questions + 2));
        out.push('\n');
    }
    out
}
