//! The Mixture-of-Experts half of a block (Switch Transformer, GShard): in place of the
//! MLP, E MLPs of the same shape (the experts) and a router that sends each token to
//! `top_k` of them, at most C tokens per expert (`ops/router.rs` decides).
//!
//! ```text
//! forward:   logits   = ln2 · W_router                      (N x E)
//!            routing  = route(logits)                        slots: C per expert, gates
//!            X[slot]  = ln2[token of slot]                   (E*C x d, zeros where empty)
//!            Y        = expert_e(X[slots of e]) = fc_proj(act(fc(X)))   for every e
//!                       (act: GPT-2's GELU, or Llama's SwiGLU on fc's gate and up; the
//!                       experts are the family's MLP, with or without biases)
//!            out[t]   = res_attn[t] + sum over t's slots of gate x Y[slot]
//! backward:  dY[slot] = gate x dout[token],  dgate[slot] = dout[token] · Y[slot]
//!            dX       = each expert's MLP backward (its weight gradients accumulate)
//!            dln2[t]  = sum over t's slots of dX[slot] + dlogits · W_routerᵀ
//!            dlogits  = route_backward(dgate, the balance loss)
//! ```
//!
//! With expert parallelism (`parallel.ep`, `parallel/expert.rs`) this rank holds E/ep of
//! the experts. The slots are laid out expert by expert, so the slots for the experts of
//! rank r are one run; an all-to-all sends each run to its rank (which then holds, from
//! every source rank, C rows for each of its experts) and a second one brings the outputs
//! back. Backward does the same with the gradients. Each rank routes its own tokens, so
//! capacity and drops are per source rank, the same whatever ep is.

use distlab_common::ModelFamily;

use crate::backend::{Backend, Stored};
use crate::comm::CommError;
use crate::model::layout::BlockTensors;
use crate::ops::float::Float;
use crate::ops::router::{route, route_backward, Routing, EMPTY};

/// The sizes of a Mixture-of-Experts block's buffers for one micro-batch on this rank.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct ExpertShape {
    /// Every expert of the model (E).
    pub experts: usize,
    /// This rank's (E / ep).
    pub local: usize,
    /// Ranks sharing the experts (ep).
    pub ranks: usize,
    pub top_k: usize,
    /// Tokens each expert takes from each source rank's micro-batch (C).
    pub capacity: usize,
    /// Weight of the balance loss in the objective.
    pub aux_loss_coef: f64,
    /// An expert's MLP: the family's (GELU with biases, or SwiGLU without) and its hidden
    /// width f.
    pub family: ModelFamily,
    pub hidden: usize,
}

impl ExpertShape {
    /// The shape for micro-batches of `rows` tokens on one of `ep` expert-parallel ranks
    /// (None: a dense model).
    pub fn of(spec: &distlab_common::ModelSpec, rows: usize, ep: usize) -> Option<Self> {
        let ep = ep.max(1);
        spec.is_moe().then(|| ExpertShape {
            experts: spec.experts,
            local: spec.experts / ep,
            ranks: ep,
            top_k: spec.expert_top_k,
            capacity: spec.expert_capacity(rows),
            aux_loss_coef: spec.aux_loss_coef,
            family: spec.family,
            hidden: spec.d_ff(),
        })
    }

    /// Width of an expert's first matmul's output: f, or Llama's gate and up, 2f (as the
    /// dense block's, `activations::mlp_in`, which imports this module).
    pub fn mlp_in(&self) -> usize {
        match self.family {
            ModelFamily::Gpt2 => self.hidden,
            ModelFamily::Llama => 2 * self.hidden,
        }
    }

    /// What a slot keeps of its expert's MLP: fc's output and the activation's (GPT-2 2f,
    /// Llama 3f).
    pub fn kept_width(&self) -> usize {
        self.mlp_in() + self.hidden
    }

    /// Backward's MLP scratch per row: the hidden gradient, and Llama's gate's and up's
    /// beside it (GPT-2 f, GELU's backward in place; Llama 3f).
    pub fn grad_width(&self) -> usize {
        match self.family {
            ModelFamily::Gpt2 => self.hidden,
            ModelFamily::Llama => 3 * self.hidden,
        }
    }

