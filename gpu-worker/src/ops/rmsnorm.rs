//! RMSNorm over the last dimension (width c), eps = 1e-5 (Llama's `rms_norm_eps`): a
//! LayerNorm without the mean and without the bias (Zhang & Sennrich 2019).
//!
//!   forward:  rstd = 1 / sqrt((1/c) sum_j x_j^2 + eps),   xhat_j = x_j * rstd
//!             y_j = xhat_j * gamma_j
//!   backward: g_j = dy_j * gamma_j
//!             dx_j += rstd * (g_j - xhat_j * mean_k(g_k * xhat_k))
//!             dgamma_j += sum_rows dy_j * xhat_j
//!
//! As in layernorm.rs: rows are independent (the CPU backend splits them over threads),
//! the gain's gradient is a sum over rows split over column ranges instead, so that each
//! column is summed in row order whatever the thread count.

use rayon::prelude::*;

use crate::backend::buffers::Buffers;
use crate::backend::cpu::CpuBackend;
use crate::ops::float::{lane_sum, AccRow};
use crate::ops::float::{Float, Stored};
use crate::ops::simd::simd_kernel;

pub const RMSNORM_EPS: f64 = 1e-5;

simd_kernel! {
    /// A chunk of rows: `out`, `inp` are `rows x c`; `rstd` has `rows` entries.
    pub fn rmsnorm_forward<F: Float, S: Stored<Acc = F>>(
        out: &mut [S],
        rstd: &mut [S],
        inp: &[S],
        gamma: &[S],
        c: usize,
    ) {
        let inv_c = F::from_f64(1.0 / c as f64);
        let eps = F::from_f64(RMSNORM_EPS);
        let (mut gamma_acc, mut x_acc, mut y_acc) = (AccRow::new(), AccRow::new(), AccRow::new());
        let gamma = gamma_acc.load(&gamma[..c]);
        for ((y, x), s) in out.chunks_exact_mut(c).zip(inp.chunks_exact(c)).zip(rstd.iter_mut()) {
            let x = x_acc.load(x);
            let r = F::ONE / (lane_sum(c, |j| x[j] * x[j]) * inv_c + eps).sqrt();
            for ((y, &x), &g) in y_acc.open(y, false).iter_mut().zip(x).zip(gamma) {
                *y = x * r * g;
            }
            y_acc.store(y);
            *s = S::store(r);
        }
    }
}

simd_kernel! {
    /// A chunk of rows: ADDS the input gradient into `dinp`.
    pub fn rmsnorm_backward_input<F: Float, S: Stored<Acc = F>>(
        dinp: &mut [S],
        dout: &[S],
        inp: &[S],
        gamma: &[S],
        rstd: &[S],
        c: usize,
    ) {
        let inv_c = F::from_f64(1.0 / c as f64);
        let (mut gamma_acc, mut dy_acc, mut x_acc, mut dx_acc) = (AccRow::new(), AccRow::new(), AccRow::new(), AccRow::new());
        let gamma = gamma_acc.load(&gamma[..c]);
        for (((dx, dy), x), &r) in dinp.chunks_exact_mut(c).zip(dout.chunks_exact(c)).zip(inp.chunks_exact(c)).zip(rstd) {
            let (dy, x, r) = (dy_acc.load(&dy[..c]), x_acc.load(&x[..c]), r.load());
            let mean_gx = lane_sum(c, |j| dy[j] * gamma[j] * x[j] * r) * inv_c;
            for (((dx, &dy), &x), &g) in dx_acc.open(dx, true).iter_mut().zip(dy).zip(x).zip(gamma) {
                *dx += r * (dy * g - x * r * mean_gx);
            }
            dx_acc.store(dx);
        }
    }
}

simd_kernel! {
    /// Columns `col0..col0 + dgamma.len()` of the gain's gradient, summed over all rows.
    pub fn rmsnorm_backward_params<F: Float, S: Stored<Acc = F>>(
        dgamma: &mut [S],
        col0: usize,
        dout: &[S],
        inp: &[S],
        rstd: &[S],
        c: usize,
    ) {
        let w = dgamma.len();
        let (mut dy_acc, mut x_acc, mut dgamma_acc) = (AccRow::new(), AccRow::new(), AccRow::new());
        let dgamma_sum = dgamma_acc.open(dgamma, true);
        for ((dy, x), &r) in dout.chunks_exact(c).zip(inp.chunks_exact(c)).zip(rstd) {
            let (dy, x, r) = (dy_acc.load(&dy[col0..col0 + w]), x_acc.load(&x[col0..col0 + w]), r.load());
            for ((dg, &dy), &x) in dgamma_sum.iter_mut().zip(dy).zip(x) {
                *dg += dy * x * r;
            }
        }
        dgamma_acc.store(dgamma);
    }
}

