//! The experiment spec: what a person submits, as JSON (docs/api.md shows one).
//!
//! Every section has defaults (the tiny config below), so `{}` is a valid spec;
//! unknown fields are rejected so that a typo never silently runs something else.

use serde::{Deserialize, Serialize};

use crate::spec::field_error::FieldError;

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(deny_unknown_fields, default)]
pub struct ExperimentSpec {
    pub name: String,
    pub model: ModelSpec,
    pub data: DataSpec,
    pub parallel: ParallelSpec,
    pub train: TrainSpec,
    pub backend: BackendKind,
    /// Instead of training, run one collective on small readable vectors across the
    /// dp ranks and record every ring step (the all-reduce replay demo).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub demo: Option<CollectiveDemo>,
}

/// A collective run on its own: rank r starts with the vector `(r+1)*100 + i` for
/// i in 0..elements, so every number in the replay can be checked by hand.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(deny_unknown_fields, default)]
pub struct CollectiveDemo {
    pub op: DemoOp,
    pub elements: usize,
}

#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(rename_all = "snake_case")]
pub enum DemoOp {
    #[default]
    AllReduce,
    ReduceScatter,
    AllGather,
    /// Every rank sends chunk j of its vector to rank j (how Mixture-of-Experts sends
    /// tokens to the ranks holding their experts).
    AllToAll,
}

impl Default for CollectiveDemo {
    fn default() -> Self {
        Self { op: DemoOp::AllReduce, elements: 16 }
    }
}

impl DemoOp {
    pub fn as_str(self) -> &'static str {
        match self {
            DemoOp::AllReduce => "all_reduce",
            DemoOp::ReduceScatter => "reduce_scatter",
            DemoOp::AllGather => "all_gather",
            DemoOp::AllToAll => "all_to_all",
        }
    }
}

impl CollectiveDemo {
    /// Rank `rank`'s starting value at index `i`.
    pub fn initial_value(rank: usize, i: usize) -> f32 {
        ((rank + 1) * 100 + i) as f32
    }
}

/// A decoder-only transformer: embeddings, `layers` pre-norm blocks, a final norm and the
/// LM head, with GPT-2's blocks or Llama's (the engine trains both, with untied embeddings).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(deny_unknown_fields, default)]
pub struct ModelSpec {
    /// The block's design: GPT-2's or Llama's.
    #[serde(skip_serializing_if = "ModelFamily::is_gpt2")]
    pub family: ModelFamily,
    pub layers: usize,
    pub d_model: usize,
    pub heads: usize,
    pub seq_len: usize,
    pub vocab: usize,
    /// Mixture of Experts: each block's MLP replaced by `experts` MLPs of the same shape
    /// and a router choosing `expert_top_k` of them per token (0: the dense model).
    pub experts: usize,
    pub expert_top_k: usize,
    /// Each expert takes at most capacity = ceil(capacity_factor x tokens x top_k /
    /// experts) of a micro-batch's tokens; the assignments beyond it are dropped (the
    /// token goes on through the residual alone).
    pub capacity_factor: f64,
    /// Weight of the router's load-balancing loss (Switch Transformer's alpha): experts x
    /// sum over experts of (share of assignments) x (mean router probability), 1 when
    /// balanced.
    pub aux_loss_coef: f64,
    /// Key/value heads: fewer than `heads` is grouped-query attention (each K/V head
    /// serves heads / kv_heads query heads); 0 means as many as `heads`.
    #[serde(skip_serializing_if = "is_zero")]
    pub kv_heads: usize,
    /// Width of the MLP's hidden layer; 0 means the family's: 4 x d_model for GPT-2,
    /// 8/3 x d_model rounded up to a multiple of 256 for Llama.
    #[serde(skip_serializing_if = "is_zero")]
    pub ffn_hidden: usize,
    /// The LM head reuses the token embedding matrix (GPT-2's original, Llama-3 8B's is not).
    #[serde(skip_serializing_if = "std::ops::Not::not")]
    pub tie_embeddings: bool,
    /// Llama's rotary position embeddings: dimension pair i of a head hs wide turns by
    /// position x rope_theta^(-2i/hs) (Llama 2: 10,000; Llama 3: 500,000). GPT-2 learns
    /// its positions instead.
    #[serde(skip_serializing_if = "is_default_rope_theta")]
    pub rope_theta: f64,
}

fn is_zero(n: &usize) -> bool {
    *n == 0
}

/// Llama 2's (and the original RoPE paper's) base.
pub const DEFAULT_ROPE_THETA: f64 = 10_000.0;

fn is_default_rope_theta(theta: &f64) -> bool {
    *theta == DEFAULT_ROPE_THETA
}

/// What a transformer block is made of.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(rename_all = "lowercase")]
pub enum ModelFamily {
    /// LayerNorm (gain and bias), biased projections, a GELU MLP of two matrices, learned
    /// position embeddings.
    #[default]
    Gpt2,
    /// RMSNorm (gain only), projections without bias, a SwiGLU MLP of three matrices
    /// (gate, up, down), rotary positions (no position embedding table).
    Llama,
}

impl ModelFamily {
    pub fn is_gpt2(&self) -> bool {
        *self == ModelFamily::Gpt2
    }
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(deny_unknown_fields, default)]
pub struct DataSpec {
    pub dataset: Dataset,
    pub seed: u64,
    /// `dataset: upload`: which uploaded text (`POST /api/datasets` answers its id).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub upload_id: Option<i64>,
    /// How a text becomes tokens: one per byte, or a byte-level BPE of `model.vocab`
    /// tokens trained on the run's own training text.
    #[serde(skip_serializing_if = "TokenizerKind::is_bytes")]
    pub tokenizer: TokenizerKind,
}

