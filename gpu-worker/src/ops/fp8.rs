//! FP8 (Micikevicius et al. 2022): two 8-bit float formats, E4M3 (4 exponent bits, 3
//! mantissa bits, bias 7; largest 448, no infinities) for weights and activations, and E5M2
//! (5 and 2, bias 15; largest 57344) for gradients, which need the range more than the
//! precision. A tensor enters FP8 with a scale of its own, chosen so its largest magnitude
//! (amax) lands near the format's largest value:
//!
//! ```text
//!   q = fp8(x · scale)      rounded to the nearest FP8 value (ties to even), saturated at ±max
//!   x̂ = q / scale           what the cast tensor stands for
//!   a product of two cast tensors:  Σ q_a · q_b  in f32 (each product exact),  × 1 / (scale_a · scale_b)
//! ```
//!
//! Rounding to FP8 is rounding to a grid whose step (quantum) is 2^(e - m) for a value of
//! binary exponent e (m mantissa bits), and 2^(1 - bias - m) below the smallest normal
//! (the subnormals): `fp8 round(x) = min(rint(|x| / quantum) · quantum, max)` with x's sign.
//! Values below half the smallest subnormal become 0 (flushed); values above max saturate.
//!
//! The scale comes from an amax ([`Fp8Scale`]): the largest power of two no larger than
//! max / amax, divided by 2^margin, as torchao's `round_scales_to_power_of_2` (and the MX
//! formats) choose it. Delayed scaling, Transformer Engine's default, uses the largest amax
//! of the tensor's last casts, so a cast uses a scale made before it saw the tensor (and
//! may saturate when the tensor grows); current scaling uses the cast's own amax, one more
//! pass over the tensor.
//!
//! A power of two makes the emulation exact: the cast keeps x̂ = q / scale in the storage
//! format (q has at most 4 significant bits, so x̂ is exact in f32 and bf16), and the
//! existing products on two cast tensors compute Σ q_a q_b / (scale_a scale_b) with f32
//! sums of exact products, as an FP8 GEMM does. The cast is the only new kernel; it reports
//! what a scaling recipe needs: the tensor's amax and how many of its elements saturated
//! or were flushed.

use std::collections::VecDeque;

use rayon::prelude::*;

use crate::backend::buffers::Buffers;
use crate::backend::cpu::CpuBackend;
use crate::ops::float::{Float, Stored};

/// One of the two FP8 formats.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Fp8Format {
    /// 4 exponent bits, 3 mantissa bits: weights and activations.
    E4M3,
    /// 5 exponent bits, 2 mantissa bits: gradients.
    E5M2,
}

impl Fp8Format {
    /// The largest finite value.
    pub fn max(self) -> f32 {
        match self {
            Fp8Format::E4M3 => 448.0,
            Fp8Format::E5M2 => 57344.0,
        }
    }

    /// (mantissa bits, exponent bias).
    fn bits(self) -> (i32, i32) {
        match self {
            Fp8Format::E4M3 => (3, 7),
            Fp8Format::E5M2 => (2, 15),
        }
    }

    /// The smallest positive value (the smallest subnormal): 2^(1 - bias - mantissa bits).
    pub fn smallest(self) -> f32 {
        let (m, bias) = self.bits();
        2f32.powi(1 - bias - m)
    }

    /// `x` rounded to the nearest value of the format (ties to even), saturated at ±max;
    /// NaN stays NaN. The same formula as `fp8.cu`'s `fp8_round`.
    pub fn round(self, x: f32) -> f32 {
        if x.is_nan() {
            return x;
        }
        let (m, bias) = self.bits();
        let a = x.abs();
        // the binary exponent of |x|, no lower than the smallest normal's (subnormals share its quantum)
        let e = ((a.to_bits() >> 23) as i32 - 127).max(1 - bias);
        let quantum = f32::from_bits(((e - m + 127) as u32) << 23);
        ((a / quantum).round_ties_even() * quantum).min(self.max()).copysign(x)
    }
}

impl Fp8Format {
    /// One element's cast: fp8(v · scale), the FP8 value (before the division by the
    /// scale), counted into `seen`.
    pub fn cast_one(self, v: f32, scale: f32, seen: &mut Fp8Cast) -> f32 {
        let scaled = v * scale;
        let r = self.round(scaled);
        seen.amax = seen.amax.max(v.abs());
        seen.saturated += u64::from(scaled.abs() > self.max());
        seen.flushed += u64::from(r == 0.0 && v != 0.0);
        r
    }
}

