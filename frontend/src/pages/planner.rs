//! `/planner`: plan a model of any size on a cluster, in the browser (the planner and the
//! estimate are `distlab_common` compiled to wasm). Memory per GPU by category with a
//! "fits?" line, communication per axis, the bubble, step time and MFU; "Run it small"
//! submits the same layout shrunk to this lab, so the prediction meets a measurement.
//!
//! `?spec=<JSON>` fills the form (the fields given over the defaults): flashcards link
//! here with their example filled in.

use distlab_common::estimate::{cluster_presets, estimate, model_presets, AxisComm, Cluster, Estimate, NoteLevel};
use distlab_common::planner::{self, Plan};
use distlab_common::recipes::{self, recipes, Recipe};
use distlab_common::scale_down::run_it_small;
use distlab_common::{ExperimentSpec, Limits};
use leptos::prelude::*;
use leptos_router::hooks::{use_navigate, use_query_map};
use serde_json::json;

use crate::api;
use crate::components::doc_link::DocLink;
use crate::components::layout_search::LayoutSearch;
use crate::components::plan_panel::{PlanPanel, PlanState};
use crate::format;

/// The largest value a whole-number field takes (the planner's products stay far inside u64;
/// Llama-3's vocabulary is 128,256).
const MAX_FIELD: usize = 1_000_000;

/// DDP's gradient buckets as the frameworks size them for real models: PyTorch DDP's
/// `bucket_cap_mb` default, 25 MiB. (The lab's own runs default to 1 MiB buckets, sized
/// for its models of a few MiB.)
const FRAMEWORK_BUCKET_BYTES: u64 = 25 << 20;

/// The page's starting point: GPT-2 124M, data parallel on one 8-GPU node, bf16, PyTorch
/// DDP's buckets.
fn default_spec() -> ExperimentSpec {
    let mut spec = ExperimentSpec { name: "planned".into(), ..ExperimentSpec::default() };
    if let Some(gpt2) = model_presets().into_iter().next() {
        spec.model = gpt2.model;
    }
    spec.parallel.dp = 8;
    spec.parallel.bucket_bytes = FRAMEWORK_BUCKET_BYTES;
    spec.train.micro_batch = 8;
    spec.train.precision = distlab_common::Precision::Bf16;
    spec
}

/// The form's first spec: `?spec=` (fields over the page's defaults), else the defaults.
fn initial_spec(raw: Option<String>) -> (ExperimentSpec, Option<String>) {
    let Some(raw) = raw.filter(|r| !r.trim().is_empty()) else { return (default_spec(), None) };
    let given: serde_json::Value = match serde_json::from_str(&raw) {
        Ok(v) => v,
        Err(e) => return (default_spec(), Some(format!("the spec in the link is not JSON: {e}"))),
    };
    let mut base = serde_json::to_value(default_spec()).unwrap_or_default();
    merge(&mut base, given);
    match ExperimentSpec::from_json_value(base) {
        Ok(spec) => (spec, None),
        Err(errors) => (
            default_spec(),
            Some(format!(
                "the spec in the link is not valid: {}",
                errors.iter().map(|e| e.to_string()).collect::<Vec<_>>().join("; ")
            )),
        ),
    }
}

/// `over` written into `base`, object by object.
fn merge(base: &mut serde_json::Value, over: serde_json::Value) {
    match (base, over) {
        (serde_json::Value::Object(b), serde_json::Value::Object(o)) => {
            for (k, v) in o {
                merge(b.entry(k).or_insert(serde_json::Value::Null), v);
            }
        }
        (b, o) => *b = o,
    }
}

