//! The planner's prediction on the new-experiment form, live: memory per rank by
//! category (the same bars as the experiment page), bytes each rank sends per step by
//! collective, the pipeline bubble and the work of one step. It runs
//! `distlab_common::planner::plan` in the browser (the same code as `POST /api/plan`),
//! so it needs no request and follows every keystroke.
//!
//! While a field holds half-typed text the panel keeps the last complete spec's plan,
//! greyed ([`next_state`]), so it does not flicker; a spec that cannot exist shows the
//! planner's field errors instead.

use distlab_common::planner::{self, CommVolume, Plan};
use distlab_common::schedule::Pipeline as PipelineShape;
use distlab_common::{ExperimentSpec, FieldError};
use leptos::prelude::*;

use crate::components::memory_bars::{Bar, BarKind, MemoryBars, MemoryLegend};
use crate::format;

/// Pipelines with at most this many stages get one bar per stage; longer ones only the peak stage's.
const MAX_STAGE_BARS: usize = 8;

/// What the panel shows.
#[derive(Clone, Debug, PartialEq)]
pub enum PlanState {
    /// The form has not held a complete spec yet.
    Waiting,
    /// The plan of `spec`; `stale` while the form's current text does not parse.
    Ready { plan: Box<Plan>, spec: Box<ExperimentSpec>, stale: bool },
    /// The spec describes a model or mesh that cannot exist.
    Impossible(Vec<FieldError>),
}

/// The state after an edit: `spec` is the form's spec when every field parsed (None while
/// some text is half-typed, which keeps the previous plan, marked stale).
pub fn next_state(prev: Option<&PlanState>, spec: Option<&ExperimentSpec>) -> PlanState {
    match spec {
        Some(spec) => match planner::plan(spec) {
            Ok(plan) => PlanState::Ready { plan: Box::new(plan), spec: Box::new(spec.clone()), stale: false },
            Err(errors) => PlanState::Impossible(errors),
        },
        None => match prev {
            Some(PlanState::Ready { plan, spec, .. }) => {
                PlanState::Ready { plan: plan.clone(), spec: spec.clone(), stale: true }
            }
            Some(other) => other.clone(),
            None => PlanState::Waiting,
        },
    }
}

/// The collectives a rank takes part in per step: (name, what moves, bytes sent), non-zero only.
pub fn comm_rows(c: &CommVolume) -> Vec<(&'static str, &'static str, u64)> {
    [
        ("dp all-reduce", "gradients (DDP, ZeRO-1)", c.dp_all_reduce),
        (
            "dp compressed",
            "gradients compressed (top-k, int8: all-gather; PowerSGD: all-reduce of P and Q)",
            c.dp_compressed,
        ),
        ("dp reduce-scatter", "gradients (ZeRO-2, FSDP)", c.dp_reduce_scatter),
        ("dp all-gather", "parameters (ZeRO after the update, FSDP before forward and backward)", c.dp_all_gather),
        ("tp all-reduce", "activations and their gradients", c.tp_all_reduce),
        ("pp send", "activations forward, their gradients backward", c.pp_send),
        ("ep all-to-all", "tokens to their experts and back, and their gradients", c.ep_all_to_all),
        (
            "cp exchange",
            "Ulysses: q, k, v to whole sequences and attention's output back (all-to-all); the ring: k and v \
             passed round; and their gradients",
            c.cp_all_to_all,
        ),
        (
            "ps push",
            "asynchronous SGD: a worker's gradient pushed to the parameter server (on the server's rank: the \
             parameters sent back to every other worker)",
            c.ps_push_pull,
        ),
    ]
    .into_iter()
    .filter(|r| r.2 > 0)
    .collect()
}

/// The bars: every stage of a short pipeline, else the peak stage alone.
pub fn stage_bars(plan: &Plan) -> Vec<Bar> {
    let many = plan.stages.len() > 1;
    plan.stages
        .iter()
        .filter(|s| plan.stages.len() <= MAX_STAGE_BARS || s.stage == plan.peak_stage)
        .map(|s| {
            let peak = s.stage == plan.peak_stage && many;
            Bar {
                label: if many {
                    format!("stage {}{}", s.stage, if peak { " (peak)" } else { "" })
                } else if plan.parameter_server.is_some() {
                    "every other rank (a worker)".into()
                } else {
                    "per rank".into()
                },
                owner: format!("a rank of stage {}", s.stage),
                rank: None,
                kind: BarKind::Predicted,
                memory: s.memory.clone(),
            }
        })
        .chain(plan.parameter_server.as_ref().map(|server| Bar {
            label: "rank 0, with the parameter server".into(),
            owner: "rank 0".into(),
            rank: Some(0),
            kind: BarKind::Predicted,
            memory: server.memory.clone(),
        }))
        .collect()
}

