//! The CUDA backend (cargo feature `cuda`): buffers live in GPU memory, GEMMs go through
//! cuBLAS (fp32, or bf16/fp16 with fp32 accumulation), and every other kernel is CUDA C
//! (`cuda_prelude.cu`, `cuda_reductions.cu`, each op's `.cu` beside its CPU kernel in `ops/`),
//! compiled by NVRTC for the buffers' format when the backend starts (`modules.rs`). cudarc loads libcuda, cuBLAS and NVRTC at run time, so this builds on a machine
//! without CUDA; there [`CudaBackend::new`] says what is missing instead of starting.
//!
//! Everything runs in order on one stream, so a kernel may read what the one before it
//! wrote; results come back to the host (`download`, `sum`, the loss) after a sync.
//! Views are device pointers with a length, borrowed from the buffer like slices.
//!
//! The backend is a folder by family: `buffers.rs`, `optimizer.rs`, `collectives.rs`, and
//! `modules.rs` (the CUDA C and its compilation). The model's kernels are launched from
//! their ops' files (`ops/<op>.rs`'s `cuda` module, with `ops/cuda.rs` what they share).
//!
//! Like the CPU backend, results do not depend on timing: no kernel uses atomics, every
//! sum over rows runs in a fixed order, and cuBLAS's default algorithms are deterministic
//! on one stream.

use std::sync::Arc;

use cudarc::cublas::{result as blas, sys as blas_sys, CudaBlas};
use cudarc::driver::CudaContext;

mod buffers;
mod collectives;
mod modules;
mod optimizer;

use crate::ops::cuda::Launcher;
pub use crate::ops::cuda::{DeviceElem, DeviceView, DeviceViewMut};
pub use crate::ops::optimizer::cuda::DeviceOptimizerBuffers;
use modules::load_kernels;
pub use modules::{compile_kernels, kernel_names, KERNELS};