#[component]
pub fn PlannerPage() -> impl IntoView {
    let query = use_query_map();
    let (first, link_error) = initial_spec(query.read_untracked().get("spec"));
    let spec = RwSignal::new(first);
    let cluster = RwSignal::new(Cluster::default());
    let recipe = RwSignal::new(None::<Recipe>);
    let plan = Memo::new(move |_| spec.with(planner::plan));
    let plan_state = Signal::derive(move || match plan.get() {
        Ok(p) => PlanState::Ready { plan: Box::new(p), spec: Box::new(spec.get()), stale: false },
        Err(errors) => PlanState::Impossible(errors),
    });
    let estimated =
        Memo::new(move |_| plan.get().ok().map(|p: Plan| spec.with(|s| estimate(s, &p, &cluster.get().for_spec(s)))));

    view! {
        <section class="card" id="planner-page">
            <h1>"Plan a training run"</h1>
            <DocLink page="planner"/>
            <p class="muted">
                "Any model on any cluster: what each GPU holds, what it sends, how long a step takes and how much of the hardware does useful work. "
                "The planner is the one the lab's runs are checked against; the time model adds peak FLOP/s and an alpha–beta network (latency per message + bytes / bandwidth)."
            </p>
            {link_error.map(|e| view! { <p class="alert error" id="link-error">{e}</p> })}
            <label class="recipe-pick">"a recipe from the study chapter "
                <select id="recipe" on:change=move |ev| {
                    let key = event_target_value(&ev);
                    let found = recipes().into_iter().find(|r| r.key == key);
                    if let Some(r) = &found {
                        spec.set(r.spec.clone());
                        cluster.set(r.cluster.clone());
                    }
                    recipe.set(found);
                }>
                    <option value="">"(none)"</option>
                    {recipes().into_iter().map(|r| view! { <option value=r.key.clone()>{r.label.clone()}</option> }).collect_view()}
                </select>
            </label>
            {move || recipe.get().map(|r| recipe_view(r, spec, cluster))}
            <div class="planner-form">
                <fieldset>
                    <legend>"Model"</legend>
                    <label>"preset "
                        <select id="model-preset"
                            prop:value=move || spec.with(|s| model_presets().into_iter().find(|p| p.model == s.model).map(|p| p.key).unwrap_or_default())
                            on:change=move |ev| {
                            let key = event_target_value(&ev);
                            if let Some(p) = model_presets().into_iter().find(|p| p.key == key) {
                                spec.update(|s| s.model = p.model);
                            }
                        }>
                            <option value="">"(custom)"</option>
                            {model_presets().into_iter().map(|p| view! { <option value=p.key.clone()>{p.label.clone()}</option> }).collect_view()}
                        </select>
                    </label>
                    {number(spec, "layers", |s| s.model.layers, |s, v| s.model.layers = v)}
                    {number(spec, "d_model", |s| s.model.d_model, |s, v| s.model.d_model = v)}
                    {number(spec, "heads", |s| s.model.heads, |s, v| s.model.heads = v)}
                    {number(spec, "seq_len", |s| s.model.seq_len, |s, v| s.model.seq_len = v)}
                    {number(spec, "vocab", |s| s.model.vocab, |s, v| s.model.vocab = v)}
                    {choice(spec, "family", &["gpt2", "llama"], |s| json_str(&s.model.family),
                        |s, v| if let Ok(x) = serde_json::from_value(json!(v)) { s.model.family = x })}
                    {number(spec, "kv_heads", |s| s.model.kv_heads, |s, v| s.model.kv_heads = v)}
                    {number(spec, "ffn_hidden", |s| s.model.ffn_hidden, |s, v| s.model.ffn_hidden = v)}
                    {choice(spec, "head", &["untied", "tied"], |s| if s.model.tie_embeddings { "tied" } else { "untied" }.to_string(),
                        |s, v| s.model.tie_embeddings = v == "tied")}
                    {number(spec, "experts", |s| s.model.experts, |s, v| s.model.experts = v)}
                    {number(spec, "expert_top_k", |s| s.model.expert_top_k, |s, v| s.model.expert_top_k = v)}
                </fieldset>
                <fieldset>
                    <legend>"Parallelism"</legend>
                    {number(spec, "dp", |s| s.parallel.dp, |s, v| s.parallel.dp = v)}
                    {number(spec, "tp", |s| s.parallel.tp, |s, v| s.parallel.tp = v)}
                    {number(spec, "pp", |s| s.parallel.pp, |s, v| s.parallel.pp = v)}
                    {number(spec, "ep", |s| s.parallel.ep, |s, v| s.parallel.ep = v)}
                    {number(spec, "cp", |s| s.parallel.cp, |s, v| s.parallel.cp = v)}
                    {choice(spec, "sharding", &["none", "zero1", "zero2", "fsdp", "hsdp"], |s| s.parallel.sharding.as_str().to_string(),
                        |s, v| if let Ok(x) = serde_json::from_value(json!(v)) { s.parallel.sharding = x })}
                    {choice(spec, "pp_schedule", &["1f1b", "gpipe", "interleaved", "zb-h1", "zbv", "dualpipev"], |s| json_str(&s.parallel.pp_schedule),
                        |s, v| if let Ok(x) = serde_json::from_value(json!(v)) { s.parallel.pp_schedule = x })}
                    {number(spec, "virtual_stages", |s| s.parallel.virtual_stages, |s, v| s.parallel.virtual_stages = v)}
                    {number(spec, "bucket_mib", |s| (s.parallel.bucket_bytes >> 20) as usize,
                        |s, v| s.parallel.bucket_bytes = (v.max(1) as u64) << 20)}
                    <p class="muted field-note" id="bucket-note">{move || bucket_note(spec.with(|s| s.parallel.bucket_bytes))}</p>
                </fieldset>
                <fieldset>
                    <legend>"Training"</legend>
                    {number(spec, "micro_batch", |s| s.train.micro_batch, |s, v| s.train.micro_batch = v)}
                    {number(spec, "micro_batches", |s| s.train.micro_batches, |s, v| s.train.micro_batches = v)}
                    {number(spec, "grad_accum", |s| s.train.grad_accum, |s, v| s.train.grad_accum = v)}
                    {choice(spec, "precision", &["fp32", "bf16", "fp16"], |s| json_str(&s.train.precision),
                        |s, v| if let Ok(x) = serde_json::from_value(json!(v)) { s.train.precision = x })}
                    {choice(spec, "checkpointing", &["none", "selective", "every", "sqrt"], |s| json_str(&s.train.checkpointing),
                        |s, v| if let Ok(x) = serde_json::from_value(json!(v)) { s.train.checkpointing = x })}
                    {choice(spec, "activation_offload", &["none", "host", "disk"], |s| json_str(&s.train.activation_offload),
                        |s, v| if let Ok(x) = serde_json::from_value(json!(v)) { s.train.activation_offload = x })}
                    {choice(spec, "optimizer", &["adamw", "sgd", "lamb", "lars"], |s| json_str(&s.train.optimizer),
                        |s, v| if let Ok(x) = serde_json::from_value(json!(v)) { s.train.optimizer = x })}
                </fieldset>
                <ClusterFields cluster=cluster/>
            </div>
        </section>
        <section class="card" id="estimate">
            {move || match estimated.get() {
                Some(e) => estimate_view(e, cluster.get()).into_any(),
                None => view! { <p class="muted">"No estimate: the planner cannot plan this spec (below)."</p> }.into_any(),
            }}
        </section>
        <LayoutSearch spec=spec cluster=cluster/>
        <section class="card"><PlanPanel state=plan_state/></section>
        <RunItSmall spec=spec/>
    }
}

