//! Linear layer (fully connected), the bulk of the FLOPs: x (rows, c_in),
//! W (c_in, c_out) row-major, b (c_out).
//!
//!   forward:  y = x·W + b            (optionally y = r + x·W + b: the residual add, fused)
//!   backward: dx = dy·Wᵀ,   dW += xᵀ·dy,   db += sum_rows dy
//!
//! The products go through `gemm.rs` on strided views (the transposes are views, not
//! copies). Bias and residual: in f32, where the packed product runs, its epilogue adds
//! them as it stores the output (one pass over it); elsewhere they are written first and
//! the product is accumulated on top, so the output is written once and read once.
//! The bias gradient: in f32, where the packed product runs, it is added up as the weight
//! gradient's product packs dy (one read of dy for both); elsewhere in a pass of its own.

use std::mem::MaybeUninit;

use rayon::prelude::*;

use crate::backend::buffers::Buffers;
use crate::backend::cpu::CpuBackend;
use crate::memory::{kernel_scratch, with_kernel_ledger};
use crate::ops::float::AccRow;
use crate::ops::float::{Float, Stored};
use crate::ops::gemm::{
    matmul, matmul_and_rhs_col_sums, matmul_onto_bias_residual, matmul_wide, matmul_widened, narrow_slice, Mat, MatMut,
    Parallelism,
};
use crate::ops::simd::simd_kernel;

simd_kernel! {
    /// A chunk of output rows, in the compute format: `out = residual + bias` (either may
    /// be absent; zeros when both are). Writes every element of `out`.
    pub fn fill_bias_residual<F: Float, S: Stored<Acc = F>>(
        out: &mut [MaybeUninit<F>],
        bias: Option<&[S]>,
        residual: Option<&[S]>,
        c_out: usize,
    ) {
        assert_eq!(out.len() % c_out, 0, "whole rows");
        let (mut b_acc, mut r_acc) = (AccRow::new(), AccRow::new());
        match (bias, residual) {
            (Some(b), Some(r)) => {
                let b = b_acc.load(&b[..c_out]);
                let r = &r[..out.len()];
                for (y, r) in out.chunks_exact_mut(c_out).zip(r.chunks_exact(c_out)) {
                    for ((y, &r), &b) in y.iter_mut().zip(r_acc.load(r)).zip(b) {
                        y.write(r + b);
                    }
                }
            }
            (Some(b), None) => {
                let b = b_acc.load(&b[..c_out]);
                for y in out.chunks_exact_mut(c_out) {
                    for (y, &b) in y.iter_mut().zip(b) {
                        y.write(b);
                    }
                }
            }
            (None, Some(r)) => S::widen_uninit(&r[..out.len()], out),
            (None, None) => out.fill(MaybeUninit::new(F::ZERO)),
        }
    }
}

