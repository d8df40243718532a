//! How far a worker's quick FMA peak (five runs of 8 ms, taken before each run it starts)
//! lies from the benchmarks' thorough one (five runs of 50 ms): the two measured in turn,
//! `--pairs` times, each pair's ratio and time printed. Behind `Sampling::QUICK`.
//!
//! `cargo run --release -p distlab-worker --example peak_sampling [-- --pairs 10]`

use std::time::Instant;

use distlab_worker::machine_limits::{fma_peak, Sampling};

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let pairs: usize = match args.iter().position(|a| a == "--pairs") {
        Some(i) => args.get(i + 1).and_then(|v| v.parse().ok()).unwrap_or(10),
        None => 10,
    };
    println!("pair  quick GFLOP/s (ms)  thorough GFLOP/s (ms)  quick/thorough");
    let mut ratios = Vec::new();
    for pair in 0..pairs {
        let timed = |sampling| {
            let start = Instant::now();
            let peak = fma_peak(1, sampling);
            (peak.gflops_per_s, start.elapsed().as_secs_f64() * 1e3)
        };
        let (quick, quick_ms) = timed(Sampling::QUICK);
        let (thorough, thorough_ms) = timed(Sampling::THOROUGH);
        ratios.push(quick / thorough);
        println!(
            "{pair:>4}  {quick:>8.1} ({quick_ms:>5.1})  {thorough:>11.1} ({thorough_ms:>6.1})  {:>14.3}",
            quick / thorough
        );
    }
    ratios.sort_by(f64::total_cmp);
    println!(
        "quick/thorough: min {:.3}, median {:.3}, max {:.3}",
        ratios[0],
        ratios[ratios.len() / 2],
        ratios[ratios.len() - 1]
    );
}
