//! The teacher's view of an assignment: every student's latest run on one loss chart, the
//! quantity each question asks about as every student's run measured it next to their
//! answer, every submission with its verdicts, who has not submitted, and the gradebook.

use distlab_common::assignments::{AssignmentView, QuestionKind, Submission};
use distlab_common::MetricPoint;
use leptos::prelude::*;

use super::work::{answer_text, measured, Grading, SubmissionTable};
use crate::api;
use crate::components::overlay_chart::{OverlayChart, Series};
use crate::load::{load, Load, Loaded};

/// One colour per student's curve (repeating past ten).
const COLORS: [&str; 10] =
    ["#2563eb", "#dc2626", "#059669", "#d97706", "#7c3aed", "#0891b2", "#db2777", "#65a30d", "#475569", "#ea580c"];

/// Each student's newest submission, by student name.
fn latest(submissions: &[Submission]) -> Vec<Submission> {
    let mut out: Vec<Submission> = Vec::new();
    // The API lists the newest first.
    for s in submissions {
        if out.iter().all(|l| l.student != s.student) {
            out.push(s.clone());
        }
    }
    out.sort_by(|a, b| a.student.cmp(&b.student));
    out
}

#[component]
pub fn ClassView(id: i64, progress: Load<AssignmentView>) -> impl IntoView {
    // The runs to draw: each student's latest, refetched when that set changes.
    let runs = Memo::new(move |_| {
        progress
            .get()
            .and_then(Result::ok)
            .map(|v| latest(&v.submissions).into_iter().map(|s| (s.student, s.experiment_id)).collect::<Vec<_>>())
            .unwrap_or_default()
    });
    let curves: Load<Vec<(String, i64, Vec<MetricPoint>)>> = load(move || {
        let runs = runs.get();
        async move {
            let mut out = Vec::with_capacity(runs.len());
            for (student, id) in runs {
                let metrics = api::get_metrics(id).await?;
                out.push((student, id, metrics.steps));
            }
            Ok(out)
        }
    });
    view! {
        <section class="card" id="class-view">
            <h2>"The class"</h2>
            {Loaded::new(progress).view(move |view| {
                let newest = latest(&view.submissions);
                let questions = view.assignment.content.questions.clone();
                view! {
                    <p id="class-summary">
                        {format!("{} of the class submitted ({} runs in all). ", newest.len(), view.submissions.len())}
                        <a id="grades-csv" href=format!("/api/assignments/{id}/grades.csv") download="">"Gradebook (CSV)"</a>
                    </p>
                    {(!view.not_submitted.is_empty()).then(|| view! {
                        <p id="not-submitted">"Not submitted yet: " {view.not_submitted.join(", ")}</p>
                    })}
                    <QuantityBars questions=questions.clone() latest=newest/>
                    {(!view.submissions.is_empty()).then(|| view! {
                        <h3>"Every submission"</h3>
                        <SubmissionTable questions=questions submissions=view.submissions.clone() with_student=true
                            grading=Grading { assignment: id, progress }/>
                    })}
                }
            })}
            <h3>"Loss of each student's latest run"</h3>
            {Loaded::new(curves).view(|curves| {
                let legend = curves.iter().enumerate().map(|(i, (student, id, _))| view! {
                    <span class="legend-item"><span class="swatch" style=format!("background:{}", COLORS[i % COLORS.len()])></span>
                        {format!("{student} (#{id})")}</span>
                }).collect_view();
                let series: Vec<Series> = curves
                    .iter()
                    .enumerate()
                    .map(|(i, (_, id, points))| Series {
                        id: *id,
                        color: COLORS[i % COLORS.len()],
                        points: points.iter().map(|p| (p.step as f64, p.loss)).collect(),
                    })
                    .collect();
                view! {
                    <div class="chart-wrap" id="class-loss"><OverlayChart series=series bands=Vec::new() x_title="step".to_string()/></div>
                    <p class="legend">{legend}</p>
                }
            })}
        </section>
    }
}

/// For each question a run checks: every student's measured value as a bar, with their
/// answer beside it.
#[component]
fn QuantityBars(questions: Vec<distlab_common::assignments::Question>, latest: Vec<Submission>) -> impl IntoView {
    questions
        .into_iter()
        .enumerate()
        .filter_map(|(i, q)| {
            let quantity = match &q.answer {
                QuestionKind::Number { quantity, .. } | QuestionKind::Choice { quantity, .. } => *quantity,
                QuestionKind::Text => return None,
            };
            let rows: Vec<(String, Option<f64>, String, &'static str)> = latest
                .iter()
                .map(|s| {
                    let verdict = s.verdicts.get(i);
                    let given = s.answers.iter().find(|a| a.question == i);
                    let said = answer_text(&q.answer, given);
                    (s.student.clone(), verdict.and_then(|v| v.measured), said, verdict.map_or("", |v| v.state.as_str()))
                })
                .collect();
            let max = rows.iter().filter_map(|r| r.1).fold(0.0f64, |m, v| m.max(v.abs())).max(1e-12);
            Some(view! {
                <div class="quantity-bars" data-question=i.to_string()>
                    <h3>{format!("Question {}: {}", i + 1, quantity.label())}</h3>
                    {rows.into_iter().map(|(student, value, said, state)| view! {
                        <div class="quantity-row" data-student=student.clone()>
                            <span class="quantity-student">{student.clone()}</span>
                            <span class="quantity-bar-track">
                                <span class="quantity-bar" style=format!("width:{:.1}%", 100.0 * value.unwrap_or(0.0).abs() / max)></span>
                            </span>
                            <span class="num">{value.map(measured).unwrap_or_else(|| "not measured yet".into())}</span>
                            <span class=format!("verdict-{state}")>{format!(" answered {said}")}</span>
                        </div>
                    }).collect_view()}
                </div>
            })
        })
        .collect_view()
}