/// How a text dataset is cut into tokens.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(rename_all = "lowercase")]
pub enum TokenizerKind {
    /// Token i is byte i: 256 tokens, every text has as many tokens as bytes.
    #[default]
    Bytes,
    /// Byte-level BPE (GPT-2's scheme): the 256 bytes, then the most frequent adjacent
    /// pairs merged until the vocabulary is full, learned from the run's training text.
    Bpe,
}

impl TokenizerKind {
    pub fn is_bytes(&self) -> bool {
        *self == TokenizerKind::Bytes
    }
}

/// A byte-level BPE starts from the 256 bytes: it needs room for at least one merge.
pub const MIN_BPE_VOCAB: usize = 257;

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(rename_all = "lowercase")]
pub enum Dataset {
    /// A random Markov chain over the vocabulary, fixed by the data seed:
    /// the best possible loss is its entropy rate.
    Markov,
    /// A small public-domain English text, one token per byte.
    Text,
    /// A UTF-8 text someone uploaded (`data.upload_id`), one token per byte like `text`.
    Upload,
}

impl Dataset {
    /// Whether its tokens are a text's bytes (the vocabulary needs all 256 of them).
    pub fn is_text(self) -> bool {
        matches!(self, Dataset::Text | Dataset::Upload)
    }
}

/// How a text of `len` bytes is split for sequences of `seq_len` tokens: the bytes trained
/// on (the rest, the last tenth but at least one window of seq_len + 1 bytes, is held out
/// for the validation loss), or None when the text cannot hold a window on each side.
pub fn text_split(len: usize, seq_len: usize) -> Option<usize> {
    let window = seq_len.saturating_add(1);
    let held_out = (len / 10).max(window);
    len.checked_sub(held_out).filter(|&trained| trained >= window)
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(deny_unknown_fields, default)]
pub struct ParallelSpec {
    pub dp: usize,
    pub tp: usize,
    pub pp: usize,
    pub sharding: Sharding,
    pub pp_schedule: PpSchedule,
    /// `pp_schedule: interleaved`: chunks of layers per pipeline stage (v); stage s holds
    /// chunks s, s + pp, s + 2pp, ... of the pp * v equal chunks.
    pub virtual_stages: usize,
    pub bucket_bytes: u64,
    /// FSDP: gather the unit the model opens next on a communication thread while the
    /// current one computes (forward in order, backward in reverse), at most two gathered.
    pub prefetch: bool,
    /// The format of the data-parallel collectives on the wire (gradients, ZeRO/FSDP's
    /// parameters): fp32, or a 2-byte run's own format (half the bytes; sums still made
    /// in f32 where they arrive).
    pub comm_dtype: Precision,
    /// FSDP with `train.fp8`: each rank casts its shard of the blocks' four linear weights
    /// to FP8 (E4M3, the weight's own scale) before they are all-gathered, so they cross
    /// the wire in one byte each (`plan/fp8_gather.rs`); the rest keeps `comm_dtype`.
    pub fp8_all_gather: bool,
    /// ZeRO-Offload: where the optimizer's state lives and its step runs.
    pub offload: Offload,
    /// Megatron sequence parallelism (tp > 1): the LayerNorm and residual regions are
    /// split along the tokens across the tensor-parallel group, with an all-gather before
    /// each column-parallel matmul and a reduce-scatter after each row-parallel one in
    /// place of the all-reduce.
    pub sequence_parallel: bool,
    /// How the data-parallel gradients are all-reduced (DDP, ZeRO-1).
    pub allreduce: AllReduce,
    /// `allreduce: hierarchical`: ranks per "node" (consecutive DP ranks); a ring inside
    /// each node, one across the nodes' leaders.
    pub ranks_per_node: usize,
    /// DDP's gradients compressed before they cross the wire, with error feedback
    /// (`parallel/compression.rs`).
    pub grad_compression: GradCompression,
    /// `grad_compression: topk`: the share of each gradient tensor's values sent (0 to 1].
    pub compression_ratio: f64,
    /// `grad_compression: powersgd`: the rank of each matrix's approximation.
    pub compression_rank: usize,
    /// Expert parallelism: the experts of every block spread over `ep` consecutive ranks
    /// of the data-parallel group (E/ep each), tokens sent to their experts and back by
    /// all-to-all.
    pub ep: usize,
    /// Context parallelism: every sequence split along its tokens over `cp` consecutive
    /// ranks of the data-parallel group (T/cp each), which read the same sequences; their
    /// gradients are summed with the rest of the group's. `dp/cp` replicas of the data.
    pub cp: usize,
    /// How the context-parallel ranks meet in attention.
    pub cp_kind: ContextParallel,
    /// How the data-parallel replicas stay together: a gradient sum every step, or
    /// DiLoCo's local steps with an outer step every `outer_steps_every`.
    pub sync: DataSync,
    /// `sync: diloco`: the inner optimizer steps each replica takes alone between two
    /// outer steps (H).
    pub outer_steps_every: u64,
    /// `sync: diloco`: the outer step's learning rate, on the replicas' mean parameter
    /// change (1 with no momentum: the mean of the replicas' parameters).
    pub outer_lr: f64,
    /// `sync: diloco`: the outer step's Nesterov momentum (0: none).
    pub outer_momentum: f64,
    /// `sharding: hsdp`: data-parallel ranks per shard group (0: `ranks_per_node`, the
    /// consecutive data-parallel ranks the spec counts to a node).
    pub shard_group: usize,
    /// What happens when a rank's process dies: the run fails (and is resumed from a
    /// checkpoint), or the other data-parallel replicas go on without it and a
    /// replacement rejoins from a live peer (`parallel/fault_tolerant.rs`).
    pub fault_tolerance: FaultTolerance,
    /// `fault_tolerance: replicas`: a drill that kills one rank's process (SIGKILL, as a
    /// crashed machine or the kernel's out-of-memory killer would) once, after a step, to
    /// watch the others go on and a replacement rejoin.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub fault_drill: Option<FaultDrill>,
}

