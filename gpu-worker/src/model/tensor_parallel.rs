//! Tensor parallelism, the model's side: where a block's collectives go (Megatron-LM's f
//! and g), and sequence parallelism's exchanges (Megatron-SP, Korthikanti et al. 2022).
//! `parallel/tensor.rs` holds the group that runs them and how the matrices are split;
//! `layout.rs` which slice of each tensor a rank holds.
//!
//! Each rank runs the same block on its slice: its heads (d/tp wide) and its 1/tp of the
//! MLP's hidden units (4d/tp). The two row-parallel outputs are partial sums, summed over
//! the group in forward (g: all-reduce), and so are the two LayerNorm output gradients in
//! backward (f: all-reduce). The row-parallel biases and the residual are added by TP
//! rank 0 alone, so that the sum counts them once.
//!
//! With sequence parallelism the LayerNorms and the residual stream, whole on every TP
//! rank above, are split along the tokens: each rank normalises and keeps its own tokens
//! (b*s/t of them). Where a block crosses from the split region into the tensor-parallel
//! one and back:
//!
//! ```text
//!   LayerNorm (own tokens) -> gather_tokens (all-gather) -> column-parallel matmul
//!   row-parallel matmul -> row_parallel_forward (reduce-scatter, + own residual)
//!   backward: the output gradient gathered (gather_tokens), the LayerNorm output
//!   gathered again for the weight gradient, its gradient reduce-scattered (sum_input_grad)
//! ```
//!
//! The same bytes as the two all-reduces (an all-reduce is a reduce-scatter then an
//! all-gather), minus what the regions no longer keep whole; each rank's LayerNorm
//! parameter gradients now come from its own tokens and are summed over the group.
//! Without sequence parallelism the same functions are f and g: identity and all-reduce.
//! `block.rs`, `head.rs` and `gpt.rs` call them.

use std::ops::Range;
use std::sync::Arc;

use distlab_common::trace::Span;

use crate::backend::Backend;
use crate::comm::{CommError, InPlace, ReduceOp};
use crate::memory::{Category, MemoryTracker};
use crate::model::layout::TpPlace;

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

/// Sequence parallelism: this rank's share of a micro-batch's tokens (rows `start ..
/// start + len` of every (tokens x width) tensor).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Tokens {
    pub start: usize,
    pub len: usize,
}

impl Tokens {
    /// Its elements in a (tokens x `width`) buffer.
    pub fn of(self, width: usize) -> Range<usize> {
        self.start * width..(self.start + self.len) * width
    }
}

/// Sequence parallelism's buffers, shared by every block (one micro-batch at a time).
pub struct Exchange<Buf> {
    /// A LayerNorm output gathered whole (b*s x d) for a column-parallel matmul.
    pub gathered: Buf,
    /// A row-parallel output before its reduce-scatter, the embedding output before each
    /// rank keeps its tokens'; in backward an output gradient (or the embedding output's)
    /// gathered whole (b*s x d).
    pub full: Buf,
    /// A block's norm parameter gradients from this rank's tokens (ln1's, then ln2's: gain
    /// and bias for LayerNorm, gain for RMSNorm).
    pub ln_grads: Buf,
    /// The final norm's (last stage only).
    pub lnf_grads: Option<Buf>,
}

impl<Buf> Exchange<Buf> {
    /// For micro-batches of `rows` tokens `c` wide and norms of `norm` parameters, with the
    /// final norm's scratch on the `last` stage; each buffer from `alloc(category, floats)`.
    pub fn new(rows: usize, c: usize, norm: usize, last: bool, alloc: &mut dyn FnMut(Category, usize) -> Buf) -> Self {
        Exchange {
            gathered: alloc(Category::Activations, rows * c),
            full: alloc(Category::Activations, rows * c),
            ln_grads: alloc(Category::ActivationGrads, 2 * norm),
            lnf_grads: last.then(|| alloc(Category::ActivationGrads, norm)),
        }
    }

    pub fn buffers(&self) -> Vec<&Buf> {
        let mut bufs = vec![&self.gathered, &self.full, &self.ln_grads];
        bufs.extend(self.lnf_grads.iter());
        bufs
    }
}

