//! The analytic planner: what an experiment needs per rank, predicted from its spec alone.
//!
//! For any spec (the tiny CPU configs up to 175B models on thousands of ranks: the
//! server's run limits do NOT apply here) it predicts, for one rank of every pipeline
//! stage (all dp x tp ranks of a stage are alike; with uneven shards the figures are
//! those of the rank with the largest shard):
//!
//! - memory by category: parameters, gradients, optimizer state, the gathered FSDP unit,
//!   saved activations, activation gradients and communication buffers ([`RankMemory`]);
//! - bytes sent per optimizer step by each collective ([`CommVolume`]);
//! - the pipeline bubble and the training FLOPs of one step ([`Plan`], [`Flops`]).
//!
//! The page shows these NEXT to what the engine measures; they never replace it.
//!
//! # Model state (bytes per parameter, see [`bytes_per_param`])
//!
//! | precision | optimizer | parameters | gradients | optimizer state               | sum |
//! |-----------|-----------|-----------:|----------:|-------------------------------|----:|
//! | fp32      | adamw     | 4          | 4         | 8 (m, v)                      | 16  |
//! | bf16/fp16 | adamw     | 2          | 2         | 12 (fp32 master copy, m, v)   | 16  |
//! | fp32      | sgd       | 4          | 4         | 0 (no momentum: no state)     | 8   |
//! | bf16/fp16 | sgd       | 2          | 2         | 4 (fp32 master copy)          | 8   |
//!
//! Sharding over the data-parallel group of `dp` ranks (ZeRO stages; a shard is
//! `ceil(n / dp)` elements, the largest piece of the engine's flat split):
//!
//! | sharding | parameters | gradients | optimizer state |
//! |----------|-----------|-----------|-----------------|
//! | none     | full      | full      | full            |
//! | zero1    | full      | full      | 1/dp            |
//! | zero2    | full      | 1/dp      | 1/dp            |
//! | fsdp     | 1/dp      | 1/dp      | 1/dp            |
//!
//! The optimizer state always includes the fp32 master weights (ZeRO paper convention).
//!
//! # How tensor and pipeline parallelism divide the model
//!
//! TP splits each block's QKV, attention-projection and MLP matrices (and the biases of
//! the column-parallel ones) over `tp` ranks; the LayerNorms, the two row-parallel
//! biases, the embeddings and the LM head stay whole on every TP rank. PP gives each
//! stage a contiguous run of blocks (the first stages take one more when `pp` does not
//! divide `layers`); the embeddings live on the first stage, the final LayerNorm and the
//! LM head on the last.
//!
//! All arithmetic is u64 (saturating) or f64, so no input can overflow or panic.
//!
//! # Where it is
//!
//! [`plan`] (`stages.rs`) plans a spec stage by stage, from `structure.rs` (what a spec
//! must be to be planned at all), `model_state.rs` (bytes per parameter, sharded),
//! `activations.rs` (what forward keeps, backward's scratch, checkpointing), `comm.rs`
//! (bytes by collective) and `flops.rs` (the FLOPs of a step). The plan's types are here.

use serde::{Deserialize, Serialize};

mod activations;
mod comm;
mod flops;
mod model_state;
mod parameter_server;
mod stages;
mod structure;

pub use activations::{
    activation_grad_elements, attention_elements, context_exchange_elements, expert_block_elements,
    layer_activation_elements, Cut,
};
pub use comm::wire_bytes;
pub use model_state::{
    activation_bytes, bytes_per_param, model_state, model_state_with_shard, ModelState, OFFLOAD_PIECE_ELEMENTS,
};
pub use stages::plan;
pub use structure::{check_structure, MAX_PLANNED_PARAMS, MAX_PLANNED_STAGES};

/// What the planner predicts for one spec. Byte counts are exact integers (JSON numbers).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct Plan {
    /// All parameters of the model ([`ModelSpec::param_count`](crate::spec::ModelSpec::param_count)).
    pub param_count: u64,
    /// dp x tp x pp.
    pub world_size: u64,
    /// The byte accounting used for model state.
    pub bytes_per_param: BytesPerParam,
    /// Bytes of one activation element (4 in fp32, 2 in bf16/fp16).
    pub activation_bytes: u64,
    /// One entry per pipeline stage, for one rank of that stage.
    pub stages: Vec<StagePlan>,
    /// Index (in `stages`) of the stage whose ranks need the most memory: the peak rank.
    pub peak_stage: usize,
    /// Share of a step a pipeline stage sits idle: (P-1) / (M+P-1) for P stages and M
    /// micro-batches, (P-1) / (vM+P-1) interleaved (0 without pipeline parallelism).
    pub bubble_fraction: f64,
    /// The same idle time relative to the useful compute: (P-1) / M (the GPipe paper's
    /// ratio; interleaved (P-1) / (vM)).
    pub bubble_over_compute: f64,
    pub flops: Flops,
    /// `sync: async_ps`: rank 0, a worker that also keeps the parameter server (the
    /// stage's plan is every other worker's).
    #[serde(default)]
    pub parameter_server: Option<ParameterServerPlan>,
    /// `fault_tolerance: replicas`: what a replacement replica receives to rejoin.
    #[serde(default)]
    pub rejoin: Option<RejoinPlan>,
}

