//! The op-level test suite, written once and run on every backend this build has (the
//! `test_device!` pattern of candle): each check makes random inputs, runs kernels through
//! the `Backend` trait on the backend under test, and compares with the op written out
//! plainly in f64 (`reference/mod.rs`, independent of the engine) on the same inputs
//! (rounded to the tested format first). The whole-GPT check composes the kernels, so it is
//! held to the engine's own kernels run in f64.
//!
//! Backends: the CPU in fp32, bf16 and fp16 always; with `--features cuda`, CUDA in fp32, bf16
//! and fp16. The CUDA tests need a GPU and are opt-in: plain `cargo test` reports them as
//! ignored; `cargo xtask test --gpu` runs them, and fails on a machine without a GPU.
//!
//! Every element is held to |got - want| <= atol + rtol·|want|, atol a small share of the
//! tensor's largest magnitude (for elements that are sums cancelling to near zero): a
//! wholly wrong small element fails. Bounds per format in [`bound`]: fp32 (sums of a few
//! hundred products in another order), bf16 and fp16 (8 and 11 mantissa bits; stored
//! intermediate tensors, such as the attention probabilities, are rounded).
use distlab_common::ModelSpec;
use distlab_worker::backend::{Backend, CpuBackend, Stored};
use distlab_worker::memory::MemoryTracker;
use distlab_worker::model::{FlatState, Gpt};
use distlab_worker::ops::attention::{AttentionShape, Positions};
use distlab_worker::ops::ring_attention::RingShape;
use distlab_worker::rng::Rng;

#[path = "reference/mod.rs"]
mod reference;

/// The engine's own kernels in f64 (for the whole-GPT composition check).
type Reference = CpuBackend<f64>;

/// Per-element bound: |got - want| <= atol·max|want| + rtol·|want|.
#[derive(Clone, Copy, Debug)]
struct Bound {
    rtol: f64,
    atol: f64,
}

fn bound<B: Backend>() -> Bound {
    match <B::Elem as Stored>::NAME {
        "bf16" => Bound { rtol: 3e-2, atol: 1e-2 },
        "fp16" => Bound { rtol: 6e-3, atol: 3e-3 },
        _ => Bound { rtol: 1e-4, atol: 2e-6 },
    }
}

/// `n` normal values times `scale`, rounded to `B`'s format (what both backends get).
fn random<B: Backend>(n: usize, seed: u64, scale: f64) -> Vec<f64> {
    let mut rng = Rng::new(seed);
    (0..n).map(|_| B::Elem::from_f64(scale * rng.normal()).to_f64()).collect()
}

fn put<B: Backend>(be: &B, x: &[f64]) -> B::Buf {
    let mut buf = be.alloc(x.len());
    let host: Vec<B::Elem> = x.iter().map(|&v| B::Elem::from_f64(v)).collect();
    be.upload(&mut buf, &host);
    buf
}

fn get<B: Backend>(be: &B, buf: &B::Buf) -> Vec<f64> {
    let mut host = vec![B::Elem::default(); be.buf_len(buf)];
    be.download(buf, &mut host);
    host.iter().map(|v| v.to_f64()).collect()
}

/// Asserts every element within `b`: |got - want| <= atol·max|want| + rtol·|want|.
fn assert_close(name: &str, got: &[f64], want: &[f64], b: Bound) {
    assert_eq!(got.len(), want.len(), "{name}: length");
    let scale = want.iter().fold(0.0f64, |m, w| m.max(w.abs()));
    let (mut worst, mut at) = (0.0f64, 0);
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        let allowed = b.atol * scale + b.rtol * w.abs();
        let ratio = if allowed > 0.0 {
            (g - w).abs() / allowed
        } else if g == w {
            0.0
        } else {
            f64::INFINITY
        };
        if ratio > worst || ratio.is_nan() {
            (worst, at) = (if ratio.is_nan() { f64::INFINITY } else { ratio }, i);
        }
    }
    let largest = got.iter().zip(want).map(|(g, w)| (g - w).abs()).fold(0.0f64, f64::max);
    eprintln!(
        "{name}: {} values, largest error {largest:.2e} (the largest value {scale:.2e}), worst element at {worst:.2} \
         of its bound ({b:?})",
        got.len()
    );
    assert!(worst <= 1.0, "{name}[{at}]: got {} want {} ({worst:.2} times its bound {b:?})", got[at], want[at]);
}

/// Runs `op` on the backend under test and on the reference with the same inputs, and
/// compares every output buffer. `op` gets the backend and its input/output buffers.
fn compare<B: Backend>(
    be: &B,
    name: &str,
    buffers: &[Vec<f64>],
    op_tested: impl FnOnce(&B, &mut [B::Buf]),
    op_reference: impl FnOnce(&mut [Vec<f64>]),
    outputs: &[usize],
) {
    let mut tested: Vec<B::Buf> = buffers.iter().map(|x| put(be, x)).collect();
    op_tested(be, &mut tested);
    let mut reference: Vec<Vec<f64>> = buffers.to_vec();
    op_reference(&mut reference);
    for &i in outputs {
        assert_close(&format!("{name} (output {i})"), &get(be, &tested[i]), &reference[i], bound::<B>());
    }
}