/// `out = [residual +] inp · W [+ bias]`. With a bias or a residual the output starts from
/// them, written in the compute format, and the product is accumulated on top, so that the
/// output is written once and read once; a 2-byte output starts in an f32 copy (never
/// written in 2 bytes first) and is rounded once at the end. The start is written
/// `rows_per_task` rows at a time, in parallel.
#[allow(clippy::too_many_arguments)]
pub fn matmul_forward<S: Stored>(
    out: &mut [S],
    inp: &[S],
    weight: &[S],
    (bias, residual): (Option<&[S]>, Option<&[S]>),
    c_in: usize,
    c_out: usize,
    rows_per_task: usize,
    par: Parallelism,
) {
    let rows = inp.len() / c_in;
    let (x, w) = (Mat::row_major(inp, rows, c_in), Mat::row_major(weight, c_in, c_out));
    if bias.is_none() && residual.is_none() {
        return matmul(MatMut::row_major(out, rows, c_out), false, x, w, S::Acc::ONE, par);
    }
    // In the compute format already (f32): bias and residual written by the product's own
    // epilogue, where the packed product takes it.
    if let (Some(out), Some(x), Some(w)) = (S::as_acc_mut(&mut out[..rows * c_out]), S::as_acc(inp), S::as_acc(weight))
    {
        let (bias, residual) = (bias.and_then(S::as_acc), residual.and_then(S::as_acc));
        let (x, w) = (Mat::row_major(x, rows, c_in), Mat::row_major(w, c_in, c_out));
        if matmul_onto_bias_residual(MatMut::row_major(out, rows, c_out), x, w, bias, residual, par) {
            return;
        }
    }
    let (x, w) = (x.widen(par), w.widen(par));
    let task = rows_per_task.max(1) * c_out;
    let start = |acc: &mut [MaybeUninit<S::Acc>]| {
        acc.par_chunks_mut(task).enumerate().for_each(|(i, chunk)| {
            let residual = residual.map(|r| &r[i * task..i * task + chunk.len()]);
            fill_bias_residual(chunk, bias, residual, c_out);
        })
    };
    let product = |acc: &mut [S::Acc]| {
        matmul_widened(MatMut::row_major(acc, rows, c_out), true, x.view(), w.view(), S::Acc::ONE, par)
    };
    if let Some(acc) = S::as_acc_mut(&mut out[..rows * c_out]) {
        // SAFETY: the same elements seen as possibly uninitialised; `start` writes only
        // initialised values into them.
        start(unsafe { &mut *(acc as *mut [S::Acc] as *mut [MaybeUninit<S::Acc>]) });
        return product(acc);
    }
    let mut acc = Vec::with_capacity(rows * c_out);
    start(&mut acc.spare_capacity_mut()[..rows * c_out]);
    // SAFETY: fill_bias_residual wrote every element of each chunk.
    unsafe { acc.set_len(rows * c_out) };
    let _booked = kernel_scratch::<S::Acc>(acc.len());
    product(&mut acc);
    narrow_slice(&acc, &mut out[..rows * c_out], par);
}

/// Both halves of the backward below (`dinp = dout · Wᵀ` when asked, `dW += inpᵀ · dout`),
/// with `dout` widened once for the two products when it is stored in 2 bytes; and `dbias
/// += Σ_rows dout` where the weights' product adds it up (the bias gradient back where it
/// did not: the caller's to add up).
#[allow(clippy::too_many_arguments)]
pub fn matmul_backward<'b, S: Stored>(
    dinp: Option<&mut [S]>,
    dweight: &mut [S],
    dbias: Option<&'b mut [S]>,
    dout: &[S],
    inp: &[S],
    weight: &[S],
    c_in: usize,
    c_out: usize,
    par: Parallelism,
) -> Option<&'b mut [S]> {
    let rows = dout.len() / c_out;
    let dout = Mat::row_major(dout, rows, c_out).widen(par);
    if let Some(dinp) = dinp {
        let weight_t = Mat::row_major(weight, c_in, c_out).t().widen(par);
        matmul_wide(MatMut::row_major(dinp, rows, c_in), false, dout.view(), weight_t.view(), S::Acc::ONE, par);
    }
    let inp_t = Mat::row_major(inp, rows, c_in).t().widen(par);
    weight_product(dweight, dbias, inp_t.view(), dout.view(), (c_in, c_out), par)
}

/// `dW += inpᵀ · dout` on operands in the compute format, and `dbias += Σ_rows dout` with it
/// where the packed product takes both (f32); the bias gradient back where it did not.
fn weight_product<'b, S: Stored>(
    dweight: &mut [S],
    mut dbias: Option<&'b mut [S]>,
    inp_t: Mat<'_, S::Acc>,
    dout: Mat<'_, S::Acc>,
    (c_in, c_out): (usize, usize),
    par: Parallelism,
) -> Option<&'b mut [S]> {
    if let (Some(dw), Some(db)) = (S::as_acc_mut(dweight), dbias.as_deref_mut().and_then(S::as_acc_mut)) {
        if matmul_and_rhs_col_sums(MatMut::row_major(dw, c_in, c_out), inp_t, dout, db, par) {
            return None;
        }
    }
    matmul_wide(MatMut::row_major(dweight, c_in, c_out), true, inp_t, dout, S::Acc::ONE, par);
    dbias
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

