//! The training loop of one rank: the entry point the CLI and the worker loop call.
//!
//! One optimizer step = `micro_batches * grad_accum` micro-batches of `micro_batch`
//! sequences, run one after another with their gradients accumulated (with pp = 1
//! pipeline micro-batches and accumulation steps are the same thing). Each token's
//! loss is weighted by 1 / (tokens in the step), so the reported loss and the
//! gradient are those of the mean over the global batch. Then: the global gradient
//! norm (reported before clipping), clipping, the learning rate of the step, the
//! optimizer update.
//!
//! `trainer.rs` holds the trainer and its step, `report.rs` what a run reports; this file
//! is the run itself: checks, the kernel threads, the step loop with its checkpoints.

mod report;
mod trainer;

pub(crate) use report::{log, mib_bytes, StepTally};
use report::{mib, report_checkpoints};
pub use report::{RankRun, CHECKPOINT_LOG};
pub use trainer::{CpuTrainer, Groups, StepStats, Trainer, SPAN_STEPS};

use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Instant;

use distlab_common::planner::OFFLOAD_PIECE_ELEMENTS;
use distlab_common::trace::RankTrace;
use distlab_common::{
    BackendKind, CheckpointWrite, ExperimentSpec, FieldError, Offload, Precision, RunEvent, RunSummary, ValidSpec,
};

use crate::backend::{CpuBackend, Stored};
use crate::checkpoint::{self, CheckpointDir, CheckpointError, CheckpointWriter};
use crate::comm::CommError;
use crate::data::DataError;
use crate::model::Gpt;
use crate::parallel::TrainBackend;

/// How to run (not part of the experiment: results do not depend on it).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct TrainOptions {
    /// Kernel threads; 0 = all available cores.
    pub threads: usize,
    /// Where checkpoints go (None: the run saves none, whatever `checkpoint_every` says).
    pub checkpoints: Option<CheckpointOptions>,
    /// Where `parallel.offload=disk` keeps the optimizer's state (None: the system's
    /// temporary directory).
    pub offload_dir: Option<PathBuf>,
    /// Where each rank writes its final parameters when the run succeeds (`export.rs`
    /// puts them together; None: not written).
    pub final_weights: Option<PathBuf>,
    /// The text of `data.dataset: upload` (None for the built-in datasets).
    pub dataset: Option<PathBuf>,
}

/// The run's checkpoint directory and the step to resume from.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CheckpointOptions {
    /// The experiment's directory (see `checkpoint.rs`), made ready by `CheckpointDir::prepare`.
    pub dir: PathBuf,
    /// Resume from the complete checkpoint of this step.
    pub resume_from: Option<u64>,
}

#[derive(Debug, thiserror::Error)]
pub enum TrainError {
    #[error("invalid spec: {}", join_field_errors(.0))]
    Invalid(Vec<FieldError>),
    /// A valid spec asking for something this worker does not implement yet.
    #[error("{0}")]
    Unsupported(String),
    #[error("cancelled")]
    Cancelled,
    #[error(
        "training diverged at step {step}: loss {loss}, gradient norm {grad_norm} (not finite); \
         try a lower learning rate or gradient clipping (with fp16: loss_scaling=dynamic)"
    )]
    Diverged { step: u64, loss: f64, grad_norm: f64 },
    #[error("data: {0}")]
    Data(#[from] DataError),
    #[error(transparent)]
    Checkpoint(#[from] CheckpointError),
    #[error(transparent)]
    Comm(#[from] CommError),
    #[error(transparent)]
    Offload(#[from] crate::offload::OffloadError),
    /// The GPU or its libraries failed (not the spec's fault).
    #[error("GPU: {0}")]
    Device(String),
    #[error("could not start {threads} kernel threads: {message}")]
    Threads { threads: usize, message: String },
    /// The run would need more memory than this machine has available.
    #[error(
        "this run needs about {needed_mib} MiB (parameters, gradients, optimizer state and activations) but only \
         {available_mib} MiB are available on this worker; use a smaller micro_batch, seq_len or model"
    )]
    OutOfMemory { needed_mib: u64, available_mib: u64 },
}

fn join_field_errors(errors: &[FieldError]) -> String {
    errors.iter().map(|e| e.to_string()).collect::<Vec<_>>().join("; ")
}

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

/// Bytes the engine allocates for `spec` on one rank at most: parameters, gradients,
/// optimizer state (all counted whole, fp32 master weights included, unless offloaded) and
/// activations; what [`train`] checks against the available memory.
pub fn memory_bytes(spec: &ExperimentSpec) -> u64 {
    let params = spec.model.param_count();
    let (model_bytes, master) = match spec.train.precision {
        Precision::Fp32 => (4u64, 0u64),
        Precision::Bf16 | Precision::Fp16 => (2, 1),
    };
    let optimizer_states = match spec.train.optimizer {
        distlab_common::Optimizer::Adamw => 2 + master,
        distlab_common::Optimizer::Sgd => master,
    };
    let activations = Gpt::<CpuBackend<f32>>::activation_floats_for(
        &spec.model,
        spec.train.micro_batch,
        (spec.parallel.tp, spec.parallel.ep),
        spec.train.attention,
        spec.parallel.sequence_parallel,
    ) as u64;
    // ZeRO-Offload: the state leaves the device (a disk state's piece stays in host memory,
    // which is the CPU backend's device).
    let optimizer_params = match (spec.parallel.offload, spec.backend) {
        (Offload::None, _) => params,
        (Offload::Disk, BackendKind::Cpu) => params.min(OFFLOAD_PIECE_ELEMENTS as u64),
        (Offload::Host | Offload::Disk, _) => 0,
    };
    let model = model_bytes.saturating_mul(params.saturating_mul(2).saturating_add(activations));
    model.saturating_add(optimizer_params.saturating_mul(4 * optimizer_states))
}

/// Memory the kernel reports as available (Linux `MemAvailable`), when it can be read.
pub fn available_memory_bytes() -> Option<u64> {
    meminfo("MemAvailable:")
}

/// The machine's physical memory (Linux `MemTotal`), when it can be read.
pub fn total_memory_bytes() -> Option<u64> {
    meminfo("MemTotal:")
}

fn meminfo(field: &str) -> Option<u64> {
    let info = std::fs::read_to_string("/proc/meminfo").ok()?;
    let line = info.lines().find(|l| l.starts_with(field))?;
    let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kib * 1024)
}

