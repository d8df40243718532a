//! Number formats. [`Stored`] is what a buffer holds: f32, bf16 or fp16 for training,
//! f64 for the finite-difference checks (so that the SAME kernel code is checked in
//! f64). [`Float`] is what the kernels compute in: f32 (for f32, bf16 and fp16 buffers)
//! or f64.
//!
//! `f32` uses a branch-free `exp` approximation (about 1-2 ulp) that the compiler
//! vectorises; libm's scalar `expf` would cost more than the GEMMs in GELU and
//! softmax. `f64` uses the standard library.

use std::fmt::Debug;
use std::iter::Sum;
use std::mem::MaybeUninit;
use std::ops::{Add, AddAssign, Div, DivAssign, Mul, MulAssign, Neg, Sub, SubAssign};

pub trait Float:
    Copy
    + Send
    + Sync
    + Default
    + Debug
    + PartialOrd
    + Sum
    + 'static
    + Add<Output = Self>
    + Sub<Output = Self>
    + Mul<Output = Self>
    + Div<Output = Self>
    + Neg<Output = Self>
    + AddAssign
    + SubAssign
    + MulAssign
    + DivAssign
{
    const ZERO: Self;
    const ONE: Self;
    /// Bytes per element.
    const BYTES: usize;
    fn from_f64(x: f64) -> Self;
    fn to_f64(self) -> f64;
    fn exp(self) -> Self;
    fn sqrt(self) -> Self;
    fn ln(self) -> Self;
    fn max(self, other: Self) -> Self;
    fn is_finite(self) -> bool;
}

impl Float for f64 {
    const ZERO: f64 = 0.0;
    const ONE: f64 = 1.0;
    const BYTES: usize = 8;
    #[inline(always)]
    fn from_f64(x: f64) -> f64 {
        x
    }
    #[inline(always)]
    fn to_f64(self) -> f64 {
        self
    }
    #[inline(always)]
    fn exp(self) -> f64 {
        f64::exp(self)
    }
    #[inline(always)]
    fn sqrt(self) -> f64 {
        f64::sqrt(self)
    }
    #[inline(always)]
    fn ln(self) -> f64 {
        f64::ln(self)
    }
    #[inline(always)]
    fn max(self, other: f64) -> f64 {
        if self > other {
            self
        } else {
            other
        }
    }
    #[inline(always)]
    fn is_finite(self) -> bool {
        f64::is_finite(self)
    }
}

impl Float for f32 {
    const ZERO: f32 = 0.0;
    const ONE: f32 = 1.0;
    const BYTES: usize = 4;
    #[inline(always)]
    fn from_f64(x: f64) -> f32 {
        x as f32
    }
    #[inline(always)]
    fn to_f64(self) -> f64 {
        self as f64
    }
    #[inline(always)]
    fn exp(self) -> f32 {
        exp_f32(self)
    }
    #[inline(always)]
    fn sqrt(self) -> f32 {
        f32::sqrt(self)
    }
    #[inline(always)]
    fn ln(self) -> f32 {
        f32::ln(self)
    }
    #[inline(always)]
    fn max(self, other: f32) -> f32 {
        if self > other {
            self
        } else {
            other
        }
    }
    #[inline(always)]
    fn is_finite(self) -> bool {
        f32::is_finite(self)
    }
}

