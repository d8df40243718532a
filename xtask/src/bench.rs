//! `cargo xtask bench`: the engine's speed as a share of this machine's own limits, with
//! PyTorch measured in the same run when a Python with torch is present.
//!
//! 1. The training step (`gpu-worker/benches/train_step.rs`) in fp32, bf16 and fp16 on 1
//!    and 2 threads. That bench measures the FMA peak on as many threads first and gives
//!    every step its share of it.
//! 2. PyTorch on the same shape (`xtask/reference/gpt_step.py --untied`, SDPA attention),
//!    fp32 and bf16 autocast, on 1 and 2 threads.
//! 3. The same step in Llama blocks of about the same size (`train_step --family llama`,
//!    `gpt_step.py --llama`), fp32, on 1 and 2 threads, ours and PyTorch's.
//! 4. all_reduce of 64 MiB between W = 2, 4, 8 rank processes (`distlab-worker bench-comm`),
//!    bus bandwidth as a share of one thread's memcpy.
//!
//! Steps 1 and 2 run in `rounds` rounds, ours and PyTorch's for a format one after the other
//! in each, and the table shows each one's median over the rounds of its median step: this
//! machine's speed drifts by tens of percent within minutes, and a figure taken minutes away
//! from the one it is compared with would compare the drift.
//!
//! Then one table of all of it. Nothing is compared with a figure from another run.

use std::collections::BTreeMap;
use std::process::{Command, Stdio};

use anyhow::{bail, Context, Result};
use serde_json::Value;

use crate::{cargo, root};

const THREADS: [u64; 2] = [1, 2];
const PRECISIONS: [&str; 3] = ["fp32", "bf16", "fp16"];
/// The formats the PyTorch reference runs (fp16 autocast on a CPU is not what it is used for).
const TORCH_PRECISIONS: [&str; 2] = ["fp32", "bf16"];
/// The Llama of `train_step --family llama`, for the PyTorch reference.
const TORCH_LLAMA: [&str; 5] = ["--llama", "--kv-heads", "2", "--ffn-hidden", "784"];
/// The Samples key of the Llama rows (fp32).
const LLAMA: &str = "llama fp32";
const RING_BYTES: usize = 64 << 20;
const RING_WORLDS: [usize; 3] = [2, 4, 8];

