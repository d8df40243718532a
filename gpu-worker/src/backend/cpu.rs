//! The CPU backend: buffers are `Vec`s, views are slices, GEMMs go through the
//! `gemm` crate, and the other kernels (whose math is in `model/*.rs`) are split
//! over the threads of the rayon pool the caller runs us in (`pool.install`).
//!
//! Work splitting never changes results: row-wise kernels compute each row alone;
//! reductions over rows (bias, LayerNorm and embedding gradients) are split by
//! column or vocabulary ranges so every sum runs in row order; `sum` and
//! `sum_squares` add fixed-size chunks in order; a matrix product gives each thread
//! a block of whole output rows or columns (`ops/gemm.rs`). So losses are
//! bit-identical run to run and for any thread count (tests/train.rs checks 1, 2
//! and 3 threads).

use std::marker::PhantomData;
use std::ops::Range;
use std::sync::Arc;

use rayon::prelude::*;

use crate::backend::{Buffers, DeviceCollectives, Float, ModelKernels, OptimizerKernels, Stored};
use crate::memory::{with_kernel_ledger, MemoryTracker};
use crate::ops::flash_attention::{self, PAIR};
use crate::ops::float::{lane_sum, map_elements};
use crate::ops::gemm::Parallelism;
use crate::ops::optimizer::{HostOptimizerBuffers, OptimizerSlices, OptimizerState, Update};
use crate::ops::{attention, embedding, layernorm, linear, loss, mlp};

/// Elements per chunk of the elementwise kernels and of the ordered reductions.
const ELEMENT_CHUNK: usize = 1 << 14;
/// Rows per task of the cross-entropy forward (whose loss sums are added in task order).
const LOSS_ROWS: usize = 32;

/// CPU kernels on buffers of `S` (f32 for training, bf16/fp16 for mixed precision, f64
/// for gradient checks).
#[derive(Clone)]
pub struct CpuBackend<S: Stored = f32> {
    threads: usize,
    /// Where the kernels' per-call scratch is booked (the rank's ledger), if anywhere.
    ledger: Option<Arc<MemoryTracker>>,
    _format: PhantomData<S>,
}

impl<S: Stored> CpuBackend<S> {
    /// `threads` must match the rayon pool the kernels run in (at least 1).
    pub fn new(threads: usize) -> Self {
        Self { threads: threads.max(1), ledger: None, _format: PhantomData }
    }

    /// Books the scratch the kernels allocate per call (the f32 copies a 2-byte matrix
    /// product works on) in `ledger`, as transient.
    pub fn booking_scratch_in(mut self, ledger: &Arc<MemoryTracker>) -> Self {
        self.ledger = Some(ledger.clone());
        self
    }

    fn gemm_parallelism(&self) -> Parallelism {
        if self.threads > 1 {
            Parallelism::Rayon(self.threads)
        } else {
            Parallelism::None
        }
    }

    /// Rows per task for a row-wise kernel: about four tasks per thread.
    fn rows_per_task(&self, rows: usize) -> usize {
        if self.threads <= 1 {
            rows.max(1)
        } else {
            rows.div_ceil(4 * self.threads).max(1)
        }
    }

    /// Columns per task for a column-split reduction: one block per thread, 16-aligned.
    fn cols_per_task(&self, cols: usize) -> usize {
        if self.threads <= 1 {
            cols.max(1)
        } else {
            cols.div_ceil(self.threads).next_multiple_of(16).max(1)
        }
    }

    /// `dbias += Σ_rows dout`, a block of columns per thread.
    fn bias_backward(&self, dbias: &mut [S], dout: &[S], c_out: usize) {
        let w = self.cols_per_task(c_out);
        dbias.par_chunks_mut(w).enumerate().for_each(|(i, db)| linear::bias_backward(db, i * w, dout, c_out));
    }
}

/// Sum of `f(x)` over `x`, in f64: each chunk with 8 running sums (`lane_sum`: one sum
/// would make every addition wait for the one before), the chunks' sums added in order.
fn ordered_sum<S: Stored>(x: &[S], f: impl Fn(f64) -> f64 + Sync) -> f64 {
    let partials: Vec<f64> =
        x.par_chunks(ELEMENT_CHUNK).map(|chunk| lane_sum(chunk.len(), |i| f(chunk[i].to_f64()))).collect();
    partials.iter().sum()
}

