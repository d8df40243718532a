//! `/experiments/:id/pipeline`: the pipeline schedule of one step, its measured bubble
//! next to the schedule's formula ((P-1)/(M+P-1), interleaved (P-1)/(vM+P-1)), the same
//! step replayed from its measured pass durations as if every stage had a device of its
//! own (the formula's world, where ranks do not share cores), and the same for another
//! finished run of the same model and pp with another schedule.

use distlab_common::spec::PpSchedule;
use distlab_common::trace::ExperimentTrace;
use distlab_common::{ExperimentSpec, ExperimentView};
use leptos::prelude::*;
use leptos_router::components::A;
use leptos_router::hooks::use_params_map;

use crate::api::{self, ApiResult};
use crate::components::doc_link::DocLink;
use crate::components::pipeline_chart::PipelineChart;
use crate::load::{load, Loaded};
use distlab_common::pipeline::{
    default_step, measured_bubble, project, recorded_steps, stage_durations, stage_rows, zero_bubble_formula,
    StageDurations,
};
use distlab_common::schedule::Pipeline as PipelineShape;

#[component]
pub fn PipelinePage() -> impl IntoView {
    let params = use_params_map();
    let id = Memo::new(move |_| params.read().get("id").and_then(|s| s.parse::<i64>().ok()));
    move || match id.get() {
        Some(id) => view! { <Pipeline id=id/> }.into_any(),
        None => view! { <section class="card"><p class="alert error">"This is not an experiment id."</p></section> }
            .into_any(),
    }
}

/// The schedule of `spec`'s pipeline, as the texts name it.
fn schedule_name(spec: &distlab_common::ExperimentSpec) -> String {
    match spec.parallel.pp_schedule {
        PpSchedule::Interleaved => format!("interleaved 1F1B, v = {}", spec.parallel.virtual_stages),
        PpSchedule::ZbH1 => "ZB-H1 (backward split into B and W)".into(),
        PpSchedule::Zbv => "ZBV (2P chunks in a V, backward split into B and W)".into(),
        PpSchedule::DualPipeV => {
            "DualPipeV (ZBV's V in DeepSeek's order: a forward paired with another micro-batch's backward)".into()
        }
        schedule => schedule.title().into(),
    }
}

/// The bubble formula of `pipe` with its numbers filled in.
fn formula_text(pipe: &PipelineShape) -> String {
    let (p, m, v) = (pipe.stages, pipe.micro_batches, pipe.chunks);
    match pipe.kind {
        PpSchedule::Interleaved => format!("(P-1)/(v·M+P-1) = ({p}-1)/({v}·{m}+{p}-1) = "),
        // Qi et al. 2023, section 3.1: (P-1)(F+B-W) idle against M(F+B+W) busy.
        PpSchedule::ZbH1 => format!("(P-1)(F+B-W)/(M(F+B+W)+(P-1)(F+B-W)), with F = B = W: ({p}-1)/(3·{m}+{p}-1) = "),
        // P-1 chunk passes idle against 2 chunks x 3 passes x M busy.
        PpSchedule::Zbv => format!("with F = B = W per chunk pass, (P-1)/(6M+P-1) = ({p}-1)/(6·{m}+{p}-1) = "),
        // DeepSeek's (P-1)(F&B+B-3W) idle, B a whole backward: a pair counted as one block.
        PpSchedule::DualPipeV => {
            format!("(P-1)(F&B+B-3W) with F&B = F+B and F = B = W per chunk pass: ({p}-1)/(3·{m}+{p}-1) = ")
        }
        _ => format!("(P-1)/(M+P-1) = ({p}-1)/({m}+{p}-1) = "),
    }
}

/// An experiment and its trace, once both arrived.
type Run = (ExperimentView, ExperimentTrace);

async fn load_run(id: i64) -> ApiResult<Run> {
    let view = api::get_experiment(id).await?;
    let trace = api::get_trace(id).await?;
    Ok((view, trace))
}

/// The finished runs of the same model and pp with another schedule (to compare with).
async fn other_schedules(id: i64, spec: &ExperimentSpec) -> Vec<ExperimentView> {
    let Ok(list) = api::list_succeeded(50).await else { return Vec::new() };
    list.experiments
        .into_iter()
        .filter(|e| {
            e.id != id
                && e.spec.model == spec.model
                && e.spec.parallel.pp == spec.parallel.pp
                && (e.spec.parallel.pp_schedule, e.spec.parallel.virtual_stages)
                    != (spec.parallel.pp_schedule, spec.parallel.virtual_stages)
        })
        .collect()
}

