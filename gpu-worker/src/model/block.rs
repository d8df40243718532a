//! One transformer block, forward and backward, on this rank's slice of it, GPT-2's:
//!
//! ```text
//!   res_attn = x + attn_proj(attention(ln1(x)))          (layernorm.rs, linear.rs,
//!   res_mlp  = res_attn + fc_proj(gelu(fc(ln2(res_attn)))) attention.rs, mlp.rs)
//! ```
//!
//! or Llama's: RMSNorm for the LayerNorms (rmsnorm.rs), no biases, rotary positions
//! turning q and k after the qkv matmul (rope.rs), grouped-query attention, and SwiGLU
//! (swiglu.rs) on fc's gate and up columns in place of GELU:
//!
//! ```text
//!   res_attn = x + attn_proj(attention(rope(qkv(rms1(x)))))
//!   res_mlp  = res_attn + fc_proj(swiglu(fc(rms2(res_attn))))
//! ```
//!
//! the Mixture-of-Experts MLP in its place where the model has experts (`experts.rs`),
//! the tensor-parallel sums and sequence-parallel exchanges where `tensor_parallel.rs`
//! puts them, context parallelism's all-to-alls around attention
//! (`context_parallel.rs`), and ZB-H1's split of the backward into B (input gradients) and W (weight
//! gradients).

use std::ops::Range;
use std::sync::Arc;

use distlab_common::{Attention, ModelFamily};

use crate::backend::Backend;
use crate::comm::{CommError, InPlace, ReduceOp};
use crate::memory::{Category, MemoryTracker};
use crate::model::activations::{mlp_in, ActivationShape, Activations, BlockActivations, WeightStash};
use crate::model::attend::{attend, attend_backward, AttendDims};
use crate::model::context_parallel::{
    context_attention_backward, context_attention_forward, ContextDims, ContextExchange, ContextSplit,
};
use crate::model::experts::{
    experts_backward, experts_forward, ExpertGrads, ExpertGroup, ExpertScratch, ExpertShape, Hidden, HiddenGrads,
};
use crate::model::fp8_linear::{Fp8Block, Fp8Linear};
use crate::model::layout::BlockTensors;
use crate::model::tensor_parallel::{
    add_pieces, gather_tokens, gathered, pieces, row_parallel_forward, sum_input_grad, Exchange, TensorParallelGroup,
    Tokens, TpPoint,
};
use crate::ops::attention::{AttentionShape, Positions};

/// FP8 (`train.fp8`): a block's linear layers' scales and the ledger their casts book into.
pub(super) type Fp8Here<'a> = (&'a mut Fp8Block, &'a Arc<MemoryTracker>);

/// A block's sizes on this rank: sequence length, model width, this rank's attention
/// width and heads, its MLP hidden width, and whether it adds the row-parallel biases and
/// the residual (tensor-parallel rank 0; the only rank without tensor parallelism), and
/// with sequence parallelism the tokens it keeps.
#[derive(Clone, Copy, Debug)]
pub(super) struct Dims {
    pub(super) c: usize,
    pub(super) cl: usize,
    /// The query and key/value heads this rank's attention runs (and the sequence length).
    pub(super) heads: AttentionShape,
    /// Width of q, k and v together as this rank's qkv matmul makes them (with context
    /// parallelism, for every head of this tensor-parallel rank; attention has 1/cp of them).
    pub(super) qkv: usize,
    /// Where the rows attention sees sit in their sequences (every token in order, or the
    /// ring's rank's tokens).
    pub(super) positions: Positions,
    /// Context parallelism: how the rank's tokens meet in attention (None without it).
    pub(super) context: Option<ContextDims>,
    pub(super) hidden: usize,
    /// GPT-2's blocks or Llama's.
    pub(super) family: ModelFamily,
    /// Llama: the rotary positions' base.
    pub(super) rope_theta: f64,
    pub(super) lead: bool,
    pub(super) attention: Attention,
    /// Sequence parallelism: the tokens whose LayerNorm and residual regions this rank keeps.
    pub(super) mine: Option<Tokens>,
    /// Selective recompute: attention's probabilities are in the scratch's `probs`, made
    /// by the forward and again before the block's backward ([`recompute_probabilities`]).
    pub(super) recompute_probabilities: bool,
    /// Mixture of Experts (None: dense blocks).
    pub(super) experts: Option<ExpertShape>,
    /// Backward: the balance loss's weight in the objective (aux_loss_coef x tokens x
    /// d(objective)/d(a token's loss)).
    pub(super) balance_weight: f64,
}

