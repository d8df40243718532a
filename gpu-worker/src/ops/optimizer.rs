//! The optimizer's element kernels: one AdamW or SGD update of a range of parameters (the
//! math in `optim/mod.rs`'s opening comment), the CPU kernels here and the CUDA kernels in
//! `optimizer.cu` beside them, and the vocabulary a backend's optimizer state is made of:
//! an update's rule and numbers ([`Update`]), the state in host memory
//! ([`HostOptimizerBuffers`], the CPU backend's), what a checkpoint reads of it
//! ([`OptimizerSlices`]) and keeps ([`OptimizerState`]).
//!
//! A leaf, as the other ops are: the backends import it (their `OptimizerKernels`), and
//! the optimizer (`optim/`) imports the backends and it, never the other way round.

use std::ops::Range;

use rayon::prelude::*;

use crate::ops::float::{lane_sum, Float, Stored};
use crate::ops::simd::simd_kernel;

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

/// AdamW's numbers for one step in the compute format F, shared by the update and LAMB's
/// first pass so that both make this step's moments with the same operations.
struct AdamNumbers<F> {
    beta1: F,
    beta2: F,
    one_minus_beta1: F,
    one_minus_beta2: F,
    m_correction: F,
    v_correction: F,
    eps: F,
    grad_scale: F,
}

impl<F: Float> AdamNumbers<F> {
    #[inline(always)]
    fn new(hp: &AdamWStep) -> Self {
        Self {
            beta1: F::from_f64(hp.beta1),
            beta2: F::from_f64(hp.beta2),
            one_minus_beta1: F::from_f64(1.0 - hp.beta1),
            one_minus_beta2: F::from_f64(1.0 - hp.beta2),
            m_correction: F::from_f64(1.0 / (1.0 - hp.beta1.powf(hp.step as f64))),
            v_correction: F::from_f64(1.0 / (1.0 - hp.beta2.powf(hp.step as f64))),
            eps: F::from_f64(hp.eps),
            grad_scale: F::from_f64(hp.grad_scale),
        }
    }

    /// This step's m and v from the last step's and the (unscaled) gradient g.
    #[inline(always)]
    fn moments(&self, m: F, v: F, g: F) -> (F, F) {
        let g = g * self.grad_scale;
        (self.beta1 * m + self.one_minus_beta1 * g, self.beta2 * v + self.one_minus_beta2 * g * g)
    }
}

