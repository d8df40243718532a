//! The last stage's end of the model: the final LayerNorm (Llama: RMSNorm) and the LM head
//! (not tied to the embedding), forward and backward; the loss itself is `ops/loss.rs`. Also the count of
//! the logit gradients that underflowed to 0 ([`LogitGradZeros`]).
//!
//! ```text
//!   logits = lnf(x) · lm_head                   forward
//!   dx = lnf'(dlogits · lm_headᵀ)               backward, dlm_head += lnfᵀ · dlogits
//! ```
//!
//! Under tensor parallelism every rank runs the head in full (it is replicated). With
//! sequence parallelism each rank normalises its own tokens and the output is gathered
//! whole for the LM head; in backward each rank takes its tokens' share of lnf's output
//! gradient, and the final LayerNorm's parameter gradients, each rank's from its own
//! tokens, are summed over the group.

use crate::backend::{Backend, Stored};
use crate::comm::{CommError, InPlace, ReduceOp};
use crate::model::activations::HeadActivations;
use crate::model::block::{norm_backward, norm_forward, norm_widths, shift, Dims, GradScratch};
use crate::model::layout::ParamLayout;
use crate::model::tensor_parallel::{add_pieces, pieces, Exchange, TensorParallelGroup, TpPoint};

/// The head's parameters (or views of their gradients), in buffer order.
pub(super) struct HeadTensors<V> {
    pub(super) lnf_g: V,
    pub(super) lnf_b: V,
    pub(super) lm_head: V,
}

/// The head's parameters in `p`, a buffer that holds the parameters from `at` on.
pub(super) fn head_params<'a, B: Backend>(
    be: &B,
    lay: &ParamLayout,
    p: &'a B::Buf,
    at: usize,
) -> HeadTensors<B::View<'a>> {
    HeadTensors {
        lnf_g: be.view(p, shift(&lay.lnf_g, at)),
        lnf_b: be.view(p, shift(&lay.lnf_b, at)),
        lm_head: be.view(p, shift(&lay.lm_head, at)),
    }
}

/// Cuts the head's gradient view into its tensors (they are contiguous, in order).
pub(super) fn split_head<'a, B: Backend>(
    be: &B,
    view: B::ViewMut<'a>,
    lay: &ParamLayout,
) -> HeadTensors<B::ViewMut<'a>> {
    let (lnf_g, rest) = be.split_mut(view, lay.lnf_g.len());
    let (lnf_b, lm_head) = be.split_mut(rest, lay.lnf_b.len());
    HeadTensors { lnf_g, lnf_b, lm_head }
}

/// Logit gradients stored as exactly 0: in exact arithmetic none is (every softmax
/// probability is above 0), so in fp16 these are the ones that underflowed.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct LogitGradZeros {
    pub zeros: u64,
    pub sampled: u64,
}

/// The logit gradient's first rows (tokens) are counted, enough to see the share.
const LOGIT_SAMPLE_ROWS: usize = 64;

impl LogitGradZeros {
    /// Counts the zeros in the first rows of `dlogits`, the logits' gradient of `tokens`
    /// tokens (rows of `vocab`).
    pub(super) fn count<B: Backend>(be: &B, dlogits: &B::Buf, tokens: usize, vocab: usize) -> Self {
        let sampled = tokens.min(LOGIT_SAMPLE_ROWS) * vocab;
        let zeros = be.read_host(be.view(dlogits, 0..sampled), |g| {
            g.iter().filter(|v| Stored::to_f64(**v) == 0.0).count() as u64
        });
        LogitGradZeros { zeros, sampled: sampled as u64 }
    }
}

