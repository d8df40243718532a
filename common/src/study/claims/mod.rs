//! A flashcard's claim checked by a run: the number the card predicts next to the number
//! the lab measured (`GET /api/cards/checks`). Each [`ClaimCheck`] reads one kind of
//! evidence from a finished run of a preset: collective byte counters, the memory
//! ledger, the pipeline timeline, the losses.
//!
//! [`measure`] is the table: one line per check, naming the function that measures it,
//! grouped by the evidence it reads: `traffic.rs` (bytes on the wire), `all_reduce.rs` (the
//! other all-reduce algorithms), `data_parallel.rs` (compressed and accumulated gradients),
//! `memory.rs` (one run's memory), `memory_pairs.rs` (two runs one setting apart),
//! `experts.rs` (expert capacity), `timeline.rs` (the bubble, recompute time),
//! `utilisation.rs` (MFU) and `losses.rs`.

use serde::{Deserialize, Serialize};

mod all_reduce;
mod data_parallel;
mod experts;
mod losses;
mod memory;
mod memory_pairs;
#[cfg(test)]
mod test_runs;
mod timeline;
mod traffic;
mod utilisation;

use crate::analysis::compare;
use crate::plan::planner::{self, Plan};
use crate::study::cards::{Card, ClaimCheck, Demo};
use crate::wire::events::MetricPoint;
use crate::wire::trace::{CollectiveOp, RankTrace};
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
        ClaimCheck::SelectiveRecompute => "selective",
        ClaimCheck::ContextParallel => "ulysses",
        ClaimCheck::PrefetchGatheredPeak => "fsdp",
        ClaimCheck::SequenceParallelActivations => "megatron",
        ClaimCheck::TwoByteWire => "zero2",
        ClaimCheck::TreeAllreduce => "allreduce-tree",
        ClaimCheck::HierarchicalAllreduce => "allreduce-hierarchical",
        ClaimCheck::CompressedGradients => "topk",
        ClaimCheck::AccumulationAllreduces => "ddp2",
        ClaimCheck::ExpertCapacity => "experts",
        ClaimCheck::DiskOffloadMemory => "offload-disk",
        ClaimCheck::ActivationOffloadMemory => "offload-activations",
        ClaimCheck::TpAllreduces => "megatron",
        ClaimCheck::LossScalingUnderflow => "fp16-plain",
        ClaimCheck::Bf16NoScaling => "bf16",
        ClaimCheck::Fp8DelayedScaling => "fp8",
        ClaimCheck::Fp8AllGather => "fp8-all-gather",
        ClaimCheck::ZbvBubble => "zbv",
        ClaimCheck::DualPipeVAgainstZbv => "dualpipev",
        ClaimCheck::DilocoBytes => "diloco",
        ClaimCheck::ParameterServerBottleneck => "async-ps",
        ClaimCheck::ReplicaRejoin => "lost-replica",
        ClaimCheck::LambLargeBatch => "lamb-large-batch",
        ClaimCheck::HsdpAcrossGroups => "hsdp",
        ClaimCheck::ModelFlopUtilisation => "reference",
    }
}

