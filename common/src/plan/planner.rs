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

use serde::{Deserialize, Serialize};

use crate::plan::compression::{self, Compressor};
use crate::plan::ring::{ring_all_reduce_bytes, ring_reduce_scatter_bytes};
use crate::plan::schedule::{Action, Pipeline};
use crate::spec::field_error::FieldError;
use crate::spec::*;

/// The planner models models up to this many parameters (a thousand times GPT-3).
pub const MAX_PLANNED_PARAMS: f64 = 1e15;
/// An interleaved or ZB-H1 stage's activation peak is found by following its schedule:
/// at most this many passes over all stages.
const MAX_FOLLOWED_PASSES: usize = 1 << 22;

/// The plan lists every pipeline stage, so `pp` is bounded.
pub const MAX_PLANNED_STAGES: usize = 1024;

/// What the planner predicts for one spec. Byte counts are exact integers (JSON numbers).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct Plan {
    /// All parameters of the model ([`ModelSpec::param_count`]).
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
    /// Holds the final LayerNorm and the LM head (the last stage).
    pub head: bool,
    /// Parameters of this stage held by one TP rank, before any ZeRO/FSDP sharding.
    pub params_per_rank: u64,
    /// Micro-batches whose activations are held at once (interleaved: chunk passes; see
    /// [`Pipeline::activations_in_flight`]).
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
    /// ZeRO-Offload: the optimizer state kept off the device (host memory or disk), not
    /// counted in `total`.
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
    /// DDP's gradients compressed (`parallel.grad_compression`) in place of `dp_all_reduce`:
    /// top-k's and int8's all-gathers, PowerSGD's all-reduces of P and Q.
    #[serde(default)]
    pub dp_compressed: u64,
    /// Expert parallelism's all-to-alls: each block's slots to the experts' ranks and back,
    /// and their gradients.
    #[serde(default)]
    pub ep_all_to_all: u64,
    pub total: u64,
}

/// Floating-point operations of one optimizer step, over all ranks.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct Flops {
    /// dp * micro_batch * micro_batches * grad_accum * seq_len.
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

/// The byte accounting of model state for a precision and an optimizer (see the module
/// table): 16 bytes per parameter with AdamW in either precision, split differently.
pub fn bytes_per_param(precision: Precision, optimizer: Optimizer) -> BytesPerParam {
    let mixed = precision != Precision::Fp32;
    let (weight, master) = if mixed { (2, 4) } else { (4, 0) };
    let moments = match optimizer {
        Optimizer::Adamw => 2 * 4, // m and v, fp32
        Optimizer::Sgd => 0,       // no momentum, as in the engine's optim.rs
    };
    BytesPerParam { parameters: weight, gradients: weight, optimizer_state: master + moments }
}

/// Bytes of one activation element: the storage dtype (4 in fp32, 2 in bf16/fp16).
pub fn activation_bytes(precision: Precision) -> u64 {
    match precision {
        Precision::Fp32 => 4,
        Precision::Bf16 | Precision::Fp16 => 2,
    }
}

/// Disk offload streams the optimizer's state through a buffer this many parameters long:
/// the piece being updated is all of it in memory.
pub const OFFLOAD_PIECE_ELEMENTS: usize = 1 << 18;

/// Model state of one rank that holds `params` parameters before sharding, with the
/// data-parallel group of `dp` ranks (values below 1 count as 1). This is the whole
/// accounting for the textbook cases ("7B with Adam = 112 GB per DDP rank"); the
/// spec-based [`plan`] calls it with the parameters of one stage on one TP rank.
///
/// parameters = P * w, gradients = P * w, optimizer = P * o, where the sharded
/// categories use ceil(P / dp) instead of P (zero1: optimizer; zero2: + gradients;
/// fsdp: + parameters).
pub fn model_state(params: u64, sharding: Sharding, precision: Precision, optimizer: Optimizer, dp: u64) -> ModelState {
    model_state_with_shard(params, params.div_ceil(dp.max(1)), sharding, precision, optimizer)
}

/// [`model_state`] with the shard size given: the engine cuts every unit (embeddings, each
/// block, the head) into dp chunks separately, so its largest shard is the sum of each
/// unit's largest chunk, which can exceed ceil(P / dp) by up to one element per unit.
pub fn model_state_with_shard(
    params: u64,
    shard: u64,
    sharding: Sharding,
    precision: Precision,
    optimizer: Optimizer,
) -> ModelState {
    let b = bytes_per_param(precision, optimizer);
    let (p, g, o) = match sharding {
        Sharding::None => (params, params, params),
        Sharding::Zero1 => (params, params, shard),
        Sharding::Zero2 => (params, shard, shard),
        Sharding::Fsdp => (shard, shard, shard),
    };
    ModelState {
        parameters: p.saturating_mul(b.parameters),
        gradients: g.saturating_mul(b.gradients),
        optimizer_state: o.saturating_mul(b.optimizer_state),
    }
}

/// Parameters, gradients and optimizer state of one rank, in bytes.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct ModelState {
    pub parameters: u64,
    pub gradients: u64,
    pub optimizer_state: u64,
}

impl ModelState {
    pub fn total(&self) -> u64 {
        self.parameters.saturating_add(self.gradients).saturating_add(self.optimizer_state)
    }
}

/// Activation elements one transformer block saves for backward, for one micro-batch of
/// `batch` sequences of `seq` tokens (d = d_model, h = heads, t = tp), as the engine
/// stores them (model/gpt.rs `BlockActivations`):
///
/// ```text
///   b*s * (4d + 12d/t + 4)  +  b * (h/t) * s^2        (flash: b * (h/t) * s * 2)
/// ```
///
/// - 4d whole on every TP rank: the outputs of ln1 and ln2, and the residual stream
///   after the attention half and after the MLP half;
/// - 12d split over TP: q, k, v (3d), the attention output before its projection (d),
///   the MLP hidden layer before and after GELU (4d + 4d);
/// - 4 per token: mean and 1/std of the two LayerNorms;
/// - the softmax probabilities, heads x s x s per sequence; with FlashAttention only one
///   log-sum-exp per row and head, kept as a (hi, lo) pair: the s^2 term is gone.
///
/// With sequence parallelism (`sp`) the 4d and the 4 statistics are split over TP too:
/// each rank keeps them for its own b*s/t tokens, b*s * ((4d + 4)/t + 12d/t).
///
/// In 16-bit that is s*b*d*(32 + 8/d + 2*h*s/d) bytes, close to Korthikanti et al.'s
/// s*b*d*(34 + 5*h*s/d), which also keeps dropout masks and the pre-softmax scores
/// (the engine has no dropout and overwrites the scores). This is THE per-layer term:
/// adjust it here when the engine's measured activations say otherwise.
///
/// Other shapes ([`ModelSpec::tp_split_activation_width`]): grouped-query attention keeps
/// narrower K and V, a wider or SwiGLU MLP more hidden values, RMSNorm one statistic.
pub fn layer_activation_elements(m: &ModelSpec, batch: u64, tp: u64, attention: Attention, sp: bool) -> u64 {
    let (seq, d, heads) = (m.seq_len as u64, m.d_model as u64, m.heads as u64);
    let tp = tp.max(1);
    let rows = batch.saturating_mul(seq);
    let whole = rows.saturating_mul(d.saturating_mul(4).saturating_add(m.norm_statistics()));
    let whole = if sp { whole / tp } else { whole };
    let split = rows.saturating_mul(m.tp_split_activation_width() / tp);
    whole.saturating_add(split).saturating_add(attention_elements(batch, seq, heads / tp, attention))
}

/// What attention keeps for one micro-batch (and the size of its gradient scratch): the
/// (s, s) probabilities per sequence and head, or (flash) a log-sum-exp pair per row.
pub fn attention_elements(batch: u64, seq: u64, heads: u64, attention: Attention) -> u64 {
    let per_head = match attention {
        Attention::Naive => seq.saturating_mul(seq),
        Attention::Flash => seq.saturating_mul(2),
    };
    batch.saturating_mul(heads).saturating_mul(per_head)
}

/// Elements of backward's activation-gradient buffers (model/gpt.rs `GradScratch`): the
/// residual and LayerNorm gradients (2d, whole), the attention output, QKV and MLP hidden
/// gradients (d + 3d + 4d, split over TP) and the attention probabilities' gradient:
/// b*s*(2d + 8d/t) + b*(h/t)*s^2 (flash: a pair per row, rowsum(dO ∘ O), in place of s^2).
/// With sequence parallelism (`sp`) the residual's gradient is this rank's b*s/t tokens
/// only, and the LayerNorm parameters' gradients of a block (4d) are made in scratch
/// before they are summed over the group.
pub fn activation_grad_elements(m: &ModelSpec, batch: u64, tp: u64, attention: Attention, sp: bool) -> u64 {
    let (seq, d, heads) = (m.seq_len as u64, m.d_model as u64, m.heads as u64);
    let tp = tp.max(1);
    let rows = batch.saturating_mul(seq);
    let split = rows.saturating_mul(m.tp_split_gradient_width() / tp);
    let whole = match sp {
        false => rows.saturating_mul(d.saturating_mul(2)),
        true => (rows.saturating_mul(d) / tp).saturating_add(rows.saturating_mul(d)).saturating_add(4 * d),
    };
    whole.saturating_add(split).saturating_add(attention_elements(batch, seq, heads / tp, attention))
}

