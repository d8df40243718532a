//! A coloured label for an experiment's status.

use distlab_common::ExperimentStatus;
use leptos::prelude::*;

#[component]
pub fn StatusBadge(
    #[prop(into)] status: Signal<ExperimentStatus>,
    /// An element id, for the one badge of a page that tests look for (`status`).
    #[prop(optional)]
    id: Option<&'static str>,
) -> impl IntoView {
    view! {
        <span
            id=id
            class=move || format!("badge badge-{}", status.get().as_str())
            data-status=move || status.get().as_str()
        >
            {move || status.get().as_str()}
        </span>
    }
}