    fn biased(&self) -> bool {
        self.family == ModelFamily::Gpt2
    }

    /// Slots of one micro-batch: E x C (as many arrive at a rank's experts, C from each
    /// source rank for each of its E/ep experts).
    pub fn slots(&self) -> usize {
        self.experts.saturating_mul(self.capacity)
    }
}

/// What a Mixture-of-Experts block keeps from forward for backward, besides the hidden
/// layers before and after the activation (`fch`, `fch_act`: slots x its widths, in
/// `BlockActivations`).
pub struct ExpertActivations<Buf> {
    /// Router probabilities (N x E).
    pub probs: Buf,
    /// Each slot's gate (E*C).
    pub gates: Buf,
    /// The tokens in their slots, at the source (E*C x d).
    pub dispatched: Buf,
    /// With ep > 1: the slots arrived at this rank's experts (E*C x d).
    pub arrived: Option<Buf>,
    /// The experts' outputs where they ran (E*C x d).
    pub expert_out: Buf,
    /// With ep > 1: the outputs back at the source (E*C x d).
    pub returned: Option<Buf>,
    /// The routing decisions (host memory: a token index per slot, a count per expert).
    pub routing: Routing,
}

impl<Buf> ExpertActivations<Buf> {
    /// `slots` x d buffers (and the router's), each from `alloc(floats)`.
    pub fn new(shape: &ExpertShape, rows: usize, c: usize, alloc: &mut dyn FnMut(usize) -> Buf) -> Self {
        let slots = shape.slots();
        let exchanged = shape.ranks > 1;
        ExpertActivations {
            probs: alloc(rows * shape.experts),
            gates: alloc(slots),
            dispatched: alloc(slots * c),
            arrived: exchanged.then(|| alloc(slots * c)),
            expert_out: alloc(slots * c),
            returned: exchanged.then(|| alloc(slots * c)),
            routing: Routing::default(),
        }
    }

    pub fn buffers(&self) -> Vec<&Buf> {
        let mut bufs = vec![&self.probs, &self.gates, &self.dispatched, &self.expert_out];
        bufs.extend(self.arrived.iter().chain(self.returned.iter()));
        bufs
    }

    /// [`Self::buffers`], writable, in the same order.
    pub fn buffers_mut(&mut self) -> Vec<&mut Buf> {
        let mut bufs = vec![&mut self.probs, &mut self.gates, &mut self.dispatched, &mut self.expert_out];
        bufs.extend(self.arrived.iter_mut().chain(self.returned.iter_mut()));
        bufs
    }

    /// The slots this rank's experts run on.
    fn at_experts(&self) -> &Buf {
        self.arrived.as_ref().unwrap_or(&self.dispatched)
    }

    /// The experts' outputs at the source.
    fn at_source(&self) -> &Buf {
        self.returned.as_ref().unwrap_or(&self.expert_out)
    }
}

/// Floats of one [`ExpertActivations`] plus the two hidden layers, for the planner's check.
pub fn expert_activation_floats(shape: &ExpertShape, rows: usize, c: usize) -> usize {
    let mut floats = 0usize;
    ExpertActivations::<()>::new(shape, rows, c, &mut |len| floats = floats.saturating_add(len));
    floats.saturating_add(shape.slots().saturating_mul(shape.kept_width()))
}

/// Backward's scratch for a Mixture-of-Experts block (one set, reused by every block).
pub struct ExpertScratch<Buf> {
    /// The slots' output gradients, then their input gradients (E*C x d).
    pub dslots: Buf,
    /// With ep > 1: the same, at the other end of the all-to-all.
    pub dslots_exchanged: Option<Buf>,
    /// The router logits' gradient (N x E).
    pub dlogits: Buf,
    /// The router's share of the LayerNorm output gradient (N x d).
    pub dln_router: Buf,
}