/// RMSNorm on a backend's views (the conventions: `backend/mod.rs`).
pub trait RmsNormKernels: Buffers {
    /// RMSNorm over rows of width `c`: saves each row's 1/rms for backward.
    fn rmsnorm_forward(
        &self,
        out: Self::ViewMut<'_>,
        rstd: Self::ViewMut<'_>,
        inp: Self::View<'_>,
        gamma: Self::View<'_>,
        c: usize,
    );

    /// ADDS the input gradient into `dinp` (the residual stream) and accumulates `dgamma`.
    #[allow(clippy::too_many_arguments)]
    fn rmsnorm_backward(
        &self,
        dinp: Self::ViewMut<'_>,
        dgamma: Self::ViewMut<'_>,
        dout: Self::View<'_>,
        inp: Self::View<'_>,
        gamma: Self::View<'_>,
        rstd: Self::View<'_>,
        c: usize,
    );
}

impl<S: Stored> RmsNormKernels for CpuBackend<S> {
    fn rmsnorm_forward(&self, out: &mut [S], rstd: &mut [S], inp: &[S], gamma: &[S], c: usize) {
        let k = self.rows_per_task(inp.len() / c);
        out.par_chunks_mut(k * c)
            .zip(rstd.par_chunks_mut(k))
            .zip(inp.par_chunks(k * c))
            .for_each(|((y, r), x)| rmsnorm_forward(y, r, x, gamma, c));
    }

    fn rmsnorm_backward(
        &self,
        dinp: &mut [S],
        dgamma: &mut [S],
        dout: &[S],
        inp: &[S],
        gamma: &[S],
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
                    .zip(rstd.par_chunks(k))
                    .for_each(|(((dx, dy), x), r)| rmsnorm_backward_input(dx, dy, x, gamma, r, c));
            },
            || {
                dgamma.par_chunks_mut(w).enumerate().for_each(|(i, dg)| {
                    rmsnorm_backward_params(dg, i * w, dout, inp, rstd, c);
                });
            },
        );
    }
}

/// The launch of RMSNorm's kernels (`rmsnorm.cu`): one warp per row, the gain's gradient
/// as column partial sums over blocks of rows added in order.
#[cfg(feature = "cuda")]
mod cuda {
    use cudarc::driver::LaunchConfig;

    use super::RmsNormKernels;
    use crate::backend::cuda::CudaBackend;
    use crate::ops::cuda::{
        blocks_for, column_blocks, elementwise, int, launch, warp_per_row, DeviceElem, DeviceView, DeviceViewMut, BLOCK,
    };

    impl<S: DeviceElem> RmsNormKernels for CudaBackend<S> {
        fn rmsnorm_forward(
            &self,
            out: DeviceViewMut<'_, S>,
            rstd: DeviceViewMut<'_, S>,
            inp: DeviceView<'_, S>,
            gamma: DeviceView<'_, S>,
            c: usize,
        ) {
            let gpu = &self.launcher;
            let rows = inp.len / c;
            launch!(
                gpu,
                "rmsnorm_forward",
                warp_per_row(rows),
                out.ptr,
                rstd.ptr,
                inp.ptr,
                gamma.ptr,
                int(rows),
                int(c)
            );
        }

        fn rmsnorm_backward(
            &self,
            dinp: DeviceViewMut<'_, S>,
            dgamma: DeviceViewMut<'_, S>,
            dout: DeviceView<'_, S>,
            inp: DeviceView<'_, S>,
            gamma: DeviceView<'_, S>,
            rstd: DeviceView<'_, S>,
            c: usize,
        ) {
            let gpu = &self.launcher;
            let rows = inp.len / c;
            launch!(
                gpu,
                "rmsnorm_backward_input",
                warp_per_row(rows),
                dinp.ptr,
                dout.ptr,
                inp.ptr,
                gamma.ptr,
                rstd.ptr,
                int(rows),
                int(c)
            );
            let (blocks, per_block) = column_blocks(rows);
            let partial = gpu.scratch::<f32>(blocks * c);
            let p = gpu.ptr_of(&partial);
            let cfg = LaunchConfig {
                grid_dim: (blocks_for(c, BLOCK), blocks as u32, 1),
                block_dim: (BLOCK, 1, 1),
                shared_mem_bytes: 0,
            };
            launch!(
                gpu,
                "rmsnorm_param_partials",
                cfg,
                p,
                dout.ptr,
                inp.ptr,
                rstd.ptr,
                int(rows),
                int(c),
                int(per_block)
            );
            launch!(gpu, "add_column_partials", elementwise(c), dgamma.ptr, p, int(blocks), int(c));
        }
    }
}
