//! The GPT-2-style decoder, composed from the backend's kernels.
//!
//! ```text
//! x = wte[tokens] + wpe[positions]                      (embedding.rs)
//! for each block:  x = x + attn_proj(attention(ln1(x)))  (layernorm.rs, linear.rs, attention.rs
//!                                                         or flash_attention.rs)
//!                  x = x + fc_proj(gelu(fc(ln2(x))))      (linear.rs, mlp.rs)
//! logits = lnf(x) · lm_head                              (LM head NOT tied to wte)
//! loss = mean cross-entropy(logits, targets)             (loss.rs)
//! ```
//!
//! Parameters and gradients are laid out by [`ParamLayout`] (`layout.rs`). Where they
//! live is not the model's business: it opens one unit (embeddings, a block, the head)
//! at a time through a [`ModelState`] (`state.rs`), whole buffers for one rank or DDP,
//! gathered shards for FSDP. A micro-batch's activations are taken (and booked in the
//! memory ledger) when its forward starts and released when its backward is done, so the
//! memory a pipeline schedule holds is what the running schedule keeps alive. Released
//! sets are kept for reuse (as a caching allocator would), so a stage allocates as many
//! sets as it ever had in flight at once; the backward scratch and the recompute buffers
//! are allocated once.
//!
//! Under tensor parallelism (`parallel/tensor.rs`) each rank runs the same code on its
//! slice of every block: its heads (d/tp wide) and its 1/tp of the MLP's hidden units
//! (4d/tp), and sums the two row-parallel outputs over the group (forward), and the two
//! LayerNorm output gradients (backward). The row-parallel biases and the residual are
//! added by TP rank 0 alone, so that the sum counts them once.
//!
//! With sequence parallelism (Megatron-SP, Korthikanti et al. 2022) the LayerNorms and
//! the residual stream, whole on every TP rank above, are split along the tokens: each
//! rank normalises and keeps its own tokens (b*s/t of them). Before a column-parallel
//! matmul the LayerNorm output is all-gathered (and again in backward, for the weight
//! gradient, instead of being kept whole); after a row-parallel matmul the partial
//! outputs are reduce-scattered, each rank receiving its own tokens' sums. In backward
//! the mirror images: the output gradient gathered, the LayerNorm output gradient
//! reduce-scattered. The same bytes as the two all-reduces (an all-reduce is a
//! reduce-scatter then an all-gather), minus what the regions no longer keep whole; each
//! rank's LayerNorm parameter gradients now come from its own tokens and are summed over
//! the group.
//!
//! With activation checkpointing ([`Saved`]) forward keeps only each segment's output
//! and runs its blocks in one shared set of segment buffers; backward runs a segment's
//! forward again there, from the segment's saved input, just before the segment's
//! backward (`Pass::Recompute`).

use std::ops::Range;
use std::sync::Arc;

use distlab_common::trace::Span;
use distlab_common::{Attention, Checkpointing, ModelSpec};

use crate::backend::Backend;
use crate::comm::{CommError, InPlace, ReduceOp};
use crate::memory::{Category, MemoryTracker, Receipt};
use crate::model::experts::{
    expert_activation_floats, expert_scratch_floats, experts_backward, experts_forward, ExpertActivations, ExpertGrads,
    ExpertGroup, ExpertScratch, ExpertShape, Hidden,
};
use crate::model::layout::{BlockTensors, ExpertPlace, ParamLayout, TpPlace};
use crate::model::sequence_parallel::{
    add_pieces, gather_tokens, gathered, pieces, row_parallel_forward, sum_input_grad, Exchange, Tokens,
};
use crate::model::state::{ModelState, Pass, Unit};
use crate::trace::now_us;

/// What one block keeps from forward for backward (one micro-batch).
struct BlockActivations<Buf> {
    ln1: Buf,
    ln1_mean: Buf,
    ln1_rstd: Buf,
    qkv: Buf,
    /// Softmax probabilities, (batch, heads, T, T); with flash attention only one
    /// log-sum-exp per row, (batch, heads, T, 2).
    att: Buf,
    /// Attention output before its projection.
    atty: Buf,
    /// Residual stream after the attention half.
    res_attn: Buf,
    ln2: Buf,
    ln2_mean: Buf,
    ln2_rstd: Buf,
    /// MLP hidden layer before and after GELU (with experts: of every slot).
    fch: Buf,
    fch_gelu: Buf,
    /// Residual stream after the MLP half: the block's output.
    res_mlp: Buf,
    /// Mixture of Experts: the router's and the slots' buffers, the routing.
    moe: Option<ExpertActivations<Buf>>,
}

impl<Buf> BlockActivations<Buf> {
    fn buffers(&self) -> Vec<&Buf> {
        let mut bufs = vec![
            &self.ln1,
            &self.ln1_mean,
            &self.ln1_rstd,
            &self.qkv,
            &self.att,
            &self.atty,
            &self.res_attn,
            &self.ln2,
            &self.ln2_mean,
            &self.ln2_rstd,
            &self.fch,
            &self.fch_gelu,
            &self.res_mlp,
        ];
        bufs.extend(self.moe.iter().flat_map(ExpertActivations::buffers));
        bufs
    }
}

/// ZB-H1: what a block's B leaves for its W, the gradients of its four matmuls' outputs
/// (their inputs are activations the micro-batch keeps until the W anyway).
struct WeightStash<Buf> {
    /// d(MLP output), the gradient of `fc_proj`'s output (rows x c).
    dmlp_out: Buf,
    /// d(MLP hidden layer before GELU), of `fc`'s output (rows x 4c/tp).
    dfch: Buf,
    /// d(attention output), of `attn_proj`'s output (rows x c).
    dattn_out: Buf,
    /// d(q, k, v), of `qkv`'s output (rows x 3c/tp).
    dqkv: Buf,
}

impl<Buf> WeightStash<Buf> {
    fn buffers(&self) -> [&Buf; 4] {
        [&self.dmlp_out, &self.dfch, &self.dattn_out, &self.dqkv]
    }
}

/// What one micro-batch leaves on this stage for its backward.
struct Activations<Buf> {
    /// The stage's input: the embedding output on the first stage, what the previous
    /// stage sent on the others.
    encoded: Buf,
    /// The stage's blocks, in order (without activation checkpointing).
    blocks: Vec<BlockActivations<Buf>>,
    /// With checkpointing: the output of each segment's last block (b x s x d each; with
    /// sequence parallelism this rank's tokens, b x s/t x d).
    checkpoints: Vec<Buf>,
    /// The last stage only.
    head: Option<HeadActivations<Buf>>,
}

struct HeadActivations<Buf> {
    lnf: Buf,
    lnf_mean: Buf,
    lnf_rstd: Buf,
    /// Logits, turned into probabilities by the loss, then into their gradient.
    logits: Buf,
    losses: Buf,
}

impl<Buf> Activations<Buf> {
    /// The stage's output: its last block's (or, with no blocks, its input).
    fn output(&self) -> &Buf {
        stage_output(&self.checkpoints, &self.blocks, &self.encoded)
    }
}

/// [`Activations::output`] from the fields, for callers that hold `head` mutably.
fn stage_output<'a, Buf>(checkpoints: &'a [Buf], blocks: &'a [BlockActivations<Buf>], encoded: &'a Buf) -> &'a Buf {
    checkpoints.last().or(blocks.last().map(|b| &b.res_mlp)).unwrap_or(encoded)
}

/// The part of the model one pipeline stage runs: a run of blocks (interleaved: v chunks
/// of them), plus the embeddings on the first stage and the final LayerNorm, LM head and
/// loss on the last.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Stage {
    /// Its chunks of consecutive blocks, in model order (one but for interleaved).
    pub chunks: Vec<Range<usize>>,
    /// Holds the embeddings: its first chunk starts the model.
    pub first: bool,
    /// Holds the final LayerNorm, LM head and loss: its last chunk ends the model.
    pub last: bool,
    /// Every block of the model in parameter-buffer order (0..L but for interleaved,
    /// where each stage's chunks sit side by side: `ParamLayout::with_block_order`).
    pub block_order: Vec<usize>,
}

impl Stage {
    /// The whole model (no pipeline parallelism).
    pub fn whole(layers: usize) -> Stage {
        #[allow(clippy::single_range_in_vec_init)] // one chunk of blocks 0..layers
        let chunks = vec![0..layers];
        Stage { chunks, first: true, last: true, block_order: (0..layers).collect() }
    }

    /// Its blocks, chunk after chunk.
    pub fn blocks(&self) -> impl Iterator<Item = usize> + '_ {
        self.chunks.iter().flat_map(Range::clone)
    }

    pub fn block_count(&self) -> usize {
        self.chunks.iter().map(Range::len).sum()
    }

    /// Whether chunk `chunk` starts from the tokens (the embeddings run before it).
    pub fn starts_model(&self, chunk: usize) -> bool {
        self.first && chunk == 0
    }

    /// Whether chunk `chunk` ends in the head and the loss.
    pub fn ends_model(&self, chunk: usize) -> bool {
        self.last && chunk + 1 == self.chunks.len()
    }

    /// The contiguous run of the parameter buffer this stage's units cover.
    pub fn range(&self, layout: &ParamLayout) -> Range<usize> {
        let units = self.units();
        match (units.first(), units.last()) {
            (Some(first), Some(last)) => first.range(layout).start..last.range(layout).end,
            _ => 0..0,
        }
    }

    /// The units (in buffer order) whose parameters this stage holds.
    pub fn units(&self) -> Vec<Unit> {
        let mut units = Vec::new();
        if self.first {
            units.push(Unit::Embeddings);
        }
        units.extend(self.blocks().map(Unit::Block));
        if self.last {
            units.push(Unit::Head);
        }
        units
    }
}

