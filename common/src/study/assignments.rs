//! Assignments: a teacher's exercise whose answers the students' own runs check.
//!
//! A teacher (an admin) writes an [`NewAssignment`]: instructions in Markdown, a starting
//! spec, the spec fields a student may change (the server refuses a run that changes any
//! other), and questions. A question is answered with a number checked against a
//! [`Quantity`] measured on the student's own run (within the teacher's tolerance), with a
//! choice among options whose values the teacher states (the right one is the option
//! nearest the measurement), or with text the teacher grades. A student submits a run and
//! answers together ([`NewSubmission`]); every submission is kept. Once the run has
//! finished, each answer gets its [`Verdict`] with the measured number beside it.

use serde::{Deserialize, Serialize};

use crate::analysis::compare::{flatten, RunStats};
use crate::spec::field_error::FieldError;
use crate::wire::events::ExperimentStatus;
use crate::ExperimentSpec;

pub mod ready_made;

pub const MAX_TITLE: usize = 200;
pub const MAX_INSTRUCTIONS: usize = 20_000;
pub const MAX_QUESTIONS: usize = 20;
pub const MAX_PROMPT: usize = 2_000;
pub const MAX_OPTIONS: usize = 8;
pub const MAX_TEXT_ANSWER: usize = 5_000;
pub const MAX_EDITABLE: usize = 32;

/// What a run measured that a question can ask about.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(rename_all = "snake_case")]
pub enum Quantity {
    /// The last step's training loss (nats per token).
    FinalLoss,
    /// The last validation loss (nats per token).
    ValLoss,
    /// Tokens per second, mean over the steps after the first.
    TokensPerS,
    /// Model FLOP utilisation, in percent.
    MfuPercent,
    /// The busiest rank's peak memory, all categories, in MiB (the memory ledger).
    PeakMemoryMib,
    /// Data-parallel bytes the busiest rank sent per step (its collectives' counters).
    DpBytesPerStep,
    /// Mean step time in milliseconds.
    StepMs,
    /// The pipeline bubble in percent: the step replayed from its stages' measured passes
    /// with a core per stage, as the schedules' formulas count it.
    BubblePercent,
}

impl Quantity {
    /// In words, with its unit.
    pub fn label(self) -> &'static str {
        match self {
            Quantity::FinalLoss => "final loss (nats/token)",
            Quantity::ValLoss => "validation loss (nats/token)",
            Quantity::TokensPerS => "tokens per second",
            Quantity::MfuPercent => "MFU (%)",
            Quantity::PeakMemoryMib => "the busiest rank's peak memory (MiB)",
            Quantity::DpBytesPerStep => "data-parallel bytes per step, busiest rank",
            Quantity::StepMs => "mean step time (ms)",
            Quantity::BubblePercent => "the pipeline bubble (%)",
        }
    }

    /// This quantity on a finished run: its summary's and traces' numbers
    /// ([`crate::analysis::compare::run_stats`]) and its metrics' last validation loss.
    pub fn of(self, stats: &RunStats, last_val_loss: Option<f64>) -> Option<f64> {
        match self {
            Quantity::FinalLoss => stats.final_loss,
            Quantity::ValLoss => last_val_loss,
            Quantity::TokensPerS => stats.tokens_per_s,
            Quantity::MfuPercent => stats.mfu.map(|m| m * 100.0),
            Quantity::PeakMemoryMib => stats.peak_memory.as_ref().map(|m| m.total as f64 / (1u64 << 20) as f64),
            Quantity::DpBytesPerStep => stats.dp_comm_bytes_per_step,
            Quantity::StepMs => stats.step_ms,
            Quantity::BubblePercent => stats.bubble.map(|b| b * 100.0),
        }
    }
}

/// One option of a multiple-choice question: what it says and the value it stands for.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(deny_unknown_fields)]
pub struct ChoiceOption {
    pub label: String,
    pub value: f64,
}

