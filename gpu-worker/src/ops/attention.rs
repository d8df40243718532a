//! Causal multi-head self-attention for one sequence at a time (the CPU backend
//! runs sequences in parallel). qkv is (T, 3C) = [Q | K | V], head h owns columns
//! h*hs..(h+1)*hs of each part (hs = C / heads); the output is (T, C).
//!
//!   forward (per head):   S = Q Kᵀ / sqrt(hs)
//!                         P_ij = softmax_j(S_ij) over j <= i (0 for j > i)
//!                         Y = P V
//!   backward (per head):  dP = dY Vᵀ,   dV = Pᵀ dY
//!                         dS_ij = P_ij (dP_ij - sum_k P_ik dP_ik) / sqrt(hs)
//!                         dQ = dS K,   dK = dSᵀ Q
//!
//! The four products per head are GEMMs on strided views of qkv (no copies),
//! in row blocks that skip the blocks above the diagonal. A 2-byte format widens each
//! operand once, for all the products that read it: qkv and dY once per sequence, P
//! and dS once per head.

use rayon::prelude::*;

use crate::backend::buffers::Buffers;
use crate::backend::cpu::CpuBackend;
use crate::ops::float::{lane_max, lane_sum, AccRow};
use crate::ops::float::{Float, Stored};
use crate::ops::gemm::{matmul_wide, Mat, MatMut, Parallelism};
use crate::ops::simd::simd_kernel;

/// Row-block size for skipping the masked (upper-right) blocks of the T x T products.
const BLOCK: usize = 64;

/// Row blocks `[r0, r1)` covering `0..t`. Row block i only needs key columns `0..r1`,
/// and key/value block j only gets gradient from query rows `r0..t`: for T = 128 this
/// skips a quarter of the attention FLOPs.
fn row_blocks(t: usize) -> impl Iterator<Item = (usize, usize)> {
    (0..t.div_ceil(BLOCK)).map(move |b| (b * BLOCK, ((b + 1) * BLOCK).min(t)))
}

simd_kernel! {
    /// One sequence: `out` (T, C), `att` (heads, T, T) keeps P for the backward pass.
    pub fn attention_forward<F: Float, S: Stored<Acc = F>>(
        out: &mut [S],
        att: &mut [S],
        qkv: &[S],
        t: usize,
        c: usize,
        heads: usize,
    ) {
        let hs = c / heads;
        let c3 = 3 * c;
        let scale = F::from_f64(1.0 / (hs as f64).sqrt());
        let mut row_acc = AccRow::new();
        // A dense row-major view keeps its layout when widened.
        let qkv = Mat::row_major(qkv, t, c3).widen(Parallelism::None);
        let qkv = qkv.data();
        for (h, p) in att.chunks_exact_mut(t * t).enumerate().take(heads) {
            let (q, k, v) = (h * hs, c + h * hs, 2 * c + h * hs);
            // S = Q Kᵀ / sqrt(hs), only the blocks on or below the diagonal
            for (r0, r1) in row_blocks(t) {
                let s = MatMut::new(&mut p[r0 * t..], r1 - r0, r1, t, 1);
                let q_rows = Mat::new(&qkv[r0 * c3 + q..], r1 - r0, hs, c3, 1);
                let k_rows = Mat::new(&qkv[k..], r1, hs, c3, 1);
                matmul_wide(s, false, q_rows, k_rows.t(), scale, Parallelism::None);
            }
            for (i, row) in p.chunks_exact_mut(t).enumerate() {
                causal_softmax_row(row, i, &mut row_acc);
            }
            // Y = P V
            let p = Mat::row_major(&*p, t, t).widen(Parallelism::None);
            for (r0, r1) in row_blocks(t) {
                let y = MatMut::new(&mut out[r0 * c + h * hs..], r1 - r0, hs, c, 1);
                let p_rows = Mat::new(&p.data()[r0 * t..], r1 - r0, r1, t, 1);
                let v_rows = Mat::new(&qkv[v..], r1, hs, c3, 1);
                matmul_wide(y, false, p_rows, v_rows, F::ONE, Parallelism::None);
            }
        }
    }
}

