//! `/experiments/:id`: one experiment, live. The server-sent event stream feeds the
//! status, the metric points (the loss chart grows while it runs) and the log; the
//! REST endpoints fill in the rest (spec, timestamps) and cover a missed stream.
//! Once the ranks have stored their traces the page shows their timeline and links
//! to the ring replay; a collective demo shows its checked result instead of a loss.
//! A training run shows every rank's memory: the planner's prediction from the start,
//! the measured memory next to it once the run has ended and its ranks reported it.

use std::time::Duration;

use distlab_common::elastic::latest_checkpoint;
use distlab_common::memory::MemoryView;
use distlab_common::trace::ExperimentTrace;
use distlab_common::{
    AttemptView, CollectiveCheck, DemoOp, ExperimentSpec, ExperimentStatus, ExperimentView, ExpertMetrics, LogLevel,
    LogLine, MetricPoint, Precision, RunSummary, StreamEvent,
};
use leptos::prelude::*;
use leptos_router::components::A;
use leptos_router::hooks::use_params_map;

use crate::api::{self, EventStream};
use crate::components::loss_chart::{LossChart, Reference};
use crate::components::memory_section::{predicted_only, MemorySection};
use crate::components::progress::ProgressBar;
use crate::components::spec_view::{one_line, SpecView};
use crate::components::status_badge::StatusBadge;
use crate::components::timeline::{RankSpans, Timeline};
use crate::components::try_model::TryModel;
use crate::format;
use crate::ring_replay::ring_collectives;

/// Log lines kept on the page.
const MAX_LOG: usize = 300;

#[component]
pub fn ExperimentPage() -> impl IntoView {
    let params = use_params_map();
    let id = Memo::new(move |_| params.read().get("id").and_then(|s| s.parse::<i64>().ok()));
    move || match id.get() {
        Some(id) => view! { <ExperimentDetail id=id/> }.into_any(),
        None => view! {
            <section class="card">
                <p class="alert error">"This is not an experiment id. " <A href="/">"Back to the list"</A></p>
            </section>
        }
        .into_any(),
    }
}

/// What one attempt did, in a line.
fn attempt_line(a: &AttemptView) -> String {
    let worker = a.worker.as_deref().unwrap_or("a worker that is gone");
    let start = match a.from_step {
        None => "has not reported where it starts yet".to_string(),
        Some(0) if a.attempt == 1 => "started at step 0".to_string(),
        Some(0) => "started over at step 0 (no complete checkpoint)".to_string(),
        Some(step) => format!("resumed from the checkpoint of step {step}"),
    };
    let lost = match a.lost_steps {
        0 => String::new(),
        1 => " · 1 step lost and run again".to_string(),
        n => format!(" · {n} steps lost and run again"),
    };
    format!("attempt {} on {worker}: {start}{lost}", a.attempt)
}

/// Inserts a point in step order; a point for a step already present replaces it
/// (the stream replays stored points when it reconnects).
fn merge_point(points: &mut Vec<MetricPoint>, p: MetricPoint) {
    match points.last() {
        Some(last) if last.step < p.step => points.push(p),
        None => points.push(p),
        _ => match points.binary_search_by_key(&p.step, |q| q.step) {
            Ok(i) => points[i] = p,
            Err(i) => points.insert(i, p),
        },
    }
}

