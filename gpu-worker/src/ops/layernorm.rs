//! LayerNorm over the last dimension (width c), eps = 1e-5 as in PyTorch.
//!
//!   forward:  mean = (1/c) sum_j x_j,  rstd = 1 / sqrt((1/c) sum_j (x_j - mean)^2 + eps)
//!             xhat_j = (x_j - mean) * rstd,   y_j = xhat_j * gamma_j + beta_j
//!   backward: g_j = dy_j * gamma_j
//!             dx_j += rstd * (g_j - mean_k(g_k) - xhat_j * mean_k(g_k * xhat_k))
//!             dgamma_j += sum_rows dy_j * xhat_j,   dbeta_j += sum_rows dy_j
//!
//! Rows are independent (the CPU backend splits them over threads); the parameter
//! gradients are sums over rows, split over column ranges instead so that each
//! column is summed in row order whatever the thread count.

use rayon::prelude::*;

use crate::backend::buffers::Buffers;
use crate::backend::cpu::CpuBackend;
use crate::ops::float::{lane_sum, AccRow};
use crate::ops::float::{Float, Stored};
use crate::ops::simd::simd_kernel;

pub const LAYERNORM_EPS: f64 = 1e-5;

simd_kernel! {
    /// A chunk of rows: `out`, `inp` are `rows x c`; `mean`, `rstd` have `rows` entries.
    pub fn layernorm_forward<F: Float, S: Stored<Acc = F>>(
        out: &mut [S],
        mean: &mut [S],
        rstd: &mut [S],
        inp: &[S],
        gamma: &[S],
        beta: &[S],
        c: usize,
    ) {
        let inv_c = F::from_f64(1.0 / c as f64);
        let eps = F::from_f64(LAYERNORM_EPS);
        let (mut gamma_acc, mut beta_acc, mut x_acc, mut y_acc) = (AccRow::new(), AccRow::new(), AccRow::new(), AccRow::new());
        let (gamma, beta) = (gamma_acc.load(&gamma[..c]), beta_acc.load(&beta[..c]));
        for (((y, x), m), s) in out.chunks_exact_mut(c).zip(inp.chunks_exact(c)).zip(mean.iter_mut()).zip(rstd.iter_mut()) {
            let x = x_acc.load(x);
            let mu = lane_sum(c, |j| x[j]) * inv_c;
            let var = lane_sum(c, |j| {
                let d = x[j] - mu;
                d * d
            }) * inv_c;
            let r = F::ONE / (var + eps).sqrt();
            for (((y, &x), &g), &b) in y_acc.open(y, false).iter_mut().zip(x).zip(gamma).zip(beta) {
                *y = (x - mu) * r * g + b;
            }
            y_acc.store(y);
            *m = S::store(mu);
            *s = S::store(r);
        }
    }
}

simd_kernel! {
    /// A chunk of rows: ADDS the input gradient into `dinp`.
    pub fn layernorm_backward_input<F: Float, S: Stored<Acc = F>>(
        dinp: &mut [S],
        dout: &[S],
        inp: &[S],
        gamma: &[S],
        mean: &[S],
        rstd: &[S],
        c: usize,
    ) {
        let inv_c = F::from_f64(1.0 / c as f64);
        let (mut gamma_acc, mut dy_acc, mut x_acc, mut dx_acc) = (AccRow::new(), AccRow::new(), AccRow::new(), AccRow::new());
        let gamma = gamma_acc.load(&gamma[..c]);
        for ((((dx, dy), x), &mu), &r) in
            dinp.chunks_exact_mut(c).zip(dout.chunks_exact(c)).zip(inp.chunks_exact(c)).zip(mean).zip(rstd)
        {
            let (dy, x, mu, r) = (dy_acc.load(&dy[..c]), x_acc.load(&x[..c]), mu.load(), r.load());
            let mean_g = lane_sum(c, |j| dy[j] * gamma[j]) * inv_c;
            let mean_gx = lane_sum(c, |j| dy[j] * gamma[j] * (x[j] - mu) * r) * inv_c;
            for (((dx, &dy), &x), &g) in dx_acc.open(dx, true).iter_mut().zip(dy).zip(x).zip(gamma) {
                let xhat = (x - mu) * r;
                *dx += r * (dy * g - mean_g - xhat * mean_gx);
            }
            dx_acc.store(dx);
        }
    }
}

