//! `/experiments/:id/ring`: the ring replay. The page fetches the experiment's trace,
//! lets the learner pick one of its ring collectives, and steps through it: step,
//! play / pause, reset and a scrub slider over the recorded steps. Every state shown
//! is computed by [`Replay`] from what the ranks recorded; at the end the page says
//! whether every rank's buffer equals the output it recorded and the sum of the inputs.

use std::time::Duration;

use distlab_common::trace::CollectiveOp;
use distlab_common::DemoOp;
use leptos::prelude::*;
use leptos_router::components::A;
use leptos_router::hooks::use_params_map;

use crate::api;
use crate::components::doc_link::DocLink;
use crate::components::link_table::LinkTable;
use crate::components::ring_view::{partial_fill, RingView};
use crate::format;
use crate::load::{load, Loaded};
use crate::ring_replay::{
    opening_collective, ring_collectives, Check, ChunkKind, CollectiveInfo, CollectiveKey, Replay, Schedule,
};

/// Time between two steps while playing.
const PLAY_EVERY: Duration = Duration::from_millis(1200);

#[component]
pub fn RingReplayPage() -> impl IntoView {
    let params = use_params_map();
    let id = Memo::new(move |_| params.read().get("id").and_then(|s| s.parse::<i64>().ok()));
    move || match id.get() {
        Some(id) => view! { <RingReplay id=id/> }.into_any(),
        None => view! {
            <section class="card">
                <p class="alert error">"This is not an experiment id. " <A href="/">"Back to the list"</A></p>
            </section>
        }
        .into_any(),
    }
}

#[component]
fn RingReplay(id: i64) -> impl IntoView {
    let experiment = load(move || api::get_experiment(id));
    let trace = load(move || api::get_trace(id));
    let collectives = Memo::new(move |_| match trace.get() {
        Some(Ok(t)) => ring_collectives(&t),
        _ => Vec::new(),
    });
    let selected = RwSignal::new(None::<CollectiveKey>);
    Effect::new(move |_| {
        if selected.get_untracked().is_none() {
            let list = collectives.get();
            if let Some(c) = opening_collective(&list) {
                selected.set(Some(c.key.clone()));
            }
        }
    });

    let demo_op = Memo::new(move |_| {
        experiment.with(|e| e.as_ref().and_then(|e| e.as_ref().ok()).and_then(|e| e.spec.demo.as_ref().map(|d| d.op)))
    });
    let back = format!("/experiments/{id}");
    let title = move || {
        experiment.with(|e| {
            e.as_ref()
                .and_then(|e| e.as_ref().ok())
                .map(|e| format!("{} #{}", e.name, e.id))
                .unwrap_or_else(|| format!("#{id}"))
        })
    };
    view! {
        <section class="card">
            <div class="card-head">
                <h1>"Ring replay " <span class="muted id">{title}</span></h1>
                <DocLink page="collectives"/>
                <div class="spacer"></div>
                <A href=back.clone() attr:class="button small" attr:id="back-to-experiment">"← experiment"</A>
            </div>
            <p class="muted">
                "A collective, step by step, as the rank processes recorded it. On a ring each rank sends only to its right "
                "neighbour and receives only from its left one; the buffer is cut into one chunk per rank, and each step moves one chunk over every link at the same time."
            </p>
            {Loaded::new(trace)
                .loading(|| view! { <p class="muted">"loading the trace…"</p> })
                .error(|e| view! { <p class="alert error" id="ring-error">{e}</p> })
                .view(move |_| {
                    if collectives.with(|c| c.is_empty()) {
                        view! {
                            <p class="empty" id="ring-empty">
                                "This experiment has no ring collective recorded in detail (yet): a collective demo, or a training run "
                                "with dp > 1, records its first collectives step by step. "
                                <A href=back.clone()>"Back to the experiment"</A>
                            </p>
                        }
                        .into_any()
                    } else {
                        view! { <CollectivePicker collectives=collectives selected=selected/> }.into_any()
                    }
                })}
        </section>
        {move || {
            // Rebuilt only when another collective is picked (the player keeps its step otherwise).
            let key = selected.get()?;
            let replay = trace.with(|t| t.as_ref().and_then(|t| t.as_ref().ok()).and_then(|t| Replay::build(t, &key)))?;
            Some(view! { <ReplayPlayer replay=replay demo_op=demo_op/> })
        }}
        {move || trace.with(|t| t.as_ref().and_then(|t| t.as_ref().ok()).cloned()).map(|t| view! { <LinkTable trace=t/> })}
    }
}

