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

use crate::ops::float::{in_acc, lane_sum};
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
        let (gamma, beta) = (&gamma[..c], &beta[..c]);
        for (((y, x), m), s) in out.chunks_exact_mut(c).zip(inp.chunks_exact(c)).zip(mean.iter_mut()).zip(rstd.iter_mut()) {
            let mu = lane_sum(c, |j| x[j].load()) * inv_c;
            let var = lane_sum(c, |j| {
                let d = x[j].load() - mu;
                d * d
            }) * inv_c;
            let r = F::ONE / (var + eps).sqrt();
            for (((y, &x), &g), &b) in y.iter_mut().zip(x).zip(gamma).zip(beta) {
                *y = S::store((x.load() - mu) * r * g.load() + b.load());
            }
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
        let gamma = &gamma[..c];
        for ((((dx, dy), x), &mu), &r) in
            dinp.chunks_exact_mut(c).zip(dout.chunks_exact(c)).zip(inp.chunks_exact(c)).zip(mean).zip(rstd)
        {
            let (dy, x, mu, r) = (&dy[..c], &x[..c], mu.load(), r.load());
            let mean_g = lane_sum(c, |j| dy[j].load() * gamma[j].load()) * inv_c;
            let mean_gx = lane_sum(c, |j| dy[j].load() * gamma[j].load() * (x[j].load() - mu) * r) * inv_c;
            for (((dx, &dy), &x), &g) in dx.iter_mut().zip(dy).zip(x).zip(gamma) {
                let xhat = (x.load() - mu) * r;
                *dx = S::store(dx.load() + r * (dy.load() * g.load() - mean_g - xhat * mean_gx));
            }
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
        in_acc(dgamma, |dgamma| {
            in_acc(&mut dbeta[..w], |dbeta| {
                for (((dy, x), &mu), &r) in dout.chunks_exact(c).zip(inp.chunks_exact(c)).zip(mean).zip(rstd) {
                    let (dy, x, mu, r) = (&dy[col0..col0 + w], &x[col0..col0 + w], mu.load(), r.load());
                    for (((dg, db), &dy), &x) in dgamma.iter_mut().zip(dbeta.iter_mut()).zip(dy).zip(x) {
                        *dg += dy.load() * (x.load() - mu) * r;
                        *db += dy.load();
                    }
                }
            })
        });
    }
}
