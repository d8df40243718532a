//! DDP with each all-reduce algorithm (`parallel.allreduce`): the same training as the
//! ring's (the sums come in another order), and the bytes the busiest rank (rank 0 here)
//! sends per step are the planner's.

use distlab_common::planner::plan;
use distlab_common::trace::CollectiveOp;
use distlab_common::*;
use distlab_tests::*;

fn spec(algorithm: AllReduce) -> ExperimentSpec {
    let mut spec = quick_spec(&format!("ddp {}", algorithm.as_str()), 6);
    spec.model = ModelSpec::dense(2, 64, 4, 32, 64);
    spec.train.micro_batch = 2;
    spec.parallel.dp = 4;
    spec.parallel.allreduce = algorithm;
    spec.parallel.ranks_per_node = 2;
    spec.parallel.bucket_bytes = 64 << 10;
    spec
}

#[test]
fn every_all_reduce_algorithm_trains_like_the_ring_and_sends_the_planned_bytes() {
    let _serial = one_at_a_time();
    let ring = run_steps(&spec(AllReduce::Ring));
    for algorithm in [AllReduce::Naive, AllReduce::Tree, AllReduce::Hierarchical] {
        let s = spec(algorithm);
        let (losses, trace) = run_with_trace(&s);
        let ring_losses: Vec<f64> = ring.iter().map(|p| p.loss).collect();
        assert_same_losses(&ring_losses, &losses, algorithm.as_str());
        let sent = sent_per_step(&trace, CollectiveOp::AllReduce, s.train.steps);
        let planned = plan(&s).unwrap().stages[0].comm.dp_all_reduce;
        assert_eq!(sent, planned, "{algorithm:?}: rank 0's all-reduce bytes per step");
    }
}
