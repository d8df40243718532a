//! Where every parameter sits in the flat parameter (and gradient) buffer, and which part
//! of each tensor a tensor-parallel rank holds.
//!
//! Parameters are laid out tensor after tensor in the order of [`ParamLayout`]
//! (embeddings, block 0..L, final LayerNorm, LM head), and gradients the same way, so a
//! flat range of either is a well-defined shard.
//!
//! A Llama model has the same tensors less those it does not have (no position table, no
//! biases, RMSNorm's gain only: their ranges are empty): qkv_w is [d, (heads + 2 kv_heads)
//! hs] with grouped-query attention, fc_w [d, 2f] holds the gate's f columns then the up
//! projection's, fc_proj_w [f, d] is the down projection.
//!
//! With tensor parallelism over `tp` ranks (Megatron-LM; the why is in
//! `parallel/tensor.rs`) every rank has the same layout with narrower matrices:
//!
//! ```text
//!   qkv_w  [d, 3d]  -> [d, 3d/tp]   columns: 1/tp of q's, of k's and of v's (whole heads)
//!   qkv_b  [3d]     -> [3d/tp]
//!   attn_proj_w [d, d] -> [d/tp, d] rows: the inputs that come from this rank's heads
//!   fc_w   [d, 4d]  -> [d, 4d/tp]   columns: 1/tp of the MLP's hidden units
//!   fc_b   [4d]     -> [4d/tp]
//!   fc_proj_w [4d, d] -> [4d/tp, d] rows: the inputs from this rank's hidden units
//!   everything else (LayerNorms, the two row-parallel biases, embeddings, LM head): whole
//! ```
//!
//! Every rank starts from the same parameters as one rank alone would (the values the whole
//! model's initialisation gives, cut), so a run with `tp > 1` can be checked against one
//! rank loss for loss; each rank computes only its own part of them.

use std::ops::Range;

use distlab_common::{ModelFamily, ModelSpec};

use crate::backend::{Backend, Stored};
use crate::model::state::Unit;
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
    /// Mixture of Experts: the router, (d, E); empty in a dense block.
    pub router_w: T,
    /// The MLP's four tensors; with experts each has a leading expert dimension (this
    /// rank's E/ep experts, one after another).
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
            router_w: f(&self.router_w),
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

/// How tensor parallelism cuts a tensor (seen as rows x columns; a vector is one row).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Split {
    /// Whole on every tensor-parallel rank.
    Replicated,
    /// Column-parallel: the columns fall into groups of these widths in the whole tensor (q,
    /// k and v: three; GPT-2's fc: one; Llama's fc, gate and up: two; a 0 is no group), and
    /// each rank takes its 1/tp of every group.
    Columns { groups: [usize; 3] },
    /// Row-parallel: each rank takes 1/tp of the rows, in order.
    Rows,
    /// Expert-parallel: each of the ep ranks takes E/ep whole experts (the leading
    /// dimension), in order.
    Experts,
}

/// Where each group of a column-parallel tensor starts, and its width (in the whole tensor).
pub fn column_groups(groups: &[usize; 3]) -> impl Iterator<Item = (usize, usize)> + '_ {
    groups
        .iter()
        .scan(0, |start, &width| {
            let at = *start;
            *start += width;
            Some((at, width))
        })
        .filter(|&(_, width)| width > 0)
}

/// One named tensor of the parameter buffer.
#[derive(Clone, Debug, PartialEq)]
pub struct TensorInfo {
    /// e.g. `blocks.0.qkv_w`
    pub name: String,
    pub range: Range<usize>,
    /// This rank's shape (its part of the tensor under tensor parallelism).
    pub shape: Vec<usize>,
    pub init: Init,
    /// Whether AdamW's weight decay applies (matrices and embeddings).
    pub decay: bool,
    pub split: Split,
}

/// This rank's place in its tensor-parallel group.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct TpPlace {
    pub rank: usize,
    pub size: usize,
}

