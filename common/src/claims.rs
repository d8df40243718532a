//! A flashcard's claim checked by a run: the number the card predicts next to the number
//! the lab measured (`GET /api/cards/checks`). Each [`ClaimCheck`] reads one kind of
//! evidence from a finished run of a preset: collective byte counters, the memory
//! ledger, the pipeline timeline, the losses.

use serde::{Deserialize, Serialize};

use crate::cards::{Card, ClaimCheck, Demo};
use crate::compare;
use crate::events::MetricPoint;
use crate::pipeline::{default_step, measured_bubble, recorded_steps, stage_rows};
use crate::planner::{self, Plan};
use crate::schedule::Pipeline;
use crate::trace::{CollectiveOp, RankTrace, RingPhase};
use crate::{Checkpointing, ExperimentSpec, ExperimentView};

/// `GET /api/cards/checks`: one entry per (check, preset) the deck uses.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct ClaimChecks {
    pub checks: Vec<ClaimStatus>,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
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
            canonical_preset(check)
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
        ClaimCheck::ActivationCheckpointingMemory => "checkpointing",
        ClaimCheck::ZeroMemory | ClaimCheck::FsdpTraffic | ClaimCheck::FsdpGatheredPeak => "fsdp",
        ClaimCheck::Zero2Traffic => "zero2",
        ClaimCheck::TpAllreduces => "megatron",
        ClaimCheck::LossScalingUnderflow => "fp16-plain",
        ClaimCheck::Bf16NoScaling => "bf16",
    }
}

