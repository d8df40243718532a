//! Optimizers (AdamW, SGD, LAMB, LARS), the learning-rate schedule and global-norm clipping; the
//! update's element kernels are an op (`ops/optimizer.rs`, beside its `.cu`), and
//! `offload.rs` keeps the state off the device.
//!
//! AdamW (decoupled weight decay, as `torch.optim.AdamW`), with g = grad_scale * grad:
//!   m = b1 m + (1 - b1) g,   v = b2 v + (1 - b2) g^2
//!   p = p - lr * ( m / (1 - b1^t) / (sqrt(v / (1 - b2^t)) + eps) + wd * p )
//! betas (0.9, 0.95), eps 1e-8 (GPT-2/3 practice). Weight decay applies to the
//! matrices and embeddings only, never to biases or LayerNorm parameters.
//!
//! SGD is plain stochastic gradient descent, no momentum (so it keeps no optimizer
//! state; AdamW keeps two floats per parameter):  p = p - lr * (g + wd * p).
//!
//! The layer-wise optimizers scale each tensor's step by a trust ratio of that tensor's
//! own norms, so that every tensor moves by about lr times its size whatever its gradient's
//! scale (what lets a batch grow far beyond where one learning rate suits every layer):
//!   LAMB (You et al. 2019):  r = m_hat / (sqrt(v_hat) + eps) + wd * p,
//!                            p = p - lr * (|p| / |r|) * r      (AdamW's moments)
//!   LARS (You et al. 2017):  p = p - lr * |p| / (|g| + wd |p|) * (g + wd * p)
//! with |.| a whole tensor's L2 norm (a ratio of 1 where either norm is 0), the paper's
//! trust coefficient folded into lr, and LARS without momentum as distlab's SGD. Both run
//! in two passes: the squares of each tensor's pieces (`TrustPass`), summed over the ranks
//! a sharded tensor is spread on, then AdamW's or SGD's own update with lr times the
//! tensor's ratio (r = m_hat / (sqrt(v_hat) + eps) + wd p makes LAMB's step exactly
//! AdamW's with that lr).
//!
//! Schedule: linear warmup from lr/warmup_steps to lr over `warmup_steps`, then
//! `constant` or `cosine` decay to 10% of lr at the end of the run.
//! Clipping: the gradient norm is the L2 norm over ALL parameters (reported before
//! clipping); when it exceeds grad_clip (> 0) the update uses g * grad_clip / norm.

use std::ops::Range;
use std::sync::Arc;

use distlab_common::{LrSchedule, Optimizer as OptimizerKind, TrainSpec};

use crate::backend::{Backend, Stored};
use crate::comm::Communicator;
use crate::error::TrainError;
use crate::memory::{Category, MemoryTracker, Receipt};
/// The optimizer's state as the strategies and the trainer name it (`crate::optim::...`); the
/// types are the optimizer op's (`ops/optimizer.rs`), which the backends share.
pub use crate::ops::optimizer::{needs_master, OptimizerSlices, OptimizerState};
use crate::ops::optimizer::{AdamWStep, TrustPass, Update};
use offload::{OffloadError, OffloadTo, OffloadedState};

pub mod offload;

pub const ADAM_BETA1: f64 = 0.9;
pub const ADAM_BETA2: f64 = 0.95;
pub const ADAM_EPS: f64 = 1e-8;
/// Cosine decay ends at this fraction of the peak learning rate.
pub const COSINE_FINAL_FRACTION: f64 = 0.1;

/// The learning rate of optimizer step `step` (0-based).
pub fn lr_at(train: &TrainSpec, step: u64) -> f64 {
    let peak = train.lr;
    if step < train.warmup_steps {
        return peak * (step + 1) as f64 / train.warmup_steps as f64;
    }
    match train.lr_schedule {
        LrSchedule::Constant => peak,
        LrSchedule::Cosine => {
            let decay_steps = train.steps.saturating_sub(train.warmup_steps).max(1);
            let progress = ((step - train.warmup_steps) as f64 / decay_steps as f64).min(1.0);
            let min_lr = COSINE_FINAL_FRACTION * peak;
            min_lr + 0.5 * (peak - min_lr) * (1.0 + (std::f64::consts::PI * progress).cos())
        }
    }
}

/// The factor the clipped gradient is multiplied by (1 when clipping is off or not needed).
pub fn clip_scale(grad_norm: f64, grad_clip: f64) -> f64 {
    if grad_clip > 0.0 && grad_norm > grad_clip {
        grad_clip / grad_norm
    } else {
        1.0
    }
}

