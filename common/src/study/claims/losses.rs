//! Claims read from the losses: data parallelism trains like one rank, fp16 needs loss
//! scaling where bf16 does not, LAMB holds a large batch's large steps where AdamW does not.

use super::{Inputs, Measurement, RunEvidence};
use crate::analysis::compare;

/// Data-parallel training's losses against a one-rank run of the same global batch (the partner): equal.
pub(super) fn ddp_equals_one_rank(input: &Inputs) -> Result<Measurement, String> {
    let run = input.run;
    let partner = input.partner;
    let spec = input.spec;
    let id = input.run.view.id;
    let one = partner.ok_or("no finished one-rank run with the same global batch yet")?;
    let verdict = compare::equivalence((one.view.id, &one.view.spec, one.metrics), (id, spec, run.metrics));
    let rel = verdict.max_rel_diff.map_or("–".to_string(), |r| format!("{r:.1e}"));
    Ok(input.m(
        format!("equal losses within {:.0e} relative per step", verdict.tolerance),
        format!("max relative difference {rel} over {} steps (one rank: run {})", verdict.common_steps, one.view.id),
        verdict.equivalent,
    ))
}

/// fp16 without loss scaling against with it (the partner): the logit gradients stored as 0, and how far the loss fell.
pub(super) fn loss_scaling_underflow(input: &Inputs) -> Result<Measurement, String> {
    let run = input.run;
    let partner = input.partner;
    let scaled = partner.ok_or("no finished run of the same config with dynamic loss scaling yet")?;
    let (plain, with) = (descent(run)?, descent(scaled)?);
    let (plain_zeros, scaled_zeros) = (zero_share(run)?, zero_share(scaled)?);
    let overflowed = scaled.metrics.iter().filter_map(|p| p.skipped_steps).max().unwrap_or(0);
    Ok(input.m(
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

/// bf16 without loss scaling against fp32 (the partner): the loss falls as far.
pub(super) fn bf16_no_scaling(input: &Inputs) -> Result<Measurement, String> {
    let run = input.run;
    let partner = input.partner;
    let fp32 =
        partner.ok_or("no finished run of the same config in fp32 yet (resubmit the preset with precision fp32)")?;
    let (bf16, full) = (descent(run)?, descent(fp32)?);
    Ok(input.m(
        format!("without scaling bf16 falls as far as fp32 (within {:.0}%)", 100.0 * (1.0 - ALONGSIDE)),
        format!("{:.0}%: down {bf16:.4} in bf16, {full:.4} in fp32 (run {})", 100.0 * bf16 / full, fp32.view.id),
        full > 0.0 && bf16 >= ALONGSIDE * full,
    ))
}

/// FP8 with delayed scaling (this run) against the same training in its storage format
/// (the partner): the first step casts at scale 1 and over a fifth of the gradients
/// underflow; from the
/// third step on none does (fewer than 1 in 1000) and nothing saturates in the last step;
/// the loss falls as far as without FP8 (within 5%).
pub(super) fn fp8_delayed_scaling(input: &Inputs) -> Result<Measurement, String> {
    let run = input.run;
    let plain =
        input.partner.ok_or("no finished run of the same config with fp8 none yet (resubmit the preset with it)")?;
    let casts: Vec<_> = run.metrics.iter().filter_map(|p| p.fp8.map(|f| (p.step, f))).collect();
    let (Some((_, first)), Some((_, last))) = (casts.first(), casts.last()) else {
        return Err(format!("run {} recorded no FP8 casts", run.view.id));
    };
    let share = |c: &crate::events::Fp8Casts| c.flushed as f64 / c.elements.max(1) as f64;
    let later = casts.iter().filter(|(step, _)| *step >= 2).map(|(_, f)| share(&f.grads)).fold(0.0, f64::max);
    let saturated = last.inputs.saturated + last.weights.saturated + last.grads.saturated;
    let (ours, theirs) = (descent(run)?, descent(plain)?);
    Ok(input.m(
        "with delayed scaling over a fifth of the first step's gradients underflow E5M2 at scale 1; from the \
         third step on fewer than 1 in 1000 do and the last step saturates nothing; the loss falls as far as without FP8 \
         (within 5%)"
            .to_string(),
        format!(
            "step 0: {:.0}% of the gradients stored as 0 (scale 2^{:.0}); steps 2 on: at most {:.3}% (last step's \
             gradient scales 2^{:.0} to 2^{:.0}); {saturated} saturated in the last step; the loss fell {:.0}% as \
             far: down {ours:.4} with FP8, {theirs:.4} without (run {})",
            100.0 * share(&first.grads),
            first.grads.max_scale.log2(),
            100.0 * later,
            last.grads.min_scale.log2(),
            last.grads.max_scale.log2(),
            100.0 * ours / theirs,
            plain.view.id
        ),
        share(&first.grads) > 0.2 && later < 1e-3 && saturated == 0 && theirs > 0.0 && (ours / theirs - 1.0).abs() <= 0.05,
    ))
}

/// Without loss scaling fp16 must fall less than this share of the scaled run's descent.
const SLOWER: f64 = 0.9;
/// "Most" logit gradients: more than this share stored as 0.
const MOST: f64 = 0.5;
/// bf16 must fall at least this share of fp32's descent.
const ALONGSIDE: f64 = 0.95;

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

/// How far a run's loss fell: its first step's loss minus its last (the summary's final).
/// LAMB (this run) against AdamW (the partner) at the same large batch and learning rate:
/// AdamW's loss climbs above its first step's before it falls, LAMB's never does, and LAMB
/// ends lower.
pub(super) fn lamb_large_batch(input: &Inputs) -> Result<Measurement, String> {
    let adamw = input
        .partner
        .ok_or("no finished run of the same config with optimizer adamw yet (resubmit the preset with it)")?;
    // (the first step's loss, the highest after it, the last)
    let read = |r: &RunEvidence| -> Result<(f64, f64, f64), String> {
        let first = r.metrics.first().map(|p| p.loss).ok_or("the run has no loss")?;
        let highest = r.metrics.iter().skip(1).map(|p| p.loss).fold(f64::NEG_INFINITY, f64::max);
        let last = final_loss(r)?;
        if !(first.is_finite() && highest.is_finite() && last.is_finite()) {
            return Err(format!("run {} has a loss that is not finite", r.view.id));
        }
        Ok((first, highest, last))
    };
    let ((first, highest, last), (a_first, a_highest, a_last)) = (read(input.run)?, read(adamw)?);
    let lr = input.spec.train.lr;
    Ok(input.m(
        format!(
            "at lr {lr} AdamW's loss climbs above where it started before it falls, LAMB's never does \
             (each tensor moves by about lr x its norm), and LAMB's last loss is lower"
        ),
        format!(
            "LAMB: {first:.4} at step 0, at most {highest:.4} after, {last:.4} at the end; AdamW (run {}): \
             {a_first:.4}, at most {a_highest:.4}, {a_last:.4}",
            adamw.view.id
        ),
        input.spec.train.optimizer == crate::Optimizer::Lamb
            && adamw.view.spec.train.optimizer == crate::Optimizer::Adamw
            && highest <= first
            && a_highest > a_first
            && last < a_last,
    ))
}

fn descent(run: &RunEvidence) -> Result<f64, String> {
    let first = run.metrics.first().map(|p| p.loss).ok_or("the run has no loss")?;
    let last = final_loss(run)?;
    if !(first.is_finite() && last.is_finite()) {
        return Err(format!("run {} has a loss that is not finite", run.view.id));
    }
    Ok(first - last)
}

fn final_loss(run: &RunEvidence) -> Result<f64, String> {
    run.view
        .summary
        .as_ref()
        .map(|s| s.final_loss)
        .or(run.metrics.last().map(|p| p.loss))
        .ok_or_else(|| "the run has no loss".into())
}

#[cfg(test)]
mod tests {
    use crate::spec::presets::presets;
    use crate::study::cards::ClaimCheck;
    use crate::study::claims::test_runs::{losses, succeeded_view};
    use crate::study::claims::{is_partner, measure, RunEvidence};
    use crate::wire::events::MetricPoint;

    #[test]
    fn mixed_precision_claims_compare_how_far_the_loss_fell_with_a_measured_partner() {
        let find = |key: &str| presets().into_iter().find(|p| p.key == key).map(|p| p.spec).unwrap_or_default();
        let (plain, scaled, bf16) = (
            succeeded_view(1, find("fp16-plain"), None),
            succeeded_view(2, find("fp16-scaled"), None),
            succeeded_view(3, find("bf16"), None),
        );
        let mut fp32_spec = find("bf16");
        fp32_spec.train.precision = crate::Precision::Fp32;
        assert_eq!(is_partner(ClaimCheck::Bf16NoScaling, &bf16.spec, &fp32_spec), Some(true));
        let fp32 = succeeded_view(4, fp32_spec, None);
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

    /// LAMB against AdamW on the lamb-large-batch preset (measured: LAMB 4.166, never
    /// above it, 1.483 at the end; AdamW 4.166, up to 4.785, 1.594). A LAMB run that climbs
    /// too (its trust ratio ignored: AdamW's step), or that ends higher, does not agree.
    #[test]
    fn the_lamb_claim_wants_adamw_to_climb_lamb_not_and_lamb_lower() {
        let lamb_spec = presets().into_iter().find(|p| p.key == "lamb-large-batch").unwrap().spec;
        let mut adamw_spec = lamb_spec.clone();
        adamw_spec.train.optimizer = crate::Optimizer::Adamw;
        assert_eq!(is_partner(ClaimCheck::LambLargeBatch, &lamb_spec, &adamw_spec), Some(true));
        assert_eq!(is_partner(ClaimCheck::LambLargeBatch, &lamb_spec, &lamb_spec), Some(false));
        let (lamb, adamw) = (succeeded_view(1, lamb_spec, None), succeeded_view(2, adamw_spec, None));
        let path = |points: &[f64]| {
            points
                .iter()
                .enumerate()
                .map(|(i, &loss)| MetricPoint { step: i as u64, loss, ..MetricPoint::default() })
                .collect::<Vec<_>>()
        };
        let climbing = path(&[4.166, 4.785, 3.0, 1.594]);
        let adamw_run = RunEvidence { view: &adamw, metrics: &climbing, ranks: &[], traced_steps: 1 };
        let verdict = |l: &[MetricPoint]| {
            let lamb_run = RunEvidence { view: &lamb, metrics: l, ranks: &[], traced_steps: 1 };
            measure(ClaimCheck::LambLargeBatch, &lamb_run, Some(&adamw_run))
        };
        assert!(verdict(&path(&[4.166, 4.1, 2.0, 1.483])).unwrap().agrees);
        assert!(!verdict(&path(&[4.166, 4.785, 3.0, 1.483])).unwrap().agrees, "LAMB climbing too");
        assert!(!verdict(&path(&[4.166, 4.1, 2.0, 1.7])).unwrap().agrees, "LAMB ending higher");
        let alone = RunEvidence { view: &lamb, metrics: &climbing, ranks: &[], traced_steps: 1 };
        assert!(measure(ClaimCheck::LambLargeBatch, &alone, None).unwrap_err().contains("adamw"));
    }
}
