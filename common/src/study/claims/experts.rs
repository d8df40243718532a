//! The Mixture-of-Experts capacity claim: each expert takes at most
//! C = ceil(capacity_factor x tokens x k / E) of a micro-batch's assignments and drops
//! the rest; with capacity_factor = E/k, C is the whole micro-batch and nothing is dropped.

use super::{Measurement, RunEvidence};

/// The run's (assignments, dropped) over every step.
fn routed(run: &RunEvidence) -> Result<(u64, u64), String> {
    let steps: Vec<_> = run.metrics.iter().filter_map(|p| p.experts).collect();
    if steps.is_empty() {
        return Err(format!("run {} recorded no routing", run.view.id));
    }
    Ok((steps.iter().map(|e| e.assignments).sum(), steps.iter().map(|e| e.dropped).sum()))
}

pub(super) fn capacity(run: &RunEvidence, partner: Option<&RunEvidence>) -> Result<Measurement, String> {
    let model = &run.view.spec.model;
    if !model.is_moe() {
        return Err("the run has no experts: run the experts preset".into());
    }
    let (e, k) = (model.experts, model.expert_top_k);
    let roomy = partner.ok_or_else(|| {
        format!(
            "no finished run of the same config with capacity_factor E/k = {} yet (resubmit the preset with it)",
            e as f64 / k as f64
        )
    })?;
    let tokens = run.view.spec.train.micro_batch * model.seq_len;
    let ((assigned, dropped), (roomy_assigned, roomy_dropped)) = (routed(run)?, routed(roomy)?);
    let roomy_factor = roomy.view.spec.model.capacity_factor;
    Ok(Measurement {
        experiment_id: run.view.id,
        predicted: format!(
            "C = ceil({} x {tokens} tokens x {k} / {e}) = {} assignments per expert and micro-batch, the rest \
             dropped; with capacity_factor E/k = {} (C = {}) none dropped",
            model.capacity_factor,
            model.expert_capacity(tokens),
            e as f64 / k as f64,
            roomy.view.spec.model.expert_capacity(tokens)
        ),
        measured: format!(
            "{dropped} of {assigned} assignments dropped ({:.1}%); {roomy_dropped} of {roomy_assigned} with \
             capacity_factor {roomy_factor} (run {})",
            100.0 * dropped as f64 / assigned.max(1) as f64,
            roomy.view.id
        ),
        agrees: dropped > 0 && roomy_dropped == 0 && roomy_factor * k as f64 >= e as f64,
        note: None,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::spec::presets::presets;
    use crate::wire::events::{ExpertMetrics, MetricPoint};
    use crate::{ExperimentSpec, ExperimentView};

    fn view(id: i64, spec: ExperimentSpec) -> ExperimentView {
        super::super::test_runs::succeeded_view(id, spec, None)
    }

    fn routing(dropped: u64) -> Vec<MetricPoint> {
        let experts = Some(ExpertMetrics { balance: 1.0, assignments: 1024, dropped });
        (0..3).map(|step| MetricPoint { step, experts, ..MetricPoint::default() }).collect()
    }

    #[test]
    fn drops_are_counted_and_vanish_when_every_expert_has_room() {
        let spec = presets().into_iter().find(|p| p.key == "experts").map(|p| p.spec).unwrap();
        let mut roomy = spec.clone();
        roomy.model.capacity_factor = 2.0;
        assert_eq!(
            super::super::is_partner(crate::study::cards::ClaimCheck::ExpertCapacity, &spec, &roomy),
            Some(true)
        );
        let (v, v_roomy) = (view(1, spec), view(2, roomy));
        let (some, none) = (routing(20), routing(0));
        let run = |v, m| RunEvidence { view: v, metrics: m, ranks: &[], traced_steps: 3 };
        let got = capacity(&run(&v, &some), Some(&run(&v_roomy, &none))).unwrap();
        assert!(got.agrees && got.predicted.starts_with("C = ceil(1.25 x 128 tokens x 2 / 4) = 80"), "{got:?}");
        // No capacity at all (nothing dropped) disagrees; so do drops with room for every token.
        assert!(!capacity(&run(&v, &none), Some(&run(&v_roomy, &none))).unwrap().agrees);
        assert!(!capacity(&run(&v, &some), Some(&run(&v_roomy, &some))).unwrap().agrees);
    }
}