/// A fault-tolerant replacement's rejoin: the state a live replica copies it.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct RejoinPlan {
    /// A 24-byte header (the optimizer's step count, the parts' lengths), then in fp32 the
    /// N parameters, the optimizer's moments (AdamW: m and v, 2N) and mixed precision's
    /// master weights (N): 24 + 4N (1 + 2 + 1) for AdamW in bf16.
    pub state_bytes: u64,
}

/// Bytes of the header that opens a rejoin's state.
pub const REJOIN_HEADER_BYTES: u64 = 24;

/// Rank 0 under asynchronous SGD: its memory and what it sends, the server's included.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct ParameterServerPlan {
    pub memory: RankMemory,
    /// Per round of pushes (each worker one gradient).
    pub comm: CommVolume,
}

/// Bytes each parameter costs, per category of model state.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct BytesPerParam {
    pub parameters: u64,
    pub gradients: u64,
    /// fp32 master weights (mixed precision only) + the optimizer's moments (AdamW: m and v).
    pub optimizer_state: u64,
}

/// One pipeline stage, as seen by any one of its dp x tp ranks.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct StagePlan {
    pub stage: usize,
    /// Index of the stage's first transformer block (interleaved: of its first chunk).
    pub first_layer: usize,
    /// Transformer blocks on this stage (interleaved: in all its chunks).
    pub layers: usize,
    /// Holds the token and position embeddings (the first stage).
    pub embedding: bool,
    /// Holds the final LayerNorm and the LM head (the last stage; in a V, the first).
    pub head: bool,
    /// Parameters of this stage held by one TP rank, before any ZeRO/FSDP sharding.
    pub params_per_rank: u64,
    /// Micro-batches whose activations are held at once (interleaved: chunk passes; see
    /// [`Pipeline::activations_in_flight`](crate::plan::schedule::Pipeline::activations_in_flight)).
    pub in_flight_micro_batches: u64,
    pub memory: RankMemory,
    pub comm: CommVolume,
}

/// Bytes one rank holds, by category (at the peak of a step).
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct RankMemory {
    pub parameters: u64,
    pub gradients: u64,
    pub optimizer_state: u64,
    /// FSDP only: the largest unit (a block, the embeddings, or LayerNorm + LM head)
    /// gathered in full for its forward or backward, on top of the rank's own shard.
    pub gathered_parameters: u64,
    /// Tensors saved by forward for backward, for every micro-batch in flight.
    pub activations: u64,
    /// Backward's activation-gradient buffers (one set, reused by every block).
    pub activation_grads: u64,
    /// Pipeline stages: their receive buffers (input activation, output gradient).
    /// Gradients waiting for a collective: DDP and ZeRO-1 copy every gradient bucket for
    /// the communication thread (one more gradient's worth, when dp > 1); ZeRO-2 and FSDP
    /// hold one unit's gradient until it is reduce-scattered.
    pub comm_buffers: u64,
    /// Measured only (the planner predicts none): buffers that live for one call, the f32
    /// copies 2-byte buffers get for a collective or a matrix product.
    #[serde(default)]
    pub transient: u64,
    /// Measured only (the planner predicts none): what this lab's channels between rank
    /// processes keep on the heap, the rings' staging pieces (the shared-memory pipes are
    /// reported apart). A GPU cluster's NCCL has buffers of its own the planner does not model.
    #[serde(default)]
    pub transport: u64,
    /// Measured only: the host copy of the rank's state its checkpoints are written from.
    #[serde(default)]
    pub checkpoint: u64,
    /// Gradient compression: the error-feedback residual (one fp32 value per gradient
    /// value) and PowerSGD's Q kept for the next step.
    #[serde(default)]
    pub compression_state: u64,
    /// Kept off the device (host memory or disk), not counted in `total`: ZeRO-Offload's
    /// optimizer state, and activation offload's blocks at their peak.
    #[serde(default)]
    pub offloaded: u64,
    /// Every category but `offloaded`: the device memory the rank holds.
    pub total: u64,
}

