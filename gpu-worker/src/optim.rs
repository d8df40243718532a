//! Optimizers (AdamW, SGD), the learning-rate schedule and global-norm clipping.
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

use crate::ops::simd::simd_kernel;
use rayon::prelude::*;

use crate::backend::{Backend, Float, Stored};
use crate::memory::{Category, MemoryTracker, Receipt};
use crate::offload::{OffloadError, OffloadTo, OffloadedState};

pub const ADAM_BETA1: f64 = 0.9;
pub const ADAM_BETA2: f64 = 0.95;
pub const ADAM_EPS: f64 = 1e-8;
/// Cosine decay ends at this fraction of the peak learning rate.
pub const COSINE_FINAL_FRACTION: f64 = 0.1;

/// The hyperparameters of one AdamW update.
#[derive(Clone, Debug, PartialEq)]
pub struct AdamWStep {
    pub lr: f64,
    pub beta1: f64,
    pub beta2: f64,
    pub eps: f64,
    pub weight_decay: f64,
    /// 1-based step count, for the bias corrections.
    pub step: u64,
    /// Multiplies the gradient first (the clipping factor; 1 = none).
    pub grad_scale: f64,
}

simd_kernel! {
    /// The AdamW update on one chunk of parameters. The weights it updates and the moments
    /// are in the compute format F (f32): the model's own parameters in an fp32 run, the
    /// fp32 master copy in a mixed-precision run. The gradients are in the model's format
    /// S (bf16/fp16 there), widened as they are read.
    pub fn adamw_update<F: Float, S: Stored<Acc = F>>(params: &mut [F], grads: &[S], m: &mut [F], v: &mut [F], hp: &AdamWStep) {
        let b1 = F::from_f64(hp.beta1);
        let b2 = F::from_f64(hp.beta2);
        let one_minus_b1 = F::from_f64(1.0 - hp.beta1);
        let one_minus_b2 = F::from_f64(1.0 - hp.beta2);
        let m_correction = F::from_f64(1.0 / (1.0 - hp.beta1.powf(hp.step as f64)));
        let v_correction = F::from_f64(1.0 / (1.0 - hp.beta2.powf(hp.step as f64)));
        let lr = F::from_f64(hp.lr);
        let eps = F::from_f64(hp.eps);
        let decay = F::from_f64(1.0 - hp.lr * hp.weight_decay);
        let scale = F::from_f64(hp.grad_scale);
        let n = params.len();
        let (grads, m, v) = (&grads[..n], &mut m[..n], &mut v[..n]);
        for (((p, &g), m), v) in params.iter_mut().zip(grads).zip(m.iter_mut()).zip(v.iter_mut()) {
            let g = g.load() * scale;
            *m = b1 * *m + one_minus_b1 * g;
            *v = b2 * *v + one_minus_b2 * g * g;
            let m_hat = *m * m_correction;
            let v_hat = *v * v_correction;
            *p = *p * decay - lr * m_hat / (v_hat.sqrt() + eps);
        }
    }
}

simd_kernel! {
    /// The SGD update on one chunk of parameters (F: as for AdamW).
    pub fn sgd_update<F: Float, S: Stored<Acc = F>>(params: &mut [F], grads: &[S], lr: f64, weight_decay: f64, grad_scale: f64) {
        let lr_g = F::from_f64(lr * grad_scale);
        let decay = F::from_f64(1.0 - lr * weight_decay);
        let grads = &grads[..params.len()];
        for (p, &g) in params.iter_mut().zip(grads) {
            *p = *p * decay - lr_g * g.load();
        }
    }
}

simd_kernel! {
    /// Mixed precision, after the update: the model's parameters become the master
    /// weights rounded to its format (what the next forward computes with).
    pub fn round_to_model<F: Float, S: Stored<Acc = F>>(params: &mut [S], master: &[F]) {
        for (p, &w) in params.iter_mut().zip(master) {
            *p = S::store(w);
        }
    }
}

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

/// One update's rule and numbers, as a backend applies it to a range of parameters.
#[derive(Clone, Debug, PartialEq)]
pub enum Update {
    AdamW(AdamWStep),
    Sgd { lr: f64, weight_decay: f64, grad_scale: f64 },
}