/// Three distinct mutable buffers of a slice (the kernels write several at once).
fn three<T>(v: &mut [T]) -> (&mut T, &mut T, &mut T, &mut [T]) {
    let (a, rest) = v.split_first_mut().unwrap();
    let (b, rest) = rest.split_first_mut().unwrap();
    let (c, rest) = rest.split_first_mut().unwrap();
    (a, b, c, rest)
}

// ---- the checks -------------------------------------------------------------------------

fn memory_ops<B: Backend>(be: &B) {
    let x = random::<B>(70_001, 1, 1.0);
    let buf = put(be, &x);
    let want: f64 = x.iter().sum();
    let want_sq: f64 = x.iter().map(|v| v * v).sum();
    assert!((be.sum(be.all(&buf)) - want).abs() <= 1e-9 * want_sq, "sum");
    assert!((be.sum_squares(be.all(&buf)) - want_sq).abs() <= 1e-9 * want_sq, "sum of squares");
    // fill and copy on views at an offset, split in two
    let mut dst = be.alloc(1000);
    let view = be.view_mut(&mut dst, 100..900);
    let (left, right) = be.split_mut(view, 300);
    be.fill(left, 2.5);
    be.copy(right, be.view(&buf, 5..505));
    let got = get(be, &dst);
    let mut want = vec![0.0; 1000];
    want[100..400].fill(2.5);
    want[400..900].copy_from_slice(&x[5..505]);
    assert_eq!(got, want, "fill + copy on split views");
    assert_eq!(be.sum(be.view(&dst, 0..0)), 0.0, "sum of nothing");
}

fn encoder<B: Backend>(be: &B) {
    encoder_of(be, true);
}

/// Llama's embedding: the token table alone (its positions are rotary).
fn encoder_without_positions<B: Backend>(be: &B) {
    encoder_of(be, false);
}

fn encoder_of<B: Backend>(be: &B, positions: bool) {
    let (batch, t, c, v) = (3, 17, 24, 11);
    let rows = batch * t;
    // repeated tokens, so rows add into the same embedding row
    let tokens: Vec<u32> = (0..rows as u32).map(|i| (i * 7 + i / 5) % v as u32).collect();
    let mut bufs = [
        vec![0.0; rows * c],           // 0 out
        random::<B>(v * c, 2, 1.0),    // 1 wte
        random::<B>(t * c, 3, 1.0),    // 2 wpe
        random::<B>(rows * c, 4, 1.0), // 3 dout
        random::<B>(v * c, 5, 0.1),    // 4 dwte (accumulated into)
        random::<B>(t * c, 6, 0.1),    // 5 dwpe
    ];
    if !positions {
        (bufs[2], bufs[5]) = (Vec::new(), Vec::new());
    }
    fn run<X: Backend>(be: &X, b: &mut [X::Buf], tokens: &[u32], t: usize, c: usize) {
        let (out, wte, wpe, rest) = three(b);
        be.encoder_forward(be.all_mut(out), tokens, be.all(wte), be.all(wpe), t, c);
        let (dout, dwte, dwpe, _) = three(rest);
        be.encoder_backward(be.all_mut(dwte), be.all_mut(dwpe), be.all(dout), tokens, t, c);
    }
    let plain = |b: &mut [Vec<f64>]| reference::encoder(b, &tokens, t, c);
    let name = if positions { "encoder" } else { "encoder without positions" };
    compare(be, name, &bufs, |be, b| run(be, b, &tokens, t, c), plain, &[0, 4, 5]);
}

fn layernorm<B: Backend>(be: &B) {
    layernorm_of(be, 131, 96);
}

/// Rows wider than a warp keeps in registers (the CUDA kernels' other path).
fn layernorm_wide<B: Backend>(be: &B) {
    layernorm_of(be, 5, 1100);
}

fn layernorm_of<B: Backend>(be: &B, rows: usize, c: usize) {
    let bufs = [
        random::<B>(rows * c, 7, 2.0),  // 0 inp
        random::<B>(c, 8, 1.0),         // 1 gamma
        random::<B>(c, 9, 1.0),         // 2 beta
        vec![0.0; rows * c],            // 3 out
        vec![0.0; rows],                // 4 mean
        vec![0.0; rows],                // 5 rstd
        random::<B>(rows * c, 10, 1.0), // 6 dout
        random::<B>(rows * c, 11, 1.0), // 7 dinp (added into)
        random::<B>(c, 12, 1.0),        // 8 dgamma
        random::<B>(c, 13, 1.0),        // 9 dbeta
    ];
    fn run<X: Backend>(be: &X, b: &mut [X::Buf], c: usize) {
        let (inp, gamma, beta, rest) = three(b);
        let (out, mean, rstd, rest) = three(rest);
        be.layernorm_forward(
            be.all_mut(out),
            be.all_mut(mean),
            be.all_mut(rstd),
            be.all(inp),
            be.all(gamma),
            be.all(beta),
            c,
        );
        let (dout, dinp, dgamma, rest) = three(rest);
        let dbeta = &mut rest[0];
        be.layernorm_backward(
            be.all_mut(dinp),
            be.all_mut(dgamma),
            be.all_mut(dbeta),
            be.all(dout),
            be.all(inp),
            be.all(gamma),
            be.all(mean),
            be.all(rstd),
            c,
        );
    }
    compare(be, "layernorm", &bufs, |be, b| run(be, b, c), |b| reference::layernorm(b, c), &[3, 4, 5, 7, 8, 9]);
}