/// Bytes one rank SENDS per optimizer step, by collective (it receives as much).
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct CommVolume {
    /// DDP gradient all-reduce over the data-parallel group.
    pub dp_all_reduce: u64,
    /// ZeRO / FSDP gradient reduce-scatter over the data-parallel group.
    pub dp_reduce_scatter: u64,
    /// ZeRO parameter all-gather after the update; FSDP's gathers before forward and backward.
    pub dp_all_gather: u64,
    /// Tensor-parallel collectives of activations and their gradients: all-reduces, or with
    /// sequence parallelism all-gathers and reduce-scatters (and the LayerNorm parameter
    /// gradients' all-reduces).
    pub tp_all_reduce: u64,
    /// Pipeline point-to-point sends: activations forward, their gradients backward.
    pub pp_send: u64,
    /// Asynchronous SGD: a worker's push of its gradient (with a 24-byte header) to the
    /// parameter server; on the server's rank, θ (with its 4-byte version) sent back for
    /// every other worker's push.
    #[serde(default)]
    pub ps_push_pull: u64,
    /// DDP's gradients compressed (`parallel.grad_compression`) in place of `dp_all_reduce`:
    /// top-k's and int8's all-gathers, PowerSGD's all-reduces of P and Q.
    #[serde(default)]
    pub dp_compressed: u64,
    /// Expert parallelism's all-to-alls: each block's slots to the experts' ranks and back,
    /// and their gradients.
    #[serde(default)]
    pub ep_all_to_all: u64,
    /// Context parallelism's exchanges: Ulysses' all-to-alls (each block's q, k and v to
    /// head-split and its attention output back to token-split, and their gradients), or
    /// the ring's sends of each block's keys and values and their gradients.
    #[serde(default)]
    pub cp_all_to_all: u64,
    pub total: u64,
}

/// Floating-point operations of one optimizer step, over all ranks.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct Flops {
    /// dp/cp * micro_batch * micro_batches * grad_accum * seq_len (cp: context-parallel ranks share their sequences).
    pub tokens_per_step: u64,
    /// The 6 * params * tokens rule: forward 2, backward 4 per parameter a token uses (with
    /// experts, only its top_k experts').
    pub six_params_tokens: f64,
    /// Attention scores and weighted sums: 12 * layers * seq_len * d_model per token.
    pub attention: f64,
    /// Recomputed forward passes of the blocks when activation checkpointing is on.
    pub recompute: f64,
    pub total: f64,
    /// total / world_size: the average work of one rank.
    pub per_rank: f64,
}

impl Plan {
    /// Each stage's part of the model's training FLOPs per token
    /// ([`flops::stage_flops_per_token`]); one number without pipeline parallelism.
    pub fn stage_flops_per_token(&self, spec: &crate::spec::ExperimentSpec) -> Vec<f64> {
        flops::stage_flops_per_token(spec, &self.stages)
    }

    /// The most activation bytes any one rank holds (the stage with the most).
    pub fn peak_activations(&self) -> u64 {
        self.stages.iter().map(|s| s.memory.activations).max().unwrap_or(0)
    }

    /// Bytes every rank of the run holds together at its peak: each stage's rank times
    /// the dp x tp ranks of that stage.
    pub fn memory_of_all_ranks(&self) -> u64 {
        let per_stage = self.world_size / (self.stages.len().max(1) as u64);
        let server = match (&self.parameter_server, self.stages.first()) {
            (Some(server), Some(worker)) => server.memory.total.saturating_sub(worker.memory.total),
            _ => 0,
        };
        self.stages.iter().map(|s| s.memory.total.saturating_mul(per_stage)).fold(server, u64::saturating_add)
    }

    /// At most the bytes one GPU holds when the ranks take `gpus` GPUs in turn (rank mod
    /// gpus, as the CUDA worker places them): the peak rank's memory times the ranks that
    /// share a GPU.
    pub fn memory_per_gpu(&self, gpus: u64) -> u64 {
        self.peak_rank_memory().total.saturating_mul(self.world_size.div_ceil(gpus.max(1)))
    }

    /// The memory of the rank that needs the most: one of the peak stage's, or the
    /// parameter server's rank when it holds more.
    pub fn peak_rank_memory(&self) -> RankMemory {
        let stage = self.stages.get(self.peak_stage).map(|s| s.memory.clone()).unwrap_or_default();
        match &self.parameter_server {
            Some(server) if server.memory.total > stage.total => server.memory.clone(),
            _ => stage,
        }
    }

    /// The memory the planner predicts for `rank` of `spec` (this plan's): its stage's, or
    /// the parameter server's for data-parallel rank 0 under asynchronous SGD.
    pub fn rank_memory(&self, spec: &crate::ExperimentSpec, rank: usize) -> RankMemory {
        match &self.parameter_server {
            Some(server) if rank == 0 => server.memory.clone(),
            _ => self.stages.get(spec.stage_of(rank)).map(|s| s.memory.clone()).unwrap_or_default(),
        }
    }
}
