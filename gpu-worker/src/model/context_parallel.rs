//! The model's half of context parallelism (the exchanges themselves, and why, are in
//! `parallel/context.rs`): a rank holds T/cp tokens of each of its sequences through every
//! token-wise layer (embeddings at their positions, norms, matmuls, the MLP, the loss); only
//! attention needs the other ranks' tokens, in one of two ways.
//!
//! Ulysses: two all-to-alls turn q, k and v into whole sequences of heads/cp heads and
//! attention's output back into this rank's tokens; backward the same in reverse.
//!
//! ```text
//!   qkv = ln1(x) · W_qkv            (T/cp tokens, every head: [Q | K | V])
//!   qkv' = to_heads(qkv)            (T tokens, heads/cp: [Q' | K' | V'])       all-to-all
//!   y'   = attention(rope(qkv'))    (unchanged kernels, whole causal sequences)
//!   y    = to_tokens(y')            (T/cp tokens, every head)                   all-to-all
//! ```
//!
//! A block keeps `qkv'` (as many values as `qkv`) instead of `qkv`; flash attention also
//! keeps `y'` for its backward.
//!
//! The ring (`ops/ring_attention.rs`): each rank keeps its queries; the blocks of keys and
//! values travel round the ranks, each merged into the output by its log-sum-exp:
//!
//! ```text
//!   qkv = rope(ln1(x) · W_qkv)      (this rank's tokens, at their positions)
//!   y, L = block(q, own k, v)       then cp-1 times: pass the block held on, and
//!   y, L = merge(y, L, block(q, k_s, v_s))           merge the one from rank s = r-1, r-2, ...
//!   backward: the blocks travel again, each with its k and v's gradient, which every rank
//!   adds to; one last pass brings each block's gradient home
//! ```
//!
//! A block keeps its own q, k, v and output and one log-sum-exp per row, as flash
//! attention does. [`ContextExchange`] holds the buffers the exchanges go through, one set
//! for the stage.

use crate::backend::Backend;
use crate::comm::CommError;
use crate::memory::Category;
use crate::model::activations::BlockActivations;
use crate::model::attend::{attend, attend_backward, AttendDims};
use crate::ops::attention::Positions;
use crate::ops::ring_attention::RingShape;

pub use crate::parallel::exchange::Columns;

/// This rank's place in its context-parallel group: it holds tokens
/// `rank * T/size .. (rank + 1) * T/size` of every sequence (the balanced ring: chunks rank
/// and 2 size - 1 - rank of 2 size) and, with Ulysses, heads `rank * H/size ..` of its
/// (tensor-parallel) heads in attention.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ContextPlace {
    pub rank: usize,
    pub size: usize,
}

impl ContextPlace {
    pub const ALONE: ContextPlace = ContextPlace { rank: 0, size: 1 };
}

/// How the rows and columns of an exchanged tensor are laid out: `batch` sequences of
/// `tokens` tokens on this rank, and the column groups of a row when it holds every head
/// (q, k and v: three; attention's output: one; a 0 is no group). Each group is cut in cp
/// equal parts, part r being rank r's heads.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ExchangeShape {
    pub batch: usize,
    pub tokens: usize,
    pub groups: [usize; 3],
}

/// How a block's attention meets the other ranks' tokens.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ContextDims {
    /// Ulysses: the shapes of q, k and v and of attention's output as they are exchanged.
    Ulysses { qkv: ExchangeShape, out: ExchangeShape },
    /// The ring: this rank's place, the sequence length and whether each rank holds two
    /// balanced chunks.
    Ring { place: ContextPlace, seq: usize, balanced: bool },
}

impl ContextDims {
    /// Where rank `rank`'s tokens sit (the ring).
    fn positions_of(seq: usize, place: ContextPlace, balanced: bool) -> Positions {
        Positions::of_rank(place.rank, place.size, seq, balanced)
    }
}

/// A context-parallel group as the model sees it (`parallel/context.rs` is the one there is).
pub trait ContextParallelGroup<B: Backend>: Send {
    fn place(&self) -> ContextPlace;
    /// Ulysses: `from` (this rank's tokens, every head) becomes `to` (every token, this
    /// rank's heads).
    fn to_heads(
        &mut self,
        be: &B,
        from: &B::Buf,
        to: &mut B::Buf,
        shape: ExchangeShape,
        what: &'static str,
        layer: usize,
    ) -> Result<(), CommError>;
    /// Ulysses' inverse: `from` (every token, this rank's heads) becomes `to` (this rank's
    /// tokens, every head).
    fn to_tokens(
        &mut self,
        be: &B,
        from: &B::Buf,
        to: &mut B::Buf,
        shape: ExchangeShape,
        what: &'static str,
        layer: usize,
    ) -> Result<(), CommError>;
    /// The ring: the `send` columns go to the next rank, the previous rank's arrive in the
    /// `recv` columns.
    #[allow(clippy::too_many_arguments)]
    fn pass_on(
        &mut self,
        be: &B,
        send: (&B::Buf, Columns),
        recv: (&mut B::Buf, Columns),
        what: &'static str,
        step: usize,
        layer: usize,
    ) -> Result<(), CommError>;
    fn begin_step(&mut self, step: u64, record: bool);
    fn spans(&self) -> Vec<distlab_common::trace::Span>;
    /// Books its copies in the rank's memory ledger from now on.
    fn attach_memory(&mut self, memory: &std::sync::Arc<crate::memory::MemoryTracker>);
}