fn matmul<B: Backend>(be: &B) {
    let (rows, c_in, c_out) = (67, 48, 80);
    for (with_bias, with_residual, with_dinp) in [(true, true, true), (false, false, false), (true, false, true)] {
        let bufs = [
            random::<B>(rows * c_in, 14, 1.0),  // 0 inp
            random::<B>(c_in * c_out, 15, 0.2), // 1 weight
            random::<B>(c_out, 16, 1.0),        // 2 bias
            random::<B>(rows * c_out, 17, 1.0), // 3 residual
            vec![0.0; rows * c_out],            // 4 out
            random::<B>(rows * c_out, 18, 1.0), // 5 dout
            vec![0.0; rows * c_in],             // 6 dinp
            random::<B>(c_in * c_out, 19, 1.0), // 7 dweight (accumulated into)
            random::<B>(c_out, 20, 1.0),        // 8 dbias
        ];
        fn go<X: Backend>(be: &X, b: &mut [X::Buf], flags: (bool, bool, bool), c_in: usize, c_out: usize) {
            let (inp, weight, bias, rest) = three(b);
            let (residual, out, dout, rest) = three(rest);
            let (dinp, dweight, dbias, _) = three(rest);
            let (with_bias, with_residual, with_dinp) = flags;
            be.matmul_forward(
                be.all_mut(out),
                be.all(inp),
                be.all(weight),
                with_bias.then(|| be.all(bias)),
                with_residual.then(|| be.all(residual)),
                c_in,
                c_out,
            );
            be.matmul_backward(
                with_dinp.then(|| be.all_mut(dinp)),
                be.all_mut(dweight),
                with_bias.then(|| be.all_mut(dbias)),
                be.all(dout),
                be.all(inp),
                be.all(weight),
                c_in,
                c_out,
            );
        }
        let flags = (with_bias, with_residual, with_dinp);
        compare(
            be,
            &format!("matmul bias={with_bias} residual={with_residual} dinp={with_dinp}"),
            &bufs,
            |be, b| go(be, b, flags, c_in, c_out),
            |b| reference::matmul(b, flags, c_in, c_out),
            &[4, 6, 7, 8],
        );
    }
}

fn attention<B: Backend>(be: &B) {
    attention_of(be, 2, AttentionShape::multi_head(19, 32, 4));
}

/// A sequence longer than a warp keeps in registers (the CUDA kernels' other path).
fn attention_long<B: Backend>(be: &B) {
    attention_of(be, 1, AttentionShape::multi_head(1030, 8, 2));
}

/// Grouped-query attention: 6 query heads on 2 K/V heads (groups of 3), and multi-query
/// (every query head on one K/V head).
fn attention_grouped<B: Backend>(be: &B) {
    attention_of(be, 2, AttentionShape { seq_len: 19, heads: 6, kv_heads: 2, head_size: 8 });
    attention_of(be, 1, AttentionShape { seq_len: 70, heads: 4, kv_heads: 1, head_size: 6 });
}

fn attention_of<B: Backend>(be: &B, batch: usize, shape: AttentionShape) {
    let (rows, t, heads) = (batch * shape.seq_len, shape.seq_len, shape.heads);
    let (c, width) = (shape.q_width(), shape.qkv_width());
    let bufs = [
        random::<B>(rows * width, 21, 1.0), // 0 qkv
        vec![0.0; rows * c],                // 1 out
        vec![0.0; batch * heads * t * t],   // 2 att
        random::<B>(rows * c, 22, 1.0),     // 3 dout
        vec![0.0; rows * width],            // 4 dqkv
        vec![0.0; batch * heads * t * t],   // 5 datt (scratch)
    ];
    fn run<X: Backend>(be: &X, b: &mut [X::Buf], shape: AttentionShape) {
        let (qkv, out, att, rest) = three(b);
        be.attention_forward(be.all_mut(out), be.all_mut(att), be.all(qkv), shape);
        let (dout, dqkv, datt, _) = three(rest);
        be.attention_backward(be.all_mut(dqkv), be.all_mut(datt), be.all(dout), be.all(qkv), be.all(att), shape);
    }
    let plain = |b: &mut [Vec<f64>]| reference::attention(b, t, heads, shape.kv_heads, shape.head_size);
    let name = format!("attention {heads} heads on {} K/V heads", shape.kv_heads);
    compare(be, &name, &bufs, |be, b| run(be, b, shape), plain, &[1, 2, 4]);
}

