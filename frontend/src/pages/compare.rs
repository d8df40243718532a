//! `/compare?ids=1,2,3`: 2 to 6 runs side by side. The URL is the whole view's state, so
//! it can be shared. Loss curves overlaid (x: step or wall time, smoothing, seed bands),
//! the "equivalent?" verdicts, the summary table, the config diff, re-runs and exports.

use std::time::Duration;

use distlab_common::compare::{self, CompareView, ComparedRun, ConfigRow, Equivalence, RunStats};
use distlab_common::{ExperimentView, Limits};
use leptos::prelude::*;
use leptos_router::components::A;
use leptos_router::hooks::{use_navigate, use_query_map};

use crate::api;
use crate::components::doc_link::DocLink;
use crate::components::overlay_chart::{smooth, Band, OverlayChart, Series};
use crate::components::status_badge::StatusBadge;
use crate::format;
use crate::load::{load_keeping, loading_card, Loaded};

/// One color per compared run, in order (6 at most).
pub const COLORS: [&str; compare::MAX_RUNS] = ["#2563eb", "#dc2626", "#059669", "#d97706", "#7c3aed", "#0891b2"];

#[component]
pub fn ComparePage() -> impl IntoView {
    let query = use_query_map();
    let ids = Memo::new(move |_| compare::parse_ids(&query.read().get("ids").unwrap_or_default()));
    move || match ids.get() {
        Ok(ids) => view! { <Compare ids=ids/> }.into_any(),
        Err(e) => view! {
            <section class="card" id="compare-pick">
                <h1>"Compare runs"</h1>
                <p class="alert">{e}</p>
                <p>"Tick 2 to 6 experiments in " <A href="/">"the list"</A> " and press “Compare”."</p>
            </section>
        }
        .into_any(),
    }
}

#[derive(Clone, Copy, PartialEq)]
enum XAxis {
    Step,
    WallTime,
}

#[component]
fn Compare(ids: Vec<i64>) -> impl IntoView {
    let url = format!("/api/compare?ids={}", ids.iter().map(i64::to_string).collect::<Vec<_>>().join(","));
    // A refresh that fails leaves the last good view on the page, saying why.
    let (view_data, refresh_error) = load_keeping({
        let url = url.clone();
        move || {
            let url = url.clone();
            async move { api::get_compare(&url).await }
        }
    });
    // Refresh while a compared run is still queued or running.
    if let Ok(handle) = set_interval_with_handle(
        move || {
            let live = view_data.with_untracked(
                |v| matches!(v, Some(Ok(v)) if v.runs.iter().any(|r| !r.experiment.status.is_finished())),
            );
            if live {
                view_data.refetch();
            }
        },
        Duration::from_secs(2),
    ) {
        on_cleanup(move || handle.clear());
    }

    let x_axis = RwSignal::new(XAxis::Step);
    let smoothing = RwSignal::new(0.0f64);
    let diff_only = RwSignal::new(true);
    let ids_for_rerun = StoredValue::new(ids.clone());

    let error = |e| {
        view! { <section class="card"><h1>"Compare runs"</h1><p class="alert error" id="compare-error">{e}</p></section> }
    };
    Loaded::new(view_data).loading(loading_card).error(error).view(move |data| {
        let data = StoredValue::new(data);
        let series = Signal::derive(move || data.with_value(|d| curves(&d.runs, x_axis.get(), smoothing.get())));
        let bands = Signal::derive(move || data.with_value(|d| seed_bands(d, x_axis.get(), smoothing.get())));
        let x_title = Signal::derive(move || match x_axis.get() {
            XAxis::Step => "step".to_string(),
            XAxis::WallTime => "wall time (s, summed step times)".to_string(),
        });
        view! {
            <section class="card" id="compare">
                <div class="card-head">
                    <h1>"Compare runs"</h1>
                    <DocLink page="compare"/>
                    <div class="exports" id="exports">
                        "Export: "
                        <a class="button small" id="export-metrics-csv" href=format!("{url}&format=csv") download="">"metrics CSV"</a>
                        <a class="button small" id="export-summary-csv" href=format!("{url}&format=csv&table=summary") download="">"summary CSV"</a>
                        <a class="button small" id="export-json" href=format!("{url}&format=json") download="">"JSON"</a>
                    </div>
                </div>
                {move || refresh_error.get().map(|e| view! {
                    <p class="alert small">{format!("Could not refresh ({e}); showing the last answer, trying again.")}</p>
                })}
                <ul class="legend" id="legend">
                    {data.with_value(|d| d.runs.iter().enumerate().map(|(i, r)| legend_item(i, &r.experiment, ids_for_rerun)).collect_view())}
                </ul>
                <div class="chart-controls">
                    <label>"x axis "
                        <select id="x-axis" prop:value=move || if x_axis.get() == XAxis::Step { "step" } else { "time" }
                            on:change=move |ev| x_axis.set(if event_target_value(&ev) == "time" { XAxis::WallTime } else { XAxis::Step })>
                            <option value="step">"step"</option>
                            <option value="time">"wall time"</option>
                        </select>
                    </label>
                    <label>"smoothing "
                        <input id="smoothing" type="range" min="0" max="0.95" step="0.05" prop:value=move || smoothing.get().to_string()
                            on:input=move |ev| smoothing.set(event_target_value(&ev).parse().unwrap_or(0.0))/>
                        <span class="muted">{move || format!(" {:.2}", smoothing.get())}</span>
                    </label>
                </div>
                <div class="chart-wrap"><OverlayChart series=series bands=bands x_title=x_title/></div>
                {data.with_value(|d| (!d.seed_bands.is_empty()).then(|| view! {
                    <p class="muted small" id="seed-bands">
                        {d.seed_bands.iter().map(|b| format!("Shaded: min–max over runs {} (same spec, different seeds). ",
                            b.ids.iter().map(|i| format!("#{i}")).collect::<Vec<_>>().join(", "))).collect::<String>()}
                    </p>
                }))}
            </section>
            <section class="card" id="verdicts">
                <h2>"Equivalent?"</h2>
                {data.with_value(|d| d.equivalence.iter().map(verdict).collect_view())}
            </section>
            <section class="card">
                <h2>"Summary"</h2>
                {data.with_value(|d| summary_table(&d.runs))}
            </section>
            <section class="card" id="config">
                <div class="card-head">
                    <h2>"Configuration"</h2>
                    <label class="toggle">
                        <input type="checkbox" id="diff-only" prop:checked=move || diff_only.get()
                            on:change=move |ev| diff_only.set(event_target_checked(&ev))/>
                        " differences only"
                    </label>
                </div>
                {move || data.with_value(|d| config_table(d, diff_only.get()))}
            </section>
        }
    })
}

