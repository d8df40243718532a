//! The GPT-2-style decoder, composed from the backend's kernels.
//!
//! ```text
//! x = wte[tokens] + wpe[positions]                      (embedding.rs)
//! for each block:  x = x + attn_proj(attention(ln1(x)))  (layernorm.rs, linear.rs, attention.rs)
//!                  x = x + fc_proj(gelu(fc(ln2(x))))      (linear.rs, mlp.rs)
//! logits = lnf(x) · lm_head                              (LM head NOT tied to wte)
//! loss = mean cross-entropy(logits, targets)             (loss.rs)
//! ```
//!
//! Parameters are laid out tensor after tensor in the order of [`ParamLayout`]
//! (embeddings, block 0..L, final LayerNorm, LM head), and gradients the same way, so
//! a flat range of either is a well-defined shard. Where they live is not the model's
//! business: it opens one unit (embeddings, a block, the head) at a time through a
//! [`ModelState`] (`state.rs`), whole buffers for one rank or DDP, gathered shards for
//! FSDP. Activations are allocated once for a micro-batch of `batch` sequences and
//! reused every step.

use std::ops::Range;
use std::sync::Arc;

use distlab_common::ModelSpec;

use crate::backend::{Backend, Float};
use crate::comm::CommError;
use crate::memory::{Category, MemoryTracker, Receipt};
use crate::model::state::{ModelState, Pass, Unit};
use crate::optim::ParamGroup;
use crate::rng::Rng;

/// GPT-2's initialisation: N(0, 0.02) for matrices and embeddings, the residual
/// projections scaled by 1/sqrt(2 * layers), zero biases, LayerNorm gain 1.
pub const INIT_STD: f64 = 0.02;
const INIT_STREAM: u64 = 0x494e_4954_0000_0001;

/// The tensors of one transformer block, in their order in the parameter buffer.
#[derive(Clone, Debug, PartialEq)]
pub struct BlockTensors<T> {
    pub ln1_g: T,
    pub ln1_b: T,
    pub qkv_w: T,
    pub qkv_b: T,
    pub attn_proj_w: T,
    pub attn_proj_b: T,
    pub ln2_g: T,
    pub ln2_b: T,
    pub fc_w: T,
    pub fc_b: T,
    pub fc_proj_w: T,
    pub fc_proj_b: T,
}

impl<T> BlockTensors<T> {
    pub fn map<U>(&self, mut f: impl FnMut(&T) -> U) -> BlockTensors<U> {
        BlockTensors {
            ln1_g: f(&self.ln1_g),
            ln1_b: f(&self.ln1_b),
            qkv_w: f(&self.qkv_w),
            qkv_b: f(&self.qkv_b),
            attn_proj_w: f(&self.attn_proj_w),
            attn_proj_b: f(&self.attn_proj_b),
            ln2_g: f(&self.ln2_g),
            ln2_b: f(&self.ln2_b),
            fc_w: f(&self.fc_w),
            fc_b: f(&self.fc_b),
            fc_proj_w: f(&self.fc_proj_w),
            fc_proj_b: f(&self.fc_proj_b),
        }
    }
}

/// How a tensor starts.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Init {
    Normal { std: f64 },
    Zeros,
    Ones,
}

/// One named tensor of the parameter buffer.
#[derive(Clone, Debug, PartialEq)]
pub struct TensorInfo {
    /// e.g. `blocks.0.qkv_w`
    pub name: String,
    pub range: Range<usize>,
    pub shape: Vec<usize>,
    pub init: Init,
    /// Whether AdamW's weight decay applies (matrices and embeddings).
    pub decay: bool,
}