/// Flash attention against the same plain attention: the output and the gradients (what
/// it keeps instead of the probabilities, one log-sum-exp per row, is its own business).
/// 19 positions fit one tile; 150 cross three query and key tiles, with a ragged last one.
fn flash_attention<B: Backend>(be: &B) {
    flash_attention_of(be, 2, AttentionShape::multi_head(19, 32, 4));
    flash_attention_of(be, 1, AttentionShape::multi_head(150, 16, 2));
}

/// Grouped-query and multi-query flash attention (no K/V repeated per query head): the
/// same groups as [`attention_grouped`], one across three tiles.
fn flash_attention_grouped<B: Backend>(be: &B) {
    flash_attention_of(be, 2, AttentionShape { seq_len: 19, heads: 6, kv_heads: 2, head_size: 8 });
    flash_attention_of(be, 1, AttentionShape { seq_len: 150, heads: 4, kv_heads: 1, head_size: 6 });
}

/// A sequence many tiles long with a ragged last one, with wide heads (the CUDA kernels'
/// registers). (Seven tiles take a seventh of the 17 that T = 1030 took on the emulated GPU,
/// where this test was half of the op suite's time.)
fn flash_attention_long<B: Backend>(be: &B) {
    flash_attention_of(be, 1, AttentionShape::multi_head(400, 256, 2));
}

fn flash_attention_of<B: Backend>(be: &B, batch: usize, shape: AttentionShape) {
    let (rows, t, heads) = (batch * shape.seq_len, shape.seq_len, shape.heads);
    let (c, width) = (shape.q_width(), shape.qkv_width());
    let bufs = [
        random::<B>(rows * width, 41, 1.0), // 0 qkv
        vec![0.0; rows * c],                // 1 out
        vec![0.0; batch * heads * t * 2],   // 2 lse (pairs)
        random::<B>(rows * c, 42, 1.0),     // 3 dout
        vec![0.0; rows * width],            // 4 dqkv
        vec![0.0; batch * heads * t * 2],   // 5 delta (scratch)
    ];
    fn run<X: Backend>(be: &X, b: &mut [X::Buf], shape: AttentionShape) {
        let (qkv, out, lse, rest) = three(b);
        be.flash_attention_forward(be.all_mut(out), be.all_mut(lse), be.all(qkv), shape);
        let (dout, dqkv, delta, _) = three(rest);
        let (dqkv, delta) = (be.all_mut(dqkv), be.all_mut(delta));
        be.flash_attention_backward(dqkv, delta, be.all(dout), be.all(qkv), be.all(out), be.all(lse), shape);
    }
    let plain = |b: &mut [Vec<f64>]| {
        let mut naive = vec![
            b[0].clone(),
            vec![0.0; rows * c],
            vec![0.0; batch * heads * t * t],
            b[3].clone(),
            vec![0.0; rows * width],
            Vec::new(),
        ];
        reference::attention(&mut naive, t, heads, shape.kv_heads, shape.head_size);
        (b[1], b[4]) = (naive[1].clone(), naive[4].clone());
    };
    let name = format!("flash attention T={t}, {heads} heads on {} K/V heads", shape.kv_heads);
    compare(be, &name, &bufs, |be, b| run(be, b, shape), plain, &[1, 4]);
}

fn gelu<B: Backend>(be: &B) {
    let n = 5000;
    let bufs = [random::<B>(n, 23, 2.0), vec![0.0; n], random::<B>(n, 24, 1.0)];
    fn run<X: Backend>(be: &X, b: &mut [X::Buf]) {
        let (inp, out, dinout, _) = three(b);
        be.gelu_forward(be.all_mut(out), be.all(inp));
        be.gelu_backward(be.all_mut(dinout), be.all(inp));
    }
    compare(be, "gelu", &bufs, run, reference::gelu, &[1, 2]);
}

/// RMSNorm, on rows narrower and wider than a warp keeps in registers.
fn rmsnorm<B: Backend>(be: &B) {
    for (rows, c) in [(131, 96), (5, 1100)] {
        let bufs = [
            random::<B>(rows * c, 61, 2.0), // 0 inp
            random::<B>(c, 62, 1.0),        // 1 gamma
            vec![0.0; rows * c],            // 2 out
            vec![0.0; rows],                // 3 rstd
            random::<B>(rows * c, 63, 1.0), // 4 dout
            random::<B>(rows * c, 64, 1.0), // 5 dinp (added into)
            random::<B>(c, 65, 1.0),        // 6 dgamma (added into)
        ];
        fn run<X: Backend>(be: &X, b: &mut [X::Buf], c: usize) {
            let (inp, gamma, out, rest) = three(b);
            let (rstd, dout, dinp, rest) = three(rest);
            be.rmsnorm_forward(be.all_mut(out), be.all_mut(rstd), be.all(inp), be.all(gamma), c);
            let dgamma = &mut rest[0];
            let (dinp, dgamma) = (be.all_mut(dinp), be.all_mut(dgamma));
            be.rmsnorm_backward(dinp, dgamma, be.all(dout), be.all(inp), be.all(gamma), be.all(rstd), c);
        }
        let plain = |b: &mut [Vec<f64>]| reference::rmsnorm(b, c);
        compare(be, &format!("rmsnorm c={c}"), &bufs, |be, b| run(be, b, c), plain, &[2, 3, 5, 6]);
    }
}