/// `dW += inpᵀ · dout`, and `dbias += Σ_rows dout` where the product adds it up (the bias
/// gradient back where it did not: the caller's to add up).
pub fn matmul_backward_weight<'b, S: Stored>(
    dweight: &mut [S],
    dbias: Option<&'b mut [S]>,
    dout: &[S],
    inp: &[S],
    c_in: usize,
    c_out: usize,
    par: Parallelism,
) -> Option<&'b mut [S]> {
    let rows = dout.len() / c_out;
    let (inp_t, dout) = (Mat::row_major(inp, rows, c_in).t().widen(par), Mat::row_major(dout, rows, c_out).widen(par));
    weight_product(dweight, dbias, inp_t.view(), dout.view(), (c_in, c_out), par)
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

/// The linear layers' matrix products on a backend's views (the conventions: `backend/mod.rs`).
pub trait LinearKernels: Buffers {
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
}

/// `dbias += Σ_rows dout` on the CPU, a block of columns per thread.
fn bias_backward_split<S: Stored>(be: &CpuBackend<S>, dbias: &mut [S], dout: &[S], c_out: usize) {
    let w = be.cols_per_task(c_out);
    dbias.par_chunks_mut(w).enumerate().for_each(|(i, db)| bias_backward(db, i * w, dout, c_out));
}

impl<S: Stored> LinearKernels for CpuBackend<S> {
    fn matmul_forward(
        &self,
        out: &mut [S],
        inp: &[S],
        weight: &[S],
        bias: Option<&[S]>,
        residual: Option<&[S]>,
        c_in: usize,
        c_out: usize,
    ) {
        let rows = inp.len() / c_in;
        let (k, par) = (self.rows_per_task(rows), self.gemm_parallelism());
        with_kernel_ledger(self.ledger.as_ref(), || {
            matmul_forward(out, inp, weight, (bias, residual), c_in, c_out, k, par)
        });
    }

    fn matmul_backward(
        &self,
        dinp: Option<&mut [S]>,
        dweight: &mut [S],
        dbias: Option<&mut [S]>,
        dout: &[S],
        inp: &[S],
        weight: &[S],
        c_in: usize,
        c_out: usize,
    ) {
        let par = self.gemm_parallelism();
        let left = with_kernel_ledger(self.ledger.as_ref(), || {
            matmul_backward(dinp, dweight, dbias, dout, inp, weight, c_in, c_out, par)
        });
        if let Some(dbias) = left {
            bias_backward_split(self, dbias, dout, c_out);
        }
    }

    fn matmul_backward_input(&self, dinp: &mut [S], dout: &[S], weight: &[S], c_in: usize, c_out: usize) {
        let par = self.gemm_parallelism();
        with_kernel_ledger(self.ledger.as_ref(), || {
            matmul_backward_input(dinp, dout, weight, c_in, c_out, par);
        });
    }

    fn matmul_backward_weights(
        &self,
        dweight: &mut [S],
        dbias: Option<&mut [S]>,
        dout: &[S],
        inp: &[S],
        c_in: usize,
        c_out: usize,
    ) {
        let par = self.gemm_parallelism();
        let left = with_kernel_ledger(self.ledger.as_ref(), || {
            matmul_backward_weight(dweight, dbias, dout, inp, c_in, c_out, par)
        });
        if let Some(dbias) = left {
            bias_backward_split(self, dbias, dout, c_out);
        }
    }
}