/// Where every tensor sits in the flat parameter (and gradient) buffer.
#[derive(Clone, Debug, PartialEq)]
pub struct ParamLayout {
    pub wte: Range<usize>,
    pub wpe: Range<usize>,
    pub blocks: Vec<BlockTensors<Range<usize>>>,
    pub lnf_g: Range<usize>,
    pub lnf_b: Range<usize>,
    pub lm_head: Range<usize>,
    /// Every tensor in buffer order.
    pub tensors: Vec<TensorInfo>,
    /// Parameters in all (= `ModelSpec::param_count()`).
    pub total: usize,
}

struct LayoutBuilder {
    tensors: Vec<TensorInfo>,
    next: usize,
}

impl LayoutBuilder {
    fn push(&mut self, name: String, shape: &[usize], init: Init) -> Range<usize> {
        let len: usize = shape.iter().product();
        let range = self.next..self.next + len;
        self.next += len;
        let decay = shape.len() >= 2;
        self.tensors.push(TensorInfo { name, range: range.clone(), shape: shape.to_vec(), init, decay });
        range
    }
}

impl ParamLayout {
    pub fn new(m: &ModelSpec) -> Self {
        let (v, t, c, l) = (m.vocab, m.seq_len, m.d_model, m.layers);
        let normal = Init::Normal { std: INIT_STD };
        let residual = Init::Normal { std: INIT_STD / (2.0 * l.max(1) as f64).sqrt() };
        let mut b = LayoutBuilder { tensors: Vec::new(), next: 0 };
        let wte = b.push("wte".into(), &[v, c], normal);
        let wpe = b.push("wpe".into(), &[t, c], normal);
        let blocks = (0..l)
            .map(|i| {
                let mut push = |name: &str, shape: &[usize], init| b.push(format!("blocks.{i}.{name}"), shape, init);
                BlockTensors {
                    ln1_g: push("ln1_g", &[c], Init::Ones),
                    ln1_b: push("ln1_b", &[c], Init::Zeros),
                    qkv_w: push("qkv_w", &[c, 3 * c], normal),
                    qkv_b: push("qkv_b", &[3 * c], Init::Zeros),
                    attn_proj_w: push("attn_proj_w", &[c, c], residual),
                    attn_proj_b: push("attn_proj_b", &[c], Init::Zeros),
                    ln2_g: push("ln2_g", &[c], Init::Ones),
                    ln2_b: push("ln2_b", &[c], Init::Zeros),
                    fc_w: push("fc_w", &[c, 4 * c], normal),
                    fc_b: push("fc_b", &[4 * c], Init::Zeros),
                    fc_proj_w: push("fc_proj_w", &[4 * c, c], residual),
                    fc_proj_b: push("fc_proj_b", &[c], Init::Zeros),
                }
            })
            .collect();
        let lnf_g = b.push("lnf_g".into(), &[c], Init::Ones);
        let lnf_b = b.push("lnf_b".into(), &[c], Init::Zeros);
        let lm_head = b.push("lm_head".into(), &[c, v], normal);
        Self { wte, wpe, blocks, lnf_g, lnf_b, lm_head, tensors: b.tensors, total: b.next }
    }

    /// Parameters of one block (they are contiguous).
    pub fn block_len(&self) -> usize {
        self.blocks.first().map_or(0, |b| b.fc_proj_b.end - b.ln1_g.start)
    }

    /// `param_groups` cut to `range` and counted from its start (a stage's own buffer).
    pub fn param_groups_in(&self, range: &Range<usize>) -> Vec<ParamGroup> {
        self.param_groups()
            .into_iter()
            .filter_map(|g| {
                let (start, end) = (g.range.start.max(range.start), g.range.end.min(range.end));
                (start < end).then(|| ParamGroup { range: start - range.start..end - range.start, decay: g.decay })
            })
            .collect()
    }

    /// Runs of adjacent tensors with the same weight-decay setting, for the optimizer.
    pub fn param_groups(&self) -> Vec<ParamGroup> {
        let mut groups: Vec<ParamGroup> = Vec::new();
        for t in &self.tensors {
            match groups.last_mut() {
                Some(g) if g.decay == t.decay && g.range.end == t.range.start => g.range.end = t.range.end,
                _ => groups.push(ParamGroup { range: t.range.clone(), decay: t.decay }),
            }
        }
        groups
    }