/// Which rank a fault drill kills, and after which step (0-based) it does.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(deny_unknown_fields, default)]
pub struct FaultDrill {
    pub rank: usize,
    pub after_step: u64,
}

/// What a run does when one of its rank processes dies.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(rename_all = "snake_case")]
pub enum FaultTolerance {
    /// The whole run stops; a worker resumes it from its latest checkpoint.
    #[default]
    None,
    /// TorchFT's idea: the data-parallel replicas agree on who is alive every step (a
    /// quorum kept by the worker); the step a replica dies in finishes without it, and a
    /// replacement process rejoins at a later step by copying the parameters and
    /// optimizer state of a live replica.
    Replicas,
}

impl FaultTolerance {
    /// Its name in a spec's JSON.
    pub fn as_str(self) -> &'static str {
        match self {
            FaultTolerance::None => "none",
            FaultTolerance::Replicas => "replicas",
        }
    }
}

impl ParallelSpec {
    /// The axes that split one model over several ranks, as (field, name, size): tensor,
    /// pipeline, expert and context parallelism.
    pub fn model_splits(&self) -> impl Iterator<Item = (&'static str, &'static str, usize)> {
        [
            ("parallel.tp", "tp", self.tp),
            ("parallel.pp", "pp", self.pp),
            ("parallel.ep", "ep", self.ep),
            ("parallel.cp", "cp", self.cp),
        ]
        .into_iter()
    }
}

/// How context-parallel ranks, each holding T/cp tokens of every sequence, run attention.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(rename_all = "kebab-case")]
pub enum ContextParallel {
    /// DeepSpeed-Ulysses (Jacobs et al. 2023): an all-to-all turns q, k and v from
    /// sequence-split (T/cp tokens, every head) into head-split (every token, heads/cp),
    /// attention runs unchanged on whole sequences, a second all-to-all turns its output
    /// back; backward the same in reverse. The heads (and key/value heads) must divide by cp.
    #[default]
    Ulysses,
    /// Ring attention (Liu et al. 2023): each rank keeps its queries, and the blocks of
    /// keys and values travel round the ranks; each block's attention is merged into the
    /// output by its log-sum-exp, FlashAttention's way; backward sends the blocks round
    /// again with their gradients. Causally load-balanced: with 2cp chunks of the sequence,
    /// rank r holds chunks r and 2cp-1-r (Megatron's and torchtitan's split).
    Ring,
    /// The ring with each rank holding one contiguous run of T/cp tokens: the last rank's
    /// queries see every block, the first rank's only its own (to compare with `ring`).
    RingUnbalanced,
}

impl ContextParallel {
    /// Its name in a spec's JSON.
    pub fn as_str(self) -> &'static str {
        match self {
            ContextParallel::Ulysses => "ulysses",
            ContextParallel::Ring => "ring",
            ContextParallel::RingUnbalanced => "ring-unbalanced",
        }
    }

    /// Whether the blocks of keys and values travel round the ranks.
    pub fn is_ring(self) -> bool {
        matches!(self, ContextParallel::Ring | ContextParallel::RingUnbalanced)
    }
}

/// How DDP's gradients are compressed on the wire; what each loses is kept on the rank
/// (error feedback) and added to the next step's gradient.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(rename_all = "lowercase")]
pub enum GradCompression {
    /// fp32 values, all-reduced round the ring.
    None,
    /// Each tensor's `compression_ratio` largest values (by magnitude) and their indices,
    /// all-gathered and added up.
    Topk,
    /// Each tensor as 8-bit integers with one fp32 scale, all-gathered and added up.
    Int8,
    /// Each matrix as a rank-`compression_rank` product P Q^T, P and Q all-reduced
    /// (Vogels et al., 2019); vectors all-reduced whole.
    Powersgd,
}

impl GradCompression {
    /// Its name in a spec's JSON.
    pub fn as_str(self) -> &'static str {
        match self {
            GradCompression::None => "none",
            GradCompression::Topk => "topk",
            GradCompression::Int8 => "int8",
            GradCompression::Powersgd => "powersgd",
        }
    }
}

/// How data-parallel replicas keep their parameters together.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(rename_all = "snake_case")]
pub enum DataSync {
    /// The gradients summed over the replicas every step (DDP, ZeRO, FSDP).
    #[default]
    EveryStep,
    /// DiLoCo (Douillard et al. 2023), local SGD with an outer optimizer: each replica
    /// takes H inner steps alone, then the replicas average their parameter changes and
    /// take one Nesterov step on them (`parallel/diloco.rs`).
    Diloco,
    /// Asynchronous SGD with a parameter server (`parallel/async_ps.rs`): data-parallel
    /// rank 0 keeps the parameters and the optimizer; every rank pushes its gradient and
    /// pulls the parameters after each backward, without waiting for the others.
    AsyncPs,
}

impl DataSync {
    /// Its name in a spec's JSON.
    pub fn as_str(self) -> &'static str {
        match self {
            DataSync::EveryStep => "every_step",
            DataSync::Diloco => "diloco",
            DataSync::AsyncPs => "async_ps",
        }
    }
}

/// An all-reduce algorithm (`comm/all_reduce.rs`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(rename_all = "lowercase")]
pub enum AllReduce {
    /// Reduce-scatter then all-gather round a ring: 2(W-1)/W x D sent by every rank.
    #[default]
    Ring,
    /// A binary tree: partial sums up to rank 0, the result back down.
    Tree,
    /// The parameter-server pattern: every rank sends to rank 0, which sums and sends the
    /// result to each: (W-1) x D through rank 0 each way.
    Naive,
    /// A ring inside each node, a ring across the nodes' leaders, then each leader sends
    /// the result to its node.
    Hierarchical,
}