/// A contiguous range of parameters sharing one weight-decay setting: one tensor for a
/// layer-wise optimizer, else a run of them.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ParamGroup {
    pub range: Range<usize>,
    pub decay: bool,
    /// The index of its (first) tensor in the layout's tensors.
    pub tensor: usize,
}

/// A run of parameters this optimizer updates: where it is in the whole flat layout
/// (`global`) and in this rank's shard (`local`, also where its m and v live). Without
/// sharding the two are equal.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct OptimGroup {
    pub global: Range<usize>,
    pub local: Range<usize>,
    pub decay: bool,
    /// The index of its (first) tensor in the layout's tensors: with a layer-wise optimizer,
    /// the tensor whose trust ratio it takes (a sharded tensor's pieces on several ranks).
    pub tensor: usize,
}

impl OptimGroup {
    /// Where it is in a buffer indexed as said.
    pub fn range(&self, indexing: Indexing) -> Range<usize> {
        match indexing {
            Indexing::Global => self.global.clone(),
            Indexing::Local => self.local.clone(),
        }
    }

    /// The groups of a whole, unsharded parameter buffer.
    pub fn unsharded(groups: &[ParamGroup]) -> Vec<OptimGroup> {
        groups
            .iter()
            .map(|g| OptimGroup { global: g.range.clone(), local: g.range.clone(), decay: g.decay, tensor: g.tensor })
            .collect()
    }
}

/// What an optimizer updates: its runs of parameters, and how many tensors the model's
/// layout has (the length of the layer-wise norms summed over a sharded tensor's ranks,
/// the same on every rank whatever its shard holds).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct OptimGroups {
    pub runs: Vec<OptimGroup>,
    pub tensors: usize,
}

/// How a buffer handed to `Optimizer::step` is indexed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Indexing {
    /// The whole flat layout.
    Global,
    /// This rank's shard only.
    Local,
}

/// Optimizer state for the parameters of `groups`, on backend `B`: AdamW's m and v, and
/// in mixed precision the fp32 master weights, all fp32 and allocated once (the backend
/// keeps them where its buffers live). Indexed by the groups' `local` ranges (this rank's
/// shard, or everything).
///
/// Mixed precision (bf16/fp16 models): the model computes with 2-byte parameters, but an
/// update (lr x a normalised gradient, 1e-4 and less) is below bf16's resolution for most
/// weights and would round away. So the optimizer keeps fp32 master weights, applies the
/// update there, and rounds the result into the model's copy: 2 + 2 bytes for the model's
/// parameters and gradients, 4 + 4 + 4 for master, m and v: 16 bytes per parameter with
/// AdamW, the mixed-precision accounting of the ZeRO paper.
///
/// With `parallel.offload` the state lives off the device instead (`offload.rs`).
pub struct Optimizer<B: Backend> {
    kind: OptimizerKind,
    weight_decay: f64,
    groups: OptimGroups,
    state: Placement<B>,
    steps_taken: u64,
    memory: Arc<MemoryTracker>,
    _receipts: Vec<Receipt>,
}

/// Whether what an offloaded optimizer keeps in host memory is the device's memory too
/// (the CPU backend).
fn host_is_device<B: Backend>(be: &B) -> bool {
    be.buffers_on_host()
}

/// Where an optimizer's state lives.
enum Placement<B: Backend> {
    /// Where the model's buffers are, updated by the backend's kernels.
    Device(B::OptimizerBuffers),
    /// Off the device (host memory or disk), updated on the host.
    Offloaded(OffloadedState),
}