simd_kernel! {
    /// One sequence: overwrites `dqkv` (T, 3C); `datt` (heads, T, T) is scratch.
    pub fn attention_backward<F: Float, S: Stored<Acc = F>>(
        dqkv: &mut [S],
        datt: &mut [S],
        dout: &[S],
        qkv: &[S],
        att: &[S],
        t: usize,
        c: usize,
        heads: usize,
    ) {
        let hs = c / heads;
        let c3 = 3 * c;
        let scale = F::from_f64(1.0 / (hs as f64).sqrt());
        let (mut p_acc, mut dp_acc) = (AccRow::new(), AccRow::new());
        // Dense row-major views keep their layout when widened.
        let qkv = Mat::row_major(qkv, t, c3).widen(Parallelism::None);
        let qkv = qkv.data();
        let dout = Mat::row_major(dout, t, c).widen(Parallelism::None);
        let dout = dout.data();
        for (h, (dp, p)) in datt.chunks_exact_mut(t * t).zip(att.chunks_exact(t * t)).enumerate().take(heads) {
            let (q, k, v) = (h * hs, c + h * hs, 2 * c + h * hs);
            let dy = h * hs;
            let p_wide = Mat::row_major(p, t, t).widen(Parallelism::None);
            for (r0, r1) in row_blocks(t) {
                // dP = dY Vᵀ (rows r0..r1, columns 0..r1)
                let dp_rows = MatMut::new(&mut dp[r0 * t..], r1 - r0, r1, t, 1);
                let dy_rows = Mat::new(&dout[r0 * c + dy..], r1 - r0, hs, c, 1);
                let v_rows = Mat::new(&qkv[v..], r1, hs, c3, 1);
                matmul_wide(dp_rows, false, dy_rows, v_rows.t(), F::ONE, Parallelism::None);
                // dV = Pᵀ dY (rows r0..r1 of dV get gradient from query rows r0..t)
                let dv = MatMut::new(&mut dqkv[r0 * c3 + v..], r1 - r0, hs, c3, 1);
                let p_cols = Mat::new(&p_wide.data()[r0 * t + r0..], t - r0, r1 - r0, t, 1);
                let dy_below = Mat::new(&dout[r0 * c + dy..], t - r0, hs, c, 1);
                matmul_wide(dv, false, p_cols.t(), dy_below, F::ONE, Parallelism::None);
            }
            // dS, in place over dP
            for (i, (dp_row, p_row)) in dp.chunks_exact_mut(t).zip(p.chunks_exact(t)).enumerate() {
                causal_softmax_backward_row(dp_row, p_row, i, scale, &mut p_acc, &mut dp_acc);
            }
            let ds = Mat::row_major(&*dp, t, t).widen(Parallelism::None);
            for (r0, r1) in row_blocks(t) {
                // dQ = dS K
                let dq = MatMut::new(&mut dqkv[r0 * c3 + q..], r1 - r0, hs, c3, 1);
                let ds_rows = Mat::new(&ds.data()[r0 * t..], r1 - r0, r1, t, 1);
                let k_rows = Mat::new(&qkv[k..], r1, hs, c3, 1);
                matmul_wide(dq, false, ds_rows, k_rows, F::ONE, Parallelism::None);
                // dK = dSᵀ Q
                let dk = MatMut::new(&mut dqkv[r0 * c3 + k..], r1 - r0, hs, c3, 1);
                let ds_cols = Mat::new(&ds.data()[r0 * t + r0..], t - r0, r1 - r0, t, 1);
                let q_below = Mat::new(&qkv[r0 * c3 + q..], t - r0, hs, c3, 1);
                matmul_wide(dk, false, ds_cols.t(), q_below, F::ONE, Parallelism::None);
            }
        }
    }
}

/// Row i of the score matrix: softmax over columns 0..=i, zeros after, computed in the
/// compute format (`row_acc`) and rounded once as it is stored.
#[inline(always)]
fn causal_softmax_row<F: Float, S: Stored<Acc = F>>(row: &mut [S], i: usize, row_acc: &mut AccRow<F>) {
    let (live, masked) = row.split_at_mut(i + 1);
    let v = row_acc.open(live, true);
    let m = lane_max(v.len(), |j| v[j]);
    for v in v.iter_mut() {
        *v = (*v - m).exp();
    }
    let inv = F::ONE / lane_sum(v.len(), |j| v[j]);
    for v in v.iter_mut() {
        *v *= inv;
    }
    row_acc.store(live);
    masked.fill(S::default());
}