#[component]
fn ExperimentDetail(id: i64) -> impl IntoView {
    let experiment = RwSignal::new(None::<Result<ExperimentView, String>>);
    let status = RwSignal::new(None::<ExperimentStatus>);
    let points = RwSignal::new(Vec::<MetricPoint>::new());
    let error = RwSignal::new(None::<String>);
    let summary = RwSignal::new(None::<RunSummary>);
    let logs = RwSignal::new(Vec::<LogLine>::new());
    let stream_state = RwSignal::new("connecting");
    let attempts = RwSignal::new(Vec::<AttemptView>::new());
    let action_error = RwSignal::new(None::<String>);
    let now = RwSignal::new(format::now_ms());
    let trace = RwSignal::new(None::<ExperimentTrace>);
    // The server's memory view; fetched with the trace (the memory comes with the traces).
    let memory = RwSignal::new(None::<MemoryView>);
    // One trace request at a time; a request asked for meanwhile runs after it.
    let trace_loading = StoredValue::new(false);
    let trace_again = StoredValue::new(false);

    let reload = move || {
        leptos::task::spawn_local(async move {
            if let Ok(a) = api::get_attempts(id).await {
                attempts.try_set(a.attempts);
            }
            match api::get_experiment(id).await {
                Ok(view) => {
                    // The stream's status is at least as fresh, except when the run has finished.
                    if status.get_untracked().is_none() || view.status.is_finished() {
                        status.try_set(Some(view.status));
                    }
                    if view.error.is_some() {
                        error.try_set(view.error.clone());
                    }
                    if view.summary.is_some() {
                        summary.try_set(view.summary.clone());
                    }
                    experiment.try_set(Some(Ok(view)));
                }
                Err(e) => {
                    if experiment.get_untracked().is_none() {
                        experiment.try_set(Some(Err(e.message)));
                    }
                }
            }
        })
    };
    reload();
    leptos::task::spawn_local(async move {
        if let Ok(m) = api::get_metrics(id).await {
            points.try_update(|ps| m.steps.into_iter().for_each(|p| merge_point(ps, p)));
        }
    });

    /// Fetches the traces and the memory view, which is built from them.
    fn load_trace(
        id: i64,
        trace: RwSignal<Option<ExperimentTrace>>,
        memory: RwSignal<Option<MemoryView>>,
        loading: StoredValue<bool>,
        again: StoredValue<bool>,
    ) {
        if loading.get_value() {
            again.set_value(true);
            return;
        }
        loading.set_value(true);
        leptos::task::spawn_local(async move {
            loop {
                again.set_value(false);
                if let Ok(t) = api::get_trace(id).await {
                    if trace.try_set(Some(t)).is_some() {
                        // The page is gone.
                        break;
                    }
                }
                if let Ok(m) = api::get_memory(id).await {
                    if memory.try_set(Some(m)).is_some() {
                        break;
                    }
                }
                if !again.get_value() {
                    break;
                }
            }
            loading.set_value(false);
        });
    }
    let load_trace = move || load_trace(id, trace, memory, trace_loading, trace_again);
    // Ranks store their traces at the end of a run: fetch once it has finished (and
    // again for any trace that arrives after that).
    Effect::new(move |fetched: Option<bool>| {
        let finished = status.get().is_some_and(|s| s.is_finished());
        if finished && fetched != Some(true) {
            load_trace();
        }
        finished
    });

    let on_event = move |event: StreamEvent| {
        stream_state.try_set("live");
        match event {
            StreamEvent::Status(change) => {
                let changed = status.get_untracked() != Some(change.status);
                status.try_set(Some(change.status));
                if change.error.is_some() {
                    error.try_set(change.error);
                }
                if change.summary.is_some() {
                    summary.try_set(change.summary);
                }
                if changed {
                    reload();
                }
            }
            // A new attempt redoes the steps from its checkpoint on: drop the old points.
            StreamEvent::Start { from_step } => {
                points.try_update(|ps| ps.retain(|p| p.step < from_step));
                reload();
            }
            StreamEvent::Metric(p) => {
                points.try_update(|ps| merge_point(ps, p));
            }
            StreamEvent::Log(line) => {
                logs.try_update(|l| {
                    l.push(line);
                    if l.len() > MAX_LOG {
                        l.drain(..l.len() - MAX_LOG);
                    }
                });
            }
            // Traces are fetched from /trace: now, if the run is over (else when it ends).
            StreamEvent::Trace { .. } => {
                if status.get_untracked().is_some_and(|s| s.is_finished()) {
                    load_trace();
                }
            }
        }
    };
    let on_error = move |source: &web_sys::EventSource| {
        // The server ends the stream when the experiment has finished: stop, or the
        // browser would reconnect and replay it forever.
        if status.get_untracked().is_some_and(|s| s.is_finished()) {
            source.close();
            stream_state.try_set("closed");
        } else {
            stream_state.try_set("reconnecting");
        }
    };
    match EventStream::open(id, on_event, on_error) {
        // Dropped (and closed) with this page.
        Ok(stream) => _ = StoredValue::new_local(stream),
        Err(e) => action_error.set(Some(e.message)),
    }
    if let Ok(handle) = set_interval_with_handle(move || now.set(format::now_ms()), Duration::from_secs(1)) {
        on_cleanup(move || handle.clear());
    }

    let cancel = move |_| {
        action_error.set(None);
        leptos::task::spawn_local(async move {
            match api::cancel_experiment(id).await {
                Ok(()) => reload(),
                Err(e) => _ = action_error.try_set(Some(format!("could not cancel: {}", e.message))),
            }
        });
    };

    move || match experiment.get() {
        None => view! { <section class="card"><p class="muted">"loading…"</p></section> }.into_any(),
        Some(Err(e)) => view! {
            <section class="card">
                <h1>"Experiment " {id}</h1>
                <p class="alert error" id="error">{e}</p>
                <p><A href="/">"Back to the list"</A></p>
            </section>
        }
        .into_any(),
        Some(Ok(view)) => {
            let spec = view.spec.clone();
            let view_spec = spec.clone();
            let memory_spec = spec.clone();
            let total = spec.train.steps;
            let vocab = spec.model.vocab.max(1) as f64;
            let mixed = spec.train.precision != Precision::Fp32;
            let name = view.name.clone();
            let started = view.started_at.clone();
            let finished = view.finished_at.clone();
            let steps_done_server = view.steps_done;
            let status_now = Signal::derive(move || status.get().unwrap_or(ExperimentStatus::Queued));
            let latest = move || points.with(|p| p.last().cloned());
            let steps_done = Signal::derive(move || {
                points.with(|p| p.last().map_or(0, |p| p.step + 1)).max(steps_done_server).min(total)
            });
            let refs = Signal::derive(move || {
                let s = summary.get();
                let uniform =
                    s.as_ref().map(|s| s.uniform_loss).filter(|u| u.is_finite() && *u > 0.0).unwrap_or(vocab.ln());
                let mut refs = vec![Reference {
                    class: "ref-uniform",
                    value: uniform,
                    label: format!("uniform guess: ln({}) = {:.3}", vocab as u64, uniform),
                    below: false,
                }];
                if let Some(floor) = s.and_then(|s| s.loss_floor) {
                    refs.push(Reference {
                        class: "ref-floor",
                        value: floor,
                        label: format!("loss floor (entropy rate) = {floor:.3}"),
                        below: true,
                    });
                }
                refs
            });
            let title = format!("{name} (#{id}): training loss");
            let subtitle = one_line(&spec);
            let elapsed = move || {
                let start = started.as_deref().and_then(format::parse_time)?;
                let end = match finished.as_deref().and_then(format::parse_time) {
                    Some(end) => end,
                    None if status_now.get().is_finished() => return None,
                    None => now.get(),
                };
                Some(format::duration((end - start) / 1000.0))
            };
            view! {
                <section class="card">
                    <div class="card-head">
                        <h1>
                            <span id="experiment-name">{name.clone()}</span>
                            <span class="muted id">" #" {id}</span>
                        </h1>
                        <StatusBadge status=status_now id="status"/>
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
                            (!status_now.get().is_finished())
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
                    {move || (status_now.get() == ExperimentStatus::Queued)
                        .then(|| view! { <p class="note" id="queued-note">"Waiting for a worker to pick it up…"</p> })}
                    {move || (status_now.get() == ExperimentStatus::Failed).then(|| view! {
                        <div class="alert error" id="error">
                            <strong>"The run failed"</strong>
                            <pre>{error.get().unwrap_or_else(|| "no error message was recorded".into())}</pre>
                        </div>
                    })}
                    {move || (status_now.get() == ExperimentStatus::Cancelled).then(|| view! {
                        <div class="alert" id="cancelled">
                            <strong>"Cancelled"</strong>
                            {error.get().map(|e| view! { <pre>{e}</pre> })}
                        </div>
                    })}

                    {match spec.demo.clone() {
                        Some(demo) => view! {
                            <DemoOverview spec=spec.clone() op=demo.op elements=demo.elements/>
                            {move || {
                                let check = summary.get().filter(|_| status_now.get() == ExperimentStatus::Succeeded).and_then(|s| s.collective);
                                check.map(|c| view! { <CollectivePanel id=id check=c/> })
                            }}
                        }
                        .into_any(),
                        None => view! {
                            <div class="stats" id="stats">
                                <div class="stat wide">
                                    <span class="k">"step"</span>
                                    <span class="v" id="step">{move || format!("{} / {}", steps_done.get(), total)}</span>
                                    <ProgressBar done=steps_done total=total/>
                                </div>
                                <div class="stat">
                                    <span class="k">"loss"</span>
                                    <span class="v" id="loss">{move || latest().map(|p| format!("{:.4}", p.loss)).unwrap_or("–".into())}</span>
                                </div>
                                <div class="stat">
                                    <span class="k">"tokens / s"</span>
                                    <span class="v" id="tokens-per-s">{move || latest().map(|p| format::si(p.tokens_per_s)).unwrap_or("–".into())}</span>
                                </div>
                                <div class="stat">
                                    <span class="k">"learning rate"</span>
                                    <span class="v" id="lr">{move || latest().map(|p| format::num(p.lr)).unwrap_or("–".into())}</span>
                                </div>
                                <div class="stat">
                                    <span class="k">"grad norm"</span>
                                    <span class="v" id="grad-norm">{move || latest().map(|p| grad_norm_text(p.grad_norm)).unwrap_or("–".into())}</span>
                                </div>
                                {move || latest().and_then(|p| p.loss_scale.map(|scale| (scale, p.skipped_steps.unwrap_or(0)))).map(|(scale, skipped)| view! {
                                    <div class="stat" title="fp16 dynamic loss scaling: the loss is multiplied by this before backward; a step whose gradient overflows is skipped and the scale halves">
                                        <span class="k">"loss scale"</span>
                                        <span class="v" id="loss-scale" data-scale=scale.to_string()>
                                            {match power_of_two(scale) {
                                                Some(e) => view! { "2"<sup>{e}</sup> }.into_any(),
                                                None => format::num(scale).into_any(),
                                            }}
                                        </span>
                                        <span class="k" id="skipped-steps">{format!("{skipped} skipped")}</span>
                                    </div>
                                })}
                                {move || latest().and_then(|p| p.logit_grad_zero_share).filter(|_| mixed).map(|share| view! {
                                    <div class="stat" title="measured: of this step's logit gradients (its first 64 tokens), the share stored as exactly 0. None is 0 in exact arithmetic, so in fp16 these are the ones that underflowed; loss scaling lifts them back">
                                        <span class="k">"logit grads stored as 0"</span>
                                        <span class="v" id="logit-zeros">{format!("{:.1}%", 100.0 * share)}</span>
                                    </div>
                                })}
                                {move || latest().and_then(|p| p.experts).map(|e| view! {
                                    <div class="stat" id="experts" title="Mixture of Experts, this step over every block, micro-batch and rank: the token-to-expert assignments the routers made, those an expert had no room for (its capacity was full: the token went on through the residual alone), and the routers' load-balancing loss (1 when even)">
                                        <span class="k">"dropped assignments"</span>
                                        <span class="v" id="dropped">{dropped_text(&e)}</span>
                                        <span class="k" id="balance">{format!("balance loss {:.3}", e.balance)}</span>
                                    </div>
                                })}
                                {move || points.with(|p| run_dropped(p)).map(|text| view! {
                                    <div class="stat" id="run-dropped" title="every step's dropped assignments so far, over every step's assignments">
                                        <span class="k">"dropped, whole run"</span>
                                        <span class="v">{text}</span>
                                    </div>
                                })}
                                <div class="stat">
                                    <span class="k">"step time"</span>
                                    <span class="v" id="step-ms">{move || latest().map(|p| format!("{:.1} ms", p.step_ms)).unwrap_or("–".into())}</span>
                                </div>
                                <div class="stat">
                                    <span class="k">"elapsed"</span>
                                    <span class="v" id="elapsed">{move || elapsed().unwrap_or("–".into())}</span>
                                </div>
                            </div>

                            <div class="chart-wrap">
                                <LossChart points=points total_steps=total refs=refs title=title subtitle=subtitle/>
                            </div>

                            {move || {
                                let s = summary.get().filter(|_| status_now.get() == ExperimentStatus::Succeeded)?;
                                Some(match s.collective.clone() {
                                    Some(c) => view! { <CollectivePanel id=id check=c/> }.into_any(),
                                    None => view! { <SummaryPanel summary=s/> }.into_any(),
                                })
                            }}
                        }
                        .into_any(),
                    }}
                    {move || trace.with(|t| t.as_ref().map(|t| ring_collectives(t).len())).filter(|&n| n > 0 && spec_demo_none(&view_spec))
                        .map(|n| view! {
                            <p class="replay-line">
                                <A href=format!("/experiments/{id}/ring") attr:class="button" attr:id="replay-link">"Replay the ring →"</A>
                                " " {format!("{n} collective{} recorded step by step", if n == 1 { "" } else { "s" })}
                            </p>
                        })}
                    {move || {
                        let list = attempts.get();
                        (list.len() > 1).then(|| view! {
                            <div class="attempts" id="attempts">
                                <h3>"Attempts"</h3>
                                <p class="muted small">
                                    "A worker that stops answering loses its lease and the experiment goes back to the queue; "
                                    "the next worker resumes from the latest complete checkpoint. The steps run after that checkpoint were lost and are run again."
                                </p>
                                <ul>
                                    {list.iter().map(|a| view! {
                                        <li class="attempt">{attempt_line(a)} <span class="muted">" · leased " {format::local_time(&a.started_at)}</span></li>
                                    }).collect_view()}
                                </ul>
                            </div>
                        })
                    }}
                    {(spec.demo.is_none() && spec.train.checkpoint_every > 0).then(|| {
                        let kept_by = spec.clone();
                        move || {
                            let done = points.with(|p| p.last().map_or(0, |p| p.step + 1));
                            let step = latest_checkpoint(&kept_by, done).filter(|_| status_now.get().is_finished())?;
                            Some(view! {
                                <p class="replay-line">
                                    <A href=format!("/new?resume_from={id}&step={step}") attr:class="button" attr:id="continue-link">{format!("Continue from step {step} →")}</A>
                                    " in a new experiment with another dp or sharding: its checkpoint is re-cut for the new ranks, the global batch kept"
                                </p>
                            })
                        }
                    })}
                    {(spec.parallel.pp > 1).then(|| view! {
                        <p class="replay-line">
                            <A href=format!("/experiments/{id}/pipeline") attr:class="button" attr:id="pipeline-link">"Pipeline schedule →"</A>
                            " " {format!("{} stages, {} schedule: every forward and backward, and the bubble", spec.parallel.pp, match spec.parallel.pp_schedule {
                                distlab_common::spec::PpSchedule::Gpipe => "GPipe",
                                distlab_common::spec::PpSchedule::OneFOneB => "1F1B",
                                distlab_common::spec::PpSchedule::Interleaved => "interleaved 1F1B",
                                distlab_common::spec::PpSchedule::ZbH1 => "ZB-H1",
                            })}
                        </p>
                    })}
                </section>

                {distlab_common::export::not_exportable(&spec).is_none().then(|| {
                    let (text, vocab) = (spec.data.dataset.is_text(), spec.model.vocab);
                    move || (status_now.get() == ExperimentStatus::Succeeded).then(|| view! { <TryModel id=id text=text vocab=vocab/> })
                })}

                {move || {
                    let ranks: Vec<RankSpans> = trace.with(|t| {
                        t.as_ref()
                            .map(|t| t.ranks.iter().filter(|r| !r.spans.is_empty()).map(|r| RankSpans { rank: r.rank, spans: r.spans.clone() }).collect())
                            .unwrap_or_default()
                    });
                    (!ranks.is_empty()).then(|| view! {
                        <section class="card" id="timeline-card">
                            <h2>"What every rank did, over time"</h2>
                            <p class="muted small">
                                "Each rank's compute thread (forward, backward, optimizer), its communication thread (DDP's buckets, FSDP's prefetched gathers) and the collectives the compute thread waits for (DP blocking: ZeRO/FSDP's gathers and reduce-scatters; TP comm), as recorded for the first steps. "
                                "Hover a box for its name, duration and bytes."
                            </p>
                            <Timeline ranks=ranks/>
                        </section>
                    })
                }}

                {spec_demo_none(&memory_spec).then(|| {
                    let predicted = predicted_only(&memory_spec);
                    let shown = Signal::derive(move || memory.get().or_else(|| predicted.clone()));
                    // "Finished" for the card once the server's view of the ended run is here.
                    let finished =
                        Signal::derive(move || status_now.get().is_finished() && memory.with(Option::is_some));
                    view! { <MemorySection view=shown finished=finished/> }
                })}

                <section class="card">
                    <h2>"Spec"</h2>
                    <SpecView spec=spec/>
                </section>

                {move || {
                    let lines = logs.get();
                    (!lines.is_empty()).then(|| view! {
                        <section class="card">
                            <h2>"Log"</h2>
                            <div class="log" id="log">
                                {lines.into_iter().map(|l| {
                                    let class = match l.level { LogLevel::Info => "info", LogLevel::Warn => "warn", LogLevel::Error => "error" };
                                    view! { <div class=format!("log-line {class}")>{l.message}</div> }
                                }).collect_view()}
                            </div>
                        </section>
                    })
                }}
            }
            .into_any()
        }
    }
}

