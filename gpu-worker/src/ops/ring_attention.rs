//! Ring attention's block (Liu et al. 2023; the merge is FlashAttention's): causal attention
//! of this rank's queries on one block of keys and values, the block the ring has brought,
//! merged into what the blocks before it gave. Each rank holds T/cp tokens of a sequence,
//! in one run or (causal load balancing) two: with chunks of T/(2cp) tokens, rank r holds
//! chunks r and 2cp-1-r, so every rank has as many (query, key) pairs under the diagonal.
//!
//!   forward (per query row i and head h; its key/value head g = h / group):
//!     S_j = q_i · k_j / sqrt(hs)          for the block's keys at or before i's position
//!     m = max_j S_j,  l = Σ_j exp(S_j - m),  o = Σ_j exp(S_j - m) v_j / l,  L_b = m + ln l
//!     merged with the rows' (O, L) so far:  L' = ln(exp L + exp L_b)
//!                                           O  = O exp(L - L') + o exp(L_b - L')
//!   backward (per block, with the final O and L; D_i = rowsum(dO_i ∘ O_i)):
//!     P_ij = exp(S_ij - L_i),  dv_j += P_ij dO_i,  dS_ij = P_ij (dO_i · v_j - D_i) / sqrt(hs)
//!     dq_i += dS_ij k_j,       dk_j += dS_ij q_i
//!
//! The first block a rank merges is its own: every query sees at least its own key there, so
//! every row's L is finite from the start. L is kept as a (hi, lo) pair of the storage
//! format, as flash attention's (`flash_attention.rs`).

use rayon::prelude::*;

use crate::backend::buffers::Buffers;
use crate::backend::cpu::CpuBackend;
use crate::ops::attention::Positions;
use crate::ops::flash_attention::{load_pair, store_pair};
use crate::ops::float::{Float, Stored};

/// A block's shape: the query and key/value heads, their width, and where the queries and
/// the keys sit. Per sequence, `q` rows are [Q | K | V] (this rank's qkv, Q read), `kv`
/// rows hold K and V (`own`: this rank's qkv, its own block; else a block that travelled,
/// rows [K | V]), `out` rows the heads' outputs, `lse` (heads, queries, 2), `dkv` rows
/// [K | V].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RingShape {
    pub heads: usize,
    pub kv_heads: usize,
    pub head_size: usize,
    pub q: Positions,
    pub k: Positions,
    pub own: bool,
}

impl RingShape {
    fn q_width(&self) -> usize {
        self.heads * self.head_size
    }

    fn kv_width(&self) -> usize {
        self.kv_heads * self.head_size
    }

    /// Width of a row of the rank's qkv.
    pub fn qkv_width(&self) -> usize {
        self.q_width() + 2 * self.kv_width()
    }

    /// A `kv` row's width and where its K starts (V is kv_width later).
    pub fn kv_row(&self) -> (usize, usize) {
        match self.own {
            true => (self.qkv_width(), self.q_width()),
            false => (2 * self.kv_width(), 0),
        }
    }

    /// Query head `h`'s key and value columns in a `kv` row, and in a [K | V] row.
    fn kv_columns(&self, h: usize) -> ((usize, usize), (usize, usize)) {
        let g = h / (self.heads / self.kv_heads);
        let (k, at) = (self.kv_width(), g * self.head_size);
        let (_, k0) = self.kv_row();
        ((k0 + at, k0 + k + at), (at, k + at))
    }

    /// Whether query `i` sees key `j`.
    fn sees(&self, i: usize, j: usize) -> bool {
        self.k.at(j) <= self.q.at(i)
    }
}

fn dot<F: Float, S: Stored<Acc = F>>(a: &[S], b: &[S]) -> F {
    a.iter().zip(b).map(|(x, y)| x.load() * y.load()).sum()
}