/// The launch of the linear layer on the GPU: the products through cuBLAS (column-major, so
/// each row-major product is written transposed), the bias (`linear.cu`) and its gradient
/// (column sums).
#[cfg(feature = "cuda")]
mod cuda {
    use super::LinearKernels;
    use crate::backend::cuda::CudaBackend;
    use crate::ops::cuda::{check_shape, elementwise, int, launch, DeviceElem, DeviceView, DeviceViewMut, Operand};

    impl<S: DeviceElem> LinearKernels for CudaBackend<S> {
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
            let gpu = &self.launcher;
            let rows = inp.len / c_in;
            check_shape(
                "matmul_forward",
                &[(inp.len, rows * c_in), (weight.len, c_in * c_out), (out.len, rows * c_out)],
            );
            let beta = match residual {
                Some(residual) => {
                    gpu.copy(DeviceViewMut::new(out.ptr, out.len), residual);
                    1.0
                }
                None => 0.0,
            };
            // Row-major out (rows x c_out) = inp · W is column-major outᵀ = Wᵀ · inpᵀ.
            gpu.gemm(
                (false, false),
                (c_out, rows, c_in),
                1.0,
                Operand { ptr: weight.ptr, ld: c_out, stride: 0 },
                Operand { ptr: inp.ptr, ld: c_in, stride: 0 },
                beta,
                Operand { ptr: out.ptr, ld: c_out, stride: 0 },
                1,
            );
            if let Some(bias) = bias {
                launch!(gpu, "add_bias", elementwise(rows * c_out), out.ptr, bias.ptr, int(rows), int(c_out));
            }
        }