impl AllReduce {
    /// Its name in a spec's JSON.
    pub fn as_str(self) -> &'static str {
        match self {
            AllReduce::Ring => "ring",
            AllReduce::Tree => "tree",
            AllReduce::Naive => "naive",
            AllReduce::Hierarchical => "hierarchical",
        }
    }
}

/// Where the optimizer's state (AdamW's moments, the master weights) lives.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(rename_all = "lowercase")]
pub enum Offload {
    /// Beside the model, on its device.
    None,
    /// In host memory, the update run there by CPU threads (a GPU run's ZeRO-Offload).
    Host,
    /// In a file, streamed through a small buffer piece by piece for each update
    /// (ZeRO-Infinity's NVMe tier).
    Disk,
}

impl Offload {
    /// Its name in a spec's JSON.
    pub fn as_str(self) -> &'static str {
        match self {
            Offload::None => "none",
            Offload::Host => "host",
            Offload::Disk => "disk",
        }
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(rename_all = "lowercase")]
pub enum Sharding {
    None,
    Zero1,
    Zero2,
    Fsdp,
    /// Hybrid sharding (FSDP2's HSDP, ZeRO++'s hierarchical partitioning): FSDP inside
    /// groups of `shard_group` consecutive data-parallel ranks, whole replicas across them;
    /// gradients reduce-scattered inside a group and the shard all-reduced across.
    Hsdp,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub enum PpSchedule {
    #[serde(rename = "gpipe")]
    Gpipe,
    #[serde(rename = "1f1b")]
    OneFOneB,
    /// Megatron-LM's interleaved 1F1B: each stage holds `virtual_stages` chunks of layers.
    #[serde(rename = "interleaved")]
    Interleaved,
    /// Zero-bubble ZB-H1 (Qi et al. 2023): backward split into the input gradient (B) and
    /// the weight gradient (W), the W passes deferred into the pipeline's bubbles.
    #[serde(rename = "zb-h1")]
    ZbH1,
    /// Zero-bubble V (Qi et al. 2024): two chunks per stage in a V (stage s holds chunks s
    /// and 2P-1-s), backward split into B and W as in ZB-H1.
    #[serde(rename = "zbv")]
    Zbv,
    /// DeepSeek's DualPipeV (DualPipe cut in half): the V of ZBV, run in DualPipe's order:
    /// the forward of one micro-batch paired with the backward of another in the steady
    /// state, the backward whole there and split into B and W at the ramps.
    #[serde(rename = "dualpipev")]
    DualPipeV,
}

impl PpSchedule {
    /// Its name in the texts.
    pub fn title(self) -> &'static str {
        match self {
            PpSchedule::Gpipe => "GPipe",
            PpSchedule::OneFOneB => "1F1B",
            PpSchedule::Interleaved => "interleaved 1F1B",
            PpSchedule::ZbH1 => "ZB-H1",
            PpSchedule::Zbv => "ZBV",
            PpSchedule::DualPipeV => "DualPipeV",
        }
    }
    /// Whether its backward runs as B and W (ZB-H1, ZBV, DualPipeV).
    pub fn splits_backward(self) -> bool {
        matches!(self, PpSchedule::ZbH1 | PpSchedule::Zbv | PpSchedule::DualPipeV)
    }

    /// Whether it lays two chunks per stage out in a V (ZBV, DualPipeV): stage s holds
    /// model chunks s and 2P-1-s.
    pub fn is_v(self) -> bool {
        matches!(self, PpSchedule::Zbv | PpSchedule::DualPipeV)
    }

    /// Its name in a spec's JSON.
    pub fn as_str(self) -> &'static str {
        match self {
            PpSchedule::Gpipe => "gpipe",
            PpSchedule::OneFOneB => "1f1b",
            PpSchedule::Interleaved => "interleaved",
            PpSchedule::ZbH1 => "zb-h1",
            PpSchedule::Zbv => "zbv",
            PpSchedule::DualPipeV => "dualpipev",
        }
    }
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(deny_unknown_fields, default)]
pub struct TrainSpec {
    pub steps: u64,
    pub micro_batch: usize,
    pub micro_batches: usize,
    pub grad_accum: usize,
    pub lr: f64,
    pub warmup_steps: u64,
    pub lr_schedule: LrSchedule,
    pub optimizer: Optimizer,
    pub weight_decay: f64,
    pub grad_clip: f64,
    pub precision: Precision,
    pub loss_scaling: LossScaling,
    pub checkpointing: Checkpointing,
    /// How attention is computed: the whole (heads, T, T) probability matrix kept for
    /// backward, or FlashAttention's tiles (one log-sum-exp per row kept, the rest
    /// recomputed in backward).
    pub attention: Attention,
    /// Activation offload: each block's saved activations (all but its output, the next
    /// block's input) leave the device after its forward and come back before its
    /// backward, the next one read ahead on a thread: `host` memory (a GPU run's) or a
    /// `disk` file (the CPU backend's, whose host is its device).
    pub activation_offload: Offload,
    /// FP8 products: the blocks' four linear layers multiply inputs and weights cast to
    /// E4M3 and, in backward, output gradients cast to E5M2, each tensor with its own
    /// power-of-two scale from its amax (`delayed`: the largest of the last steps'; `current`:
    /// the cast's own), sums in f32; the rest of the model in `precision`.
    pub fp8: Fp8Recipe,
    pub checkpoint_every: u64,
    /// Validation loss after every `eval_every` steps and after the last (0: never): the
    /// mean loss on held-out data (the text's last tenth; Markov sequences drawn apart
    /// from the training ones), as many sequences as a step's global batch, forward only.
    pub eval_every: u64,
    /// Who writes a checkpoint: a writer thread while training goes on, or the training
    /// loop itself.
    pub checkpoint_write: CheckpointWrite,
    pub seed: u64,
    /// Elastic resume: start from another experiment's checkpoint, with any dp and
    /// sharding (`elastic.rs` says what must match).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub resume_from: Option<ResumeFrom>,
}

