//! Flash attention (`train.attention: "flash"`): the same training as the attention that
//! keeps its probabilities, on every strategy it composes with, and no (T, T) buffer: the
//! activations the ranks hold are the planner's, which has no T² term for it.

use distlab_common::planner::plan;
use distlab_common::*;
use distlab_tests::*;

/// 128 positions: two query tiles and two key tiles of flash attention's 64.
fn spec(name: &str, attention: Attention) -> ExperimentSpec {
    let mut spec = quick_spec(name, 20);
    spec.model = ModelSpec::dense(2, 64, 4, 128, 64);
    spec.train.micro_batch = 2;
    spec.train.attention = attention;
    spec
}

type Mesh = fn(&mut ExperimentSpec);

const MESHES: [(&str, Mesh); 5] = [
    ("one rank", |_| {}),
    ("dp=2", |s| s.parallel.dp = 2),
    ("tp=2", |s| s.parallel.tp = 2),
    ("pp=2 1F1B, 2 micro-batches", |s| {
        s.parallel.pp = 2;
        s.train.micro_batches = 2;
    }),
    ("dp=2 fsdp, checkpointing every block", |s| {
        s.parallel.dp = 2;
        s.parallel.sharding = Sharding::Fsdp;
        s.train.checkpointing = Checkpointing::Every;
    }),
];

/// 20 steps in fp32: every loss within 1e-5 relative of the naive attention's, every
/// gradient norm within 1e-4 (the sums run in another order, so not bit for bit).
#[test]
fn flash_attention_trains_like_the_attention_that_keeps_its_probabilities() {
    let _serial = one_at_a_time();
    for (name, mesh) in MESHES {
        let (mut naive, mut flash) = (spec(name, Attention::Naive), spec(name, Attention::Flash));
        mesh(&mut naive);
        mesh(&mut flash);
        let (want, got) = (run_steps(&naive), run_steps(&flash));
        assert_eq!(want.len(), got.len(), "{name}: steps");
        for (w, g) in want.iter().zip(&got) {
            let loss = (g.loss - w.loss).abs() / w.loss.abs();
            let norm = (g.grad_norm - w.grad_norm).abs() / w.grad_norm.abs();
            assert!(loss < 1e-5, "{name}, step {}: loss {} vs {} ({loss:.1e})", w.step, g.loss, w.loss);
            assert!(norm < 1e-4, "{name}, step {}: grad norm {} vs {} ({norm:.1e})", w.step, g.grad_norm, w.grad_norm);
        }
        eprintln!("{name}: final loss naive {} flash {}", want[19].loss, got[19].loss);
    }
}

/// The activations and activation gradients every rank holds at its peak are the
/// planner's, with flash as without; flash's are smaller by the probabilities and their
/// gradient (heads x T x T per sequence and layer, less the log-sum-exp pairs).
#[test]
fn flash_attention_holds_no_t_by_t_buffer() {
    let _serial = one_at_a_time();
    for tp in [1, 2] {
        let mut peaks = Vec::new();
        for attention in [Attention::Naive, Attention::Flash] {
            let mut s = spec("memory", attention);
            (s.parallel.tp, s.train.steps, s.train.warmup_steps) = (tp, 2, 1);
            let predicted = plan(&s).unwrap();
            let (_, trace) = run_with_trace(&s);
            for r in &trace.ranks {
                let measured = &r.memory.as_ref().unwrap().peak;
                let stage = &predicted.stages[0].memory;
                assert_eq!(measured.activations, stage.activations, "tp={tp} {attention:?} rank {}", r.rank);
                assert_eq!(measured.activation_grads, stage.activation_grads, "tp={tp} {attention:?} rank {}", r.rank);
            }
            let peak = &trace.ranks[0].memory.as_ref().unwrap().peak;
            peaks.push(peak.activations + peak.activation_grads);
        }
        // Per layer, b x (heads / tp) x (T² - 2T) floats of probabilities, once more for
        // their gradient (one scratch for all layers).
        let (b, h, t, layers) = (2u64, 4 / tp as u64, 128u64, 2u64);
        let per_layer = b * h * (t * t - 2 * t) * 4;
        assert_eq!(peaks[0] - peaks[1], per_layer * (layers + 1), "tp={tp}: naive {} flash {}", peaks[0], peaks[1]);
    }
}
