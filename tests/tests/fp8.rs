//! FP8 training (`train.fp8`): the blocks' linear layers multiply E4M3 inputs and weights
//! and E5M2 output gradients, each tensor with its own power-of-two scale. It trains within
//! a margin of bf16; delayed scaling starts at scale 1 (over a tenth of the gradients underflow in the
//! first step) and from then on casts with what the last steps' amaxes gave; current
//! scaling never saturates; the step's casts are reported.

use distlab_common::planner::plan;
use distlab_common::trace::CollectiveOp;
use distlab_common::*;
use distlab_tests::*;

fn spec(name: &str, fp8: Fp8Recipe) -> ExperimentSpec {
    let mut spec = quick_spec(name, 40);
    spec.model = ModelSpec::dense(2, 128, 4, 64, 256);
    spec.train.micro_batch = 8;
    spec.train.precision = Precision::Bf16;
    spec.train.eval_every = 0;
    spec.train.fp8 = fp8;
    spec
}

/// The mean loss of the last 5 steps.
fn final_loss(points: &[MetricPoint]) -> f64 {
    let tail = &points[points.len() - 5..];
    tail.iter().map(|p| p.loss).sum::<f64>() / tail.len() as f64
}

type Variant = fn(&mut ExperimentSpec);

const VARIANTS: [(&str, Variant); 3] = [
    ("one rank", |_| {}),
    ("dp=2 FSDP", |s| (s.parallel.dp, s.parallel.sharding) = (2, Sharding::Fsdp)),
    ("pp=2 1F1B", |s| (s.parallel.pp, s.train.micro_batches) = (2, 4)),
];

#[test]
fn fp8_trains_within_its_margin_of_bf16() {
    let _serial = one_at_a_time();
    for (name, variant) in VARIANTS {
        let mut bf16 = spec(name, Fp8Recipe::None);
        variant(&mut bf16);
        let reference = run_steps(&bf16);
        assert!(reference.iter().all(|p| p.fp8.is_none()), "{name}: no FP8 metrics without FP8");
        for recipe in [Fp8Recipe::Delayed, Fp8Recipe::Current] {
            let what = format!("{name}, {}", recipe.as_str());
            let s = ExperimentSpec { train: TrainSpec { fp8: recipe, ..bf16.train.clone() }, ..bf16.clone() };
            let points = run_steps(&s);
            let (ours, theirs) = (final_loss(&points), final_loss(&reference));
            eprintln!("{what}: last 5 steps' loss {ours:.4} against bf16's {theirs:.4}");
            assert!((ours - theirs).abs() <= 0.02 * theirs, "{what}: {ours} against bf16's {theirs}");
            assert!(ours < 0.7 * points[0].loss, "{what}: it learns ({} -> {ours})", points[0].loss);
            assert_ne!(points[5].loss, reference[5].loss, "{what}: the products are not bf16's");
            for p in &points {
                let f = p.fp8.unwrap_or_else(|| panic!("{what}: step {} has no FP8 metrics", p.step));
                assert!([f.inputs, f.weights, f.grads].iter().all(|k| k.elements > 0), "{what}: {f:?}");
                let powers = [f.inputs, f.weights, f.grads]
                    .iter()
                    .all(|k| [k.min_scale, k.max_scale].iter().all(|s| *s > 0.0 && s.log2().fract() == 0.0));
                assert!(powers, "{what} step {}: scales are powers of two: {f:?}", p.step);
                match (recipe, p.step) {
                    // (delayed: nothing seen yet, every scale 1, most gradients below E5M2's smallest)
                    (Fp8Recipe::Delayed, 0) => {
                        assert_eq!((f.grads.min_scale, f.grads.max_scale), (1.0, 1.0), "{what}");
                        assert!(f.grads.flushed * 10 > f.grads.elements, "{what}: step 0 {:?}", f.grads);
                    }
                    (Fp8Recipe::Delayed, step) if step >= 2 => {
                        assert!(f.grads.min_scale > 1.0, "{what} step {step}: {:?}", f.grads);
                        assert!(f.grads.flushed * 1000 < f.grads.elements, "{what} step {step}: {:?}", f.grads);
                    }
                    (Fp8Recipe::Current, _) => {
                        let saturated = f.inputs.saturated + f.weights.saturated + f.grads.saturated;
                        assert_eq!(saturated, 0, "{what} step {}: a scale from the cast's own amax", p.step);
                    }
                    _ => {}
                }
            }
        }
    }
}

/// FSDP with `fp8_all_gather`: each rank casts its shard of the blocks' weights to FP8
/// before the gather, and the model takes them as they arrive. The casts are those the
/// model makes of the gathered weights (same values, same scales: the largest of the
/// shards' amaxes), so the run is bit for bit the run gathering bf16, with the same FP8
/// metrics; its gathers send the planner's bytes, a bit more than half of bf16's.
#[test]
fn fsdp_gathers_the_weights_in_fp8_bit_for_bit_for_the_planners_bytes() {
    let _serial = one_at_a_time();
    for recipe in [Fp8Recipe::Delayed, Fp8Recipe::Current] {
        let what = recipe.as_str();
        let mut bf16 = spec(&format!("fp8-gather-{what}"), recipe);
        bf16.train.steps = 6;
        (bf16.parallel.dp, bf16.parallel.sharding, bf16.parallel.comm_dtype) = (2, Sharding::Fsdp, Precision::Bf16);
        let mut fp8 = bf16.clone();
        fp8.parallel.fp8_all_gather = true;
        let (bf16_points, bf16_trace) = run_points_with_trace(&bf16);
        let (fp8_points, fp8_trace) = run_points_with_trace(&fp8);
        for (a, b) in bf16_points.iter().zip(&fp8_points) {
            assert_eq!(a.loss.to_bits(), b.loss.to_bits(), "{what} step {}: {} vs {}", a.step, a.loss, b.loss);
            assert_eq!(a.fp8, b.fp8, "{what} step {}: the casts saw the same", a.step);
        }
        let gathered = |trace| sent_per_step(trace, CollectiveOp::AllGather, fp8.train.steps);
        let planned = |s| plan(s).unwrap().stages[0].comm.dp_all_gather;
        assert_eq!(gathered(&bf16_trace), planned(&bf16), "{what}: bf16 gathers");
        assert_eq!(gathered(&fp8_trace), planned(&fp8), "{what}: FP8 gathers, the planner's bytes");
        let share = gathered(&fp8_trace) as f64 / gathered(&bf16_trace) as f64;
        let (ours, theirs) = (gathered(&fp8_trace), gathered(&bf16_trace));
        eprintln!("{what}: FSDP's gathers send {ours} bytes a step with FP8 weights, {theirs} in bf16: {share:.3}");
        assert!(share < 0.6, "{what}: {share}");
        let names: Vec<&str> = fp8_trace.ranks[0].spans.iter().map(|s| s.name.as_str()).collect();
        assert!(names.contains(&"all_gather block 1 (fp8)"), "{what}: {names:?}");
    }
}