impl<S: Stored> Buffers for CpuBackend<S> {
    type Elem = S;
    type Buf = Vec<S>;
    type View<'a> = &'a [S];
    type ViewMut<'a> = &'a mut [S];

    fn name(&self) -> &'static str {
        "cpu"
    }

    fn threads(&self) -> usize {
        self.threads
    }

    fn alloc(&self, len: usize) -> Vec<S> {
        vec![S::default(); len]
    }

    fn buf_len(&self, buf: &Vec<S>) -> usize {
        buf.len()
    }

    fn upload(&self, dst: &mut Vec<S>, src: &[S]) {
        dst[..src.len()].copy_from_slice(src);
    }

    fn download(&self, src: &Vec<S>, dst: &mut [S]) {
        dst.copy_from_slice(&src[..dst.len()]);
    }

    fn view<'a>(&self, buf: &'a Vec<S>, range: Range<usize>) -> &'a [S] {
        &buf[range]
    }

    fn view_mut<'a>(&self, buf: &'a mut Vec<S>, range: Range<usize>) -> &'a mut [S] {
        &mut buf[range]
    }

    fn subview<'a>(&self, view: Self::View<'a>, range: Range<usize>) -> Self::View<'a> {
        &view[range]
    }

    fn split_mut<'a>(&self, view: Self::ViewMut<'a>, mid: usize) -> (Self::ViewMut<'a>, Self::ViewMut<'a>) {
        view.split_at_mut(mid)
    }

    fn reborrow<'b>(&self, view: &'b mut Self::ViewMut<'_>) -> Self::ViewMut<'b> {
        view
    }

    fn freeze<'a>(&self, view: Self::ViewMut<'a>) -> Self::View<'a> {
        view
    }

    fn copy(&self, dst: &mut [S], src: &[S]) {
        dst.par_chunks_mut(ELEMENT_CHUNK).zip(src.par_chunks(ELEMENT_CHUNK)).for_each(|(d, s)| d.copy_from_slice(s));
    }

    fn add(&self, dst: &mut [S], src: &[S]) {
        assert_eq!(dst.len(), src.len(), "add between views of different lengths");
        dst.par_chunks_mut(ELEMENT_CHUNK)
            .zip(src.par_chunks(ELEMENT_CHUNK))
            .for_each(|(d, s)| map_elements(d, s, |x, y| y + x));
    }

    fn on_host<R>(&self, view: &mut [S], f: impl FnOnce(&mut [S]) -> R) -> R {
        f(view)
    }

    fn read_host<R>(&self, view: &[S], f: impl FnOnce(&[S]) -> R) -> R {
        f(view)
    }

    fn fill(&self, out: &mut [S], value: f64) {
        let v = S::from_f64(value);
        out.par_chunks_mut(ELEMENT_CHUNK).for_each(|chunk| chunk.fill(v));
    }
}

impl<S: Stored> ModelKernels for CpuBackend<S> {
    fn sum(&self, x: &[S]) -> f64 {
        ordered_sum(x, |v| v)
    }

    fn sum_squares(&self, x: &[S]) -> f64 {
        ordered_sum(x, |v| v * v)
    }

    fn encoder_forward(&self, out: &mut [S], tokens: &[u32], wte: &[S], wpe: &[S], seq_len: usize, c: usize) {
        let rows = tokens.len();
        let k = self.rows_per_task(rows);
        out[..rows * c].par_chunks_mut(k * c).enumerate().for_each(|(i, chunk)| {
            embedding::encoder_forward(chunk, tokens, i * k, wte, wpe, seq_len, c);
        });
    }

    fn encoder_backward(&self, dwte: &mut [S], dwpe: &mut [S], dout: &[S], tokens: &[u32], seq_len: usize, c: usize) {
        let dout = &dout[..tokens.len() * c];
        let vocab = dwte.len() / c;
        let kv = self.rows_per_task(vocab);
        let kt = self.rows_per_task(seq_len);
        rayon::join(
            || {
                dwte.par_chunks_mut(kv * c).enumerate().for_each(|(i, chunk)| {
                    embedding::encoder_backward_wte(chunk, i * kv, dout, tokens, c);
                })
            },
            || {
                dwpe[..seq_len * c].par_chunks_mut(kt * c).enumerate().for_each(|(i, chunk)| {
                    embedding::encoder_backward_wpe(chunk, i * kt, dout, seq_len, c);
                })
            },
        );
    }