/// The buffers a stage's exchanges go through (booked as activations, like sequence
/// parallelism's).
pub enum ContextExchange<Buf> {
    /// `qkv` holds a block's q, k and v as the matmul makes them before they leave (in
    /// backward their gradient when it comes home); `heads_out` attention's output before
    /// it leaves (naive attention; in backward the output gradient when it arrives).
    Ulysses { qkv: Buf, heads_out: Buf },
    /// Two blocks of keys and values ([K | V] rows): the one attended to and the one
    /// arriving; and two of their gradients.
    Ring { kv: [Buf; 2], dkv: [Buf; 2] },
}

impl<Buf> ContextExchange<Buf> {
    /// For micro-batches of `rows` tokens on this rank, q, k and v `qkv` wide and the
    /// attention output `out` wide (this tensor-parallel rank's): Ulysses', or the ring's.
    pub fn new(
        rows: usize,
        (qkv, out): (usize, usize),
        ring: bool,
        alloc: &mut dyn FnMut(Category, usize) -> Buf,
    ) -> Self {
        let mut alloc = |len| alloc(Category::Activations, len);
        match ring {
            false => ContextExchange::Ulysses { qkv: alloc(rows * qkv), heads_out: alloc(rows * out) },
            true => {
                let kv = rows * (qkv - out);
                ContextExchange::Ring { kv: [alloc(kv), alloc(kv)], dkv: [alloc(kv), alloc(kv)] }
            }
        }
    }

    pub fn buffers(&self) -> Vec<&Buf> {
        match self {
            ContextExchange::Ulysses { qkv, heads_out } => vec![qkv, heads_out],
            ContextExchange::Ring { kv, dkv } => kv.iter().chain(dkv).collect(),
        }
    }
}

/// A stage's context parallelism: the group and the buffers its exchanges go through.
pub struct ContextSplit<B: Backend> {
    pub group: Box<dyn ContextParallelGroup<B>>,
    pub exchange: ContextExchange<B::Buf>,
}

/// Attention of a block whose q, k and v the matmul made (Ulysses: in the exchange buffer;
/// the ring: in `a.qkv`), into `a.atty`, keeping what its backward needs.
pub(super) fn context_attention_forward<B: Backend>(
    be: &B,
    cx: &mut ContextSplit<B>,
    context: ContextDims,
    a: &mut BlockActivations<B::Buf>,
    probs: Option<&mut B::Buf>,
    d: AttendDims,
    layer: usize,
) -> Result<(), CommError> {
    let ContextSplit { group, exchange } = cx;
    match (exchange, context) {
        (ContextExchange::Ulysses { qkv, heads_out }, ContextDims::Ulysses { qkv: qkv_shape, out }) => {
            group.to_heads(be, qkv, &mut a.qkv, qkv_shape, "qkv", layer)?;
            // (flash attention's backward reads its output as attention made it: kept)
            let made = match d.attention {
                distlab_common::Attention::Flash => &mut a.atty_heads,
                distlab_common::Attention::Naive => heads_out,
            };
            attend(be, (made, probs, &mut a.att), &mut a.qkv, d);
            group.to_tokens(be, made, &mut a.atty, out, "attention output", layer)
        }
        (ContextExchange::Ring { kv, .. }, ContextDims::Ring { place, seq, balanced }) => {
            if d.family == distlab_common::ModelFamily::Llama {
                be.rope_forward(be.all_mut(&mut a.qkv), d.heads, d.rope_theta, d.positions);
            }
            let shape = ring_shape(d, place, seq, balanced);
            let (own, travelled) = (shape(place.rank, true), Columns::all(2 * d.heads.kv_width()));
            let (out, lse, q) = (&mut a.atty, &mut a.att, &a.qkv);
            be.ring_attention_forward(be.all_mut(out), be.all_mut(lse), be.all(q), be.all(q), own, true);
            for step in 1..place.size {
                let from = (place.rank + place.size - step) % place.size;
                let [held, arriving] = pair(kv, step);
                let sent = if step == 1 { (q, own_kv(d)) } else { (&*held, travelled) };
                group.pass_on(be, sent, (arriving, travelled), "k, v", step, layer)?;
                let block = shape(from, false);
                be.ring_attention_forward(be.all_mut(out), be.all_mut(lse), be.all(q), be.all(arriving), block, false);
            }
            Ok(())
        }
        _ => unreachable!("the exchange buffers are made for the model's context parallelism"),
    }
}

