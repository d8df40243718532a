//! Where the reference training step's time goes, kernel by kernel: every CPU kernel of
//! one block (and the head) on the bench's shapes (batch 16 x seq 128 rows, d_model 256,
//! 4 heads, vocab 256), timed alone on 1 and on 2 threads, with its FLOP rate where it is
//! a product and that rate's share of the FMA peak on as many threads. For profiling;
//! speeds are reported by `cargo xtask bench`.
//!
//! `cargo run --release -p distlab-worker --example kernel_times [-- --reps 20]`

use std::time::Instant;

use distlab_worker::backend::CpuBackend;
use distlab_worker::machine_limits::{fma_peak, Sampling};
use distlab_worker::ops::attention::AttentionShape;
use distlab_worker::ops::kernels::*;

const ROWS: usize = 16 * 128;
const T: usize = 128;
const C: usize = 256;
const HEADS: usize = 4;
const VOCAB: usize = 256;

fn filled(len: usize, seed: u32) -> Vec<f32> {
    (0..len)
        .map(|i| ((i as u32).wrapping_mul(2_654_435_761).wrapping_add(seed) >> 8) as f32 / 16_777_216.0 - 0.5)
        .collect()
}

/// Median ms of `reps` calls of `f` (after one warm-up).
fn time(reps: usize, mut f: impl FnMut()) -> f64 {
    f();
    let mut ms: Vec<f64> = (0..reps)
        .map(|_| {
            let start = Instant::now();
            f();
            start.elapsed().as_secs_f64() * 1e3
        })
        .collect();
    ms.sort_by(f64::total_cmp);
    ms[ms.len() / 2]
}

