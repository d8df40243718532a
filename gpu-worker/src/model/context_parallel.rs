//! The model's half of context parallelism (Ulysses; the exchange itself, and why, is in
//! `parallel/context.rs`): a rank holds T/cp tokens of each of its sequences through every
//! token-wise layer (embeddings at their positions, norms, matmuls, the MLP, the loss), and
//! around attention two all-to-alls turn q, k and v into whole sequences of heads/cp heads
//! and attention's output back into this rank's tokens; backward the same in reverse.
//!
//! ```text
//!   qkv = ln1(x) · W_qkv            (T/cp tokens, every head: [Q | K | V])
//!   qkv' = to_heads(qkv)            (T tokens, heads/cp: [Q' | K' | V'])       all-to-all
//!   y'   = attention(rope(qkv'))    (unchanged kernels, whole causal sequences)
//!   y    = to_tokens(y')            (T/cp tokens, every head)                   all-to-all
//! ```
//!
//! A block keeps `qkv'` (as many values as `qkv`) instead of `qkv`; flash attention also
//! keeps `y'` for its backward. [`ContextExchange`] holds the two buffers the exchanges
//! go through, one set for the stage.

use crate::backend::Backend;
use crate::comm::CommError;
use crate::memory::Category;

/// This rank's place in its context-parallel group: it holds tokens
/// `rank * T/size .. (rank + 1) * T/size` of every sequence and, in attention, heads
/// `rank * H/size ..` of its (tensor-parallel) heads.
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

/// A context-parallel group as the model sees it (`parallel/context.rs` is the one there is).
pub trait ContextParallelGroup<B: Backend>: Send {
    fn place(&self) -> ContextPlace;
    /// `from` (this rank's tokens, every head) becomes `to` (every token, this rank's heads).
    fn to_heads(
        &mut self,
        be: &B,
        from: &B::Buf,
        to: &mut B::Buf,
        shape: ExchangeShape,
        what: &'static str,
        layer: usize,
    ) -> Result<(), CommError>;
    /// The inverse: `from` (every token, this rank's heads) becomes `to` (this rank's
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
    fn begin_step(&mut self, step: u64, record: bool);
    fn spans(&self) -> Vec<distlab_common::trace::Span>;
    /// Books its copies in the rank's memory ledger from now on.
    fn attach_memory(&mut self, memory: &std::sync::Arc<crate::memory::MemoryTracker>);
}

/// The buffers a stage's exchanges go through (booked as activations, like sequence
/// parallelism's): `qkv` holds a block's q, k and v as the matmul makes them before they
/// leave (in backward their gradient when it comes home); `heads_out` attention's output
/// before it leaves (naive attention; in backward the output gradient when it arrives).
pub struct ContextExchange<Buf> {
    pub qkv: Buf,
    pub heads_out: Buf,
}

impl<Buf> ContextExchange<Buf> {
    /// For micro-batches of `rows` tokens on this rank, q, k and v `qkv` wide and the
    /// attention output `out` wide (this tensor-parallel rank's).
    pub fn new(rows: usize, (qkv, out): (usize, usize), alloc: &mut dyn FnMut(Category, usize) -> Buf) -> Self {
        ContextExchange {
            qkv: alloc(Category::Activations, rows * qkv),
            heads_out: alloc(Category::Activations, rows * out),
        }
    }

    pub fn buffers(&self) -> [&Buf; 2] {
        [&self.qkv, &self.heads_out]
    }
}

/// A stage's context parallelism: the group and the buffers its exchanges go through.
pub struct ContextSplit<B: Backend> {
    pub group: Box<dyn ContextParallelGroup<B>>,
    pub exchange: ContextExchange<B::Buf>,
}