#[component]
pub fn PlanPanel(#[prop(into)] state: Signal<PlanState>) -> impl IntoView {
    move || {
        match state.get() {
        PlanState::Waiting => view! {
            <div class="planner" id="planner"><p class="muted">"The planner's prediction appears once the spec is complete."</p></div>
        }
        .into_any(),
        PlanState::Impossible(errors) => view! {
            <div class="planner" id="planner">
                <h2>"What the planner predicts"</h2>
                <div class="alert error" id="planner-errors">
                    <strong>"The planner cannot plan this spec:"</strong>
                    <ul>{errors.into_iter().map(|e| view! { <li>{e.to_string()}</li> }).collect_view()}</ul>
                </div>
            </div>
        }
        .into_any(),
        PlanState::Ready { plan, spec, stale } => view! { <PlanView plan=*plan spec=*spec stale=stale/> }.into_any(),
    }
    }
}

#[component]
fn PlanView(plan: Plan, spec: ExperimentSpec, stale: bool) -> impl IntoView {
    let peak = plan.stages.get(plan.peak_stage).cloned();
    let Some(peak) = peak else { return ().into_any() };
    let p = &spec.parallel;
    let memory = peak.memory.total;
    let comm = peak.comm.clone();
    let rows = comm_rows(&comm);
    let where_ = if plan.stages.len() > 1 {
        format!("one rank of stage {} of {} (the stage that needs the most memory)", peak.stage, plan.stages.len())
    } else {
        "each rank".to_string()
    };
    let bubble = (p.pp > 1).then(|| {
        view! {
            <div>
                <span class="k">"pipeline bubble"</span>
                <span class="v" id="planner-bubble">{format::percent(plan.bubble_fraction)}</span>
                <span class="small muted">{format!("{}, P={} M={}", PipelineShape::of(&spec).formula_name(), p.pp, spec.pipeline_micro_batches())}</span>
            </div>
        }
    });
    // A fault-tolerant replacement's copy: once per rejoin, not per step.
    let rejoin = plan.rejoin.as_ref().map(|r| {
        view! {
            <div>
                <span class="k">"a rejoin copies"</span>
                <span class="v" id="planner-rejoin" title=format::bytes_exact(r.state_bytes)>{format::bytes(r.state_bytes as f64)}</span>
                <span class="small muted">"parameters and optimizer state in fp32, from a live replica, once per replacement"</span>
            </div>
        }
    });
    let bpp = plan.bytes_per_param;
    let comm_table = if rows.is_empty() {
        view! { <p class="muted small" id="planner-comm-table">"No communication: a single rank holds the whole model."</p> }
            .into_any()
    } else {
        view! {
            <table class="bytes-table" id="planner-comm-table">
                <thead><tr><th>"collective"</th><th>"what moves"</th><th>"bytes sent per rank per step"</th></tr></thead>
                <tbody>
                    {rows.into_iter().map(|(name, what, bytes)| view! {
                        <tr data-collective=name>
                            <td>{name}</td>
                            <td class="muted">{what}</td>
                            <td title=format::bytes_exact(bytes)>{format::bytes(bytes as f64)}</td>
                        </tr>
                    }).collect_view()}
                    <tr class="overall"><td>"total"</td><td></td><td title=format::bytes_exact(comm.total)>{format::bytes(comm.total as f64)}</td></tr>
                </tbody>
            </table>
        }
        .into_any()
    };
    view! {
        <div class="planner" class:stale=stale id="planner" data-stale=stale.to_string()>
            <h2>"What the planner predicts"</h2>
            <p class="muted small">
                {format!("For {where_}, from the spec alone (the analytic planner, the same code the server runs), updated as you type. ")}
                {format!(
                    "Model state: {} bytes per parameter ({} parameters + {} gradients + {} optimizer state), sharded over dp={} as sharding={} says.",
                    bpp.parameters + bpp.gradients + bpp.optimizer_state,
                    bpp.parameters,
                    bpp.gradients,
                    bpp.optimizer_state,
                    p.dp,
                    p.sharding.as_str()
                )}
            </p>
            {stale.then(|| view! { <p class="note warn">"Some field is not a complete value yet: this is the plan of the last complete spec."</p> })}
            <div class="derived planner-stats">
                <div>
                    <span class="k">"memory per rank (peak)"</span>
                    <span class="v" id="planner-memory" data-bytes=memory.to_string() title=format::bytes_exact(memory)>{format::bytes(memory as f64)}</span>
                </div>
                <div>
                    <span class="k">"sent per rank per step"</span>
                    <span class="v" id="planner-comm" data-bytes=comm.total.to_string() title=format::bytes_exact(comm.total)>{format::bytes(comm.total as f64)}</span>
                </div>
                {bubble}
                {rejoin}
                <div><span class="k">"tokens / step"</span><span class="v" id="planner-tokens">{format::si(plan.flops.tokens_per_step as f64)}</span></div>
                <div><span class="k">"FLOPs / step"</span><span class="v" id="planner-flops">{format::si(plan.flops.total)}</span></div>
                <div><span class="k">"FLOPs / rank / step"</span><span class="v">{format::si(plan.flops.per_rank)}</span></div>
                <div><span class="k">"parameters"</span><span class="v">{format::si(plan.param_count as f64)}</span></div>
            </div>
            <h3>"Memory per rank, by category"</h3>
            <MemoryLegend planner_only=true/>
            <MemoryBars bars=stage_bars(&plan) scale_max=0u64/>
            <h3>"Communication per optimizer step"</h3>
            {comm_table}
        </div>
    }
    .into_any()
}