impl<B: Backend<Elem: Stored<Acc = f32>>> Optimizer<B> {
    /// State for `local_len` parameters (the shard, or everything), registered with
    /// `memory`, where `offload` says. `initial` gives the starting fp32 values of those
    /// parameters, which a mixed-precision optimizer keeps as its master weights.
    pub fn new(
        be: &B,
        train: &TrainSpec,
        groups: OptimGroups,
        local_len: usize,
        initial: impl FnOnce() -> Vec<f32>,
        memory: &Arc<MemoryTracker>,
        offload: &OffloadTo,
    ) -> Result<Self, OffloadError> {
        let moments = train.optimizer.keeps_moments();
        let floats = local_len * (2 * moments as usize + needs_master::<B::Elem>() as usize);
        let state = match offload {
            OffloadTo::None => Placement::Device(be.optimizer_buffers(local_len, moments, initial)),
            OffloadTo::Host => Placement::Offloaded(OffloadedState::host::<B::Elem>(local_len, moments, initial)),
            OffloadTo::Disk(dir) => {
                Placement::Offloaded(OffloadedState::disk::<B::Elem>(dir, local_len, moments, initial)?)
            }
        };
        // On the device: all of it. Offloaded: all of it off the device; what of it is in
        // host memory at every step (a disk state's piece) is device memory too where the
        // host is the device (the CPU backend: its buffers are on the heap).
        let (resident, offloaded) = match &state {
            Placement::Device(_) => (floats, 0),
            Placement::Offloaded(off) => (if host_is_device(be) { off.host_floats() } else { 0 }, floats),
        };
        let receipts = [(Category::OptimizerState, resident), (Category::Offloaded, offloaded)]
            .into_iter()
            .filter(|&(_, floats)| floats > 0)
            .map(|(category, floats)| memory.alloc(category, floats))
            .collect();
        Ok(Self {
            kind: train.optimizer,
            weight_decay: train.weight_decay,
            groups,
            state,
            steps_taken: 0,
            memory: memory.clone(),
            _receipts: receipts,
        })
    }

    /// Bytes of the state buffers in device memory (for checking the memory ledger).
    pub fn held_bytes(&self, be: &B) -> u64 {
        match &self.state {
            Placement::Device(buffers) => be.read_optimizer_buffers(buffers, |s| {
                (s.m.len() + s.v.len() + s.master.map_or(0, <[f32]>::len)) as u64 * 4
            }),
            Placement::Offloaded(off) if host_is_device(be) => off.host_floats() as u64 * 4,
            Placement::Offloaded(_) => 0,
        }
    }

    /// One update of every parameter group; `params` (the model's) and `grads` are indexed
    /// as said. With master weights the update goes there and `params` get it rounded.
    /// `shards`: the group a sharded tensor's pieces are spread over (ZeRO/FSDP), whose
    /// ranks sum a layer-wise optimizer's norms; None where every tensor is whole here.
    pub fn step(
        &mut self,
        be: &B,
        params: (&mut B::Buf, Indexing),
        grads: (&B::Buf, Indexing),
        lr: f64,
        grad_scale: f64,
        shards: Option<&mut dyn Communicator>,
    ) -> Result<(), TrainError> {
        self.steps_taken += 1;
        let (params, params_indexing) = params;
        let (grads, grads_indexing) = grads;
        let squares = match self.kind {
            OptimizerKind::Lamb | OptimizerKind::Lars => {
                let read = (&*params, params_indexing);
                Some(self.tensor_squares(be, read, (grads, grads_indexing), grad_scale, shards)?)
            }
            OptimizerKind::Adamw | OptimizerKind::Sgd => None,
        };
        for group in &self.groups.runs {
            let weight_decay = self.decay_of(group);
            // LAMB's and LARS's second pass: AdamW's and SGD's update at lr times the ratio.
            let ratio = squares.as_ref().map_or(1.0, |squares| {
                let (w, u) = (squares[2 * group.tensor].sqrt(), squares[2 * group.tensor + 1].sqrt());
                match self.kind {
                    OptimizerKind::Lars => trust_ratio(w, grad_scale * u + weight_decay * w),
                    _ => trust_ratio(w, u),
                }
            });
            let lr = lr * ratio;
            let update = match self.kind {
                OptimizerKind::Adamw | OptimizerKind::Lamb => Update::AdamW(self.adam(weight_decay, lr, grad_scale)),
                OptimizerKind::Sgd | OptimizerKind::Lars => Update::Sgd { lr, weight_decay, grad_scale },
            };
            let model = be.view_mut(params, group.range(params_indexing));
            let g = be.view(grads, group.range(grads_indexing));
            match &mut self.state {
                Placement::Device(buffers) => be.optimizer_update(model, g, buffers, group.local.clone(), &update),
                // Off the device: the gradients come down, the parameters go down and back up.
                Placement::Offloaded(state) => be.read_host(g, |g| {
                    be.on_host(model, |model| state.update(model, g, group.local.clone(), &update))
                })?,
            }
        }
        Ok(())
    }