/// What forward saves for backward: every activation, or (activation checkpointing)
/// only some blocks' outputs; the attention's probabilities, or (flash attention) one
/// log-sum-exp per row.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Saved {
    pub checkpointing: Checkpointing,
    pub attention: Attention,
    /// Sequence parallelism: the LayerNorm and residual regions keep this rank's tokens only.
    pub sequence_parallel: bool,
    /// ZB-H1: backward runs as B (`backward_stage`), which keeps each matmul's output
    /// gradient, and W (`weights_stage`), which turns them into weight gradients.
    pub split_backward: bool,
}

impl Default for Saved {
    fn default() -> Self {
        Saved {
            checkpointing: Checkpointing::None,
            attention: Attention::Naive,
            sequence_parallel: false,
            split_backward: false,
        }
    }
}

impl Saved {
    /// Blocks per recomputed segment on a stage of `blocks` blocks: every block its own
    /// segment, or about sqrt(blocks) of them (ceil), keeping one output per segment
    /// (Chen et al. 2016: sqrt(L) memory for one extra forward).
    pub fn segment(&self, blocks: usize) -> Option<usize> {
        match self.checkpointing {
            Checkpointing::None => None,
            Checkpointing::Every => Some(1),
            Checkpointing::Sqrt => Some(ceil_sqrt(blocks).max(1)),
        }
    }
}

fn ceil_sqrt(n: usize) -> usize {
    let r = n.isqrt();
    if r * r < n {
        r + 1
    } else {
        r
    }
}

/// What a stage's forward starts from.
pub enum StageInput<'a, F> {
    /// The first stage: token ids.
    Tokens(&'a [u32]),
    /// The other stages: the previous stage's output activation.
    Activation(&'a [F]),
}

/// What a tensor-parallel collective carries (the timeline names it).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TpPoint {
    /// The row-parallel outputs: summed (g: all-reduce), or with sequence parallelism
    /// reduce-scattered to the ranks that own the tokens.
    AttentionOutput,
    MlpOutput,
    /// The gradients of the LayerNorm outputs, through each rank's heads or hidden units:
    /// summed (f: all-reduce), or reduce-scattered.
    Ln1OutputGrad,
    Ln2OutputGrad,
    /// Sequence parallelism: the LayerNorm outputs gathered for a column-parallel matmul
    /// (in forward, and again in backward for its weight gradient).
    Ln1Output,
    Ln2Output,
    /// Sequence parallelism: the row-parallel outputs' gradients gathered.
    AttentionOutputGrad,
    MlpOutputGrad,
    /// Sequence parallelism: a block's LayerNorm parameter gradients, each rank's from its
    /// own tokens, summed.
    LayerNormGrads,
    /// Sequence parallelism: the final LayerNorm's output gathered for the LM head, its
    /// parameter gradients summed, and the embedding output's gradient gathered.
    LnfOutput,
    LnfGrads,
    EmbeddingOutputGrad,
}

impl TpPoint {
    /// What it carries, in words.
    pub fn tensor(self) -> &'static str {
        match self {
            TpPoint::AttentionOutput => "attention output",
            TpPoint::MlpOutput => "MLP output",
            TpPoint::Ln1OutputGrad => "ln1 output gradient",
            TpPoint::Ln2OutputGrad => "ln2 output gradient",
            TpPoint::Ln1Output => "ln1 output",
            TpPoint::Ln2Output => "ln2 output",
            TpPoint::AttentionOutputGrad => "attention output gradient",
            TpPoint::MlpOutputGrad => "MLP output gradient",
            TpPoint::LayerNormGrads => "LayerNorm parameter gradients",
            TpPoint::LnfOutput => "final LayerNorm output",
            TpPoint::LnfGrads => "final LayerNorm parameter gradients",
            TpPoint::EmbeddingOutputGrad => "embedding output gradient",
        }
    }
}

/// A tensor-parallel group as the model sees it (`parallel/tensor.rs` has the real one).
pub trait TensorParallelGroup<B: Backend>: Send {
    fn place(&self) -> TpPlace;
    /// Runs `op` over the group on `buf`, in place (an all-gather fills every rank's chunk
    /// from each rank's own; a reduce-scatter leaves each rank its chunk's sum). `layer`:
    /// the block it belongs to (None: the embeddings or the head).
    fn collective(
        &mut self,
        be: &B,
        buf: &mut B::Buf,
        op: InPlace,
        point: TpPoint,
        layer: Option<usize>,
    ) -> Result<(), CommError>;
    /// Sums a scalar over the group (the gradient norm's squares).
    fn sum_scalar(&mut self, value: f64) -> Result<f64, CommError>;
    /// Before a step: whether to record its collectives on the timeline.
    fn begin_step(&mut self, step: u64, record: bool);
    /// The collectives recorded so far.
    fn spans(&self) -> Vec<Span>;
    /// (collectives, payload bytes summed, bytes this rank sent) since the start.
    fn totals(&self) -> (u64, u64, u64);
    /// The rank's memory ledger, for what the group's collectives allocate.
    fn attach_memory(&mut self, memory: &Arc<MemoryTracker>);
}

/// Activation gradients, shared by all blocks (backward visits one block at a time).
struct GradScratch<Buf> {
    /// Gradient of the residual stream.
    dres: Buf,
    /// Gradient of a LayerNorm output.
    dln: Buf,
    datty: Buf,
    dqkv: Buf,
    /// The probabilities' gradient (batch, heads, T, T); with flash attention the
    /// per-row rowsum(dO ∘ O), (batch, heads, T, 2).
    datt: Buf,
    /// The MLP hidden layer's gradient (with experts: of every slot).
    dfch: Buf,
    /// Mixture of Experts: the slots' and the router's gradients.
    experts: Option<ExpertScratch<Buf>>,
}

/// The sizes of one micro-batch's [`Activations`] on this rank.
#[derive(Clone, Copy, Debug)]
struct ActivationShape {
    batch: usize,
    rows: usize,
    /// Rows of the LayerNorm and residual regions this rank keeps: all of them, or with
    /// sequence parallelism its own tokens' (rows / tp).
    res_rows: usize,
    t: usize,
    c: usize,
    /// This rank's width of the attention (its heads) and of the MLP's hidden layer.
    cl: usize,
    heads: usize,
    hidden: usize,
    vocab: usize,
    /// Blocks whose activations are all kept (none with checkpointing).
    kept_blocks: usize,
    /// Segment outputs kept (checkpointing).
    checkpoints: usize,
    last: bool,
    attention: Attention,
    /// Mixture of Experts (None: dense blocks).
    experts: Option<ExpertShape>,
}

impl ActivationShape {
    /// Rows of the MLP's hidden layer: the tokens, or with experts every slot.
    fn mlp_rows(&self) -> usize {
        self.experts.map_or(self.rows, |e| e.slots())
    }

    /// Elements of the attention's saved tensor (and of its gradient scratch).
    fn attention_floats(&self) -> usize {
        attention_floats(self.batch, self.heads, self.t, self.attention)
    }

    /// One block's buffers, each from `alloc(floats)`.
    fn block<Buf>(&self, alloc: &mut dyn FnMut(usize) -> Buf) -> BlockActivations<Buf> {
        let (rows, own, c, cl, hidden) = (self.rows, self.res_rows, self.c, self.cl, self.hidden);
        BlockActivations {
            ln1: alloc(own * c),
            ln1_mean: alloc(own),
            ln1_rstd: alloc(own),
            qkv: alloc(rows * 3 * cl),
            att: alloc(self.attention_floats()),
            atty: alloc(rows * cl),
            res_attn: alloc(own * c),
            ln2: alloc(own * c),
            ln2_mean: alloc(own),
            ln2_rstd: alloc(own),
            fch: alloc(self.mlp_rows() * hidden),
            fch_gelu: alloc(self.mlp_rows() * hidden),
            res_mlp: alloc(own * c),
            moe: self.experts.map(|e| ExpertActivations::new(&e, rows, c, alloc)),
        }
    }

    /// Everything one micro-batch's forward leaves for its backward.
    fn set<Buf>(&self, alloc: &mut dyn FnMut(usize) -> Buf) -> Activations<Buf> {
        let (rows, own, c) = (self.rows, self.res_rows, self.c);
        Activations {
            encoded: alloc(own * c),
            blocks: (0..self.kept_blocks).map(|_| self.block(alloc)).collect(),
            checkpoints: (0..self.checkpoints).map(|_| alloc(own * c)).collect(),
            // The final LayerNorm's output is whole (gathered, with sequence parallelism)
            // for the LM head, which every TP rank runs in full.
            head: self.last.then(|| HeadActivations {
                lnf: alloc(rows * c),
                lnf_mean: alloc(own),
                lnf_rstd: alloc(own),
                logits: alloc(rows * self.vocab),
                losses: alloc(rows),
            }),
        }
    }

    /// Floats of one [`Self::set`].
    fn set_floats(&self) -> usize {
        let mut floats = 0;
        self.set(&mut |len| floats += len);
        floats
    }
}

/// One micro-batch in flight through one of this stage's chunks: its activations, booked
/// in the ledger until its backward is done (ZB-H1: until its W, with what the B left).
struct InFlight<Buf> {
    chunk: usize,
    micro: usize,
    acts: Activations<Buf>,
    _booked: Receipt,
    /// ZB-H1, between the B and the W: one stash per block of the chunk, booked.
    stash: Option<(Vec<WeightStash<Buf>>, Receipt)>,
}

