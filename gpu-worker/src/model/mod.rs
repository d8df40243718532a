//! The GPT model: `gpt.rs` composes the layers through the
//! [`Backend`](crate::backend::Backend) trait (the ops' math lives in `ops/`), `layout.rs`
//! places every parameter in one flat buffer, `state.rs` says where they live while it
//! runs, `sequence_parallel.rs` splits the LayerNorm regions over a tensor-parallel group.

pub mod experts;
pub mod gpt;
pub mod layout;
pub mod sequence_parallel;
pub mod state;

pub use gpt::{Gpt, Saved, Stage, StageInput};
pub use layout::{BlockTensors, ExpertPlace, Init, ParamLayout, Split, TensorInfo, TpPlace};
pub use state::{FlatState, ModelState, OpenUnit, Pass, Unit};