/// Activation gradients, shared by all blocks (backward visits one block at a time), and
/// selective recompute's attention probabilities.
pub(super) struct GradScratch<Buf> {
    /// Gradient of the residual stream.
    pub(super) dres: Buf,
    /// Gradient of a LayerNorm output.
    pub(super) dln: Buf,
    pub(super) datty: Buf,
    pub(super) dqkv: Buf,
    /// The probabilities' gradient (batch, heads, T, T); with flash attention the
    /// per-row rowsum(dO ∘ O), (batch, heads, T, 2).
    pub(super) datt: Buf,
    /// The MLP hidden layer's gradient (with experts: of every slot); GPT-2's GELU turns it
    /// into fc's output gradient in place.
    pub(super) dfch: Buf,
    /// Llama: fc's output gradient, the gate's and up's (SwiGLU's backward makes it beside
    /// the hidden layer's); empty for GPT-2.
    pub(super) dgate_up: Buf,
    /// Mixture of Experts: the slots' and the router's gradients.
    pub(super) experts: Option<ExpertScratch<Buf>>,
    /// Selective recompute: the probabilities (batch, heads, T, T) of the block whose
    /// forward or backward runs, booked as activations (empty otherwise).
    pub(super) probs: Buf,
}

impl Dims {
    /// Whether the block's matmuls have biases (GPT-2's do, Llama's do not).
    fn biased(&self) -> bool {
        self.family == ModelFamily::Gpt2
    }

    /// A bias tensor as a matmul takes it: None where the family has none.
    fn bias<V>(&self, view: V) -> Option<V> {
        self.biased().then_some(view)
    }

    /// Width of q, k and v together on this rank.
    fn qkv(&self) -> usize {
        self.qkv
    }

    /// What attention needs to know of the block.
    pub(super) fn attend(&self) -> AttendDims {
        AttendDims {
            heads: self.heads,
            positions: self.positions,
            family: self.family,
            rope_theta: self.rope_theta,
            attention: self.attention,
        }
    }
}

/// A norm's parameters: GPT-2's LayerNorm its gain and bias, `c` each; Llama's RMSNorm its
/// gain alone.
pub(super) fn norm_widths(family: ModelFamily, c: usize) -> [usize; 2] {
    match family {
        ModelFamily::Gpt2 => [c, c],
        ModelFamily::Llama => [c, 0],
    }
}

/// A norm forward (GPT-2: LayerNorm, keeping each row's mean and 1/std; Llama: RMSNorm,
/// keeping its 1/rms, with no bias).
#[allow(clippy::too_many_arguments)]
pub(super) fn norm_forward<B: Backend>(
    be: &B,
    family: ModelFamily,
    out: B::ViewMut<'_>,
    (mean, rstd): (B::ViewMut<'_>, B::ViewMut<'_>),
    x: B::View<'_>,
    (gain, bias): (B::View<'_>, B::View<'_>),
    c: usize,
) {
    match family {
        ModelFamily::Gpt2 => be.layernorm_forward(out, mean, rstd, x, gain, bias, c),
        ModelFamily::Llama => be.rmsnorm_forward(out, rstd, x, gain, c),
    }
}

/// A norm backward: ADDS the input gradient into `dinp` and the parameter gradients into
/// `dgain` (and GPT-2's `dbias`).
#[allow(clippy::too_many_arguments)]
pub(super) fn norm_backward<B: Backend>(
    be: &B,
    family: ModelFamily,
    dinp: B::ViewMut<'_>,
    (dgain, dbias): (B::ViewMut<'_>, B::ViewMut<'_>),
    dout: B::View<'_>,
    x: B::View<'_>,
    gain: B::View<'_>,
    (mean, rstd): (B::View<'_>, B::View<'_>),
    c: usize,
) {
    match family {
        ModelFamily::Gpt2 => be.layernorm_backward(dinp, dgain, dbias, dout, x, gain, mean, rstd, c),
        ModelFamily::Llama => be.rmsnorm_backward(dinp, dgain, dout, x, gain, rstd, c),
    }
}

