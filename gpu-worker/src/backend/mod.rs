//! Backends: where buffers live and how the model's kernels run on them.
//!
//! A backend is four small traits by family, as candle splits its device from its storage:
//! - [`Buffers`] (`buffers.rs`): the number format, buffers and their views, fill / copy /
//!   add, host access;
//! - [`ModelKernels`] (`ops/mod.rs`): the dozen kernels a GPT needs (llm.c's list) and
//!   the ordered sums, one trait per op in the op's file, implemented there for both
//!   backends;
//! - [`OptimizerKernels`] (`optimizer.rs`): the optimizer's state where the buffers live,
//!   fp32 whatever the model's format, and its update (`ops/optimizer.rs`);
//! - [`DeviceCollectives`] (`collectives.rs`): collectives on the buffers where they live.
//!
//! [`Backend`] is all four, the one bound the model, the strategies and the optimizer use.
//! Kernels work on views of backend-owned buffers, so a GPU backend implements them with
//! device memory (`cuda/`) the same way the CPU backend does with slices (`cpu.rs`). Token
//! ids are passed as host slices (a few KiB per micro-batch; a GPU backend copies them).
//!
//! Conventions every implementation follows:
//! - tensors are row-major; `rows` of an activation is its length / its width `c`;
//! - a linear layer computes `out = inp · W + b` with `W` stored `(c_in, c_out)`;
//! - kernels that write a *parameter* gradient ACCUMULATE (`+=`), so micro-batches
//!   add up; the trainer zeroes the gradients once per optimizer step;
//! - activation gradients are overwritten, except where a kernel says it adds
//!   into the residual stream (`layernorm_backward`).
//!
//! Each op's math, CPU kernel, thread split and CUDA launch live in one file
//! (`ops/layernorm.rs` holds `layernorm_forward` and `layernorm_backward`, llm.c style,
//! and `LayerNormKernels` for both backends), its CUDA C beside it (`ops/layernorm.cu`).

pub mod buffers;
pub mod collectives;
pub mod cpu;
#[cfg(feature = "cuda")]
pub mod cuda;
pub mod optimizer;

pub use buffers::Buffers;
pub use collectives::DeviceCollectives;
pub use cpu::CpuBackend;
pub use optimizer::OptimizerKernels;

pub use crate::ops::float::{Float, Stored};
pub use crate::ops::ModelKernels;

/// A backend: every family. Implemented for whatever implements the four.
pub trait Backend: Buffers + ModelKernels + OptimizerKernels + DeviceCollectives {}

impl<B: Buffers + ModelKernels + OptimizerKernels + DeviceCollectives> Backend for B {}
