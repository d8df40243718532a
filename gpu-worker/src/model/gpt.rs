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
//! The pieces live beside this file: one block's forward and backward in `block.rs`, the
//! final LayerNorm and LM head in `head.rs`, the activations and their bookkeeping (and
//! their sizes) in `activations.rs`, a pipeline stage in `stage.rs`, tensor and sequence
//! parallelism's collectives in `tensor_parallel.rs`, Mixture of Experts in `experts.rs`;
//! ZB-H1's W pass, the second half of a split backward, in `gpt/weights_pass.rs`.
//!
//! With activation checkpointing ([`Saved`]) forward keeps only each segment's output
//! and runs its blocks in one shared set of segment buffers; backward runs a segment's
//! forward again there, from the segment's saved input, just before the segment's
//! backward (`Pass::Recompute`). With activation offload ([`Gpt::offload_activations`],
//! `activation_offload.rs`) each block's activations but its output leave the device
//! after its forward and come back for its backward.

mod weights_pass;

use std::ops::Range;
use std::sync::Arc;

use distlab_common::events::Fp8Metrics;
use distlab_common::trace::Span;
use distlab_common::{Checkpointing, ContextParallel, Fp8Recipe, ModelSpec};

use crate::backend::Backend;
use crate::comm::CommError;
use crate::error::TrainError;
use crate::memory::{Category, MemoryTracker, Receipt};
use crate::model::activation_offload::{ActivationOffload, ActivationOffloadError, ActivationTier, BlockKey};
use crate::model::activations::{
    activation_floats_for, stage_output, ActivationShape, BlockActivations, InFlightSets, Saved,
};
use crate::model::block::{
    block_backward, block_forward, recompute_probabilities, segment_block_forward, shift, split_block, Dims,
    GradScratch,
};
use crate::model::context_parallel::{
    ContextDims, ContextExchange, ContextParallelGroup, ContextPlace, ContextSplit, ExchangeShape,
};
use crate::model::experts::{ExpertGroup, ExpertStats};
use crate::model::fp8_linear::Fp8Blocks;
use crate::model::head::{head_backward, head_forward, head_params, split_head, LogitGradZeros};
use crate::model::layout::{ExpertPlace, ParamLayout, TpPlace};
use crate::model::stage::{Stage, StageInput, Upcoming};
use crate::model::state::{ModelState, OpenUnit, Pass, Unit};
use crate::model::tensor_parallel::{gather_tokens, Exchange, TensorParallelGroup, Tokens, TpPoint};
use crate::ops::attention::{AttentionShape, Positions};
use crate::trace::now_us;

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
    activations: InFlightSets<B>,
    /// ZB-H1: backward runs as B and W (see [`Saved::split_backward`]).
    split_backward: bool,
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
    /// Context parallelism (None: this rank holds whole sequences).
    cx: Option<ContextSplit<B>>,
    /// The routing of the forwards since the last [`Gpt::take_expert_stats`].
    expert_stats: ExpertStats,
    /// The first backward since the last [`Gpt::take_logit_grad_zeros`]: of the logit
    /// gradients sampled, how many were stored as 0.
    logit_grad_zeros: Option<LogitGradZeros>,
    /// When timing (see [`Gpt::time_recomputes`]): the forwards a backward ran again
    /// inside a block's own backward (each checkpointed segment's last block).
    recomputes_timed: Option<Vec<RecomputeTime>>,
    /// Activation offload (None: every block's activations stay on the device).
    offload: Option<ActivationOffload<B>>,
    /// FP8 products in the blocks' linear layers: their scales (None: `precision`'s).
    fp8: Option<Fp8Blocks>,
}

/// A block's forward run again inside its backward, timed apart from the backward.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct RecomputeTime {
    pub layer: usize,
    pub start_us: u64,
    pub end_us: u64,
}