impl<Buf> GradScratch<Buf> {
    /// Sized for micro-batches of `shape`, each buffer from `alloc(category, floats)`.
    pub(super) fn new(shape: &ActivationShape, alloc: &mut dyn FnMut(Category, usize) -> Buf) -> Self {
        let probs = if shape.recompute_probabilities { shape.attention_floats() } else { 0 };
        let probs = alloc(Category::Activations, probs);
        let alloc = &mut |len| alloc(Category::ActivationGrads, len);
        let ActivationShape { rows, res_rows, c, cl, hidden, .. } = *shape;
        let gate_up = match shape.family {
            ModelFamily::Gpt2 => 0,
            ModelFamily::Llama => rows.max(shape.mlp_rows()) * shape.mlp_in(),
        };
        GradScratch {
            dres: alloc(res_rows * c),
            dln: alloc(rows * c),
            datty: alloc(rows * cl),
            dqkv: alloc(rows * shape.qkv),
            datt: alloc(shape.attention_floats()),
            dfch: alloc(rows.max(shape.mlp_rows()) * hidden),
            dgate_up: alloc(gate_up),
            experts: shape.experts.map(|e| ExpertScratch::new(&e, rows, c, alloc)),
            probs,
        }
    }

    pub(super) fn buffers(&self) -> Vec<&Buf> {
        let mut bufs =
            vec![&self.dres, &self.dln, &self.datty, &self.dqkv, &self.datt, &self.dfch, &self.dgate_up, &self.probs];
        bufs.extend(self.experts.iter().flat_map(ExpertScratch::buffers));
        bufs
    }
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
/// row-parallel outputs reduce-scattered. With selective recompute attention's
/// probabilities go to `probs` (the stage's one buffer), not to `a`.
#[allow(clippy::too_many_arguments)]
pub(super) fn block_forward<B: Backend>(
    be: &B,
    w: &BlockTensors<B::View<'_>>,
    x: &B::Buf,
    a: &mut BlockActivations<B::Buf>,
    probs: Option<&mut B::Buf>,
    d: Dims,
    tp: &mut Option<Box<dyn TensorParallelGroup<B>>>,
    exchange: &mut Option<Exchange<B::Buf>>,
    ep: &mut ExpertGroup<B>,
    cx: &mut Option<ContextSplit<B>>,
    layer: usize,
    mut fp8: Option<Fp8Here<'_>>,
) -> Result<(), CommError> {
    let Dims { c, cl, hidden, mine, family, .. } = d;
    let at = Some(layer);
    let rows = be.buf_len(&a.qkv) / d.qkv();
    // attention half
    let stats = (be.all_mut(&mut a.ln1_mean), be.all_mut(&mut a.ln1_rstd));
    norm_forward(be, family, be.all_mut(&mut a.ln1), stats, be.all(x), (w.ln1_g, w.ln1_b), c);
    let ln1 = gather_tokens(be, &a.ln1, gathered(exchange), mine, c, tp, TpPoint::Ln1Output, at)?;
    // (Ulysses: this rank's tokens' q, k and v are made in the exchange buffer, to leave for
    // their heads' ranks)
    let made = match cx.as_mut() {
        Some(ContextSplit { exchange: ContextExchange::Ulysses { qkv, .. }, .. }) => qkv,
        _ => &mut a.qkv,
    };
    match fp8.as_mut() {
        Some((f, memory)) => {
            let operands = (be.all(ln1), w.qkv_w);
            f.qkv.forward(be, memory, be.all_mut(made), operands, (d.bias(w.qkv_b), None), (rows, c, d.qkv()))
        }
        None => be.matmul_forward(be.all_mut(made), be.all(ln1), w.qkv_w, d.bias(w.qkv_b), None, c, d.qkv()),
    }
    match (cx.as_mut(), d.context) {
        (Some(cx), Some(context)) => context_attention_forward(be, cx, context, a, probs, d.attend(), layer)?,
        _ => attend(be, (&mut a.atty, probs, &mut a.att), &mut a.qkv, d.attend()),
    }
    // (this rank's width, whether it adds the bias and residual, its tokens)
    let place = (c, d.lead, mine);
    let proj = (w.attn_proj_w, d.bias(w.attn_proj_b), cl);
    match fp8.as_mut() {
        // (tp = 1: the whole product, with the bias and the residual)
        Some((f, memory)) => {
            let (out, operands) = (be.all_mut(&mut a.res_attn), (be.all(&a.atty), w.attn_proj_w));
            f.attn_proj.forward(be, memory, out, operands, (proj.1, Some(be.all(x))), (rows, cl, c))
        }
        None => row_parallel_forward(
            be,
            (&mut a.res_attn, &a.atty, x),
            proj,
            TpPoint::AttentionOutput,
            place,
            tp,
            exchange,
            layer,
        )?,
    }
    // MLP half
    let stats = (be.all_mut(&mut a.ln2_mean), be.all_mut(&mut a.ln2_rstd));
    norm_forward(be, family, be.all_mut(&mut a.ln2), stats, be.all(&a.res_attn), (w.ln2_g, w.ln2_b), c);
    if let (Some(shape), Some(moe)) = (d.experts, a.moe.as_mut()) {
        // Mixture of Experts (tp = 1: ln2 and the residual are whole here)
        let hidden = Hidden { fch: &mut a.fch, fch_act: &mut a.fch_act };
        let bufs = (&a.ln2, &a.res_attn, &mut a.res_mlp);
        return experts_forward(be, w, bufs, moe, hidden, &shape, c, ep, layer);
    }
    let ln2 = gather_tokens(be, &a.ln2, gathered(exchange), mine, c, tp, TpPoint::Ln2Output, at)?;
    let fc_out = mlp_in(family, hidden);
    match fp8.as_mut() {
        Some((f, memory)) => {
            let operands = (be.all(ln2), w.fc_w);
            f.fc.forward(be, memory, be.all_mut(&mut a.fch), operands, (d.bias(w.fc_b), None), (rows, c, fc_out))
        }
        None => be.matmul_forward(be.all_mut(&mut a.fch), be.all(ln2), w.fc_w, d.bias(w.fc_b), None, c, fc_out),
    }
    match family {
        ModelFamily::Gpt2 => be.gelu_forward(be.all_mut(&mut a.fch_act), be.all(&a.fch)),
        ModelFamily::Llama => be.swiglu_forward(be.all_mut(&mut a.fch_act), be.all(&a.fch), hidden),
    }
    let proj = (w.fc_proj_w, d.bias(w.fc_proj_b), hidden);
    let (out, inp, residual) = (&mut a.res_mlp, &a.fch_act, &a.res_attn);
    match fp8 {
        Some((f, memory)) => {
            let extras = (proj.1, Some(be.all(residual)));
            f.fc_proj.forward(be, memory, be.all_mut(out), (be.all(inp), proj.0), extras, (rows, hidden, c));
            Ok(())
        }
        None => row_parallel_forward(be, (out, inp, residual), proj, TpPoint::MlpOutput, place, tp, exchange, layer),
    }
}

/// Checkpointing: block `i` of the stage forward (the first time, or again in backward),
/// into segment buffer `i % k`, from the segment's saved input or the previous segment
/// buffer's output.
#[allow(clippy::too_many_arguments)]
pub(super) fn segment_block_forward<B: Backend>(
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
    cx: &mut Option<ContextSplit<B>>,
    layer: usize,
) -> Result<(), CommError> {
    let j = i % k;
    let (before, rest) = segment.split_at_mut(j);
    let x = match (j, i) {
        (0, 0) => &acts.encoded,
        (0, _) => &acts.checkpoints[i / k - 1],
        _ => &before[j - 1].res_mlp,
    };
    block_forward(be, w, x, &mut rest[0], None, d, tp, exchange, ep, cx, layer, None)
}

/// Selective recompute, before a block's backward: attention's probabilities again from
/// the q and k its forward kept, into `s.probs` (Korthikanti et al.: the softmax and the
/// two products around it are cheap to redo and the largest thing a block would keep).
/// The output it makes on the way, equal to the kept `atty`, lands in `s.datty`, which the
/// backward overwrites before reading it.
pub(super) fn recompute_probabilities<B: Backend>(
    be: &B,
    a: &BlockActivations<B::Buf>,
    s: &mut GradScratch<B::Buf>,
    d: Dims,
) {
    be.attention_forward(be.all_mut(&mut s.datty), be.all_mut(&mut s.probs), be.all(&a.qkv), d.heads);
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
pub(super) fn block_backward<B: Backend>(
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
    cx: &mut Option<ContextSplit<B>>,
    layer: usize,
    mut keep: Option<&mut WeightStash<B::Buf>>,
    mut fp8: Option<Fp8Here<'_>>,
) -> Result<(), CommError> {
    let Dims { c, cl, hidden, mine, family, .. } = d;
    let at = Some(layer);
    let rows = be.buf_len(&a.qkv) / d.qkv();

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
    let [gain, bias] = norm_widths(family, c);
    let widths = [gain, bias, gain, bias];
    let [d_ln1_g, d_ln1_b, d_ln2_g, d_ln2_b] = match ln_scratch.as_deref_mut() {
        Some(buf) => {
            be.fill(be.all_mut(buf), 0.0);
            pieces(be, buf, widths)
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
        let bufs = (&s.dres, &a.ln2, &mut s.dln);
        let hidden = HiddenGrads { fch: &a.fch, fch_act: &a.fch_act, dfch: &mut s.dfch, dgate_up: &mut s.dgate_up };
        experts_backward(be, w, grads, bufs, moe, hidden, scratch, &shape, c, ep, layer, d.balance_weight)?;
        0..be.buf_len(&s.dln)
    } else {
        let dout = gather_tokens(be, &s.dres, full.as_deref_mut(), mine, c, tp, TpPoint::MlpOutputGrad, at)?;
        let kept = keep.as_deref_mut().map(|k| &mut k.dmlp_out);
        let weights = (fc_proj_w, d.bias(fc_proj_b));
        linear_backward(
            be,
            be.all_mut(&mut s.dfch),
            weights,
            be.all(dout),
            be.all(&a.fch_act),
            w.fc_proj_w,
            (hidden, c),
            kept,
            fp8_layer(&mut fp8, |f| &mut f.fc_proj, rows),
        );
        // fc's output gradient: GELU's backward in place, SwiGLU's beside it
        let dfc_out = match family {
            ModelFamily::Gpt2 => {
                be.gelu_backward(be.all_mut(&mut s.dfch), be.all(&a.fch));
                &s.dfch
            }
            ModelFamily::Llama => {
                be.swiglu_backward(be.all_mut(&mut s.dgate_up), be.all(&s.dfch), be.all(&a.fch), hidden);
                &s.dgate_up
            }
        };
        let ln2 = gather_tokens(be, &a.ln2, gathered.as_deref_mut(), mine, c, tp, TpPoint::Ln2Output, at)?;
        let kept = keep.as_deref_mut().map(|k| &mut k.dfch);
        linear_backward(
            be,
            be.all_mut(&mut s.dln),
            (fc_w, d.bias(fc_b)),
            be.all(dfc_out),
            be.all(ln2),
            w.fc_w,
            (c, mlp_in(family, hidden)),
            kept,
            fp8_layer(&mut fp8, |f| &mut f.fc, rows),
        );
        // f's backward: ln2's output fed every rank's hidden units
        sum_input_grad(be, &mut s.dln, mine, c, tp, TpPoint::Ln2OutputGrad, layer)?
    };
    norm_backward(
        be,
        family,
        be.all_mut(&mut s.dres),
        (d_ln2_g, d_ln2_b),
        be.view(&s.dln, dln),
        be.all(&a.res_attn),
        w.ln2_g,
        (be.all(&a.ln2_mean), be.all(&a.ln2_rstd)),
        c,
    );
    // attention half (dres becomes d x)
    let dout = gather_tokens(be, &s.dres, full, mine, c, tp, TpPoint::AttentionOutputGrad, at)?;
    let kept = keep.as_deref_mut().map(|k| &mut k.dattn_out);
    let weights = (attn_proj_w, d.bias(attn_proj_b));
    let (atty, proj) = (be.all(&a.atty), fp8_layer(&mut fp8, |f| &mut f.attn_proj, rows));
    linear_backward(be, be.all_mut(&mut s.datty), weights, be.all(dout), atty, w.attn_proj_w, (cl, c), kept, proj);
    let probs = if d.recompute_probabilities { &s.probs } else { &a.att };
    let scratch = (&s.datty, &mut s.datt, &mut s.dqkv, probs);
    match (cx.as_mut(), d.context) {
        (Some(cx), Some(context)) => context_attention_backward(be, cx, context, a, scratch, d.attend(), layer)?,
        _ => attend_backward(be, scratch, (&a.qkv, &a.atty), d.attend()),
    }
    let ln1 = gather_tokens(be, &a.ln1, gathered, mine, c, tp, TpPoint::Ln1Output, at)?;
    let kept = keep.map(|k| &mut k.dqkv);
    linear_backward(
        be,
        be.all_mut(&mut s.dln),
        (qkv_w, d.bias(qkv_b)),
        be.all(&s.dqkv),
        be.all(ln1),
        w.qkv_w,
        (c, d.qkv()),
        kept,
        fp8_layer(&mut fp8, |f| &mut f.qkv, rows),
    );
    let dln = sum_input_grad(be, &mut s.dln, mine, c, tp, TpPoint::Ln1OutputGrad, layer)?;
    norm_backward(
        be,
        family,
        be.all_mut(&mut s.dres),
        (d_ln1_g, d_ln1_b),
        be.view(&s.dln, dln),
        be.all(x),
        w.ln1_g,
        (be.all(&a.ln1_mean), be.all(&a.ln1_rstd)),
        c,
    );
    if let (Some(buf), Some(tp)) = (ln_scratch, tp) {
        tp.collective(be, buf, InPlace::AllReduce(ReduceOp::Sum), TpPoint::LayerNormGrads, at)?;
        add_pieces(be, g_ln, buf, widths);
    }
    Ok(())
}

/// FP8: the layer `pick` chooses of the block's, with the ledger and the rows.
fn fp8_layer<'a>(
    fp8: &'a mut Option<Fp8Here<'_>>,
    pick: fn(&mut Fp8Block) -> &mut Fp8Linear,
    rows: usize,
) -> Option<(&'a mut Fp8Linear, &'a Arc<MemoryTracker>, usize)> {
    fp8.as_mut().map(|(f, memory)| (pick(f), &**memory, rows))
}

/// One matmul's backward inside a block: `dinp = dout · Wᵀ` and the weight gradients
/// (`dW += inpᵀ · dout`, `db += Σ dout` where it has a bias), or (ZB-H1's B, `keep`) `dinp`
/// only, with `dout` copied into `keep` for the W; with `fp8` (its layer, the ledger and
/// the rows) on FP8 operands.
#[allow(clippy::too_many_arguments)]
pub(super) fn linear_backward<B: Backend>(
    be: &B,
    dinp: B::ViewMut<'_>,
    (dweight, dbias): (B::ViewMut<'_>, Option<B::ViewMut<'_>>),
    dout: B::View<'_>,
    inp: B::View<'_>,
    weight: B::View<'_>,
    (c_in, c_out): (usize, usize),
    keep: Option<&mut B::Buf>,
    fp8: Option<(&mut Fp8Linear, &Arc<MemoryTracker>, usize)>,
) {
    match (keep, fp8) {
        (Some(kept), _) => {
            be.copy(be.all_mut(kept), dout);
            be.matmul_backward_input(dinp, dout, weight, c_in, c_out);
        }
        (None, Some((f, memory, rows))) => {
            f.backward(be, memory, dinp, (dweight, dbias), (dout, inp, weight), (rows, c_in, c_out))
        }
        (None, None) => be.matmul_backward(Some(dinp), dweight, dbias, dout, inp, weight, c_in, c_out),
    }
}

/// ZB-H1's W of one block: the four matmuls' weight and bias gradients from the output
/// gradients its B kept (`k`) and the inputs its forward saved (`a`).
pub(super) fn block_weights<B: Backend>(
    be: &B,
    gw: BlockTensors<B::ViewMut<'_>>,
    a: &BlockActivations<B::Buf>,
    k: &WeightStash<B::Buf>,
    d: Dims,
) {
    debug_assert!(d.experts.is_none(), "validation keeps ZB-H1 to dense blocks");
    let Dims { c, cl, hidden, .. } = d;
    let weights = |dw, db, dout: &B::Buf, inp: &B::Buf, c_in, c_out| {
        be.matmul_backward_weights(dw, d.bias(db), be.all(dout), be.all(inp), c_in, c_out);
    };
    weights(gw.fc_proj_w, gw.fc_proj_b, &k.dmlp_out, &a.fch_act, hidden, c);
    weights(gw.fc_w, gw.fc_b, &k.dfch, &a.ln2, c, mlp_in(d.family, hidden));
    weights(gw.attn_proj_w, gw.attn_proj_b, &k.dattn_out, &a.atty, cl, c);
    weights(gw.qkv_w, gw.qkv_b, &k.dqkv, &a.ln1, c, d.qkv());
}

/// A global range of the parameter buffer, in a buffer whose first element is global `at`.
pub(super) fn shift(range: &Range<usize>, at: usize) -> Range<usize> {
    range.start - at..range.end - at
}

/// Cuts one block's gradient view into its tensors (they are contiguous, in order).
pub(super) fn split_block<'a, B: Backend>(
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
