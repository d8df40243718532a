//! A student's part of an assignment's page: the run to start from, with only the fields
//! the teacher left open editable (the server refuses any other change), the questions,
//! and the student's own submissions, each answer with its verdict and the number the run
//! measured once it has finished. Every submission is kept: a second one does not replace
//! the first.

use distlab_common::assignments::{
    editable_fields, with_field, Assignment, AssignmentView, GivenAnswer, NewSubmission, Question, QuestionKind,
    Submission, TextGrade, Verdict, VerdictState,
};
use leptos::prelude::*;
use leptos_router::components::A;

use crate::api::{self, RequestError};
use crate::components::spec_view::SpecView;
use crate::components::status_badge::StatusBadge;
use crate::format;
use crate::load::{Load, Loaded};
use crate::pages::sign_in::Session;

#[component]
pub fn StudentWork(assignment: Assignment, progress: Load<AssignmentView>) -> impl IntoView {
    let id = assignment.id;
    let content = StoredValue::new(assignment.content);
    let name = RwSignal::new(content.with_value(|c| c.spec.name.clone()));
    let fields: Vec<(String, RwSignal<String>)> = content
        .with_value(|c| editable_fields(&c.spec, &c.editable))
        .into_iter()
        .map(|(path, value)| (path, RwSignal::new(value)))
        .collect();
    let fields = StoredValue::new(fields);
    let answers: Vec<RwSignal<String>> =
        content.with_value(|c| c.questions.iter().map(|_| RwSignal::new(String::new())).collect());
    let answers = StoredValue::new(answers);
    let outcome = RwSignal::new(None::<Result<String, RequestError>>);
    let sending = RwSignal::new(false);
    let session = use_context::<RwSignal<Session>>();

    let submit = move |ev: leptos::ev::SubmitEvent| {
        ev.prevent_default();
        let given = fields.with_value(|fs| fs.iter().map(|(p, v)| (p.clone(), v.get_untracked())).collect::<Vec<_>>());
        let typed = answers.with_value(|a| a.iter().map(|s| s.get_untracked()).collect::<Vec<_>>());
        let built = content.with_value(|c| submission(&c.spec, &c.questions, &name.get_untracked(), &given, &typed));
        let body = match built {
            Ok(body) => body,
            Err(message) => {
                outcome.set(Some(Err(RequestError { message, fields: Vec::new(), status: None })));
                return;
            }
        };
        sending.set(true);
        leptos::task::spawn_local(async move {
            let said = api::submit_assignment(id, &body).await.map(|s| {
                progress.refetch();
                format!("Submitted: run #{} is queued; the verdicts come when it has finished.", s.experiment_id)
            });
            outcome.try_set(Some(said));
            sending.try_set(false);
        });
    };

    view! {
        <section class="card" id="assignment-work">
            <h2>"Your run"</h2>
            <SpecView spec=content.with_value(|c| c.spec.clone())/>
            <form class="assignment-form" id="assignment-form" on:submit=submit>
                <div class="form-grid">
                    <label>"run name"
                        <input id="assignment-run-name" maxlength="200" autocomplete="off"
                            prop:value=move || name.get() on:input=move |ev| name.set(event_target_value(&ev))/>
                    </label>
                    {fields.with_value(|fs| fs.iter().map(|(path, value)| {
                        let value = *value;
                        view! {
                            <label>{path.clone()}
                                <input class="assignment-field" data-path=path.clone() autocomplete="off"
                                    prop:value=move || value.get() on:input=move |ev| value.set(event_target_value(&ev))/>
                            </label>
                        }
                    }).collect_view())}
                </div>
                <p class="muted small">{move || content.with_value(|c| fixed_note(&c.editable))}</p>
                <h2>"Questions"</h2>
                <ol class="assignment-questions">
                    {content.with_value(|c| c.questions.clone()).into_iter().enumerate().map(|(i, q)| {
                        let answer = answers.with_value(|a| a[i]);
                        view! { <QuestionInput index=i question=q answer=answer/> }
                    }).collect_view()}
                </ol>
                <button class="button primary" id="submit-assignment" type="submit" disabled=move || sending.get()>
                    "Run it and submit the answers"
                </button>
            </form>
            {move || outcome.get().map(|o| match o {
                Ok(done) => view! { <p class="alert ok" id="assignment-submitted">{done}</p> }.into_any(),
                Err(e) => view! { <Refusal id="assignment-refused" error=e/> }.into_any(),
            })}
        </section>
        <section class="card" id="my-submissions">
            <h2>"Your submissions"</h2>
            {Loaded::new(progress).view(move |view| {
                let me = session.and_then(|s| s.get_untracked().name());
                let mine: Vec<Submission> = view
                    .submissions
                    .into_iter()
                    .filter(|s| me.as_deref().is_none_or(|me| me == s.student))
                    .collect();
                if mine.is_empty() {
                    return view! { <p class="muted" id="no-submissions">"None yet."</p> }.into_any();
                }
                let questions = view.assignment.content.questions;
                view! { <SubmissionTable questions=questions submissions=mine with_student=false/> }.into_any()
            })}
        </section>
    }
}