/// A Mixture-of-Experts block (tp = 1) on one of `ep` expert-parallel ranks, for one
/// micro-batch of `rows` tokens: the activations it keeps and the backward scratch, from a
/// dense block's (`dense_layer`, `dense_grads`), as the engine allocates them
/// (model/experts.rs): the MLP's hidden layers (4d before and after GELU) now for each of
/// the E x C slots instead of each token; the router's probabilities (rows x E), each
/// slot's gate, the slots' inputs and outputs (slots x d each, twice with ep > 1: before and
/// after each all-to-all). Scratch: the hidden gradient for max(rows, slots) rows, the
/// slots' gradients (slots x d, twice with ep > 1), the router logits' gradient (rows x E)
/// and its share of the LayerNorm output gradient (rows x d).
pub fn expert_block_elements(m: &ModelSpec, rows: u64, ep: u64, dense_layer: u64, dense_grads: u64) -> (u64, u64) {
    let (d, e) = (m.d_model as u64, m.experts as u64);
    let slots = e.saturating_mul(m.expert_capacity(rows as usize) as u64);
    let exchanged = if ep > 1 { 2 } else { 1 };
    let (kept, made) = m.mlp_activation_widths();
    let slot_rows = |n: u64| slots.saturating_mul(n);
    let layer = [rows.saturating_mul(e), slots, slot_rows(d).saturating_mul(2 * exchanged), slot_rows(kept)]
        .into_iter()
        .fold(dense_layer.saturating_sub(rows.saturating_mul(kept)), u64::saturating_add);
    let grads = [
        rows.max(slots).saturating_mul(made),
        slot_rows(d).saturating_mul(exchanged),
        rows.saturating_mul(e),
        rows.saturating_mul(d),
    ]
    .into_iter()
    .fold(dense_grads.saturating_sub(rows.saturating_mul(made)), u64::saturating_add);
    (layer, grads)
}

/// Checks that `spec` describes a model and a mesh that can exist at all: positive
/// sizes, whole heads per TP rank, at least one block per pipeline stage. Run limits
/// (world size, parameters, steps) are NOT checked: see [`ExperimentSpec::validate`].
pub fn check_structure(spec: &ExperimentSpec) -> Result<(), Vec<FieldError>> {
    let mut errs = Vec::new();
    let mut err = |field: &str, message: String| errs.push(FieldError::new(field, message));
    let (m, p, t) = (&spec.model, &spec.parallel, &spec.train);
    for (field, value) in [
        ("model.layers", m.layers),
        ("model.d_model", m.d_model),
        ("model.heads", m.heads),
        ("model.seq_len", m.seq_len),
        ("model.vocab", m.vocab),
        ("parallel.dp", p.dp),
        ("parallel.tp", p.tp),
        ("parallel.pp", p.pp),
        ("train.micro_batch", t.micro_batch),
        ("train.micro_batches", t.micro_batches),
        ("train.grad_accum", t.grad_accum),
    ] {
        if value == 0 {
            let name = field.rsplit('.').next().unwrap_or(field);
            err(field, format!("{name} must be at least 1 (it is 0)"));
        }
    }
    if m.heads >= 1 && m.d_model % m.heads != 0 {
        err(
            "model.heads",
            format!("heads={} does not divide d_model={}: every head needs the same width", m.heads, m.d_model),
        );
    }
    if p.tp >= 1 && m.heads >= 1 && m.heads % p.tp != 0 {
        err(
            "parallel.tp",
            format!("tp={} does not divide heads={}: each tensor-parallel rank takes whole heads", p.tp, m.heads),
        );
    }
    let kv_heads = m.key_value_heads();
    if m.heads >= 1 && (kv_heads > m.heads || m.heads % kv_heads != 0) {
        err(
            "model.kv_heads",
            format!(
                "kv_heads={kv_heads} does not divide heads={}: each K/V head serves a whole group of query heads",
                m.heads
            ),
        );
    } else if p.tp >= 1 && m.heads >= 1 && m.heads % p.tp == 0 && kv_heads % p.tp != 0 {
        err(
            "parallel.tp",
            format!("tp={} does not divide kv_heads={kv_heads}: each tensor-parallel rank takes whole K/V heads", p.tp),
        );
    }
    if p.tp >= 1 && m.d_ff() % p.tp != 0 {
        err("parallel.tp", format!("tp={} does not divide the MLP width {}", p.tp, m.d_ff()));
    }
    if p.pp >= 1 && m.layers >= 1 && p.pp > m.layers {
        err(
            "parallel.pp",
            format!("pp={} is more than layers={}: every pipeline stage needs at least one layer", p.pp, m.layers),
        );
    } else if p.pp > MAX_PLANNED_STAGES {
        err(
            "parallel.pp",
            format!("pp={}: the planner lists every stage and handles at most {MAX_PLANNED_STAGES}", p.pp),
        );
    } else {
        spec.check_pipeline_schedule(&mut err);
        spec.check_experts(&mut err);
        // Interleaved and ZB-H1 peaks are found by following every stage's passes.
        let passes = spec.pipeline_micro_batches().saturating_mul(p.virtual_stages.max(1)).saturating_mul(p.pp);
        if matches!(p.pp_schedule, PpSchedule::Interleaved | PpSchedule::ZbH1) && passes > MAX_FOLLOWED_PASSES {
            err(
                "train.micro_batches",
                format!(
                    "pp x virtual_stages x micro_batches x grad_accum = {passes}: the planner follows an {} \
                     schedule pass by pass and handles at most {MAX_FOLLOWED_PASSES}",
                    p.pp_schedule.as_str()
                ),
            );
        }
    }
    // Estimated in f64 first, so that param_count (u64) is only called when it cannot overflow.
    let (v, s, d, l) = (m.vocab as f64, m.seq_len as f64, m.d_model as f64, m.layers as f64);
    let (ff, copies) = (m.d_ff() as f64, m.experts.max(1) as f64);
    let matrices = if m.family.is_gpt2() { 2.0 } else { 3.0 };
    let estimate = 2.0 * v * d + s * d + l * (4.0 * d * d + 13.0 * d + copies * (matrices * d * ff + ff)) + 2.0 * d;
    if estimate > MAX_PLANNED_PARAMS {
        err("model", format!("this model has about {estimate:.3e} parameters; the planner handles at most 1e15"));
    }
    if errs.is_empty() {
        Ok(())
    } else {
        Err(errs)
    }
}

impl Plan {
    /// The most activation bytes any one rank holds (the stage with the most).
    pub fn peak_activations(&self) -> u64 {
        self.stages.iter().map(|s| s.memory.activations).max().unwrap_or(0)
    }

    /// Bytes every rank of the run holds together at its peak: each stage's rank times
    /// the dp x tp ranks of that stage.
    pub fn memory_of_all_ranks(&self) -> u64 {
        let per_stage = self.world_size / (self.stages.len().max(1) as u64);
        self.stages.iter().map(|s| s.memory.total.saturating_mul(per_stage)).fold(0, u64::saturating_add)
    }

    /// At most the bytes one GPU holds when the ranks take `gpus` GPUs in turn (rank mod
    /// gpus, as the CUDA worker places them): the peak rank's memory times the ranks that
    /// share a GPU.
    pub fn memory_per_gpu(&self, gpus: u64) -> u64 {
        let peak_rank = self.stages.get(self.peak_stage).map_or(0, |s| s.memory.total);
        peak_rank.saturating_mul(self.world_size.div_ceil(gpus.max(1)))
    }
}

/// The most parameters two units opened one after the other hold: a block and the
/// embeddings, two blocks, or a block and the head (`units`: (block size, blocks),
/// (embeddings, 1), (head, 1), zero where the stage has none).
fn largest_adjacent_pair(units: &[(u64, u64); 3]) -> u64 {
    let [(block, blocks), (embedding, _), (head, _)] = *units;
    let two_blocks = if blocks >= 2 { block.saturating_mul(2) } else { block };
    two_blocks.max(block.saturating_add(embedding)).max(block.saturating_add(head))
}