/// Whether `candidate` is the run a check sets `run` against, for the checks that compare
/// two measured runs: any one-rank run of the same training (equal losses), the same
/// config with dynamic loss scaling (underflow), in fp32 (bf16), without activation
/// checkpointing (its memory), with the GPipe schedule (activation peaks per stage), with
/// naive attention, with FSDP's prefetch, with sequence parallelism, with a 2-byte wire,
/// gathering in the wire format rather than FP8, under ZB-H1 rather than ZBV, with DDP's
/// every-step sync rather than DiLoCo's or a parameter server's, with AdamW rather than LAMB, with more accumulation steps, with room for every token in each expert, or with the
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
        ClaimCheck::ActivationCheckpointingMemory | ClaimCheck::SelectiveRecompute => {
            twin.train.checkpointing = Checkpointing::None
        }
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
        ClaimCheck::ActivationOffloadMemory => twin.train.activation_offload = crate::Offload::None,
        ClaimCheck::Fp8DelayedScaling => twin.train.fp8 = crate::Fp8Recipe::None,
        ClaimCheck::Fp8AllGather => twin.parallel.fp8_all_gather = false,
        ClaimCheck::ZbvBubble => twin.parallel.pp_schedule = crate::PpSchedule::ZbH1,
        ClaimCheck::DualPipeVAgainstZbv => twin.parallel.pp_schedule = crate::PpSchedule::Zbv,
        ClaimCheck::DilocoBytes => {
            twin.parallel.sync = crate::DataSync::EveryStep;
            // (the outer step's settings mean nothing to DDP)
            (twin.parallel.outer_steps_every, twin.parallel.outer_lr, twin.parallel.outer_momentum) =
                (candidate.parallel.outer_steps_every, candidate.parallel.outer_lr, candidate.parallel.outer_momentum);
        }
        ClaimCheck::ParameterServerBottleneck => twin.parallel.sync = crate::DataSync::EveryStep,
        ClaimCheck::ContextParallel => (twin.parallel.dp, twin.parallel.cp) = (run.parallel.data_replicas(), 1),
        ClaimCheck::LambLargeBatch => twin.train.optimizer = crate::Optimizer::Adamw,
        ClaimCheck::HsdpAcrossGroups => {
            (twin.parallel.sharding, twin.parallel.shard_group) = (crate::Sharding::Fsdp, 0);
        }
        _ => return None,
    }
    Some(twin.same_up_to_name(candidate))
}

/// Checks `check` on `run` (and `partner`, when the check compares two runs): each check is
/// one function, found here.
pub fn measure(check: ClaimCheck, run: &RunEvidence, partner: Option<&RunEvidence>) -> Result<Measurement, String> {
    let input = &Inputs::new(run, partner)?;
    match check {
        ClaimCheck::AllreduceBytes => traffic::allreduce_bytes(input),
        ClaimCheck::RingPhaseBytes => traffic::ring_phase_bytes(input),
        ClaimCheck::Zero2Traffic => traffic::zero2_traffic(input),
        ClaimCheck::FsdpTraffic => traffic::fsdp_traffic(input),
        ClaimCheck::Zero1Traffic => traffic::zero1_traffic(input),
        ClaimCheck::ExpertAllToAll => traffic::expert_all_to_all(input),
        ClaimCheck::TwoByteWire => traffic::two_byte_wire(input),
        ClaimCheck::Fp8AllGather => traffic::fp8_all_gather(input),
        ClaimCheck::DilocoBytes => traffic::diloco_bytes(input),
        ClaimCheck::ParameterServerBottleneck => traffic::parameter_server_bottleneck(input),
        ClaimCheck::ReplicaRejoin => traffic::replica_rejoin(input),
        ClaimCheck::HsdpAcrossGroups => traffic::hsdp_across_groups(input),
        ClaimCheck::TpAllreduces => traffic::tp_allreduces(input),
        ClaimCheck::TreeAllreduce => all_reduce::tree(run),
        ClaimCheck::HierarchicalAllreduce => all_reduce::hierarchical(run),
        ClaimCheck::CompressedGradients => data_parallel::compressed(run),
        ClaimCheck::AccumulationAllreduces => data_parallel::accumulation(run, partner),
        ClaimCheck::BytesPerParam => memory::bytes_per_param(input),
        ClaimCheck::ZeroMemory => memory::zero_memory(input),
        ClaimCheck::FsdpGatheredPeak => memory::fsdp_gathered_peak(input),
        ClaimCheck::ExpertParameters => memory::expert_parameters(input),
        ClaimCheck::ActivationCheckpointingMemory => memory_pairs::activation_checkpointing_memory(input),
        ClaimCheck::PipelineActivationPeaks => memory_pairs::pipeline_activation_peaks(input),
        ClaimCheck::FlashAttentionMemory => memory_pairs::flash_attention_memory(input),
        ClaimCheck::SelectiveRecompute => memory_pairs::selective_recompute(input),
        ClaimCheck::ContextParallel => traffic::context_parallel(input),
        ClaimCheck::PrefetchGatheredPeak => memory_pairs::prefetch_gathered_peak(input),
        ClaimCheck::SequenceParallelActivations => memory_pairs::sequence_parallel_activations(input),
        ClaimCheck::DiskOffloadMemory => memory_pairs::disk_offload_memory(input),
        ClaimCheck::ActivationOffloadMemory => memory_pairs::activation_offload_memory(input),
        ClaimCheck::ExpertCapacity => experts::capacity(run, partner),
        ClaimCheck::BubbleFraction => timeline::bubble_fraction(input),
        ClaimCheck::ZbvBubble => timeline::zbv_bubble(input),
        ClaimCheck::DualPipeVAgainstZbv => timeline::dualpipev_against_zbv(input),
        ClaimCheck::CheckpointingRecomputeTime => timeline::checkpointing_recompute_time(input),
        ClaimCheck::DdpEqualsOneRank => losses::ddp_equals_one_rank(input),
        ClaimCheck::LossScalingUnderflow => losses::loss_scaling_underflow(input),
        ClaimCheck::Bf16NoScaling => losses::bf16_no_scaling(input),
        ClaimCheck::Fp8DelayedScaling => losses::fp8_delayed_scaling(input),
        ClaimCheck::LambLargeBatch => losses::lamb_large_batch(input),
        ClaimCheck::ModelFlopUtilisation => utilisation::model_flop_utilisation(input),
    }
}