/// A GPT (or the stage of it this rank runs) on backend `B`: its layout and the
/// activations of the micro-batches (of `batch` sequences) in flight (parameters and
/// gradients live in a [`ModelState`]).
pub struct Gpt<B: Backend> {
    pub spec: ModelSpec,
    /// Sequences per micro-batch (activations are sized for this).
    pub batch: usize,
    pub layout: ParamLayout,
    pub stage: Stage,
    /// The micro-batches between their forward and the end of their backward.
    in_flight: Vec<InFlight<B::Buf>>,
    /// Sets whose backward is done (with the chunk they fit), kept for the next forward
    /// instead of being freed and allocated again (what a caching allocator does: no
    /// longer booked in the ledger, still on the heap, so between steps they show as
    /// "untracked").
    spare: Vec<(usize, Activations<B::Buf>)>,
    /// ZB-H1: stashes whose W is done, kept for the next B like `spare`.
    spare_stashes: Vec<Vec<WeightStash<B::Buf>>>,
    /// ZB-H1: backward runs as B and W (see [`Saved::split_backward`]).
    split_backward: bool,
    /// The sizes of one micro-batch's activations through each chunk.
    shapes: Vec<ActivationShape>,
    /// Floats of one micro-batch's activations through each chunk (what its forward books).
    set_floats: Vec<usize>,
    memory: Arc<MemoryTracker>,
    /// Activation checkpointing: blocks per segment (None: keep every activation).
    segment: Option<usize>,
    /// With checkpointing: one segment's block activations, shared by every micro-batch
    /// (forward runs each block here; backward recomputes a segment here).
    recompute: Vec<BlockActivations<B::Buf>>,
    scratch: GradScratch<B::Buf>,
    /// The memory ledger's record of the recompute and scratch buffers.
    receipts: Vec<Receipt>,
    /// Tensor parallelism (None: this rank holds every block whole).
    tp: Option<Box<dyn TensorParallelGroup<B>>>,
    /// Sequence parallelism's buffers (None without it).
    exchange: Option<Exchange<B::Buf>>,
    /// Expert parallelism (None: every expert on this rank, or a dense model).
    ep: ExpertGroup<B>,
    /// The routing of the forwards since the last [`Gpt::take_expert_stats`].
    expert_stats: ExpertStats,
    /// The first backward since the last [`Gpt::take_logit_grad_zeros`]: of the logit
    /// gradients sampled, how many were stored as 0.
    logit_grad_zeros: Option<LogitGradZeros>,
    /// When timing (see [`Gpt::time_recomputes`]): the forwards a backward ran again
    /// inside a block's own backward (each checkpointed segment's last block).
    recomputes_timed: Option<Vec<RecomputeTime>>,
}

/// A block's forward run again inside its backward, timed apart from the backward.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct RecomputeTime {
    pub layer: usize,
    pub start_us: u64,
    pub end_us: u64,
}

/// Logit gradients stored as exactly 0: in exact arithmetic none is (every softmax
/// probability is above 0), so in fp16 these are the ones that underflowed.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct LogitGradZeros {
    pub zeros: u64,
    pub sampled: u64,
}

/// The logit gradient's first rows (tokens) are counted, enough to see the share.
const LOGIT_SAMPLE_ROWS: usize = 64;

/// The groups of ranks the model itself runs collectives in (the strategies have theirs).
pub struct ModelGroups<B: Backend> {
    /// Tensor parallelism (None: this rank holds every block whole).
    pub tp: Option<Box<dyn TensorParallelGroup<B>>>,
    /// Expert parallelism (None: every expert on this rank, or a dense model).
    pub ep: ExpertGroup<B>,
}

impl<B: Backend> ModelGroups<B> {
    /// One rank holding the whole model.
    pub fn alone() -> Self {
        ModelGroups { tp: None, ep: None }
    }
}

/// What the routers did: summed over blocks and micro-batches (and, in a step's metrics,
/// over the ranks).
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct ExpertStats {
    /// The sum of every routing's balance loss (1: balanced).
    pub balance_sum: f64,
    /// Routings (blocks x micro-batches).
    pub routings: u64,
    /// Token-to-expert assignments the routers made, and those dropped for capacity.
    pub assignments: u64,
    pub dropped: u64,
}

impl ExpertStats {
    /// Counts one block's routing of one micro-batch (nothing for a dense block).
    fn add<Buf>(&mut self, moe: Option<&ExpertActivations<Buf>>) {
        if let Some(r) = moe.map(|m| &m.routing) {
            self.balance_sum += r.balance;
            self.routings += 1;
            self.assignments += r.chosen.iter().map(|&n| u64::from(n)).sum::<u64>();
            self.dropped += r.dropped as u64;
        }
    }
}

impl<B: Backend> Gpt<B> {
    /// The whole model, activations for one micro-batch at a time.
    pub fn new(be: &B, spec: &ModelSpec, batch: usize, memory: &Arc<MemoryTracker>) -> Self {
        Self::new_stage(be, spec, batch, Stage::whole(spec.layers), Saved::default(), ModelGroups::alone(), memory)
    }

    /// `stage` of the model (this rank's slice of it with `tp`), saving activations as
    /// `saved` says. The recompute and scratch buffers are allocated here and registered
    /// with `memory`; each micro-batch's activations when its forward starts.
    pub fn new_stage(
        be: &B,
        spec: &ModelSpec,
        batch: usize,
        stage: Stage,
        saved: Saved,
        groups: ModelGroups<B>,
        memory: &Arc<MemoryTracker>,
    ) -> Self {
        let ModelGroups { tp, ep } = groups;
        // (an interleaved stage's chunks are alike)
        let chunk_blocks = stage.chunks.iter().map(Range::len).max().unwrap_or(0);
        let segment = saved.segment(chunk_blocks);
        let mut tp = tp;
        if let Some(group) = tp.as_mut() {
            group.attach_memory(memory);
        }
        let place = tp.as_ref().map_or(TpPlace::ALONE, |g| g.place());
        let mut ep = ep;
        if let Some(group) = ep.as_mut() {
            group.attach_memory(memory);
        }
        let experts = ep.as_ref().map_or(ExpertPlace::ALONE, |g| g.place());
        let layout = match spec.is_moe() {
            true => ParamLayout::for_experts(spec, experts, &stage.block_order),
            false => ParamLayout::with_block_order(spec, place, &stage.block_order),
        };
        let n = place.size;
        let sequence_parallel = saved.sequence_parallel && n > 1;
        let rows = batch * spec.seq_len;
        assert!(
            !sequence_parallel || rows.is_multiple_of(n),
            "sequence parallelism splits {rows} tokens over tp={n}: validation lets only multiples through"
        );
        let shape = ActivationShape {
            batch,
            rows,
            res_rows: if sequence_parallel { rows / n } else { rows },
            t: spec.seq_len,
            c: spec.d_model,
            cl: spec.d_model / n,
            heads: spec.heads / n,
            hidden: 4 * spec.d_model / n,
            vocab: spec.vocab,
            kept_blocks: 0,
            checkpoints: 0,
            last: false,
            attention: saved.attention,
            experts: ExpertShape::of(spec, rows, experts.size),
        };
        let shapes: Vec<ActivationShape> = (0..stage.chunks.len())
            .map(|chunk| {
                let blocks = stage.chunks[chunk].len();
                let (kept_blocks, checkpoints) = match segment {
                    None => (blocks, 0),
                    Some(k) => (0, blocks.div_ceil(k)),
                };
                ActivationShape { kept_blocks, checkpoints, last: stage.ends_model(chunk), ..shape }
            })
            .collect();
        let (rows, c, cl, hidden) = (shape.rows, shape.c, shape.cl, shape.hidden);
        let mlp_rows = rows.max(shape.mlp_rows());
        let mut floats = 0usize;
        let mut receipts = Vec::new();
        let mut alloc = |category: Category, len: usize| {
            floats += len;
            receipts.push(memory.alloc_of::<B::Elem>(category, len));
            be.alloc(len)
        };
        let recompute =
            (0..segment.unwrap_or(0)).map(|_| shape.block(&mut |len| alloc(Category::Activations, len))).collect();
        let scratch = GradScratch {
            dres: alloc(Category::ActivationGrads, shape.res_rows * c),
            dln: alloc(Category::ActivationGrads, rows * c),
            datty: alloc(Category::ActivationGrads, rows * cl),
            dqkv: alloc(Category::ActivationGrads, rows * 3 * cl),
            datt: alloc(Category::ActivationGrads, shape.attention_floats()),
            dfch: alloc(Category::ActivationGrads, mlp_rows * hidden),
            experts: shape
                .experts
                .map(|e| ExpertScratch::new(&e, rows, c, &mut |len| alloc(Category::ActivationGrads, len))),
        };
        let exchange = sequence_parallel.then(|| Exchange {
            gathered: alloc(Category::Activations, rows * c),
            full: alloc(Category::Activations, rows * c),
            ln_grads: alloc(Category::ActivationGrads, 4 * c),
            lnf_grads: stage.last.then(|| alloc(Category::ActivationGrads, 2 * c)),
        });
        let set_floats: Vec<usize> = shapes.iter().map(ActivationShape::set_floats).collect();
        if stage == Stage::whole(spec.layers) && segment.is_none() {
            let expected =
                Self::activation_floats_for(spec, batch, (n, experts.size), saved.attention, sequence_parallel);
            debug_assert_eq!(floats + set_floats[0], expected);
        }
        Self {
            spec: spec.clone(),
            batch,
            layout,
            stage,
            in_flight: Vec::new(),
            spare: Vec::new(),
            spare_stashes: Vec::new(),
            split_backward: saved.split_backward,
            shapes,
            set_floats,
            memory: memory.clone(),
            segment,
            recompute,
            scratch,
            receipts,
            tp,
            exchange,
            ep,
            expert_stats: ExpertStats::default(),
            logit_grad_zeros: None,
            recomputes_timed: None,
        }
    }

    /// Micro-batch `micro`'s forward through chunk `chunk` starts: its activations are
    /// allocated and booked (a forward run again before its backward, as a
    /// finite-difference check does, reuses them).
    fn take_activations(&mut self, be: &B, chunk: usize, micro: usize) {
        if let Some(i) = self.in_flight.iter().position(|f| (f.chunk, f.micro) == (chunk, micro)) {
            let last = self.in_flight.len() - 1;
            self.in_flight.swap(i, last);
            return;
        }
        let booked = self.memory.alloc_of::<B::Elem>(Category::Activations, self.set_floats[chunk]);
        let shape = self.shapes[chunk];
        let acts = match self.spare.iter().position(|(c, _)| *c == chunk) {
            Some(i) => self.spare.swap_remove(i).1,
            None => shape.set(&mut |len| be.alloc(len)),
        };
        self.in_flight.push(InFlight { chunk, micro, acts, _booked: booked, stash: None });
    }