fn main() {
    let reps = std::env::args().skip_while(|a| a != "--reps").nth(1).and_then(|v| v.parse().ok()).unwrap_or(20);
    let mut table: Vec<(String, f64, Vec<f64>)> = Vec::new();
    let peaks = [fma_peak(1, Sampling::THOROUGH).gflops_per_s, fma_peak(2, Sampling::THOROUGH).gflops_per_s];
    for threads in [1usize, 2] {
        let pool = rayon::ThreadPoolBuilder::new().num_threads(threads).build().expect("a thread pool");
        let be = CpuBackend::<f32>::new(threads);
        let mut row = 0;
        let mut record = |name: &str, flops: f64, ms: f64| {
            if threads == 1 {
                table.push((name.to_string(), flops, vec![ms]));
            } else {
                table[row].2.push(ms);
            }
            row += 1;
        };
        pool.install(|| {
            for (name, c_in, c_out) in
                [("qkv", C, 3 * C), ("attn proj", C, C), ("fc", C, 4 * C), ("fc proj", 4 * C, C), ("head", C, VOCAB)]
            {
                let (inp, w, b) = (filled(ROWS * c_in, 1), filled(c_in * c_out, 2), filled(c_out, 3));
                let dout = filled(ROWS * c_out, 4);
                let (mut out, mut dinp, mut dw, mut db) =
                    (vec![0.0; ROWS * c_out], vec![0.0; ROWS * c_in], vec![0.0; c_in * c_out], vec![0.0; c_out]);
                let flops = 2.0 * (ROWS * c_in * c_out) as f64;
                record(
                    &format!("{name} forward"),
                    flops,
                    time(reps, || be.matmul_forward(&mut out, &inp, &w, Some(&b), None, c_in, c_out)),
                );
                record(
                    &format!("{name} backward input"),
                    flops,
                    time(reps, || be.matmul_backward_input(&mut dinp, &dout, &w, c_in, c_out)),
                );
                record(
                    &format!("{name} backward weights"),
                    flops,
                    time(reps, || be.matmul_backward_weights(&mut dw, Some(&mut db), &dout, &inp, c_in, c_out)),
                );
            }
            let qkv = filled(ROWS * 3 * C, 5);
            let dy = filled(ROWS * C, 6);
            let (mut y, mut att, mut dqkv, mut datt) = (
                vec![0.0; ROWS * C],
                vec![0.0; 16 * HEADS * T * T],
                vec![0.0; ROWS * 3 * C],
                vec![0.0; 16 * HEADS * T * T],
            );
            // Q Kᵀ and P V over the causal blocks (3/4 of T x T at T = 128).
            let attention_flops = 2.0 * 2.0 * (16 * HEADS * T * T * (C / HEADS)) as f64 * 0.75;
            record(
                "attention forward",
                attention_flops,
                time(reps, || be.attention_forward(&mut y, &mut att, &qkv, AttentionShape::multi_head(T, C, HEADS))),
            );
            record(
                "attention backward",
                2.0 * attention_flops,
                time(reps, || {
                    be.attention_backward(
                        &mut dqkv,
                        &mut datt,
                        &dy,
                        &qkv,
                        &att,
                        AttentionShape::multi_head(T, C, HEADS),
                    )
                }),
            );
            let (mut lse, mut delta) = (vec![0.0; 16 * HEADS * T * 2], vec![0.0; 16 * HEADS * T * 2]);
            record(
                "flash attention forward",
                attention_flops,
                time(reps, || {
                    be.flash_attention_forward(&mut y, &mut lse, &qkv, AttentionShape::multi_head(T, C, HEADS))
                }),
            );
            // Its backward recomputes the probabilities: one more Q Kᵀ.
            record(
                "flash attention backward",
                2.5 * attention_flops,
                time(reps, || {
                    be.flash_attention_backward(
                        &mut dqkv,
                        &mut delta,
                        &dy,
                        &qkv,
                        &y,
                        &lse,
                        AttentionShape::multi_head(T, C, HEADS),
                    )
                }),
            );
            let x = filled(ROWS * C, 7);
            let (gamma, beta) = (filled(C, 8), filled(C, 9));
            let (mut ln, mut mean, mut rstd) = (vec![0.0; ROWS * C], vec![0.0; ROWS], vec![0.0; ROWS]);
            record(
                "layernorm forward",
                0.0,
                time(reps, || be.layernorm_forward(&mut ln, &mut mean, &mut rstd, &x, &gamma, &beta, C)),
            );
            let (mut dx, mut dg, mut dbeta) = (vec![0.0; ROWS * C], vec![0.0; C], vec![0.0; C]);
            record(
                "layernorm backward",
                0.0,
                time(reps, || be.layernorm_backward(&mut dx, &mut dg, &mut dbeta, &dy, &x, &gamma, &mean, &rstd, C)),
            );
            let h = filled(ROWS * 4 * C, 10);
            let mut g = vec![0.0; ROWS * 4 * C];
            record("gelu forward", 0.0, time(reps, || be.gelu_forward(&mut g, &h)));
            record("gelu backward", 0.0, time(reps, || be.gelu_backward(&mut g, &h)));
        });
    }
    println!("FMA peak: {:.1} GFLOP/s on 1 thread, {:.1} on 2", peaks[0], peaks[1]);
    println!("| kernel | 1 thread ms | GFLOP/s (% of peak) | 2 threads ms | GFLOP/s (% of peak) | speed-up |");
    println!("| --- | --- | --- | --- | --- | --- |");
    for (name, flops, ms) in &table {
        let rate = |ms: f64, peak: f64| match flops / ms / 1e6 {
            gflops if *flops > 0.0 => format!("{gflops:.1} ({:.0}%)", gflops / peak * 100.0),
            _ => "-".into(),
        };
        let (one, two) = (rate(ms[0], peaks[0]), rate(ms[1], peaks[1]));
        println!("| {name} | {:.3} | {one} | {:.3} | {two} | {:.2} |", ms[0], ms[1], ms[0] / ms[1]);
    }
    let (one, two): (f64, f64) = table.iter().fold((0.0, 0.0), |(a, b), (_, _, ms)| (a + ms[0], b + ms[1]));
    println!("| sum | {one:.2} | | {two:.2} | | {:.2} |", one / two);
}
