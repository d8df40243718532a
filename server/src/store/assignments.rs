//! Assignments and their submissions: the `assignments` table (each assignment's content as
//! JSON) and `assignment_submissions` (a student's run and answers; every one kept).

use std::time::SystemTime;

use distlab_common::assignments::{Assignment, GivenAnswer, NewAssignment};

use crate::clock;
use crate::store::{corrupt, Db, StoreError};

/// Stores `content` as written by `created_by` at `now`; answers its id.
pub async fn create(db: &Db, created_by: &str, content: &NewAssignment, now: SystemTime) -> Result<i64, StoreError> {
    let json = serde_json::to_string(content).map_err(|e| corrupt("assignment", e))?;
    Ok(sqlx::query_scalar(
        "INSERT INTO assignments (title, created_by, created_at, content) VALUES ($1, $2, $3, $4) RETURNING id",
    )
    .bind(&content.title)
    .bind(created_by)
    .bind(clock::rfc3339(now))
    .bind(json)
    .fetch_one(db)
    .await?)
}

#[derive(sqlx::FromRow)]
struct AssignmentRow {
    id: i64,
    created_by: String,
    created_at: String,
    content: String,
}

impl AssignmentRow {
    fn into_assignment(self) -> Result<Assignment, StoreError> {
        let content = serde_json::from_str(&self.content)
            .map_err(|e| corrupt("stored assignment", format!("assignment {}: {e}", self.id)))?;
        Ok(Assignment { id: self.id, created_by: self.created_by, created_at: self.created_at, content })
    }
}

/// Every assignment, newest first.
pub async fn list(db: &Db) -> Result<Vec<Assignment>, StoreError> {
    let rows: Vec<AssignmentRow> =
        sqlx::query_as("SELECT id, created_by, created_at, content FROM assignments ORDER BY id DESC")
            .fetch_all(db)
            .await?;
    rows.into_iter().map(AssignmentRow::into_assignment).collect()
}

/// Assignment `id`, if there is one.
pub async fn load(db: &Db, id: i64) -> Result<Option<Assignment>, StoreError> {
    let row: Option<AssignmentRow> =
        sqlx::query_as("SELECT id, created_by, created_at, content FROM assignments WHERE id = $1")
            .bind(id)
            .fetch_optional(db)
            .await?;
    row.map(AssignmentRow::into_assignment).transpose()
}

/// A submission as stored (its verdicts are computed from its run when it is shown).
pub struct StoredSubmission {
    pub id: i64,
    pub student: String,
    pub experiment_id: i64,
    pub answers: Vec<GivenAnswer>,
    pub late: bool,
    pub submitted_at: String,
}

/// Keeps `student`'s submission to assignment `assignment_id`: run `experiment_id` and
/// `answers`; answers its id.
pub async fn submit(
    db: &Db,
    assignment_id: i64,
    student: &str,
    experiment_id: i64,
    answers: &[GivenAnswer],
    late: bool,
    now: SystemTime,
) -> Result<StoredSubmission, StoreError> {
    let json = serde_json::to_string(answers).map_err(|e| corrupt("answers", e))?;
    let submitted_at = clock::rfc3339(now);
    let id = sqlx::query_scalar(
        "INSERT INTO assignment_submissions (assignment_id, student, experiment_id, answers, late, submitted_at) \
         VALUES ($1, $2, $3, $4, $5, $6) RETURNING id",
    )
    .bind(assignment_id)
    .bind(student)
    .bind(experiment_id)
    .bind(json)
    .bind(i64::from(late))
    .bind(&submitted_at)
    .fetch_one(db)
    .await?;
    Ok(StoredSubmission {
        id,
        student: student.to_string(),
        experiment_id,
        answers: answers.to_vec(),
        late,
        submitted_at,
    })
}

#[derive(sqlx::FromRow)]
struct SubmissionRow {
    id: i64,
    student: String,
    experiment_id: i64,
    answers: String,
    late: i64,
    submitted_at: String,
}

/// Assignment `assignment_id`'s submissions, newest first: `student`'s only, or everyone's.
pub async fn submissions(
    db: &Db,
    assignment_id: i64,
    student: Option<&str>,
) -> Result<Vec<StoredSubmission>, StoreError> {
    let rows: Vec<SubmissionRow> = sqlx::query_as(
        "SELECT id, student, experiment_id, answers, late, submitted_at FROM assignment_submissions \
         WHERE assignment_id = $1 AND ($2 = '' OR student = $2) ORDER BY id DESC",
    )
    .bind(assignment_id)
    .bind(student.unwrap_or(""))
    .fetch_all(db)
    .await?;
    rows.into_iter()
        .map(|r| {
            let answers = serde_json::from_str(&r.answers)
                .map_err(|e| corrupt("stored submission", format!("submission {}: {e}", r.id)))?;
            Ok(StoredSubmission {
                id: r.id,
                student: r.student,
                experiment_id: r.experiment_id,
                answers,
                late: r.late != 0,
                submitted_at: r.submitted_at,
            })
        })
        .collect()
}