/// Rotary positions on the Q and K heads of a grouped-query qkv (V untouched), forward and
/// back, at positions far enough that the angles wrap many times.
fn rope<B: Backend>(be: &B) {
    let (batch, theta) = (2, 10_000.0);
    let shape = AttentionShape { seq_len: 37, heads: 4, kv_heads: 2, head_size: 10 };
    let n = batch * shape.seq_len * shape.qkv_width();
    let bufs = [random::<B>(n, 66, 1.0), random::<B>(n, 67, 1.0)];
    let run = |be: &B, b: &mut [B::Buf]| {
        let (x, dx) = b.split_first_mut().unwrap();
        be.rope_forward(be.all_mut(x), shape, theta, Positions::run(0, shape.seq_len));
        be.rope_backward(be.all_mut(&mut dx[0]), shape, theta, Positions::run(0, shape.seq_len));
    };
    let (width, rotated) = (shape.qkv_width(), shape.heads + shape.kv_heads);
    let plain = |b: &mut [Vec<f64>]| reference::rope(b, shape.seq_len, rotated, shape.head_size, width, theta);
    compare(be, "rope", &bufs, run, plain, &[0, 1]);
}

/// Ring attention's block, a ring of cp ranks simulated on one device (balanced and
/// contiguous splits, grouped-query heads, two sequences): every rank's output after
/// merging every block, its query gradients and each block's key and value gradients summed
/// over the ring are the whole sequence's plain attention at the rank's tokens.
#[allow(clippy::needless_range_loop)]
fn ring_attention<B: Backend>(be: &B) {
    let (batch, heads, kv_heads, hs) = (2, 4, 2, 8);
    let shape_of = |t| AttentionShape { seq_len: t, heads, kv_heads, head_size: hs };
    for (cp, balanced) in [(2, true), (3, false)] {
        let t = 2 * cp * 5;
        let whole = shape_of(t);
        let (c, width, kv_w) = (whole.q_width(), whole.qkv_width(), 2 * whole.kv_width());
        let mut plain = vec![
            random::<B>(batch * t * width, 31, 1.0),
            vec![0.0; batch * t * c],
            vec![0.0; batch * heads * t * t],
            random::<B>(batch * t * c, 32, 1.0),
            vec![0.0; batch * t * width],
            vec![0.0; batch * heads * t * t],
        ];
        reference::attention(&mut plain, t, heads, kv_heads, hs);
        let place = |r: usize| Positions::of_rank(r, cp, t, balanced);
        let tl = t / cp;
        // rank r's rows of a (batch, t, w) tensor, columns `cols`
        let rows = |r: usize, x: &[f64], w: usize, cols: std::ops::Range<usize>| -> Vec<f64> {
            let p = place(r);
            (0..batch)
                .flat_map(|b| (0..tl).map(move |i| (b, p.at(i))))
                .flat_map(|(b, at)| x[(b * t + at) * w..][cols.clone()].to_vec())
                .collect()
        };
        let q: Vec<B::Buf> = (0..cp).map(|r| put(be, &rows(r, &plain[0], width, 0..width))).collect();
        let kv: Vec<B::Buf> = (0..cp).map(|r| put(be, &rows(r, &plain[0], width, c..width))).collect();
        let mut dkv: Vec<B::Buf> = (0..cp).map(|_| put(be, &vec![0.0; batch * tl * kv_w])).collect();
        for r in 0..cp {
            let (mut out, mut lse) = (be.alloc(batch * tl * c), be.alloc(batch * heads * tl * 2));
            let dout = put(be, &rows(r, &plain[3], c, 0..c));
            let mut dq = put(be, &vec![0.0; batch * tl * width]);
            let shape = |s: usize| RingShape { heads, kv_heads, head_size: hs, q: place(r), k: place(s), own: s == r };
            let block = |s: usize| if s == r { &q[r] } else { &kv[s] };
            for step in 0..cp {
                let s = (r + cp - step) % cp;
                let first = step == 0;
                be.ring_attention_forward(
                    be.all_mut(&mut out),
                    be.all_mut(&mut lse),
                    be.all(&q[r]),
                    be.all(block(s)),
                    shape(s),
                    first,
                );
            }
            for (s, dkv_s) in dkv.iter_mut().enumerate() {
                let (dq, dkv_s, dout, qr, y, l) =
                    (be.all_mut(&mut dq), be.all_mut(dkv_s), be.all(&dout), be.all(&q[r]), be.all(&out), be.all(&lse));
                be.ring_attention_backward(dq, dkv_s, dout, qr, be.all(block(s)), y, l, shape(s));
            }
            let what = format!("ring attention cp={cp} balanced={balanced} rank {r}");
            assert_close(&format!("{what} output"), &get(be, &out), &rows(r, &plain[1], c, 0..c), bound::<B>());
            let dq_got: Vec<f64> = get(be, &dq).chunks(width).flat_map(|x| x[..c].to_vec()).collect();
            assert_close(&format!("{what} dq"), &dq_got, &rows(r, &plain[4], width, 0..c), bound::<B>());
        }
        for (s, got) in dkv.iter().enumerate() {
            let what = format!("ring attention cp={cp} balanced={balanced} block {s} dk, dv");
            assert_close(&what, &get(be, got), &rows(s, &plain[4], width, c..width), bound::<B>());
        }
    }
}

