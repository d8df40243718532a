//! LAMB and LARS (`train.optimizer: lamb | lars`): every tensor's step scaled by a trust
//! ratio of its own norms. Sharded (ZeRO-1/2, FSDP) each tensor's norms are summed over
//! the ranks its pieces are on, so the training is one rank's; the memory is the planner's.

use distlab_common::planner::plan;
use distlab_common::*;
use distlab_tests::*;

fn spec(name: &str, optimizer: Optimizer, dp: usize, micro_batch: usize) -> ExperimentSpec {
    let mut spec = quick_spec(name, 20);
    spec.parallel.dp = dp;
    spec.train.micro_batch = micro_batch;
    spec.train.optimizer = optimizer;
    spec.train.weight_decay = 0.1;
    // Each tensor moves by about lr times its norm a step: large enough steps that a ratio
    // taken from a shard's piece alone shows in the losses.
    spec.train.lr = 0.01;
    spec
}

/// dp = 2 over the whole batch (replicated, ZeRO-1/2, FSDP: a tensor cut between the two
/// shards takes the ratio of its whole norms) and a pipeline of 2 stages (each holding
/// whole tensors): losses and gradient norms one rank's within `assert_same_training`'s
/// bounds. A ratio taken from one shard's piece alone parts from them.
#[test]
fn lamb_and_lars_train_like_one_rank_replicated_sharded_and_pipelined() {
    let _serial = one_at_a_time();
    for optimizer in [Optimizer::Lamb, Optimizer::Lars] {
        let single = run_steps(&spec("one rank", optimizer, 1, 4));
        for sharding in [Sharding::None, Sharding::Zero1, Sharding::Zero2, Sharding::Fsdp] {
            let mut s = spec(sharding.as_str(), optimizer, 2, 2);
            s.parallel.sharding = sharding;
            assert_same_training(&single, &run_steps(&s), &format!("{optimizer:?} dp=2 {sharding:?}"));
        }
        let mut piped = spec("pipeline", optimizer, 1, 2);
        (piped.parallel.pp, piped.train.micro_batches) = (2, 2);
        assert_same_training(&single, &run_steps(&piped), &format!("{optimizer:?} pp=2"));
    }
}

/// LAMB keeps AdamW's moments (8 bytes a parameter), LARS nothing, sharded as the spec says:
/// every rank's measured optimizer state is the planner's.
#[test]
fn lamb_and_lars_hold_the_planners_optimizer_state() {
    let _serial = one_at_a_time();
    for (optimizer, sharding) in [(Optimizer::Lamb, Sharding::Zero2), (Optimizer::Lars, Sharding::Fsdp)] {
        let mut s = spec("memory", optimizer, 2, 2);
        (s.parallel.sharding, s.train.steps, s.train.warmup_steps) = (sharding, 2, 1);
        let predicted = plan(&s).unwrap().stages[0].memory.clone();
        let (_, trace) = run_with_trace(&s);
        for rank in &trace.ranks {
            let measured = &rank.memory.as_ref().expect("ranks report their memory").peak;
            let what = format!("{optimizer:?} {sharding:?} rank {}", rank.rank);
            assert_eq!(measured.optimizer_state, predicted.optimizer_state, "{what}");
            assert_eq!(measured.parameters, predicted.parameters, "{what}");
        }
    }
}