/// How a question is answered and checked.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(tag = "kind", rename_all = "snake_case", deny_unknown_fields)]
pub enum QuestionKind {
    /// A number, right when within `tolerance` (relative: 0.05 is 5%) of `quantity` as the
    /// student's run measured it.
    Number { quantity: Quantity, tolerance: f64 },
    /// One of `options`, right when it is the option whose value is nearest `quantity` as
    /// the student's run measured it.
    Choice { quantity: Quantity, options: Vec<ChoiceOption> },
    /// Text the teacher grades.
    Text,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(deny_unknown_fields)]
pub struct Question {
    pub prompt: String,
    pub answer: QuestionKind,
}

/// `POST /api/assignments` (admins).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(deny_unknown_fields)]
pub struct NewAssignment {
    pub title: String,
    /// Markdown, rendered without raw HTML.
    #[serde(default)]
    pub instructions: String,
    /// The run every student starts from.
    pub spec: ExperimentSpec,
    /// The spec fields students may change, by path ("parallel.dp", "train.micro_batches");
    /// the run's `name` is always theirs.
    #[serde(default)]
    pub editable: Vec<String>,
    /// RFC3339; a submission after it is kept and marked late.
    #[serde(default)]
    pub due: Option<String>,
    pub questions: Vec<Question>,
}

/// An assignment as the API shows it.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct Assignment {
    pub id: i64,
    pub created_by: String,
    pub created_at: String,
    #[serde(flatten)]
    pub content: NewAssignment,
}

/// One answer of a submission; `question` is the question's index.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(deny_unknown_fields)]
pub struct GivenAnswer {
    pub question: usize,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub number: Option<f64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub option: Option<usize>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub text: Option<String>,
}

/// `POST /api/assignments/{id}/submissions`: the run (the assignment's spec with only the
/// editable fields changed) and the answers.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(deny_unknown_fields)]
pub struct NewSubmission {
    pub spec: ExperimentSpec,
    pub answers: Vec<GivenAnswer>,
}

/// `PUT /api/assignments/{id}/submissions/{submission}/grade` (admins): the teacher's verdict
/// on a text answer; grading the same answer again replaces it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(deny_unknown_fields)]
pub struct TextGrade {
    pub question: usize,
    pub right: bool,
}

/// Where an answer stands.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(rename_all = "snake_case")]
pub enum VerdictState {
    /// The run has not finished.
    Pending,
    Right,
    Wrong,
    /// Not answered.
    Missing,
    /// The run did not measure the quantity (it failed, or measures no such thing).
    NotMeasured,
    /// Text the teacher has not graded yet (graded, it is right or wrong).
    ToGrade,
}

impl VerdictState {
    /// As the API and the gradebook write it.
    pub fn as_str(self) -> &'static str {
        match self {
            VerdictState::Pending => "pending",
            VerdictState::Right => "right",
            VerdictState::Wrong => "wrong",
            VerdictState::Missing => "missing",
            VerdictState::NotMeasured => "not_measured",
            VerdictState::ToGrade => "to_grade",
        }
    }
}

/// An answer's verdict, with the number the run measured.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct Verdict {
    pub question: usize,
    pub state: VerdictState,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub measured: Option<f64>,
    /// For a choice: the option nearest the measurement.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub right_option: Option<usize>,
}

/// A submission as the API shows it.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct Submission {
    pub id: i64,
    pub assignment_id: i64,
    pub student: String,
    pub experiment_id: i64,
    pub submitted_at: String,
    /// Submitted after the due date.
    pub late: bool,
    pub status: ExperimentStatus,
    pub answers: Vec<GivenAnswer>,
    pub verdicts: Vec<Verdict>,
}

/// `GET /api/assignments/{id}`: the assignment and the submissions the caller may see
/// (a student's own, every one for an admin, newest first), and for an admin the students
/// with none.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct AssignmentView {
    pub assignment: Assignment,
    /// The instructions as HTML: the Markdown rendered without any raw HTML of the
    /// writer's or script URLs (the server renders it).
    #[serde(default)]
    pub instructions_html: String,
    pub submissions: Vec<Submission>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub not_submitted: Vec<String>,
}