/// Plans `spec`: every structural problem at once as field errors (422), else the plan.
pub fn plan(spec: &ExperimentSpec) -> Result<Plan, Vec<FieldError>> {
    check_structure(spec)?;
    let (m, p, t) = (&spec.model, &spec.parallel, &spec.train);
    let u = |x: usize| x as u64;
    let (d, seq, vocab) = (u(m.d_model), u(m.seq_len), u(m.vocab));
    let (dp, tp, pp) = (u(p.dp), u(p.tp), u(p.pp));
    let (batch, micro_batches) = (u(t.micro_batch), u(t.micro_batches));
    let micro_steps = micro_batches.saturating_mul(u(t.grad_accum));

    let param_count = m.param_count();
    let per_param = bytes_per_param(t.precision, t.optimizer);
    let act_bytes = activation_bytes(t.precision);

    // The model's parts as the engine lays them out (ParamLayout): they add up to param_count.
    // A tied LM head split from its embedding by a pipeline is a second copy on the last
    // stage (Megatron's: the two copies' gradients are summed between the stages).
    let embedding = m.embedding_params();
    let head = m.head_params() + if m.tie_embeddings && pp > 1 { d * vocab } else { 0 };
    let ep = u(p.ep.max(1));
    // With experts (tp = 1) a rank of an expert-parallel group holds E/ep of each block's.
    let experts_per_block = u(m.experts) / ep * m.mlp_params();
    let block = m.block_params() - (u(m.experts) - u(m.experts) / ep) * m.mlp_params();
    // Split by TP: GPT-2's QKV (3d^2 + 3d), attention projection weight (d^2), MLP (4d^2 + 4d, 4d^2).
    let block_split = m.tp_split_block_params();
    let block_per_tp_rank = block_split / tp + (block - block_split);

    let rows = batch.saturating_mul(seq);
    let rows_d = rows.saturating_mul(d);
    let sp = p.splits_sequence();
    let layer_acts = layer_activation_elements(m, batch, tp, t.attention, sp);
    let grad_acts = activation_grad_elements(m, batch, tp, t.attention, sp);
    let (layer_acts, grad_acts) = match m.is_moe() {
        true => expert_block_elements(m, rows, ep, layer_acts, grad_acts),
        false => (layer_acts, grad_acts),
    };
    // ZB-H1 (no sequence parallelism): the gradients of a block's matmul outputs (attention
    // projection, MLP out: b*s*d each; QKV and the MLP's hidden gradients, split over TP:
    // GPT-2 3d + 4d, Llama's gate and up 2f).
    let weight_stash_elements =
        rows.saturating_mul(d.saturating_mul(2) + (m.qkv_width() + m.mlp_activation_widths().1) / tp);
    // The residual stream between blocks (a stage's input and output, checkpointed segment
    // outputs): whole on every TP rank, or with sequence parallelism this rank's tokens.
    let res_d = if sp { rows_d / tp } else { rows_d };
    let recomputing = t.checkpointing != Checkpointing::None;

    // M is every micro-batch of the step (accumulated ones too): one schedule runs them.
    let pipe = Pipeline::of(spec);
    let mut stages = Vec::with_capacity(p.pp);
    for s in 0..p.pp {
        let chunks = pipe.blocks_of(m.layers, s);
        let layers = chunks.iter().map(|c| u(c.len())).sum::<u64>();
        let (first, last) = (s == 0, s + 1 == p.pp);
        let params_per_rank =
            layers * block_per_tp_rank + if first { embedding } else { 0 } + if last { head } else { 0 };
        let in_flight = u(pipe.activations_in_flight(s));

        // Model state, sharded unit by unit as the engine does (see model_state_with_shard).
        let units = [
            (if layers > 0 { block_per_tp_rank } else { 0 }, layers),
            (if first { embedding } else { 0 }, 1),
            (if last { head } else { 0 }, 1),
        ];
        let shard =
            units.iter().map(|&(n, count)| n.div_ceil(dp).saturating_mul(count)).fold(0u64, u64::saturating_add);
        let state = model_state_with_shard(params_per_rank, shard, p.sharding, t.precision, t.optimizer);
        // FSDP gathers one whole unit at a time (even alone: the gather is then a copy);
        // with prefetch the next unit's gather is under way too: two units in the order
        // they are opened (embeddings, blocks, head, and back).
        let largest_unit = units.iter().map(|&(n, _)| n).max().unwrap_or(0);
        let gathered_units = if p.prefetch { largest_adjacent_pair(&units) } else { largest_unit };
        let gathered =
            if p.sharding == Sharding::Fsdp { gathered_units.saturating_mul(per_param.parameters) } else { 0 };
        // What waits for a collective: DDP and ZeRO-1 copy every gradient bucket (the whole
        // gradient, when there is a group to reduce with; the buckets are fp32 in every
        // precision, as gradients are summed across ranks in fp32); ZeRO-2 and FSDP hold one
        // unit's gradient until it is reduce-scattered.
        // (with expert parallelism the experts' gradients are summed apart, in place)
        let experts_here = if ep > 1 { layers.saturating_mul(experts_per_block) } else { 0 };
        let comm_buffers = match p.sharding {
            Sharding::None | Sharding::Zero1 if dp > 1 => (params_per_rank - experts_here).saturating_mul(4),
            Sharding::None | Sharding::Zero1 => 0,
            Sharding::Zero2 | Sharding::Fsdp => largest_unit.saturating_mul(per_param.gradients),
        };
        // A pipeline stage receives into one activation buffer (all but the first) and one
        // output-gradient buffer (all but the last; interleaved: every stage both). Copies
        // queued for sending come on top, as many as the schedule runs ahead of the
        // neighbour: not predicted.
        let (gets_activations, gets_gradients) = pipe.receives(s);
        let receive_buffers = u64::from(gets_activations) + u64::from(gets_gradients);
        let comm_buffers = comm_buffers.saturating_add(receive_buffers.saturating_mul(res_d).saturating_mul(act_bytes));

        // Activations (elements). Every stage keeps its input per micro-batch (the first
        // stage: the embedding output; the others: what the previous stage sent); the last
        // stage also the final LayerNorm output and statistics, logits and token losses.
        // With sequence parallelism the final LayerNorm's statistics are this rank's tokens
        // only, its output gathered whole for the LM head.
        // Each of the stage's chunks keeps its own (interleaved: one set per chunk and
        // micro-batch, the head's only on the model's last chunk); the peak is the most
        // the schedule's order holds at once.
        let lnf_stats = if sp { rows.saturating_mul(2) / tp } else { rows.saturating_mul(2) };
        let head_acts =
            rows_d.saturating_add(lnf_stats).saturating_add(rows).saturating_add(rows.saturating_mul(vocab));
        let per_chunk: Vec<u64> = (0..chunks.len())
            .map(|c| {
                let (kept_layers, _) = checkpointed(u(chunks[c].len()), t.checkpointing, res_d, layer_acts);
                let is_head = pipe.model_chunk(s, c) + 1 == pipe.model_chunks();
                res_d.saturating_add(kept_layers).saturating_add(if is_head { head_acts } else { 0 })
            })
            .collect();
        let recompute_peak =
            chunks.iter().map(|c| checkpointed(u(c.len()), t.checkpointing, res_d, layer_acts).1).max().unwrap_or(0);
        // ZB-H1's B leaves each block's four output gradients for the W (the weight
        // gradients' other operands are activations the W keeps anyway).
        let stash = if pipe.splits_backward() { layers.saturating_mul(weight_stash_elements) } else { 0 };
        let held_at_peak = match pipe.kind {
            // (the sets are alike: no need to follow the order pass by pass)
            PpSchedule::Gpipe | PpSchedule::OneFOneB => in_flight.saturating_mul(per_chunk[0]),
            PpSchedule::Interleaved | PpSchedule::ZbH1 => peak_held(&pipe.actions(s), &per_chunk, stash),
        };
        // Sequence parallelism's two exchange buffers (b*s*d each, shared by every block):
        // a LayerNorm output gathered whole, a row-parallel output before its reduce-scatter.
        let exchange = if sp { rows_d.saturating_mul(2) } else { 0 };
        let activations = held_at_peak.saturating_add(recompute_peak).saturating_add(exchange);

        // ZeRO-Offload: the optimizer's state leaves the device. Streamed from disk, one
        // piece of it at a time is in memory while it is updated.
        let optimizer_elements = if p.sharding == Sharding::None { params_per_rank } else { shard };
        let (optimizer_state, offloaded) = match p.offload {
            Offload::None => (state.optimizer_state, 0),
            Offload::Host => (0, state.optimizer_state),
            // (on a GPU the piece is host memory: not the device's)
            Offload::Disk if spec.backend == BackendKind::Cuda => (0, state.optimizer_state),
            Offload::Disk => (
                optimizer_elements.min(OFFLOAD_PIECE_ELEMENTS as u64).saturating_mul(per_param.optimizer_state),
                state.optimizer_state,
            ),
        };
        // Gradient compression: its residual and PowerSGD's Q, fp32 (DDP only, dp > 1).
        let compressor =
            Compressor { method: p.grad_compression, ratio: p.compression_ratio, rank: p.compression_rank };
        let shapes = compression::stage_shapes(m, p.tp, layers as usize, first, last);
        let compressing = dp > 1 && p.grad_compression != GradCompression::None;
        let compression_state = if compressing { compressor.state_floats(&shapes) as u64 * 4 } else { 0 };
        let mut memory = RankMemory {
            parameters: state.parameters,
            gradients: state.gradients,
            optimizer_state,
            gathered_parameters: gathered,
            activations: activations.saturating_mul(act_bytes),
            // (with sequence parallelism the last stage's final LayerNorm gradients too, 2d)
            activation_grads: grad_acts.saturating_add(if sp && last { 2 * d } else { 0 }).saturating_mul(act_bytes),
            comm_buffers,
            transient: 0,
            transport: 0,
            checkpoint: 0,
            compression_state,
            offloaded,
            total: 0,
        };
        memory.total = [
            memory.compression_state,
            memory.parameters,
            memory.gradients,
            memory.optimizer_state,
            memory.gathered_parameters,
            memory.activations,
            memory.activation_grads,
            memory.comm_buffers,
        ]
        .into_iter()
        .fold(0u64, u64::saturating_add);

        let comm = stage_comm(StageCommInput {
            params_per_rank,
            embedding: if first { embedding } else { 0 },
            layers,
            first,
            last,
            sharding: p.sharding,
            dp,
            tp,
            micro_steps,
            rows_d,
            res_d,
            d,
            sp,
            recomputing,
            regathered: chunks
                .iter()
                .map(|c| recomputed_before_backward(u(c.len()), t.checkpointing))
                .sum::<u64>()
                .saturating_mul(block_per_tp_rank),
            chunks: u(pipe.chunks),
            dp_wire_bytes: wire_bytes(p.comm_dtype),
            allreduce: p.allreduce,
            ranks_per_node: p.ranks_per_node,
            compressed: compressing.then(|| compressor.bytes_sent(&shapes, p.dp)),
            experts: (ep > 1).then(|| ExpertComm {
                params: experts_here,
                ep,
                slots_d: u(m.experts).saturating_mul(u(m.expert_capacity(rows as usize))).saturating_mul(d),
            }),
        });
        stages.push(StagePlan {
            stage: s,
            first_layer: chunks.first().map_or(0, |c| c.start),
            layers: layers as usize,
            embedding: first,
            head: last,
            params_per_rank,
            in_flight_micro_batches: in_flight,
            memory,
            comm,
        });
    }
    let peak_stage =
        stages.iter().enumerate().max_by_key(|(i, st)| (st.memory.total, usize::MAX - i)).map_or(0, |x| x.0);

    let world_size = dp.saturating_mul(tp).saturating_mul(pp);
    let flops = step_flops(spec, world_size);
    Ok(Plan {
        param_count,
        world_size,
        bytes_per_param: per_param,
        activation_bytes: act_bytes,
        stages,
        peak_stage,
        bubble_fraction: pipe.formula_bubble(),
        // idle / busy = bubble / (1 - bubble): (P-1)/M, (P-1)/(vM), (P-1)/(3M).
        bubble_over_compute: pipe.formula_bubble() / (1.0 - pipe.formula_bubble()),
        flops,
    })
}

