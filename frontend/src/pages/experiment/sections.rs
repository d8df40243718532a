//! The cards below an experiment's run: what every rank did over time (once the traces
//! are in), every rank's memory (predicted from the start, measured once the run has
//! ended), and the live log.

use distlab_common::analysis::replicas::{replica_events, ReplicaEvent};
use distlab_common::{ExperimentSpec, LogLevel};
use leptos::prelude::*;

use super::Live;
use crate::components::memory_section::{predicted_only, MemorySection};
use crate::components::staleness_chart::StalenessChart;
use crate::components::timeline::{RankSpans, Timeline};
use crate::format;

/// Every rank's timeline, once the run has stored its traces.
#[component]
pub(super) fn TimelineCard(live: Live) -> impl IntoView {
    let trace = live.trace;
    view! {
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
                        "Each rank's compute thread (forward, backward, optimizer), its communication thread (DDP's buckets, FSDP's prefetched gathers) and the collectives the compute thread waits for (DP blocking: ZeRO/FSDP's gathers and reduce-scatters; TP comm; EP and CP comm: all-to-alls, and the ring's passes) and, with activation offload, each block's activations going out after its forward and coming back before its backward (offload), as recorded for the first steps. "
                        "Hover a box for its name, duration and bytes."
                    </p>
                    <Timeline ranks=ranks/>
                </section>
            })
        }}
    }
}

/// Asynchronous SGD: every gradient the parameter server applied and how stale it was,
/// once the server's rank has stored its trace.
#[component]
pub(super) fn StalenessCard(live: Live) -> impl IntoView {
    let trace = live.trace;
    view! {
        {move || {
            let applied = trace.with(|t| {
                t.as_ref().and_then(|t| t.ranks.iter().find(|r| !r.applied_gradients.is_empty())).map(|r| r.applied_gradients.clone())
            });
            applied.map(|applied| view! {
                <section class="card" id="staleness-card">
                    <h2>"The parameter server's updates, and how stale each gradient was"</h2>
                    <p class="muted small">
                        "Measured: the server's record of every gradient it applied. A gradient's staleness is how many other workers' gradients reached the parameters between the pull it was computed on and its push; synchronous data parallelism applies every gradient at staleness 0."
                    </p>
                    <StalenessChart applied=applied/>
                </section>
            })
        }}
    }
}

/// Fault-tolerant replicas: every loss and rejoin the ranks recorded, once their traces
/// are in.
#[component]
pub(super) fn ReplicasCard(live: Live) -> impl IntoView {
    let trace = live.trace;
    view! {
        {move || {
            let events = trace.with(|t| t.as_ref().map(|t| replica_events(&t.ranks)))?;
            let rows = events.into_iter().map(|e| match e {
                ReplicaEvent::Lost { step, lost, seen_by } => view! {
                    <tr class="replica-lost" data-step=step>
                        <td class="num">{step}</td>
                        <td>{format!("rank(s) {} lost", list(&lost))}</td>
                        <td class="muted">{format!("ranks {} finished the step without it: their mean gradient, their batch", list(&seen_by))}</td>
                    </tr>
                }.into_any(),
                ReplicaEvent::Rejoined { step, rank, source, copy_ms, bytes, same_parameters } => view! {
                    <tr class="replica-rejoined" data-step=step data-rank=rank>
                        <td class="num">{step}</td>
                        <td>{format!("rank {rank} rejoined with rank {source}'s state")}</td>
                        <td class="muted">
                            {format!("{} copied in {copy_ms:.1} ms; ", format::bytes(bytes as f64))}
                            <span class="replica-check">{match same_parameters {
                                Some(true) => "the parameters it took are the ones rank ".to_string() + &source.to_string() + " sent, bit for bit",
                                Some(false) => "the parameters it took DIFFER from what rank ".to_string() + &source.to_string() + " sent",
                                None => "the source's record is missing".to_string(),
                            }}</span>
                        </td>
                    </tr>
                }.into_any(),
            }).collect_view();
            Some(view! {
                <section class="card" id="replicas-card">
                    <h2>"Replicas lost and rejoined"</h2>
                    <p class="muted small">
                        "Measured: what each rank recorded when the replicas' quorum changed. A step a replica dies in finishes without it; its replacement waits for the next step's start and copies the parameters and optimizer state of a live replica (no checkpoint). The log says how long each took from the loss to the rejoin."
                    </p>
                    <table class="bytes-table" id="replica-events">
                        <thead><tr><th>"step"</th><th>"what happened"</th><th>"measured"</th></tr></thead>
                        <tbody>{rows}</tbody>
                    </table>
                </section>
            })
        }}
    }
}

/// "0, 1 and 3".
fn list(ranks: &[u32]) -> String {
    let names: Vec<String> = ranks.iter().map(u32::to_string).collect();
    match names.split_last() {
        Some((last, rest)) if !rest.is_empty() => format!("{} and {last}", rest.join(", ")),
        _ => names.join(""),
    }
}

/// The planner's memory per rank from the start; the measured one next to it at the end.
#[component]
pub(super) fn MemoryCard(spec: ExperimentSpec, live: Live) -> impl IntoView {
    let Live { status, memory, .. } = live;
    let predicted = predicted_only(&spec);
    let shown = Signal::derive(move || memory.get().or_else(|| predicted.clone()));
    // "Finished" for the card once the server's view of the ended run is here.
    let finished = Signal::derive(move || status.get().is_finished() && memory.with(Option::is_some));
    view! { <MemorySection view=shown finished=finished/> }
}

/// The run's log lines as they arrive (the last few hundred).
#[component]
pub(super) fn LogCard(live: Live) -> impl IntoView {
    let logs = live.logs;
    view! {
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
}
