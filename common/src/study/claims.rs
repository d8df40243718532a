//! A flashcard's claim checked by a run: the number the card predicts next to the number
//! the lab measured (`GET /api/cards/checks`). Each [`ClaimCheck`] reads one kind of
//! evidence from a finished run of a preset: collective byte counters, the memory
//! ledger, the pipeline timeline, the losses.

use serde::{Deserialize, Serialize};

mod all_reduce;
mod data_parallel;
mod experts;

use crate::analysis::compare;
use crate::analysis::pipeline::{default_step, measured_bubble, project, recorded_steps, stage_durations, stage_rows};
use crate::plan::planner;
use crate::plan::schedule::Pipeline;
use crate::study::cards::{Card, ClaimCheck, Demo};
use crate::wire::events::MetricPoint;
use crate::wire::trace::{CollectiveOp, RankTrace, RingPhase};
use crate::{Checkpointing, ExperimentSpec, ExperimentView};

/// `GET /api/cards/checks`: one entry per (check, preset) the deck uses.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct ClaimChecks {
    pub checks: Vec<ClaimStatus>,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct ClaimStatus {
    pub check: ClaimCheck,
    /// The preset whose run checks it.
    pub preset: String,
    /// None until a run of the preset (and, for an equality, its partner) has finished.
    pub measurement: Option<Measurement>,
    /// What to run to check it, or why the latest run could not.
    pub how: String,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct Measurement {
    /// The run measured (the latest finished run of the preset).
    pub experiment_id: i64,
    pub predicted: String,
    pub measured: String,
    /// The measurement agrees with the prediction (within the stated bound).
    pub agrees: bool,
    /// What else the measured number contains, when the formula leaves something out.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub note: Option<String>,
}

/// A finished run with what a check reads.
pub struct RunEvidence<'a> {
    pub view: &'a ExperimentView,
    pub metrics: &'a [MetricPoint],
    pub ranks: &'a [RankTrace],
    /// Steps the traces cover: a resumed run's ranks trace only their last attempt.
    pub traced_steps: u64,
}

/// The preset whose latest run checks a card's claim: the card's own demo run, or for a
/// planner or ring demo the check's canonical preset. The loss-scaling claim is always
/// checked on fp16 without scaling, set against the same config with it.
pub fn preset_for(card: &Card) -> Option<&str> {
    let check = card.claim.as_ref()?.check;
    Some(match (&card.demo, check) {
        (_, ClaimCheck::LossScalingUnderflow) | (Demo::Planner { .. } | Demo::Ring { .. }, _) => {
            // A ZeRO card's planner demo is checked on the preset of its own stage.
            match (check, card.demo.planner_spec()) {
                (ClaimCheck::ZeroMemory, Some(Ok(spec))) => match spec.parallel.sharding {
                    crate::Sharding::Zero1 => "zero1",
                    crate::Sharding::Zero2 => "zero2",
                    _ => canonical_preset(check),
                },
                _ => canonical_preset(check),
            }
        }
        (demo, _) => demo.preset().unwrap_or(canonical_preset(check)),
    })
}

/// The preset that checks a claim when the card's own demo runs none (a planner demo).
pub fn canonical_preset(check: ClaimCheck) -> &'static str {
    match check {
        ClaimCheck::AllreduceBytes | ClaimCheck::RingPhaseBytes => "allreduce",
        ClaimCheck::DdpEqualsOneRank => "ddp2",
        ClaimCheck::BubbleFraction | ClaimCheck::PipelineActivationPeaks => "pipeline",
        ClaimCheck::BytesPerParam => "reference",
        ClaimCheck::ActivationCheckpointingMemory | ClaimCheck::CheckpointingRecomputeTime => "checkpointing",
        ClaimCheck::ZeroMemory | ClaimCheck::FsdpTraffic | ClaimCheck::FsdpGatheredPeak => "fsdp",
        ClaimCheck::Zero2Traffic => "zero2",
        ClaimCheck::Zero1Traffic => "zero1",
        ClaimCheck::ExpertAllToAll | ClaimCheck::ExpertParameters => "experts",
        ClaimCheck::FlashAttentionMemory => "flash",
        ClaimCheck::PrefetchGatheredPeak => "fsdp",
        ClaimCheck::SequenceParallelActivations => "megatron",
        ClaimCheck::TwoByteWire => "zero2",
        ClaimCheck::TreeAllreduce => "allreduce-tree",
        ClaimCheck::HierarchicalAllreduce => "allreduce-hierarchical",
        ClaimCheck::CompressedGradients => "topk",
        ClaimCheck::AccumulationAllreduces => "ddp2",
        ClaimCheck::ExpertCapacity => "experts",
        ClaimCheck::DiskOffloadMemory => "offload-disk",
        ClaimCheck::TpAllreduces => "megatron",
        ClaimCheck::LossScalingUnderflow => "fp16-plain",
        ClaimCheck::Bf16NoScaling => "bf16",
    }
}

/// Whether `candidate` is the run a check sets `run` against, for the checks that compare
/// two measured runs: any one-rank run of the same training (equal losses), the same
/// config with dynamic loss scaling (underflow), in fp32 (bf16), without activation
/// checkpointing (its memory), with the GPipe schedule (activation peaks per stage), with
/// naive attention, with FSDP's prefetch, with sequence parallelism, with a 2-byte wire,
/// with more accumulation steps, with room for every token in each expert, or with the
/// optimizer's state in memory. None: the check needs no partner.
pub fn is_partner(check: ClaimCheck, run: &ExperimentSpec, candidate: &ExperimentSpec) -> Option<bool> {
    let mut twin = run.clone();
    match check {
        ClaimCheck::DdpEqualsOneRank => {
            return Some(candidate.world_size() == 1 && compare::why_not_equal(run, candidate).is_empty())
        }
        ClaimCheck::LossScalingUnderflow => twin.train.loss_scaling = crate::LossScaling::Dynamic,
        ClaimCheck::Bf16NoScaling => {
            twin.train.precision = crate::Precision::Fp32;
            twin.train.loss_scaling = crate::LossScaling::None;
        }
        ClaimCheck::ActivationCheckpointingMemory => twin.train.checkpointing = Checkpointing::None,
        ClaimCheck::PipelineActivationPeaks => twin.parallel.pp_schedule = crate::PpSchedule::Gpipe,
        ClaimCheck::FlashAttentionMemory => twin.train.attention = crate::Attention::Naive,
        ClaimCheck::PrefetchGatheredPeak => twin.parallel.prefetch = true,
        ClaimCheck::SequenceParallelActivations => twin.parallel.sequence_parallel = true,
        ClaimCheck::TwoByteWire => twin.parallel.comm_dtype = run.train.precision,
        ClaimCheck::AccumulationAllreduces => {
            twin.train.grad_accum = candidate.train.grad_accum.max(run.train.grad_accum + 1)
        }
        ClaimCheck::ExpertCapacity => {
            let every_token = run.model.experts as f64 / run.model.expert_top_k.max(1) as f64;
            twin.model.capacity_factor = candidate.model.capacity_factor.max(every_token)
        }
        ClaimCheck::DiskOffloadMemory => twin.parallel.offload = crate::Offload::None,
        _ => return None,
    }
    Some(twin.same_up_to_name(candidate))
}

