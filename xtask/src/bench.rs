//! `cargo xtask bench`: the engine's speed as a share of this machine's own limits, with
//! PyTorch measured in the same run when a Python with torch is present.
//!
//! 1. The training step (`gpu-worker/benches/train_step.rs`) in fp32, bf16 and fp16 on 1
//!    and 2 threads. That bench measures the FMA peak on as many threads first and gives
//!    every step its share of it.
//! 2. PyTorch on the same shape (`xtask/reference/gpt_step.py --untied`, SDPA attention),
//!    fp32 and bf16 autocast, on 1 and 2 threads.
//! 3. all_reduce of 64 MiB between W = 2, 4, 8 rank processes (`distlab-worker bench-comm`),
//!    bus bandwidth as a share of one thread's memcpy.
//!
//! Then one table of all of it. Nothing is compared with a figure from another run.

use std::collections::BTreeMap;
use std::process::{Command, Stdio};

use anyhow::{bail, Context, Result};
use serde_json::Value;

use crate::{cargo, root};

const THREADS: [u64; 2] = [1, 2];
const PRECISIONS: [&str; 3] = ["fp32", "bf16", "fp16"];
const RING_BYTES: usize = 64 << 20;
const RING_WORLDS: [usize; 3] = [2, 4, 8];

/// One training-step result: whose, in which format, on how many threads.
#[derive(Default)]
struct Step {
    tokens_per_s: f64,
    gflops_per_s: f64,
}

pub fn run() -> Result<()> {
    let mut peaks: BTreeMap<u64, f64> = BTreeMap::new();
    let mut ours: BTreeMap<(&str, u64), Step> = BTreeMap::new();
    let mut flops_per_token = None;
    for precision in PRECISIONS {
        let text = run_printing(
            cargo().args(["bench", "-p", "distlab-worker", "--bench", "train_step", "--", "--precision", precision]),
        )
        .with_context(|| format!("the {precision} train_step benchmark"))?;
        for line in json_lines(&text) {
            let threads = line["threads"].as_u64().unwrap_or(0);
            match line["bench"].as_str() {
                // Each run measures the peak again; the best of them is the machine's.
                Some("fma_peak") => {
                    let peak = peaks.entry(threads).or_default();
                    *peak = peak.max(line["gflops_per_s"].as_f64().unwrap_or(0.0));
                }
                Some("train_step") => {
                    flops_per_token = line["flops_per_token"].as_f64();
                    ours.insert(
                        (precision, threads),
                        Step {
                            tokens_per_s: line["tokens_per_s"].as_f64().unwrap_or(0.0),
                            gflops_per_s: line["gflops_per_s"].as_f64().unwrap_or(0.0),
                        },
                    );
                }
                _ => {}
            }
        }
    }
    let flops_per_token = flops_per_token.context("the train_step benchmark printed no step")?;

    let theirs = pytorch_steps(flops_per_token)?;
    let ring = ring_shares()?;

    println!("\n## Training step (4 layers, d_model 256, seq 128, batch 16, AdamW; {flops_per_token} FLOP/token)\n");
    for (threads, peak) in &peaks {
        println!("FMA peak on {threads} thread(s): {peak:.1} GFLOP/s");
    }
    println!(
        "\n| format | threads | distlab tok/s | GFLOP/s | % of FMA peak | PyTorch tok/s | PyTorch % of peak | distlab / PyTorch |"
    );
    println!("| --- | --- | --- | --- | --- | --- | --- | --- |");
    for (precision, threads) in PRECISIONS.iter().flat_map(|p| THREADS.map(|t| (*p, t))) {
        let Some(step) = ours.get(&(precision, threads)) else { continue };
        let peak = peaks.get(&threads).copied().unwrap_or(f64::NAN);
        let (torch_tps, torch_share, ratio) = match theirs.get(&(precision, threads)) {
            Some(t) => (
                format!("{:.0}", t.tokens_per_s),
                format!("{:.1}%", t.gflops_per_s / peak * 100.0),
                format!("{:.2}", step.tokens_per_s / t.tokens_per_s),
            ),
            None => ("-".into(), "-".into(), "-".into()),
        };
        println!(
            "| {precision} | {threads} | {:.0} | {:.1} | {:.1}% | {torch_tps} | {torch_share} | {ratio} |",
            step.tokens_per_s,
            step.gflops_per_s,
            step.gflops_per_s / peak * 100.0
        );
    }
    if let Some((memcpy, rows)) = ring {
        println!("\n## all_reduce, {} MiB (one-thread memcpy: {memcpy:.2} GB/s)\n", RING_BYTES >> 20);
        println!("| ranks | memory | busbw GB/s | % of memcpy |");
        println!("| --- | --- | --- | --- |");
        for (world, memory, busbw) in rows {
            println!("| {world} | {memory} | {busbw:.2} | {:.1}% |", busbw / memcpy * 100.0);
        }
    }
    Ok(())
}