/// A number format a buffer stores: every element is loaded into `Acc` (the format
/// arithmetic runs in), computed on there, and rounded once when a kernel stores its
/// result, as a GPU kernel does with bf16/fp16 tensors (load, compute in f32, round on
/// the store). f32 and f64 load and store themselves unchanged.
///
/// Sealed (implemented here for f32, f64, bf16 and fp16 only): unsafe code relies on the
/// slice conversions writing every element they are given.
pub trait Stored: sealed::Sealed + bytemuck::Pod + Copy + Send + Sync + Default + Debug + PartialEq + 'static {
    /// The format kernels compute in.
    type Acc: Float;
    /// Short name for logs ("bf16").
    const NAME: &'static str;
    fn load(self) -> Self::Acc;
    /// Rounds to the nearest representable value (overflow gives ±inf, as on a GPU).
    fn store(x: Self::Acc) -> Self;
    /// This slice as the compute format, when the two are the same (f32, f64).
    fn as_acc(x: &[Self]) -> Option<&[Self::Acc]>;
    /// `dst[i] = src[i].load()` over equal lengths, into memory not yet initialised (fp16
    /// overrides it with the CPU's conversion instructions, several times faster than
    /// its `load`; inlined elsewhere, so that a `simd_kernel!` caller vectorises it).
    #[inline(always)]
    fn widen_uninit(src: &[Self], dst: &mut [MaybeUninit<Self::Acc>]) {
        for (d, s) in dst.iter_mut().zip(src) {
            d.write(s.load());
        }
    }
    /// `dst[i] = src[i].load()` over equal lengths.
    #[inline(always)]
    fn widen_slice(src: &[Self], dst: &mut [Self::Acc]) {
        // SAFETY: the same layout, and widen_uninit writes only initialised values.
        Self::widen_uninit(src, unsafe { &mut *(dst as *mut [Self::Acc] as *mut [MaybeUninit<Self::Acc>]) })
    }
    /// `dst[i] = store(src[i])` over equal lengths (fp16 overrides it, as `widen_uninit`).
    #[inline(always)]
    fn narrow_slice(src: &[Self::Acc], dst: &mut [Self]) {
        for (d, &s) in dst.iter_mut().zip(src) {
            *d = Self::store(s);
        }
    }
    fn as_acc_mut(x: &mut [Self]) -> Option<&mut [Self::Acc]>;
    #[inline(always)]
    fn from_f64(x: f64) -> Self {
        Self::store(Self::Acc::from_f64(x))
    }
    #[inline(always)]
    fn to_f64(self) -> f64 {
        self.load().to_f64()
    }
}

mod sealed {
    pub trait Sealed {}
    impl Sealed for f32 {}
    impl Sealed for f64 {}
    impl Sealed for half::bf16 {}
    impl Sealed for half::f16 {}
}

macro_rules! stored_as_itself {
    ($t:ty, $name:literal) => {
        impl Stored for $t {
            type Acc = $t;
            const NAME: &'static str = $name;
            #[inline(always)]
            fn load(self) -> $t {
                self
            }
            #[inline(always)]
            fn store(x: $t) -> $t {
                x
            }
            #[inline(always)]
            fn as_acc(x: &[$t]) -> Option<&[$t]> {
                Some(x)
            }
            #[inline(always)]
            fn as_acc_mut(x: &mut [$t]) -> Option<&mut [$t]> {
                Some(x)
            }
        }
    };
}
stored_as_itself!(f32, "fp32");
stored_as_itself!(f64, "fp64");

/// bf16: f32's 8 exponent bits (same range), 7 mantissa bits. Rounds to nearest even.
impl Stored for half::bf16 {
    type Acc = f32;
    const NAME: &'static str = "bf16";
    #[inline(always)]
    fn load(self) -> f32 {
        f32::from_bits((self.to_bits() as u32) << 16)
    }
    /// Round to nearest even on the 16 dropped bits (a carry into the exponent rounds up to
    /// the next power of two, or to inf past the largest finite); NaN stays a quiet NaN.
    /// The same as `half::bf16::from_f32`, written without a branch so that it vectorises.
    #[inline(always)]
    fn store(x: f32) -> half::bf16 {
        let bits = x.to_bits();
        let rounded = bits.wrapping_add(0x7fff + ((bits >> 16) & 1)) >> 16;
        let quiet_nan = (bits >> 16) | 0x0040;
        half::bf16::from_bits(if x.is_nan() { quiet_nan } else { rounded } as u16)
    }
    fn as_acc(_: &[Self]) -> Option<&[f32]> {
        None
    }
    fn as_acc_mut(_: &mut [Self]) -> Option<&mut [f32]> {
        None
    }
}

