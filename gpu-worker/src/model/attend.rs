//! Attention as a block runs it on what this rank holds (whole sequences, or with Ulysses
//! whole sequences of some heads): rotary positions on q and k (Llama), then attention,
//! naive or flash; and the backward of the two. The block (`block.rs`) and Ulysses
//! (`context_parallel.rs`) both call it.

use distlab_common::{Attention, ModelFamily};

use crate::backend::Backend;
use crate::ops::attention::{AttentionShape, Positions};

/// What attention needs to know of a block: the heads it runs and where its rows sit, the
/// family (Llama turns q and k first), and naive or flash.
#[derive(Clone, Copy, Debug)]
pub(super) struct AttendDims {
    pub(super) heads: AttentionShape,
    pub(super) positions: Positions,
    pub(super) family: ModelFamily,
    pub(super) rope_theta: f64,
    pub(super) attention: Attention,
}

/// Rotary positions (Llama), then attention of `qkv`'s rows into `out`, keeping its
/// probabilities (flash: its log-sum-exps) in `probs` when given (selective recompute's
/// stage-wide buffer), else in `att`.
pub(super) fn attend<B: Backend>(
    be: &B,
    (out, probs, att): (&mut B::Buf, Option<&mut B::Buf>, &mut B::Buf),
    qkv: &mut B::Buf,
    d: AttendDims,
) {
    if d.family == ModelFamily::Llama {
        be.rope_forward(be.all_mut(qkv), d.heads, d.rope_theta, d.positions);
    }
    let saved = be.all_mut(probs.unwrap_or(att));
    let (out, qkv) = (be.all_mut(out), be.all(qkv));
    match d.attention {
        Attention::Naive => be.attention_forward(out, saved, qkv, d.heads),
        Attention::Flash => be.flash_attention_forward(out, saved, qkv, d.heads),
    }
}

/// Attention's backward from `dy`, the gradient of its output `out` (flash reads it):
/// `dqkv` overwritten with q, k and v's gradients, turned back by the rotary positions
/// (Llama); `scratch` the probabilities' gradient (flash: its rowsums); `probs` what the
/// forward kept.
pub(super) fn attend_backward<B: Backend>(
    be: &B,
    (dy, scratch, dqkv, probs): (&B::Buf, &mut B::Buf, &mut B::Buf, &B::Buf),
    (qkv, out): (&B::Buf, &B::Buf),
    d: AttendDims,
) {
    let (scratch, qkv) = (be.all_mut(scratch), be.all(qkv));
    match d.attention {
        Attention::Naive => be.attention_backward(be.all_mut(dqkv), scratch, be.all(dy), qkv, be.all(probs), d.heads),
        Attention::Flash => {
            be.flash_attention_backward(be.all_mut(dqkv), scratch, be.all(dy), qkv, be.all(out), be.all(probs), d.heads)
        }
    }
    if d.family == ModelFamily::Llama {
        // the rotated q and k's gradients, turned back: the unrotated ones
        be.rope_backward(be.all_mut(dqkv), d.heads, d.rope_theta, d.positions);
    }
}