/// The final LayerNorm of the stage's output `x` and the logits, into `head`.
pub(super) fn head_forward<B: Backend>(
    be: &B,
    w: &HeadTensors<B::View<'_>>,
    x: &B::Buf,
    head: &mut HeadActivations<B::Buf>,
    (d, vocab): (Dims, usize),
    tp: &mut Option<Box<dyn TensorParallelGroup<B>>>,
) -> Result<(), CommError> {
    let c = d.c;
    let whole = be.buf_len(&head.lnf);
    let own = d.mine.map_or(0..whole, |mine| mine.of(c));
    let stats = (be.all_mut(&mut head.lnf_mean), be.all_mut(&mut head.lnf_rstd));
    norm_forward(be, d.family, be.view_mut(&mut head.lnf, own), stats, be.all(x), (w.lnf_g, w.lnf_b), c);
    if let (Some(tp), Some(_)) = (tp, d.mine) {
        tp.collective(be, &mut head.lnf, InPlace::AllGather, TpPoint::LnfOutput, None)?;
    }
    be.matmul_forward(be.all_mut(&mut head.logits), be.all(&head.lnf), w.lm_head, None, None, c, vocab);
    Ok(())
}

/// From the logits' gradient (in `head.logits`): `s.dres` becomes the gradient of the
/// stage's output `x`, the parameter gradients are ADDED into `g`. ZB-H1's B (`split`)
/// leaves the LM head's weight gradient for the W, which has the logits' gradient and lnf
/// (the micro-batch keeps them until then).
#[allow(clippy::too_many_arguments)]
pub(super) fn head_backward<B: Backend>(
    be: &B,
    w: &HeadTensors<B::View<'_>>,
    g: HeadTensors<B::ViewMut<'_>>,
    x: &B::Buf,
    head: &HeadActivations<B::Buf>,
    s: &mut GradScratch<B::Buf>,
    (d, vocab, split): (Dims, usize, bool),
    tp: &mut Option<Box<dyn TensorParallelGroup<B>>>,
    exchange: &mut Option<Exchange<B::Buf>>,
) -> Result<(), CommError> {
    let c = d.c;
    let HeadTensors { lnf_g, lnf_b, lm_head: g_lm_head } = g;
    // The final LayerNorm's parameter gradients: straight into `g`, or (sequence
    // parallelism: from this rank's tokens only) into scratch, summed over the group and
    // then added.
    let mut g_lnf = [lnf_g, lnf_b];
    let mut lnf_scratch = exchange.as_mut().and_then(|e| e.lnf_grads.as_mut());
    let widths = norm_widths(d.family, c);
    let [d_lnf_g, d_lnf_b] = match lnf_scratch.as_deref_mut() {
        Some(buf) => {
            be.fill(be.all_mut(buf), 0.0);
            pieces(be, buf, widths)
        }
        None => g_lnf.each_mut().map(|v| be.reborrow(v)),
    };
    let dlogits = be.all(&head.logits);
    match split {
        true => be.matmul_backward_input(be.all_mut(&mut s.dln), dlogits, w.lm_head, c, vocab),
        false => be.matmul_backward(
            Some(be.all_mut(&mut s.dln)),
            g_lm_head,
            None,
            dlogits,
            be.all(&head.lnf),
            w.lm_head,
            c,
            vocab,
        ),
    }
    be.fill(be.all_mut(&mut s.dres), 0.0);
    // Every TP rank has the whole gradient of lnf's output; each takes its tokens'.
    let own = d.mine.map_or(0..be.buf_len(&s.dln), |mine| mine.of(c));
    norm_backward(
        be,
        d.family,
        be.all_mut(&mut s.dres),
        (d_lnf_g, d_lnf_b),
        be.view(&s.dln, own),
        be.all(x),
        w.lnf_g,
        (be.all(&head.lnf_mean), be.all(&head.lnf_rstd)),
        c,
    );
    if let (Some(buf), Some(tp)) = (lnf_scratch, tp) {
        tp.collective(be, buf, InPlace::AllReduce(ReduceOp::Sum), TpPoint::LnfGrads, None)?;
        add_pieces(be, g_lnf, buf, widths);
    }
    Ok(())
}
