//! distlab's worker: the training engine (this crate's library) and the
//! `distlab-worker` binary that runs experiments for a server or from a spec file.
//!
//! Engine layout (see docs/ARCHITECTURE.md): `backend/` (buffers + kernels: CPU, and CUDA with the `cuda` feature),
//! `ops/` (each layer's math, CPU kernel and CUDA kernel), `model/` (the GPT),
//! `parallel/` (the strategies), `comm/`, `optim/` (the optimizer, and `offload.rs`: its state off the device),
//! `data.rs`, and `train/`,
//! whose [`train`] is the entry point the CLI and the worker loop call.

pub mod backend;
pub mod checkpoint;
pub mod comm;
pub mod data;
pub mod elastic;
pub mod error;
pub mod export;
pub mod generate;
pub mod heap;
pub mod loss_scale;
pub mod machine_limits;
pub mod memory;
pub mod model;
pub mod ops;
pub mod optim;
/// `crate::offload` as the strategies and the trainer name it (the module is `optim/offload.rs`).
pub use optim::offload;
pub mod parallel;
pub mod rng;
pub mod tokenizer;
pub mod trace;
pub mod train;

pub use train::{train, CpuTrainer, StepStats, TrainError, TrainOptions, Trainer};
