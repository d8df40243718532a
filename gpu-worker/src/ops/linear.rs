//! Linear layer (fully connected), the bulk of the FLOPs: x (rows, c_in),
//! W (c_in, c_out) row-major, b (c_out).
//!
//!   forward:  y = x·W + b            (optionally y = r + x·W + b: the residual add, fused)
//!   backward: dx = dy·Wᵀ,   dW += xᵀ·dy,   db += sum_rows dy
//!
//! The products go through the `gemm` crate on strided views (the transposes are
//! views, not copies); bias and residual are written first and the product is
//! accumulated on top, so the output is written once and read once.

use crate::ops::float::AccRow;
use crate::ops::float::{Float, Stored};
use crate::ops::gemm::{matmul, Mat, MatMut, Parallelism};
use crate::ops::simd::simd_kernel;

simd_kernel! {
    /// A chunk of output rows: `out = residual + bias` (either may be absent).
    pub fn fill_bias_residual<F: Float, S: Stored<Acc = F>>(out: &mut [S], bias: Option<&[S]>, residual: Option<&[S]>, c_out: usize) {
        match (bias, residual) {
            (Some(b), Some(r)) => {
                let (mut b_acc, mut r_acc, mut y_acc) = (AccRow::new(), AccRow::new(), AccRow::new());
                let b = b_acc.load(&b[..c_out]);
                for (y, r) in out.chunks_exact_mut(c_out).zip(r.chunks_exact(c_out)) {
                    for ((y, &r), &b) in y_acc.open(y, false).iter_mut().zip(r_acc.load(r)).zip(b) {
                        *y = r + b;
                    }
                    y_acc.store(y);
                }
            }
            (Some(b), None) => {
                for y in out.chunks_exact_mut(c_out) {
                    y.copy_from_slice(&b[..c_out]);
                }
            }
            (None, Some(r)) => out.copy_from_slice(&r[..out.len()]),
            (None, None) => {}
        }
    }
}

/// `out (+)= inp · W`: accumulates onto `out` when it already holds bias/residual.
pub fn matmul_forward<S: Stored>(
    out: &mut [S],
    inp: &[S],
    weight: &[S],
    c_in: usize,
    c_out: usize,
    accumulate: bool,
    par: Parallelism,
) {
    let rows = inp.len() / c_in;
    matmul(
        MatMut::row_major(out, rows, c_out),
        accumulate,
        Mat::row_major(inp, rows, c_in),
        Mat::row_major(weight, c_in, c_out),
        S::Acc::ONE,
        par,
    );
}

/// `dinp = dout · Wᵀ` (overwritten).
pub fn matmul_backward_input<S: Stored>(
    dinp: &mut [S],
    dout: &[S],
    weight: &[S],
    c_in: usize,
    c_out: usize,
    par: Parallelism,
) {
    let rows = dout.len() / c_out;
    matmul(
        MatMut::row_major(dinp, rows, c_in),
        false,
        Mat::row_major(dout, rows, c_out),
        Mat::row_major(weight, c_in, c_out).t(),
        S::Acc::ONE,
        par,
    );
}

/// `dW += inpᵀ · dout`.
pub fn matmul_backward_weight<S: Stored>(
    dweight: &mut [S],
    dout: &[S],
    inp: &[S],
    c_in: usize,
    c_out: usize,
    par: Parallelism,
) {
    let rows = dout.len() / c_out;
    matmul(
        MatMut::row_major(dweight, c_in, c_out),
        true,
        Mat::row_major(inp, rows, c_in).t(),
        Mat::row_major(dout, rows, c_out),
        S::Acc::ONE,
        par,
    );
}

simd_kernel! {
    /// Columns `col0..col0 + dbias.len()`: `dbias += sum over rows of dout`.
    pub fn bias_backward<F: Float, S: Stored<Acc = F>>(dbias: &mut [S], col0: usize, dout: &[S], c_out: usize) {
        let w = dbias.len();
        let (mut dy_acc, mut dbias_acc) = (AccRow::new(), AccRow::new());
        let sum = dbias_acc.open(dbias, true);
        for dy in dout.chunks_exact(c_out) {
            for (db, &g) in sum.iter_mut().zip(dy_acc.load(&dy[col0..col0 + w])) {
                *db += g;
            }
        }
        dbias_acc.store(dbias);
    }
}