/// What the bucket size means, and where the page's default comes from.
fn bucket_note(bytes: u64) -> String {
    let size = if bytes.is_multiple_of(1 << 20) { format!("{} MiB", bytes >> 20) } else { format!("{bytes} bytes") };
    let whose = if bytes == FRAMEWORK_BUCKET_BYTES {
        " (PyTorch DDP's default bucket_cap_mb; the lab's own small runs use 1 MiB)"
    } else {
        ""
    };
    format!(
        "DDP and ZeRO-1 all-reduce the gradients in buckets of {size}{whose}: one ring all-reduce, 2(W-1) messages, per bucket. Smaller buckets start sooner under backward but pay the latency per message more often."
    )
}

fn json_str<T: serde::Serialize>(x: &T) -> String {
    serde_json::to_value(x).ok().and_then(|v| v.as_str().map(str::to_string)).unwrap_or_default()
}

/// A whole-number field bound to one spec value; text that is not a number leaves the spec as it was.
fn number(
    spec: RwSignal<ExperimentSpec>,
    name: &'static str,
    get: fn(&ExperimentSpec) -> usize,
    set: fn(&mut ExperimentSpec, usize),
) -> impl IntoView {
    let bad = RwSignal::new(false);
    let on_input = move |ev: leptos::ev::Event| match event_target_value(&ev).trim().parse::<usize>() {
        Ok(v) if v <= MAX_FIELD => {
            bad.set(false);
            spec.update(|s| set(s, v));
        }
        _ => bad.set(true),
    };
    view! {
        <label>{name}" "
            <input type="number" min="0" max=MAX_FIELD name=name class:invalid=move || bad.get()
                title=format!("a whole number up to {MAX_FIELD}")
                prop:value=move || spec.with(get).to_string() on:input=on_input/>
        </label>
    }
}