#[cfg(test)]
mod tests {
    use super::*;
    use distlab_common::Sharding;

    fn spec(dp: usize, sharding: Sharding, pp: usize) -> ExperimentSpec {
        let mut spec = ExperimentSpec::default();
        spec.parallel.dp = dp;
        spec.parallel.sharding = sharding;
        spec.parallel.pp = pp;
        spec.model.layers = spec.model.layers.max(pp);
        spec
    }

    fn total(state: &PlanState) -> u64 {
        match state {
            PlanState::Ready { plan, .. } => plan.stages[plan.peak_stage].memory.total,
            other => panic!("not ready: {other:?}"),
        }
    }

    #[test]
    fn half_typed_input_keeps_the_last_plan_greyed() {
        let first = next_state(None, Some(&spec(1, Sharding::None, 1)));
        assert!(matches!(first, PlanState::Ready { stale: false, .. }));
        let typing = next_state(Some(&first), None);
        assert!(matches!(typing, PlanState::Ready { stale: true, .. }));
        assert_eq!(total(&typing), total(&first));
        assert_eq!(next_state(None, None), PlanState::Waiting);
        // Sharding over more ranks shrinks a rank's memory.
        let fsdp = next_state(Some(&typing), Some(&spec(4, Sharding::Fsdp, 1)));
        assert!(total(&fsdp) < total(&first));
        // Impossible specs list the planner's field errors; half-typed text keeps them.
        let mut bad = spec(1, Sharding::None, 1);
        bad.parallel.tp = 3;
        let impossible = next_state(Some(&fsdp), Some(&bad));
        let PlanState::Impossible(errors) = &impossible else { panic!("{impossible:?}") };
        assert!(errors.iter().any(|e| e.field == "parallel.tp"), "{errors:?}");
        assert_eq!(next_state(Some(&impossible), None), impossible);
    }

    #[test]
    fn communication_rows_follow_the_sharding() {
        let plan = |s: &ExperimentSpec| planner::plan(s).expect("plan");
        let names = |s: &ExperimentSpec| {
            let p = plan(s);
            comm_rows(&p.stages[p.peak_stage].comm).into_iter().map(|r| r.0).collect::<Vec<_>>()
        };
        assert!(names(&spec(1, Sharding::None, 1)).is_empty());
        assert_eq!(names(&spec(2, Sharding::None, 1)), vec!["dp all-reduce"]);
        assert_eq!(names(&spec(2, Sharding::Zero1, 1)), vec!["dp all-reduce", "dp all-gather"]);
        assert_eq!(names(&spec(2, Sharding::Fsdp, 1)), vec!["dp reduce-scatter", "dp all-gather"]);
        assert_eq!(names(&spec(1, Sharding::None, 2)), vec!["pp send"]);
    }

    #[test]
    fn bars_per_stage_of_short_pipelines() {
        let one = planner::plan(&spec(1, Sharding::None, 1)).expect("plan");
        assert_eq!(stage_bars(&one).iter().map(|b| b.label.as_str()).collect::<Vec<_>>(), vec!["per rank"]);
        let two = planner::plan(&spec(1, Sharding::None, 2)).expect("plan");
        let labels: Vec<String> = stage_bars(&two).into_iter().map(|b| b.label).collect();
        assert_eq!(labels.len(), 2);
        assert!(labels.iter().filter(|l| l.ends_with("(peak)")).count() == 1, "{labels:?}");
        let mut long = spec(1, Sharding::None, 12);
        long.model.layers = 12;
        let long = planner::plan(&long).expect("plan");
        assert_eq!(stage_bars(&long).len(), 1);
    }
}
