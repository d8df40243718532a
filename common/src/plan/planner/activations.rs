//! Activations: what one transformer block's forward keeps for backward and backward's
//! scratch, per micro-batch, as the engine allocates them; what activation checkpointing
//! keeps and recomputes; and the most a stage holds at once in its schedule's order.

use crate::plan::schedule::Action;
use crate::spec::{Attention, Checkpointing, ModelSpec};

/// Activation elements one transformer block saves for backward, for one micro-batch of
/// `batch` sequences of `seq` tokens (d = d_model, h = heads, t = tp), as the engine
/// stores them (model/activations.rs `BlockActivations`):
///
/// ```text
///   b*s * (4d + 12d/t + 4)  +  b * (h/t) * s^2        (flash: b * (h/t) * s * 2)
/// ```
///
/// - 4d whole on every TP rank: the outputs of ln1 and ln2, and the residual stream
///   after the attention half and after the MLP half;
/// - 12d split over TP: q, k, v (3d), the attention output before its projection (d),
///   the MLP hidden layer before and after GELU (4d + 4d);
/// - 4 per token: mean and 1/std of the two LayerNorms;
/// - the softmax probabilities, heads x s x s per sequence; with FlashAttention only one
///   log-sum-exp per row and head, kept as a (hi, lo) pair: the s^2 term is gone.
///
/// With sequence parallelism (`sp`) the 4d and the 4 statistics are split over TP too:
/// each rank keeps them for its own b*s/t tokens, b*s * ((4d + 4)/t + 12d/t).
///
/// In 16-bit that is s*b*d*(32 + 8/d + 2*h*s/d) bytes, close to Korthikanti et al.'s
/// s*b*d*(34 + 5*h*s/d), which also keeps dropout masks and the pre-softmax scores
/// (the engine has no dropout and overwrites the scores). This is THE per-layer term:
/// adjust it here when the engine's measured activations say otherwise.
///
/// Other shapes ([`ModelSpec::tp_split_activation_width`]): grouped-query attention keeps
/// narrower K and V, a wider or SwiGLU MLP more hidden values, RMSNorm one statistic.
///
/// With context parallelism over `cp` ranks every token-wise term is this rank's s/cp
/// tokens'. Ulysses keeps q, k and v for the whole sequence and heads/cp heads (as many
/// values), and the probabilities heads/(t cp) x s^2; flash attention's output also
/// head-split for its backward (b*s/cp x d/t more). The ring keeps its own tokens' q, k, v
/// and output, and one log-sum-exp pair per row (flash's b * (h/t) * (s/cp) * 2).
pub fn layer_activation_elements(m: &ModelSpec, batch: u64, cut: Cut, attention: Attention, sp: bool) -> u64 {
    let (seq, d) = (m.seq_len as u64, m.d_model as u64);
    let (tp, cp) = (cut.tp.max(1), cut.cp.max(1));
    let rows = batch.saturating_mul(seq) / cp;
    let whole = rows.saturating_mul(d.saturating_mul(4).saturating_add(m.norm_statistics()));
    let whole = if sp { whole / tp } else { whole };
    let split = rows.saturating_mul(m.tp_split_activation_width() / tp);
    let ulysses_flash = cp > 1 && !cut.ring && attention == Attention::Flash;
    let flash_heads_out = if ulysses_flash { rows.saturating_mul(d / tp) } else { 0 };
    whole.saturating_add(split).saturating_add(flash_heads_out).saturating_add(cut.attention(m, batch, attention))
}

/// How one rank's share of a block is cut: over `tp` tensor-parallel ranks, and `cp`
/// context-parallel ones (`ring`: by the ring, else by Ulysses).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Cut {
    pub tp: u64,
    pub cp: u64,
    pub ring: bool,
}

impl Cut {
    /// One rank holding whole sequences of every head.
    pub const WHOLE: Cut = Cut { tp: 1, cp: 1, ring: false };

    /// `tp` tensor-parallel ranks alone.
    pub fn tp(tp: u64) -> Cut {
        Cut { tp, ..Cut::WHOLE }
    }

