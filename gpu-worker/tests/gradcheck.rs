//! Every op's backward, and the whole model's gradient, against central finite
//! differences in f64. The kernels are the engine's own (generic over the float
//! type), called through the `Backend` trait on `CpuBackend<f64>` inside 1- and
//! 3-thread pools, so the threaded splits of the work are checked too.

use distlab_common::ModelSpec;
use distlab_worker::backend::{Backend, CpuBackend, Stored};
use distlab_worker::memory::MemoryTracker;
use distlab_worker::model::{FlatState, Gpt};
use distlab_worker::ops::attention::{AttentionShape, Positions};
use distlab_worker::ops::kernels::*;
use distlab_worker::rng::Rng;
use half::{bf16, f16};

/// Central differences: truncation error grows as EPS² times the third derivative (the
/// Llama model's SwiGLU at ten times its initial weights needs EPS below 1e-5), rounding
/// error as 1e-16 / EPS.
const EPS: f64 = 3e-6;

fn random(n: usize, seed: u64, scale: f64) -> Vec<f64> {
    let mut rng = Rng::new(seed);
    (0..n).map(|_| scale * rng.normal()).collect()
}

fn dot(a: &[f64], b: &[f64]) -> f64 {
    a.iter().zip(b).map(|(x, y)| x * y).sum()
}

/// Compares `analytic` with central differences of `f` around `x`, for every coordinate.
fn check(name: &str, x: &[f64], analytic: &[f64], mut f: impl FnMut(&[f64]) -> f64) {
    assert_eq!(x.len(), analytic.len(), "{name}: gradient length");
    let mut xp = x.to_vec();
    let mut worst = 0.0f64;
    for i in 0..x.len() {
        xp[i] = x[i] + EPS;
        let up = f(&xp);
        xp[i] = x[i] - EPS;
        let down = f(&xp);
        xp[i] = x[i];
        let numeric = (up - down) / (2.0 * EPS);
        let err = (analytic[i] - numeric).abs() / (1e-4 + numeric.abs().max(analytic[i].abs()));
        worst = worst.max(err);
        assert!(err < 1e-5, "{name}[{i}]: analytic {} vs numeric {numeric}", analytic[i]);
    }
    eprintln!("{name}: {} coordinates, worst relative error {worst:.2e}", x.len());
}

/// Runs `f` with backends of 1 and 3 threads, each inside its own pool.
fn with_backends(mut f: impl FnMut(&CpuBackend<f64>) + Send) {
    for threads in [1, 3] {
        let pool = rayon::ThreadPoolBuilder::new().num_threads(threads).build().unwrap();
        let be = CpuBackend::<f64>::new(threads);
        pool.install(|| f(&be));
    }
}

#[test]
fn encoder_backward_matches_finite_differences() {
    let (b, t, c, v) = (3, 5, 6, 7);
    let tokens: Vec<u32> = vec![0, 3, 3, 6, 1, 2, 3, 0, 0, 5, 6, 6, 2, 1, 4];
    let wte = random(v * c, 1, 1.0);
    let wpe = random(t * c, 2, 1.0);
    let r = random(b * t * c, 3, 1.0);
    with_backends(|be| {
        let forward = |wte: &[f64], wpe: &[f64]| {
            let mut out = vec![0.0; b * t * c];
            be.encoder_forward(&mut out, &tokens, wte, wpe, t, c);
            dot(&out, &r)
        };
        let (mut dwte, mut dwpe) = (vec![0.0; v * c], vec![0.0; t * c]);
        be.encoder_backward(&mut dwte, &mut dwpe, &r, &tokens, t, c);
        check("encoder dwte", &wte, &dwte, |x| forward(x, &wpe));
        check("encoder dwpe", &wpe, &dwpe, |x| forward(&wte, x));
    });
}

