//! What forward keeps for backward, and its bookkeeping: one micro-batch's activations
//! on a stage ([`Activations`], a [`BlockActivations`] per block), what ZB-H1's B leaves
//! for its W ([`WeightStash`]), and [`InFlight`] sets: taken (and booked in the memory
//! ledger) when a micro-batch's forward starts, released when its backward (or W) is
//! done, and kept for reuse as a caching allocator would, so a stage allocates as many
//! sets as it ever had in flight at once. [`Saved`] says what is kept (activation
//! checkpointing, flash attention's log-sum-exp), [`activation_floats_for`] how much,
//! without allocating.

use std::sync::Arc;

use distlab_common::{Attention, Checkpointing, ContextParallel, Fp8Recipe, ModelFamily, ModelSpec};

use crate::backend::Backend;
use crate::memory::{Category, MemoryTracker, Receipt};
use crate::model::experts::{expert_activation_floats, expert_scratch_floats, ExpertActivations, ExpertShape};
use crate::model::stage::Stage;

/// What one block keeps from forward for backward (one micro-batch).
pub(super) struct BlockActivations<Buf> {
    pub(super) ln1: Buf,
    /// The norms' row statistics: LayerNorm's mean and 1/std; RMSNorm's 1/rms only (its
    /// mean buffers are empty).
    pub(super) ln1_mean: Buf,
    pub(super) ln1_rstd: Buf,
    pub(super) qkv: Buf,
    /// Softmax probabilities, (batch, heads, T, T); with flash attention only one
    /// log-sum-exp per row, (batch, heads, T, 2); with selective recompute nothing (the
    /// stage's one `GradScratch::probs` holds them, made again by the block's backward).
    pub(super) att: Buf,
    /// Attention output before its projection.
    pub(super) atty: Buf,
    /// Context parallelism with flash attention: the output as attention made it, every
    /// token of this rank's heads, for flash's backward (empty otherwise).
    pub(super) atty_heads: Buf,
    /// Residual stream after the attention half.
    pub(super) res_attn: Buf,
    pub(super) ln2: Buf,
    pub(super) ln2_mean: Buf,
    pub(super) ln2_rstd: Buf,
    /// The MLP's first matmul's output (GPT-2: the hidden layer; Llama: the gate and the
    /// up projection side by side, twice as wide) and the hidden layer after the
    /// nonlinearity, GELU or SwiGLU (with experts: of every slot).
    pub(super) fch: Buf,
    pub(super) fch_act: Buf,
    /// Residual stream after the MLP half: the block's output.
    pub(super) res_mlp: Buf,
    /// Mixture of Experts: the router's and the slots' buffers, the routing.
    pub(super) moe: Option<ExpertActivations<Buf>>,
}

impl<Buf> BlockActivations<Buf> {
    pub(super) fn buffers(&self) -> Vec<&Buf> {
        let mut bufs = vec![
            &self.ln1,
            &self.ln1_mean,
            &self.ln1_rstd,
            &self.qkv,
            &self.att,
            &self.atty,
            &self.atty_heads,
            &self.res_attn,
            &self.ln2,
            &self.ln2_mean,
            &self.ln2_rstd,
            &self.fch,
            &self.fch_act,
            &self.res_mlp,
        ];
        bufs.extend(self.moe.iter().flat_map(ExpertActivations::buffers));
        bufs
    }

    /// What activation offload moves off the device between the block's forward and its
    /// backward: every buffer but its output (`res_mlp`), which the next block reads as
    /// its input in both passes (the routing of experts is host memory already).
    pub(super) fn offloaded_mut(&mut self) -> Vec<&mut Buf> {
        let mut bufs = vec![
            &mut self.ln1,
            &mut self.ln1_mean,
            &mut self.ln1_rstd,
            &mut self.qkv,
            &mut self.att,
            &mut self.atty,
            &mut self.atty_heads,
            &mut self.res_attn,
            &mut self.ln2,
            &mut self.ln2_mean,
            &mut self.ln2_rstd,
            &mut self.fch,
            &mut self.fch_act,
        ];
        bufs.extend(self.moe.iter_mut().flat_map(ExpertActivations::buffers_mut));
        bufs
    }
}