    /// What attention keeps for one micro-batch on this rank: its heads' (s, s)
    /// probabilities (Ulysses: heads/cp of them, whole sequences), or one log-sum-exp pair
    /// per row (flash, and the ring's s/cp rows).
    pub fn attention(&self, m: &ModelSpec, batch: u64, attention: Attention) -> u64 {
        let (seq, heads, tp, cp) = (m.seq_len as u64, m.heads as u64, self.tp.max(1), self.cp.max(1));
        match self.ring && cp > 1 {
            true => attention_elements(batch, seq / cp, heads / tp, Attention::Flash),
            false => attention_elements(batch, seq, heads / tp / cp, attention),
        }
    }
}

/// What attention keeps for one micro-batch (and the size of its gradient scratch): the
/// (s, s) probabilities per sequence and head, or (flash) a log-sum-exp pair per row.
pub fn attention_elements(batch: u64, seq: u64, heads: u64, attention: Attention) -> u64 {
    let per_head = match attention {
        Attention::Naive => seq.saturating_mul(seq),
        Attention::Flash => seq.saturating_mul(2),
    };
    batch.saturating_mul(heads).saturating_mul(per_head)
}

/// Elements of backward's activation-gradient buffers (model/block.rs `GradScratch`): the
/// residual and LayerNorm gradients (2d, whole), the attention output, QKV and MLP hidden
/// gradients (d + 3d + 4d, split over TP) and the attention probabilities' gradient:
/// b*s*(2d + 8d/t) + b*(h/t)*s^2 (flash: a pair per row, rowsum(dO ∘ O), in place of s^2).
/// With sequence parallelism (`sp`) the residual's gradient is this rank's b*s/t tokens
/// only, and the norm parameters' gradients of a block (GPT-2's two LayerNorms 4d,
/// Llama's two RMSNorms 2d) are made in scratch before they are summed over the group.
/// With context parallelism the token-wise terms are this rank's s/cp tokens' and the
/// attention term as [`Cut::attention`] says.
pub fn activation_grad_elements(m: &ModelSpec, batch: u64, cut: Cut, attention: Attention, sp: bool) -> u64 {
    let d = m.d_model as u64;
    let (tp, cp) = (cut.tp.max(1), cut.cp.max(1));
    let rows = batch.saturating_mul(m.seq_len as u64) / cp;
    let split = rows.saturating_mul(m.tp_split_gradient_width() / tp);
    let whole = match sp {
        false => rows.saturating_mul(d.saturating_mul(2)),
        true => {
            (rows.saturating_mul(d) / tp).saturating_add(rows.saturating_mul(d)).saturating_add(2 * m.norm_params())
        }
    };
    whole.saturating_add(split).saturating_add(cut.attention(m, batch, attention))
}

/// Context parallelism's buffers on a stage (shared by its blocks), per micro-batch of
/// `rows` of this rank's tokens. Ulysses: q, k and v before the all-to-all that splits them
/// by heads (in backward their gradients after it), and attention's output before the one
/// that splits it by tokens again (in backward the output gradient after it). The ring:
/// two blocks of keys and values (the one attended to, the one arriving) and two of their
/// gradients, [K | V] rows each.
pub fn context_exchange_elements(m: &ModelSpec, rows: u64, cut: Cut) -> u64 {
    let tp = cut.tp.max(1);
    let kv = (m.qkv_width() - m.d_model as u64) / tp;
    match cut.ring {
        true => rows.saturating_mul(kv).saturating_mul(4),
        false => rows.saturating_mul(m.qkv_width() / tp + m.d_model as u64 / tp),
    }
}

