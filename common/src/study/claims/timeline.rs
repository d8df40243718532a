//! Claims read from the timeline of a run's passes: the pipeline bubble (the step replayed
//! with a core per stage), ZBV's against ZB-H1's, DualPipeV's against ZBV's, and the time
//! activation checkpointing's recompute takes.

use super::memory::stage_activation_peaks;
use super::{checkpointing_name, ms, Inputs, Measurement, RunEvidence};
use crate::analysis::pipeline::{
    default_step, measured_bubble, recorded_steps, replay_with_a_core_per_stage, stage_rows,
};
use crate::plan::planner;
use crate::plan::schedule::Pipeline;
use crate::PpSchedule;

/// The pipeline bubble replayed from the stages' measured passes with a core per stage, against the schedule's formula.
pub(super) fn bubble_fraction(input: &Inputs) -> Result<Measurement, String> {
    let run = input.run;
    let spec = input.spec;
    let steps = recorded_steps(run.ranks);
    let step = default_step(&steps).ok_or("the run recorded no timeline")?;
    let rows = stage_rows(run.ranks, step);
    let bubble = measured_bubble(&rows).ok_or("the timeline has no forward or backward")?;
    // The passes replayed with a core per stage, as the formulas assume.
    let (durations, projected) = replay_with_a_core_per_stage(spec, run.ranks, step)
        .ok_or("the timeline has a stage without a forward or a backward")?;
    let pipe = Pipeline::of(spec);
    let passes = durations
        .iter()
        .map(|d| format!("{}+{}", ms(d.forward), ms(d.backward + d.weights)))
        .collect::<Vec<_>>()
        .join(", ");
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
        ..input.m(
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

/// ZBV's step replayed with a core per stage against the same model's under ZB-H1 (the
/// partner), and each stage's activation peak in both runs against the planner's.
pub(super) fn zbv_bubble(input: &Inputs) -> Result<Measurement, String> {
    let zb_h1 = input
        .partner
        .ok_or("no finished run of the same config with pp_schedule zb-h1 yet (resubmit the preset with zb-h1)")?;
    let ((ours, ours_peaks, ours_planned), (theirs, theirs_peaks, theirs_planned)) =
        (replayed_bubble_and_peaks(input.run)?, replayed_bubble_and_peaks(zb_h1)?);
    let (v, h) = (Pipeline::of(input.spec), Pipeline::of(&zb_h1.view.spec));
    Ok(input.m(
        format!(
            "with F = B = W, {} = {:.1}% against ZB-H1's {:.1}%; activation peaks per stage {} KiB (ZB-H1: {} KiB)",
            v.formula_name(),
            100.0 * v.formula_bubble(),
            100.0 * h.formula_bubble(),
            kib(&ours_planned),
            kib(&theirs_planned)
        ),
        format!(
            "replayed with a core per stage from the runs' own passes: {:.1}% against {:.1}% (run {}); peaks {} KiB \
             and {} KiB",
            100.0 * ours,
            100.0 * theirs,
            zb_h1.view.id,
            kib(&ours_peaks),
            kib(&theirs_peaks)
        ),
        input.spec.parallel.pp_schedule == PpSchedule::Zbv
            && zb_h1.view.spec.parallel.pp_schedule == PpSchedule::ZbH1
            && ours < theirs
            && ours_peaks == ours_planned
            && theirs_peaks == theirs_planned,
    ))
}

/// DualPipeV's step replayed with a core per stage against the same V's under ZBV (the
/// partner): it idles less than 1F1B's formula says; every stage holds one chunk's
/// activations more than under ZBV but fewer backwards' outputs waiting for their W, and
/// its highest stage holds less than ZBV's (whose last stage ends on a row of Bs); every
/// peak the planner's.
pub(super) fn dualpipev_against_zbv(input: &Inputs) -> Result<Measurement, String> {
    let zbv = input
        .partner
        .ok_or("no finished run of the same config with pp_schedule zbv yet (resubmit the preset with zbv)")?;
    let ((ours, ours_peaks, ours_planned), (theirs, theirs_peaks, theirs_planned)) =
        (replayed_bubble_and_peaks(input.run)?, replayed_bubble_and_peaks(zbv)?);
    let (d, v) = (Pipeline::of(input.spec), Pipeline::of(&zbv.view.spec));
    let one_f_one_b = Pipeline { kind: PpSchedule::OneFOneB, chunks: 1, ..d }.formula_bubble();
    Ok(input.m(
        format!(
            "DeepSeek's {} = {:.1}%, counting a pair as one block; ZBV's {:.1}%; 1F1B's {:.1}%. Every stage holds \
             2P+1 chunk activations against ZBV's 2P, and at most s+1 Bs waiting for their W against ZBV's up \
             to 2P-1 on its last stage: planned peaks {} KiB (ZBV: {} KiB)",
            d.formula_name(),
            100.0 * d.formula_bubble(),
            100.0 * v.formula_bubble(),
            100.0 * one_f_one_b,
            kib(&ours_planned),
            kib(&theirs_planned)
        ),
        format!(
            "replayed with a core per stage from the runs' own passes: {:.1}% against ZBV's {:.1}% (run {}); \
             peaks {} KiB and {} KiB",
            100.0 * ours,
            100.0 * theirs,
            zbv.view.id,
            kib(&ours_peaks),
            kib(&theirs_peaks)
        ),
        input.spec.parallel.pp_schedule == PpSchedule::DualPipeV
            && zbv.view.spec.parallel.pp_schedule == PpSchedule::Zbv
            && ours < one_f_one_b
            && ours_peaks == ours_planned
            && theirs_peaks == theirs_planned
            && ours_planned.iter().max() < theirs_planned.iter().max(),
    ))
}

/// A pipelined run's step replayed with a core per stage, and each stage's activation peak
/// measured and planned.
fn replayed_bubble_and_peaks(r: &RunEvidence) -> Result<(f64, Vec<u64>, Vec<u64>), String> {
    let spec = &r.view.spec;
    let step =
        default_step(&recorded_steps(r.ranks)).ok_or_else(|| format!("run {} recorded no timeline", r.view.id))?;
    let (_, replayed) = replay_with_a_core_per_stage(spec, r.ranks, step)
        .ok_or_else(|| format!("run {}'s timeline has a stage without a forward or a backward", r.view.id))?;
    let plan = planner::plan(spec).map_err(|_| format!("the planner cannot plan run {}", r.view.id))?;
    let planned = plan.stages.iter().map(|s| s.memory.activations).collect();
    Ok((replayed.overall, stage_activation_peaks(r)?, planned))
}

/// Bytes as KiB, listed.
fn kib(v: &[u64]) -> String {
    v.iter().map(|b| format!("{}", b / 1024)).collect::<Vec<_>>().join(", ")
}

/// Rank 0's time recomputing forwards against its forward and backward, set against the planner's FLOPs.
pub(super) fn checkpointing_recompute_time(input: &Inputs) -> Result<Measurement, String> {
    let spec = input.spec;
    let traced_steps = input.traced_steps;
    let RecomputeShare { recompute, forward, backward, rise, planned } = recompute_share(input)?;
    Ok(Measurement {
        note: Some(
            "The texts price checkpointing three ways: about a third more compute (one more forward, the \
             backward costing two: the deck, the quiz), 20 to 40% more time (the notes, the quiz's \
             30-40%), and twice the forward's compute (the chapter). All three describe the same extra \
             forward: measured against the step, against the time, or against the forward alone."
                .into(),
        ),
        ..input.m(
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
            spec.train.checkpointing.recomputes_blocks() && recompute > 0 && (rise - planned).abs() <= 0.12,
        )
    })
}

/// Rank 0's traced time recomputing (checkpointing's forwards, or selective recompute's
/// attention probabilities) next to its forward and backward, in µs, and as a share of the
/// two (`rise`), with the planner's recompute FLOPs as a share of the rest (`planned`).
pub(super) struct RecomputeShare {
    pub(super) recompute: u64,
    pub(super) forward: u64,
    pub(super) backward: u64,
    pub(super) rise: f64,
    pub(super) planned: f64,
}

pub(super) fn recompute_share(input: &Inputs) -> Result<RecomputeShare, String> {
    let plan = &input.plan;
    // Rank 0's traced steps: whole forward passes, the recomputes and the units' backwards
    // are spans of their own, end to end on the compute lane.
    let rank = input.rank0.ok_or("the run recorded no trace")?;
    let total = |keep: &dyn Fn(&crate::wire::trace::Span) -> bool| -> u64 {
        rank.spans
            .iter()
            .filter(|s| s.lane == crate::wire::trace::lane::COMPUTE && keep(s))
            .map(|s| s.duration_us())
            .sum()
    };
    let recompute = total(&|s| s.is_recompute());
    let forward = total(&|s| s.kind == crate::wire::trace::SpanKind::Forward && !s.is_recompute());
    let backward =
        total(&|s| matches!(s.kind, crate::wire::trace::SpanKind::Backward | crate::wire::trace::SpanKind::Weights));
    if forward == 0 || backward == 0 {
        return Err("the run recorded no forward or backward spans (a pipelined run times whole passes only)".into());
    }
    Ok(RecomputeShare {
        recompute,
        forward,
        backward,
        rise: recompute as f64 / (forward + backward) as f64,
        planned: plan.flops.recompute / (plan.flops.total - plan.flops.recompute).max(1.0),
    })
}

#[cfg(test)]
mod tests {
    use crate::analysis::pipeline::project;
    use crate::plan::planner;
    use crate::plan::schedule::Pipeline;
    use crate::spec::presets::presets;
    use crate::study::cards::ClaimCheck;
    use crate::study::claims::test_runs::succeeded_view;
    use crate::study::claims::{measure, RunEvidence};
    use crate::wire::trace::RankTrace;

    #[test]
    fn the_bubble_is_replayed_from_the_stages_passes_and_set_against_both_formulas() {
        use crate::analysis::pipeline::StageDurations;
        let spec = presets().into_iter().find(|p| p.key == "pipeline").map(|p| p.spec).unwrap_or_default();
        let v = succeeded_view(1, spec.clone(), None);
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
        use crate::wire::trace::SpanKind;
        let spec = presets().into_iter().find(|p| p.key == "checkpointing").map(|p| p.spec).unwrap_or_default();
        let flops = planner::plan(&spec).unwrap().flops;
        let planned = flops.recompute / (flops.total - flops.recompute);
        let v = succeeded_view(1, spec.clone(), None);
        let span = crate::study::claims::test_runs::compute_span;
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
}
