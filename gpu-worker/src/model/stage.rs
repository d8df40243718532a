//! The part of the model a pipeline stage runs ([`Stage`]): its chunks of blocks, and
//! whether it holds the embeddings and the head; the order in which its forward, backward
//! and (ZB-H1) W open the model's units, which a sharded state prefetches by.

use std::ops::Range;

use crate::backend::Backend;
use crate::model::layout::ParamLayout;
use crate::model::state::{ModelState, Pass, Unit};

/// The part of the model one pipeline stage runs: a run of blocks (interleaved: v chunks
/// of them), plus the embeddings on the first stage and the final LayerNorm, LM head and
/// loss on the last.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Stage {
    /// Its chunks of consecutive blocks, in model order (one but for interleaved and ZBV).
    pub chunks: Vec<Range<usize>>,
    /// Holds the embeddings: its first chunk starts the model.
    pub first: bool,
    /// Holds the final LayerNorm, LM head and loss: its last chunk ends the model.
    pub last: bool,
    /// Every unit of the model in parameter-buffer order (`Unit::all` but for interleaved
    /// pipelines, where each stage's chunks sit side by side, and V ones, where the head
    /// follows the first stage's blocks: `ParamLayout::with_unit_order`).
    pub unit_order: Vec<Unit>,
}

impl Stage {
    /// The whole model (no pipeline parallelism).
    pub fn whole(layers: usize) -> Stage {
        #[allow(clippy::single_range_in_vec_init)] // one chunk of blocks 0..layers
        let chunks = vec![0..layers];
        Stage { chunks, first: true, last: true, unit_order: Unit::all(layers).collect() }
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

    /// The units one micro-batch's forward through chunk `chunk` opens, in order.
    pub fn forward_opens(&self, chunk: usize) -> Vec<(Unit, Pass)> {
        let mut opens = Vec::new();
        if self.starts_model(chunk) {
            opens.push((Unit::Embeddings, Pass::Forward));
        }
        opens.extend(self.chunks[chunk].clone().map(|l| (Unit::Block(l), Pass::Forward)));
        if self.ends_model(chunk) {
            opens.push((Unit::Head, Pass::Forward));
        }
        opens
    }

    /// The units one micro-batch's backward opens, in order: the head, the segments of
    /// blocks last first (with checkpointing, each segment's blocks but its last
    /// recomputed first, then every block's backward in reverse), the embeddings. `segment`:
    /// blocks per checkpointed segment (None: no checkpointing); `with_params`: how the
    /// head and the blocks are opened.
    pub fn backward_opens(&self, chunk: usize, segment: Option<usize>, with_params: Pass) -> Vec<(Unit, Pass)> {
        let mut opens = Vec::new();
        if self.ends_model(chunk) {
            opens.push((Unit::Head, with_params));
        }
        let (first_block, blocks) = (self.chunks[chunk].start, self.chunks[chunk].len());
        let k = segment.unwrap_or(blocks.max(1));
        for start in (0..blocks).step_by(k).rev() {
            let end = (start + k).min(blocks);
            if segment.is_some() {
                opens.extend((start..end - 1).map(|i| (Unit::Block(first_block + i), Pass::Recompute)));
            }
            opens.extend((start..end).rev().map(|i| (Unit::Block(first_block + i), with_params)));
        }
        if self.starts_model(chunk) {
            opens.push((Unit::Embeddings, Pass::Backward { params: false }));
        }
        opens
    }

    /// The units ZB-H1's W opens, in order: the head, the blocks last first.
    pub fn weights_opens(&self, chunk: usize) -> Vec<(Unit, Pass)> {
        let head = self.ends_model(chunk).then_some((Unit::Head, Pass::Weights));
        let blocks = self.chunks[chunk].clone().rev().map(|l| (Unit::Block(l), Pass::Weights));
        head.into_iter().chain(blocks).collect()
    }
}

/// What a stage's forward starts from.
pub enum StageInput<'a, F> {
    /// The first stage: token ids.
    Tokens(&'a [u32]),
    /// The other stages: the previous stage's output activation.
    Activation(&'a [F]),
}

/// Where a pass is in the list of units it opens ([`Stage::forward_opens`],
/// [`Stage::backward_opens`]): before each open, the state hears what comes after it.
pub(super) struct Upcoming {
    opens: Vec<(Unit, Pass)>,
    at: usize,
}

impl Upcoming {
    pub(super) fn new(opens: Vec<(Unit, Pass)>) -> Self {
        Self { opens, at: 0 }
    }

    pub(super) fn before_open<B: Backend>(&mut self, state: &mut dyn ModelState<B>, unit: Unit, pass: Pass) {
        debug_assert_eq!(self.opens.get(self.at), Some(&(unit, pass)), "units opened out of the listed order");
        self.at += 1;
        state.announce_next(self.opens.get(self.at).copied());
    }
}
