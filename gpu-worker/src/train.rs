//! The training loop of one rank: the entry point the CLI and the worker loop call.
//!
//! One optimizer step = `micro_batches * grad_accum` micro-batches of `micro_batch`
//! sequences, run one after another with their gradients accumulated (with pp = 1
//! pipeline micro-batches and accumulation steps are the same thing). Each token's
//! loss is weighted by 1 / (tokens in the step), so the reported loss and the
//! gradient are those of the mean over the global batch. Then: the global gradient
//! norm (reported before clipping), clipping, the learning rate of the step, the
//! optimizer update.

use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Instant;

use distlab_common::{
    BackendKind, Checkpointing, ExperimentSpec, FieldError, Limits, LogLevel, LogLine, LossScaling, MetricPoint,
    Precision, RunEvent, RunSummary, Sharding,
};

use distlab_common::trace::{Span, SpanKind};

use crate::backend::{Backend, CpuBackend};
use crate::comm::CommError;
use crate::data::{Data, DataError};
use crate::model::Gpt;
use crate::optim::{clip_scale, lr_at, Optimizer};
use crate::parallel::ddp::DataParallel;
use crate::trace::now_us;

/// How to run (not part of the experiment: results do not depend on it).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct TrainOptions {
    /// Kernel threads; 0 = all available cores.
    pub threads: usize,
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
         try a lower learning rate or gradient clipping"
    )]
    Diverged { step: u64, loss: f64, grad_norm: f64 },
    #[error("data: {0}")]
    Data(#[from] DataError),
    #[error(transparent)]
    Comm(#[from] CommError),
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
    let p = &spec.parallel;
    let t = &spec.train;
    let mut out = Vec::new();
    if p.tp > 1 {
        out.push(format!("parallel.tp={}: tensor parallelism is not yet supported by this worker; use tp=1", p.tp));
    }
    if p.pp > 1 {
        out.push(format!("parallel.pp={}: pipeline parallelism is not yet supported by this worker; use pp=1", p.pp));
    }
    if p.sharding != Sharding::None {
        out.push(format!(
            "parallel.sharding={}: ZeRO / FSDP sharding is not yet supported by this worker; use sharding=none",
            p.sharding.as_str()
        ));
    }
    if t.precision != Precision::Fp32 {
        out.push(format!(
            "train.precision={}: only fp32 training is supported by this worker so far; use precision=fp32",
            t.precision.as_str()
        ));
    }
    if t.loss_scaling != LossScaling::None {
        out.push(
            "train.loss_scaling=dynamic: loss scaling is not yet supported by this worker (it comes with fp16)".into(),
        );
    }
    if t.checkpointing != Checkpointing::None {
        let name = match t.checkpointing {
            Checkpointing::Every => "every",
            _ => "sqrt",
        };
        out.push(format!(
            "train.checkpointing={name}: activation checkpointing (recomputation) is not yet supported by this worker; \
             use checkpointing=none"
        ));
    }
    if t.checkpoint_every > 0 {
        out.push(format!(
            "train.checkpoint_every={}: saving checkpoints is not yet supported by this worker; use 0",
            t.checkpoint_every
        ));
    }
    if spec.backend == BackendKind::Cuda {
        out.push("backend=cuda: this worker has no CUDA backend yet; use backend=cpu".into());
    }
    out
}

/// Bytes the engine allocates for `spec`: parameters, gradients, optimizer state
/// and activations (fp32); what [`train`] checks against the available memory.
pub fn memory_bytes(spec: &ExperimentSpec) -> u64 {
    let params = spec.model.param_count();
    let optimizer_states = match spec.train.optimizer {
        distlab_common::Optimizer::Adamw => 2,
        distlab_common::Optimizer::Sgd => 0,
    };
    let activations = Gpt::<CpuBackend<f32>>::activation_floats_for(&spec.model, spec.train.micro_batch) as u64;
    4u64.saturating_mul(params.saturating_mul(2 + optimizer_states).saturating_add(activations))
}

/// Memory the kernel reports as available (Linux `MemAvailable`), when it can be read.
fn available_memory_bytes() -> Option<u64> {
    let info = std::fs::read_to_string("/proc/meminfo").ok()?;
    let line = info.lines().find(|l| l.starts_with("MemAvailable:"))?;
    let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kib * 1024)
}