/// ZB-H1: what a block's B leaves for its W, the gradients of its four matmuls' outputs
/// (their inputs are activations the micro-batch keeps until the W anyway).
pub(super) struct WeightStash<Buf> {
    /// d(MLP output), the gradient of `fc_proj`'s output (rows x c).
    pub(super) dmlp_out: Buf,
    /// d(MLP hidden layer before its nonlinearity), of `fc`'s output (rows x its width).
    pub(super) dfch: Buf,
    /// d(attention output), of `attn_proj`'s output (rows x c).
    pub(super) dattn_out: Buf,
    /// d(q, k, v), of `qkv`'s output (rows x its width).
    pub(super) dqkv: Buf,
}

impl<Buf> WeightStash<Buf> {
    pub(super) fn buffers(&self) -> [&Buf; 4] {
        [&self.dmlp_out, &self.dfch, &self.dattn_out, &self.dqkv]
    }
}

/// What one micro-batch leaves on this stage for its backward.
pub(super) struct Activations<Buf> {
    /// The stage's input: the embedding output on the first stage, what the previous
    /// stage sent on the others.
    pub(super) encoded: Buf,
    /// The stage's blocks, in order (without activation checkpointing).
    pub(super) blocks: Vec<BlockActivations<Buf>>,
    /// With checkpointing: the output of each segment's last block (b x s x d each; with
    /// sequence parallelism this rank's tokens, b x s/t x d).
    pub(super) checkpoints: Vec<Buf>,
    /// The last stage only.
    pub(super) head: Option<HeadActivations<Buf>>,
}

/// What the head keeps from forward for backward (the last stage only).
pub(super) struct HeadActivations<Buf> {
    pub(super) lnf: Buf,
    pub(super) lnf_mean: Buf,
    pub(super) lnf_rstd: Buf,
    /// Logits, turned into probabilities by the loss, then into their gradient.
    pub(super) logits: Buf,
    pub(super) losses: Buf,
}

impl<Buf> Activations<Buf> {
    /// The stage's output: its last block's (or, with no blocks, its input).
    pub(super) fn output(&self) -> &Buf {
        stage_output(&self.checkpoints, &self.blocks, &self.encoded)
    }
}

/// [`Activations::output`] from the fields, for callers that hold `head` mutably.
pub(super) fn stage_output<'a, Buf>(
    checkpoints: &'a [Buf],
    blocks: &'a [BlockActivations<Buf>],
    encoded: &'a Buf,
) -> &'a Buf {
    checkpoints.last().or(blocks.last().map(|b| &b.res_mlp)).unwrap_or(encoded)
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
    /// Context parallelism's kind (with cp > 1): Ulysses keeps head-split q, k, v, the ring
    /// its own tokens' and a log-sum-exp per row.
    pub cp_kind: ContextParallel,
    /// FP8 products in the blocks' linear layers (`fp8_linear.rs`): nothing more is kept.
    pub fp8: Fp8Recipe,
}

impl Default for Saved {
    fn default() -> Self {
        Saved {
            checkpointing: Checkpointing::None,
            attention: Attention::Naive,
            sequence_parallel: false,
            split_backward: false,
            cp_kind: ContextParallel::Ulysses,
            fp8: Fp8Recipe::None,
        }
    }
}

