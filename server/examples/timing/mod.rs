//! What the `*_costs` examples share: one way to time a call.

use std::time::Instant;

/// Calls timed per figure (after a tenth as many untimed, to warm caches and connections).
pub const ROUNDS: u32 = 2000;

/// Microseconds per call of `f`, over ROUNDS calls.
pub async fn per_call<F: std::future::Future<Output = ()>>(mut f: impl FnMut() -> F) -> f64 {
    for _ in 0..ROUNDS / 10 {
        f().await;
    }
    let start = Instant::now();
    for _ in 0..ROUNDS {
        f().await;
    }
    start.elapsed().as_secs_f64() * 1e6 / f64::from(ROUNDS)
}