impl NewAssignment {
    /// Every problem with the assignment itself (its spec is validated by the caller, with
    /// the server's limits), each naming its field.
    pub fn problems(&self) -> Vec<FieldError> {
        let mut out = Vec::new();
        let mut bad = |field: String, message: String| out.push(FieldError::new(field, message));
        if self.title.trim().is_empty() || self.title.chars().count() > MAX_TITLE {
            bad("title".into(), format!("a title of 1 to {MAX_TITLE} characters"));
        }
        if self.instructions.chars().count() > MAX_INSTRUCTIONS {
            bad("instructions".into(), format!("at most {MAX_INSTRUCTIONS} characters"));
        }
        if self.editable.len() > MAX_EDITABLE {
            bad("editable".into(), format!("at most {MAX_EDITABLE} fields"));
        }
        let paths: Vec<String> = flatten(&self.spec).into_iter().map(|(path, _)| path).collect();
        for (i, field) in self.editable.iter().enumerate() {
            let known = paths.iter().any(|p| p == field || p.starts_with(&format!("{field}.")))
                || OPTIONAL_FIELDS.contains(&field.as_str());
            if !known {
                bad(format!("editable[{i}]"), format!("the spec has no field '{}'", clip(field)));
            }
        }
        if let Some(due) = &self.due {
            if !is_rfc3339(due) {
                bad("due".into(), "an RFC3339 time, e.g. 2026-12-01T09:00:00Z".into());
            }
        }
        if self.questions.is_empty() || self.questions.len() > MAX_QUESTIONS {
            bad("questions".into(), format!("1 to {MAX_QUESTIONS} questions"));
        }
        for (i, q) in self.questions.iter().enumerate() {
            if q.prompt.trim().is_empty() || q.prompt.chars().count() > MAX_PROMPT {
                bad(format!("questions[{i}].prompt"), format!("a prompt of 1 to {MAX_PROMPT} characters"));
            }
            match &q.answer {
                QuestionKind::Number { tolerance, .. } if !(tolerance.is_finite() && *tolerance > 0.0) => {
                    bad(format!("questions[{i}].answer.tolerance"), "a relative tolerance above 0, e.g. 0.05".into());
                }
                QuestionKind::Choice { options, .. } => {
                    if options.len() < 2 || options.len() > MAX_OPTIONS {
                        bad(format!("questions[{i}].answer.options"), format!("2 to {MAX_OPTIONS} options"));
                    }
                    for (j, o) in options.iter().enumerate() {
                        if o.label.trim().is_empty() || o.label.chars().count() > MAX_PROMPT || !o.value.is_finite() {
                            bad(format!("questions[{i}].answer.options[{j}]"), "a label and a finite value".into());
                        }
                    }
                }
                _ => {}
            }
        }
        out
    }
}

/// Spec fields that may be absent from a spec (serialised as null, so not among its
/// flattened paths) yet are fine to make editable.
const OPTIONAL_FIELDS: &[&str] = &["train.resume_from", "data.upload_id"];

fn clip(s: &str) -> String {
    s.chars().take(80).collect()
}

/// "2026-12-01T09:00:00Z" and the like (date, 'T', time, a zone).
fn is_rfc3339(s: &str) -> bool {
    let b = s.as_bytes();
    let digits = |r: std::ops::Range<usize>| b.get(r).is_some_and(|d| d.iter().all(u8::is_ascii_digit));
    s.len() <= 40
        && digits(0..4)
        && b.get(4) == Some(&b'-')
        && digits(5..7)
        && b.get(7) == Some(&b'-')
        && digits(8..10)
        && matches!(b.get(10), Some(b'T' | b't'))
        && digits(11..13)
        && b.get(13) == Some(&b':')
        && digits(14..16)
        && (s.ends_with('Z') || s.ends_with('z') || s[16..].contains('+') || s[16..].contains('-'))
}