impl<Buf> ExpertScratch<Buf> {
    pub fn new(shape: &ExpertShape, rows: usize, c: usize, alloc: &mut dyn FnMut(usize) -> Buf) -> Self {
        ExpertScratch {
            dslots: alloc(shape.slots() * c),
            dslots_exchanged: (shape.ranks > 1).then(|| alloc(shape.slots() * c)),
            dlogits: alloc(rows * shape.experts),
            dln_router: alloc(rows * c),
        }
    }

    pub fn buffers(&self) -> Vec<&Buf> {
        let mut bufs = vec![&self.dslots, &self.dlogits, &self.dln_router];
        bufs.extend(self.dslots_exchanged.iter());
        bufs
    }
}

/// Floats of one [`ExpertScratch`].
pub fn expert_scratch_floats(shape: &ExpertShape, rows: usize, c: usize) -> usize {
    let mut floats = 0usize;
    ExpertScratch::<()>::new(shape, rows, c, &mut |len| floats = floats.saturating_add(len));
    floats
}

/// The gradients of a Mixture-of-Experts block's router and experts.
pub struct ExpertGrads<V> {
    pub router_w: V,
    pub fc_w: V,
    pub fc_b: V,
    pub fc_proj_w: V,
    pub fc_proj_b: V,
}

/// The all-to-all an expert-parallel group runs for the model (`parallel/expert.rs`).
pub trait ExpertParallelGroup<B: Backend>: Send {
    /// This rank's place in the group.
    fn place(&self) -> crate::model::layout::ExpertPlace;
    /// Chunk r of `send` (equal chunks) to rank r, chunk r of `recv` from rank r.
    fn all_to_all(
        &mut self,
        be: &B,
        send: &B::Buf,
        recv: &mut B::Buf,
        what: &'static str,
        layer: usize,
    ) -> Result<(), CommError>;
    fn begin_step(&mut self, step: u64, record: bool);
    fn spans(&self) -> Vec<distlab_common::trace::Span>;
    /// Books its copies in the rank's memory ledger from now on.
    fn attach_memory(&mut self, memory: &std::sync::Arc<crate::memory::MemoryTracker>);
}

pub type ExpertGroup<B> = Option<Box<dyn ExpertParallelGroup<B>>>;

/// The hidden layers of the experts (fc's output and the activation's, for every slot),
/// kept in the block's activations.
pub struct Hidden<'a, Buf> {
    pub fch: &'a mut Buf,
    pub fch_act: &'a mut Buf,
}

/// The experts' backward buffers: their saved hidden layers, and the scratch for the
/// hidden gradient and (Llama) the gate's and up's.
pub struct HiddenGrads<'a, Buf> {
    pub fch: &'a Buf,
    pub fch_act: &'a Buf,
    pub dfch: &'a mut Buf,
    pub dgate_up: &'a mut Buf,
}

