//! Softmax cross-entropy over the LM head's logits (the LM head itself is a
//! linear layer without bias, see `linear.rs`).
//!
//!   forward:  p_j = exp(z_j - m) / sum_k exp(z_k - m)   (m = max_k z_k)
//!             loss = log sum_k exp(z_k - m) - (z_target - m)
//!   backward: dz_j = dloss * (p_j - [j == target])
//!
//! Both work in place on one (rows, vocab) buffer: logits -> probs -> dlogits.

use rayon::prelude::*;

use crate::backend::buffers::Buffers;
use crate::backend::cpu::CpuBackend;
use crate::ops::float::{lane_max, lane_sum};
use crate::ops::float::{Float, Stored};
use crate::ops::simd::simd_kernel;

/// Rows per task of the CPU's forward (whose loss sums are added in task order, so the
/// loss does not depend on the thread count).
const LOSS_ROWS: usize = 32;

simd_kernel! {
    /// A chunk of rows: logits become probabilities; `losses[r]` = that row's loss. Returns
    /// the chunk's sum of losses, added in f64 before they are rounded to the stored format
    /// (the reported loss keeps full precision in bf16 and fp16 too).
    pub fn crossentropy_forward<F: Float, S: Stored<Acc = F>>(
        logits: &mut [S],
        losses: &mut [S],
        targets: &[u32],
        vocab: usize,
    ) -> f64 {
        let mut total = 0.0f64;
        let mut exps = vec![F::ZERO; vocab];
        for ((z, loss), &target) in logits.chunks_exact_mut(vocab).zip(losses.iter_mut()).zip(targets) {
            let target = target as usize;
            let m = lane_max(vocab, |j| z[j].load());
            let z_target = z[target].load();
            for (e, v) in exps.iter_mut().zip(z.iter()) {
                *e = (v.load() - m).exp();
            }
            let sum = lane_sum(vocab, |j| exps[j]);
            let inv = F::ONE / sum;
            for (v, &e) in z.iter_mut().zip(&exps) {
                *v = S::store(e * inv);
            }
            let row_loss = sum.ln() - (z_target - m);
            total += row_loss.to_f64();
            *loss = S::store(row_loss);
        }
        total
    }
}

simd_kernel! {
    /// A chunk of rows: probabilities become `dloss * (p - onehot)`.
    pub fn crossentropy_backward<F: Float, S: Stored<Acc = F>>(probs: &mut [S], targets: &[u32], vocab: usize, dloss: F) {
        for (p, &target) in probs.chunks_exact_mut(vocab).zip(targets) {
            let target = target as usize;
            let p_target = p[target].load();
            for v in p.iter_mut() {
                *v = S::store(v.load() * dloss);
            }
            p[target] = S::store(p_target * dloss - dloss);
        }
    }
}

/// The softmax cross-entropy on a backend's views (the conventions: `backend/mod.rs`).
pub trait CrossEntropyKernels: Buffers {
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

impl<S: Stored> CrossEntropyKernels for CpuBackend<S> {
    fn crossentropy_forward(&self, logits: &mut [S], losses: &mut [S], targets: &[u32], vocab: usize) -> f64 {
        // Tasks of a fixed number of rows, so the partial sums (and the loss) do not depend
        // on the thread count.
        let rows = targets.len();
        let k = LOSS_ROWS;
        let partials: Vec<f64> = logits[..rows * vocab]
            .par_chunks_mut(k * vocab)
            .zip(losses[..rows].par_chunks_mut(k))
            .zip(targets.par_chunks(k))
            .map(|((z, l), t)| crossentropy_forward(z, l, t, vocab))
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
            .for_each(|(p, t)| crossentropy_backward(p, t, vocab, dloss));
    }
}

/// The launch of the cross-entropy's kernels (`loss.cu`): one block per row; each row's loss
/// comes back to the host in f64 and is added there in row order.
#[cfg(feature = "cuda")]
mod cuda {
    use super::CrossEntropyKernels;
    use crate::backend::cuda::CudaBackend;
    use crate::ops::cuda::{block_per_row, check_tokens, int, launch, DeviceElem, DeviceViewMut};

    impl<S: DeviceElem> CrossEntropyKernels for CudaBackend<S> {
        fn crossentropy_forward(
            &self,
            logits: DeviceViewMut<'_, S>,
            losses: DeviceViewMut<'_, S>,
            targets: &[u32],
            vocab: usize,
        ) -> f64 {
            let gpu = &self.launcher;
            let rows = logits.len / vocab;
            if rows == 0 {
                return 0.0;
            }
            check_tokens("crossentropy_forward", &targets[..rows], vocab);
            assert!(losses.len >= rows, "crossentropy_forward: {} losses for {rows} rows", losses.len);
            let targets = gpu.upload(&targets[..rows]);
            let row_loss = gpu.scratch::<f64>(rows);
            launch!(
                gpu,
                "crossentropy_forward",
                block_per_row(rows),
                logits.ptr,
                losses.ptr,
                gpu.ptr_of(&row_loss),
                gpu.ptr_of(&targets),
                int(vocab)
            );
            gpu.download_f64(&row_loss, rows).iter().sum()
        }

        fn crossentropy_backward(&self, probs: DeviceViewMut<'_, S>, targets: &[u32], vocab: usize, dloss: f64) {
            let gpu = &self.launcher;
            let rows = probs.len / vocab;
            if rows == 0 {
                return;
            }
            check_tokens("crossentropy_backward", &targets[..rows], vocab);
            let targets = gpu.upload(&targets[..rows]);
            launch!(
                gpu,
                "crossentropy_backward",
                block_per_row(rows),
                probs.ptr,
                gpu.ptr_of(&targets),
                int(vocab),
                dloss as f32
            );
        }
    }
}