#[component]
fn Pipeline(id: i64) -> impl IntoView {
    let step = RwSignal::new(None::<u64>);
    // The run, then the runs to compare it with: the page shows once both are in.
    let main = load(move || async move {
        let run = load_run(id).await?;
        step.try_set(default_step(&recorded_steps(&run.1.ranks)));
        let others = other_schedules(id, &run.0.spec).await;
        Ok((run, others))
    });
    let others = move || main.get().and_then(Result::ok).map(|(_, others)| others).unwrap_or_default();
    let compare_id = RwSignal::new(None::<i64>);
    let compare = LocalResource::new(move || {
        let other = compare_id.get();
        async move {
            match other {
                Some(other) => Some(load_run(other).await),
                None => None,
            }
        }
    });

    let steps = move || {
        main.with(|m| {
            m.as_ref().and_then(|r| r.as_ref().ok()).map(|((_, t), _)| recorded_steps(&t.ranks)).unwrap_or_default()
        })
    };
    view! {
        <section class="card" id="pipeline-card">
            <p><A href=format!("/experiments/{id}")>"← experiment " {id}</A></p>
            <h1>"Pipeline schedule"</h1>
            <DocLink page="pipeline-parallel"/>
            <p class="muted small">
                "One row per pipeline stage: a box for the forward (F) and the backward (B) of every micro-batch, numbered by micro-batch "
                "(interleaved: and lettered by the stage's chunk of layers, a, b, ..., every other chunk lighter; "
                "ZB-H1, ZBV and DualPipeV: the backward split into B, the input's gradient, and W, the weights' gradient, which waits for a bubble "
                "(DualPipeV's only at the ends, its steady state running each W right after its B); "
                "ZBV and DualPipeV: chunk a on the way down the V, b on the way back, stage 0 holding the embeddings and the head); "
                "hatched boxes are waits for a neighbouring stage. The bubble is the share of the step a stage sat idle: "
                "1 - busy / window, where the window runs from the earliest forward to the latest backward over all stages."
            </p>
            <div class="timeline-controls">
                <label for="pipeline-step">"step "</label>
                <select id="pipeline-step" on:change=move |ev| step.set(event_target_value(&ev).parse().ok())>
                    {move || steps().into_iter().map(|s| view! {
                        <option value=s.to_string() selected=move || step.get() == Some(s)>{format!("step {s}")}</option>
                    }).collect_view()}
                </select>
                <span class="legend">
                    <span class="legend-item"><span class="swatch span-forward"></span>"forward"</span>
                    <span class="legend-item"><span class="swatch span-backward"></span>"backward"</span>
                    <span class="legend-item"><span class="swatch span-weights"></span>"weights (W: ZB-H1, ZBV, DualPipeV)"</span>
                    <span class="legend-item"><span class="swatch pp-idle"></span>"wait for a neighbour"</span>
                </span>
                <label for="pipeline-compare">" compare with "</label>
                <select id="pipeline-compare" on:change=move |ev| compare_id.set(event_target_value(&ev).parse().ok())>
                    <option value="">"(none)"</option>
                    {move || others().into_iter().map(|e| view! {
                        <option value=e.id.to_string()>{format!("#{} {} ({})", e.id, e.name, schedule_name(&e.spec))}</option>
                    }).collect_view()}
                </select>
            </div>
            {Loaded::new(main).view(move |(run, _)| view! { <Schedule run=run step=step.into() dom_id="pipeline-main"/> })}
            {move || compare.get().flatten().map(|c| match c {
                Err(e) => view! { <p class="alert error">{e.message}</p> }.into_any(),
                Ok(run) => view! { <div class="pp-compare"><Schedule run=run step=step.into() dom_id="pipeline-compare-chart"/></div> }.into_any(),
            })}
        </section>
    }
}

