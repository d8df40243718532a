//! Parallel strategies, one per file (as in picotron): how one rank holds the model's
//! parameters, gradients and optimizer state, and how it keeps them in step with the
//! other ranks of its data-parallel group.
//!
//! * `ddp.rs`: every rank holds everything; gradients are all-reduced in buckets that
//!   overlap backward. With ZeRO-1 the optimizer state is sharded (`zero1`).
//! * `sharded.rs`: ZeRO-2 (gradients and optimizer state sharded) and FSDP / ZeRO-3
//!   (parameters too, gathered one unit at a time); `prefetch.rs`: FSDP's next gather
//!   on a communication thread while the current unit computes; `fp8_gather.rs`: FSDP's
//!   gathers of the blocks' linear weights as FP8 (`parallel.fp8_all_gather`).
//! * `diloco.rs`: DiLoCo, replicas that step alone and average their parameter changes
//!   every H steps with an outer Nesterov step (`parallel.sync: diloco`).
//! * `compression.rs`: DDP's gradients compressed on the wire (top-k, int8, PowerSGD)
//!   with error feedback.
//! * `shard.rs`: which piece of every unit a rank owns.
//! * `pipeline.rs`: pipeline stages; their GPipe / 1F1B schedules are plain functions in
//!   `distlab_common::schedule`, which the pipeline page replays too.
//! * `expert.rs`: expert parallelism, Mixture-of-Experts blocks' experts spread over
//!   ranks of the data-parallel group (the model runs it; this is its group).
//! * `context.rs`: context parallelism, Ulysses' all-to-alls turning tokens into heads
//!   around attention, or ring attention's passes (the model runs it; this is its group
//!   and the exchanges).
//! * `exchange.rs`: the recorded all-to-all and ring pass, through host memory, both use.
//! * `tensor.rs`: Megatron tensor parallelism (the model runs it; this is its group).
//! * `mesh.rs`: the dp x tp x pp topology that hands every rank its groups.

pub mod async_ps;
pub mod compression;
pub mod context;
pub mod ddp;
pub mod diloco;
pub mod exchange;
pub mod expert;
pub mod fault_tolerant;
pub mod fp8_gather;
pub mod mesh;
pub mod pipeline;
pub mod prefetch;
pub use distlab_common::schedule;
pub mod shard;
pub mod sharded;
pub mod tensor;

use std::borrow::Cow;
use std::ops::Range;
use std::sync::Arc;

use distlab_common::trace::Span;
use distlab_common::{DataSync, ExperimentSpec, FaultTolerance, Precision, Sharding};

use crate::backend::{Backend, Stored};
use crate::comm::{CommError, Communicator, InPlace};
use crate::error::TrainError;
use crate::memory::{Category, MemoryTracker};
use crate::model::{ModelState, ParamLayout, Stage};
use crate::offload::{OffloadError, OffloadTo};
use crate::ops::float::in_acc;
use crate::optim::{OptimizerSlices, OptimizerState};

/// A backend the engine trains on: any `Backend` whose buffers hold a format that
/// computes in f32 (f32 itself, or bf16/fp16 for mixed precision). The strategies are
/// written against this alone; which backend runs them is the trainer's choice.
pub trait TrainBackend: Backend<Elem: Stored<Acc = f32>> {}
impl<B: Backend<Elem: Stored<Acc = f32>>> TrainBackend for B {}