    /// ZB-H1: the stashes a B of `blocks` blocks fills (one per block), booked as
    /// activations until its W.
    fn take_stash(&mut self, be: &B, blocks: usize) -> (Vec<WeightStash<B::Buf>>, Receipt) {
        let ActivationShape { rows, c, cl, hidden, .. } = self.shapes[0];
        let floats = rows * (2 * c + 3 * cl + hidden);
        let booked = self.memory.alloc_of::<B::Elem>(Category::Activations, blocks * floats);
        let mut stash = self.spare_stashes.pop().unwrap_or_default();
        stash.truncate(blocks);
        while stash.len() < blocks {
            stash.push(WeightStash {
                dmlp_out: be.alloc(rows * c),
                dfch: be.alloc(rows * hidden),
                dattn_out: be.alloc(rows * c),
                dqkv: be.alloc(rows * 3 * cl),
            });
        }
        (stash, booked)
    }

    /// ZB-H1's W of `index` is over: its activations and stash are released from the
    /// ledger and kept for the next forward and B.
    fn release(&mut self, index: usize) {
        let done = self.in_flight.swap_remove(index);
        self.spare.push((done.chunk, done.acts));
        if let Some((stash, _booked)) = done.stash {
            self.spare_stashes.push(stash);
        }
    }

    /// Forgets every micro-batch's activations (an evaluation's forward, which no backward
    /// follows): released from the ledger and kept for the next forward.
    pub fn drop_activations(&mut self) {
        while !self.in_flight.is_empty() {
            self.release(self.in_flight.len() - 1);
        }
    }

    /// Where the activations of micro-batch `micro` through chunk `chunk` are (its forward
    /// ran, its backward has not).
    fn activations_of(&self, chunk: usize, micro: usize) -> usize {
        self.in_flight.iter().position(|f| (f.chunk, f.micro) == (chunk, micro)).unwrap_or_else(|| {
            panic!("micro-batch {micro} has no activations in chunk {chunk}: backward before forward")
        })
    }

    /// After a forward of the whole model on micro-batch 0 (and before its backward): the
    /// next-token probabilities at every position, (batch * seq_len, vocab) — the loss
    /// turns the logits into them in place.
    pub fn probabilities(&self) -> Option<&B::Buf> {
        let f = self.in_flight.iter().find(|f| (f.chunk, f.micro) == (0, 0))?;
        f.acts.head.as_ref().map(|head| &head.logits)
    }

    /// Micro-batches whose activations this stage holds now.
    pub fn micro_batches_in_flight(&self) -> usize {
        self.in_flight.len()
    }

    /// Bytes of every buffer the model holds in use (spare activation sets aside),
    /// counted from the buffers themselves (what the memory ledger must agree with).
    pub fn held_bytes(&self, be: &B) -> u64 {
        let s = &self.scratch;
        let block = BlockActivations::buffers;
        let mut bufs = Vec::new();
        bufs.extend(self.recompute.iter().flat_map(block));
        bufs.extend([&s.dres, &s.dln, &s.datty, &s.dqkv, &s.datt, &s.dfch]);
        bufs.extend(s.experts.iter().flat_map(ExpertScratch::buffers));
        if let Some(e) = &self.exchange {
            bufs.extend([&e.gathered, &e.full, &e.ln_grads]);
            bufs.extend(e.lnf_grads.iter());
        }
        debug_assert_eq!(bufs.len(), self.receipts.len());
        for a in self.in_flight.iter().map(|f| &f.acts) {
            bufs.push(&a.encoded);
            if let Some(h) = &a.head {
                bufs.extend([&h.lnf, &h.lnf_mean, &h.lnf_rstd, &h.logits, &h.losses]);
            }
            bufs.extend(a.blocks.iter().flat_map(block));
            bufs.extend(a.checkpoints.iter());
        }
        for (stash, _) in self.in_flight.iter().filter_map(|f| f.stash.as_ref()) {
            bufs.extend(stash.iter().flat_map(WeightStash::buffers));
        }
        bufs.iter().map(|b| (be.buf_len(b) * std::mem::size_of::<B::Elem>()) as u64).sum()
    }

    /// What [`Gpt::new`] will allocate for activations and their gradients on one of `tp`
    /// tensor-parallel ranks (with `sequence_parallel`, its share of the LayerNorm and
    /// residual regions) and one of `ep` expert-parallel ranks, without allocating
    /// (saturating, so absurd specs give a huge number, not an overflow).
    pub fn activation_floats_for(
        spec: &ModelSpec,
        batch: usize,
        (tp, ep): (usize, usize),
        attention: Attention,
        sequence_parallel: bool,
    ) -> usize {
        let n = tp.max(1);
        let (t, c, v, h, l) = (spec.seq_len, spec.d_model, spec.vocab, spec.heads / n, spec.layers);
        let rows = batch.saturating_mul(t);
        let own = if sequence_parallel && n > 1 { rows / n } else { rows };
        let att = attention_floats(batch, h, t, attention);
        let rc = rows.saturating_mul(c);
        let own_c = own.saturating_mul(c);
        let split = rows.saturating_mul(c / n);
        // per block: ln1, res_attn, ln2, res_mlp (own rows x c); qkv (3c/tp), atty (c/tp),
        // fch, fch_gelu (4c/tp); 4 row statistics (mean, rstd of two LayerNorms, own rows);
        // attention probabilities of this rank's heads (a log-sum-exp pair per row with flash)
        let block = own_c
            .saturating_mul(4)
            .saturating_add(split.saturating_mul(3 + 1 + 8))
            .saturating_add(own.saturating_mul(4))
            .saturating_add(att);
        // encoded (own rows), lnf (rows x c), lnf statistics (own rows), logits, losses
        let top = own_c
            .saturating_add(rc)
            .saturating_add(own.saturating_mul(2))
            .saturating_add(rows)
            .saturating_add(rows.saturating_mul(v));
        // backward scratch: dres (own rows), dln (c), datty (c/tp), dqkv (3c/tp), dfch
        // (4c/tp), datt (the size of att); sequence parallelism's exchange buffers (two
        // rows x c) and LayerNorm gradient scratch (4c + 2c)
        let scratch = own_c.saturating_add(rc).saturating_add(split.saturating_mul(1 + 3 + 4)).saturating_add(att);
        let exchange = if own < rows { rc.saturating_mul(2).saturating_add(6 * c) } else { 0 };
        // Mixture of Experts (tp = 1): the hidden layers of every slot in place of every
        // token's, the router's and the slots' buffers, and their gradients.
        let (block, scratch) = match ExpertShape::of(spec, rows, ep) {
            None => (block, scratch),
            Some(e) => {
                let dense_hidden = rows.saturating_mul(4 * c);
                let block =
                    block.saturating_sub(2 * dense_hidden).saturating_add(expert_activation_floats(&e, rows, c));
                let dfch = rows.max(e.slots()).saturating_mul(4 * c);
                let scratch = scratch.saturating_sub(dense_hidden).saturating_add(dfch);
                (block, scratch.saturating_add(expert_scratch_floats(&e, rows, c)))
            }
        };
        block.saturating_mul(l).saturating_add(top).saturating_add(scratch).saturating_add(exchange)
    }

    /// The routing of every forward since the last call (not the recomputed ones), and
    /// starts counting again.
    pub fn take_expert_stats(&mut self) -> ExpertStats {
        std::mem::take(&mut self.expert_stats)
    }

    /// Times the next backwards' in-backward recomputes (or stops timing them); the
    /// trainer reads them with [`Gpt::take_recompute_times`] to draw them apart from the
    /// backward spans around them.
    pub fn time_recomputes(&mut self, on: bool) {
        self.recomputes_timed = on.then(Vec::new);
    }

    pub fn take_recompute_times(&mut self) -> Vec<RecomputeTime> {
        self.recomputes_timed.as_mut().map(std::mem::take).unwrap_or_default()
    }

    /// The logit gradients stored as 0 in the first backward since the last call (None on
    /// a rank without the LM head), and starts counting again.
    pub fn take_logit_grad_zeros(&mut self) -> Option<LogitGradZeros> {
        self.logit_grad_zeros.take()
    }

    /// The expert-parallel group, if any (the trainer starts its steps, sums the gradient
    /// norm's expert part over it and reads its spans).
    pub fn expert_parallel(&mut self) -> Option<&mut (dyn crate::model::experts::ExpertParallelGroup<B> + 'static)> {
        self.ep.as_deref_mut()
    }

    /// The all-to-alls the expert-parallel group recorded (None without one).
    pub fn ep_spans(&self) -> Option<Vec<Span>> {
        self.ep.as_ref().map(|g| g.spans())
    }

    /// The collectives the tensor-parallel group recorded (None without one).
    pub fn tp_spans(&self) -> Option<Vec<Span>> {
        self.tp.as_ref().map(|g| g.spans())
    }

    /// The tensor-parallel group, if any (the trainer starts its steps and reads its spans).
    pub fn tensor_parallel(&mut self) -> Option<&mut (dyn TensorParallelGroup<B> + 'static)> {
        self.tp.as_deref_mut()
    }

    /// Runs the whole model on `batch` sequences (`inputs`, `targets`: batch * seq_len
    /// tokens) with the parameters of `state` and returns the SUM of the per-token losses.
    pub fn forward(
        &mut self,
        be: &B,
        state: &mut dyn ModelState<B>,
        inputs: &[u32],
        targets: &[u32],
    ) -> Result<f64, CommError> {
        self.forward_stage(be, state, 0, 0, StageInput::Tokens(inputs), targets)
    }

