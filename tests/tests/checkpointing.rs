//! Activation checkpointing: recomputing a block (or, selective, its attention
//! probabilities) gives bit-for-bit the activations forward made, so the losses are exactly
//! those without it, alone and under TP, PP and FSDP; the activations held fall to what the
//! planner predicts; FSDP gathers what it recomputes.

use distlab_common::planner::plan;
use distlab_common::trace::{self, SpanKind};
use distlab_common::*;
use distlab_tests::*;

/// Five blocks: sqrt checkpointing cuts them into segments of 3 and 2.
fn spec(name: &str, checkpointing: Checkpointing) -> ExperimentSpec {
    let mut spec = quick_spec(name, 5);
    spec.model = ModelSpec::dense(5, 64, 4, 32, 64);
    spec.train.micro_batch = 2;
    spec.train.micro_batches = 2;
    spec.train.checkpointing = checkpointing;
    spec
}

const MODES: [Checkpointing; 3] = [Checkpointing::Every, Checkpointing::Sqrt, Checkpointing::Selective];

#[test]
fn recomputing_gives_exactly_the_training_without_it() {
    let _serial = one_at_a_time();
    type Mesh = fn(&mut ExperimentSpec);
    let meshes: [(&str, Mesh); 4] = [
        ("one rank", |_| {}),
        ("tp=2", |s| s.parallel.tp = 2),
        ("pp=2 1F1B", |s| s.parallel.pp = 2),
        ("dp=2 fsdp", |s| {
            s.parallel.dp = 2;
            s.parallel.sharding = Sharding::Fsdp;
        }),
    ];
    for (name, mesh) in meshes {
        let mut plain = spec(name, Checkpointing::None);
        mesh(&mut plain);
        // Bit for bit: the same losses and the same gradient norms.
        let same = |m: &[MetricPoint]| m.iter().map(|p| (p.loss, p.grad_norm)).collect::<Vec<_>>();
        let expected = same(&run_steps(&plain));
        for mode in MODES {
            let mut s = plain.clone();
            s.train.checkpointing = mode;
            assert_eq!(same(&run_steps(&s)), expected, "{name} with checkpointing {mode:?}");
        }
    }
}

/// Measured peak activations equal the planner's (one rank and each stage of pp=2) and are
/// below those without checkpointing. Here "every" holds less than "sqrt": a block's
/// activations are ~16x its output, so 5 outputs + 1 block beat 2 outputs + 3 blocks (sqrt
/// pays off where a segment's internals are small next to what it saves). Backward shows
/// a "recompute layer" span for each block recomputed ahead of its own backward. Selective
/// recompute keeps all but the blocks' attention probabilities (one block's held instead),
/// and recomputes them in a span of their own before each block's backward.
#[test]
fn activations_held_match_the_plan_and_recomputes_show_on_the_timeline() {
    let _serial = one_at_a_time();
    for pp in [1, 2] {
        let mut peaks = Vec::new();
        for mode in [Checkpointing::None, Checkpointing::Every, Checkpointing::Sqrt, Checkpointing::Selective] {
            let mut s = spec("memory", mode);
            s.parallel.pp = pp;
            s.train.steps = 2;
            s.train.warmup_steps = 1;
            let predicted = plan(&s).unwrap();
            let (_, trace) = run_with_trace(&s);
            for r in &trace.ranks {
                let measured = &r.memory.as_ref().unwrap().peak;
                let stage = &predicted.stages[s.stage_of(r.rank as usize)].memory;
                assert_eq!(measured.activations, stage.activations, "pp={pp} {mode:?} rank {}", r.rank);
                assert_eq!(measured.activation_grads, stage.activation_grads, "pp={pp} {mode:?} rank {}", r.rank);
            }
            peaks.push(trace.ranks[0].memory.as_ref().unwrap().peak.activations);
            if pp == 1 {
                let recomputed = trace.ranks[0]
                    .spans
                    .iter()
                    .filter(|x| x.step == 1 && x.kind == SpanKind::Forward && x.name.starts_with("recompute layer"))
                    .count();
                // Every block's forward runs again once per micro-batch, each a span of its
                // own: every: inside its backward; sqrt: segments [0 1 2] [3 4], a segment's
                // last block inside its backward, the others on their own.
                let expected = match mode {
                    Checkpointing::None => 0,
                    _ => s.model.layers * s.train.micro_batches,
                };
                assert_eq!(recomputed, expected, "{mode:?}: recompute spans");
                // A recompute is drawn apart from its block's backward: they never overlap.
                let spans = &trace.ranks[0].spans;
                for r in spans.iter().filter(|x| x.is_recompute()) {
                    let overlaps = |b: &&trace::Span| {
                        b.kind == SpanKind::Backward
                            && b.layer == r.layer
                            && b.start_us < r.end_us
                            && r.start_us < b.end_us
                    };
                    assert!(!spans.iter().any(|b| overlaps(&b)), "{mode:?}: {} overlaps its backward", r.name);
                }
            }
        }
        assert!(peaks[1] < peaks[0] && peaks[2] < peaks[0], "pp={pp}: none, every, sqrt peaks {peaks:?}");
        assert!(peaks[1] < peaks[2], "pp={pp}: every below sqrt here: {peaks:?}");
        assert!(peaks[2] < peaks[3] && peaks[3] < peaks[0], "pp={pp}: selective between sqrt and none: {peaks:?}");
    }
}

