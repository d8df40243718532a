//! Dynamic loss scaling for fp16 (Micikevicius et al., "Mixed Precision Training").
//!
//! fp16 keeps 5 exponent bits: its smallest subnormal is 2^-24 (about 6e-8) and its
//! largest value 65504. Many gradients of a small model sit below 2^-24 and round to zero
//! when stored in fp16 (the run stalls). Multiplying the loss by S multiplies every
//! gradient by S (backward is linear in the loss), lifting them into fp16's range; the
//! optimizer divides by S again (in f32, on the master weights' side) before it uses them.
//!
//! S is chosen as it goes: start high (2^16); when a step's gradients hold inf or NaN
//! (S was too high: something overflowed past 65504), skip the update and halve S; after
//! `GROWTH_INTERVAL` good steps in a row, double it. bf16 has f32's exponent range and
//! needs none of this.

/// The first scale (PyTorch's GradScaler starts at 2^16 too).
pub const INITIAL_SCALE: f64 = 65536.0;
/// Good steps in a row before the scale doubles. PyTorch's default is 2000; the runs this
/// lab teaches with last hundreds of steps, so the growth shows up within a run.
pub const GROWTH_INTERVAL: u64 = 100;
/// The scale never falls below this (a run whose gradients overflow even at 1 is broken).
pub const MIN_SCALE: f64 = 1.0;

#[derive(Clone, Debug, PartialEq)]
pub struct LossScaler {
    scale: f64,
    good_steps: u64,
    skipped: u64,
}

/// What to do with a step's gradients.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ScaledStep {
    /// Finite: unscale (multiply by `1 / scale`) and update.
    Apply,
    /// inf or NaN: no update this step; the scale was halved for the next.
    Skip,
}

impl Default for LossScaler {
    fn default() -> Self {
        Self::new(INITIAL_SCALE)
    }
}

impl LossScaler {
    pub fn new(scale: f64) -> Self {
        Self { scale: scale.max(MIN_SCALE), good_steps: 0, skipped: 0 }
    }

    /// The factor the loss (and so every gradient) is multiplied by in this step.
    pub fn scale(&self) -> f64 {
        self.scale
    }

    /// Steps skipped since the run began.
    pub fn skipped(&self) -> u64 {
        self.skipped
    }

    /// After backward: `finite` says whether every gradient (their norm) is finite.
    pub fn update(&mut self, finite: bool) -> ScaledStep {
        if !finite {
            self.skipped += 1;
            self.good_steps = 0;
            self.scale = (self.scale / 2.0).max(MIN_SCALE);
            return ScaledStep::Skip;
        }
        self.good_steps += 1;
        if self.good_steps >= GROWTH_INTERVAL {
            self.good_steps = 0;
            self.scale *= 2.0;
        }
        ScaledStep::Apply
    }

    /// What a checkpoint keeps: (scale, good steps in a row, skipped steps).
    pub fn state(&self) -> (f64, u64, u64) {
        (self.scale, self.good_steps, self.skipped)
    }

    pub fn from_state((scale, good_steps, skipped): (f64, u64, u64)) -> Self {
        Self { scale: scale.max(MIN_SCALE), good_steps, skipped }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use half::f16;

    #[test]
    fn overflow_halves_the_scale_and_skips_good_steps_double_it() {
        let mut s = LossScaler::default();
        assert_eq!(s.update(false), ScaledStep::Skip);
        assert_eq!(s.update(false), ScaledStep::Skip);
        assert_eq!((s.scale(), s.skipped()), (INITIAL_SCALE / 4.0, 2));
        for _ in 0..GROWTH_INTERVAL - 1 {
            assert_eq!(s.update(true), ScaledStep::Apply);
        }
        assert_eq!(s.scale(), INITIAL_SCALE / 4.0);
        s.update(true);
        assert_eq!(s.scale(), INITIAL_SCALE / 2.0, "doubles after the interval");
        // An overflow restarts the count.
        s.update(false);
        for _ in 0..GROWTH_INTERVAL - 1 {
            s.update(true);
        }
        assert_eq!(s.scale(), INITIAL_SCALE / 4.0);
        assert_eq!(LossScaler::from_state(s.state()), s);
    }

    #[test]
    fn the_scale_never_drops_below_one() {
        let mut s = LossScaler::new(2.0);
        for _ in 0..5 {
            s.update(false);
        }
        assert_eq!(s.scale(), MIN_SCALE);
    }

    #[test]
    fn scaling_keeps_a_small_gradient_alive_in_fp16() {
        // The lesson in one number: 1e-8 is below fp16's smallest subnormal (2^-24).
        let g = 1e-8f32;
        assert_eq!(f16::from_f32(g).to_f32(), 0.0);
        let scaled = f16::from_f32(g * INITIAL_SCALE as f32);
        let unscaled = scaled.to_f32() / INITIAL_SCALE as f32;
        assert!((unscaled - g).abs() < 1e-3 * g, "{unscaled}");
    }
}
