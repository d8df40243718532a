//! A progress bar for optimizer steps: `done / total`.

use leptos::prelude::*;

#[component]
pub fn ProgressBar(#[prop(into)] done: Signal<u64>, #[prop(into)] total: Signal<u64>) -> impl IntoView {
    let percent = move || {
        let total = total.get();
        if total == 0 {
            0.0
        } else {
            (done.get() as f64 / total as f64 * 100.0).clamp(0.0, 100.0)
        }
    };
    view! {
        <div
            class="progress"
            role="progressbar"
            aria-valuemin="0"
            aria-valuemax=move || total.get().to_string()
            aria-valuenow=move || done.get().to_string()
        >
            <div class="progress-fill" style:width=move || format!("{:.1}%", percent())></div>
            <span class="progress-text">{move || format!("{} / {}", done.get(), total.get())}</span>
        </div>
    }
}