/// fp16: 5 exponent bits (largest 65504, smallest normal 6.1e-5), 10 mantissa bits.
impl Stored for half::f16 {
    type Acc = f32;
    const NAME: &'static str = "fp16";
    /// Exponent and mantissa moved into f32's places and scaled by 2^112 (the difference of
    /// the two exponent biases, 127 - 15), which also makes fp16's subnormals normal f32s;
    /// inf and NaN (exponent all ones) keep all ones, NaN made quiet. The same as
    /// `half::f16::to_f32`, without a branch or a call, so that it vectorises.
    #[inline(always)]
    fn load(self) -> f32 {
        let h = self.to_bits() as u32;
        let sign = (h & 0x8000) << 16;
        let magnitude = (h & 0x7fff) << 13;
        let finite = (f32::from_bits(magnitude) * f32::from_bits(0x7780_0000)).to_bits();
        let mantissa = magnitude & 0x007f_ffff;
        let special = 0x7f80_0000 | mantissa | if mantissa != 0 { 0x0040_0000 } else { 0 };
        f32::from_bits(sign | if magnitude >= 0x0f80_0000 { special } else { finite })
    }
    /// Round to nearest even, as `half::f16::from_f32`, in three branch-free cases (F. Giesen's
    /// `float_to_half_fast3_rtne`): from 65536 up, inf (NaN stays a quiet NaN with its top
    /// payload bits); below 2^-14, the fp16 subnormals, by one f32 addition that shifts the
    /// mantissa into place and rounds it; otherwise the exponent rebiased and the 13 dropped
    /// mantissa bits rounded with the carry.
    #[inline(always)]
    fn store(x: f32) -> half::f16 {
        const ABOVE_HALF: u32 = (127 + 16) << 23;
        const SUBNORMAL_MAGIC: u32 = ((127 - 15) + (23 - 10) + 1) << 23;
        let bits = x.to_bits();
        let sign = (bits & 0x8000_0000) >> 16;
        let a = bits & 0x7fff_ffff;
        let special = if a > 0x7f80_0000 { 0x7e00 | ((a & 0x007f_ffff) >> 13) } else { 0x7c00 };
        let subnormal = (f32::from_bits(a) + f32::from_bits(SUBNORMAL_MAGIC)).to_bits().wrapping_sub(SUBNORMAL_MAGIC);
        // Exponent bias 127 -> 15, plus just under half of the last kept bit; the odd bit
        // below makes a tie round to even.
        const REBIAS_ROUND: u32 = ((-112i32 << 23) as u32).wrapping_add(0xfff);
        let normal = a.wrapping_add(REBIAS_ROUND).wrapping_add((a >> 13) & 1) >> 13;
        let h = if a >= ABOVE_HALF {
            special
        } else if a < (113 << 23) {
            subnormal
        } else {
            normal
        };
        half::f16::from_bits((h | sign) as u16)
    }
    fn as_acc(_: &[Self]) -> Option<&[f32]> {
        None
    }
    fn widen_uninit(src: &[Self], dst: &mut [MaybeUninit<f32>]) {
        #[cfg(target_arch = "x86_64")]
        if crate::ops::simd::x86::level() >= crate::ops::simd::x86::V3 {
            // SAFETY: level V3 is only reported where F16C and AVX2 (so AVX) were detected.
            return unsafe { f16c::widen(src, dst) };
        }
        for (d, s) in dst.iter_mut().zip(src) {
            d.write(s.load());
        }
    }
    fn narrow_slice(src: &[f32], dst: &mut [Self]) {
        #[cfg(target_arch = "x86_64")]
        if crate::ops::simd::x86::level() >= crate::ops::simd::x86::V3 {
            // SAFETY: as above.
            return unsafe { f16c::narrow(src, dst) };
        }
        for (d, &s) in dst.iter_mut().zip(src) {
            *d = Self::store(s);
        }
    }
    fn as_acc_mut(_: &mut [Self]) -> Option<&mut [f32]> {
        None
    }
}