fn choice(
    spec: RwSignal<ExperimentSpec>,
    name: &'static str,
    options: &'static [&'static str],
    get: fn(&ExperimentSpec) -> String,
    set: fn(&mut ExperimentSpec, &str),
) -> impl IntoView {
    view! {
        <label>{name}" "
            <select name=name prop:value=move || spec.with(get) on:change=move |ev| {
                let v = event_target_value(&ev);
                spec.update(|s| set(s, &v));
            }>
                {options.iter().map(|o| view! { <option value=*o selected=spec.with_untracked(get) == *o>{*o}</option> }).collect_view()}
            </select>
        </label>
    }
}

#[component]
fn ClusterFields(cluster: RwSignal<Cluster>) -> impl IntoView {
    // Rates are edited in the units people quote: GB, GB/s, TFLOP/s, microseconds.
    let field = move |name: &'static str, unit: f64, get: fn(&Cluster) -> f64, set: fn(&mut Cluster, f64)| {
        let on_change = move |ev: leptos::ev::Event| {
            if let Ok(v) = event_target_value(&ev).trim().parse::<f64>() {
                if v.is_finite() && v >= 0.0 {
                    cluster.update(|c| set(c, v * unit));
                }
            }
        };
        view! {
            <label>{name}" "
                <input type="number" min="0" step="any" name=name
                    prop:value=move || format!("{}", (cluster.with(get) / unit * 1000.0).round() / 1000.0)
                    on:change=on_change/>
            </label>
        }
    };
    view! {
        <fieldset>
            <legend>"Cluster"</legend>
            <label>"GPU "
                <select id="cluster-preset" on:change=move |ev| {
                    let key = event_target_value(&ev);
                    if let Some(p) = cluster_presets().into_iter().find(|p| p.key == key) { cluster.set(p.cluster); }
                }>
                    {cluster_presets().into_iter().map(|p| view! { <option value=p.key.clone()>{p.label.clone()}</option> }).collect_view()}
                </select>
            </label>
            {field("GPUs per node", 1.0, |c| c.gpus_per_node as f64, |c, v| c.gpus_per_node = v as u64)}
            {field("GPU memory (GB)", 1e9, |c| c.gpu_memory_bytes as f64, |c, v| c.gpu_memory_bytes = v as u64)}
            {field("bf16/fp16 TFLOP/s", 1e12, |c| c.peak_flops_bf16, |c, v| { c.peak_flops_bf16 = v; c.peak_flops_fp16 = v; })}
            {field("fp32 TFLOP/s", 1e12, |c| c.peak_flops_fp32, |c, v| c.peak_flops_fp32 = v)}
            {field("intra-node GB/s", 1e9, |c| c.intra_node_bytes_per_s, |c, v| c.intra_node_bytes_per_s = v)}
            {field("inter-node GB/s", 1e9, |c| c.inter_node_bytes_per_s, |c, v| c.inter_node_bytes_per_s = v)}
            {field("latency (µs)", 1e-6, |c| c.latency_s, |c, v| c.latency_s = v)}
        </fieldset>
    }
}

/// GPU memory is sold in decimal GB; the planner's panel below counts in GiB: both here.
fn gb(bytes: f64) -> String {
    format!("{:.1} GB ({:.1} GiB)", bytes / 1e9, bytes / (1u64 << 30) as f64)
}

fn seconds(s: f64) -> String {
    if s >= 1.0 {
        format!("{s:.2} s")
    } else {
        format!("{:.2} ms", s * 1000.0)
    }
}

