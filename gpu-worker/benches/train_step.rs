//! Training-step throughput on the reference config (the one
//! xtask/reference/gpt_step.py times in PyTorch): 4 layers, d_model 256,
//! 4 heads, seq 128, vocab 256, batch 16, fp32, AdamW; forward + backward +
//! optimizer step, through the public `train()` entry point.
//!
//! Prints one JSON line per thread count:
//!   {"bench":"train_step","threads":1,"tokens_per_s":...,"tokens_per_step":...,"step_ms":...,
//!    "step_ms_median":...,"step_ms_min":...,"params":...,"gflops_per_s":...,"config":{...}}
//! (`tokens_per_s` from the mean step; `cargo xtask bench` reads the median step instead).
//!
//! `cargo bench -p distlab-worker --bench train_step [-- --threads 1,2 --steps 20 --warmup 3
//!  --precision fp32|bf16|fp16 --checkpointing none|selective|every|sqrt --attention naive|flash
//!  --seq-len 128 --batch 16 --family gpt2|llama]`
//!
//! `--family llama`: the reference shape in Llama blocks of about the same parameter count
//! (3,328,256 against GPT-2's 3,323,392): 4 query heads on 2 K/V heads, a SwiGLU 784 wide,
//! rotary positions, no biases ([`LLAMA_REFERENCE`]).
//!
//! Each line also carries the rank's peak memory by category (MiB, from the ledger), and
//! its FLOP rate as a share of the machine's FMA peak on as many threads, measured first
//! and printed as its own line: {"bench":"fma_peak","threads":1,"isa":"avx512","gflops_per_s":...}

use std::sync::atomic::AtomicBool;

use distlab_common::{
    Attention, Checkpointing, ExperimentSpec, Limits, LossScaling, ModelFamily, ModelSpec, Precision, RunEvent,
    TrainSpec,
};
use distlab_worker::machine_limits::{bf16_dot_peak, fma_peak, Sampling};
use distlab_worker::{train, TrainOptions};

struct Args {
    threads: Vec<usize>,
    steps: u64,
    warmup: u64,
    precision: Precision,
    checkpointing: Checkpointing,
    attention: Attention,
    seq_len: usize,
    batch: usize,
    family: ModelFamily,
}

/// The Llama of the reference shape: 4 blocks of d_model 256, 4 query heads on 2 K/V heads,
/// a SwiGLU of 784 (3 x 256 x 784 in the MLP, against GPT-2's 8 x 256^2 + 5 x 256 with its
/// 4 x 256^2 + 4 x 256 attention), so that with no position table the two models differ by
/// 0.15% in parameters.
const LLAMA_KV_HEADS: usize = 2;
const LLAMA_FFN_HIDDEN: usize = 784;

/// A spec enum from its JSON name ("bf16", "sqrt").
fn choice<T: serde::de::DeserializeOwned>(value: &str) -> Result<T, serde_json::Error> {
    serde_json::from_value(serde_json::Value::String(value.into()))
}

fn parse_args() -> Args {
    let mut args = Args {
        threads: vec![1, 2],
        steps: 20,
        warmup: 3,
        precision: Precision::Fp32,
        checkpointing: Checkpointing::None,
        attention: Attention::Naive,
        seq_len: 128,
        batch: 16,
        family: ModelFamily::Gpt2,
    };
    let argv: Vec<String> = std::env::args().skip(1).collect();
    let mut i = 0;
    while i < argv.len() {
        let value = argv.get(i + 1).cloned().unwrap_or_default();
        match argv[i].as_str() {
            "--threads" => {
                args.threads = value.split(',').filter_map(|s| s.trim().parse().ok()).collect();
                i += 1;
            }
            "--steps" => {
                args.steps = value.parse().unwrap_or(args.steps);
                i += 1;
            }
            "--warmup" => {
                args.warmup = value.parse().unwrap_or(args.warmup);
                i += 1;
            }
            "--precision" => {
                args.precision = choice(&value).unwrap_or_else(|_| panic!("--precision fp32|bf16|fp16, not {value}"));
                i += 1;
            }
            "--checkpointing" => {
                args.checkpointing =
                    choice(&value).unwrap_or_else(|_| panic!("--checkpointing none|selective|every|sqrt, not {value}"));
                i += 1;
            }
            "--attention" => {
                args.attention = choice(&value).unwrap_or_else(|_| panic!("--attention naive|flash, not {value}"));
                i += 1;
            }
            "--seq-len" => {
                args.seq_len = value.parse().unwrap_or_else(|_| panic!("--seq-len takes a number, not {value}"));
                i += 1;
            }
            "--batch" => {
                args.batch = value.parse().unwrap_or_else(|_| panic!("--batch takes a number, not {value}"));
                i += 1;
            }
            "--family" => {
                args.family = choice(&value).unwrap_or_else(|_| panic!("--family gpt2|llama, not {value}"));
                i += 1;
            }
            _ => {} // cargo passes --bench; ignore anything else
        }
        i += 1;
    }
    args
}