/// A measured number as a person reads it: whole and grouped from 1,000 (bytes, tokens/s),
/// to a few digits below.
pub(super) fn measured(x: f64) -> String {
    if x.abs() >= 1000.0 && x.is_finite() {
        let sign = if x < 0.0 { "-" } else { "" };
        format!("{sign}{}", format::grouped(x.abs().round() as u64))
    } else {
        format::num(x)
    }
}

/// What a student answered, in words: the number, the option's label or the text ("–" for
/// none).
pub(super) fn answer_text(kind: &QuestionKind, given: Option<&GivenAnswer>) -> String {
    match (kind, given) {
        (_, None) => "–".to_string(),
        (QuestionKind::Number { .. }, Some(a)) => a.number.map(measured).unwrap_or_default(),
        (QuestionKind::Choice { options, .. }, Some(a)) => {
            a.option.and_then(|o| options.get(o)).map(|o| o.label.clone()).unwrap_or_default()
        }
        (QuestionKind::Text, Some(a)) => a.text.clone().unwrap_or_default(),
    }
}

/// A refused request: the server's reason and each field it names.
#[component]
pub(super) fn Refusal(id: &'static str, error: RequestError) -> impl IntoView {
    view! {
        <div class="alert error" id=id>
            <p>{error.message}</p>
            <ul>{error.fields.into_iter().map(|f| view! { <li><code>{f.field}</code>": "{f.message}</li> }).collect_view()}</ul>
        </div>
    }
}

/// The fields an assignment leaves open, in words.
fn fixed_note(editable: &[String]) -> String {
    if editable.is_empty() {
        "The assignment fixes every field of the run but its name.".into()
    } else {
        format!("The assignment fixes every other field of the run (you may change {}).", editable.join(", "))
    }
}

/// The submission the form describes, or what is wrong with it in words.
fn submission(
    start: &distlab_common::ExperimentSpec,
    questions: &[Question],
    name: &str,
    fields: &[(String, String)],
    typed: &[String],
) -> Result<NewSubmission, String> {
    let mut spec = start.clone();
    spec.name = name.trim().to_string();
    for (path, value) in fields {
        spec = with_field(&spec, path, value)?;
    }
    let mut answers = Vec::new();
    for (i, (q, text)) in questions.iter().zip(typed).enumerate() {
        let text = text.trim();
        if text.is_empty() {
            continue;
        }
        let mut answer = GivenAnswer { question: i, number: None, option: None, text: None };
        match q.answer {
            QuestionKind::Number { .. } => {
                let n: f64 = text.parse().map_err(|_| format!("question {}: '{text}' is not a number", i + 1))?;
                answer.number = Some(n);
            }
            QuestionKind::Choice { .. } => answer.option = text.parse().ok(),
            QuestionKind::Text => answer.text = Some(text.to_string()),
        }
        answers.push(answer);
    }
    Ok(NewSubmission { spec, answers })
}

/// A question and the input its kind takes; `answer` holds the typed number, the chosen
/// option's index or the text.
#[component]
fn QuestionInput(index: usize, question: Question, answer: RwSignal<String>) -> impl IntoView {
    let input = match question.answer {
        QuestionKind::Number { quantity, tolerance } => view! {
            <input class="answer-number" type="text" inputmode="decimal" autocomplete="off"
                aria-label=format!("answer to question {}", index + 1)
                prop:value=move || answer.get() on:input=move |ev| answer.set(event_target_value(&ev))/>
            <span class="muted small">{format!(" {} · right within {:.0}% of what your run measures", quantity.label(), tolerance * 100.0)}</span>
        }
        .into_any(),
        QuestionKind::Choice { options, .. } => view! {
            <div class="answer-options">
                {options.into_iter().enumerate().map(|(j, o)| view! {
                    <label class="check">
                        <input type="radio" name=format!("question-{index}") class="answer-option" value=j.to_string()
                            prop:checked=move || answer.get() == j.to_string()
                            on:change=move |_| answer.set(j.to_string())/>
                        {o.label}
                    </label>
                }).collect_view()}
            </div>
        }
        .into_any(),
        QuestionKind::Text => view! {
            <textarea class="answer-text" rows="3" maxlength="5000"
                aria-label=format!("answer to question {}", index + 1)
                prop:value=move || answer.get() on:input=move |ev| answer.set(event_target_value(&ev))></textarea>
            <span class="muted small">" the teacher reads it"</span>
        }
        .into_any(),
    };
    view! {
        <li class="question" data-question=index.to_string()>
            <p>{question.prompt}</p>
            {input}
        </li>
    }
}

