//! The ordered sums: the loss's and the gradient norm's reductions to one number.
//!
//!   sum(x) = Σ_i x_i,   sum_squares(x) = Σ_i x_i²   (accumulated in f64)
//!
//! Both add fixed-size chunks, each in a fixed order, then the chunks' sums in order, so
//! the result does not depend on the thread count (CPU) or on the launch (CUDA: one
//! block per chunk in a fixed tree, `reductions.cu`, the blocks' sums added on the host).

use rayon::prelude::*;

use crate::backend::buffers::Buffers;
use crate::backend::cpu::CpuBackend;
use crate::backend::cpu::ELEMENT_CHUNK;
use crate::ops::float::{lane_sum, Stored};

/// The ordered sums on a backend's views (the conventions: `backend/mod.rs`).
pub trait Reductions: Buffers {
    /// Sum of the elements, accumulated in f64 in a fixed order (deterministic).
    fn sum(&self, x: Self::View<'_>) -> f64;

    /// Sum of squares (for the global gradient norm), in f64, fixed order.
    fn sum_squares(&self, x: Self::View<'_>) -> f64;
}

/// Sum of `f(x)` over `x`, in f64: each chunk with 8 running sums (`lane_sum`: one sum
/// would make every addition wait for the one before), the chunks' sums added in order.
fn ordered_sum<S: Stored>(x: &[S], f: impl Fn(f64) -> f64 + Sync) -> f64 {
    let partials: Vec<f64> =
        x.par_chunks(ELEMENT_CHUNK).map(|chunk| lane_sum(chunk.len(), |i| f(chunk[i].to_f64()))).collect();
    partials.iter().sum()
}

impl<S: Stored> Reductions for CpuBackend<S> {
    fn sum(&self, x: &[S]) -> f64 {
        ordered_sum(x, |v| v)
    }

    fn sum_squares(&self, x: &[S]) -> f64 {
        ordered_sum(x, |v| v * v)
    }
}

/// The launch of the sums' kernel (`reductions.cu`): a block of [`BLOCK`] threads per
/// chunk of [`SUM_CHUNK`] elements.
#[cfg(feature = "cuda")]
mod cuda {
    use cudarc::driver::LaunchConfig;

    use super::Reductions;
    use crate::backend::cuda::CudaBackend;
    use crate::ops::cuda::{launch, DeviceElem, DeviceView, BLOCK};

    /// Elements per block of `sum` / `sum_squares`.
    const SUM_CHUNK: usize = 1 << 16;

    fn ordered_sum<S: DeviceElem>(be: &CudaBackend<S>, x: DeviceView<'_, S>, squares: bool) -> f64 {
        if x.len == 0 {
            return 0.0;
        }
        let gpu = &be.launcher;
        let blocks = x.len.div_ceil(SUM_CHUNK);
        let partial = gpu.scratch::<f64>(blocks);
        let cfg = LaunchConfig { grid_dim: (blocks as u32, 1, 1), block_dim: (BLOCK, 1, 1), shared_mem_bytes: 0 };
        launch!(gpu, "partial_sums", cfg, x.ptr, x.len as i64, SUM_CHUNK as i64, gpu.ptr_of(&partial), squares as i32);
        gpu.download_f64(&partial, blocks).iter().sum()
    }

    impl<S: DeviceElem> Reductions for CudaBackend<S> {
        fn sum(&self, x: DeviceView<'_, S>) -> f64 {
            ordered_sum(self, x, false)
        }

        fn sum_squares(&self, x: DeviceView<'_, S>) -> f64 {
            ordered_sum(self, x, true)
        }
    }
}
