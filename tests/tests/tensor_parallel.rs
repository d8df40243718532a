//! Tensor parallelism across rank processes: tp=2 and tp=4 give the losses of one rank,
//! so do the dp x tp x pp meshes; each block does two all-reduces of b x s x d forward and
//! two backward; each rank holds what the planner predicts.

use distlab_common::planner::plan;
use distlab_common::trace::SpanKind;
use distlab_common::*;
use distlab_tests::*;

const MODEL: ModelSpec = ModelSpec::dense(4, 64, 4, 32, 64);

fn spec(name: &str, dp: usize, tp: usize, pp: usize) -> ExperimentSpec {
    let mut spec = quick_spec(name, 8);
    spec.model = MODEL;
    spec.parallel.dp = dp;
    spec.parallel.tp = tp;
    spec.parallel.pp = pp;
    spec.train.micro_batch = 2;
    spec.train.micro_batches = 4;
    spec
}

// The sums of partial products come in another order than one rank's matmul, and the
// loss and gradient norm cross an f32 all-reduce: `assert_same_training` (1e-5 on the loss,
// 2e-5 on the gradient norm) as for the other strategies, under AdamW and SGD.

#[test]
fn tensor_parallel_trains_like_one_rank() {
    let _serial = one_at_a_time();
    for optimizer in OPTIMIZERS {
        let single = run_steps(&optimizer.on(spec("one rank", 1, 1, 1)));
        assert!(single.last().unwrap().loss < single[0].loss - 0.3, "the model learns: {single:?}");
        for tp in [2, 4] {
            let what = format!("tp={tp} {optimizer:?}");
            assert_same_training(&single, &run_steps(&optimizer.on(spec("tp", 1, tp, 1))), &what);
        }
    }
}

/// dp2 x tp2 (with every DP sharding), tp2 x pp2 (both schedules) and dp2 x tp2 x pp2 on
/// eight processes, against one rank with the same global batch.
#[test]
fn meshes_train_like_one_rank() {
    let _serial = one_at_a_time();
    for optimizer in OPTIMIZERS {
        let run = |s: ExperimentSpec| run_steps(&optimizer.on(s));
        let mut single = spec("one rank", 1, 1, 1);
        single.train.micro_batches = 8;
        let single = run(single);
        let tp_pp = run(spec("tp2 x pp2", 1, 2, 2));
        assert_same_training(&run(spec("one rank", 1, 1, 1)), &tp_pp, &format!("tp2 x pp2 1F1B {optimizer:?}"));
        let mut gpipe = spec("tp2 x pp2", 1, 2, 2);
        gpipe.parallel.pp_schedule = PpSchedule::Gpipe;
        assert_same_training(&tp_pp, &run(gpipe), &format!("tp2 x pp2 GPipe {optimizer:?}"));
        for sharding in [Sharding::None, Sharding::Zero1, Sharding::Zero2, Sharding::Fsdp] {
            let mut mesh = spec("dp2 x tp2", 2, 2, 1);
            mesh.parallel.sharding = sharding;
            assert_same_training(&single, &run(mesh), &format!("dp2 x tp2 {sharding:?} {optimizer:?}"));
        }
        for sharding in [Sharding::None, Sharding::Fsdp] {
            let mut mesh = spec("dp2 x tp2 x pp2", 2, 2, 2);
            mesh.parallel.sharding = sharding;
            assert_same_training(&single, &run(mesh), &format!("dp2 x tp2 x pp2 {sharding:?} {optimizer:?}"));
        }
    }
}

/// Megatron's f and g: per block two all-reduces forward (attention output, MLP output)
/// and two backward (the two LayerNorm output gradients), each of one micro-batch's
/// b x s x d activations; and every rank holds what the planner predicts.
#[test]
fn each_block_all_reduces_twice_per_direction_and_memory_matches_the_plan() {
    let _serial = one_at_a_time();
    let mut s = spec("tp trace", 1, 2, 1);
    s.train.steps = 2;
    s.train.warmup_steps = 1;
    let (_, trace) = run_with_trace(&s);
    let predicted = plan(&s).unwrap();
    let t = &s.train;
    let activation_bytes = (t.micro_batch * MODEL.seq_len * MODEL.d_model * 4) as u64;
    assert_eq!(trace.ranks.len(), 2);
    for rank in &trace.ranks {
        let tp: Vec<_> =
            rank.spans.iter().filter(|x| x.step == 1 && x.kind == SpanKind::Comm && x.name.contains(" tp ")).collect();
        for layer in 0..MODEL.layers as u32 {
            let of_layer = |op: &str| tp.iter().filter(|x| x.layer == Some(layer) && x.name.contains(op)).count();
            assert_eq!(of_layer("tp g:"), 2 * t.micro_batches, "forward sums of layer {layer}: {tp:#?}");
            assert_eq!(of_layer("tp f:"), 2 * t.micro_batches, "backward sums of layer {layer}");
        }
        assert!(tp.iter().all(|x| x.bytes == Some(activation_bytes)), "each sum moves one activation");
        let measured = &rank.memory.as_ref().unwrap().peak;
        let stage = &predicted.stages[0].memory;
        assert_eq!(measured.parameters, stage.parameters, "rank {}", rank.rank);
        assert_eq!(measured.optimizer_state, stage.optimizer_state, "rank {}", rank.rank);
        assert_eq!(measured.activations, stage.activations, "rank {}", rank.rank);
        assert_eq!(measured.activation_grads, stage.activation_grads, "rank {}", rank.rank);
    }
}
