//! The ops: one file per layer of the model with its forward and backward side by side,
//! the math in a comment and the CPU kernel in Rust (llm.c style), next to the same op's
//! CUDA kernel in a `.cu` file of the same name (compiled by the CUDA backend) and, in the
//! `.rs` file's `cuda` module (feature `cuda`), that kernel's launch. Below them, what every
//! op computes with: the number formats (`float.rs`), the matrix product on strided views
//! (`gemm.rs`), the kernels' SIMD dispatch (`simd.rs`) and the CUDA launches' kit
//! (`cuda.rs`). The optimizer's update is an op too (`optimizer.rs`, `optimizer.cu`).
//!
//! The ops are a leaf: the backends depend on them (`backend/cpu.rs` splits their work over
//! threads, `backend/cuda/kernels.rs` calls their launches), the model and the optimizer
//! (`optim/`) on the backends; no op imports a backend or the optimizer.

pub mod attention;
#[cfg(feature = "cuda")]
pub mod cuda;
pub mod embedding;
pub mod flash_attention;
pub mod float;
pub mod gemm;
pub mod layernorm;
pub mod linear;
pub mod loss;
pub mod mlp;
pub mod optimizer;
pub mod router;
pub mod simd;

/// Every op's CUDA C (`<op>.cu`), one string in the order NVRTC compiles them, after what
/// the kernels share (`backend/cuda/modules.rs`, `KERNELS`): a new op adds its name here,
/// beside its `mod`.
#[cfg(feature = "cuda")]
macro_rules! cuda_sources {
    () => {
        $crate::ops::op_sources!(
            "embedding",
            "layernorm",
            "linear",
            "mlp",
            "attention",
            "flash_attention",
            "loss",
            "optimizer"
        )
    };
}
#[cfg(feature = "cuda")]
pub(crate) use cuda_sources;

/// The `.cu` files of the ops named, one after another (by their path from the crate's
/// root, which `include_str!` in a macro needs: a relative one is the caller's).
#[cfg(feature = "cuda")]
macro_rules! op_sources {
    ($($op:literal),+) => {
        concat!($(include_str!(concat!(env!("CARGO_MANIFEST_DIR"), "/src/ops/", $op, ".cu"))),+)
    };
}
#[cfg(feature = "cuda")]
pub(crate) use op_sources;