simd_kernel! {
    /// The AdamW update on one chunk of parameters. The weights it updates and the moments
    /// are in the compute format F (f32): the model's own parameters in an fp32 run, the
    /// fp32 master copy in a mixed-precision run. The gradients are in the model's format
    /// S (bf16/fp16 there), widened as they are read.
    pub fn adamw_update<F: Float, S: Stored<Acc = F>>(params: &mut [F], grads: &[S], m: &mut [F], v: &mut [F], hp: &AdamWStep) {
        let adam = AdamNumbers::<F>::new(hp);
        let lr = F::from_f64(hp.lr);
        let decay = F::from_f64(1.0 - hp.lr * hp.weight_decay);
        let n = params.len();
        let (grads, m, v) = (&grads[..n], &mut m[..n], &mut v[..n]);
        for (((p, &g), m), v) in params.iter_mut().zip(grads).zip(m.iter_mut()).zip(v.iter_mut()) {
            (*m, *v) = adam.moments(*m, *v, g.load());
            let m_hat = *m * adam.m_correction;
            let v_hat = *v * adam.v_correction;
            *p = *p * decay - lr * m_hat / (v_hat.sqrt() + adam.eps);
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

/// The first pass of a layer-wise update (LAMB, LARS) over a piece of one tensor: what the
/// tensor's trust ratio is made of, read without changing anything. The second pass is
/// then a plain AdamW or SGD update with lr times the ratio (see `optim/mod.rs`).
#[derive(Clone, Debug, PartialEq)]
pub enum TrustPass {
    /// LAMB: the squares of w and of r = m̂/(√v̂ + ε) + wd·w, r from the moments this
    /// step's AdamW update will store (computed here the same way, not stored).
    Lamb(AdamWStep),
    /// LARS: the squares of w and of the raw gradient.
    Lars,
}

simd_kernel! {
    /// LAMB's first pass on one chunk: Σw² and Σr², r = m̂/(√v̂ + ε) + wd·w with m and v
    /// as [`adamw_update`] is about to make them (the same operations, so the same bits).
    pub fn lamb_squares<F: Float, S: Stored<Acc = F>>(params: &[F], grads: &[S], m: &[F], v: &[F], hp: &AdamWStep) -> (F, F) {
        let adam = AdamNumbers::<F>::new(hp);
        let decay = F::from_f64(hp.weight_decay);
        let n = params.len();
        let (grads, m, v) = (&grads[..n], &m[..n], &v[..n]);
        let w2 = lane_sum(n, |i| params[i] * params[i]);
        let r2 = lane_sum(n, |i| {
            let (m, v) = adam.moments(m[i], v[i], grads[i].load());
            let r = m * adam.m_correction / ((v * adam.v_correction).sqrt() + adam.eps) + decay * params[i];
            r * r
        });
        (w2, r2)
    }
}

simd_kernel! {
    /// LARS's first pass on one chunk: Σw² and Σg² (the gradient unscaled).
    pub fn lars_squares<F: Float, S: Stored<Acc = F>>(params: &[F], grads: &[S]) -> (F, F) {
        let n = params.len();
        let grads = &grads[..n];
        (lane_sum(n, |i| params[i] * params[i]), lane_sum(n, |i| grads[i].load() * grads[i].load()))
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
    /// Buffers for `len` parameters of a model stored as `S` (see `OptimizerKernels::optimizer_buffers`).
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

    /// A layer-wise update's first pass over a piece of one tensor (`params`, `grads`,
    /// state `range`): (Σw², Σu²), u LAMB's direction or LARS's gradient, w the master
    /// weights where there are some. Summed chunk by chunk in order: the same on any
    /// number of threads.
    pub fn trust_squares<S: Stored<Acc = F>>(
        &self,
        params: &[S],
        grads: &[S],
        range: Range<usize>,
        pass: &TrustPass,
    ) -> (f64, f64) {
        let weights: &[F] = match &self.master {
            Some(master) => &master[range.clone()],
            None => S::as_acc(params).expect("an fp32 model is its own master copy"),
        };
        let pieces: Vec<(F, F)> = match pass {
            TrustPass::Lamb(hp) => {
                let (m, v) = (&self.m[range.clone()], &self.v[range]);
                weights
                    .par_chunks(CHUNK)
                    .zip(grads.par_chunks(CHUNK))
                    .zip(m.par_chunks(CHUNK))
                    .zip(v.par_chunks(CHUNK))
                    .map(|(((w, g), m), v)| lamb_squares(w, g, m, v, hp))
                    .collect()
            }
            TrustPass::Lars => {
                weights.par_chunks(CHUNK).zip(grads.par_chunks(CHUNK)).map(|(w, g)| lars_squares(w, g)).collect()
            }
        };
        pieces.iter().fold((0.0, 0.0), |(w2, u2), &(w, u)| (w2 + w.to_f64(), u2 + u.to_f64()))
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

/// Whether a model stored as `S` needs fp32 master weights (it does unless it is fp32).
pub fn needs_master<S: Stored>() -> bool {
    S::as_acc(&[S::default()]).is_none()
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

/// The optimizer's state on the GPU and the launch of its update's kernels
/// (`optimizer.cu`): one thread per parameter.
#[cfg(feature = "cuda")]
pub mod cuda {
    use std::ops::Range;

    use cudarc::driver::CudaSlice;

    use cudarc::driver::LaunchConfig;

    use super::{TrustPass, Update};
    use crate::ops::cuda::{elementwise, launch, DeviceElem, DeviceView, DeviceViewMut, Launcher, BLOCK};

    /// Elements per block of `trust_squares`.
    const TRUST_CHUNK: usize = 1 << 14;

    /// The optimizer's state on the GPU (the CUDA backend's `OptimizerBuffers`).
    pub struct DeviceOptimizerBuffers {
        /// Parameters it is for (a buffer is never empty on the GPU: at least one element).
        pub len: usize,
        /// AdamW's m and v (None for SGD).
        pub moments: Option<(CudaSlice<f32>, CudaSlice<f32>)>,
        /// fp32 master weights (bf16/fp16 models only).
        pub master: Option<CudaSlice<f32>>,
    }

    /// One AdamW or SGD update on the GPU (the math of [`adamw_update`](super::adamw_update)
    /// and [`sgd_update`](super::sgd_update)): the fp32 weights are the master copy at
    /// `range` (mixed precision, rounded into `params` after) or `params` themselves (fp32).
    pub(crate) fn optimizer_update<S: DeviceElem>(
        gpu: &Launcher<S>,
        params: DeviceViewMut<'_, S>,
        grads: DeviceView<'_, S>,
        state: &mut DeviceOptimizerBuffers,
        range: Range<usize>,
        update: &Update,
    ) {
        assert!(params.len == grads.len && params.len == range.len(), "a gradient and a state slot per parameter");
        let n = range.len();
        if n == 0 {
            return;
        }
        let (weights, model) = match &state.master {
            Some(master) => (gpu.ptr_of(master) + (range.start * 4) as u64, params.ptr),
            None => (params.ptr, 0),
        };
        match update {
            Update::Sgd { lr, weight_decay, grad_scale } => {
                let (lr_g, decay) = ((lr * grad_scale) as f32, (1.0 - lr * weight_decay) as f32);
                launch!(gpu, "sgd", elementwise(n), weights, model, grads.ptr, n as i64, lr_g, decay);
            }
            Update::AdamW(hp) => {
                let Some((m, v)) = &state.moments else { panic!("AdamW needs its moments (state made without them)") };
                let at = |ptr: u64| ptr + (range.start * 4) as u64;
                let m_correction = (1.0 / (1.0 - hp.beta1.powf(hp.step as f64))) as f32;
                let v_correction = (1.0 / (1.0 - hp.beta2.powf(hp.step as f64))) as f32;
                let decay = (1.0 - hp.lr * hp.weight_decay) as f32;
                launch!(
                    gpu,
                    "adamw",
                    elementwise(n),
                    weights,
                    model,
                    grads.ptr,
                    at(gpu.ptr_of(m)),
                    at(gpu.ptr_of(v)),
                    n as i64,
                    hp.lr as f32,
                    hp.beta1 as f32,
                    hp.beta2 as f32,
                    (1.0 - hp.beta1) as f32,
                    (1.0 - hp.beta2) as f32,
                    hp.eps as f32,
                    decay,
                    m_correction,
                    v_correction,
                    hp.grad_scale as f32,
                );
            }
        }
    }

    /// A layer-wise update's first pass on the GPU (the math of
    /// [`lamb_squares`](super::lamb_squares) and [`lars_squares`](super::lars_squares), in
    /// double): the blocks' sums come back and are added in order.
    pub(crate) fn trust_squares<S: DeviceElem>(
        gpu: &Launcher<S>,
        params: DeviceView<'_, S>,
        grads: DeviceView<'_, S>,
        state: &DeviceOptimizerBuffers,
        range: Range<usize>,
        pass: &TrustPass,
    ) -> (f64, f64) {
        assert!(params.len == grads.len && params.len == range.len(), "a gradient and a state slot per parameter");
        let n = range.len();
        if n == 0 {
            return (0.0, 0.0);
        }
        let at = |ptr: u64| ptr + (range.start * 4) as u64;
        let weights = match &state.master {
            Some(master) => at(gpu.ptr_of(master)),
            None => params.ptr,
        };
        let (m, v) = match &state.moments {
            Some((m, v)) => (at(gpu.ptr_of(m)), at(gpu.ptr_of(v))),
            None => (0, 0),
        };
        let blocks = n.div_ceil(TRUST_CHUNK);
        let out = gpu.scratch::<f64>(2 * blocks);
        let cfg = LaunchConfig { grid_dim: (blocks as u32, 1, 1), block_dim: (BLOCK, 1, 1), shared_mem_bytes: 0 };
        let (lamb, hp) = match pass {
            TrustPass::Lamb(hp) => {
                assert!(state.moments.is_some(), "LAMB needs its moments (state made without them)");
                (1i32, hp.clone())
            }
            TrustPass::Lars => (
                0,
                super::AdamWStep {
                    lr: 0.0,
                    beta1: 0.0,
                    beta2: 0.0,
                    eps: 0.0,
                    weight_decay: 0.0,
                    step: 1,
                    grad_scale: 1.0,
                },
            ),
        };
        launch!(
            gpu,
            "trust_squares",
            cfg,
            weights,
            grads.ptr,
            m,
            v,
            n as i64,
            TRUST_CHUNK as i64,
            gpu.ptr_of(&out),
            lamb,
            hp.beta1 as f32,
            hp.beta2 as f32,
            (1.0 - hp.beta1) as f32,
            (1.0 - hp.beta2) as f32,
            hp.eps as f32,
            hp.weight_decay as f32,
            (1.0 / (1.0 - hp.beta1.powf(hp.step as f64))) as f32,
            (1.0 / (1.0 - hp.beta2.powf(hp.step as f64))) as f32,
            hp.grad_scale as f32,
        );
        let sums = gpu.download_f64(&out, 2 * blocks);
        sums.chunks(2).fold((0.0, 0.0), |(w2, u2), pair| (w2 + pair[0], u2 + pair[1]))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

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
}
