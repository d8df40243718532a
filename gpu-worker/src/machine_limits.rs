//! The machine's own limits, measured here: the yardsticks the benchmarks report their
//! results against (`cargo xtask bench` prints every result also as a share of one).
//!
//! - FMA peak: each thread runs fused multiply-adds on independent registers in the
//!   widest vectors the CPU has (AVX-512, else AVX2), with no memory traffic, all threads
//!   at once. One FMA on L lanes is 2L FLOPs. A training step can at best reach this.
//! - bf16 dot-product peak (CPUs with AVX-512 BF16): the same loop on `vdpbf16ps`, which
//!   adds two bf16 products into each f32 lane (4 FLOPs per lane): what a bf16 GEMM could
//!   reach at best on this CPU, next to the f32 FMA peak.
//! - memcpy bandwidth: one thread copying one buffer into another, pages touched first.
//!   A collective moves every byte at least once, so this bounds its bus bandwidth.

use std::sync::Barrier;
use std::time::Instant;

/// The FLOP rate of `threads` threads doing nothing but FMAs.
#[derive(Clone, Copy, Debug, serde::Serialize)]
pub struct FmaPeak {
    pub threads: usize,
    /// "avx512", "avx2" or "scalar" (no FMA instruction: multiply then add, 1 FLOP each).
    pub isa: &'static str,
    pub gflops_per_s: f64,
}

/// Independent accumulators per thread: more than FMA latency x FMA ports on any current
/// x86 core (4 cycles x 2 ports), so the ports never wait on a result.
const CHAINS: usize = 12;

/// How a rate is measured: the best of `rounds` runs of about `seconds` each, every thread
/// at once. The best, not the mean: on a shared machine a run can only lose time.
#[derive(Clone, Copy, Debug)]
pub struct Sampling {
    pub rounds: usize,
    pub seconds: f64,
}

impl Sampling {
    /// The benchmarks' yardstick: five runs of 50 ms (a quarter second).
    pub const THOROUGH: Sampling = Sampling { rounds: 5, seconds: 0.05 };
    /// A worker's, before each run it starts (the run's MFU's denominator): five runs of 8 ms,
    /// about 43 ms in all with the calibration against 305 ms for the thorough one, and
    /// 0.95-1.04x of it (median 1.02) in 12 pairs measured in turn on a 2-core Zen 3, where
    /// the thorough one itself spread over ±2% (`examples/peak_sampling.rs`).
    pub const QUICK: Sampling = Sampling { rounds: 5, seconds: 0.008 };
}

/// The FMA peak of `threads` threads, measured as `sampling` says.
pub fn fma_peak(threads: usize, sampling: Sampling) -> FmaPeak {
    let (isa, lanes) = widest_fma();
    let flops_per_lane = if isa == "scalar" { 1 } else { 2 };
    let rate = best_rate(threads, lanes * flops_per_lane, sampling, |iters| fma_chains(isa, iters));
    FmaPeak { threads, isa, gflops_per_s: rate }
}

/// The `vdpbf16ps` rate on `threads` threads, where the CPU has AVX-512 BF16.
pub fn bf16_dot_peak(threads: usize) -> Option<FmaPeak> {
    #[cfg(target_arch = "x86_64")]
    if is_x86_feature_detected!("avx512bf16") && is_x86_feature_detected!("avx512f") {
        // SAFETY: both features were just detected.
        let rate = best_rate(threads, 16 * 4, Sampling::THOROUGH, |iters| unsafe { x86::chains_dpbf16(iters) });
        return Some(FmaPeak { threads, isa: "avx512bf16", gflops_per_s: rate });
    }
    let _ = threads;
    None
}

/// GFLOP/s of `threads` threads running `chains(iters)` at once (each round: CHAINS
/// instructions of `flops` FLOPs), the best of `sampling`'s runs.
fn best_rate(threads: usize, flops: u64, sampling: Sampling, chains: impl Fn(u64) -> f32 + Sync) -> f64 {
    let threads = threads.max(1);
    // Calibrate on one thread: iterations for about `sampling.seconds`, from a run of at
    // least a fifth of that.
    let mut iters = 1u64 << 14;
    loop {
        let start = Instant::now();
        std::hint::black_box(chains(iters));
        let seconds = start.elapsed().as_secs_f64();
        if seconds > sampling.seconds / 5.0 {
            iters = ((iters as f64 * sampling.seconds / seconds) as u64).max(1);
            break;
        }
        iters *= 4;
    }
    let mut best = 0.0f64;
    for _ in 0..sampling.rounds.max(1) {
        let barrier = Barrier::new(threads);
        let seconds = std::thread::scope(|s| {
            let runs: Vec<_> = (0..threads)
                .map(|_| {
                    s.spawn(|| {
                        barrier.wait();
                        let start = Instant::now();
                        std::hint::black_box(chains(iters));
                        start.elapsed().as_secs_f64()
                    })
                })
                .collect();
            // The slowest thread decides the wall time of the whole.
            runs.into_iter().map(|r| r.join().unwrap_or(f64::INFINITY)).fold(0.0, f64::max)
        });
        let total = (threads as u64 * iters * CHAINS as u64 * flops) as f64;
        best = best.max(total / seconds / 1e9);
    }
    best
}