/// fp16 slices converted by the CPU (x86 F16C), 8 values per instruction: `vcvtph2ps`
/// widens exactly, `vcvtps2ph` rounds to nearest even; both as `load` and `store` do,
/// NaNs made quiet with their top payload bits.
#[cfg(target_arch = "x86_64")]
mod f16c {
    use std::arch::x86_64::*;
    use std::mem::MaybeUninit;

    use super::Stored;

    /// # Safety
    /// The CPU has F16C and AVX.
    #[target_feature(enable = "avx,f16c")]
    pub unsafe fn widen(src: &[half::f16], dst: &mut [MaybeUninit<f32>]) {
        let n = src.len().min(dst.len());
        let (src, dst) = (&src[..n], &mut dst[..n]);
        let full = n / 8 * 8;
        for (s, d) in src[..full].chunks_exact(8).zip(dst[..full].chunks_exact_mut(8)) {
            // SAFETY: 8 values of 2 bytes read, 8 of 4 written, inside the chunks.
            unsafe {
                let h = _mm_loadu_si128(s.as_ptr().cast());
                _mm256_storeu_ps(d.as_mut_ptr().cast(), _mm256_cvtph_ps(h));
            }
        }
        for (d, s) in dst[full..].iter_mut().zip(&src[full..]) {
            d.write(s.load());
        }
    }

    /// # Safety
    /// The CPU has F16C and AVX.
    #[target_feature(enable = "avx,f16c")]
    pub unsafe fn narrow(src: &[f32], dst: &mut [half::f16]) {
        let n = src.len().min(dst.len());
        let (src, dst) = (&src[..n], &mut dst[..n]);
        let full = n / 8 * 8;
        for (s, d) in src[..full].chunks_exact(8).zip(dst[..full].chunks_exact_mut(8)) {
            // SAFETY: 8 values of 4 bytes read, 8 of 2 written, inside the chunks.
            unsafe {
                let h = _mm256_cvtps_ph::<_MM_FROUND_TO_NEAREST_INT>(_mm256_loadu_ps(s.as_ptr()));
                _mm_storeu_si128(d.as_mut_ptr().cast(), h);
            }
        }
        for (d, &s) in dst[full..].iter_mut().zip(&src[full..]) {
            *d = <half::f16 as Stored>::store(s);
        }
    }
}

/// Runs `f` on `buf` in the compute format: in place when the formats are the same, else
/// on a widened copy that is stored back (rounded once) afterwards. For sums over many
/// rows into a gradient, which a GPU kernel also accumulates in f32 before its one store,
/// and for collectives, which carry f32.
#[inline(always)]
pub fn in_acc<S: Stored, R>(buf: &mut [S], f: impl FnOnce(&mut [S::Acc]) -> R) -> R {
    let mut wide = AccRow::new();
    let result = f(wide.open(buf, true));
    wide.store(buf);
    result
}

/// A buffer that shows rows of a stored slice in the compute format: the row itself when
/// the formats are the same (f32, f64: no copy), else the row widened into the buffer
/// (bf16, fp16: one slice conversion per row, where element-by-element loads would
/// convert each value as often as a kernel reads it). Kept between rows, so that a kernel
/// allocates once per call.
pub struct AccRow<A>(Vec<A>);

impl<A: Float> AccRow<A> {
    pub fn new() -> Self {
        Self(Vec::new())
    }

    /// `src` in the compute format.
    #[inline(always)]
    pub fn load<'a, S: Stored<Acc = A>>(&'a mut self, src: &'a [S]) -> &'a [A] {
        match S::as_acc(src) {
            Some(same) => same,
            None => self.widened(src),
        }
    }