/// Attention's backward in a block with context parallelism: from `datty` (this rank's
/// tokens' output gradient) to `dqkv` (its q, k and v's gradients); `datt` the
/// probabilities' gradient's scratch, `probs` what the forward kept (Ulysses).
pub(super) fn context_attention_backward<B: Backend>(
    be: &B,
    cx: &mut ContextSplit<B>,
    context: ContextDims,
    a: &BlockActivations<B::Buf>,
    (datty, datt, dqkv, probs): (&B::Buf, &mut B::Buf, &mut B::Buf, &B::Buf),
    d: AttendDims,
    layer: usize,
) -> Result<(), CommError> {
    let ContextSplit { group, exchange } = cx;
    match (exchange, context) {
        (ContextExchange::Ulysses { qkv, heads_out }, ContextDims::Ulysses { qkv: qkv_shape, out }) => {
            // the output gradient to every token of this rank's heads; q, k and v's home
            group.to_heads(be, datty, heads_out, out, "attention output gradient", layer)?;
            let kept = match d.attention {
                distlab_common::Attention::Flash => &a.atty_heads,
                distlab_common::Attention::Naive => &a.atty,
            };
            attend_backward(be, (heads_out, datt, qkv, probs), (&a.qkv, kept), d);
            group.to_tokens(be, qkv, dqkv, qkv_shape, "qkv gradient", layer)
        }
        (ContextExchange::Ring { kv, dkv }, ContextDims::Ring { place, seq, balanced }) => {
            let shape = ring_shape(d, place, seq, balanced);
            let (own, travelled) = (shape(place.rank, true), Columns::all(2 * d.heads.kv_width()));
            be.fill(be.all_mut(dqkv), 0.0);
            be.fill(be.all_mut(&mut dkv[0]), 0.0);
            let (dy, q, out, lse) = (datty, &a.qkv, &a.atty, &a.att);
            let dq = dqkv;
            be.ring_attention_backward(
                be.all_mut(dq),
                be.all_mut(&mut dkv[0]),
                be.all(dy),
                be.all(q),
                be.all(q),
                be.all(out),
                be.all(lse),
                own,
            );
            for step in 1..place.size {
                let from = (place.rank + place.size - step) % place.size;
                let [held, arriving] = pair(kv, step);
                let sent = if step == 1 { (q, own_kv(d)) } else { (&*held, travelled) };
                group.pass_on(be, sent, (arriving, travelled), "k, v", step, layer)?;
                let [held_grad, arriving_grad] = pair(dkv, step);
                group.pass_on(be, (held_grad, travelled), (arriving_grad, travelled), "dk, dv", step, layer)?;
                be.ring_attention_backward(
                    be.all_mut(dq),
                    be.all_mut(arriving_grad),
                    be.all(dy),
                    be.all(q),
                    be.all(arriving),
                    be.all(out),
                    be.all(lse),
                    shape(from, false),
                );
            }
            // The block held now is the next rank's, every rank's share in it: home it goes,
            // and this rank's own arrives, into its K and V columns.
            let held = &dkv[(place.size - 1) % 2];
            group.pass_on(be, (held, travelled), (dq, own_kv(d)), "dk, dv home", place.size, layer)?;
            if d.family == distlab_common::ModelFamily::Llama {
                be.rope_backward(be.all_mut(dq), d.heads, d.rope_theta, d.positions);
            }
            Ok(())
        }
        _ => unreachable!("the exchange buffers are made for the model's context parallelism"),
    }
}

/// The ring's block shape for this rank's queries on rank `from`'s keys and values
/// (`own`: read from this rank's qkv).
fn ring_shape(d: AttendDims, place: ContextPlace, seq: usize, balanced: bool) -> impl Fn(usize, bool) -> RingShape {
    let h = d.heads;
    move |from, own| RingShape {
        heads: h.heads,
        kv_heads: h.kv_heads,
        head_size: h.head_size,
        q: ContextDims::positions_of(seq, place, balanced),
        k: ContextDims::positions_of(seq, ContextPlace { rank: from, ..place }, balanced),
        own,
    }
}

/// The K and V columns of this rank's qkv rows.
fn own_kv(d: AttendDims) -> Columns {
    let h = d.heads;
    Columns { row: h.qkv_width(), at: h.q_width(), width: 2 * h.kv_width() }
}

/// The ring's two buffers at pass `step`: the one held (filled by the pass before) and the
/// one arriving.
fn pair<Buf>(bufs: &mut [Buf; 2], step: usize) -> [&mut Buf; 2] {
    let [a, b] = bufs;
    if step % 2 == 1 {
        [a, b]
    } else {
        [b, a]
    }
}