/// The curves as drawn: x in steps or in seconds since the start, losses smoothed.
fn curves(runs: &[ComparedRun], x_axis: XAxis, smoothing: f64) -> Vec<Series> {
    runs.iter()
        .enumerate()
        .map(|(i, run)| {
            let xs = x_values(&run.metrics, x_axis);
            let losses: Vec<f64> = run.metrics.iter().map(|p| p.loss).collect();
            Series {
                id: run.experiment.id,
                color: COLORS[i % COLORS.len()],
                points: xs.into_iter().zip(smooth(&losses, smoothing)).collect(),
            }
        })
        .collect()
}

/// Step numbers, or the wall time at the end of each step (the sum of step times so far).
fn x_values(metrics: &[distlab_common::MetricPoint], x_axis: XAxis) -> Vec<f64> {
    let mut elapsed = 0.0;
    metrics
        .iter()
        .map(|p| match x_axis {
            XAxis::Step => p.step as f64,
            XAxis::WallTime => {
                elapsed += p.step_ms / 1000.0;
                elapsed
            }
        })
        .collect()
}

/// Bands at each step, smoothed as the lines are; on the wall-time axis a band takes the
/// first run's times.
fn seed_bands(view: &CompareView, x_axis: XAxis, smoothing: f64) -> Vec<Band> {
    view.seed_bands
        .iter()
        .filter_map(|band| {
            let first = view.runs.iter().position(|r| Some(&r.experiment.id) == band.ids.first())?;
            let times: std::collections::BTreeMap<u64, f64> = view.runs[first]
                .metrics
                .iter()
                .map(|p| p.step)
                .zip(x_values(&view.runs[first].metrics, x_axis))
                .collect();
            let mins = smooth(&band.points.iter().map(|p| p.min).collect::<Vec<_>>(), smoothing);
            let maxs = smooth(&band.points.iter().map(|p| p.max).collect::<Vec<_>>(), smoothing);
            let points = band
                .points
                .iter()
                .zip(mins.into_iter().zip(maxs))
                .filter(|(_, (min, max))| min.is_finite() && max.is_finite())
                .filter_map(|(p, (min, max))| Some((*times.get(&p.step)?, min, max)))
                .collect();
            Some(Band { color: COLORS[first % COLORS.len()], points })
        })
        .collect()
}