    /// `dst` in the compute format, to compute into: `dst` itself when the formats are the
    /// same, else the buffer, holding `dst` widened when `keep` (and anything when not:
    /// write every element); [`AccRow::store`] rounds it into the same `dst` after. (Not a
    /// closure: a closure here would be compiled once for every SIMD width of a
    /// `simd_kernel!` and left out of line, at the baseline's.)
    #[inline(always)]
    pub fn open<'a, S: Stored<Acc = A>>(&'a mut self, dst: &'a mut [S], keep: bool) -> &'a mut [A] {
        if S::as_acc(dst).is_none() {
            if keep {
                return self.widened(dst);
            }
            self.0.resize(dst.len(), A::ZERO);
            return &mut self.0;
        }
        S::as_acc_mut(dst).expect("as_acc and as_acc_mut agree on the format")
    }

    /// The buffer holding `src` widened (written straight into its spare capacity).
    #[inline(always)]
    fn widened<S: Stored<Acc = A>>(&mut self, src: &[S]) -> &mut [A] {
        self.0.clear();
        self.0.reserve(src.len());
        S::widen_uninit(src, &mut self.0.spare_capacity_mut()[..src.len()]);
        // SAFETY: widen_uninit wrote the first src.len() elements (Stored is sealed).
        unsafe { self.0.set_len(src.len()) };
        &mut self.0
    }

    /// Rounds what [`AccRow::open`] gave for `dst` into it (nothing to do when it was `dst`).
    #[inline(always)]
    pub fn store<S: Stored<Acc = A>>(&self, dst: &mut [S]) {
        if S::as_acc(dst).is_none() {
            debug_assert_eq!(self.0.len(), dst.len(), "store takes the slice open was given");
            S::narrow_slice(&self.0[..dst.len()], dst);
        }
    }
}

impl<A: Float> Default for AccRow<A> {
    fn default() -> Self {
        Self::new()
    }
}

/// Elements per block when a 2-byte buffer is widened for an elementwise kernel (two
/// blocks of f32 stay in L1).
const WIDEN_BLOCK: usize = 512;

/// `out[i] = f(inp[i], out[i])`, computed in the compute format: straight on the slices
/// when they are f32 (or f64); for bf16/fp16 through blocks widened and narrowed with
/// slice conversions, so that `f` still runs on plain f32 arrays the compiler vectorises.
#[inline(always)]
pub fn map_elements<S: Stored>(out: &mut [S], inp: &[S], f: impl Fn(S::Acc, S::Acc) -> S::Acc) {
    if let (Some(x), Some(y)) = (S::as_acc(inp), S::as_acc_mut(out)) {
        for (y, &x) in y.iter_mut().zip(x) {
            *y = f(x, *y);
        }
        return;
    }
    let mut x = [S::Acc::ZERO; WIDEN_BLOCK];
    let mut y = [S::Acc::ZERO; WIDEN_BLOCK];
    for (out, inp) in out.chunks_mut(WIDEN_BLOCK).zip(inp.chunks(WIDEN_BLOCK)) {
        let n = out.len().min(inp.len());
        let (x, y) = (&mut x[..n], &mut y[..n]);
        S::widen_slice(&inp[..n], x);
        S::widen_slice(&out[..n], y);
        for (y, &x) in y.iter_mut().zip(x.iter()) {
            *y = f(x, *y);
        }
        S::narrow_slice(y, &mut out[..n]);
    }
}

/// e^x for f32 (Cephes `expf`): x = n ln2 + r with |r| <= ln2/2, e^r by a degree-6
/// polynomial, 2^n put into the exponent bits. Inputs are clamped to [-87, 88]
/// (e^-87 ~ 1.6e-38 stands in for smaller results). No branches, no libm call.
#[inline(always)]
pub fn exp_f32(x: f32) -> f32 {
    const LOG2E: f32 = std::f32::consts::LOG2_E;
    const LN2_HI: f32 = 0.693_359_4;
    const LN2_LO: f32 = -2.121_944_4e-4;
    // Adding 1.5 * 2^23 rounds to the nearest integer and leaves it in the low mantissa bits.
    const ROUND: f32 = 12_582_912.0;
    let x = if x < -87.0 { -87.0 } else { x };
    let x = if x > 88.0 { 88.0 } else { x };
    let shifted = x * LOG2E + ROUND;
    let n = shifted - ROUND;
    let n_int = shifted.to_bits().wrapping_sub(ROUND.to_bits()) as i32;
    let r = x - n * LN2_HI - n * LN2_LO;
    let r2 = r * r;
    let p = ((((1.987_569_1e-4 * r + 1.398_199_9e-3) * r + 8.333_452e-3) * r + 4.166_579_6e-2) * r + 1.666_666_5e-1)
        * r
        + 0.5;
    let er = p * r2 + r + 1.0;
    let two_n = f32::from_bits(((n_int + 127) as u32) << 23);
    er * two_n
}

