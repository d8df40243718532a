//! Trains a GPT on one GPU with the CUDA backend (dp = 1) and reports its speed: tokens/s
//! over the timed steps, and MFU against the GPU's dense peak for the precision (H100 SXM
//! datasheet: 989 TFLOP/s bf16, 67 TFLOP/s fp32; the engine multiplies fp32 in fp32, not
//! TF32). Model FLOPs per token are `ModelSpec::train_flops_per_token` (6 x params plus
//! the attention square), the count the planner and the seed texts use.
//!
//! `cargo run --release --features cuda --example cuda_train -- --layers 12 --d-model 768
//!  --heads 12 --seq-len 1024 --vocab 50304 --micro-batch 8 --precision bf16 --steps 20`
//!
//! Prints the loss of every step and one JSON line at the end.

use std::time::Instant;

use clap::Parser;
use distlab_common::estimate::Cluster;
use distlab_common::{Checkpointing, ExperimentSpec, Limits, ModelSpec, Precision, ValidSpec};
use distlab_worker::backend::cuda::{CudaBackend, DeviceElem};
use distlab_worker::memory::MemoryTracker;
use distlab_worker::train::{Groups, Trainer};

#[derive(Parser, Debug)]
struct Args {
    #[arg(long, default_value_t = 12)]
    layers: usize,
    #[arg(long, default_value_t = 768)]
    d_model: usize,
    #[arg(long, default_value_t = 12)]
    heads: usize,
    #[arg(long, default_value_t = 1024)]
    seq_len: usize,
    #[arg(long, default_value_t = 50304)]
    vocab: usize,
    #[arg(long, default_value_t = 8)]
    micro_batch: usize,
    /// fp32, bf16 or fp16 (fp16 without loss scaling).
    #[arg(long, default_value = "bf16")]
    precision: String,
    /// none, every or sqrt.
    #[arg(long, default_value = "none")]
    checkpointing: String,
    /// Timed steps (after the warm-up ones).
    #[arg(long, default_value_t = 20)]
    steps: u64,
    #[arg(long, default_value_t = 3)]
    warmup: u64,
}

fn choice<T: serde::de::DeserializeOwned>(value: &str) -> T {
    serde_json::from_value(serde_json::Value::String(value.into())).unwrap_or_else(|e| panic!("{value}: {e}"))
}

fn main() {
    let args = Args::parse();
    let mut spec = ExperimentSpec {
        name: "cuda-train".into(),
        model: ModelSpec::dense(args.layers, args.d_model, args.heads, args.seq_len, args.vocab),
        ..ExperimentSpec::default()
    };
    spec.train.micro_batch = args.micro_batch;
    spec.train.micro_batches = 1;
    spec.train.grad_accum = 1;
    spec.train.steps = args.warmup + args.steps;
    spec.train.warmup_steps = 2;
    spec.train.lr = 6e-4;
    spec.train.precision = choice::<Precision>(&args.precision);
    spec.train.checkpointing = choice::<Checkpointing>(&args.checkpointing);
    // GPT-2 124M is larger than a shared server lets one experiment be: no size limits here.
    let limits = Limits { max_params: u64::MAX, max_tokens_per_step: usize::MAX, ..Limits::default() };
    let spec = spec.validated(&limits).unwrap_or_else(|errors| {
        errors.iter().for_each(|e| eprintln!("{e}"));
        std::process::exit(2)
    });
    match spec.train.precision {
        Precision::Fp32 => run::<f32>(&spec, &args),
        Precision::Bf16 => run::<half::bf16>(&spec, &args),
        Precision::Fp16 => run::<half::f16>(&spec, &args),
    }
}

fn run<S: DeviceElem>(spec: &ValidSpec, args: &Args) {
    let fail = |e: &dyn std::fmt::Display| -> ! {
        eprintln!("cannot train on the GPU: {e}");
        std::process::exit(2);
    };
    let backend = CudaBackend::<S>::new(0).unwrap_or_else(|e| fail(&e));
    let device = backend.device().to_string();
    // The same trainer the worker runs, here for one rank alone on GPU 0.
    let mut trainer =
        Trainer::build(spec, backend, MemoryTracker::new(), Groups::default()).unwrap_or_else(|e| fail(&e));
    eprintln!("{device}");
    eprintln!("{}", trainer.data().describe());
    let params = trainer.model().layout.total;
    let tokens_per_step = (spec.train.micro_batch * spec.model.seq_len) as f64;
    let mut timed = 0.0;
    let mut last_loss = f64::NAN;
    for step in 0..spec.train.steps {
        let start = Instant::now();
        let stats = trainer.step(step).expect("step");
        let seconds = start.elapsed().as_secs_f64();
        if step >= args.warmup {
            timed += seconds;
        }
        last_loss = stats.loss;
        eprintln!(
            "step {step:3}: loss {:.4}  grad norm {:.3}  {:.1} ms  {:.0} tokens/s",
            stats.loss,
            stats.grad_norm,
            seconds * 1e3,
            tokens_per_step / seconds
        );
    }
    let tokens_per_s = tokens_per_step * args.steps as f64 / timed;
    let flops_per_token = spec.model.train_flops_per_token();
    let achieved = flops_per_token * tokens_per_s;
    let peak = Cluster::h100_80gb_sxm().peak_flops(spec.train.precision);
    let memory = trainer.memory_report();
    println!(
        "{}",
        serde_json::json!({
            "bench": "cuda_train",
            "device": device,
            "precision": spec.train.precision.as_str(),
            "checkpointing": args.checkpointing,
            "params": params,
            "micro_batch": spec.train.micro_batch,
            "seq_len": spec.model.seq_len,
            "steps": args.steps,
            "step_ms": timed / args.steps as f64 * 1e3,
            "tokens_per_s": tokens_per_s,
            "model_tflops_per_s": achieved / 1e12,
            "peak_tflops_per_s": peak / 1e12,
            "mfu": achieved / peak,
            "final_loss": last_loss,
            "held_mib": trainer.held_bytes() as f64 / (1u64 << 20) as f64,
            "ledger_peak_mib": memory.peak.total as f64 / (1u64 << 20) as f64,
        })
    );
}