/// The expert half forward: `out = res_attn + experts(ln2)`, keeping what backward needs.
#[allow(clippy::too_many_arguments)]
pub fn experts_forward<B: Backend>(
    be: &B,
    w: &BlockTensors<B::View<'_>>,
    (ln2, res_attn, out): (&B::Buf, &B::Buf, &mut B::Buf),
    a: &mut ExpertActivations<B::Buf>,
    h: Hidden<'_, B::Buf>,
    shape: &ExpertShape,
    c: usize,
    group: &mut ExpertGroup<B>,
    layer: usize,
) -> Result<(), CommError> {
    let e = shape.experts;
    // the router
    be.matmul_forward(be.all_mut(&mut a.probs), be.all(ln2), w.router_w, None, None, c, e);
    let logits = be.read_host(be.all(&a.probs), widen);
    let routed = route(&logits, e, shape.top_k, shape.capacity);
    be.on_host(be.all_mut(&mut a.probs), |p| store_all(p, &routed.probs));
    be.on_host(be.all_mut(&mut a.gates), |g| store_all(g, &routed.gates));
    a.routing = routed.routing;
    // tokens into their slots, and (ep > 1) to the ranks of their experts
    let slot_token = &a.routing.slot_token;
    be.read_host(be.all(ln2), |x| {
        be.on_host(be.all_mut(&mut a.dispatched), |d| {
            for (slot, &t) in slot_token.iter().enumerate() {
                let row = &mut d[slot * c..(slot + 1) * c];
                match t {
                    EMPTY => row.fill(B::Elem::default()),
                    t => row.copy_from_slice(&x[t as usize * c..(t as usize + 1) * c]),
                }
            }
        })
    });
    if let (Some(g), Some(arrived)) = (group.as_mut(), a.arrived.as_mut()) {
        g.all_to_all(be, &a.dispatched, arrived, "dispatch", layer)?;
    }
    // every expert of this rank on its C rows from each source rank
    let (f, f_in) = (shape.hidden, shape.mlp_in());
    let (cap, local) = (shape.capacity, shape.local);
    let input = a.arrived.as_ref().unwrap_or(&a.dispatched);
    for run in 0..shape.ranks * local {
        let x = run % local;
        let rows = run * cap..(run + 1) * cap;
        let (r_c, r_h, r_in) =
            (rows.start * c..rows.end * c, rows.start * f..rows.end * f, rows.start * f_in..rows.end * f_in);
        let (fc_w, fc_b, proj_w, proj_b) = expert_weights::<B>(be, w, x, c, shape);
        be.matmul_forward(be.view_mut(h.fch, r_in.clone()), be.view(input, r_c.clone()), fc_w, fc_b, None, c, f_in);
        match shape.family {
            ModelFamily::Gpt2 => be.gelu_forward(be.view_mut(h.fch_act, r_h.clone()), be.view(h.fch, r_h.clone())),
            ModelFamily::Llama => be.swiglu_forward(be.view_mut(h.fch_act, r_h.clone()), be.view(h.fch, r_in), f),
        }
        let y = be.view_mut(&mut a.expert_out, r_c);
        be.matmul_forward(y, be.view(h.fch_act, r_h), proj_w, proj_b, None, f, c);
    }
    if let (Some(g), Some(returned)) = (group.as_mut(), a.returned.as_mut()) {
        g.all_to_all(be, &a.expert_out, returned, "return", layer)?;
    }
    // each token's outputs, weighted by their gates, onto the residual
    be.copy(be.all_mut(out), be.all(res_attn));
    let y = a.at_source();
    be.read_host(be.all(y), |y| {
        be.read_host(be.all(&a.gates), |gates| {
            be.on_host(be.all_mut(out), |o| {
                for (slot, &t) in a.routing.slot_token.iter().enumerate() {
                    if t == EMPTY {
                        continue;
                    }
                    let gate = gates[slot].load().to_f64();
                    let (o, y) = (&mut o[t as usize * c..(t as usize + 1) * c], &y[slot * c..(slot + 1) * c]);
                    for (o, y) in o.iter_mut().zip(y) {
                        *o = B::Elem::from_f64(o.load().to_f64() + gate * y.load().to_f64());
                    }
                }
            })
        })
    });
    Ok(())
}

