//! FlashAttention (Dao et al. 2022; the backward in FlashAttention-2's order): the causal
//! self-attention of attention.rs (multi-head or grouped-query: query head h reads K/V head
//! g = h / group, no K/V copied per query head), computed tile by tile for one sequence at
//! a time. The result is the same; what is kept differs: no (heads, T, T) matrix of
//! probabilities, only the output and one log-sum-exp L per row.
//!
//!   forward (per head; query tile i, key tiles j <= i; m = -inf, l = 0, O = 0 at first):
//!     S  = Qi Kjᵀ / sqrt(hs)                          (masked above the diagonal)
//!     m' = max(m, rowmax S),   P = exp(S - m')
//!     l  = l exp(m - m') + rowsum P,   O = O exp(m - m') + P Vj,   m = m'
//!     last: O = O / l,   L = m + ln l
//!   backward (per head; D = rowsum(dO ∘ O), attention.rs's sum_k P_ik dP_ik):
//!     P  = exp(Qi Kjᵀ / sqrt(hs) - L)                 (recomputed, tile by tile)
//!     dVj += Pᵀ dOi,   dP = dOi Vjᵀ,   dS = P ∘ (dP - D) / sqrt(hs)
//!     dQi += dS Kj,    dKj += dSᵀ Qi
//!   (with grouped-query attention dK and dV of K/V head g sum over its group's query heads)
//!
//! Each head's Q, K, V (and O, dO) are widened to the compute format once and its
//! gradients summed there, stored once at the end: the tiles are what a GPU keeps in
//! shared memory. L and D are per-row scalars that a 2-byte format would blur (bf16 keeps
//! 8 bits: L = 5 would be off by 0.02, every P by 2%), so each is kept as a pair of the
//! storage format, hi = round(x) and lo = round(x - hi), whose sum is within about 2^-16
//! of x relative even in bf16 (exact in f32).

use rayon::prelude::*;

use crate::backend::buffers::Buffers;
use crate::backend::cpu::CpuBackend;
use crate::memory::kernel_scratch;
use crate::ops::attention::AttentionShape;
use crate::ops::float::{lane_max, lane_sum, Float, Stored};
use crate::ops::gemm::{matmul_widened, Mat, MatMut, Parallelism};
use crate::ops::simd::simd_kernel;

/// Rows of a query tile and of a key tile.
const TILE: usize = 64;

/// Tiles `[r0, r1)` covering `0..t`.
fn tiles(t: usize) -> impl Iterator<Item = (usize, usize)> {
    (0..t.div_ceil(TILE)).map(move |b| (b * TILE, ((b + 1) * TILE).min(t)))
}

/// Elements a per-row scalar takes in the storage format (a (hi, lo) pair).
pub const PAIR: usize = 2;

pub(crate) fn store_pair<S: Stored>(pair: &mut [S], x: S::Acc) {
    let hi = S::store(x);
    pair[0] = hi;
    pair[1] = S::store(x - hi.load());
}

pub(crate) fn load_pair<S: Stored>(pair: &[S]) -> S::Acc {
    pair[0].load() + pair[1].load()
}

/// One head's columns of `src` (rows of `stride` elements, the head's `hs` columns from
/// `col`) as a dense (t, hs) matrix of the compute format.
fn widen_head<S: Stored>(dst: &mut [S::Acc], src: &[S], t: usize, hs: usize, stride: usize, col: usize) {
    for (i, row) in dst.chunks_exact_mut(hs).enumerate().take(t) {
        S::widen_slice(&src[i * stride + col..i * stride + col + hs], row);
    }
}

/// The inverse: rounds a dense (t, hs) matrix into the head's columns of `dst`.
fn narrow_head<S: Stored>(dst: &mut [S], src: &[S::Acc], t: usize, hs: usize, stride: usize, col: usize) {
    for (i, row) in src.chunks_exact(hs).enumerate().take(t) {
        S::narrow_slice(row, &mut dst[i * stride + col..i * stride + col + hs]);
    }
}

/// Key columns of tile row `i` (global row `r0 + i`) at or before the diagonal, in a key
/// tile starting at `c0` with `cols` columns. Tiles are aligned, so a key tile at or
/// before a query tile always has at least one.
fn live_columns(r0: usize, i: usize, c0: usize, cols: usize) -> usize {
    (r0 + i + 1).saturating_sub(c0).min(cols)
}

