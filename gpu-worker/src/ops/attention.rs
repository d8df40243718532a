//! Causal self-attention for one sequence at a time (the CPU backend runs sequences in
//! parallel), multi-head or grouped-query (GQA: `kv_heads` key/value heads, each serving
//! heads / kv_heads query heads; multi-query when it is 1). qkv is (T, (heads + 2 kv_heads)
//! hs) = [Q | K | V], query head h owns columns h*hs..(h+1)*hs of Q and uses key/value head
//! g = h / (heads / kv_heads) of K and V; the output is (T, heads hs).
//!
//!   forward (per query head h, its K/V head g):
//!                         S = Q_h K_gᵀ / sqrt(hs)
//!                         P_ij = softmax_j(S_ij) over j <= i (0 for j > i)
//!                         Y_h = P V_g
//!   backward:             dP = dY_h V_gᵀ,   dV_g += Pᵀ dY_h
//!                         dS_ij = P_ij (dP_ij - sum_k P_ik dP_ik) / sqrt(hs)
//!                         dQ_h = dS K_g,   dK_g += dSᵀ Q_h
//!
//! (a K/V head's gradients sum over the query heads of its group). The four products per
//! head are GEMMs on strided views of qkv (no copies, no repeated K/V), in row blocks that
//! skip the blocks above the diagonal. A 2-byte format widens each operand once, for all
//! the products that read it: qkv and dY once per sequence, P and dS once per head.

use rayon::prelude::*;

use crate::backend::buffers::Buffers;
use crate::backend::cpu::CpuBackend;
use crate::ops::float::{lane_max, lane_sum, AccRow};
use crate::ops::float::{Float, Stored};
use crate::ops::gemm::{matmul_wide, Mat, MatMut, Parallelism};
use crate::ops::simd::simd_kernel;

/// The shape of causal self-attention: sequences of `seq_len` tokens, `heads` query heads
/// and `kv_heads` key/value heads (as many: multi-head attention; fewer, dividing `heads`:
/// grouped-query attention), `head_size` wide each.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct AttentionShape {
    pub seq_len: usize,
    pub heads: usize,
    pub kv_heads: usize,
    pub head_size: usize,
}

impl AttentionShape {
    /// Multi-head attention of width `c` (GPT-2's): `heads` query and key/value heads.
    pub fn multi_head(seq_len: usize, c: usize, heads: usize) -> Self {
        AttentionShape { seq_len, heads, kv_heads: heads, head_size: c / heads }
    }

    /// Width of Q (and of the output): heads x head_size.
    pub fn q_width(&self) -> usize {
        self.heads * self.head_size
    }

    /// Width of K (and of V): kv_heads x head_size.
    pub fn kv_width(&self) -> usize {
        self.kv_heads * self.head_size
    }

    /// Width of a row of qkv, [Q | K | V].
    pub fn qkv_width(&self) -> usize {
        self.q_width() + 2 * self.kv_width()
    }

    /// Query heads per key/value head.
    pub fn group(&self) -> usize {
        self.heads / self.kv_heads
    }

    /// The columns of qkv where query head `h`'s Q, K and V start.
    pub fn columns(&self, h: usize) -> (usize, usize, usize) {
        let (hs, g) = (self.head_size, h / self.group());
        (h * hs, self.q_width() + g * hs, self.q_width() + self.kv_width() + g * hs)
    }
}

/// Where a rank's tokens of a sequence sit in it (context parallelism; else one run from
/// 0): `parts` runs (1 or 2) of `part` tokens, run r from position `starts[r]`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Positions {
    pub starts: [usize; 2],
    pub parts: usize,
    pub part: usize,
}

impl Positions {
    /// One run of `len` tokens from `start`.
    pub fn run(start: usize, len: usize) -> Self {
        Positions { starts: [start, start], parts: 1, part: len }
    }