        fn matmul_backward_input(
            &self,
            dinp: DeviceViewMut<'_, S>,
            dout: DeviceView<'_, S>,
            weight: DeviceView<'_, S>,
            c_in: usize,
            c_out: usize,
        ) {
            let gpu = &self.launcher;
            let rows = dinp.len / c_in;
            check_shape(
                "matmul_backward_input",
                &[(dinp.len, rows * c_in), (weight.len, c_in * c_out), (dout.len, rows * c_out)],
            );
            // dinp = dout · Wᵀ: column-major dinpᵀ (c_in x rows) = W · doutᵀ.
            gpu.gemm(
                (true, false),
                (c_in, rows, c_out),
                1.0,
                Operand { ptr: weight.ptr, ld: c_out, stride: 0 },
                Operand { ptr: dout.ptr, ld: c_out, stride: 0 },
                0.0,
                Operand { ptr: dinp.ptr, ld: c_in, stride: 0 },
                1,
            );
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
            let gpu = &self.launcher;
            let rows = inp.len / c_in;
            check_shape(
                "matmul_backward_weights",
                &[(inp.len, rows * c_in), (dweight.len, c_in * c_out), (dout.len, rows * c_out)],
            );
            // dW += inpᵀ · dout: column-major dWᵀ (c_out x c_in) += doutᵀ · inp.
            gpu.gemm(
                (false, true),
                (c_out, c_in, rows),
                1.0,
                Operand { ptr: dout.ptr, ld: c_out, stride: 0 },
                Operand { ptr: inp.ptr, ld: c_in, stride: 0 },
                1.0,
                Operand { ptr: dweight.ptr, ld: c_out, stride: 0 },
                1,
            );
            if let Some(dbias) = dbias {
                gpu.add_column_sums(dbias.ptr, dout.ptr, rows, c_out);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `out = residual + inp · W + bias` in each format, with either start absent, its rows
    /// filled in uneven tasks on two threads: the exact value of the stored operands,
    /// rounded once (within half a unit in the format's last place, plus what summing in
    /// f32 may add), and the same bits as on one thread. The bigger shapes are big enough
    /// for the packed product (whose epilogue adds bias and residual in f32), split over
    /// the threads by rows and by columns.
    #[test]
    fn the_forward_starts_from_bias_and_residual() {
        /// `mantissa`: the format's stored fraction bits; `min_exp`: its smallest normal
        /// exponent (below it, and at zero, the spacing stays that of 2^min_exp).
        fn check<S: Stored>(mantissa: i32, min_exp: i32) {
            for (rows, c_in, c_out) in [(37, 24, 20), (300, 130, 150), (150, 130, 300)] {
                check_shape::<S>(mantissa, min_exp, rows, c_in, c_out);
            }
        }
        fn check_shape<S: Stored>(mantissa: i32, min_exp: i32, rows: usize, c_in: usize, c_out: usize) {
            let make = |n: usize, f: f64| (0..n).map(|i| S::from_f64((i as f64 * f).sin())).collect::<Vec<S>>();
            let (inp, weight) = (make(rows * c_in, 0.37), make(c_in * c_out, 0.13));
            let (bias, residual) = (make(c_out, 0.7), make(rows * c_out, 0.29));
            let pool = rayon::ThreadPoolBuilder::new().num_threads(2).build().expect("a pool");
            let half_ulp = |x: f64| 2f64.powi((x.abs().log2().floor() as i32).max(min_exp) - mantissa - 1);
            for start in [(Some(&bias[..]), Some(&residual[..])), (Some(&bias[..]), None), (None, Some(&residual[..]))]
            {
                let run = |par, rows_per_task| {
                    let mut out = make(rows * c_out, 0.5);
                    pool.install(|| matmul_forward(&mut out, &inp, &weight, start, c_in, c_out, rows_per_task, par));
                    out
                };
                let one = run(Parallelism::None, rows);
                assert_eq!(one, run(Parallelism::Rayon(2), 5), "{} on two threads", S::NAME);
                for (i, got) in one.iter().enumerate() {
                    let (r, c) = (i / c_out, i % c_out);
                    let terms: Vec<f64> = (0..c_in)
                        .map(|k| inp[r * c_in + k].to_f64() * weight[k * c_out + c].to_f64())
                        .chain(start.0.map(|b| b[c].to_f64()))
                        .chain(start.1.map(|x| x[i].to_f64()))
                        .collect();
                    let want: f64 = terms.iter().sum();
                    let f32_error = 2f64.powi(-22) * terms.iter().map(|t| t.abs()).sum::<f64>();
                    let got = got.to_f64();
                    assert!(
                        (got - want).abs() <= half_ulp(want.abs().max(got.abs())) + f32_error,
                        "{} row {r} column {c}: {got} for {want}, more than one rounding away",
                        S::NAME
                    );
                }
            }
        }
        check::<f32>(23, -126);
        check::<half::bf16>(7, -126);
        check::<half::f16>(10, -14);
    }

    /// The backward that widens `dout` once gives the bits of its two halves run apart (as
    /// ZB-H1's B and W run them), in every format.
    #[test]
    fn the_shared_backward_gives_the_bits_of_its_halves() {
        fn check<S: Stored>() {
            let (rows, c_in, c_out) = (300, 24, 56);
            let make = |n: usize, f: f64| (0..n).map(|i| S::from_f64((i as f64 * f).sin())).collect::<Vec<S>>();
            let (dout, inp, weight) = (make(rows * c_out, 0.37), make(rows * c_in, 0.91), make(c_in * c_out, 0.13));
            let pool = rayon::ThreadPoolBuilder::new().num_threads(2).build().expect("a pool");
            for par in [Parallelism::None, Parallelism::Rayon(2)] {
                // dinp starts non-zero: it is overwritten, never accumulated onto.
                let (mut dinp, mut dweight) = (make(rows * c_in, 0.7), make(c_in * c_out, 0.5));
                let (mut dinp_apart, mut dweight_apart) = (dinp.clone(), dweight.clone());
                pool.install(|| {
                    matmul_backward(Some(&mut dinp), &mut dweight, None, &dout, &inp, &weight, c_in, c_out, par);
                    matmul_backward_input(&mut dinp_apart, &dout, &weight, c_in, c_out, par);
                    matmul_backward_weight(&mut dweight_apart, None, &dout, &inp, c_in, c_out, par);
                });
                assert_eq!(dinp, dinp_apart, "{}", S::NAME);
                assert_eq!(dweight, dweight_apart, "{}", S::NAME);
                assert!(dinp.iter().any(|x| *x != S::default()));
                // Without dinp, the weights' half alone.
                let mut dweight_only = make(c_in * c_out, 0.5);
                pool.install(|| matmul_backward(None, &mut dweight_only, None, &dout, &inp, &weight, c_in, c_out, par));
                assert_eq!(dweight_only, dweight);
            }
        }
        check::<f32>();
        check::<half::bf16>();
        check::<half::f16>();
    }

    /// The bias gradient added up with the weights' product (f32, where the packed product
    /// runs) gives the bits of its own pass, on 1 and 2 threads, the output's rows or its
    /// columns split between them; in 2-byte formats it is left to that pass.
    #[test]
    fn the_bias_gradient_added_up_with_the_weights_gives_its_own_passs_bits() {
        fn check<S: Stored>() {
            let make = |n: usize, f: f64| (0..n).map(|i| S::from_f64((i as f64 * f).sin())).collect::<Vec<S>>();
            let pool = rayon::ThreadPoolBuilder::new().num_threads(2).build().expect("a pool");
            // (tokens, c_in, c_out): split by rows (c_in the longer side), then by columns.
            for (rows, c_in, c_out) in [(512, 288, 40), (520, 40, 290)] {
                let (dout, inp, weight) = (make(rows * c_out, 0.37), make(rows * c_in, 0.91), make(c_in * c_out, 0.13));
                let mut own_pass = make(c_out, 0.29);
                bias_backward(&mut own_pass, 0, &dout, c_out);
                let fused_here = crate::ops::packed_gemm::takes(c_in, c_out, rows) && S::NAME == "fp32";
                for par in [Parallelism::None, Parallelism::Rayon(2)] {
                    let (mut dbias, mut dweight, mut dweight_alone) =
                        (make(c_out, 0.29), make(c_in * c_out, 0.5), make(c_in * c_out, 0.5));
                    let mut dbias_shared = dbias.clone();
                    let mut dweight_shared = dweight.clone();
                    pool.install(|| {
                        let left =
                            matmul_backward_weight(&mut dweight, Some(&mut dbias), &dout, &inp, c_in, c_out, par);
                        assert_eq!(left.is_none(), fused_here, "{} {rows}x{c_in}x{c_out}", S::NAME);
                        if let Some(dbias) = left {
                            bias_backward(dbias, 0, &dout, c_out);
                        }
                        let shared = (&mut dweight_shared, Some(&mut dbias_shared[..]));
                        if let Some(dbias) =
                            matmul_backward(None, shared.0, shared.1, &dout, &inp, &weight, c_in, c_out, par)
                        {
                            bias_backward(dbias, 0, &dout, c_out);
                        }
                        matmul_backward_weight(&mut dweight_alone, None, &dout, &inp, c_in, c_out, par);
                    });
                    let bits = |x: &[S]| x.iter().map(|v| v.to_f64().to_bits()).collect::<Vec<_>>();
                    assert_eq!(bits(&dbias), bits(&own_pass), "{} {rows}x{c_in}x{c_out} {par:?}", S::NAME);
                    assert_eq!(bits(&dbias_shared), bits(&own_pass), "{} shared, {par:?}", S::NAME);
                    assert_eq!(bits(&dweight), bits(&dweight_alone), "{} weights, {par:?}", S::NAME);
                    assert_eq!(bits(&dweight_shared), bits(&dweight_alone), "{} shared weights, {par:?}", S::NAME);
                }
            }
        }
        check::<f32>();
        check::<half::bf16>();
    }
}