/// A Mixture-of-Experts block (tp = 1) on one of `ep` expert-parallel ranks, for one
/// micro-batch of `rows` tokens: the activations it keeps and the backward scratch, from a
/// dense block's (`dense_layer`, `dense_grads`), as the engine allocates them
/// (model/experts.rs): the MLP's hidden layers (4d before and after GELU) now for each of
/// the E x C slots instead of each token; the router's probabilities (rows x E), each
/// slot's gate, the slots' inputs and outputs (slots x d each, twice with ep > 1: before and
/// after each all-to-all). Scratch: the hidden gradient for max(rows, slots) rows, the
/// slots' gradients (slots x d, twice with ep > 1), the router logits' gradient (rows x E)
/// and its share of the LayerNorm output gradient (rows x d).
pub fn expert_block_elements(m: &ModelSpec, rows: u64, ep: u64, dense_layer: u64, dense_grads: u64) -> (u64, u64) {
    let (d, e) = (m.d_model as u64, m.experts as u64);
    let slots = e.saturating_mul(m.expert_capacity(rows as usize) as u64);
    let exchanged = if ep > 1 { 2 } else { 1 };
    let (kept, made) = m.mlp_activation_widths();
    let slot_rows = |n: u64| slots.saturating_mul(n);
    let layer = [rows.saturating_mul(e), slots, slot_rows(d).saturating_mul(2 * exchanged), slot_rows(kept)]
        .into_iter()
        .fold(dense_layer.saturating_sub(rows.saturating_mul(kept)), u64::saturating_add);
    let grads = [
        rows.max(slots).saturating_mul(made),
        slot_rows(d).saturating_mul(exchanged),
        rows.saturating_mul(e),
        rows.saturating_mul(d),
    ]
    .into_iter()
    .fold(dense_grads.saturating_sub(rows.saturating_mul(made)), u64::saturating_add);
    (layer, grads)
}

/// With activation checkpointing, forward keeps only some blocks' outputs (b*s*d each)
/// and backward recomputes one segment at a time, holding that segment's full
/// activations (for one micro-batch). Returns (elements kept per micro-batch, peak of
/// what is recomputed) for a stage of `layers` blocks whose activations are `layer_acts`
/// each, `att` of them attention's probabilities:
///
/// - none:      every block's activations,               no recompute;
/// - selective: every block's but the probabilities,     one block's probabilities at a time;
/// - every:     each block's output,                     one block recomputed at a time;
/// - sqrt:      every k-th output with k = ceil(sqrt(L)), k blocks recomputed at a time.
pub(super) fn checkpointed(
    layers: u64,
    checkpointing: Checkpointing,
    rows_d: u64,
    (layer_acts, att): (u64, u64),
) -> (u64, u64) {
    match checkpointing {
        Checkpointing::None => (layers.saturating_mul(layer_acts), 0),
        Checkpointing::Selective => (layers.saturating_mul(layer_acts.saturating_sub(att)), att),
        Checkpointing::Every => (layers.saturating_mul(rows_d), layer_acts),
        Checkpointing::Sqrt => {
            let k = ceil_sqrt(layers).max(1);
            (layers.div_ceil(k).saturating_mul(rows_d), k.saturating_mul(layer_acts))
        }
    }
}

/// The most elements a stage holds at once running `actions`, when a forward of its chunk
/// c keeps `per_chunk[c]` until the backward of the same pass (split backwards: until its
/// W) and a split B of chunk c keeps `stash_per_chunk[c]` more until its W.
pub(super) fn peak_held(actions: &[Action], per_chunk: &[u64], stash_per_chunk: &[u64]) -> u64 {
    let split = actions.iter().any(|a| matches!(a, Action::Weights { .. }));
    let (mut held, mut peak) = (0u64, 0u64);
    for a in actions {
        let size = per_chunk.get(a.chunk()).copied().unwrap_or(0);
        let stash = stash_per_chunk.get(a.chunk()).copied().unwrap_or(0);
        match a {
            Action::Forward { .. } => held = held.saturating_add(size),
            Action::Backward { .. } if split => held = held.saturating_add(stash),
            Action::Backward { .. } => held = held.saturating_sub(size),
            Action::Weights { .. } => held = held.saturating_sub(size.saturating_add(stash)),
        }
        peak = peak.max(held);
    }
    peak
}

/// Blocks whose recomputation runs before their own backward, with their parameters
/// opened just for it: all but the last block of each segment (the last one recomputes
/// inside its backward). With FSDP each costs one more all-gather per micro-batch.
pub(super) fn recomputed_before_backward(layers: u64, checkpointing: Checkpointing) -> u64 {
    match checkpointing {
        Checkpointing::None | Checkpointing::Selective | Checkpointing::Every => 0,
        Checkpointing::Sqrt => layers - layers.div_ceil(ceil_sqrt(layers).max(1)),
    }
}