#[test]
fn layernorm_backward_matches_finite_differences() {
    let (rows, c) = (9, 40);
    let inp = random(rows * c, 4, 2.0);
    let gamma: Vec<f64> = random(c, 5, 0.3).iter().map(|g| 1.0 + g).collect();
    let beta = random(c, 6, 0.3);
    let r = random(rows * c, 7, 1.0);
    with_backends(|be| {
        let forward = |inp: &[f64], gamma: &[f64], beta: &[f64]| {
            let (mut out, mut mean, mut rstd) = (vec![0.0; rows * c], vec![0.0; rows], vec![0.0; rows]);
            be.layernorm_forward(&mut out, &mut mean, &mut rstd, inp, gamma, beta, c);
            (dot(&out, &r), mean, rstd)
        };
        let (_, mean, rstd) = forward(&inp, &gamma, &beta);
        // the input gradient is ADDED to dinp: start from a known value
        let base = random(rows * c, 8, 1.0);
        let mut dinp = base.clone();
        let (mut dgamma, mut dbeta) = (vec![0.0; c], vec![0.0; c]);
        be.layernorm_backward(&mut dinp, &mut dgamma, &mut dbeta, &r, &inp, &gamma, &mean, &rstd, c);
        let dinp: Vec<f64> = dinp.iter().zip(&base).map(|(d, b)| d - b).collect();
        check("layernorm dinp", &inp, &dinp, |x| forward(x, &gamma, &beta).0);
        check("layernorm dgamma", &gamma, &dgamma, |x| forward(&inp, x, &beta).0);
        check("layernorm dbeta", &beta, &dbeta, |x| forward(&inp, &gamma, x).0);
    });
}

#[test]
fn matmul_backward_matches_finite_differences() {
    let (rows, c_in, c_out) = (11, 6, 37);
    let inp = random(rows * c_in, 9, 1.0);
    let w = random(c_in * c_out, 10, 1.0);
    let bias = random(c_out, 11, 1.0);
    let residual = random(rows * c_out, 12, 1.0);
    let r = random(rows * c_out, 13, 1.0);
    with_backends(|be| {
        let forward = |inp: &[f64], w: &[f64], bias: &[f64], residual: &[f64]| {
            let mut out = vec![0.0; rows * c_out];
            be.matmul_forward(&mut out, inp, w, Some(bias), Some(residual), c_in, c_out);
            dot(&out, &r)
        };
        // plain product (no bias, no residual) against a naive loop
        let mut out = vec![0.0; rows * c_out];
        be.matmul_forward(&mut out, &inp, &w, None, None, c_in, c_out);
        for i in 0..rows {
            for j in 0..c_out {
                let want: f64 = (0..c_in).map(|k| inp[i * c_in + k] * w[k * c_out + j]).sum();
                assert!((out[i * c_out + j] - want).abs() < 1e-12);
            }
        }
        let mut dinp = vec![7.0; rows * c_in]; // overwritten
        let (mut dw, mut db) = (vec![0.0; c_in * c_out], vec![0.0; c_out]);
        be.matmul_backward(Some(&mut dinp), &mut dw, Some(&mut db), &r, &inp, &w, c_in, c_out);
        check("matmul dinp", &inp, &dinp, |x| forward(x, &w, &bias, &residual));
        check("matmul dweight", &w, &dw, |x| forward(&inp, x, &bias, &residual));
        check("matmul dbias", &bias, &db, |x| forward(&inp, &w, x, &residual));
        check("matmul dresidual", &residual, &r, |x| forward(&inp, &w, &bias, x));
        // weight and bias gradients accumulate
        be.matmul_backward(None, &mut dw, Some(&mut db), &r, &inp, &w, c_in, c_out);
        let (mut dw1, mut db1) = (vec![0.0; c_in * c_out], vec![0.0; c_out]);
        be.matmul_backward(None, &mut dw1, Some(&mut db1), &r, &inp, &w, c_in, c_out);
        for (a, b) in dw.iter().zip(&dw1).chain(db.iter().zip(&db1)) {
            assert!((a - 2.0 * b).abs() < 1e-12 * (1.0 + b.abs()));
        }
    });
}

#[test]
fn attention_backward_matches_finite_differences() {
    check_attention(2, 5, 8, 2);
}

#[test]
fn attention_with_several_causal_blocks_matches_finite_differences() {
    // seq_len 70 > the 64-row block: exercises the skipped upper-right blocks
    // and a ragged last block.
    check_attention(1, 70, 4, 2);
}