/// One sequence: merges the block `kv` into `out` and `lse` (`first`: the rank's own block,
/// which sets them).
pub fn ring_attention_forward<F: Float, S: Stored<Acc = F>>(
    out: &mut [S],
    lse: &mut [S],
    q: &[S],
    kv: &[S],
    shape: RingShape,
    first: bool,
) {
    let (hs, tq, tk) = (shape.head_size, shape.q.tokens(), shape.k.tokens());
    let (qkv_w, (kv_w, _), out_w) = (shape.qkv_width(), shape.kv_row(), shape.q_width());
    let scale = F::from_f64(1.0 / (hs as f64).sqrt());
    let mut scores = vec![F::ZERO; tk];
    let mut o = vec![F::ZERO; hs];
    for h in 0..shape.heads {
        let ((kc, vc), _) = shape.kv_columns(h);
        for i in 0..tq {
            let qi = &q[i * qkv_w + h * hs..][..hs];
            let mut m = None::<F>;
            for (j, s) in scores.iter_mut().enumerate().filter(|(j, _)| shape.sees(i, *j)) {
                *s = dot(qi, &kv[j * kv_w + kc..][..hs]) * scale;
                m = Some(m.map_or(*s, |m| m.max(*s)));
            }
            let Some(m) = m else {
                debug_assert!(!first, "the rank's own block has every query's own key");
                continue;
            };
            let mut l = F::ZERO;
            o.iter_mut().for_each(|x| *x = F::ZERO);
            for (j, &s) in scores.iter().enumerate().filter(|(j, _)| shape.sees(i, *j)) {
                let p = (s - m).exp();
                l += p;
                for (x, v) in o.iter_mut().zip(&kv[j * kv_w + vc..][..hs]) {
                    *x += p * v.load();
                }
            }
            let block_lse = m + l.ln();
            let (row, pair) = (&mut out[i * out_w + h * hs..][..hs], &mut lse[(h * tq + i) * 2..][..2]);
            if first {
                for (y, &x) in row.iter_mut().zip(&o) {
                    *y = S::store(x / l);
                }
                store_pair(pair, block_lse);
            } else {
                let before = load_pair(pair);
                let merged = before.max(block_lse)
                    + ((before - before.max(block_lse)).exp() + (block_lse - before.max(block_lse)).exp()).ln();
                let (keep, add) = ((before - merged).exp(), (block_lse - merged).exp() / l);
                for (y, &x) in row.iter_mut().zip(&o) {
                    *y = S::store(y.load() * keep + x * add);
                }
                store_pair(pair, merged);
            }
        }
    }
}

/// One sequence: ADDS the block's share of the query gradients into the Q columns of
/// `dq` (rows as `q`'s) and of its keys' and values' into `dkv` (rows as `kv`'s), from the
/// final `out` and `lse`.
#[allow(clippy::too_many_arguments)]
pub fn ring_attention_backward<F: Float, S: Stored<Acc = F>>(
    dq: &mut [S],
    dkv: &mut [S],
    dout: &[S],
    q: &[S],
    kv: &[S],
    out: &[S],
    lse: &[S],
    shape: RingShape,
) {
    let (hs, tq, tk) = (shape.head_size, shape.q.tokens(), shape.k.tokens());
    let (qkv_w, (kv_w, _), out_w, dkv_w) = (shape.qkv_width(), shape.kv_row(), shape.q_width(), 2 * shape.kv_width());
    let scale = F::from_f64(1.0 / (hs as f64).sqrt());
    // (summed in the compute format, stored once)
    let mut dq_acc: Vec<F> = dq.iter().map(|x| x.load()).collect();
    let mut dkv_acc: Vec<F> = dkv.iter().map(|x| x.load()).collect();
    for h in 0..shape.heads {
        let ((kc, vc), (dkc, dvc)) = shape.kv_columns(h);
        for i in 0..tq {
            let (qi, dyi) = (&q[i * qkv_w + h * hs..][..hs], &dout[i * out_w + h * hs..][..hs]);
            let d: F = dot(dyi, &out[i * out_w + h * hs..][..hs]);
            let l = load_pair(&lse[(h * tq + i) * 2..][..2]);
            for j in (0..tk).filter(|&j| shape.sees(i, j)) {
                let (kj, vj) = (&kv[j * kv_w + kc..][..hs], &kv[j * kv_w + vc..][..hs]);
                let p = (dot(qi, kj) * scale - l).exp();
                let ds = p * (dot(dyi, vj) - d) * scale;
                for e in 0..hs {
                    dkv_acc[j * dkv_w + dvc + e] += p * dyi[e].load();
                    dq_acc[i * qkv_w + h * hs + e] += ds * kj[e].load();
                    dkv_acc[j * dkv_w + dkc + e] += ds * qi[e].load();
                }
            }
        }
    }
    for (y, x) in dq.iter_mut().zip(&dq_acc) {
        *y = S::store(*x);
    }
    for (y, x) in dkv.iter_mut().zip(&dkv_acc) {
        *y = S::store(*x);
    }
}