/// The optimizer's buffers in host memory (the CPU backend's `OptimizerBuffers`), in the
/// compute format F (f32 for training; f64 where the CPU backend checks gradients):
/// AdamW's m and v (empty for SGD), and the master weights of a bf16/fp16 model.
#[derive(Debug, Default)]
pub struct HostOptimizerBuffers<F = f32> {
    pub m: Vec<F>,
    pub v: Vec<F>,
    pub master: Option<Vec<F>>,
}

impl<F: Float> HostOptimizerBuffers<F> {
    /// Buffers for `len` parameters of a model stored as `S` (see `Backend::optimizer_buffers`).
    pub fn new<S: Stored<Acc = F>>(len: usize, moments: bool, initial: impl FnOnce() -> Vec<f32>) -> Self {
        let moment = || if moments { vec![F::ZERO; len] } else { Vec::new() };
        let master = needs_master::<S>().then(|| {
            let values = initial();
            assert_eq!(values.len(), len, "master weights for every parameter this optimizer updates");
            values.into_iter().map(|x| F::from_f64(x as f64)).collect()
        });
        Self { m: moment(), v: moment(), master }
    }

    /// One update of `params` (the model's, in its format) from `grads`, whose state is
    /// `range` of these buffers. With master weights the update goes there and `params`
    /// get it rounded; an fp32 model's parameters are their own master copy.
    pub fn update<S: Stored<Acc = F>>(&mut self, params: &mut [S], grads: &[S], range: Range<usize>, update: &Update) {
        let weights: &mut [F] = match &mut self.master {
            Some(master) => &mut master[range.clone()],
            None => S::as_acc_mut(params).expect("an fp32 model is its own master copy"),
        };
        match update {
            Update::AdamW(hp) => {
                let (m, v) = (&mut self.m[range.clone()], &mut self.v[range.clone()]);
                weights
                    .par_chunks_mut(CHUNK)
                    .zip(grads.par_chunks(CHUNK))
                    .zip(m.par_chunks_mut(CHUNK))
                    .zip(v.par_chunks_mut(CHUNK))
                    .for_each(|(((p, g), m), v)| adamw_update(p, g, m, v, hp));
            }
            &Update::Sgd { lr, weight_decay, grad_scale } => weights
                .par_chunks_mut(CHUNK)
                .zip(grads.par_chunks(CHUNK))
                .for_each(|(p, g)| sgd_update(p, g, lr, weight_decay, grad_scale)),
        }
        if let Some(master) = &self.master {
            let master = &master[range];
            params.par_chunks_mut(CHUNK).zip(master.par_chunks(CHUNK)).for_each(|(p, w)| round_to_model(p, w));
        }
    }

    /// Puts back a checkpoint's buffers, which must be as long as these.
    pub fn load(&mut self, saved: &OptimizerState) -> Result<(), String> {
        let held_master = self.master.as_ref().map_or(0, Vec::len);
        saved.check_lengths(self.m.len(), held_master)?;
        let saved_master = saved.master.as_deref().unwrap_or_default();
        let put =
            |held: &mut [F], saved: &[f32]| held.iter_mut().zip(saved).for_each(|(h, &s)| *h = F::from_f64(s as f64));
        put(&mut self.m, &saved.m);
        put(&mut self.v, &saved.v);
        if let Some(master) = &mut self.master {
            put(master, saved_master);
        }
        Ok(())
    }
}

/// What a checkpoint copies of an optimizer's buffers: m and v (empty for SGD), master,
/// in the compute format F.
pub struct OptimizerSlices<'a, F = f32> {
    pub m: &'a [F],
    pub v: &'a [F],
    pub master: Option<&'a [F]>,
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