/// A `<select>` when the trace holds several collectives; a line when it holds one.
#[component]
fn CollectivePicker(
    collectives: Memo<Vec<CollectiveInfo>>,
    selected: RwSignal<Option<CollectiveKey>>,
) -> impl IntoView {
    move || {
        let list = collectives.get();
        if list.len() == 1 {
            return view! { <p class="collective-one" id="ring-collective-label">"Collective " <strong>{list[0].label()}</strong></p> }
                .into_any();
        }
        let options = list
            .into_iter()
            .map(|c| {
                let value = c.key.to_param();
                let key = c.key.clone();
                view! { <option value=value selected=move || selected.get().as_ref() == Some(&key)>{c.label()}</option> }
            })
            .collect_view();
        view! {
            <p class="collective-pick">
                <label for="ring-collective">"Collective "</label>
                <select id="ring-collective" on:change=move |ev| selected.set(CollectiveKey::parse(&event_target_value(&ev)))>
                    {options}
                </select>
                <span class="muted small">" (the first collectives of each rank are recorded step by step)"</span>
            </p>
        }
        .into_any()
    }
}

/// The controls, the ring, the explanation, the buffers and the verdict for one collective.
#[component]
fn ReplayPlayer(replay: Replay, #[prop(into)] demo_op: Signal<Option<DemoOp>>) -> impl IntoView {
    let last = replay.steps();
    let replay = StoredValue::new(replay);
    let frame = RwSignal::new(0usize);
    let playing = RwSignal::new(false);
    if let Ok(handle) = set_interval_with_handle(
        move || {
            if playing.get_untracked() {
                let k = frame.get_untracked();
                if k < last {
                    frame.set(k + 1);
                }
                if k + 1 >= last {
                    playing.set(false);
                }
            }
        },
        PLAY_EVERY,
    ) {
        on_cleanup(move || handle.clear());
    }
    let stop = move || playing.set(false);
    let reset = move |_| {
        stop();
        frame.set(0);
    };
    let step_back = move |_| {
        stop();
        frame.update(|k| *k = k.saturating_sub(1));
    };
    let step = move |_| {
        stop();
        frame.update(|k| *k = (*k + 1).min(last));
    };
    let toggle = move |_| {
        if playing.get_untracked() {
            stop();
        } else {
            if frame.get_untracked() >= last {
                frame.set(0);
            }
            playing.set(true);
        }
    };
    let info = replay.with_value(|r| r.info.clone());
    let w = info.ranks.len();
    let formula = replay.with_value(|r| r.formula_text());
    let notes = replay.with_value(|r| r.notes.clone());
    let phase = move || replay.with_value(|r| r.phase_label(frame.get()));
    let explain = move || replay.with_value(|r| r.explain(frame.get()));
    let duration = move || {
        replay
            .with_value(|r| r.frames[frame.get()].duration_us())
            .map(|us| format!(" · this step took {:.3} ms on the wire", us as f64 / 1000.0))
    };

    view! {
        <section class="card ring-card">
            <div class="ring-controls" id="ring-controls">
                <button class="button" id="ring-reset" on:click=reset disabled=move || frame.get() == 0 && !playing.get()>"↺ reset"</button>
                <button class="button" id="ring-back" on:click=step_back disabled=move || frame.get() == 0>"◀ back"</button>
                <button class="button primary" id="ring-step" on:click=step disabled=move || { frame.get() >= last }>"step ▶"</button>
                <button class="button" id="ring-play" on:click=toggle data-playing=move || playing.get().to_string()>
                    {move || if playing.get() { "‖ pause" } else { "▶▶ play" }}
                </button>
                <input
                    type="range"
                    id="ring-scrub"
                    min="0"
                    max=last.to_string()
                    step="1"
                    prop:value=move || frame.get().to_string()
                    on:input=move |ev| {
                        stop();
                        if let Ok(k) = event_target_value(&ev).parse::<usize>() {
                            frame.set(k.min(last));
                        }
                    }
                    aria-label="scrub through the recorded steps"
                />
                <span class="ring-position" id="ring-position" data-frame=move || frame.get().to_string() data-last=last.to_string()>
                    {move || format!("step {} / {}", frame.get(), last)}
                </span>
            </div>
            {(info.schedule == Schedule::WholeBuffers).then(|| view! {
                <p class="note" id="ring-not-a-ring">
                    "Not a ring: this all-reduce (" <code>"parallel.allreduce"</code> " naive or tree) sends whole buffers between two ranks at a time, "
                    "partial sums towards rank 0 first, then the result back out. Every transfer is drawn in the order it was sent; "
                    "compare what each rank sent with the ring's 2(W-1)/W × D."
                </p>
            })}
            {(info.schedule == Schedule::Hierarchical).then(|| view! {
                <p class="note" id="ring-hierarchical">
                    "Hierarchical (" <code>"parallel.allreduce"</code> " hierarchical, " <code>"ranks_per_node"</code>
                    "): a ring inside every node, a ring across the nodes' first ranks, then each of them sends the result into its node. "
                    "Only the leaders' ring crosses nodes, so the slow links carry 2(N-1)/N × D from N ranks instead of every rank's share."
                </p>
            })}
            <h2 class="ring-phase" id="ring-phase">{phase}</h2>
            <p class="ring-explain" id="ring-explain">{explain}</p>
            <div class="chart-wrap ring-wrap">
                <RingView replay=replay frame=frame/>
            </div>
            <RingLegend world=w/>
            <p class="muted small ring-formula" id="ring-formula">
                "Bytes each rank sends, in the textbook: " <strong>{formula}</strong>
                " (D = " {info.elements} " f32 = " {info.elements * 4} " B). The bar on each rank fills as it sends."
                {duration}
            </p>
            {(!notes.is_empty()).then(|| view! {
                <div class="note warn" id="ring-notes">{notes.into_iter().map(|n| view! { <p>{n}</p> }).collect_view()}</div>
            })}
        </section>
        <section class="card">
            <h2>"Every rank's buffer, element by element"</h2>
            <BufferTable replay=replay frame=frame/>
            {move || (frame.get() == last).then(|| view! { <Verdict replay=replay demo_op=demo_op/> })}
        </section>
    }
}