/// `sum_{i<n} f(i)` with 8 independent partial sums, so that the compiler can
/// vectorise it; the order is fixed by `n` alone, so results are deterministic.
#[inline(always)]
pub fn lane_sum<F: Float>(n: usize, mut f: impl FnMut(usize) -> F) -> F {
    let mut acc = [F::ZERO; 8];
    let full = n / 8 * 8;
    let mut i = 0;
    while i < full {
        for (lane, a) in acc.iter_mut().enumerate() {
            *a += f(i + lane);
        }
        i += 8;
    }
    let mut tail = F::ZERO;
    for i in full..n {
        tail += f(i);
    }
    ((acc[0] + acc[4]) + (acc[1] + acc[5])) + ((acc[2] + acc[6]) + (acc[3] + acc[7])) + tail
}

/// `max_{i<n} f(i)` (n > 0) with 8 independent partial maxima, so that it vectorises.
#[inline(always)]
pub fn lane_max<F: Float>(n: usize, mut f: impl FnMut(usize) -> F) -> F {
    let first = f(0);
    let mut acc = [first; 8];
    let full = n / 8 * 8;
    let mut i = 0;
    while i < full {
        for (lane, a) in acc.iter_mut().enumerate() {
            *a = a.max(f(i + lane));
        }
        i += 8;
    }
    let mut m = first;
    for i in full..n {
        m = m.max(f(i));
    }
    for a in acc {
        m = m.max(a);
    }
    m
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bf16_store_rounds_as_half_does() {
        let edge = [0.0f32, -0.0, 1.0, f32::MAX, f32::MIN, f32::MIN_POSITIVE, 1e-45, f32::INFINITY, f32::NEG_INFINITY];
        let spread = (0..u32::MAX / 4099).map(|i| f32::from_bits(i.wrapping_mul(4099).wrapping_add(i >> 3)));
        // Ties of both parities, and the values just either side of them.
        let ties = (0..1000u32).flat_map(|i| {
            let t = 0x3f80_8000 + (i << 16);
            [t - 1, t, t + 1].map(f32::from_bits)
        });
        for x in edge.into_iter().chain(spread).chain(ties).chain([f32::NAN, -f32::NAN]) {
            let (ours, theirs) = (<half::bf16 as Stored>::store(x), half::bf16::from_f32(x));
            assert_eq!(ours.to_bits(), theirs.to_bits(), "{x:e} ({:#x})", x.to_bits());
        }
    }

    #[test]
    fn fp16_store_rounds_as_half_does() {
        let edge = [0.0f32, -0.0, 1.0, 65504.0, 65519.0, 65520.0, 65536.0, f32::MAX, 6.1e-5, 6.0e-8, 2.9e-8, 3.0e-8];
        let spread = (0..u32::MAX / 4099).map(|i| f32::from_bits(i.wrapping_mul(4099).wrapping_add(i >> 3)));
        // Ties of both parities around 1 and among the subnormals, and either side of them.
        let ties = (0..1000u32).flat_map(|i| {
            let (t, sub) = (0x3f80_1000 + (i << 13), f32::to_bits(2f32.powi(-24) * (i as f32 + 0.5)));
            [t - 1, t, t + 1, sub - 1, sub, sub + 1].map(f32::from_bits)
        });
        let special = [f32::INFINITY, f32::NEG_INFINITY, f32::NAN, -f32::NAN, f32::from_bits(0x7f80_0001)];
        let all: Vec<f32> = edge.into_iter().chain(spread).chain(ties).chain(special).collect();
        for &x in &all {
            let (ours, theirs) = (<half::f16 as Stored>::store(x), half::f16::from_f32(x));
            assert_eq!(ours.to_bits(), theirs.to_bits(), "{x:e} ({:#x})", x.to_bits());
        }
        // The slice conversion (the CPU's instructions where present) rounds alike, the
        // last few values (past the 8-wide blocks) included.
        // A longer destination keeps what lies past the source.
        let mut narrowed = vec![half::f16::ONE; all.len() + 3];
        <half::f16 as Stored>::narrow_slice(&all, &mut narrowed);
        for (&x, h) in all.iter().zip(&narrowed) {
            assert_eq!(h.to_bits(), half::f16::from_f32(x).to_bits(), "{x:e} ({:#x})", x.to_bits());
        }
        assert_eq!(narrowed[all.len()..], [half::f16::ONE; 3]);
        assert_ne!(all.len() % 8, 0, "the test covers a tail");
    }

    #[test]
    fn fp16_load_widens_every_value_as_half_does() {
        for bits in 0..=u16::MAX {
            let h = half::f16::from_bits(bits);
            assert_eq!(h.load().to_bits(), h.to_f32().to_bits(), "{bits:#06x}");
        }
        // The slice conversion too, on a length with a tail past the 8-wide blocks.
        let every: Vec<half::f16> = (0..=u16::MAX).chain(0..5).map(half::f16::from_bits).collect();
        let mut widened = vec![0.0f32; every.len()];
        <half::f16 as Stored>::widen_slice(&every, &mut widened);
        for (h, w) in every.iter().zip(&widened) {
            assert_eq!(w.to_bits(), h.to_f32().to_bits(), "{:#06x}", h.to_bits());
        }
    }

    #[test]
    fn exp_f32_is_accurate() {
        let mut worst = 0.0f64;
        let mut x = -80.0f32;
        while x < 80.0 {
            let want = (x as f64).exp();
            let got = exp_f32(x) as f64;
            worst = worst.max(((got - want) / want).abs());
            x += 0.0137;
        }
        assert!(worst < 3e-7, "worst relative error {worst}");
        assert_eq!(exp_f32(0.0), 1.0);
        assert!(exp_f32(-1000.0) < 1e-37);
        assert!(exp_f32(1000.0).is_finite());
    }

    #[test]
    fn half_formats_round_to_nearest_and_overflow_to_infinity() {
        use half::{bf16, f16};
        assert_eq!(<bf16 as Stored>::store(1.0 + 1.0 / 512.0).load(), 1.0, "a tie rounds to even");
        assert_eq!(<bf16 as Stored>::store(3.0e38).load(), bf16::from_f32(3.0e38).to_f32(), "bf16 keeps f32's range");
        assert!(<bf16 as Stored>::store(3.0e38).load().is_finite());
        assert_eq!(<f16 as Stored>::store(65504.0).load(), 65504.0);
        assert_eq!(<f16 as Stored>::store(70000.0).load(), f32::INFINITY, "beyond 65504 is inf");
        assert_eq!(<f16 as Stored>::store(1e-8).load(), 0.0, "below fp16's smallest subnormal is 0");
        for x in [0.1f32, -2.5, 1234.5678] {
            assert_eq!(<bf16 as Stored>::store(x).load(), bf16::from_f32(x).to_f32());
        }
    }

    #[test]
    fn lane_max_and_lane_sum_cover_every_element() {
        for n in [1usize, 7, 8, 9, 30] {
            let x: Vec<f32> = (0..n).map(|i| ((i * 37) % 11) as f32 - (i == n / 2) as u8 as f32 * -100.0).collect();
            assert_eq!(lane_max(n, |i| x[i]), x.iter().copied().fold(f32::MIN, f32::max));
            assert_eq!(lane_sum(n, |i| x[i]), x.iter().sum::<f32>());
        }
    }
}