/// What one cast saw.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct Fp8Cast {
    /// The largest |x|, before scaling.
    pub amax: f32,
    /// Elements whose |x · scale| is above the format's largest value (stored as ±max).
    pub saturated: u64,
    /// Nonzero elements stored as 0 (|x · scale| at most half the smallest subnormal).
    pub flushed: u64,
}

impl Fp8Cast {
    /// Both casts' counts, the larger amax (casts of parts of one tensor).
    pub fn merge(self, other: Fp8Cast) -> Fp8Cast {
        Fp8Cast {
            amax: self.amax.max(other.amax),
            saturated: self.saturated + other.saturated,
            flushed: self.flushed + other.flushed,
        }
    }
}

/// How a tensor's scale is chosen from its amax (Transformer Engine's recipes).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Fp8Scaling {
    /// From the largest amax of the tensor's last `history` casts (this one not among them).
    Delayed { history: usize },
    /// From this cast's own amax.
    Current,
}

/// One tensor's scale and the amaxes it is made from.
#[derive(Clone, Debug, PartialEq)]
pub struct Fp8Scale {
    pub format: Fp8Format,
    pub scaling: Fp8Scaling,
    /// scale = max / amax / 2^margin: a margin leaves room for the tensor to grow.
    pub margin: i32,
    /// The scale the next cast uses (delayed scaling), 1 before any amax was seen.
    pub scale: f32,
    amaxes: VecDeque<f32>,
}

impl Fp8Scale {
    pub fn new(format: Fp8Format, scaling: Fp8Scaling, margin: i32) -> Self {
        Fp8Scale { format, scaling, margin, scale: 1.0, amaxes: VecDeque::new() }
    }

    /// The largest power of two that maps `amax` to at most the format's largest value,
    /// over 2^margin; the scale kept when `amax` is 0 or not finite (nothing to learn from).
    pub fn scale_for(&self, amax: f32) -> f32 {
        if amax > 0.0 && amax.is_finite() {
            let exponent = (self.format.max() / amax).log2().floor() as i32 - self.margin;
            // (f32 powers of two from 2^-126 to 2^127)
            return 2f32.powi(exponent.clamp(-126, 127));
        }
        self.scale
    }

    /// Records a cast's amax; with delayed scaling the next scale comes from the history.
    pub fn record(&mut self, amax: f32) {
        let Fp8Scaling::Delayed { history } = self.scaling else {
            self.scale = self.scale_for(amax);
            return;
        };
        self.amaxes.push_back(amax);
        while self.amaxes.len() > history.max(1) {
            self.amaxes.pop_front();
        }
        let largest = self.amaxes.iter().copied().fold(0.0f32, f32::max);
        self.scale = self.scale_for(largest);
    }

    /// Floats a checkpoint keeps of a scale of `history` amaxes: the scale, how many amaxes
    /// the history holds, and those (the rest of the slots 0).
    pub fn saved_len(history: usize) -> usize {
        2 + history.max(1)
    }

    /// What the next casts depend on, in [`Fp8Scale::saved_len`] floats: the scale and the
    /// amax history (oldest first).
    pub fn save(&self, out: &mut Vec<f32>, history: usize) {
        out.extend([self.scale, self.amaxes.len() as f32]);
        out.extend(self.amaxes.iter().copied().chain(std::iter::repeat(0.0)).take(history.max(1)));
    }

    /// Puts back what [`Fp8Scale::save`] wrote.
    pub fn restore(&mut self, saved: &[f32]) -> Result<(), String> {
        let Some((&[scale, held], amaxes)) = saved.split_first_chunk::<2>() else {
            return Err(format!("an FP8 scale needs at least 2 floats, not {}", saved.len()));
        };
        let held = held as usize;
        if !(scale > 0.0 && scale.is_finite()) || held > amaxes.len() {
            return Err(format!("an FP8 scale of {scale} with {held} amaxes of {} slots", amaxes.len()));
        }
        self.scale = scale;
        self.amaxes = amaxes[..held].iter().copied().collect();
        Ok(())
    }
}

/// Elements of `x` cast into `q` with `scale` (x̂ = fp8(x · scale) / scale), and what the cast saw.
fn cast_chunk<S: Stored>(q: &mut [S], x: &[S], scale: f32, format: Fp8Format) -> Fp8Cast {
    let mut seen = Fp8Cast::default();
    for (q, x) in q.iter_mut().zip(x) {
        let r = format.cast_one(x.load().to_f64() as f32, scale, &mut seen);
        *q = S::store(S::Acc::from_f64((r / scale) as f64));
    }
    seen
}

/// Elements per task of the CPU's cast (and per block of the GPU's).
pub const CAST_CHUNK: usize = 1 << 14;

