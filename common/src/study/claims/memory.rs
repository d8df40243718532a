//! Claims about the memory one run's rank 0 holds, measured by its ledger and set against
//! the planner and the texts: bytes per parameter, ZeRO's model state, FSDP's gathered
//! unit, the experts' parameters, each pipeline stage's activation peak.

use super::{bytes_text, Inputs, Measurement, RunEvidence};
use crate::plan::planner;
use crate::ExperimentSpec;

/// Rank 0's measured model state per parameter against the planner's bytes per parameter.
pub(super) fn bytes_per_param(input: &Inputs) -> Result<Measurement, String> {
    let spec = input.spec;
    let plan = &input.plan;
    let rank0 = input.rank0;
    let rank = rank0.ok_or("the run recorded no trace")?;
    let measured = rank.memory.as_ref().ok_or("the run recorded no memory")?;
    let stage = &plan.stages[spec.stage_of(0)];
    let (got, want) = (model_state(&measured.peak), model_state(&stage.memory));
    let per_param = |b: u64| b as f64 / stage.params_per_rank.max(1) as f64;
    Ok(input.m(
        format!("{:.2} bytes per parameter", per_param(want)),
        format!("{:.2} bytes per parameter ({} on rank 0)", per_param(got), bytes_text(got)),
        got == want,
    ))
}

/// Rank 0's model state under ZeRO or FSDP against the texts' counts of it (the master weights sharded or whole).
pub(super) fn zero_memory(input: &Inputs) -> Result<Measurement, String> {
    let spec = input.spec;
    let plan = &input.plan;
    let rank0 = input.rank0;
    let rank = rank0.ok_or("the run recorded no trace")?;
    let got = &rank.memory.as_ref().ok_or("the run recorded no memory")?.peak;
    let stage = &plan.stages[spec.stage_of(0)];
    let want = &stage.memory;
    let counts = zero_counts(spec, stage.params_per_rank, want);
    let total = model_state(got);
    let matching: Vec<&str> = counts.iter().filter(|c| c.bytes == total).map(|c| c.source).collect();
    let same_categories =
        (got.parameters, got.gradients, got.optimizer_state) == (want.parameters, want.gradients, want.optimizer_state);
    let predicted = counts
        .iter()
        .map(|c| format!("{} = {} ({})", c.formula, bytes_text(c.bytes), c.source))
        .collect::<Vec<_>>()
        .join("; ");
    Ok(input.m(
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

/// FSDP on rank 0: the weights' shard it keeps and the most it gathers at once, against the planner.
pub(super) fn fsdp_gathered_peak(input: &Inputs) -> Result<Measurement, String> {
    let spec = input.spec;
    let plan = &input.plan;
    let rank0 = input.rank0;
    let rank = rank0.ok_or("the run recorded no trace")?;
    let peak = &rank.memory.as_ref().ok_or("the run recorded no memory")?.peak;
    let stage = &plan.stages[spec.stage_of(0)];
    let whole = stage.params_per_rank.saturating_mul(plan.bytes_per_param.parameters);
    let (shard, gathered) = (stage.memory.parameters, stage.memory.gathered_parameters);
    Ok(input.m(
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

/// The parameters rank 0 holds with the experts spread over ep ranks, against the planner.
pub(super) fn expert_parameters(input: &Inputs) -> Result<Measurement, String> {
    let spec = input.spec;
    let plan = &input.plan;
    let rank0 = input.rank0;
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
    Ok(input.m(
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

/// Parameters, gradients and optimizer state: the model state of a rank's memory.
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
        // (K here is the shard group, not the whole data-parallel group)
        crate::Sharding::Hsdp => (format!("{}N/K", w + w + o), None),
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

/// Each pipeline stage's activation peak: the most any of its ranks booked (ledger).
pub(super) fn stage_activation_peaks(run: &RunEvidence) -> Result<Vec<u64>, String> {
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

#[cfg(test)]
mod tests {
    use crate::plan::planner;
    use crate::spec::presets::presets;
    use crate::study::cards::ClaimCheck;
    use crate::study::claims::test_runs::succeeded_view;
    use crate::study::claims::{measure, preset_for, RunEvidence};
    use crate::wire::trace::RankTrace;

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
        let v = succeeded_view(1, spec.clone(), None);
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
        let deck = crate::study::cards::load_deck(include_str!("../../../../cards/deck.json")).unwrap();
        let card = |id: &str| deck.iter().find(|c| c.id == id).unwrap();
        assert_eq!(preset_for(card("zero-redundancy")), Some("zero1"));
        assert_eq!(preset_for(card("zero-memory-table")), Some("zero2"));
        assert_eq!(preset_for(card("reduce-scatter-for-sharded-gradients")), Some("zero2"));
        for (key, sharded, whole) in [("zero1", "4N + 12N/K", "8N + 8N/K"), ("zero2", "2N + 14N/K", "6N + 10N/K")] {
            let spec = presets().into_iter().find(|p| p.key == key).map(|p| p.spec).unwrap_or_default();
            let stage = planner::plan(&spec).unwrap().stages[0].clone();
            let v = succeeded_view(1, spec.clone(), None);
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
}