/// A checkpoint of another experiment: the state before its optimizer step `step`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(deny_unknown_fields)]
pub struct ResumeFrom {
    pub experiment: i64,
    pub step: u64,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(rename_all = "lowercase")]
pub enum LrSchedule {
    Cosine,
    Constant,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(rename_all = "lowercase")]
pub enum Optimizer {
    Adamw,
    Sgd,
    /// AdamW's direction scaled per tensor by ‖w‖/‖direction‖ (You et al. 2019).
    Lamb,
    /// SGD's step scaled per tensor by ‖w‖/(‖g‖ + wd‖w‖) (You et al. 2017), without momentum
    /// as distlab's SGD.
    Lars,
}

impl Optimizer {
    pub fn as_str(self) -> &'static str {
        match self {
            Optimizer::Adamw => "adamw",
            Optimizer::Sgd => "sgd",
            Optimizer::Lamb => "lamb",
            Optimizer::Lars => "lars",
        }
    }

    /// Whether it keeps Adam's two moments per parameter (m and v, fp32).
    pub fn keeps_moments(self) -> bool {
        matches!(self, Optimizer::Adamw | Optimizer::Lamb)
    }

    /// Whether every tensor's step is scaled by a trust ratio of its own norms (the
    /// layer-wise optimizers), which needs the norms of the whole tensor at every step.
    pub fn layer_wise(self) -> bool {
        matches!(self, Optimizer::Lamb | Optimizer::Lars)
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(rename_all = "lowercase")]
pub enum Precision {
    Fp32,
    Bf16,
    Fp16,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(rename_all = "lowercase")]
pub enum LossScaling {
    None,
    Dynamic,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(rename_all = "lowercase")]
pub enum Checkpointing {
    None,
    /// Every block's output kept, each block run again before its backward.
    Every,
    /// About sqrt(L) segment outputs kept, a segment run again before its backward.
    Sqrt,
    /// Everything kept but attention's (T, T) probabilities, which each block's backward
    /// computes again from its q and k (Korthikanti et al.'s selective recompute).
    Selective,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(rename_all = "lowercase")]
pub enum Attention {
    Naive,
    Flash,
}

/// How FP8's per-tensor scales are chosen (`train.fp8`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(rename_all = "lowercase")]
pub enum Fp8Recipe {
    /// No FP8: the products in `precision`.
    None,
    /// Transformer Engine's default: each tensor's scale from the largest amax of its last
    /// [`FP8_AMAX_HISTORY`] steps, updated after each step.
    Delayed,
    /// From each cast's own amax (one more pass over the tensor).
    Current,
}

/// Steps of amax history delayed scaling keeps per tensor.
pub const FP8_AMAX_HISTORY: usize = 16;

impl Fp8Recipe {
    /// Its name in a spec's JSON.
    pub fn as_str(self) -> &'static str {
        match self {
            Fp8Recipe::None => "none",
            Fp8Recipe::Delayed => "delayed",
            Fp8Recipe::Current => "current",
        }
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(rename_all = "lowercase")]
pub enum CheckpointWrite {
    Async,
    Sync,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(rename_all = "lowercase")]
pub enum BackendKind {
    Cpu,
    Cuda,
}

impl BackendKind {
    /// Its name in a spec's JSON.
    pub fn as_str(self) -> &'static str {
        match self {
            BackendKind::Cpu => "cpu",
            BackendKind::Cuda => "cuda",
        }
    }
}

impl Default for ExperimentSpec {
    fn default() -> Self {
        Self {
            name: "tiny-gpt".into(),
            model: ModelSpec::default(),
            data: DataSpec::default(),
            parallel: ParallelSpec::default(),
            train: TrainSpec::default(),
            backend: BackendKind::Cpu,
            demo: None,
        }
    }
}

impl Default for ModelSpec {
    fn default() -> Self {
        Self::dense(2, 64, 4, 32, 64)
    }
}

impl Default for DataSpec {
    fn default() -> Self {
        Self { dataset: Dataset::Markov, seed: 1, upload_id: None, tokenizer: TokenizerKind::Bytes }
    }
}

impl ParallelSpec {
    /// Whether sequence parallelism is in effect: asked for, with a tensor-parallel group
    /// to split the tokens over.
    pub fn splits_sequence(&self) -> bool {
        self.sequence_parallel && self.tp > 1
    }

    /// Replicas of the data: the data-parallel ranks over the context-parallel ones that
    /// share each sequence.
    pub fn data_replicas(&self) -> usize {
        self.dp / self.cp.max(1)
    }

    /// Over how many data-parallel ranks ZeRO/FSDP cut the model state: the shard group's
    /// under HSDP, the whole group's otherwise (1 without sharding).
    pub fn shard_ways(&self) -> usize {
        match self.sharding {
            Sharding::None => 1,
            Sharding::Hsdp if self.shard_group == 0 => self.ranks_per_node.max(1),
            Sharding::Hsdp => self.shard_group,
            _ => self.dp,
        }
    }
}

impl Default for ParallelSpec {
    fn default() -> Self {
        Self {
            dp: 1,
            tp: 1,
            pp: 1,
            sharding: Sharding::None,
            pp_schedule: PpSchedule::OneFOneB,
            virtual_stages: 1,
            bucket_bytes: 1 << 20,
            prefetch: false,
            comm_dtype: Precision::Fp32,
            fp8_all_gather: false,
            offload: Offload::None,
            sequence_parallel: false,
            allreduce: AllReduce::Ring,
            ranks_per_node: 2,
            grad_compression: GradCompression::None,
            compression_ratio: 0.01,
            compression_rank: 4,
            ep: 1,
            cp: 1,
            cp_kind: ContextParallel::Ulysses,
            sync: DataSync::EveryStep,
            outer_steps_every: 8,
            outer_lr: 0.7,
            outer_momentum: 0.9,
            shard_group: 0,
            fault_tolerance: FaultTolerance::None,
            fault_drill: None,
        }
    }
}