    /// Runs this stage's chunk `chunk` on micro-batch `micro`, keeping what backward needs
    /// in activations allocated for it. Where the chunk ends the model returns the SUM of
    /// the per-token losses (`targets`); elsewhere 0, and the output for the next chunk is
    /// `output(chunk, micro)`.
    pub fn forward_stage(
        &mut self,
        be: &B,
        state: &mut dyn ModelState<B>,
        chunk: usize,
        micro: usize,
        input: StageInput<'_, B::Elem>,
        targets: &[u32],
    ) -> Result<f64, CommError> {
        let ModelSpec { seq_len: t, d_model: c, vocab, .. } = self.spec;
        let dims = self.dims();
        self.take_activations(be, chunk, micro);
        let mut upcoming = Upcoming::new(self.forward_opens(chunk));
        let lay = &self.layout;
        let acts = &mut self.in_flight.last_mut().expect("taken above").acts;

        match input {
            StageInput::Tokens(inputs) => {
                assert_eq!(inputs.len(), self.batch * t, "inputs must hold batch * seq_len tokens");
                upcoming.before_open(state, Unit::Embeddings, Pass::Forward);
                let (p, at) = state.open(be, Unit::Embeddings, Pass::Forward)?.params.expect("forward has parameters");
                // With sequence parallelism every rank embeds every token (the embeddings
                // are replicated) and keeps its own.
                let out = match &mut self.exchange {
                    Some(e) => &mut e.full,
                    None => &mut acts.encoded,
                };
                be.encoder_forward(
                    be.all_mut(out),
                    inputs,
                    be.view(p, shift(&lay.wte, at)),
                    be.view(p, shift(&lay.wpe, at)),
                    t,
                    c,
                );
                if let (Some(e), Some(mine)) = (&self.exchange, dims.mine) {
                    be.copy(be.all_mut(&mut acts.encoded), be.view(&e.full, mine.of(c)));
                }
                state.close(be, Unit::Embeddings, Pass::Forward)?;
            }
            StageInput::Activation(x) => be.upload(&mut acts.encoded, x),
        }
        let blocks = self.stage.chunks[chunk].len();
        for (i, l) in self.stage.chunks[chunk].clone().enumerate() {
            upcoming.before_open(state, Unit::Block(l), Pass::Forward);
            let (p, at) = state.open(be, Unit::Block(l), Pass::Forward)?.params.expect("forward has parameters");
            let w = lay.blocks[l].map(|r| be.view(p, shift(r, at)));
            match self.segment {
                // Keep everything: block i's activations live in the slot.
                None => {
                    let (done, rest) = acts.blocks.split_at_mut(i);
                    let x = done.last().map_or(&acts.encoded, |prev| &prev.res_mlp);
                    let (tp, exchange, ep) = (&mut self.tp, &mut self.exchange, &mut self.ep);
                    block_forward(be, &w, x, &mut rest[0], dims, tp, exchange, ep, l)?;
                    self.expert_stats.add(rest[0].moe.as_ref());
                }
                // Checkpointing: run the block in the shared segment buffers and keep only
                // the output of each segment's last block.
                Some(k) => {
                    let (tp, exchange, ep) = (&mut self.tp, &mut self.exchange, &mut self.ep);
                    segment_block_forward(be, &w, acts, &mut self.recompute, i, k, dims, tp, exchange, ep, l)?;
                    self.expert_stats.add(self.recompute[i % k].moe.as_ref());
                    if i % k == k - 1 || i == blocks - 1 {
                        be.copy(be.all_mut(&mut acts.checkpoints[i / k]), be.all(&self.recompute[i % k].res_mlp));
                    }
                }
            }
            state.close(be, Unit::Block(l), Pass::Forward)?;
        }
        let Some(head) = acts.head.as_mut() else { return Ok(0.0) };
        let last = stage_output(&acts.checkpoints, &acts.blocks, &acts.encoded);
        assert_eq!(targets.len(), self.batch * t, "targets must hold batch * seq_len tokens");
        {
            upcoming.before_open(state, Unit::Head, Pass::Forward);
            let (p, at) = state.open(be, Unit::Head, Pass::Forward)?.params.expect("forward has parameters");
            // With sequence parallelism each rank normalises its own tokens, then the
            // output is gathered whole for the LM head.
            let whole = be.buf_len(&head.lnf);
            let own = dims.mine.map_or(0..whole, |mine| mine.of(c));
            be.layernorm_forward(
                be.view_mut(&mut head.lnf, own),
                be.all_mut(&mut head.lnf_mean),
                be.all_mut(&mut head.lnf_rstd),
                be.all(last),
                be.view(p, shift(&lay.lnf_g, at)),
                be.view(p, shift(&lay.lnf_b, at)),
                c,
            );
            if let (Some(tp), Some(_)) = (&mut self.tp, dims.mine) {
                tp.collective(be, &mut head.lnf, InPlace::AllGather, TpPoint::LnfOutput, None)?;
            }
            be.matmul_forward(
                be.all_mut(&mut head.logits),
                be.all(&head.lnf),
                be.view(p, shift(&lay.lm_head, at)),
                None,
                None,
                c,
                vocab,
            );
        }
        state.close(be, Unit::Head, Pass::Forward)?;
        Ok(be.crossentropy_forward(be.all_mut(&mut head.logits), be.all_mut(&mut head.losses), targets, vocab))
    }

    /// The units one micro-batch's forward through chunk `chunk` opens, in order.
    fn forward_opens(&self, chunk: usize) -> Vec<(Unit, Pass)> {
        let mut opens = Vec::new();
        if self.stage.starts_model(chunk) {
            opens.push((Unit::Embeddings, Pass::Forward));
        }
        opens.extend(self.stage.chunks[chunk].clone().map(|l| (Unit::Block(l), Pass::Forward)));
        if self.stage.ends_model(chunk) {
            opens.push((Unit::Head, Pass::Forward));
        }
        opens
    }

    /// The units one micro-batch's backward opens, in order: the head, the segments of
    /// blocks last first (with checkpointing, each segment's blocks but its last
    /// recomputed first, then every block's backward in reverse), the embeddings.
    fn backward_opens(&self, chunk: usize) -> Vec<(Unit, Pass)> {
        let with_params = self.backward_pass();
        let mut opens = Vec::new();
        if self.stage.ends_model(chunk) {
            opens.push((Unit::Head, with_params));
        }
        let (first_block, blocks) = (self.stage.chunks[chunk].start, self.stage.chunks[chunk].len());
        let k = self.segment.unwrap_or(blocks.max(1));
        for start in (0..blocks).step_by(k).rev() {
            let end = (start + k).min(blocks);
            if self.segment.is_some() {
                opens.extend((start..end - 1).map(|i| (Unit::Block(first_block + i), Pass::Recompute)));
            }
            opens.extend((start..end).rev().map(|i| (Unit::Block(first_block + i), with_params)));
        }
        if self.stage.starts_model(chunk) {
            opens.push((Unit::Embeddings, Pass::Backward { params: false }));
        }
        opens
    }

    /// The units ZB-H1's W opens, in order: the head, the blocks last first.
    fn weights_opens(&self, chunk: usize) -> Vec<(Unit, Pass)> {
        let head = self.stage.ends_model(chunk).then_some((Unit::Head, Pass::Weights));
        let blocks = self.stage.chunks[chunk].clone().rev().map(|l| (Unit::Block(l), Pass::Weights));
        head.into_iter().chain(blocks).collect()
    }

    /// How backward opens the head and the blocks: for the whole backward, or (ZB-H1)
    /// its input's half.
    fn backward_pass(&self) -> Pass {
        if self.split_backward {
            Pass::BackwardInput
        } else {
            Pass::Backward { params: true }
        }
    }

    /// This rank's widths (its heads and its part of the MLP under tensor parallelism).
    fn dims(&self) -> Dims {
        let TpPlace { rank, size: n } = self.layout.tp;
        let ModelSpec { seq_len, d_model, heads, .. } = self.spec;
        let own = self.shapes[0].res_rows;
        Dims {
            t: seq_len,
            c: d_model,
            cl: d_model / n,
            heads: heads / n,
            hidden: 4 * d_model / n,
            lead: rank == 0,
            attention: self.shapes[0].attention,
            mine: self.exchange.is_some().then_some(Tokens { start: rank * own, len: own }),
            experts: self.shapes[0].experts,
            balance_weight: 0.0,
        }
    }

    /// Elements of what a stage hands to the next one (and gets the gradient of): a
    /// micro-batch's residual stream, this rank's tokens' with sequence parallelism.
    pub fn stage_output_len(&self) -> usize {
        self.shapes[0].res_rows * self.shapes[0].c
    }

    /// What the forward of `micro` through chunk `chunk` hands to the next chunk: its last
    /// block's output.
    pub fn output(&self, chunk: usize, micro: usize) -> &B::Buf {
        self.in_flight[self.activations_of(chunk, micro)].acts.output()
    }

    /// After `backward_stage` on a stage that is not the first: the gradient of the stage's
    /// input, for the previous stage.
    pub fn input_grad(&self) -> &B::Buf {
        &self.scratch.dres
    }

    /// Backpropagates the last `forward` (same inputs and targets and state) and ADDS the
    /// parameter gradients into the state's gradient buffers, unit by unit: the LM head and
    /// final LayerNorm, then each block from the last to the first, then the embeddings.
    /// Closing a unit tells the state its gradients for this micro-batch are final (data
    /// parallelism starts reducing them while backward goes on). `dloss` weighs every
    /// token's loss: 1 / (tokens in the optimizer step) gives the gradients of the mean loss.
    pub fn backward(
        &mut self,
        be: &B,
        state: &mut dyn ModelState<B>,
        inputs: &[u32],
        targets: &[u32],
        dloss: f64,
    ) -> Result<(), CommError> {
        self.backward_stage(be, state, 0, 0, inputs, targets, None, dloss)
    }

