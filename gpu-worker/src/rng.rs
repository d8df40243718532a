//! A small deterministic random number generator (SplitMix64), so that parameter
//! initialisation and data depend on the seeds alone, on every platform and
//! whatever crate versions are in the lock file.

/// SplitMix64 (Steele, Lea, Flood 2014): passes BigCrush, one u64 of state.
#[derive(Clone, Debug)]
pub struct Rng {
    state: u64,
    /// The second normal deviate of the last Box-Muller pair.
    spare_normal: Option<f64>,
}

const GOLDEN_GAMMA: u64 = 0x9e37_79b9_7f4a_7c15;

/// The SplitMix64 output function: a strong 64-bit mixer.
pub fn mix64(mut z: u64) -> u64 {
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

impl Rng {
    pub fn new(seed: u64) -> Self {
        Self { state: mix64(seed ^ GOLDEN_GAMMA), spare_normal: None }
    }

    /// An independent stream named by several numbers, e.g. (seed, step, sequence).
    pub fn from_parts(parts: &[u64]) -> Self {
        let mut h = 0x6a09_e667_f3bc_c908u64;
        for &p in parts {
            h = mix64(h ^ p).wrapping_add(GOLDEN_GAMMA);
        }
        Self::new(h)
    }

    pub fn next_u64(&mut self) -> u64 {
        self.state = self.state.wrapping_add(GOLDEN_GAMMA);
        mix64(self.state)
    }

    /// Uniform in [0, 1), 53 random bits.
    pub fn uniform(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 * (1.0 / (1u64 << 53) as f64)
    }

    /// Uniform integer in [0, n) (Lemire's multiply-shift with rejection: unbiased). n > 0.
    pub fn below(&mut self, n: u64) -> u64 {
        debug_assert!(n > 0);
        let threshold = n.wrapping_neg() % n;
        loop {
            let m = (self.next_u64() as u128) * (n as u128);
            if (m as u64) >= threshold {
                return (m >> 64) as u64;
            }
        }
    }

    /// This generator moved on so that its next [`Self::normal`] is deviate `k` of its
    /// stream (each Box-Muller pair takes two draws, and SplitMix64 jumps in O(1)).
    pub fn at_normal(mut self, k: u64) -> Self {
        self.state = self.state.wrapping_add((k / 2).wrapping_mul(2).wrapping_mul(GOLDEN_GAMMA));
        self.spare_normal = None;
        if k % 2 == 1 {
            self.normal();
        }
        self
    }

    /// Standard normal deviate (Box-Muller).
    pub fn normal(&mut self) -> f64 {
        if let Some(z) = self.spare_normal.take() {
            return z;
        }
        let u1 = 1.0 - self.uniform(); // (0, 1]
        let u2 = self.uniform();
        let r = (-2.0 * u1.ln()).sqrt();
        let theta = 2.0 * std::f64::consts::PI * u2;
        self.spare_normal = Some(r * theta.sin());
        r * theta.cos()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn jumping_to_a_normal_deviate_gives_the_streams_value() {
        let mut stream = Rng::new(3);
        let drawn: Vec<f64> = (0..9).map(|_| stream.normal()).collect();
        for (k, &value) in drawn.iter().enumerate() {
            assert_eq!(Rng::new(3).at_normal(k as u64).normal(), value, "deviate {k}");
        }
    }

    #[test]
    fn same_seed_same_stream_and_streams_differ() {
        let a: Vec<u64> = (0..4).scan(Rng::new(7), |r, _| Some(r.next_u64())).collect();
        let b: Vec<u64> = (0..4).scan(Rng::new(7), |r, _| Some(r.next_u64())).collect();
        let c: Vec<u64> = (0..4).scan(Rng::new(8), |r, _| Some(r.next_u64())).collect();
        assert_eq!(a, b);
        assert_ne!(a, c);
        assert_ne!(Rng::from_parts(&[1, 2]).next_u64(), Rng::from_parts(&[2, 1]).next_u64());
    }

    #[test]
    fn normal_has_unit_moments_and_below_is_in_range() {
        let mut r = Rng::new(1);
        let n = 200_000;
        let xs: Vec<f64> = (0..n).map(|_| r.normal()).collect();
        let mean = xs.iter().sum::<f64>() / n as f64;
        let var = xs.iter().map(|x| (x - mean).powi(2)).sum::<f64>() / n as f64;
        assert!(mean.abs() < 0.01 && (var - 1.0).abs() < 0.02, "mean {mean} var {var}");
        for _ in 0..1000 {
            assert!(r.below(7) < 7);
        }
    }
}
