//! The MLP's nonlinearity, GELU with the tanh approximation (GPT-2's), between
//! the fc (c -> 4c) and proj (4c -> c) linear layers (see `linear.rs`).
//!
//!   forward:  u = s (x + k x^3),   y = x/2 (1 + tanh u),   s = sqrt(2/pi), k = 0.044715
//!   backward: dy/dx = (1 + tanh u)/2 + x/2 (1 - tanh^2 u) s (1 + 3k x^2)
//!
//! computed through the logistic function, since (1 + tanh u)/2 = sigmoid(2u) = 1/(1 + e^-2u):
//!
//!   forward:  y = x sigmoid(2u)
//!   backward: dy/dx = sigmoid(2u) + x sigmoid(2u) (1 - sigmoid(2u)) 2s (1 + 3k x^2)
//!
//! one exponential and one division per element, where tanh also needs its sign and
//! small-argument handling (a quarter less time on one core, the same function).

use rayon::prelude::*;

use crate::backend::buffers::Buffers;
use crate::backend::cpu::CpuBackend;
use crate::backend::cpu::ELEMENT_CHUNK;
use crate::ops::float::map_elements;
use crate::ops::float::{Float, Stored};
use crate::ops::simd::simd_kernel;

const GELU_K: f64 = 0.044715;

fn gelu_s() -> f64 {
    (2.0 / std::f64::consts::PI).sqrt()
}

simd_kernel! {
    pub fn gelu_forward<F: Float, S: Stored<Acc = F>>(out: &mut [S], inp: &[S]) {
        let s = F::from_f64(gelu_s());
        let k = F::from_f64(GELU_K);
        map_elements(out, inp, |x, _| {
            let u = s * (x + k * x * x * x);
            x / (F::ONE + (-(u + u)).exp())
        });
    }
}

simd_kernel! {
    /// In place: `dinout *= gelu'(inp)`.
    pub fn gelu_backward<F: Float, S: Stored<Acc = F>>(dinout: &mut [S], inp: &[S]) {
        let s = F::from_f64(gelu_s());
        let k = F::from_f64(GELU_K);
        let k3 = F::from_f64(3.0 * GELU_K);
        let s2 = F::from_f64(2.0 * gelu_s());
        map_elements(dinout, inp, |x, d| {
            let x2 = x * x;
            let u = s * (x + k * x2 * x);
            let sig = F::ONE / (F::ONE + (-(u + u)).exp());
            let local = sig + x * sig * (F::ONE - sig) * s2 * (F::ONE + k3 * x2);
            d * local
        });
    }
}

/// GELU on a backend's views (the conventions: `backend/mod.rs`).
pub trait GeluKernels: Buffers {
    /// GELU, tanh approximation.
    fn gelu_forward(&self, out: Self::ViewMut<'_>, inp: Self::View<'_>);

    /// In place: `dinout = dinout * gelu'(inp)`.
    fn gelu_backward(&self, dinout: Self::ViewMut<'_>, inp: Self::View<'_>);
}

impl<S: Stored> GeluKernels for CpuBackend<S> {
    fn gelu_forward(&self, out: &mut [S], inp: &[S]) {
        out.par_chunks_mut(ELEMENT_CHUNK).zip(inp.par_chunks(ELEMENT_CHUNK)).for_each(|(y, x)| gelu_forward(y, x));
    }

    fn gelu_backward(&self, dinout: &mut [S], inp: &[S]) {
        dinout.par_chunks_mut(ELEMENT_CHUNK).zip(inp.par_chunks(ELEMENT_CHUNK)).for_each(|(d, x)| gelu_backward(d, x));
    }
}

/// The launch of GELU's kernels (`mlp.cu`): one thread per element.
#[cfg(feature = "cuda")]
mod cuda {
    use super::GeluKernels;
    use crate::backend::cuda::CudaBackend;
    use crate::ops::cuda::{elementwise, launch, DeviceElem, DeviceView, DeviceViewMut};

    impl<S: DeviceElem> GeluKernels for CudaBackend<S> {
        fn gelu_forward(&self, out: DeviceViewMut<'_, S>, inp: DeviceView<'_, S>) {
            let gpu = &self.launcher;
            launch!(gpu, "gelu_forward", elementwise(inp.len), out.ptr, inp.ptr, inp.len as i64);
        }

        fn gelu_backward(&self, dinout: DeviceViewMut<'_, S>, inp: DeviceView<'_, S>) {
            let gpu = &self.launcher;
            launch!(gpu, "gelu_backward", elementwise(inp.len), dinout.ptr, inp.ptr, inp.len as i64);
        }
    }
}
