//! A flashcard profile's scheduling: the desired retention FSRS schedules for, and FSRS's
//! parameters fitted to the profile's own review log, with the fit's scores before and
//! after (log loss and binned RMSE of the predicted recalls, on that log).

use distlab_common::review::{NewReviewSettings, ParameterFit, RETENTION_RANGE};
use leptos::prelude::*;

use crate::api;
use crate::load::{load, Loaded};

/// The retentions offered, from `RETENTION_RANGE`.
const RETENTIONS: [f32; 7] = [0.70, 0.75, 0.80, 0.85, 0.90, 0.95, 0.97];

/// The retentions to offer: the usual ones, and the profile's own if it is another.
fn offered(current: f32) -> Vec<f32> {
    let mut all: Vec<f32> = RETENTIONS.iter().copied().filter(|r| RETENTION_RANGE.contains(r)).collect();
    if !all.iter().any(|r| (r - current).abs() < 1e-4) {
        all.push(current);
        all.sort_by(f32::total_cmp);
    }
    all
}

#[component]
pub fn Scheduling(profile: i64) -> impl IntoView {
    let settings = load(move || api::review_settings(profile));
    let message = RwSignal::new(None::<(bool, String)>);
    let busy = RwSignal::new(false);
    let save = move |body: NewReviewSettings| {
        leptos::task::spawn_local(async move {
            match api::set_review_settings(profile, &body).await {
                Ok(s) => {
                    settings.try_set(Some(Ok(s)));
                    message.try_set(None);
                }
                Err(e) => {
                    message.try_set(Some((false, e.message)));
                }
            }
        });
    };
    let fit = move |_| {
        busy.set(true);
        message.set(Some((true, "fitting FSRS to your reviews…".into())));
        leptos::task::spawn_local(async move {
            match api::fit_parameters(profile).await {
                Ok(_) => {
                    message.try_set(None);
                }
                Err(e) => {
                    message.try_set(Some((false, e.message)));
                }
            }
            settings.refetch();
            busy.try_set(false);
        });
    };
    view! {
        <section class="card" id="scheduling">
            <h2>"Scheduling"</h2>
            {Loaded::new(settings)
                .loading(|| ())
                .error(|e| view! { <p class="alert error" id="scheduling-message">{e}</p> })
                .view(move |s| {
                let retention = s.desired_retention;
                let can_fit = s.repeat_reviews >= s.repeat_reviews_needed;
                view! {
                    <p>
                        <label>"bring a card back when the chance of recalling it falls to "
                            <select id="desired-retention" on:change=move |ev| {
                                if let Ok(r) = event_target_value(&ev).parse::<f32>() {
                                    save(NewReviewSettings { desired_retention: r, default_parameters: false });
                                }
                            }>
                                {offered(retention).into_iter().map(|r| {
                                    let chosen = (r - retention).abs() < 1e-4;
                                    view! { <option value=r.to_string() selected=chosen>{format!("{:.0}%", 100.0 * r)}</option> }
                                }).collect_view()}
                            </select>
                        </label>
                        <span class="muted small">" (lower: fewer reviews, more forgotten)"</span>
                    </p>
                    <p id="parameters-state" data-fitted=s.fitted.to_string()>
                        {if s.fitted { "FSRS's parameters: fitted to your reviews. ".to_string() } else { "FSRS's parameters: the defaults. ".to_string() }}
                        <span class="muted small">{format!("{} repeat reviews in your log; a fit needs {}.", s.repeat_reviews, s.repeat_reviews_needed)}</span>
                    </p>
                    <p>
                        <button class="button small" id="fit-parameters" disabled=move || !can_fit || busy.get() on:click=fit>"fit to my reviews"</button>
                        {s.fitted.then(|| view! {
                            <button class="button small secondary" id="default-parameters"
                                on:click=move |_| save(NewReviewSettings { desired_retention: retention, default_parameters: true })>"back to the defaults"</button>
                        })}
                    </p>
                    {s.fit.clone().map(fit_view)}
                }
                })}
            {move || message.get().map(|(ok, text)| view! {
                <p class=if ok { "muted small" } else { "alert error" } id="scheduling-message">{text}</p>
            })}
        </section>
    }
}

/// The latest fit: how well the parameters before and after predicted the log's recalls.
fn fit_view(fit: ParameterFit) -> impl IntoView {
    let changed =
        fit.before.parameters.iter().zip(&fit.after.parameters).filter(|(a, b)| (*a - *b).abs() > 1e-4).count();
    view! {
        <table class="data small" id="fit-scores">
            <thead><tr><th></th><th>"log loss"</th><th>"RMSE (bins)"</th></tr></thead>
            <tbody>
                <tr data-row="before"><td>"before"</td><td class="num">{format!("{:.4}", fit.before.log_loss)}</td><td class="num">{format!("{:.4}", fit.before.rmse_bins)}</td></tr>
                <tr data-row="after"><td>"fitted"</td><td class="num">{format!("{:.4}", fit.after.log_loss)}</td><td class="num">{format!("{:.4}", fit.after.rmse_bins)}</td></tr>
            </tbody>
        </table>
        <p class="muted small">{format!(
            "Fitted {} on {} repeat reviews: {changed} of the {} parameters moved. Both sets are scored on the same reviews: the lower, the better the predicted recalls matched yours.",
            fit.fitted_at, fit.repeat_reviews, fit.after.parameters.len()
        )}</p>
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_retention_set_elsewhere_is_offered_too() {
        assert_eq!(offered(0.9).len(), RETENTIONS.len());
        let with = offered(0.93);
        assert_eq!(with.len(), RETENTIONS.len() + 1);
        assert!(with.windows(2).all(|w| w[0] < w[1]) && with.contains(&0.93));
    }
}