/// The FP8 cast of a tensor spanning many magnitudes (some saturate at the scale, some are
/// flushed), into E4M3 and E5M2 at power-of-two scales: every value NVIDIA's conversion
/// (the float8 crate) of the stored input times the scale, over the scale, bit for bit;
/// the amax and the counts the same.
fn fp8_cast<B: Backend>(be: &B) {
    use distlab_worker::ops::fp8::{Fp8Cast, Fp8Format};
    let n = 70_001;
    let mut rng = Rng::new(68);
    // magnitudes 2^-30 .. 2^12, either sign
    let x: Vec<f64> = (0..n)
        .map(|_| B::Elem::from_f64(rng.normal().signum() * 2f64.powf(rng.uniform() * 42.0 - 30.0)).to_f64())
        .collect();
    for (format, scale) in [(Fp8Format::E4M3, 0.25f32), (Fp8Format::E5M2, 32.0f32)] {
        let (xd, mut qd) = (put(be, &x), be.alloc(n));
        let seen = be.fp8_cast(be.all_mut(&mut qd), be.all(&xd), scale, format);
        let nvidia = |v: f32| match format {
            Fp8Format::E4M3 => float8::F8E4M3::from_f32(v).to_f32(),
            Fp8Format::E5M2 => float8::F8E5M2::from_f32(v).to_f32(),
        };
        let mut want = Fp8Cast::default();
        for &v in &x {
            let (v, scaled) = (v as f32, v as f32 * scale);
            want.amax = want.amax.max(v.abs());
            want.saturated += u64::from(scaled.abs() > format.max());
            want.flushed += u64::from(nvidia(scaled) == 0.0 && v != 0.0);
        }
        let got = get(be, &qd);
        for (i, (&g, &v)) in got.iter().zip(&x).enumerate() {
            assert_eq!(g as f32, nvidia(v as f32 * scale) / scale, "{format:?}: element {i} ({v:e})");
        }
        eprintln!("fp8_cast {format:?} x {scale}: {seen:?}");
        assert_eq!(seen, want, "{format:?}");
        assert!(seen.saturated > 1000 && seen.flushed > 1000, "{format:?}: the test reaches both edges: {seen:?}");
    }
}

fn swiglu<B: Backend>(be: &B) {
    let (rows, f) = (37, 70);
    let bufs = [
        random::<B>(rows * 2 * f, 68, 2.0), // 0 inp [gate | up]
        vec![0.0; rows * f],                // 1 out
        random::<B>(rows * f, 69, 1.0),     // 2 dout
        vec![0.0; rows * 2 * f],            // 3 dinp
    ];
    let run = |be: &B, b: &mut [B::Buf]| {
        let (inp, out, dout, rest) = three(b);
        be.swiglu_forward(be.all_mut(out), be.all(inp), f);
        be.swiglu_backward(be.all_mut(&mut rest[0]), be.all(dout), be.all(inp), f);
    };
    compare(be, "swiglu", &bufs, run, |b| reference::swiglu(b, f), &[1, 3]);
}

fn crossentropy<B: Backend>(be: &B) {
    let (rows, vocab) = (37, 1000);
    let targets: Vec<u32> = (0..rows as u32).map(|r| (r * 131) % vocab as u32).collect();
    let logits = random::<B>(rows * vocab, 25, 3.0);
    let (mut tested, mut losses) = (put(be, &logits), be.alloc(rows));
    let total = be.crossentropy_forward(be.all_mut(&mut tested), be.all_mut(&mut losses), &targets, vocab);
    let (want, want_losses, want_total) = reference::crossentropy_forward(&logits, &targets, vocab);
    let b = bound::<B>();
    assert!((total - want_total).abs() <= b.rtol * want_total.abs(), "loss sum {total} vs {want_total}");
    assert_close("crossentropy probabilities", &get(be, &tested), &want, b);
    assert_close("crossentropy losses", &get(be, &losses), &want_losses, b);
    be.crossentropy_backward(be.all_mut(&mut tested), &targets, vocab, 0.25);
    let want = reference::crossentropy_backward(&want, &targets, vocab, 0.25);
    assert_close("crossentropy dlogits", &get(be, &tested), &want, b);
}

/// The whole GPT: loss and every parameter gradient of one forward + backward, and the
/// same bits when it runs again (the backends are deterministic).
fn gpt<B: Backend>(be: &B) {
    model_check(be, ModelSpec::dense(2, 32, 4, 16, 50));
}