    /// Rank `rank` of `cp`'s tokens of a sequence of `seq` tokens: its one run, or
    /// (`balanced`) chunks rank and 2cp-1-rank of 2cp.
    pub fn of_rank(rank: usize, cp: usize, seq: usize, balanced: bool) -> Self {
        match balanced {
            false => Positions::run(rank * seq / cp, seq / cp),
            true => {
                let chunk = seq / (2 * cp);
                Positions { starts: [rank * chunk, (2 * cp - 1 - rank) * chunk], parts: 2, part: chunk }
            }
        }
    }

    pub fn tokens(&self) -> usize {
        self.parts * self.part
    }

    /// The position of the block's token `i`.
    pub fn at(&self, i: usize) -> usize {
        self.starts[i / self.part] + i % self.part
    }
}

/// Row-block size for skipping the masked (upper-right) blocks of the T x T products.
const BLOCK: usize = 64;

/// Row blocks `[r0, r1)` covering `0..t`. Row block i only needs key columns `0..r1`,
/// and key/value block j only gets gradient from query rows `r0..t`: for T = 128 this
/// skips a quarter of the attention FLOPs.
fn row_blocks(t: usize) -> impl Iterator<Item = (usize, usize)> {
    (0..t.div_ceil(BLOCK)).map(move |b| (b * BLOCK, ((b + 1) * BLOCK).min(t)))
}

simd_kernel! {
    /// One sequence: `out` (T, heads hs), `att` (heads, T, T) keeps P for the backward pass.
    pub fn attention_forward<F: Float, S: Stored<Acc = F>>(
        out: &mut [S],
        att: &mut [S],
        qkv: &[S],
        shape: AttentionShape,
    ) {
        let AttentionShape { seq_len: t, heads, head_size: hs, .. } = shape;
        let (c, width) = (shape.q_width(), shape.qkv_width());
        let scale = F::from_f64(1.0 / (hs as f64).sqrt());
        let mut row_acc = AccRow::new();
        // A dense row-major view keeps its layout when widened.
        let qkv = Mat::row_major(qkv, t, width).widen(Parallelism::None);
        let qkv = qkv.data();
        for (h, p) in att.chunks_exact_mut(t * t).enumerate().take(heads) {
            let (q, k, v) = shape.columns(h);
            // S = Q Kᵀ / sqrt(hs), only the blocks on or below the diagonal
            for (r0, r1) in row_blocks(t) {
                let s = MatMut::new(&mut p[r0 * t..], r1 - r0, r1, t, 1);
                let q_rows = Mat::new(&qkv[r0 * width + q..], r1 - r0, hs, width, 1);
                let k_rows = Mat::new(&qkv[k..], r1, hs, width, 1);
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
                let v_rows = Mat::new(&qkv[v..], r1, hs, width, 1);
                matmul_wide(y, false, p_rows, v_rows, F::ONE, Parallelism::None);
            }
        }
    }
}

