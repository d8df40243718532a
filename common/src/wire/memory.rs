//! Memory one rank holds, as the engine's allocation tracker measured it, and the page's
//! view of it next to the planner's prediction (`GET /api/experiments/{id}/memory`).
//!
//! Measured and predicted use the same breakdown ([`RankMemory`]) so that every category
//! can be compared one to one.

use serde::{Deserialize, Serialize};

use crate::plan::planner::{Plan, RankMemory};

/// One category of [`RankMemory`] (`total` is their sum, not a category).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum MemoryCategory {
    Parameters,
    Gradients,
    OptimizerState,
    /// FSDP: a unit's full parameters, gathered for its forward or backward.
    GatheredParameters,
    /// Tensors forward keeps for backward.
    Activations,
    /// Backward's activation-gradient scratch.
    ActivationGrads,
    /// What waits for a collective or a neighbour (DDP buckets, a unit's gradient before its
    /// reduce-scatter, a pipeline stage's receive buffers and queued sends).
    CommBuffers,
    /// Buffers that live for one call: the f32 copies of 2-byte buffers for a collective
    /// or a matrix product. Measured only: the planner does not predict them.
    Transient,
    /// The channels between rank processes: the rings' staging pieces. Measured only.
    Transport,
    /// The host copy of the rank's state a checkpoint is written from (kept for the next
    /// checkpoint to reuse). Measured only.
    Checkpoint,
    /// Gradient compression: the error-feedback residual and PowerSGD's Q.
    CompressionState,
    /// Kept off the device (host memory, or files on disk): ZeRO-Offload's optimizer state,
    /// activation offload's blocks. Not device memory: not in [`ALL`](MemoryCategory::ALL),
    /// not in `total`.
    Offloaded,
}

impl MemoryCategory {
    /// Every category of device memory (all but `Offloaded`), model state first (the order
    /// bars stack them); `total` is their sum.
    pub const ALL: [MemoryCategory; 11] = [
        MemoryCategory::Parameters,
        MemoryCategory::Gradients,
        MemoryCategory::OptimizerState,
        MemoryCategory::GatheredParameters,
        MemoryCategory::Activations,
        MemoryCategory::ActivationGrads,
        MemoryCategory::CommBuffers,
        MemoryCategory::CompressionState,
        MemoryCategory::Transient,
        MemoryCategory::Transport,
        MemoryCategory::Checkpoint,
    ];

    /// Every category, device memory first, then `Offloaded`: what is compared with the
    /// planner and taken at its peak.
    pub const EVERY: [MemoryCategory; 12] = {
        let mut every = [MemoryCategory::Offloaded; 12];
        let mut i = 0;
        while i < MemoryCategory::ALL.len() {
            every[i] = MemoryCategory::ALL[i];
            i += 1;
        }
        every
    };

    /// Whether the planner predicts it (every category but the measured-only ones).
    pub fn planned(self) -> bool {
        !matches!(self, MemoryCategory::Transient | MemoryCategory::Transport | MemoryCategory::Checkpoint)
    }

    pub fn name(self) -> &'static str {
        match self {
            MemoryCategory::Parameters => "parameters",
            MemoryCategory::Gradients => "gradients",
            MemoryCategory::OptimizerState => "optimizer state",
            MemoryCategory::GatheredParameters => "gathered parameters",
            MemoryCategory::Activations => "activations",
            MemoryCategory::ActivationGrads => "activation gradients",
            MemoryCategory::CommBuffers => "communication buffers",
            MemoryCategory::CompressionState => "compression state",
            MemoryCategory::Transient => "transient (measured only)",
            MemoryCategory::Transport => "transport (measured only)",
            MemoryCategory::Checkpoint => "checkpoint copy (measured only)",
            MemoryCategory::Offloaded => "offloaded (off the device)",
        }
    }

    /// Its bytes in `m`.
    pub fn of(self, m: &RankMemory) -> u64 {
        match self {
            MemoryCategory::Parameters => m.parameters,
            MemoryCategory::Gradients => m.gradients,
            MemoryCategory::OptimizerState => m.optimizer_state,
            MemoryCategory::GatheredParameters => m.gathered_parameters,
            MemoryCategory::Activations => m.activations,
            MemoryCategory::ActivationGrads => m.activation_grads,
            MemoryCategory::CommBuffers => m.comm_buffers,
            MemoryCategory::CompressionState => m.compression_state,
            MemoryCategory::Transient => m.transient,
            MemoryCategory::Transport => m.transport,
            MemoryCategory::Checkpoint => m.checkpoint,
            MemoryCategory::Offloaded => m.offloaded,
        }
    }

    /// Its field in `m`.
    pub fn field(self, m: &mut RankMemory) -> &mut u64 {
        match self {
            MemoryCategory::Parameters => &mut m.parameters,
            MemoryCategory::Gradients => &mut m.gradients,
            MemoryCategory::OptimizerState => &mut m.optimizer_state,
            MemoryCategory::GatheredParameters => &mut m.gathered_parameters,
            MemoryCategory::Activations => &mut m.activations,
            MemoryCategory::ActivationGrads => &mut m.activation_grads,
            MemoryCategory::CommBuffers => &mut m.comm_buffers,
            MemoryCategory::CompressionState => &mut m.compression_state,
            MemoryCategory::Transient => &mut m.transient,
            MemoryCategory::Transport => &mut m.transport,
            MemoryCategory::Checkpoint => &mut m.checkpoint,
            MemoryCategory::Offloaded => &mut m.offloaded,
        }
    }
}

