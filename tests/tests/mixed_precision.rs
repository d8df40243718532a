//! bf16 and fp16 across rank processes: every parallel strategy trains with 2-byte
//! parameters, gradients and activations, follows the one-rank run of the same precision,
//! and every rank's measured memory is the planner's prediction.

use distlab_common::planner::plan;
use distlab_common::*;
use distlab_tests::*;

fn spec(name: &str, precision: Precision) -> ExperimentSpec {
    let mut spec = quick_spec(name, 8);
    spec.train.precision = precision;
    if precision == Precision::Fp16 {
        spec.train.loss_scaling = LossScaling::Dynamic;
    }
    spec.train.micro_batch = 2;
    spec.train.micro_batches = 2;
    spec
}

/// Every layout of 2 ranks (and dp2 x tp2 x pp2), against one rank with the same global
/// batch. The gradients are summed in another order and, across ranks, in fp32 before one
/// rounding to the model's format: the losses agree to well within that format's rounding
/// (measured over 8 steps: bf16 within 2.1e-4 relative, fp16 within 3.2e-5).
#[test]
fn every_strategy_trains_in_bf16_and_fp16_like_one_rank() {
    type Layout = fn(&mut ExperimentSpec);
    let layouts: [(&str, Layout); 7] = [
        ("ddp", |s| s.parallel.dp = 2),
        ("zero1", |s| (s.parallel.dp, s.parallel.sharding) = (2, Sharding::Zero1)),
        ("zero2", |s| (s.parallel.dp, s.parallel.sharding) = (2, Sharding::Zero2)),
        ("fsdp", |s| (s.parallel.dp, s.parallel.sharding) = (2, Sharding::Fsdp)),
        ("tp2", |s| s.parallel.tp = 2),
        ("pp2 1f1b", |s| s.parallel.pp = 2),
        ("dp2 x tp2 x pp2 fsdp", |s| {
            (s.parallel.dp, s.parallel.tp, s.parallel.pp, s.parallel.sharding) = (2, 2, 2, Sharding::Fsdp)
        }),
    ];
    for (precision, tolerance) in [(Precision::Bf16, 1e-3), (Precision::Fp16, 2e-4)] {
        // One rank with the global batch of dp = 1 and of dp = 2.
        let alone = |dp: usize| {
            let mut s = spec("one rank", precision);
            s.train.micro_batches *= dp;
            run_losses(&s)
        };
        let (alone_1, alone_2) = (alone(1), alone(2));
        for (name, layout) in layouts {
            // The 8-rank layout once, in bf16 (it costs 8 processes on 2 cores).
            if name.starts_with("dp2 x") && precision == Precision::Fp16 {
                continue;
            }
            let mut s = spec(name, precision);
            layout(&mut s);
            let losses = run_losses(&s);
            assert_eq!(losses.len(), 8, "{name}");
            let alone = if s.parallel.dp == 2 { &alone_2 } else { &alone_1 };
            for (step, (a, b)) in alone.iter().zip(&losses).enumerate() {
                let rel = (a - b).abs() / a.abs();
                assert!(
                    rel < tolerance,
                    "{} {name} step {step}: one rank {a}, {name} {b} ({rel:e})",
                    precision.as_str()
                );
            }
        }
    }
}

