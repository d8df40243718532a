//! `/experiments/:id`: one experiment, live. The server-sent event stream feeds the
//! status, the metric points (the loss chart grows while it runs) and the log; the
//! REST endpoints fill in the rest (spec, timestamps) and cover a missed stream.
//! Once the ranks have stored their traces the page shows their timeline and links
//! to the ring replay; a collective demo shows its checked result instead of a loss.
//! A training run shows every rank's memory: the planner's prediction from the start,
//! the measured memory next to it once the run has ended and its ranks reported it.
//!
//! One file per part: `header` (name, status, cancel, why it waits or failed), `training`
//! (stats, loss chart, result), `outcome` (a demo's check, a run's result), `links`
//! (replay, attempts, continue, pipeline) and `sections` (timeline, memory, log). This
//! file loads the run and follows its stream.

mod header;
mod links;
mod outcome;
mod sections;
mod training;

use std::cell::RefCell;
use std::rc::Rc;
use std::time::Duration;

use distlab_common::memory::MemoryView;
use distlab_common::trace::ExperimentTrace;
use distlab_common::{AttemptView, ExperimentStatus, LogLine, MetricPoint, RunSummary, StreamEvent};
use leptos::prelude::*;
use leptos_router::components::A;
use leptos_router::hooks::use_params_map;

use self::header::RunHeader;
use self::links::RunLinks;
use self::outcome::{CollectivePanel, DemoOverview};
use self::sections::{LogCard, MemoryCard, ReplicasCard, StalenessCard, TimelineCard};
use self::training::TrainingRun;
use crate::api::{self, EventStream};
use crate::components::spec_view::SpecView;
use crate::components::try_model::TryModel;
use crate::format;
use crate::load::{load_keeping, loading_card, Loaded};

/// Log lines kept on the page.
const MAX_LOG: usize = 300;

/// Requests for a finished run's traces at most, the first included.
const MAX_TRACE_ASKS: u32 = 10;

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

/// What the page knows of a run besides its stored view, most of it live from the stream;
/// every part of the page reads it.
#[derive(Clone, Copy)]
struct Live {
    status: Signal<ExperimentStatus>,
    points: RwSignal<Vec<MetricPoint>>,
    /// The failed or cancelled run's message.
    error: RwSignal<Option<String>>,
    summary: RwSignal<Option<RunSummary>>,
    logs: RwSignal<Vec<LogLine>>,
    stream_state: RwSignal<&'static str>,
    /// The clock, ticking every second (the elapsed time of a running run).
    now: RwSignal<f64>,
    attempts: Signal<Vec<AttemptView>>,
    trace: Signal<Option<ExperimentTrace>>,
    /// The server's memory view (it is built from the traces).
    memory: Signal<Option<MemoryView>>,
}

/// What `/trace` and `/memory` answered last (a request that failed keeps the older answer).
#[derive(Clone, Default)]
struct Traces {
    trace: Option<ExperimentTrace>,
    memory: Option<MemoryView>,
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
    let status = RwSignal::new(None::<ExperimentStatus>);
    let points = RwSignal::new(Vec::<MetricPoint>::new());
    let error = RwSignal::new(None::<String>);
    let summary = RwSignal::new(None::<RunSummary>);
    let logs = RwSignal::new(Vec::<LogLine>::new());
    let stream_state = RwSignal::new("connecting");
    let action_error = RwSignal::new(None::<String>);
    let now = RwSignal::new(format::now_ms());