/// The FP8 cast on a backend's views (the conventions: `backend/mod.rs`).
pub trait Fp8Kernels: Buffers {
    /// `q = fp8(x · scale) / scale` element by element (x̂, in the storage format; exact for
    /// a power-of-two `scale`), and what the cast saw.
    fn fp8_cast(&self, q: Self::ViewMut<'_>, x: Self::View<'_>, scale: f32, format: Fp8Format) -> Fp8Cast;
}

impl<S: Stored> Fp8Kernels for CpuBackend<S> {
    fn fp8_cast(&self, q: &mut [S], x: &[S], scale: f32, format: Fp8Format) -> Fp8Cast {
        assert_eq!(q.len(), x.len(), "fp8_cast: q and x differ in length");
        q.par_chunks_mut(CAST_CHUNK)
            .zip(x.par_chunks(CAST_CHUNK))
            .map(|(q, x)| cast_chunk(q, x, scale, format))
            .reduce(Fp8Cast::default, Fp8Cast::merge)
    }
}

/// The launch of the cast's kernel (`fp8.cu`): a block of [`BLOCK`] threads per
/// [`CAST_CHUNK`] elements, each block's amax and counts read back and merged.
#[cfg(feature = "cuda")]
mod cuda {
    use cudarc::driver::LaunchConfig;

    use super::{Fp8Cast, Fp8Format, Fp8Kernels, CAST_CHUNK};
    use crate::backend::cuda::CudaBackend;
    use crate::ops::cuda::{launch, DeviceElem, DeviceView, DeviceViewMut, BLOCK};