impl Saved {
    /// Blocks per recomputed segment on a stage of `blocks` blocks: every block its own
    /// segment, or about sqrt(blocks) of them (ceil), keeping one output per segment
    /// (Chen et al. 2016: sqrt(L) memory for one extra forward).
    pub fn segment(&self, blocks: usize) -> Option<usize> {
        match self.checkpointing {
            Checkpointing::None | Checkpointing::Selective => None,
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

/// The sizes of one micro-batch's [`Activations`] on this rank.
#[derive(Clone, Copy, Debug)]
pub(super) struct ActivationShape {
    pub(super) batch: usize,
    pub(super) rows: usize,
    /// Rows of the LayerNorm and residual regions this rank keeps: all of them, or with
    /// sequence parallelism its own tokens' (rows / tp).
    pub(super) res_rows: usize,
    /// Tokens of each sequence on this rank (with context parallelism T/cp), and the
    /// whole sequence's, which attention sees.
    pub(super) t: usize,
    pub(super) seq: usize,
    /// Context parallelism: ranks sharing each sequence (1 without it), and how.
    pub(super) cp: usize,
    pub(super) cp_kind: ContextParallel,
    pub(super) c: usize,
    /// This rank's width of the attention (its query heads), of q, k and v together, and of
    /// the MLP's hidden layer.
    pub(super) cl: usize,
    pub(super) qkv: usize,
    pub(super) heads: usize,
    pub(super) hidden: usize,
    /// GPT-2's blocks or Llama's (RMSNorm's one statistic, SwiGLU's gate and up).
    pub(super) family: ModelFamily,
    pub(super) vocab: usize,
    /// Blocks whose activations are all kept (none with checkpointing).
    pub(super) kept_blocks: usize,
    /// Segment outputs kept (checkpointing).
    pub(super) checkpoints: usize,
    pub(super) last: bool,
    pub(super) attention: Attention,
    /// Selective recompute: blocks keep no attention probabilities; the stage holds one
    /// block's, for the forward that makes them and the backward that makes them again.
    pub(super) recompute_probabilities: bool,
    /// Mixture of Experts (None: dense blocks).
    pub(super) experts: Option<ExpertShape>,
}

impl ActivationShape {
    /// The sizes on one of `tp` tensor-parallel ranks (with `sequence_parallel`, its share
    /// of the LayerNorm and residual regions), one of `ep` expert-parallel ranks and one of
    /// `cp` context-parallel ranks (its T/cp tokens, attention's heads/cp), for
    /// micro-batches of `batch` sequences, before [`Self::for_chunks`] says what a chunk keeps.
    pub(super) fn new(
        spec: &ModelSpec,
        batch: usize,
        (tp, ep, cp): (usize, usize, usize),
        saved: Saved,
        sequence_parallel: bool,
    ) -> Self {
        let attention = saved.attention;
        let t = spec.seq_len / cp;
        let rows = batch * t;
        assert!(
            !sequence_parallel || rows.is_multiple_of(tp),
            "sequence parallelism splits {rows} tokens over tp={tp}: validation lets only multiples through"
        );
        ActivationShape {
            batch,
            rows,
            res_rows: if sequence_parallel { rows / tp } else { rows },
            t,
            seq: spec.seq_len,
            cp,
            cp_kind: saved.cp_kind,
            c: spec.d_model,
            cl: spec.d_model / tp,
            qkv: spec.qkv_width() as usize / tp,
            heads: spec.heads / tp,
            hidden: spec.d_ff() / tp,
            family: spec.family,
            vocab: spec.vocab,
            kept_blocks: 0,
            checkpoints: 0,
            last: false,
            attention,
            recompute_probabilities: false,
            experts: ExpertShape::of(spec, rows, ep),
        }
    }

    /// This shape for each of `stage`'s chunks: every block's activations kept, or with
    /// checkpointing (`segment`: blocks per segment) each segment's output; the head's on
    /// the chunk that ends the model.
    pub(super) fn for_chunks(&self, stage: &Stage, segment: Option<usize>) -> Vec<ActivationShape> {
        (0..stage.chunks.len())
            .map(|chunk| {
                let blocks = stage.chunks[chunk].len();
                let (kept_blocks, checkpoints) = match segment {
                    None => (blocks, 0),
                    Some(k) => (0, blocks.div_ceil(k)),
                };
                ActivationShape { kept_blocks, checkpoints, last: stage.ends_model(chunk), ..*self }
            })
            .collect()
    }

    /// Rows of the MLP's hidden layer: the tokens, or with experts every slot.
    pub(super) fn mlp_rows(&self) -> usize {
        self.experts.map_or(self.rows, |e| e.slots())
    }

    /// Width of the MLP's first matmul's output: the hidden layer, or Llama's gate and up.
    pub(super) fn mlp_in(&self) -> usize {
        mlp_in(self.family, self.hidden)
    }

    /// Rows a norm keeps statistics for, per statistic: (mean, 1/std or 1/rms).
    pub(super) fn norm_stat_rows(&self) -> (usize, usize) {
        norm_stat_rows(self.family, self.res_rows)
    }

    /// Elements of the attention's saved tensor (and of its gradient scratch).
    pub(super) fn attention_floats(&self) -> usize {
        match self.ring() {
            true => attention_floats(self.batch, self.heads, self.t, Attention::Flash),
            false => attention_floats(self.batch, self.heads / self.cp, self.seq, self.attention),
        }
    }

    /// Whether the ring runs attention (cp > 1).
    pub(super) fn ring(&self) -> bool {
        self.cp > 1 && self.cp_kind.is_ring()
    }

    /// Context parallelism: its exchange buffers' widths (q, k and v; the attention
    /// output), or None without it.
    pub(super) fn context_widths(&self) -> Option<(usize, usize)> {
        (self.cp > 1).then_some((self.qkv, self.cl))
    }

    /// One block's buffers, each from `alloc(floats)`.
    pub(super) fn block<Buf>(&self, alloc: &mut dyn FnMut(usize) -> Buf) -> BlockActivations<Buf> {
        let (rows, own, c, cl, hidden) = (self.rows, self.res_rows, self.c, self.cl, self.hidden);
        let (mean, rstd) = self.norm_stat_rows();
        BlockActivations {
            ln1: alloc(own * c),
            ln1_mean: alloc(mean),
            ln1_rstd: alloc(rstd),
            qkv: alloc(rows * self.qkv),
            att: alloc(if self.recompute_probabilities { 0 } else { self.attention_floats() }),
            atty: alloc(rows * cl),
            atty_heads: alloc(match self.cp > 1 && !self.ring() && self.attention == Attention::Flash {
                true => rows * cl,
                false => 0,
            }),
            res_attn: alloc(own * c),
            ln2: alloc(own * c),
            ln2_mean: alloc(mean),
            ln2_rstd: alloc(rstd),
            fch: alloc(self.mlp_rows() * self.mlp_in()),
            fch_act: alloc(self.mlp_rows() * hidden),
            res_mlp: alloc(own * c),
            moe: self.experts.map(|e| ExpertActivations::new(&e, rows, c, alloc)),
        }
    }

    /// One block's buffers with only its output made, the rest empty (activation offload
    /// makes them for the block's forward and brings them back for its backward).
    pub(super) fn output_only<Buf>(&self, alloc: &mut dyn FnMut(usize) -> Buf) -> BlockActivations<Buf> {
        let mut block = self.block(&mut |_| alloc(0));
        block.res_mlp = alloc(self.res_rows * self.c);
        block
    }

    /// Everything one micro-batch's forward leaves for its backward.
    pub(super) fn set<Buf>(&self, alloc: &mut dyn FnMut(usize) -> Buf) -> Activations<Buf> {
        let (rows, own, c) = (self.rows, self.res_rows, self.c);
        let (mean, rstd) = self.norm_stat_rows();
        Activations {
            encoded: alloc(own * c),
            blocks: (0..self.kept_blocks).map(|_| self.block(alloc)).collect(),
            checkpoints: (0..self.checkpoints).map(|_| alloc(own * c)).collect(),
            // The final LayerNorm's output is whole (gathered, with sequence parallelism)
            // for the LM head, which every TP rank runs in full.
            head: self.last.then(|| HeadActivations {
                lnf: alloc(rows * c),
                lnf_mean: alloc(mean),
                lnf_rstd: alloc(rstd),
                logits: alloc(rows * self.vocab),
                losses: alloc(rows),
            }),
        }
    }

    /// The lengths of the buffers activation offload moves off the device of one block,
    /// in [`BlockActivations::offloaded_mut`]'s order.
    pub(super) fn offloaded_lens(&self) -> Vec<usize> {
        self.block(&mut |len| len).offloaded_mut().into_iter().map(|len| *len).collect()
    }

    /// Floats of what activation offload moves off the device of one block.
    pub(super) fn offloaded_floats(&self) -> usize {
        self.offloaded_lens().iter().sum()
    }

    /// Floats of one [`Self::set`].
    pub(super) fn set_floats(&self) -> usize {
        let mut floats = 0;
        self.set(&mut |len| floats += len);
        floats
    }
}

/// Width of the MLP's first matmul's output for `hidden` units: GPT-2's hidden layer, or
/// Llama's gate and up projection side by side.
pub(super) fn mlp_in(family: ModelFamily, hidden: usize) -> usize {
    match family {
        ModelFamily::Gpt2 => hidden,
        ModelFamily::Llama => 2 * hidden,
    }
}

/// Rows of a norm's statistics over `rows` rows: LayerNorm's mean and 1/std, RMSNorm's
/// 1/rms alone.
fn norm_stat_rows(family: ModelFamily, rows: usize) -> (usize, usize) {
    match family {
        ModelFamily::Gpt2 => (rows, rows),
        ModelFamily::Llama => (0, rows),
    }
}

/// Elements attention keeps per micro-batch of `batch` sequences for `heads` heads: the
/// (T, T) probabilities of each head, or (flash) a log-sum-exp pair per row.
pub(super) fn attention_floats(batch: usize, heads: usize, t: usize, attention: Attention) -> usize {
    let per_head = match attention {
        Attention::Naive => t.saturating_mul(t),
        Attention::Flash => t.saturating_mul(crate::ops::flash_attention::PAIR),
    };
    batch.saturating_mul(heads).saturating_mul(per_head)
}

/// One micro-batch in flight through one of this stage's chunks: its activations, booked
/// in the ledger until its backward is done (ZB-H1: until its W, with what the B left).
pub(super) struct InFlight<Buf> {
    pub(super) chunk: usize,
    pub(super) micro: usize,
    pub(super) acts: Activations<Buf>,
    pub(super) _booked: Receipt,
    /// ZB-H1, between the B and the W: one stash per block of the chunk, booked.
    pub(super) stash: Option<(Vec<WeightStash<Buf>>, Receipt)>,
}

/// The activations of the micro-batches between their forward and the end of their
/// backward on this stage, and the spare sets kept for the next forwards.
pub(super) struct InFlightSets<B: Backend> {
    pub(super) in_flight: Vec<InFlight<B::Buf>>,
    /// Sets whose backward is done (with the chunk they fit), kept for the next forward
    /// instead of being freed and allocated again (what a caching allocator does: no
    /// longer booked in the ledger, still on the heap, so between steps they show as
    /// "untracked").
    spare: Vec<(usize, Activations<B::Buf>)>,
    /// ZB-H1: stashes whose W is done, kept for the next B like `spare`.
    spare_stashes: Vec<Vec<WeightStash<B::Buf>>>,
    /// The sizes of one micro-batch's activations through each chunk.
    pub(super) shapes: Vec<ActivationShape>,
    /// Floats of one micro-batch's activations through each chunk (what its forward books).
    set_floats: Vec<usize>,
    /// Activation offload: what of each block leaves the device (booked block by block by
    /// the offload, not with the set); 0 without it.
    offloaded_block_floats: usize,
    memory: Arc<MemoryTracker>,
}

impl<B: Backend> InFlightSets<B> {
    pub(super) fn new(shapes: Vec<ActivationShape>, memory: &Arc<MemoryTracker>) -> Self {
        let set_floats = shapes.iter().map(ActivationShape::set_floats).collect();
        Self {
            in_flight: Vec::new(),
            spare: Vec::new(),
            spare_stashes: Vec::new(),
            shapes,
            set_floats,
            offloaded_block_floats: 0,
            memory: memory.clone(),
        }
    }

    /// Activation offload: the sets keep each block's output only, the rest of a block
    /// is allocated for its forward and its backward by the offload, which books it.
    /// Returns the floats of a block it moves.
    pub(super) fn offload_blocks(&mut self) -> usize {
        let block = self.shapes[0].offloaded_floats();
        for (floats, shape) in self.set_floats.iter_mut().zip(&self.shapes) {
            *floats -= shape.kept_blocks * block;
        }
        self.offloaded_block_floats = block;
        block
    }

    /// The ledger the sets are booked in.
    pub(super) fn memory(&self) -> &Arc<MemoryTracker> {
        &self.memory
    }

    /// Floats one micro-batch's forward through chunk `chunk` books.
    pub(super) fn set_floats(&self, chunk: usize) -> usize {
        self.set_floats[chunk]
    }

    /// Micro-batch `micro`'s forward through chunk `chunk` starts: its activations are
    /// allocated and booked (a forward run again before its backward, as a
    /// finite-difference check does, reuses them). Returns them.
    pub(super) fn take(&mut self, be: &B, chunk: usize, micro: usize) -> &mut Activations<B::Buf> {
        if let Some(i) = self.in_flight.iter().position(|f| (f.chunk, f.micro) == (chunk, micro)) {
            let last = self.in_flight.len() - 1;
            self.in_flight.swap(i, last);
        } else {
            let booked = self.memory.alloc_of::<B::Elem>(Category::Activations, self.set_floats[chunk]);
            let shape = self.shapes[chunk];
            let acts = match self.spare.iter().position(|(c, _)| *c == chunk) {
                Some(i) => self.spare.swap_remove(i).1,
                // (offloaded: a block's buffers but its output come with its forward)
                None if self.offloaded_block_floats > 0 => {
                    let mut acts = ActivationShape { kept_blocks: 0, ..shape }.set(&mut |len| be.alloc(len));
                    let output_only = |_| shape.output_only(&mut |len| be.alloc(len));
                    acts.blocks = (0..shape.kept_blocks).map(output_only).collect();
                    acts
                }
                None => shape.set(&mut |len| be.alloc(len)),
            };
            self.in_flight.push(InFlight { chunk, micro, acts, _booked: booked, stash: None });
        }
        &mut self.in_flight.last_mut().expect("taken above").acts
    }

    /// ZB-H1: the stashes a B of `blocks` blocks fills (one per block), booked as
    /// activations until its W.
    pub(super) fn take_stash(&mut self, be: &B, blocks: usize) -> (Vec<WeightStash<B::Buf>>, Receipt) {
        let shape = self.shapes[0];
        let (rows, c) = (shape.rows, shape.c);
        let floats = rows * (2 * c + shape.qkv + shape.mlp_in());
        let booked = self.memory.alloc_of::<B::Elem>(Category::Activations, blocks * floats);
        let mut stash = self.spare_stashes.pop().unwrap_or_default();
        stash.truncate(blocks);
        while stash.len() < blocks {
            stash.push(WeightStash {
                dmlp_out: be.alloc(rows * c),
                dfch: be.alloc(rows * shape.mlp_in()),
                dattn_out: be.alloc(rows * c),
                dqkv: be.alloc(rows * shape.qkv),
            });
        }
        (stash, booked)
    }

    /// The backward (ZB-H1: the W) of set `index` is over: its activations and stash are
    /// released from the ledger and kept for the next forward and B.
    pub(super) fn release(&mut self, index: usize) {
        let done = self.in_flight.swap_remove(index);
        self.spare.push((done.chunk, done.acts));
        if let Some((stash, _booked)) = done.stash {
            self.spare_stashes.push(stash);
        }
    }

    /// Releases every set (an evaluation's forward, which no backward follows).
    pub(super) fn release_all(&mut self) {
        while !self.in_flight.is_empty() {
            self.release(self.in_flight.len() - 1);
        }
    }

    /// Where the activations of micro-batch `micro` through chunk `chunk` are (its forward
    /// ran, its backward has not).
    pub(super) fn index_of(&self, chunk: usize, micro: usize) -> usize {
        self.in_flight.iter().position(|f| (f.chunk, f.micro) == (chunk, micro)).unwrap_or_else(|| {
            panic!("micro-batch {micro} has no activations in chunk {chunk}: backward before forward")
        })
    }

    /// The activations of micro-batch `micro` through chunk `chunk`, if its forward ran
    /// and its backward has not.
    pub(super) fn find(&self, chunk: usize, micro: usize) -> Option<&Activations<B::Buf>> {
        self.in_flight.iter().find(|f| (f.chunk, f.micro) == (chunk, micro)).map(|f| &f.acts)
    }

    /// Every buffer of the sets in flight (with their stashes), spare sets aside.
    pub(super) fn buffers(&self) -> Vec<&B::Buf> {
        let mut bufs = Vec::new();
        for a in self.in_flight.iter().map(|f| &f.acts) {
            bufs.push(&a.encoded);
            if let Some(h) = &a.head {
                bufs.extend([&h.lnf, &h.lnf_mean, &h.lnf_rstd, &h.logits, &h.losses]);
            }
            bufs.extend(a.blocks.iter().flat_map(BlockActivations::buffers));
            bufs.extend(a.checkpoints.iter());
        }
        for (stash, _) in self.in_flight.iter().filter_map(|f| f.stash.as_ref()) {
            bufs.extend(stash.iter().flat_map(WeightStash::buffers));
        }
        bufs
    }
}

/// Floats of one block's activations that activation offload moves off the device (all
/// but its output), on a rank cut as [`activation_floats_for`] says.
pub fn offloaded_block_floats(spec: &ModelSpec, batch: usize, ranks: (usize, usize, usize), saved: Saved) -> usize {
    let (tp, ep, cp) = ranks;
    let sequence_parallel = saved.sequence_parallel && tp > 1;
    let shape = ActivationShape {
        recompute_probabilities: saved.checkpointing == Checkpointing::Selective,
        ..ActivationShape::new(spec, batch, (tp.max(1), ep.max(1), cp.max(1)), saved, sequence_parallel)
    };
    shape.offloaded_floats()
}

/// What [`Gpt::new`](super::Gpt::new) will allocate for activations and their gradients on one of `tp`
/// tensor-parallel ranks (with sequence parallelism, its share of the LayerNorm and
/// residual regions), one of `ep` expert-parallel ranks and one of `cp` context-parallel
/// ranks, without allocating
/// (saturating, so absurd specs give a huge number, not an overflow), keeping every
/// block's activations (selective recompute: but their attention probabilities, one
/// block's held instead).
pub fn activation_floats_for(
    spec: &ModelSpec,
    batch: usize,
    (tp, ep, cp): (usize, usize, usize),
    saved: Saved,
) -> usize {
    let Saved { attention, sequence_parallel, .. } = saved;
    let (n, cp) = (tp.max(1), cp.max(1));
    let ring = cp > 1 && saved.cp_kind.is_ring();
    let (t, c, v, h, l) = (spec.seq_len, spec.d_model, spec.vocab, spec.heads / n, spec.layers);
    let rows = batch.saturating_mul(t) / cp;
    let own = if sequence_parallel && n > 1 { rows / n } else { rows };
    let att = match ring {
        true => attention_floats(batch, h, t / cp, Attention::Flash),
        false => attention_floats(batch, h / cp, t, attention),
    };
    let rc = rows.saturating_mul(c);
    let own_c = own.saturating_mul(c);
    let (qkv, hidden) = (rows.saturating_mul(spec.qkv_width() as usize / n), rows.saturating_mul(spec.d_ff() / n));
    let (mean, rstd) = norm_stat_rows(spec.family, own);
    let (stats, llama) = (mean.saturating_add(rstd), spec.family == ModelFamily::Llama);
    // The MLP's saved values (GPT-2: the hidden layer before and after GELU; Llama: gate
    // and up, and their product) and backward's (GPT-2: one hidden gradient, GELU's
    // backward in place; Llama: the product's, then the gate's and up's).
    let mlp = hidden.saturating_mul(if llama { 3 } else { 2 });
    let dmlp = hidden.saturating_mul(if llama { 3 } else { 1 });
    // per block: ln1, res_attn, ln2, res_mlp (own rows x c); qkv, atty (c/tp), the MLP's;
    // the two norms' statistics; attention probabilities of this rank's heads (a
    // log-sum-exp pair per row with flash; with selective recompute the stage's one set)
    let (kept_att, probs) = match saved.checkpointing {
        Checkpointing::Selective => (0, att),
        _ => (att, 0),
    };
    let block = own_c
        .saturating_mul(4)
        .saturating_add(qkv)
        .saturating_add(rows.saturating_mul(c / n))
        .saturating_add(mlp)
        .saturating_add(stats.saturating_mul(2))
        .saturating_add(kept_att)
        .saturating_add(if cp > 1 && !ring && attention == Attention::Flash { rows.saturating_mul(c / n) } else { 0 });
    // encoded (own rows), lnf (rows x c), lnf statistics (own rows), logits, losses
    let top =
        own_c.saturating_add(rc).saturating_add(stats).saturating_add(rows).saturating_add(rows.saturating_mul(v));
    // backward scratch: dres (own rows), dln (c), datty (c/tp), dqkv, the MLP's, datt (the
    // size of att); sequence parallelism's exchange buffers (two rows x c) and the norms'
    // parameter gradient scratch (a block's two, the final one)
    let scratch = own_c
        .saturating_add(rc)
        .saturating_add(rows.saturating_mul(c / n))
        .saturating_add(qkv)
        .saturating_add(dmlp)
        .saturating_add(att);
    let norm = spec.norm_params() as usize;
    let exchange = if own < rows { rc.saturating_mul(2).saturating_add(3 * norm) } else { 0 };
    // context parallelism's exchange buffers: Ulysses' q, k, v and attention output, the
    // ring's two blocks of k and v and two of their gradients
    let kv = qkv.saturating_sub(rows.saturating_mul(c / n));
    let exchange = exchange
        + match (cp > 1, ring) {
            (false, _) => 0,
            (true, false) => qkv.saturating_add(rows.saturating_mul(c / n)),
            (true, true) => kv.saturating_mul(4),
        };
    // Mixture of Experts (tp = 1): the hidden layers of every slot in place of every
    // token's, the router's and the slots' buffers, and their gradients.
    let (block, scratch) = match ExpertShape::of(spec, rows, ep) {
        None => (block, scratch),
        Some(e) => {
            let block = block.saturating_sub(mlp).saturating_add(expert_activation_floats(&e, rows, c));
            let dmlp_slots = rows.max(e.slots()).saturating_mul(e.grad_width());
            let scratch = scratch.saturating_sub(dmlp).saturating_add(dmlp_slots);
            (block, scratch.saturating_add(expert_scratch_floats(&e, rows, c)))
        }
    };
    block.saturating_mul(l).saturating_add(top).saturating_add(scratch).saturating_add(exchange).saturating_add(probs)
}