fn reference_spec(args: &Args) -> ExperimentSpec {
    let steps = args.warmup + args.steps;
    let defaults = ExperimentSpec::default();
    let mut spec = ExperimentSpec {
        name: "bench-train-step".into(),
        model: match args.family {
            ModelFamily::Gpt2 => ModelSpec::dense(4, 256, 4, args.seq_len, 256),
            ModelFamily::Llama => ModelSpec::llama(4, 256, 4, LLAMA_KV_HEADS, LLAMA_FFN_HIDDEN, args.seq_len, 256),
        },
        train: TrainSpec {
            micro_batch: args.batch,
            steps,
            warmup_steps: 0,
            lr: 3e-4,
            weight_decay: 0.1,
            ..defaults.train.clone()
        },
        ..defaults
    };
    spec.train.precision = args.precision;
    spec.train.checkpointing = args.checkpointing;
    spec.train.attention = args.attention;
    if args.precision == Precision::Fp16 {
        spec.train.loss_scaling = LossScaling::Dynamic;
    }
    spec
}

fn main() {
    let args = parse_args();
    let spec = reference_spec(&args).validated(&Limits::default()).unwrap_or_else(|errors| {
        errors.iter().for_each(|e| eprintln!("{e}"));
        std::process::exit(2)
    });
    let tokens_per_step = spec.tokens_per_step() as f64;
    let flops_per_token = spec.model.train_flops_per_token();
    // The yardsticks first, while nothing else runs.
    let peaks: Vec<_> = args.threads.iter().map(|&threads| fma_peak(threads, Sampling::THOROUGH)).collect();
    let bf16_peaks: Vec<_> = args.threads.iter().filter_map(|&threads| bf16_dot_peak(threads)).collect();
    for (name, peak) in peaks.iter().map(|p| ("fma_peak", p)).chain(bf16_peaks.iter().map(|p| ("bf16_dot_peak", p))) {
        println!(
            "{}",
            serde_json::json!({"bench": name, "threads": peak.threads, "isa": peak.isa,
                                          "gflops_per_s": (peak.gflops_per_s * 10.0).round() / 10.0})
        );
    }
    for (&threads, fma) in args.threads.iter().zip(&peaks) {
        let mut step_ms = Vec::new();
        let mut peak = None;
        let cancel = AtomicBool::new(false);
        let summary = train(
            &spec,
            &TrainOptions { threads, ..TrainOptions::default() },
            &mut |e| match e {
                RunEvent::Metric(m) => step_ms.push(m.step_ms),
                RunEvent::Trace(t) => peak = t.memory.map(|m| m.peak),
                _ => {}
            },
            &cancel,
        );
        let summary = match summary {
            Ok(s) => s,
            Err(e) => {
                eprintln!("train_step bench failed: {e}");
                std::process::exit(1);
            }
        };
        let timed = &step_ms[args.warmup as usize..];
        let mean_ms = timed.iter().sum::<f64>() / timed.len() as f64;
        let mut sorted = timed.to_vec();
        sorted.sort_by(f64::total_cmp);
        // The middle step, or the mean of the two middle ones (as Python's statistics.median).
        let middle = sorted.len() / 2;
        let median_ms =
            if sorted.len() % 2 == 1 { sorted[middle] } else { (sorted[middle - 1] + sorted[middle]) / 2.0 };
        let tokens_per_s = tokens_per_step / (mean_ms / 1e3);
        let gflops_per_s = flops_per_token * tokens_per_s / 1e9;
        let line = serde_json::json!({
            "bench": "train_step",
            "threads": summary.threads,
            "tokens_per_s": (tokens_per_s * 10.0).round() / 10.0,
            "tokens_per_step": tokens_per_step,
            "step_ms": (mean_ms * 100.0).round() / 100.0,
            "step_ms_median": (median_ms * 100.0).round() / 100.0,
            "step_ms_min": (sorted[0] * 100.0).round() / 100.0,
            "params": summary.params,
            "flops_per_token": flops_per_token,
            "gflops_per_s": (gflops_per_s * 100.0).round() / 100.0,
            "share_of_fma_peak": (gflops_per_s / fma.gflops_per_s * 1000.0).round() / 1000.0,
            "steps": timed.len(),
            "warmup": args.warmup,
            "final_loss": (summary.final_loss * 1e4).round() / 1e4,
            "config": {"family": args.family, "layers": 4, "d_model": 256, "heads": 4,
                       "kv_heads": spec.model.key_value_heads(), "ffn_hidden": spec.model.d_ff(),
                       "seq_len": args.seq_len, "vocab": 256,
                       "batch": args.batch, "dtype": args.precision.as_str(), "checkpointing": args.checkpointing,
                       "attention": args.attention,
                       "optim": "AdamW", "tied": false},
            "peak_mib": peak.map(|p| {
                let mib = |b: u64| (b as f64 / 1048576.0 * 100.0).round() / 100.0;
                serde_json::json!({
                    "parameters": mib(p.parameters), "gradients": mib(p.gradients),
                    "optimizer_state": mib(p.optimizer_state), "activations": mib(p.activations),
                    "activation_grads": mib(p.activation_grads), "total": mib(p.total),
                })
            }),
        });
        println!("{line}");
    }
}
