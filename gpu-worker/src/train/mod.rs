//! The training of one rank: the entry point the CLI and the worker loop call.
//!
//! One optimizer step = `micro_batches * grad_accum` micro-batches of `micro_batch`
//! sequences, run one after another with their gradients accumulated (with pp = 1
//! pipeline micro-batches and accumulation steps are the same thing). Each token's
//! loss is weighted by 1 / (tokens in the step), so the reported loss and the
//! gradient are those of the mean over the global batch. Then: the global gradient
//! norm (reported before clipping), clipping, the learning rate of the step, the
//! optimizer update.
//!
//! `trainer.rs` holds the trainer and its step, `run.rs` the step loop with its
//! checkpoints, `report.rs` what a run reports, `fits.rs` whether a run fits the machine,
//! `cpu.rs` and `cuda.rs` a rank on each backend; this file picks the backend.

mod cpu;
#[cfg(feature = "cuda")]
pub mod cuda;
mod fits;
mod options;
mod report;
mod run;
mod trainer;

pub use crate::error::TrainError;
pub use fits::{available_memory_bytes, memory_bytes, ranks_fit, total_memory_bytes};
pub use options::{CheckpointOptions, TrainOptions};
pub use report::{RankRun, CHECKPOINT_LOG, REJOIN_LOG};
pub use trainer::{CpuTrainer, Groups, StepStats, Trainer, SPAN_STEPS};

use std::sync::atomic::AtomicBool;

use distlab_common::trace::RankTrace;
use distlab_common::{BackendKind, ExperimentSpec, Precision, RunEvent, RunSummary, ValidSpec};

/// Every feature of a valid spec that this worker cannot run yet, one message each.
pub fn unsupported_features(spec: &ExperimentSpec) -> Vec<String> {
    let backend = spec.backend.as_str();
    #[allow(unused_mut)]
    let mut out: Vec<String> = distlab_common::backends::unsupported_on_backend(spec)
        .iter()
        .map(|why| format!("backend={backend}: {why}"))
        .collect();
    #[cfg(not(feature = "cuda"))]
    if spec.backend == BackendKind::Cuda {
        out.push("backend=cuda: this worker was built without the cuda feature (cargo build --features cuda)".into());
    }
    out
}

/// Trains `spec` on this process (one rank), reporting every optimizer step to
/// `on_event`, and checking `cancel` between steps.
pub fn train(
    spec: &ValidSpec,
    opts: &TrainOptions,
    on_event: &mut dyn FnMut(RunEvent),
    cancel: &AtomicBool,
) -> Result<RunSummary, TrainError> {
    let unsupported = unsupported_features(spec);
    if !unsupported.is_empty() {
        return Err(TrainError::Unsupported(unsupported.join("; ")));
    }
    if spec.world_size() > 1 {
        let p = &spec.parallel;
        return Err(TrainError::Unsupported(format!(
            "parallel.dp={} x tp={} x pp={}: a run of several ranks runs one process per rank; start it through \
             the launcher (distlab-worker run or a server), not in this process",
            p.dp, p.tp, p.pp
        )));
    }
    let groups = Groups {
        offload_dir: opts.offload_dir.clone(),
        dataset: opts.dataset.clone(),
        cut_text: opts.cut_text.clone(),
        ..Groups::default()
    };
    let run = train_rank(spec, opts, groups, on_event, cancel)?;
    on_event(RunEvent::Trace(RankTrace {
        rank: 0,
        world: 1,
        span_steps: SPAN_STEPS,
        spans: run.spans,
        comm: Default::default(),
        memory: Some(run.memory),
        host: None,
        applied_gradients: Vec::new(),
    }));
    Ok(run.summary)
}

/// Trains this rank's part of `spec`: the whole run when `dp` is None. Every rank reports
/// the same (global) metrics.
pub fn train_rank(
    spec: &ValidSpec,
    opts: &TrainOptions,
    groups: Groups,
    on_event: &mut dyn FnMut(RunEvent),
    cancel: &AtomicBool,
) -> Result<RankRun, TrainError> {
    match (spec.backend, spec.train.precision) {
        (BackendKind::Cpu, Precision::Fp32) => cpu::train_on_cpu::<f32>(spec, opts, groups, on_event, cancel),
        (BackendKind::Cpu, Precision::Bf16) => cpu::train_on_cpu::<half::bf16>(spec, opts, groups, on_event, cancel),
        (BackendKind::Cpu, Precision::Fp16) => cpu::train_on_cpu::<half::f16>(spec, opts, groups, on_event, cancel),
        #[cfg(feature = "cuda")]
        (BackendKind::Cuda, precision) => cuda::train_on_gpu(precision, spec, opts, groups, on_event, cancel),
        #[cfg(not(feature = "cuda"))]
        (BackendKind::Cuda, _) => Err(TrainError::Unsupported(unsupported_features(spec).join("; "))),
    }
}
