//! DiLoCo (`parallel.sync: diloco`): replicas that take H steps alone, then average their
//! parameter changes and take an outer Nesterov step. With SGD inside, H = 1, outer lr 1 and
//! no outer momentum it is DDP; its bytes fall H-fold; its memory is the planner's.

use distlab_common::planner::plan;
use distlab_common::trace::CollectiveOp;
use distlab_common::*;
use distlab_tests::*;

fn spec(name: &str, sync: DataSync, every: u64, steps: u64) -> ExperimentSpec {
    let mut spec = quick_spec(name, steps);
    spec.parallel.dp = 2;
    spec.train.micro_batch = 2;
    (spec.parallel.sync, spec.parallel.outer_steps_every) = (sync, every);
    spec
}

/// SGD inside, H = 1, outer lr 1, no momentum: the outer step's mean of the replicas'
/// changes, lr times their mean gradient, is DDP's step (losses within 1e-5; each replica
/// reports its own gradient's norm, not the sum's, so the norms differ). With AdamW
/// inside, or outer momentum, it is not DDP.
#[test]
fn diloco_with_sgd_every_step_and_no_momentum_is_ddp() {
    let _serial = one_at_a_time();
    let sgd = TestOptimizer::SgdWeightDecay;
    let ddp = run_losses(&sgd.on(spec("ddp", DataSync::EveryStep, 1, 12)));
    let mut plain = sgd.on(spec("diloco h1", DataSync::Diloco, 1, 12));
    (plain.parallel.outer_lr, plain.parallel.outer_momentum) = (1.0, 0.0);
    assert_same_losses(&ddp, &run_losses(&plain), "diloco H=1 sgd, outer lr 1, no momentum");

    let mut momentum = plain.clone();
    momentum.parallel.outer_momentum = 0.9;
    let with_momentum = run_losses(&momentum);
    let apart = |other: &[f64]| ddp.iter().zip(other).map(|(a, b)| ((a - b) / a).abs()).fold(0.0, f64::max);
    assert!(apart(&with_momentum) > 1e-3, "outer momentum changes the training: {with_momentum:?} vs {ddp:?}");

    let adamw = |sync, every| {
        let mut s = spec("adamw", sync, every, 12);
        (s.parallel.outer_lr, s.parallel.outer_momentum, s.train.grad_clip) = (1.0, 0.0, 0.0);
        run_losses(&s)
    };
    let (ddp_adamw, diloco_adamw) = (adamw(DataSync::EveryStep, 1), adamw(DataSync::Diloco, 1));
    let parted = ddp_adamw.iter().zip(&diloco_adamw).map(|(a, b)| ((a - b) / a).abs()).fold(0.0, f64::max);
    assert!(parted > 1e-4, "AdamW normalises each replica's gradient by its own moments: {parted:e}");
}

/// The outer step's all-reduce every H steps: the bytes per step H-fold fewer than DDP's,
/// each sync the planner's; the outer state in the ledger equals the planner's.
#[test]
fn diloco_sends_h_fold_fewer_bytes_and_holds_the_planners_state() {
    let _serial = one_at_a_time();
    let steps = 8;
    let sent = |s: &ExperimentSpec| {
        let (_, trace) = run_with_trace(s);
        let rank0 = trace.ranks.iter().find(|r| r.rank == 0).unwrap();
        let bytes: u64 =
            rank0.comm.counters.iter().filter(|c| c.op == CollectiveOp::AllReduce).map(|c| c.bytes_sent).sum();
        (bytes, rank0.memory.clone().unwrap())
    };
    let (ddp_bytes, _) = sent(&spec("ddp", DataSync::EveryStep, 1, steps));
    for every in [1, 4] {
        let s = spec("diloco", DataSync::Diloco, every, steps);
        let (bytes, memory) = sent(&s);
        let planned = plan(&s).unwrap();
        let stage = &planned.stages[0];
        // (the loss's one-float all-reduce each step rides along: a few bytes)
        let planned_bytes = stage.comm.dp_all_reduce * steps;
        assert!(
            (planned_bytes..=planned_bytes + 64 * steps).contains(&bytes),
            "H={every}: {bytes} B, planned {planned_bytes}"
        );
        let ratio = ddp_bytes as f64 / bytes as f64;
        assert!((ratio - every as f64).abs() < 0.01, "H={every}: DDP sends {ratio:.3}x as much");
        assert_eq!(memory.peak.optimizer_state, stage.memory.optimizer_state, "H={every}: inner and outer state");
        assert_eq!(memory.peak.comm_buffers, stage.memory.comm_buffers, "H={every}: no gradient buckets");
        println!("H={every}: {bytes} B in {steps} steps against DDP's {ddp_bytes} ({ratio:.2}x fewer)");
    }
}