    fn layernorm_forward(
        &self,
        out: &mut [S],
        mean: &mut [S],
        rstd: &mut [S],
        inp: &[S],
        gamma: &[S],
        beta: &[S],
        c: usize,
    ) {
        let k = self.rows_per_task(inp.len() / c);
        out.par_chunks_mut(k * c)
            .zip(mean.par_chunks_mut(k))
            .zip(rstd.par_chunks_mut(k))
            .zip(inp.par_chunks(k * c))
            .for_each(|(((y, m), r), x)| layernorm::layernorm_forward(y, m, r, x, gamma, beta, c));
    }

    fn layernorm_backward(
        &self,
        dinp: &mut [S],
        dgamma: &mut [S],
        dbeta: &mut [S],
        dout: &[S],
        inp: &[S],
        gamma: &[S],
        mean: &[S],
        rstd: &[S],
        c: usize,
    ) {
        let k = self.rows_per_task(inp.len() / c);
        let w = self.cols_per_task(c);
        rayon::join(
            || {
                dinp.par_chunks_mut(k * c)
                    .zip(dout.par_chunks(k * c))
                    .zip(inp.par_chunks(k * c))
                    .zip(mean.par_chunks(k))
                    .zip(rstd.par_chunks(k))
                    .for_each(|((((dx, dy), x), m), r)| layernorm::layernorm_backward_input(dx, dy, x, gamma, m, r, c));
            },
            || {
                dgamma.par_chunks_mut(w).zip(dbeta.par_chunks_mut(w)).enumerate().for_each(|(i, (dg, db))| {
                    layernorm::layernorm_backward_params(dg, db, i * w, dout, inp, mean, rstd, c);
                });
            },
        );
    }

    fn matmul_forward(
        &self,
        out: &mut [S],
        inp: &[S],
        weight: &[S],
        bias: Option<&[S]>,
        residual: Option<&[S]>,
        c_in: usize,
        c_out: usize,
    ) {
        let rows = inp.len() / c_in;
        let (k, par) = (self.rows_per_task(rows), self.gemm_parallelism());
        with_kernel_ledger(self.ledger.as_ref(), || {
            linear::matmul_forward(out, inp, weight, (bias, residual), c_in, c_out, k, par)
        });
    }

    fn matmul_backward(
        &self,
        dinp: Option<&mut [S]>,
        dweight: &mut [S],
        dbias: Option<&mut [S]>,
        dout: &[S],
        inp: &[S],
        weight: &[S],
        c_in: usize,
        c_out: usize,
    ) {
        let par = self.gemm_parallelism();
        with_kernel_ledger(self.ledger.as_ref(), || {
            linear::matmul_backward(dinp, dweight, dout, inp, weight, c_in, c_out, par);
        });
        if let Some(dbias) = dbias {
            self.bias_backward(dbias, dout, c_out);
        }
    }

    fn matmul_backward_input(&self, dinp: &mut [S], dout: &[S], weight: &[S], c_in: usize, c_out: usize) {
        let par = self.gemm_parallelism();
        with_kernel_ledger(self.ledger.as_ref(), || {
            linear::matmul_backward_input(dinp, dout, weight, c_in, c_out, par);
        });
    }

    fn matmul_backward_weights(
        &self,
        dweight: &mut [S],
        dbias: Option<&mut [S]>,
        dout: &[S],
        inp: &[S],
        c_in: usize,
        c_out: usize,
    ) {
        let par = self.gemm_parallelism();
        with_kernel_ledger(self.ledger.as_ref(), || {
            linear::matmul_backward_weight(dweight, dout, inp, c_in, c_out, par);
        });
        if let Some(dbias) = dbias {
            self.bias_backward(dbias, dout, c_out);
        }
    }

    fn attention_forward(&self, out: &mut [S], att: &mut [S], qkv: &[S], seq_len: usize, c: usize, heads: usize) {
        let t = seq_len;
        out.par_chunks_mut(t * c)
            .zip(att.par_chunks_mut(heads * t * t))
            .zip(qkv.par_chunks(t * 3 * c))
            .for_each(|((y, a), x)| attention::attention_forward(y, a, x, t, c, heads));
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
            .for_each(|((((dx, da), dy), x), a)| attention::attention_backward(dx, da, dy, x, a, t, c, heads));
    }