/// The expert half backward: from `dout` (the gradient of the block's output, which is
/// also the residual's), the LayerNorm output's gradient into `dln`; the experts' and the
/// router's weight gradients are ADDED into `gw`. `balance_weight` is the balance loss's
/// weight in the objective (aux_loss_coef x tokens x d(objective)/d(token loss)).
#[allow(clippy::too_many_arguments)]
pub fn experts_backward<B: Backend>(
    be: &B,
    w: &BlockTensors<B::View<'_>>,
    mut gw: ExpertGrads<B::ViewMut<'_>>,
    (dout, ln2, dln): (&B::Buf, &B::Buf, &mut B::Buf),
    a: &ExpertActivations<B::Buf>,
    h: HiddenGrads<'_, B::Buf>,
    s: &mut ExpertScratch<B::Buf>,
    shape: &ExpertShape,
    c: usize,
    group: &mut ExpertGroup<B>,
    layer: usize,
    balance_weight: f64,
) -> Result<(), CommError> {
    let slot_token = &a.routing.slot_token;
    // dY = gate x dout[token], dgate = dout[token] · Y
    let mut dgates = vec![0.0f64; slot_token.len()];
    be.read_host(be.all(dout), |dout| {
        be.read_host(be.all(&a.gates), |gates| {
            be.read_host(be.all(a.at_source()), |y| {
                be.on_host(be.all_mut(&mut s.dslots), |dy| {
                    for (slot, &t) in slot_token.iter().enumerate() {
                        let dy = &mut dy[slot * c..(slot + 1) * c];
                        if t == EMPTY {
                            dy.fill(B::Elem::default());
                            continue;
                        }
                        let (g, y) = (&dout[t as usize * c..(t as usize + 1) * c], &y[slot * c..(slot + 1) * c]);
                        let gate = gates[slot].load().to_f64();
                        for (d, g) in dy.iter_mut().zip(g) {
                            *d = B::Elem::from_f64(gate * g.load().to_f64());
                        }
                        dgates[slot] = g.iter().zip(y).map(|(g, y)| g.load().to_f64() * y.load().to_f64()).sum();
                    }
                })
            })
        })
    });
    // (ep > 1) the output gradients to the experts' ranks
    if let (Some(g), Some(exchanged)) = (group.as_mut(), s.dslots_exchanged.as_mut()) {
        g.all_to_all(be, &s.dslots, exchanged, "dispatch gradient", layer)?;
    }
    let at_experts = s.dslots_exchanged.as_mut().unwrap_or(&mut s.dslots);
    let (f, f_in) = (shape.hidden, shape.mlp_in());
    let (cap, local) = (shape.capacity, shape.local);
    let input = a.at_experts();
    let HiddenGrads { fch, fch_act, dfch, dgate_up } = h;
    for run in 0..shape.ranks * local {
        let x = run % local;
        let rows = run * cap..(run + 1) * cap;
        let (r_c, r_h, r_in) =
            (rows.start * c..rows.end * c, rows.start * f..rows.end * f, rows.start * f_in..rows.end * f_in);
        let (fc_w, _, proj_w, _) = expert_weights::<B>(be, w, x, c, shape);
        let (dfc_w, dfc_b, dproj_w, dproj_b) = expert_grads::<B>(be, &mut gw, x, c, shape);
        // fc_proj, then the activation, then fc; the slots' input gradient overwrites their
        // output's
        let dy = be.view(at_experts, r_c.clone());
        let (dh, act) = (be.view_mut(dfch, r_h.clone()), be.view(fch_act, r_h.clone()));
        be.matmul_backward(Some(dh), dproj_w, dproj_b, dy, act, proj_w, f, c);
        let dfc_out = match shape.family {
            ModelFamily::Gpt2 => {
                be.gelu_backward(be.view_mut(dfch, r_h.clone()), be.view(fch, r_h.clone()));
                be.view(dfch, r_h)
            }
            ModelFamily::Llama => {
                let (dgu, fc_out) = (be.view_mut(dgate_up, r_in.clone()), be.view(fch, r_in.clone()));
                be.swiglu_backward(dgu, be.view(dfch, r_h), fc_out, f);
                be.view(dgate_up, r_in)
            }
        };
        let dx = be.view_mut(at_experts, r_c.clone());
        be.matmul_backward(Some(dx), dfc_w, dfc_b, dfc_out, be.view(input, r_c), fc_w, c, f_in);
    }
    // (ep > 1) the input gradients back to the tokens' ranks
    if let (Some(g), Some(exchanged)) = (group.as_mut(), s.dslots_exchanged.as_ref()) {
        g.all_to_all(be, exchanged, &mut s.dslots, "return gradient", layer)?;
    }
    // dln2 = sum of each token's slots' input gradients + the router's
    be.read_host(be.all(&s.dslots), |dx| {
        be.on_host(be.all_mut(dln), |dln| {
            let mut sums = vec![0.0f64; dln.len()];
            for (slot, &t) in slot_token.iter().enumerate() {
                if t != EMPTY {
                    let (s, dx) = (&mut sums[t as usize * c..(t as usize + 1) * c], &dx[slot * c..(slot + 1) * c]);
                    s.iter_mut().zip(dx).for_each(|(s, d)| *s += d.load().to_f64());
                }
            }
            store_all(dln, &sums);
        })
    });
    let probs = be.read_host(be.all(&a.probs), widen);
    let dlogits = route_backward(&a.routing, &probs, &dgates, balance_weight);
    be.on_host(be.all_mut(&mut s.dlogits), |d| store_all(d, &dlogits));
    let drouter = be.reborrow(&mut gw.router_w);
    let dln_router = be.all_mut(&mut s.dln_router);
    be.matmul_backward(Some(dln_router), drouter, None, be.all(&s.dlogits), be.all(ln2), w.router_w, c, shape.experts);
    be.add(be.all_mut(dln), be.all(&s.dln_router));
    Ok(())
}

