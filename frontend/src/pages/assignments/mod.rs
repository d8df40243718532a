//! `/assignments`: the exercises a teacher hands out, and `/assignments/:id`: one of them.
//!
//! Everyone sees the list and, on an assignment's page, its instructions, the run to start
//! from with only the fields the teacher left open editable, the questions, and their own
//! submissions with each answer's verdict and the number their run measured (`work.rs`).
//! A teacher (an admin) also writes assignments (`write.rs`) and sees the class: every
//! student's runs overlaid, each answer's verdict, who has not submitted, and the
//! gradebook as CSV (`class.rs`).

mod class;
mod work;
mod write;

use std::time::Duration;

use distlab_common::assignments::{Assignment, AssignmentView};
use leptos::prelude::*;
use leptos_router::components::A;
use leptos_router::hooks::use_params_map;

use self::class::ClassView;
use self::work::StudentWork;
use self::write::NewAssignmentForm;
use crate::api;
use crate::format;
use crate::load::{error_card, load, load_keeping, loading_card, Load, Loaded};
use crate::pages::sign_in::Session;

/// Whether the signed-in person is a teacher here (an admin; on a server without accounts,
/// whoever runs it).
fn is_teacher() -> Signal<bool> {
    let session = use_context::<RwSignal<Session>>();
    Signal::derive(move || session.is_some_and(|s| s.get().is_admin()))
}

#[component]
pub fn AssignmentsPage() -> impl IntoView {
    let list = load(api::list_assignments);
    let teacher = is_teacher();
    view! {
        <section class="card" id="assignments-page">
            <h1>"Assignments"</h1>
            <p class="muted">"Exercises whose answers your own runs check: start a run from one, answer its questions, and once the run has finished each answer gets its verdict with the number the run measured."</p>
            {Loaded::new(list)
                .error(|e| view! { <p class="alert error" id="assignments-error">{e}</p> })
                .view(|list| {
                    if list.is_empty() {
                        return view! { <p class="muted" id="no-assignments">"No assignment yet."</p> }.into_any();
                    }
                    view! {
                        <table class="data" id="assignments">
                            <thead><tr><th>"assignment"</th><th>"questions"</th><th>"due"</th><th>"by"</th></tr></thead>
                            <tbody>{list.into_iter().map(|a| view! { <AssignmentRow assignment=a/> }).collect_view()}</tbody>
                        </table>
                    }
                    .into_any()
                })}
        </section>
        {move || teacher.get().then(|| view! { <NewAssignmentForm on_created=move || list.refetch()/> })}
    }
}

#[component]
fn AssignmentRow(assignment: Assignment) -> impl IntoView {
    let due = assignment.content.due.as_deref().map(format::local_time).unwrap_or_else(|| "–".into());
    view! {
        <tr data-id=assignment.id.to_string()>
            <td><A href=format!("/assignments/{}", assignment.id)>{assignment.content.title.clone()}</A></td>
            <td class="num">{assignment.content.questions.len()}</td>
            <td>{due}</td>
            <td>{assignment.created_by.clone()}</td>
        </tr>
    }
}

#[component]
pub fn AssignmentPage() -> impl IntoView {
    let params = use_params_map();
    let id = Memo::new(move |_| params.read().get("id").and_then(|s| s.parse::<i64>().ok()));
    move || match id.get() {
        Some(id) => view! { <AssignmentDetail id=id/> }.into_any(),
        None => error_card("This is not an assignment id.".into()).into_any(),
    }
}

/// The assignment, loaded once, and followed while a submission's run has not finished: a
/// new answer redraws the submissions and the class, not the form being filled in.
#[component]
fn AssignmentDetail(id: i64) -> impl IntoView {
    let (progress, _) = load_keeping(move || api::get_assignment(id));
    follow_pending(progress);
    let head = Memo::new(move |_| {
        progress.get().map(|r| r.map(|v| (v.assignment, v.instructions_html)).map_err(|e| e.message))
    });
    let teacher = is_teacher();
    move || match head.get() {
        None => loading_card().into_any(),
        Some(Err(e)) => error_card(e).into_any(),
        Some(Ok((assignment, instructions_html))) => {
            let content = &assignment.content;
            let due = content.due.as_deref().map(|d| format!(" · due {}", format::local_time(d)));
            view! {
                <section class="card" id="assignment" data-id=id.to_string()>
                    <h1 id="assignment-title">{content.title.clone()}</h1>
                    <p class="muted">
                        {format!("by {}", assignment.created_by)}{due}
                        " · " <A href="/assignments">"all assignments"</A>
                    </p>
                    // The server rendered the Markdown without raw HTML or script URLs
                    // (server/src/markdown.rs).
                    <div class="instructions" id="assignment-instructions" inner_html=instructions_html></div>
                </section>
                // A teacher sees the class first; the form below lets them try the run too.
                {move || teacher.get().then(|| view! { <ClassView id=id progress=progress/> })}
                <StudentWork assignment=assignment.clone() progress=progress/>
            }
            .into_any()
        }
    }
}

/// Fetches `view` again every 3 s while one of its submissions' runs has not finished.
fn follow_pending(view: Load<AssignmentView>) {
    let tick = move || {
        let pending = view
            .get_untracked()
            .is_some_and(|v| v.is_ok_and(|v| v.submissions.iter().any(|s| !s.status.is_finished())));
        if pending {
            view.refetch();
        }
    };
    if let Ok(handle) = set_interval_with_handle(tick, Duration::from_secs(3)) {
        on_cleanup(move || handle.clear());
    }
}
