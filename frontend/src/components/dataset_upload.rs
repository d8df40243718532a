//! Bring your own text: upload a file (`POST /api/datasets`) or pick one uploaded before
//! (`GET /api/datasets`); either sets the form's `data.dataset` to "upload" and its
//! `data.upload_id`.

use distlab_common::DatasetView;
use leptos::prelude::*;
use wasm_bindgen::JsCast;

use crate::api;
use crate::format;
use crate::load::load_keeping;

#[component]
pub fn DatasetUpload(
    /// The form's `data.dataset` and `data.upload_id` texts.
    dataset: RwSignal<String>,
    upload_id: RwSignal<String>,
    on_edit: impl Fn() + Copy + Send + Sync + 'static,
) -> impl IntoView {
    // A list that fails to load or refresh leaves the last one (or none) on the form.
    let (datasets, _) = load_keeping(api::list_datasets);
    let message = RwSignal::new(None::<(bool, String)>);
    let busy = RwSignal::new(false);
    let choose = move |d: &DatasetView| {
        dataset.set("upload".into());
        upload_id.set(d.id.to_string());
        on_edit();
    };
    let on_change = move |ev: leptos::ev::Event| {
        let Some(input) = ev.target().and_then(|t| t.dyn_into::<web_sys::HtmlInputElement>().ok()) else { return };
        let Some(file) = input.files().and_then(|f| f.get(0)) else { return };
        input.set_value("");
        let name = file.name();
        let name = name.rsplit_once('.').map_or(name.as_str(), |(stem, _)| stem).to_string();
        busy.set(true);
        message.set(None);
        leptos::task::spawn_local(async move {
            match api::upload_dataset(&name, file).await {
                Ok(d) => {
                    message.try_set(Some((
                        true,
                        format!(
                            "uploaded \"{}\": {} (dataset {}, seq_len up to {})",
                            d.name,
                            format::bytes(d.bytes as f64),
                            d.id,
                            d.max_seq_len
                        ),
                    )));
                    choose(&d);
                    // On the list at once (newest first), then the list as the server has it.
                    datasets.try_update(|answer| {
                        if let Some(Ok(list)) = answer {
                            list.datasets.retain(|old| old.id != d.id);
                            list.datasets.insert(0, d);
                        }
                    });
                    datasets.refetch();
                }
                Err(e) => {
                    let fields: Vec<String> = e.fields.iter().map(|f| f.message.clone()).collect();
                    message.try_set(Some((false, if fields.is_empty() { e.message } else { fields.join("; ") })));
                }
            }
            busy.try_set(false);
        });
    };
    view! {
        <div class="dataset-upload" id="dataset-upload">
            <label class="button">
                {move || if busy.get() { "Uploading…" } else { "Upload a text file…" }}
                <input type="file" id="dataset-file" accept=".txt,text/plain" class="visually-hidden"
                    disabled=move || busy.get() on:change=on_change/>
            </label>
            <small class="help">"UTF-8 text, one token per byte (vocab ≥ 256); its last tenth is held out for the validation loss"</small>
            {move || message.get().map(|(ok, text)| view! {
                <p class=if ok { "note" } else { "alert error" } id="dataset-message">{text}</p>
            })}
            {move || {
                let list = datasets.get().and_then(Result::ok).map(|l| l.datasets).unwrap_or_default();
                (!list.is_empty()).then(|| view! {
                    <ul class="dataset-list" id="datasets">
                        {list.into_iter().map(|d| {
                            let id = d.id;
                            let chosen = move || dataset.get() == "upload" && upload_id.get() == id.to_string();
                            let label = format!("{} · {} · {}", d.name, format::bytes(d.bytes as f64), d.owner);
                            view! {
                                <li class:chosen=chosen data-dataset=id>
                                    <button type="button" class="button" on:click=move |_| choose(&d)>"Use"</button>
                                    " " {label}
                                </li>
                            }
                        }).collect_view()}
                    </ul>
                })
            }}
        </div>
    }
}