/// The groups of ranks the model itself runs collectives in (the strategies have theirs).
pub struct ModelGroups<B: Backend> {
    /// Tensor parallelism (None: this rank holds every block whole).
    pub tp: Option<Box<dyn TensorParallelGroup<B>>>,
    /// Expert parallelism (None: every expert on this rank, or a dense model).
    pub ep: ExpertGroup<B>,
    /// Context parallelism (None: this rank holds whole sequences).
    pub cp: Option<Box<dyn ContextParallelGroup<B>>>,
}

impl<B: Backend> ModelGroups<B> {
    /// One rank holding the whole model.
    pub fn alone() -> Self {
        ModelGroups { tp: None, ep: None, cp: None }
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
        let ModelGroups { mut tp, mut ep, cp } = groups;
        // (an interleaved stage's chunks are alike)
        let chunk_blocks = stage.chunks.iter().map(Range::len).max().unwrap_or(0);
        let segment = saved.segment(chunk_blocks);
        if let Some(group) = tp.as_mut() {
            group.attach_memory(memory);
        }
        let place = tp.as_ref().map_or(TpPlace::ALONE, |g| g.place());
        if let Some(group) = ep.as_mut() {
            group.attach_memory(memory);
        }
        let experts = ep.as_ref().map_or(ExpertPlace::ALONE, |g| g.place());
        let context = cp.as_ref().map_or(ContextPlace::ALONE, |g| g.place());
        let layout = match spec.is_moe() {
            true => ParamLayout::for_experts(spec, experts, &stage.unit_order),
            false => ParamLayout::with_unit_order(spec, place, &stage.unit_order),
        };
        let ranks = (place.size, experts.size, context.size);
        let sequence_parallel = saved.sequence_parallel && place.size > 1;
        let shape = ActivationShape {
            recompute_probabilities: saved.checkpointing == Checkpointing::Selective,
            ..ActivationShape::new(spec, batch, ranks, saved, sequence_parallel)
        };
        let mut floats = 0usize;
        let mut receipts = Vec::new();
        let mut alloc = |category: Category, len: usize| {
            floats += len;
            receipts.push(memory.alloc_of::<B::Elem>(category, len));
            be.alloc(len)
        };
        let recompute =
            (0..segment.unwrap_or(0)).map(|_| shape.block(&mut |len| alloc(Category::Activations, len))).collect();
        let scratch = GradScratch::new(&shape, &mut alloc);
        let norm = spec.norm_params() as usize;
        let exchange = sequence_parallel.then(|| Exchange::new(shape.rows, shape.c, norm, stage.last, &mut alloc));
        let cx = match (cp, shape.context_widths()) {
            (Some(mut group), Some(widths)) => {
                group.attach_memory(memory);
                let exchange = ContextExchange::new(shape.rows, widths, shape.ring(), &mut alloc);
                Some(ContextSplit { group, exchange })
            }
            _ => None,
        };
        let activations = InFlightSets::new(shape.for_chunks(&stage, segment), memory);
        if stage == Stage::whole(spec.layers) && segment.is_none() {
            let expected = activation_floats_for(spec, batch, ranks, saved);
            debug_assert_eq!(floats + activations.set_floats(0), expected);
        }
        Self {
            spec: spec.clone(),
            batch,
            layout,
            stage,
            activations,
            split_backward: saved.split_backward,
            segment,
            recompute,
            scratch,
            receipts,
            tp,
            exchange,
            ep,
            cx,
            expert_stats: ExpertStats::default(),
            logit_grad_zeros: None,
            recomputes_timed: None,
            offload: None,
            fp8: (saved.fp8 != Fp8Recipe::None).then(|| Fp8Blocks::new(saved.fp8, spec.layers, memory)),
        }
    }

    /// Activation offload: from now on each block's activations but its output leave the
    /// device for `tier` after its forward and come back for its backward. Not with
    /// checkpointing that recomputes blocks, nor ZB-H1's W (validation refuses both).
    pub fn offload_activations(&mut self, be: &B, tier: &ActivationTier) -> Result<(), ActivationOffloadError> {
        assert!(
            self.segment.is_none() && !self.split_backward,
            "activation offload moves kept blocks once each way: not with checkpointing segments or a W"
        );
        let lens = self.activations.shapes[0].offloaded_lens();
        let memory = self.activations.memory().clone();
        self.offload = Some(ActivationOffload::new(be, tier, lens, &memory)?);
        self.activations.offload_blocks();
        Ok(())
    }