/// A (rows, cols) view of a tile buffer whose rows are TILE apart.
fn tile_mut<F>(buf: &mut [F], rows: usize, cols: usize) -> MatMut<'_, F> {
    MatMut::new(buf, rows, cols, TILE, 1)
}

fn tile<F>(buf: &[F], rows: usize, cols: usize) -> Mat<'_, F> {
    Mat::new(buf, rows, cols, TILE, 1)
}

/// `hs` columns of the dense (t, hs) matrix `m`, rows `r0..r1`.
fn rows_of<F>(m: &[F], r0: usize, r1: usize, hs: usize) -> Mat<'_, F> {
    Mat::new(&m[r0 * hs..], r1 - r0, hs, hs, 1)
}

fn rows_of_mut<F>(m: &mut [F], r0: usize, r1: usize, hs: usize) -> MatMut<'_, F> {
    MatMut::new(&mut m[r0 * hs..], r1 - r0, hs, hs, 1)
}

simd_kernel! {
    /// One sequence: `out` (T, heads hs); `lse` (heads, T, PAIR) keeps L for the backward pass.
    pub fn flash_attention_forward<F: Float, S: Stored<Acc = F>>(
        out: &mut [S],
        lse: &mut [S],
        qkv: &[S],
        shape: AttentionShape,
    ) {
        let AttentionShape { seq_len: t, heads, head_size: hs, .. } = shape;
        let (c, c3) = (shape.q_width(), shape.qkv_width());
        let scale = F::from_f64(1.0 / (hs as f64).sqrt());
        let _scratch = kernel_scratch::<F>(4 * t * hs + TILE * TILE + 2 * TILE);
        let (mut q, mut k, mut v, mut o) = (
            vec![F::ZERO; t * hs],
            vec![F::ZERO; t * hs],
            vec![F::ZERO; t * hs],
            vec![F::ZERO; t * hs],
        );
        let mut s = vec![F::ZERO; TILE * TILE];
        let (mut m, mut l) = (vec![F::ZERO; TILE], vec![F::ZERO; TILE]);
        for (h, lse) in lse.chunks_exact_mut(t * PAIR).enumerate().take(heads) {
            let (q_col, k_col, v_col) = shape.columns(h);
            widen_head(&mut q, qkv, t, hs, c3, q_col);
            if h % shape.group() == 0 {
                widen_head(&mut k, qkv, t, hs, c3, k_col);
                widen_head(&mut v, qkv, t, hs, c3, v_col);
            }
            o.fill(F::ZERO);
            for (r0, r1) in tiles(t) {
                let rows = r1 - r0;
                m[..rows].fill(F::from_f64(f64::NEG_INFINITY));
                l[..rows].fill(F::ZERO);
                for (c0, c1) in tiles(r1) {
                    let cols = c1 - c0;
                    // S = Qi Kjᵀ / sqrt(hs)
                    let (qi, kj) = (rows_of(&q, r0, r1, hs), rows_of(&k, c0, c1, hs));
                    matmul_widened(tile_mut(&mut s, rows, cols), false, qi, kj.t(), scale, Parallelism::None);
                    for i in 0..rows {
                        let row = &mut s[i * TILE..i * TILE + cols];
                        let live = live_columns(r0, i, c0, cols);
                        let m_new = lane_max(live, |j| row[j]).max(m[i]);
                        let correction = (m[i] - m_new).exp();
                        row[..live].iter_mut().for_each(|x| *x = (*x - m_new).exp());
                        row[live..].fill(F::ZERO);
                        (l[i], m[i]) = (l[i] * correction + lane_sum(live, |j| row[j]), m_new);
                        o[(r0 + i) * hs..(r0 + i + 1) * hs].iter_mut().for_each(|x| *x *= correction);
                    }
                    // O += P Vj
                    let (p, vj) = (tile(&s, rows, cols), rows_of(&v, c0, c1, hs));
                    matmul_widened(rows_of_mut(&mut o, r0, r1, hs), true, p, vj, F::ONE, Parallelism::None);
                }
                for i in 0..rows {
                    let inv = F::ONE / l[i];
                    o[(r0 + i) * hs..(r0 + i + 1) * hs].iter_mut().for_each(|x| *x *= inv);
                    store_pair(&mut lse[(r0 + i) * PAIR..], m[i] + l[i].ln());
                }
            }
            narrow_head(out, &o, t, hs, c, h * hs);
        }
    }
}