    // The stored view; a reload that fails keeps the last one on the page.
    let (experiment, _) = load_keeping(move || async move {
        let answer = api::get_experiment(id).await;
        if let Ok(view) = &answer {
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
        }
        answer
    });
    let (attempts, _) = load_keeping(move || api::get_attempts(id));
    let reload = move || {
        attempts.refetch();
        experiment.refetch();
    };
    // The points stored so far (the stream brings the next ones, and replays these).
    let metrics = LocalResource::new(move || api::get_metrics(id));
    Effect::new(move || {
        if let Some(Ok(m)) = metrics.get() {
            points.update(|ps| m.steps.into_iter().for_each(|p| merge_point(ps, p)));
        }
    });
    // Ranks store their traces at the end of a run: asked for once it has finished, and
    // again for any trace that arrives after that (one request at a time).
    let trace_asks = RwSignal::new(0u32);
    let kept = Rc::new(RefCell::new(Traces::default()));
    let traces = LocalResource::new(move || {
        let (asked, kept) = (trace_asks.get() > 0, kept.clone());
        async move {
            if asked {
                if let Ok(t) = api::get_trace(id).await {
                    kept.borrow_mut().trace = Some(t);
                }
                if let Ok(m) = api::get_memory(id).await {
                    kept.borrow_mut().memory = Some(m);
                }
            }
            kept.borrow().clone()
        }
    });
    let ask_traces = move || trace_asks.update(|n| *n += 1);
    Effect::new(move |asked: Option<bool>| {
        let finished = status.get().is_some_and(|s| s.is_finished());
        if finished && asked != Some(true) {
            ask_traces();
        }
        finished
    });
    // A finished run whose memory still lacks a rank's measurement (that rank's trace landed
    // after the page asked, and no stream told it): asked again every 2 s, 10 times at most.
    let lacks_a_rank = move || {
        traces
            .get_untracked()
            .is_some_and(|t| t.memory.as_ref().is_some_and(|m| m.ranks.iter().any(|r| r.measured.is_none())))
    };
    let ask_again = move || {
        let finished = status.get_untracked().is_some_and(|s| s.is_finished());
        if finished && trace_asks.get_untracked() < MAX_TRACE_ASKS && lacks_a_rank() {
            ask_traces();
        }
    };
    if let Ok(handle) = set_interval_with_handle(ask_again, Duration::from_secs(2)) {
        on_cleanup(move || handle.clear());
    }

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
                    ask_traces();
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

    let live = Live {
        status: Signal::derive(move || status.get().unwrap_or(ExperimentStatus::Queued)),
        points,
        error,
        summary,
        logs,
        stream_state,
        now,
        attempts: Signal::derive(move || attempts.get().and_then(Result::ok).map(|a| a.attempts).unwrap_or_default()),
        trace: Signal::derive(move || traces.with(|t| t.as_ref().and_then(|t| t.trace.clone()))),
        memory: Signal::derive(move || traces.with(|t| t.as_ref().and_then(|t| t.memory.clone()))),
    };
    let reload = Callback::new(move |()| reload());

    Loaded::new(experiment)
        .loading(loading_card)
        .error(move |e| view! {
            <section class="card">
                <h1>"Experiment " {id}</h1>
                <p class="alert error" id="error">{e}</p>
                <p><A href="/">"Back to the list"</A></p>
            </section>
        })
        .view(move |view| {
            let spec = view.spec.clone();
            let status = live.status;
            let run = match spec.demo.clone() {
                Some(demo) => view! {
                    <DemoOverview spec=spec.clone() op=demo.op elements=demo.elements/>
                    {move || {
                        let check = live.summary.get().filter(|_| status.get() == ExperimentStatus::Succeeded).and_then(|s| s.collective);
                        check.map(|c| view! { <CollectivePanel id=id check=c/> })
                    }}
                }
                .into_any(),
                None => view! {
                    <TrainingRun id=id name=view.name.clone() spec=spec.clone() steps_done_server=view.steps_done
                        started=view.started_at.clone() finished=view.finished_at.clone() live=live/>
                }
                .into_any(),
            };
            let try_model = distlab_common::export::not_exportable(&spec).is_none().then(|| {
                let (text, vocab, bpe) =
                    (spec.data.dataset.is_text(), spec.model.vocab, !spec.data.tokenizer.is_bytes());
                move || {
                    (status.get() == ExperimentStatus::Succeeded)
                        .then(|| view! { <TryModel id=id text=text bpe=bpe vocab=vocab/> })
                }
            });
            view! {
                <section class="card">
                    <RunHeader view=view.clone() live=live action_error=action_error reload=reload/>
                    {run}
                    <RunLinks id=id spec=spec.clone() live=live/>
                </section>
                {try_model}
                <TimelineCard live=live/>
                <StalenessCard live=live/>
                {(spec.parallel.fault_tolerance == distlab_common::FaultTolerance::Replicas).then(|| view! { <ReplicasCard live=live/> })}
                {spec.demo.is_none().then(|| view! { <MemoryCard spec=spec.clone() live=live/> })}
                <section class="card">
                    <h2>"Spec"</h2>
                    <SpecView spec=spec.clone()/>
                </section>
                <LogCard live=live/>
            }
        })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn p(step: u64) -> MetricPoint {
        MetricPoint { step, loss: step as f64, ..Default::default() }
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
