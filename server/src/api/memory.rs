//! `GET /api/experiments/{id}/memory`: every rank's measured memory (from the `memory` of
//! its stored trace) next to the analytic planner's prediction for its pipeline stage,
//! with one line per category where the two differ, saying by how much and why
//! ([`differences`], a pure function).
//!
//! The store decodes the traces only as far as their `memory` (a trace can be a few MB of
//! spans and ring steps, which this endpoint does not need).

use std::collections::BTreeMap;

use axum::extract::{Path, State};
use axum::Json;
use distlab_common::memory::{MemoryCategory as Category, MemoryView, RankMemoryReport, RankMemoryView};
use distlab_common::planner::{self, Plan, RankMemory};
use distlab_common::{Checkpointing, ExperimentSpec, Sharding};

use crate::api::error::HttpError;
use crate::api::extract::parse_id;
use crate::{store, AppState};

/// `GET /api/experiments/{id}/memory`: `MemoryView`, one entry per rank 0..world_size.
#[utoipa::path(
    get, path = "/experiments/{id}/memory", operation_id = "experiment_memory", tag = "experiments",
    params(("id" = i64, Path, description = "the experiment's id")),
    responses(
        (status = 200, body = distlab_common::memory::MemoryView),
        (status = 404, description = "no such experiment", body = distlab_common::ApiError),
    ),
)]
pub async fn memory(State(state): State<AppState>, Path(raw_id): Path<String>) -> Result<Json<MemoryView>, HttpError> {
    let id = parse_id(&raw_id)?;
    let spec = store::experiments::spec(&state.db, id).await?.ok_or_else(|| HttpError::no_experiment(id))?;
    let plan = planner::plan(&spec).map_err(|errors| {
        let list: Vec<String> = errors.iter().map(ToString::to_string).collect();
        HttpError::internal("planning a stored spec", format!("experiment {id}: {}", list.join("; ")))
    })?;

    let measured = store::traces::memory_reports(&state.db, id).await?;
    Ok(Json(view(&spec, plan, measured)))
}

/// The view of every rank 0..world_size: `measured` by rank (ranks without a report are
/// None), the planner's prediction for the rank (its stage's; under asynchronous SGD rank
/// 0's own, with the parameter server), and their differences.
pub fn view(spec: &ExperimentSpec, plan: Plan, mut measured: BTreeMap<i64, RankMemoryReport>) -> MemoryView {
    let ranks = (0..spec.world_size())
        .map(|rank| {
            let stage = spec.stage_of(rank);
            let predicted = plan.rank_memory(spec, rank);
            let measured = measured.remove(&(rank as i64));
            let differences = measured.as_ref().map(|m| differences(&m.peak, &predicted, spec)).unwrap_or_default();
            RankMemoryView { rank: rank as u32, stage, measured, predicted, differences }
        })
        .collect();
    MemoryView { ranks, plan }
}

/// One line per category whose measured peak differs from the planner's prediction, in
/// the order of [`RankMemory`]'s fields: "activations: measured 3.20 MiB, planner
/// 3.06 MiB (+147456 B, +4.7%): ...why". Equal categories give no line; `total` never does.
/// The offloaded state (off the device) is compared too, last.
pub fn differences(measured: &RankMemory, predicted: &RankMemory, spec: &ExperimentSpec) -> Vec<String> {
    Category::EVERY
        .iter()
        .filter(|c| c.planned())
        .filter_map(|&c| {
            let (m, p) = (c.of(measured), c.of(predicted));
            (m != p).then(|| {
                format!(
                    "{}: measured {}, planner {} ({}): {}",
                    c.name(),
                    human_bytes(m),
                    human_bytes(p),
                    by_how_much(m, p),
                    reason(c, m > p, spec)
                )
            })
        })
        .collect()
}

/// "+147456 B, +4.7%", or "+147456 B; the planner expects none" when the prediction is 0.
fn by_how_much(measured: u64, predicted: u64) -> String {
    let diff = measured as i128 - predicted as i128;
    if predicted == 0 {
        format!("{diff:+} B; the planner expects none")
    } else {
        let percent = diff as f64 / predicted as f64 * 100.0;
        if percent.abs() < 0.05 {
            format!("{diff:+} B, under 0.1%")
        } else {
            format!("{diff:+} B, {percent:+.1}%")
        }
    }
}

