//! Claims about what data parallelism sends per step: compressed gradients against the
//! all-reduce, and one all-reduce per step however many micro-batches it accumulates.

use super::{bytes_text, op_counters, Measurement, RunEvidence, SCALAR_BYTES};
use crate::plan::planner;
use crate::wire::trace::CollectiveOp;
use crate::GradCompression;

/// The data-parallel collectives on rank 0, per step: (bytes sent, calls).
fn dp_sent(run: &RunEvidence) -> Result<(u64, u64), String> {
    let rank =
        run.ranks.iter().find(|r| r.rank == 0).ok_or_else(|| format!("run {} recorded no trace", run.view.id))?;
    let ops = [CollectiveOp::AllReduce, CollectiveOp::ReduceScatter, CollectiveOp::AllGather];
    let counters: Vec<_> = ops.into_iter().flat_map(|op| op_counters(rank, op)).collect();
    let steps = run.traced_steps.max(1);
    Ok((
        counters.iter().map(|c| c.bytes_sent).sum::<u64>() / steps,
        counters.iter().map(|c| c.calls).sum::<u64>() / steps,
    ))
}

fn planned_comm(spec: &crate::ExperimentSpec) -> Result<planner::CommVolume, String> {
    let plan = planner::plan(spec).map_err(|_| "the planner cannot plan the run's spec".to_string())?;
    Ok(plan.stages[spec.stage_of(0)].comm.clone())
}

/// Compressed gradients: the bytes rank 0 sends per step, against the planner's count of
/// the method's messages and against the all-reduce of the same gradients uncompressed.
/// The chapter puts compression at 10-100x.
pub(super) fn compressed(run: &RunEvidence) -> Result<Measurement, String> {
    let spec = &run.view.spec;
    let method = spec.parallel.grad_compression;
    if method == GradCompression::None || spec.parallel.dp < 2 {
        return Err("the run compresses nothing: run the topk preset".into());
    }
    let (sent, _) = dp_sent(run)?;
    let planned = planned_comm(spec)?.dp_compressed;
    let mut whole = spec.clone();
    whole.parallel.grad_compression = GradCompression::None;
    let all_reduce = planned_comm(&whole)?.dp_all_reduce;
    let ratio = all_reduce as f64 / sent.max(1) as f64;
    Ok(Measurement {
        experiment_id: run.view.id,
        predicted: format!(
            "{} per rank and step with {} (planner), against {} for the uncompressed all-reduce: {:.0}x less; the \
             chapter: 10-100x",
            bytes_text(planned),
            method.as_str(),
            bytes_text(all_reduce),
            all_reduce as f64 / planned.max(1) as f64
        ),
        measured: format!("{} on rank 0: {ratio:.1}x less than the all-reduce", bytes_text(sent)),
        agrees: (planned..=planned + SCALAR_BYTES).contains(&sent) && (10.0..=100.0).contains(&ratio),
        note: None,
    })
}