    /// A layer-wise step's first pass: for every tensor of the layout, Σw² and Σu² (at 2t
    /// and 2t + 1) over its pieces here, summed over `shards` where a tensor is cut.
    fn tensor_squares(
        &mut self,
        be: &B,
        (params, params_indexing): (&B::Buf, Indexing),
        (grads, grads_indexing): (&B::Buf, Indexing),
        grad_scale: f64,
        shards: Option<&mut dyn Communicator>,
    ) -> Result<Vec<f64>, TrainError> {
        let mut squares = vec![0.0f64; 2 * self.groups.tensors];
        for group in &self.groups.runs {
            let pass = match self.kind {
                // (the lr does not enter the direction)
                OptimizerKind::Lamb => TrustPass::Lamb(self.adam(self.decay_of(group), 0.0, grad_scale)),
                _ => TrustPass::Lars,
            };
            let (model, g) =
                (be.view(params, group.range(params_indexing)), be.view(grads, group.range(grads_indexing)));
            let (w2, u2) = match &mut self.state {
                Placement::Device(buffers) => be.trust_squares(model, g, buffers, group.local.clone(), &pass),
                Placement::Offloaded(state) => be.read_host(g, |g| {
                    be.read_host(model, |model| state.trust_squares(model, g, group.local.clone(), &pass))
                })?,
            };
            squares[2 * group.tensor] += w2;
            squares[2 * group.tensor + 1] += u2;
        }
        Ok(match shards {
            Some(comm) => sum_over(comm, &squares)?,
            None => squares,
        })
    }

    /// AdamW's numbers for this step.
    fn adam(&self, weight_decay: f64, lr: f64, grad_scale: f64) -> AdamWStep {
        let (beta1, beta2, eps, step) = (ADAM_BETA1, ADAM_BETA2, ADAM_EPS, self.steps_taken);
        AdamWStep { lr, beta1, beta2, eps, weight_decay, step, grad_scale }
    }

    /// The weight decay of a group's parameters.
    fn decay_of(&self, group: &OptimGroup) -> f64 {
        if group.decay {
            self.weight_decay
        } else {
            0.0
        }
    }