/// The demo's own panel links the replay; a training run links it below its result.
fn spec_demo_none(spec: &ExperimentSpec) -> bool {
    spec.demo.is_none()
}

/// A collective demo in words, while it is queued or running and after.
#[component]
fn DemoOverview(spec: ExperimentSpec, op: DemoOp, elements: usize) -> impl IntoView {
    let w = spec.parallel.dp;
    let what = match op {
        DemoOp::AllReduce => "all-reduce: afterwards every rank holds the element-wise sum of all the vectors",
        DemoOp::ReduceScatter => "reduce-scatter: afterwards rank r holds chunk r of the element-wise sum",
        DemoOp::AllGather => {
            "all-gather: rank r contributes chunk r of its vector; afterwards every rank holds all the chunks"
        }
        DemoOp::AllToAll => {
            "all-to-all: every rank cuts its vector into one chunk per rank and sends chunk j to rank j; afterwards chunk i of rank j's vector is what rank i meant for it"
        }
    };
    view! {
        <div class="demo-overview" id="demo-overview">
            <p>
                <strong>"Collective demo, no training. "</strong>
                {format!("{w} rank processes run one {what}. Each holds {elements} numbers; rank r starts with (r+1)·100 + i, so every number can be checked by hand.")}
            </p>
        </div>
    }
}