/// Whether every rank of `spec` fits in `available` bytes together (the planner's count
/// of what they hold, against three quarters of it: the rest is the machine's), checked
/// before the ranks start so that a run too big fails saying so instead of being killed.
pub fn ranks_fit(spec: &ExperimentSpec, available: u64) -> Result<(), TrainError> {
    let Ok(plan) = distlab_common::planner::plan(spec) else { return Ok(()) };
    let needed = plan.memory_of_all_ranks();
    if needed > available / 4 * 3 {
        return Err(TrainError::OutOfMemory { needed_mib: needed >> 20, available_mib: available >> 20 });
    }
    Ok(())
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
    let groups = Groups { offload_dir: opts.offload_dir.clone(), dataset: opts.dataset.clone(), ..Groups::default() };
    let run = train_rank(spec, opts, groups, on_event, cancel)?;
    on_event(RunEvent::Trace(RankTrace {
        rank: 0,
        world: 1,
        span_steps: SPAN_STEPS,
        spans: run.spans,
        comm: Default::default(),
        memory: Some(run.memory),
        host: None,
    }));
    Ok(run.summary)
}

/// Loads this rank's part of the checkpoint of `step` (and DP rank 0's, for the state it
/// writes for the whole group); returns the run's lowest loss so far.
fn resume<B: TrainBackend>(trainer: &mut Trainer<B>, dir: &CheckpointDir, step: u64) -> Result<f64, CheckpointError> {
    let place = trainer.place();
    let own = checkpoint::read(&dir.file(step, place))?;
    let zero = if place.dp == 0 { None } else { Some(checkpoint::read(&dir.file(step, place.dp_rank_zero()))?) };
    trainer
        .restore(&own, zero.as_ref().unwrap_or(&own))
        .map_err(|why| CheckpointError::Mismatch { path: dir.file(step, place), why })?;
    Ok(own.min_loss)
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
        (BackendKind::Cpu, Precision::Fp32) => train_on_cpu::<f32>(spec, opts, groups, on_event, cancel),
        (BackendKind::Cpu, Precision::Bf16) => train_on_cpu::<half::bf16>(spec, opts, groups, on_event, cancel),
        (BackendKind::Cpu, Precision::Fp16) => train_on_cpu::<half::f16>(spec, opts, groups, on_event, cancel),
        #[cfg(feature = "cuda")]
        (BackendKind::Cuda, precision) => {
            crate::cuda_rank::train_on_gpu(precision, spec, opts, groups, on_event, cancel)
        }
        #[cfg(not(feature = "cuda"))]
        (BackendKind::Cuda, _) => Err(TrainError::Unsupported(unsupported_features(spec).join("; "))),
    }
}

