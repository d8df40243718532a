//! `/`: every experiment, newest first, refreshed every 1.5 s. Ticking 2 to 6 of them
//! and pressing "Compare" opens `/compare?ids=...`.

use std::time::Duration;

use distlab_common::compare::{MAX_RUNS, MIN_RUNS};
use distlab_common::ExperimentView;
use leptos::prelude::*;
use leptos_router::components::A;
use leptos_router::hooks::use_navigate;

use crate::api;
use crate::components::progress::ProgressBar;
use crate::components::spec_view::one_line;
use crate::components::status_badge::StatusBadge;
use crate::format;
use crate::load::{load, refresh_every, Loaded};

const PAGE: u32 = 100;

#[component]
pub fn ExperimentList() -> impl IntoView {
    let list = load(|| async {
        api::list_experiments(PAGE).await.map(|mut l| {
            l.experiments.sort_by_key(|e| std::cmp::Reverse(e.id));
            (l.experiments, l.total)
        })
    });
    refresh_every(list, Duration::from_millis(1500));

    // The ticked experiments, in the order they were ticked (the first is the baseline).
    let selected = RwSignal::new(Vec::<i64>::new());
    let navigate = use_navigate();
    let compare = move |_| {
        let ids = selected.get_untracked();
        if (MIN_RUNS..=MAX_RUNS).contains(&ids.len()) {
            let list = ids.iter().map(i64::to_string).collect::<Vec<_>>().join(",");
            navigate(&format!("/compare?ids={list}"), Default::default());
        }
    };
    view! {
        <section class="card">
            <div class="card-head">
                <h1>"Experiments"</h1>
                <div class="head-actions">
                    <button class="button" id="compare-selected"
                        disabled=move || !(MIN_RUNS..=MAX_RUNS).contains(&selected.with(Vec::len))
                        title=format!("tick {MIN_RUNS} to {MAX_RUNS} experiments")
                        on:click=compare>
                        {move || format!("Compare ({})", selected.with(Vec::len))}
                    </button>
                    <A href="/new" attr:class="button primary" attr:id="new-experiment">"+ New experiment"</A>
                </div>
            </div>
            {Loaded::new(list).view(move |(items, total)| {
                if items.is_empty() {
                    view! {
                        <p class="empty" id="no-experiments">
                            "No experiments yet. " <A href="/new">"Start one"</A>
                            " — the tiny preset trains in seconds."
                        </p>
                    }
                        .into_any()
                } else {
                    let more = (total > items.len() as u64)
                        .then(|| format!("showing the newest {} of {total}", items.len()));
                    view! {
                        <table class="experiments" id="experiments">
                            <thead>
                                <tr>
                                    <th class="pick" title="tick runs to compare">"cmp"</th>
                                    <th class="num">"#"</th>
                                    <th>"name"</th>
                                    <th>"status"</th>
                                    <th class="progress-col">"progress (steps)"</th>
                                    <th>"created"</th>
                                    <th></th>
                                </tr>
                            </thead>
                            <tbody>{items.into_iter().map(|e| row(e, selected)).collect_view()}</tbody>
                        </table>
                        {more.map(|m| view! { <p class="muted">{m}</p> })}
                    }
                        .into_any()
                }
            })}
        </section>
    }
}

fn row(e: ExperimentView, selected: RwSignal<Vec<i64>>) -> impl IntoView {
    let id = e.id;
    let href = format!("/experiments/{}", e.id);
    let status = e.status;
    let created = e.created_at.clone();
    view! {
        <tr class="experiment-row" data-id=e.id.to_string() data-status=status.as_str()>
            <td class="pick">
                <input type="checkbox" class="compare-pick" aria-label=format!("compare experiment {id}")
                    prop:checked=move || selected.with(|s| s.contains(&id))
                    on:change=move |ev| {
                        let on = event_target_checked(&ev);
                        selected.update(|s| {
                            s.retain(|x| *x != id);
                            if on && s.len() < MAX_RUNS {
                                s.push(id);
                            }
                        });
                    }/>
            </td>
            <td class="num">{e.id}</td>
            <td>
                <A href=href.clone() attr:class="experiment-link">{e.name.clone()}</A>
                <div class="muted small">{one_line(&e.spec)}</div>
            </td>
            <td><StatusBadge status=status/></td>
            <td class="progress-col">
                {match &e.spec.demo {
                    Some(demo) => view! { <span class="muted small">{format!("{} demo", demo.op.as_str())}</span> }.into_any(),
                    None => view! { <ProgressBar done=e.steps_done total=e.spec.train.steps/> }.into_any(),
                }}
            </td>
            <td class="created">
                <span title=created.clone()>{format::local_time(&created)}</span>
                <div class="muted small">{format::ago(&created)}</div>
            </td>
            <td><A href=href attr:class="button small">"open"</A></td>
        </tr>
    }
}
