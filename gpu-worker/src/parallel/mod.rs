//! Parallel strategies, one per file (as in picotron): how one rank holds the model's
//! parameters, gradients and optimizer state, and how it keeps them in step with the
//! other ranks of its data-parallel group.
//!
//! * `ddp.rs`: every rank holds everything; gradients are all-reduced in buckets that
//!   overlap backward. With ZeRO-1 the optimizer state is sharded (`zero1`).
//! * `sharded.rs`: ZeRO-2 (gradients and optimizer state sharded) and FSDP / ZeRO-3
//!   (parameters too, gathered one unit at a time).
//! * `shard.rs`: which piece of every unit a rank owns.
//! * `pipeline.rs` + `schedule.rs`: pipeline stages and the GPipe / 1F1B schedules.
//! * `tensor.rs`: Megatron tensor parallelism (the model runs it; this is its group).
//! * `mesh.rs`: the dp x tp x pp topology that hands every rank its groups.

pub mod ddp;
pub mod mesh;
pub mod pipeline;
pub mod schedule;
pub mod shard;
pub mod sharded;
pub mod tensor;

use std::sync::Arc;

use distlab_common::trace::Span;
use distlab_common::{ExperimentSpec, Sharding};

use crate::backend::CpuBackend;
use crate::comm::{CommError, Communicator};
use crate::memory::MemoryTracker;
use crate::model::{ModelState, ParamLayout, Stage};
use crate::optim::OptimizerState;

/// The backend the strategies run on (their collectives work on host memory).
pub type Cpu = CpuBackend<f32>;

/// How one rank holds and updates the model.
pub trait Strategy: Send {
    /// Before a step's micro-batches: zero the gradients; `record` keeps its timeline.
    fn begin_step(&mut self, be: &Cpu, step: u64, record: bool);
    /// The state the model runs a micro-batch on (`last`: the step's last micro-batch).
    fn state(&mut self, last: bool) -> &mut dyn ModelState<Cpu>;
    /// After every micro-batch's backward: gradients summed over the group; returns the
    /// sum of their squares over the stage's parameters (the squared L2 norm of the
    /// stage's part of the gradient).
    fn reduce_gradients(&mut self, be: &Cpu) -> Result<f64, CommError>;
    /// The optimizer update (then the parameters are made whole again where needed).
    fn update(&mut self, be: &Cpu, lr: f64, grad_scale: f64) -> Result<(), CommError>;
    /// Sums a scalar over the data-parallel group (the step's loss).
    fn sum_scalar(&mut self, value: f64) -> Result<f64, CommError>;
    /// Communication spans recorded so far.
    fn comm_spans(&self) -> Vec<Span>;
    /// Bytes of the buffers it holds, counted from the buffers themselves (what the
    /// memory ledger must agree with).
    fn held_bytes(&self, be: &Cpu) -> u64;
    /// What an optimizer step changes, for a checkpoint to copy.
    fn state_view(&self) -> StateView<'_>;
    /// Puts back a state `save` took on the same rank of the same run.
    fn load(&mut self, state: SavedState) -> Result<(), String>;
}

/// The state a checkpoint keeps of a strategy (see `checkpoint.rs`), as it holds it.
pub struct StateView<'a> {
    /// This rank's parameters: all of its stage's, or its shard of them (FSDP).
    pub params: &'a [f32],
    /// AdamW's m and v (empty for SGD).
    pub moments: [&'a [f32]; 2],
    pub optimizer_steps: u64,
    /// Every rank of the data-parallel group holds the same parameters (then DP rank 0
    /// alone writes them).
    pub params_replicated: bool,
    /// Every rank of the group holds the same optimizer state (DDP without ZeRO).
    pub optimizer_replicated: bool,
}

/// A checkpoint's state for [`Strategy::load`].
#[derive(Clone, Debug, Default, PartialEq)]
pub struct SavedState {
    pub params: Vec<f32>,
    pub optimizer: OptimizerState,
}

/// Replaces `held` by `saved`, which must be as long.
pub fn load_params(held: &mut Vec<f32>, saved: Vec<f32>) -> Result<(), String> {
    if saved.len() != held.len() {
        return Err(format!("{} parameters saved, this rank holds {}", saved.len(), held.len()));
    }
    *held = saved;
    Ok(())
}

/// This rank's data-parallel group: two communicators over the same ranks, one for the
/// gradients (DDP moves it onto its communication thread) and one for the training
/// loop's own small collectives.
pub struct DpGroup {
    pub rank: usize,
    pub world: usize,
    pub grads: Box<dyn Communicator>,
    pub scalars: Box<dyn Communicator>,
}

/// The strategy `spec.parallel.sharding` asks for, for the parameters of `stage` (one
/// rank alone when `dp` is None).
pub fn build(
    spec: &ExperimentSpec,
    be: &Cpu,
    layout: &ParamLayout,
    stage: &Stage,
    memory: &Arc<MemoryTracker>,
    dp: Option<DpGroup>,
) -> Result<Box<dyn Strategy>, CommError> {
    Ok(match spec.parallel.sharding {
        Sharding::None | Sharding::Zero1 => Box::new(ddp::Replicated::new(spec, be, layout, stage, memory, dp)?),
        Sharding::Zero2 | Sharding::Fsdp => Box::new(sharded::Sharded::new(spec, be, layout, stage, memory, dp)?),
    })
}
