//! The GPT model: `gpt.rs` composes it and runs a stage's forward and backward through the
//! [`Backend`](crate::backend::Backend) trait (the ops' math lives in `ops/`), with
//! ZB-H1's W pass in `gpt/weights_pass.rs`; `block.rs` is one transformer block, `head.rs`
//! the final LayerNorm and LM head, `activations.rs` what forward keeps for backward,
//! `stage.rs` the part of the model a pipeline stage runs, `tensor_parallel.rs` where
//! tensor and sequence parallelism's collectives go, `experts.rs` the Mixture-of-Experts
//! MLP; `layout.rs` places every parameter in one flat buffer, `state.rs` says where they
//! live while it runs.

pub mod activation_offload;
pub mod activations;
mod attend;
pub mod block;
pub mod context_parallel;
pub mod experts;
pub mod fp8_linear;
pub mod gpt;
pub mod head;
pub mod layout;
pub mod stage;
pub mod state;
pub mod tensor_parallel;

pub use activation_offload::{ActivationOffloadError, ActivationTier};
pub use activations::{activation_floats_for, offloaded_block_floats, Saved};
pub use context_parallel::{Columns, ContextParallelGroup, ContextPlace, ExchangeShape};
pub use experts::ExpertStats;
pub use gpt::{Gpt, ModelGroups, RecomputeTime};
pub use head::LogitGradZeros;
pub use layout::{BlockTensors, ExpertPlace, Init, ParamLayout, Split, TensorInfo, TpPlace};
pub use stage::{Stage, StageInput};
pub use state::{FlatState, ModelState, OpenUnit, Pass, Unit};
pub use tensor_parallel::{TensorParallelGroup, TpPoint};