fn check_attention(b: usize, t: usize, c: usize, heads: usize) {
    let qkv = random(b * t * 3 * c, 14, 1.0);
    let r = random(b * t * c, 15, 1.0);
    with_backends(|be| {
        let forward = |qkv: &[f64]| {
            let (mut out, mut att) = (vec![0.0; b * t * c], vec![0.0; b * heads * t * t]);
            be.attention_forward(&mut out, &mut att, qkv, AttentionShape::multi_head(t, c, heads));
            (dot(&out, &r), out, att)
        };
        let (_, out, att) = forward(&qkv);
        // causality: probabilities above the diagonal are zero, rows sum to one
        for row in att.chunks(t).enumerate().map(|(i, row)| (i % t, row)) {
            let (i, p) = row;
            assert!(p[i + 1..].iter().all(|&x| x == 0.0));
            assert!((p.iter().sum::<f64>() - 1.0).abs() < 1e-12);
        }
        // the first position attends only to itself: its output is its own V
        for h in 0..heads {
            let hs = c / heads;
            for d in 0..hs {
                assert!((out[h * hs + d] - qkv[2 * c + h * hs + d]).abs() < 1e-12);
            }
        }
        let mut dqkv = vec![3.0; b * t * 3 * c];
        let mut datt = vec![0.0; b * heads * t * t];
        be.attention_backward(&mut dqkv, &mut datt, &r, &qkv, &att, AttentionShape::multi_head(t, c, heads));
        check("attention dqkv", &qkv, &dqkv, |x| forward(x).0);
    });
}

/// Flash attention's backward (which recomputes the probabilities from the log-sum-exp
/// pairs) against finite differences of its own forward: one tile, and 70 positions
/// (two query and key tiles, the second ragged).
#[test]
fn flash_attention_backward_matches_finite_differences() {
    for (b, t, c, heads) in [(2, 5, 8, 2), (1, 70, 4, 2)] {
        let qkv = random(b * t * 3 * c, 18, 1.0);
        let r = random(b * t * c, 19, 1.0);
        with_backends(|be| {
            let forward = |qkv: &[f64]| {
                let (mut out, mut lse) = (vec![0.0; b * t * c], vec![0.0; b * heads * t * 2]);
                be.flash_attention_forward(&mut out, &mut lse, qkv, AttentionShape::multi_head(t, c, heads));
                (dot(&out, &r), out, lse)
            };
            let (_, out, lse) = forward(&qkv);
            // the first position attends only to itself: its output is its own V
            let hs = c / heads;
            for d in 0..c {
                assert!((out[d] - qkv[2 * c + d]).abs() < 1e-12, "position 0, column {d}");
            }
            // and its log-sum-exp is its one score, q·k / sqrt(hs)
            for h in 0..heads {
                let score: f64 =
                    (0..hs).map(|d| qkv[h * hs + d] * qkv[c + h * hs + d]).sum::<f64>() / (hs as f64).sqrt();
                let l = lse[h * t * 2] + lse[h * t * 2 + 1];
                assert!((l - score).abs() < 1e-12, "head {h}: log-sum-exp {l} vs {score}");
            }
            let mut dqkv = vec![3.0; b * t * 3 * c];
            let mut delta = vec![0.0; b * heads * t * 2];
            let shape = AttentionShape::multi_head(t, c, heads);
            be.flash_attention_backward(&mut dqkv, &mut delta, &r, &qkv, &out, &lse, shape);
            check("flash attention dqkv", &qkv, &dqkv, |x| forward(x).0);
        });
    }
}

/// Grouped-query attention, plain and flash: a K/V head's gradient sums over the query
/// heads of its group (6 query heads on 2 K/V heads; 70 positions cross two blocks).
#[test]
fn grouped_query_attention_backward_matches_finite_differences() {
    for (b, t) in [(2, 5), (1, 70)] {
        let shape = AttentionShape { seq_len: t, heads: 6, kv_heads: 2, head_size: 2 };
        let (c, width) = (shape.q_width(), shape.qkv_width());
        let qkv = random(b * t * width, 20, 1.0);
        let r = random(b * t * c, 21, 1.0);
        with_backends(|be| {
            let plain = |qkv: &[f64]| {
                let (mut out, mut att) = (vec![0.0; b * t * c], vec![0.0; b * 6 * t * t]);
                be.attention_forward(&mut out, &mut att, qkv, shape);
                (dot(&out, &r), out, att)
            };
            let (_, out, att) = plain(&qkv);
            let mut dqkv = vec![3.0; b * t * width];
            be.attention_backward(&mut dqkv, &mut vec![0.0; att.len()], &r, &qkv, &att, shape);
            check("grouped attention dqkv", &qkv, &dqkv, |x| plain(x).0);
            let flash = |qkv: &[f64]| {
                let (mut out, mut lse) = (vec![0.0; b * t * c], vec![0.0; b * 6 * t * 2]);
                be.flash_attention_forward(&mut out, &mut lse, qkv, shape);
                (dot(&out, &r), out, lse)
            };
            let (_, flash_out, lse) = flash(&qkv);
            assert!(flash_out.iter().zip(&out).all(|(a, b)| (a - b).abs() < 1e-12), "flash and plain outputs");
            let mut dqkv = vec![3.0; b * t * width];
            be.flash_attention_backward(&mut dqkv, &mut vec![0.0; lse.len()], &r, &qkv, &flash_out, &lse, shape);
            check("grouped flash attention dqkv", &qkv, &dqkv, |x| flash(x).0);
        });
    }
}