/// Kernel threads `opts` asks for (0: every core), in a rayon pool of their own.
pub(crate) fn kernel_pool(opts: &TrainOptions) -> Result<(rayon::ThreadPool, usize), TrainError> {
    let threads = match opts.threads {
        0 => std::thread::available_parallelism().map_or(1, |n| n.get()),
        n => n,
    };
    let pool = rayon::ThreadPoolBuilder::new()
        .num_threads(threads)
        .thread_name(|i| format!("distlab-kernel-{i}"))
        .build()
        .map_err(|e| TrainError::Threads { threads, message: e.to_string() })?;
    Ok((pool, threads))
}

/// [`train_rank`] on the CPU backend, with the model's parameters, gradients and
/// activations stored as `S`.
fn train_on_cpu<S: Stored<Acc = f32>>(
    spec: &ValidSpec,
    opts: &TrainOptions,
    groups: Groups,
    on_event: &mut dyn FnMut(RunEvent),
    cancel: &AtomicBool,
) -> Result<RankRun, TrainError> {
    let started = Instant::now();
    let needed = memory_bytes(spec);
    if let Some(available) = available_memory_bytes() {
        // Leave a quarter for the rest of the machine (and the other ranks, later).
        if needed > available / 4 * 3 {
            return Err(TrainError::OutOfMemory { needed_mib: needed >> 20, available_mib: available >> 20 });
        }
    }
    let (pool, threads) = kernel_pool(opts)?;
    let trainer = pool.install(|| CpuTrainer::<S>::with_groups(spec, threads, groups))?;
    run(spec, opts, trainer, &pool, threads, started, on_event, cancel)
}

