//! Context parallelism (`parallel.cp`): each sequence split along its tokens over cp ranks
//! of the data-parallel group, Ulysses' all-to-alls around attention or the ring's passes of
//! keys and values. It trains as the same global batch does without it, on every mesh it
//! composes with; each rank keeps the activations the planner predicts (less as cp grows),
//! and its exchanges move the bytes the planner predicts.

use distlab_common::planner::plan;
use distlab_common::trace::{lane, SpanKind};
use distlab_common::*;
use distlab_tests::*;

const MODEL: ModelSpec = ModelSpec::dense(2, 64, 4, 32, 64);

/// `cp` ranks sharing each sequence, in a data-parallel group of `dp` ranks: `dp/cp`
/// replicas of the data, as many sequences per step as `dp/cp` ranks without it.
fn spec(name: &str, dp: usize, cp: usize) -> ExperimentSpec {
    let mut spec = quick_spec(name, 6);
    spec.model = MODEL;
    (spec.parallel.dp, spec.parallel.cp) = (dp, cp);
    spec.train.micro_batch = 2;
    spec
}

type Variant = fn(&mut ExperimentSpec);

const VARIANTS: [(&str, Variant); 16] = [
    ("cp=2", |_| {}),
    ("cp=4", |s| (s.parallel.dp, s.parallel.cp) = (4, 4)),
    // (DDP's buckets wait for the end of backward: the exchanges use the same links)
    ("cp=4, DDP with 4 KiB buckets", |s| (s.parallel.dp, s.parallel.cp, s.parallel.bucket_bytes) = (4, 4, 4096)),
    ("dp=4 (2 replicas) x cp=2 ZeRO-2", |s| (s.parallel.dp, s.parallel.sharding) = (4, Sharding::Zero2)),
    ("cp=2 FSDP, flash attention", |s| (s.parallel.sharding, s.train.attention) = (Sharding::Fsdp, Attention::Flash)),
    ("cp=2 x tp=2 with sequence parallelism", |s| (s.parallel.tp, s.parallel.sequence_parallel) = (2, true)),
    ("cp=2 x pp=2 1F1B, every block recomputed", |s| {
        (s.parallel.pp, s.train.micro_batches, s.train.checkpointing) = (2, 2, Checkpointing::Every)
    }),
    ("cp=2, selective recompute", |s| s.train.checkpointing = Checkpointing::Selective),
    ("cp=2 x pp=2 ZB-H1", |s| {
        (s.parallel.pp, s.parallel.pp_schedule, s.train.micro_batches) = (2, PpSchedule::ZbH1, 4)
    }),
    ("cp=2, Llama with grouped-query attention", |s| {
        s.model = ModelSpec::llama(2, 64, 4, 2, 176, 32, 64);
    }),
    ("ring cp=2", ring),
    ("ring-unbalanced cp=4", |s| {
        ring(s);
        (s.parallel.dp, s.parallel.cp, s.parallel.cp_kind) = (4, 4, ContextParallel::RingUnbalanced);
    }),
    ("ring cp=4 (balanced), FSDP", |s| {
        ring(s);
        (s.parallel.dp, s.parallel.cp, s.parallel.sharding) = (4, 4, Sharding::Fsdp);
    }),
    ("ring cp=2 x tp=2 with sequence parallelism, Llama GQA", |s| {
        ring(s);
        s.model = ModelSpec::llama(2, 64, 4, 2, 176, 32, 64);
        (s.parallel.tp, s.parallel.sequence_parallel) = (2, true);
    }),
    ("ring cp=2 x pp=2 1F1B, every block recomputed", |s| {
        ring(s);
        (s.parallel.pp, s.train.micro_batches, s.train.checkpointing) = (2, 2, Checkpointing::Every)
    }),
    ("ring cp=2 x pp=2 ZB-H1", |s| {
        ring(s);
        (s.parallel.pp, s.parallel.pp_schedule, s.train.micro_batches) = (2, PpSchedule::ZbH1, 4)
    }),
];

/// The balanced ring, and the flash attention it needs.
fn ring(s: &mut ExperimentSpec) {
    (s.parallel.cp_kind, s.train.attention) = (ContextParallel::Ring, Attention::Flash);
}

/// The same sequences, cut in cp: the losses and gradient norms of the run without it
/// (the sums come in another order: `assert_same_training`'s 1e-5).
#[test]
fn context_parallelism_trains_like_whole_sequences() {
    let _serial = one_at_a_time();
    for (name, variant) in VARIANTS {
        let mut split = spec(name, 2, 2);
        variant(&mut split);
        let mut whole = split.clone();
        (whole.parallel.dp, whole.parallel.cp) = (split.parallel.data_replicas(), 1);
        if whole.parallel.dp < 2 {
            // (one rank shards nothing: the same arithmetic)
            (whole.parallel.sharding, whole.parallel.prefetch) = (Sharding::None, false);
        }
        assert_eq!(whole.global_batch(), split.global_batch(), "{name}");
        assert_same_training(&run_steps(&whole), &run_steps(&split), name);
    }
}

/// Per rank: activations, their gradients and the context-parallel bytes of a step equal
/// the planner's, and the activations fall as cp grows.
#[test]
fn context_parallelism_keeps_each_rank_its_tokens_as_planned() {
    let _serial = one_at_a_time();
    let mut peaks = Vec::new();
    let (ulysses, ring, unbalanced) =
        (ContextParallel::Ulysses, ContextParallel::Ring, ContextParallel::RingUnbalanced);
    let flash = Attention::Flash;
    for (cp, attention, kind) in [
        (1, Attention::Naive, ulysses),
        (2, Attention::Naive, ulysses),
        (4, Attention::Naive, ulysses),
        (2, flash, ulysses),
        (2, flash, ring),
        (4, flash, ring),
        (4, flash, unbalanced),
    ] {
        let mut s = spec("memory", cp, cp);
        (s.train.attention, s.parallel.cp_kind) = (attention, kind);
        (s.train.steps, s.train.warmup_steps) = (2, 1);
        let predicted = plan(&s).unwrap().stages[0].clone();
        let (_, trace) = run_with_trace(&s);
        assert_eq!(trace.ranks.len(), cp);
        for rank in &trace.ranks {
            let what = format!("cp={cp} {attention:?} {} rank {}", kind.as_str(), rank.rank);
            let measured = &rank.memory.as_ref().unwrap().peak;
            assert_eq!(measured.activations, predicted.memory.activations, "{what}: activations");
            assert_eq!(measured.activation_grads, predicted.memory.activation_grads, "{what}: their gradients");
            let exchanges: Vec<_> =
                rank.spans.iter().filter(|x| x.step == 1 && x.kind == SpanKind::Comm && x.lane == lane::CP).collect();
            let sent: u64 = exchanges.iter().filter_map(|x| x.bytes).sum();
            assert_eq!(sent, predicted.comm.cp_all_to_all, "{what}: context-parallel bytes of a step");
            // (Ulysses: 4 all-to-alls per block; the ring: cp-1 passes forward, 2(cp-1) + 1 back)
            let per_block = match (cp > 1, kind.is_ring()) {
                (false, _) => 0,
                (true, false) => 4,
                (true, true) => 3 * cp - 2,
            };
            assert_eq!(exchanges.len(), per_block * MODEL.layers, "{what}: exchanges");
        }
        if attention == Attention::Naive {
            eprintln!("cp={cp}: activation peak per rank {} B", predicted.memory.activations);
            peaks.push(predicted.memory.activations);
        }
    }
    assert!(peaks[1] < peaks[0] && peaks[2] < peaks[1], "{peaks:?}");
}