#[test]
fn rmsnorm_backward_matches_finite_differences() {
    let (rows, c) = (9, 40);
    let inp = random(rows * c, 22, 2.0);
    let gamma: Vec<f64> = random(c, 23, 0.3).iter().map(|g| 1.0 + g).collect();
    let r = random(rows * c, 24, 1.0);
    with_backends(|be| {
        let forward = |inp: &[f64], gamma: &[f64]| {
            let (mut out, mut rstd) = (vec![0.0; rows * c], vec![0.0; rows]);
            be.rmsnorm_forward(&mut out, &mut rstd, inp, gamma, c);
            (dot(&out, &r), rstd)
        };
        let (_, rstd) = forward(&inp, &gamma);
        // the input gradient is ADDED to dinp: start from a known value
        let base = random(rows * c, 25, 1.0);
        let mut dinp = base.clone();
        let mut dgamma = vec![0.0; c];
        be.rmsnorm_backward(&mut dinp, &mut dgamma, &r, &inp, &gamma, &rstd, c);
        let dinp: Vec<f64> = dinp.iter().zip(&base).map(|(d, b)| d - b).collect();
        check("rmsnorm dinp", &inp, &dinp, |x| forward(x, &gamma).0);
        check("rmsnorm dgamma", &gamma, &dgamma, |x| forward(&inp, x).0);
    });
}

/// RoPE's backward is the transpose of its rotation: the gradient of r · rope(x).
#[test]
fn rope_backward_matches_finite_differences() {
    let shape = AttentionShape { seq_len: 7, heads: 4, kv_heads: 2, head_size: 6 };
    let n = 2 * shape.seq_len * shape.qkv_width();
    let (x, r) = (random(n, 26, 1.0), random(n, 27, 1.0));
    with_backends(|be| {
        let forward = |x: &[f64]| {
            let mut y = x.to_vec();
            be.rope_forward(&mut y, shape, 500_000.0, Positions::run(0, shape.seq_len));
            dot(&y, &r)
        };
        let mut dx = r.clone();
        be.rope_backward(&mut dx, shape, 500_000.0, Positions::run(0, shape.seq_len));
        check("rope dx", &x, &dx, forward);
        // V is not turned: its gradient passes through
        let v = shape.q_width() + shape.kv_width();
        assert_eq!(dx[v..shape.qkv_width()], r[v..shape.qkv_width()]);
    });
}

#[test]
fn swiglu_backward_matches_finite_differences() {
    let (rows, f) = (5, 9);
    let inp = random(rows * 2 * f, 28, 2.0);
    let r = random(rows * f, 29, 1.0);
    with_backends(|be| {
        let forward = |x: &[f64]| {
            let mut out = vec![0.0; rows * f];
            be.swiglu_forward(&mut out, x, f);
            dot(&out, &r)
        };
        let mut d = vec![3.0; rows * 2 * f];
        be.swiglu_backward(&mut d, &r, &inp, f);
        check("swiglu", &inp, &d, forward);
    });
}

#[test]
fn gelu_backward_matches_finite_differences() {
    let n = 50;
    let inp = random(n, 16, 2.0);
    let r = random(n, 17, 1.0);
    with_backends(|be| {
        let forward = |x: &[f64]| {
            let mut out = vec![0.0; n];
            be.gelu_forward(&mut out, x);
            dot(&out, &r)
        };
        let mut d = r.clone();
        be.gelu_backward(&mut d, &inp);
        check("gelu", &inp, &d, forward);
    });
}