/// One point of a rank's memory timeline, taken at an op boundary of the first steps.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct MemorySample {
    /// Microseconds since the Unix epoch (the clock of the rank's spans).
    pub t_us: u64,
    pub step: u64,
    /// What just happened: "forward block 2", "gather block 3", "free block 3", ...
    pub event: String,
    /// Bytes held right after it, by category (`total` is their sum).
    pub bytes: RankMemory,
    /// Heap bytes the process held at that moment (counting allocator), when measured.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub heap: Option<u64>,
    /// Of `bytes`, what lives in shared memory (DDP's buckets), not on the heap.
    #[serde(default, skip_serializing_if = "is_zero")]
    pub shared: u64,
}

fn is_zero(x: &u64) -> bool {
    *x == 0
}

/// What the rank process measured of itself, beside the ledger's bookings: every heap
/// allocation (a counting global allocator) and the kernel's peak resident set. Each is
/// None where it was not measured.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct ProcessMemory {
    /// Heap bytes live when training ended.
    #[serde(default)]
    pub heap_current: Option<u64>,
    /// The most heap bytes ever live at once, start-up included.
    #[serde(default)]
    pub heap_peak: Option<u64>,
    /// Peak resident set size (`VmHWM`): heap, stacks, shared-memory pipes and code.
    #[serde(default)]
    pub peak_resident: Option<u64>,
    /// GPU: device memory the run holds, from the driver (free before the run minus free
    /// when the report was made; cuda backend).
    #[serde(default)]
    pub device_used: Option<u64>,
    /// The peaks when the model and its state had been built, before the first step.
    #[serde(default)]
    pub start_up: Option<StartUpMemory>,
}

/// Start-up: the heap's peak (counting allocator) and the most the ledger booked on the
/// heap, once the model and its state are built. Their difference is what initialisation held beside
/// the booked buffers (a whole-model copy on a rank that keeps a shard would show here).
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct StartUpMemory {
    pub heap_peak: u64,
    pub ledger_peak: u64,
}

impl ProcessMemory {
    /// Heap bytes at the process's peak that the ledger's bookings on the heap do not
    /// explain (`booked_heap_peak`: the most the ledger booked on the heap at once).
    pub fn untracked(&self, booked_heap_peak: u64) -> Option<i64> {
        self.heap_peak.map(|heap| heap as i64 - booked_heap_peak as i64)
    }
}

/// A rank's measured memory: the engine's own allocations, by category.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct RankMemoryReport {
    pub rank: u32,
    /// Each category at its own highest point during the run; `total` is the highest the
    /// sum ever was (so it can be less than the sum of the categories' peaks).
    pub peak: RankMemory,
    /// What was held when training ended.
    pub current: RankMemory,
    /// Samples at op boundaries of the first recorded steps (FSDP's gather/free sawtooth).
    pub timeline: Vec<MemorySample>,
    /// The most the ledger had booked in shared memory (DDP's buckets, which every rank of
    /// the group maps) rather than on the heap.
    #[serde(default)]
    pub shared_peak: u64,
    /// The shared-memory pipes to the other rank processes this rank maps (2 MiB + 4 KiB each
    /// way per peer): not in the categories (mostly never touched; the resident set shows
    /// what is).
    #[serde(default)]
    pub pipe_bytes: u64,
    /// The most the ledger had booked on the heap at once (its total less shared memory);
    /// what the heap measurement is set against. None from older workers.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub booked_heap_peak: Option<u64>,
    /// The process's own measurement beside the ledger (None from older workers).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub process: Option<ProcessMemory>,
}

impl RankMemoryReport {
    /// Heap bytes at the peak the ledger does not explain (None when not measured).
    pub fn untracked(&self) -> Option<i64> {
        let booked = self.booked_heap_peak.unwrap_or(self.peak.total);
        self.process.as_ref()?.untracked(booked)
    }
}

/// `GET /api/experiments/{id}/memory`: every rank's measured memory next to the planner.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct MemoryView {
    pub ranks: Vec<RankMemoryView>,
    /// The planner's output for the experiment's spec.
    pub plan: Plan,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct RankMemoryView {
    pub rank: u32,
    /// The rank's pipeline stage (an index into `plan.stages`).
    pub stage: usize,
    /// None until the run has reported its memory (queued, running, or failed early).
    pub measured: Option<RankMemoryReport>,
    /// The planner's peak for this rank's stage.
    pub predicted: RankMemory,
    /// One learner-readable line per category where the measured peak differs from the
    /// prediction, saying by how much and why.
    pub differences: Vec<String>,
}
