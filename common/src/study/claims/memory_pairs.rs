//! Claims about memory that set two measured runs one setting apart against each other
//! and against the planner: checkpointing on and off, 1F1B against GPipe stage by stage,
//! FlashAttention, selective recompute, FSDP's prefetch, sequence parallelism, the
//! optimizer's state on disk.

use super::memory::stage_activation_peaks;
use super::timeline::{recompute_share, RecomputeShare};
use super::{bytes_text, checkpointing_name, ms, Inputs, Measurement, RunEvidence};
use crate::plan::planner;
use crate::study::cards::ClaimCheck;
use crate::Checkpointing;

/// The activations kept with checkpointing as a share of those without (the partner), against the planner's share.
pub(super) fn activation_checkpointing_memory(input: &Inputs) -> Result<Measurement, String> {
    let run = input.run;
    let partner = input.partner;
    let spec = input.spec;
    let plan = &input.plan;
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
    Ok(input.m(
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

/// Each stage's activation peak as a share of GPipe's (the partner), against the planner's shares.
pub(super) fn pipeline_activation_peaks(input: &Inputs) -> Result<Measurement, String> {
    let run = input.run;
    let partner = input.partner;
    let spec = input.spec;
    let plan = &input.plan;
    // Each stage's activation peak under this schedule and under GPipe, both measured
    // (the ledger of every rank of the stage), as a share of GPipe's.
    let gpipe = partner
        .ok_or("no finished run of the same config with pp_schedule gpipe yet (resubmit the preset with gpipe)")?;
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
    Ok(input.m(
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

/// The activations with FlashAttention against naive attention (the partner).
pub(super) fn flash_attention_memory(input: &Inputs) -> Result<Measurement, String> {
    two_runs_memory(ClaimCheck::FlashAttentionMemory, input.run, input.partner)
}

/// FSDP's gathered weights without prefetch against with it (the partner).
pub(super) fn prefetch_gathered_peak(input: &Inputs) -> Result<Measurement, String> {
    two_runs_memory(ClaimCheck::PrefetchGatheredPeak, input.run, input.partner)
}

/// The activations with tensor parallelism alone against with sequence parallelism (the partner).
pub(super) fn sequence_parallel_activations(input: &Inputs) -> Result<Measurement, String> {
    two_runs_memory(ClaimCheck::SequenceParallelActivations, input.run, input.partner)
}

/// The optimizer state on the device offloaded to disk against kept in memory (the partner), and the step times.
pub(super) fn disk_offload_memory(input: &Inputs) -> Result<Measurement, String> {
    two_runs_memory(ClaimCheck::DiskOffloadMemory, input.run, input.partner)
}

/// The activations on the device with activation offload (this run) against kept (the
/// partner), each against the planner, with what left the device and the steps' times.
pub(super) fn activation_offload_memory(input: &Inputs) -> Result<Measurement, String> {
    two_runs_memory(ClaimCheck::ActivationOffloadMemory, input.run, input.partner)
}

/// Selective recompute (this run) against none (the partner): the activations of each,
/// against the planner, and the price: rank 0's time recomputing the probabilities as a
/// share of its forward's time, against the recompute's FLOPs as a share of the forward's
/// (a third of the step's, backward costing two forwards): at least that share less 10
/// points, and nearer to it than to a whole forward (what checkpointing every block pays).
/// Only a floor from the FLOPs: the softmax's exponentials, counted one FLOP each, cost
/// several, by how much depends on the CPU (measured 56% of the forward on an Intel with
/// AVX-512, 64% on another machine, for 54% of its FLOPs). (Against the whole step the
/// FLOPs would undercount it further: the exponentials are in the forward and the
/// recompute, not in the backward.)
pub(super) fn selective_recompute(input: &Inputs) -> Result<Measurement, String> {
    let memory = two_runs_memory(ClaimCheck::SelectiveRecompute, input.run, input.partner)?;
    let RecomputeShare { recompute, forward, backward, .. } = recompute_share(input)?;
    let flops = &input.plan.flops;
    let planned = flops.recompute / ((flops.total - flops.recompute) / 3.0).max(1.0);
    let measured = recompute as f64 / forward as f64;
    let selective = input.spec.train.checkpointing == Checkpointing::Selective;
    Ok(Measurement {
        predicted: format!(
            "{}; recomputing attention's probabilities costs {:.0}% of a forward's FLOPs",
            memory.predicted,
            100.0 * planned
        ),
        measured: format!(
            "{}; {:.0}% of the forward's time: recompute {} ms against forward {} ms (backward {} ms) on rank 0",
            memory.measured,
            100.0 * measured,
            ms(recompute),
            ms(forward),
            ms(backward)
        ),
        agrees: memory.agrees
            && selective
            && recompute > 0
            && measured >= planned - 0.10
            && measured <= (1.0 + planned) / 2.0,
        ..memory
    })
}

/// A memory category measured on two runs that differ in one setting, each against the
/// planner: FlashAttention (this run) against naive attention (the partner), FSDP without
/// prefetch (this run) against with it, TP without sequence parallelism against with it,
/// the optimizer's state on disk against in memory (with the price: the steps' times).
pub(super) fn two_runs_memory(
    check: ClaimCheck,
    run: &RunEvidence,
    partner: Option<&RunEvidence>,
) -> Result<Measurement, String> {
    let (category, setting, ours_smaller): (&str, &str, bool) = match check {
        ClaimCheck::FlashAttentionMemory => ("activations", "attention naive", true),
        ClaimCheck::SelectiveRecompute => ("activations", "checkpointing none", true),
        ClaimCheck::ContextParallel => ("activations", "whole sequences (cp 1)", true),
        ClaimCheck::PrefetchGatheredPeak => ("gathered weights", "prefetch on", true),
        ClaimCheck::DiskOffloadMemory => ("optimizer state", "offload none", true),
        ClaimCheck::ActivationOffloadMemory => ("activations", "activation_offload none", true),
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
    // (activation offload: what left the device, rank 0's, measured and planned)
    let offloaded = (offloaded_peak(run), planner::plan(&run.view.spec).map_or(0, |p| p.stages[0].memory.offloaded));
    let offloaded_as_planned = check != ClaimCheck::ActivationOffloadMemory || offloaded.0 == offloaded.1;
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
        agrees: ours == ours_planned && theirs == theirs_planned && smaller_as_said && offloaded_as_planned,
        note: match check {
            ClaimCheck::DiskOffloadMemory => Some(format!(
                "The price of reading and writing the state each step: a median step of {} ms here against {} ms \
                 with it in memory (the page cache may hold the file; a cold disk would cost more).",
                ms((median_step_ms(run) * 1000.0) as u64),
                ms((median_step_ms(other) * 1000.0) as u64)
            )),
            ClaimCheck::ActivationOffloadMemory => Some(format!(
                "Off the device at the peak: {} of activations on rank 0 (planner: {}). The price of writing every \
                 block out and reading it back each step: a median step of {} ms here against {} ms with them kept \
                 (the page cache may hold the file).",
                bytes_text(offloaded.0),
                bytes_text(offloaded.1),
                ms((median_step_ms(run) * 1000.0) as u64),
                ms((median_step_ms(other) * 1000.0) as u64)
            )),
            _ => None,
        },
    })
}

/// Rank 0's peak of bytes off the device (0 without a memory record).
fn offloaded_peak(run: &RunEvidence) -> u64 {
    let rank = run.ranks.iter().find(|x| x.rank == 0);
    rank.and_then(|r| r.memory.as_ref()).map_or(0, |m| m.peak.offloaded)
}

/// The median of a run's step times, in milliseconds (0 without metrics).
fn median_step_ms(run: &RunEvidence) -> f64 {
    let mut times: Vec<f64> = run.metrics.iter().map(|p| p.step_ms).collect();
    times.sort_by(f64::total_cmp);
    times.get(times.len() / 2).copied().unwrap_or(0.0)
}

/// The most activation memory any rank of a run booked (its memory ledger).
fn measured_activations(run: &RunEvidence) -> Result<u64, String> {
    let peaks = run.ranks.iter().filter_map(|r| r.memory.as_ref()).map(|m| m.peak.activations);
    peaks.max().ok_or_else(|| format!("run {} recorded no memory", run.view.id))
}

#[cfg(test)]
mod tests {
    use crate::plan::planner;
    use crate::spec::presets::presets;
    use crate::study::cards::ClaimCheck;
    use crate::study::claims::test_runs::succeeded_view;
    use crate::study::claims::{canonical_preset, is_partner, measure, RunEvidence};
    use crate::wire::trace::RankTrace;
    use crate::{Checkpointing, ExperimentSpec};

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
        let (ours, theirs) = (succeeded_view(1, spec.clone(), None), succeeded_view(2, gpipe_spec.clone(), None));
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
    fn one_setting_apart_each_run_is_held_to_the_planner_and_the_difference_to_the_card() {
        let find = |key: &str| presets().into_iter().find(|p| p.key == key).map(|p| p.spec).unwrap_or_default();
        type Edit = fn(&mut ExperimentSpec);
        let cases: [(ClaimCheck, &str, Edit); 5] = [
            (ClaimCheck::FlashAttentionMemory, "flash", |s| s.train.attention = crate::Attention::Naive),
            (ClaimCheck::PrefetchGatheredPeak, "fsdp", |s| s.parallel.prefetch = true),
            (ClaimCheck::SequenceParallelActivations, "megatron", |s| s.parallel.sequence_parallel = true),
            (ClaimCheck::DiskOffloadMemory, "offload-disk", |s| s.parallel.offload = crate::Offload::None),
            (ClaimCheck::ActivationOffloadMemory, "offload-activations", |s| {
                s.train.activation_offload = crate::Offload::None
            }),
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
            let (ours, theirs) = (succeeded_view(1, spec.clone(), None), succeeded_view(2, other.clone(), None));
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
    fn selective_recompute_is_held_to_the_planners_memory_and_flops() {
        use crate::wire::trace::SpanKind;
        let spec = presets().into_iter().find(|p| p.key == "selective").map(|p| p.spec).unwrap_or_default();
        assert_eq!(canonical_preset(ClaimCheck::SelectiveRecompute), "selective");
        let mut plain_spec = spec.clone();
        plain_spec.train.checkpointing = Checkpointing::None;
        assert_eq!(is_partner(ClaimCheck::SelectiveRecompute, &spec, &plain_spec), Some(true));
        let flops = planner::plan(&spec).unwrap().flops;
        let planned_share = flops.recompute / ((flops.total - flops.recompute) / 3.0);
        let span = crate::study::claims::test_runs::compute_span;
        // Rank 0's activations, and a forward of 1000 µs, a backward of 2000 µs and recomputes
        // of `recompute` µs.
        let ranks = |activations: u64, recompute: u64| {
            vec![RankTrace {
                memory: Some(crate::wire::memory::RankMemoryReport {
                    peak: planner::RankMemory { activations, ..Default::default() },
                    ..Default::default()
                }),
                spans: vec![
                    span(SpanKind::Forward, "forward", 0, 1000),
                    span(SpanKind::Forward, "recompute layer 0", 1000, 1000 + recompute),
                    span(SpanKind::Backward, "backward layer 0", 0, 2000),
                ],
                ..RankTrace::default()
            }]
        };
        let planned = |s: &ExperimentSpec| planner::plan(s).unwrap().stages[0].memory.activations;
        let (with, without) = (succeeded_view(1, spec.clone(), None), succeeded_view(2, plain_spec.clone(), None));
        let on_time = (planned_share * 1000.0) as u64;
        let r_without = ranks(planned(&plain_spec), 0);
        fn run<'a>(view: &'a crate::ExperimentView, ranks: &'a [RankTrace]) -> RunEvidence<'a> {
            RunEvidence { view, metrics: &[], ranks, traced_steps: 1 }
        }
        let check = |r_with: &[RankTrace]| {
            measure(ClaimCheck::SelectiveRecompute, &run(&with, r_with), Some(&run(&without, &r_without))).unwrap()
        };
        let got = check(&ranks(planned(&spec), on_time));
        assert!(got.agrees, "{got:?}");
        assert!(planned(&spec) * 2 < planned(&plain_spec), "the preset's probabilities are most of its activations");
        // Probabilities kept after all, none recomputed, or a whole forward run again: disagrees.
        assert!(planned_share < 0.8, "{planned_share}");
        assert!(!check(&ranks(planned(&plain_spec), on_time)).agrees);
        assert!(!check(&ranks(planned(&spec), 0)).agrees);
        assert!(!check(&ranks(planned(&spec), 1000)).agrees);
        // Slower than its FLOPs (exponentials dearer than a FLOP) agrees; under them does not.
        let slow = ((planned_share + 1.0) / 2.0 * 1000.0) as u64 - 10;
        assert!(check(&ranks(planned(&spec), slow)).agrees);
        assert!(!check(&ranks(planned(&spec), on_time - 120)).agrees);
        assert!(measure(ClaimCheck::SelectiveRecompute, &run(&with, &ranks(planned(&spec), on_time)), None).is_err());
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
        let (with, without) = (succeeded_view(1, spec.clone(), None), succeeded_view(2, plain_spec.clone(), None));
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