simd_kernel! {
    /// One sequence: overwrites `dqkv` (T, qkv width); `delta` (heads, T, PAIR) is scratch for D.
    pub fn flash_attention_backward<F: Float, S: Stored<Acc = F>>(
        dqkv: &mut [S],
        delta: &mut [S],
        dout: &[S],
        qkv: &[S],
        out: &[S],
        lse: &[S],
        shape: AttentionShape,
    ) {
        let AttentionShape { seq_len: t, heads, head_size: hs, .. } = shape;
        let (c, c3) = (shape.q_width(), shape.qkv_width());
        let scale = F::from_f64(1.0 / (hs as f64).sqrt());
        let zeros = || vec![F::ZERO; t * hs];
        let _scratch = kernel_scratch::<F>(8 * t * hs + 2 * TILE * TILE);
        let (mut q, mut k, mut v, mut dy) = (zeros(), zeros(), zeros(), zeros());
        let (mut dq, mut dk, mut dv) = (zeros(), zeros(), zeros());
        let mut y = zeros();
        let (mut p, mut ds) = (vec![F::ZERO; TILE * TILE], vec![F::ZERO; TILE * TILE]);
        for (h, (delta, lse)) in delta.chunks_exact_mut(t * PAIR).zip(lse.chunks_exact(t * PAIR)).enumerate().take(heads) {
            let (q_col, k_col, v_col) = shape.columns(h);
            // A group's first query head loads its K/V head and zeroes their gradients.
            let (first, last) = (h % shape.group() == 0, h % shape.group() == shape.group() - 1);
            widen_head(&mut q, qkv, t, hs, c3, q_col);
            if first {
                widen_head(&mut k, qkv, t, hs, c3, k_col);
                widen_head(&mut v, qkv, t, hs, c3, v_col);
                dk.fill(F::ZERO);
                dv.fill(F::ZERO);
            }
            widen_head(&mut y, out, t, hs, c, h * hs);
            widen_head(&mut dy, dout, t, hs, c, h * hs);
            // D = rowsum(dO ∘ O)
            for (i, (dyi, yi)) in dy.chunks_exact(hs).zip(y.chunks_exact(hs)).enumerate() {
                let d = lane_sum(hs, |j| dyi[j] * yi[j]);
                store_pair(&mut delta[i * PAIR..], d);
            }
            dq.fill(F::ZERO);
            for (c0, c1) in tiles(t) {
                let cols = c1 - c0;
                for (r0, r1) in tiles(t).filter(|&(_, r1)| r1 > c0) {
                    let rows = r1 - r0;
                    // P = exp(Qi Kjᵀ / sqrt(hs) - L)
                    let (qi, kj) = (rows_of(&q, r0, r1, hs), rows_of(&k, c0, c1, hs));
                    matmul_widened(tile_mut(&mut p, rows, cols), false, qi, kj.t(), scale, Parallelism::None);
                    for i in 0..rows {
                        let lse_i = load_pair(&lse[(r0 + i) * PAIR..]);
                        let row = &mut p[i * TILE..i * TILE + cols];
                        let live = live_columns(r0, i, c0, cols);
                        row[..live].iter_mut().for_each(|x| *x = (*x - lse_i).exp());
                        row[live..].fill(F::ZERO);
                    }
                    // dVj += Pᵀ dOi
                    let dyi = rows_of(&dy, r0, r1, hs);
                    matmul_widened(
                        rows_of_mut(&mut dv, c0, c1, hs),
                        true,
                        tile(&p, rows, cols).t(),
                        dyi,
                        F::ONE,
                        Parallelism::None,
                    );
                    // dP = dOi Vjᵀ, then dS = P ∘ (dP - D) / sqrt(hs) in place
                    let vj = rows_of(&v, c0, c1, hs);
                    matmul_widened(tile_mut(&mut ds, rows, cols), false, dyi, vj.t(), F::ONE, Parallelism::None);
                    for i in 0..rows {
                        let d = load_pair(&delta[(r0 + i) * PAIR..]);
                        let (dsi, pi) = (&mut ds[i * TILE..i * TILE + cols], &p[i * TILE..i * TILE + cols]);
                        dsi.iter_mut().zip(pi).for_each(|(x, &pij)| *x = pij * (*x - d) * scale);
                    }
                    // dQi += dS Kj,  dKj += dSᵀ Qi
                    let dsij = tile(&ds, rows, cols);
                    matmul_widened(rows_of_mut(&mut dq, r0, r1, hs), true, dsij, kj, F::ONE, Parallelism::None);
                    matmul_widened(rows_of_mut(&mut dk, c0, c1, hs), true, dsij.t(), qi, F::ONE, Parallelism::None);
                }
            }
            narrow_head(dqkv, &dq, t, hs, c3, q_col);
            if last {
                narrow_head(dqkv, &dk, t, hs, c3, k_col);
                narrow_head(dqkv, &dv, t, hs, c3, v_col);
            }
        }
    }
}