/// What one optimizer step reports.
#[derive(Clone, Debug, PartialEq)]
pub struct StepStats {
    /// Mean loss over the step's global batch.
    pub loss: f64,
    pub lr: f64,
    /// Global L2 norm of the gradient, before clipping.
    pub grad_norm: f64,
    /// False when the loss or gradient was not finite: then nothing was updated.
    pub updated: bool,
}

/// A model, its optimizer and its data on the CPU backend, ready to take steps.
/// Call it from inside the rayon pool the backend was made for (see [`train`]).
pub struct Trainer {
    spec: ExperimentSpec,
    backend: CpuBackend<f32>,
    model: Gpt<CpuBackend<f32>>,
    optimizer: Optimizer<CpuBackend<f32>>,
    data: Data,
    inputs: Vec<u32>,
    targets: Vec<u32>,
    /// Data parallelism across rank processes (None: this process is the whole run).
    dp: Option<DataParallel>,
    /// Timeline spans of the first `SPAN_STEPS` steps (compute lane; comm spans come
    /// from the gradient synchroniser).
    pub spans: Vec<Span>,
}

/// Steps whose timeline is recorded span by span.
pub const SPAN_STEPS: u64 = 3;

fn span(kind: SpanKind, name: String, step: u64, lane: &str, start_us: u64, end_us: u64, layer: Option<u32>) -> Span {
    Span { kind, name, step, lane: lane.into(), start_us, end_us, layer, bucket: None, bytes: None }
}

impl Trainer {
    /// Builds everything a run needs; the spec must be valid and supported.
    pub fn new(spec: &ExperimentSpec, threads: usize) -> Result<Self, TrainError> {
        Self::with_data_parallel(spec, threads, None)
    }

    /// A trainer for one rank of a data-parallel group (`dp`), or the whole run (None).
    pub fn with_data_parallel(
        spec: &ExperimentSpec,
        threads: usize,
        dp: Option<DataParallel>,
    ) -> Result<Self, TrainError> {
        let backend = CpuBackend::<f32>::new(threads);
        let data = Data::new(&spec.data, &spec.model, spec.global_batch())?;
        let model = Gpt::new(&backend, &spec.model, spec.train.micro_batch, spec.train.seed);
        let optimizer = Optimizer::new(&backend, &spec.train, model.layout.param_groups(), model.layout.total);
        let tokens = spec.train.micro_batch * spec.model.seq_len;
        Ok(Self {
            spec: spec.clone(),
            backend,
            model,
            optimizer,
            data,
            inputs: vec![0; tokens],
            targets: vec![0; tokens],
            dp,
            spans: Vec::new(),
        })
    }

    pub fn model(&self) -> &Gpt<CpuBackend<f32>> {
        &self.model
    }

    pub fn data(&self) -> &Data {
        &self.data
    }