/// One thread copying `bytes` between two buffers: best of ten copies, in GB/s.
pub fn memcpy_gbps(bytes: usize) -> f64 {
    let src = vec![1u8; bytes];
    let mut dst = vec![0u8; bytes];
    let mut best = f64::INFINITY;
    for _ in 0..10 {
        let start = Instant::now();
        dst.copy_from_slice(std::hint::black_box(&src));
        best = best.min(start.elapsed().as_secs_f64());
        std::hint::black_box(&mut dst);
    }
    bytes as f64 / best / 1e9
}

/// The widest FMA this CPU runs, and its f32 lanes.
fn widest_fma() -> (&'static str, u64) {
    #[cfg(target_arch = "x86_64")]
    {
        if is_x86_feature_detected!("avx512f") {
            return ("avx512", 16);
        }
        if is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma") {
            return ("avx2", 8);
        }
    }
    ("scalar", 1)
}

/// `iters` rounds of `c = c * a + b` on each of the chains; returns their sum so the work
/// is kept. (c converges to b / (1 - a): no overflow, no denormals.)
fn fma_chains(isa: &str, iters: u64) -> f32 {
    #[cfg(target_arch = "x86_64")]
    {
        // SAFETY: `widest_fma` reported the features each one enables.
        match isa {
            "avx512" => return unsafe { x86::chains_avx512(iters) },
            "avx2" => return unsafe { x86::chains_avx2(iters) },
            _ => {}
        }
    }
    let mut c = [0.0f32; CHAINS];
    let (a, b) = (std::hint::black_box(0.999_999f32), std::hint::black_box(1e-7f32));
    for _ in 0..iters {
        for x in c.iter_mut() {
            *x = *x * a + b;
        }
    }
    c.iter().sum()
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use super::CHAINS;
    use std::arch::x86_64::*;

    /// The same loop on both widths: CHAINS independent vector FMAs per round.
    macro_rules! chains {
        ($name:ident, $feature:literal, $vec:ty, $set1:ident, $fmadd:ident, $add:ident, $store:ident, $lanes:literal) => {
            #[target_feature(enable = $feature)]
            pub unsafe fn $name(iters: u64) -> f32 {
                let a = $set1(std::hint::black_box(0.999_999));
                let b = $set1(std::hint::black_box(1e-7));
                let mut c: [$vec; CHAINS] = [$set1(0.0); CHAINS];
                for _ in 0..iters {
                    // A constant-length loop over registers: unrolled, kept in registers.
                    for x in c.iter_mut() {
                        *x = $fmadd(*x, a, b);
                    }
                }
                let mut sum = $set1(0.0);
                for x in c {
                    sum = $add(sum, x);
                }
                let mut out = [0.0f32; $lanes];
                // SAFETY: `out` holds exactly one vector.
                unsafe { $store(out.as_mut_ptr(), sum) };
                out.iter().sum()
            }
        };
    }
    chains!(chains_avx512, "avx512f", __m512, _mm512_set1_ps, _mm512_fmadd_ps, _mm512_add_ps, _mm512_storeu_ps, 16);
    chains!(chains_avx2, "avx2,fma", __m256, _mm256_set1_ps, _mm256_fmadd_ps, _mm256_add_ps, _mm256_storeu_ps, 8);

    /// CHAINS independent `c += a0 b0 + a1 b1` per lane, on bf16 pairs (a = b = 2^-10: the
    /// sums grow by 2^-19 per round, far from overflow).
    #[target_feature(enable = "avx512bf16,avx512f")]
    pub unsafe fn chains_dpbf16(iters: u64) -> f32 {
        let pair = std::hint::black_box(0x3a80_3a80u32) as i32; // two bf16 2^-10
        let ab: __m512bh = std::mem::transmute(_mm512_set1_epi32(pair));
        let mut c: [__m512; CHAINS] = [_mm512_set1_ps(0.0); CHAINS];
        for _ in 0..iters {
            for x in c.iter_mut() {
                *x = _mm512_dpbf16_ps(*x, ab, ab);
            }
        }
        let mut sum = _mm512_set1_ps(0.0);
        for x in c {
            sum = _mm512_add_ps(sum, x);
        }
        _mm512_reduce_add_ps(sum)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_fma_loop_computes_what_it_claims() {
        // c_n = c_{n-1} a + b from 0: b (1 - a^n) / (1 - a), on every chain and lane.
        let (isa, lanes) = widest_fma();
        let n = 1000u64;
        let a = 0.999_999f64;
        let one_lane = 1e-7 * (1.0 - a.powi(n as i32)) / (1.0 - a);
        let want = one_lane * (CHAINS as u64 * if isa == "scalar" { 1 } else { lanes }) as f64;
        let got = fma_chains(isa, n) as f64;
        assert!((got - want).abs() < want * 1e-3, "{got} vs {want}");
    }

    #[cfg(target_arch = "x86_64")]
    #[test]
    fn the_bf16_loop_adds_two_products_per_lane() {
        if !(is_x86_feature_detected!("avx512bf16") && is_x86_feature_detected!("avx512f")) {
            eprintln!("no AVX-512 BF16 here: nothing to check");
            return;
        }
        // SAFETY: detected above. Each round adds 2 * 2^-20 to every lane of every chain.
        let got = unsafe { x86::chains_dpbf16(1000) } as f64;
        assert_eq!(got, 1000.0 * 2f64.powi(-19) * (CHAINS * 16) as f64);
    }
}
