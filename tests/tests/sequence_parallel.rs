//! Megatron sequence parallelism (`parallel.sequence_parallel`): the LayerNorm and
//! residual regions split along the tokens across the tensor-parallel group. It trains
//! like tensor parallelism without it on every mesh it composes with, each rank keeps the
//! activations the planner predicts (less than without it), and the group moves the bytes
//! the planner predicts: all-gathers and reduce-scatters in place of the all-reduces.

use distlab_common::planner::plan;
use distlab_common::trace::{lane, SpanKind};
use distlab_common::*;
use distlab_tests::*;

const MODEL: ModelSpec = ModelSpec::dense(4, 64, 4, 32, 64);

fn spec(name: &str, tp: usize, sequence_parallel: bool) -> ExperimentSpec {
    let mut spec = quick_spec(name, 8);
    spec.model = MODEL;
    spec.parallel.tp = tp;
    spec.parallel.sequence_parallel = sequence_parallel;
    spec.train.micro_batch = 2;
    spec.train.micro_batches = 2;
    spec
}

type Variant = fn(&mut ExperimentSpec);

const VARIANTS: [(&str, Variant); 7] = [
    ("tp=2", |_| {}),
    ("tp=4", |s| s.parallel.tp = 4),
    ("tp=2, sqrt checkpointing", |s| s.train.checkpointing = Checkpointing::Sqrt),
    ("tp=2, flash attention", |s| s.train.attention = Attention::Flash),
    ("dp=2 x tp=2 FSDP", |s| (s.parallel.dp, s.parallel.sharding) = (2, Sharding::Fsdp)),
    ("tp=2 x pp=2 1F1B", |s| s.parallel.pp = 2),
    ("tp=2, SGD", |s| s.train.optimizer = Optimizer::Sgd),
];

/// The sums come in another order (a reduce-scatter then the residual, instead of one
/// all-reduce with the residual in it): `assert_same_training`'s 1e-5 on the loss.
#[test]
fn sequence_parallelism_trains_like_tensor_parallelism() {
    let _serial = one_at_a_time();
    for (name, variant) in VARIANTS {
        let (mut whole, mut split) = (spec(name, 2, false), spec(name, 2, true));
        variant(&mut whole);
        variant(&mut split);
        assert_same_training(&run_steps(&whole), &run_steps(&split), name);
    }
}

/// Per rank: activations, their gradients and the tensor-parallel bytes of a step equal
/// the planner's; the activation peak is below tensor parallelism's without it.
#[test]
fn sequence_parallelism_keeps_each_rank_its_tokens_as_planned() {
    let _serial = one_at_a_time();
    for tp in [2, 4] {
        let mut peaks = Vec::new();
        for sequence_parallel in [false, true] {
            let mut s = spec("memory", tp, sequence_parallel);
            (s.train.steps, s.train.warmup_steps) = (2, 1);
            let predicted = plan(&s).unwrap().stages[0].clone();
            let (_, trace) = run_with_trace(&s);
            assert_eq!(trace.ranks.len(), tp);
            for rank in &trace.ranks {
                let what = format!("tp={tp} sp={sequence_parallel} rank {}", rank.rank);
                let measured = &rank.memory.as_ref().unwrap().peak;
                assert_eq!(measured.activations, predicted.memory.activations, "{what}: activations");
                assert_eq!(measured.activation_grads, predicted.memory.activation_grads, "{what}: their gradients");
                let sent: u64 = rank
                    .spans
                    .iter()
                    .filter(|x| x.step == 1 && x.kind == SpanKind::Comm && x.lane == lane::TP)
                    .filter_map(|x| x.bytes)
                    .sum();
                assert_eq!(sent, predicted.comm.tp_all_reduce, "{what}: tensor-parallel bytes of a step");
                let ops = |op: &str| rank.spans.iter().filter(|x| x.step == 1 && x.name.starts_with(op)).count();
                let gathers_and_scatters = ops("all_gather tp") + ops("reduce_scatter tp");
                assert_eq!(gathers_and_scatters > 0, sequence_parallel, "{what}: {gathers_and_scatters}");
            }
            peaks.push(predicted.memory.activations);
        }
        eprintln!("tp={tp}: activation peak per rank {} B without sequence parallelism, {} B with", peaks[0], peaks[1]);
        assert!(peaks[1] < peaks[0], "tp={tp}: {peaks:?}");
    }
}