/// The same for a Llama: RMSNorm, rotary positions, grouped-query attention (4 query heads
/// on 2 K/V heads), SwiGLU.
fn llama<B: Backend>(be: &B) {
    model_check(be, ModelSpec::llama(2, 32, 4, 2, 48, 16, 50));
}

fn model_check<B: Backend>(be: &B, spec: ModelSpec) {
    let batch = 3;
    let tokens: Vec<u32> =
        (0..(batch * spec.seq_len + 1) as u32).map(|i| (i * 13 + i / 3) % spec.vocab as u32).collect();
    let (inputs, targets) = (&tokens[..batch * spec.seq_len], &tokens[1..]);
    fn run<X: Backend>(be: &X, spec: &ModelSpec, batch: usize, inputs: &[u32], targets: &[u32]) -> (f64, Vec<f64>) {
        let memory = MemoryTracker::new();
        let mut model = Gpt::new(be, spec, batch, &memory);
        let mut state = FlatState::new(be, &model.layout, 42);
        let loss = model.forward(be, &mut state, inputs, targets).expect("forward");
        model.backward(be, &mut state, inputs, targets, 1.0 / inputs.len() as f64).expect("backward");
        (loss, get(be, &state.grads))
    }
    let (loss, grads) = run(be, &spec, batch, inputs, targets);
    let again = run(be, &spec, batch, inputs, targets);
    assert!(again.0 == loss && again.1 == grads, "the same step twice gives different bits");
    let (want_loss, want_grads) = run(&Reference::new(1), &spec, batch, inputs, targets);
    let b = bound::<B>();
    eprintln!("{:?} loss {loss} vs {want_loss}", spec.family);
    assert!((loss - want_loss).abs() <= b.rtol * want_loss, "loss {loss} vs {want_loss}");
    // Every kernel's rounding compounds through two blocks: twice the per-kernel bound.
    let name = format!("{:?} gradients", spec.family);
    assert_close(&name, &grads, &want_grads, Bound { rtol: 2.0 * b.rtol, atol: 2.0 * b.atol });
}

// ---- one test per (check, backend) --------------------------------------------------------

/// The CUDA backend on GPU 0; these tests run only when asked for (`--gpu`), so a machine
/// without a GPU fails them, saying why.
#[cfg(feature = "cuda")]
fn cuda<S: distlab_worker::backend::cuda::DeviceElem>() -> distlab_worker::backend::cuda::CudaBackend<S> {
    distlab_worker::backend::cuda::CudaBackend::<S>::new(0)
        .unwrap_or_else(|why| panic!("the GPU tests were asked for, but the CUDA backend cannot start: {why}"))
}

macro_rules! test_device {
    ($($check:ident),+ $(,)?) => {$(
        mod $check {
            #[test]
            fn cpu_fp32() {
                super::$check(&super::CpuBackend::<f32>::new(2));
            }
            #[test]
            fn cpu_bf16() {
                super::$check(&super::CpuBackend::<half::bf16>::new(2));
            }
            #[test]
            fn cpu_fp16() {
                super::$check(&super::CpuBackend::<half::f16>::new(2));
            }
            #[cfg(feature = "cuda")]
            #[test]
            #[ignore = "needs a GPU: cargo xtask test --gpu"]
            fn cuda_fp32() {
                super::$check(&super::cuda::<f32>());
            }
            #[cfg(feature = "cuda")]
            #[test]
            #[ignore = "needs a GPU: cargo xtask test --gpu"]
            fn cuda_bf16() {
                super::$check(&super::cuda::<half::bf16>());
            }
            #[cfg(feature = "cuda")]
            #[test]
            #[ignore = "needs a GPU: cargo xtask test --gpu"]
            fn cuda_fp16() {
                super::$check(&super::cuda::<half::f16>());
            }
        }
    )+};
}

test_device!(
    memory_ops,
    encoder,
    encoder_without_positions,
    layernorm,
    layernorm_wide,
    rmsnorm,
    rope,
    matmul,
    attention,
    attention_long,
    attention_grouped,
    flash_attention,
    flash_attention_long,
    flash_attention_grouped,
    ring_attention,
    gelu,
    swiglu,
    fp8_cast,
    crossentropy,
    gpt,
    llama
);

/// A step runs on whichever thread of the pool takes it: the backend's own driver and cuBLAS
/// calls (copies, reading back, products) bind its context first, so they work on a thread
/// that has never touched CUDA (the emulated device, like a GPU, refuses them otherwise).
#[cfg(feature = "cuda")]
#[test]
#[ignore = "needs a GPU: cargo xtask test --gpu"]
fn cuda_calls_work_from_a_thread_new_to_cuda() {
    use distlab_worker::backend::Buffers;
    use distlab_worker::ops::kernels::*;

    let be = cuda::<f32>();
    let (k, n) = (8, 4);
    let x: Vec<f32> = (0..k).map(|i| i as f32).collect();
    let w: Vec<f32> = (0..k * n).map(|i| (i % 5) as f32 - 2.0).collect();
    let (mut xd, mut wd, mut copy, mut out) = (be.alloc(k), be.alloc(k * n), be.alloc(k), be.alloc(n));
    be.upload(&mut xd, &x);
    be.upload(&mut wd, &w);
    std::thread::scope(|s| {
        s.spawn(|| {
            be.copy(be.all_mut(&mut copy), be.all(&xd));
            be.matmul_forward(be.all_mut(&mut out), be.all(&copy), be.all(&wd), None, None, k, n);
        });
    });
    let copied = std::thread::scope(|s| s.spawn(|| be.read_host(be.all(&copy), |h| h.to_vec())).join().unwrap());
    assert_eq!(copied, x);
    let mut got = vec![0.0f32; n];
    be.download(&out, &mut got);
    // out[j] = sum_i x[i] W[i, j] (W is c_in x c_out); small integers, so exact in any order.
    let want: Vec<f32> = (0..n).map(|j| (0..k).map(|i| x[i] * w[i * n + j]).sum()).collect();
    assert_eq!(got, want);
}