simd_kernel! {
    /// One sequence: overwrites `dqkv` (T, qkv width); `datt` (heads, T, T) is scratch.
    pub fn attention_backward<F: Float, S: Stored<Acc = F>>(
        dqkv: &mut [S],
        datt: &mut [S],
        dout: &[S],
        qkv: &[S],
        att: &[S],
        shape: AttentionShape,
    ) {
        let AttentionShape { seq_len: t, heads, head_size: hs, .. } = shape;
        let (c, width) = (shape.q_width(), shape.qkv_width());
        let scale = F::from_f64(1.0 / (hs as f64).sqrt());
        let (mut p_acc, mut dp_acc) = (AccRow::new(), AccRow::new());
        // Dense row-major views keep their layout when widened.
        let qkv = Mat::row_major(qkv, t, width).widen(Parallelism::None);
        let qkv = qkv.data();
        let dout = Mat::row_major(dout, t, c).widen(Parallelism::None);
        let dout = dout.data();
        for (h, (dp, p)) in datt.chunks_exact_mut(t * t).zip(att.chunks_exact(t * t)).enumerate().take(heads) {
            let (q, k, v) = shape.columns(h);
            // The first query head of a group writes its K/V head's gradients, the rest add.
            let add = h % shape.group() != 0;
            let dy = h * hs;
            let p_wide = Mat::row_major(p, t, t).widen(Parallelism::None);
            for (r0, r1) in row_blocks(t) {
                // dP = dY Vᵀ (rows r0..r1, columns 0..r1)
                let dp_rows = MatMut::new(&mut dp[r0 * t..], r1 - r0, r1, t, 1);
                let dy_rows = Mat::new(&dout[r0 * c + dy..], r1 - r0, hs, c, 1);
                let v_rows = Mat::new(&qkv[v..], r1, hs, width, 1);
                matmul_wide(dp_rows, false, dy_rows, v_rows.t(), F::ONE, Parallelism::None);
                // dV = Pᵀ dY (rows r0..r1 of dV get gradient from query rows r0..t)
                let dv = MatMut::new(&mut dqkv[r0 * width + v..], r1 - r0, hs, width, 1);
                let p_cols = Mat::new(&p_wide.data()[r0 * t + r0..], t - r0, r1 - r0, t, 1);
                let dy_below = Mat::new(&dout[r0 * c + dy..], t - r0, hs, c, 1);
                matmul_wide(dv, add, p_cols.t(), dy_below, F::ONE, Parallelism::None);
            }
            // dS, in place over dP
            for (i, (dp_row, p_row)) in dp.chunks_exact_mut(t).zip(p.chunks_exact(t)).enumerate() {
                causal_softmax_backward_row(dp_row, p_row, i, scale, &mut p_acc, &mut dp_acc);
            }
            let ds = Mat::row_major(&*dp, t, t).widen(Parallelism::None);
            for (r0, r1) in row_blocks(t) {
                // dQ = dS K
                let dq = MatMut::new(&mut dqkv[r0 * width + q..], r1 - r0, hs, width, 1);
                let ds_rows = Mat::new(&ds.data()[r0 * t..], r1 - r0, r1, t, 1);
                let k_rows = Mat::new(&qkv[k..], r1, hs, width, 1);
                matmul_wide(dq, false, ds_rows, k_rows, F::ONE, Parallelism::None);
                // dK = dSᵀ Q
                let dk = MatMut::new(&mut dqkv[r0 * width + k..], r1 - r0, hs, width, 1);
                let ds_cols = Mat::new(&ds.data()[r0 * t + r0..], t - r0, r1 - r0, t, 1);
                let q_below = Mat::new(&qkv[r0 * width + q..], t - r0, hs, width, 1);
                matmul_wide(dk, add, ds_cols.t(), q_below, F::ONE, Parallelism::None);
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
    /// Causal self-attention. `qkv` is `(rows, shape.qkv_width())` = [Q | K | V], each head
    /// a contiguous block of `head_size` columns; `out` is `(rows, shape.q_width())`; `att`
    /// keeps the softmax probabilities, `(batch, heads, seq_len, seq_len)`.
    fn attention_forward(
        &self,
        out: Self::ViewMut<'_>,
        att: Self::ViewMut<'_>,
        qkv: Self::View<'_>,
        shape: AttentionShape,
    );

    /// Overwrites `dqkv`; `datt` is scratch of the size of `att`.
    fn attention_backward(
        &self,
        dqkv: Self::ViewMut<'_>,
        datt: Self::ViewMut<'_>,
        dout: Self::View<'_>,
        qkv: Self::View<'_>,
        att: Self::View<'_>,
        shape: AttentionShape,
    );
}

impl<S: Stored> AttentionKernels for CpuBackend<S> {
    fn attention_forward(&self, out: &mut [S], att: &mut [S], qkv: &[S], shape: AttentionShape) {
        let AttentionShape { seq_len: t, heads, .. } = shape;
        out.par_chunks_mut(t * shape.q_width())
            .zip(att.par_chunks_mut(heads * t * t))
            .zip(qkv.par_chunks(t * shape.qkv_width()))
            .for_each(|((y, a), x)| attention_forward(y, a, x, shape));
    }

    fn attention_backward(
        &self,
        dqkv: &mut [S],
        datt: &mut [S],
        dout: &[S],
        qkv: &[S],
        att: &[S],
        shape: AttentionShape,
    ) {
        let AttentionShape { seq_len: t, heads, .. } = shape;
        let width = t * shape.qkv_width();
        dqkv.par_chunks_mut(width)
            .zip(datt.par_chunks_mut(heads * t * t))
            .zip(dout.par_chunks(t * shape.q_width()))
            .zip(qkv.par_chunks(width))
            .zip(att.par_chunks(heads * t * t))
            .for_each(|((((dx, da), dy), x), a)| attention_backward(dx, da, dy, x, a, shape));
    }
}

/// The launch of attention on the GPU: the per-(sequence, head) products through cuBLAS,
/// the causal softmax and its backward (`attention.cu`) one warp per row. With grouped-query
/// attention each product runs once per place in a group (query heads g x group + r of
/// every K/V head g in one batched call), the K/V gradients of the second and later places
/// added to the first's.
#[cfg(feature = "cuda")]
mod cuda {
    use super::{AttentionKernels, AttentionShape};
    use crate::backend::cuda::CudaBackend;
    use crate::ops::cuda::{
        check_shape, int, launch, warp_per_row, DeviceElem, DeviceView, DeviceViewMut, HeadOperand,
    };

    /// The operands of one place `r` in every group: query heads g x group + r, K/V head g.
    struct Place {
        t: usize,
        hs: usize,
        group: usize,
        heads: usize,
        width: usize,
        q_width: usize,
        kv_width: usize,
        e: u64,
        r: usize,
    }

    impl Place {
        /// Q (`part` 0), K (1) or V (2) of qkv-shaped `ptr` for this place's heads.
        fn qkv(&self, ptr: u64, part: usize) -> HeadOperand {
            let (col, head) = match part {
                0 => (self.r * self.hs, self.group * self.hs),
                1 => (self.q_width, self.hs),
                _ => (self.q_width + self.kv_width, self.hs),
            };
            HeadOperand { ptr: ptr + (col as u64) * self.e, ld: self.width, seq: self.t * self.width, head }
        }

        /// This place's heads of an output-shaped (rows, q width) buffer.
        fn out(&self, ptr: u64) -> HeadOperand {
            let (col, head) = (self.r * self.hs, self.group * self.hs);
            HeadOperand { ptr: ptr + (col as u64) * self.e, ld: self.q_width, seq: self.t * self.q_width, head }
        }

        /// This place's heads of a (batch, heads, T, T) buffer.
        fn scores(&self, ptr: u64) -> HeadOperand {
            let tt = self.t * self.t;
            HeadOperand {
                ptr: ptr + (self.r * tt) as u64 * self.e,
                ld: self.t,
                seq: self.heads * tt,
                head: self.group * tt,
            }
        }
    }

    fn places<S>(shape: AttentionShape) -> impl Iterator<Item = Place> {
        let AttentionShape { seq_len: t, heads, head_size: hs, .. } = shape;
        let (group, width, q_width, kv_width) = (shape.group(), shape.qkv_width(), shape.q_width(), shape.kv_width());
        let e = size_of::<S>() as u64;
        (0..group).map(move |r| Place { t, hs, group, heads, width, q_width, kv_width, e, r })
    }

    impl<S: DeviceElem> AttentionKernels for CudaBackend<S> {
        fn attention_forward(
            &self,
            out: DeviceViewMut<'_, S>,
            att: DeviceViewMut<'_, S>,
            qkv: DeviceView<'_, S>,
            shape: AttentionShape,
        ) {
            let gpu = &self.launcher;
            let AttentionShape { seq_len: t, heads, kv_heads, head_size: hs } = shape;
            let batch = qkv.len / (t * shape.qkv_width());
            check_shape(
                "attention_forward",
                &[(out.len, batch * t * shape.q_width()), (att.len, batch * heads * t * t)],
            );
            let scale = 1.0 / (hs as f32).sqrt();
            let groups = (batch, kv_heads);
            // S = Q Kᵀ * scale: column-major Sᵀ (keys x queries) = K · Qᵀ.
            for p in places::<S>(shape) {
                let (k, q, s) = (p.qkv(qkv.ptr, 1), p.qkv(qkv.ptr, 0), p.scores(att.ptr));
                gpu.head_gemm((true, false), (t, t, hs), scale, k, q, 0.0, s, groups);
            }
            launch!(
                gpu,
                "causal_softmax_forward",
                warp_per_row(batch * heads * t),
                att.ptr,
                (batch * heads * t) as i64,
                int(t)
            );
            // Y = P V: column-major Yᵀ (hs x T) = Vᵀ · Pᵀ.
            for p in places::<S>(shape) {
                let (v, s, y) = (p.qkv(qkv.ptr, 2), p.scores(att.ptr), p.out(out.ptr));
                gpu.head_gemm((false, false), (hs, t, t), 1.0, v, s, 0.0, y, groups);
            }
        }

        fn attention_backward(
            &self,
            dqkv: DeviceViewMut<'_, S>,
            datt: DeviceViewMut<'_, S>,
            dout: DeviceView<'_, S>,
            qkv: DeviceView<'_, S>,
            att: DeviceView<'_, S>,
            shape: AttentionShape,
        ) {
            let gpu = &self.launcher;
            let AttentionShape { seq_len: t, heads, kv_heads, head_size: hs } = shape;
            let batch = qkv.len / (t * shape.qkv_width());
            check_shape(
                "attention_backward",
                &[
                    (dqkv.len, qkv.len),
                    (dout.len, batch * t * shape.q_width()),
                    (att.len, batch * heads * t * t),
                    (datt.len, att.len),
                ],
            );
            let scale = 1.0 / (hs as f32).sqrt();
            let groups = (batch, kv_heads);
            for p in places::<S>(shape) {
                // The first place writes the K/V gradients, the others add theirs.
                let add = if p.r == 0 { 0.0 } else { 1.0 };
                let dy = p.out(dout.ptr);
                // dP = dY Vᵀ: column-major dPᵀ = V · dYᵀ.
                gpu.head_gemm((true, false), (t, t, hs), 1.0, p.qkv(qkv.ptr, 2), dy, 0.0, p.scores(datt.ptr), groups);
                // dV = Pᵀ dY: column-major dVᵀ (hs x T) = dYᵀ · P.
                gpu.head_gemm((false, true), (hs, t, t), 1.0, dy, p.scores(att.ptr), add, p.qkv(dqkv.ptr, 2), groups);
            }
            let rows = batch * heads * t;
            launch!(gpu, "causal_softmax_backward", warp_per_row(rows), datt.ptr, att.ptr, rows as i64, int(t), scale);
            for p in places::<S>(shape) {
                let add = if p.r == 0 { 0.0 } else { 1.0 };
                let ds = p.scores(datt.ptr);
                // dQ = dS K: column-major dQᵀ (hs x T) = Kᵀ · dSᵀ.
                gpu.head_gemm((false, false), (hs, t, t), 1.0, p.qkv(qkv.ptr, 1), ds, 0.0, p.qkv(dqkv.ptr, 0), groups);
                // dK = dSᵀ Q: column-major dKᵀ (hs x T) = Qᵀ · dS.
                gpu.head_gemm((false, true), (hs, t, t), 1.0, p.qkv(qkv.ptr, 0), ds, add, p.qkv(dqkv.ptr, 1), groups);
            }
        }
    }
}