    /// Backpropagates the forward of `micro` through chunk `chunk`, then frees its
    /// activations. The model's last chunk starts from the loss (`targets`, `dloss`); the
    /// others from `grad_output`, the gradient of their output that the next chunk sent.
    /// The model's first chunk ends in the embeddings (`inputs`); the others leave the
    /// gradient of their input in `input_grad()`. With checkpointing,
    /// each segment's forward runs again (from the saved input of the segment) just before
    /// the segment's backward.
    #[allow(clippy::too_many_arguments)]
    pub fn backward_stage(
        &mut self,
        be: &B,
        state: &mut dyn ModelState<B>,
        chunk: usize,
        micro: usize,
        inputs: &[u32],
        targets: &[u32],
        grad_output: Option<&[B::Elem]>,
        dloss: f64,
    ) -> Result<(), CommError> {
        let ModelSpec { seq_len: t, d_model: c, vocab, aux_loss_coef, .. } = self.spec;
        // The balance loss of each routing is weighted as the micro-batch's tokens are.
        let balance_weight = aux_loss_coef * (self.batch * t) as f64 * dloss;
        let dims = Dims { balance_weight, ..self.dims() };
        // ZB-H1: each block's B keeps its matmuls' output gradients here for the W.
        let mut stash = self.split_backward.then(|| self.take_stash(be, self.stage.chunks[chunk].len()));
        let lay = &self.layout;
        let index = self.activations_of(chunk, micro);
        let mut upcoming = Upcoming::new(self.backward_opens(chunk));
        let with_params = self.backward_pass();
        let s = &mut self.scratch;
        let acts = &mut self.in_flight[index].acts;

        if let Some(head) = acts.head.as_mut() {
            // loss and LM head
            be.crossentropy_backward(be.all_mut(&mut head.logits), targets, vocab, dloss);
            if self.logit_grad_zeros.is_none() {
                let sampled = targets.len().min(LOGIT_SAMPLE_ROWS) * vocab;
                let zeros = be.read_host(be.view(&head.logits, 0..sampled), |g| {
                    g.iter().filter(|v| crate::ops::float::Stored::to_f64(**v) == 0.0).count() as u64
                });
                self.logit_grad_zeros = Some(LogitGradZeros { zeros, sampled: sampled as u64 });
            }
        }
        let acts = &*acts;
        if let Some(head) = &acts.head {
            upcoming.before_open(state, Unit::Head, with_params);
            let open = state.open(be, Unit::Head, with_params)?;
            let (p, at) = open.params.expect("backward of the head has parameters");
            let (g, g_at) = open.grads.expect("backward has gradients");
            let g = be.view_mut(g, shift(&Unit::Head.range(lay), g_at));
            let (g_lnf_g, g) = be.split_mut(g, lay.lnf_g.len());
            let (g_lnf_b, g_lm_head) = be.split_mut(g, lay.lnf_b.len());
            let mut g_lnf = [g_lnf_g, g_lnf_b];
            // The final LayerNorm's parameter gradients: straight into the state's, or
            // (sequence parallelism: from this rank's tokens only) into scratch, summed
            // over the group and then added.
            let mut lnf_scratch = self.exchange.as_mut().and_then(|e| e.lnf_grads.as_mut());
            let [d_lnf_g, d_lnf_b] = match lnf_scratch.as_deref_mut() {
                Some(buf) => {
                    be.fill(be.all_mut(buf), 0.0);
                    pieces::<B, 2>(be, buf, c)
                }
                None => g_lnf.each_mut().map(|v| be.reborrow(v)),
            };
            // (ZB-H1: the LM head's weight gradient waits for the W, from the logits'
            // gradient and lnf, which the micro-batch keeps until then)
            let (dlogits, lm_head) = (be.all(&head.logits), be.view(p, shift(&lay.lm_head, at)));
            match stash {
                Some(_) => be.matmul_backward_input(be.all_mut(&mut s.dln), dlogits, lm_head, c, vocab),
                None => be.matmul_backward(
                    Some(be.all_mut(&mut s.dln)),
                    g_lm_head,
                    None,
                    dlogits,
                    be.all(&head.lnf),
                    lm_head,
                    c,
                    vocab,
                ),
            }
            be.fill(be.all_mut(&mut s.dres), 0.0);
            let last = acts.output();
            // Every TP rank has the whole gradient of lnf's output; each takes its tokens'.
            let own = dims.mine.map_or(0..be.buf_len(&s.dln), |mine| mine.of(c));
            be.layernorm_backward(
                be.all_mut(&mut s.dres),
                d_lnf_g,
                d_lnf_b,
                be.view(&s.dln, own),
                be.all(last),
                be.view(p, shift(&lay.lnf_g, at)),
                be.all(&head.lnf_mean),
                be.all(&head.lnf_rstd),
                c,
            );
            if let (Some(buf), Some(tp)) = (lnf_scratch, &mut self.tp) {
                tp.collective(be, buf, InPlace::AllReduce(ReduceOp::Sum), TpPoint::LnfGrads, None)?;
                add_pieces(be, g_lnf, buf, c);
            }
        } else {
            // The next stage sent the gradient of our output.
            be.upload(&mut s.dres, grad_output.expect("a stage before the last gets its output's gradient"));
        }
        if acts.head.is_some() {
            state.close(be, Unit::Head, with_params)?;
        }

        // Segments of blocks, last first: without checkpointing one segment of them all,
        // with its activations saved; with it, `k` blocks at a time, recomputed first.
        let first_block = self.stage.chunks[chunk].start;
        let blocks = self.stage.chunks[chunk].len();
        let k = self.segment.unwrap_or(blocks.max(1));
        for start in (0..blocks).step_by(k).rev() {
            let end = (start + k).min(blocks);
            if self.segment.is_some() {
                // Every block of the segment but the last runs forward again on its own;
                // the last one below, with the parameters its backward opens anyway.
                for i in start..end - 1 {
                    let l = first_block + i;
                    upcoming.before_open(state, Unit::Block(l), Pass::Recompute);
                    let (p, at) =
                        state.open(be, Unit::Block(l), Pass::Recompute)?.params.expect("recompute has parameters");
                    let w = lay.blocks[l].map(|r| be.view(p, shift(r, at)));
                    let (tp, exchange, ep) = (&mut self.tp, &mut self.exchange, &mut self.ep);
                    segment_block_forward(be, &w, acts, &mut self.recompute, i, k, dims, tp, exchange, ep, l)?;
                    state.close(be, Unit::Block(l), Pass::Recompute)?;
                }
            }
            for i in (start..end).rev() {
                let l = first_block + i;
                // (a scope, so that the block's views end before it is closed)
                {
                    upcoming.before_open(state, Unit::Block(l), with_params);
                    let open = state.open(be, Unit::Block(l), with_params)?;
                    let (p, at) = open.params.expect("backward of a block has parameters");
                    let (g, g_at) = open.grads.expect("backward has gradients");
                    let gw = split_block(be, be.view_mut(g, shift(&Unit::Block(l).range(lay), g_at)), &lay.blocks[l]);
                    let w = lay.blocks[l].map(|r| be.view(p, shift(r, at)));
                    let (x, a) = match self.segment {
                        None => (if i == 0 { &acts.encoded } else { &acts.blocks[i - 1].res_mlp }, &acts.blocks[i]),
                        Some(_) => {
                            if i == end - 1 {
                                let (tp, exchange, ep) = (&mut self.tp, &mut self.exchange, &mut self.ep);
                                let recompute = &mut self.recompute;
                                let start = self.recomputes_timed.is_some().then(now_us);
                                segment_block_forward(be, &w, acts, recompute, i, k, dims, tp, exchange, ep, l)?;
                                if let (Some(start), Some(timed)) = (start, self.recomputes_timed.as_mut()) {
                                    be.synchronize();
                                    timed.push(RecomputeTime { layer: l, start_us: start, end_us: now_us() });
                                }
                            }
                            let j = i - start;
                            let x = match (j, i) {
                                (0, 0) => &acts.encoded,
                                (0, _) => &acts.checkpoints[i / k - 1],
                                _ => &self.recompute[j - 1].res_mlp,
                            };
                            (x, &self.recompute[j])
                        }
                    };
                    let keep = stash.as_mut().map(|(kept, _)| &mut kept[i]);
                    let (tp, exchange, ep) = (&mut self.tp, &mut self.exchange, &mut self.ep);
                    block_backward(be, &w, gw, x, a, s, dims, tp, exchange, ep, l, keep)?;
                }
                state.close(be, Unit::Block(l), with_params)?;
            }
        }
        // Every activation of this micro-batch is consumed (the embeddings' backward needs
        // only the token ids): released from the ledger, kept for the next forward. ZB-H1
        // keeps them, and the stash, for the W.
        match stash {
            Some(kept) => self.in_flight[index].stash = Some(kept),
            None => {
                let done = self.in_flight.swap_remove(index);
                self.spare.push((chunk, done.acts));
            }
        }
        if !self.stage.starts_model(chunk) {
            return Ok(());
        }
        let without_params = Pass::Backward { params: false };
        {
            upcoming.before_open(state, Unit::Embeddings, without_params);
            let (g, g_at) = state.open(be, Unit::Embeddings, without_params)?.grads.expect("backward has gradients");
            let g = be.view_mut(g, shift(&Unit::Embeddings.range(lay), g_at));
            let (g_wte, g_wpe) = be.split_mut(g, lay.wte.len());
            // With sequence parallelism the replicated embeddings need every token's gradient.
            let whole = gather_tokens(
                be,
                &s.dres,
                self.exchange.as_mut().map(|e| &mut e.full),
                dims.mine,
                c,
                &mut self.tp,
                TpPoint::EmbeddingOutputGrad,
                None,
            )?;
            be.encoder_backward(g_wte, g_wpe, be.all(whole), inputs, t, c);
        }
        state.close(be, Unit::Embeddings, without_params)
    }
}