/// The outcome of a collective demo: bytes per rank against the formula, and the error.
#[component]
fn CollectivePanel(id: i64, check: CollectiveCheck) -> impl IntoView {
    let c = check;
    let w = c.world;
    let d = c.elements * 4;
    let formula = match c.op {
        DemoOp::AllReduce => format!("2(W-1)/W × D = 2·{}/{w} × {d} B", w.saturating_sub(1)),
        _ => format!("(W-1)/W × D = {}/{w} × {d} B", w.saturating_sub(1)),
    };
    // Another all-reduce than the ring: each rank against its own share by that algorithm.
    let expected = |r: usize| c.rank_formula_bytes.get(r).map_or(c.formula_bytes, |&b| b as f64);
    let exact = c.bytes_sent.iter().enumerate().all(|(r, &b)| b as f64 == expected(r));
    let algorithm = (!c.rank_formula_bytes.is_empty()).then(|| {
        let shares: Vec<String> = c.rank_formula_bytes.iter().map(|b| format!("{b} B")).collect();
        format!(
            "This demo ran the {} all-reduce: whole buffers of D = {d} B, so each rank sends D per buffer it passes on ({}), where the ring would have every rank send {}.",
            c.algorithm.as_str(),
            shares.join(", "),
            formula
        )
    });
    let ok = c.max_abs_error == 0.0;
    let rows = c
        .bytes_sent
        .iter()
        .enumerate()
        .map(|(r, &b)| {
            let equal = b as f64 == expected(r);
            view! {
                <tr data-rank=r.to_string()>
                    <td>{format!("rank {r}")}</td>
                    <td class="bytes" data-bytes=b.to_string()>{format!("{b} B")}</td>
                    <td class=if equal { "ok" } else { "muted" }>
                        {if equal { "= formula".to_string() } else { format!("{:+} B vs formula (uneven chunks)", b as f64 - expected(r)) }}
                    </td>
                </tr>
            }
        })
        .collect_view();
    view! {
        <div class=if ok { "summary collective-check" } else { "summary collective-check bad" } id="collective-check" data-exact=exact.to_string()>
            <h2>"Collective check"</h2>
            <p class="headline">
                {format!("{} of {} numbers over {}W = {w} ranks: ", c.op.as_str(), c.elements, if c.rank_formula_bytes.is_empty() { "a ring of " } else { "" })}
                {if ok {
                    view! { <span>"every rank's result equals a sequential computation exactly (largest error " <strong id="max-error">{format::num(c.max_abs_error)}</strong> ")."</span> }.into_any()
                } else {
                    view! { <span>"the largest difference from a sequential computation is " <strong id="max-error">{format::num(c.max_abs_error)}</strong> "."</span> }.into_any()
                }}
            </p>
            {match algorithm {
                Some(text) => view! { <p id="collective-algorithm">{text} {if exact { " Every rank sent exactly its share." } else { "" }}</p> }.into_any(),
                None => view! {
                    <p>
                        "Bytes each rank sent, against the textbook " <strong>{formula}</strong> " = "
                        <strong id="formula-bytes">{format::value(c.formula_bytes as f32)} " B"</strong>
                        {if exact { " — exactly, on every rank." } else { "." }}
                    </p>
                }.into_any(),
            }}
            <table class="bytes-table" id="collective-bytes">
                <thead><tr><th>"rank"</th><th>"bytes sent"</th><th></th></tr></thead>
                <tbody>{rows}</tbody>
            </table>
            <p class="replay-cta">
                <A href=format!("/experiments/{id}/ring") attr:class="button primary big" attr:id="replay-link">"▶ Replay the ring, step by step"</A>
                <span class="muted small">" watch the partial sums travel round the ring and check every number"</span>
            </p>
        </div>
    }
}

