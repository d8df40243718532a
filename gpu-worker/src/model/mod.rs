//! The GPT model: one file per layer with its forward and backward math side by
//! side (the CPU kernels, llm.c style), and `gpt.rs`, which composes them through
//! the [`Backend`](crate::backend::Backend) trait.

pub mod attention;
pub mod embedding;
pub mod gpt;
pub mod layernorm;
pub mod layout;
pub mod linear;
pub mod loss;
pub mod mlp;
pub mod state;

pub use gpt::{Gpt, Saved, Stage, StageInput};
pub use layout::{BlockTensors, Init, ParamLayout, Split, TensorInfo, TpPlace};
pub use state::{FlatState, ModelState, OpenUnit, Pass, Unit};
