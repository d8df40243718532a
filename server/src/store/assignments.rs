//! Assignments and their submissions: the `assignments` table (each assignment's content as
//! JSON), `assignment_submissions` (a student's run and answers; every one kept) and
//! `assignment_grades` (the teacher's verdicts on text answers).

use std::time::SystemTime;

use distlab_common::assignments::{Assignment, GivenAnswer, NewAssignment, TextGrade};

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

crate::store::row! {
    struct AssignmentRow {
        id: i64,
        created_by: String,
        created_at: String,
        content: String,
    }
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
    /// The teacher's grades of its text answers.
    pub grades: Vec<TextGrade>,
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
        grades: Vec::new(),
    })
}

crate::store::row! {
    struct SubmissionRow {
        id: i64,
        student: String,
        experiment_id: i64,
        answers: String,
        late: i64,
        submitted_at: String,
    }
}

/// Assignment `assignment_id`'s submissions, newest first: `student`'s only, or everyone's.
pub async fn submissions(
    db: &Db,
    assignment_id: i64,
    student: Option<&str>,
) -> Result<Vec<StoredSubmission>, StoreError> {
    select(db, assignment_id, student.unwrap_or(""), 0).await
}

/// Submission `id` of assignment `assignment_id`, if it is one of its.
pub async fn submission(db: &Db, assignment_id: i64, id: i64) -> Result<Option<StoredSubmission>, StoreError> {
    Ok(select(db, assignment_id, "", id).await?.pop())
}

/// The submissions of `assignment_id` by `student` ("": anyone) with id `id` (0: any), each
/// with its grades.
async fn select(db: &Db, assignment_id: i64, student: &str, id: i64) -> Result<Vec<StoredSubmission>, StoreError> {
    let rows: Vec<SubmissionRow> = sqlx::query_as(
        "SELECT id, student, experiment_id, answers, late, submitted_at FROM assignment_submissions \
         WHERE assignment_id = $1 AND ($2 = '' OR student = $2) AND ($3 = 0 OR id = $3) ORDER BY id DESC",
    )
    .bind(assignment_id)
    .bind(student)
    .bind(id)
    .fetch_all(db)
    .await?;
    let grades: Vec<(i64, i64, i64)> = sqlx::query_as(
        "SELECT g.submission_id, g.question, g.is_right FROM assignment_grades g \
         JOIN assignment_submissions s ON s.id = g.submission_id \
         WHERE s.assignment_id = $1 AND ($2 = '' OR s.student = $2) AND ($3 = 0 OR s.id = $3)",
    )
    .bind(assignment_id)
    .bind(student)
    .bind(id)
    .fetch_all(db)
    .await?;
    rows.into_iter()
        .map(|r| {
            let answers = serde_json::from_str(&r.answers)
                .map_err(|e| corrupt("stored submission", format!("submission {}: {e}", r.id)))?;
            let grades = grades
                .iter()
                .filter(|g| g.0 == r.id)
                .map(|&(_, question, right)| TextGrade { question: question.max(0) as usize, right: right != 0 })
                .collect();
            Ok(StoredSubmission {
                id: r.id,
                student: r.student,
                experiment_id: r.experiment_id,
                answers,
                late: r.late != 0,
                submitted_at: r.submitted_at,
                grades,
            })
        })
        .collect()
}

/// Keeps `teacher`'s grade of submission `submission_id`'s text answer, replacing an earlier
/// one of the same answer.
pub async fn grade(
    db: &Db,
    submission_id: i64,
    grade: TextGrade,
    teacher: &str,
    now: SystemTime,
) -> Result<(), StoreError> {
    sqlx::query(
        "INSERT INTO assignment_grades (submission_id, question, is_right, graded_by, graded_at) \
         VALUES ($1, $2, $3, $4, $5) ON CONFLICT (submission_id, question) \
         DO UPDATE SET is_right = excluded.is_right, graded_by = excluded.graded_by, graded_at = excluded.graded_at",
    )
    .bind(submission_id)
    .bind(grade.question as i64)
    .bind(i64::from(grade.right))
    .bind(teacher)
    .bind(clock::rfc3339(now))
    .execute(db)
    .await?;
    Ok(())
}