impl Default for TrainSpec {
    fn default() -> Self {
        Self {
            steps: 100,
            micro_batch: 8,
            micro_batches: 1,
            grad_accum: 1,
            lr: 3e-3,
            warmup_steps: 5,
            lr_schedule: LrSchedule::Cosine,
            optimizer: Optimizer::Adamw,
            weight_decay: 0.0,
            grad_clip: 1.0,
            precision: Precision::Fp32,
            loss_scaling: LossScaling::None,
            checkpointing: Checkpointing::None,
            checkpoint_every: 0,
            eval_every: 10,
            checkpoint_write: CheckpointWrite::Async,
            attention: Attention::Naive,
            activation_offload: Offload::None,
            fp8: Fp8Recipe::None,
            seed: 42,
            resume_from: None,
        }
    }
}

impl ModelSpec {
    /// A dense model (no experts) of this shape.
    pub const fn dense(layers: usize, d_model: usize, heads: usize, seq_len: usize, vocab: usize) -> Self {
        Self {
            family: ModelFamily::Gpt2,
            layers,
            d_model,
            heads,
            seq_len,
            vocab,
            experts: 0,
            expert_top_k: 1,
            capacity_factor: 1.25,
            aux_loss_coef: 0.01,
            kv_heads: 0,
            ffn_hidden: 0,
            tie_embeddings: false,
            rope_theta: DEFAULT_ROPE_THETA,
        }
    }

    /// A Llama-style model: RMSNorm, SwiGLU of width `ffn_hidden`, `kv_heads` key/value
    /// heads, rotary positions, untied embeddings.
    pub const fn llama(
        layers: usize,
        d_model: usize,
        heads: usize,
        kv_heads: usize,
        ffn_hidden: usize,
        seq_len: usize,
        vocab: usize,
    ) -> Self {
        let mut m = Self::dense(layers, d_model, heads, seq_len, vocab);
        m.family = ModelFamily::Llama;
        m.kv_heads = kv_heads;
        m.ffn_hidden = ffn_hidden;
        m
    }

    /// Whether the blocks' MLPs are experts.
    pub fn is_moe(&self) -> bool {
        self.experts > 0
    }

    /// Parameters of one MLP (an expert), f = d_ff: GPT-2 d x f + f, f x d + d; Llama's
    /// SwiGLU three matrices without bias, gate and up d x f, down f x d.
    pub fn mlp_params(&self) -> u64 {
        let (d, ff) = (self.d_model as u64, self.d_ff() as u64);
        match self.family {
            ModelFamily::Gpt2 => (d * ff + ff) + (ff * d + d),
            ModelFamily::Llama => 3 * d * ff,
        }
    }

    /// Key/value heads in effect: `kv_heads`, or `heads` when it is 0.
    pub fn key_value_heads(&self) -> usize {
        if self.kv_heads == 0 {
            self.heads
        } else {
            self.kv_heads
        }
    }

    /// Width of Q, K and V together: d_model for the queries and 2 x kv_heads x head width
    /// for keys and values (3 x d_model without grouped-query attention). Saturating, for
    /// head counts far beyond any that validation is about to refuse.
    pub fn qkv_width(&self) -> u64 {
        let head_width = (self.d_model / self.heads.max(1)) as u64;
        (self.key_value_heads() as u64).saturating_mul(2).saturating_mul(head_width).saturating_add(self.d_model as u64)
    }

    /// Parameters of one norm: LayerNorm's gain and bias (2d), RMSNorm's gain (d).
    pub fn norm_params(&self) -> u64 {
        let d = self.d_model as u64;
        match self.family {
            ModelFamily::Gpt2 => 2 * d,
            ModelFamily::Llama => d,
        }
    }

    /// Parameters of a block's attention: QKV (d x qkv_width) and the output projection
    /// (d x d), each with a bias in GPT-2.
    pub fn attention_params(&self) -> u64 {
        let (d, qkv) = (self.d_model as u64, self.qkv_width());
        match self.family {
            ModelFamily::Gpt2 => (d * qkv + qkv) + (d * d + d),
            ModelFamily::Llama => d * qkv + d * d,
        }
    }

    /// Parameters of a dense block that tensor parallelism splits (Megatron): QKV (with
    /// its bias), the output projection's weight, the MLP's matrices and its first bias.
    /// The norms and the row-parallel layers' biases stay whole on every rank. (0 with
    /// experts: the engine does not combine them with tensor parallelism.)
    pub fn tp_split_block_params(&self) -> u64 {
        let d = self.d_model as u64;
        let whole = match self.family {
            ModelFamily::Gpt2 => 2 * self.norm_params() + 2 * d,
            ModelFamily::Llama => 2 * self.norm_params(),
        };
        if self.is_moe() {
            0
        } else {
            self.block_params() - whole
        }
    }

    /// What an MLP keeps for backward per token (GPT-2 its hidden layer before and after
    /// GELU, 2f; Llama gate, up and their SwiGLU product, 3f), and the hidden gradients
    /// backward makes (GPT-2 f, GELU's backward in place; Llama the product's f and, beside
    /// it, the gate's and up's 2f).
    pub fn mlp_activation_widths(&self) -> (u64, u64) {
        let ff = self.d_ff() as u64;
        match self.family {
            ModelFamily::Gpt2 => (2 * ff, ff),
            ModelFamily::Llama => (3 * ff, 3 * ff),
        }
    }