impl<B: Backend> Gpt<B> {
    /// ZB-H1's W of micro-batch `micro` through chunk `chunk`, after its B: every matmul's
    /// weight (and bias) gradient, `dW += inpᵀ · dout`, from the output gradients the B
    /// kept and the inputs forward saved; then the micro-batch's activations are released.
    pub fn weights_stage(
        &mut self,
        be: &B,
        state: &mut dyn ModelState<B>,
        chunk: usize,
        micro: usize,
    ) -> Result<(), CommError> {
        let ModelSpec { d_model: c, vocab, .. } = self.spec;
        let dims = self.dims();
        let index = self.activations_of(chunk, micro);
        let mut upcoming = Upcoming::new(self.weights_opens(chunk));
        let lay = &self.layout;
        let InFlight { acts, stash, .. } = &self.in_flight[index];
        let Some((stash, _)) = stash else {
            panic!("the W of micro-batch {micro} in chunk {chunk} before its B");
        };
        if let Some(head) = &acts.head {
            upcoming.before_open(state, Unit::Head, Pass::Weights);
            {
                let (g, g_at) = state.open(be, Unit::Head, Pass::Weights)?.grads.expect("the W has gradients");
                let g_lm_head = be.view_mut(g, shift(&lay.lm_head, g_at));
                be.matmul_backward_weights(g_lm_head, None, be.all(&head.logits), be.all(&head.lnf), c, vocab);
            }
            state.close(be, Unit::Head, Pass::Weights)?;
        }
        let first_block = self.stage.chunks[chunk].start;
        for (i, kept) in stash.iter().enumerate().rev() {
            let l = first_block + i;
            upcoming.before_open(state, Unit::Block(l), Pass::Weights);
            {
                let (g, g_at) = state.open(be, Unit::Block(l), Pass::Weights)?.grads.expect("the W has gradients");
                let gw = split_block(be, be.view_mut(g, shift(&Unit::Block(l).range(lay), g_at)), &lay.blocks[l]);
                block_weights(be, gw, &acts.blocks[i], kept, dims);
            }
            state.close(be, Unit::Block(l), Pass::Weights)?;
        }
        self.release(index);
        Ok(())
    }
}

/// Where a pass is in the list of units it opens ([`Gpt::forward_opens`],
/// [`Gpt::backward_opens`]): before each open, the state hears what comes after it.
struct Upcoming {
    opens: Vec<(Unit, Pass)>,
    at: usize,
}

impl Upcoming {
    fn new(opens: Vec<(Unit, Pass)>) -> Self {
        Self { opens, at: 0 }
    }

    fn before_open<B: Backend>(&mut self, state: &mut dyn ModelState<B>, unit: Unit, pass: Pass) {
        debug_assert_eq!(self.opens.get(self.at), Some(&(unit, pass)), "units opened out of the listed order");
        self.at += 1;
        state.announce_next(self.opens.get(self.at).copied());
    }
}

/// A block's sizes on this rank: sequence length, model width, this rank's attention
/// width and heads, its MLP hidden width, and whether it adds the row-parallel biases and
/// the residual (tensor-parallel rank 0; the only rank without tensor parallelism), and
/// with sequence parallelism the tokens it keeps.
#[derive(Clone, Copy, Debug)]
struct Dims {
    t: usize,
    c: usize,
    cl: usize,
    heads: usize,
    hidden: usize,
    lead: bool,
    attention: Attention,
    /// Sequence parallelism: the tokens whose LayerNorm and residual regions this rank keeps.
    mine: Option<Tokens>,
    /// Mixture of Experts (None: dense blocks).
    experts: Option<ExpertShape>,
    /// Backward: the balance loss's weight in the objective (aux_loss_coef x tokens x
    /// d(objective)/d(a token's loss)).
    balance_weight: f64,
}

/// Elements attention keeps per micro-batch of `batch` sequences for `heads` heads: the
/// (T, T) probabilities of each head, or (flash) a log-sum-exp pair per row.
fn attention_floats(batch: usize, heads: usize, t: usize, attention: Attention) -> usize {
    let per_head = match attention {
        Attention::Naive => t.saturating_mul(t),
        Attention::Flash => t.saturating_mul(crate::ops::flash_attention::PAIR),
    };
    batch.saturating_mul(heads).saturating_mul(per_head)
}

/// One transformer block forward, from its input `x`, keeping what backward needs in `a`:
///
/// ```text
///   res_attn = x + attn_proj(attention(ln1(x)))
///   res_mlp  = res_attn + fc_proj(gelu(fc(ln2(res_attn))))
/// ```
///
/// With tensor parallelism each rank has its heads' q, k, v and its share of the hidden
/// units, and the two row-parallel outputs are partial sums: g all-reduces them. With
/// sequence parallelism `x`, the LayerNorms and the residuals are this rank's tokens only:
/// the LayerNorm outputs are gathered before the column-parallel matmuls and the
/// row-parallel outputs reduce-scattered.
#[allow(clippy::too_many_arguments)]
fn block_forward<B: Backend>(
    be: &B,
    w: &BlockTensors<B::View<'_>>,
    x: &B::Buf,
    a: &mut BlockActivations<B::Buf>,
    d: Dims,
    tp: &mut Option<Box<dyn TensorParallelGroup<B>>>,
    exchange: &mut Option<Exchange<B::Buf>>,
    ep: &mut ExpertGroup<B>,
    layer: usize,
) -> Result<(), CommError> {
    let Dims { t, c, cl, heads, hidden, attention, mine, .. } = d;
    let at = Some(layer);
    // attention half
    be.layernorm_forward(
        be.all_mut(&mut a.ln1),
        be.all_mut(&mut a.ln1_mean),
        be.all_mut(&mut a.ln1_rstd),
        be.all(x),
        w.ln1_g,
        w.ln1_b,
        c,
    );
    let ln1 = gather_tokens(be, &a.ln1, gathered(exchange), mine, c, tp, TpPoint::Ln1Output, at)?;
    be.matmul_forward(be.all_mut(&mut a.qkv), be.all(ln1), w.qkv_w, Some(w.qkv_b), None, c, 3 * cl);
    match attention {
        Attention::Naive => {
            be.attention_forward(be.all_mut(&mut a.atty), be.all_mut(&mut a.att), be.all(&a.qkv), t, cl, heads)
        }
        Attention::Flash => {
            be.flash_attention_forward(be.all_mut(&mut a.atty), be.all_mut(&mut a.att), be.all(&a.qkv), t, cl, heads)
        }
    }
    // (this rank's width, whether it adds the bias and residual, its tokens)
    let place = (c, d.lead, mine);
    let proj = (w.attn_proj_w, w.attn_proj_b, cl);
    row_parallel_forward(
        be,
        (&mut a.res_attn, &a.atty, x),
        proj,
        TpPoint::AttentionOutput,
        place,
        tp,
        exchange,
        layer,
    )?;
    // MLP half
    be.layernorm_forward(
        be.all_mut(&mut a.ln2),
        be.all_mut(&mut a.ln2_mean),
        be.all_mut(&mut a.ln2_rstd),
        be.all(&a.res_attn),
        w.ln2_g,
        w.ln2_b,
        c,
    );
    if let (Some(shape), Some(moe)) = (d.experts, a.moe.as_mut()) {
        // Mixture of Experts (tp = 1: ln2 and the residual are whole here)
        let hidden = Hidden { fch: &mut a.fch, fch_gelu: &mut a.fch_gelu };
        let bufs = (&a.ln2, &a.res_attn, &mut a.res_mlp);
        return experts_forward(be, w, bufs, moe, hidden, &shape, c, ep, layer);
    }
    let ln2 = gather_tokens(be, &a.ln2, gathered(exchange), mine, c, tp, TpPoint::Ln2Output, at)?;
    be.matmul_forward(be.all_mut(&mut a.fch), be.all(ln2), w.fc_w, Some(w.fc_b), None, c, hidden);
    be.gelu_forward(be.all_mut(&mut a.fch_gelu), be.all(&a.fch));
    let proj = (w.fc_proj_w, w.fc_proj_b, hidden);
    let (out, inp, residual) = (&mut a.res_mlp, &a.fch_gelu, &a.res_attn);
    row_parallel_forward(be, (out, inp, residual), proj, TpPoint::MlpOutput, place, tp, exchange, layer)
}

/// Checkpointing: block `i` of the stage forward (the first time, or again in backward),
/// into segment buffer `i % k`, from the segment's saved input or the previous segment
/// buffer's output.
#[allow(clippy::too_many_arguments)]
fn segment_block_forward<B: Backend>(
    be: &B,
    w: &BlockTensors<B::View<'_>>,
    acts: &Activations<B::Buf>,
    segment: &mut [BlockActivations<B::Buf>],
    i: usize,
    k: usize,
    d: Dims,
    tp: &mut Option<Box<dyn TensorParallelGroup<B>>>,
    exchange: &mut Option<Exchange<B::Buf>>,
    ep: &mut ExpertGroup<B>,
    layer: usize,
) -> Result<(), CommError> {
    let j = i % k;
    let (before, rest) = segment.split_at_mut(j);
    let x = match (j, i) {
        (0, 0) => &acts.encoded,
        (0, _) => &acts.checkpoints[i / k - 1],
        _ => &before[j - 1].res_mlp,
    };
    block_forward(be, w, x, &mut rest[0], d, tp, exchange, ep, layer)
}

