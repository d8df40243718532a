//! 2-byte communication (`parallel.comm_dtype`): a bf16 or fp16 run's data-parallel
//! collectives carry its own 2-byte format. The bytes every rank sends per step are half
//! of fp32's, as the planner says, on every strategy, and the training stays within the
//! format's rounding of the same run with an fp32 wire.

use distlab_common::planner::plan;
use distlab_common::trace::CollectiveOp;
use distlab_common::*;
use distlab_tests::*;

fn spec(name: &str, dp: usize, precision: Precision, sharding: Sharding, comm_dtype: Precision) -> ExperimentSpec {
    let mut spec = quick_spec(name, 8);
    spec.train.precision = precision;
    if precision == Precision::Fp16 {
        spec.train.loss_scaling = LossScaling::Dynamic;
    }
    spec.train.micro_batch = 2;
    (spec.parallel.dp, spec.parallel.sharding, spec.parallel.comm_dtype) = (dp, sharding, comm_dtype);
    spec
}

/// For DDP, ZeRO-1, ZeRO-2 and FSDP in bf16 and fp16, on 2 and 4 ranks: bytes per
/// collective kind are the planner's and half of the fp32 wire's. On 2 ranks the training
/// is bit for bit the fp32 wire's: a 2-byte run's gradients are 2-byte values already, and
/// one hop sums them in f32 before the one rounding the model makes anyway. On 4 ranks
/// the ring's partial sums are rounded at each hop: every loss within 1e-2 relative (the
/// largest difference printed).
#[test]
fn a_two_byte_wire_sends_half_the_bytes_and_trains_alike() {
    let layouts =
        [Sharding::None, Sharding::Zero1, Sharding::Zero2, Sharding::Fsdp].into_iter().flat_map(|s| [(2, s), (4, s)]);
    for (dp, sharding) in layouts {
        for precision in [Precision::Bf16, Precision::Fp16] {
            let name = format!("{} {} dp={dp}", precision.as_str(), sharding.as_str());
            let (wide, narrow) = (
                spec(&name, dp, precision, sharding, Precision::Fp32),
                spec(&name, dp, precision, sharding, precision),
            );
            let (wide_losses, wide_trace) = run_with_trace(&wide);
            let (narrow_losses, narrow_trace) = run_with_trace(&narrow);
            let predicted = plan(&narrow).unwrap().stages[0].comm.clone();
            let sent = |trace, op| sent_per_step(trace, op, narrow.train.steps);
            // Gathers and reduce-scatters exactly; all-reduces may carry a few bytes more:
            // the one-float all-reduces of the loss and gradient norm, which stay fp32.
            for (op, want) in [
                (CollectiveOp::ReduceScatter, predicted.dp_reduce_scatter),
                (CollectiveOp::AllGather, predicted.dp_all_gather),
            ] {
                assert_eq!(sent(&narrow_trace, op), want, "{name}: {op:?} bytes per step, the planner's");
                assert_eq!(2 * want, sent(&wide_trace, op), "{name}: {op:?} half of fp32's");
            }
            let all_reduce = sent(&narrow_trace, CollectiveOp::AllReduce);
            let planned = predicted.dp_all_reduce;
            assert!((planned..=planned + 16).contains(&all_reduce), "{name} all_reduce: {all_reduce} vs {planned}");
            let worst = wide_losses.iter().zip(&narrow_losses).map(|(w, n)| ((n - w) / w).abs()).fold(0.0f64, f64::max);
            eprintln!("{name}: largest loss difference against the fp32 wire {worst:.2e} relative");
            if dp == 2 {
                assert_eq!(narrow_losses, wide_losses, "{name}: one hop loses nothing");
            } else {
                assert!(worst < 1e-2, "{name}: {worst:.2e}");
            }
        }
    }
}