    /// Width of the MLP's first matmul's output, per token: GPT-2's hidden layer f, Llama's
    /// gate and up projections side by side, 2f.
    pub fn mlp_input_width(&self) -> u64 {
        let ff = self.d_ff() as u64;
        match self.family {
            ModelFamily::Gpt2 => ff,
            ModelFamily::Llama => 2 * ff,
        }
    }

    /// Activations of one block that tensor parallelism splits, per token: Q, K, V, the
    /// attention output before its projection and the MLP's hidden values.
    pub fn tp_split_activation_width(&self) -> u64 {
        self.qkv_width() + self.d_model as u64 + self.mlp_activation_widths().0
    }

    /// Backward's split activation gradients per token: the attention output, QKV and the
    /// MLP's hidden gradients.
    pub fn tp_split_gradient_width(&self) -> u64 {
        self.qkv_width() + self.d_model as u64 + self.mlp_activation_widths().1
    }

    /// Statistics a block's two norms keep per token: LayerNorm's mean and 1/std (4),
    /// RMSNorm's 1/rms (2).
    pub fn norm_statistics(&self) -> u64 {
        match self.family {
            ModelFamily::Gpt2 => 4,
            ModelFamily::Llama => 2,
        }
    }

    /// Rows each expert takes from a micro-batch of `tokens` tokens: ceil(capacity_factor x
    /// tokens x top_k / experts), at least 1 and at most `tokens` (a token picks an expert
    /// once); 0 for a dense model.
    pub fn expert_capacity(&self, tokens: usize) -> usize {
        if !self.is_moe() {
            return 0;
        }
        let wanted = self.capacity_factor * tokens as f64 * self.expert_top_k as f64 / self.experts as f64;
        let wanted = if wanted.is_finite() { wanted.ceil().max(1.0) } else { 1.0 };
        (wanted.min(tokens as f64) as usize).max(1)
    }

    /// Width of the MLP's hidden layer: `ffn_hidden`, or the family's (GPT-2 4 x d_model;
    /// Llama 2/3 of that rounded up to a multiple of 256, as Meta's code sizes it).
    /// Saturating, for a d_model far beyond any limit that validation is about to refuse.
    pub fn d_ff(&self) -> usize {
        match (self.ffn_hidden, self.family) {
            (0, ModelFamily::Gpt2) => self.d_model.saturating_mul(4),
            (0, ModelFamily::Llama) => (self.d_model.saturating_mul(8) / 3).div_ceil(256).saturating_mul(256),
            (width, _) => width,
        }
    }

    /// Parameters of one transformer block: two norms, the attention, the MLP; with
    /// experts, the router (d x E) and E MLPs.
    pub fn block_params(&self) -> u64 {
        let d = self.d_model as u64;
        let attention = 2 * self.norm_params() + self.attention_params();
        match self.is_moe() {
            false => attention + self.mlp_params(),
            true => attention + d * self.experts as u64 + (self.experts as u64).saturating_mul(self.mlp_params()),
        }
    }

    /// Parameters of one block that one token's forward uses (its top_k experts').
    pub fn active_block_params(&self) -> u64 {
        let idle = self.experts.saturating_sub(self.expert_top_k) as u64;
        self.block_params() - idle * self.mlp_params()
    }

    /// Parameters one token's forward uses: all of them, less the experts it does not
    /// visit (E - top_k per block).
    pub fn active_param_count(&self) -> u64 {
        self.param_count() - self.layers as u64 * (self.block_params() - self.active_block_params())
    }

    /// The first stage's own parameters: the token embedding (vocab x d) and, for GPT-2,
    /// the learned positions (seq_len x d).
    pub fn embedding_params(&self) -> u64 {
        let (d, v, t) = (self.d_model as u64, self.vocab as u64, self.seq_len as u64);
        match self.family {
            ModelFamily::Gpt2 => v * d + t * d,
            ModelFamily::Llama => v * d,
        }
    }

    /// The last stage's own parameters: the final norm and the LM head (d x vocab), the
    /// head left out when it is tied to the token embedding.
    pub fn head_params(&self) -> u64 {
        let matrix = if self.tie_embeddings { 0 } else { self.d_model as u64 * self.vocab as u64 };
        self.norm_params() + matrix
    }

    /// All parameters, each counted once: embeddings, the blocks, the final norm and the
    /// LM head (when not tied).
    pub fn param_count(&self) -> u64 {
        self.embedding_params() + self.layers as u64 * self.block_params() + self.head_params()
    }

    /// Training FLOPs per token: 6 x (active) params for the matmuls (forward 2, backward 4)
    /// plus causal attention scores and weighted sum (12 x layers x seq_len x d_model,
    /// counting the full square as PyTorch's FLOP counters and the seed texts do).
    pub fn train_flops_per_token(&self) -> f64 {
        6.0 * self.active_param_count() as f64 + 12.0 * self.layers as f64 * self.seq_len as f64 * self.d_model as f64
    }
}

impl ExperimentSpec {
    /// dp x tp x pp: the number of rank processes.
    pub fn world_size(&self) -> usize {
        self.parallel.dp * self.parallel.tp * self.parallel.pp
    }

    /// The pipeline stage of global rank `rank`: ranks are numbered with tensor parallelism
    /// innermost, then pipeline stages, then data-parallel replicas.
    pub fn stage_of(&self, rank: usize) -> usize {
        (rank / self.parallel.tp.max(1)) % self.parallel.pp.max(1)
    }

    /// The same experiment whatever it is called.
    pub fn same_up_to_name(&self, other: &ExperimentSpec) -> bool {
        let mut other = other.clone();
        other.name.clone_from(&self.name);
        *self == other
    }

    /// M, the micro-batches of one pipeline flush: `micro_batches` x `grad_accum`. The engine
    /// runs every micro-batch of an optimizer step, accumulated ones included, in one
    /// schedule, so the bubble (P-1)/(M+P-1) is paid once per step with this M, and GPipe
    /// holds the activations of all M. The one definition of M everywhere (saturating: the
    /// planner takes any size).
    pub fn pipeline_micro_batches(&self) -> usize {
        self.train.micro_batches.saturating_mul(self.train.grad_accum)
    }