/// Ring attention's block on a backend's views (the conventions: `backend/mod.rs`), for
/// every sequence of a micro-batch at once.
pub trait RingAttentionKernels: Buffers {
    /// Merges the attention of `q`'s queries on the block `kv` into `out` and `lse`
    /// ((batch, heads, queries, 2) pairs); `first` (the rank's own block): sets them.
    fn ring_attention_forward(
        &self,
        out: Self::ViewMut<'_>,
        lse: Self::ViewMut<'_>,
        q: Self::View<'_>,
        kv: Self::View<'_>,
        shape: RingShape,
        first: bool,
    );

    /// ADDS the block's share of the query gradients into the Q columns of `dq` (rows as
    /// `q`'s) and of its keys' and values' into `dkv` ([K | V] rows), from the final `out`
    /// and `lse`.
    #[allow(clippy::too_many_arguments)]
    fn ring_attention_backward(
        &self,
        dq: Self::ViewMut<'_>,
        dkv: Self::ViewMut<'_>,
        dout: Self::View<'_>,
        q: Self::View<'_>,
        kv: Self::View<'_>,
        out: Self::View<'_>,
        lse: Self::View<'_>,
        shape: RingShape,
    );
}

impl<S: Stored> RingAttentionKernels for CpuBackend<S> {
    fn ring_attention_forward(&self, out: &mut [S], lse: &mut [S], q: &[S], kv: &[S], shape: RingShape, first: bool) {
        let (tq, tk) = (shape.q.tokens(), shape.k.tokens());
        out.par_chunks_mut(tq * shape.q_width())
            .zip(lse.par_chunks_mut(shape.heads * tq * 2))
            .zip(q.par_chunks(tq * shape.qkv_width()))
            .zip(kv.par_chunks(tk * shape.kv_row().0))
            .for_each(|(((y, l), q), kv)| ring_attention_forward(y, l, q, kv, shape, first));
    }

    fn ring_attention_backward(
        &self,
        dq: &mut [S],
        dkv: &mut [S],
        dout: &[S],
        q: &[S],
        kv: &[S],
        out: &[S],
        lse: &[S],
        shape: RingShape,
    ) {
        let (tq, tk, c) = (shape.q.tokens(), shape.k.tokens(), shape.q_width());
        dq.par_chunks_mut(tq * shape.qkv_width())
            .zip(dkv.par_chunks_mut(tk * 2 * shape.kv_width()))
            .zip(dout.par_chunks(tq * c))
            .zip(q.par_chunks(tq * shape.qkv_width()))
            .zip(kv.par_chunks(tk * shape.kv_row().0))
            .zip(out.par_chunks(tq * c))
            .zip(lse.par_chunks(shape.heads * tq * 2))
            .for_each(|((((((dq, dkv), dy), q), kv), y), l)| ring_attention_backward(dq, dkv, dy, q, kv, y, l, shape));
    }
}

/// The launch of ring attention's kernels (`ring_attention.cu`): one thread per query row
/// (forward, dQ) or key row of a K/V head (dK, dV).
#[cfg(feature = "cuda")]
mod cuda {
    use super::{RingAttentionKernels, RingShape};
    use crate::backend::cuda::CudaBackend;
    use crate::ops::cuda::{check_shape, elementwise, int, launch, DeviceElem, DeviceView, DeviceViewMut};

    /// The widest head the kernels hold (`RING_MAX_HEAD`, checked by the spec).
    const RING_MAX_HEAD: usize = distlab_common::backends::CUDA_RING_MAX_HEAD;

    /// The shape's numbers in the kernels' order (`RingLayout`).
    fn layout(s: &RingShape) -> [i32; 14] {
        let (kv_stride, k_col) = s.kv_row();
        [
            s.q.tokens(),
            s.k.tokens(),
            s.heads,
            s.kv_heads,
            s.head_size,
            s.qkv_width(),
            kv_stride,
            k_col,
            s.q.starts[0],
            s.q.starts[1],
            s.q.part,
            s.k.starts[0],
            s.k.starts[1],
            s.k.part,
        ]
        .map(int)
    }