fn estimate_view(e: Estimate, cluster: Cluster) -> impl IntoView {
    let fits_line = if e.fits {
        format!(
            "Fits: {} of {} per GPU ({} to spare)",
            gb(e.memory_per_gpu_bytes as f64),
            gb(e.gpu_memory_bytes as f64),
            gb(e.headroom_bytes as f64)
        )
    } else {
        format!(
            "Does not fit: {} per GPU, the GPU has {} ({} short)",
            gb(e.memory_per_gpu_bytes as f64),
            gb(e.gpu_memory_bytes as f64),
            gb(-(e.headroom_bytes as f64))
        )
    };
    let axis_row = |name: &'static str, a: &AxisComm| {
        (a.group_size > 1).then(|| {
            view! {
                <tr data-axis=name>
                    <td>{name}</td>
                    <td class="num">{a.group_size}</td>
                    <td>{if a.crosses_nodes { "across nodes" } else { "inside a node" }}</td>
                    <td class="num">{format!("{:.0} GB/s", a.bytes_per_s / 1e9)}</td>
                    <td class="num">{format::bytes(a.bytes_per_rank as f64)}</td>
                    <td class="num">{a.messages}</td>
                    <td class="num">{seconds(a.seconds)}</td>
                </tr>
            }
        })
    };
    let any_comm = [&e.dp, &e.tp, &e.pp].iter().any(|a| a.group_size > 1);
    view! {
        <h2>"On the cluster"</h2>
        <p class=if e.fits { "fits yes" } else { "fits no" } id="fits" data-fits=e.fits.to_string()>
            <strong>{fits_line}</strong>
            <span class="muted small">{format!(" · {} GPUs on {} node(s) of {}", e.world_size, e.nodes, cluster.gpus_per_node)}</span>
        </p>
        <div class="derived planner-stats">
            <div><span class="k">"step time"</span><span class="v" id="step-time">{seconds(e.step_seconds)}</span></div>
            <div><span class="k">"tokens / s"</span><span class="v">{format::si(e.tokens_per_second)}</span></div>
            <div><span class="k">"MFU"</span><span class="v" id="mfu">{format::percent(e.mfu)}</span></div>
            <div><span class="k">"HFU (with recompute)"</span><span class="v">{format::percent(e.hfu)}</span></div>
            <div><span class="k">"compute at peak (busiest stage)"</span><span class="v">{seconds(e.compute_seconds)}</span></div>
            <div><span class="k">"pipeline bubble"</span><span class="v">{seconds(e.bubble_seconds)}</span></div>
            <div><span class="k">"exposed comm"</span><span class="v">{seconds(e.exposed_comm_seconds)}</span></div>
        </div>
        <p class="muted small">"MFU = (6 × parameters × tokens + attention FLOPs) / (step time × GPUs × peak FLOP/s). Compute runs at peak and data-parallel communication is counted as not overlapped, so the step time is a first-order estimate."</p>
        {any_comm.then(|| view! {
            <h3>"Communication per step, by axis"</h3>
            <table class="data" id="axis-comm">
                <thead><tr><th>"axis"</th><th>"group"</th><th>"placement"</th><th>"bandwidth"</th><th>"bytes per rank"</th><th>"messages"</th><th>"time"</th></tr></thead>
                <tbody>{axis_row("dp", &e.dp)}{axis_row("tp", &e.tp)}{axis_row("pp", &e.pp)}</tbody>
            </table>
        })}
        <ul class="notes" id="estimate-notes">
            {e.notes.into_iter().map(|n| view! {
                <li class=if n.level == NoteLevel::Warning { "note warn" } else { "note" }>{n.text}</li>
            }).collect_view()}
        </ul>
    }
}

/// A recipe's setup and the planner's verdict on what the recipe states: each stated
/// figure next to the planner's, the arithmetic under each, the ones more than 2x apart
/// marked. The verdict is for the recipe as written (the form may since have changed).
fn recipe_view(r: Recipe, spec: RwSignal<ExperimentSpec>, cluster: RwSignal<Cluster>) -> impl IntoView {
    let verdict = recipes::verdict(&r);
    let (as_written_spec, as_written_cluster) = (r.spec.clone(), r.cluster.clone());
    let edited = move || !(spec.with(|s| *s == as_written_spec) && cluster.with(|c| *c == as_written_cluster));
    let body = match verdict {
        Err(e) => view! { <p class="alert error">{e}</p> }.into_any(),
        Ok(v) => {
            let fits = if v.fits {
                format!("fits: {} of {} per GPU", gb(v.memory_per_gpu_bytes as f64), gb(v.gpu_memory_bytes as f64))
            } else {
                let smaller = v
                    .fits_with
                    .map(|(m, a)| {
                        format!("; {m} sequences per micro-step and {a} accumulation steps (the same global batch) fit")
                    })
                    .unwrap_or_default();
                format!(
                    "does not fit as written: {} per GPU, the GPU has {}{smaller}",
                    gb(v.memory_per_gpu_bytes as f64),
                    gb(v.gpu_memory_bytes as f64)
                )
            };
            let rows = v.figures.into_iter().map(|f| view! {
                <tr class=if f.far_off { "far-off" } else { "" } data-far-off=f.far_off.to_string()>
                    <td>{f.what}</td>
                    <td class="num">{f.stated}</td>
                    <td class="num">{f.planner}</td>
                    <td class="num">{if f.far_off { format!("{:.2}x: more than 2x apart", f.ratio) } else { format!("{:.2}x", f.ratio) }}</td>
                    <td class="small">{f.arithmetic}</td>
                </tr>
            }).collect_view();
            view! {
                <p id="recipe-fits" data-fits=v.fits.to_string()><strong>{fits}</strong>
                    {format!(" · step {} at {} MFU", seconds(v.step_seconds), format::percent(v.mfu))}</p>
                <table class="data" id="recipe-figures">
                    <thead><tr><th>"the recipe says"</th><th>"stated"</th><th>"planner"</th><th>"planner / stated"</th><th>"how the planner gets it"</th></tr></thead>
                    <tbody>{rows}</tbody>
                </table>
            }.into_any()
        }
    };
    view! {
        <div class="recipe" id="recipe-verdict" data-recipe=r.key.clone()>
            <p><strong>{r.label.clone()}</strong>": "{r.setup.clone()}</p>
            {body}
            <ul class="notes">{r.caveats.into_iter().map(|c| view! { <li class="note">{c}</li> }).collect_view()}</ul>
            <Show when=edited><p class="muted small" id="recipe-edited">"The form has changed since: the verdict above is for the recipe as written."</p></Show>
        </div>
    }
}