/// Checks `check` on `run` (and `partner`, when the check compares two runs).
pub fn measure(check: ClaimCheck, run: &RunEvidence, partner: Option<&RunEvidence>) -> Result<Measurement, String> {
    let spec = &run.view.spec;
    let plan = planner::plan(spec).map_err(|_| "the planner cannot plan the run's spec".to_string())?;
    let id = run.view.id;
    let rank0 = run.ranks.iter().find(|r| r.rank == 0);
    let traced_steps = run.traced_steps.max(1);
    let m = |predicted: String, measured: String, agrees: bool| Measurement {
        experiment_id: id,
        predicted,
        measured,
        agrees,
        note: None,
    };
    match check {
        ClaimCheck::AllreduceBytes => {
            if let Some(c) = run.view.summary.as_ref().and_then(|s| s.collective.as_ref()) {
                let most = c.bytes_sent.iter().copied().max().unwrap_or(0);
                let least = c.bytes_sent.iter().copied().min().unwrap_or(0);
                // The ring's steps, one after another: what its latency grows with.
                let rank0_steps = run.ranks.iter().filter(|r| r.rank == 0).flat_map(|r| &r.comm.steps);
                let steps = rank0_steps.filter(|s| s.from == 0).count();
                return Ok(m(
                    format!("{} bytes per rank, in 2(W-1) = {} steps", c.formula_bytes, 2 * c.world.saturating_sub(1)),
                    format!(
                        "{least}–{most} bytes per rank ({} ranks), rank 0 sent in {steps} steps: the bytes per rank stay \
                         about 2D whatever W, the steps grow with it",
                        c.world
                    ),
                    least == most && (most as f64 - c.formula_bytes).abs() < 0.5,
                ));
            }
            // The data-parallel ring is the one traced (tensor and pipeline rings are not).
            let rank = rank0.ok_or("the run recorded no trace")?;
            let sent: u64 = op_counters(rank, CollectiveOp::AllReduce).map(|c| c.bytes_sent).sum();
            let predicted = plan.stages[0].comm.dp_all_reduce;
            let per_step = sent / traced_steps;
            Ok(m(
                format!("{} per rank per step (2(W-1)/W x D, W={})", bytes_text(predicted), spec.parallel.dp),
                format!("{} on rank 0", bytes_text(per_step)),
                per_step == predicted,
            ))
        }
        ClaimCheck::BytesPerParam => {
            let rank = rank0.ok_or("the run recorded no trace")?;
            let measured = rank.memory.as_ref().ok_or("the run recorded no memory")?;
            let stage = &plan.stages[spec.stage_of(0)];
            let (got, want) = (model_state(&measured.peak), model_state(&stage.memory));
            let per_param = |b: u64| b as f64 / stage.params_per_rank.max(1) as f64;
            Ok(m(
                format!("{:.2} bytes per parameter", per_param(want)),
                format!("{:.2} bytes per parameter ({} on rank 0)", per_param(got), bytes_text(got)),
                got == want,
            ))
        }
        ClaimCheck::ZeroMemory => {
            let rank = rank0.ok_or("the run recorded no trace")?;
            let got = &rank.memory.as_ref().ok_or("the run recorded no memory")?.peak;
            let stage = &plan.stages[spec.stage_of(0)];
            let want = &stage.memory;
            let counts = zero_counts(spec, stage.params_per_rank, want);
            let total = model_state(got);
            let matching: Vec<&str> = counts.iter().filter(|c| c.bytes == total).map(|c| c.source).collect();
            let same_categories = (got.parameters, got.gradients, got.optimizer_state)
                == (want.parameters, want.gradients, want.optimizer_state);
            let predicted = counts
                .iter()
                .map(|c| format!("{} = {} ({})", c.formula, bytes_text(c.bytes), c.source))
                .collect::<Vec<_>>()
                .join("; ");
            Ok(m(
                format!(
                    "model state on rank 0, sharding {} over K = {}, N = {} parameters: {predicted}",
                    spec.parallel.sharding.as_str(),
                    spec.parallel.dp,
                    stage.params_per_rank
                ),
                format!(
                    "{}: parameters {}, gradients {}, optimizer {}{}",
                    bytes_text(total),
                    bytes_text(got.parameters),
                    bytes_text(got.gradients),
                    bytes_text(got.optimizer_state),
                    match matching.as_slice() {
                        [] => " (neither count)".to_string(),
                        sources => format!(" (the count of {})", sources.join(" and ")),
                    }
                ),
                same_categories && counts.first().is_some_and(|c| c.bytes == total),
            ))
        }
        ClaimCheck::ActivationCheckpointingMemory => {
            // Measured on both runs: this one, and the same config without checkpointing.
            let plain = partner.ok_or(
                "no finished run of the same config without checkpointing yet (resubmit the preset with \
                 checkpointing none)",
            )?;
            let with = measured_activations(run)?;
            let without = measured_activations(plain)?;
            let ratio = with as f64 / without.max(1) as f64;
            let mut plain_spec = spec.clone();
            plain_spec.train.checkpointing = Checkpointing::None;
            let planned = planner::plan(&plain_spec).map(|p| p.peak_activations()).unwrap_or(0);
            let planned_ratio = plan.peak_activations() as f64 / planned.max(1) as f64;
            Ok(m(
                format!(
                    "checkpointing {} keeps {:.0}% of the activations (planner: {} of {})",
                    checkpointing_name(spec.train.checkpointing),
                    100.0 * planned_ratio,
                    bytes_text(plan.peak_activations()),
                    bytes_text(planned)
                ),
                format!(
                    "{:.0}%: {} kept, {} without checkpointing (run {})",
                    100.0 * ratio,
                    bytes_text(with),
                    bytes_text(without),
                    plain.view.id
                ),
                spec.train.checkpointing != Checkpointing::None && (ratio - planned_ratio).abs() <= 0.05,
            ))
        }
        ClaimCheck::CheckpointingRecomputeTime => {
            // Rank 0's traced steps: whole forward passes, the blocks' recomputed forwards and
            // the units' backwards are spans of their own, end to end on the compute lane.
            let rank = rank0.ok_or("the run recorded no trace")?;
            let total = |keep: &dyn Fn(&crate::wire::trace::Span) -> bool| -> u64 {
                rank.spans
                    .iter()
                    .filter(|s| s.lane == crate::wire::trace::lane::COMPUTE && keep(s))
                    .map(|s| s.duration_us())
                    .sum()
            };
            let recompute = total(&|s| s.is_recompute());
            let forward = total(&|s| s.kind == crate::wire::trace::SpanKind::Forward && !s.is_recompute());
            let backward = total(&|s| {
                matches!(s.kind, crate::wire::trace::SpanKind::Backward | crate::wire::trace::SpanKind::Weights)
            });
            if forward == 0 || backward == 0 {
                return Err(
                    "the run recorded no forward or backward spans (a pipelined run times whole passes only)".into()
                );
            }
            let rise = recompute as f64 / (forward + backward) as f64;
            let planned = plan.flops.recompute / (plan.flops.total - plan.flops.recompute).max(1.0);
            Ok(Measurement {
                note: Some(
                    "The texts price checkpointing three ways: about a third more compute (one more forward, the \
                     backward costing two: the deck, the quiz), 20 to 40% more time (the notes, the quiz's \
                     30-40%), and twice the forward's compute (the chapter). All three describe the same extra \
                     forward: measured against the step, against the time, or against the forward alone."
                        .into(),
                ),
                ..m(
                    format!(
                        "recomputing checkpointing {}'s blocks adds {:.0}% to the forward and backward FLOPs (planner); \
                         one more forward is about +33% when backward costs twice the forward",
                        checkpointing_name(spec.train.checkpointing),
                        100.0 * planned
                    ),
                    format!(
                        "+{:.0}% of the time: recompute {} ms against forward {} ms and backward {} ms on rank 0 over \
                         {} steps; the recompute took {:.2}x the forward's time",
                        100.0 * rise,
                        ms(recompute),
                        ms(forward),
                        ms(backward),
                        traced_steps,
                        recompute as f64 / forward as f64
                    ),
                    spec.train.checkpointing != Checkpointing::None && recompute > 0 && (rise - planned).abs() <= 0.12,
                )
            })
        }
        ClaimCheck::PipelineActivationPeaks => {
            // Each stage's activation peak under this schedule and under GPipe, both measured
            // (the ledger of every rank of the stage), as a share of GPipe's.
            let gpipe = partner.ok_or(
                "no finished run of the same config with pp_schedule gpipe yet (resubmit the preset with gpipe)",
            )?;
            let (ours, theirs) = (stage_activation_peaks(run)?, stage_activation_peaks(gpipe)?);
            let gpipe_plan = planner::plan(&gpipe.view.spec).map_err(|_| "the planner cannot plan the GPipe run")?;
            let share = |a: u64, b: u64| a as f64 / b.max(1) as f64;
            let planned: Vec<f64> = plan
                .stages
                .iter()
                .zip(&gpipe_plan.stages)
                .map(|(a, b)| share(a.memory.activations, b.memory.activations))
                .collect();
            let measured: Vec<f64> = ours.iter().zip(&theirs).map(|(&a, &b)| share(a, b)).collect();
            let held: Vec<String> = plan.stages.iter().map(|s| s.in_flight_micro_batches.to_string()).collect();
            let percents = |v: &[f64]| v.iter().map(|x| format!("{:.0}%", 100.0 * x)).collect::<Vec<_>>().join(", ");
            let agrees = measured.len() == planned.len()
                && measured.iter().zip(&planned).all(|(m, p)| (m - p).abs() <= 0.05)
                && measured.first().is_some_and(|&first| first < 1.0);
            Ok(m(
                format!(
                    "stages 0-{} hold {} of GPipe's M = {} micro-batches: {} of its activations (planner)",
                    planned.len().saturating_sub(1),
                    held.join(", "),
                    spec.pipeline_micro_batches(),
                    percents(&planned)
                ),
                format!(
                    "{}: {} against GPipe's {} (run {})",
                    percents(&measured),
                    ours.iter().map(|&b| bytes_text(b)).collect::<Vec<_>>().join(", "),
                    theirs.iter().map(|&b| bytes_text(b)).collect::<Vec<_>>().join(", "),
                    gpipe.view.id
                ),
                agrees,
            ))
        }
        ClaimCheck::BubbleFraction => {
            let steps = recorded_steps(run.ranks);
            let step = default_step(&steps).ok_or("the run recorded no timeline")?;
            let rows = stage_rows(run.ranks, step);
            let bubble = measured_bubble(&rows).ok_or("the timeline has no forward or backward")?;
            // The passes replayed with a core per stage, as the formulas assume: each stage's
            // forward and backward with a core to themselves (`stage_durations`) over every
            // recorded step after the first (the warm-up).
            let mut pooled = rows.clone();
            pooled.iter_mut().for_each(|r| r.spans.clear());
            for &s in steps.iter().filter(|&&s| s > 0 || steps.len() == 1) {
                for (row, more) in pooled.iter_mut().zip(stage_rows(run.ranks, s)) {
                    row.spans.extend(more.spans);
                }
            }
            let pipe = Pipeline::of(spec);
            let stages: Vec<usize> = rows.iter().map(|r| spec.stage_of(r.rank as usize)).collect();
            let durations = stage_durations(&pooled, &stages, pipe.stages)
                .ok_or("the timeline has a stage without a forward or a backward")?;
            let passes = durations
                .iter()
                .map(|d| format!("{}+{}", ms(d.forward), ms(d.backward + d.weights)))
                .collect::<Vec<_>>()
                .join(", ");
            let projected = project(pipe, &durations, step)
                .and_then(|rows| measured_bubble(&rows))
                .ok_or("the timeline has a stage without a forward or a backward")?;
            let (p, m_) = (spec.parallel.pp as f64, spec.pipeline_micro_batches() as f64);
            let formula = pipe.formula_bubble();
            // The chapter's simpler count, (N-1)/M with N the stages, for the plain schedules.
            let simple = (!pipe.splits_backward() && pipe.chunks == 1).then(|| (p - 1.0) / m_.max(1.0));
            let closer = match simple {
                Some(simple) if (projected.overall - simple).abs() < (projected.overall - formula).abs() => "(P-1)/M",
                _ => pipe.formula_name(),
            };
            Ok(Measurement {
                note: Some(format!(
                    "The formulas assume every stage has a processor of its own and equal work. Here {} rank \
                     processes run at once on the worker's machine: with more of them than cores a stage also \
                     waits for a core, which the whole step's bubble counts. The replay runs the step's own \
                     passes (each stage's forward and backward as they take with a core, over the recorded steps) \
                     with a core per stage; it is what the formulas describe. (P-1)/M (the chapter, N = P) leaves out that the last micro-batch's \
                     backward also has to drain through the P-1 stages: the step is M+P-1 pass-times long, not M.",
                    spec.world_size()
                )),
                ..m(
                    format!(
                        "{} = {:.1}% (P={}, M={}){}",
                        pipe.formula_name(),
                        100.0 * formula,
                        spec.parallel.pp,
                        spec.pipeline_micro_batches(),
                        simple.map(|s| format!("; the simpler (P-1)/M = {:.1}%", 100.0 * s)).unwrap_or_default()
                    ),
                    format!(
                        "{:.1}% replayed with a core per stage, closer to {closer} (the stages' forward+backward: \
                         {passes} ms; {:.1}% idle in step {step} on this machine's cores)",
                        100.0 * projected.overall,
                        100.0 * bubble.overall
                    ),
                    // (the stages' passes differ by a few percent, one from the other and step
                    // to step: the slowest sets the pace, and the replay's bubble grows with it)
                    (projected.overall - formula).abs() <= 0.08,
                )
            })
        }
        ClaimCheck::FsdpGatheredPeak => {
            let rank = rank0.ok_or("the run recorded no trace")?;
            let peak = &rank.memory.as_ref().ok_or("the run recorded no memory")?.peak;
            let stage = &plan.stages[spec.stage_of(0)];
            let whole = stage.params_per_rank.saturating_mul(plan.bytes_per_param.parameters);
            let (shard, gathered) = (stage.memory.parameters, stage.memory.gathered_parameters);
            Ok(m(
                format!(
                    "the weights' shard kept ({}) plus one unit gathered at a time ({}), against the whole model's {}",
                    bytes_text(shard),
                    bytes_text(gathered),
                    bytes_text(whole)
                ),
                format!(
                    "{} kept and at most {} gathered at once on rank 0",
                    bytes_text(peak.parameters),
                    bytes_text(peak.gathered_parameters)
                ),
                spec.parallel.sharding == crate::Sharding::Fsdp
                    && peak.parameters == shard
                    && peak.gathered_parameters == gathered
                    && gathered > 0
                    && gathered < whole,
            ))
        }
        ClaimCheck::Zero2Traffic | ClaimCheck::FsdpTraffic => {
            let rank = rank0.ok_or("the run recorded no trace")?;
            let (rs, ag) = (CollectiveOp::ReduceScatter, CollectiveOp::AllGather);
            let sent_in = |op| op_counters(rank, op).map(|c| c.bytes_sent).sum::<u64>() / traced_steps;
            let (rs_bytes, ag_bytes) = (sent_in(rs), sent_in(ag));
            let per_step = rs_bytes + ag_bytes;
            let stage = &plan.stages[spec.stage_of(0)];
            let planned = stage.comm.dp_reduce_scatter + stage.comm.dp_all_gather;
            // D: the gradient (or the parameters) as they cross the wire.
            let d = stage.params_per_rank.saturating_mul(planner::wire_bytes(spec.parallel.comm_dtype)).max(1);
            let w = spec.parallel.dp as f64;
            let (passes, what) = match check {
                ClaimCheck::Zero2Traffic => (2.0, "a reduce-scatter of the gradients, an all-gather of the parameters"),
                _ => (3.0, "a reduce-scatter of the gradients, all-gathers of the parameters for forward and backward"),
            };
            let multiple = passes * (w - 1.0) / w * spec.pipeline_micro_batches() as f64;
            let measured = per_step as f64 / d as f64;
            let mut got = m(
                format!("{passes}(W-1)/W x D = {multiple:.2} x D per rank per step (W={}): {what}", spec.parallel.dp),
                format!(
                    "{measured:.3} x D: {} on rank 0, {:.3} x D reduce-scattered and {:.3} x D all-gathered (D = {}; \
                     the planner's count: {})",
                    bytes_text(per_step),
                    rs_bytes as f64 / d as f64,
                    ag_bytes as f64 / d as f64,
                    bytes_text(d),
                    bytes_text(planned)
                ),
                spec.parallel.sharding != crate::Sharding::None
                    && per_step == planned
                    && (measured - multiple).abs() <= 0.05 * multiple,
            );
            if check == ClaimCheck::FsdpTraffic {
                got.note = Some(
                    "Backward gathers every unit but the embeddings (their backward needs only the token ids), \
                     so FSDP sends a little less than 3(W-1)/W x D."
                        .into(),
                );
            }
            Ok(got)
        }
        ClaimCheck::Zero1Traffic => {
            // DDP's all-reduce and ZeRO's all-gather of the updated parameters. The
            // all-reduce counter also holds the step's one-float all-reduces (the loss, the
            // gradient norm): at most a few hundred bytes.
            let rank = rank0.ok_or("the run recorded no trace")?;
            let sent_in = |op| op_counters(rank, op).map(|c| c.bytes_sent).sum::<u64>() / traced_steps;
            let (ar, ag) = (sent_in(CollectiveOp::AllReduce), sent_in(CollectiveOp::AllGather));
            let stage = &plan.stages[spec.stage_of(0)];
            let planned = stage.comm.dp_all_reduce + stage.comm.dp_all_gather;
            let d = stage.params_per_rank.saturating_mul(planner::wire_bytes(spec.parallel.comm_dtype)).max(1);
            let w = spec.parallel.dp as f64;
            let multiple = 3.0 * (w - 1.0) / w * spec.pipeline_micro_batches() as f64;
            let measured = (ar + ag) as f64 / d as f64;
            Ok(m(
                format!(
                    "3(W-1)/W x D = {multiple:.2} x D per rank per step (W={}): DDP's all-reduce, 2(W-1)/W x D, \
                     and the updated parameters' all-gather, (W-1)/W x D",
                    spec.parallel.dp
                ),
                format!(
                    "{measured:.3} x D: {:.3} x D all-reduced and {:.3} x D all-gathered on rank 0 (D = {}; the \
                     planner's count: {})",
                    ar as f64 / d as f64,
                    ag as f64 / d as f64,
                    bytes_text(d),
                    bytes_text(planned)
                ),
                spec.parallel.sharding == crate::Sharding::Zero1
                    && (planned..=planned + SCALAR_BYTES).contains(&(ar + ag))
                    && (measured - multiple).abs() <= 0.05 * multiple,
            ))
        }
        ClaimCheck::ExpertAllToAll => {
            let rank = rank0.ok_or("the run recorded no trace")?;
            let counters: Vec<_> = op_counters(rank, CollectiveOp::AllToAll).collect();
            let bytes = counters.iter().map(|c| c.bytes_sent).sum::<u64>() / traced_steps;
            let calls = counters.iter().map(|c| c.calls).sum::<u64>() / traced_steps;
            let stage = &plan.stages[spec.stage_of(0)];
            let per_block: u64 = if spec.train.checkpointing == Checkpointing::None { 4 } else { 6 };
            let expected_calls = per_block * stage.layers as u64 * spec.pipeline_micro_batches() as u64;
            let ep = spec.parallel.ep;
            Ok(m(
                format!(
                    "{per_block} all-to-alls per block and micro-batch: {expected_calls} per step, each (ep-1)/ep = \
                     {}/{ep} of the rank's expert slots: {} per rank and step",
                    ep.saturating_sub(1),
                    bytes_text(stage.comm.ep_all_to_all)
                ),
                format!("{calls} all-to-alls sending {} on rank 0", bytes_text(bytes)),
                ep > 1 && calls == expected_calls && bytes == stage.comm.ep_all_to_all,
            ))
        }
        ClaimCheck::ExpertParameters => {
            let rank = rank0.ok_or("the run recorded no trace")?;
            let got = rank.memory.as_ref().ok_or("the run recorded no memory")?.peak.parameters;
            let planned = plan.stages[spec.stage_of(0)].memory.parameters;
            // The same model with every expert on each rank, and the dense model.
            let parameters_of = |edit: &dyn Fn(&mut ExperimentSpec)| {
                let mut other = spec.clone();
                edit(&mut other);
                planner::plan(&other).ok().map(|p| p.stages[other.stage_of(0)].memory.parameters)
            };
            let all_experts = parameters_of(&|s| s.parallel.ep = 1).unwrap_or(0);
            let dense = parameters_of(&|s| (s.model.experts, s.parallel.ep) = (0, 1)).unwrap_or(0);
            Ok(m(
                format!(
                    "{} per rank with E = {} experts over ep = {} ranks (planner), against {} with every expert on \
                     each rank and {} for the dense model",
                    bytes_text(planned),
                    spec.model.experts,
                    spec.parallel.ep,
                    bytes_text(all_experts),
                    bytes_text(dense)
                ),
                format!("{} of parameters on rank 0", bytes_text(got)),
                spec.model.is_moe() && got == planned && (spec.parallel.ep == 1 || got < all_experts),
            ))
        }
        ClaimCheck::FlashAttentionMemory
        | ClaimCheck::PrefetchGatheredPeak
        | ClaimCheck::SequenceParallelActivations
        | ClaimCheck::DiskOffloadMemory => two_runs_memory(check, run, partner),
        ClaimCheck::TreeAllreduce => all_reduce::tree(run),
        ClaimCheck::HierarchicalAllreduce => all_reduce::hierarchical(run),
        ClaimCheck::CompressedGradients => data_parallel::compressed(run),
        ClaimCheck::AccumulationAllreduces => data_parallel::accumulation(run, partner),
        ClaimCheck::ExpertCapacity => experts::capacity(run, partner),
        ClaimCheck::TwoByteWire => {
            // The data-parallel collectives' bytes per step on rank 0, on both runs (the
            // all-reduce counter also holds the step's few scalar floats).
            let two = partner.ok_or(
                "no finished run of the same config with comm_dtype set to its precision yet (resubmit the preset \
                 with it)",
            )?;
            let dp_bytes = |r: &RunEvidence| -> Result<(u64, u64), String> {
                let rank = r
                    .ranks
                    .iter()
                    .find(|x| x.rank == 0)
                    .ok_or_else(|| format!("run {} recorded no trace", r.view.id))?;
                let ops = [CollectiveOp::AllReduce, CollectiveOp::ReduceScatter, CollectiveOp::AllGather];
                let sent: u64 = ops.into_iter().flat_map(|op| op_counters(rank, op)).map(|c| c.bytes_sent).sum();
                let plan =
                    planner::plan(&r.view.spec).map_err(|_| "the planner cannot plan the run's spec".to_string())?;
                let c = &plan.stages[r.view.spec.stage_of(0)].comm;
                Ok((sent / r.traced_steps.max(1), c.dp_all_reduce + c.dp_reduce_scatter + c.dp_all_gather))
            };
            let ((wide, wide_planned), (narrow, narrow_planned)) = (dp_bytes(run)?, dp_bytes(two)?);
            let within = |got: u64, planned: u64| (planned..=planned + SCALAR_BYTES).contains(&got);
            let ratio = narrow as f64 / wide.max(1) as f64;
            Ok(m(
                format!(
                    "the data-parallel collectives carry {} per rank and step on an fp32 wire, {} on a {} wire: half \
                     (planner)",
                    bytes_text(wide_planned),
                    bytes_text(narrow_planned),
                    two.view.spec.parallel.comm_dtype.as_str()
                ),
                format!("{} and {} on rank 0 (run {}): {ratio:.3}x", bytes_text(wide), bytes_text(narrow), two.view.id),
                spec.parallel.comm_dtype == crate::Precision::Fp32
                    && two.view.spec.parallel.comm_dtype != crate::Precision::Fp32
                    && within(wide, wide_planned)
                    && within(narrow, narrow_planned)
                    && (ratio - 0.5).abs() <= 0.01,
            ))
        }
        ClaimCheck::TpAllreduces => {
            let step = default_step(&recorded_steps(run.ranks)).ok_or("the run recorded no timeline")?;
            let rank = rank0.ok_or("the run recorded no trace")?;
            let calls = rank.spans.iter().filter(|s| s.step == step && s.lane == crate::wire::trace::lane::TP).count();
            let layers = plan.stages[spec.stage_of(0)].layers;
            // Checkpointing recomputes each block's forward, with its two all-reduces.
            let per_block = if spec.train.checkpointing == Checkpointing::None { 4 } else { 6 };
            let micro_batches = spec.pipeline_micro_batches();
            let predicted = per_block * layers * micro_batches;
            Ok(Measurement {
                note: Some(
                    "Texts that count one all-reduce per layer count the MLP's alone; two per layer are the \
                     attention's and the MLP's in the forward pass. Backward adds as many again, in the reverse \
                     order: the gradient of each block's input is summed over the ranks."
                        .into(),
                ),
                ..m(
                    format!("{per_block} x {layers} blocks x {micro_batches} micro-batches = {predicted} per step"),
                    format!("{calls} on rank 0 in step {step}"),
                    calls == predicted,
                )
            })
        }
        ClaimCheck::DdpEqualsOneRank => {
            let one = partner.ok_or("no finished one-rank run with the same global batch yet")?;
            let verdict = compare::equivalence((one.view.id, &one.view.spec, one.metrics), (id, spec, run.metrics));
            let rel = verdict.max_rel_diff.map_or("–".to_string(), |r| format!("{r:.1e}"));
            Ok(m(
                format!("equal losses within {:.0e} relative per step", verdict.tolerance),
                format!(
                    "max relative difference {rel} over {} steps (one rank: run {})",
                    verdict.common_steps, one.view.id
                ),
                verdict.equivalent,
            ))
        }
        ClaimCheck::LossScalingUnderflow => {
            let scaled = partner.ok_or("no finished run of the same config with dynamic loss scaling yet")?;
            let (plain, with) = (descent(run)?, descent(scaled)?);
            let (plain_zeros, scaled_zeros) = (zero_share(run)?, zero_share(scaled)?);
            let overflowed = scaled.metrics.iter().filter_map(|p| p.skipped_steps).max().unwrap_or(0);
            Ok(m(
                format!(
                    "without scaling most logit gradients (over {:.0}%) are stored as 0 in fp16, with it far fewer \
                     (under half as many), and the loss falls less than {:.0}% as far",
                    100.0 * MOST,
                    100.0 * SLOWER
                ),
                format!(
                    "{:.0}% of the logit gradients stored as 0 without scaling, {:.1}% with it; the loss fell {:.0}% as \
                     far: down {:.4} without scaling, {:.4} with it (run {}); the plain run's loss stayed finite \
                     (underflow, not overflow), the scaled run skipped {overflowed} overflowed steps",
                    100.0 * plain_zeros,
                    100.0 * scaled_zeros,
                    100.0 * plain / with,
                    plain,
                    with,
                    scaled.view.id
                ),
                with > 0.0 && plain < SLOWER * with && plain_zeros > MOST && scaled_zeros < 0.5 * plain_zeros,
            ))
        }
        ClaimCheck::Bf16NoScaling => {
            let fp32 = partner
                .ok_or("no finished run of the same config in fp32 yet (resubmit the preset with precision fp32)")?;
            let (bf16, full) = (descent(run)?, descent(fp32)?);
            Ok(m(
                format!("without scaling bf16 falls as far as fp32 (within {:.0}%)", 100.0 * (1.0 - ALONGSIDE)),
                format!(
                    "{:.0}%: down {bf16:.4} in bf16, {full:.4} in fp32 (run {})",
                    100.0 * bf16 / full,
                    fp32.view.id
                ),
                full > 0.0 && bf16 >= ALONGSIDE * full,
            ))
        }
        ClaimCheck::RingPhaseBytes => {
            let c = run
                .view
                .summary
                .as_ref()
                .and_then(|s| s.collective.as_ref())
                .ok_or("the phases are measured on the all-reduce demo's ring replay: run the allreduce preset")?;
            let per_phase = c.formula_bytes / 2.0;
            let sent = |rank: u32, phase: RingPhase| -> u64 {
                let rank_steps = run.ranks.iter().filter(|r| r.rank == rank).flat_map(|r| &r.comm.steps);
                rank_steps.filter(|s| s.from == rank && s.phase == phase).map(|s| s.bytes).sum()
            };
            let phases: Vec<(u64, u64)> = (0..c.world as u32)
                .map(|r| (sent(r, RingPhase::ReduceScatter), sent(r, RingPhase::AllGather)))
                .collect();
            if phases.iter().all(|&(rs, ag)| rs == 0 && ag == 0) {
                return Err("the run recorded no ring steps".into());
            }
            let agrees = phases.iter().all(|&(rs, ag)| rs as f64 == per_phase && ag as f64 == per_phase);
            let (rs, ag) = phases[0];
            Ok(m(
                format!("(W-1)/W x D = {per_phase} bytes per rank in each phase (W={})", c.world),
                format!(
                    "rank 0 sent {rs} bytes in reduce-scatter and {ag} in all-gather; {}",
                    if agrees { "every rank the same" } else { "not every rank the same" }
                ),
                agrees,
            ))
        }
    }
}