/// The spec's fields a student may change, `(path, value)` in the order of their paths: every
/// field `editable` names, or lies under one it names.
pub fn editable_fields(spec: &ExperimentSpec, editable: &[String]) -> Vec<(String, String)> {
    let mut fields: Vec<(String, String)> = flatten(spec)
        .into_iter()
        .filter(|(path, _)| path != "name" && editable.iter().any(|e| path == e || path.starts_with(&format!("{e}."))))
        .collect();
    // A field a spec may leave out (null) is still the student's to fill in.
    for e in editable {
        if OPTIONAL_FIELDS.contains(&e.as_str()) && fields.iter().all(|(p, _)| p != e) {
            fields.push((e.clone(), String::new()));
        }
    }
    fields
}

/// `spec` with the field at `path` ("parallel.dp") set to `raw`, read as the kind of value
/// the field holds (a number, true/false, a name); an empty `raw` clears a field the spec
/// may leave out. The error says what is wrong in words.
pub fn with_field(spec: &ExperimentSpec, path: &str, raw: &str) -> Result<ExperimentSpec, String> {
    use serde_json::Value;
    let mut value = serde_json::to_value(spec).map_err(|e| e.to_string())?;
    let mut slot = &mut value;
    for key in path.split('.') {
        slot = slot
            .as_object_mut()
            .and_then(|fields| {
                if !fields.contains_key(key) && OPTIONAL_FIELDS.contains(&path) {
                    fields.insert(key.to_string(), Value::Null);
                }
                fields.get_mut(key)
            })
            .ok_or_else(|| format!("the spec has no field '{}'", clip(path)))?;
    }
    let raw = raw.trim();
    *slot = match &*slot {
        Value::Number(_) => {
            let number: f64 = raw.parse().map_err(|_| format!("{path}: '{}' is not a number", clip(raw)))?;
            serde_json::from_str(raw)
                .ok()
                .filter(Value::is_number)
                .or_else(|| serde_json::Number::from_f64(number).map(Value::Number))
                .ok_or_else(|| format!("{path}: '{}' is not a finite number", clip(raw)))?
        }
        Value::Bool(_) => match raw {
            "true" => Value::Bool(true),
            "false" => Value::Bool(false),
            _ => return Err(format!("{path}: true or false, not '{}'", clip(raw))),
        },
        Value::String(_) => Value::String(raw.to_string()),
        Value::Null if raw.is_empty() => Value::Null,
        Value::Null => serde_json::from_str(raw).unwrap_or_else(|_| Value::String(raw.to_string())),
        Value::Object(_) | Value::Array(_) => {
            serde_json::from_str(raw).map_err(|e| format!("{path}: not JSON ({e})"))?
        }
    };
    serde_json::from_value(value).map_err(|e| format!("{path}: {e}"))
}

/// The fields `submitted` changes from the assignment's `start`, each refused unless
/// `editable` names it (or a field above it); the run's name is always the student's.
pub fn disallowed_changes(start: &ExperimentSpec, submitted: &ExperimentSpec, editable: &[String]) -> Vec<FieldError> {
    let (a, b) = (flatten(start), flatten(submitted));
    let value = |list: &[(String, String)], path: &str| list.iter().find(|(p, _)| p == path).map(|(_, v)| v.clone());
    let mut paths: Vec<&String> = a.iter().chain(&b).map(|(p, _)| p).collect();
    paths.sort();
    paths.dedup();
    let allowed =
        |path: &str| path == "name" || editable.iter().any(|e| path == e || path.starts_with(&format!("{e}.")));
    paths
        .into_iter()
        .filter(|p| value(&a, p) != value(&b, p) && !allowed(p))
        .map(|p| FieldError::new(format!("spec.{p}"), "this assignment fixes this field"))
        .collect()
}

