//! Where the model's parameters and gradients live while it runs.
//!
//! The model (`gpt.rs`) is only the math: it asks a `ModelState` for one unit's
//! parameters (and, in backward, its gradient buffer) just before it needs them and says
//! when it is done with them. A unit is what sharding cuts as one piece: the embeddings,
//! one transformer block, or the head (final LayerNorm + LM head).
//!
//! * `FlatState` keeps everything, whole, in two flat buffers (one rank; DDP; ZeRO-1).
//! * `parallel::sharded::Sharded` keeps only this rank's shard of every unit and
//!   gathers or reduce-scatters a unit at the moment it is opened or closed (ZeRO-2, FSDP).

use std::ops::Range;

use crate::backend::Backend;
use crate::comm::CommError;
use crate::model::fp8_linear::Fp8Block;
use crate::model::ParamLayout;

/// One unit of the parameter buffer, in buffer order: `Embeddings`, `Block(0..L)`, `Head`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Unit {
    Embeddings,
    Block(usize),
    Head,
}

impl Unit {
    /// Every unit in buffer order.
    pub fn all(layers: usize) -> impl Iterator<Item = Unit> {
        std::iter::once(Unit::Embeddings).chain((0..layers).map(Unit::Block)).chain(std::iter::once(Unit::Head))
    }

    /// Its range in the flat parameter buffer.
    pub fn range(self, layout: &ParamLayout) -> Range<usize> {
        match self {
            Unit::Embeddings => layout.wte.start..layout.wpe.end,
            Unit::Block(l) => layout.blocks[l].ln1_g.start..layout.blocks[l].fc_proj_b.end,
            Unit::Head => layout.lnf_g.start..layout.lm_head.end,
        }
    }

    pub fn name(self) -> String {
        match self {
            Unit::Embeddings => "embeddings".into(),
            Unit::Block(l) => format!("block {l}"),
            Unit::Head => "head".into(),
        }
    }
}

/// What the model needs of a unit.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Pass {
    Forward,
    /// Activation checkpointing: backward runs a block's forward again, from its saved
    /// input, before the block's own backward (the parameters are needed as in forward).
    Recompute,
    /// Backward; `params` is false where the unit's gradient needs no parameters (the
    /// embeddings).
    Backward {
        params: bool,
    },
    /// ZB-H1's B: the input's gradient (the LayerNorms' parameter gradients too); the
    /// matmuls' weight gradients wait for the W.
    BackwardInput,
    /// ZB-H1's W: the matmuls' weight and bias gradients, which complete the unit's.
    Weights,
}

impl Pass {
    /// Whether the unit's parameters must be at hand (FSDP gathers them).
    pub fn needs_params(self) -> bool {
        matches!(self, Pass::Forward | Pass::Recompute | Pass::Backward { params: true } | Pass::BackwardInput)
    }

    /// Whether the model adds into the unit's gradient.
    pub fn writes_grads(self) -> bool {
        matches!(self, Pass::Backward { .. } | Pass::BackwardInput | Pass::Weights)
    }

    /// Whether the unit's gradient is complete for this micro-batch when the pass closes it.
    pub fn completes_grads(self) -> bool {
        matches!(self, Pass::Backward { .. } | Pass::Weights)
    }
}

/// A unit opened for the model: buffers holding it, and where the unit starts in each (a
/// tensor at global range `r` is at `r - at` in the buffer).
pub struct OpenUnit<'a, Buf> {
    pub params: Option<(&'a Buf, usize)>,
    /// Backward only; the model ADDS into it.
    pub grads: Option<(&'a mut Buf, usize)>,
}

pub trait ModelState<B: Backend> {
    /// Makes `unit` available for `pass` (gathering it first if it is sharded).
    fn open(&mut self, be: &B, unit: Unit, pass: Pass) -> Result<OpenUnit<'_, B::Buf>, CommError>;
    /// Opens block `unit` as [`ModelState::open`] does for a model whose linear layers
    /// multiply FP8 (`fp8`: the block's scales). FSDP with `parallel.fp8_all_gather` casts
    /// the weights' shards before it gathers them and marks them arrived cast in `fp8`;
    /// any other state opens the unit as usual, and the model casts the weights itself.
    fn open_fp8(
        &mut self,
        be: &B,
        unit: Unit,
        pass: Pass,
        fp8: &mut Fp8Block,
    ) -> Result<OpenUnit<'_, B::Buf>, CommError> {
        let _ = fp8;
        self.open(be, unit, pass)
    }
    /// Said just before the model opens a unit: what it opens after that one in the same
    /// pass (None: nothing). FSDP with prefetch starts gathering it once the unit about
    /// to be opened is in place; a state that gathers nothing ignores it.
    fn announce_next(&mut self, next: Option<(Unit, Pass)>);
    /// The model is done with `unit` for `pass`; after backward its gradients for this
    /// micro-batch are final (data parallelism starts reducing them here).
    fn close(&mut self, be: &B, unit: Unit, pass: Pass) -> Result<(), CommError>;
}

/// Every parameter and gradient of a stage (the whole model without pipeline
/// parallelism), whole, in two flat buffers laid out by `ParamLayout`.
pub struct FlatState<B: Backend> {
    pub params: B::Buf,
    pub grads: B::Buf,
    /// The global index of the buffers' first element (the stage's first parameter).
    pub at: usize,
}

impl<B: Backend> FlatState<B> {
    /// The whole model: parameters initialised from `seed`; gradients zero.
    pub fn new(be: &B, layout: &ParamLayout, seed: u64) -> Self {
        Self::for_range(be, layout, 0..layout.total, seed)
    }

    /// Parameters `range` of the flat layout (a pipeline stage's), initialised exactly as
    /// the whole model would be.
    pub fn for_range(be: &B, layout: &ParamLayout, range: Range<usize>, seed: u64) -> Self {
        let mut params = be.alloc(range.len());
        be.upload(&mut params, &layout.init_params_range::<B::Elem>(seed, range.clone()));
        FlatState { params, grads: be.alloc(range.len()), at: range.start }
    }

    pub fn zero_grads(&mut self, be: &B) {
        be.fill(be.all_mut(&mut self.grads), 0.0);
    }
}

impl<B: Backend> ModelState<B> for FlatState<B> {
    fn open(&mut self, _be: &B, _unit: Unit, pass: Pass) -> Result<OpenUnit<'_, B::Buf>, CommError> {
        let grads = pass.writes_grads().then_some((&mut self.grads, self.at));
        Ok(OpenUnit { params: Some((&self.params, self.at)), grads })
    }

    fn announce_next(&mut self, _next: Option<(Unit, Pass)>) {}

    fn close(&mut self, _be: &B, _unit: Unit, _pass: Pass) -> Result<(), CommError> {
        Ok(())
    }
}