    fn flash_attention_forward(&self, out: &mut [S], lse: &mut [S], qkv: &[S], seq_len: usize, c: usize, heads: usize) {
        let t = seq_len;
        out.par_chunks_mut(t * c)
            .zip(lse.par_chunks_mut(heads * t * PAIR))
            .zip(qkv.par_chunks(t * 3 * c))
            .for_each(|((y, l), x)| flash_attention::flash_attention_forward(y, l, x, t, c, heads));
    }

    fn flash_attention_backward(
        &self,
        dqkv: &mut [S],
        delta: &mut [S],
        dout: &[S],
        qkv: &[S],
        out: &[S],
        lse: &[S],
        seq_len: usize,
        c: usize,
        heads: usize,
    ) {
        let t = seq_len;
        dqkv.par_chunks_mut(t * 3 * c)
            .zip(delta.par_chunks_mut(heads * t * PAIR))
            .zip(dout.par_chunks(t * c))
            .zip(qkv.par_chunks(t * 3 * c))
            .zip(out.par_chunks(t * c))
            .zip(lse.par_chunks(heads * t * PAIR))
            .for_each(|(((((dx, d), dy), x), y), l)| {
                flash_attention::flash_attention_backward(dx, d, dy, x, y, l, t, c, heads)
            });
    }

    fn gelu_forward(&self, out: &mut [S], inp: &[S]) {
        out.par_chunks_mut(ELEMENT_CHUNK).zip(inp.par_chunks(ELEMENT_CHUNK)).for_each(|(y, x)| mlp::gelu_forward(y, x));
    }

    fn gelu_backward(&self, dinout: &mut [S], inp: &[S]) {
        dinout
            .par_chunks_mut(ELEMENT_CHUNK)
            .zip(inp.par_chunks(ELEMENT_CHUNK))
            .for_each(|(d, x)| mlp::gelu_backward(d, x));
    }

    fn crossentropy_forward(&self, logits: &mut [S], losses: &mut [S], targets: &[u32], vocab: usize) -> f64 {
        // Tasks of a fixed number of rows, so the partial sums (and the loss) do not depend
        // on the thread count.
        let rows = targets.len();
        let k = LOSS_ROWS;
        let partials: Vec<f64> = logits[..rows * vocab]
            .par_chunks_mut(k * vocab)
            .zip(losses[..rows].par_chunks_mut(k))
            .zip(targets.par_chunks(k))
            .map(|((z, l), t)| loss::crossentropy_forward(z, l, t, vocab))
            .collect();
        partials.iter().sum()
    }

    fn crossentropy_backward(&self, probs: &mut [S], targets: &[u32], vocab: usize, dloss: f64) {
        let rows = targets.len();
        let k = self.rows_per_task(rows);
        let dloss = S::Acc::from_f64(dloss);
        probs[..rows * vocab]
            .par_chunks_mut(k * vocab)
            .zip(targets.par_chunks(k))
            .for_each(|(p, t)| loss::crossentropy_backward(p, t, vocab, dloss));
    }
}

impl<S: Stored> OptimizerKernels for CpuBackend<S> {
    type OptimizerBuffers = HostOptimizerBuffers<S::Acc>;

    fn optimizer_buffers(
        &self,
        len: usize,
        moments: bool,
        initial: impl FnOnce() -> Vec<f32>,
    ) -> Self::OptimizerBuffers {
        HostOptimizerBuffers::new::<S>(len, moments, initial)
    }

    fn optimizer_update(
        &self,
        params: &mut [S],
        grads: &[S],
        buffers: &mut Self::OptimizerBuffers,
        range: Range<usize>,
        update: &Update,
    ) {
        buffers.update(params, grads, range, update);
    }

    fn read_optimizer_buffers<R>(
        &self,
        buffers: &Self::OptimizerBuffers,
        f: impl FnOnce(OptimizerSlices<'_, S::Acc>) -> R,
    ) -> R {
        f(OptimizerSlices { m: &buffers.m, v: &buffers.v, master: buffers.master.as_deref() })
    }

    fn load_optimizer_buffers(
        &self,
        buffers: &mut Self::OptimizerBuffers,
        saved: &OptimizerState,
    ) -> Result<(), String> {
        buffers.load(saved)
    }
}

/// The CPU's buffers are host memory: every communicator reaches them, no collective runs
/// on a device.
impl<S: Stored> DeviceCollectives for CpuBackend<S> {}