    /// Optimizer step `step` (0-based): forward + backward over every micro-batch of this
    /// rank's slice of the global batch, the gradient sum across data-parallel ranks, then
    /// the update (the same on every rank).
    pub fn step(&mut self, step: u64) -> Result<StepStats, TrainError> {
        let be = &self.backend;
        let t = &self.spec.train;
        let seq_len = self.spec.model.seq_len;
        let micro_steps = t.micro_batches * t.grad_accum;
        let (dp_rank, dp_world) = self.dp.as_ref().map_or((0, 1), |d| (d.rank, d.world));
        // Rank r takes sequences [r * per_rank, (r+1) * per_rank) of the global batch.
        let per_rank = micro_steps * t.micro_batch;
        let step_tokens = dp_world * per_rank * seq_len;
        let dloss = 1.0 / step_tokens as f64;
        let record = step < SPAN_STEPS;
        let layers = self.spec.model.layers;

        self.model.zero_grads(be);
        let mut loss_sum = 0.0;
        for micro in 0..micro_steps {
            let first_sequence = dp_rank * per_rank + micro * t.micro_batch;
            self.data.fill_batch(step, first_sequence, t.micro_batch, seq_len, &mut self.inputs, &mut self.targets);
            let forward_start = now_us();
            loss_sum += self.model.forward(be, &self.inputs, &self.targets);
            let mut mark = now_us();
            if record {
                self.spans.push(span(
                    SpanKind::Forward,
                    format!("forward {micro}"),
                    step,
                    "compute",
                    forward_start,
                    mark,
                    None,
                ));
            }
            // Gradients are summed across ranks once per step: only the last micro-step's
            // backward hands finished buckets to the communication thread (no_sync before).
            let last = micro + 1 == micro_steps;
            let mut sync = if last { self.dp.as_mut().map(|d| &mut d.grads) } else { None };
            if let Some(sync) = sync.as_mut() {
                sync.begin_step(step, record);
            }
            let spans = &mut self.spans;
            self.model.backward_with(be, &self.inputs, &self.targets, dloss, &mut |unit, grads| {
                let now = now_us();
                if record {
                    let (name, layer) = match unit {
                        0 => ("backward head".to_string(), None),
                        u if u <= layers => (format!("backward layer {}", layers - u), Some((layers - u) as u32)),
                        _ => ("backward embeddings".to_string(), None),
                    };
                    spans.push(span(SpanKind::Backward, name, step, "compute", mark, now, layer));
                }
                mark = now;
                if let Some(sync) = sync.as_mut() {
                    sync.unit_ready(unit, grads);
                }
            });
        }
        if let Some(dp) = self.dp.as_mut() {
            let wait_start = now_us();
            dp.grads.finish(&mut self.model.grads)?;
            if record {
                self.spans.push(span(
                    SpanKind::Idle,
                    "wait for gradients".into(),
                    step,
                    "compute",
                    wait_start,
                    now_us(),
                    None,
                ));
            }
            loss_sum = dp.sum_scalar(loss_sum)?;
        }
        let optimizer_start = now_us();
        let loss = loss_sum * dloss;
        let grad_norm = be.sum_squares(be.all(&self.model.grads)).sqrt();
        let lr = lr_at(t, step);
        let updated = loss.is_finite() && grad_norm.is_finite();
        if updated {
            let scale = clip_scale(grad_norm, t.grad_clip);
            self.optimizer.step(be, &mut self.model.params, &self.model.grads, lr, scale);
        }
        if record {
            self.spans.push(span(
                SpanKind::Optimizer,
                "optimizer".into(),
                step,
                "compute",
                optimizer_start,
                now_us(),
                None,
            ));
        }
        Ok(StepStats { loss, lr, grad_norm, updated })
    }

    /// This rank's timeline so far: compute spans and the communication thread's spans.
    pub fn timeline(&self) -> Vec<Span> {
        let mut spans = self.spans.clone();
        if let Some(dp) = &self.dp {
            spans.extend(dp.grads.spans.iter().cloned());
        }
        spans.sort_by_key(|s| s.start_us);
        spans
    }
}

fn log(on_event: &mut dyn FnMut(RunEvent), message: String) {
    on_event(RunEvent::Log(LogLine { level: LogLevel::Info, message }));
}

fn mib(floats: usize) -> f64 {
    (floats * 4) as f64 / (1024.0 * 1024.0)
}

/// Trains `spec` on this process (one rank), reporting every optimizer step to
/// `on_event`, and checking `cancel` between steps.
pub fn train(
    spec: &ExperimentSpec,
    opts: &TrainOptions,
    on_event: &mut dyn FnMut(RunEvent),
    cancel: &AtomicBool,
) -> Result<RunSummary, TrainError> {
    let unsupported = unsupported_features(spec);
    if !unsupported.is_empty() {
        return Err(TrainError::Unsupported(unsupported.join("; ")));
    }
    if spec.parallel.dp > 1 {
        return Err(TrainError::Unsupported(format!(
            "parallel.dp={}: data parallelism runs one process per rank; start it through the launcher \
             (distlab-worker run or a server), not in this process",
            spec.parallel.dp
        )));
    }
    train_rank(spec, opts, None, on_event, cancel).map(|(summary, _)| summary)
}