/// What a successful run ended with, against what was possible.
#[component]
fn SummaryPanel(summary: RunSummary) -> impl IntoView {
    let s = summary;
    let learned = s.uniform_loss - s.final_loss;
    let floor_text = s.loss_floor.map(|floor| {
        let gap = s.final_loss - floor;
        let share = if s.uniform_loss - floor > 0.0 { learned / (s.uniform_loss - floor) * 100.0 } else { 0.0 };
        if gap > 0.0 {
            format!(
                "The best possible loss on this data (the chain's entropy rate) is {floor:.4}: the run ended {gap:.4} nats above it, {share:.0}% of the way there from a uniform guess."
            )
        } else {
            format!(
                "The best possible loss on this data (the chain's entropy rate) is {floor:.4}: the run reached it (a last batch can score a little below the floor by chance)."
            )
        }
    });
    view! {
        <div class="summary" id="summary">
            <h2>"Result"</h2>
            <p class="headline">
                "Final loss " <strong id="final-loss">{format!("{:.4}", s.final_loss)}</strong> " nats/token "
                "(lowest " {format!("{:.4}", s.min_loss)} ") vs " {format!("{:.4}", s.uniform_loss)}
                " for a uniform guess ln(vocab): the model learned " {format!("{learned:.3}")} " nats/token."
            </p>
            {floor_text.map(|t| view! { <p>{t}</p> })}
            <dl class="summary-grid">
                <div><dt>"steps"</dt><dd>{s.steps}</dd></div>
                <div><dt>"parameters"</dt><dd>{format::si(s.params as f64)}</dd></div>
                <div><dt>"tokens"</dt><dd>{format::si(s.tokens as f64)}</dd></div>
                <div><dt>"tokens / s (mean)"</dt><dd>{format::si(s.tokens_per_s)}</dd></div>
                <div><dt>"step time (mean)"</dt><dd>{format!("{:.1} ms", s.mean_step_ms)}</dd></div>
                <div><dt>"wall time"</dt><dd>{format::duration(s.wall_s)}</dd></div>
                <div><dt>"ranks"</dt><dd>{s.world_size}</dd></div>
                <div><dt>"threads"</dt><dd>{s.threads}</dd></div>
            </dl>
        </div>
    }
}