/// The GPU's optimizer kernels against the CPU's (`ops/optimizer.rs`), over three updates of a
/// slice of the parameters (the rest must stay as they were): AdamW and SGD, fp32 and bf16
/// (whose update goes to fp32 master weights and is rounded into the model).
#[cfg(feature = "cuda")]
mod cuda_optimizer {
    use distlab_worker::backend::cuda::DeviceElem;
    use distlab_worker::backend::{Buffers, OptimizerKernels};
    use distlab_worker::ops::optimizer::{adamw_update, sgd_update, AdamWStep, Update};

    fn check<S: DeviceElem>(adamw: bool) {
        let be = super::cuda::<S>();
        let (n, range) = (3000, 100..2900);
        let weights: Vec<f32> = super::random::<distlab_worker::backend::CpuBackend<f32>>(n, 31, 0.5)
            .iter()
            .map(|&w| S::store(w as f32).load())
            .collect();
        let grads: Vec<S> = super::random::<distlab_worker::backend::CpuBackend<f32>>(n, 32, 1.0)
            .iter()
            .map(|&g| S::store(g as f32))
            .collect();
        let model: Vec<S> = weights.iter().map(|&w| S::store(w)).collect();
        let (mut params, mut grads_d) = (be.alloc(n), be.alloc(n));
        be.upload(&mut params, &model);
        be.upload(&mut grads_d, &grads);
        let mut state = be.optimizer_buffers(n, adamw, || weights.clone());
        // The CPU reference: fp32 weights (the master copy), moments.
        let (mut want, mut m, mut v) = (weights.clone(), vec![0.0f32; n], vec![0.0f32; n]);
        for step in 1..=3 {
            let hp =
                AdamWStep { lr: 1e-2, beta1: 0.9, beta2: 0.95, eps: 1e-8, weight_decay: 0.1, step, grad_scale: 0.5 };
            let r = range.clone();
            let (p, g) = (be.view_mut(&mut params, r.clone()), be.view(&grads_d, r.clone()));
            if adamw {
                be.optimizer_update(p, g, &mut state, r.clone(), &Update::AdamW(hp.clone()));
                adamw_update(&mut want[r.clone()], &grads[r.clone()], &mut m[r.clone()], &mut v[r], &hp);
            } else {
                let update = Update::Sgd { lr: hp.lr, weight_decay: hp.weight_decay, grad_scale: hp.grad_scale };
                be.optimizer_update(p, g, &mut state, r.clone(), &update);
                sgd_update(&mut want[r.clone()], &grads[r], hp.lr, hp.weight_decay, hp.grad_scale);
            }
        }
        let mut got = vec![S::default(); n];
        be.download(&params, &mut got);
        let scale = want.iter().fold(0.0f32, |a, w| a.max(w.abs()));
        let worst =
            got.iter().zip(&want).map(|(g, w)| (g.load() - S::store(*w).load()).abs() / scale).fold(0.0, f32::max);
        eprintln!(
            "{} {}: largest error {worst:.2e} of max |w| {scale:.3}",
            if adamw { "adamw" } else { "sgd" },
            S::NAME
        );
        // The same operations in the same order, each rounded once (1 - beta made in f64 on
        // the host, no multiply-adds contracted): bit for bit, fp32 and bf16 alike.
        assert_eq!(worst, 0.0, "largest error {worst:e}");
        assert_eq!(&got[..100], &model[..100], "parameters outside the range are untouched");
        assert_eq!(&got[2900..], &model[2900..], "parameters outside the range are untouched");
    }

    #[test]
    #[ignore = "needs a GPU: cargo xtask test --gpu"]
    fn adamw_fp32() {
        check::<f32>(true);
    }
    #[test]
    #[ignore = "needs a GPU: cargo xtask test --gpu"]
    fn adamw_bf16() {
        check::<half::bf16>(true);
    }
    #[test]
    #[ignore = "needs a GPU: cargo xtask test --gpu"]
    fn sgd_fp32() {
        check::<f32>(false);
    }
    #[test]
    #[ignore = "needs a GPU: cargo xtask test --gpu"]
    fn sgd_bf16() {
        check::<half::bf16>(false);
    }
}
