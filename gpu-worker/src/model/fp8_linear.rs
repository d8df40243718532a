//! FP8 training (`train.fp8`): each block's four linear layers (qkv, attention projection,
//! the MLP's two) multiply FP8 operands, the rest of the model stays in `precision`.
//!
//! ```text
//!   forward    out = x̂ · Ŵ + b          x̂ = cast(x, E4M3),  Ŵ = cast(W, E4M3)
//!   backward   ĝ = cast(dout, E5M2)
//!              dx = ĝ · Ŵᵀ,  dW += x̂ᵀ · ĝ,  db += Σ ĝ
//! ```
//!
//! A cast (`ops/fp8.rs`) stores x̂ = fp8(x · scale) / scale in the storage format: with a
//! power-of-two scale that is exact, so the existing products on cast operands compute what
//! an FP8 GEMM does (exact products of FP8 values, f32 sums, one rescale). The master
//! weights, the optimizer and every other op keep `precision`.
//!
//! Every tensor of every linear layer has its own scale ([`Fp8Tensor`]): delayed scaling
//! casts with the scale the last steps' amaxes gave (updated once per optimizer step, so
//! every micro-batch of a step, forward and backward, uses the same); current scaling
//! measures each cast's own amax first. Backward casts the layer's input and weight again
//! (the same values: the same tensor, the same scale) rather than keeping x̂ and Ŵ, and
//! only the gradient's cast is recorded there. A weight FSDP gathered in FP8
//! (`parallel.fp8_all_gather`) arrives cast and is used as it is. The cast operands live
//! for one product, booked as transient.

use std::sync::Arc;

use distlab_common::events::{Fp8Casts, Fp8Metrics};
use distlab_common::{Fp8Recipe, FP8_AMAX_HISTORY};

use crate::backend::Backend;
use crate::memory::{Category, MemoryTracker};
use crate::ops::fp8::{Fp8Cast, Fp8Format, Fp8Scale, Fp8Scaling};

/// The checkpoint section of a rank's FP8 scales and amax histories ([`Fp8Blocks::save`]).
pub const FP8_SCALES: &str = "fp8_scales";

/// One tensor's FP8 scale and what its casts saw this step.
#[derive(Clone, Debug)]
pub struct Fp8Tensor {
    scale: Fp8Scale,
    /// This step's casts (recorded ones): the largest amax, counts, and the scales used.
    seen: Fp8Cast,
    elements: u64,
    scales: Option<(f32, f32)>,
    /// The values the next product gets were cast already (a weight FSDP gathered in FP8).
    arrived_cast: bool,
}

impl Fp8Tensor {
    fn new(format: Fp8Format, recipe: Fp8Recipe) -> Self {
        let scaling = match recipe {
            Fp8Recipe::Current => Fp8Scaling::Current,
            _ => Fp8Scaling::Delayed { history: FP8_AMAX_HISTORY },
        };
        let scale = Fp8Scale::new(format, scaling, 0);
        Fp8Tensor { scale, seen: Fp8Cast::default(), elements: 0, scales: None, arrived_cast: false }
    }

    /// The scale a cast of this tensor uses when the tensor's amax is `amax`: the cast's
    /// own (current scaling) or the one its history gave (delayed). FSDP's FP8 gather casts
    /// a weight's shards, on the ranks that hold them, with it.
    pub fn scale_for_cast(&self, amax: f32) -> f32 {
        match self.scale.scaling {
            Fp8Scaling::Delayed { .. } => self.scale.scale,
            Fp8Scaling::Current => self.scale.scale_for(amax),
        }
    }

    /// The tensor was cast elsewhere with `scale` (FSDP's FP8 gather, by shards: `seen`
    /// their casts together, over `elements`): the next product takes the values it is
    /// given as they are; the casts count when `record`.
    pub fn arrived_cast(&mut self, scale: f32, seen: Fp8Cast, elements: usize, record: bool) {
        self.arrived_cast = true;
        if record {
            self.note(scale, seen, elements);
        }
    }

    fn note(&mut self, scale: f32, seen: Fp8Cast, elements: usize) {
        self.seen = self.seen.merge(seen);
        self.elements += elements as u64;
        let (lo, hi) = self.scales.unwrap_or((scale, scale));
        self.scales = Some((lo.min(scale), hi.max(scale)));
    }