#[test]
fn crossentropy_backward_matches_finite_differences() {
    let (rows, v) = (7, 13);
    let logits = random(rows * v, 18, 2.0);
    let targets: Vec<u32> = vec![0, 12, 5, 5, 3, 7, 1];
    let dloss = 0.37;
    with_backends(|be| {
        let forward = |z: &[f64]| {
            let mut z = z.to_vec();
            let mut losses = vec![0.0; rows];
            be.crossentropy_forward(&mut z, &mut losses, &targets, v);
            dloss * be.sum(&losses)
        };
        // the loss is -log softmax
        let mut z = logits.clone();
        let mut losses = vec![0.0; rows];
        be.crossentropy_forward(&mut z, &mut losses, &targets, v);
        let row = &logits[..v];
        let lse = row.iter().map(|x| x.exp()).sum::<f64>().ln();
        assert!((losses[0] - (lse - row[0])).abs() < 1e-12);
        be.crossentropy_backward(&mut z, &targets, v, dloss);
        check("crossentropy dlogits", &logits, &z, forward);
    });
}

fn tiny_model() -> ModelSpec {
    ModelSpec::dense(2, 8, 2, 5, 11)
}

fn tiny_batch(spec: &ModelSpec, batch: usize) -> (Vec<u32>, Vec<u32>) {
    let mut rng = Rng::new(99);
    let n = batch * spec.seq_len;
    let inputs = (0..n).map(|_| rng.below(spec.vocab as u64) as u32).collect();
    let targets = (0..n).map(|_| rng.below(spec.vocab as u64) as u32).collect();
    (inputs, targets)
}

/// The model, its state with larger-than-GPT-2 weights (so that every path carries a
/// visible gradient), zeroed gradients, and those weights.
fn model_with_visible_weights(
    be: &CpuBackend<f64>,
    spec: &ModelSpec,
    batch: usize,
) -> (Gpt<CpuBackend<f64>>, FlatState<CpuBackend<f64>>, Vec<f64>) {
    let model = Gpt::new(be, spec, batch, &MemoryTracker::new());
    let mut state = FlatState::new(be, &model.layout, 3);
    assert_eq!(model.layout.total as u64, spec.param_count());
    let params: Vec<f64> = state.params.iter().enumerate().map(|(i, p)| p * 10.0 + 0.01 * (i as f64).sin()).collect();
    state.params.copy_from_slice(&params);
    state.zero_grads(be);
    (model, state, params)
}

#[test]
fn whole_model_gradient_matches_finite_differences() {
    whole_model_gradient_check(tiny_model());
}

/// The same for a tiny Llama: RMSNorm, rotary positions, 2 query heads on 1 K/V head, SwiGLU.
#[test]
fn whole_llama_gradient_matches_finite_differences() {
    whole_model_gradient_check(ModelSpec::llama(2, 8, 2, 1, 12, 5, 11));
}

fn whole_model_gradient_check(spec: ModelSpec) {
    let batch = 2;
    let (inputs, targets) = tiny_batch(&spec, batch);
    let dloss = 1.0 / (batch * spec.seq_len) as f64;
    with_backends(|be| {
        let (mut model, mut state, params) = model_with_visible_weights(be, &spec, batch);
        model.forward(be, &mut state, &inputs, &targets).unwrap();
        model.backward(be, &mut state, &inputs, &targets, dloss).unwrap();
        let analytic = state.grads.clone();
        assert!(analytic.iter().all(|g| g.is_finite()));
        let mut loss_at = |x: &[f64]| {
            state.params.copy_from_slice(x);
            model.forward(be, &mut state, &inputs, &targets).unwrap() * dloss
        };
        check(&format!("{:?} (all parameters)", spec.family), &params, &analytic, &mut loss_at);
    });
}

/// A model and its state, the loss and the gradient of one forward + backward.
fn loss_and_gradient<B: Backend>(
    be: &B,
    spec: &ModelSpec,
    inputs: &[u32],
    targets: &[u32],
    dloss: f64,
) -> (f64, Vec<B::Elem>)
where
    B::Buf: Clone + Into<Vec<B::Elem>>,
{
    let mut model = Gpt::new(be, spec, 2, &MemoryTracker::new());
    let mut state = FlatState::new(be, &model.layout, 3);
    state.zero_grads(be);
    let loss = model.forward(be, &mut state, inputs, targets).unwrap();
    model.backward(be, &mut state, inputs, targets, dloss).unwrap();
    (loss, state.grads.clone().into())
}