fn legend_item(i: usize, e: &ExperimentView, ids: StoredValue<Vec<i64>>) -> impl IntoView {
    let color = COLORS[i % COLORS.len()];
    let spec = e.spec.clone();
    let source = e.id;
    let navigate = use_navigate();
    let busy = RwSignal::new(false);
    let error = RwSignal::new(None::<String>);
    let rerun = move |new_seed: bool| {
        if busy.get_untracked() {
            return;
        }
        busy.set(true);
        let mut spec = spec.clone();
        let base = spec.name.trim_end_matches(" (re-run)").to_string();
        spec.name = format!("{base} (re-run)").chars().take(Limits::default().max_name_len).collect();
        if new_seed {
            // A seed from the clock: different from every earlier run's with near certainty.
            spec.train.seed = (js_sys::Date::now() as u64) % 1_000_000_007;
        }
        let navigate = navigate.clone();
        leptos::task::spawn_local(async move {
            let body = serde_json::to_value(&spec).unwrap_or_default();
            match api::create_experiment(&body).await {
                Ok(created) => {
                    // A full view gives up its oldest run after the baseline (not the one re-run).
                    let mut ids = ids.get_value();
                    if ids.len() >= compare::MAX_RUNS {
                        if let Some(i) = (1..ids.len()).find(|&i| ids[i] != source) {
                            ids.remove(i);
                        }
                    }
                    ids.push(created.id);
                    let list = ids.iter().map(i64::to_string).collect::<Vec<_>>().join(",");
                    navigate(&format!("/compare?ids={list}"), Default::default());
                }
                Err(e) => {
                    error.try_set(Some(e.message));
                }
            }
            busy.try_set(false);
        });
    };
    let rerun_same = rerun.clone();
    view! {
        <li class="legend-item" data-id=e.id.to_string()>
            <span class="swatch" style=format!("background:{color}")></span>
            <A href=format!("/experiments/{}", e.id)>{format!("#{} {}", e.id, e.name)}</A>
            " " <StatusBadge status=e.status/>
            <span class="muted small">{format!(" seed {}", e.spec.train.seed)}</span>
            <button class="button small rerun" disabled=move || busy.get() on:click=move |_| rerun_same(false)>"re-run"</button>
            <button class="button small rerun-seed" disabled=move || busy.get() on:click=move |_| rerun(true)>"re-run, new seed"</button>
            {move || error.get().map(|e| view! { <span class="alert error small">{e}</span> })}
        </li>
    }
}

fn verdict(e: &Equivalence) -> impl IntoView {
    let (class, headline) = if e.equivalent {
        ("verdict yes", format!("#{} ≡ #{}: the same training, within the engine's tolerance", e.other, e.baseline))
    } else if !e.not_expected_because.is_empty() {
        (
            "verdict na",
            format!("#{} vs #{}: not expected to match — {}", e.other, e.baseline, e.not_expected_because.join("; ")),
        )
    } else if e.common_steps == 0 {
        ("verdict na", format!("#{} vs #{}: no common steps yet", e.other, e.baseline))
    } else {
        (
            "verdict no",
            format!("#{} vs #{}: expected to match, but they differ beyond the tolerance", e.other, e.baseline),
        )
    };
    let detail = match (e.max_abs_diff, e.max_rel_diff) {
        (Some(abs), Some(rel)) => format!(
            "max |loss difference| {} (relative {}) over {} common steps; tolerance {:.0e} relative per step",
            format::num(abs),
            format::num(rel),
            e.common_steps,
            e.tolerance
        ),
        _ => format!("tolerance {:.0e} relative per step", e.tolerance),
    };
    view! {
        <div class=class data-other=e.other.to_string() data-equivalent=e.equivalent.to_string()>
            <strong>{headline}</strong>
            <div class="muted small">{detail}</div>
        </div>
    }
}

fn opt(x: Option<f64>, f: fn(f64) -> String) -> String {
    x.map(f).unwrap_or_else(|| "–".into())
}

/// The data-parallel bytes a run's busiest rank sent per step: counted, NCCL's formula
/// (said so), or "not traced" for a run of several ranks that recorded no collective.
fn dp_bytes(s: &RunStats, world: usize) -> String {
    match s.dp_comm_bytes_per_step {
        Some(b) if s.dp_comm_bytes_from_formula => format!("{} (NCCL: formula)", format::bytes(b)),
        Some(b) => format::bytes(b),
        None if world > 1 && s.time_split.is_some() => "not traced".into(),
        None => "–".into(),
    }
}

