//! Runtime dispatch to wider SIMD for the non-GEMM kernels.
//!
//! The crate is compiled for baseline x86-64 (SSE2: 4 floats per instruction).
//! A kernel written inside [`simd_kernel!`] is compiled three times, for x86-64-v4
//! (AVX-512), v3 (AVX2) and the baseline, and each call runs the widest version
//! the CPU supports. Results are bit-identical across the versions: only the
//! vector width changes, never the operations (no FMA contraction, no
//! reassociation), so runs stay deterministic from machine to machine.

#[cfg(target_arch = "x86_64")]
pub mod x86 {
    use std::sync::atomic::{AtomicU8, Ordering};

    pub const BASELINE: u8 = 1;
    pub const V3: u8 = 2;
    pub const V4: u8 = 3;
    static LEVEL: AtomicU8 = AtomicU8::new(0);

    /// The widest level this CPU supports (detected once).
    #[inline]
    pub fn level() -> u8 {
        match LEVEL.load(Ordering::Relaxed) {
            0 => {
                let level = detect();
                LEVEL.store(level, Ordering::Relaxed);
                level
            }
            l => l,
        }
    }

    fn detect() -> u8 {
        let v3 = is_x86_feature_detected!("avx2")
            && is_x86_feature_detected!("fma")
            && is_x86_feature_detected!("bmi1")
            && is_x86_feature_detected!("bmi2")
            && is_x86_feature_detected!("lzcnt")
            && is_x86_feature_detected!("popcnt")
            && is_x86_feature_detected!("f16c");
        let v4 = v3
            && is_x86_feature_detected!("avx512f")
            && is_x86_feature_detected!("avx512bw")
            && is_x86_feature_detected!("avx512cd")
            && is_x86_feature_detected!("avx512dq")
            && is_x86_feature_detected!("avx512vl");
        if v4 {
            V4
        } else if v3 {
            V3
        } else {
            BASELINE
        }
    }
}

/// Defines a kernel `fn name<F: Float, S: Stored<Acc = F>>(args) [-> T] { body }` (buffers
/// of `S`, arithmetic in `F`) whose body is compiled for AVX-512, AVX2 and baseline x86-64,
/// and dispatched at run time.
macro_rules! simd_kernel {
    (
        $(#[$meta:meta])*
        $vis:vis fn $name:ident<F: Float, S: Stored<Acc = F>>($($arg:ident: $ty:ty),* $(,)?) $(-> $ret:ty)? $body:block
    ) => {
        $(#[$meta])*
        #[allow(clippy::too_many_arguments)]
        $vis fn $name<F: Float, S: Stored<Acc = F>>($($arg: $ty),*) $(-> $ret)? {
            #[inline(always)]
            #[allow(clippy::too_many_arguments)]
            fn body<F: Float, S: Stored<Acc = F>>($($arg: $ty),*) $(-> $ret)? $body

            #[cfg(target_arch = "x86_64")]
            {
                #[target_feature(enable = "avx512f,avx512bw,avx512cd,avx512dq,avx512vl,avx2,fma,bmi1,bmi2,lzcnt,popcnt,f16c")]
                #[allow(clippy::too_many_arguments)]
                unsafe fn v4<F: Float, S: Stored<Acc = F>>($($arg: $ty),*) $(-> $ret)? {
                    body($($arg),*)
                }
                #[target_feature(enable = "avx2,fma,bmi1,bmi2,lzcnt,popcnt,f16c")]
                #[allow(clippy::too_many_arguments)]
                unsafe fn v3<F: Float, S: Stored<Acc = F>>($($arg: $ty),*) $(-> $ret)? {
                    body($($arg),*)
                }
                match $crate::ops::simd::x86::level() {
                    // SAFETY: the level is only reported when the CPU has every enabled feature.
                    $crate::ops::simd::x86::V4 => return unsafe { v4($($arg),*) },
                    $crate::ops::simd::x86::V3 => return unsafe { v3($($arg),*) },
                    _ => {}
                }
            }
            body($($arg),*)
        }
    };
}

pub(crate) use simd_kernel;
