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

use crate::backend::float::lane_sum;
use crate::backend::simd::simd_kernel;
use crate::backend::Float;

pub const LAYERNORM_EPS: f64 = 1e-5;

simd_kernel! {
    /// A chunk of rows: `out`, `inp` are `rows x c`; `mean`, `rstd` have `rows` entries.
    pub fn layernorm_forward<F: Float>(
        out: &mut [F],
        mean: &mut [F],
        rstd: &mut [F],
        inp: &[F],
        gamma: &[F],
        beta: &[F],
        c: usize,
    ) {
        let inv_c = F::from_f64(1.0 / c as f64);
        let eps = F::from_f64(LAYERNORM_EPS);
        let (gamma, beta) = (&gamma[..c], &beta[..c]);
        for (((y, x), m), s) in out.chunks_exact_mut(c).zip(inp.chunks_exact(c)).zip(mean.iter_mut()).zip(rstd.iter_mut()) {
            let mu = lane_sum(c, |j| x[j]) * inv_c;
            let var = lane_sum(c, |j| {
                let d = x[j] - mu;
                d * d
            }) * inv_c;
            let r = F::ONE / (var + eps).sqrt();
            for (((y, &x), &g), &b) in y.iter_mut().zip(x).zip(gamma).zip(beta) {
                *y = (x - mu) * r * g + b;
            }
            *m = mu;
            *s = r;
        }
    }
}

simd_kernel! {
    /// A chunk of rows: ADDS the input gradient into `dinp`.
    pub fn layernorm_backward_input<F: Float>(
        dinp: &mut [F],
        dout: &[F],
        inp: &[F],
        gamma: &[F],
        mean: &[F],
        rstd: &[F],
        c: usize,
    ) {
        let inv_c = F::from_f64(1.0 / c as f64);
        let gamma = &gamma[..c];
        for ((((dx, dy), x), &mu), &r) in
            dinp.chunks_exact_mut(c).zip(dout.chunks_exact(c)).zip(inp.chunks_exact(c)).zip(mean).zip(rstd)
        {
            let (dy, x) = (&dy[..c], &x[..c]);
            let mean_g = lane_sum(c, |j| dy[j] * gamma[j]) * inv_c;
            let mean_gx = lane_sum(c, |j| dy[j] * gamma[j] * (x[j] - mu) * r) * inv_c;
            for (((dx, &dy), &x), &g) in dx.iter_mut().zip(dy).zip(x).zip(gamma) {
                let xhat = (x - mu) * r;
                *dx += r * (dy * g - mean_g - xhat * mean_gx);
            }
        }
    }
}

simd_kernel! {
    /// Columns `col0..col0 + dgamma.len()` of the parameter gradients, summed over all rows.
    pub fn layernorm_backward_params<F: Float>(
        dgamma: &mut [F],
        dbeta: &mut [F],
        col0: usize,
        dout: &[F],
        inp: &[F],
        mean: &[F],
        rstd: &[F],
        c: usize,
    ) {
        let w = dgamma.len();
        let dbeta = &mut dbeta[..w];
        for (((dy, x), &mu), &r) in dout.chunks_exact(c).zip(inp.chunks_exact(c)).zip(mean).zip(rstd) {
            let dy = &dy[col0..col0 + w];
            let x = &x[col0..col0 + w];
            for (((dg, db), &dy), &x) in dgamma.iter_mut().zip(dbeta.iter_mut()).zip(dy).zip(x) {
                *dg += dy * (x - mu) * r;
                *db += dy;
            }
        }
    }
}