/// Where the teacher's grades of text answers go: the assignment, and its view to reload.
#[derive(Clone, Copy)]
pub struct Grading {
    pub assignment: i64,
    pub progress: Load<AssignmentView>,
}

/// Submissions, newest first: when, the run, each answer with its verdict and the measured
/// number (and, for the class, whose, with buttons that grade the text answers).
#[component]
pub fn SubmissionTable(
    questions: Vec<Question>,
    submissions: Vec<Submission>,
    with_student: bool,
    #[prop(optional)] grading: Option<Grading>,
) -> impl IntoView {
    let headers = (1..=questions.len()).map(|i| view! { <th>{format!("question {i}")}</th> }).collect_view();
    let questions = StoredValue::new(questions);
    view! {
        <div class="table-scroll">
            <table class="data submissions">
                <thead><tr>
                    {with_student.then(|| view! { <th>"student"</th> })}
                    <th>"submitted"</th><th>"run"</th>{headers}
                </tr></thead>
                <tbody>
                    {submissions.into_iter().map(|s| {
                        let cells = questions.with_value(|qs| qs.iter().zip(&s.verdicts).map(|(q, v)| {
                            let given = s.answers.iter().find(|a| a.question == v.question);
                            let grade = grading.filter(|_| matches!(q.answer, QuestionKind::Text) && given.is_some()).map(|g| (g, s.id));
                            view! { <VerdictCell question=q.clone() given=given.cloned() verdict=v.clone() grade=grade/> }
                        }).collect_view());
                        view! {
                            <tr class="submission" data-id=s.id.to_string() data-student=s.student.clone()>
                                {with_student.then(|| view! { <td>{s.student.clone()}</td> })}
                                <td>{format::local_time(&s.submitted_at)}{s.late.then_some(" (late)")}</td>
                                <td>
                                    <A href=format!("/experiments/{}", s.experiment_id)>{format!("#{}", s.experiment_id)}</A>
                                    " " <StatusBadge status=s.status/>
                                </td>
                                {cells}
                            </tr>
                        }
                    }).collect_view()}
                </tbody>
            </table>
        </div>
    }
}

/// One answer and its verdict: "0.52 · right (measured 0.51)"; with `grade`, a text answer's
/// buttons for the teacher.
#[component]
fn VerdictCell(
    question: Question,
    given: Option<GivenAnswer>,
    verdict: Verdict,
    grade: Option<(Grading, i64)>,
) -> impl IntoView {
    let said = answer_text(&question.answer, given.as_ref());
    let short: String = said.chars().take(60).collect();
    let state = match verdict.state {
        VerdictState::Pending => "waiting for the run",
        VerdictState::Right => "right",
        VerdictState::Wrong => "wrong",
        VerdictState::Missing => "not answered",
        VerdictState::NotMeasured => "not measured by the run",
        VerdictState::ToGrade => "for the teacher",
    };
    let measured = match (&question.answer, verdict.measured) {
        (QuestionKind::Choice { options, .. }, Some(m)) => {
            let nearest = verdict.right_option.and_then(|o| options.get(o)).map(|o| o.label.as_str()).unwrap_or("");
            format!(" (measured {}: {nearest})", measured(m))
        }
        (_, Some(m)) => format!(" (measured {})", measured(m)),
        (_, None) => String::new(),
    };
    let class = format!("verdict verdict-{}", verdict.state.as_str());
    view! {
        <td class=class data-question=verdict.question.to_string() data-measured=verdict.measured.map(|m| m.to_string())>
            <span class="answer" title=said.clone()>{short}</span>
            <br/>
            <span class="verdict-state">{state}</span>
            <span class="muted small">{measured}</span>
            {grade.map(|(grading, submission)| {
                let question = verdict.question;
                let refused = RwSignal::new(None::<String>);
                let send = move |right: bool| {
                    leptos::task::spawn_local(async move {
                        let grade = TextGrade { question, right };
                        match api::grade_answer(grading.assignment, submission, grade).await {
                            Ok(_) => grading.progress.refetch(),
                            Err(e) => {
                                refused.try_set(Some(e.message));
                            }
                        }
                    });
                };
                view! {
                    <span class="grade-buttons">
                        <button class="button small grade-right" type="button" on:click=move |_| send(true)>"right"</button>
                        <button class="button small grade-wrong" type="button" on:click=move |_| send(false)>"wrong"</button>
                    </span>
                    {move || refused.get().map(|e| view! { <span class="alert error small">{e}</span> })}
                }
            })}
        </td>
    }
}