#[component]
fn RingLegend(world: usize) -> impl IntoView {
    let w = world;
    view! {
        <div class="legend ring-legend" id="ring-legend">
            <span class="legend-item"><span class="swatch chunk-own"></span>"own data, untouched"</span>
            <span class="legend-item"><span class="swatch chunk-partial-lo"></span><span class="swatch chunk-partial-hi"></span>
                {format!("partial sum (k/{w}: holds k ranks' contributions)")}</span>
            <span class="legend-item"><span class="swatch chunk-complete"></span>{format!("complete sum ({w}/{w}), reduced here")}</span>
            <span class="legend-item"><span class="swatch chunk-gathered"></span>"copy received (all-gather, broadcast)"</span>
            <span class="legend-item"><span class="swatch chunk-empty"></span>"empty"</span>
            <span class="legend-item"><span class="swatch received"></span>"written in this step"</span>
            <span class="legend-item"><span class="swatch sending"></span>"sent in this step"</span>
        </div>
    }
}

/// Each rank's whole vector at the current frame, one cell per element, coloured by its chunk.
#[component]
fn BufferTable(replay: StoredValue<Replay>, #[prop(into)] frame: Signal<usize>) -> impl IntoView {
    let (ranks, chunks, n) = replay.with_value(|r| (r.info.ranks.clone(), r.chunks.clone(), r.info.elements as usize));
    let known = replay.with_value(|r| r.info.has_values);
    if !known {
        return view! {
            <p class="muted" id="ring-buffers-none">
                "This collective moved " {n} " elements per rank: only buffers of up to 64 elements keep their numbers, "
                "so the replay tracks whose contributions each chunk holds (the colours above) without the values."
            </p>
        }
        .into_any();
    }
    let header = chunks
        .iter()
        .enumerate()
        .map(|(c, range)| view! { <th colspan=range.len().to_string() class="chunk-head">{format!("chunk {c}")}</th> })
        .collect_view();
    let index_row = (0..n).map(|i| view! { <th class="index">{i}</th> }).collect_view();
    view! {
        <div class="table-scroll">
            <table class="buffers" id="ring-buffers">
                <thead>
                    <tr><th></th>{header}</tr>
                    <tr><th class="index">"i"</th>{index_row}</tr>
                </thead>
                <tbody>
                    {move || {
                        let k = frame.get();
                        replay.with_value(|r| {
                            let f = &r.frames[k];
                            ranks
                                .iter()
                                .enumerate()
                                .map(|(p, &rank)| {
                                    let cells = f.buffers[p]
                                        .iter()
                                        .enumerate()
                                        .flat_map(|(c, chunk)| {
                                            let mut class = format!("value {}", chunk.kind.class());
                                            if chunk.received {
                                                class.push_str(" received");
                                            }
                                            let style = (chunk.kind == ChunkKind::Partial)
                                                .then(|| format!("background: {}", partial_fill(chunk.count(), r.world())));
                                            (0..r.chunks[c].len())
                                                .map(|i| {
                                                    let text = chunk.values.as_ref().and_then(|v| v.get(i)).map(|&x| format::value(x)).unwrap_or_default();
                                                    (class.clone(), text, style.clone())
                                                })
                                                .collect::<Vec<_>>()
                                        })
                                        .collect::<Vec<_>>();
                                    let values = cells.iter().map(|(_, t, _)| t.clone()).collect::<Vec<_>>().join(" ");
                                    let cells = cells
                                        .into_iter()
                                        .map(|(class, text, style)| view! { <td class=class style=style>{text}</td> })
                                        .collect_view();
                                    view! {
                                        <tr data-rank=rank.to_string() data-values=values>
                                            <th class="rank">{format!("rank {rank}")}</th>
                                            {cells}
                                        </tr>
                                    }
                                })
                                .collect_view()
                        })
                    }}
                </tbody>
            </table>
        </div>
    }
    .into_any()
}