/// FlashAttention on a backend's views (the conventions: `backend/mod.rs`).
pub trait FlashAttentionKernels: Buffers {
    /// The same attention, FlashAttention's way (ops/flash_attention.rs): tile by tile,
    /// keeping only `out` and, in `lse`, one log-sum-exp per row as a (hi, lo) pair of the
    /// storage format, `(batch, heads, seq_len, 2)`.
    fn flash_attention_forward(
        &self,
        out: Self::ViewMut<'_>,
        lse: Self::ViewMut<'_>,
        qkv: Self::View<'_>,
        shape: AttentionShape,
    );

    /// Overwrites `dqkv`, recomputing the probabilities from `lse`; `delta` is scratch of
    /// the size of `lse` (rowsum(dout ∘ out), as pairs).
    #[allow(clippy::too_many_arguments)]
    fn flash_attention_backward(
        &self,
        dqkv: Self::ViewMut<'_>,
        delta: Self::ViewMut<'_>,
        dout: Self::View<'_>,
        qkv: Self::View<'_>,
        out: Self::View<'_>,
        lse: Self::View<'_>,
        shape: AttentionShape,
    );
}

impl<S: Stored> FlashAttentionKernels for CpuBackend<S> {
    fn flash_attention_forward(&self, out: &mut [S], lse: &mut [S], qkv: &[S], shape: AttentionShape) {
        let AttentionShape { seq_len: t, heads, .. } = shape;
        out.par_chunks_mut(t * shape.q_width())
            .zip(lse.par_chunks_mut(heads * t * PAIR))
            .zip(qkv.par_chunks(t * shape.qkv_width()))
            .for_each(|((y, l), x)| flash_attention_forward(y, l, x, shape));
    }

    fn flash_attention_backward(
        &self,
        dqkv: &mut [S],
        delta: &mut [S],
        dout: &[S],
        qkv: &[S],
        out: &[S],
        lse: &[S],
        shape: AttentionShape,
    ) {
        let AttentionShape { seq_len: t, heads, .. } = shape;
        let (c, c3) = (shape.q_width(), shape.qkv_width());
        dqkv.par_chunks_mut(t * c3)
            .zip(delta.par_chunks_mut(heads * t * PAIR))
            .zip(dout.par_chunks(t * c))
            .zip(qkv.par_chunks(t * c3))
            .zip(out.par_chunks(t * c))
            .zip(lse.par_chunks(heads * t * PAIR))
            .for_each(|(((((dx, d), dy), x), y), l)| flash_attention_backward(dx, d, dy, x, y, l, shape));
    }
}

/// The launch of flash attention's kernels (`flash_attention.cu`): one warp per query row
/// (forward, delta, dQ) or key row of a K/V head (dK, dV, summed over its group's query
/// heads), the head held in registers.
#[cfg(feature = "cuda")]
mod cuda {
    use super::FlashAttentionKernels;
    use crate::backend::cuda::CudaBackend;
    use crate::ops::attention::AttentionShape;
    use crate::ops::cuda::{check_shape, int, launch, warp_per_row, DeviceElem, DeviceView, DeviceViewMut};

    /// The widest head flash attention's kernels hold in registers (WARP * ROW_REGS).
    const FLASH_MAX_HEAD: usize = distlab_common::backends::CUDA_FLASH_MAX_HEAD;