/// Whether `candidate` is the run a check sets `run` against, for the checks that compare
/// two measured runs: any one-rank run of the same training (equal losses), the same
/// config with dynamic loss scaling (underflow), in fp32 (bf16), without activation
/// checkpointing (its memory), or with the GPipe schedule (activation peaks per stage). None: the check needs no partner.
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
                return Ok(m(
                    format!("{} bytes per rank", c.formula_bytes),
                    format!("{least}–{most} bytes per rank ({} ranks)", c.world),
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
        ClaimCheck::BytesPerParam | ClaimCheck::ZeroMemory => {
            let rank = rank0.ok_or("the run recorded no trace")?;
            let measured = rank.memory.as_ref().ok_or("the run recorded no memory")?;
            let stage = &plan.stages[spec.stage_of(0)];
            let state = |m: &planner::RankMemory| m.parameters + m.gradients + m.optimizer_state;
            let (got, want) = (state(&measured.peak), state(&stage.memory));
            if check == ClaimCheck::BytesPerParam {
                let per_param = |b: u64| b as f64 / stage.params_per_rank.max(1) as f64;
                Ok(m(
                    format!("{:.2} bytes per parameter", per_param(want)),
                    format!("{:.2} bytes per parameter ({} on rank 0)", per_param(got), bytes_text(got)),
                    got == want,
                ))
            } else {
                Ok(m(
                    format!(
                        "{} of model state on rank 0 (sharding {}, dp={})",
                        bytes_text(want),
                        spec.parallel.sharding.as_str(),
                        spec.parallel.dp
                    ),
                    bytes_text(got),
                    got == want,
                ))
            }
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
            let planned = planner::plan(&plain_spec).map(|p| peak_activations(&p)).unwrap_or(0);
            let planned_ratio = peak_activations(&plan) as f64 / planned.max(1) as f64;
            Ok(m(
                format!(
                    "checkpointing {} keeps {:.0}% of the activations (planner: {} of {})",
                    checkpointing_name(spec.train.checkpointing),
                    100.0 * planned_ratio,
                    bytes_text(peak_activations(&plan)),
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
            let step = default_step(&recorded_steps(run.ranks)).ok_or("the run recorded no timeline")?;
            let bubble =
                measured_bubble(&stage_rows(run.ranks, step)).ok_or("the timeline has no forward or backward")?;
            let formula = Pipeline::of(spec).formula_bubble();
            Ok(Measurement {
                note: Some(format!(
                    "The formula assumes every stage has a processor of its own and equal work. Here {} \
                     rank processes run at once on the worker's machine: with more of them than cores, a \
                     stage also waits for a core, and the first and last stages do more (embeddings, LM \
                     head). Both add idle time the formula does not count.",
                    spec.world_size()
                )),
                ..m(
                    format!(
                        "{} = {:.1}% (P={}, M={})",
                        Pipeline::of(spec).formula_name(),
                        100.0 * formula,
                        spec.parallel.pp,
                        spec.pipeline_micro_batches()
                    ),
                    format!("{:.1}% idle in step {step}", 100.0 * bubble.overall),
                    (bubble.overall - formula).abs() <= 0.1,
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
            let sent: u64 = op_counters(rank, rs).chain(op_counters(rank, ag)).map(|c| c.bytes_sent).sum();
            let per_step = sent / traced_steps;
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
                    "{measured:.3} x D: {} on rank 0 (D = {}; the planner's count: {})",
                    bytes_text(per_step),
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
        ClaimCheck::TpAllreduces => {
            let step = default_step(&recorded_steps(run.ranks)).ok_or("the run recorded no timeline")?;
            let rank = rank0.ok_or("the run recorded no trace")?;
            let calls = rank.spans.iter().filter(|s| s.step == step && s.lane == crate::trace::lane::TP).count();
            let layers = plan.stages[spec.stage_of(0)].layers;
            // Checkpointing recomputes each block's forward, with its two all-reduces.
            let per_block = if spec.train.checkpointing == Checkpointing::None { 4 } else { 6 };
            let micro_batches = spec.pipeline_micro_batches();
            let predicted = per_block * layers * micro_batches;
            Ok(m(
                format!("{per_block} x {layers} blocks x {micro_batches} micro-batches = {predicted} per step"),
                format!("{calls} on rank 0 in step {step}"),
                calls == predicted,
            ))
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
            Ok(m(
                format!("without scaling the loss falls less than {:.0}% as far", 100.0 * SLOWER),
                format!(
                    "{:.0}%: down {:.4} without scaling, {:.4} with it (run {})",
                    100.0 * plain / with,
                    plain,
                    with,
                    scaled.view.id
                ),
                with > 0.0 && plain < SLOWER * with,
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

/// Without loss scaling fp16 must fall less than this share of the scaled run's descent.
const SLOWER: f64 = 0.9;
/// bf16 must fall at least this share of fp32's descent.
const ALONGSIDE: f64 = 0.95;

/// How far a run's loss fell: its first step's loss minus its last (the summary's final).
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

fn op_counters(rank: &RankTrace, op: CollectiveOp) -> impl Iterator<Item = &crate::trace::CollectiveCounter> {
    rank.comm.counters.iter().filter(move |c| c.op == op)
}

fn peak_activations(plan: &Plan) -> u64 {
    plan.stages.iter().map(|s| s.memory.activations).max().unwrap_or(0)
}

fn final_loss(run: &RunEvidence) -> Result<f64, String> {
    run.view
        .summary
        .as_ref()
        .map(|s| s.final_loss)
        .or(run.metrics.last().map(|p| p.loss))
        .ok_or_else(|| "the run has no loss".into())
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::presets::presets;

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
            ClaimCheck::PipelineActivationPeaks,
            ClaimCheck::ZeroMemory,
            ClaimCheck::Zero2Traffic,
            ClaimCheck::FsdpTraffic,
            ClaimCheck::FsdpGatheredPeak,
            ClaimCheck::TpAllreduces,
            ClaimCheck::LossScalingUnderflow,
            ClaimCheck::Bf16NoScaling,
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
        let deck = crate::cards::load_deck(include_str!("../../cards/deck.json")).unwrap_or_default();
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
        let step = |from: u32, phase: RingPhase, bytes: u64| crate::trace::RingStep {
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
            comm: crate::trace::RankCommTrace {
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
        let (l_plain, l_scaled, l_bf16, l_fp32) =
            (losses(8.3226, 7.7657), losses(8.3226, 7.6178), losses(8.3226, 7.6181), losses(8.3226, 7.6179));
        let under =
            measure(ClaimCheck::LossScalingUnderflow, &run(&plain, &l_plain), Some(&run(&scaled, &l_scaled))).unwrap();
        assert!(under.agrees, "{under:?}");
        // A fp16 run that falls nearly as far as the scaled one does not show underflow.
        let nearly = losses(8.3226, 7.65);
        assert!(
            !measure(ClaimCheck::LossScalingUnderflow, &run(&plain, &nearly), Some(&run(&scaled, &l_scaled)))
                .unwrap()
                .agrees
        );
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
                    memory: Some(crate::memory::RankMemoryReport {
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
                memory: Some(crate::memory::RankMemoryReport {
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
    fn sharded_traffic_is_measured_in_multiples_of_d() {
        for (key, check) in [("zero2", ClaimCheck::Zero2Traffic), ("fsdp", ClaimCheck::FsdpTraffic)] {
            let spec = presets().into_iter().find(|p| p.key == key).map(|p| p.spec).unwrap_or_default();
            assert_eq!(canonical_preset(check), key);
            let comm = planner::plan(&spec).unwrap().stages[0].comm.clone();
            let counter = |op, bytes_sent| crate::trace::CollectiveCounter {
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
                    comm: crate::trace::RankCommTrace {
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
    fn checkpointing_memory_is_set_against_a_measured_run_without_it() {
        let spec = presets().into_iter().find(|p| p.key == "checkpointing").map(|p| p.spec).unwrap_or_default();
        let mut plain_spec = spec.clone();
        plain_spec.train.checkpointing = Checkpointing::None;
        assert_eq!(is_partner(ClaimCheck::ActivationCheckpointingMemory, &spec, &plain_spec), Some(true));
        let planned = |s: &ExperimentSpec| peak_activations(&planner::plan(s).unwrap());
        let ranks = |activations: u64| {
            vec![RankTrace {
                memory: Some(crate::memory::RankMemoryReport {
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