    /// Shows `f` the buffers (read on the host) and the updates made so far.
    pub fn read<R>(&self, be: &B, f: impl FnOnce(OptimizerSlices<'_, f32>, u64) -> R) -> Result<R, OffloadError> {
        match &self.state {
            Placement::Device(buffers) => Ok(be.read_optimizer_buffers(buffers, |slices| f(slices, self.steps_taken))),
            Placement::Offloaded(state) => {
                // A disk state is read whole for the call: booked while it is.
                let _copy =
                    (state.read_floats() > 0).then(|| self.memory.alloc(Category::Transient, state.read_floats()));
                state.read(|slices| f(slices, self.steps_taken))
            }
        }
    }

    /// Puts back a checkpoint's state, taken from an optimizer of the same shape.
    pub fn load_state(&mut self, be: &B, state: OptimizerState) -> Result<(), String> {
        match &mut self.state {
            Placement::Device(buffers) => be.load_optimizer_buffers(buffers, &state)?,
            Placement::Offloaded(offloaded) => offloaded.load(&state)?,
        }
        self.steps_taken = state.steps_taken;
        Ok(())
    }
}

/// A tensor's trust ratio |w| / |u| (u its step's direction, or LARS's |g| + wd |w|): 1
/// where either is 0 (a tensor at zero, or with nothing to move, takes the plain step).
pub fn trust_ratio(w_norm: f64, u_norm: f64) -> f64 {
    if w_norm > 0.0 && u_norm > 0.0 {
        w_norm / u_norm
    } else {
        1.0
    }
}

/// `values` summed element-wise over `comm`'s ranks (all-reduced in fp32).
fn sum_over(comm: &mut dyn Communicator, values: &[f64]) -> Result<Vec<f64>, crate::comm::CommError> {
    let mut buf: Vec<f32> = values.iter().map(|&v| v as f32).collect();
    comm.all_reduce(&mut buf, crate::comm::ReduceOp::Sum)?;
    Ok(buf.into_iter().map(f64::from).collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn schedule_warms_up_then_decays_to_ten_percent() {
        let mut t = TrainSpec { steps: 100, warmup_steps: 10, lr: 1.0, ..TrainSpec::default() };
        assert!((lr_at(&t, 0) - 0.1).abs() < 1e-12);
        assert!((lr_at(&t, 9) - 1.0).abs() < 1e-12);
        assert!((lr_at(&t, 10) - 1.0).abs() < 1e-12);
        assert!(lr_at(&t, 55) < 0.6 && lr_at(&t, 55) > 0.5);
        assert!((lr_at(&t, 99) - 0.1).abs() < 1e-3);
        t.lr_schedule = LrSchedule::Constant;
        assert_eq!(lr_at(&t, 99), 1.0);
        t.warmup_steps = 0;
        assert_eq!(lr_at(&t, 0), 1.0);
    }

    /// One step of a layer-wise optimizer on two tensors, w = [3, 4] (decayed) and
    /// [0, 1, 0] (not), from gradients `g`, lr 0.1, weight decay `wd`, clipping factor 0.5.
    fn lamb_or_lars(kind: OptimizerKind, g: [f32; 5], wd: f64) -> Vec<f32> {
        use crate::backend::{Buffers, CpuBackend};
        let be = CpuBackend::<f32>::new(1);
        let train = TrainSpec { optimizer: kind, weight_decay: wd, ..TrainSpec::default() };
        let runs = vec![
            OptimGroup { global: 0..2, local: 0..2, decay: true, tensor: 0 },
            OptimGroup { global: 2..5, local: 2..5, decay: false, tensor: 1 },
        ];
        let initial = || vec![3.0, 4.0, 0.0, 1.0, 0.0];
        let memory = MemoryTracker::new();
        let groups = OptimGroups { runs, tensors: 2 };
        let mut optimizer = Optimizer::new(&be, &train, groups, 5, initial, &memory, &OffloadTo::None).unwrap();
        let (mut params, mut grads) = (be.alloc(5), be.alloc(5));
        be.upload(&mut params, &initial());
        be.upload(&mut grads, &g);
        optimizer.step(&be, (&mut params, Indexing::Global), (&grads, Indexing::Global), 0.1, 0.5, None).unwrap();
        let mut out = vec![0.0; 5];
        be.download(&params, &mut out);
        out
    }

    fn assert_close(got: &[f32], want: &[f64]) {
        let near = got.iter().zip(want).all(|(&a, &b)| (a as f64 - b).abs() < 1e-6);
        assert!(near, "{got:?} against {want:?}");
    }

    /// LAMB's first step, worked by hand: m_hat = g and v_hat = g^2, so r = sign(g) (eps
    /// aside). Tensor 0: r = [1, -1], |r| = sqrt 2, |w| = 5, each weight moves by
    /// 0.1 * 5 / sqrt 2 against its gradient; tensor 1: |w| = 1, r = [1, 1, -1], moves
    /// 0.1 / sqrt 3 each. AdamW would move every weight by 0.1.
    #[test]
    fn lamb_scales_each_tensors_adam_step_by_its_trust_ratio() {
        let w = lamb_or_lars(OptimizerKind::Lamb, [1.0, -1.0, 2.0, 0.5, -3.0], 0.0);
        let (a, b) = (0.1 * 5.0 / 2f64.sqrt(), 0.1 / 3f64.sqrt());
        assert_close(&w, &[3.0 - a, 4.0 + a, -b, 1.0 - b, b]);
        // With decay, r = sign(g) + wd w on the decayed tensor only: [1 + 1.5, -1 + 2] for wd 0.5.
        let w = lamb_or_lars(OptimizerKind::Lamb, [1.0, -1.0, 2.0, 0.5, -3.0], 0.5);
        let (r, norm) = ([2.5, 1.0], (2.5f64 * 2.5 + 1.0).sqrt());
        assert_close(&w, &[3.0 - 0.1 * 5.0 / norm * r[0], 4.0 - 0.1 * 5.0 / norm * r[1], -b, 1.0 - b, b]);
    }

    /// LARS, worked by hand: each tensor's SGD step scaled by |w| / (|g_clipped| + wd |w|).
    /// Tensor 0: g = [6, 8] clipped by 0.5 to [3, 4], |g| = 5, wd 0.2: ratio 5 / (5 + 1)
    /// and w - 0.1 * 5/6 * (g + 0.2 w). Tensor 1 (no decay): g = [0, 2, 0] -> [0, 1, 0],
    /// ratio 1 / 1: w - 0.1 * g.
    #[test]
    fn lars_scales_each_tensors_sgd_step_by_its_trust_ratio() {
        let w = lamb_or_lars(OptimizerKind::Lars, [6.0, 8.0, 0.0, 2.0, 0.0], 0.2);
        let step = 0.1 * 5.0 / 6.0;
        assert_close(&w, &[3.0 - step * (3.0 + 0.6), 4.0 - step * (4.0 + 0.8), 0.0, 1.0 - 0.1, 0.0]);
    }

    #[test]
    fn clipping_scales_only_above_the_threshold() {
        assert_eq!(clip_scale(0.5, 1.0), 1.0);
        assert_eq!(clip_scale(4.0, 1.0), 0.25);
        assert_eq!(clip_scale(4.0, 0.0), 1.0);
    }
}