    /// Sequences consumed by one optimizer step (context-parallel ranks share theirs).
    pub fn global_batch(&self) -> usize {
        self.parallel.data_replicas() * self.train.micro_batch * self.train.micro_batches * self.train.grad_accum
    }

    /// Tokens consumed by one optimizer step.
    pub fn tokens_per_step(&self) -> usize {
        self.global_batch() * self.model.seq_len
    }

    /// Parses a spec from JSON, naming the field for type errors, unknown fields
    /// and unknown enum values (`parallel.sharding: unknown variant ...`).
    pub fn from_json_value(value: serde_json::Value) -> Result<Self, Vec<FieldError>> {
        serde_path_to_error::deserialize::<_, ExperimentSpec>(value).map_err(|e| {
            let path = e.path().to_string();
            let field = if path == "." { String::new() } else { path };
            vec![FieldError::new(field, e.into_inner().to_string())]
        })
    }

    /// Parses a spec from JSON text (see [`ExperimentSpec::from_json_value`]).
    pub fn from_json_str(text: &str) -> Result<Self, Vec<FieldError>> {
        let value: serde_json::Value =
            serde_json::from_str(text).map_err(|e| vec![FieldError::new("", format!("not valid JSON: {e}"))])?;
        Self::from_json_value(value)
    }
}

impl Sharding {
    pub fn as_str(self) -> &'static str {
        match self {
            Sharding::None => "none",
            Sharding::Zero1 => "zero1",
            Sharding::Zero2 => "zero2",
            Sharding::Fsdp => "fsdp",
            Sharding::Hsdp => "hsdp",
        }
    }

    /// Whether the parameters are sharded (gathered for every unit's forward and backward).
    pub fn shards_params(self) -> bool {
        matches!(self, Sharding::Fsdp | Sharding::Hsdp)
    }

    /// Whether only a shard of the gradients is kept (reduce-scattered as backward makes them).
    pub fn shards_grads(self) -> bool {
        matches!(self, Sharding::Zero2 | Sharding::Fsdp | Sharding::Hsdp)
    }
}

impl Checkpointing {
    pub fn as_str(self) -> &'static str {
        match self {
            Checkpointing::None => "none",
            Checkpointing::Every => "every",
            Checkpointing::Sqrt => "sqrt",
            Checkpointing::Selective => "selective",
        }
    }

    /// Whether backward runs whole blocks' forward again (every, sqrt), opening their
    /// parameters and repeating their tensor-parallel sums; selective recompute only
    /// recomputes attention's probabilities inside each block's backward.
    pub fn recomputes_blocks(self) -> bool {
        matches!(self, Checkpointing::Every | Checkpointing::Sqrt)
    }
}

impl Precision {
    pub fn as_str(self) -> &'static str {
        match self {
            Precision::Fp32 => "fp32",
            Precision::Bf16 => "bf16",
            Precision::Fp16 => "fp16",
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn empty_object_is_the_default_spec() {
        let spec = ExperimentSpec::from_json_str("{}").unwrap();
        assert_eq!(spec, ExperimentSpec::default());
    }

    #[test]
    fn design_md_example_parses() {
        let text = r#"{
          "name": "ddp-vs-single",
          "model":    {"layers": 4, "d_model": 128, "heads": 4, "seq_len": 64, "vocab": 256},
          "data":     {"dataset": "markov", "seed": 1},
          "parallel": {"dp": 2, "tp": 1, "pp": 1, "sharding": "zero2",
                       "pp_schedule": "1f1b", "bucket_bytes": 1048576},
          "train":    {"steps": 50, "micro_batch": 8, "micro_batches": 1, "grad_accum": 1,
                       "lr": 0.001, "warmup_steps": 5, "lr_schedule": "cosine",
                       "optimizer": "adamw", "weight_decay": 0.0, "grad_clip": 1.0,
                       "precision": "bf16", "loss_scaling": "none",
                       "checkpointing": "sqrt", "checkpoint_every": 0, "seed": 42},
          "backend":  "cpu"
        }"#;
        let spec = ExperimentSpec::from_json_str(text).unwrap();
        assert_eq!(spec.parallel.sharding, Sharding::Zero2);
        assert_eq!(spec.parallel.pp_schedule, PpSchedule::OneFOneB);
        assert_eq!(spec.train.precision, Precision::Bf16);
        assert_eq!(spec.world_size(), 2);
        assert_eq!(spec.global_batch(), 16);
        // Round trip keeps every field.
        let again = ExperimentSpec::from_json_value(serde_json::to_value(&spec).unwrap()).unwrap();
        assert_eq!(again, spec);
    }

    #[test]
    fn unknown_field_names_its_path() {
        let errs = ExperimentSpec::from_json_str(r#"{"train": {"stepz": 3}}"#).unwrap_err();
        assert_eq!(errs[0].field, "train.stepz");
        assert!(errs[0].message.contains("stepz"), "{}", errs[0].message);
    }

    #[test]
    fn unknown_enum_value_names_its_path() {
        let errs = ExperimentSpec::from_json_str(r#"{"parallel": {"sharding": "zero4"}}"#).unwrap_err();
        assert_eq!(errs[0].field, "parallel.sharding");
        assert!(errs[0].message.contains("zero4"), "{}", errs[0].message);
    }

    #[test]
    fn param_count_matches_gpt2_small() {
        // GPT-2 small (untied head, 1024 positions) = 124.4M + 38.6M head.
        let m = ModelSpec::dense(12, 768, 12, 1024, 50257);
        let tied = m.param_count() - (m.d_model * m.vocab) as u64;
        assert_eq!(tied, 124_439_808);
    }
}