/// A memory category measured on two runs that differ in one setting, each against the
/// planner: FlashAttention (this run) against naive attention (the partner), FSDP without
/// prefetch (this run) against with it, TP without sequence parallelism against with it,
/// the optimizer's state on disk against in memory (with the price: the steps' times).
fn two_runs_memory(check: ClaimCheck, run: &RunEvidence, partner: Option<&RunEvidence>) -> Result<Measurement, String> {
    let (category, setting, ours_smaller): (&str, &str, bool) = match check {
        ClaimCheck::FlashAttentionMemory => ("activations", "attention naive", true),
        ClaimCheck::PrefetchGatheredPeak => ("gathered weights", "prefetch on", true),
        ClaimCheck::DiskOffloadMemory => ("optimizer state", "offload none", true),
        _ => ("activations", "sequence_parallel on", false),
    };
    let other = partner.ok_or_else(|| {
        format!("no finished run of the same config with {setting} yet (resubmit the preset with it)")
    })?;
    let value = |m: &planner::RankMemory| match check {
        ClaimCheck::PrefetchGatheredPeak => m.gathered_parameters,
        ClaimCheck::DiskOffloadMemory => m.optimizer_state,
        _ => m.activations,
    };
    // Rank 0's peak, measured and planned.
    let peak = |r: &RunEvidence| -> Result<(u64, u64), String> {
        let rank =
            r.ranks.iter().find(|x| x.rank == 0).ok_or_else(|| format!("run {} recorded no trace", r.view.id))?;
        let measured =
            value(&rank.memory.as_ref().ok_or_else(|| format!("run {} recorded no memory", r.view.id))?.peak);
        let plan = planner::plan(&r.view.spec).map_err(|_| "the planner cannot plan the run's spec".to_string())?;
        Ok((measured, value(&plan.stages[r.view.spec.stage_of(0)].memory)))
    };
    let ((ours, ours_planned), (theirs, theirs_planned)) = (peak(run)?, peak(other)?);
    let smaller_as_said = if ours_smaller { ours < theirs } else { theirs < ours };
    Ok(Measurement {
        experiment_id: run.view.id,
        predicted: format!(
            "{category} on rank 0: {} here, {} with {setting} (planner)",
            bytes_text(ours_planned),
            bytes_text(theirs_planned)
        ),
        measured: format!(
            "{} here, {} with {setting} (run {}): {:.2}x",
            bytes_text(ours),
            bytes_text(theirs),
            other.view.id,
            ours as f64 / theirs.max(1) as f64
        ),
        agrees: ours == ours_planned && theirs == theirs_planned && smaller_as_said,
        note: (check == ClaimCheck::DiskOffloadMemory).then(|| {
            format!(
                "The price of reading and writing the state each step: a median step of {} ms here against {} ms \
                 with it in memory (the page cache may hold the file; a cold disk would cost more).",
                ms((median_step_ms(run) * 1000.0) as u64),
                ms((median_step_ms(other) * 1000.0) as u64)
            )
        }),
    })
}