#[test]
fn every_rank_measures_the_bf16_memory_the_planner_predicts() {
    // The largest unit in bf16: what FSDP gathers at once (the planner's count).
    let largest_unit_bf16 = {
        let mut fsdp = spec("fsdp", Precision::Bf16);
        (fsdp.parallel.dp, fsdp.parallel.sharding) = (2, Sharding::Fsdp);
        plan(&fsdp).unwrap().stages[0].memory.gathered_parameters
    };
    for sharding in [Sharding::None, Sharding::Zero1, Sharding::Zero2, Sharding::Fsdp] {
        let mut s = spec(sharding.as_str(), Precision::Bf16);
        s.parallel.dp = 2;
        s.parallel.sharding = sharding;
        s.train.steps = 2;
        s.train.warmup_steps = 1;
        let predicted = plan(&s).unwrap().stages[0].memory.clone();
        let (_, trace) = run_with_trace(&s);
        assert_eq!(trace.ranks.len(), 2);
        for rank in &trace.ranks {
            let measured = &rank.memory.as_ref().expect("ranks report their memory").peak;
            let what = format!("bf16 {sharding:?} rank {}", rank.rank);
            assert_eq!(measured.parameters, predicted.parameters, "{what}");
            assert_eq!(measured.gradients, predicted.gradients, "{what}");
            assert_eq!(measured.optimizer_state, predicted.optimizer_state, "{what}");
            assert_eq!(measured.gathered_parameters, predicted.gathered_parameters, "{what}");
            assert_eq!(measured.activations, predicted.activations, "{what}");
            assert_eq!(measured.activation_grads, predicted.activation_grads, "{what}");
            // DDP's buckets and ZeRO/FSDP's unit gradients: the planner's count, in the
            // format they are held in.
            assert_eq!(measured.comm_buffers, predicted.comm_buffers, "{what}");
            // Measured only, one call's copies at a time: the f32 copy a bf16 unit gets for
            // its gather or reduce-scatter (4 bytes for each of the largest unit's elements,
            // FSDP's gathered unit in bf16 is 2; none for DDP, whose buckets are f32 already),
            // or the f32 copies of a matrix product's operands and output.
            let largest_unit_f32 = 2 * largest_unit_bf16;
            let collective = if sharding == Sharding::None { 0 } else { largest_unit_f32 };
            let expected = collective.max(largest_product_f32(&s));
            assert_eq!(measured.transient, expected, "{what}: transient");
        }
    }
}

/// The largest f32 copies a bf16 matrix product makes at once, in bytes: both operands and
/// the output, `rows·c_in + c_in·c_out + rows·c_out` floats for each of the model's linear
/// layers (forward, and both products of backward, make the same three sizes).
fn largest_product_f32(s: &ExperimentSpec) -> u64 {
    let rows = (s.train.micro_batch * s.model.seq_len) as u64;
    let c = s.model.d_model as u64;
    let layers = [(c, 3 * c), (c, c), (c, 4 * c), (4 * c, c), (c, s.model.vocab as u64)];
    layers.iter().map(|&(c_in, c_out)| 4 * (rows * c_in + c_in * c_out + rows * c_out)).max().unwrap_or(0)
}

/// fp16 with dynamic loss scaling follows fp32 under SGD, whose update is proportional to
/// the gradient: the scale (2^16) multiplies the loss before backward and must come off
/// the gradients before the update, or every step is 65,536 times too large. The gradient
/// norm is reported unscaled too. No step is skipped in these 10 (at step 12 the first
/// scaled gradient overflows fp16, and the trajectories part).
#[test]
fn loss_scaling_unscales_before_the_update() {
    let sgd = |precision| {
        let mut s = TestOptimizer::SgdWeightDecay.on(spec("sgd", precision));
        s.train.steps = 10;
        s
    };
    let fp32 = run_steps(&sgd(Precision::Fp32));
    let fp16 = run_steps(&sgd(Precision::Fp16));
    assert!(fp32.last().unwrap().loss < fp32[0].loss - 0.2, "SGD trains: {fp32:?}");
    for (a, b) in fp32.iter().zip(&fp16) {
        assert_eq!(b.loss_scale, Some(65536.0), "step {}", b.step);
        assert_eq!(b.skipped_steps, Some(0), "step {}", b.step);
        let loss = (a.loss - b.loss).abs() / a.loss;
        let norm = (a.grad_norm - b.grad_norm).abs() / a.grad_norm;
        // Seen: losses within 7.8e-5 relative, gradient norms within 2.5e-3 (fp16 rounding).
        assert!(loss < 1e-3 && norm < 1e-2, "step {}: fp32 {a:?}\nfp16 {b:?}", a.step);
    }
}