/// Row i: `dp` (holding dP) becomes dS = P (dP - <P, dP>) * scale over 0..=i, zeros after.
#[inline(always)]
fn causal_softmax_backward_row<F: Float, S: Stored<Acc = F>>(
    dp: &mut [S],
    p: &[S],
    i: usize,
    scale: F,
    p_acc: &mut AccRow<F>,
    dp_acc: &mut AccRow<F>,
) {
    let (live, masked) = dp.split_at_mut(i + 1);
    let p = p_acc.load(&p[..i + 1]);
    let d = dp_acc.open(live, true);
    let dot = lane_sum(i + 1, |j| p[j] * d[j]);
    for (d, &pj) in d.iter_mut().zip(p) {
        *d = pj * (*d - dot) * scale;
    }
    dp_acc.store(live);
    masked.fill(S::default());
}

/// Causal self-attention with its probabilities kept on a backend's views (the conventions: `backend/mod.rs`).
pub trait AttentionKernels: Buffers {
    /// Causal multi-head self-attention. `qkv` is `(rows, 3c)` = [Q | K | V], each
    /// head a contiguous block of `c / heads` columns; `out` is `(rows, c)`; `att`
    /// keeps the softmax probabilities, `(batch, heads, seq_len, seq_len)`.
    fn attention_forward(
        &self,
        out: Self::ViewMut<'_>,
        att: Self::ViewMut<'_>,
        qkv: Self::View<'_>,
        seq_len: usize,
        c: usize,
        heads: usize,
    );

    /// Overwrites `dqkv`; `datt` is scratch of the size of `att`.
    #[allow(clippy::too_many_arguments)]
    fn attention_backward(
        &self,
        dqkv: Self::ViewMut<'_>,
        datt: Self::ViewMut<'_>,
        dout: Self::View<'_>,
        qkv: Self::View<'_>,
        att: Self::View<'_>,
        seq_len: usize,
        c: usize,
        heads: usize,
    );
}

impl<S: Stored> AttentionKernels for CpuBackend<S> {
    fn attention_forward(&self, out: &mut [S], att: &mut [S], qkv: &[S], seq_len: usize, c: usize, heads: usize) {
        let t = seq_len;
        out.par_chunks_mut(t * c)
            .zip(att.par_chunks_mut(heads * t * t))
            .zip(qkv.par_chunks(t * 3 * c))
            .for_each(|((y, a), x)| attention_forward(y, a, x, t, c, heads));
    }

    fn attention_backward(
        &self,
        dqkv: &mut [S],
        datt: &mut [S],
        dout: &[S],
        qkv: &[S],
        att: &[S],
        seq_len: usize,
        c: usize,
        heads: usize,
    ) {
        let t = seq_len;
        dqkv.par_chunks_mut(t * 3 * c)
            .zip(datt.par_chunks_mut(heads * t * t))
            .zip(dout.par_chunks(t * c))
            .zip(qkv.par_chunks(t * 3 * c))
            .zip(att.par_chunks(heads * t * t))
            .for_each(|((((dx, da), dy), x), a)| attention_backward(dx, da, dy, x, a, t, c, heads));
    }
}

/// The launch of attention on the GPU: the per-(sequence, head) products through cuBLAS,
/// the causal softmax and its backward (`attention.cu`) one warp per row.
#[cfg(feature = "cuda")]
mod cuda {
    use super::AttentionKernels;
    use crate::backend::cuda::CudaBackend;
    use crate::ops::cuda::{
        check_shape, int, launch, warp_per_row, DeviceElem, DeviceView, DeviceViewMut, HeadOperand,
    };

