//! "Find a layout": the planner page's model and cluster, a number of GPUs and a global
//! batch, searched on the server (`POST /api/plan/layouts`): the ten fastest layouts that
//! fit, why each is slower than the first, and what could not run. "Use" loads a layout
//! into the page's form.

use distlab_common::estimate::Cluster;
use distlab_common::layout_search::{Candidate, SearchRequest, SearchResult};
use distlab_common::ExperimentSpec;
use leptos::prelude::*;

use crate::api;
use crate::format;

#[component]
pub fn LayoutSearch(spec: RwSignal<ExperimentSpec>, cluster: RwSignal<Cluster>) -> impl IntoView {
    let gpus = RwSignal::new(spec.with_untracked(|s| s.world_size()).to_string());
    let batch = RwSignal::new(spec.with_untracked(|s| s.global_batch()).to_string());
    let result = RwSignal::new(None::<SearchResult>);
    let error = RwSignal::new(None::<String>);
    let busy = RwSignal::new(false);
    let run = move |_| {
        let whole = |s: RwSignal<String>, what: &str| {
            s.get()
                .trim()
                .parse::<u32>()
                .ok()
                .filter(|&n| n >= 1)
                .ok_or(format!("{what}: '{}' is not a whole number of at least 1", s.get()))
        };
        let request = (|| -> Result<SearchRequest, String> {
            let s = spec.get();
            Ok(SearchRequest {
                model: s.model.clone(),
                cluster: cluster.get().with_gpus(u64::from(whole(gpus, "GPUs")?)),
                global_batch: whole(batch, "global batch")? as usize,
                precision: s.train.precision,
                attention: s.train.attention,
            })
        })();
        let request = match request {
            Ok(r) => r,
            Err(e) => return error.set(Some(e)),
        };
        busy.set(true);
        error.set(None);
        leptos::task::spawn_local(async move {
            match api::search_layouts(&request).await {
                Ok(found) => {
                    result.try_set(Some(found));
                }
                Err(e) => {
                    let fields: Vec<String> = e.fields.iter().map(|f| f.to_string()).collect();
                    error.try_set(Some(if fields.is_empty() { e.message } else { fields.join("; ") }));
                }
            }
            busy.try_set(false);
        });
    };
    view! {
        <section class="card" id="layout-search">
            <h2>"Find a layout"</h2>
            <p class="muted">
                "Every way to spread this model over the GPUs (dp × tp × pp, schedule, sharding, micro-batch, checkpointing), planned and timed by the estimate above; the ten fastest that fit, and why each is slower than the first."
            </p>
            <div class="planner-form">
                <label>"GPUs " <input type="number" min="1" name="search-gpus" prop:value=move || gpus.get() on:input=move |ev| gpus.set(event_target_value(&ev))/></label>
                <label>"global batch (sequences) " <input type="number" min="1" name="search-batch" prop:value=move || batch.get() on:input=move |ev| batch.set(event_target_value(&ev))/></label>
                <button class="button primary" id="search-layouts" disabled=move || busy.get() on:click=run>
                    {move || if busy.get() { "Searching…" } else { "Search layouts" }}
                </button>
            </div>
            {move || error.get().map(|e| view! { <p class="alert error" id="search-error">{e}</p> })}
            {move || result.get().map(|r| results_view(r, spec))}
        </section>
    }
}

fn results_view(r: SearchResult, spec: RwSignal<ExperimentSpec>) -> impl IntoView {
    let summary = format!("{} layouts planned, {} fit; the fastest {}:", r.examined, r.fitting, r.best.len());
    let row = move |(rank, c): (usize, Candidate)| {
        // "Use" takes the layout only: the mesh and its settings, the micro-batching, the
        // checkpointing; the form's optimizer, steps, data and precision stay.
        let chosen = c.spec.clone();
        let use_it = move |_| {
            let (p, t) = (&chosen.parallel, &chosen.train);
            spec.update(|s| {
                (s.parallel.dp, s.parallel.tp, s.parallel.pp) = (p.dp, p.tp, p.pp);
                (s.parallel.sharding, s.parallel.pp_schedule, s.parallel.virtual_stages) =
                    (p.sharding, p.pp_schedule, p.virtual_stages);
                (s.train.micro_batch, s.train.micro_batches, s.train.grad_accum) = (t.micro_batch, t.micro_batches, 1);
                s.train.checkpointing = t.checkpointing;
            });
        };
        view! {
            <tr data-rank=rank>
                <td class="num">{rank + 1}</td>
                <td>{c.layout}</td>
                <td class="num">{format!("{:.3} s", c.step_seconds)}</td>
                <td class="num">{format::percent(c.mfu)}</td>
                <td class="num">{format!("{:.1} GB", c.memory_per_gpu_bytes as f64 / 1e9)}</td>
                <td class="small">{c.loses_by.unwrap_or_else(|| "the fastest".into())}</td>
                <td><button class="button" on:click=use_it>"Use"</button></td>
            </tr>
        }
    };
    let too_big = (!r.too_big.is_empty()).then(|| {
        view! {
            <p class="small">"Faster, but too big:"</p>
            <ul class="notes">{r.too_big.into_iter().map(|c| view! {
                <li class="note warn">{format!("{} ({:.3} s): {}", c.layout, c.step_seconds, c.loses_by.unwrap_or_default())}</li>
            }).collect_view()}</ul>
        }
    });
    view! {
        <p id="search-summary">{summary}</p>
        <table class="data" id="search-results">
            <thead><tr><th>"#"</th><th>"layout"</th><th>"step"</th><th>"MFU"</th><th>"busiest GPU"</th><th>"why it is slower"</th><th></th></tr></thead>
            <tbody>{r.best.into_iter().enumerate().map(row).collect_view()}</tbody>
        </table>
        {too_big}
        <ul class="notes" id="search-rejected">{r.rejected.into_iter().map(|x| view! {
            <li class="note">{format!("{} layouts: {} (e.g. {})", x.count, x.reason, x.example)}</li>
        }).collect_view()}</ul>
        <p class="muted small">"Step time and MFU are the estimate's: compute at peak FLOP/s, communication by the alpha–beta model, data-parallel traffic not overlapped. Published runs measure lower MFU (Megatron-LM: 44–52% on A100s) than it predicts."</p>
    }
}