    /// The initial parameters, deterministic from `seed` (drawn in buffer order).
    pub fn init_params<F: Float>(&self, seed: u64) -> Vec<F> {
        let mut rng = Rng::from_parts(&[seed, INIT_STREAM]);
        let mut params = vec![F::ZERO; self.total];
        for t in &self.tensors {
            let dst = &mut params[t.range.clone()];
            match t.init {
                Init::Normal { std } => dst.iter_mut().for_each(|p| *p = F::from_f64(std * rng.normal())),
                Init::Zeros => dst.fill(F::ZERO),
                Init::Ones => dst.fill(F::ONE),
            }
        }
        params
    }
}

/// What one block keeps from forward for backward (one micro-batch).
struct BlockActivations<Buf> {
    ln1: Buf,
    ln1_mean: Buf,
    ln1_rstd: Buf,
    qkv: Buf,
    /// Softmax probabilities, (batch, heads, T, T).
    att: Buf,
    /// Attention output before its projection.
    atty: Buf,
    /// Residual stream after the attention half.
    res_attn: Buf,
    ln2: Buf,
    ln2_mean: Buf,
    ln2_rstd: Buf,
    /// MLP hidden layer before and after GELU.
    fch: Buf,
    fch_gelu: Buf,
    /// Residual stream after the MLP half: the block's output.
    res_mlp: Buf,
}

/// What one micro-batch leaves on this stage for its backward.
struct Activations<Buf> {
    /// The stage's input: the embedding output on the first stage, what the previous
    /// stage sent on the others.
    encoded: Buf,
    /// The stage's blocks, in order.
    blocks: Vec<BlockActivations<Buf>>,
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

/// The part of the model one pipeline stage runs: a run of blocks, plus the embeddings on
/// the first stage and the final LayerNorm, LM head and loss on the last.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Stage {
    pub blocks: Range<usize>,
    pub first: bool,
    pub last: bool,
}

impl Stage {
    /// The whole model (no pipeline parallelism).
    pub fn whole(layers: usize) -> Stage {
        Stage { blocks: 0..layers, first: true, last: true }
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
        units.extend(self.blocks.clone().map(Unit::Block));
        if self.last {
            units.push(Unit::Head);
        }
        units
    }
}