/// One transformer block backward: `s.dres` holds the gradient of the block's output and
/// becomes the gradient of its input `x`; the parameter gradients are ADDED into `gw`.
/// With tensor parallelism `dres` is whole on every rank (g's backward is the identity,
/// so each rank computes the same gradient for the replicated biases and LayerNorms once
/// f's backward has summed the LayerNorm output gradients over the group). With sequence
/// parallelism `dres` is this rank's tokens': it is gathered whole for the row-parallel
/// layers' backward, the LayerNorm outputs are gathered again for the column-parallel
/// weight gradients, the LayerNorm output gradients reduce-scattered, and the LayerNorm
/// parameter gradients (each rank's from its own tokens) summed over the group.
#[allow(clippy::too_many_arguments)]
fn block_backward<B: Backend>(
    be: &B,
    w: &BlockTensors<B::View<'_>>,
    gw: BlockTensors<B::ViewMut<'_>>,
    x: &B::Buf,
    a: &BlockActivations<B::Buf>,
    s: &mut GradScratch<B::Buf>,
    d: Dims,
    tp: &mut Option<Box<dyn TensorParallelGroup<B>>>,
    exchange: &mut Option<Exchange<B::Buf>>,
    ep: &mut ExpertGroup<B>,
    layer: usize,
    mut keep: Option<&mut WeightStash<B::Buf>>,
) -> Result<(), CommError> {
    let Dims { t, c, cl, heads, hidden, attention, mine, .. } = d;
    let at = Some(layer);
    let BlockTensors {
        ln1_g,
        ln1_b,
        qkv_w,
        qkv_b,
        attn_proj_w,
        attn_proj_b,
        ln2_g,
        ln2_b,
        router_w,
        fc_w,
        fc_b,
        fc_proj_w,
        fc_proj_b,
    } = gw;
    let (mut gathered, mut full, mut ln_scratch) = match exchange {
        Some(e) => (Some(&mut e.gathered), Some(&mut e.full), Some(&mut e.ln_grads)),
        None => (None, None, None),
    };
    // The LayerNorm parameter gradients: straight into gw, or (sequence parallelism) into
    // scratch, summed over the group at the end and then added to gw.
    let mut g_ln = [ln1_g, ln1_b, ln2_g, ln2_b];
    let [d_ln1_g, d_ln1_b, d_ln2_g, d_ln2_b] = match ln_scratch.as_deref_mut() {
        Some(buf) => {
            be.fill(be.all_mut(buf), 0.0);
            pieces::<B, 4>(be, buf, c)
        }
        None => g_ln.each_mut().map(|v| be.reborrow(v)),
    };
    // MLP half (dres holds d res_mlp, and becomes d res_attn)
    let experts = match (d.experts, a.moe.as_ref(), s.experts.as_mut()) {
        (Some(shape), Some(moe), Some(scratch)) => Some((shape, moe, scratch)),
        _ => None,
    };
    let dln = if let Some((shape, moe, scratch)) = experts {
        // Mixture of Experts (tp = 1)
        let grads = ExpertGrads { router_w, fc_w, fc_b, fc_proj_w, fc_proj_b };
        let (bufs, hidden) = ((&s.dres, &a.ln2, &mut s.dln), (&a.fch, &a.fch_gelu, &mut s.dfch));
        experts_backward(be, w, grads, bufs, moe, hidden, scratch, &shape, c, ep, layer, d.balance_weight)?;
        0..be.buf_len(&s.dln)
    } else {
        let dout = gather_tokens(be, &s.dres, full.as_deref_mut(), mine, c, tp, TpPoint::MlpOutputGrad, at)?;
        let kept = keep.as_deref_mut().map(|k| &mut k.dmlp_out);
        let weights = (fc_proj_w, Some(fc_proj_b));
        linear_backward(
            be,
            be.all_mut(&mut s.dfch),
            weights,
            be.all(dout),
            be.all(&a.fch_gelu),
            w.fc_proj_w,
            (hidden, c),
            kept,
        );
        be.gelu_backward(be.all_mut(&mut s.dfch), be.all(&a.fch));
        let ln2 = gather_tokens(be, &a.ln2, gathered.as_deref_mut(), mine, c, tp, TpPoint::Ln2Output, at)?;
        let kept = keep.as_deref_mut().map(|k| &mut k.dfch);
        linear_backward(
            be,
            be.all_mut(&mut s.dln),
            (fc_w, Some(fc_b)),
            be.all(&s.dfch),
            be.all(ln2),
            w.fc_w,
            (c, hidden),
            kept,
        );
        // f's backward: ln2's output fed every rank's hidden units
        sum_input_grad(be, &mut s.dln, mine, c, tp, TpPoint::Ln2OutputGrad, layer)?
    };
    be.layernorm_backward(
        be.all_mut(&mut s.dres),
        d_ln2_g,
        d_ln2_b,
        be.view(&s.dln, dln),
        be.all(&a.res_attn),
        w.ln2_g,
        be.all(&a.ln2_mean),
        be.all(&a.ln2_rstd),
        c,
    );
    // attention half (dres becomes d x)
    let dout = gather_tokens(be, &s.dres, full, mine, c, tp, TpPoint::AttentionOutputGrad, at)?;
    let kept = keep.as_deref_mut().map(|k| &mut k.dattn_out);
    let weights = (attn_proj_w, Some(attn_proj_b));
    linear_backward(be, be.all_mut(&mut s.datty), weights, be.all(dout), be.all(&a.atty), w.attn_proj_w, (cl, c), kept);
    match attention {
        Attention::Naive => be.attention_backward(
            be.all_mut(&mut s.dqkv),
            be.all_mut(&mut s.datt),
            be.all(&s.datty),
            be.all(&a.qkv),
            be.all(&a.att),
            t,
            cl,
            heads,
        ),
        Attention::Flash => be.flash_attention_backward(
            be.all_mut(&mut s.dqkv),
            be.all_mut(&mut s.datt),
            be.all(&s.datty),
            be.all(&a.qkv),
            be.all(&a.atty),
            be.all(&a.att),
            t,
            cl,
            heads,
        ),
    }
    let ln1 = gather_tokens(be, &a.ln1, gathered, mine, c, tp, TpPoint::Ln1Output, at)?;
    let kept = keep.map(|k| &mut k.dqkv);
    linear_backward(
        be,
        be.all_mut(&mut s.dln),
        (qkv_w, Some(qkv_b)),
        be.all(&s.dqkv),
        be.all(ln1),
        w.qkv_w,
        (c, 3 * cl),
        kept,
    );
    let dln = sum_input_grad(be, &mut s.dln, mine, c, tp, TpPoint::Ln1OutputGrad, layer)?;
    be.layernorm_backward(
        be.all_mut(&mut s.dres),
        d_ln1_g,
        d_ln1_b,
        be.view(&s.dln, dln),
        be.all(x),
        w.ln1_g,
        be.all(&a.ln1_mean),
        be.all(&a.ln1_rstd),
        c,
    );
    if let (Some(buf), Some(tp)) = (ln_scratch, tp) {
        tp.collective(be, buf, InPlace::AllReduce(ReduceOp::Sum), TpPoint::LayerNormGrads, at)?;
        add_pieces(be, g_ln, buf, c);
    }
    Ok(())
}

/// One matmul's backward inside a block: `dinp = dout · Wᵀ` and the weight gradients
/// (`dW += inpᵀ · dout`, `db += Σ dout`), or (ZB-H1's B, `keep`) `dinp` only, with `dout`
/// copied into `keep` for the W.
#[allow(clippy::too_many_arguments)]
fn linear_backward<B: Backend>(
    be: &B,
    dinp: B::ViewMut<'_>,
    (dweight, dbias): (B::ViewMut<'_>, Option<B::ViewMut<'_>>),
    dout: B::View<'_>,
    inp: B::View<'_>,
    weight: B::View<'_>,
    (c_in, c_out): (usize, usize),
    keep: Option<&mut B::Buf>,
) {
    match keep {
        Some(kept) => {
            be.copy(be.all_mut(kept), dout);
            be.matmul_backward_input(dinp, dout, weight, c_in, c_out);
        }
        None => be.matmul_backward(Some(dinp), dweight, dbias, dout, inp, weight, c_in, c_out),
    }
}

/// ZB-H1's W of one block: the four matmuls' weight and bias gradients from the output
/// gradients its B kept (`k`) and the inputs its forward saved (`a`).
fn block_weights<B: Backend>(
    be: &B,
    gw: BlockTensors<B::ViewMut<'_>>,
    a: &BlockActivations<B::Buf>,
    k: &WeightStash<B::Buf>,
    d: Dims,
) {
    debug_assert!(d.experts.is_none(), "validation keeps ZB-H1 to dense blocks");
    let Dims { c, cl, hidden, .. } = d;
    let weights = |dw, db, dout: &B::Buf, inp: &B::Buf, c_in, c_out| {
        be.matmul_backward_weights(dw, Some(db), be.all(dout), be.all(inp), c_in, c_out);
    };
    weights(gw.fc_proj_w, gw.fc_proj_b, &k.dmlp_out, &a.fch_gelu, hidden, c);
    weights(gw.fc_w, gw.fc_b, &k.dfch, &a.ln2, c, hidden);
    weights(gw.attn_proj_w, gw.attn_proj_b, &k.dattn_out, &a.atty, cl, c);
    weights(gw.qkv_w, gw.qkv_b, &k.dqkv, &a.ln1, c, 3 * cl);
}

/// A global range of the parameter buffer, in a buffer whose first element is global `at`.
fn shift(range: &Range<usize>, at: usize) -> Range<usize> {
    range.start - at..range.end - at
}

/// Cuts one block's gradient view into its tensors (they are contiguous, in order).
fn split_block<'a, B: Backend>(
    be: &B,
    view: B::ViewMut<'a>,
    lay: &BlockTensors<Range<usize>>,
) -> BlockTensors<B::ViewMut<'a>> {
    let mut rest = Some(view);
    let mut take = |len: usize| {
        let whole = rest.take().expect("split_block takes views one after another");
        let (head, tail) = be.split_mut(whole, len);
        rest = Some(tail);
        head
    };
    BlockTensors {
        ln1_g: take(lay.ln1_g.len()),
        ln1_b: take(lay.ln1_b.len()),
        qkv_w: take(lay.qkv_w.len()),
        qkv_b: take(lay.qkv_b.len()),
        attn_proj_w: take(lay.attn_proj_w.len()),
        attn_proj_b: take(lay.attn_proj_b.len()),
        ln2_g: take(lay.ln2_g.len()),
        ln2_b: take(lay.ln2_b.len()),
        router_w: take(lay.router_w.len()),
        fc_w: take(lay.fc_w.len()),
        fc_b: take(lay.fc_b.len()),
        fc_proj_w: take(lay.fc_proj_w.len()),
        fc_proj_b: take(lay.fc_proj_b.len()),
    }
}