/// A row-parallel linear layer's `out = inp · W + b + residual`, every rank's partial
/// product summed (`point` names the sum): whole (g: all-reduce; rank 0 alone adds the
/// bias and the residual so the sum counts them once), or with sequence parallelism
/// reduce-scattered so each rank gets its own tokens' sums, to which it adds its own
/// tokens' residual.
#[allow(clippy::too_many_arguments)]
pub fn row_parallel_forward<B: Backend>(
    be: &B,
    (out, inp, residual): (&mut B::Buf, &B::Buf, &B::Buf),
    (weight, bias, c_in): (B::View<'_>, Option<B::View<'_>>, usize),
    point: TpPoint,
    (c, lead, mine): (usize, bool, Option<Tokens>),
    tp: &mut Option<Box<dyn TensorParallelGroup<B>>>,
    exchange: &mut Option<Exchange<B::Buf>>,
    layer: usize,
) -> Result<(), CommError> {
    let bias = bias.filter(|_| lead);
    match (exchange, mine, tp) {
        (Some(e), Some(mine), Some(tp)) => {
            be.matmul_forward(be.all_mut(&mut e.full), be.all(inp), weight, bias, None, c_in, c);
            tp.collective(be, &mut e.full, InPlace::ReduceScatter(ReduceOp::Sum), point, Some(layer))?;
            be.copy(be.all_mut(out), be.view(&e.full, mine.of(c)));
            be.add(be.all_mut(out), be.all(residual));
        }
        (_, _, tp) => {
            let residual = lead.then(|| be.all(residual));
            be.matmul_forward(be.all_mut(out), be.all(inp), weight, bias, residual, c_in, c);
            if let Some(tp) = tp {
                tp.collective(be, out, InPlace::AllReduce(ReduceOp::Sum), point, Some(layer))?;
            }
        }
    }
    Ok(())
}

/// Sequence parallelism's buffer for gathered LayerNorm outputs, if any.
pub fn gathered<Buf>(exchange: &mut Option<Exchange<Buf>>) -> Option<&mut Buf> {
    exchange.as_mut().map(|e| &mut e.gathered)
}

/// A (tokens x `c`) tensor whole: `local` itself, or with sequence parallelism (`mine`)
/// `local`, this rank's tokens, put in its place in `whole` and every other rank's
/// gathered around it (all-gather).
#[allow(clippy::too_many_arguments)]
pub fn gather_tokens<'a, B: Backend>(
    be: &B,
    local: &'a B::Buf,
    whole: Option<&'a mut B::Buf>,
    mine: Option<Tokens>,
    c: usize,
    tp: &mut Option<Box<dyn TensorParallelGroup<B>>>,
    point: TpPoint,
    layer: Option<usize>,
) -> Result<&'a B::Buf, CommError> {
    let (Some(whole), Some(mine), Some(tp)) = (whole, mine, tp.as_mut()) else { return Ok(local) };
    be.copy(be.view_mut(whole, mine.of(c)), be.all(local));
    tp.collective(be, whole, InPlace::AllGather, point, layer)?;
    Ok(whole)
}

/// The gradient of a LayerNorm output, from every rank's partial `grad` (tokens x `c`,
/// through its heads or hidden units): summed whole (f: all-reduce), or with sequence
/// parallelism only this rank's tokens' sums (reduce-scatter). Returns where in `grad`
/// it is.
pub fn sum_input_grad<B: Backend>(
    be: &B,
    grad: &mut B::Buf,
    mine: Option<Tokens>,
    c: usize,
    tp: &mut Option<Box<dyn TensorParallelGroup<B>>>,
    point: TpPoint,
    layer: usize,
) -> Result<Range<usize>, CommError> {
    let whole = 0..be.buf_len(grad);
    let Some(tp) = tp.as_mut() else { return Ok(whole) };
    match mine {
        Some(mine) => {
            tp.collective(be, grad, InPlace::ReduceScatter(ReduceOp::Sum), point, Some(layer))?;
            Ok(mine.of(c))
        }
        None => {
            tp.collective(be, grad, InPlace::AllReduce(ReduceOp::Sum), point, Some(layer))?;
            Ok(whole)
        }
    }
}

/// `buf`, `N` pieces of `widths` one after another, as N views (a width may be 0).
pub fn pieces<'a, B: Backend, const N: usize>(be: &B, buf: &'a mut B::Buf, widths: [usize; N]) -> [B::ViewMut<'a>; N] {
    let mut rest = Some(be.all_mut(buf));
    widths.map(|width| {
        let (piece, tail) = be.split_mut(rest.take().expect("one piece at a time"), width);
        rest = Some(tail);
        piece
    })
}

/// Adds piece i of `buf` (pieces of `widths`) into `targets[i]` (as wide).
pub fn add_pieces<B: Backend, const N: usize>(be: &B, targets: [B::ViewMut<'_>; N], buf: &B::Buf, widths: [usize; N]) {
    let mut at = 0;
    for (target, width) in targets.into_iter().zip(widths) {
        if width > 0 {
            be.add(target, be.view(buf, at..at + width));
        }
        at += width;
    }
}