    /// `x` cast for a product (booked as transient while it lives, as [`Fp8Tensor::cast`]),
    /// or None when it arrived cast.
    fn cast_unless_arrived<B: Backend>(
        &mut self,
        be: &B,
        x: B::View<'_>,
        len: usize,
        memory: &Arc<MemoryTracker>,
        record: bool,
    ) -> Option<(B::Buf, crate::memory::Receipt)> {
        match std::mem::take(&mut self.arrived_cast) {
            true => None,
            false => Some(self.cast(be, x, len, memory, record)),
        }
    }

    /// Casts `x` into a new buffer (booked as transient in `memory` while it lives) with
    /// this tensor's scale (current scaling: from `x`'s own amax, found by a first pass),
    /// counting what the cast saw when `record`.
    fn cast<B: Backend>(
        &mut self,
        be: &B,
        x: B::View<'_>,
        len: usize,
        memory: &Arc<MemoryTracker>,
        record: bool,
    ) -> (B::Buf, crate::memory::Receipt) {
        let booked = memory.alloc_of::<B::Elem>(Category::Transient, len);
        let mut q = be.alloc(len);
        let format = self.scale.format;
        let scale = match self.scale.scaling {
            Fp8Scaling::Delayed { .. } => self.scale.scale,
            Fp8Scaling::Current => {
                let amax = be.fp8_cast(be.all_mut(&mut q), x, 1.0, format).amax;
                self.scale.scale_for(amax)
            }
        };
        let seen = be.fp8_cast(be.all_mut(&mut q), x, scale, format);
        if record {
            self.note(scale, seen, len);
        }
        (q, booked)
    }

    /// Forgets the casts since the last step (an evaluation's: not training's).
    fn forget(&mut self) {
        (self.seen, self.elements, self.scales) = (Fp8Cast::default(), 0, None);
    }

    /// The step is over: its casts as metrics, and (delayed scaling) the largest amax into
    /// the history, which gives the next step's scale.
    fn end_step(&mut self) -> Fp8Casts {
        let (lo, hi) = self.scales.take().unwrap_or((self.scale.scale, self.scale.scale));
        let casts = Fp8Casts {
            amax: f64::from(self.seen.amax),
            min_scale: f64::from(lo),
            max_scale: f64::from(hi),
            saturated: self.seen.saturated,
            flushed: self.seen.flushed,
            elements: self.elements,
        };
        if matches!(self.scale.scaling, Fp8Scaling::Delayed { .. }) {
            self.scale.record(self.seen.amax);
        }
        (self.seen, self.elements) = (Fp8Cast::default(), 0);
        casts
    }
}

/// One linear layer's three FP8 tensors.
#[derive(Clone, Debug)]
pub struct Fp8Linear {
    input: Fp8Tensor,
    weight: Fp8Tensor,
    grad: Fp8Tensor,
}

impl Fp8Linear {
    fn new(recipe: Fp8Recipe) -> Self {
        Fp8Linear {
            input: Fp8Tensor::new(Fp8Format::E4M3, recipe),
            weight: Fp8Tensor::new(Fp8Format::E4M3, recipe),
            grad: Fp8Tensor::new(Fp8Format::E5M2, recipe),
        }
    }

    /// `out = x̂ · Ŵ + b (+ residual)` for `rows` x `c_in` inputs.
    #[allow(clippy::too_many_arguments)]
    pub fn forward<B: Backend>(
        &mut self,
        be: &B,
        memory: &Arc<MemoryTracker>,
        out: B::ViewMut<'_>,
        (inp, weight): (B::View<'_>, B::View<'_>),
        (bias, residual): (Option<B::View<'_>>, Option<B::View<'_>>),
        (rows, c_in, c_out): (usize, usize, usize),
    ) {
        let (x, _x_booked) = self.input.cast(be, inp, rows * c_in, memory, true);
        match self.weight.cast_unless_arrived(be, weight, c_in * c_out, memory, true) {
            Some((w, _w_booked)) => be.matmul_forward(out, be.all(&x), be.all(&w), bias, residual, c_in, c_out),
            None => be.matmul_forward(out, be.all(&x), weight, bias, residual, c_in, c_out),
        }
    }

