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