impl TpPlace {
    /// No tensor parallelism: one rank holds every tensor whole.
    pub const ALONE: TpPlace = TpPlace { rank: 0, size: 1 };
}

/// This rank's place in its expert-parallel group: it holds experts
/// `rank * E/size .. (rank + 1) * E/size` of every block.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ExpertPlace {
    pub rank: usize,
    pub size: usize,
}

impl ExpertPlace {
    /// No expert parallelism: every expert on every rank.
    pub const ALONE: ExpertPlace = ExpertPlace { rank: 0, size: 1 };
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
    /// Parameters on this rank (= `ModelSpec::param_count()` without tensor parallelism).
    pub total: usize,
    /// For each of `tensors`, its index in the model's own order (embeddings, blocks
    /// 0..L, head): the same unless the blocks are laid out in another order.
    canonical: Vec<usize>,
    pub model: ModelSpec,
    pub tp: TpPlace,
    pub ep: ExpertPlace,
}

/// Adds a tensor (name, shape, init, split) to a block and says where it went.
type PushTensor<'a> = dyn FnMut(&str, &[usize], Init, Split) -> Range<usize> + 'a;

struct LayoutBuilder {
    tensors: Vec<TensorInfo>,
    next: usize,
    /// For each of `tensors`, its unit and its place among the unit's tensors.
    owners: Vec<(Unit, usize)>,
    unit: Unit,
    /// Tensors of `unit` pushed so far.
    place: usize,
}

impl LayoutBuilder {
    /// The tensors pushed next are `unit`'s.
    fn begin(&mut self, unit: Unit) {
        (self.unit, self.place) = (unit, 0);
    }

    fn push(&mut self, name: String, shape: &[usize], init: Init, split: Split) -> Range<usize> {
        let len: usize = shape.iter().product();
        let range = self.next..self.next + len;
        self.next += len;
        self.owners.push((self.unit, self.place));
        self.place += 1;
        // Matrices and embeddings (the normal-initialised tensors) decay; biases and
        // LayerNorms do not.
        let decay = matches!(init, Init::Normal { .. });
        self.tensors.push(TensorInfo { name, range: range.clone(), shape: shape.to_vec(), init, decay, split });
        range
    }

    /// An empty range where a tensor the model does not have would go.
    fn nothing(&self) -> Range<usize> {
        self.next..self.next
    }
}

impl ParamLayout {
    /// The whole model on one rank.
    pub fn new(m: &ModelSpec) -> Self {
        Self::for_tp(m, TpPlace::ALONE)
    }

    /// The part of the model tensor-parallel rank `tp.rank` of `tp.size` holds (`tp.size`
    /// must divide `heads`, which divides `d_model`: the spec's validation checks both).
    pub fn for_tp(m: &ModelSpec, tp: TpPlace) -> Self {
        Self::with_unit_order(m, tp, &Unit::all(m.layers).collect::<Vec<_>>())
    }

    /// The part of a Mixture-of-Experts model expert-parallel rank `ep.rank` of `ep.size`
    /// holds: every tensor, but only its E/ep experts of each block.
    pub fn for_experts(m: &ModelSpec, ep: ExpertPlace, order: &[Unit]) -> Self {
        Self::build(m, TpPlace::ALONE, ep, order)
    }

    /// [`Self::for_tp`] with the units laid out in `order` (each of them once): an
    /// interleaved pipeline puts each stage's chunks side by side, a V the head beside the
    /// first stage's blocks, so that every stage's parameters are one run of the buffer.
    /// Each tensor keeps its initial values.
    pub fn with_unit_order(m: &ModelSpec, tp: TpPlace, order: &[Unit]) -> Self {
        Self::build(m, tp, ExpertPlace::ALONE, order)
    }