simd_kernel! {
    /// Columns `col0..col0 + dgamma.len()` of the parameter gradients, summed over all rows.
    pub fn layernorm_backward_params<F: Float, S: Stored<Acc = F>>(
        dgamma: &mut [S],
        dbeta: &mut [S],
        col0: usize,
        dout: &[S],
        inp: &[S],
        mean: &[S],
        rstd: &[S],
        c: usize,
    ) {
        let w = dgamma.len();
        let dbeta = &mut dbeta[..w];
        let (mut dy_acc, mut x_acc, mut dgamma_acc, mut dbeta_acc) = (AccRow::new(), AccRow::new(), AccRow::new(), AccRow::new());
        let (dgamma_sum, dbeta_sum) = (dgamma_acc.open(dgamma, true), dbeta_acc.open(dbeta, true));
        for (((dy, x), &mu), &r) in dout.chunks_exact(c).zip(inp.chunks_exact(c)).zip(mean).zip(rstd) {
            let (dy, x) = (dy_acc.load(&dy[col0..col0 + w]), x_acc.load(&x[col0..col0 + w]));
            let (mu, r) = (mu.load(), r.load());
            for (((dg, db), &dy), &x) in dgamma_sum.iter_mut().zip(dbeta_sum.iter_mut()).zip(dy).zip(x) {
                *dg += dy * (x - mu) * r;
                *db += dy;
            }
        }
        dgamma_acc.store(dgamma);
        dbeta_acc.store(dbeta);
    }
}

/// LayerNorm on a backend's views (the conventions: `backend/mod.rs`).
pub trait LayerNormKernels: Buffers {
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
}

impl<S: Stored> LayerNormKernels for CpuBackend<S> {
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
            .for_each(|(((y, m), r), x)| layernorm_forward(y, m, r, x, gamma, beta, c));
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
                    .for_each(|((((dx, dy), x), m), r)| layernorm_backward_input(dx, dy, x, gamma, m, r, c));
            },
            || {
                dgamma.par_chunks_mut(w).zip(dbeta.par_chunks_mut(w)).enumerate().for_each(|(i, (dg, db))| {
                    layernorm_backward_params(dg, db, i * w, dout, inp, mean, rstd, c);
                });
            },
        );
    }
}

/// The launch of LayerNorm's kernels (`layernorm.cu`): one warp per row, the parameter
/// gradients as column partial sums over blocks of rows added in order.
#[cfg(feature = "cuda")]
mod cuda {
    use cudarc::driver::LaunchConfig;

    use super::LayerNormKernels;
    use crate::backend::cuda::CudaBackend;
    use crate::ops::cuda::{
        blocks_for, column_blocks, elementwise, int, launch, warp_per_row, DeviceElem, DeviceView, DeviceViewMut, BLOCK,
    };

    impl<S: DeviceElem> LayerNormKernels for CudaBackend<S> {
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
            let gpu = &self.launcher;
            let rows = inp.len / c;
            launch!(
                gpu,
                "layernorm_forward",
                warp_per_row(rows),
                out.ptr,
                mean.ptr,
                rstd.ptr,
                inp.ptr,
                gamma.ptr,
                beta.ptr,
                int(rows),
                int(c)
            );
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
            let gpu = &self.launcher;
            let rows = inp.len / c;
            launch!(
                gpu,
                "layernorm_backward_input",
                warp_per_row(rows),
                dinp.ptr,
                dout.ptr,
                inp.ptr,
                gamma.ptr,
                mean.ptr,
                rstd.ptr,
                int(rows),
                int(c)
            );
            let (blocks, per_block) = column_blocks(rows);
            let partial = gpu.scratch::<f32>(2 * blocks * c);
            let p = gpu.ptr_of(&partial);
            let cfg = LaunchConfig {
                grid_dim: (blocks_for(c, BLOCK), blocks as u32, 1),
                block_dim: (BLOCK, 1, 1),
                shared_mem_bytes: 0,
            };
            launch!(
                gpu,
                "layernorm_param_partials",
                cfg,
                p,
                dout.ptr,
                inp.ptr,
                mean.ptr,
                rstd.ptr,
                int(rows),
                int(c),
                int(per_block)
            );
            launch!(gpu, "add_column_partials", elementwise(c), dgamma.ptr, p, int(blocks), int(c));
            let dbeta_partial = p + (blocks * c * 4) as u64;
            launch!(gpu, "add_column_partials", elementwise(c), dbeta.ptr, dbeta_partial, int(blocks), int(c));
        }
    }
}