    impl<S: DeviceElem> Fp8Kernels for CudaBackend<S> {
        fn fp8_cast(&self, q: DeviceViewMut<'_, S>, x: DeviceView<'_, S>, scale: f32, format: Fp8Format) -> Fp8Cast {
            assert_eq!(q.len, x.len, "fp8_cast: q and x differ in length");
            if x.len == 0 {
                return Fp8Cast::default();
            }
            let gpu = &self.launcher;
            let blocks = x.len.div_ceil(CAST_CHUNK);
            // per block: amax, saturated, flushed
            let partial = gpu.scratch::<f64>(3 * blocks);
            let cfg = LaunchConfig { grid_dim: (blocks as u32, 1, 1), block_dim: (BLOCK, 1, 1), shared_mem_bytes: 0 };
            let e5m2 = i32::from(format == Fp8Format::E5M2);
            launch!(
                gpu,
                "fp8_cast",
                cfg,
                q.ptr,
                x.ptr,
                x.len as i64,
                CAST_CHUNK as i64,
                scale,
                e5m2,
                gpu.ptr_of(&partial)
            );
            gpu.download_f64(&partial, 3 * blocks)
                .chunks_exact(3)
                .map(|p| Fp8Cast { amax: p[0] as f32, saturated: p[1] as u64, flushed: p[2] as u64 })
                .fold(Fp8Cast::default(), Fp8Cast::merge)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The formats' landmarks: largest, smallest normal and subnormal, what lies between.
    #[test]
    fn the_formats_round_as_their_grids_say() {
        let e4 = Fp8Format::E4M3;
        assert_eq!(e4.smallest(), 2f32.powi(-9));
        assert_eq!(Fp8Format::E5M2.smallest(), 2f32.powi(-16));
        // 448 = 1.75 · 2^8; the step there is 32: 460 rounds to 448, anything above saturates.
        assert_eq!(e4.round(460.0), 448.0);
        assert_eq!(e4.round(1e9), 448.0);
        assert_eq!(e4.round(f32::INFINITY), 448.0);
        assert_eq!(e4.round(-1e9), -448.0);
        // 1 + 1/16 is halfway between 1 and 1.125: ties to even (1).
        assert_eq!(e4.round(1.0625), 1.0);
        assert_eq!(e4.round(1.1875), 1.25);
        // half the smallest subnormal is flushed, a little more is not
        assert_eq!(e4.round(2f32.powi(-10)), 0.0);
        assert_eq!(e4.round(2f32.powi(-10) * 1.01), 2f32.powi(-9));
        assert_eq!(Fp8Format::E5M2.round(57344.0 + 4096.0), 57344.0);
        assert_eq!(Fp8Format::E5M2.round(1.1), 1.0);
        assert!(e4.round(f32::NAN).is_nan());
    }

    /// NVIDIA's own conversion (`cuda_fp8.hpp`'s saturating cast, as the float8 crate
    /// ports it), value by value.
    fn nvidia(format: Fp8Format, x: f32) -> f32 {
        match format {
            Fp8Format::E4M3 => float8::F8E4M3::from_f32(x).to_f32(),
            Fp8Format::E5M2 => float8::F8E5M2::from_f32(x).to_f32(),
        }
    }

    fn agrees(format: Fp8Format, x: f32) -> bool {
        let (ours, theirs) = (format.round(x), nvidia(format, x));
        ours.to_bits() == theirs.to_bits() || (ours.is_nan() && theirs.is_nan())
    }

    /// Every FP8 value, the midpoints between neighbours and the floats right around them
    /// (where ties and rounding direction are decided), the flush and saturation edges, and
    /// a million random floats of every magnitude: the same bits as NVIDIA's conversion.
    #[test]
    fn rounding_matches_nvidias_conversion() {
        for format in [Fp8Format::E4M3, Fp8Format::E5M2] {
            let mut values: Vec<f32> = (0u8..=255)
                .map(|code| match format {
                    Fp8Format::E4M3 => float8::F8E4M3::from_bits(code).to_f32(),
                    Fp8Format::E5M2 => float8::F8E5M2::from_bits(code).to_f32(),
                })
                .filter(|v| v.is_finite() && *v >= 0.0)
                .collect();
            values.sort_by(f32::total_cmp);
            let mut probes = vec![0.0, f32::MIN_POSITIVE, 1e-30, f32::MAX, f32::INFINITY, format.max() * 1.5];
            for pair in values.windows(2) {
                let mid = (pair[0] + pair[1]) / 2.0;
                probes.extend([pair[0], mid]);
            }
            probes.push(*values.last().unwrap() + format.max() / 16.0);
            let mut rng = crate::rng::Rng::new(7);
            probes.extend((0..1_000_000).map(|_| f32::from_bits(rng.next_u64() as u32 & 0x7fff_ffff)));
            for p in probes {
                for x in [p, f32::from_bits(p.to_bits().saturating_sub(1)), f32::from_bits(p.to_bits() + 1)] {
                    for x in [x, -x] {
                        assert!(
                            agrees(format, x),
                            "{format:?} {x:e}: ours {} NVIDIA's {}",
                            format.round(x),
                            nvidia(format, x)
                        );
                    }
                }
            }
        }
    }

    /// All 2^32 floats, by hand (a minute on two cores): `cargo test -p distlab-worker --lib
    /// fp8 -- --ignored`.
    #[test]
    #[ignore = "every f32: run by hand"]
    fn rounding_matches_nvidias_conversion_on_every_float() {
        for format in [Fp8Format::E4M3, Fp8Format::E5M2] {
            let wrong = (0..=u32::MAX).into_par_iter().filter(|&bits| !agrees(format, f32::from_bits(bits))).count();
            assert_eq!(wrong, 0, "{format:?}");
        }
    }

    #[test]
    fn delayed_scaling_uses_the_history_and_current_its_own_amax() {
        let mut delayed = Fp8Scale::new(Fp8Format::E4M3, Fp8Scaling::Delayed { history: 2 }, 0);
        assert_eq!(delayed.scale, 1.0);
        // 448 / 4 = 112: the largest power of two below it is 64
        delayed.record(4.0);
        assert_eq!(delayed.scale, 64.0);
        delayed.record(2.0);
        assert_eq!(delayed.scale, 64.0, "the larger amax of the last two");
        delayed.record(1.0);
        assert_eq!(delayed.scale, 128.0, "4 has left the history");
        delayed.record(0.0);
        assert_eq!(delayed.scale, 256.0);
        // 57344 / 0.5 = 114688: 65536, over 2^1 for the margin
        let mut current = Fp8Scale::new(Fp8Format::E5M2, Fp8Scaling::Current, 1);
        current.record(0.5);
        assert_eq!(current.scale, 32768.0);
        current.record(0.0);
        assert_eq!(current.scale, 32768.0, "an amax of 0 keeps the scale");
    }

    #[test]
    fn the_cpu_cast_counts_what_it_saturates_and_flushes() {
        let be = CpuBackend::<f32>::new(1);
        let x = [1.0f32, -2.0, 1000.0, 1e-6, 0.0, 3.1];
        let mut q = [0.0f32; 6];
        let seen = be.fp8_cast(&mut q, &x, 0.5, Fp8Format::E4M3);
        // 3.1 · 0.5 = 1.55 rounds to 1.5 (the step is 1/8), which stands for 3
        assert_eq!(q, [1.0, -2.0, 896.0, 0.0, 0.0, 3.0]);
        assert_eq!(seen, Fp8Cast { amax: 1000.0, saturated: 1, flushed: 1 });
    }
}
