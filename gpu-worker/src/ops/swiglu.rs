//! SwiGLU (Shazeer 2020), Llama's MLP nonlinearity, between the gate-and-up projection
//! (c -> 2f, the gate's and the up projection's columns side by side in one matmul, see
//! `linear.rs`) and the down projection (f -> c). A row of its input is [g | u], f each:
//!
//!   forward:  h = silu(g) * u,   silu(g) = g sigmoid(g)
//!   backward: du = dh * silu(g)
//!             dg = dh * u * sigmoid(g) (1 + g (1 - sigmoid(g)))
//!
//! Rows are independent (the CPU backend splits them over threads).

use rayon::prelude::*;

use crate::backend::buffers::Buffers;
use crate::backend::cpu::CpuBackend;
use crate::ops::float::AccRow;
use crate::ops::float::{Float, Stored};
use crate::ops::simd::simd_kernel;

simd_kernel! {
    /// A chunk of rows: `out` (rows, f) from `inp` (rows, 2f).
    pub fn swiglu_forward<F: Float, S: Stored<Acc = F>>(out: &mut [S], inp: &[S], f: usize) {
        let (mut x_acc, mut y_acc) = (AccRow::new(), AccRow::new());
        for (y, x) in out.chunks_exact_mut(f).zip(inp.chunks_exact(2 * f)) {
            let x = x_acc.load(x);
            let (gate, up) = x.split_at(f);
            for ((y, &g), &u) in y_acc.open(y, false).iter_mut().zip(gate).zip(up) {
                *y = g / (F::ONE + (-g).exp()) * u;
            }
            y_acc.store(y);
        }
    }
}

simd_kernel! {
    /// A chunk of rows: overwrites `dinp` (rows, 2f) from `dout` (rows, f).
    pub fn swiglu_backward<F: Float, S: Stored<Acc = F>>(dinp: &mut [S], dout: &[S], inp: &[S], f: usize) {
        let (mut x_acc, mut dy_acc, mut dx_acc) = (AccRow::new(), AccRow::new(), AccRow::new());
        for ((dx, dy), x) in dinp.chunks_exact_mut(2 * f).zip(dout.chunks_exact(f)).zip(inp.chunks_exact(2 * f)) {
            let (x, dy) = (x_acc.load(x), dy_acc.load(dy));
            let (gate, up) = x.split_at(f);
            let (dgate, dup) = dx_acc.open(dx, false).split_at_mut(f);
            for ((((dg, du), &g), &u), &dh) in dgate.iter_mut().zip(dup.iter_mut()).zip(gate).zip(up).zip(dy) {
                let sig = F::ONE / (F::ONE + (-g).exp());
                *du = dh * g * sig;
                *dg = dh * u * sig * (F::ONE + g * (F::ONE - sig));
            }
            dx_acc.store(dx);
        }
    }
}

/// SwiGLU on a backend's views (the conventions: `backend/mod.rs`).
pub trait SwiGluKernels: Buffers {
    /// `out` (rows, f) = silu(gate) * up of `inp` (rows, 2f) = [gate | up].
    fn swiglu_forward(&self, out: Self::ViewMut<'_>, inp: Self::View<'_>, f: usize);

    /// Overwrites `dinp` (rows, 2f) with the gate's and the up projection's gradients.
    fn swiglu_backward(&self, dinp: Self::ViewMut<'_>, dout: Self::View<'_>, inp: Self::View<'_>, f: usize);
}

impl<S: Stored> SwiGluKernels for CpuBackend<S> {
    fn swiglu_forward(&self, out: &mut [S], inp: &[S], f: usize) {
        let k = self.rows_per_task(out.len() / f);
        out.par_chunks_mut(k * f).zip(inp.par_chunks(2 * k * f)).for_each(|(y, x)| swiglu_forward(y, x, f));
    }

    fn swiglu_backward(&self, dinp: &mut [S], dout: &[S], inp: &[S], f: usize) {
        let k = self.rows_per_task(dout.len() / f);
        dinp.par_chunks_mut(2 * k * f)
            .zip(dout.par_chunks(k * f))
            .zip(inp.par_chunks(2 * k * f))
            .for_each(|((dx, dy), x)| swiglu_backward(dx, dy, x, f));
    }
}

/// The launch of SwiGLU's kernels (`swiglu.cu`): one thread per hidden unit.
#[cfg(feature = "cuda")]
mod cuda {
    use super::SwiGluKernels;
    use crate::backend::cuda::CudaBackend;
    use crate::ops::cuda::{check_shape, elementwise, int, launch, DeviceElem, DeviceView, DeviceViewMut};

    impl<S: DeviceElem> SwiGluKernels for CudaBackend<S> {
        fn swiglu_forward(&self, out: DeviceViewMut<'_, S>, inp: DeviceView<'_, S>, f: usize) {
            let gpu = &self.launcher;
            check_shape("swiglu_forward", &[(inp.len, 2 * out.len)]);
            launch!(gpu, "swiglu_forward", elementwise(out.len), out.ptr, inp.ptr, out.len as i64, int(f));
        }

        fn swiglu_backward(
            &self,
            dinp: DeviceViewMut<'_, S>,
            dout: DeviceView<'_, S>,
            inp: DeviceView<'_, S>,
            f: usize,
        ) {
            let gpu = &self.launcher;
            check_shape("swiglu_backward", &[(inp.len, 2 * dout.len), (dinp.len, 2 * dout.len)]);
            let n = dout.len;
            launch!(gpu, "swiglu_backward", elementwise(n), dinp.ptr, dout.ptr, inp.ptr, n as i64, int(f));
        }
    }
}
