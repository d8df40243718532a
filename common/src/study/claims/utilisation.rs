//! The claim on model FLOP utilisation: the MFU a run reports is its model FLOPs per second
//! (the planner's count per token x its tokens per second) over its devices' peak, and
//! the same number comes back when recomputed from the run's own step times.

use super::{Inputs, Measurement};

/// How far the reported MFU may be from the one recomputed here (relative).
const TOLERANCE: f64 = 0.01;

/// The run's MFU against (planner FLOPs per token) x (tokens / time of its steps) / peak.
pub(super) fn model_flop_utilisation(input: &Inputs) -> Result<Measurement, String> {
    let summary = input.run.view.summary.as_ref().ok_or("the run has no summary")?;
    let peak = summary.peak.as_ref().ok_or("the worker that ran it knows no peak for its device")?;
    let reported = summary.mfu.ok_or("the run reports no MFU")?;
    // The steps' own times, leaving out the first (warm-up) when there are more, as the
    // summary's tokens/s does.
    let mut steps: Vec<_> = input.run.metrics.iter().filter(|p| p.step_ms > 0.0).collect();
    steps.sort_by_key(|p| p.step);
    if steps.len() > 1 {
        steps.remove(0);
    }
    let seconds: f64 = steps.iter().map(|p| p.step_ms / 1e3).sum();
    if seconds <= 0.0 {
        return Err("the run recorded no step times".into());
    }
    let flops = &input.plan.flops;
    let per_token = flops.total / flops.tokens_per_step.max(1) as f64;
    let tokens_per_s = steps.len() as f64 * input.spec.tokens_per_step() as f64 / seconds;
    let recomputed = per_token * tokens_per_s / peak.flops_per_s;
    let agrees = (reported - recomputed).abs() <= TOLERANCE * recomputed;
    Ok(Measurement {
        note: Some(format!("Peak: {:.3e} FLOP/s, the {}.", peak.flops_per_s, peak.basis)),
        ..input.m(
            format!(
                "{per_token:.3e} FLOPs/token x {tokens_per_s:.0} tokens/s (its {} timed steps) / peak = {:.2}%",
                steps.len(),
                recomputed * 100.0
            ),
            format!("{:.2}% (the run's summary)", reported * 100.0),
            agrees,
        )
    })
}

#[cfg(test)]
mod tests {
    use super::super::test_runs::succeeded_view;
    use super::super::{measure, RunEvidence};
    use crate::study::cards::ClaimCheck;
    use crate::wire::events::{DevicePeak, MetricPoint};
    use crate::{presets::presets, RunSummary};

    #[test]
    fn the_reported_mfu_is_checked_against_the_step_times() {
        let spec = presets().into_iter().find(|p| p.key == "reference").map(|p| p.spec).unwrap();
        let tokens = spec.tokens_per_step() as f64;
        // Four steps: the first (warm-up) slow, then 100 ms each.
        let metrics: Vec<MetricPoint> = [400.0, 100.0, 100.0, 100.0]
            .iter()
            .enumerate()
            .map(|(i, &ms)| MetricPoint { step: i as u64, step_ms: ms, ..MetricPoint::default() })
            .collect();
        let peak = DevicePeak { flops_per_s: 1e11, basis: "made up".into() };
        let good = RunSummary { tokens_per_s: tokens / 0.1, ..RunSummary::default() }
            .with_utilisation(spec.model.train_flops_per_token(), Some(peak.clone()));
        let check = |summary: RunSummary| {
            let view = succeeded_view(1, spec.clone(), Some(summary));
            let run = RunEvidence { view: &view, metrics: &metrics, ranks: &[], traced_steps: 4 };
            measure(ClaimCheck::ModelFlopUtilisation, &run, None)
        };
        let m = check(good.clone()).unwrap();
        assert!(m.agrees, "{m:?}");
        let expected = spec.model.train_flops_per_token() * tokens / 0.1 / 1e11;
        assert!((good.mfu.unwrap() - expected).abs() < 1e-12);
        // Counting only 6N (no attention), or the warm-up step, is caught.
        let six_n = RunSummary { tokens_per_s: tokens / 0.1, ..RunSummary::default() }
            .with_utilisation(6.0 * spec.model.active_param_count() as f64, Some(peak.clone()));
        assert!(!check(six_n).unwrap().agrees);
        let with_warm_up = RunSummary { tokens_per_s: 4.0 * tokens / 0.7, ..RunSummary::default() }
            .with_utilisation(spec.model.train_flops_per_token(), Some(peak));
        assert!(!check(with_warm_up).unwrap().agrees);
        // No peak: no claim to check, said so.
        let unknown = RunSummary { tokens_per_s: 1.0, ..RunSummary::default() }.with_utilisation(1.0, None);
        assert!(check(unknown).unwrap_err().contains("peak"));
    }
}
