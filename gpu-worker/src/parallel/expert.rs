//! Expert parallelism (GShard, Lepikhin et al. 2020; DeepSpeed-MoE): the experts of every
//! Mixture-of-Experts block spread over `ep` ranks of the data-parallel group, E/ep each.
//!
//! ```text
//!   dp = 4, ep = 2:   expert-parallel groups {0, 1} {2, 3}   (consecutive DP ranks)
//!                     expert replicas        {0, 2} {1, 3}   (the same experts)
//! ```
//!
//! Every rank still routes its own micro-batch (the attention, the router and everything
//! outside the experts is data parallel as before). The slots a rank fills are laid out
//! expert by expert, so the slots for rank r's experts are one run of E/ep x C rows: one
//! all-to-all hands each run to its rank, which runs its experts on C rows from every
//! source, and a second all-to-all brings the outputs home. Backward sends the output
//! gradients the same way and the input gradients back: four all-to-alls per block and
//! micro-batch, each moving (ep-1)/ep of E x C x d values per rank, on the critical path.
//!
//! Gradients: the parameters outside the experts are summed over the whole data-parallel
//! group as in DDP; an expert's gradient already holds every token of its expert-parallel
//! group that visited it, so it is summed only over the ranks holding the same experts
//! (its replicas; none when ep = dp). For the gradient norm each rank counts the shared
//! tensors 1/ep (`ParamLayout::grad_squares`); summed over the data-parallel group that
//! counts everything dp/ep times (the trainer divides).
//! The model's half of this is `model/experts.rs`, the layout's `ParamLayout::for_experts`.

use std::sync::Arc;

use distlab_common::trace::{lane, Span};

use super::exchange::RecordedExchange;
use super::TrainBackend;
use crate::comm::{CommError, Communicator};
use crate::memory::MemoryTracker;
use crate::model::experts::ExpertParallelGroup;
use crate::model::ExpertPlace;

/// One rank's expert-parallel group: its communicator and the record of its all-to-alls.
pub struct ExpertParallel(RecordedExchange);

impl ExpertParallel {
    pub fn new(comm: Box<dyn Communicator>) -> Self {
        ExpertParallel(RecordedExchange::new(comm, lane::EP))
    }

    /// The group's communicator, for a faster one over the same ranks to take its place
    /// (NCCL, see `train/cuda.rs`).
    pub fn comm_mut(&mut self) -> &mut Box<dyn Communicator> {
        self.0.comm_mut()
    }

    /// What the group's communicator keeps for staging (see `Communicator::staging_bytes`).
    pub fn staging_bytes(&self) -> u64 {
        self.0.staging_bytes()
    }
}

impl<B: TrainBackend> ExpertParallelGroup<B> for ExpertParallel {
    fn place(&self) -> ExpertPlace {
        let (rank, size) = self.0.place();
        ExpertPlace { rank, size }
    }

    fn all_to_all(
        &mut self,
        be: &B,
        send: &B::Buf,
        recv: &mut B::Buf,
        what: &'static str,
        layer: usize,
    ) -> Result<(), CommError> {
        // (the slots are laid out by destination already: they cross as they are)
        self.0.all_to_all(be, (send, recv), None, format!("all_to_all ep: layer {layer} {what}"), layer)
    }

    fn begin_step(&mut self, step: u64, record: bool) {
        self.0.begin_step(step, record);
    }

    fn spans(&self) -> Vec<Span> {
        self.0.spans()
    }

    fn attach_memory(&mut self, memory: &Arc<MemoryTracker>) {
        self.0.attach_memory(memory);
    }
}