fn summary_table(runs: &[ComparedRun]) -> impl IntoView {
    let rows = runs
        .iter()
        .enumerate()
        .map(|(i, run)| {
            let s: &RunStats = &run.stats;
            let split = s.time_split;
            let peak = s.peak_memory.clone();
            let mem = move |f: fn(&distlab_common::planner::RankMemory) -> u64| {
                peak.as_ref().map(|m| format::bytes(f(m) as f64)).unwrap_or_else(|| "–".into())
            };
            view! {
                <tr class="summary-row" data-id=run.experiment.id.to_string()>
                    <td><span class="swatch" style=format!("background:{}", COLORS[i % COLORS.len()])></span>{format!("#{}", run.experiment.id)}</td>
                    <td class="num">{run.experiment.spec.world_size()}</td>
                    <td class="num final-loss">{opt(s.final_loss, |l| format!("{l:.4}"))}</td>
                    <td class="num">{opt(s.tokens_per_s, format::si)}</td>
                    <td class="num">{opt(s.mfu, format::percent)}</td>
                    <td class="num">{opt(s.step_ms, |v| format!("{v:.1}"))}</td>
                    <td class="num">{opt(split.map(|t| t.compute_ms), |v| format!("{v:.1}"))}</td>
                    <td class="num">{opt(split.map(|t| t.comm_ms), |v| format!("{v:.1}"))}</td>
                    <td class="num">{opt(split.map(|t| t.idle_ms), |v| format!("{v:.1}"))}</td>
                    <td class="num">{mem(|m| m.parameters)}</td>
                    <td class="num">{mem(|m| m.gradients)}</td>
                    <td class="num">{mem(|m| m.optimizer_state)}</td>
                    <td class="num">{mem(|m| m.activations)}</td>
                    <td class="num">{mem(|m| m.total)}</td>
                    <td class="num">{dp_bytes(s, run.experiment.spec.world_size())}" / "{opt(s.predicted_dp_comm_bytes_per_step.map(|b| b as f64), format::bytes)}</td>
                    <td class="num">{opt(s.bubble, format::percent)}" / "{opt(s.predicted_bubble, format::percent)}</td>
                </tr>
            }
        })
        .collect_view();
    view! {
        <div class="table-scroll">
            <table class="data compare-summary" id="summary">
                <thead>
                    <tr>
                        <th>"run"</th><th>"ranks"</th><th>"final loss"</th><th>"tokens/s"</th>
                        <th title="model FLOP/s over the peak of the devices the run used">"MFU"</th><th>"step ms"</th>
                        <th title="forward, backward, optimizer">"compute ms"</th>
                        <th title="communication no compute ran under">"exposed comm ms"</th>
                        <th title="waiting: pipeline neighbours, the last bucket">"idle ms"</th>
                        <th>"params"</th><th>"grads"</th><th>"optimizer"</th><th>"activations"</th><th>"peak total"</th>
                        <th title="data-parallel bytes the busiest rank sent per step: measured / planner">"DP comm per step (measured / planned)"</th>
                        <th title="measured (the step replayed from its stages' passes with a core per stage) / the planner's (P-1)/(M+P-1)">"bubble"</th>
                    </tr>
                </thead>
                <tbody>{rows}</tbody>
            </table>
        </div>
        <p class="muted small">"Times per step and rank, from the recorded timelines (the first, warm-up step left out); tensor-parallel all-reduces count as communication, while FSDP and ZeRO gathers issued inside forward or the optimizer count as compute. Memory: each category's highest peak over the ranks."</p>
    }
}

fn config_table(view: &CompareView, diff_only: bool) -> impl IntoView {
    let shown: Vec<&ConfigRow> = view.config.iter().filter(|r| !diff_only || r.differs).collect();
    let empty = shown
        .is_empty()
        .then(|| view! { <p class="muted" id="no-differences">"The configurations are identical."</p> });
    let head = view.runs.iter().enumerate().map(|(i, r)| view! {
        <th><span class="swatch" style=format!("background:{}", COLORS[i % COLORS.len()])></span>{format!("#{}", r.experiment.id)}</th>
    }).collect_view();
    let rows = shown
        .into_iter()
        .map(|row| view! {
            <tr class="config-row" class:derived-row=row.derived class:differs=row.differs data-field=row.field.clone()>
                <td class="field">{row.field.clone()}</td>
                {row.values.iter().map(|v| view! { <td>{v.clone()}</td> }).collect_view()}
            </tr>
        })
        .collect_view();
    view! {
        <table class="data config-diff" id="config-diff">
            <thead><tr><th>"field"</th>{head}</tr></thead>
            <tbody>{rows}</tbody>
        </table>
        {empty}
        <p class="muted small">"Rows in italics are derived from the spec (world size, bytes per parameter, the planner's predictions)."</p>
    }
}