/// Expert `x`'s (of this rank) fc_w, fc_b, fc_proj_w, fc_proj_b (no biases for Llama).
#[allow(clippy::type_complexity)]
fn expert_weights<'a, B: Backend>(
    be: &B,
    w: &BlockTensors<B::View<'a>>,
    x: usize,
    c: usize,
    shape: &ExpertShape,
) -> (B::View<'a>, Option<B::View<'a>>, B::View<'a>, Option<B::View<'a>>) {
    let (f, f_in) = (shape.hidden, shape.mlp_in());
    (
        be.subview(w.fc_w, x * c * f_in..(x + 1) * c * f_in),
        shape.biased().then(|| be.subview(w.fc_b, x * f_in..(x + 1) * f_in)),
        be.subview(w.fc_proj_w, x * f * c..(x + 1) * f * c),
        shape.biased().then(|| be.subview(w.fc_proj_b, x * c..(x + 1) * c)),
    )
}

/// Expert `x`'s four gradients (no biases for Llama).
#[allow(clippy::type_complexity)]
fn expert_grads<'b, B: Backend>(
    be: &B,
    gw: &'b mut ExpertGrads<B::ViewMut<'_>>,
    x: usize,
    c: usize,
    shape: &ExpertShape,
) -> (B::ViewMut<'b>, Option<B::ViewMut<'b>>, B::ViewMut<'b>, Option<B::ViewMut<'b>>) {
    let (f, f_in, biased) = (shape.hidden, shape.mlp_in(), shape.biased());
    let piece = |view: &'b mut B::ViewMut<'_>, len: usize| {
        let whole = be.reborrow(view);
        let (_, rest) = be.split_mut(whole, x * len);
        be.split_mut(rest, len).0
    };
    (
        piece(&mut gw.fc_w, c * f_in),
        biased.then(|| piece(&mut gw.fc_b, f_in)),
        piece(&mut gw.fc_proj_w, f * c),
        biased.then(|| piece(&mut gw.fc_proj_b, c)),
    )
}

/// `dst[i] = src[i]` rounded to the storage format.
fn store_all<S: Stored>(dst: &mut [S], src: &[f64]) {
    for (d, &s) in dst.iter_mut().zip(src) {
        *d = S::from_f64(s);
    }
}

/// The values as f64 (the router's host math).
fn widen<S: Stored>(values: &[S]) -> Vec<f64> {
    values.iter().map(|x| x.load().to_f64()).collect()
}

/// What the routers did: summed over blocks and micro-batches (and, in a step's metrics,
/// over the ranks).
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct ExpertStats {
    /// The sum of every routing's balance loss (1: balanced).
    pub balance_sum: f64,
    /// Routings (blocks x micro-batches).
    pub routings: u64,
    /// Token-to-expert assignments the routers made, and those dropped for capacity.
    pub assignments: u64,
    pub dropped: u64,
}

impl ExpertStats {
    /// Counts one block's routing of one micro-batch (nothing for a dense block).
    pub(super) fn add<Buf>(&mut self, moe: Option<&ExpertActivations<Buf>>) {
        if let Some(r) = moe.map(|m| &m.routing) {
            self.balance_sum += r.balance;
            self.routings += 1;
            self.assignments += r.chosen.iter().map(|&n| u64::from(n)).sum::<u64>();
            self.dropped += r.dropped as u64;
        }
    }
}