#[test]
fn f32_gradient_agrees_with_f64() {
    // The f32 kernels (fast exp) give the same gradient as the f64 reference.
    let spec = tiny_model();
    let (inputs, targets) = tiny_batch(&spec, 2);
    let dloss = 1.0 / (2 * spec.seq_len) as f64;
    let (l64, g64) = loss_and_gradient(&CpuBackend::<f64>::new(1), &spec, &inputs, &targets, dloss);
    let (l32, g32) = loss_and_gradient(&CpuBackend::<f32>::new(1), &spec, &inputs, &targets, dloss);
    assert!((l64 - l32).abs() < 1e-5 * l64.abs(), "loss f64 {l64} vs f32 {l32}");
    let norm: f64 = g64.iter().map(|g| g * g).sum::<f64>().sqrt();
    let diff: f64 = g64.iter().zip(&g32).map(|(a, &b)| (a - b as f64).powi(2)).sum::<f64>().sqrt();
    assert!(diff < 1e-5 * norm, "gradient difference {diff} vs norm {norm}");
}

/// Relative L2 distance of a gradient from the f64 one.
fn relative_distance<S: Stored>(reference: &[f64], got: &[S]) -> f64 {
    let norm: f64 = reference.iter().map(|g| g * g).sum::<f64>().sqrt();
    let diff: f64 = reference.iter().zip(got).map(|(a, b)| (a - b.to_f64()).powi(2)).sum::<f64>().sqrt();
    diff / norm
}

#[test]
fn bf16_and_fp16_gradients_follow_f64_to_their_precision() {
    // The same kernels on 2-byte buffers: each stored value carries a rounding error of
    // 2^-9 (bf16) or 2^-12 (fp16) relative, and the layers compound a few of them.
    let spec = tiny_model();
    let (inputs, targets) = tiny_batch(&spec, 2);
    let dloss = 1.0 / (2 * spec.seq_len) as f64;
    let (l64, g64) = loss_and_gradient(&CpuBackend::<f64>::new(1), &spec, &inputs, &targets, dloss);
    let (lb, gb) = loss_and_gradient(&CpuBackend::<bf16>::new(1), &spec, &inputs, &targets, dloss);
    let (lh, gh) = loss_and_gradient(&CpuBackend::<f16>::new(1), &spec, &inputs, &targets, dloss);
    let (db, dh) = (relative_distance(&g64, &gb), relative_distance(&g64, &gh));
    eprintln!("loss f64 {l64:.6} bf16 {lb:.6} fp16 {lh:.6}; gradient distance bf16 {db:.2e} fp16 {dh:.2e}");
    assert!((lb - l64).abs() < 3e-3 * l64 && (lh - l64).abs() < 5e-4 * l64, "losses {l64} {lb} {lh}");
    assert!(db < 2e-2 && dh < 3e-3, "gradient distances bf16 {db}, fp16 {dh}");
    assert!(dh < db, "fp16 keeps 3 more mantissa bits than bf16");
}

#[test]
fn fp16_gradients_underflow_without_loss_scaling_and_survive_with_it() {
    // A step of 32768 tokens weights each token's loss by 1/32768. With 2048 tokens in the
    // vocabulary an unlikely token's logit gradient, p / 32768 ~ 1.5e-8, is below fp16's
    // smallest subnormal (2^-24 ~ 6e-8): stored in fp16 it is 0. Scaling the loss by 2^16
    // lifts every gradient into range; dividing by 2^16 afterwards (in f32) gives it back.
    let spec = ModelSpec::dense(1, 16, 2, 8, 2048);
    let (inputs, targets) = tiny_batch(&spec, 2);
    let dloss = 1.0 / 32768.0;
    let scale = 65536.0;
    let (_, g64) = loss_and_gradient(&CpuBackend::<f64>::new(1), &spec, &inputs, &targets, dloss);
    let (_, plain) = loss_and_gradient(&CpuBackend::<f16>::new(1), &spec, &inputs, &targets, dloss);
    let (_, scaled) = loss_and_gradient(&CpuBackend::<f16>::new(1), &spec, &inputs, &targets, dloss * scale);
    let unscaled: Vec<f64> = scaled.iter().map(|g| g.to_f64() / scale).collect();
    let lost = |g: &[f64]| {
        let nonzero = g64.iter().filter(|&&x| x != 0.0).count();
        let lost = g64.iter().zip(g).filter(|&(&x, &y)| x != 0.0 && y == 0.0).count();
        lost as f64 / nonzero as f64
    };
    let plain: Vec<f64> = plain.iter().map(|g| g.to_f64()).collect();
    let (lost_plain, lost_scaled) = (lost(&plain), lost(&unscaled));
    let (d_plain, d_scaled) = (relative_distance(&g64, &plain), relative_distance(&g64, &unscaled));
    eprintln!(
        "fp16 gradient entries flushed to zero: {:.1}% unscaled, {:.2}% with a 2^16 loss scale; distance from f64 \
         {d_plain:.2e} vs {d_scaled:.2e}",
        100.0 * lost_plain,
        100.0 * lost_scaled
    );
    assert!(lost_plain > 0.3, "most of the tiny gradients vanish: {lost_plain}");
    assert!(lost_scaled < 0.01, "scaled, they survive: {lost_scaled}");
    assert!(d_scaled < 1e-2 && d_scaled < d_plain / 5.0, "{d_scaled} vs {d_plain}");
}