    /// `dinp = ĝ · Ŵᵀ`, `dW += x̂ᵀ · ĝ`, `db += Σ ĝ` for `rows` x `c_out` output gradients.
    #[allow(clippy::too_many_arguments)]
    pub fn backward<B: Backend>(
        &mut self,
        be: &B,
        memory: &Arc<MemoryTracker>,
        dinp: B::ViewMut<'_>,
        (dweight, dbias): (B::ViewMut<'_>, Option<B::ViewMut<'_>>),
        (dout, inp, weight): (B::View<'_>, B::View<'_>, B::View<'_>),
        (rows, c_in, c_out): (usize, usize, usize),
    ) {
        let (g, _g_booked) = self.grad.cast(be, dout, rows * c_out, memory, true);
        let (x, _x_booked) = self.input.cast(be, inp, rows * c_in, memory, false);
        let (g, x) = (be.all(&g), be.all(&x));
        match self.weight.cast_unless_arrived(be, weight, c_in * c_out, memory, false) {
            Some((w, _w_booked)) => be.matmul_backward(Some(dinp), dweight, dbias, g, x, be.all(&w), c_in, c_out),
            None => be.matmul_backward(Some(dinp), dweight, dbias, g, x, weight, c_in, c_out),
        }
    }
}

/// One block's four FP8 linear layers.
#[derive(Clone, Debug)]
pub struct Fp8Block {
    pub qkv: Fp8Linear,
    pub attn_proj: Fp8Linear,
    pub fc: Fp8Linear,
    pub fc_proj: Fp8Linear,
}

impl Fp8Block {
    /// The four weights' tensors, in the block's buffer order (qkv, attention projection,
    /// the MLP's two): what FSDP's FP8 gather casts.
    pub fn weights_mut(&mut self) -> [&mut Fp8Tensor; 4] {
        self.layers_mut().map(|linear| &mut linear.weight)
    }

    fn layers(&self) -> [&Fp8Linear; 4] {
        [&self.qkv, &self.attn_proj, &self.fc, &self.fc_proj]
    }

    fn layers_mut(&mut self) -> [&mut Fp8Linear; 4] {
        [&mut self.qkv, &mut self.attn_proj, &mut self.fc, &mut self.fc_proj]
    }
}

/// The FP8 state of a stage's blocks (by layer) and the ledger its casts book into.
pub struct Fp8Blocks {
    pub blocks: Vec<Fp8Block>,
    pub memory: Arc<MemoryTracker>,
}

impl Fp8Blocks {
    /// FP8 state for `layers` blocks (the model's; a stage uses those it runs).
    pub fn new(recipe: Fp8Recipe, layers: usize, memory: &Arc<MemoryTracker>) -> Self {
        let linear = || Fp8Linear::new(recipe);
        let block = || Fp8Block { qkv: linear(), attn_proj: linear(), fc: linear(), fc_proj: linear() };
        Fp8Blocks { blocks: (0..layers).map(|_| block()).collect(), memory: memory.clone() }
    }

    /// Block `layer`'s layers and the ledger.
    pub fn of(&mut self, layer: usize) -> (&mut Fp8Block, &Arc<MemoryTracker>) {
        (&mut self.blocks[layer], &self.memory)
    }

    /// Forgets the casts since the last step: an evaluation's forwards, which neither count
    /// in the step's metrics nor move the scales.
    pub fn forget_casts(&mut self) {
        for block in &mut self.blocks {
            for linear in block.layers_mut() {
                [&mut linear.input, &mut linear.weight, &mut linear.grad].into_iter().for_each(Fp8Tensor::forget);
            }
        }
    }

    /// Floats [`Fp8Blocks::save`] writes.
    pub fn saved_len(&self) -> usize {
        self.blocks.len() * 4 * 3 * Fp8Scale::saved_len(FP8_AMAX_HISTORY)
    }

    /// What the next steps' casts depend on, for a checkpoint: every tensor's scale and
    /// amax history, block by block, layer by layer (input, weight, gradient). Between
    /// steps: nothing of a step's casts is left to keep.
    pub fn save(&self) -> Vec<f32> {
        let mut out = Vec::with_capacity(self.saved_len());
        for block in &self.blocks {
            for linear in block.layers() {
                for t in [&linear.input, &linear.weight, &linear.grad] {
                    t.scale.save(&mut out, FP8_AMAX_HISTORY);
                }
            }
        }
        out
    }

