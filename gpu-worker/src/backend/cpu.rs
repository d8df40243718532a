//! The CPU backend: buffers are `Vec`s, views are slices, and every kernel is split over
//! the threads of the rayon pool the caller runs us in (`pool.install`). Each op's file in
//! `ops/` implements its kernels' trait for [`CpuBackend`] beside the math (with the
//! splitting helpers here); this file holds the buffers, the optimizer's state and update,
//! and the collectives' (absent) device path.
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

use crate::backend::{Buffers, DeviceCollectives, OptimizerKernels, Stored};
use crate::memory::MemoryTracker;
use crate::ops::float::map_elements;
use crate::ops::gemm::Parallelism;
use crate::ops::optimizer::{HostOptimizerBuffers, OptimizerSlices, OptimizerState, TrustPass, Update};

/// Elements per task of the elementwise kernels and of the ordered sums (`ops/reductions.rs`).
pub(crate) const ELEMENT_CHUNK: usize = 1 << 14;

/// CPU kernels on buffers of `S` (f32 for training, bf16/fp16 for mixed precision, f64
/// for gradient checks).
#[derive(Clone)]
pub struct CpuBackend<S: Stored = f32> {
    threads: usize,
    /// Where the kernels' per-call scratch is booked (the rank's ledger), if anywhere.
    pub(crate) ledger: Option<Arc<MemoryTracker>>,
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

    pub(crate) fn gemm_parallelism(&self) -> Parallelism {
        if self.threads > 1 {
            Parallelism::Rayon(self.threads)
        } else {
            Parallelism::None
        }
    }

    /// Rows per task for a row-wise kernel: about four tasks per thread.
    pub(crate) fn rows_per_task(&self, rows: usize) -> usize {
        if self.threads <= 1 {
            rows.max(1)
        } else {
            rows.div_ceil(4 * self.threads).max(1)
        }
    }

    /// Columns per task for a column-split reduction: one block per thread, 16-aligned.
    pub(crate) fn cols_per_task(&self, cols: usize) -> usize {
        if self.threads <= 1 {
            cols.max(1)
        } else {
            cols.div_ceil(self.threads).next_multiple_of(16).max(1)
        }
    }
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

    fn move_to_host(&self, buf: Vec<S>) -> Vec<S> {
        buf
    }

    fn move_from_host(&self, host: Vec<S>) -> Vec<S> {
        host
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

    fn trust_squares(
        &self,
        params: &[S],
        grads: &[S],
        buffers: &Self::OptimizerBuffers,
        range: Range<usize>,
        pass: &TrustPass,
    ) -> (f64, f64) {
        buffers.trust_squares(params, grads, range, pass)
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