/// What a check reads: the run (and its partner, for a check of two runs) and the
/// planner's plan of the run's spec (every check needs a spec the planner can plan).
struct Inputs<'a> {
    run: &'a RunEvidence<'a>,
    partner: Option<&'a RunEvidence<'a>>,
    spec: &'a ExperimentSpec,
    plan: Plan,
    /// Rank 0's trace, if the run recorded one.
    rank0: Option<&'a RankTrace>,
    /// The steps the traces cover, at least 1.
    traced_steps: u64,
}

impl<'a> Inputs<'a> {
    fn new(run: &'a RunEvidence<'a>, partner: Option<&'a RunEvidence<'a>>) -> Result<Self, String> {
        let spec = &run.view.spec;
        let plan = planner::plan(spec).map_err(|_| "the planner cannot plan the run's spec".to_string())?;
        let rank0 = run.ranks.iter().find(|r| r.rank == 0);
        Ok(Inputs { run, partner, spec, plan, rank0, traced_steps: run.traced_steps.max(1) })
    }

    /// The run's measurement, without a note.
    fn m(&self, predicted: String, measured: String, agrees: bool) -> Measurement {
        Measurement { experiment_id: self.run.view.id, predicted, measured, agrees, note: None }
    }
}

/// The one-float all-reduces of a step (the loss, the gradient norm) that the planner's
/// all-reduce bytes leave out, at most.
const SCALAR_BYTES: u64 = 1024;

fn op_counters(rank: &RankTrace, op: CollectiveOp) -> impl Iterator<Item = &crate::wire::trace::CollectiveCounter> {
    rank.comm.counters.iter().filter(move |c| c.op == op)
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
            ClaimCheck::SelectiveRecompute,
            ClaimCheck::ContextParallel,
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
            ClaimCheck::ActivationOffloadMemory,
            ClaimCheck::Fp8DelayedScaling,
            ClaimCheck::Fp8AllGather,
            ClaimCheck::ZbvBubble,
            ClaimCheck::DualPipeVAgainstZbv,
            ClaimCheck::DilocoBytes,
            ClaimCheck::ParameterServerBottleneck,
            ClaimCheck::ReplicaRejoin,
            ClaimCheck::LambLargeBatch,
            ClaimCheck::HsdpAcrossGroups,
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
        let deck = crate::study::cards::load_deck(include_str!("../../../../cards/deck.json")).unwrap_or_default();
        let scaling = |c: &&Card| c.claim.as_ref().is_some_and(|c| c.check == ClaimCheck::LossScalingUnderflow);
        assert!(deck.iter().filter(scaling).count() > 0);
        for card in deck.iter().filter(scaling) {
            assert_eq!(preset_for(card), Some("fp16-plain"), "{}", card.id);
        }
        assert!(deck.iter().filter(|c| c.claim.is_none()).all(|c| preset_for(c).is_none()));
    }
}