/// What a stage's forward starts from.
pub enum StageInput<'a, F> {
    /// The first stage: token ids.
    Tokens(&'a [u32]),
    /// The other stages: the previous stage's output activation.
    Activation(&'a [F]),
}

/// Activation gradients, shared by all blocks (backward visits one block at a time).
struct GradScratch<Buf> {
    /// Gradient of the residual stream.
    dres: Buf,
    /// Gradient of a LayerNorm output.
    dln: Buf,
    datty: Buf,
    dqkv: Buf,
    datt: Buf,
    dfch: Buf,
}

/// A GPT (or the stage of it this rank runs) on backend `B`: its layout and the
/// activations for micro-batches of `batch` sequences, one set per micro-batch in flight
/// (parameters and gradients live in a [`ModelState`]).
pub struct Gpt<B: Backend> {
    pub spec: ModelSpec,
    /// Sequences per micro-batch (activations are sized for this).
    pub batch: usize,
    pub layout: ParamLayout,
    pub stage: Stage,
    /// One set of saved activations per slot (micro-batch in flight).
    acts: Vec<Activations<B::Buf>>,
    scratch: GradScratch<B::Buf>,
    activation_floats: usize,
    /// The memory ledger's record of every buffer above.
    receipts: Vec<Receipt>,
}

impl<B: Backend> Gpt<B> {
    /// The whole model, activations for one micro-batch at a time.
    pub fn new(be: &B, spec: &ModelSpec, batch: usize, memory: &Arc<MemoryTracker>) -> Self {
        Self::new_stage(be, spec, batch, Stage::whole(spec.layers), 1, memory)
    }

    /// `stage` of the model, with activations for `slots` micro-batches in flight; every
    /// buffer is allocated once and registered with `memory`.
    pub fn new_stage(
        be: &B,
        spec: &ModelSpec,
        batch: usize,
        stage: Stage,
        slots: usize,
        memory: &Arc<MemoryTracker>,
    ) -> Self {
        let layout = ParamLayout::new(spec);
        debug_assert_eq!(layout.total as u64, spec.param_count());
        let (t, c, v, h) = (spec.seq_len, spec.d_model, spec.vocab, spec.heads);
        let rows = batch * t;
        let mut floats = 0usize;
        let mut receipts = Vec::new();
        let mut alloc = |category: Category, len: usize| {
            floats += len;
            receipts.push(memory.alloc(category, len));
            be.alloc(len)
        };
        let one_set = |alloc: &mut dyn FnMut(Category, usize) -> B::Buf| Activations {
            encoded: alloc(Category::Activations, rows * c),
            blocks: stage
                .blocks
                .clone()
                .map(|_| BlockActivations {
                    ln1: alloc(Category::Activations, rows * c),
                    ln1_mean: alloc(Category::Activations, rows),
                    ln1_rstd: alloc(Category::Activations, rows),
                    qkv: alloc(Category::Activations, rows * 3 * c),
                    att: alloc(Category::Activations, batch * h * t * t),
                    atty: alloc(Category::Activations, rows * c),
                    res_attn: alloc(Category::Activations, rows * c),
                    ln2: alloc(Category::Activations, rows * c),
                    ln2_mean: alloc(Category::Activations, rows),
                    ln2_rstd: alloc(Category::Activations, rows),
                    fch: alloc(Category::Activations, rows * 4 * c),
                    fch_gelu: alloc(Category::Activations, rows * 4 * c),
                    res_mlp: alloc(Category::Activations, rows * c),
                })
                .collect(),
            head: stage.last.then(|| HeadActivations {
                lnf: alloc(Category::Activations, rows * c),
                lnf_mean: alloc(Category::Activations, rows),
                lnf_rstd: alloc(Category::Activations, rows),
                logits: alloc(Category::Activations, rows * v),
                losses: alloc(Category::Activations, rows),
            }),
        };
        let acts = (0..slots.max(1)).map(|_| one_set(&mut alloc)).collect();
        let scratch = GradScratch {
            dres: alloc(Category::ActivationGrads, rows * c),
            dln: alloc(Category::ActivationGrads, rows * c),
            datty: alloc(Category::ActivationGrads, rows * c),
            dqkv: alloc(Category::ActivationGrads, rows * 3 * c),
            datt: alloc(Category::ActivationGrads, batch * h * t * t),
            dfch: alloc(Category::ActivationGrads, rows * 4 * c),
        };
        if stage == Stage::whole(spec.layers) && slots == 1 {
            debug_assert_eq!(floats, Self::activation_floats_for(spec, batch));
        }
        Self { spec: spec.clone(), batch, layout, stage, acts, scratch, activation_floats: floats, receipts }
    }

    /// Floats held for activations and their gradients (for memory reports).
    pub fn activation_floats(&self) -> usize {
        self.activation_floats
    }

    /// Bytes of every buffer the model holds, counted from the buffers themselves (what
    /// the memory ledger must agree with).
    pub fn held_bytes(&self, be: &B) -> u64 {
        let s = &self.scratch;
        let mut bufs = Vec::new();
        for a in &self.acts {
            bufs.push(&a.encoded);
            if let Some(h) = &a.head {
                bufs.extend([&h.lnf, &h.lnf_mean, &h.lnf_rstd, &h.logits, &h.losses]);
            }
            bufs.extend(a.blocks.iter().flat_map(|b| {
                [
                    &b.ln1,
                    &b.ln1_mean,
                    &b.ln1_rstd,
                    &b.qkv,
                    &b.att,
                    &b.atty,
                    &b.res_attn,
                    &b.ln2,
                    &b.ln2_mean,
                    &b.ln2_rstd,
                    &b.fch,
                    &b.fch_gelu,
                    &b.res_mlp,
                ]
            }));
        }
        bufs.extend([&s.dres, &s.dln, &s.datty, &s.dqkv, &s.datt, &s.dfch]);
        debug_assert_eq!(bufs.len(), self.receipts.len());
        bufs.iter().map(|b| (be.buf_len(b) * std::mem::size_of::<B::Float>()) as u64).sum()
    }

    /// What [`Gpt::new`] will allocate for activations and their gradients, without
    /// allocating (saturating, so absurd specs give a huge number, not an overflow).
    pub fn activation_floats_for(spec: &ModelSpec, batch: usize) -> usize {
        let (t, c, v, h, l) = (spec.seq_len, spec.d_model, spec.vocab, spec.heads, spec.layers);
        let rows = batch.saturating_mul(t);
        let att = batch.saturating_mul(h).saturating_mul(t).saturating_mul(t);
        let rc = rows.saturating_mul(c);
        // per block: ln1, atty, res_attn, ln2, res_mlp (rows x c); qkv (3c); fch, fch_gelu (4c);
        // 4 row statistics (mean, rstd of two LayerNorms); attention probabilities
        let block = rc.saturating_mul(5 + 3 + 8).saturating_add(rows.saturating_mul(4)).saturating_add(att);
        // encoded, lnf (rows x c), lnf statistics, logits, losses
        let top = rc.saturating_mul(2).saturating_add(rows.saturating_mul(3)).saturating_add(rows.saturating_mul(v));
        // backward scratch: dres, dln, datty (c), dqkv (3c), dfch (4c), datt
        let scratch = rc.saturating_mul(3 + 3 + 4).saturating_add(att);
        block.saturating_mul(l).saturating_add(top).saturating_add(scratch)
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
        self.forward_stage(be, state, 0, StageInput::Tokens(inputs), targets)
    }

    /// Runs this stage on one micro-batch, keeping its activations in `slot`. On the last
    /// stage returns the SUM of the per-token losses (`targets`); elsewhere 0, and the
    /// output for the next stage is `output(slot)`.
    pub fn forward_stage(
        &mut self,
        be: &B,
        state: &mut dyn ModelState<B>,
        slot: usize,
        input: StageInput<'_, B::Float>,
        targets: &[u32],
    ) -> Result<f64, CommError> {
        let ModelSpec { seq_len: t, d_model: c, heads, vocab, .. } = self.spec;
        let lay = &self.layout;
        let acts = &mut self.acts[slot];

        match input {
            StageInput::Tokens(inputs) => {
                assert_eq!(inputs.len(), self.batch * t, "inputs must hold batch * seq_len tokens");
                let (p, at) = state.open(be, Unit::Embeddings, Pass::Forward)?.params.expect("forward has parameters");
                be.encoder_forward(
                    be.all_mut(&mut acts.encoded),
                    inputs,
                    be.view(p, shift(&lay.wte, at)),
                    be.view(p, shift(&lay.wpe, at)),
                    t,
                    c,
                );
                state.close(be, Unit::Embeddings, Pass::Forward)?;
            }
            StageInput::Activation(x) => be.upload(&mut acts.encoded, x),
        }
        for (i, l) in self.stage.blocks.clone().enumerate() {
            let (p, at) = state.open(be, Unit::Block(l), Pass::Forward)?.params.expect("forward has parameters");
            let w = lay.blocks[l].map(|r| be.view(p, shift(r, at)));
            let (done, rest) = acts.blocks.split_at_mut(i);
            let x = done.last().map_or(&acts.encoded, |prev| &prev.res_mlp);
            let a = &mut rest[0];
            // attention half: res_attn = x + attn_proj(attention(ln1(x)))
            be.layernorm_forward(
                be.all_mut(&mut a.ln1),
                be.all_mut(&mut a.ln1_mean),
                be.all_mut(&mut a.ln1_rstd),
                be.all(x),
                w.ln1_g,
                w.ln1_b,
                c,
            );
            be.matmul_forward(be.all_mut(&mut a.qkv), be.all(&a.ln1), w.qkv_w, Some(w.qkv_b), None, c, 3 * c);
            be.attention_forward(be.all_mut(&mut a.atty), be.all_mut(&mut a.att), be.all(&a.qkv), t, c, heads);
            be.matmul_forward(
                be.all_mut(&mut a.res_attn),
                be.all(&a.atty),
                w.attn_proj_w,
                Some(w.attn_proj_b),
                Some(be.all(x)),
                c,
                c,
            );
            // MLP half: res_mlp = res_attn + fc_proj(gelu(fc(ln2(res_attn))))
            be.layernorm_forward(
                be.all_mut(&mut a.ln2),
                be.all_mut(&mut a.ln2_mean),
                be.all_mut(&mut a.ln2_rstd),
                be.all(&a.res_attn),
                w.ln2_g,
                w.ln2_b,
                c,
            );
            be.matmul_forward(be.all_mut(&mut a.fch), be.all(&a.ln2), w.fc_w, Some(w.fc_b), None, c, 4 * c);
            be.gelu_forward(be.all_mut(&mut a.fch_gelu), be.all(&a.fch));
            be.matmul_forward(
                be.all_mut(&mut a.res_mlp),
                be.all(&a.fch_gelu),
                w.fc_proj_w,
                Some(w.fc_proj_b),
                Some(be.all(&a.res_attn)),
                4 * c,
                c,
            );
            state.close(be, Unit::Block(l), Pass::Forward)?;
        }
        let last = acts.blocks.last().map_or(&acts.encoded, |a| &a.res_mlp);
        let Some(head) = acts.head.as_mut() else { return Ok(0.0) };
        assert_eq!(targets.len(), self.batch * t, "targets must hold batch * seq_len tokens");
        {
            let (p, at) = state.open(be, Unit::Head, Pass::Forward)?.params.expect("forward has parameters");
            be.layernorm_forward(
                be.all_mut(&mut head.lnf),
                be.all_mut(&mut head.lnf_mean),
                be.all_mut(&mut head.lnf_rstd),
                be.all(last),
                be.view(p, shift(&lay.lnf_g, at)),
                be.view(p, shift(&lay.lnf_b, at)),
                c,
            );
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
        be.crossentropy_forward(be.all_mut(&mut head.logits), be.all_mut(&mut head.losses), targets, vocab);
        Ok(be.sum(be.all(&head.losses)))
    }

    /// What this stage's forward of `slot` hands to the next stage: its last block's output.
    pub fn output(&self, slot: usize) -> &B::Buf {
        let a = &self.acts[slot];
        a.blocks.last().map_or(&a.encoded, |b| &b.res_mlp)
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
        self.backward_stage(be, state, 0, inputs, targets, None, dloss)
    }

    /// Backpropagates this stage's forward of `slot`. The last stage starts from the loss
    /// (`targets`, `dloss`); the others from `grad_output`, the gradient of their output
    /// that the next stage sent. The first stage ends in the embeddings (`inputs`); the
    /// others leave the gradient of their input in `input_grad()`.
    #[allow(clippy::too_many_arguments)]
    pub fn backward_stage(
        &mut self,
        be: &B,
        state: &mut dyn ModelState<B>,
        slot: usize,
        inputs: &[u32],
        targets: &[u32],
        grad_output: Option<&[B::Float]>,
        dloss: f64,
    ) -> Result<(), CommError> {
        let ModelSpec { seq_len: t, d_model: c, heads, vocab, .. } = self.spec;
        let lay = &self.layout;
        let s = &mut self.scratch;
        let with_params = Pass::Backward { params: true };
        let acts = &mut self.acts[slot];

        if let Some(head) = acts.head.as_mut() {
            // loss and LM head
            be.crossentropy_backward(be.all_mut(&mut head.logits), targets, vocab, dloss);
        }
        let acts = &*acts;
        if let Some(head) = &acts.head {
            let open = state.open(be, Unit::Head, with_params)?;
            let (p, at) = open.params.expect("backward of the head has parameters");
            let (g, g_at) = open.grads.expect("backward has gradients");
            let g = be.view_mut(g, shift(&Unit::Head.range(lay), g_at));
            let (g_lnf_g, g) = be.split_mut(g, lay.lnf_g.len());
            let (g_lnf_b, g_lm_head) = be.split_mut(g, lay.lnf_b.len());
            be.matmul_backward(
                Some(be.all_mut(&mut s.dln)),
                g_lm_head,
                None,
                be.all(&head.logits),
                be.all(&head.lnf),
                be.view(p, shift(&lay.lm_head, at)),
                c,
                vocab,
            );
            be.fill(be.all_mut(&mut s.dres), 0.0);
            let last = acts.blocks.last().map_or(&acts.encoded, |a| &a.res_mlp);
            be.layernorm_backward(
                be.all_mut(&mut s.dres),
                g_lnf_g,
                g_lnf_b,
                be.all(&s.dln),
                be.all(last),
                be.view(p, shift(&lay.lnf_g, at)),
                be.all(&head.lnf_mean),
                be.all(&head.lnf_rstd),
                c,
            );
        } else {
            // The next stage sent the gradient of our output.
            be.upload(&mut s.dres, grad_output.expect("a stage before the last gets its output's gradient"));
        }
        if acts.head.is_some() {
            state.close(be, Unit::Head, with_params)?;
        }

        for (i, l) in self.stage.blocks.clone().enumerate().rev() {
            // (a scope, so that the block's views end before it is closed)
            {
                let open = state.open(be, Unit::Block(l), with_params)?;
                let (p, at) = open.params.expect("backward of a block has parameters");
                let (g, g_at) = open.grads.expect("backward has gradients");
                let gw = split_block(be, be.view_mut(g, shift(&Unit::Block(l).range(lay), g_at)), &lay.blocks[l]);
                let w = lay.blocks[l].map(|r| be.view(p, shift(r, at)));
                let x = if i == 0 { &acts.encoded } else { &acts.blocks[i - 1].res_mlp };
                let a = &acts.blocks[i];
                // MLP half (dres holds d res_mlp, and becomes d res_attn)
                be.matmul_backward(
                    Some(be.all_mut(&mut s.dfch)),
                    gw.fc_proj_w,
                    Some(gw.fc_proj_b),
                    be.all(&s.dres),
                    be.all(&a.fch_gelu),
                    w.fc_proj_w,
                    4 * c,
                    c,
                );
                be.gelu_backward(be.all_mut(&mut s.dfch), be.all(&a.fch));
                be.matmul_backward(
                    Some(be.all_mut(&mut s.dln)),
                    gw.fc_w,
                    Some(gw.fc_b),
                    be.all(&s.dfch),
                    be.all(&a.ln2),
                    w.fc_w,
                    c,
                    4 * c,
                );
                be.layernorm_backward(
                    be.all_mut(&mut s.dres),
                    gw.ln2_g,
                    gw.ln2_b,
                    be.all(&s.dln),
                    be.all(&a.res_attn),
                    w.ln2_g,
                    be.all(&a.ln2_mean),
                    be.all(&a.ln2_rstd),
                    c,
                );
                // attention half (dres becomes d x)
                be.matmul_backward(
                    Some(be.all_mut(&mut s.datty)),
                    gw.attn_proj_w,
                    Some(gw.attn_proj_b),
                    be.all(&s.dres),
                    be.all(&a.atty),
                    w.attn_proj_w,
                    c,
                    c,
                );
                be.attention_backward(
                    be.all_mut(&mut s.dqkv),
                    be.all_mut(&mut s.datt),
                    be.all(&s.datty),
                    be.all(&a.qkv),
                    be.all(&a.att),
                    t,
                    c,
                    heads,
                );
                be.matmul_backward(
                    Some(be.all_mut(&mut s.dln)),
                    gw.qkv_w,
                    Some(gw.qkv_b),
                    be.all(&s.dqkv),
                    be.all(&a.ln1),
                    w.qkv_w,
                    c,
                    3 * c,
                );
                be.layernorm_backward(
                    be.all_mut(&mut s.dres),
                    gw.ln1_g,
                    gw.ln1_b,
                    be.all(&s.dln),
                    be.all(x),
                    w.ln1_g,
                    be.all(&a.ln1_mean),
                    be.all(&a.ln1_rstd),
                    c,
                );
            }
            state.close(be, Unit::Block(l), with_params)?;
        }
        if !self.stage.first {
            return Ok(());
        }
        let without_params = Pass::Backward { params: false };
        {
            let (g, g_at) = state.open(be, Unit::Embeddings, without_params)?.grads.expect("backward has gradients");
            let g = be.view_mut(g, shift(&Unit::Embeddings.range(lay), g_at));
            let (g_wte, g_wpe) = be.split_mut(g, lay.wte.len());
            be.encoder_backward(g_wte, g_wpe, be.all(&s.dres), inputs, t, c);
        }
        state.close(be, Unit::Embeddings, without_params)
    }
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
        fc_w: take(lay.fc_w.len()),
        fc_b: take(lay.fc_b.len()),
        fc_proj_w: take(lay.fc_proj_w.len()),
        fc_proj_b: take(lay.fc_proj_b.len()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn layout_matches_the_planner_param_count_and_is_contiguous() {
        for m in [
            ModelSpec::default(),
            ModelSpec { layers: 4, d_model: 256, heads: 4, seq_len: 128, vocab: 256 },
            ModelSpec { layers: 1, d_model: 8, heads: 2, seq_len: 3, vocab: 5 },
        ] {
            let lay = ParamLayout::new(&m);
            assert_eq!(lay.total as u64, m.param_count());
            let mut next = 0;
            for t in &lay.tensors {
                assert_eq!(t.range.start, next, "{} is not where the previous tensor ended", t.name);
                assert_eq!(t.range.len(), t.shape.iter().product::<usize>());
                next = t.range.end;
            }
            assert_eq!(next, lay.total);
            assert_eq!(lay.block_len() as u64, m.block_params());
            let groups = lay.param_groups();
            assert_eq!(groups.iter().map(|g| g.range.len()).sum::<usize>(), lay.total);
        }
    }

    #[test]
    fn init_is_deterministic_and_scaled() {
        let m = ModelSpec { layers: 2, d_model: 64, heads: 4, seq_len: 16, vocab: 32 };
        let lay = ParamLayout::new(&m);
        let a = lay.init_params::<f32>(7);
        assert_eq!(a, lay.init_params::<f32>(7));
        assert_ne!(a, lay.init_params::<f32>(8));
        let std = |r: &Range<usize>| {
            let x = &a[r.clone()];
            (x.iter().map(|v| (*v as f64).powi(2)).sum::<f64>() / x.len() as f64).sqrt()
        };
        let b = &lay.blocks[0];
        assert!((std(&b.fc_w) - 0.02).abs() < 0.002);
        assert!((std(&b.fc_proj_w) - 0.01).abs() < 0.001); // 0.02 / sqrt(2 * 2)
        assert!(a[b.ln1_g.clone()].iter().all(|&g| g == 1.0));
        assert!(a[b.qkv_b.clone()].iter().all(|&g| g == 0.0));
    }
}