/// Why the CUDA backend cannot start here.
#[derive(Debug, thiserror::Error)]
pub enum CudaUnavailable {
    #[error("the CUDA driver library (libcuda.so) is not installed on this machine")]
    NoDriver,
    #[error("{0} is not installed on this machine")]
    NoLibrary(&'static str),
    #[error("no CUDA device {ordinal} (this machine has {count})")]
    NoDevice { ordinal: usize, count: i32 },
    #[error("the CUDA driver finds no usable GPU: {0}")]
    NoUsableDevice(cudarc::driver::DriverError),
    #[error("CUDA: {0}")]
    Driver(#[from] cudarc::driver::DriverError),
    #[error("cuBLAS: {0}")]
    Blas(#[from] blas::CublasError),
    #[error("NVRTC could not compile the kernels: {0}")]
    Compile(String),
}

impl CudaUnavailable {
    /// True when this machine simply has no GPU to offer (no driver, library or device),
    /// as opposed to a GPU that is there but failed.
    pub fn no_gpu_here(&self) -> bool {
        matches!(self, Self::NoDriver | Self::NoLibrary(_) | Self::NoDevice { .. } | Self::NoUsableDevice(_))
    }
}

/// How many GPUs this machine has (without making a context on any).
pub fn device_count() -> Result<usize, CudaUnavailable> {
    if !unsafe { cudarc::driver::sys::is_culib_present() } {
        return Err(CudaUnavailable::NoDriver);
    }
    let count = CudaContext::device_count().map_err(CudaUnavailable::NoUsableDevice)?;
    Ok(count.max(0) as usize)
}

/// A GPU of this machine, as a worker reports it.
pub struct Gpu {
    /// e.g. "cuda:0 NVIDIA H100 80GB HBM3 (79 GiB)".
    pub label: String,
    pub memory_bytes: u64,
}

/// The GPUs this machine offers, or why it offers none.
pub fn devices() -> Result<Vec<Gpu>, CudaUnavailable> {
    // cudarc panics on first use of a library it cannot load: check first.
    if !unsafe { cudarc::driver::sys::is_culib_present() } {
        return Err(CudaUnavailable::NoDriver);
    }
    let count = CudaContext::device_count().map_err(CudaUnavailable::NoUsableDevice)?;
    (0..count.max(0) as usize)
        .map(|i| {
            let ctx = CudaContext::new(i)?;
            let memory_bytes = ctx.total_mem()? as u64;
            let gib = memory_bytes as f64 / (1u64 << 30) as f64;
            Ok(Gpu { label: format!("cuda:{i} {} ({gib:.0} GiB)", ctx.name()?), memory_bytes })
        })
        .collect()
}

/// CUDA kernels on buffers of `S` on one GPU.
pub struct CudaBackend<S: DeviceElem = f32> {
    /// The stream every kernel runs on, its cuBLAS handle and the compiled kernels.
    pub(crate) launcher: Launcher<S>,
    device: String,
    /// Free device memory when the backend was made (what the run's use is measured from).
    free_at_start: usize,
}

impl<S: DeviceElem> Clone for CudaBackend<S> {
    fn clone(&self) -> Self {
        Self { launcher: self.launcher.clone(), device: self.device.clone(), free_at_start: self.free_at_start }
    }
}

impl<S: DeviceElem> CudaBackend<S> {
    /// A backend on GPU `ordinal`: a context, one stream, a cuBLAS handle and the kernels
    /// compiled for this GPU and format `S`.
    pub fn new(ordinal: usize) -> Result<Self, CudaUnavailable> {
        if !unsafe { cudarc::driver::sys::is_culib_present() } {
            return Err(CudaUnavailable::NoDriver);
        }
        if !unsafe { cudarc::cublas::sys::is_culib_present() } {
            return Err(CudaUnavailable::NoLibrary("cuBLAS (libcublas.so)"));
        }
        if !unsafe { cudarc::nvrtc::sys::is_culib_present() } {
            return Err(CudaUnavailable::NoLibrary("NVRTC (libnvrtc.so)"));
        }
        let count = CudaContext::device_count().map_err(CudaUnavailable::NoUsableDevice)?;
        if ordinal >= count.max(0) as usize {
            return Err(CudaUnavailable::NoDevice { ordinal, count });
        }
        let ctx = CudaContext::new(ordinal)?;
        // One stream: order is enough, cudarc's per-buffer events would only cost time.
        // SAFETY: called before any buffer or stream of this context exists.
        unsafe { ctx.disable_event_tracking() };
        let (major, minor) = ctx.compute_capability()?;
        let stream = ctx.default_stream();
        let kernels = load_kernels(&ctx, S::DEFINE, (major, minor))?;
        let blas = CudaBlas::new(stream.clone())?;
        // Split-K partial sums stay fp32 in 2-byte GEMMs (cuBLAS's default may round them
        // to the format), as the CPU's sums do.
        // SAFETY: a live handle; the mode is one of cuBLAS's.
        unsafe {
            blas_sys::cublasSetMathMode(
                *blas.handle(),
                blas_sys::cublasMath_t::CUBLAS_MATH_DISALLOW_REDUCED_PRECISION_REDUCTION,
            )
        }
        .result()?;
        let gib = ctx.total_mem()? as f64 / (1u64 << 30) as f64;
        let free_at_start = ctx.mem_get_info()?.0;
        Ok(Self {
            device: format!("cuda:{ordinal} {} ({gib:.0} GiB, sm_{major}{minor})", ctx.name()?),
            free_at_start,
            launcher: Launcher::new(stream, Arc::new(blas), Arc::new(kernels)),
        })
    }

    /// Which GPU this is, for logs and reports.
    pub fn device(&self) -> &str {
        &self.device
    }

    /// Bytes of GPU memory free now.
    pub fn free_memory(&self) -> Result<usize, CudaUnavailable> {
        Ok(self.launcher.stream.context().mem_get_info()?.0)
    }
}
