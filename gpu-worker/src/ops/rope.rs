//! Rotary position embeddings (RoPE, Su et al. 2021) in Hugging Face Llama's layout
//! ("rotate half"): at position p, dimension i of a query or key head is rotated with
//! dimension i + h (h = hs / 2, i < h) by the angle a_i = p * theta^(-2i / hs):
//!
//!   forward:  y_i     = x_i cos a_i - x_{i+h} sin a_i
//!             y_{i+h} = x_{i+h} cos a_i + x_i sin a_i
//!   backward: the rotation's transpose, the rotation by -a_i:
//!             dx_i     = dy_i cos a_i + dy_{i+h} sin a_i
//!             dx_{i+h} = dy_{i+h} cos a_i - dy_i sin a_i
//!
//! so q_p · k_s depends on p - s only. In place on the Q and K heads of qkv (the first
//! heads + kv_heads heads of each row; V is not rotated): the matmul that made qkv needs
//! only its input for its backward, so the rotated values take the unrotated ones' place,
//! and backward rotates dqkv back before that matmul's backward. Row r of qkv is token
//! r mod seq_len of its sequence, at the position `positions` gives it (its index, or with
//! context parallelism where the rank's tokens sit). The angles' cosines and sines are
//! computed in f64 on the host, once per call, into (seq_len, hs/2) tables of the compute
//! format (f32 on the GPU), one row per token, so that every backend turns by the same
//! factors.

use rayon::prelude::*;

use crate::backend::buffers::Buffers;
use crate::backend::cpu::CpuBackend;
use crate::ops::attention::{AttentionShape, Positions};
use crate::ops::float::{Float, Stored};
use crate::ops::simd::simd_kernel;

/// The angle of dimension pair `i` of a head `hs` wide at position `pos`.
pub fn rope_angle(pos: usize, i: usize, hs: usize, theta: f64) -> f64 {
    pos as f64 * theta.powf(-2.0 * i as f64 / hs as f64)
}

simd_kernel! {
    /// Rows `row0..` of qkv (`width` wide): rotates the first `rotated` heads of each by
    /// `sign` x their angles (`cos`, `sin`: the (seq_len, hs/2) tables).
    pub fn rope_rotate<F: Float, S: Stored<Acc = F>>(
        qkv: &mut [S],
        row0: usize,
        cos: &[F],
        sin: &[F],
        shape: AttentionShape,
        sign: F,
    ) {
        let (width, hs, half) = (shape.qkv_width(), shape.head_size, shape.head_size / 2);
        let rotated = shape.heads + shape.kv_heads;
        for (r, row) in qkv.chunks_exact_mut(width).enumerate() {
            let pos = (row0 + r) % shape.seq_len;
            let (cos, sin) = (&cos[pos * half..(pos + 1) * half], &sin[pos * half..(pos + 1) * half]);
            for head in row[..rotated * hs].chunks_exact_mut(hs) {
                let (lo, hi) = head.split_at_mut(half);
                for (((a, b), &c), &s) in lo.iter_mut().zip(hi.iter_mut()).zip(cos).zip(sin) {
                    let (x, y) = (a.load(), b.load());
                    let s = sign * s;
                    *a = S::store(x * c - y * s);
                    *b = S::store(y * c + x * s);
                }
            }
        }
    }
}

/// RoPE on a backend's views (the conventions: `backend/mod.rs`).
pub trait RopeKernels: Buffers {
    /// Rotates the query and key heads of `qkv` (rows of `shape.qkv_width()`, `shape.seq_len`
    /// tokens of each sequence, at `positions`) in place.
    fn rope_forward(&self, qkv: Self::ViewMut<'_>, shape: AttentionShape, theta: f64, positions: Positions);

    /// Rotates the query and key gradients of `dqkv` back in place.
    fn rope_backward(&self, dqkv: Self::ViewMut<'_>, shape: AttentionShape, theta: f64, positions: Positions);
}

/// `f` (cos or sin) of every token's angles, (seq_len, hs/2), in the compute format.
pub fn rope_table<F: Float>(shape: AttentionShape, theta: f64, positions: Positions, f: fn(f64) -> f64) -> Vec<F> {
    let (hs, half) = (shape.head_size, shape.head_size / 2);
    debug_assert_eq!(positions.tokens(), shape.seq_len);
    (0..shape.seq_len * half).map(|j| F::from_f64(f(rope_angle(positions.at(j / half), j % half, hs, theta)))).collect()
}

impl<S: Stored> CpuBackend<S> {
    fn rope(&self, qkv: &mut [S], shape: AttentionShape, (theta, positions): (f64, Positions), sign: f64) {
        let cos = rope_table::<S::Acc>(shape, theta, positions, f64::cos);
        let sin = rope_table::<S::Acc>(shape, theta, positions, f64::sin);
        let width = shape.qkv_width();
        let k = self.rows_per_task(qkv.len() / width);
        let sign = S::Acc::from_f64(sign);
        qkv.par_chunks_mut(k * width)
            .enumerate()
            .for_each(|(i, rows)| rope_rotate(rows, i * k, &cos, &sin, shape, sign));
    }
}

impl<S: Stored> RopeKernels for CpuBackend<S> {
    fn rope_forward(&self, qkv: &mut [S], shape: AttentionShape, theta: f64, positions: Positions) {
        self.rope(qkv, shape, (theta, positions), 1.0);
    }

    fn rope_backward(&self, dqkv: &mut [S], shape: AttentionShape, theta: f64, positions: Positions) {
        self.rope(dqkv, shape, (theta, positions), -1.0);
    }
}

/// The launch of RoPE's kernel (`rope.cu`): the cosine and sine tables uploaded, one
/// thread per rotated pair.
#[cfg(feature = "cuda")]
mod cuda {
    use super::{rope_table, RopeKernels};
    use crate::backend::cuda::CudaBackend;
    use crate::ops::attention::{AttentionShape, Positions};
    use crate::ops::cuda::{elementwise, int, launch, DeviceElem, DeviceViewMut};

    fn rope<S: DeviceElem>(
        be: &CudaBackend<S>,
        qkv: DeviceViewMut<'_, S>,
        shape: AttentionShape,
        (theta, positions): (f64, Positions),
        sign: f32,
    ) {
        let gpu = &be.launcher;
        let rows = qkv.len / shape.qkv_width();
        let pairs = rows * (shape.heads + shape.kv_heads) * (shape.head_size / 2);
        let cos = gpu.upload(&rope_table::<f32>(shape, theta, positions, f64::cos));
        let sin = gpu.upload(&rope_table::<f32>(shape, theta, positions, f64::sin));
        launch!(
            gpu,
            "rope_rotate",
            elementwise(pairs),
            qkv.ptr,
            gpu.ptr_of(&cos),
            gpu.ptr_of(&sin),
            pairs as i64,
            int(shape.seq_len),
            int(shape.heads + shape.kv_heads),
            int(shape.head_size),
            int(shape.qkv_width()),
            sign
        );
    }

    impl<S: DeviceElem> RopeKernels for CudaBackend<S> {
        fn rope_forward(&self, qkv: DeviceViewMut<'_, S>, shape: AttentionShape, theta: f64, positions: Positions) {
            rope(self, qkv, shape, (theta, positions), 1.0);
        }

        fn rope_backward(&self, dqkv: DeviceViewMut<'_, S>, shape: AttentionShape, theta: f64, positions: Positions) {
            rope(self, dqkv, shape, (theta, positions), -1.0);
        }
    }
}
