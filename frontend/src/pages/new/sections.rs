//! The form's sections: one fieldset per part of the spec (model, data, parallelism,
//! training, ...), each field with its problems, the data section with the upload, and
//! the collective demo's section with its switch.

use leptos::prelude::*;

use super::{training_only, ErrorList, FieldInput, FormField, DEMO, SECTIONS};
use crate::components::dataset_upload::DatasetUpload;

#[component]
pub(super) fn FormSections(
    fields: StoredValue<Vec<FormField>>,
    demo_on: RwSignal<bool>,
    /// A field's (or a section's) problems, local and from the server.
    errors_for: Callback<&'static str, Vec<String>>,
    on_edit: impl Fn() + Copy + Send + Sync + 'static,
) -> impl IntoView {
    SECTIONS
        .iter()
        .map(|section| {
            let inputs = section
                .fields
                .iter()
                .map(|def| {
                    let field = fields.with_value(|fs| fs.iter().find(|f| std::ptr::eq(f.def, def)).copied());
                    let unused = Signal::derive(move || demo_on.get() && training_only(def.path));
                    field.map(|field| view! { <FieldInput field=field errors=Signal::derive(move || errors_for.run(field.def.path)) on_edit=on_edit unused=unused/> })
                })
                .collect_view();
            let key = section.key;
            if key == DEMO {
                return view! {
                    <fieldset class="section demo-section" class:on=move || demo_on.get() data-section=key id="demo-section">
                        <legend>
                            <label class="toggle">
                                <input
                                    type="checkbox"
                                    id="demo-enabled"
                                    prop:checked=move || demo_on.get()
                                    on:change=move |ev| { demo_on.set(event_target_checked(&ev)); on_edit(); }
                                />
                                {section.title}
                            </label>
                        </legend>
                        <ErrorList messages=Signal::derive(move || errors_for.run(key)) field=key/>
                        {move || if demo_on.get() {
                            view! {
                                <p class="muted small demo-help">
                                    "No model is trained: dp rank processes (set dp under Parallelism: it is the ring size W) run one collective "
                                    "on a small vector, rank r starting with (r+1)·100 + i, and record every ring step for the replay. "
                                    "The greyed-out fields keep their values but are not used."
                                </p>
                            }.into_any()
                        } else {
                            view! {
                                <p class="muted small demo-help">
                                    "Tick to run one all-reduce, reduce-scatter or all-gather across the dp ranks instead of training, "
                                    "and watch it step by step on the ring replay."
                                </p>
                            }.into_any()
                        }}
                        <div class="fields" class:hidden=move || !demo_on.get()>{inputs}</div>
                    </fieldset>
                }
                .into_any();
            }
            let all_training_only = section.fields.iter().all(|d| training_only(d.path));
            let value_of = |path: &str| fields.with_value(|fs| fs.iter().find(|f| f.def.path == path).map(|f| f.value));
            let upload = match (key, value_of("data.dataset"), value_of("data.upload_id")) {
                ("data", Some(dataset), Some(upload_id)) => {
                    Some(view! { <DatasetUpload dataset=dataset upload_id=upload_id on_edit=on_edit/> })
                }
                _ => None,
            };
            view! {
                <fieldset class="section" class:unused=move || all_training_only && demo_on.get() data-section=key>
                    <legend>
                        {section.title}
                        {move || (all_training_only && demo_on.get()).then(|| view! { <span class="unused-tag">" — not used by a collective demo"</span> })}
                    </legend>
                    <ErrorList messages=Signal::derive(move || errors_for.run(key)) field=key/>
                    <div class="fields">{inputs}</div>
                    {upload}
                </fieldset>
            }
            .into_any()
        })
        .collect_view()
}