/// Every problem with a submission's answers to `questions` (each question at most once,
/// of its kind).
pub fn answer_problems(questions: &[Question], answers: &[GivenAnswer]) -> Vec<FieldError> {
    let mut out = Vec::new();
    let mut seen = vec![false; questions.len()];
    for (i, a) in answers.iter().enumerate() {
        let field = format!("answers[{i}]");
        let Some(q) = questions.get(a.question) else {
            out.push(FieldError::new(field, format!("no question {} (there are {})", a.question, questions.len())));
            continue;
        };
        if std::mem::replace(&mut seen[a.question], true) {
            out.push(FieldError::new(field, format!("question {} is answered twice", a.question)));
            continue;
        }
        let fits = match &q.answer {
            QuestionKind::Number { .. } => {
                a.number.is_some_and(f64::is_finite) && a.option.is_none() && a.text.is_none()
            }
            QuestionKind::Choice { options, .. } => {
                a.option.is_some_and(|o| o < options.len()) && a.number.is_none() && a.text.is_none()
            }
            QuestionKind::Text => {
                a.text.as_ref().is_some_and(|t| t.chars().count() <= MAX_TEXT_ANSWER)
                    && a.number.is_none()
                    && a.option.is_none()
            }
        };
        if !fits {
            let wants = match &q.answer {
                QuestionKind::Number { .. } => "a finite number (number)".to_string(),
                QuestionKind::Choice { options, .. } => format!("an option from 0 to {} (option)", options.len() - 1),
                QuestionKind::Text => format!("text of at most {MAX_TEXT_ANSWER} characters (text)"),
            };
            out.push(FieldError::new(field, format!("question {} takes {wants} and nothing else", a.question)));
        }
    }
    out
}

/// Every problem with grading `grade` on a submission's `answers`: the question must ask for
/// text, and have been answered.
pub fn grade_problems(questions: &[Question], answers: &[GivenAnswer], grade: &TextGrade) -> Vec<FieldError> {
    let problem = match questions.get(grade.question) {
        None => format!("no question {} (there are {})", grade.question, questions.len()),
        Some(Question { answer: QuestionKind::Text, .. }) if answers.iter().any(|a| a.question == grade.question) => {
            return Vec::new()
        }
        Some(Question { answer: QuestionKind::Text, .. }) => format!("question {} was not answered", grade.question),
        Some(_) => format!("question {} is checked by the run, not graded", grade.question),
    };
    vec![FieldError::new("question", problem)]
}

