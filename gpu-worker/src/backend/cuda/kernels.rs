//! The CUDA backend's model kernels: each a delegation to its op's launch (`ops/<op>.rs`'s
//! `cuda` module, beside `ops/<op>.cu`), and the ordered sums (`cuda_reductions.cu`).

use cudarc::driver::LaunchConfig;

use super::CudaBackend;
use crate::backend::ModelKernels;
use crate::ops::cuda::{launch, DeviceElem, DeviceView, DeviceViewMut, BLOCK};
use crate::ops::{attention, embedding, flash_attention, layernorm, linear, loss, mlp};

/// Elements per block of `sum` / `sum_squares`.
const SUM_CHUNK: usize = 1 << 16;

impl<S: DeviceElem> CudaBackend<S> {
    fn ordered_sum(&self, x: DeviceView<'_, S>, squares: bool) -> f64 {
        if x.len == 0 {
            return 0.0;
        }
        let blocks = x.len.div_ceil(SUM_CHUNK);
        let partial = self.launcher.scratch::<f64>(blocks);
        let cfg = LaunchConfig { grid_dim: (blocks as u32, 1, 1), block_dim: (BLOCK, 1, 1), shared_mem_bytes: 0 };
        launch!(
            self.launcher,
            "partial_sums",
            cfg,
            x.ptr,
            x.len as i64,
            SUM_CHUNK as i64,
            self.launcher.ptr_of(&partial),
            squares as i32
        );
        self.launcher.download_f64(&partial, blocks).iter().sum()
    }
}

impl<S: DeviceElem> ModelKernels for CudaBackend<S> {
    fn sum(&self, x: DeviceView<'_, S>) -> f64 {
        self.ordered_sum(x, false)
    }

    fn sum_squares(&self, x: DeviceView<'_, S>) -> f64 {
        self.ordered_sum(x, true)
    }

    fn encoder_forward(
        &self,
        out: DeviceViewMut<'_, S>,
        tokens: &[u32],
        wte: DeviceView<'_, S>,
        wpe: DeviceView<'_, S>,
        seq_len: usize,
        c: usize,
    ) {
        embedding::cuda::encoder_forward(&self.launcher, out, tokens, wte, wpe, seq_len, c);
    }

    fn encoder_backward(
        &self,
        dwte: DeviceViewMut<'_, S>,
        dwpe: DeviceViewMut<'_, S>,
        dout: DeviceView<'_, S>,
        tokens: &[u32],
        seq_len: usize,
        c: usize,
    ) {
        embedding::cuda::encoder_backward(&self.launcher, dwte, dwpe, dout, tokens, seq_len, c);
    }

    fn layernorm_forward(
        &self,
        out: DeviceViewMut<'_, S>,
        mean: DeviceViewMut<'_, S>,
        rstd: DeviceViewMut<'_, S>,
        inp: DeviceView<'_, S>,
        gamma: DeviceView<'_, S>,
        beta: DeviceView<'_, S>,
        c: usize,
    ) {
        layernorm::cuda::layernorm_forward(&self.launcher, out, mean, rstd, inp, gamma, beta, c);
    }

    fn layernorm_backward(
        &self,
        dinp: DeviceViewMut<'_, S>,
        dgamma: DeviceViewMut<'_, S>,
        dbeta: DeviceViewMut<'_, S>,
        dout: DeviceView<'_, S>,
        inp: DeviceView<'_, S>,
        gamma: DeviceView<'_, S>,
        mean: DeviceView<'_, S>,
        rstd: DeviceView<'_, S>,
        c: usize,
    ) {
        layernorm::cuda::layernorm_backward(&self.launcher, dinp, dgamma, dbeta, dout, inp, gamma, mean, rstd, c);
    }

    fn matmul_forward(
        &self,
        out: DeviceViewMut<'_, S>,
        inp: DeviceView<'_, S>,
        weight: DeviceView<'_, S>,
        bias: Option<DeviceView<'_, S>>,
        residual: Option<DeviceView<'_, S>>,
        c_in: usize,
        c_out: usize,
    ) {
        linear::cuda::matmul_forward(&self.launcher, out, inp, weight, bias, residual, c_in, c_out);
    }

    fn matmul_backward_input(
        &self,
        dinp: DeviceViewMut<'_, S>,
        dout: DeviceView<'_, S>,
        weight: DeviceView<'_, S>,
        c_in: usize,
        c_out: usize,
    ) {
        linear::cuda::matmul_backward_input(&self.launcher, dinp, dout, weight, c_in, c_out);
    }

    fn matmul_backward_weights(
        &self,
        dweight: DeviceViewMut<'_, S>,
        dbias: Option<DeviceViewMut<'_, S>>,
        dout: DeviceView<'_, S>,
        inp: DeviceView<'_, S>,
        c_in: usize,
        c_out: usize,
    ) {
        linear::cuda::matmul_backward_weights(&self.launcher, dweight, dbias, dout, inp, c_in, c_out);
    }

    fn attention_forward(
        &self,
        out: DeviceViewMut<'_, S>,
        att: DeviceViewMut<'_, S>,
        qkv: DeviceView<'_, S>,
        seq_len: usize,
        c: usize,
        heads: usize,
    ) {
        attention::cuda::attention_forward(&self.launcher, out, att, qkv, seq_len, c, heads);
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
        attention::cuda::attention_backward(&self.launcher, dqkv, datt, dout, qkv, att, seq_len, c, heads);
    }

    fn flash_attention_forward(
        &self,
        out: DeviceViewMut<'_, S>,
        lse: DeviceViewMut<'_, S>,
        qkv: DeviceView<'_, S>,
        seq_len: usize,
        c: usize,
        heads: usize,
    ) {
        flash_attention::cuda::flash_attention_forward(&self.launcher, out, lse, qkv, seq_len, c, heads);
    }

    fn flash_attention_backward(
        &self,
        dqkv: DeviceViewMut<'_, S>,
        delta: DeviceViewMut<'_, S>,
        dout: DeviceView<'_, S>,
        qkv: DeviceView<'_, S>,
        out: DeviceView<'_, S>,
        lse: DeviceView<'_, S>,
        seq_len: usize,
        c: usize,
        heads: usize,
    ) {
        flash_attention::cuda::flash_attention_backward(
            &self.launcher,
            dqkv,
            delta,
            dout,
            qkv,
            out,
            lse,
            seq_len,
            c,
            heads,
        );
    }

    fn gelu_forward(&self, out: DeviceViewMut<'_, S>, inp: DeviceView<'_, S>) {
        mlp::cuda::gelu_forward(&self.launcher, out, inp);
    }

    fn gelu_backward(&self, dinout: DeviceViewMut<'_, S>, inp: DeviceView<'_, S>) {
        mlp::cuda::gelu_backward(&self.launcher, dinout, inp);
    }

    fn crossentropy_forward(
        &self,
        logits: DeviceViewMut<'_, S>,
        losses: DeviceViewMut<'_, S>,
        targets: &[u32],
        vocab: usize,
    ) -> f64 {
        loss::cuda::crossentropy_forward(&self.launcher, logits, losses, targets, vocab)
    }

    fn crossentropy_backward(&self, probs: DeviceViewMut<'_, S>, targets: &[u32], vocab: usize, dloss: f64) {
        loss::cuda::crossentropy_backward(&self.launcher, probs, targets, vocab, dloss);
    }
}