/// The median of a run's step times, in milliseconds (0 without metrics).
fn median_step_ms(run: &RunEvidence) -> f64 {
    let mut times: Vec<f64> = run.metrics.iter().map(|p| p.step_ms).collect();
    times.sort_by(f64::total_cmp);
    times.get(times.len() / 2).copied().unwrap_or(0.0)
}

/// The one-float all-reduces of a step (the loss, the gradient norm) that the planner's
/// all-reduce bytes leave out, at most.
const SCALAR_BYTES: u64 = 1024;
/// Without loss scaling fp16 must fall less than this share of the scaled run's descent.
const SLOWER: f64 = 0.9;
/// "Most" logit gradients: more than this share stored as 0.
const MOST: f64 = 0.5;
/// bf16 must fall at least this share of fp32's descent.
const ALONGSIDE: f64 = 0.95;

/// How far a run's loss fell: its first step's loss minus its last (the summary's final).
fn model_state(m: &planner::RankMemory) -> u64 {
    m.parameters + m.gradients + m.optimizer_state
}

/// One way the texts count a rank's model state under ZeRO.
struct ZeroCount {
    formula: String,
    bytes: u64,
    source: &'static str,
}

/// The texts' counts of one rank's model state for the run's sharding, the engine's first.
/// In mixed precision ZeRO-1 and ZeRO-2 are counted two ways: with the fp32 master weights
/// sharded like Adam's moments (the chapter and the ZeRO paper: 4N + 12N/K, 2N + 14N/K),
/// or kept whole on every rank (the flashcard deck: 8N + 8N/K, 6N + 10N/K). `planned` is
/// the planner's memory of the rank (the first count); the second moves the master copy's
/// shard back to all N parameters.
fn zero_counts(spec: &ExperimentSpec, n: u64, planned: &planner::RankMemory) -> Vec<ZeroCount> {
    let b = planner::bytes_per_param(spec.train.precision, spec.train.optimizer);
    let (w, o) = (b.parameters, b.optimizer_state);
    let sharded = planned.parameters + planned.gradients + planned.optimizer_state;
    let (formula, whole_master) = match spec.parallel.sharding {
        crate::Sharding::None => (format!("{}N", w + w + o), None),
        crate::Sharding::Zero1 => {
            (format!("{}N + {o}N/K", w + w), Some(format!("{}N + {}N/K", w + w + 4, o.saturating_sub(4))))
        }
        crate::Sharding::Zero2 => {
            (format!("{w}N + {}N/K", w + o), Some(format!("{}N + {}N/K", w + 4, (w + o).saturating_sub(4))))
        }
        crate::Sharding::Fsdp => (format!("{}N/K", w + w + o), None),
    };
    let mixed = spec.train.precision != crate::Precision::Fp32;
    let mut counts = vec![ZeroCount {
        formula,
        bytes: sharded,
        source: if mixed && whole_master.is_some() {
            "master sharded: the chapter, the ZeRO paper"
        } else {
            "every text"
        },
    }];
    if let (true, Some(formula)) = (mixed, whole_master) {
        // The planner's optimizer shard holds `o` bytes per parameter of the shard.
        let shard = planned.optimizer_state / o.max(1);
        counts.push(ZeroCount {
            formula,
            bytes: sharded + 4 * n.saturating_sub(shard),
            source: "master kept whole: the flashcard deck",
        });
    }
    counts
}