/// Tokens per second by (format, threads), then by round.
type Samples = BTreeMap<(&'static str, u64), BTreeMap<usize, f64>>;

pub fn run(rounds: usize) -> Result<()> {
    if rounds == 0 {
        bail!("--rounds must be at least 1");
    }
    let python = torch_python();
    let mut peaks: BTreeMap<u64, f64> = BTreeMap::new();
    let (mut ours, mut theirs) = (Samples::new(), Samples::new());
    let mut flops_per_token = None;
    let mut llama_flops_per_token = None;
    for round in 1..=rounds {
        for (key, precision, family) in PRECISIONS.map(|p| (p, p, "gpt2")).into_iter().chain([(LLAMA, "fp32", "llama")])
        {
            println!("xtask: round {round} of {rounds}, {key}");
            let text =
                run_printing(cargo().args(["bench", "-p", "distlab-worker", "--bench", "train_step", "--"]).args([
                    "--precision",
                    precision,
                    "--family",
                    family,
                ]))
                .with_context(|| format!("the {key} train_step benchmark"))?;
            for line in json_lines(&text) {
                let threads = line["threads"].as_u64().unwrap_or(0);
                match line["bench"].as_str() {
                    // Each run measures the peak again; the best of them is the machine's.
                    Some("fma_peak") => {
                        let peak = peaks.entry(threads).or_default();
                        *peak = peak.max(line["gflops_per_s"].as_f64().unwrap_or(0.0));
                    }
                    Some("train_step") => {
                        match family {
                            "llama" => llama_flops_per_token = line["flops_per_token"].as_f64(),
                            _ => flops_per_token = line["flops_per_token"].as_f64(),
                        }
                        if let Some(tps) = median_tokens_per_s(&line) {
                            ours.entry((key, threads)).or_default().insert(round, tps);
                        }
                    }
                    _ => {}
                }
            }
            match (&python, family) {
                (Some(python), "llama") => pytorch_steps(python, (key, precision), &TORCH_LLAMA, round, &mut theirs),
                (Some(python), _) if TORCH_PRECISIONS.contains(&precision) => {
                    pytorch_steps(python, (key, precision), &[], round, &mut theirs)
                }
                _ => {}
            }
        }
    }
    let flops_per_token = flops_per_token.context("the train_step benchmark printed no step")?;
    let llama_flops_per_token = llama_flops_per_token.context("the llama train_step benchmark printed no step")?;
    let ring = ring_shares()?;

    println!("\n## Training step (4 layers, d_model 256, seq 128, batch 16, AdamW; {flops_per_token} FLOP/token)\n");
    for (threads, peak) in &peaks {
        println!("FMA peak on {threads} thread(s): {peak:.1} GFLOP/s (the best of every run's)");
    }
    println!(
        "\nTokens per second from the median step, median of {rounds} round(s) (each round's in brackets); \
         the ratio is the median of each round's ratio."
    );
    println!(
        "\n| format | threads | distlab tok/s | GFLOP/s | % of FMA peak | PyTorch tok/s | PyTorch % of peak | distlab / PyTorch |"
    );
    println!("| --- | --- | --- | --- | --- | --- | --- | --- |");
    let gflops = |tps: f64| tps * flops_per_token / 1e9;
    for (precision, threads) in PRECISIONS.iter().flat_map(|p| THREADS.map(|t| (*p, t))) {
        let Some(mine) = ours.get(&(precision, threads)) else { continue };
        let tps = median(mine.values());
        let peak = peaks.get(&threads).copied().unwrap_or(f64::NAN);
        let (torch_tps, torch_share, ratio) = match theirs.get(&(precision, threads)) {
            Some(t) => (
                format!("{:.0} {}", median(t.values()), rounds_of(t)),
                format!("{:.1}%", gflops(median(t.values())) / peak * 100.0),
                format!("{:.2}", paired_ratio(mine, t)),
            ),
            None => ("-".into(), "-".into(), "-".into()),
        };
        println!(
            "| {precision} | {threads} | {tps:.0} {} | {:.1} | {:.1}% | {torch_tps} | {torch_share} | {ratio} |",
            rounds_of(mine),
            gflops(tps),
            gflops(tps) / peak * 100.0
        );
    }
    println!(
        "\n## The same step in Llama blocks of about the same size (4 query heads on 2 K/V heads, SwiGLU 784, \
         fp32; {llama_flops_per_token} FLOP/token)\n"
    );
    println!("| threads | distlab Llama tok/s | % of FMA peak | Llama / GPT-2 (distlab) | PyTorch Llama tok/s | distlab / PyTorch |");
    println!("| --- | --- | --- | --- | --- | --- |");
    for threads in THREADS {
        let (Some(llama), Some(gpt2)) = (ours.get(&(LLAMA, threads)), ours.get(&("fp32", threads))) else { continue };
        let peak = peaks.get(&threads).copied().unwrap_or(f64::NAN);
        let tps = median(llama.values());
        let (torch_tps, ratio) = match theirs.get(&(LLAMA, threads)) {
            Some(t) => {
                (format!("{:.0} {}", median(t.values()), rounds_of(t)), format!("{:.2}", paired_ratio(llama, t)))
            }
            None => ("-".into(), "-".into()),
        };
        println!(
            "| {threads} | {tps:.0} {} | {:.1}% | {:.2} | {torch_tps} | {ratio} |",
            rounds_of(llama),
            tps * llama_flops_per_token / 1e9 / peak * 100.0,
            paired_ratio(llama, gpt2)
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

/// Tokens per second at the median step of a step line (ours and PyTorch's alike).
fn median_tokens_per_s(line: &Value) -> Option<f64> {
    let tokens = line["tokens_per_step"].as_f64()?;
    let step_ms = line["step_ms_median"].as_f64().filter(|ms| *ms > 0.0)?;
    Some(tokens / (step_ms / 1e3))
}

fn median<'a>(samples: impl Iterator<Item = &'a f64>) -> f64 {
    let mut sorted: Vec<f64> = samples.copied().collect();
    sorted.sort_by(f64::total_cmp);
    match sorted.len() {
        0 => f64::NAN,
        n if n % 2 == 1 => sorted[n / 2],
        n => (sorted[n / 2 - 1] + sorted[n / 2]) / 2.0,
    }
}

/// The median over the rounds both ran of ours / theirs (a round one of them lost is left out).
fn paired_ratio(ours: &BTreeMap<usize, f64>, theirs: &BTreeMap<usize, f64>) -> f64 {
    let ratios: Vec<f64> = theirs.iter().filter_map(|(round, t)| Some(ours.get(round)? / t)).collect();
    median(ratios.iter())
}

/// "[4012, 4230, 4101]": each round's figure, for a table cell.
fn rounds_of(samples: &BTreeMap<usize, f64>) -> String {
    let each: Vec<String> = samples.values().map(|s| format!("{s:.0}")).collect();
    format!("[{}]", each.join(", "))
}

/// A Python that imports torch (`DISTLAB_TORCH_PYTHON`, else python3), or none.
fn torch_python() -> Option<String> {
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
    }
    has_torch.then_some(python)
}

/// PyTorch's step in `precision` (with `model` arguments for another model than GPT-2) on
/// each thread count, added to `theirs` under `key`.
fn pytorch_steps(
    python: &str,
    (key, precision): (&'static str, &'static str),
    model: &[&str],
    round: usize,
    theirs: &mut Samples,
) {
    let script = root().join("xtask/reference/gpt_step.py");
    for threads in THREADS {
        let mut cmd = Command::new(python);
        cmd.arg(&script).args(["--untied", "--dtype", precision, "--threads", &threads.to_string()]).args(model);
        let Ok(text) = run_printing(&mut cmd) else {
            println!("xtask: the PyTorch reference ({key}, {threads} thread(s)) failed");
            continue;
        };
        // The same model as ours, so the same FLOPs per token.
        if let Some(tps) = json_lines(&text).iter().find_map(median_tokens_per_s) {
            theirs.entry((key, threads)).or_default().insert(round, tps);
        }
    }
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_table_takes_medians() {
        assert_eq!(median([3.0, 1.0, 2.0].iter()), 2.0);
        assert_eq!(median([4.0, 1.0, 3.0, 2.0].iter()), 2.5);
        assert!(median([].iter()).is_nan());
        // 2048 tokens in a 400 ms median step (the mean is not what is read).
        let line: Value =
            serde_json::from_str(r#"{"step_ms": 500.0, "step_ms_median": 400.0, "tokens_per_step": 2048}"#)
                .expect("json");
        assert_eq!(median_tokens_per_s(&line), Some(5120.0));
        let broken: Value = serde_json::from_str(r#"{"step_ms_median": 0.0, "tokens_per_step": 2048}"#).expect("json");
        assert_eq!(median_tokens_per_s(&broken), None);
        assert_eq!(rounds_of(&BTreeMap::from([(1, 4012.4), (2, 4230.6)])), "[4012, 4231]");
        // Each round against its own: round 2 (fast for both) does not pair with round 1.
        let ours = BTreeMap::from([(1, 100.0), (2, 300.0), (3, 110.0)]);
        let theirs = BTreeMap::from([(1, 50.0), (2, 150.0)]);
        assert_eq!(paired_ratio(&ours, &theirs), 2.0);
    }
}
