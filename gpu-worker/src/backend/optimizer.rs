//! [`OptimizerKernels`]: the optimizer's state where a backend's buffers live and its
//! update there (the update's math and CPU kernels: `ops/optimizer.rs`, beside its `.cu`).

use std::ops::Range;

use super::Buffers;
use crate::ops::float::Stored;
use crate::ops::optimizer::{OptimizerSlices, OptimizerState, TrustPass, Update};

/// An optimizer's state and update on a backend (the optimizer itself, `optim/`, decides
/// what to update with what; it may also keep the state off the device, `optim/offload.rs`).
pub trait OptimizerKernels: Buffers {
    /// The optimizer's state where this backend's buffers live, f32 whatever `Elem` is:
    /// AdamW's m and v, and the master weights of a bf16/fp16 model.
    type OptimizerBuffers: Send + Sync;
    /// Buffers for `len` parameters: the moments (with `moments`), and master weights
    /// starting from `initial` (the parameters' fp32 values) when `Elem` is not f32.
    fn optimizer_buffers(
        &self,
        len: usize,
        moments: bool,
        initial: impl FnOnce() -> Vec<f32>,
    ) -> Self::OptimizerBuffers;
    /// One update of `params` from `grads` (as long), whose optimizer state is `range` of
    /// `buffers`.
    fn optimizer_update(
        &self,
        params: Self::ViewMut<'_>,
        grads: Self::View<'_>,
        buffers: &mut Self::OptimizerBuffers,
        range: Range<usize>,
        update: &Update,
    );
    /// A layer-wise update's first pass over a piece of one tensor whose state is `range`
    /// of `buffers`: (Σw², Σu²) as [`TrustPass`] says, summed in an order that depends on
    /// the piece alone. Reads, changes nothing.
    fn trust_squares(
        &self,
        params: Self::View<'_>,
        grads: Self::View<'_>,
        buffers: &Self::OptimizerBuffers,
        range: Range<usize>,
        pass: &TrustPass,
    ) -> (f64, f64);
    /// Runs `f` on the buffers read in host memory (for checkpoints).
    fn read_optimizer_buffers<R>(
        &self,
        buffers: &Self::OptimizerBuffers,
        f: impl FnOnce(OptimizerSlices<'_, <Self::Elem as Stored>::Acc>) -> R,
    ) -> R;
    /// Puts back a checkpoint's state; an error when its lengths are not the buffers'.
    fn load_optimizer_buffers(
        &self,
        buffers: &mut Self::OptimizerBuffers,
        saved: &OptimizerState,
    ) -> Result<(), String>;
}