/// Why a category can differ, in words (`more`: the engine measured more than predicted).
fn reason(c: Category, more: bool, spec: &ExperimentSpec) -> String {
    let p = &spec.parallel;
    match c {
        Category::Parameters | Category::Gradients | Category::OptimizerState | Category::Offloaded => {
            "unexpected: the engine and the planner disagree on model state, which both count exactly \
             (parameters x bytes per parameter, sharded over dp as the sharding says)"
                .into()
        }
        Category::GatheredParameters => {
            let base = "the planner counts one unit gathered in full at a time (the largest of a block, the \
                        embeddings, or the final LayerNorm + LM head), with sharding=fsdp only";
            if p.sharding != Sharding::Fsdp {
                format!("{base}; this run has sharding={}", p.sharding.as_str())
            } else if more {
                format!("{base}; the engine held more at once (e.g. the next unit gathered before the last was freed)")
            } else {
                format!("{base}; the engine's largest gathered unit was smaller")
            }
        }
        Category::Activations => {
            let base = "the planner estimates the tensors each block saves for backward (its per-layer formula), \
                        plus each stage's input and, on the last stage, the logits, for every micro-batch in flight";
            let recompute = match spec.train.checkpointing {
                Checkpointing::None => "",
                Checkpointing::Selective => {
                    " (with selective recompute, without attention's probabilities) and one block's probabilities"
                }
                Checkpointing::Every | Checkpointing::Sqrt => {
                    " and, with activation checkpointing, one recomputed segment"
                }
            };
            if more {
                format!("{base}{recompute}; the engine also keeps buffers that formula leaves out")
            } else {
                format!("{base}{recompute}; the engine keeps less than that formula assumes")
            }
        }
        Category::ActivationGrads => {
            let base = "the planner counts one set of backward's activation-gradient buffers (residual, LayerNorm, \
                        attention, QKV, MLP hidden and attention-probability gradients), reused by every block";
            if more {
                format!("{base}; the engine held more gradient scratch at its peak")
            } else {
                format!("{base}; the engine needed less scratch than that")
            }
        }
        Category::Transient | Category::Transport | Category::Checkpoint => {
            "measured only: the planner does not predict it".into()
        }
        Category::CompressionState => format!(
            "the planner counts one fp32 residual per gradient value and PowerSGD's Q per matrix, with \
             grad_compression set and dp > 1 (this run: grad_compression={}, dp={}); the engine {}",
            p.grad_compression.as_str(),
            p.dp,
            if more { "kept more" } else { "kept less" }
        ),
        Category::CommBuffers => {
            let held = if more { "held more" } else { "held less" };
            let pipeline = if p.pp > 1 {
                "; with pp > 1 it adds the stage's receive buffers, while activations and gradients queued for \
                 sending to a neighbour (as many as the schedule runs ahead) come on top and are not predicted"
            } else {
                ""
            };
            let reason = match p.sharding {
                Sharding::None | Sharding::Zero1 => format!(
                    "with sharding={} the planner counts the gradient buckets copied for the communication thread: \
                     one more gradient's worth when dp > 1, none with dp = 1 (this run has dp={}); the engine's \
                     buckets {held} at their peak",
                    p.sharding.as_str(),
                    p.dp
                ),
                Sharding::Zero2 | Sharding::Fsdp | Sharding::Hsdp if p.pp_schedule.splits_backward() && p.pp > 1 => {
                    format!(
                        "with sharding={} under {} the planner counts the units' gradients waiting from their B to \
                         their W (a chunk's at a time, followed pass by pass) before they are reduce-scattered; the \
                         engine {held} waiting for its collectives at once",
                        p.sharding.as_str(),
                        p.pp_schedule.title()
                    )
                }
                Sharding::Zero2 | Sharding::Fsdp | Sharding::Hsdp => format!(
                    "with sharding={} the planner counts one unit's gradient (the largest unit) held until it is \
                     reduce-scattered; the engine {held} waiting for its collectives at once",
                    p.sharding.as_str()
                ),
            };
            format!("{reason}{pipeline}")
        }
    }
}