/// Trains this rank's part of `spec`: the whole run when `dp` is None. Every rank reports
/// the same (global) metrics. Returns the summary and this rank's timeline spans.
pub fn train_rank(
    spec: &ExperimentSpec,
    opts: &TrainOptions,
    dp: Option<DataParallel>,
    on_event: &mut dyn FnMut(RunEvent),
    cancel: &AtomicBool,
) -> Result<(RunSummary, Vec<Span>), TrainError> {
    let started = Instant::now();
    let world = dp.as_ref().map_or(1, |d| d.world);
    spec.validate(&Limits::default()).map_err(TrainError::Invalid)?;
    let unsupported = unsupported_features(spec);
    if !unsupported.is_empty() {
        return Err(TrainError::Unsupported(unsupported.join("; ")));
    }
    let needed = memory_bytes(spec);
    if let Some(available) = available_memory_bytes() {
        // Leave a quarter for the rest of the machine (and the other ranks, later).
        if needed > available / 4 * 3 {
            return Err(TrainError::OutOfMemory { needed_mib: needed >> 20, available_mib: available >> 20 });
        }
    }
    let threads = match opts.threads {
        0 => std::thread::available_parallelism().map_or(1, |n| n.get()),
        n => n,
    };
    let pool = rayon::ThreadPoolBuilder::new()
        .num_threads(threads)
        .thread_name(|i| format!("distlab-kernel-{i}"))
        .build()
        .map_err(|e| TrainError::Threads { threads, message: e.to_string() })?;
    let mut trainer = pool.install(|| Trainer::with_data_parallel(spec, threads, dp))?;

    let m = &spec.model;
    let t = &spec.train;
    let params = trainer.model().layout.total;
    log(
        on_event,
        format!(
            "model: GPT with {params} parameters ({:.2} MiB fp32): {} layers, d_model {}, {} heads, seq_len {}, \
             vocab {}, LM head not tied to the embedding",
            mib(params),
            m.layers,
            m.d_model,
            m.heads,
            m.seq_len,
            m.vocab
        ),
    );
    log(on_event, trainer.data().describe());
    log(
        on_event,
        format!(
            "memory (fp32): parameters {:.2} MiB, gradients {:.2} MiB, optimizer state {:.2} MiB, \
             activations {:.2} MiB",
            mib(params),
            mib(params),
            mib(params * trainer.optimizer.state_floats_per_param()),
            mib(trainer.model().activation_floats())
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

    let tokens_per_step = spec.tokens_per_step();
    let mut final_loss = f64::NAN;
    let mut min_loss = f64::INFINITY;
    let mut timed_seconds = 0.0;
    let mut timed_steps = 0u64;
    for step in 0..t.steps {
        if cancel.load(Ordering::Relaxed) {
            return Err(TrainError::Cancelled);
        }
        let step_start = Instant::now();
        let stats = pool.install(|| trainer.step(step))?;
        let seconds = step_start.elapsed().as_secs_f64();
        if !stats.updated {
            return Err(TrainError::Diverged { step, loss: stats.loss, grad_norm: stats.grad_norm });
        }
        on_event(RunEvent::Metric(MetricPoint {
            step,
            loss: stats.loss,
            lr: stats.lr,
            grad_norm: stats.grad_norm,
            tokens_per_s: tokens_per_step as f64 / seconds,
            step_ms: seconds * 1e3,
        }));
        final_loss = stats.loss;
        min_loss = min_loss.min(stats.loss);
        // The first step pays for warm-up (page faults, caches): leave it out when there are more.
        if step > 0 || t.steps == 1 {
            timed_seconds += seconds;
            timed_steps += 1;
        }
    }
    let timed_tokens = timed_steps as f64 * tokens_per_step as f64;
    let summary = RunSummary {
        steps: t.steps,
        final_loss,
        min_loss,
        uniform_loss: (m.vocab as f64).ln(),
        loss_floor: trainer.data().loss_floor(),
        params: params as u64,
        tokens: t.steps * tokens_per_step as u64,
        tokens_per_s: if timed_seconds > 0.0 { timed_tokens / timed_seconds } else { 0.0 },
        mean_step_ms: if timed_steps > 0 { timed_seconds * 1e3 / timed_steps as f64 } else { 0.0 },
        wall_s: started.elapsed().as_secs_f64(),
        world_size: world,
        threads,
        collective: None,
    };
    Ok((summary, trainer.timeline()))
}