/// With activation checkpointing, forward keeps only some blocks' outputs (b*s*d each)
/// and backward recomputes one segment at a time, holding that segment's full
/// activations (for one micro-batch). Returns (elements kept per micro-batch, peak of
/// the segment being recomputed) for a stage of `layers` blocks:
///
/// - none:  every block's activations,               no recompute;
/// - every: each block's output,                     one block recomputed at a time;
/// - sqrt:  every k-th output with k = ceil(sqrt(L)), k blocks recomputed at a time.
fn checkpointed(layers: u64, checkpointing: Checkpointing, rows_d: u64, layer_acts: u64) -> (u64, u64) {
    match checkpointing {
        Checkpointing::None => (layers.saturating_mul(layer_acts), 0),
        Checkpointing::Every => (layers.saturating_mul(rows_d), layer_acts),
        Checkpointing::Sqrt => {
            let k = ceil_sqrt(layers).max(1);
            (layers.div_ceil(k).saturating_mul(rows_d), k.saturating_mul(layer_acts))
        }
    }
}

/// The most elements a stage holds at once running `actions`, when a forward of its chunk
/// c keeps `per_chunk[c]` until the backward of the same pass (ZB-H1: until its W) and a
/// ZB-H1 B keeps `stash` more until its W.
fn peak_held(actions: &[Action], per_chunk: &[u64], stash: u64) -> u64 {
    let split = actions.iter().any(|a| matches!(a, Action::Weights { .. }));
    let (mut held, mut peak) = (0u64, 0u64);
    for a in actions {
        let size = per_chunk.get(a.chunk()).copied().unwrap_or(0);
        match a {
            Action::Forward { .. } => held = held.saturating_add(size),
            Action::Backward { .. } if split => held = held.saturating_add(stash),
            Action::Backward { .. } => held = held.saturating_sub(size),
            Action::Weights { .. } => held = held.saturating_sub(size.saturating_add(stash)),
        }
        peak = peak.max(held);
    }
    peak
}

/// Blocks whose recomputation runs before their own backward, with their parameters
/// opened just for it: all but the last block of each segment (the last one recomputes
/// inside its backward). With FSDP each costs one more all-gather per micro-batch.
fn recomputed_before_backward(layers: u64, checkpointing: Checkpointing) -> u64 {
    match checkpointing {
        Checkpointing::None | Checkpointing::Every => 0,
        Checkpointing::Sqrt => layers - layers.div_ceil(ceil_sqrt(layers).max(1)),
    }
}

fn ceil_sqrt(n: u64) -> u64 {
    let r = n.isqrt();
    if r * r < n {
        r + 1
    } else {
        r
    }
}

/// Bytes per element on the wire: the engine's collectives carry f32, the data-parallel
/// ones `parallel.comm_dtype` (2 bytes for bf16/fp16).
const WIRE_BYTES: u64 = 4;

pub fn wire_bytes(format: Precision) -> u64 {
    match format {
        Precision::Fp32 => 4,
        Precision::Bf16 | Precision::Fp16 => 2,
    }
}

struct StageCommInput {
    params_per_rank: u64,
    /// Embedding parameters on this stage (the first), which backward gathers no more.
    embedding: u64,
    layers: u64,
    first: bool,
    last: bool,
    sharding: Sharding,
    dp: u64,
    tp: u64,
    /// micro_batches * grad_accum: forward + backward passes per optimizer step.
    micro_steps: u64,
    /// Elements of one activation tensor between blocks: micro_batch * seq_len * d_model.
    rows_d: u64,
    /// Of it, what a TP rank holds of the residual stream (rows_d / tp with sequence parallelism).
    res_d: u64,
    d: u64,
    /// Sequence parallelism.
    sp: bool,
    recomputing: bool,
    /// FSDP: parameters gathered once more per micro-batch, for blocks recomputed before
    /// their own backward opens them (see [`recomputed_before_backward`]).
    regathered: u64,
    /// Chunks of layers on the stage (v: interleaved; else 1).
    chunks: u64,
    /// Bytes per element of the data-parallel collectives (`parallel.comm_dtype`).
    dp_wire_bytes: u64,
    /// The gradient all-reduce's algorithm and `hierarchical`'s node size.
    allreduce: AllReduce,
    ranks_per_node: usize,
    /// With gradient compression: the bytes its messages take, in place of the all-reduce.
    compressed: Option<u64>,
    /// Expert parallelism.
    experts: Option<ExpertComm>,
}

/// What expert parallelism moves on one rank of a stage.
struct ExpertComm {
    /// The stage's expert parameters on this rank (summed over its dp/ep replicas only).
    params: u64,
    ep: u64,
    /// Elements of a micro-batch's slots in one block, E x C x d: what each all-to-all
    /// exchanges.
    slots_d: u64,
}

/// Bytes one rank of a stage sends per optimizer step (N = params_per_rank, W = dp,
/// n = micro_batches * grad_accum, A = one b*s*d activation tensor, all ring collectives):
///
/// - none (DDP): one gradient all-reduce per step (accumulation runs without sync):
///   2(W-1)/W * N * grad bytes round the ring; with `allreduce` naive, tree or hierarchical
///   the busiest rank's bytes (`all_reduce.rs`: rank 0's (W-1) * N for naive); with
///   `grad_compression` its messages instead (`compression.rs`);
/// - zero1: DDP's gradient all-reduce (2(W-1)/W * N; every rank keeps the full gradient),
///   then each rank updates its shard and the ranks all-gather the parameters:
///   (W-1)/W * N;
/// - zero2: only a gradient shard is kept, so every micro-batch's gradients are
///   reduce-scattered as they are made: n * (W-1)/W * N, plus the parameter all-gather;
/// - fsdp: every micro-batch gathers the parameters before forward and again before
///   backward (except the embeddings, whose gradient needs no parameters) and
///   reduce-scatters the gradients: n * (W-1)/W * (3N - E); nothing after the update
///   (parameters stay sharded); sqrt checkpointing gathers the blocks it recomputes
///   ahead of their backward once more;
/// - TP: per block and micro-batch, 2 all-reduces of A forward (after the attention and
///   MLP row-parallel layers) and 2 backward (the gradients of their inputs), plus 2 more
///   when checkpointing recomputes the forward: 2(T-1)/T * A each;
/// - TP with sequence parallelism: all-gathers and reduce-scatters of A, (T-1)/T * A each:
///   per block and micro-batch 2 + 2 forward (the LayerNorm outputs gathered, the
///   row-parallel outputs reduce-scattered), 6 backward (the output gradients gathered, the
///   LayerNorm outputs gathered again for the weight gradients, the LayerNorm output
///   gradients reduce-scattered), 4 more when checkpointing recomputes the forward, and an
///   all-reduce of the block's LayerNorm parameter gradients (4d); the last stage gathers
///   the final LayerNorm's output (and all-reduces its 2d parameter gradients), the first
///   gathers the embedding output's gradient;
/// - PP: per micro-batch, A forward to the next stage (all but the last) and its gradient
///   back to the previous one (all but the first); with sequence parallelism A / T.
///
/// By default everything crosses the wire in fp32, in every precision: bf16/fp16 gradients
/// are summed across ranks in fp32 (Megatron-LM does the same for bf16), and parameters
/// and activations are widened (exactly) for the ring. With `comm_dtype` bf16/fp16 the
/// data-parallel collectives (gradients, ZeRO/FSDP's parameters) carry 2 bytes per
/// element, half the DP bytes below; TP and PP stay fp32.
///
/// Not counted: the engine's one-float all-reduces of the step's loss (and, when sharded,
/// of the squared gradient norm).
fn stage_comm(c: StageCommInput) -> CommVolume {
    let mut v = match &c.experts {
        None => dp_and_tp_comm(&c),
        Some(e) => {
            // The shared tensors over the data-parallel group, the experts over their replicas.
            let shared = StageCommInput { params_per_rank: c.params_per_rank - e.params, experts: None, ..c };
            let mut v = dp_and_tp_comm(&shared);
            let replicas = c.dp / e.ep;
            v.dp_all_reduce =
                v.dp_all_reduce.saturating_add(ring_all_reduce_bytes(e.params, replicas, c.dp_wire_bytes));
            // Four all-to-alls per block and micro-batch (the slots there and back, their
            // gradients there and back), two more for a recomputed forward.
            let per_block = if c.recomputing { 6 } else { 4 };
            let one = ring_reduce_scatter_bytes(e.slots_d, e.ep, WIRE_BYTES);
            v.ep_all_to_all = one.saturating_mul(per_block).saturating_mul(c.layers).saturating_mul(c.micro_steps);
            v
        }
    };
    v.total = [v.dp_all_reduce, v.dp_reduce_scatter, v.dp_all_gather, v.tp_all_reduce, v.pp_send, v.dp_compressed]
        .into_iter()
        .chain([v.ep_all_to_all])
        .fold(0u64, u64::saturating_add);
    v
}