#[test]
fn backward_accumulates_across_micro_batches() {
    let spec = tiny_model();
    let (inputs, targets) = tiny_batch(&spec, 2);
    let be = CpuBackend::<f64>::new(1);
    let mut model = Gpt::new(&be, &spec, 2, &MemoryTracker::new());
    let mut state = FlatState::new(&be, &model.layout, 3);
    state.zero_grads(&be);
    model.forward(&be, &mut state, &inputs, &targets).unwrap();
    model.backward(&be, &mut state, &inputs, &targets, 0.1).unwrap();
    let once = state.grads.clone();
    model.forward(&be, &mut state, &inputs, &targets).unwrap();
    model.backward(&be, &mut state, &inputs, &targets, 0.1).unwrap();
    for (a, b) in state.grads.iter().zip(&once) {
        assert!((a - 2.0 * b).abs() <= 1e-12 * (1.0 + b.abs()));
    }
}

/// A Mixture-of-Experts model: 4 experts, top-2, capacity for 60% of the assignments (so
/// some are dropped), a visible balance loss.
fn tiny_moe() -> ModelSpec {
    tiny_moe_of(tiny_model())
}

fn tiny_moe_of(dense: ModelSpec) -> ModelSpec {
    ModelSpec { experts: 4, expert_top_k: 2, capacity_factor: 0.6, aux_loss_coef: 0.1, ..dense }
}

#[test]
fn mixture_of_experts_gradient_matches_finite_differences() {
    mixture_of_experts_gradient_check(tiny_moe());
}

/// The same with SwiGLU experts (a tiny Llama's blocks: no biases, gate and up).
#[test]
fn swiglu_experts_gradient_matches_finite_differences() {
    mixture_of_experts_gradient_check(tiny_moe_of(ModelSpec::llama(2, 8, 2, 1, 12, 5, 11)));
}

fn mixture_of_experts_gradient_check(spec: ModelSpec) {
    let batch = 2;
    let (inputs, targets) = tiny_batch(&spec, batch);
    let rows = batch * spec.seq_len;
    let dloss = 1.0 / rows as f64;
    with_backends(|be| {
        let (mut model, mut state, params) = model_with_visible_weights(be, &spec, batch);
        model.forward(be, &mut state, &inputs, &targets).unwrap();
        let stats = model.take_expert_stats();
        assert_eq!(stats.routings, 2, "one routing per block");
        assert_eq!(stats.assignments, (2 * rows * 2) as u64);
        assert!(stats.dropped > 0, "capacity 0.6 drops some assignments");
        model.backward(be, &mut state, &inputs, &targets, dloss).unwrap();
        let analytic = state.grads.clone();
        assert!(analytic.iter().all(|g| g.is_finite()));
        // The objective: the mean loss plus aux_loss_coef x each routing's balance loss,
        // weighted as its micro-batch's tokens are.
        let mut objective_at = |x: &[f64]| {
            state.params.copy_from_slice(x);
            let loss = model.forward(be, &mut state, &inputs, &targets).unwrap();
            let balance = model.take_expert_stats().balance_sum;
            (loss + spec.aux_loss_coef * rows as f64 * balance) * dloss
        };
        check(&format!("moe {:?} (all parameters)", spec.family), &params, &analytic, &mut objective_at);
    });
}