/// The mean share of the logit gradients stored as 0 over the run's steps.
fn zero_share(run: &RunEvidence) -> Result<f64, String> {
    let shares: Vec<f64> = run.metrics.iter().filter_map(|p| p.logit_grad_zero_share).collect();
    if shares.is_empty() {
        return Err(format!(
            "run {} recorded no logit-gradient zeros (a run from before they were counted)",
            run.view.id
        ));
    }
    Ok(shares.iter().sum::<f64>() / shares.len() as f64)
}

fn descent(run: &RunEvidence) -> Result<f64, String> {
    let first = run.metrics.first().map(|p| p.loss).ok_or("the run has no loss")?;
    let last = final_loss(run)?;
    if !(first.is_finite() && last.is_finite()) {
        return Err(format!("run {} has a loss that is not finite", run.view.id));
    }
    Ok(first - last)
}

/// The most activation memory any rank of a run booked (its memory ledger).
fn measured_activations(run: &RunEvidence) -> Result<u64, String> {
    let peaks = run.ranks.iter().filter_map(|r| r.memory.as_ref()).map(|m| m.peak.activations);
    peaks.max().ok_or_else(|| format!("run {} recorded no memory", run.view.id))
}

/// Each pipeline stage's activation peak: the most any of its ranks booked (ledger).
fn stage_activation_peaks(run: &RunEvidence) -> Result<Vec<u64>, String> {
    let spec = &run.view.spec;
    let mut peaks = vec![None; spec.parallel.pp.max(1)];
    for r in run.ranks {
        let (Some(memory), Some(peak)) = (r.memory.as_ref(), peaks.get_mut(spec.stage_of(r.rank as usize))) else {
            continue;
        };
        *peak = Some(peak.unwrap_or(0).max(memory.peak.activations));
    }
    peaks
        .into_iter()
        .collect::<Option<Vec<u64>>>()
        .ok_or_else(|| format!("run {} recorded no memory for a stage", run.view.id))
}

fn op_counters(rank: &RankTrace, op: CollectiveOp) -> impl Iterator<Item = &crate::wire::trace::CollectiveCounter> {
    rank.comm.counters.iter().filter(move |c| c.op == op)
}

fn final_loss(run: &RunEvidence) -> Result<f64, String> {
    run.view
        .summary
        .as_ref()
        .map(|s| s.final_loss)
        .or(run.metrics.last().map(|p| p.loss))
        .ok_or_else(|| "the run has no loss".into())
}

fn ms(us: u64) -> String {
    format!("{:.2}", us as f64 / 1e3)
}

fn checkpointing_name(c: Checkpointing) -> String {
    serde_json::to_value(c).ok().and_then(|v| v.as_str().map(str::to_string)).unwrap_or_default()
}

/// Bytes in words, exact below 10 KiB: "96 B", "431.0 KiB (441,344 B)".
fn bytes_text(b: u64) -> String {
    const KIB: f64 = 1024.0;
    let x = b as f64;
    if b < 10 * 1024 {
        format!("{b} B")
    } else if x < KIB * KIB {
        format!("{:.1} KiB ({b} B)", x / KIB)
    } else {
        format!("{:.2} MiB ({b} B)", x / KIB / KIB)
    }
}

