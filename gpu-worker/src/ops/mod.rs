//! The ops: one file per layer of the model with its forward and backward side by side,
//! the math in a comment and the CPU kernel in Rust (llm.c style), next to the same op's
//! CUDA kernel in a `.cu` file of the same name (compiled by the CUDA backend). Each op's
//! `.rs` file also says what the op is on any backend, a trait (`LayerNormKernels`, ...),
//! and implements it twice: for the CPU backend (the work split over threads) and, in its
//! `cuda` module (feature `cuda`), for the CUDA backend (the kernel's launch). Below them,
//! what every op computes with: the number formats (`float.rs`), the matrix product on
//! strided views (`gemm.rs`, over our packed product, `packed_gemm.rs`, or the gemm
//! crate), the kernels' SIMD dispatch (`simd.rs`) and the CUDA launches'
//! kit (`cuda.rs`). The optimizer's update is an op too (`optimizer.rs`, `optimizer.cu`).
//!
//! A new op is three files: its `.rs`, its `.cu`, and three lines here (its `mod`, its
//! `.cu` in [`cuda_sources`], its trait in [`ModelKernels`]).
//!
//! The ops sit on the backends' buffers (`backend/buffers.rs`, the two backends' types) and
//! under the model; no op imports the model, a strategy or the optimizer.

pub mod attention;
#[cfg(feature = "cuda")]
pub mod cuda;
pub mod embedding;
pub mod flash_attention;
pub mod float;
pub mod fp8;
pub mod gemm;
pub mod layernorm;
pub mod linear;
pub mod loss;
pub mod mlp;
pub mod optimizer;
pub mod packed_gemm;
pub mod reductions;
pub mod ring_attention;
pub mod rmsnorm;
pub mod rope;
pub mod router;
pub mod simd;
pub mod swiglu;

use crate::backend::buffers::Buffers;

/// The kernels a GPT or Llama needs (llm.c's list and Llama's three), one trait per op, each in its op's file.
macro_rules! model_kernels {
    ($($op:ident::$kernels:ident),+ $(,)?) => {
        /// The model's kernels on a backend's views (the conventions they follow:
        /// `backend/mod.rs`): every op's trait, implemented for whatever implements them all.
        pub trait ModelKernels: Buffers $(+ $op::$kernels)+ {}

        impl<B: Buffers $(+ $op::$kernels)+> ModelKernels for B {}

        /// Every op's trait, for code that calls kernels on a backend named by its type
        /// (`use ops::kernels::*`); code generic over a `Backend` has them all already.
        pub mod kernels {
            $(pub use super::$op::$kernels;)+
        }
    };
}

model_kernels!(
    reductions::Reductions,
    embedding::EmbeddingKernels,
    layernorm::LayerNormKernels,
    rmsnorm::RmsNormKernels,
    rope::RopeKernels,
    linear::LinearKernels,
    attention::AttentionKernels,
    flash_attention::FlashAttentionKernels,
    ring_attention::RingAttentionKernels,
    mlp::GeluKernels,
    swiglu::SwiGluKernels,
    loss::CrossEntropyKernels,
    fp8::Fp8Kernels,
);

/// Every op's CUDA C (`<op>.cu`), one string in the order NVRTC compiles them, after what
/// the kernels share (`backend/cuda/modules.rs`, `KERNELS`): a new op adds its name here,
/// beside its `mod`.
#[cfg(feature = "cuda")]
macro_rules! cuda_sources {
    () => {
        $crate::ops::op_sources!(
            "embedding",
            "layernorm",
            "rmsnorm",
            "rope",
            "linear",
            "mlp",
            "swiglu",
            "attention",
            "flash_attention",
            "ring_attention",
            "loss",
            "fp8",
            "reductions",
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
