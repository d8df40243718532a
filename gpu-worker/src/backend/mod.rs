//! Backends: where buffers live and how the model's kernels run on them.
//!
//! The trait is deliberately small: the buffers and the dozen kernels a GPT
//! needs (llm.c's list). The optimizer's kernels (`optim.rs`) run on host slices: its
//! state is fp32 whatever the model's format. Kernels work on views of backend-owned buffers, so a
//! GPU backend can implement it with device memory (`CudaView` / `CudaViewMut`
//! in cudarc) the same way the CPU backend does with slices. Token ids are
//! passed as host slices (a few KiB per micro-batch; a GPU backend copies them).
//!
//! Conventions every implementation follows:
//! - tensors are row-major; `rows` of an activation is its length / its width `c`;
//! - a linear layer computes `out = inp · W + b` with `W` stored `(c_in, c_out)`;
//! - kernels that write a *parameter* gradient ACCUMULATE (`+=`), so micro-batches
//!   add up; the trainer zeroes the gradients once per optimizer step;
//! - activation gradients are overwritten, except where a kernel says it adds
//!   into the residual stream (`layernorm_backward`).
//!
//! The math of each CPU kernel lives beside the model layer that uses it
//! (`ops/layernorm.rs` holds `layernorm_forward` and `layernorm_backward`, llm.c
//! style); `cpu.rs` splits the work over threads and calls them.

pub mod cpu;
#[cfg(feature = "cuda")]
pub mod cuda;

use std::ops::Range;

use crate::comm::{CommError, Communicator, InPlace};
pub use crate::ops::float::{Float, Stored};
use crate::optim::{OptimizerSlices, OptimizerState, Update};
pub use cpu::CpuBackend;

