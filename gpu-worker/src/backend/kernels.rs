//! [`ModelKernels`]: the kernels a GPT needs (llm.c's list), each op's math and CPU kernel
//! in `ops/<op>.rs` beside its CUDA kernel (`ops/<op>.cu`) and that kernel's launch
//! (`ops/<op>.rs`'s `cuda` module): the CPU backend splits each kernel's work over threads,
//! the CUDA backend's implementation only delegates to the launch.

use super::Buffers;

/// The model's kernels on a backend's views (the conventions they follow: `backend/mod.rs`).
pub trait ModelKernels: Buffers {
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