fn ceil_sqrt(n: u64) -> u64 {
    let r = n.isqrt();
    if r * r < n {
        r + 1
    } else {
        r
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::plan::planner::{plan, Plan};
    use crate::spec::ExperimentSpec;

    /// Flash attention keeps no (s, s) matrix: its activations grow linearly in s.
    #[test]
    fn flash_attention_has_no_quadratic_term() {
        let (b, d, h) = (2, 64, 4);
        for s in [128u64, 1024] {
            let m = ModelSpec::dense(2, d as usize, h as usize, s as usize, 64);
            let naive = layer_activation_elements(&m, b, Cut::WHOLE, Attention::Naive, false);
            let flash = layer_activation_elements(&m, b, Cut::WHOLE, Attention::Flash, false);
            assert_eq!(naive - flash, b * h * (s * s - 2 * s), "s={s}");
            assert_eq!(flash, b * s * (16 * d + 4) + b * h * s * 2, "s={s}");
            let grads = activation_grad_elements(&m, b, Cut::tp(2), Attention::Flash, false);
            assert_eq!(grads, b * s * (2 * d + 4 * d) + b * (h / 2) * s * 2, "s={s}, tp=2");
        }
    }

    /// Ulysses divides every token-wise term and attention's heads by cp: a block's
    /// activations exactly by cp; a step's tokens too (the cp ranks share their sequences);
    /// the all-to-alls send (cp-1)/cp of q, k, v and the output, twice each per block.
    #[test]
    fn context_parallelism_divides_tokens_and_heads() {
        let m = ModelSpec::dense(2, 64, 4, 256, 64);
        let whole = layer_activation_elements(&m, 2, Cut::WHOLE, Attention::Naive, false);
        for cp in [2u64, 4] {
            assert_eq!(
                layer_activation_elements(&m, 2, Cut { cp, ..Cut::WHOLE }, Attention::Naive, false) * cp,
                whole,
                "cp={cp}"
            );
            let grads = activation_grad_elements(&m, 2, Cut { cp, ..Cut::WHOLE }, Attention::Naive, false);
            assert_eq!(grads * cp, activation_grad_elements(&m, 2, Cut::WHOLE, Attention::Naive, false), "cp={cp}");
        }
        let mut spec = ExperimentSpec { model: m.clone(), ..ExperimentSpec::default() };
        (spec.parallel.dp, spec.train.micro_batch) = (4, 2);
        let replicated = plan(&spec).unwrap();
        spec.parallel.cp = 2;
        let split = plan(&spec).unwrap();
        assert_eq!(split.flops.tokens_per_step * 2, replicated.flops.tokens_per_step);
        assert_eq!(replicated.stages[0].comm.cp_all_to_all, 0);
        let rows = 2 * 256 / 2;
        let per_block = (rows * (3 * 64) / 2 + rows * 64 / 2) * 4 * 2;
        assert_eq!(split.stages[0].comm.cp_all_to_all, per_block * 2);
        assert!(split.stages[0].memory.activations < replicated.stages[0].memory.activations);
    }

    #[test]
    fn checkpointing_trades_activations_for_recompute() {
        let mut spec = ExperimentSpec::default();
        spec.model.layers = 16;
        let none = plan(&spec).unwrap();
        spec.train.checkpointing = Checkpointing::Sqrt;
        let sqrt = plan(&spec).unwrap();
        spec.train.checkpointing = Checkpointing::Every;
        let every = plan(&spec).unwrap();
        let acts = |p: &Plan| p.stages[0].memory.activations;
        assert!(
            acts(&sqrt) < acts(&none) && acts(&every) < acts(&none),
            "{} {} {}",
            acts(&none),
            acts(&sqrt),
            acts(&every)
        );
        // One extra forward of the blocks.
        let m = &spec.model;
        let tokens = 256.0;
        let extra = (2.0 * 16.0 * m.block_params() as f64 + 4.0 * 16.0 * 32.0 * 64.0) * tokens;
        assert_eq!(sqrt.flops.recompute, extra);
        assert_eq!(every.flops.total, none.flops.total + extra);
    }
}