pub trait Backend: Send + Sync + 'static {
    /// Number format of every buffer: f32 for training, bf16 or fp16 for mixed precision
    /// (kernels compute in f32 and round on the store), f64 on the CPU for checks.
    type Elem: Stored;
    /// An owned buffer of `Elem`s on the device.
    type Buf: Send + Sync;
    /// A read-only range of a buffer.
    type View<'a>: Copy + Send + Sync;
    /// A writable range of a buffer.
    type ViewMut<'a>: Send;

    /// Short name for logs ("cpu").
    fn name(&self) -> &'static str;
    /// Waits until every kernel queued so far has finished, so that a clock read after it
    /// times them (a GPU queues kernels and returns at once; the CPU runs them in the call).
    fn synchronize(&self) {}
    /// Device memory this backend's run uses now, measured by the driver (free when the
    /// backend was made minus free now), for a backend whose buffers are not on the host
    /// heap; None for the CPU backend, whose buffers the heap measurement counts.
    fn device_memory_used(&self) -> Option<u64> {
        None
    }
    /// Whether the buffers are host memory (the CPU backend), so that what the host holds
    /// for the run is device memory too (an offloaded optimizer's piece).
    fn buffers_on_host(&self) -> bool {
        true
    }
    /// Threads the kernels use.
    fn threads(&self) -> usize;

    // ---- memory -------------------------------------------------------------

    /// A zero-filled buffer of `len` elements.
    fn alloc(&self, len: usize) -> Self::Buf;
    fn buf_len(&self, buf: &Self::Buf) -> usize;
    /// Copies host data into the start of `dst`.
    fn upload(&self, dst: &mut Self::Buf, src: &[Self::Elem]);
    /// Copies the start of `src` to the host.
    fn download(&self, src: &Self::Buf, dst: &mut [Self::Elem]);
    fn view<'a>(&self, buf: &'a Self::Buf, range: Range<usize>) -> Self::View<'a>;
    fn view_mut<'a>(&self, buf: &'a mut Self::Buf, range: Range<usize>) -> Self::ViewMut<'a>;
    /// Part `range` of a read-only view (one expert's weights inside a tensor of them).
    fn subview<'a>(&self, view: Self::View<'a>, range: Range<usize>) -> Self::View<'a>;
    /// Splits a writable view at `mid` (so that several parameter gradients can be
    /// written at once).
    fn split_mut<'a>(&self, view: Self::ViewMut<'a>, mid: usize) -> (Self::ViewMut<'a>, Self::ViewMut<'a>);
    /// A shorter-lived copy of a writable view, so the view can be handed to a kernel
    /// and still be used afterwards.
    fn reborrow<'b>(&self, view: &'b mut Self::ViewMut<'_>) -> Self::ViewMut<'b>;
    /// Gives up writing: the same range read-only, for as long as the view lived
    /// (how backward hands finished gradients to data parallelism while it goes on).
    fn freeze<'a>(&self, view: Self::ViewMut<'a>) -> Self::View<'a>;
    /// The whole buffer, read-only.
    fn all<'a>(&self, buf: &'a Self::Buf) -> Self::View<'a> {
        self.view(buf, 0..self.buf_len(buf))
    }
    /// The whole buffer, writable.
    fn all_mut<'a>(&self, buf: &'a mut Self::Buf) -> Self::ViewMut<'a> {
        let len = self.buf_len(buf);
        self.view_mut(buf, 0..len)
    }
    fn fill(&self, out: Self::ViewMut<'_>, value: f64);
    /// `dst = src` (the same length).
    fn copy(&self, dst: Self::ViewMut<'_>, src: Self::View<'_>);
    /// `dst += src` (the same length), in f32, rounded once.
    fn add(&self, dst: Self::ViewMut<'_>, src: Self::View<'_>);

    // ---- host access (collectives over host channels, the optimizer, checkpoints) ----

    /// Runs `f` on the elements of `view` in host memory, and keeps what it writes: the
    /// CPU backend's buffers are host memory already; a GPU backend stages the range
    /// through the host (copied down, then back up).
    fn on_host<R>(&self, view: Self::ViewMut<'_>, f: impl FnOnce(&mut [Self::Elem]) -> R) -> R;
    /// Runs `f` on the elements of `view` read in host memory.
    fn read_host<R>(&self, view: Self::View<'_>, f: impl FnOnce(&[Self::Elem]) -> R) -> R;

    // ---- collectives where the buffers live ------------------------------------------

    /// Whether `comm` moves this backend's memory itself (NCCL between GPUs), so that a
    /// collective on a buffer needs no trip through the host. The CPU backend's buffers are
    /// host memory: every communicator works on them directly.
    fn reaches(&self, _comm: &mut dyn Communicator) -> bool {
        false
    }
    /// Runs `op` through `comm` on `view` where it lives, summing in f32 whatever `Elem`
    /// is; its result is there for every kernel queued afterwards. Only for a `comm` this
    /// backend [`reaches`](Backend::reaches).
    fn device_collective(
        &self,
        _comm: &mut dyn Communicator,
        _view: Self::ViewMut<'_>,
        op: InPlace,
    ) -> Result<(), CommError> {
        Err(CommError::BadBuffer {
            collective: format!("{op:?}"),
            detail: format!("the {} backend's buffers are host memory: no collective runs on a device", self.name()),
        })
    }

    // ---- the optimizer (`optim.rs`: its math and its CPU kernels) -------------------

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

    // ---- reductions (return to the host) ---------------------------------------

    /// Sum of the elements, accumulated in f64 in a fixed order (deterministic).
    fn sum(&self, x: Self::View<'_>) -> f64;
    /// Sum of squares (for the global gradient norm), in f64, fixed order.
    fn sum_squares(&self, x: Self::View<'_>) -> f64;

    // ---- model kernels ------------------------------------------------------------

    /// `out[b,t,:] = wte[tokens[b,t],:] + wpe[t,:]`; tokens has `rows` ids, `seq_len` per sequence.
    fn encoder_forward(
        &self,
        out: Self::ViewMut<'_>,
        tokens: &[u32],
        wte: Self::View<'_>,
        wpe: Self::View<'_>,
        seq_len: usize,
        c: usize,
    );
    /// `dwte[tokens[b,t],:] += dout[b,t,:]`, `dwpe[t,:] += sum_b dout[b,t,:]`.
    fn encoder_backward(
        &self,
        dwte: Self::ViewMut<'_>,
        dwpe: Self::ViewMut<'_>,
        dout: Self::View<'_>,
        tokens: &[u32],
        seq_len: usize,
        c: usize,
    );

    /// LayerNorm over rows of width `c`: saves each row's mean and 1/std for backward.
    #[allow(clippy::too_many_arguments)]
    fn layernorm_forward(
        &self,
        out: Self::ViewMut<'_>,
        mean: Self::ViewMut<'_>,
        rstd: Self::ViewMut<'_>,
        inp: Self::View<'_>,
        gamma: Self::View<'_>,
        beta: Self::View<'_>,
        c: usize,
    );
    /// ADDS the input gradient into `dinp` (the residual stream) and accumulates
    /// `dgamma`, `dbeta`.
    #[allow(clippy::too_many_arguments)]
    fn layernorm_backward(
        &self,
        dinp: Self::ViewMut<'_>,
        dgamma: Self::ViewMut<'_>,
        dbeta: Self::ViewMut<'_>,
        dout: Self::View<'_>,
        inp: Self::View<'_>,
        gamma: Self::View<'_>,
        mean: Self::View<'_>,
        rstd: Self::View<'_>,
        c: usize,
    );

    /// `out = [residual +] inp · W [+ bias]`, `W` is `(c_in, c_out)`.
    #[allow(clippy::too_many_arguments)]
    fn matmul_forward(
        &self,
        out: Self::ViewMut<'_>,
        inp: Self::View<'_>,
        weight: Self::View<'_>,
        bias: Option<Self::View<'_>>,
        residual: Option<Self::View<'_>>,
        c_in: usize,
        c_out: usize,
    );
    /// `dinp = dout · Wᵀ` (overwritten), `dW += inpᵀ · dout`, `dbias += Σ_rows dout`.
    #[allow(clippy::too_many_arguments)]
    fn matmul_backward(
        &self,
        dinp: Option<Self::ViewMut<'_>>,
        dweight: Self::ViewMut<'_>,
        dbias: Option<Self::ViewMut<'_>>,
        dout: Self::View<'_>,
        inp: Self::View<'_>,
        weight: Self::View<'_>,
        c_in: usize,
        c_out: usize,
    ) {
        if let Some(dinp) = dinp {
            self.matmul_backward_input(dinp, dout, weight, c_in, c_out);
        }
        self.matmul_backward_weights(dweight, dbias, dout, inp, c_in, c_out);
    }
    /// The input's half of [`Self::matmul_backward`] (ZB-H1's B): `dinp = dout · Wᵀ`.
    fn matmul_backward_input(
        &self,
        dinp: Self::ViewMut<'_>,
        dout: Self::View<'_>,
        weight: Self::View<'_>,
        c_in: usize,
        c_out: usize,
    );
    /// The weights' half (ZB-H1's W): `dW += inpᵀ · dout`, `dbias += Σ_rows dout`.
    fn matmul_backward_weights(
        &self,
        dweight: Self::ViewMut<'_>,
        dbias: Option<Self::ViewMut<'_>>,
        dout: Self::View<'_>,
        inp: Self::View<'_>,
        c_in: usize,
        c_out: usize,
    );

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

    /// The same attention, FlashAttention's way (ops/flash_attention.rs): tile by tile,
    /// keeping only `out` and, in `lse`, one log-sum-exp per row as a (hi, lo) pair of the
    /// storage format, `(batch, heads, seq_len, 2)`.
    fn flash_attention_forward(
        &self,
        out: Self::ViewMut<'_>,
        lse: Self::ViewMut<'_>,
        qkv: Self::View<'_>,
        seq_len: usize,
        c: usize,
        heads: usize,
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
        seq_len: usize,
        c: usize,
        heads: usize,
    );

    /// GELU, tanh approximation.
    fn gelu_forward(&self, out: Self::ViewMut<'_>, inp: Self::View<'_>);
    /// In place: `dinout = dinout * gelu'(inp)`.
    fn gelu_backward(&self, dinout: Self::ViewMut<'_>, inp: Self::View<'_>);

    /// In place: logits -> softmax probabilities (rows of width `vocab`);
    /// `losses[r] = -ln probs[r, targets[r]]`. Returns the sum of the losses, taken before
    /// they are rounded to the buffer's format, added in a fixed order.
    fn crossentropy_forward(
        &self,
        logits: Self::ViewMut<'_>,
        losses: Self::ViewMut<'_>,
        targets: &[u32],
        vocab: usize,
    ) -> f64;
    /// In place: probs -> dlogits = `dloss * (probs - onehot(targets))`, where `dloss`
    /// is d(objective)/d(each token's loss).
    fn crossentropy_backward(&self, probs: Self::ViewMut<'_>, targets: &[u32], vocab: usize, dloss: f64);
}
