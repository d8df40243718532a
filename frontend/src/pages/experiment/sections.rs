//! The cards below an experiment's run: what every rank did over time (once the traces
//! are in), every rank's memory (predicted from the start, measured once the run has
//! ended), and the live log.

use distlab_common::{ExperimentSpec, LogLevel};
use leptos::prelude::*;

use super::Live;
use crate::components::memory_section::{predicted_only, MemorySection};
use crate::components::staleness_chart::StalenessChart;
use crate::components::timeline::{RankSpans, Timeline};

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