/// One run's schedule for the selected step, with its bubble table.
#[component]
fn Schedule(run: Run, step: Signal<Option<u64>>, dom_id: &'static str) -> impl IntoView {
    let (view, trace) = run;
    let spec = view.spec.clone();
    let pipe = PipelineShape::of(&spec);
    let (p, m) = (pipe.stages, pipe.micro_batches);
    let formula = pipe.formula_bubble();
    // M: every micro-batch of the step, accumulated ones too (one schedule runs them all).
    let heading = format!(
        "#{} {} — {}, P = {p} stages, M = {m} micro-batches ({} per flush x {} accumulated)",
        view.id,
        view.name,
        schedule_name(&spec),
        spec.train.micro_batches,
        spec.train.grad_accum
    );
    let traces = StoredValue::new(trace.ranks);
    move || {
        let Some(s) = step.get() else {
            return view! { <p class="muted">"no spans were recorded"</p> }.into_any();
        };
        let rows = traces.with_value(|r| stage_rows(r, s));
        let stages: Vec<usize> = rows.iter().map(|r| spec.stage_of(r.rank as usize)).collect();
        let bubble = measured_bubble(&rows);
        let table = bubble.as_ref().map(|b| {
            let per_rank = b.per_rank.iter().zip(&stages).map(|((_, busy, share), stage)| view! {
                <tr><td>{format!("stage {stage}")}</td><td>{format!("{:.2} ms", *busy as f64 / 1000.0)}</td><td>{format!("{:.1}%", share * 100.0)}</td></tr>
            }).collect_view();
            view! {
                <p class="bubble-line">
                    "measured bubble " <strong class="measured-bubble">{format!("{:.1}%", b.overall * 100.0)}</strong>
                    " · formula " {formula_text(&pipe)}
                    <strong class="formula-bubble">{format!("{:.1}%", formula * 100.0)}</strong>
                    {format!(" · window {:.2} ms", (b.window.1 - b.window.0) as f64 / 1000.0)}
                </p>
                <table class="bubble-table small">
                    <tr><th>"stage"</th><th>{if pipe.splits_backward() { "busy (F+B+W)" } else { "busy (F+B)" }}</th><th>"bubble"</th></tr>
                    {per_rank}
                </table>
            }
        });
        // The same passes replayed with a device per stage (durations as measured here).
        let durations = stage_durations(&rows, &stages, p);
        // ZB-H1's formula with this step's passes (their means over the stages' durations).
        let zero_bubble = durations.as_ref().filter(|_| pipe.kind == PpSchedule::ZbH1).map(|d| {
            let mean =
                |pass: fn(&StageDurations) -> u64| d.iter().map(pass).sum::<u64>() as f64 / d.len().max(1) as f64;
            let fbw = (mean(|d| d.forward), mean(|d| d.backward), mean(|d| d.weights));
            let share = zero_bubble_formula(p, m, fbw);
            view! {
                <p class="bubble-line small">
                    {format!(
                        "with this step's F = {:.2} ms, B = {:.2} ms, W = {:.2} ms (means over the stages): ",
                        fbw.0 / 1000.0, fbw.1 / 1000.0, fbw.2 / 1000.0
                    )}
                    <strong class="measured-formula-bubble">{format!("{:.1}%", share * 100.0)}</strong>
                </p>
            }
        });
        let projected = durations.and_then(|d| project(pipe, &d, s));
        let projection = projected.map(|rows| {
            let bubble = measured_bubble(&rows);
            let labels: Vec<usize> = (0..rows.len()).collect();
            view! {
                <h4>"Projected: every stage on a device of its own"</h4>
                <p class="muted small">
                    "Not a measurement: the schedule replayed from this step's measured passes (each stage's forward and "
                    "backward as they take with a core to themselves: the lower quartile over its ranks and micro-batches), every stage starting a pass as soon as its input is there, "
                    "with free transfers and no other work on its device. It removes what the machine adds (ranks sharing "
                    "its cores, the operating system's scheduling) and keeps what the schedule and unequal stages cost."
                </p>
                {bubble.map(|b| view! {
                    <p class="bubble-line">
                        "projected bubble " <strong class="projected-bubble">{format!("{:.1}%", b.overall * 100.0)}</strong>
                        " · formula " {format!("{:.1}%", formula * 100.0)}
                        {format!(" · window {:.2} ms", (b.window.1 - b.window.0) as f64 / 1000.0)}
                    </p>
                })}
                {zero_bubble.clone()}
                <PipelineChart rows=rows stages=labels id=format!("{dom_id}-projected-svg")/>
            }
        });
        view! {
            <div class="pp-schedule" id=dom_id>
                <h3>{heading.clone()}</h3>
                <h4>"Measured on this machine"</h4>
                <PipelineChart rows=rows stages=stages id=format!("{dom_id}-svg")/>
                {table}
                {projection}
            </div>
        }
        .into_any()
    }
}
