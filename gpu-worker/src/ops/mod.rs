//! The ops: one file per layer of the model with its forward and backward side by side,
//! the math in a comment and the CPU kernel in Rust (llm.c style), next to the same op's
//! CUDA kernel in a `.cu` file of the same name (compiled by the CUDA backend). Below them,
//! what every op computes with: the number formats (`float.rs`), the matrix product on
//! strided views (`gemm.rs`) and the kernels' SIMD dispatch (`simd.rs`).
//!
//! The backends depend on the ops (`backend/cpu.rs` splits their work over threads,
//! `backend/cuda.rs` launches their `.cu` kernels); the model depends on the backends.

pub mod attention;
pub mod embedding;
pub mod flash_attention;
pub mod float;
pub mod gemm;
pub mod layernorm;
pub mod linear;
pub mod loss;
pub mod mlp;
pub mod router;
pub mod simd;