/// The end of the replay, checked: against each rank's recorded output and against
/// the sum of the recorded inputs.
#[component]
fn Verdict(replay: StoredValue<Replay>, #[prop(into)] demo_op: Signal<Option<DemoOp>>) -> impl IntoView {
    let (v, op, w, n) = replay.with_value(|r| (r.verify(), r.info.op, r.world(), r.info.elements));
    let reference = match op {
        CollectiveOp::AllGather => "every rank's input chunk, gathered in order",
        CollectiveOp::AllToAll => "chunk r of every rank's input, rank after rank",
        CollectiveOp::ReduceScatter => "its chunk of the element-wise sum of every rank's input",
        _ => "the element-wise sum of every rank's input",
    };
    let ok_output = v.all_match_output();
    let ok_inputs = v.all_match_inputs();
    let cell = |c: Check| match c {
        Check::Equal(_) => view! { <td class="ok">"✓ equal"</td> }.into_any(),
        Check::Differs(d) => {
            view! { <td class="bad">{format!("✗ differs by up to {}", format::value(d))}</td> }.into_any()
        }
        Check::Unknown => view! { <td class="muted">"not recorded"</td> }.into_any(),
    };
    let demo_line = move || {
        demo_op.get().filter(|&o| o == DemoOp::AllReduce && op == CollectiveOp::AllReduce).map(|_| {
        // Σ_r ((r+1)·100 + i) = 100·W(W+1)/2 + W·i.
        let base = 100 * w * (w + 1) / 2;
        format!(
            "In this demo rank r starts with (r+1)·100 + i, so the sum over the {w} ranks is {base} + {w}·i: {} at i = 0 up to {} at i = {}.",
            base,
            base + w * (n as usize).saturating_sub(1),
            n.saturating_sub(1)
        )
    })
    };
    let headline = if ok_output && ok_inputs && op == CollectiveOp::AllToAll {
        "The replay ends where the ranks ended: every rank's replayed buffer equals the output it recorded, and every rank's chunk of the inputs.".to_string()
    } else if ok_output && ok_inputs {
        "The replay ends where the ranks ended: every rank's replayed buffer equals the output it recorded, and the sum of the inputs.".to_string()
    } else if ok_output {
        "Every rank's replayed buffer equals the output it recorded.".to_string()
    } else if v.all_complete() && v.ranks.iter().all(|r| r.vs_output == Check::Unknown) {
        format!("Every chunk of the result holds the contributions of all {w} ranks (the numbers of large buffers are not recorded, so they cannot be compared).")
    } else {
        "The replay does not match what the ranks recorded: see below.".to_string()
    };
    let good = ok_output || (v.all_complete() && v.ranks.iter().all(|r| r.vs_output == Check::Unknown));
    view! {
        <div class=if good { "verdict ok" } else { "verdict bad" } id="ring-verdict" data-ok=good.to_string()>
            <p class="headline"><strong>{headline}</strong></p>
            {move || demo_line().map(|t| view! { <p id="ring-demo-sum">{t}</p> })}
            <table class="verdict-table">
                <thead><tr><th>"rank"</th><th>"vs its recorded output"</th><th>{format!("vs {reference}")}</th><th>"all contributions"</th></tr></thead>
                <tbody>
                    {v.ranks.iter().map(|r| view! {
                        <tr data-rank=r.rank.to_string()>
                            <td>{r.rank}</td>
                            {cell(r.vs_output)}
                            {cell(r.vs_inputs)}
                            <td class=if r.complete { "ok" } else { "bad" }>{if r.complete { "✓" } else { "✗" }}</td>
                        </tr>
                    }).collect_view()}
                </tbody>
            </table>
        </div>
    }
}
