//! The top of an experiment's page: its name, status and live-stream state, the cancel
//! button while it runs, its timestamps, and why it waits, failed or was cancelled.

use distlab_common::{ExperimentStatus, ExperimentView};
use leptos::prelude::*;

use super::Live;
use crate::api;
use crate::components::status_badge::StatusBadge;
use crate::format;

#[component]
pub(super) fn RunHeader(
    view: ExperimentView,
    live: Live,
    /// A request that failed here (cancel), or the stream that could not open.
    action_error: RwSignal<Option<String>>,
    /// Loads the experiment again (after a cancel).
    reload: Callback<()>,
) -> impl IntoView {
    let Live { status, error, stream_state, .. } = live;
    let (id, name) = (view.id, view.name.clone());
    let cancel = move |_| {
        action_error.set(None);
        leptos::task::spawn_local(async move {
            match api::cancel_experiment(id).await {
                Ok(()) => reload.run(()),
                Err(e) => _ = action_error.try_set(Some(format!("could not cancel: {}", e.message))),
            }
        });
    };
    view! {
        <div class="card-head">
            <h1>
                <span id="experiment-name">{name.clone()}</span>
                <span class="muted id">" #" {id}</span>
            </h1>
            <StatusBadge status=status id="status"/>
            <span class=move || format!("stream stream-{}", stream_state.get())>
                {move || match stream_state.get() {
                    "live" => "live",
                    "reconnecting" => "reconnecting…",
                    "closed" => "stream ended",
                    _ => "connecting…",
                }}
            </span>
            <div class="spacer"></div>
            {move || {
                (!status.get().is_finished())
                    .then(|| view! { <button class="button danger" id="cancel" on:click=cancel>"Cancel"</button> })
            }}
        </div>
        <p class="muted small">
            "created " {format::local_time(&view.created_at)}
            {view.started_at.as_deref().map(|s| format!(" · started {}", format::local_time(s)))}
            {view.finished_at.as_deref().map(|s| format!(" · finished {}", format::local_time(s)))}
            {(view.attempt > 1).then(|| format!(" · attempt {}", view.attempt))}
        </p>
        {move || action_error.get().map(|e| view! { <p class="alert error">{e}</p> })}
        {move || (status.get() == ExperimentStatus::Queued)
            .then(|| view! { <p class="note" id="queued-note">"Waiting for a worker to pick it up…"</p> })}
        {move || (status.get() == ExperimentStatus::Failed).then(|| view! {
            <div class="alert error" id="error">
                <strong>"The run failed"</strong>
                <pre>{error.get().unwrap_or_else(|| "no error message was recorded".into())}</pre>
            </div>
        })}
        {move || (status.get() == ExperimentStatus::Cancelled).then(|| view! {
            <div class="alert" id="cancelled">
                <strong>"Cancelled"</strong>
                {error.get().map(|e| view! { <pre>{e}</pre> })}
            </div>
        })}
    }
}
