//! The teacher's form for a new assignment: a ready-made one to start from (or none), the
//! title, the instructions in Markdown, the run every student starts from (its spec as
//! JSON), the fields they may change, a due date and the questions (JSON, each a prompt and
//! how it is answered). The server checks everything and names each field that is wrong.

use distlab_common::assignments::ready_made::ready_made;
use distlab_common::assignments::{NewAssignment, Question};
use leptos::prelude::*;
use leptos_router::components::A;

use super::work::Refusal;
use crate::api::{self, RequestError};

/// The form's text for each part of `a`.
struct Texts {
    title: String,
    instructions: String,
    spec: String,
    editable: String,
    questions: String,
}

impl Texts {
    fn of(a: &NewAssignment) -> Self {
        Texts {
            title: a.title.clone(),
            instructions: a.instructions.clone(),
            spec: serde_json::to_string_pretty(&a.spec).unwrap_or_default(),
            editable: a.editable.join(", "),
            questions: serde_json::to_string_pretty(&a.questions).unwrap_or_default(),
        }
    }
}

/// The assignment the form's texts describe, or what is wrong with them in words.
fn assignment(t: &Texts, due: &str) -> Result<NewAssignment, String> {
    let spec = serde_json::from_str(&t.spec).map_err(|e| format!("the run's spec is not a spec: {e}"))?;
    let questions: Vec<Question> =
        serde_json::from_str(&t.questions).map_err(|e| format!("the questions are not a list of questions: {e}"))?;
    let editable = t.editable.split(',').map(str::trim).filter(|f| !f.is_empty()).map(str::to_string).collect();
    let due = (!due.trim().is_empty()).then(|| to_rfc3339(due)).transpose()?;
    Ok(NewAssignment {
        title: t.title.trim().to_string(),
        instructions: t.instructions.clone(),
        spec,
        editable,
        due,
        questions,
    })
}

/// A `datetime-local` input's value ("2026-12-01T09:00", the browser's time zone) as UTC.
fn to_rfc3339(local: &str) -> Result<String, String> {
    let date = js_sys::Date::new(&wasm_bindgen::JsValue::from_str(local));
    if date.get_time().is_nan() {
        return Err(format!("the due date '{local}' is not a date"));
    }
    Ok(String::from(date.to_iso_string()))
}

#[component]
pub fn NewAssignmentForm(on_created: impl Fn() + Send + Sync + 'static) -> impl IntoView {
    let first = Texts::of(&ready_made()[0]);
    let title = RwSignal::new(first.title);
    let instructions = RwSignal::new(first.instructions);
    let spec = RwSignal::new(first.spec);
    let editable = RwSignal::new(first.editable);
    let questions = RwSignal::new(first.questions);
    let due = RwSignal::new(String::new());
    let outcome = RwSignal::new(None::<Result<(i64, String), RequestError>>);
    let on_created = StoredValue::new(on_created);

    let start_from = move |ev: leptos::ev::Event| {
        let Some(a) = event_target_value(&ev).parse::<usize>().ok().and_then(|i| ready_made().into_iter().nth(i))
        else {
            return;
        };
        let t = Texts::of(&a);
        title.set(t.title);
        instructions.set(t.instructions);
        spec.set(t.spec);
        editable.set(t.editable);
        questions.set(t.questions);
    };
    let create = move |ev: leptos::ev::SubmitEvent| {
        ev.prevent_default();
        let texts = Texts {
            title: title.get_untracked(),
            instructions: instructions.get_untracked(),
            spec: spec.get_untracked(),
            editable: editable.get_untracked(),
            questions: questions.get_untracked(),
        };
        let body = match assignment(&texts, &due.get_untracked()) {
            Ok(body) => body,
            Err(message) => {
                outcome.set(Some(Err(RequestError { message, fields: Vec::new(), status: None })));
                return;
            }
        };
        leptos::task::spawn_local(async move {
            let made = api::create_assignment(&body).await;
            if made.is_ok() {
                on_created.with_value(|f| f());
            }
            outcome.try_set(Some(made.map(|a| (a.id, a.content.title))));
        });
    };

    let text_input = |id: &'static str, signal: RwSignal<String>| {
        view! { <input id=id autocomplete="off" prop:value=move || signal.get() on:input=move |ev| signal.set(event_target_value(&ev))/> }
    };
    let text_area = |id: &'static str, rows: &'static str, signal: RwSignal<String>| {
        view! { <textarea id=id rows=rows spellcheck="false" prop:value=move || signal.get() on:input=move |ev| signal.set(event_target_value(&ev))></textarea> }
    };
    view! {
        <section class="card" id="new-assignment">
            <h2>"Write an assignment"</h2>
            <form class="assignment-writer" on:submit=create>
                <label>"start from"
                    <select id="ready-made" on:change=start_from>
                        {ready_made().into_iter().enumerate().map(|(i, a)| view! { <option value=i.to_string()>{a.title}</option> }).collect_view()}
                    </select>
                </label>
                <label>"title" {text_input("assignment-title-input", title)}</label>
                <label>"instructions (Markdown)" {text_area("assignment-instructions-input", "8", instructions)}</label>
                <label>"the run every student starts from (spec, JSON)" {text_area("assignment-spec", "10", spec)}</label>
                <label>"fields students may change (comma-separated paths, e.g. parallel.dp)" {text_input("assignment-editable", editable)}</label>
                <label>"due (optional)"
                    <input id="assignment-due" type="datetime-local" prop:value=move || due.get() on:input=move |ev| due.set(event_target_value(&ev))/>
                </label>
                <label>"questions (JSON: each a prompt and an answer: number with a quantity and a tolerance, choice with a quantity and options, or text)"
                    {text_area("assignment-questions", "12", questions)}
                </label>
                <p class="muted small">"Quantities a run measures: final_loss, val_loss, tokens_per_s, mfu_percent, peak_memory_mib, dp_bytes_per_step, step_ms, bubble_percent. A number is right within its relative tolerance (0.05 is 5%) of the student's own run; a choice is right when it is the option whose value is nearest the run's."</p>
                <button class="button primary" id="create-assignment" type="submit">"Hand it out"</button>
            </form>
            {move || outcome.get().map(|o| match o {
                Ok((id, title)) => view! {
                    <p class="alert ok" id="assignment-created">
                        "Handed out: " <A href=format!("/assignments/{id}")>{title}</A>
                    </p>
                }.into_any(),
                Err(e) => view! { <Refusal id="assignment-create-refused" error=e/> }.into_any(),
            })}
        </section>
    }
}