/// Each question's verdict on `answers`, once the run is `status`; `measure` gives a
/// quantity as the run measured it, `grades` are the teacher's on the text answers.
pub fn verdicts(
    questions: &[Question],
    answers: &[GivenAnswer],
    grades: &[TextGrade],
    status: ExperimentStatus,
    measure: impl Fn(Quantity) -> Option<f64>,
) -> Vec<Verdict> {
    questions
        .iter()
        .enumerate()
        .map(|(i, q)| {
            let given = answers.iter().find(|a| a.question == i);
            let verdict = |state, measured, right_option| Verdict { question: i, state, measured, right_option };
            let quantity = match &q.answer {
                QuestionKind::Number { quantity, .. } | QuestionKind::Choice { quantity, .. } => *quantity,
                QuestionKind::Text => {
                    let state = match (given, grades.iter().find(|g| g.question == i)) {
                        (None, _) => VerdictState::Missing,
                        (Some(_), None) => VerdictState::ToGrade,
                        (Some(_), Some(g)) if g.right => VerdictState::Right,
                        (Some(_), Some(_)) => VerdictState::Wrong,
                    };
                    return verdict(state, None, None);
                }
            };
            if !status.is_finished() {
                return verdict(VerdictState::Pending, None, None);
            }
            let Some(measured) = measure(quantity).filter(|m| m.is_finite()) else {
                return verdict(VerdictState::NotMeasured, None, None);
            };
            match &q.answer {
                QuestionKind::Number { tolerance, .. } => {
                    let state = match given.and_then(|a| a.number) {
                        None => VerdictState::Missing,
                        Some(n) if (n - measured).abs() <= tolerance * measured.abs() => VerdictState::Right,
                        Some(_) => VerdictState::Wrong,
                    };
                    verdict(state, Some(measured), None)
                }
                QuestionKind::Choice { options, .. } => {
                    let nearest = options
                        .iter()
                        .enumerate()
                        .min_by(|(_, x), (_, y)| (x.value - measured).abs().total_cmp(&(y.value - measured).abs()))
                        .map(|(j, _)| j);
                    let state = match given.and_then(|a| a.option) {
                        None => VerdictState::Missing,
                        Some(o) if Some(o) == nearest => VerdictState::Right,
                        Some(_) => VerdictState::Wrong,
                    };
                    verdict(state, Some(measured), nearest)
                }
                QuestionKind::Text => unreachable!("answered above"),
            }
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn assignment() -> NewAssignment {
        let mut spec = ExperimentSpec::default();
        spec.parallel.dp = 2;
        NewAssignment {
            title: "ZeRO-2's memory".into(),
            instructions: "Find the smallest **dp**.".into(),
            spec,
            editable: vec!["parallel.dp".into()],
            due: Some("2026-12-24T18:00:00Z".into()),
            questions: vec![
                Question {
                    prompt: "Peak MiB?".into(),
                    answer: QuestionKind::Number { quantity: Quantity::PeakMemoryMib, tolerance: 0.05 },
                },
                Question {
                    prompt: "Which?".into(),
                    answer: QuestionKind::Choice {
                        quantity: Quantity::FinalLoss,
                        options: vec![
                            ChoiceOption { label: "about 2".into(), value: 2.0 },
                            ChoiceOption { label: "about 4".into(), value: 4.0 },
                        ],
                    },
                },
                Question { prompt: "Why?".into(), answer: QuestionKind::Text },
            ],
        }
    }

    #[test]
    fn an_assignment_names_each_of_its_problems() {
        assert!(assignment().problems().is_empty(), "{:?}", assignment().problems());
        let mut bad = assignment();
        bad.title = " ".into();
        bad.editable = vec!["parallel.dpp".into()];
        bad.due = Some("next tuesday".into());
        bad.questions[0].answer = QuestionKind::Number { quantity: Quantity::FinalLoss, tolerance: 0.0 };
        bad.questions[1].answer = QuestionKind::Choice { quantity: Quantity::FinalLoss, options: vec![] };
        let fields: Vec<String> = bad.problems().into_iter().map(|e| e.field).collect();
        assert_eq!(
            fields,
            ["title", "editable[0]", "due", "questions[0].answer.tolerance", "questions[1].answer.options"]
        );
        // A field's parent names it too.
        let mut parent = assignment();
        parent.editable = vec!["parallel".into(), "train.resume_from".into()];
        assert!(parent.problems().is_empty());
    }

    #[test]
    fn only_the_editable_fields_may_change() {
        let a = assignment();
        let mut run = a.spec.clone();
        run.name = "mine".into();
        run.parallel.dp = 4;
        assert!(disallowed_changes(&a.spec, &run, &a.editable).is_empty());
        run.train.lr = 0.5;
        run.parallel.sharding = crate::Sharding::Zero2;
        let fields: Vec<String> = disallowed_changes(&a.spec, &run, &a.editable).into_iter().map(|e| e.field).collect();
        assert_eq!(fields, ["spec.parallel.sharding", "spec.train.lr"]);
        assert_eq!(disallowed_changes(&a.spec, &run, &["parallel".into(), "train".into()]), vec![]);
    }

    #[test]
    fn answers_must_fit_their_questions() {
        let q = assignment().questions;
        let n = |question, number| GivenAnswer { question, number: Some(number), option: None, text: None };
        let good = vec![
            n(0, 12.0),
            GivenAnswer { question: 1, number: None, option: Some(1), text: None },
            GivenAnswer { question: 2, number: None, option: None, text: Some("because".into()) },
        ];
        assert!(answer_problems(&q, &good).is_empty());
        let bad = vec![n(0, 1.0), n(0, 2.0), n(1, 3.0), n(7, 1.0), n(2, f64::NAN)];
        let fields: Vec<String> = answer_problems(&q, &bad).into_iter().map(|e| e.field).collect();
        assert_eq!(fields, ["answers[1]", "answers[2]", "answers[3]", "answers[4]"]);
    }

    #[test]
    fn verdicts_set_each_answer_against_the_measurement() {
        let q = assignment().questions;
        let answers = vec![
            GivenAnswer { question: 0, number: Some(10.4), option: None, text: None },
            GivenAnswer { question: 1, number: None, option: Some(1), text: None },
            GivenAnswer { question: 2, number: None, option: None, text: Some("...".into()) },
        ];
        let measure = |q: Quantity| match q {
            Quantity::PeakMemoryMib => Some(10.0),
            Quantity::FinalLoss => Some(2.3),
            _ => None,
        };
        let v = verdicts(&q, &answers, &[], ExperimentStatus::Succeeded, measure);
        let states: Vec<VerdictState> = v.iter().map(|v| v.state).collect();
        assert_eq!(states, [VerdictState::Right, VerdictState::Wrong, VerdictState::ToGrade]);
        assert_eq!((v[0].measured, v[1].measured, v[1].right_option), (Some(10.0), Some(2.3), Some(0)));
        // 6% off is wrong at 5%; a run still going is pending; a quantity not measured says so.
        let off = vec![GivenAnswer { question: 0, number: Some(10.6), option: None, text: None }];
        assert_eq!(verdicts(&q, &off, &[], ExperimentStatus::Succeeded, measure)[0].state, VerdictState::Wrong);
        assert_eq!(verdicts(&q, &off, &[], ExperimentStatus::Running, measure)[0].state, VerdictState::Pending);
        assert_eq!(verdicts(&q, &off, &[], ExperimentStatus::Failed, |_| None)[0].state, VerdictState::NotMeasured);
        assert_eq!(verdicts(&q, &[], &[], ExperimentStatus::Succeeded, measure)[1].state, VerdictState::Missing);
    }

    #[test]
    fn the_teacher_grades_text_answers_only() {
        let q = assignment().questions;
        let answered = vec![GivenAnswer { question: 2, number: None, option: None, text: Some("because".into()) }];
        let graded = |right| [TextGrade { question: 2, right }];
        let state =
            |grades: &[TextGrade]| verdicts(&q, &answered, grades, ExperimentStatus::Running, |_| None)[2].state;
        assert_eq!(state(&[]), VerdictState::ToGrade);
        assert_eq!(state(&graded(true)), VerdictState::Right);
        assert_eq!(state(&graded(false)), VerdictState::Wrong);
        assert!(grade_problems(&q, &answered, &graded(true)[0]).is_empty());
        let problem = |question| grade_problems(&q, &answered, &TextGrade { question, right: true })[0].message.clone();
        assert!(problem(0).contains("checked by the run"), "{}", problem(0));
        assert!(problem(7).contains("no question 7"), "{}", problem(7));
        assert!(grade_problems(&q, &[], &graded(true)[0])[0].message.contains("not answered"));
    }

    #[test]
    fn a_student_edits_only_the_open_fields_each_read_as_its_kind() {
        let a = assignment();
        let fields = editable_fields(&a.spec, &a.editable);
        assert_eq!(fields, [("parallel.dp".to_string(), "2".to_string())]);
        let spec = with_field(&a.spec, "parallel.dp", " 4 ").unwrap();
        assert_eq!(spec.parallel.dp, 4);
        assert!(disallowed_changes(&a.spec, &spec, &a.editable).is_empty());
        assert!(with_field(&a.spec, "parallel.dp", "four").unwrap_err().contains("not a number"));
        assert!(with_field(&a.spec, "parallel.dp", "-1").is_err(), "a dp is not negative");
        assert!(with_field(&a.spec, "parallel.nothing", "1").unwrap_err().contains("no field"));
        let spec = with_field(&a.spec, "parallel.sharding", "zero2").unwrap();
        assert_eq!(spec.parallel.sharding, crate::Sharding::Zero2);
        assert!(with_field(&a.spec, "parallel.sharding", "zero9").is_err());
        let spec = with_field(&a.spec, "train.lr", "1e-3").unwrap();
        assert_eq!(spec.train.lr, 1e-3);
        // A field the spec may leave out is offered empty, and an empty value leaves it out.
        let open = editable_fields(&a.spec, &["data.upload_id".to_string()]);
        assert_eq!(open, [("data.upload_id".to_string(), String::new())]);
        assert_eq!(with_field(&a.spec, "data.upload_id", "").unwrap().data.upload_id, None);
        assert_eq!(with_field(&a.spec, "data.upload_id", "7").unwrap().data.upload_id, Some(7));
    }
}
