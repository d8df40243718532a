//! Gradient compression with error feedback (`parallel.grad_compression`): every rank sends
//! the bytes the planner predicts and keeps the residual it predicts, and DDP still learns
//! on the markov data: the loss of the last ten steps stays within a stated margin of
//! uncompressed DDP's.

use distlab_common::planner::plan;
use distlab_common::trace::CollectiveOp;
use distlab_common::*;
use distlab_tests::*;

fn compressed(spec: &mut ExperimentSpec, method: GradCompression) {
    spec.parallel.grad_compression = method;
    spec.parallel.compression_ratio = 0.1;
    spec.parallel.compression_rank = 4;
}

const METHODS: [GradCompression; 3] = [GradCompression::Topk, GradCompression::Int8, GradCompression::Powersgd];

#[test]
fn compressed_gradients_send_the_planned_bytes_and_keep_the_planned_residual() {
    let _serial = one_at_a_time();
    type Layout = fn(&mut ExperimentSpec);
    let layouts: [(&str, Layout); 2] = [
        ("dp=4", |s| s.parallel.dp = 4),
        ("dp=2 x pp=2", |s| (s.parallel.dp, s.parallel.pp, s.train.micro_batches) = (2, 2, 2)),
    ];
    for (layout, set) in layouts {
        for method in METHODS {
            let mut spec = quick_spec(&format!("{layout} {}", method.as_str()), 3);
            spec.train.micro_batch = 2;
            spec.parallel.bucket_bytes = 64 << 10;
            set(&mut spec);
            compressed(&mut spec, method);
            let what = format!("{layout} {method:?}");
            let (losses, trace) = run_with_trace(&spec);
            assert!(losses.iter().all(|l| l.is_finite()), "{what}: {losses:?}");
            let predicted = plan(&spec).unwrap();
            for r in &trace.ranks {
                let stage = &predicted.stages[spec.stage_of(r.rank as usize)];
                let counters = &r.comm.counters;
                let dp_bytes: u64 = counters
                    .iter()
                    .filter(|c| matches!(c.op, CollectiveOp::AllGather | CollectiveOp::AllReduce))
                    .map(|c| c.bytes_sent)
                    .sum();
                assert_eq!(dp_bytes / spec.train.steps, stage.comm.dp_compressed, "{what} rank {}: bytes", r.rank);
                assert_eq!(stage.comm.dp_all_reduce, 0, "{what}: nothing else sums the gradients");
                let peak = &r.memory.as_ref().unwrap().peak;
                assert_eq!(peak.compression_state, stage.memory.compression_state, "{what} rank {}: state", r.rank);
                assert!(stage.memory.compression_state >= stage.params_per_rank * 4, "{what}: a residual per value");
            }
            let uncompressed = plan(&ExperimentSpec {
                parallel: ParallelSpec { grad_compression: GradCompression::None, ..spec.parallel.clone() },
                ..spec.clone()
            })
            .unwrap();
            assert!(predicted.stages[0].comm.total < uncompressed.stages[0].comm.total, "{what}: fewer bytes");
        }
    }
}

/// The margins over DDP's last-ten-step loss on the ddp2 preset's 100 steps (markov data,
/// 2 ranks, 110 k parameters; measured 1.46 for DDP): int8 with error feedback trains
/// like fp32 (within 0.01), top-k at 10% and PowerSGD at rank 4 lag by at most 0.25.
#[test]
fn compressed_ddp_learns_within_a_margin_of_ddp() {
    let _serial = one_at_a_time();
    let preset = presets::presets().into_iter().find(|p| p.key == "ddp2").unwrap().spec;
    let tail = |losses: &[f64]| losses[losses.len() - 10..].iter().sum::<f64>() / 10.0;
    let ddp = tail(&run_losses(&preset));
    for (method, margin) in
        [(GradCompression::Int8, 0.01), (GradCompression::Topk, 0.25), (GradCompression::Powersgd, 0.25)]
    {
        let mut spec = preset.clone();
        compressed(&mut spec, method);
        let losses = run_losses(&spec);
        let loss = tail(&losses);
        assert!(loss < losses[0] - 1.5, "{method:?}: the loss falls ({} -> {loss})", losses[0]);
        assert!(loss - ddp < margin, "{method:?}: {loss:.3} against DDP's {ddp:.3}");
    }
}
