//! Optimizers (AdamW, SGD), the learning-rate schedule and global-norm clipping; the
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
//! Schedule: linear warmup from lr/warmup_steps to lr over `warmup_steps`, then
//! `constant` or `cosine` decay to 10% of lr at the end of the run.
//! Clipping: the gradient norm is the L2 norm over ALL parameters (reported before
//! clipping); when it exceeds grad_clip (> 0) the update uses g * grad_clip / norm.

use std::ops::Range;
use std::sync::Arc;

use distlab_common::{LrSchedule, Optimizer as OptimizerKind, TrainSpec};

use crate::backend::{Backend, Stored};
use crate::memory::{Category, MemoryTracker, Receipt};
/// The optimizer's state as the strategies and the trainer name it (`crate::optim::...`); the
/// types are the optimizer op's (`ops/optimizer.rs`), which the backends share.
pub use crate::ops::optimizer::{needs_master, OptimizerSlices, OptimizerState};
use crate::ops::optimizer::{AdamWStep, Update};
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

/// A contiguous range of parameters sharing one weight-decay setting.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ParamGroup {
    pub range: Range<usize>,
    pub decay: bool,
}

/// A run of parameters this optimizer updates: where it is in the whole flat layout
/// (`global`) and in this rank's shard (`local`, also where its m and v live). Without
/// sharding the two are equal.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct OptimGroup {
    pub global: Range<usize>,
    pub local: Range<usize>,
    pub decay: bool,
}

impl OptimGroup {
    /// The groups of a whole, unsharded parameter buffer.
    pub fn unsharded(groups: &[ParamGroup]) -> Vec<OptimGroup> {
        groups.iter().map(|g| OptimGroup { global: g.range.clone(), local: g.range.clone(), decay: g.decay }).collect()
    }
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
    groups: Vec<OptimGroup>,
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
        groups: Vec<OptimGroup>,
        local_len: usize,
        initial: impl FnOnce() -> Vec<f32>,
        memory: &Arc<MemoryTracker>,
        offload: &OffloadTo,
    ) -> Result<Self, OffloadError> {
        let adamw = train.optimizer == OptimizerKind::Adamw;
        let floats = local_len * (2 * adamw as usize + needs_master::<B::Elem>() as usize);
        let state = match offload {
            OffloadTo::None => Placement::Device(be.optimizer_buffers(local_len, adamw, initial)),
            OffloadTo::Host => Placement::Offloaded(OffloadedState::host::<B::Elem>(local_len, adamw, initial)),
            OffloadTo::Disk(dir) => {
                Placement::Offloaded(OffloadedState::disk::<B::Elem>(dir, local_len, adamw, initial)?)
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
    pub fn step(
        &mut self,
        be: &B,
        params: (&mut B::Buf, Indexing),
        grads: (&B::Buf, Indexing),
        lr: f64,
        grad_scale: f64,
    ) -> Result<(), OffloadError> {
        self.steps_taken += 1;
        let (params, params_indexing) = params;
        let (grads, grads_indexing) = grads;
        let range = |group: &OptimGroup, indexing| match indexing {
            Indexing::Global => group.global.clone(),
            Indexing::Local => group.local.clone(),
        };
        for group in &self.groups {
            let weight_decay = if group.decay { self.weight_decay } else { 0.0 };
            let update = match self.kind {
                OptimizerKind::Adamw => Update::AdamW(AdamWStep {
                    lr,
                    beta1: ADAM_BETA1,
                    beta2: ADAM_BETA2,
                    eps: ADAM_EPS,
                    weight_decay,
                    step: self.steps_taken,
                    grad_scale,
                }),
                OptimizerKind::Sgd => Update::Sgd { lr, weight_decay, grad_scale },
            };
            let model = be.view_mut(params, range(group, params_indexing));
            let g = be.view(grads, range(group, grads_indexing));
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

    #[test]
    fn clipping_scales_only_above_the_threshold() {
        assert_eq!(clip_scale(0.5, 1.0), 1.0);
        assert_eq!(clip_scale(4.0, 1.0), 0.25);
        assert_eq!(clip_scale(4.0, 0.0), 1.0);
    }
}