/// How one rank holds and updates the model, on backend `B`.
pub trait Strategy<B: TrainBackend>: Send {
    /// Before a step's micro-batches: zero the gradients; `record` keeps its timeline.
    /// (Fault-tolerant replicas agree here on who takes part in the step.)
    fn begin_step(&mut self, be: &B, step: u64, record: bool) -> Result<(), TrainError>;
    /// The state the model runs a micro-batch on (`last`: the step's last micro-batch).
    fn state(&mut self, last: bool) -> &mut dyn ModelState<B>;
    /// After every micro-batch's backward: gradients summed over the group; returns the
    /// sum of their squares over the stage's parameters (the squared L2 norm of the
    /// stage's part of the gradient).
    fn reduce_gradients(&mut self, be: &B) -> Result<f64, CommError>;
    /// The optimizer update (then the parameters are made whole again where needed).
    fn update(&mut self, be: &B, lr: f64, grad_scale: f64) -> Result<(), TrainError>;
    /// Sums a scalar over the data-parallel group (the step's loss).
    fn sum_scalar(&mut self, value: f64) -> Result<f64, CommError>;
    /// Communication spans recorded so far.
    fn comm_spans(&self) -> Vec<Span>;
    /// Asynchronous SGD, on the parameter server's rank: every gradient it applied.
    fn applied_gradients(&self) -> Vec<distlab_common::trace::AppliedGradient> {
        Vec::new()
    }
    /// Bytes of the buffers it holds, counted from the buffers themselves (what the
    /// memory ledger must agree with).
    fn held_bytes(&self, be: &B) -> u64;
    /// Shows `f` what an optimizer step changes, for a checkpoint to copy (the parameters
    /// read on the host for the call; an offloaded optimizer state read from disk).
    fn view_state(&self, be: &B, f: &mut dyn FnMut(StateView<'_>)) -> Result<(), OffloadError>;
    /// Puts back a state `save` took on the same rank of the same run.
    fn load(&mut self, be: &B, state: SavedState) -> Result<(), String>;
    /// After the last step (before the run's weights are read): what the strategy still
    /// has to do, and a line for the run's log, if any. Only the asynchronous parameter
    /// server has something: its workers say they are done and rank 0 waits for them.
    fn end(&mut self, be: &B) -> Result<Option<String>, TrainError> {
        let _ = be;
        Ok(None)
    }
    /// A fault-tolerant replacement replica: the step it joins the others at (it runs
    /// none before).
    fn joins_at(&self) -> Option<u64> {
        None
    }
}

/// Where host memory a strategy keeps beside its buffers is booked: as `on_device` where
/// the host is the device (the CPU backend), as offloaded beside a GPU.
pub(crate) fn host_category<B: TrainBackend>(be: &B, on_device: Category) -> Category {
    if be.buffers_on_host() {
        on_device
    } else {
        Category::Offloaded
    }
}

/// The state a checkpoint keeps of a strategy (see `checkpoint.rs`), as it holds it.
pub struct StateView<'a> {
    /// This rank's parameters (all of its stage's, or its shard of them with FSDP), as
    /// f32: borrowed from an fp32 model, widened (exactly) from a bf16/fp16 one.
    pub params: Cow<'a, [f32]>,
    /// AdamW's m and v (empty for SGD); mixed precision: the fp32 master weights, sharded
    /// as the optimizer state is.
    pub optimizer: OptimizerSlices<'a>,
    pub optimizer_steps: u64,
    /// Every rank of the data-parallel group holds the same parameters (then DP rank 0
    /// alone writes them).
    pub params_replicated: bool,
    /// Every rank of the group holds the same optimizer state (DDP without ZeRO).
    pub optimizer_replicated: bool,
    /// State of this rank alone, by section name: gradient compression's residual and
    /// PowerSGD's Q (every rank writes its own).
    pub local: Vec<(&'static str, Vec<f32>)>,
}

/// A checkpoint's state for [`Strategy::load`].
#[derive(Clone, Debug, Default, PartialEq)]
pub struct SavedState {
    pub params: Vec<f32>,
    pub optimizer: OptimizerState,
    /// This rank's own sections of [`StateView::local`] (absent ones start afresh).
    pub local: Vec<(String, Vec<f32>)>,
}

/// `params` as f32: the buffer itself for an fp32 model, a widened copy otherwise.
pub fn params_f32<S: Stored<Acc = f32>>(params: &[S]) -> Cow<'_, [f32]> {
    match S::as_acc(params) {
        Some(same) => Cow::Borrowed(same),
        None => Cow::Owned(params.iter().map(|p| p.load()).collect()),
    }
}

/// Replaces `held` by `saved` (f32; exact for a bf16/fp16 model, whose values it came
/// from), which must be as long.
pub fn load_params<S: Stored<Acc = f32>>(held: &mut [S], saved: Vec<f32>) -> Result<(), String> {
    if saved.len() != held.len() {
        return Err(format!("{} parameters saved, this rank holds {}", saved.len(), held.len()));
    }
    for (h, s) in held.iter_mut().zip(saved) {
        *h = S::store(s);
    }
    Ok(())
}

/// Runs a collective on `buf` in f32, the format the communicators carry: in place for
/// an fp32 model; for bf16/fp16, on a widened copy whose result is rounded back. So
/// mixed-precision gradients are summed in fp32 (as with Megatron's
/// `accumulate_allreduce_grads_in_fp32`) and move 4 bytes per element.
pub fn collective_f32<S: Stored<Acc = f32>>(
    memory: &Arc<MemoryTracker>,
    buf: &mut [S],
    f: impl FnOnce(&mut [f32]) -> Result<(), CommError>,
) -> Result<(), CommError> {
    // A 2-byte buffer travels as an f32 copy, booked for as long as it lives.
    let _copy = (std::mem::size_of::<S>() != 4).then(|| memory.alloc(Category::Transient, buf.len()));
    in_acc(buf, f)
}

/// Runs `op` through `comm` on `range` of `buf`: where the buffer lives when the backend
/// and the communicator allow it (NCCL on GPU memory), otherwise on the host in f32
/// ([`collective_f32`]), its values crossing the wire as `wire` says (f32, or 2 bytes:
/// `parallel.comm_dtype`). Either way a 2-byte buffer is summed as an f32 copy, booked.
pub fn collective<B: TrainBackend>(
    be: &B,
    memory: &Arc<MemoryTracker>,
    comm: &mut dyn Communicator,
    buf: &mut B::Buf,
    range: Range<usize>,
    op: InPlace,
    wire: Precision,
) -> Result<(), CommError> {
    if be.reaches(comm) {
        let _copy = (size_of::<B::Elem>() != 4).then(|| memory.alloc(Category::Transient, range.len()));
        return be.device_collective(comm, be.view_mut(buf, range), op);
    }
    comm.set_wire(wire);
    let done = be.on_host(be.view_mut(buf, range), |host| collective_f32(memory, host, |b| op.run(comm, b)));
    comm.set_wire(Precision::Fp32);
    done
}

/// This rank's data-parallel group: two communicators over the same ranks, one for the
/// gradients (DDP moves it onto its communication thread) and one for the training
/// loop's own small collectives.
pub struct DpGroup {
    pub rank: usize,
    pub world: usize,
    pub grads: Box<dyn Communicator>,
    pub scalars: Box<dyn Communicator>,
    /// Expert parallelism with dp > ep: the ranks holding this rank's experts (None: every
    /// expert's gradient is summed with the rest, or ep = dp and none is anywhere else).
    pub experts: Option<Box<dyn Communicator>>,
    /// Hybrid sharding: the shard group (FSDP's gathers and reduce-scatters) and the
    /// replicas of this rank's shard in the other groups (the shard's all-reduce).
    pub hybrid: Option<HybridGroups>,
    /// Asynchronous SGD: this rank's links to the parameter server (on DP rank 0).
    pub parameter_server: Option<async_ps::ServerLinks>,
    /// Fault-tolerant replicas: the worker's quorum, through which this replica meets the
    /// others (its `grads` and `scalars` are then one-rank groups, never used).
    pub membership: Option<Box<dyn fault_tolerant::Membership>>,
}

/// HSDP's two groups inside the data-parallel group: `shard`, the S consecutive ranks
/// a unit is cut over; `replicas`, the ranks at the same place of every other group.
pub struct HybridGroups {
    pub shard: Box<dyn Communicator>,
    pub replicas: Box<dyn Communicator>,
}

/// The strategy `spec.parallel.sharding` asks for, for the parameters of `stage` (one
/// rank alone when `dp` is None), its optimizer's state where `offload` says.
pub fn build<B: TrainBackend>(
    spec: &ExperimentSpec,
    be: &B,
    layout: &ParamLayout,
    stage: &Stage,
    memory: &Arc<MemoryTracker>,
    dp: Option<DpGroup>,
    offload: &OffloadTo,
) -> Result<Box<dyn Strategy<B>>, TrainError> {
    Ok(match spec.parallel.sharding {
        Sharding::None if spec.parallel.sync == DataSync::Diloco => {
            let dp =
                dp.ok_or_else(|| TrainError::Unsupported("sync=diloco needs a data-parallel group (dp >= 2)".into()))?;
            Box::new(diloco::DiLoCo::new(spec, be, layout, stage, memory, dp, offload)?)
        }
        Sharding::None if spec.parallel.sync == DataSync::AsyncPs => {
            let why = "sync=async_ps needs a data-parallel group (dp >= 2) with its links to the server";
            let (workers, links) = dp
                .and_then(|g| Some((g.world, g.parameter_server?)))
                .ok_or_else(|| TrainError::Unsupported(why.into()))?;
            Box::new(async_ps::AsyncPs::new(spec, be, layout, stage, memory, workers, links)?)
        }
        Sharding::None if spec.parallel.fault_tolerance == FaultTolerance::Replicas => {
            let why = "fault_tolerance=replicas needs a data-parallel group (dp >= 2) with the worker's quorum";
            let (place, membership) = dp
                .and_then(|g| Some(((g.rank, g.world), g.membership?)))
                .ok_or_else(|| TrainError::Unsupported(why.into()))?;
            Box::new(fault_tolerant::FaultTolerant::new(spec, be, layout, stage, memory, place, membership, offload)?)
        }
        Sharding::None | Sharding::Zero1 => {
            Box::new(ddp::Replicated::new(spec, be, layout, stage, memory, dp, offload)?)
        }
        Sharding::Zero2 | Sharding::Fsdp | Sharding::Hsdp => {
            Box::new(sharded::Sharded::new(spec, be, layout, stage, memory, dp, offload)?)
        }
    })
}