/// Accumulation: the gradients are all-reduced once per step, after the last
/// micro-batch, so a run accumulating K micro-batches sends what one without sends, for
/// K times the tokens.
pub(super) fn accumulation(run: &RunEvidence, partner: Option<&RunEvidence>) -> Result<Measurement, String> {
    let accumulating = partner.ok_or(
        "no finished run of the same config with more grad_accum steps yet (resubmit the preset with grad_accum 4)",
    )?;
    let (spec, other) = (&run.view.spec, &accumulating.view.spec);
    let k = other.train.grad_accum;
    let ((bytes, calls), (bytes_k, calls_k)) = (dp_sent(run)?, dp_sent(accumulating)?);
    let planned = planned_comm(spec)?.dp_all_reduce;
    let within = |got: u64| (planned..=planned + SCALAR_BYTES).contains(&got);
    Ok(Measurement {
        experiment_id: run.view.id,
        predicted: format!(
            "{} per rank and step at grad_accum {} and at {k} (planner): one all-reduce of the gradients per step, \
             {:.1} times the tokens per step",
            bytes_text(planned),
            spec.train.grad_accum,
            k as f64 / spec.train.grad_accum.max(1) as f64
        ),
        measured: format!(
            "{} in {calls} all-reduce call(s) here, {} in {calls_k} at grad_accum {k} (run {}): {:.2}x",
            bytes_text(bytes),
            bytes_text(bytes_k),
            accumulating.view.id,
            bytes_k as f64 / bytes.max(1) as f64
        ),
        agrees: k > spec.train.grad_accum && within(bytes) && within(bytes_k) && calls == calls_k,
        note: None,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::spec::presets::presets;
    use crate::wire::trace::{CollectiveCounter, RankCommTrace, RankTrace};
    use crate::{ExperimentSpec, ExperimentView};

    fn preset(key: &str) -> ExperimentSpec {
        presets().into_iter().find(|p| p.key == key).map(|p| p.spec).unwrap()
    }

    fn view(id: i64, spec: ExperimentSpec) -> ExperimentView {
        super::super::test_runs::succeeded_view(id, spec, None)
    }

    /// Rank 0 sending `bytes` in `calls` calls of `op` per step, over two steps.
    fn rank0(op: CollectiveOp, calls: u64, bytes: u64) -> Vec<RankTrace> {
        let counter = CollectiveCounter {
            op,
            calls: 2 * calls,
            elements: 0,
            bytes_sent: 2 * bytes,
            bytes_from_formula: false,
            total_us: 0,
        };
        vec![RankTrace { comm: RankCommTrace { counters: vec![counter], ..Default::default() }, ..Default::default() }]
    }

    fn evidence<'a>(v: &'a ExperimentView, ranks: &'a [RankTrace]) -> RunEvidence<'a> {
        RunEvidence { view: v, metrics: &[], ranks, traced_steps: 2 }
    }

    #[test]
    fn compression_is_held_to_the_planner_and_the_chapters_range() {
        let spec = preset("topk");
        let planned = planned_comm(&spec).unwrap().dp_compressed;
        let v = view(1, spec.clone());
        let got = compressed(&evidence(&v, &rank0(CollectiveOp::AllGather, 30, planned + 8))).unwrap();
        assert!(got.agrees, "{got:?}");
        // An engine that all-reduces the whole gradient anyway disagrees.
        let whole = planned_comm(&preset("ddp2")).unwrap().dp_all_reduce;
        let got = compressed(&evidence(&v, &rank0(CollectiveOp::AllReduce, 3, whole))).unwrap();
        assert!(!got.agrees && got.measured.ends_with("1.0x less than the all-reduce"), "{got:?}");
        let plain = view(2, preset("ddp2"));
        assert!(compressed(&evidence(&plain, &[])).unwrap_err().contains("topk preset"));
    }

    #[test]
    fn accumulation_all_reduces_once_per_step() {
        let spec = preset("ddp2");
        let mut four = spec.clone();
        four.train.grad_accum = 4;
        assert_eq!(
            super::super::is_partner(crate::study::cards::ClaimCheck::AccumulationAllreduces, &spec, &four),
            Some(true)
        );
        let planned = planned_comm(&spec).unwrap().dp_all_reduce;
        let (v, v4) = (view(1, spec), view(2, four));
        let once = rank0(CollectiveOp::AllReduce, 3, planned + 8);
        let got = accumulation(&evidence(&v, &once), Some(&evidence(&v4, &once))).unwrap();
        assert!(got.agrees && got.measured.ends_with("1.00x"), "{got:?}");
        // An engine that all-reduces after every micro-batch sends four times as much.
        let every = rank0(CollectiveOp::AllReduce, 12, 4 * planned + 8);
        let got = accumulation(&evidence(&v, &once), Some(&evidence(&v4, &every))).unwrap();
        assert!(!got.agrees, "{got:?}");
        assert!(accumulation(&evidence(&v, &once), None).is_err());
    }
}