/// A succeeded run of `spec` as the server would show it (for the checks' unit tests).
#[cfg(test)]
fn succeeded_view(id: i64, spec: ExperimentSpec, summary: Option<crate::RunSummary>) -> ExperimentView {
    ExperimentView {
        id,
        name: spec.name.clone(),
        owner: "local".into(),
        status: crate::ExperimentStatus::Succeeded,
        spec,
        created_at: String::new(),
        started_at: None,
        finished_at: None,
        error: None,
        summary,
        attempt: 1,
        steps_done: 0,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::spec::presets::presets;

    #[test]
    fn every_check_has_a_preset_and_partners_are_found() {
        let keys: Vec<&str> = presets().iter().map(|p| p.key).collect();
        for check in [
            ClaimCheck::AllreduceBytes,
            ClaimCheck::RingPhaseBytes,
            ClaimCheck::DdpEqualsOneRank,
            ClaimCheck::BubbleFraction,
            ClaimCheck::BytesPerParam,
            ClaimCheck::ActivationCheckpointingMemory,
            ClaimCheck::CheckpointingRecomputeTime,
            ClaimCheck::PipelineActivationPeaks,
            ClaimCheck::ZeroMemory,
            ClaimCheck::Zero2Traffic,
            ClaimCheck::FsdpTraffic,
            ClaimCheck::FsdpGatheredPeak,
            ClaimCheck::Zero1Traffic,
            ClaimCheck::ExpertAllToAll,
            ClaimCheck::ExpertParameters,
            ClaimCheck::FlashAttentionMemory,
            ClaimCheck::PrefetchGatheredPeak,
            ClaimCheck::SequenceParallelActivations,
            ClaimCheck::TwoByteWire,
            ClaimCheck::TpAllreduces,
            ClaimCheck::LossScalingUnderflow,
            ClaimCheck::Bf16NoScaling,
            ClaimCheck::TreeAllreduce,
            ClaimCheck::HierarchicalAllreduce,
            ClaimCheck::CompressedGradients,
            ClaimCheck::AccumulationAllreduces,
            ClaimCheck::ExpertCapacity,
            ClaimCheck::DiskOffloadMemory,
        ] {
            assert!(keys.contains(&canonical_preset(check)), "{check:?}");
        }
        let find = |key: &str| presets().into_iter().find(|p| p.key == key).map(|p| p.spec).unwrap_or_default();
        let (plain, scaled) = (find("fp16-plain"), find("fp16-scaled"));
        assert_eq!(is_partner(ClaimCheck::LossScalingUnderflow, &plain, &scaled), Some(true));
        assert_eq!(is_partner(ClaimCheck::LossScalingUnderflow, &plain, &plain), Some(false));
        let mut one = find("ddp2");
        (one.parallel.dp, one.train.micro_batch) = (1, 8);
        assert_eq!(is_partner(ClaimCheck::DdpEqualsOneRank, &find("ddp2"), &one), Some(true));
        assert_eq!(is_partner(ClaimCheck::BytesPerParam, &one, &one), None);
    }

    #[test]
    fn the_deck_checks_loss_scaling_on_fp16_without_scaling() {
        let deck = crate::study::cards::load_deck(include_str!("../../../cards/deck.json")).unwrap_or_default();
        let scaling = |c: &&Card| c.claim.as_ref().is_some_and(|c| c.check == ClaimCheck::LossScalingUnderflow);
        assert!(deck.iter().filter(scaling).count() > 0);
        for card in deck.iter().filter(scaling) {
            assert_eq!(preset_for(card), Some("fp16-plain"), "{}", card.id);
        }
        assert!(deck.iter().filter(|c| c.claim.is_none()).all(|c| preset_for(c).is_none()));
    }

    #[test]
    fn a_collective_demo_checks_its_byte_counts() {
        let spec = presets().into_iter().find(|p| p.key == "allreduce").map(|p| p.spec).unwrap_or_default();
        let collective = crate::CollectiveCheck {
            world: 4,
            elements: 16,
            bytes_sent: vec![96; 4],
            formula_bytes: 96.0,
            ..Default::default()
        };
        let mut v = view(7, spec, Some(crate::RunSummary { collective: Some(collective), ..Default::default() }));
        let got = measure(
            ClaimCheck::AllreduceBytes,
            &RunEvidence { view: &v, metrics: &[], ranks: &[], traced_steps: 1 },
            None,
        )
        .unwrap();
        assert!(got.agrees && got.measured.starts_with("96–96 bytes"), "{got:?}");
        if let Some(c) = v.summary.as_mut().and_then(|s| s.collective.as_mut()) {
            c.bytes_sent[2] = 112;
        }
        let got = measure(
            ClaimCheck::AllreduceBytes,
            &RunEvidence { view: &v, metrics: &[], ranks: &[], traced_steps: 1 },
            None,
        )
        .unwrap();
        assert!(!got.agrees, "{got:?}");
        let err = measure(
            ClaimCheck::DdpEqualsOneRank,
            &RunEvidence { view: &v, metrics: &[], ranks: &[], traced_steps: 1 },
            None,
        );
        assert!(err.unwrap_err().contains("one-rank"));
    }

    fn view(id: i64, spec: ExperimentSpec, summary: Option<crate::RunSummary>) -> ExperimentView {
        succeeded_view(id, spec, summary)
    }

    fn losses(first: f64, last: f64) -> Vec<MetricPoint> {
        vec![
            MetricPoint { step: 0, loss: first, ..MetricPoint::default() },
            MetricPoint { step: 1, loss: last, ..MetricPoint::default() },
        ]
    }

    #[test]
    fn the_ring_phases_are_checked_from_the_bytes_each_rank_sent_in_each() {
        let spec = presets().into_iter().find(|p| p.key == "allreduce").map(|p| p.spec).unwrap_or_default();
        let collective = crate::CollectiveCheck {
            world: 2,
            elements: 16,
            bytes_sent: vec![64; 2],
            formula_bytes: 64.0,
            ..Default::default()
        };
        let v = view(3, spec, Some(crate::RunSummary { collective: Some(collective), ..Default::default() }));
        let step = |from: u32, phase: RingPhase, bytes: u64| crate::wire::trace::RingStep {
            collective: 0,
            phase,
            step: 0,
            chunk: from,
            from,
            to: 1 - from,
            bytes,
            start_us: 0,
            end_us: 1,
            values: None,
        };
        let rank = |r: u32, rs: u64, ag: u64| RankTrace {
            rank: r,
            comm: crate::wire::trace::RankCommTrace {
                steps: vec![step(r, RingPhase::ReduceScatter, rs), step(r, RingPhase::AllGather, ag)],
                ..Default::default()
            },
            ..RankTrace::default()
        };
        let check = |ranks: &[RankTrace]| {
            measure(ClaimCheck::RingPhaseBytes, &RunEvidence { view: &v, metrics: &[], ranks, traced_steps: 1 }, None)
        };
        let right = check(&[rank(0, 32, 32), rank(1, 32, 32)]).unwrap();
        assert!(right.agrees && right.measured.contains("32 bytes in reduce-scatter"), "{right:?}");
        // An all-reduce that sends the right total but splits it wrongly between the phases.
        assert!(!check(&[rank(0, 48, 16), rank(1, 48, 16)]).unwrap().agrees);
        assert!(check(&[]).is_err());
    }

    #[test]
    fn mixed_precision_claims_compare_how_far_the_loss_fell_with_a_measured_partner() {
        let find = |key: &str| presets().into_iter().find(|p| p.key == key).map(|p| p.spec).unwrap_or_default();
        let (plain, scaled, bf16) =
            (view(1, find("fp16-plain"), None), view(2, find("fp16-scaled"), None), view(3, find("bf16"), None));
        let mut fp32_spec = find("bf16");
        fp32_spec.train.precision = crate::Precision::Fp32;
        assert_eq!(is_partner(ClaimCheck::Bf16NoScaling, &bf16.spec, &fp32_spec), Some(true));
        let fp32 = view(4, fp32_spec, None);
        let run = |v, m| RunEvidence { view: v, metrics: m, ranks: &[], traced_steps: 1 };
        // Measured on the presets: fp32 8.3226 -> 7.6179, fp16 without scaling -> 7.7657,
        // with scaling -> 7.6178, bf16 -> 7.6181.
        let zeros = |mut points: Vec<MetricPoint>, share: f64| {
            points.iter_mut().for_each(|p| p.logit_grad_zero_share = Some(share));
            points
        };
        let (l_plain, l_scaled, l_bf16, l_fp32) = (
            zeros(losses(8.3226, 7.7657), 0.9),
            zeros(losses(8.3226, 7.6178), 0.001),
            losses(8.3226, 7.6181),
            losses(8.3226, 7.6179),
        );
        let under =
            measure(ClaimCheck::LossScalingUnderflow, &run(&plain, &l_plain), Some(&run(&scaled, &l_scaled))).unwrap();
        assert!(under.agrees, "{under:?}");
        assert!(under.measured.starts_with("90% of the logit gradients stored as 0"), "{}", under.measured);
        // A fp16 run that falls nearly as far as the scaled one does not show underflow.
        let nearly = zeros(losses(8.3226, 7.65), 0.9);
        assert!(
            !measure(ClaimCheck::LossScalingUnderflow, &run(&plain, &nearly), Some(&run(&scaled, &l_scaled)))
                .unwrap()
                .agrees
        );
        // Nor one whose gradients were not stored as 0 (slower for another reason), nor one
        // whose counts are missing.
        let kept = zeros(losses(8.3226, 7.7657), 0.1);
        assert!(
            !measure(ClaimCheck::LossScalingUnderflow, &run(&plain, &kept), Some(&run(&scaled, &l_scaled)))
                .unwrap()
                .agrees
        );
        let uncounted = losses(8.3226, 7.7657);
        assert!(measure(ClaimCheck::LossScalingUnderflow, &run(&plain, &uncounted), Some(&run(&scaled, &l_scaled)))
            .unwrap_err()
            .contains("zeros"));
        let bf = measure(ClaimCheck::Bf16NoScaling, &run(&bf16, &l_bf16), Some(&run(&fp32, &l_fp32))).unwrap();
        assert!(bf.agrees, "{bf:?}");
        // bf16 that learns (below ln V) but falls much less than fp32 does not agree.
        let lagging = losses(8.3226, 8.0);
        assert!(!measure(ClaimCheck::Bf16NoScaling, &run(&bf16, &lagging), Some(&run(&fp32, &l_fp32))).unwrap().agrees);
        assert!(measure(ClaimCheck::Bf16NoScaling, &run(&bf16, &l_bf16), None).unwrap_err().contains("fp32"));
    }

    #[test]
    fn one_f_one_b_peaks_are_set_against_a_measured_gpipe_run_stage_by_stage() {
        let spec = presets().into_iter().find(|p| p.key == "pipeline").map(|p| p.spec).unwrap_or_default();
        let mut gpipe_spec = spec.clone();
        gpipe_spec.parallel.pp_schedule = crate::PpSchedule::Gpipe;
        assert_eq!(is_partner(ClaimCheck::PipelineActivationPeaks, &spec, &gpipe_spec), Some(true));
        // One rank per stage, each booking `peak(stage)`.
        let ranks = |peak: &dyn Fn(usize) -> u64| -> Vec<RankTrace> {
            (0..spec.parallel.pp)
                .map(|stage| RankTrace {
                    rank: stage as u32,
                    memory: Some(crate::wire::memory::RankMemoryReport {
                        peak: planner::RankMemory { activations: peak(stage), ..Default::default() },
                        ..Default::default()
                    }),
                    ..RankTrace::default()
                })
                .collect()
        };
        let planned = |s: &ExperimentSpec| {
            planner::plan(s).unwrap().stages.iter().map(|st| st.memory.activations).collect::<Vec<_>>()
        };
        let (p_1f1b, p_gpipe) = (planned(&spec), planned(&gpipe_spec));
        let (ours, theirs) = (view(1, spec.clone(), None), view(2, gpipe_spec.clone(), None));
        let (r_1f1b, r_gpipe) = (ranks(&|s| p_1f1b[s]), ranks(&|s| p_gpipe[s]));
        let run = |v, r| RunEvidence { view: v, metrics: &[], ranks: r, traced_steps: 1 };
        let got =
            measure(ClaimCheck::PipelineActivationPeaks, &run(&ours, &r_1f1b), Some(&run(&theirs, &r_gpipe))).unwrap();
        assert!(got.agrees, "{got:?}");
        assert!(got.predicted.contains("hold 4, 3, 2, 1 of GPipe's M = 8"), "{}", got.predicted);
        // A 1F1B that keeps every micro-batch (GPipe's memory) does not agree.
        let like_gpipe = ranks(&|s| p_gpipe[s]);
        let got = measure(ClaimCheck::PipelineActivationPeaks, &run(&ours, &like_gpipe), Some(&run(&theirs, &r_gpipe)))
            .unwrap();
        assert!(!got.agrees, "{got:?}");
        assert!(measure(ClaimCheck::PipelineActivationPeaks, &run(&ours, &r_1f1b), None)
            .unwrap_err()
            .contains("gpipe"));
    }

    #[test]
    fn fsdp_keeps_a_shard_and_gathers_one_unit_at_a_time() {
        let spec = presets().into_iter().find(|p| p.key == "fsdp").map(|p| p.spec).unwrap_or_default();
        let planned = planner::plan(&spec).unwrap().stages[0].memory.clone();
        let ranks = |parameters, gathered_parameters| {
            vec![RankTrace {
                memory: Some(crate::wire::memory::RankMemoryReport {
                    peak: planner::RankMemory { parameters, gathered_parameters, ..Default::default() },
                    ..Default::default()
                }),
                ..RankTrace::default()
            }]
        };
        let v = view(1, spec.clone(), None);
        let check = |r: &[RankTrace]| {
            measure(
                ClaimCheck::FsdpGatheredPeak,
                &RunEvidence { view: &v, metrics: &[], ranks: r, traced_steps: 1 },
                None,
            )
            .unwrap()
        };
        let got = check(&ranks(planned.parameters, planned.gathered_parameters));
        assert!(got.agrees, "{got:?}");
        // A rank that gathers the whole model at once (every unit kept) does not agree.
        let whole = planner::plan(&spec).unwrap().stages[0].params_per_rank * 4;
        assert!(!check(&ranks(planned.parameters, whole)).agrees);
    }

    #[test]
    fn zero_memory_is_counted_both_ways_and_the_run_matches_the_sharded_master() {
        let deck = crate::study::cards::load_deck(include_str!("../../../cards/deck.json")).unwrap();
        let card = |id: &str| deck.iter().find(|c| c.id == id).unwrap();
        assert_eq!(preset_for(card("zero-redundancy")), Some("zero1"));
        assert_eq!(preset_for(card("zero-memory-table")), Some("zero2"));
        assert_eq!(preset_for(card("reduce-scatter-for-sharded-gradients")), Some("zero2"));
        for (key, sharded, whole) in [("zero1", "4N + 12N/K", "8N + 8N/K"), ("zero2", "2N + 14N/K", "6N + 10N/K")] {
            let spec = presets().into_iter().find(|p| p.key == key).map(|p| p.spec).unwrap_or_default();
            let stage = planner::plan(&spec).unwrap().stages[0].clone();
            let v = view(1, spec.clone(), None);
            let check = |peak: planner::RankMemory| {
                let ranks = vec![RankTrace {
                    memory: Some(crate::wire::memory::RankMemoryReport { peak, ..Default::default() }),
                    ..RankTrace::default()
                }];
                measure(
                    ClaimCheck::ZeroMemory,
                    &RunEvidence { view: &v, metrics: &[], ranks: &ranks, traced_steps: 1 },
                    None,
                )
                .unwrap()
            };
            let got = check(stage.memory.clone());
            assert!(got.agrees, "{key}: {got:?}");
            assert!(got.predicted.contains(sharded) && got.predicted.contains(whole), "{key}: {}", got.predicted);
            assert!(got.measured.contains("the chapter"), "{key}: {}", got.measured);
            // An engine that kept the fp32 master copy whole on every rank matches the
            // other count, and the check says so.
            let n = stage.params_per_rank;
            let shard = stage.memory.optimizer_state / 12;
            let whole_master = planner::RankMemory {
                optimizer_state: stage.memory.optimizer_state + 4 * (n - shard),
                ..stage.memory.clone()
            };
            let got = check(whole_master);
            assert!(!got.agrees && got.measured.contains("flashcard deck"), "{key}: {got:?}");
            // Gradients not sharded under ZeRO-2 (or sharded under ZeRO-1) disagree too.
            let grads = if key == "zero2" { n * 2 } else { shard * 2 };
            assert!(!check(planner::RankMemory { gradients: grads, ..stage.memory.clone() }).agrees, "{key}");
        }
    }

    fn counter(op: CollectiveOp, calls: u64, bytes_sent: u64) -> crate::wire::trace::CollectiveCounter {
        crate::wire::trace::CollectiveCounter {
            op,
            calls,
            elements: 0,
            bytes_sent,
            bytes_from_formula: false,
            total_us: 0,
        }
    }

    fn traced(counters: Vec<crate::wire::trace::CollectiveCounter>, parameters: u64) -> Vec<RankTrace> {
        vec![RankTrace {
            comm: crate::wire::trace::RankCommTrace { counters, ..Default::default() },
            memory: Some(crate::wire::memory::RankMemoryReport {
                peak: planner::RankMemory { parameters, ..Default::default() },
                ..Default::default()
            }),
            ..RankTrace::default()
        }]
    }

    #[test]
    fn zero1_sends_ddps_all_reduce_and_an_all_gather() {
        let spec = presets().into_iter().find(|p| p.key == "zero1").map(|p| p.spec).unwrap_or_default();
        let comm = planner::plan(&spec).unwrap().stages[0].comm.clone();
        let v = view(1, spec, None);
        let check = |ranks: &[RankTrace]| {
            measure(ClaimCheck::Zero1Traffic, &RunEvidence { view: &v, metrics: &[], ranks, traced_steps: 2 }, None)
                .unwrap()
        };
        // Two steps, with the loss's and the gradient norm's floats in the all-reduce.
        let ok = traced(
            vec![
                counter(CollectiveOp::AllReduce, 4, 2 * comm.dp_all_reduce + 32),
                counter(CollectiveOp::AllGather, 2, 2 * comm.dp_all_gather),
            ],
            0,
        );
        let got = check(&ok);
        assert!(got.agrees && got.predicted.contains("2.25 x D"), "{got:?}");
        // The ZeRO paper's count (a reduce-scatter in place of the all-reduce) is not this run.
        let paper = traced(
            vec![
                counter(CollectiveOp::AllReduce, 2, 32),
                counter(CollectiveOp::ReduceScatter, 2, comm.dp_all_reduce),
                counter(CollectiveOp::AllGather, 2, 2 * comm.dp_all_gather),
            ],
            0,
        );
        assert!(!check(&paper).agrees);
    }

    #[test]
    fn expert_all_to_alls_and_parameters_are_measured_against_the_planner() {
        let spec = presets().into_iter().find(|p| p.key == "experts").map(|p| p.spec).unwrap_or_default();
        let stage = planner::plan(&spec).unwrap().stages[0].clone();
        let calls = 4 * stage.layers as u64 * spec.pipeline_micro_batches() as u64;
        let v = view(1, spec.clone(), None);
        let check = |check, ranks: &[RankTrace]| {
            measure(check, &RunEvidence { view: &v, metrics: &[], ranks, traced_steps: 1 }, None).unwrap()
        };
        let good =
            traced(vec![counter(CollectiveOp::AllToAll, calls, stage.comm.ep_all_to_all)], stage.memory.parameters);
        assert!(check(ClaimCheck::ExpertAllToAll, &good).agrees);
        assert!(check(ClaimCheck::ExpertParameters, &good).agrees);
        // Two all-to-alls per block (a backward that sends nothing back) disagree; so does
        // a rank holding every expert.
        let half = traced(vec![counter(CollectiveOp::AllToAll, calls / 2, stage.comm.ep_all_to_all / 2)], 0);
        assert!(!check(ClaimCheck::ExpertAllToAll, &half).agrees);
        let mut all = spec.clone();
        all.parallel.ep = 1;
        let every_expert = planner::plan(&all).unwrap().stages[0].memory.parameters;
        assert!(every_expert > stage.memory.parameters);
        assert!(!check(ClaimCheck::ExpertParameters, &traced(vec![], every_expert)).agrees);
    }

    #[test]
    fn one_setting_apart_each_run_is_held_to_the_planner_and_the_difference_to_the_card() {
        let find = |key: &str| presets().into_iter().find(|p| p.key == key).map(|p| p.spec).unwrap_or_default();
        type Edit = fn(&mut ExperimentSpec);
        let cases: [(ClaimCheck, &str, Edit); 4] = [
            (ClaimCheck::FlashAttentionMemory, "flash", |s| s.train.attention = crate::Attention::Naive),
            (ClaimCheck::PrefetchGatheredPeak, "fsdp", |s| s.parallel.prefetch = true),
            (ClaimCheck::SequenceParallelActivations, "megatron", |s| s.parallel.sequence_parallel = true),
            (ClaimCheck::DiskOffloadMemory, "offload-disk", |s| s.parallel.offload = crate::Offload::None),
        ];
        for (check, key, edit) in cases {
            assert_eq!(canonical_preset(check), key);
            let spec = find(key);
            let mut other = spec.clone();
            edit(&mut other);
            assert_eq!(is_partner(check, &spec, &other), Some(true), "{key}");
            let planned = |s: &ExperimentSpec| planner::plan(s).unwrap().stages[0].memory.clone();
            let ranks = |m: planner::RankMemory| {
                vec![RankTrace {
                    memory: Some(crate::wire::memory::RankMemoryReport { peak: m, ..Default::default() }),
                    ..RankTrace::default()
                }]
            };
            let (ours, theirs) = (view(1, spec.clone(), None), view(2, other.clone(), None));
            let (r_ours, r_theirs) = (ranks(planned(&spec)), ranks(planned(&other)));
            let run = |v, r| RunEvidence { view: v, metrics: &[], ranks: r, traced_steps: 1 };
            let got = measure(check, &run(&ours, &r_ours), Some(&run(&theirs, &r_theirs))).unwrap();
            assert!(got.agrees, "{key}: {got:?}");
            // An engine where the setting changes nothing (both runs measure the same) disagrees.
            let same = ranks(planned(&spec));
            assert!(!measure(check, &run(&ours, &r_ours), Some(&run(&theirs, &same))).unwrap().agrees, "{key}");
            assert!(measure(check, &run(&ours, &r_ours), None).is_err());
        }
    }

    #[test]
    fn a_two_byte_wire_halves_the_data_parallel_bytes() {
        let spec = presets().into_iter().find(|p| p.key == "zero2").map(|p| p.spec).unwrap_or_default();
        let mut narrow = spec.clone();
        narrow.parallel.comm_dtype = crate::Precision::Bf16;
        assert_eq!(is_partner(ClaimCheck::TwoByteWire, &spec, &narrow), Some(true));
        let comm = |s: &ExperimentSpec| planner::plan(s).unwrap().stages[0].comm.clone();
        let ranks = |c: planner::CommVolume| {
            traced(
                vec![
                    counter(CollectiveOp::AllReduce, 1, 24),
                    counter(CollectiveOp::ReduceScatter, 1, c.dp_reduce_scatter),
                    counter(CollectiveOp::AllGather, 1, c.dp_all_gather),
                ],
                0,
            )
        };
        let (v_wide, v_narrow) = (view(1, spec.clone(), None), view(2, narrow.clone(), None));
        let (r_wide, r_narrow) = (ranks(comm(&spec)), ranks(comm(&narrow)));
        let run = |v, r| RunEvidence { view: v, metrics: &[], ranks: r, traced_steps: 1 };
        let got = measure(ClaimCheck::TwoByteWire, &run(&v_wide, &r_wide), Some(&run(&v_narrow, &r_narrow))).unwrap();
        assert!(got.agrees && got.measured.ends_with("0.500x"), "{got:?}");
        // A wire that still sends 4 bytes per element disagrees.
        let got = measure(ClaimCheck::TwoByteWire, &run(&v_wide, &r_wide), Some(&run(&v_narrow, &r_wide))).unwrap();
        assert!(!got.agrees, "{got:?}");
    }

    #[test]
    fn sharded_traffic_is_measured_in_multiples_of_d() {
        for (key, check) in [("zero2", ClaimCheck::Zero2Traffic), ("fsdp", ClaimCheck::FsdpTraffic)] {
            let spec = presets().into_iter().find(|p| p.key == key).map(|p| p.spec).unwrap_or_default();
            assert_eq!(canonical_preset(check), key);
            let comm = planner::plan(&spec).unwrap().stages[0].comm.clone();
            let counter = |op, bytes_sent| crate::wire::trace::CollectiveCounter {
                op,
                calls: 1,
                elements: 0,
                bytes_sent,
                bytes_from_formula: false,
                total_us: 0,
            };
            // Three steps of the planned reduce-scatter and all-gather bytes, and a few scalars.
            let ranks = |rs: u64, ag: u64| {
                vec![RankTrace {
                    comm: crate::wire::trace::RankCommTrace {
                        counters: vec![
                            counter(CollectiveOp::ReduceScatter, 3 * rs),
                            counter(CollectiveOp::AllGather, 3 * ag),
                            counter(CollectiveOp::AllReduce, 24),
                        ],
                        ..Default::default()
                    },
                    ..RankTrace::default()
                }]
            };
            let v = view(1, spec.clone(), None);
            let good = ranks(comm.dp_reduce_scatter, comm.dp_all_gather);
            let got =
                measure(check, &RunEvidence { view: &v, metrics: &[], ranks: &good, traced_steps: 3 }, None).unwrap();
            assert!(got.agrees, "{key}: {got:?}");
            let want = if key == "zero2" { "1.50 x D" } else { "2.25 x D" };
            assert!(got.predicted.contains(want), "{key}: {}", got.predicted);
            // Without the parameters' all-gather (a broken ZeRO) the bytes fall short.
            let broken = ranks(comm.dp_reduce_scatter, 0);
            let got =
                measure(check, &RunEvidence { view: &v, metrics: &[], ranks: &broken, traced_steps: 3 }, None).unwrap();
            assert!(!got.agrees, "{key}: {got:?}");
        }
    }

    #[test]
    fn the_bubble_is_replayed_from_the_stages_passes_and_set_against_both_formulas() {
        use crate::analysis::pipeline::StageDurations;
        let spec = presets().into_iter().find(|p| p.key == "pipeline").map(|p| p.spec).unwrap_or_default();
        let v = view(1, spec.clone(), None);
        let pipe = Pipeline::of(&spec);
        // A step run as the schedule says, each stage's passes taking `durations`.
        let traced = |durations: &[StageDurations]| -> Vec<RankTrace> {
            let rows = project(pipe, durations, 1).unwrap();
            rows.into_iter().map(|r| RankTrace { rank: r.rank, spans: r.spans, ..RankTrace::default() }).collect()
        };
        let check = |ranks: &[RankTrace]| {
            measure(ClaimCheck::BubbleFraction, &RunEvidence { view: &v, metrics: &[], ranks, traced_steps: 1 }, None)
                .unwrap()
        };
        let even = vec![StageDurations { forward: 500, backward: 1000, weights: 0 }; 4];
        let got = check(&traced(&even));
        assert!(got.agrees && got.measured.starts_with("27.3% replayed"), "{got:?}");
        assert!(got.measured.contains("closer to (P-1)/(M+P-1)"), "{got:?}");
        assert!(got.predicted.contains("the simpler (P-1)/M = 37.5%"), "{got:?}");
        // A last stage three times as slow as the others sets the pace: the bubble it makes
        // is not the formula's.
        let mut uneven = even.clone();
        uneven[3] = StageDurations { forward: 1500, backward: 3000, weights: 0 };
        let got = check(&traced(&uneven));
        assert!(!got.agrees, "{got:?}");
    }

    #[test]
    fn recompute_time_is_measured_against_the_steps_forward_and_backward() {
        use crate::wire::trace::{Span, SpanKind};
        let spec = presets().into_iter().find(|p| p.key == "checkpointing").map(|p| p.spec).unwrap_or_default();
        let flops = planner::plan(&spec).unwrap().flops;
        let planned = flops.recompute / (flops.total - flops.recompute);
        let v = view(1, spec.clone(), None);
        let span = |kind, name: &str, start_us, end_us| Span {
            kind,
            name: name.into(),
            step: 0,
            lane: crate::wire::trace::lane::COMPUTE.into(),
            start_us,
            end_us,
            layer: None,
            bucket: None,
            bytes: None,
            micro: None,
            chunk: None,
        };
        // A forward of 1000 µs, backwards of 2000 µs and recomputes of `recompute` µs.
        let check = |recompute: u64| {
            let spans = vec![
                span(SpanKind::Forward, "forward", 0, 1000),
                span(SpanKind::Forward, "recompute layer 1", 1000, 1000 + recompute / 2),
                span(SpanKind::Backward, "backward layer 1", 0, 1000),
                span(SpanKind::Forward, "recompute layer 0", 0, recompute - recompute / 2),
                span(SpanKind::Backward, "backward layer 0", 0, 1000),
            ];
            let ranks = vec![RankTrace { spans, ..RankTrace::default() }];
            measure(
                ClaimCheck::CheckpointingRecomputeTime,
                &RunEvidence { view: &v, metrics: &[], ranks: &ranks, traced_steps: 1 },
                None,
            )
            .unwrap()
        };
        let got = check((planned * 3000.0) as u64);
        assert!(got.agrees, "{got:?}");
        // An engine that recomputed nothing, or every block twice over, disagrees.
        assert!(!check(0).agrees);
        assert!(!check(3000).agrees);
        // Without the per-unit spans (a pipelined run) there is nothing to measure.
        let ranks = vec![RankTrace { spans: vec![span(SpanKind::Forward, "forward", 0, 10)], ..RankTrace::default() }];
        let run = RunEvidence { view: &v, metrics: &[], ranks: &ranks, traced_steps: 1 };
        assert!(measure(ClaimCheck::CheckpointingRecomputeTime, &run, None).is_err());
    }

    #[test]
    fn checkpointing_memory_is_set_against_a_measured_run_without_it() {
        let spec = presets().into_iter().find(|p| p.key == "checkpointing").map(|p| p.spec).unwrap_or_default();
        let mut plain_spec = spec.clone();
        plain_spec.train.checkpointing = Checkpointing::None;
        assert_eq!(is_partner(ClaimCheck::ActivationCheckpointingMemory, &spec, &plain_spec), Some(true));
        let planned = |s: &ExperimentSpec| planner::plan(s).unwrap().peak_activations();
        let ranks = |activations: u64| {
            vec![RankTrace {
                memory: Some(crate::wire::memory::RankMemoryReport {
                    peak: planner::RankMemory { activations, ..Default::default() },
                    ..Default::default()
                }),
                ..RankTrace::default()
            }]
        };
        let (with, without) = (view(1, spec.clone(), None), view(2, plain_spec.clone(), None));
        let (r_with, r_without) = (ranks(planned(&spec)), ranks(planned(&plain_spec)));
        let run = |v, r| RunEvidence { view: v, metrics: &[], ranks: r, traced_steps: 1 };
        let got =
            measure(ClaimCheck::ActivationCheckpointingMemory, &run(&with, &r_with), Some(&run(&without, &r_without)))
                .unwrap();
        assert!(got.agrees, "{got:?}");
        // Checkpointing that keeps everything (a broken engine) does not agree.
        let kept_all = ranks(planned(&plain_spec));
        let got = measure(
            ClaimCheck::ActivationCheckpointingMemory,
            &run(&with, &kept_all),
            Some(&run(&without, &r_without)),
        )
        .unwrap();
        assert!(!got.agrees, "{got:?}");
        assert!(measure(ClaimCheck::ActivationCheckpointingMemory, &run(&with, &r_with), None).is_err());
    }
}