    fn build(m: &ModelSpec, tp: TpPlace, ep: ExpertPlace, order: &[Unit]) -> Self {
        let (v, t, c, l) = (m.vocab, m.seq_len, m.d_model, m.layers);
        let n = tp.size.max(1);
        let normal = Init::Normal { std: INIT_STD };
        let residual = Init::Normal { std: INIT_STD / (2.0 * l.max(1) as f64).sqrt() };
        let (qkv_width, ff) = (m.qkv_width() as usize, m.d_ff());
        let kv_width = (qkv_width - c) / 2;
        let (whole, qkv, columns, rows) = (
            Split::Replicated,
            Split::Columns { groups: [c, kv_width, kv_width] },
            Split::Columns { groups: [ff, 0, 0] },
            Split::Rows,
        );
        let mut b =
            LayoutBuilder { tensors: Vec::new(), next: 0, owners: Vec::new(), unit: Unit::Embeddings, place: 0 };
        // With experts the MLP's tensors get a leading expert dimension: this rank's E/ep.
        let (experts, local_experts) = (m.experts, m.experts / ep.size.max(1));
        let mlp = |push: &mut PushTensor<'_>, name: &str, shape: &[usize], init, split| match experts {
            0 => push(name, shape, init, split),
            _ => push(name, &[&[local_experts], shape].concat(), init, Split::Experts),
        };
        let llama = m.family == ModelFamily::Llama;
        let mut blocks: Vec<Option<BlockTensors<Range<usize>>>> = vec![None; l];
        let (mut embeddings, mut head) = (None, None);
        for &unit in order {
            b.begin(unit);
            let i = match unit {
                Unit::Embeddings => {
                    // Llama has no position table and no biases: those tensors are empty ranges.
                    let wte = b.push("wte".into(), &[v, c], normal, whole);
                    let wpe = if llama { b.nothing() } else { b.push("wpe".into(), &[t, c], normal, whole) };
                    embeddings = Some((wte, wpe));
                    continue;
                }
                Unit::Head => {
                    let lnf_g = b.push("lnf_g".into(), &[c], Init::Ones, whole);
                    let lnf_b = if llama { b.nothing() } else { b.push("lnf_b".into(), &[c], Init::Zeros, whole) };
                    let lm_head = b.push("lm_head".into(), &[c, v], normal, whole);
                    head = Some((lnf_g, lnf_b, lm_head));
                    continue;
                }
                Unit::Block(i) => i,
            };
            let at = b.next;
            let mut push = |name: &str, shape: &[usize], init, split| match shape.iter().product::<usize>() {
                0 => b.next..b.next,
                _ => b.push(format!("blocks.{i}.{name}"), shape, init, split),
            };
            // (a shape with a 0 is a tensor this family does not have)
            let bias = usize::from(!llama);
            let block = BlockTensors {
                ln1_g: push("ln1_g", &[c], Init::Ones, whole),
                ln1_b: push("ln1_b", &[c * bias], Init::Zeros, whole),
                qkv_w: push("qkv_w", &[c, qkv_width / n], normal, qkv),
                qkv_b: push("qkv_b", &[qkv_width / n * bias], Init::Zeros, qkv),
                attn_proj_w: push("attn_proj_w", &[c / n, c], residual, rows),
                attn_proj_b: push("attn_proj_b", &[c * bias], Init::Zeros, whole),
                ln2_g: push("ln2_g", &[c], Init::Ones, whole),
                ln2_b: push("ln2_b", &[c * bias], Init::Zeros, whole),
                router_w: match experts {
                    0 => at..at,
                    e => push("router_w", &[c, e], normal, whole),
                },
                // Llama: the gate's and the up projection's columns side by side (f each).
                fc_w: match llama {
                    false => mlp(&mut push, "fc_w", &[c, ff / n], normal, columns),
                    true => mlp(&mut push, "fc_w", &[c, 2 * ff / n], normal, Split::Columns { groups: [ff, ff, 0] }),
                },
                fc_b: mlp(&mut push, "fc_b", &[ff / n * bias], Init::Zeros, columns),
                fc_proj_w: mlp(&mut push, "fc_proj_w", &[ff / n, c], residual, rows),
                fc_proj_b: mlp(&mut push, "fc_proj_b", &[c * bias], Init::Zeros, whole),
            };
            blocks[i] = Some(block);
        }
        let blocks: Vec<_> = blocks.into_iter().map(|b| b.expect("the unit order names every block once")).collect();
        let (wte, wpe) = embeddings.expect("the unit order names the embeddings");
        let (lnf_g, lnf_b, lm_head) = head.expect("the unit order names the head");
        // The model's own order: the embeddings' tensors, block 0's, ..., the head's.
        let count = |of: fn(&Unit) -> bool| b.owners.iter().filter(|(u, _)| of(u)).count();
        let first_block = count(|u| *u == Unit::Embeddings);
        let per_block = count(|u| matches!(u, Unit::Block(_))) / l.max(1);
        let canonical = b
            .owners
            .iter()
            .map(|&(unit, k)| match unit {
                Unit::Embeddings => k,
                Unit::Block(i) => first_block + per_block * i + k,
                Unit::Head => first_block + per_block * l + k,
            })
            .collect();
        let (tensors, total) = (b.tensors, b.next);
        Self { wte, wpe, blocks, lnf_g, lnf_b, lm_head, tensors, total, canonical, model: m.clone(), tp, ep }
    }

    /// Parameters of one block (they are contiguous).
    pub fn block_len(&self) -> usize {
        self.blocks.first().map_or(0, |b| b.fc_proj_b.end - b.ln1_g.start)
    }

    /// `param_groups` cut to `range` and counted from its start (a stage's own buffer).
    pub fn param_groups_in(&self, range: &Range<usize>, per_tensor: bool) -> Vec<ParamGroup> {
        self.param_groups(per_tensor)
            .into_iter()
            .filter_map(|g| {
                let (start, end) = (g.range.start.max(range.start), g.range.end.min(range.end));
                (start < end).then(|| ParamGroup { range: start - range.start..end - range.start, ..g })
            })
            .collect()
    }

    /// Runs of adjacent tensors with the same weight-decay setting, for the optimizer; with
    /// `per_tensor` (a layer-wise optimizer: its trust ratio is one tensor's) a run each.
    pub fn param_groups(&self, per_tensor: bool) -> Vec<ParamGroup> {
        let mut groups: Vec<ParamGroup> = Vec::new();
        for (tensor, t) in self.tensors.iter().enumerate() {
            match groups.last_mut() {
                Some(g) if !per_tensor && g.decay == t.decay && g.range.end == t.range.start => {
                    g.range.end = t.range.end
                }
                _ => groups.push(ParamGroup { range: t.range.clone(), decay: t.decay, tensor }),
            }
        }
        groups
    }

    /// The initial parameters, deterministic from `seed` (see [`Self::init_params_range`]).
    pub fn init_params<F: Stored>(&self, seed: u64) -> Vec<F> {
        self.init_params_range(seed, 0..self.total)
    }

    /// Parameters `range` of this rank's flat buffer as initialised: exactly the values the
    /// whole model's initialisation puts there (normal deviates drawn in buffer order over
    /// the whole model without tensor parallelism, then cut), computed for `range` alone.
    /// Like materialising one shard of a model built on PyTorch's meta device: no rank ever
    /// holds the whole model's initial values (a tensor-parallel rank holds one whole
    /// tensor at a time while it cuts its part).
    pub fn init_params_range<F: Stored>(&self, seed: u64, range: Range<usize>) -> Vec<F> {
        let whole = ParamLayout::new(&self.model);
        let mut out = Vec::with_capacity(range.len());
        for (mine, &i) in self.tensors.iter().zip(&self.canonical) {
            let all = &whole.tensors[i];
            let (lo, hi) = (mine.range.start.max(range.start), mine.range.end.min(range.end));
            if lo >= hi {
                continue;
            }
            if self.tp.size <= 1 {
                // (an expert-parallel rank's experts are one run of the whole tensor)
                let skip = if mine.split == Split::Experts { self.ep.rank * mine.range.len() } else { 0 };
                let at = |x: usize| x - mine.range.start + all.range.start + skip;
                out.extend(whole.init_values::<F>(seed, i, at(lo)..at(hi)));
            } else {
                let values = whole.init_values::<F>(seed, i, all.range.clone());
                let part = self.cut(mine, all, &values);
                out.extend_from_slice(&part[lo - mine.range.start..hi - mine.range.start]);
            }
        }
        out
    }

    /// The initial values at flat positions `range` (inside tensor `i` of this layout,
    /// which has no tensor parallelism).
    fn init_values<F: Stored>(&self, seed: u64, i: usize, range: Range<usize>) -> Vec<F> {
        let t = &self.tensors[i];
        match t.init {
            Init::Zeros => vec![F::default(); range.len()],
            Init::Ones => vec![F::from_f64(1.0); range.len()],
            Init::Normal { std } => {
                // Deviate k of the stream belongs to the k-th element of the Normal tensors.
                let before: usize = self.tensors[..i]
                    .iter()
                    .filter(|t| matches!(t.init, Init::Normal { .. }))
                    .map(|t| t.range.len())
                    .sum();
                let first = before + range.start - t.range.start;
                let mut rng = Rng::from_parts(&[seed, INIT_STREAM]).at_normal(first as u64);
                range.map(|_| F::from_f64(std * rng.normal())).collect()
            }
        }
    }

    /// This rank's part of `values`, a buffer laid out by `whole` (the same model, no
    /// tensor parallelism, blocks in order), in this layout's order.
    pub fn part_of<F: Stored>(&self, whole: &ParamLayout, values: &[F]) -> Vec<F> {
        let mut out = Vec::with_capacity(self.total);
        for (mine, &i) in self.tensors.iter().zip(&self.canonical) {
            let all = &whole.tensors[i];
            out.extend(self.cut(mine, all, &values[all.range.clone()]));
        }
        debug_assert_eq!(out.len(), self.total);
        out
    }

    /// This rank's part (`mine`) of one whole tensor's values (`all`, `src`).
    fn cut<F: Stored>(&self, mine: &TensorInfo, all: &TensorInfo, src: &[F]) -> Vec<F> {
        let (rank, n) = (self.tp.rank, self.tp.size.max(1));
        match mine.split {
            Split::Replicated => src.to_vec(),
            Split::Rows => {
                let part = src.len() / n;
                src[rank * part..(rank + 1) * part].to_vec()
            }
            Split::Experts => {
                let (rank, part) = (self.ep.rank, mine.range.len());
                src[rank * part..(rank + 1) * part].to_vec()
            }
            Split::Columns { groups } => {
                let cols = *all.shape.last().expect("a tensor has a shape");
                let mut out = Vec::with_capacity(mine.range.len());
                for row in src.chunks(cols) {
                    for (start, group) in column_groups(&groups) {
                        let (at, width) = (start + rank * group / n, group / n);
                        out.extend_from_slice(&row[at..at + width]);
                    }
                }
                out
            }
        }
    }

    /// The sum of squares of elements `range` of `grads`, where element `range.start` is
    /// parameter `at` of this layout, for the global gradient norm (summed by the backend,
    /// where the gradients are): a tensor every tensor-parallel rank holds whole counts
    /// 1/tp on each, so summing over the group counts it once; so does every tensor but the
    /// experts over an expert-parallel group (1/ep).
    pub fn grad_squares<B: Backend>(&self, be: &B, grads: &B::Buf, range: Range<usize>, at: usize) -> f64 {
        if self.tp.size <= 1 && self.ep.size <= 1 {
            return be.sum_squares(be.view(grads, range));
        }
        let end = at + range.len();
        let share = |split: Split| {
            let tp = if split == Split::Replicated { 1.0 / self.tp.size as f64 } else { 1.0 };
            let ep = if split == Split::Experts { 1.0 } else { 1.0 / self.ep.size as f64 };
            tp * ep
        };
        self.tensors
            .iter()
            .filter(|t| t.range.start < end && t.range.end > at)
            .map(|t| {
                let piece = t.range.start.max(at) - at + range.start..t.range.end.min(end) - at + range.start;
                be.sum_squares(be.view(grads, piece)) * share(t.split)
            })
            .sum()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// An interleaved or V pipeline's unit order moves tensors in the buffer, never their
    /// values: each tensor starts as it does in the model's own order, whole or cut for tp.
    #[test]
    fn units_in_another_order_keep_their_initial_values() {
        let m = ModelSpec::dense(4, 8, 2, 3, 5);
        let order = [Unit::Embeddings, Unit::Block(0), Unit::Block(2), Unit::Head, Unit::Block(1), Unit::Block(3)];
        for tp in [TpPlace::ALONE, TpPlace { rank: 1, size: 2 }] {
            let plain = ParamLayout::for_tp(&m, tp);
            let moved = ParamLayout::with_unit_order(&m, tp, &order);
            let (a, b) = (plain.init_params::<f32>(7), moved.init_params::<f32>(7));
            assert_eq!(moved.total, plain.total);
            for t in &moved.tensors {
                let same = plain.tensors.iter().find(|p| p.name == t.name).unwrap();
                assert_eq!(a[same.range.clone()], b[t.range.clone()], "{} (tp {tp:?})", t.name);
            }
            // Block 2 sits right after block 0, the head after it, and any cut of the buffer
            // starts the same.
            assert_eq!(moved.lnf_g.start, moved.blocks[2].fc_proj_b.end);
            assert_eq!(moved.blocks[2].ln1_g.start, plain.blocks[1].ln1_g.start);
            let piece = moved.blocks[2].qkv_w.start + 3..moved.blocks[1].fc_w.end;
            assert_eq!(moved.init_params_range::<f32>(7, piece.clone()), b[piece]);
            let whole = ParamLayout::new(&m);
            assert_eq!(moved.part_of(&whole, &whole.init_params::<f32>(7)), b);
        }
    }

    #[test]
    fn layout_matches_the_planner_param_count_and_is_contiguous() {
        let llama = ModelSpec::llama(3, 64, 8, 2, 176, 32, 80);
        for m in [ModelSpec::default(), ModelSpec::dense(4, 256, 4, 128, 256), ModelSpec::dense(1, 8, 2, 3, 5), llama] {
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
            for per_tensor in [false, true] {
                let groups = lay.param_groups(per_tensor);
                assert_eq!(groups.iter().map(|g| g.range.len()).sum::<usize>(), lay.total);
            }
            let tensors = lay.param_groups(true);
            assert_eq!(tensors.len(), lay.tensors.len());
            assert!(tensors.iter().enumerate().all(|(i, g)| g.tensor == i && g.range == lay.tensors[i].range));
        }
    }

    /// The straightforward initialisation, written independently: every normal deviate of
    /// the whole model drawn in buffer order, then this rank's part cut out.
    fn whole_then_cut(lay: &ParamLayout, seed: u64) -> Vec<f32> {
        let whole = ParamLayout::new(&lay.model);
        let mut rng = Rng::from_parts(&[seed, INIT_STREAM]);
        let mut all = vec![0.0f32; whole.total];
        for t in &whole.tensors {
            for p in &mut all[t.range.clone()] {
                *p = match t.init {
                    Init::Normal { std } => (std * rng.normal()) as f32,
                    Init::Zeros => 0.0,
                    Init::Ones => 1.0,
                };
            }
        }
        lay.part_of(&whole, &all)
    }

    #[test]
    fn any_range_initialises_to_the_whole_models_values() {
        let m = ModelSpec::dense(2, 16, 4, 8, 24);
        for tp in [1, 2, 4] {
            for rank in 0..tp {
                let lay = ParamLayout::for_tp(&m, TpPlace { rank, size: tp });
                let expected = whole_then_cut(&lay, 9);
                assert_eq!(lay.init_params::<f32>(9), expected, "tp {rank}/{tp}");
                // Ranges that start and end inside tensors, odd offsets included (the
                // Box-Muller pairs straddle them).
                for range in [0..1, 3..7, 385..1000, 1001..lay.total, 17..lay.total - 5] {
                    let part = lay.init_params_range::<f32>(9, range.clone());
                    assert_eq!(part, expected[range.clone()], "tp {rank}/{tp} range {range:?}");
                }
            }
        }
    }

    #[test]
    fn init_is_deterministic_and_scaled() {
        let m = ModelSpec::dense(2, 64, 4, 16, 32);
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

    #[test]
    fn tensor_parallel_parts_tile_every_tensor_once() {
        let m = ModelSpec::dense(2, 16, 4, 5, 7);
        let whole = ParamLayout::new(&m);
        // Values that name their own position, so every part says where it came from.
        let ids: Vec<f32> = (0..whole.total).map(|i| i as f32).collect();
        for n in [2, 4] {
            let parts: Vec<Vec<f32>> =
                (0..n).map(|r| ParamLayout::for_tp(&m, TpPlace { rank: r, size: n }).part_of(&whole, &ids)).collect();
            let lay = ParamLayout::for_tp(&m, TpPlace { rank: 0, size: n });
            for (t, w) in lay.tensors.iter().zip(&whole.tensors) {
                let mut seen: Vec<f32> = parts.iter().flat_map(|p| p[t.range.clone()].iter().copied()).collect();
                seen.sort_by(f32::total_cmp);
                seen.dedup();
                let expected: Vec<f32> = ids[w.range.clone()].to_vec();
                assert_eq!(seen, expected, "{} with tp={n}", t.name);
            }
        }
        // Rank 1 of 2 holds the second half of q's, k's and v's columns of row 0.
        let lay = ParamLayout::for_tp(&m, TpPlace { rank: 1, size: 2 });
        let part = lay.part_of(&whole, &ids);
        let (q, w) = (&lay.blocks[0].qkv_w, &whole.blocks[0].qkv_w);
        let row0: Vec<f32> = part[q.start..q.start + 24].to_vec();
        let from = |col: usize| ids[w.start + col];
        let expected: Vec<f32> = (8..16).chain(24..32).chain(40..48).map(from).collect();
        assert_eq!(row0, expected);
    }

    #[test]
    fn replicated_gradients_count_once_over_the_tensor_parallel_group() {
        let m = ModelSpec::dense(1, 8, 2, 3, 5);
        let whole = ParamLayout::new(&m);
        let be = crate::backend::CpuBackend::<f32>::new(1);
        let grads: Vec<f32> = (0..whole.total).map(|i| ((i % 7) as f32 - 3.0) * 0.1).collect();
        let expected = whole.grad_squares(&be, &grads, 0..grads.len(), 0);
        let summed: f64 = (0..2)
            .map(|r| {
                let lay = ParamLayout::for_tp(&m, TpPlace { rank: r, size: 2 });
                let part = lay.part_of(&whole, &grads);
                // in two pieces, as a shard would see it
                let cut = lay.total / 3;
                lay.grad_squares(&be, &part, 0..cut, 0) + lay.grad_squares(&be, &part, cut..part.len(), cut)
            })
            .sum();
        assert!((summed - expected).abs() < 1e-9 * expected, "{summed} vs {expected}");
    }
}