/// Selective recompute drops nothing ZB-H1's W needs (the probabilities' gradient is the
/// B's): the same bits as ZB-H1 without it, and each stage's activations the planner's.
#[test]
fn selective_recompute_composes_with_zero_bubble() {
    let _serial = one_at_a_time();
    let mut plain = spec("zb-h1", Checkpointing::None);
    (plain.parallel.pp, plain.parallel.pp_schedule, plain.train.micro_batches) = (2, PpSchedule::ZbH1, 4);
    (plain.train.steps, plain.train.warmup_steps) = (3, 1);
    let mut selective = plain.clone();
    selective.train.checkpointing = Checkpointing::Selective;
    let bits = |m: &[MetricPoint]| m.iter().map(|p| (p.loss.to_bits(), p.grad_norm.to_bits())).collect::<Vec<_>>();
    let (points, trace) = run_points_with_trace(&selective);
    assert_eq!(bits(&points), bits(&run_steps(&plain)), "zb-h1 with selective recompute");
    let predicted = plan(&selective).unwrap();
    for r in &trace.ranks {
        let measured = &r.memory.as_ref().unwrap().peak;
        let stage = &predicted.stages[selective.stage_of(r.rank as usize)].memory;
        assert_eq!(measured.activations, stage.activations, "rank {}", r.rank);
    }
}

/// FSDP with sqrt checkpointing gathers each block recomputed ahead of its backward once
/// more; the planner counts it, and the bytes sent match it exactly.
#[test]
fn fsdp_gathers_match_the_plan_with_recomputation() {
    let _serial = one_at_a_time();
    for mode in MODES {
        let mut s = spec("fsdp", mode);
        s.parallel.dp = 2;
        s.parallel.sharding = Sharding::Fsdp;
        s.train.steps = 2;
        s.train.warmup_steps = 1;
        let predicted = plan(&s).unwrap().stages[0].comm.clone();
        let (_, trace) = run_with_trace(&s);
        let sent = |op| sent_per_step(&trace, op, s.train.steps);
        assert_eq!(sent(trace::CollectiveOp::AllGather), predicted.dp_all_gather, "{mode:?} all_gather");
        assert_eq!(sent(trace::CollectiveOp::ReduceScatter), predicted.dp_reduce_scatter, "{mode:?} reduce_scatter");
    }
}