/// [`stage_comm`] without expert parallelism.
fn dp_and_tp_comm(c: &StageCommInput) -> CommVolume {
    let (g, w) = (c.dp_wire_bytes, c.dp_wire_bytes);
    let grads_rs = ring_reduce_scatter_bytes(c.params_per_rank, c.dp, g);
    let params_ag = ring_reduce_scatter_bytes(c.params_per_rank, c.dp, w);
    let mut v = CommVolume::default();
    // The ring sends as much from every rank; the others are counted at their busiest rank.
    let all_reduce = match c.allreduce {
        AllReduce::Ring => ring_all_reduce_bytes(c.params_per_rank, c.dp, g),
        other => {
            let (n, w) = (c.params_per_rank as usize, c.dp as usize);
            (crate::plan::all_reduce::busiest_elements_sent(other, n, w, c.ranks_per_node) as u64).saturating_mul(g)
        }
    };
    match c.sharding {
        Sharding::None => match c.compressed {
            Some(bytes) => v.dp_compressed = bytes,
            None => v.dp_all_reduce = all_reduce,
        },
        Sharding::Zero1 => {
            v.dp_all_reduce = all_reduce;
            v.dp_all_gather = params_ag;
        }
        Sharding::Zero2 => {
            v.dp_reduce_scatter = c.micro_steps.saturating_mul(grads_rs);
            v.dp_all_gather = params_ag;
        }
        Sharding::Fsdp => {
            v.dp_reduce_scatter = c.micro_steps.saturating_mul(grads_rs);
            let backward_ag = ring_reduce_scatter_bytes(c.params_per_rank - c.embedding, c.dp, w);
            let recompute_ag = ring_reduce_scatter_bytes(c.regathered, c.dp, w);
            v.dp_all_gather =
                c.micro_steps.saturating_mul(params_ag.saturating_add(backward_ag).saturating_add(recompute_ag));
        }
    }
    let half = ring_reduce_scatter_bytes(c.rows_d, c.tp, WIRE_BYTES);
    let per_micro_batch = if c.sp {
        let halves_per_block = if c.recomputing { 14 } else { 10 };
        let block =
            half.saturating_mul(halves_per_block).saturating_add(ring_all_reduce_bytes(4 * c.d, c.tp, WIRE_BYTES));
        let head = if c.last { half.saturating_add(ring_all_reduce_bytes(2 * c.d, c.tp, WIRE_BYTES)) } else { 0 };
        let embeddings = if c.first { half } else { 0 };
        block.saturating_mul(c.layers).saturating_add(head).saturating_add(embeddings)
    } else {
        let all_reduces_per_block = if c.recomputing { 6 } else { 4 };
        half.saturating_mul(2 * all_reduces_per_block).saturating_mul(c.layers)
    };
    v.tp_all_reduce = if c.tp > 1 { per_micro_batch.saturating_mul(c.micro_steps) } else { 0 };
    // Every chunk of the stage sends on but the model's last; every chunk's backward sends
    // back but the model's first.
    let sends = (c.chunks - u64::from(c.last)) + (c.chunks - u64::from(c.first));
    v.pp_send = c.res_d.saturating_mul(WIRE_BYTES).saturating_mul(sends).saturating_mul(c.micro_steps);
    v
}