/// Bytes in binary units: 96 -> "96 B", 3_355_443 -> "3.20 MiB".
fn human_bytes(n: u64) -> String {
    const UNITS: [&str; 6] = ["KiB", "MiB", "GiB", "TiB", "PiB", "EiB"];
    if n < 1024 {
        return format!("{n} B");
    }
    let mut value = n as f64 / 1024.0;
    let mut unit = 0;
    while value >= 1024.0 && unit + 1 < UNITS.len() {
        value /= 1024.0;
        unit += 1;
    }
    format!("{value:.2} {}", UNITS[unit])
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spec(dp: usize, sharding: Sharding) -> ExperimentSpec {
        let mut spec = ExperimentSpec::default();
        spec.parallel.dp = dp;
        spec.parallel.sharding = sharding;
        spec
    }

    fn predicted(spec: &ExperimentSpec) -> RankMemory {
        let plan = planner::plan(spec).expect("plan");
        plan.stages[plan.peak_stage].memory.clone()
    }

    #[test]
    fn equal_memory_has_no_differences() {
        let s = spec(2, Sharding::None);
        let p = predicted(&s);
        assert_eq!(differences(&p, &p, &s), Vec::<String>::new());
        // `total` alone is not a category.
        let m = RankMemory { total: p.total + 1, ..p.clone() };
        assert!(differences(&m, &p, &s).is_empty());
    }

    #[test]
    fn one_line_per_differing_category_in_field_order() {
        let s = spec(2, Sharding::None);
        let p = predicted(&s);
        let m = RankMemory { activations: p.activations + p.activations / 20, gradients: p.gradients - 4, ..p.clone() };
        let lines = differences(&m, &p, &s);
        assert_eq!(lines.len(), 2, "{lines:?}");
        assert!(lines[0].starts_with("gradients: measured "), "{}", lines[0]);
        assert!(lines[0].contains("(-4 B, under 0.1%)"), "{}", lines[0]);
        assert!(lines[0].contains("unexpected: the engine and the planner disagree on model state"), "{}", lines[0]);
        assert!(lines[1].starts_with("activations: measured "), "{}", lines[1]);
        assert!(lines[1].contains("+5.0%"), "{}", lines[1]);
        assert!(lines[1].contains("also keeps buffers"), "{}", lines[1]);
    }

    #[test]
    fn model_state_differences_are_always_unexpected() {
        let s = spec(4, Sharding::Fsdp);
        let p = predicted(&s);
        for m in
            [RankMemory { parameters: p.parameters * 2, ..p.clone() }, RankMemory { optimizer_state: 0, ..p.clone() }]
        {
            let lines = differences(&m, &p, &s);
            assert_eq!(lines.len(), 1);
            assert!(lines[0].contains("unexpected"), "{}", lines[0]);
        }
    }

    #[test]
    fn a_category_the_planner_expects_none_of() {
        // Without FSDP the planner gathers nothing.
        let s = spec(2, Sharding::None);
        let p = predicted(&s);
        assert_eq!(p.gathered_parameters, 0);
        let m = RankMemory { gathered_parameters: 3 * 1024 * 1024, ..p.clone() };
        assert_eq!(
            differences(&m, &p, &s),
            vec!["gathered parameters: measured 3.00 MiB, planner 0 B (+3145728 B; the planner expects none): \
                 the planner counts one unit gathered in full at a time (the largest of a block, the embeddings, \
                 or the final LayerNorm + LM head), with sharding=fsdp only; this run has sharding=none"
                .to_string()]
        );
    }

    #[test]
    fn reasons_follow_the_sharding() {
        let s = spec(2, Sharding::Fsdp);
        let p = predicted(&s);
        assert!(p.gathered_parameters > 0 && p.comm_buffers > 0);
        let m = RankMemory {
            gathered_parameters: p.gathered_parameters / 2,
            comm_buffers: p.comm_buffers * 2,
            ..p.clone()
        };
        let lines = differences(&m, &p, &s);
        assert_eq!(lines.len(), 2, "{lines:?}");
        assert!(lines[0].starts_with("gathered parameters:") && lines[0].contains("smaller"), "{}", lines[0]);
        assert!(lines[1].starts_with("communication buffers:"), "{}", lines[1]);
        assert!(lines[1].contains("+100.0%") && lines[1].contains("one unit's gradient"), "{}", lines[1]);
        // DDP: the buckets.
        let s = spec(2, Sharding::None);
        let p = predicted(&s);
        let m = RankMemory { comm_buffers: p.comm_buffers - 1024, ..p.clone() };
        let lines = differences(&m, &p, &s);
        assert!(lines[0].contains("gradient buckets") && lines[0].contains("held less"), "{}", lines[0]);
    }

    #[test]
    fn bytes_in_words() {
        assert_eq!(human_bytes(0), "0 B");
        assert_eq!(human_bytes(1023), "1023 B");
        assert_eq!(human_bytes(1024), "1.00 KiB");
        assert_eq!(human_bytes(3_355_443), "3.20 MiB");
        assert_eq!(human_bytes(112 << 30), "112.00 GiB");
        assert_eq!(human_bytes(u64::MAX), "16.00 EiB");
        assert_eq!(by_how_much(105, 100), "+5 B, +5.0%");
        assert_eq!(by_how_much(0, u64::MAX), format!("-{} B, -100.0%", u64::MAX));
    }

    #[test]
    fn view_lists_every_rank_with_its_stage() {
        let mut s = spec(2, Sharding::None);
        s.parallel.pp = 2;
        let plan = planner::plan(&s).expect("plan");
        let report = RankMemoryReport { rank: 2, peak: plan.stages[0].memory.clone(), ..Default::default() };
        let v = view(&s, plan.clone(), BTreeMap::from([(2, report.clone())]));
        assert_eq!(v.ranks.len(), 4);
        assert_eq!(v.ranks.iter().map(|r| r.stage).collect::<Vec<_>>(), vec![0, 1, 0, 1]);
        assert_eq!(v.ranks[2].measured, Some(report));
        assert!(v.ranks[2].differences.is_empty());
        assert!(v.ranks.iter().enumerate().all(|(i, r)| r.rank as usize == i));
        assert!(v.ranks.iter().filter(|r| r.rank != 2).all(|r| r.measured.is_none() && r.differences.is_empty()));
        assert_eq!(v.ranks[1].predicted, plan.stages[1].memory);
    }
}