    /// FP8: the step is over; what its casts saw on this stage's blocks, and the next
    /// step's scales (None without FP8).
    pub fn fp8_end_step(&mut self) -> Option<Fp8Metrics> {
        self.fp8.as_mut().map(Fp8Blocks::end_step)
    }

    /// FP8: every tensor's scale and amax history, for a checkpoint (None without FP8).
    pub fn fp8_save(&self) -> Option<Vec<f32>> {
        self.fp8.as_ref().map(Fp8Blocks::save)
    }

    /// FP8: puts back what [`Gpt::fp8_save`] wrote.
    pub fn fp8_restore(&mut self, saved: &[f32]) -> Result<(), String> {
        match &mut self.fp8 {
            Some(fp8) => fp8.restore(saved),
            None => Err("the checkpoint holds FP8 scales and this run has no FP8".into()),
        }
    }

    /// FP8: forgets the casts since the last step (an evaluation's).
    pub fn fp8_forget_casts(&mut self) {
        if let Some(fp8) = &mut self.fp8 {
            fp8.forget_casts();
        }
    }

    /// Activation offload's moves are drawn on the timeline in step `step` when `record`.
    pub fn begin_offload_step(&mut self, step: u64, record: bool) {
        if let Some(offload) = &mut self.offload {
            offload.begin_step(step, record);
        }
    }

    /// Activation offload's moves recorded so far (None without it).
    pub fn offload_spans(&self) -> Option<Vec<Span>> {
        self.offload.as_ref().map(ActivationOffload::spans)
    }

    /// Forgets every micro-batch's activations (an evaluation's forward, which no backward
    /// follows): released from the ledger and kept for the next forward.
    pub fn drop_activations(&mut self) -> Result<(), TrainError> {
        if let Some(offload) = &mut self.offload {
            for f in &self.activations.in_flight {
                offload.forget(f.chunk, f.micro)?;
            }
        }
        self.activations.release_all();
        Ok(())
    }

    /// After a forward of the whole model on micro-batch 0 (and before its backward): the
    /// next-token probabilities at every position, (batch * seq_len, vocab) — the loss
    /// turns the logits into them in place.
    pub fn probabilities(&self) -> Option<&B::Buf> {
        self.activations.find(0, 0)?.head.as_ref().map(|head| &head.logits)
    }

    /// Micro-batches whose activations this stage holds now.
    pub fn micro_batches_in_flight(&self) -> usize {
        self.activations.in_flight.len()
    }