/// FLOPs of one optimizer step over all ranks, T = tokens per step:
/// 6 * (active) params * T (matmuls: forward 2, backward 4) + 12 * layers * seq_len * d_model * T
/// (attention, [`ModelSpec::train_flops_per_token`]) + with checkpointing one more
/// forward of every block: (2 * layers * block_params + 4 * layers * seq_len * d_model) * T.
fn step_flops(spec: &ExperimentSpec, world_size: u64) -> Flops {
    let (m, t) = (&spec.model, &spec.train);
    let tokens = [spec.parallel.dp, t.micro_batch, t.micro_batches, t.grad_accum, m.seq_len]
        .into_iter()
        .fold(1u64, |acc, x| acc.saturating_mul(x as u64));
    let tf = tokens as f64;
    // (a token's forward uses only its experts' parameters: 6 x the active ones)
    let six_params_tokens = 6.0 * m.active_param_count() as f64 * tf;
    let training = m.train_flops_per_token() * tf;
    let (l, s, d) = (m.layers as f64, m.seq_len as f64, m.d_model as f64);
    let recompute = match t.checkpointing {
        Checkpointing::None => 0.0,
        Checkpointing::Every | Checkpointing::Sqrt => (2.0 * l * m.active_block_params() as f64 + 4.0 * l * s * d) * tf,
    };
    let total = training + recompute;
    Flops {
        tokens_per_step: tokens,
        six_params_tokens,
        attention: training - six_params_tokens,
        recompute,
        total,
        per_rank: total / world_size.max(1) as f64,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::spec::validate::Limits;

    /// The seed texts count in decimal gigabytes: "7B x 16 bytes = 112 GB" is
    /// 7e9 * 16 = 112e9 bytes (it would be 104.3 GiB). The planner reports bytes; the
    /// worked numbers below are checked in GB = 1e9 bytes, the only unit that
    /// reproduces them.
    const GB: f64 = 1e9;

    fn gb(bytes: u64) -> f64 {
        bytes as f64 / GB
    }

    fn with_model(model: ModelSpec) -> ExperimentSpec {
        ExperimentSpec { model, ..ExperimentSpec::default() }
    }

    fn adam_mixed(params: u64, sharding: Sharding, dp: u64) -> ModelState {
        model_state(params, sharding, Precision::Bf16, Optimizer::Adamw, dp)
    }

    #[test]
    fn sixteen_bytes_per_param_with_adam_in_either_precision() {
        assert_eq!(
            bytes_per_param(Precision::Bf16, Optimizer::Adamw),
            BytesPerParam { parameters: 2, gradients: 2, optimizer_state: 12 }
        );
        assert_eq!(
            bytes_per_param(Precision::Fp16, Optimizer::Adamw),
            bytes_per_param(Precision::Bf16, Optimizer::Adamw)
        );
        // fp32 (the quiz's 4P + 4P + 8P): no master copy, only m and v.
        assert_eq!(
            bytes_per_param(Precision::Fp32, Optimizer::Adamw),
            BytesPerParam { parameters: 4, gradients: 4, optimizer_state: 8 }
        );
        // The engine's SGD has no momentum: no state in fp32; mixed precision keeps the master copy.
        assert_eq!(bytes_per_param(Precision::Fp32, Optimizer::Sgd).optimizer_state, 0);
        assert_eq!(bytes_per_param(Precision::Bf16, Optimizer::Sgd).optimizer_state, 4);
    }

    #[test]
    fn seven_billion_with_adam_is_112_gb_per_ddp_rank() {
        let s = adam_mixed(7_000_000_000, Sharding::None, 8);
        assert_eq!((s.parameters, s.gradients, s.optimizer_state), (14_000_000_000, 14_000_000_000, 84_000_000_000));
        assert_eq!(s.total(), 112_000_000_000);
        // The same 16 bytes per parameter in fp32, split 4 + 4 + 8.
        let fp32 = model_state(7_000_000_000, Sharding::None, Precision::Fp32, Optimizer::Adamw, 1);
        assert_eq!(fp32.total(), 112_000_000_000);
        assert_eq!(fp32.optimizer_state, 56_000_000_000);
    }

    #[test]
    fn zero_table_for_7b_on_8_gpus() {
        // (weights, gradients, optimizer) in GB per GPU, fp16 + Adam, 8-way data parallel.
        let table = [
            (Sharding::None, 14.0, 14.0, 84.0),
            (Sharding::Zero1, 14.0, 14.0, 10.5),
            (Sharding::Zero2, 14.0, 1.75, 10.5),
            (Sharding::Fsdp, 1.75, 1.75, 10.5),
        ];
        for (sharding, w, g, o) in table {
            let s = model_state(7_000_000_000, sharding, Precision::Fp16, Optimizer::Adamw, 8);
            assert_eq!((gb(s.parameters), gb(s.gradients), gb(s.optimizer_state)), (w, g, o), "{sharding:?}");
        }
        // FSDP with 8 ranks: 16N/8 = 2N = 14 GB of state per GPU.
        assert_eq!(adam_mixed(7_000_000_000, Sharding::Fsdp, 8).total(), 14_000_000_000);
    }

    #[test]
    fn zero_paper_7_5b_on_64_gpus() {
        // Rajbhandari et al.: 120 / 31.4 / 16.6 / 1.9 GB for baseline / P_os / P_os+g / P_os+g+p.
        // Reproduced only when stage 1 shards the fp32 master weights with m and v
        // (all 12 bytes): 4 + 12/64 = 4.1875 bytes per parameter -> 31.4 GB.
        let p = 7_500_000_000;
        let expected =
            [(Sharding::None, 120.0), (Sharding::Zero1, 31.4), (Sharding::Zero2, 16.6), (Sharding::Fsdp, 1.9)];
        for (sharding, total) in expected {
            let got = gb(adam_mixed(p, sharding, 64).total());
            assert!((got - total).abs() < 0.05, "{sharding:?}: {got} GB, expected {total}");
        }
        assert_eq!(adam_mixed(p, Sharding::Zero1, 64).total(), 31_406_250_000);
        assert_eq!(adam_mixed(p, Sharding::Zero2, 64).total(), 16_640_625_000);
        assert_eq!(adam_mixed(p, Sharding::Fsdp, 64).total(), 1_875_000_000);
    }

    #[test]
    fn flashcard_zero_convention_differs_on_the_master_weights() {
        // The flashcard deck writes ZeRO-1 as 8N + 8N/K and ZeRO-2 as 6N + 10N/K (K=8: 9N,
        // 7.25N): it leaves the 4N fp32 master copy unsharded. The chapter (ZeRO-1
        // optimizer 12P -> 12P/N) and the ZeRO paper (31.4 GB above) shard it, and so does
        // the planner: K=8 gives 4N + 12N/8 = 5.5N and 2N + 14N/8 = 3.75N.
        let n = 1_000_000_000u64;
        assert_eq!(adam_mixed(n, Sharding::Zero1, 8).total(), 5_500_000_000);
        assert_eq!(adam_mixed(n, Sharding::Zero2, 8).total(), 3_750_000_000);
        assert_eq!(adam_mixed(n, Sharding::Fsdp, 8).total(), 2 * n);
    }

    #[test]
    fn fsdp_7b_32_layers_on_8_ranks_holds_a_shard_plus_one_layer() {
        // Weights only, fp16: DDP 14 GB; FSDP 1.75 GB of shard + one gathered layer of
        // 7e9/32 parameters (437.5 MB, "~440 MB") = 2.1875 GB ("~2.2 GB").
        let p = 7_000_000_000u64;
        let layer = p / 32 * bytes_per_param(Precision::Fp16, Optimizer::Adamw).parameters;
        assert_eq!(adam_mixed(p, Sharding::None, 8).parameters, 14_000_000_000);
        let shard = adam_mixed(p, Sharding::Fsdp, 8).parameters;
        assert_eq!((shard, layer), (1_750_000_000, 437_500_000));
        assert!((gb(shard + layer) - 2.2).abs() < 0.05);
    }

    #[test]
    fn other_worked_numbers_of_the_seeds() {
        // 70B fp16 weights = 140 GB; 175B = 350 GB, and 350/64 ~ 5.5 GB per GPU under ZeRO-3.
        assert_eq!(adam_mixed(70_000_000_000, Sharding::None, 1).parameters, 140_000_000_000);
        let gpt3 = adam_mixed(175_000_000_000, Sharding::Fsdp, 64).parameters;
        assert!((gb(gpt3) - 5.47).abs() < 0.01, "{}", gb(gpt3));
        // 3B -> 48 GB, 1.5B -> 24 GB and FSDP over 8 -> 3 GB, 1B -> 16 GB.
        assert_eq!(adam_mixed(3_000_000_000, Sharding::None, 1).total(), 48_000_000_000);
        assert_eq!(adam_mixed(1_500_000_000, Sharding::None, 1).total(), 24_000_000_000);
        assert_eq!(adam_mixed(1_500_000_000, Sharding::Fsdp, 8).total(), 3_000_000_000);
        // 70B on TP=8 x PP=4: 70e9/32 = 2.19B parameters per rank, 4.4 GB of bf16 weights.
        let per_rank = adam_mixed(70_000_000_000 / 32, Sharding::None, 8).parameters;
        assert_eq!(per_rank, 4_375_000_000);
    }

    #[test]
    fn comm_per_sharding_relative_to_ddp() {
        // DDP 2D. ZeRO-2: reduce-scatter + all-gather = 2D as well (the ZeRO paper; the
        // flashcards' "ZeRO-2 sends half of DDP" forgets the all-gather of the updated
        // parameters). ZeRO-1 as the engine runs it (and as this project's issue defines it)
        // keeps DDP's all-reduce and adds the all-gather: 3D. FSDP: two gathers and a
        // reduce-scatter, 3D, less the embeddings' backward gather (no parameters needed).
        let spec_with = |sharding| {
            let mut spec = with_model(ModelSpec::dense(4, 64, 4, 32, 64));
            spec.parallel.dp = 4;
            spec.parallel.sharding = sharding;
            spec
        };
        let total = |sharding| plan(&spec_with(sharding)).unwrap().stages[0].comm.clone();
        let ddp = total(Sharding::None);
        let m = spec_with(Sharding::None).model;
        let params = m.param_count();
        assert_eq!(ddp.dp_all_reduce, ring_all_reduce_bytes(params, 4, 4));
        assert_eq!(ddp.total, ddp.dp_all_reduce);
        let z1 = total(Sharding::Zero1);
        let z2 = total(Sharding::Zero2);
        let fsdp = total(Sharding::Fsdp);
        assert_eq!(z2.dp_reduce_scatter + z2.dp_all_gather, ddp.total);
        assert_eq!((z1.dp_all_reduce, z1.dp_all_gather), (ddp.dp_all_reduce, z2.dp_all_gather));
        let embedding = ((m.vocab + m.seq_len) * m.d_model) as u64;
        let backward_gathers = ring_reduce_scatter_bytes(params - embedding, 4, 4);
        assert_eq!(fsdp.dp_all_gather, fsdp.dp_reduce_scatter + backward_gathers);
        assert_eq!(fsdp.total, 2 * fsdp.dp_reduce_scatter + backward_gathers);
    }

    #[test]
    fn zero2_and_fsdp_reduce_every_micro_batch() {
        let mut spec = ExperimentSpec::default();
        spec.parallel.dp = 2;
        spec.train.grad_accum = 3;
        spec.parallel.sharding = Sharding::Zero2;
        let c = plan(&spec).unwrap().stages[0].comm.clone();
        let rs = ring_reduce_scatter_bytes(spec.model.param_count(), 2, 4);
        assert_eq!((c.dp_reduce_scatter, c.dp_all_gather), (3 * rs, rs));
        spec.parallel.sharding = Sharding::None;
        assert_eq!(plan(&spec).unwrap().stages[0].comm.dp_all_reduce, 2 * rs);
    }

    /// A 2-byte wire halves every data-parallel byte and no other.
    #[test]
    fn a_two_byte_wire_halves_the_data_parallel_bytes() {
        for sharding in [Sharding::None, Sharding::Zero1, Sharding::Zero2, Sharding::Fsdp] {
            let mut spec = ExperimentSpec::default();
            (spec.parallel.dp, spec.parallel.tp, spec.parallel.sharding) = (2, 2, sharding);
            spec.train.precision = Precision::Bf16;
            let fp32 = plan(&spec).unwrap().stages[0].comm.clone();
            spec.parallel.comm_dtype = Precision::Bf16;
            let bf16 = plan(&spec).unwrap().stages[0].comm.clone();
            assert!(fp32.dp_all_reduce + fp32.dp_reduce_scatter > 0, "{sharding:?}");
            assert_eq!(2 * bf16.dp_all_reduce, fp32.dp_all_reduce, "{sharding:?}");
            assert_eq!(2 * bf16.dp_reduce_scatter, fp32.dp_reduce_scatter, "{sharding:?}");
            assert_eq!(2 * bf16.dp_all_gather, fp32.dp_all_gather, "{sharding:?}");
            assert_eq!(bf16.tp_all_reduce, fp32.tp_all_reduce, "{sharding:?}: tensor parallelism stays fp32");
        }
    }

    /// Flash attention keeps no (s, s) matrix: its activations grow linearly in s.
    #[test]
    fn flash_attention_has_no_quadratic_term() {
        let (b, d, h) = (2, 64, 4);
        for s in [128u64, 1024] {
            let m = ModelSpec::dense(2, d as usize, h as usize, s as usize, 64);
            let naive = layer_activation_elements(&m, b, 1, Attention::Naive, false);
            let flash = layer_activation_elements(&m, b, 1, Attention::Flash, false);
            assert_eq!(naive - flash, b * h * (s * s - 2 * s), "s={s}");
            assert_eq!(flash, b * s * (16 * d + 4) + b * h * s * 2, "s={s}");
            let grads = activation_grad_elements(&m, b, 2, Attention::Flash, false);
            assert_eq!(grads, b * s * (2 * d + 4 * d) + b * (h / 2) * s * 2, "s={s}, tp=2");
        }
    }

    #[test]
    fn tiny_spec_matches_the_engine_accounting() {
        // The default spec: 2 layers, d=64, 4 heads, seq 32, vocab 64, micro-batch 8, fp32, AdamW.
        let spec = ExperimentSpec::default();
        let plan = plan(&spec).unwrap();
        assert_eq!(plan.param_count, 110_336);
        assert_eq!(plan.world_size, 1);
        assert_eq!(plan.stages.len(), 1);
        let st = &plan.stages[0];
        assert_eq!((st.first_layer, st.layers, st.embedding, st.head), (0, 2, true, true));
        assert_eq!(st.params_per_rank, 110_336);
        let mem = &st.memory;
        assert_eq!((mem.parameters, mem.gradients, mem.optimizer_state), (441_344, 441_344, 882_688));
        assert_eq!((mem.gathered_parameters, mem.comm_buffers), (0, 0));
        // The engine's Gpt::activation_floats_for, by hand: rows = 8*32 = 256, rc = rows*64.
        let (rows, rc, att) = (256u64, 256 * 64u64, 8 * 4 * 32 * 32u64);
        let block = 16 * rc + 4 * rows + att;
        let top = 2 * rc + 3 * rows + rows * 64;
        let scratch = 10 * rc + att;
        assert_eq!(mem.activations, 4 * (2 * block + top));
        assert_eq!(mem.activation_grads, 4 * scratch);
        assert_eq!(mem.activations + mem.activation_grads, 4 * 838_400);
        assert_eq!(mem.total, 441_344 * 2 + 882_688 + 4 * 838_400);
        // One rank: nothing to send, no bubble.
        assert_eq!(st.comm, CommVolume::default());
        assert_eq!((plan.bubble_fraction, plan.bubble_over_compute), (0.0, 0.0));
        // 8 sequences of 32 tokens: 6 * 110336 * 256 + 12 * 2 * 32 * 64 * 256.
        assert_eq!(plan.flops.tokens_per_step, 256);
        assert_eq!(plan.flops.six_params_tokens, 6.0 * 110_336.0 * 256.0);
        assert_eq!(plan.flops.total, (6.0 * 110_336.0 + 12.0 * 2.0 * 32.0 * 64.0) * 256.0);
        assert_eq!(plan.flops.recompute, 0.0);
    }

    #[test]
    fn stages_and_tp_ranks_add_up_to_the_whole_model() {
        let mut spec = with_model(ModelSpec::dense(7, 96, 6, 16, 50));
        spec.parallel.pp = 3;
        let p = plan(&spec).unwrap();
        let layers: Vec<(usize, usize)> = p.stages.iter().map(|s| (s.first_layer, s.layers)).collect();
        assert_eq!(layers, vec![(0, 3), (3, 2), (5, 2)]);
        let sum: u64 = p.stages.iter().map(|s| s.params_per_rank).sum();
        assert_eq!(sum, spec.model.param_count());
        // TP: the split part of each block divides by tp, the rest (6d) is on every rank.
        spec.parallel.pp = 1;
        spec.parallel.tp = 3;
        let d = 96u64;
        let block = spec.model.block_params();
        let expected = (block - 6 * d) / 3 + 6 * d;
        let one = plan(&spec).unwrap().stages[0].params_per_rank;
        let embed_head = spec.model.param_count() - 7 * block;
        assert_eq!(one, 7 * expected + embed_head);
    }

    #[test]
    fn pipeline_bubble_schedules_and_sends() {
        let mut spec = ExperimentSpec::default();
        spec.model.layers = 4;
        spec.parallel.pp = 4;
        spec.train.micro_batches = 16;
        let p = plan(&spec).unwrap();
        // P=4, M=16: 3/19 = 15.8% ("about 16%"); (P-1)/M = 18.75% of the compute time.
        assert!((p.bubble_fraction - 3.0 / 19.0).abs() < 1e-12);
        assert!((p.bubble_over_compute - 3.0 / 16.0).abs() < 1e-12);
        // 1F1B holds P - stage micro-batches; GPipe all 16.
        let in_flight: Vec<u64> = p.stages.iter().map(|s| s.in_flight_micro_batches).collect();
        assert_eq!(in_flight, vec![4, 3, 2, 1]);
        spec.parallel.pp_schedule = PpSchedule::Gpipe;
        let g = plan(&spec).unwrap();
        assert!(g.stages.iter().all(|s| s.in_flight_micro_batches == 16));
        assert!(g.stages[0].memory.activations > p.stages[0].memory.activations);
        // Accumulation runs in the same schedule: M = micro_batches x grad_accum = 32.
        spec.train.micro_batches = 8;
        spec.train.grad_accum = 4;
        assert_eq!(spec.pipeline_micro_batches(), 32);
        let accumulated = plan(&spec).unwrap();
        assert!((accumulated.bubble_fraction - 3.0 / 35.0).abs() < 1e-12);
        assert!(accumulated.stages.iter().all(|s| s.in_flight_micro_batches == 32));
        spec.train.micro_batches = 16;
        spec.train.grad_accum = 1;
        // Sends: an activation of 8*32*64 fp32 per micro-batch forward and/or backward.
        let a = 8 * 32 * 64 * 4 * 16u64;
        let sends: Vec<u64> = p.stages.iter().map(|s| s.comm.pp_send).collect();
        assert_eq!(sends, vec![a, 2 * a, 2 * a, a]);
        // Interleaved, v = 2 on 8 blocks: (P-1)/(vM+P-1) = 3/35, (P-1)/(vM) of the compute;
        // every chunk but the model's last sends on, every one but its first sends back;
        // warm-up 2(P-1-s) + (v-1)P chunk passes, one more in flight.
        spec.model.layers = 8;
        (spec.parallel.pp_schedule, spec.parallel.virtual_stages) = (PpSchedule::Interleaved, 2);
        let v = plan(&spec).unwrap();
        assert!((v.bubble_fraction - 3.0 / 35.0).abs() < 1e-12);
        assert!((v.bubble_over_compute - 3.0 / 32.0).abs() < 1e-12);
        let sends: Vec<u64> = v.stages.iter().map(|s| s.comm.pp_send).collect();
        assert_eq!(sends, vec![3 * a, 4 * a, 4 * a, 3 * a]);
        let in_flight: Vec<u64> = v.stages.iter().map(|s| s.in_flight_micro_batches).collect();
        assert_eq!(in_flight, vec![11, 9, 7, 5]);
        assert!(v.stages.iter().all(|s| s.layers == 2));
        spec.parallel.virtual_stages = 3;
        let refused = plan(&spec).unwrap_err();
        assert!(refused.iter().any(|e| e.message.contains("multiple of 12")), "{refused:?}");
        // ZB-H1: a third of 1F1B's idle time against its compute, (P-1)/(3M).
        (spec.parallel.pp_schedule, spec.parallel.virtual_stages) = (PpSchedule::ZbH1, 1);
        let zb = plan(&spec).unwrap();
        assert!((zb.bubble_over_compute - 3.0 / 48.0).abs() < 1e-12);
        // Schedules the planner follows pass by pass have a bound, not a hang.
        spec.train.micro_batches = usize::MAX;
        let refused = plan(&spec).unwrap_err();
        assert!(refused.iter().any(|e| e.message.contains("pass by pass")), "{refused:?}");
    }

    /// Sequence parallelism splits the LayerNorm/residual regions: the activations per rank
    /// drop by (4d + 4)(1 - 1/t) per token and block, less the two exchange buffers; the
    /// TP bytes are those of the all-reduces plus the re-gathers in backward, the
    /// LayerNorm gradients' sums, the head's gather and the embeddings' gradient gather.
    #[test]
    fn sequence_parallelism_splits_the_layernorm_regions() {
        let mut spec = ExperimentSpec::default();
        (spec.parallel.tp, spec.model.layers) = (2, 4);
        let tp = plan(&spec).unwrap().stages[0].clone();
        spec.parallel.sequence_parallel = true;
        let sp = plan(&spec).unwrap().stages[0].clone();
        let (b, s, d, l) = (8u64, 32u64, 64u64, 4u64);
        let (rows, rows_d) = (b * s, b * s * d);
        // per block (4d + 4) per token halved; the stage input and the lnf statistics halved;
        // two b*s*d exchange buffers added.
        let saved = l * rows * (4 * d + 4) / 2 + rows_d / 2 + rows;
        assert_eq!(tp.memory.activations - sp.memory.activations, 4 * (saved - 2 * rows_d));
        assert_eq!(tp.memory.activation_grads - sp.memory.activation_grads, 4 * (rows_d / 2 - 6 * d));
        let half = ring_reduce_scatter_bytes(rows_d, 2, 4);
        let sums = l * ring_all_reduce_bytes(4 * d, 2, 4) + ring_all_reduce_bytes(2 * d, 2, 4);
        assert_eq!(sp.comm.tp_all_reduce, l * 10 * half + half + half + sums);
        assert_eq!(tp.comm.tp_all_reduce, l * 8 * half);
    }

    #[test]
    fn tp_all_reduces_four_per_block_per_micro_batch() {
        let mut spec = ExperimentSpec::default();
        spec.parallel.tp = 2;
        spec.train.micro_batches = 2;
        let p = plan(&spec).unwrap();
        let one = ring_all_reduce_bytes(8 * 32 * 64, 2, 4);
        assert_eq!(p.stages[0].comm.tp_all_reduce, 4 * 2 * 2 * one);
        spec.train.checkpointing = Checkpointing::Every;
        assert_eq!(plan(&spec).unwrap().stages[0].comm.tp_all_reduce, 6 * 2 * 2 * one);
    }

    #[test]
    fn checkpointing_trades_activations_for_recompute() {
        let mut spec = ExperimentSpec::default();
        spec.model.layers = 16;
        let none = plan(&spec).unwrap();
        spec.train.checkpointing = Checkpointing::Sqrt;
        let sqrt = plan(&spec).unwrap();
        spec.train.checkpointing = Checkpointing::Every;
        let every = plan(&spec).unwrap();
        let acts = |p: &Plan| p.stages[0].memory.activations;
        assert!(
            acts(&sqrt) < acts(&none) && acts(&every) < acts(&none),
            "{} {} {}",
            acts(&none),
            acts(&sqrt),
            acts(&every)
        );
        // One extra forward of the blocks.
        let m = &spec.model;
        let tokens = 256.0;
        let extra = (2.0 * 16.0 * m.block_params() as f64 + 4.0 * 16.0 * 32.0 * 64.0) * tokens;
        assert_eq!(sqrt.flops.recompute, extra);
        assert_eq!(every.flops.total, none.flops.total + extra);
    }

    #[test]
    fn impossible_specs_are_field_errors() {
        type Edit = fn(&mut ExperimentSpec);
        let cases: Vec<(Edit, &str, &str)> = vec![
            (|s| s.parallel.dp = 0, "parallel.dp", "dp must be at least 1"),
            (|s| s.parallel.tp = 3, "parallel.tp", "tp=3 does not divide heads=4"),
            (|s| s.parallel.pp = 3, "parallel.pp", "pp=3 is more than layers=2"),
            (|s| s.model.heads = 3, "model.heads", "heads=3 does not divide d_model=64"),
            (|s| s.model.layers = 0, "model.layers", "layers must be at least 1"),
            (|s| s.train.micro_batch = 0, "train.micro_batch", "micro_batch must be at least 1"),
            (|s| s.model.d_model = 1 << 30, "model", "the planner handles at most 1e15"),
            (
                |s| {
                    s.model.layers = 4096;
                    s.parallel.pp = 2048;
                },
                "parallel.pp",
                "at most 1024",
            ),
        ];
        for (edit, field, needle) in cases {
            let mut spec = ExperimentSpec::default();
            edit(&mut spec);
            let errs = plan(&spec).unwrap_err();
            assert!(
                errs.iter().any(|e| e.field == field && e.message.contains(needle)),
                "{field} ~ {needle}: {errs:?}"
            );
        }
        // Zero everything: every problem at once, and no panic.
        let mut spec = with_model(ModelSpec::dense(0, 0, 0, 0, 0));
        spec.parallel.dp = 0;
        assert!(plan(&spec).unwrap_err().len() >= 6);
    }

    #[test]
    fn run_limits_do_not_apply() {
        // dp=1 with zero sharding is rejected for runs but plans as unsharded state.
        let mut spec = ExperimentSpec::default();
        spec.parallel.sharding = Sharding::Zero2;
        assert!(spec.validate(&Limits::default()).is_err());
        let p = plan(&spec).unwrap();
        assert_eq!(p.stages[0].memory.gradients, 4 * p.param_count);
    }

    #[test]
    fn gpt3_on_3d_parallel_does_not_overflow() {
        // 175B-class: 96 layers, d=12288, 96 heads, seq 2048, on dp=1024 x tp=8 x pp=16.
        let mut spec = with_model(ModelSpec::dense(96, 12288, 96, 2048, 50257));
        spec.parallel = ParallelSpec { dp: 1024, tp: 8, pp: 16, sharding: Sharding::Zero1, ..ParallelSpec::default() };
        spec.train.precision = Precision::Bf16;
        spec.train.micro_batch = 1;
        spec.train.micro_batches = 64;
        spec.train.checkpointing = Checkpointing::Every;
        let p = plan(&spec).unwrap();
        assert!((p.param_count as f64 - 175e9).abs() < 2e9, "{}", p.param_count);
        assert_eq!(p.world_size, 1024 * 8 * 16);
        assert_eq!(p.stages.len(), 16);
        assert!(p.stages.iter().all(|s| s.layers == 6));
        // ~175e9 / (8 * 16) = 1.4B parameters per middle rank, 2 bytes each.
        let mid = &p.stages[5];
        assert!((mid.params_per_rank as f64 / 1.36e9 - 1.0).abs() < 0.05, "{}", mid.params_per_rank);
        assert_eq!(mid.memory.parameters, 2 * mid.params_per_rank);
        assert!(p.stages.iter().all(|s| s.memory.total < 1 << 40 && s.comm.total > 0));
        assert!(p.flops.total.is_finite() && p.flops.total > 1e18);
        assert!((p.bubble_fraction - 15.0 / 79.0).abs() < 1e-12);
        // The plan round-trips through JSON (the browser renders it).
        let again: Plan = serde_json::from_str(&serde_json::to_string(&p).unwrap()).unwrap();
        assert_eq!(again, p);
    }

    /// A Llama-style model: RMSNorm, SwiGLU and grouped-query attention, each in the
    /// places a learner would look: parameters per stage and TP rank, the activations kept.
    #[test]
    fn llama_blocks_are_planned_by_their_own_shapes() {
        // 4 blocks of d = 256, 8 heads of 32 sharing 2 K/V heads, SwiGLU of 688, vocab 1000.
        let m = ModelSpec::llama(4, 256, 8, 2, 688, 64, 1000);
        let (d, f, v) = (256u64, 688u64, 1000u64);
        let kv = 2 * 32; // two K/V heads of 32
        let block = 2 * d + (d * (d + 2 * kv) + d * d) + 3 * d * f;
        assert_eq!(m.block_params(), block);
        assert_eq!(m.param_count(), v * d + 4 * block + d + d * v, "no position table, one RMSNorm gain");
        let mut spec = ExperimentSpec { model: m.clone(), ..ExperimentSpec::default() };
        (spec.parallel.tp, spec.parallel.pp) = (2, 2);
        let p = plan(&spec).unwrap();
        // Each TP rank holds half of every matrix and both norms whole.
        assert_eq!(p.stages[0].params_per_rank, v * d + 2 * ((block - 2 * d) / 2 + 2 * d));
        assert_eq!(p.stages[1].params_per_rank, 2 * ((block - 2 * d) / 2 + 2 * d) + d + d * v);
        // Tied: the head leaves the count, but a pipeline's last stage keeps its copy.
        spec.model.tie_embeddings = true;
        let tied = plan(&spec).unwrap();
        assert_eq!(tied.param_count, p.param_count - d * v);
        assert_eq!(tied.stages[1].params_per_rank, p.stages[1].params_per_rank);
        spec.parallel.pp = 1;
        spec.model.layers = 2;
        let one_stage = plan(&spec).unwrap();
        assert_eq!(one_stage.stages[0].params_per_rank, v * d + 2 * ((block - 2 * d) / 2 + 2 * d) + d);
        // Fewer K/V heads keep narrower K and V: (8 - 2) x 32 x 2 fewer values per token.
        let full = ModelSpec { kv_heads: 8, ..m.clone() };
        let (b, t) = (2u64, 64u64);
        let saved = layer_activation_elements(&full, b, 1, Attention::Flash, false)
            - layer_activation_elements(&m, b, 1, Attention::Flash, false);
        assert_eq!(saved, b * t * 2 * (8 - 2) * 32);
        // Whole K/V heads per TP rank, and an MLP width TP divides.
        spec.parallel.tp = 4;
        let errors = plan(&spec).unwrap_err();
        assert!(errors.iter().any(|e| e.field == "parallel.tp" && e.message.contains("kv_heads=2")), "{errors:?}");
        spec.parallel.tp = 2;
        spec.model.kv_heads = 3;
        let errors = plan(&spec).unwrap_err();
        assert!(errors.iter().any(|e| e.field == "model.kv_heads"), "{errors:?}");
        // Llama's default MLP width: 8/3 d rounded up to 256 (Llama-2 7B: 11008).
        assert_eq!(ModelSpec { ffn_hidden: 0, ..ModelSpec::llama(1, 4096, 32, 32, 0, 8, 8) }.d_ff(), 11008);
    }

    #[test]
    fn absurd_sizes_saturate_instead_of_overflowing() {
        let mut spec = ExperimentSpec::default();
        spec.parallel.dp = usize::MAX;
        spec.parallel.tp = 4;
        spec.train.micro_batch = usize::MAX;
        spec.train.micro_batches = usize::MAX;
        spec.train.grad_accum = usize::MAX;
        spec.model.seq_len = 1 << 20;
        let p = plan(&spec).unwrap();
        assert_eq!(p.world_size, u64::MAX);
        assert_eq!(p.flops.tokens_per_step, u64::MAX);
        assert!(p.flops.total.is_finite());
        assert_eq!(p.stages[0].memory.total, u64::MAX);
    }
}
