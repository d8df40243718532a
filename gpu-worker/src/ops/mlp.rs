//! The MLP's nonlinearity, GELU with the tanh approximation (GPT-2's), between
//! the fc (c -> 4c) and proj (4c -> c) linear layers (see `linear.rs`).
//!
//!   forward:  u = s (x + k x^3),   y = x/2 (1 + tanh u),   s = sqrt(2/pi), k = 0.044715
//!   backward: dy/dx = (1 + tanh u)/2 + x/2 (1 - tanh^2 u) s (1 + 3k x^2)

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
        let half = F::from_f64(0.5);
        map_elements(out, inp, |x, _| {
            let u = s * (x + k * x * x * x);
            half * x * (F::ONE + u.tanh())
        });
    }
}

simd_kernel! {
    /// In place: `dinout *= gelu'(inp)`.
    pub fn gelu_backward<F: Float, S: Stored<Acc = F>>(dinout: &mut [S], inp: &[S]) {
        let s = F::from_f64(gelu_s());
        let k = F::from_f64(GELU_K);
        let k3 = F::from_f64(3.0 * GELU_K);
        let half = F::from_f64(0.5);
        map_elements(dinout, inp, |x, d| {
            let x2 = x * x;
            let th = (s * (x + k * x2 * x)).tanh();
            let local = half * (F::ONE + th) + half * x * (F::ONE - th * th) * s * (F::ONE + k3 * x2);
            d * local
        });
    }
}