    impl<S: DeviceElem> AttentionKernels for CudaBackend<S> {
        fn attention_forward(
            &self,
            out: DeviceViewMut<'_, S>,
            att: DeviceViewMut<'_, S>,
            qkv: DeviceView<'_, S>,
            seq_len: usize,
            c: usize,
            heads: usize,
        ) {
            let gpu = &self.launcher;
            let (t, hs) = (seq_len, c / heads);
            let batch = qkv.len / (t * 3 * c);
            check_shape("attention_forward", &[(out.len, batch * t * c), (att.len, batch * heads * t * t)]);
            let scale = 1.0 / (hs as f32).sqrt();
            let e = size_of::<S>() as u64;
            let qkv_part =
                |part: usize| HeadOperand { ptr: qkv.ptr + (part * c) as u64 * e, ld: 3 * c, seq: t * 3 * c, head: hs };
            let scores = |ptr: u64| HeadOperand { ptr, ld: t, seq: heads * t * t, head: t * t };
            let shape = (batch, heads);
            // S = Q Kᵀ * scale: column-major Sᵀ (keys x queries) = K · Qᵀ.
            gpu.head_gemm((true, false), (t, t, hs), scale, qkv_part(1), qkv_part(0), 0.0, scores(att.ptr), shape);
            launch!(
                gpu,
                "causal_softmax_forward",
                warp_per_row(batch * heads * t),
                att.ptr,
                (batch * heads * t) as i64,
                int(t)
            );
            // Y = P V: column-major Yᵀ (hs x T) = Vᵀ · Pᵀ.
            let y = HeadOperand { ptr: out.ptr, ld: c, seq: t * c, head: hs };
            gpu.head_gemm((false, false), (hs, t, t), 1.0, qkv_part(2), scores(att.ptr), 0.0, y, shape);
        }

        fn attention_backward(
            &self,
            dqkv: DeviceViewMut<'_, S>,
            datt: DeviceViewMut<'_, S>,
            dout: DeviceView<'_, S>,
            qkv: DeviceView<'_, S>,
            att: DeviceView<'_, S>,
            seq_len: usize,
            c: usize,
            heads: usize,
        ) {
            let gpu = &self.launcher;
            let (t, hs) = (seq_len, c / heads);
            let batch = qkv.len / (t * 3 * c);
            check_shape(
                "attention_backward",
                &[
                    (dqkv.len, qkv.len),
                    (dout.len, batch * t * c),
                    (att.len, batch * heads * t * t),
                    (datt.len, att.len),
                ],
            );
            let scale = 1.0 / (hs as f32).sqrt();
            let e = size_of::<S>() as u64;
            let part = |ptr: u64, part: usize| HeadOperand {
                ptr: ptr + (part * c) as u64 * e,
                ld: 3 * c,
                seq: t * 3 * c,
                head: hs,
            };
            let scores = |ptr: u64| HeadOperand { ptr, ld: t, seq: heads * t * t, head: t * t };
            let dy = HeadOperand { ptr: dout.ptr, ld: c, seq: t * c, head: hs };
            let shape = (batch, heads);
            // dP = dY Vᵀ: column-major dPᵀ = V · dYᵀ.
            gpu.head_gemm((true, false), (t, t, hs), 1.0, part(qkv.ptr, 2), dy, 0.0, scores(datt.ptr), shape);
            // dV = Pᵀ dY: column-major dVᵀ (hs x T) = dYᵀ · P.
            gpu.head_gemm((false, true), (hs, t, t), 1.0, dy, scores(att.ptr), 0.0, part(dqkv.ptr, 2), shape);
            let rows = batch * heads * t;
            launch!(gpu, "causal_softmax_backward", warp_per_row(rows), datt.ptr, att.ptr, rows as i64, int(t), scale);
            // dQ = dS K: column-major dQᵀ (hs x T) = Kᵀ · dSᵀ.
            gpu.head_gemm(
                (false, false),
                (hs, t, t),
                1.0,
                part(qkv.ptr, 1),
                scores(datt.ptr),
                0.0,
                part(dqkv.ptr, 0),
                shape,
            );
            // dK = dSᵀ Q: column-major dKᵀ (hs x T) = Qᵀ · dS.
            gpu.head_gemm(
                (false, true),
                (hs, t, t),
                1.0,
                part(qkv.ptr, 0),
                scores(datt.ptr),
                0.0,
                part(dqkv.ptr, 1),
                shape,
            );
        }
    }
}