/// The same layout shrunk to this lab, submitted as an experiment.
#[component]
fn RunItSmall(spec: RwSignal<ExperimentSpec>) -> impl IntoView {
    let small = Memo::new(move |_| spec.with(|s| run_it_small(s, &Limits::default())));
    let error = RwSignal::new(None::<String>);
    let busy = RwSignal::new(false);
    let navigate = use_navigate();
    let submit = move |_| {
        if busy.get_untracked() {
            return;
        }
        busy.set(true);
        error.set(None);
        let (small_spec, _) = small.get_untracked();
        let navigate = navigate.clone();
        leptos::task::spawn_local(async move {
            let body = serde_json::to_value(&small_spec).unwrap_or_default();
            match api::create_experiment(&body).await {
                Ok(created) => navigate(&format!("/experiments/{}", created.id), Default::default()),
                Err(e) => {
                    let fields: Vec<String> = e.fields.iter().map(|f| f.to_string()).collect();
                    error.try_set(Some(if fields.is_empty() { e.message } else { fields.join("; ") }));
                    busy.try_set(false);
                }
            }
        });
    };
    view! {
        <section class="card" id="run-it-small">
            <h2>"Run it small"</h2>
            {move || {
                let (s, changes) = small.get();
                let (p, m) = (&s.parallel, &s.model);
                view! {
                    <p>
                        {format!(
                            "The same layout in this lab: dp={} × tp={} × pp={}, sharding {}, {} schedule, {} micro-batches, {}, checkpointing {}; a {}-layer d{} model for {} steps. ",
                            p.dp, p.tp, p.pp, p.sharding.as_str(), json_str(&p.pp_schedule), s.train.micro_batches,
                            json_str(&s.train.precision), json_str(&s.train.checkpointing), m.layers, m.d_model, s.train.steps
                        )}
                        "Its memory page puts every rank's measured bytes next to the planner's prediction for the small spec."
                    </p>
                    <ul class="muted small">{changes.into_iter().map(|c| view! { <li>{c}</li> }).collect_view()}</ul>
                }
            }}
            <button class="button primary" id="run-small" disabled=move || busy.get() on:click=submit>"Run it small"</button>
            {move || error.get().map(|e| view! { <p class="alert error">{e}</p> })}
        </section>
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_link_fills_the_fields_it_names_over_the_defaults() {
        let (spec, error) = initial_spec(Some(
            r#"{"parallel": {"dp": 4, "sharding": "zero2"}, "train": {"precision": "fp16"}}"#.into(),
        ));
        assert_eq!(error, None);
        assert_eq!(spec.parallel.dp, 4);
        assert_eq!(spec.parallel.sharding, distlab_common::Sharding::Zero2);
        assert_eq!(spec.model, default_spec().model, "unnamed fields keep the page's defaults");
        let (spec, error) = initial_spec(Some("{not json".into()));
        assert!(error.unwrap().contains("not JSON"));
        assert_eq!(spec, default_spec());
        let (_, error) = initial_spec(Some(r#"{"parallel": {"dq": 4}}"#.into()));
        assert!(error.unwrap().contains("not valid"));
    }
}