/// PyTorch's steps by (format, threads), or none when there is no torch.
fn pytorch_steps(flops_per_token: f64) -> Result<BTreeMap<(&'static str, u64), Step>> {
    let mut theirs = BTreeMap::new();
    let python = std::env::var("DISTLAB_TORCH_PYTHON").unwrap_or_else(|_| "python3".into());
    let has_torch = Command::new(&python)
        .args(["-c", "import torch"])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|s| s.success());
    if !has_torch {
        println!(
            "xtask: PyTorch is not available ({python} cannot `import torch`): no reference numbers. \
             Set DISTLAB_TORCH_PYTHON to a Python with torch installed to compare."
        );
        return Ok(theirs);
    }
    let script = root().join("xtask/reference/gpt_step.py");
    for dtype in ["fp32", "bf16"] {
        for threads in THREADS {
            let mut cmd = Command::new(&python);
            cmd.arg(&script).args(["--untied", "--dtype", dtype, "--threads", &threads.to_string()]);
            let Ok(text) = run_printing(&mut cmd) else {
                println!("xtask: the PyTorch reference ({dtype}, {threads} thread(s)) failed");
                continue;
            };
            if let Some(line) = json_lines(&text).into_iter().find(|l| l["tokens_per_s"].is_number()) {
                let tokens_per_s = line["tokens_per_s"].as_f64().unwrap_or(0.0);
                // The same model as ours, so the same FLOPs per token.
                theirs.insert((dtype, threads), Step { tokens_per_s, gflops_per_s: tokens_per_s * flops_per_token / 1e9 });
            }
        }
    }
    Ok(theirs)
}

/// One all_reduce at RING_BYTES: ranks, "shared" or "private" buffers, bus bandwidth GB/s.
type RingRow = (usize, String, f64);

/// memcpy GB/s (the best of the runs) and the all_reduce rows.
fn ring_shares() -> Result<Option<(f64, Vec<RingRow>)>> {
    run_printing(cargo().args(["build", "--release", "-p", "distlab-worker", "--bin", "distlab-worker"]))?;
    let exe = root().join("target/release/distlab-worker");
    let mut memcpy = 0.0f64;
    let mut rows = Vec::new();
    for world in RING_WORLDS {
        let bytes = RING_BYTES.to_string();
        let mut cmd = Command::new(&exe);
        cmd.args(["bench-comm", "--world", &world.to_string(), "--min-bytes", &bytes, "--max-bytes", &bytes]);
        let text = run_printing(&mut cmd).with_context(|| format!("bench-comm --world {world}"))?;
        for line in json_lines(&text) {
            match (line["bench"].as_str(), line["op"].as_str()) {
                (Some("memcpy"), _) => memcpy = memcpy.max(line["busbw_gbps"].as_f64().unwrap_or(0.0)),
                (Some("collective"), Some("all_reduce")) => rows.push((
                    world,
                    line["memory"].as_str().unwrap_or("?").to_string(),
                    line["busbw_gbps"].as_f64().unwrap_or(0.0),
                )),
                _ => {}
            }
        }
    }
    Ok((memcpy > 0.0).then_some((memcpy, rows)))
}

/// Runs `cmd` (its stderr shown as it comes), echoes its stdout, and returns it.
fn run_printing(cmd: &mut Command) -> Result<String> {
    let out = cmd.stderr(Stdio::inherit()).output().context("cannot start the command")?;
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    print!("{text}");
    if !out.status.success() {
        bail!("it failed ({})", out.status);
    }
    Ok(text)
}

fn json_lines(text: &str) -> Vec<Value> {
    text.lines().filter_map(|line| serde_json::from_str::<Value>(line.trim()).ok()).collect()
}