    /// Puts back what [`Fp8Blocks::save`] wrote.
    pub fn restore(&mut self, saved: &[f32]) -> Result<(), String> {
        if saved.len() != self.saved_len() {
            return Err(format!(
                "the checkpoint's FP8 scales hold {} floats, {} blocks need {}",
                saved.len(),
                self.blocks.len(),
                self.saved_len()
            ));
        }
        let mut chunks = saved.chunks(Fp8Scale::saved_len(FP8_AMAX_HISTORY));
        for block in &mut self.blocks {
            for linear in block.layers_mut() {
                for t in [&mut linear.input, &mut linear.weight, &mut linear.grad] {
                    t.scale.restore(chunks.next().expect("as many chunks as tensors"))?;
                }
            }
        }
        Ok(())
    }

    /// The step is over: what its casts saw, by kind of tensor, over the blocks that ran
    /// (this stage's), and the next step's scales.
    pub fn end_step(&mut self) -> Fp8Metrics {
        let mut metrics = Fp8Metrics::default();
        for block in &mut self.blocks {
            for linear in block.layers_mut() {
                metrics.inputs = merge(metrics.inputs, linear.input.end_step());
                metrics.weights = merge(metrics.weights, linear.weight.end_step());
                metrics.grads = merge(metrics.grads, linear.grad.end_step());
            }
        }
        metrics
    }
}

/// Two sets of casts as one (a set with no element cast counts for nothing).
fn merge(a: Fp8Casts, b: Fp8Casts) -> Fp8Casts {
    if a.elements == 0 || b.elements == 0 {
        return if a.elements == 0 { b } else { a };
    }
    Fp8Casts {
        amax: a.amax.max(b.amax),
        min_scale: a.min_scale.min(b.min_scale),
        max_scale: a.max_scale.max(b.max_scale),
        saturated: a.saturated + b.saturated,
        flushed: a.flushed + b.flushed,
        elements: a.elements + b.elements,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::CpuBackend;
    use crate::rng::Rng;

    fn normal(rng: &mut Rng, n: usize, std: f32) -> Vec<f32> {
        (0..n).map(|_| std * (rng.next_u64() as f32 / u64::MAX as f32 - 0.5) * 3.4).collect()
    }

    /// An FP8 product is the product of the FP8 values: each operand rounded by the
    /// format's own rule at its scale, multiplied and summed in f64 here, within f32's sums
    /// of the engine's; the gradients likewise with the output gradient in E5M2.
    #[test]
    fn an_fp8_layer_multiplies_the_fp8_values_of_its_operands() {
        let (rows, c_in, c_out) = (8, 16, 12);
        let mut rng = Rng::new(3);
        let (x, w, g) = (
            normal(&mut rng, rows * c_in, 1.0),
            normal(&mut rng, c_in * c_out, 0.05),
            normal(&mut rng, rows * c_out, 1e-4),
        );
        let be = CpuBackend::<f32>::new(1);
        let memory = MemoryTracker::new();
        let mut layer = Fp8Linear::new(Fp8Recipe::Current);
        let mut out = vec![0.0f32; rows * c_out];
        layer.forward(&be, &memory, &mut out, (&x, &w), (None, None), (rows, c_in, c_out));
        let (mut dx, mut dw) = (vec![0.0f32; rows * c_in], vec![0.0f32; c_in * c_out]);
        layer.backward(&be, &memory, &mut dx, (&mut dw, None), (&g, &x, &w), (rows, c_in, c_out));
        // the reference: current scaling's power of two from each tensor's amax
        let cast = |v: &[f32], format: Fp8Format| -> Vec<f64> {
            let amax = v.iter().fold(0.0f32, |m, x| m.max(x.abs()));
            let scale = 2f32.powi((format.max() / amax).log2().floor() as i32);
            v.iter().map(|&x| f64::from(format.round(x * scale)) / f64::from(scale)).collect()
        };
        let (xq, wq, gq) = (cast(&x, Fp8Format::E4M3), cast(&w, Fp8Format::E4M3), cast(&g, Fp8Format::E5M2));
        let close = |got: f32, want: f64, what: &str| {
            assert!((f64::from(got) - want).abs() <= 1e-5 * want.abs().max(1e-3), "{what}: {got} vs {want}");
        };
        for r in 0..rows {
            for o in 0..c_out {
                let want: f64 = (0..c_in).map(|i| xq[r * c_in + i] * wq[i * c_out + o]).sum();
                close(out[r * c_out + o], want, "out");
            }
            for i in 0..c_in {
                let want: f64 = (0..c_out).map(|o| gq[r * c_out + o] * wq[i * c_out + o]).sum();
                close(dx[r * c_in + i] * 1e4, want * 1e4, "dx (x 1e4)");
            }
        }
        for i in 0..c_in {
            for o in 0..c_out {
                let want: f64 = (0..rows).map(|r| xq[r * c_in + i] * gq[r * c_out + o]).sum();
                close(dw[i * c_out + o] * 1e4, want * 1e4, "dw (x 1e4)");
            }
        }
        // not the high-precision product: the casts changed something
        let exact: f64 = (0..c_in).map(|i| f64::from(x[i]) * f64::from(w[i * c_out])).sum();
        assert_ne!(f64::from(out[0]), exact);
        // the cast operands are booked for their product and given back
        assert_eq!(memory.current().transient, 0);
        assert!(memory.report(0).peak.transient >= 4 * (rows * c_in + c_in * c_out) as u64);
        let grads = layer.grad.end_step();
        assert_eq!(grads.elements, (rows * c_out) as u64, "the backward's re-casts of x and W are not counted");
        assert_eq!(layer.input.end_step().elements, (rows * c_in) as u64);
    }

    /// A checkpoint's scales and histories put back give the same next scales; a section
    /// of another model's size is refused.
    #[test]
    fn saved_scales_and_histories_come_back() {
        let be = CpuBackend::<f32>::new(1);
        let memory = MemoryTracker::new();
        let mut blocks = Fp8Blocks::new(Fp8Recipe::Delayed, 2, &memory);
        for (step, amax) in [3e-3f32, 9e-3, 1e-3].into_iter().enumerate() {
            let grad = &mut blocks.blocks[1].fc.grad;
            let _ = grad.cast(&be, &[amax, -amax / 2.0][..], 2, &memory, true);
            assert_eq!(blocks.end_step().grads.elements, 2, "step {step}");
        }
        let saved = blocks.save();
        let mut back = Fp8Blocks::new(Fp8Recipe::Delayed, 2, &memory);
        back.restore(&saved).unwrap();
        assert_eq!(back.save(), saved);
        let scale = |b: &Fp8Blocks| b.blocks[1].fc.grad.scale.clone();
        assert_eq!(scale(&back), scale(&blocks));
        // 57344 / 9e-3: 2^22, from the largest of the history, not the last amax
        assert_eq!(scale(&back).scale, 2f32.powi(22));
        assert!(Fp8Blocks::new(Fp8Recipe::Delayed, 3, &memory).restore(&saved).is_err());
        let mut bad = saved.clone();
        bad[1] = 99.0;
        assert!(back.restore(&bad).is_err(), "more amaxes than slots");
    }

    /// Delayed scaling: the first step casts with 1; the next with the power of two its
    /// amax gave; an evaluation's casts in between change nothing.
    #[test]
    fn delayed_scales_come_from_the_last_steps_amax() {
        let be = CpuBackend::<f32>::new(1);
        let memory = MemoryTracker::new();
        let mut t = Fp8Tensor::new(Fp8Format::E5M2, Fp8Recipe::Delayed);
        let g = vec![1e-3f32, -2e-3, 5e-4];
        let _ = t.cast(&be, &g, 3, &memory, true);
        let first = t.end_step();
        assert_eq!((first.min_scale, first.max_scale), (1.0, 1.0));
        // 57344 / 2e-3 = 2.87e7: 2^24
        let _ = t.cast(&be, &[1e9f32][..], 1, &memory, true);
        t.forget();
        let _ = t.cast(&be, &g, 3, &memory, true);
        let second = t.end_step();
        assert_eq!((second.min_scale, second.max_scale, second.saturated), (2f64.powi(24), 2f64.powi(24), 0));
    }
}