    /// Bytes of every buffer the model holds in use (spare activation sets aside),
    /// counted from the buffers themselves (what the memory ledger must agree with).
    pub fn held_bytes(&self, be: &B) -> u64 {
        let mut bufs: Vec<&B::Buf> = self.recompute.iter().flat_map(BlockActivations::buffers).collect();
        bufs.extend(self.scratch.buffers());
        bufs.extend(self.exchange.iter().flat_map(Exchange::buffers));
        bufs.extend(self.cx.iter().flat_map(|x| x.exchange.buffers()));
        debug_assert_eq!(bufs.len(), self.receipts.len());
        bufs.extend(self.activations.buffers());
        let staging = self.offload.as_ref().map_or(0, ActivationOffload::staging_bytes);
        staging + bufs.iter().map(|b| (be.buf_len(b) * std::mem::size_of::<B::Elem>()) as u64).sum::<u64>()
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

    /// The context-parallel group, if any (the trainer starts its steps).
    pub fn context_parallel(&mut self) -> Option<&mut (dyn ContextParallelGroup<B> + 'static)> {
        self.cx.as_mut().map(|x| x.group.as_mut())
    }

    /// The all-to-alls the context-parallel group recorded (None without one).
    pub fn cp_spans(&self) -> Option<Vec<Span>> {
        self.cx.as_ref().map(|x| x.group.spans())
    }

    /// Tokens of each sequence this rank holds: seq_len, or with context parallelism its
    /// T/cp, tokens `position..position + T/cp` of every sequence.
    pub fn tokens_per_sequence(&self) -> usize {
        self.activations.shapes[0].t
    }

    /// Where this rank's tokens of each sequence sit in it: all of them, or with context
    /// parallelism its T/cp (the balanced ring's in two runs).
    fn token_positions(&self) -> Positions {
        let shape = &self.activations.shapes[0];
        match self.cx.as_ref().map(|x| x.group.place()) {
            Some(place) => {
                Positions::of_rank(place.rank, place.size, shape.seq, shape.cp_kind == ContextParallel::Ring)
            }
            None => Positions::run(0, shape.seq),
        }
    }

    /// The embeddings' pieces of a micro-batch: its rows, the tokens of a sequence in them,
    /// and the position table's rows they read (a range of the parameter buffer; empty
    /// for a model without one). One piece, or with the balanced ring one per sequence and
    /// run of positions.
    fn embedding_pieces(&self) -> Vec<(Range<usize>, usize, Range<usize>)> {
        let (pos, c, tokens) = (self.token_positions(), self.spec.d_model, self.tokens_per_sequence());
        let wpe = &self.layout.wpe;
        let table = |start: usize, len: usize| match wpe.is_empty() {
            true => wpe.clone(),
            false => wpe.start + start * c..wpe.start + (start + len) * c,
        };
        if pos.parts == 1 || wpe.is_empty() {
            return vec![(0..self.batch * tokens, tokens, table(pos.starts[0], tokens))];
        }
        (0..self.batch)
            .flat_map(|b| (0..pos.parts).map(move |r| (b, r)))
            .map(|(b, r)| {
                let rows = b * tokens + r * pos.part..b * tokens + (r + 1) * pos.part;
                (rows, pos.part, table(pos.starts[r], pos.part))
            })
            .collect()
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
    ) -> Result<f64, TrainError> {
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
    ) -> Result<f64, TrainError> {
        let ModelSpec { d_model: c, vocab, .. } = self.spec;
        let (t, pieces) = (self.tokens_per_sequence(), self.embedding_pieces());
        let dims = self.dims();
        let mut upcoming = Upcoming::new(self.stage.forward_opens(chunk));
        let lay = &self.layout;
        let acts = self.activations.take(be, chunk, micro);

        match input {
            StageInput::Tokens(inputs) => {
                assert_eq!(inputs.len(), self.batch * t, "inputs must hold batch * seq_len tokens (this rank's)");
                upcoming.before_open(state, Unit::Embeddings, Pass::Forward);
                let (p, at) = state.open(be, Unit::Embeddings, Pass::Forward)?.params.expect("forward has parameters");
                // With sequence parallelism every rank embeds every token (the embeddings
                // are replicated) and keeps its own.
                let out = match &mut self.exchange {
                    Some(e) => &mut e.full,
                    None => &mut acts.encoded,
                };
                for (rows, t, table) in pieces {
                    be.encoder_forward(
                        be.view_mut(out, rows.start * c..rows.end * c),
                        &inputs[rows],
                        be.view(p, shift(&lay.wte, at)),
                        be.view(p, shift(&table, at)),
                        t,
                        c,
                    );
                }
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
            let (p, at) =
                open_block(state, be, l, Pass::Forward, &mut self.fp8)?.params.expect("forward has parameters");
            let w = lay.blocks[l].map(|r| be.view(p, shift(r, at)));
            match self.segment {
                // Keep everything: block i's activations live in the slot.
                None => {
                    let key = BlockKey { chunk, micro, block: i, layer: l };
                    let (done, rest) = acts.blocks.split_at_mut(i);
                    if let Some(offload) = &mut self.offload {
                        offload.make(be, key, &mut rest[0]);
                    }
                    let x = done.last().map_or(&acts.encoded, |prev| &prev.res_mlp);
                    let (tp, exchange, ep, cx) = (&mut self.tp, &mut self.exchange, &mut self.ep, &mut self.cx);
                    let probs = dims.recompute_probabilities.then_some(&mut self.scratch.probs);
                    let fp8 = self.fp8.as_mut().map(|f| f.of(l));
                    block_forward(be, &w, x, &mut rest[0], probs, dims, tp, exchange, ep, cx, l, fp8)?;
                    self.expert_stats.add(rest[0].moe.as_ref());
                    if let Some(offload) = &mut self.offload {
                        offload.put(be, key, &mut rest[0])?;
                    }
                }
                // Checkpointing: run the block in the shared segment buffers and keep only
                // the output of each segment's last block.
                Some(k) => {
                    let (tp, exchange, ep, cx) = (&mut self.tp, &mut self.exchange, &mut self.ep, &mut self.cx);
                    segment_block_forward(be, &w, acts, &mut self.recompute, i, k, dims, tp, exchange, ep, cx, l)?;
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
            head_forward(be, &head_params(be, lay, p, at), last, head, (dims, vocab), &mut self.tp)?;
        }
        state.close(be, Unit::Head, Pass::Forward)?;
        Ok(be.crossentropy_forward(be.all_mut(&mut head.logits), be.all_mut(&mut head.losses), targets, vocab))
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
        let own = self.activations.shapes[0].res_rows;
        let kv_heads = self.spec.key_value_heads();
        let here = AttentionShape { seq_len, heads: heads / n, kv_heads: kv_heads / n, head_size: d_model / heads };
        let place = self.cx.as_ref().map(|x| x.group.place());
        let (batch, tokens) = (self.batch, self.tokens_per_sequence());
        let shape = &self.activations.shapes[0];
        // Context parallelism: Ulysses' attention runs heads/cp of them on whole sequences;
        // the ring's every head on this rank's tokens, at their positions.
        let (attended, positions, context) = match place {
            Some(place) if shape.ring() => {
                let balanced = shape.cp_kind == ContextParallel::Ring;
                let ring = ContextDims::Ring { place, seq: seq_len, balanced };
                (AttentionShape { seq_len: tokens, ..here }, self.token_positions(), Some(ring))
            }
            Some(place) if place.size > 1 => {
                let qkv = [here.q_width(), here.kv_width(), here.kv_width()];
                let out = [here.q_width(), 0, 0];
                let ulysses = ContextDims::Ulysses {
                    qkv: ExchangeShape { batch, tokens, groups: qkv },
                    out: ExchangeShape { batch, tokens, groups: out },
                };
                let (heads, kv_heads) = (here.heads / place.size, here.kv_heads / place.size);
                (AttentionShape { heads, kv_heads, ..here }, Positions::run(0, seq_len), Some(ulysses))
            }
            _ => (here, Positions::run(0, seq_len), None),
        };
        Dims {
            c: d_model,
            cl: d_model / n,
            heads: attended,
            qkv: here.qkv_width(),
            positions,
            context,
            hidden: self.spec.d_ff() / n,
            family: self.spec.family,
            rope_theta: self.spec.rope_theta,
            lead: rank == 0,
            attention: self.activations.shapes[0].attention,
            mine: self.exchange.is_some().then_some(Tokens { start: rank * own, len: own }),
            recompute_probabilities: self.activations.shapes[0].recompute_probabilities,
            experts: self.activations.shapes[0].experts,
            balance_weight: 0.0,
        }
    }

    /// Elements of what a stage hands to the next one (and gets the gradient of): a
    /// micro-batch's residual stream, this rank's tokens' with sequence parallelism.
    pub fn stage_output_len(&self) -> usize {
        self.activations.shapes[0].res_rows * self.activations.shapes[0].c
    }

    /// What the forward of `micro` through chunk `chunk` hands to the next chunk: its last
    /// block's output.
    pub fn output(&self, chunk: usize, micro: usize) -> &B::Buf {
        self.activations.find(chunk, micro).expect("backward before forward").output()
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
    ) -> Result<(), TrainError> {
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
    ) -> Result<(), TrainError> {
        let ModelSpec { d_model: c, vocab, aux_loss_coef, .. } = self.spec;
        let (t, pieces) = (self.tokens_per_sequence(), self.embedding_pieces());
        // The balance loss of each routing is weighted as the micro-batch's tokens are.
        let balance_weight = aux_loss_coef * (self.batch * t) as f64 * dloss;
        let dims = Dims { balance_weight, ..self.dims() };
        // ZB-H1: each block's B keeps its matmuls' output gradients here for the W.
        let mut stash = self.split_backward.then(|| self.activations.take_stash(be, self.stage.chunks[chunk].len()));
        let lay = &self.layout;
        let index = self.activations.index_of(chunk, micro);
        let with_params = self.backward_pass();
        let mut upcoming = Upcoming::new(self.stage.backward_opens(chunk, self.segment, with_params));
        let s = &mut self.scratch;
        let acts = &mut self.activations.in_flight[index].acts;
        let first_block = self.stage.chunks[chunk].start;
        let blocks = self.stage.chunks[chunk].len();
        let key = |i: usize| BlockKey { chunk, micro, block: i, layer: first_block + i };
        // (offloaded: the last block's read runs while the head's backward does)
        if let (Some(offload), Some(last)) = (&mut self.offload, blocks.checked_sub(1)) {
            offload.read_ahead(key(last))?;
        }

        if let Some(head) = acts.head.as_mut() {
            // loss and LM head
            be.crossentropy_backward(be.all_mut(&mut head.logits), targets, vocab, dloss);
            if self.logit_grad_zeros.is_none() {
                self.logit_grad_zeros = Some(LogitGradZeros::count(be, &head.logits, targets.len(), vocab));
            }
        }
        if let Some(head) = &acts.head {
            upcoming.before_open(state, Unit::Head, with_params);
            let open = state.open(be, Unit::Head, with_params)?;
            let (p, at) = open.params.expect("backward of the head has parameters");
            let (g, g_at) = open.grads.expect("backward has gradients");
            let g = split_head(be, be.view_mut(g, shift(&Unit::Head.range(lay), g_at)), lay);
            let (w, x, split) = (head_params(be, lay, p, at), acts.output(), stash.is_some());
            head_backward(be, &w, g, x, head, s, (dims, vocab, split), &mut self.tp, &mut self.exchange)?;
        } else {
            // The next stage sent the gradient of our output.
            be.upload(&mut s.dres, grad_output.expect("a stage before the last gets its output's gradient"));
        }
        if acts.head.is_some() {
            state.close(be, Unit::Head, with_params)?;
        }

        // Segments of blocks, last first: without checkpointing one segment of them all,
        // with its activations saved; with it, `k` blocks at a time, recomputed first.
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
                    let (tp, exchange, ep, cx) = (&mut self.tp, &mut self.exchange, &mut self.ep, &mut self.cx);
                    segment_block_forward(be, &w, acts, &mut self.recompute, i, k, dims, tp, exchange, ep, cx, l)?;
                    state.close(be, Unit::Block(l), Pass::Recompute)?;
                }
            }
            for i in (start..end).rev() {
                let l = first_block + i;
                if let Some(offload) = &mut self.offload {
                    offload.take_back(be, key(i), &mut acts.blocks[i], i.checked_sub(1).map(key))?;
                }
                // (a scope, so that the block's views end before it is closed)
                {
                    upcoming.before_open(state, Unit::Block(l), with_params);
                    let open = open_block(state, be, l, with_params, &mut self.fp8)?;
                    let (p, at) = open.params.expect("backward of a block has parameters");
                    let (g, g_at) = open.grads.expect("backward has gradients");
                    let gw = split_block(be, be.view_mut(g, shift(&Unit::Block(l).range(lay), g_at)), &lay.blocks[l]);
                    let w = lay.blocks[l].map(|r| be.view(p, shift(r, at)));
                    let (x, a) = match self.segment {
                        None => {
                            let a = &acts.blocks[i];
                            if dims.recompute_probabilities {
                                timed(be, &mut self.recomputes_timed, l, || recompute_probabilities(be, a, s, dims));
                            }
                            (if i == 0 { &acts.encoded } else { &acts.blocks[i - 1].res_mlp }, a)
                        }
                        Some(_) => {
                            if i == end - 1 {
                                let (tp, exchange, ep, cx) =
                                    (&mut self.tp, &mut self.exchange, &mut self.ep, &mut self.cx);
                                let recompute = &mut self.recompute;
                                timed(be, &mut self.recomputes_timed, l, || {
                                    segment_block_forward(be, &w, acts, recompute, i, k, dims, tp, exchange, ep, cx, l)
                                })?;
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
                    let (tp, exchange, ep, cx) = (&mut self.tp, &mut self.exchange, &mut self.ep, &mut self.cx);
                    let fp8 = self.fp8.as_mut().map(|f| f.of(l));
                    block_backward(be, &w, gw, x, a, s, dims, tp, exchange, ep, cx, l, keep, fp8)?;
                }
                state.close(be, Unit::Block(l), with_params)?;
                if let Some(offload) = &mut self.offload {
                    offload.free(be, key(i), &mut acts.blocks[i]);
                }
            }
        }
        // Every activation of this micro-batch is consumed (the embeddings' backward needs
        // only the token ids): released from the ledger, kept for the next forward. ZB-H1
        // keeps them, and the stash, for the W.
        match stash {
            Some(kept) => self.activations.in_flight[index].stash = Some(kept),
            None => self.activations.release(index),
        }
        if !self.stage.starts_model(chunk) {
            return Ok(());
        }
        let without_params = Pass::Backward { params: false };
        {
            upcoming.before_open(state, Unit::Embeddings, without_params);
            let (g, g_at) = state.open(be, Unit::Embeddings, without_params)?.grads.expect("backward has gradients");
            let g = be.view_mut(g, shift(&Unit::Embeddings.range(lay), g_at));
            let (mut g_wte, mut g_wpe) = be.split_mut(g, lay.wte.len());
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
            // (context parallelism: the rows of this rank's positions, in one or more pieces)
            for (rows, t, table) in pieces {
                let (_, g_table) = be.split_mut(be.reborrow(&mut g_wpe), table.start - lay.wpe.start);
                let (g_table, _) = be.split_mut(g_table, table.len());
                let dout = be.view(whole, rows.start * c..rows.end * c);
                be.encoder_backward(be.reborrow(&mut g_wte), g_table, dout, &inputs[rows], t, c);
            }
        }
        Ok(state.close(be, Unit::Embeddings, without_params)?)
    }
}

/// Runs `recompute`, a forward run again inside block `layer`'s backward, timed into
/// `times` when they are being kept ([`Gpt::time_recomputes`]).
/// Opens block `l` for `pass`; with FP8 through [`ModelState::open_fp8`], which may hand
/// its weights over already cast.
fn open_block<'s, B: Backend>(
    state: &'s mut dyn ModelState<B>,
    be: &B,
    l: usize,
    pass: Pass,
    fp8: &mut Option<Fp8Blocks>,
) -> Result<OpenUnit<'s, B::Buf>, CommError> {
    match fp8 {
        Some(fp8) => state.open_fp8(be, Unit::Block(l), pass, fp8.of(l).0),
        None => state.open(be, Unit::Block(l), pass),
    }
}

fn timed<B: Backend, R>(
    be: &B,
    times: &mut Option<Vec<RecomputeTime>>,
    layer: usize,
    recompute: impl FnOnce() -> R,
) -> R {
    let start = times.is_some().then(now_us);
    let out = recompute();
    if let (Some(start_us), Some(times)) = (start, times.as_mut()) {
        be.synchronize();
        times.push(RecomputeTime { layer, start_us, end_us: now_us() });
    }
    out
}