/// A gradient norm; the engine reports `f64::MAX` for one that overflowed (a step loss
/// scaling skipped).
fn grad_norm_text(norm: f64) -> String {
    if norm == f64::MAX {
        "overflow".into()
    } else {
        format::num(norm)
    }
}

/// A step's dropped assignments: "67 / 1024 (6.5%)".
fn dropped_text(e: &ExpertMetrics) -> String {
    format!("{} / {} ({:.1}%)", e.dropped, e.assignments, 100.0 * e.dropped_share())
}

/// The dropped assignments of every step so far (None for a dense model).
fn run_dropped(points: &[MetricPoint]) -> Option<String> {
    let steps: Vec<ExpertMetrics> = points.iter().filter_map(|p| p.experts).collect();
    let first = steps.first()?;
    let sum = steps.iter().skip(1).fold(*first, |a, e| ExpertMetrics {
        balance: 0.0,
        assignments: a.assignments + e.assignments,
        dropped: a.dropped + e.dropped,
    });
    Some(dropped_text(&sum))
}

/// The exponent of a loss scale that is a power of two (it starts at 2^16, then halves
/// and doubles), shown as 2 to that power.
fn power_of_two(scale: f64) -> Option<i32> {
    let exponent = scale.log2();
    (scale > 0.0 && exponent.fract() == 0.0).then_some(exponent as i32)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn dropped_assignments_read_as_a_share() {
        let step = |dropped, assignments| MetricPoint {
            experts: Some(ExpertMetrics { balance: 1.2, assignments, dropped }),
            ..MetricPoint::default()
        };
        assert_eq!(dropped_text(&step(67, 1024).experts.unwrap()), "67 / 1024 (6.5%)");
        assert_eq!(run_dropped(&[step(67, 1024), step(33, 1024)]), Some("100 / 2048 (4.9%)".into()));
        assert_eq!(run_dropped(&[MetricPoint::default()]), None, "a dense model routes nothing");
    }

    #[test]
    fn an_overflowed_gradient_and_the_loss_scale_read_plainly() {
        assert_eq!(grad_norm_text(f64::MAX), "overflow");
        assert_eq!(grad_norm_text(1.5), format::num(1.5));
        assert_eq!(power_of_two(65536.0), Some(16));
        assert_eq!(power_of_two(0.5), Some(-1));
        assert_eq!(power_of_two(3.0), None);
    }

    fn p(step: u64) -> MetricPoint {
        MetricPoint { step, loss: step as f64, ..Default::default() }
    }

    #[test]
    fn an_attempt_says_where_it_resumed_and_what_was_lost() {
        let a = |attempt, from_step, lost_steps| AttemptView {
            attempt,
            worker: Some("w".into()),
            started_at: String::new(),
            from_step,
            lost_steps,
        };
        assert_eq!(attempt_line(&a(1, Some(0), 0)), "attempt 1 on w: started at step 0");
        assert_eq!(
            attempt_line(&a(2, Some(20), 4)),
            "attempt 2 on w: resumed from the checkpoint of step 20 · 4 steps lost and run again"
        );
        assert_eq!(
            attempt_line(&a(3, Some(0), 1)),
            "attempt 3 on w: started over at step 0 (no complete checkpoint) · 1 step lost and run again"
        );
        assert_eq!(attempt_line(&a(2, None, 0)), "attempt 2 on w: has not reported where it starts yet");
    }

    #[test]
    fn merge_keeps_step_order_without_duplicates() {
        let mut v = Vec::new();
        for s in [0, 1, 2, 1, 0, 3, 5, 4] {
            merge_point(&mut v, p(s));
        }
        assert_eq!(v.iter().map(|q| q.step).collect::<Vec<_>>(), vec![0, 1, 2, 3, 4, 5]);
    }
}