/// Runs `trainer`'s steps from its first to the spec's last, in `pool`: reports every
/// step, writes and reports checkpoints, and sums the run up. The same for every backend.
#[allow(clippy::too_many_arguments)]
pub(crate) fn run<B: TrainBackend>(
    spec: &ExperimentSpec,
    opts: &TrainOptions,
    mut trainer: Trainer<B>,
    pool: &rayon::ThreadPool,
    threads: usize,
    started: Instant,
    on_event: &mut dyn FnMut(RunEvent),
    cancel: &AtomicBool,
) -> Result<RankRun, TrainError> {
    let (world, sharding) = (spec.world_size(), spec.parallel.sharding);
    let stored = <B::Elem as Stored>::NAME;
    let m = &spec.model;
    let t = &spec.train;
    let params = trainer.model().layout.total;
    log(
        on_event,
        format!(
            "model: GPT with {params} parameters ({:.2} MiB in {}): {} layers, d_model {}, {} heads, seq_len {}, \
             vocab {}, LM head not tied to the embedding",
            mib_bytes((params * size_of::<B::Elem>()) as u64),
            stored,
            m.layers,
            m.d_model,
            m.heads,
            m.seq_len,
            m.vocab
        ),
    );
    log(on_event, trainer.data().describe());
    let held = trainer.memory.current();
    log(
        on_event,
        format!(
            "memory of this rank ({}, {}): parameters {:.2} MiB, gradients {:.2} MiB, optimizer state {:.2} MiB, \
             activations {:.2} MiB, their gradients {:.2} MiB, communication buckets {:.2} MiB",
            sharding.as_str(),
            stored,
            mib_bytes(held.parameters),
            mib_bytes(held.gradients),
            mib_bytes(held.optimizer_state),
            mib_bytes(held.activations),
            mib_bytes(held.activation_grads),
            mib_bytes(held.comm_buffers)
        ),
    );
    log(
        on_event,
        format!(
            "training: {} steps of {} sequences x {} tokens ({} micro-batch(es) of {}), {:?}, lr {} ({:?}, {} warmup \
             steps), {} kernel thread(s) on the {} backend",
            t.steps,
            spec.global_batch(),
            m.seq_len,
            t.micro_batches * t.grad_accum,
            t.micro_batch,
            t.optimizer,
            t.lr,
            t.lr_schedule,
            t.warmup_steps,
            threads,
            trainer.backend.name()
        ),
    );

    let mut first_step = 0;
    let mut min_loss = f64::INFINITY;
    let mut writer = None;
    if let Some(c) = &opts.checkpoints {
        let dir = CheckpointDir::new(&c.dir, world);
        if let Some(step) = c.resume_from.filter(|&s| s > 0) {
            min_loss = resume(&mut trainer, &dir, step)?;
            first_step = step;
            log(
                on_event,
                format!("resumed from the checkpoint of step {step}: steps 0 to {} are not run again", step - 1),
            );
        }
        if t.checkpoint_every > 0 {
            let asynchronous = t.checkpoint_write == CheckpointWrite::Async;
            writer = Some(CheckpointWriter::new(dir, trainer.place(), asynchronous));
        }
    }
    let mut tally = StepTally::new(spec, first_step, min_loss);
    // Tensor-parallel all-reduces the evaluations made: (calls, payload bytes, bytes sent).
    let mut eval_tp = (0u64, 0u64, 0u64);
    for step in first_step..t.steps {
        if cancel.load(Ordering::Relaxed) {
            return Err(TrainError::Cancelled);
        }
        let step_start = Instant::now();
        let stats = pool.install(|| trainer.step(step))?;
        let seconds = step_start.elapsed().as_secs_f64();
        let evaluates = t.eval_every > 0 && ((step + 1) % t.eval_every == 0 || step + 1 == t.steps);
        let val_loss = if evaluates && stats.loss.is_finite() {
            let tp_before = trainer.model.tensor_parallel().map(|tp| tp.totals());
            let loss = pool.install(|| trainer.evaluate(step))?;
            // (the TP traffic reported at the end is training's)
            if let (Some(before), Some(tp)) = (tp_before, trainer.model.tensor_parallel()) {
                let after = tp.totals();
                eval_tp =
                    (eval_tp.0 + after.0 - before.0, eval_tp.1 + after.1 - before.1, eval_tp.2 + after.2 - before.2);
            }
            Some(loss)
        } else {
            None
        };
        tally.record(on_event, t.steps, step, &stats, seconds, val_loss)?;
        if let Some(writer) = &mut writer {
            let next = step + 1;
            if next % t.checkpoint_every == 0 && next < t.steps {
                let copy_start = Instant::now();
                let ckpt = trainer.checkpoint(next, tally.min_loss, writer.spare())?;
                writer.save(ckpt, copy_start.elapsed().as_secs_f64() * 1e3);
            }
            report_checkpoints(on_event, writer.finished(), trainer.place(), t.checkpoint_write);
        }
    }
    if let Some(writer) = writer {
        report_checkpoints(on_event, writer.finish(), trainer.place(), t.checkpoint_write);
    }
    if let Some((calls, payload, sent)) = trainer.model.tensor_parallel().map(|tp| tp.totals()) {
        let (calls, payload, sent) = (calls - eval_tp.0, payload - eval_tp.1, sent - eval_tp.2);
        let layers = trainer.model.stage.block_count();
        let steps_run = (t.steps - first_step) as f64;
        let per_layer = payload as f64 / (steps_run * (t.micro_batches * t.grad_accum * layers) as f64);
        log(
            on_event,
            format!(
                "tensor parallel (this rank's group): {calls} all-reduces of activations, {:.2} MiB in all \
                 ({:.3} MiB per layer per micro-batch, forward and backward together; 4 x b x s x d x 4 bytes = \
                 {:.3} MiB); this rank sent {:.2} MiB over the ring",
                mib_bytes(payload),
                per_layer / (1024.0 * 1024.0),
                mib(4 * t.micro_batch * m.seq_len * m.d_model),
                mib_bytes(sent)
            ),
        );
    }
    let summary = tally.summary(spec, params, trainer.data().loss_floor(), started.elapsed().as_secs_f64(), threads);
    // The ledger is read before the final weights' copy is booked in it.
    let run = RankRun { summary, spans: trainer.timeline(), memory: trainer.memory_report() };
    // The trained model is a by-product: a run whose weights cannot be written still
    // succeeded (the launcher then finds a rank's file missing and says the model was not
    // exported).
    if let Some(dir) = &opts.final_weights {
        let written = trainer.final_weights(t.steps).map_err(|e| e.to_string()).and_then(|weights| {
            let path = CheckpointDir::new(dir, world).file(t.steps, trainer.place());
            crate::checkpoint::write(&path, &weights).map_err(|e| e.to_string())
        });
        if let Err(e) = written {
            let message = format!("this rank's final weights were not written: {e}");
            on_event(RunEvent::Log(distlab_common::LogLine { level: distlab_common::LogLevel::Warn, message }));
        }
    }
    Ok(run)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The ranks' memory is checked together, before they start: dp=4 of a model whose one
    /// rank fits needs four times that.
    #[test]
    fn the_ranks_are_checked_together() {
        let mut spec = ExperimentSpec::default();
        spec.parallel.dp = 4;
        let all = distlab_common::planner::plan(&spec).unwrap().memory_of_all_ranks();
        let one = all / 4;
        assert!(ranks_fit(&spec, all / 3 * 4 + 4).is_ok());
        match ranks_fit(&spec, one * 2) {
            Err(TrainError::OutOfMemory { needed_mib, .. }) => assert_eq!(needed_mib, all >> 20),
            other => panic!("{other:?}"),
        }
    }
}
