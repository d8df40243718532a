//! Mixture of Experts with expert parallelism: spreading the experts over ep ranks of the
//! data-parallel group is the same training as every rank holding them all (the tokens
//! cross to their experts by all-to-all and come back), the routers report the same
//! drops, each rank's memory and all-to-all bytes are the planner's.

use distlab_common::planner::plan;
use distlab_common::trace::CollectiveOp;
use distlab_common::*;
use distlab_tests::*;

fn spec(dp: usize, ep: usize) -> ExperimentSpec {
    let mut spec = quick_spec(&format!("moe dp={dp} ep={ep}"), 5);
    // capacity 1.0 with top-2 over 4 experts: a skewed router drops some assignments
    spec.model = ModelSpec { experts: 4, expert_top_k: 2, capacity_factor: 1.0, ..ModelSpec::dense(2, 64, 4, 32, 64) };
    spec.train.micro_batch = 2;
    spec.train.warmup_steps = 1;
    spec.parallel.dp = dp;
    spec.parallel.ep = ep;
    // Buckets of a few KiB: DDP would send the first ones while backward's all-to-alls
    // still run on the same links, unless it holds them back.
    spec.parallel.bucket_bytes = 4096;
    spec
}

#[test]
fn expert_parallelism_trains_like_every_expert_on_every_rank() {
    let _serial = one_at_a_time();
    for (dp, ep) in [(2, 2), (4, 2)] {
        let whole = run_steps(&spec(dp, 1));
        let s = spec(dp, ep);
        let (spread, trace) = run_points_with_trace(&s);
        let what = format!("dp={dp} ep={ep}");
        assert_same_training(&whole, &spread, &what);
        for (a, b) in whole.iter().zip(&spread) {
            let (a, b) = (a.experts.expect("routing metrics"), b.experts.expect("routing metrics"));
            assert_eq!((a.assignments, a.dropped), (b.assignments, b.dropped), "{what} step routing");
            assert!((a.balance - b.balance).abs() < 1e-5, "{what}: balance {} vs {}", a.balance, b.balance);
        }
        let planned = plan(&s).unwrap();
        let stage = &planned.stages[0];
        assert!(stage.comm.ep_all_to_all > 0);
        assert_eq!(sent_per_step(&trace, CollectiveOp::AllToAll, s.train.steps), stage.comm.ep_all_to_all, "{what}");
        for rank in &trace.ranks {
            let measured = &rank.memory.as_ref().expect("ranks report their memory").peak;
            let predicted = &stage.memory;
            let what = format!("{what} rank {}", rank.rank);
            assert_eq!(measured.parameters, predicted.parameters, "{what}");
            assert_eq!(measured.optimizer_state, predicted.optimizer_state, "{what}");
            assert_eq!(measured.comm_buffers, predicted.comm_buffers, "{what}");
            assert_eq!(measured.activations, predicted.activations, "{what}");
            assert_eq!(measured.activation_grads, predicted.activation_grads, "{what}");
        }
    }
    // With ep = dp every rank holds a quarter of each block's experts; one rank alone all.
    let alone = plan(&spec(1, 1)).unwrap().stages[0].params_per_rank;
    let spread = plan(&spec(4, 4)).unwrap().stages[0].params_per_rank;
    let m = spec(1, 1).model;
    assert_eq!(alone - spread, 2 * 3 * m.mlp_params(), "3 of 4 experts in each of 2 blocks elsewhere");
}

#[test]
fn recomputed_experts_route_again_the_same_way() {
    // Activation checkpointing runs each block's forward again in backward, all-to-alls
    // included: the same training, and the recomputed routings are not counted twice.
    let _serial = one_at_a_time();
    let kept = run_steps(&spec(2, 2));
    let mut s = spec(2, 2);
    s.train.checkpointing = Checkpointing::Every;
    let (recomputed, trace) = run_points_with_trace(&s);
    assert_same_training(&kept, &recomputed, "checkpointing every block");
    assert_eq!(kept[0].experts.unwrap().assignments, recomputed[0].experts.unwrap().assignments);
    let planned = plan(&s).unwrap().stages[0].comm.ep_all_to_all;
    assert_eq!(sent_per_step(&trace, CollectiveOp::AllToAll, s.train.steps), planned);
}

#[test]
fn a_pipeline_of_expert_blocks_trains_like_one_stage() {
    let _serial = one_at_a_time();
    let mut one = spec(2, 2);
    one.train.micro_batches = 2;
    let mut s = one.clone();
    s.parallel.pp = 2;
    assert_same_training(&run_steps(&one), &run_steps(&s), "pp=2");
}