    impl<S: DeviceElem> RingAttentionKernels for CudaBackend<S> {
        fn ring_attention_forward(
            &self,
            out: DeviceViewMut<'_, S>,
            lse: DeviceViewMut<'_, S>,
            q: DeviceView<'_, S>,
            kv: DeviceView<'_, S>,
            shape: RingShape,
            first: bool,
        ) {
            let gpu = &self.launcher;
            assert!(shape.head_size <= RING_MAX_HEAD, "ring attention: head size above {RING_MAX_HEAD}");
            let batch = q.len / (shape.q.tokens() * shape.qkv_width());
            let rows = batch * shape.heads * shape.q.tokens();
            check_shape(
                "ring_attention_forward",
                &[
                    (out.len, batch * shape.q.tokens() * shape.q_width()),
                    (lse.len, rows * 2),
                    (kv.len, batch * shape.k.tokens() * shape.kv_row().0),
                ],
            );
            let layout = gpu.upload(&layout(&shape));
            let scale = 1.0 / (shape.head_size as f32).sqrt();
            launch!(
                gpu,
                "ring_attention_forward",
                elementwise(rows),
                out.ptr,
                lse.ptr,
                q.ptr,
                kv.ptr,
                rows as i64,
                gpu.ptr_of(&layout),
                i32::from(first),
                scale
            );
        }