    impl<S: DeviceElem> FlashAttentionKernels for CudaBackend<S> {
        fn flash_attention_forward(
            &self,
            out: DeviceViewMut<'_, S>,
            lse: DeviceViewMut<'_, S>,
            qkv: DeviceView<'_, S>,
            shape: AttentionShape,
        ) {
            let gpu = &self.launcher;
            let AttentionShape { seq_len: t, heads, kv_heads, head_size: hs } = shape;
            assert!(
                hs <= FLASH_MAX_HEAD,
                "flash attention: head size {hs} above {FLASH_MAX_HEAD} (checked by the spec)"
            );
            let batch = qkv.len / (t * shape.qkv_width());
            let rows = batch * heads * t;
            check_shape("flash_attention_forward", &[(out.len, batch * t * shape.q_width()), (lse.len, rows * 2)]);
            let scale = 1.0 / (hs as f32).sqrt();
            launch!(
                gpu,
                "flash_attention_forward",
                warp_per_row(rows),
                out.ptr,
                lse.ptr,
                qkv.ptr,
                rows as i64,
                int(t),
                int(heads),
                int(kv_heads),
                int(hs),
                scale
            );
        }

        fn flash_attention_backward(
            &self,
            dqkv: DeviceViewMut<'_, S>,
            delta: DeviceViewMut<'_, S>,
            dout: DeviceView<'_, S>,
            qkv: DeviceView<'_, S>,
            out: DeviceView<'_, S>,
            lse: DeviceView<'_, S>,
            shape: AttentionShape,
        ) {
            let gpu = &self.launcher;
            let AttentionShape { seq_len: t, heads, kv_heads, head_size: hs } = shape;
            assert!(
                hs <= FLASH_MAX_HEAD,
                "flash attention: head size {hs} above {FLASH_MAX_HEAD} (checked by the spec)"
            );
            let batch = qkv.len / (t * shape.qkv_width());
            let rows = batch * heads * t;
            let c = shape.q_width();
            check_shape(
                "flash_attention_backward",
                &[
                    (dqkv.len, qkv.len),
                    (dout.len, batch * t * c),
                    (out.len, batch * t * c),
                    (lse.len, rows * 2),
                    (delta.len, rows * 2),
                ],
            );
            let scale = 1.0 / (hs as f32).sqrt();
            let key_rows = batch * kv_heads * t;
            let (n, t, heads, kv_heads, hs) = (rows as i64, int(t), int(heads), int(kv_heads), int(hs));
            launch!(gpu, "flash_attention_delta", warp_per_row(rows), delta.ptr, dout.ptr, out.ptr, n, t, heads, hs);
            let (dqkv, dout, qkv, lse, delta) = (dqkv.ptr, dout.ptr, qkv.ptr, lse.ptr, delta.ptr);
            // dQ by query row, then dK and dV by key row: disjoint columns of dqkv.
            launch!(
                gpu,
                "flash_attention_backward_query",
                warp_per_row(rows),
                dqkv,
                dout,
                qkv,
                lse,
                delta,
                n,
                t,
                heads,
                kv_heads,
                hs,
                scale
            );
            launch!(
                gpu,
                "flash_attention_backward_key",
                warp_per_row(key_rows),
                dqkv,
                dout,
                qkv,
                lse,
                delta,
                key_rows as i64,
                t,
                heads,
                kv_heads,
                hs,
                scale
            );
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A (hi, lo) pair of bf16 or fp16 holds a log-sum-exp to about 2^-16 relative; hi
    /// alone would be off by up to 2^-9 (bf16), and every probability recomputed from it
    /// by as much.
    #[test]
    fn a_pair_keeps_a_scalar_far_more_precisely_than_one_value() {
        for x in [5.123_456_f32, -0.731_9, 11.000_7, 0.000_123_4] {
            let mut pair = [half::bf16::ZERO; PAIR];
            store_pair(&mut pair, x);
            let error = ((load_pair(&pair) - x) / x).abs();
            assert!(error < 2f32.powi(-15), "bf16 pair of {x}: relative error {error:e}");
            let one = ((half::bf16::from_f32(x).to_f32() - x) / x).abs();
            assert!(one > 16.0 * error || one == 0.0, "{x}: one bf16 {one:e}, the pair {error:e}");
            // fp16's lo runs into its subnormals below ~0.06 (a pair then keeps what fp16
            // can: loss scaling keeps gradients, and so D, away from there).
            if x.abs() >= 0.06 {
                let mut pair = [half::f16::ZERO; PAIR];
                store_pair(&mut pair, x);
                let error = ((load_pair(&pair) - x) / x).abs();
                assert!(error < 2f32.powi(-18), "fp16 pair of {x}: relative error {error:e}");
            }
        }
    }
}