/// Whether a model stored as `S` needs fp32 master weights (it does unless it is fp32).
pub fn needs_master<S: Stored>() -> bool {
    S::as_acc(&[S::default()]).is_none()
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

/// Elements per task of the update kernels.
const CHUNK: usize = 1 << 14;

/// What a checkpoint keeps of an optimizer: its step count, AdamW's m and v (empty for
/// SGD) and the master weights (mixed precision).
#[derive(Clone, Debug, Default, PartialEq)]
pub struct OptimizerState {
    pub steps_taken: u64,
    pub m: Vec<f32>,
    pub v: Vec<f32>,
    pub master: Option<Vec<f32>>,
}

impl OptimizerState {
    /// An error unless it holds `moments` values each of m and v and `master` master
    /// weights (what the optimizer it is put back into holds).
    pub fn check_lengths(&self, moments: usize, master: usize) -> Result<(), String> {
        let saved_master = self.master.as_deref().map_or(0, <[f32]>::len);
        for (name, held, saved) in
            [("m", moments, self.m.len()), ("v", moments, self.v.len()), ("master", master, saved_master)]
        {
            if saved != held {
                return Err(format!("{name} has {saved} values saved, this rank's optimizer holds {held}"));
            }
        }
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
    fn adamw_first_step_moves_by_lr() {
        // After one step m_hat = g and v_hat = g^2, so the update is lr * g / (|g| + eps).
        let mut p = [1.0f64, -2.0];
        let g = [0.5, -3.0];
        let (mut m, mut v) = ([0.0; 2], [0.0; 2]);
        let hp = AdamWStep { lr: 0.1, beta1: 0.9, beta2: 0.95, eps: 0.0, weight_decay: 0.0, step: 1, grad_scale: 1.0 };
        adamw_update(&mut p, &g, &mut m, &mut v, &hp);
        assert!((p[0] - 0.9).abs() < 1e-12 && (p[1] + 1.9).abs() < 1e-12, "{p:?}");
    }

    #[test]
    fn sgd_decays_the_weights_then_steps_against_the_unscaled_gradient() {
        // p' = p (1 - lr wd) - lr * grad_scale * g, worked by hand for lr 0.1, wd 0.5,
        // grad_scale 2: 1 * 0.95 - 0.1 * 2 * 0.5 = 0.85 and -2 * 0.95 + 0.1 * 2 * 3 = -1.3.
        let mut p = [1.0f64, -2.0];
        sgd_update(&mut p, &[0.5f64, -3.0], 0.1, 0.5, 2.0);
        assert!((p[0] - 0.85).abs() < 1e-12 && (p[1] + 1.3).abs() < 1e-12, "{p:?}");
    }

    #[test]
    fn adamw_decays_the_weights_apart_from_the_gradient() {
        // Decoupled decay: p' = p (1 - lr wd) - lr * m_hat / sqrt(v_hat); after one step the
        // second term is lr * sign(g): 1 * 0.95 - 0.1 = 0.85 for lr 0.1, wd 0.5.
        let mut p = [1.0f64];
        let (mut m, mut v) = ([0.0; 1], [0.0; 1]);
        let hp = AdamWStep { lr: 0.1, beta1: 0.9, beta2: 0.95, eps: 0.0, weight_decay: 0.5, step: 1, grad_scale: 1.0 };
        adamw_update(&mut p, &[0.5f64], &mut m, &mut v, &hp);
        assert!((p[0] - 0.85).abs() < 1e-12, "{p:?}");
    }

    #[test]
    fn mixed_adamw_updates_the_f32_master_and_rounds_the_bf16_copy() {
        use half::bf16;
        // A step far below bf16's spacing at 1.0 (2^-7) still moves the master weight; the
        // bf16 copy only moves once the steps add up to half of that spacing.
        let mut master = [1.0f32];
        let mut model = [bf16::ONE];
        let (mut m, mut v) = ([0.0f32], [0.0f32]);
        for step in 1..=40 {
            let g = [bf16::from_f32(-1.0)];
            let hp =
                AdamWStep { lr: 1e-4, beta1: 0.9, beta2: 0.95, eps: 0.0, weight_decay: 0.0, step, grad_scale: 1.0 };
            adamw_update(&mut master, &g, &mut m, &mut v, &hp);
            round_to_model(&mut model, &master);
            if step == 1 {
                assert!(master[0] > 1.0 && model[0] == bf16::ONE, "{} {}", master[0], model[0]);
            }
        }
        assert!((master[0] - 1.004).abs() < 1e-5, "{}", master[0]);
        assert_eq!(model[0], bf16::from_f32(1.0 + 1.0 / 128.0));
        // Without the master copy, every one of these updates would round away in bf16.
        assert_eq!(bf16::from_f32(1.0 + 1e-4), bf16::ONE);
    }

    #[test]
    fn clipping_scales_only_above_the_threshold() {
        assert_eq!(clip_scale(0.5, 1.0), 1.0);
        assert_eq!(clip_scale(4.0, 1.0), 0.25);
        assert_eq!(clip_scale(4.0, 0.0), 1.0);
    }
}