        fn ring_attention_backward(
            &self,
            dq: DeviceViewMut<'_, S>,
            dkv: DeviceViewMut<'_, S>,
            dout: DeviceView<'_, S>,
            q: DeviceView<'_, S>,
            kv: DeviceView<'_, S>,
            out: DeviceView<'_, S>,
            lse: DeviceView<'_, S>,
            shape: RingShape,
        ) {
            let gpu = &self.launcher;
            assert!(shape.head_size <= RING_MAX_HEAD, "ring attention: head size above {RING_MAX_HEAD}");
            let batch = q.len / (shape.q.tokens() * shape.qkv_width());
            let rows = batch * shape.heads * shape.q.tokens();
            let key_rows = batch * shape.kv_heads * shape.k.tokens();
            check_shape(
                "ring_attention_backward",
                &[
                    (dq.len, q.len),
                    (dkv.len, key_rows * 2 * shape.head_size),
                    (dout.len, out.len),
                    (out.len, batch * shape.q.tokens() * shape.q_width()),
                    (lse.len, rows * 2),
                    (kv.len, batch * shape.k.tokens() * shape.kv_row().0),
                ],
            );
            let layout = gpu.upload(&layout(&shape));
            let scale = 1.0 / (shape.head_size as f32).sqrt();
            let (dout, q, kv, out, lse, layout) = (dout.ptr, q.ptr, kv.ptr, out.ptr, lse.ptr, gpu.ptr_of(&layout));
            launch!(
                gpu,
                "ring_attention_backward_query",
                elementwise(rows),
                dq.ptr,
                dout,
                q,
                kv,
                out,
                lse,
                rows as i64,
                layout,
                scale
            );
            launch!(
                gpu,
                "ring_attention_backward_key",
                elementwise(key_rows),
                dkv.ptr,
                dout,
                q,
                kv,
                out,
                lse,
                key_rows as i64,
                layout,
                scale
            );
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::rng::Rng;

    /// Causal attention of a whole sequence in f64 (the reference): out and the gradient
    /// of `sum(out ∘ dout)` by q, k and v, rows [Q | K | V].
    fn whole(qkv: &[f64], dout: &[f64], t: usize, shape: (usize, usize, usize)) -> (Vec<f64>, Vec<f64>) {
        let (heads, kv_heads, hs) = shape;
        let (qw, kvw) = (heads * hs, kv_heads * hs);
        let w = qw + 2 * kvw;
        let (mut out, mut dqkv) = (vec![0.0; t * qw], vec![0.0; t * w]);
        for h in 0..heads {
            let g = h / (heads / kv_heads);
            let (kc, vc) = (qw + g * hs, qw + kvw + g * hs);
            for i in 0..t {
                let s: Vec<f64> = (0..=i)
                    .map(|j| (0..hs).map(|e| qkv[i * w + h * hs + e] * qkv[j * w + kc + e]).sum::<f64>())
                    .map(|x| x / (hs as f64).sqrt())
                    .collect();
                let m = s.iter().cloned().fold(f64::MIN, f64::max);
                let z: f64 = s.iter().map(|x| (x - m).exp()).sum();
                let p: Vec<f64> = s.iter().map(|x| (x - m).exp() / z).collect();
                for e in 0..hs {
                    out[i * qw + h * hs + e] = (0..=i).map(|j| p[j] * qkv[j * w + vc + e]).sum();
                }
                let dp: Vec<f64> =
                    (0..=i).map(|j| (0..hs).map(|e| dout[i * qw + h * hs + e] * qkv[j * w + vc + e]).sum()).collect();
                let d: f64 = (0..=i).map(|j| p[j] * dp[j]).sum();
                for j in 0..=i {
                    let ds = p[j] * (dp[j] - d) / (hs as f64).sqrt();
                    for e in 0..hs {
                        dqkv[j * w + vc + e] += p[j] * dout[i * qw + h * hs + e];
                        dqkv[i * w + h * hs + e] += ds * qkv[j * w + kc + e];
                        dqkv[j * w + kc + e] += ds * qkv[i * w + h * hs + e];
                    }
                }
            }
        }
        (out, dqkv)
    }

    /// cp ranks round a ring, balanced or not, grouped-query heads: every rank's output
    /// and its q, k and v gradients are the whole sequence's at its tokens.
    #[test]
    fn a_ring_of_blocks_is_attention_of_the_whole_sequence() {
        let (heads, kv_heads, hs) = (4, 2, 8);
        let w = (heads + 2 * kv_heads) * hs;
        for (cp, balanced) in [(2, false), (2, true), (4, true), (3, false)] {
            let t = 2 * cp * 3;
            let mut rng = Rng::new(7);
            let qkv: Vec<f64> = (0..t * w).map(|_| rng.normal()).collect();
            let dout: Vec<f64> = (0..t * heads * hs).map(|_| rng.normal()).collect();
            let (want_out, want_dqkv) = whole(&qkv, &dout, t, (heads, kv_heads, hs));
            let place = |r: usize| Positions::of_rank(r, cp, t, balanced);
            let rows = |r: usize, width: usize, from: &[f64], cols: std::ops::Range<usize>| -> Vec<f64> {
                let p = place(r);
                (0..p.tokens()).flat_map(|i| from[p.at(i) * width..][cols.clone()].to_vec()).collect()
            };
            let q: Vec<Vec<f64>> = (0..cp).map(|r| rows(r, w, &qkv, 0..w)).collect();
            let kv: Vec<Vec<f64>> = (0..cp).map(|r| rows(r, w, &qkv, heads * hs..w)).collect();
            let dy: Vec<Vec<f64>> = (0..cp).map(|r| rows(r, heads * hs, &dout, 0..heads * hs)).collect();
            let tl = t / cp;
            let close = |a: &[f64], b: &[f64], what: String| {
                for (x, y) in a.iter().zip(b) {
                    assert!((x - y).abs() < 1e-9, "cp={cp} balanced={balanced} {what}: {x} vs {y}");
                }
            };
            // each block's key and value gradients, summed over the ring (they travel with it)
            let mut dkv: Vec<Vec<f64>> = (0..cp).map(|_| vec![0.0; tl * 2 * kv_heads * hs]).collect();
            for r in 0..cp {
                let (mut out, mut lse) = (vec![0.0; tl * heads * hs], vec![0.0; heads * tl * 2]);
                // the ring: the own block first, then the one from r-1, r-2, ...
                for step in 0..cp {
                    let s = (r + cp - step) % cp;
                    let own = s == r;
                    let shape = RingShape { heads, kv_heads, head_size: hs, q: place(r), k: place(s), own };
                    let block = if own { &q[r] } else { &kv[s] };
                    ring_attention_forward(&mut out, &mut lse, &q[r], block, shape, step == 0);
                }
                close(&out, &rows(r, heads * hs, &want_out, 0..heads * hs), format!("rank {r} output"));
                let mut dq = vec![0.0; tl * w];
                for (s, dkv_s) in dkv.iter_mut().enumerate() {
                    let own = s == r;
                    let shape = RingShape { heads, kv_heads, head_size: hs, q: place(r), k: place(s), own };
                    let block = if own { &q[r] } else { &kv[s] };
                    ring_attention_backward(&mut dq, dkv_s, &dy[r], &q[r], block, &out, &lse, shape);
                }
                let dq_only: Vec<f64> = dq.chunks(w).flat_map(|row| row[..heads * hs].to_vec()).collect();
                close(&dq_only, &rows(r, w, &want_dqkv, 0..heads * hs), format!("rank {r} dq"));
            }
            for (s, got) in dkv.iter().enumerate() {
                close(got, &rows(s, w, &want_dqkv, heads * hs..w), format!("block {s} dk, dv"));
            }
        }
    }
}
