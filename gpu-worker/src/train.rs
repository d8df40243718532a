//! The training loop of one rank: the entry point the CLI and the worker loop call.
//!
//! One optimizer step = `micro_batches * grad_accum` micro-batches of `micro_batch`
//! sequences, run one after another with their gradients accumulated (with pp = 1
//! pipeline micro-batches and accumulation steps are the same thing). Each token's
//! loss is weighted by 1 / (tokens in the step), so the reported loss and the
//! gradient are those of the mean over the global batch. Then: the global gradient
//! norm (reported before clipping), clipping, the learning rate of the step, the
//! optimizer update.

use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Instant;

use distlab_common::{
    BackendKind, CheckpointWrite, ExperimentSpec, FieldError, Limits, LogLevel, LogLine, LossScaling, MetricPoint,
    Precision, RunEvent, RunSummary, Sharding,
};

use distlab_common::trace::{RankTrace, Span, SpanKind};

use std::sync::Arc;

use distlab_common::memory::RankMemoryReport;

use crate::backend::{CpuBackend, Stored};
use crate::checkpoint::{self, CheckpointDir, CheckpointError, CheckpointWriter, RankCheckpoint, RankPlace, Written};
use crate::comm::CommError;
use crate::data::{Data, DataError};
use crate::loss_scale::{LossScaler, ScaledStep};
use crate::memory::MemoryTracker;
use crate::memory::{Category, Receipt};
use crate::model::gpt::TensorParallelGroup;
use crate::model::{Gpt, ModelState, OpenUnit, Pass, Saved, StageInput, Unit};
use crate::optim::{clip_scale, lr_at, needs_master, OptimizerState};
use crate::parallel::pipeline::{self, PipelineGroup, PipelineLinks};
use crate::parallel::schedule::{self, Action};
use crate::parallel::tensor::TensorParallel;
use crate::parallel::{self, DpGroup, SavedState, StateView, Strategy, TrainBackend};
use crate::trace::now_us;

/// How to run (not part of the experiment: results do not depend on it).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct TrainOptions {
    /// Kernel threads; 0 = all available cores.
    pub threads: usize,
    /// Where checkpoints go (None: the run saves none, whatever `checkpoint_every` says).
    pub checkpoints: Option<CheckpointOptions>,
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
    let mut out = Vec::new();
    if spec.backend == BackendKind::Cuda {
        #[cfg(feature = "cuda")]
        out.extend(
            distlab_common::backends::unsupported_on_backend(spec).iter().map(|why| format!("backend=cuda: {why}")),
        );
        #[cfg(not(feature = "cuda"))]
        out.push("backend=cuda: this worker was built without the cuda feature (cargo build --features cuda)".into());
    }
    out
}

/// Bytes the engine allocates for `spec` on one rank at most: parameters, gradients,
/// optimizer state (all counted whole, fp32 master weights included) and activations;
/// what [`train`] checks against the available memory.
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
    let activations =
        Gpt::<CpuBackend<f32>>::activation_floats_for(&spec.model, spec.train.micro_batch, spec.parallel.tp) as u64;
    let model = model_bytes.saturating_mul(params.saturating_mul(2).saturating_add(activations));
    model.saturating_add(params.saturating_mul(4 * optimizer_states))
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
    /// Global L2 norm of the gradient, before clipping (unscaled).
    pub grad_norm: f64,
    /// False when the loss or gradient was not finite: then nothing was updated.
    pub updated: bool,
    /// Dynamic loss scaling (fp16): the scale this step's loss was multiplied by, and
    /// the steps skipped so far (this one included when it was not updated).
    pub loss_scale: Option<(f64, u64)>,
}

/// A model, its strategy (parameters, gradients, optimizer state) and its data on the CPU
/// backend with buffers of `S` (f32; bf16 or fp16 for mixed precision), ready to take
/// steps. Call it from inside the rayon pool the backend was made for (see [`train`]).
pub struct Trainer<B: TrainBackend> {
    spec: ExperimentSpec,
    backend: B,
    model: Gpt<B>,
    strategy: Box<dyn Strategy<B>>,
    data: Data,
    inputs: Vec<u32>,
    targets: Vec<u32>,
    /// This rank's place in data parallelism: (rank, world).
    dp: (usize, usize),
    /// Its place in the whole mesh (its checkpoint file).
    place: RankPlace,
    /// The first step this process runs (after a resume, the checkpoint's).
    first_step: u64,
    /// Pipeline parallelism: the links to the neighbouring stages (None: one stage).
    links: Option<PipelineLinks>,
    /// Where a stage receives its input activation and its output's gradient.
    received: Received<B::Elem>,
    /// Dynamic loss scaling (fp16 with `loss_scaling: dynamic`).
    scaler: Option<LossScaler>,
    memory: Arc<MemoryTracker>,
    /// The staging pieces of the channels to the other ranks, booked.
    _transport: Receipt,
    /// Timeline spans of the first `SPAN_STEPS` steps (compute lane; comm spans come
    /// from the strategy).
    pub spans: Vec<Span>,
}

/// Steps whose timeline is recorded span by span (and whose memory is sampled).
pub const SPAN_STEPS: u64 = 3;

fn span(kind: SpanKind, name: String, step: u64, lane: &str, start_us: u64, end_us: u64, layer: Option<u32>) -> Span {
    Span { kind, name, step, lane: lane.into(), start_us, end_us, layer, bucket: None, bytes: None, micro: None }
}

/// The trainer on the CPU backend with buffers of `S`.
pub type CpuTrainer<S = f32> = Trainer<CpuBackend<S>>;

impl<S: Stored<Acc = f32>> Trainer<CpuBackend<S>> {
    /// Builds everything a run needs; the spec must be valid and supported.
    pub fn new(spec: &ExperimentSpec, threads: usize) -> Result<Self, TrainError> {
        Self::with_data_parallel(spec, threads, None)
    }

    /// A trainer for one rank of a data-parallel group (`dp`), or the whole run (None).
    pub fn with_data_parallel(spec: &ExperimentSpec, threads: usize, dp: Option<DpGroup>) -> Result<Self, TrainError> {
        Self::with_groups(spec, threads, Groups { dp, ..Groups::default() })
    }

    /// A trainer for one rank: its data-parallel group and its pipeline group.
    pub fn with_groups(spec: &ExperimentSpec, threads: usize, groups: Groups) -> Result<Self, TrainError> {
        let memory = MemoryTracker::new();
        let backend = CpuBackend::<S>::new(threads).booking_scratch_in(&memory);
        Self::build(spec, backend, memory, groups)
    }
}

impl<B: TrainBackend> Trainer<B> {
    /// A trainer for one rank on `backend`, booking into `memory`: its model, its
    /// strategy for its groups, its data.
    pub fn build(
        spec: &ExperimentSpec,
        backend: B,
        memory: Arc<MemoryTracker>,
        groups: Groups,
    ) -> Result<Self, TrainError> {
        let stored = <B::Elem as Stored>::NAME;
        if stored != spec.train.precision.as_str() {
            return Err(TrainError::Unsupported(format!(
                "train.precision={}: this trainer stores {stored} (the trainer must be made for the spec's precision)",
                spec.train.precision.as_str(),
            )));
        }
        let data = Data::new(&spec.data, &spec.model, spec.global_batch())?;
        // The channels to the other ranks: the rings' staging pieces (heap) are booked; the
        // pipes (shared memory, mostly never touched) are reported beside the ledger.
        let transport = memory.alloc(Category::Transport, (groups.staging_bytes(spec.parallel.sharding) / 4) as usize);
        memory.set_pipe_bytes(groups.pipe_bytes);
        let t = &spec.train;
        let (stage_index, stages) = groups.pp.as_ref().map_or((0, 1), |g| (g.stage, g.stages));
        let stage = pipeline::stage_of(spec.model.layers, stages, stage_index);
        let tp_rank = groups.tp.as_ref().map_or(0, |g| g.place().rank);
        let tp = groups.tp.map(|g| Box::new(g) as Box<dyn TensorParallelGroup<B>>);
        let saved = Saved { checkpointing: t.checkpointing };
        let model = Gpt::new_stage(&backend, &spec.model, t.micro_batch, stage.clone(), saved, tp, &memory);
        let place = groups.dp.as_ref().map_or((0, 1), |g| (g.rank, g.world));
        let strategy = parallel::build(spec, &backend, &model.layout, &stage, &memory, groups.dp)?;
        let activation = t.micro_batch * spec.model.seq_len * spec.model.d_model;
        let received =
            Received::new(&memory, if stage.first { 0 } else { activation }, if stage.last { 0 } else { activation });
        let links = groups.pp.map(|g| PipelineLinks::new(g, &memory));
        let tokens = spec.train.micro_batch * spec.model.seq_len;
        memory.mark_start_up();
        Ok(Self {
            spec: spec.clone(),
            backend,
            model,
            strategy,
            data,
            inputs: vec![0; tokens],
            targets: vec![0; tokens],
            dp: place,
            place: RankPlace { dp: place.0, tp: tp_rank, pp: stage_index },
            first_step: 0,
            links,
            received,
            scaler: (t.loss_scaling == LossScaling::Dynamic).then(LossScaler::default),
            memory,
            _transport: transport,
            spans: Vec::new(),
        })
    }

    /// Dynamic loss scaling: start at `scale` instead of 2^16 (for demos and tests of the
    /// overflow path). Without loss scaling in the spec it does nothing.
    pub fn start_loss_scale(&mut self, scale: f64) {
        if let Some(scaler) = &mut self.scaler {
            *scaler = LossScaler::new(scale);
        }
    }

    pub fn model(&self) -> &Gpt<B> {
        &self.model
    }

    pub fn data(&self) -> &Data {
        &self.data
    }

    /// What the memory ledger says this rank holds, by category, and what the process
    /// measured. On a GPU the ledger's buffers are device memory: the driver's count of it
    /// is reported, and the host heap is not set against them (no heap figures, no
    /// "untracked").
    pub fn memory_report(&self) -> RankMemoryReport {
        let mut report = self.memory.report(self.dp.0);
        if let Some(used) = self.backend.device_memory_used() {
            report.booked_heap_peak = None;
            if let Some(process) = report.process.as_mut() {
                (process.heap_peak, process.heap_current, process.start_up) = (None, None, None);
                process.device_used = Some(used);
            }
        }
        report
    }

    /// Bytes of every buffer the trainer holds, counted from the buffers themselves.
    pub fn held_bytes(&self) -> u64 {
        let received = (self.received.activation.len() + self.received.grad.len()) * size_of::<B::Elem>();
        self.model.held_bytes(&self.backend) + self.strategy.held_bytes(&self.backend) + received as u64
    }

    /// Optimizer step `step` (0-based): forward + backward over every micro-batch of this
    /// rank's slice of the global batch, in the order of the pipeline schedule (one stage:
    /// forward, backward, forward, ...), the gradient sum across data-parallel ranks, then
    /// the update (the same on every rank).
    pub fn step(&mut self, step: u64) -> Result<StepStats, TrainError> {
        let be = &self.backend;
        let t = &self.spec.train;
        let seq_len = self.spec.model.seq_len;
        let micro_steps = t.micro_batches * t.grad_accum;
        let (dp_rank, dp_world) = self.dp;
        // Rank r takes sequences [r * per_rank, (r+1) * per_rank) of the global batch.
        let per_rank = micro_steps * t.micro_batch;
        let step_tokens = dp_world * per_rank * seq_len;
        let dloss = 1.0 / step_tokens as f64;
        // Dynamic loss scaling multiplies the loss, so every gradient, by the scale.
        let scale = self.scaler.as_ref().map_or(1.0, LossScaler::scale);
        let record = step - self.first_step.min(step) < SPAN_STEPS;
        self.memory.sample_step(record.then_some(step));
        let (stage, stages) = self.links.as_ref().map_or((0, 1), |l| (l.stage, l.stages));
        let (first, last) = (self.model.stage.first, self.model.stage.last);
        let actions = schedule::schedule(self.spec.parallel.pp_schedule, stages, stage, micro_steps);
        let last_backward = actions.iter().rposition(|a| matches!(a, Action::Backward { .. }));

        self.strategy.begin_step(be, step, record);
        if let Some(tp) = self.model.tensor_parallel() {
            tp.begin_step(step, record);
        }
        let mut loss_sum = 0.0;
        for (index, action) in actions.iter().enumerate() {
            let (Action::Forward { micro } | Action::Backward { micro }) = *action;
            let first_sequence = dp_rank * per_rank + micro * t.micro_batch;
            self.data.fill_batch(step, first_sequence, t.micro_batch, seq_len, &mut self.inputs, &mut self.targets);
            // What this action needs from a neighbour (the wait is the pipeline's bubble).
            // Recorded steps wait for the device at every span boundary, so spans time work.
            if record {
                be.synchronize();
            }
            let wait_start = now_us();
            match (*action, &mut self.links) {
                (Action::Forward { .. }, Some(links)) if !first => {
                    links.recv(&mut self.received.activation, stage - 1)?;
                }
                (Action::Backward { .. }, Some(links)) if !last => links.recv(&mut self.received.grad, stage + 1)?,
                _ => {}
            }
            let start = now_us();
            if record && stages > 1 && start - wait_start > 0 {
                let name = format!(
                    "wait for stage {}",
                    if matches!(action, Action::Forward { .. }) { stage as i64 - 1 } else { stage as i64 + 1 }
                );
                self.spans.push(span(SpanKind::Idle, name, step, "compute", wait_start, start, None));
            }
            let mut state = Observed {
                inner: self.strategy.state(Some(index) == last_backward),
                memory: &self.memory,
                spans: &mut self.spans,
                record: record && stages == 1,
                step,
                mark: start,
            };
            match *action {
                Action::Forward { micro } => {
                    let input = if first {
                        StageInput::Tokens(&self.inputs)
                    } else {
                        StageInput::Activation(&self.received.activation)
                    };
                    loss_sum += self.model.forward_stage(be, &mut state, micro, input, &self.targets)?;
                    if record {
                        be.synchronize();
                        let end = now_us();
                        let mut pass =
                            span(SpanKind::Forward, format!("forward {micro}"), step, "compute", start, end, None);
                        pass.micro = Some(micro as u32);
                        state.spans.push(pass);
                    }
                    if let (Some(links), false) = (&mut self.links, last) {
                        be.read_host(be.all(self.model.output(micro)), |out| links.send(out, stage + 1));
                    }
                }
                Action::Backward { micro } => {
                    let grad = (!last).then_some(&self.received.grad[..]);
                    let dloss = dloss * scale;
                    self.model.backward_stage(be, &mut state, micro, &self.inputs, &self.targets, grad, dloss)?;
                    if record && stages > 1 {
                        be.synchronize();
                        let end = now_us();
                        let mut pass =
                            span(SpanKind::Backward, format!("backward {micro}"), step, "compute", start, end, None);
                        pass.micro = Some(micro as u32);
                        state.spans.push(pass);
                    }
                    if let (Some(links), false) = (&mut self.links, first) {
                        be.read_host(be.all(self.model.input_grad()), |grad| links.send(grad, stage - 1));
                    }
                }
            }
        }
        let wait_start = now_us();
        let mut grad_norm_squared = self.strategy.reduce_gradients(be)?;
        if let Some(links) = &mut self.links {
            // Each stage holds its part of the gradient, and the loss is on the last one.
            links.flush()?;
            grad_norm_squared = links.sum_scalar(grad_norm_squared)?;
            loss_sum = links.sum_scalar(loss_sum)?;
        }
        if let Some(tp) = self.model.tensor_parallel() {
            // Each TP rank holds its slice of the split tensors (replicated ones count
            // 1/tp each); every TP rank computed the same loss.
            grad_norm_squared = tp.sum_scalar(grad_norm_squared)?;
        }
        // (A NaN gradient must stay NaN here: `max(0.0)` would turn it into 0.)
        let grad_norm = grad_norm_squared.sqrt() / scale;
        if dp_world > 1 {
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
            loss_sum = self.strategy.sum_scalar(loss_sum)?;
        }
        if record {
            be.synchronize();
        }
        let optimizer_start = now_us();
        let loss = loss_sum * dloss;
        let lr = lr_at(t, step);
        // Loss scaling acts on backward only: an overflow in forward (a non-finite loss)
        // is divergence whatever the scale; an overflowed gradient skips the step.
        let grads_finite = grad_norm.is_finite();
        let updated = loss.is_finite()
            && match self.scaler.as_mut() {
                Some(scaler) => scaler.update(grads_finite) == ScaledStep::Apply,
                None => grads_finite,
            };
        if updated {
            // Unscale (in f32, inside the update) and clip in one factor.
            self.strategy.update(be, lr, clip_scale(grad_norm, t.grad_clip) / scale)?;
        }
        if record {
            be.synchronize();
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
        self.memory.sample(|| "optimizer step".into());
        self.memory.sample_step(None);
        let loss_scale = self.scaler.as_ref().map(|s| (scale, s.skipped()));
        Ok(StepStats { loss, lr, grad_norm, updated, loss_scale })
    }

    /// This rank's checkpoint before step `step`: a copy of the state its strategy owns
    /// (state every DP rank holds alike is written by DP rank 0 alone; see `checkpoint.rs`).
    /// The copy goes into `reuse`'s buffers, already paged in by an earlier checkpoint.
    pub fn checkpoint(&self, step: u64, min_loss: f64, reuse: RankCheckpoint) -> RankCheckpoint {
        let mut reuse = Some(reuse);
        let mut made = None;
        self.strategy.view_state(&self.backend, &mut |view| {
            let reuse = reuse.take().unwrap_or_default();
            made = Some(self.checkpoint_of(view, step, min_loss, reuse));
        });
        made.expect("a strategy shows its state")
    }

    fn checkpoint_of(&self, view: StateView<'_>, step: u64, min_loss: f64, reuse: RankCheckpoint) -> RankCheckpoint {
        let writes_replicated = self.place.dp == 0;
        let mut wanted: Vec<(&str, &[f32])> = Vec::new();
        if writes_replicated || !view.params_replicated {
            wanted.push(("params", &view.params));
        }
        let writes_optimizer = writes_replicated || !view.optimizer_replicated;
        if self.has_moments() && writes_optimizer {
            wanted.extend([("adam_m", view.optimizer.m), ("adam_v", view.optimizer.v)]);
        }
        if let (Some(master), true) = (view.optimizer.master, writes_optimizer) {
            wanted.push(("master", master));
        }
        // Every rank holds the same scaler (its decisions follow the global gradient norm).
        let scaler = self.scaler.as_ref().map(|s| {
            let (scale, good_steps, skipped) = s.state();
            [scale as f32, good_steps as f32, skipped as f32]
        });
        if let Some(scaler) = &scaler {
            wanted.push(("loss_scale", scaler));
        }
        // The copy is booked from here until the next checkpoint reuses it (the writer keeps it).
        let RankCheckpoint { sections: mut spare, booked, .. } = reuse;
        drop(booked);
        let floats: usize = wanted.iter().map(|(_, v)| v.len()).sum();
        let booked = Some(self.memory.alloc(Category::Checkpoint, floats));
        let sections = wanted
            .into_iter()
            .map(|(name, values)| {
                let mut buf =
                    spare.iter().position(|(n, _)| n == name).map_or_else(Vec::new, |i| spare.swap_remove(i).1);
                buf.clear();
                buf.extend_from_slice(values);
                (name.to_string(), buf)
            })
            .collect();
        RankCheckpoint { step, optimizer_steps: view.optimizer_steps, min_loss, sections, booked }
    }

    /// Puts back the state of this rank's checkpoint `own`, taking what it does not hold
    /// (replicated state) from `dp_rank_zero`'s; the next step is `own.step`.
    pub fn restore(&mut self, own: &RankCheckpoint, dp_rank_zero: &RankCheckpoint) -> Result<(), String> {
        let find = |name: &str| {
            own.section(name)
                .or_else(|| dp_rank_zero.section(name))
                .map(<[f32]>::to_vec)
                .ok_or_else(|| format!("the checkpoint of step {} has no {name} for this rank", own.step))
        };
        let (m, v) = if self.has_moments() { (find("adam_m")?, find("adam_v")?) } else { (vec![], vec![]) };
        let master = if needs_master::<B::Elem>() { Some(find("master")?) } else { None };
        if let Some(scaler) = &mut self.scaler {
            let &[scale, good_steps, skipped] = &find("loss_scale")?[..] else {
                return Err("the loss_scale section holds 3 values".into());
            };
            *scaler = LossScaler::from_state((scale as f64, good_steps as u64, skipped as u64));
        }
        let state = SavedState {
            params: find("params")?,
            optimizer: OptimizerState { steps_taken: own.optimizer_steps, m, v, master },
        };
        self.strategy.load(&self.backend, state)?;
        self.first_step = own.step;
        Ok(())
    }

    fn has_moments(&self) -> bool {
        self.spec.train.optimizer == distlab_common::Optimizer::Adamw
    }

    pub fn place(&self) -> RankPlace {
        self.place
    }

    /// This rank's timeline so far: compute spans and the strategy's communication spans.
    pub fn timeline(&self) -> Vec<Span> {
        let mut spans = self.spans.clone();
        spans.extend(self.strategy.comm_spans());
        if let Some(tp) = &self.model.tp_spans() {
            spans.extend(tp.iter().cloned());
        }
        spans.sort_by_key(|s| s.start_us);
        spans
    }
}

/// The groups of ranks one rank belongs to (None: it is alone in that dimension).
#[derive(Default)]
pub struct Groups {
    /// This rank's place in the whole run (0..world): which GPU it takes.
    pub rank: usize,
    pub dp: Option<DpGroup>,
    pub pp: Option<PipelineGroup>,
    pub tp: Option<TensorParallel>,
    /// Bytes of the shared-memory pipes to the other rank processes this rank maps.
    pub pipe_bytes: u64,
}

impl Groups {
    /// Heap bytes the communicators the run keeps hold for staging what they move (ZeRO-2
    /// and FSDP reduce-scatter on the main data-parallel communicator and drop the other).
    fn staging_bytes(&self, sharding: Sharding) -> u64 {
        let dp = self.dp.as_ref().map_or(0, |g| {
            let grads = matches!(sharding, Sharding::None | Sharding::Zero1).then(|| g.grads.staging_bytes());
            grads.unwrap_or(0) + g.scalars.staging_bytes()
        });
        let pp = self.pp.as_ref().map_or(0, |g| g.send.staging_bytes() + g.recv.staging_bytes());
        dp + pp + self.tp.as_ref().map_or(0, TensorParallel::staging_bytes)
    }
}

/// Buffers a pipeline stage receives into: its input activation (all but the first stage)
/// and its output's gradient (all but the last).
struct Received<S> {
    activation: Vec<S>,
    grad: Vec<S>,
    _receipts: Vec<Receipt>,
}

impl<S: Stored> Received<S> {
    fn new(memory: &Arc<MemoryTracker>, activation: usize, grad: usize) -> Self {
        let receipts = [activation, grad]
            .iter()
            .filter(|&&n| n > 0)
            .map(|&n| memory.alloc_of::<S>(Category::CommBuffers, n))
            .collect();
        Received { activation: vec![S::default(); activation], grad: vec![S::default(); grad], _receipts: receipts }
    }
}

/// The strategy's state as the model sees it, plus what the trainer observes on the way:
/// a backward span per unit, and a memory sample after every open and close.
struct Observed<'a, B: TrainBackend> {
    inner: &'a mut dyn ModelState<B>,
    memory: &'a MemoryTracker,
    spans: &'a mut Vec<Span>,
    record: bool,
    step: u64,
    /// When the current backward span began.
    mark: u64,
}

impl<B: TrainBackend> ModelState<B> for Observed<'_, B> {
    fn open(&mut self, be: &B, unit: Unit, pass: Pass) -> Result<OpenUnit<'_, B::Buf>, CommError> {
        let open = self.inner.open(be, unit, pass)?;
        self.memory.sample(|| format!("{} {}: open", pass_name(pass), unit.name()));
        Ok(open)
    }

    fn close(&mut self, be: &B, unit: Unit, pass: Pass) -> Result<(), CommError> {
        let recorded = match (pass, unit) {
            (Pass::Forward, _) => None,
            (Pass::Recompute, Unit::Block(l)) => Some((SpanKind::Forward, format!("recompute layer {l}"), Some(l))),
            (Pass::Recompute, _) => None,
            (Pass::Backward { .. }, Unit::Head) => Some((SpanKind::Backward, "backward head".to_string(), None)),
            (Pass::Backward { .. }, Unit::Block(l)) => {
                Some((SpanKind::Backward, format!("backward layer {l}"), Some(l)))
            }
            (Pass::Backward { .. }, Unit::Embeddings) => {
                Some((SpanKind::Backward, "backward embeddings".to_string(), None))
            }
        };
        if let (true, Some((kind, name, layer))) = (self.record, recorded) {
            be.synchronize();
            let layer = layer.map(|l| l as u32);
            self.spans.push(span(kind, name, self.step, "compute", self.mark, now_us(), layer));
        }
        self.inner.close(be, unit, pass)?;
        self.mark = now_us();
        self.memory.sample(|| format!("{} {}: close", pass_name(pass), unit.name()));
        Ok(())
    }
}

fn pass_name(pass: Pass) -> &'static str {
    match pass {
        Pass::Forward => "forward",
        Pass::Recompute => "recompute",
        Pass::Backward { .. } => "backward",
    }
}

pub(crate) fn log(on_event: &mut dyn FnMut(RunEvent), message: String) {
    on_event(RunEvent::Log(LogLine { level: LogLevel::Info, message }));
}

fn mib(floats: usize) -> f64 {
    (floats * 4) as f64 / (1024.0 * 1024.0)
}

pub(crate) fn mib_bytes(bytes: u64) -> f64 {
    bytes as f64 / (1024.0 * 1024.0)
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
    if spec.world_size() > 1 {
        let p = &spec.parallel;
        return Err(TrainError::Unsupported(format!(
            "parallel.dp={} x tp={} x pp={}: a run of several ranks runs one process per rank; start it through \
             the launcher (distlab-worker run or a server), not in this process",
            p.dp, p.tp, p.pp
        )));
    }
    let run = train_rank(spec, opts, Groups::default(), on_event, cancel)?;
    on_event(RunEvent::Trace(RankTrace {
        rank: 0,
        world: 1,
        span_steps: SPAN_STEPS,
        spans: run.spans,
        comm: Default::default(),
        memory: Some(run.memory),
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

/// How the log line of a checkpoint write begins.
pub const CHECKPOINT_LOG: &str = "checkpoint of step";

/// A log line per checkpoint write: its size and what it cost the training loop.
fn report_checkpoints(
    on_event: &mut dyn FnMut(RunEvent),
    written: Vec<Result<Written, CheckpointError>>,
    place: RankPlace,
    mode: CheckpointWrite,
) {
    for w in written {
        let (level, message) = match (w, mode) {
            (Ok(w), CheckpointWrite::Async) => (
                LogLevel::Info,
                format!(
                    "{CHECKPOINT_LOG} {} (rank dp{} tp{} pp{}): {:.2} MiB written in {:.1} ms by the writer \
                     thread; training waited {:.1} ms to copy the state",
                    w.step,
                    place.dp,
                    place.tp,
                    place.pp,
                    mib_bytes(w.bytes),
                    w.write_ms,
                    w.waited_ms
                ),
            ),
            (Ok(w), CheckpointWrite::Sync) => (
                LogLevel::Info,
                format!(
                    "{CHECKPOINT_LOG} {} (rank dp{} tp{} pp{}): {:.2} MiB written in {:.1} ms; training waited \
                     {:.1} ms",
                    w.step,
                    place.dp,
                    place.tp,
                    place.pp,
                    mib_bytes(w.bytes),
                    w.write_ms,
                    w.waited_ms
                ),
            ),
            (Err(e), _) => (LogLevel::Warn, format!("{e}; training goes on without this checkpoint")),
        };
        on_event(RunEvent::Log(LogLine { level, message }));
    }
}

/// What a training loop reports of each optimizer step, and keeps for the run's summary.
pub(crate) struct StepTally {
    first_step: u64,
    tokens_per_step: usize,
    final_loss: f64,
    /// The lowest step loss so far (a resumed run starts from its checkpoint's).
    pub min_loss: f64,
    timed_seconds: f64,
    timed_steps: u64,
}

impl StepTally {
    pub fn new(spec: &ExperimentSpec, first_step: u64, min_loss: f64) -> Self {
        let tokens_per_step = spec.tokens_per_step();
        Self { first_step, tokens_per_step, final_loss: f64::NAN, min_loss, timed_seconds: 0.0, timed_steps: 0 }
    }

    /// Reports step `step`, which took `seconds`: its metric point, and a log line when loss
    /// scaling skipped it; an error when it diverged.
    pub fn record(
        &mut self,
        on_event: &mut dyn FnMut(RunEvent),
        steps: u64,
        step: u64,
        stats: &StepStats,
        seconds: f64,
    ) -> Result<(), TrainError> {
        // A step loss scaling skipped (its gradient overflowed) is not divergence, unless the
        // scale could not go lower.
        let skipped = !stats.updated
            && stats.loss.is_finite()
            && stats.loss_scale.is_some_and(|(scale, _)| scale > crate::loss_scale::MIN_SCALE);
        if !stats.updated && !skipped {
            return Err(TrainError::Diverged { step, loss: stats.loss, grad_norm: stats.grad_norm });
        }
        if let (true, Some((scale, _))) = (skipped, stats.loss_scale) {
            log(
                on_event,
                format!(
                    "step {step}: the gradient overflowed fp16 at loss scale {scale}; step skipped, the scale halves \
                     to {}",
                    scale / 2.0
                ),
            );
        }
        on_event(RunEvent::Metric(MetricPoint {
            step,
            loss: stats.loss,
            lr: stats.lr,
            grad_norm: if stats.grad_norm.is_finite() { stats.grad_norm } else { f64::MAX },
            tokens_per_s: self.tokens_per_step as f64 / seconds,
            step_ms: seconds * 1e3,
            loss_scale: stats.loss_scale.map(|(scale, _)| scale),
            skipped_steps: stats.loss_scale.map(|(_, skipped)| skipped),
        }));
        self.final_loss = stats.loss;
        self.min_loss = self.min_loss.min(stats.loss);
        // The first step pays for warm-up (page faults, caches, cuBLAS heuristics): leave it
        // out when there are more.
        if step > self.first_step || steps == self.first_step + 1 {
            self.timed_seconds += seconds;
            self.timed_steps += 1;
        }
        Ok(())
    }

    /// The run's summary; `loss_floor` is the data's, `threads` the kernel threads per rank.
    pub fn summary(
        &self,
        spec: &ExperimentSpec,
        params: usize,
        loss_floor: Option<f64>,
        wall_s: f64,
        threads: usize,
    ) -> RunSummary {
        let steps = spec.train.steps;
        let timed_tokens = self.timed_steps as f64 * self.tokens_per_step as f64;
        RunSummary {
            steps,
            final_loss: self.final_loss,
            min_loss: self.min_loss,
            uniform_loss: (spec.model.vocab as f64).ln(),
            loss_floor,
            params: params as u64,
            tokens: steps * self.tokens_per_step as u64,
            tokens_per_s: if self.timed_seconds > 0.0 { timed_tokens / self.timed_seconds } else { 0.0 },
            mean_step_ms: if self.timed_steps > 0 { self.timed_seconds * 1e3 / self.timed_steps as f64 } else { 0.0 },
            wall_s,
            world_size: spec.world_size(),
            threads,
            collective: None,
        }
    }
}

/// What one rank's training leaves behind.
pub struct RankRun {
    pub summary: RunSummary,
    /// Timeline spans of the first steps.
    pub spans: Vec<Span>,
    pub memory: RankMemoryReport,
}

/// Trains this rank's part of `spec`: the whole run when `dp` is None. Every rank reports
/// the same (global) metrics.
pub fn train_rank(
    spec: &ExperimentSpec,
    opts: &TrainOptions,
    groups: Groups,
    on_event: &mut dyn FnMut(RunEvent),
    cancel: &AtomicBool,
) -> Result<RankRun, TrainError> {
    spec.validate(&Limits::default()).map_err(TrainError::Invalid)?;
    let unsupported = unsupported_features(spec);
    if !unsupported.is_empty() {
        return Err(TrainError::Unsupported(unsupported.join("; ")));
    }
    match (spec.backend, spec.train.precision) {
        (BackendKind::Cpu, Precision::Fp32) => train_on_cpu::<f32>(spec, opts, groups, on_event, cancel),
        (BackendKind::Cpu, Precision::Bf16) => train_on_cpu::<half::bf16>(spec, opts, groups, on_event, cancel),
        (BackendKind::Cpu, Precision::Fp16) => train_on_cpu::<half::f16>(spec, opts, groups, on_event, cancel),
        #[cfg(feature = "cuda")]
        (BackendKind::Cuda, precision) => {
            crate::cuda_rank::train_on_gpu(precision, spec, opts, groups, on_event, cancel)
        }
        #[cfg(not(feature = "cuda"))]
        (BackendKind::Cuda, _) => unreachable!("unsupported_features refuses cuda without the cuda feature"),
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
    spec: &ExperimentSpec,
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
    if let (Some(c), true) = (&opts.checkpoints, t.checkpoint_every > 0) {
        let dir = CheckpointDir::new(&c.dir, world);
        if let Some(step) = c.resume_from.filter(|&s| s > 0) {
            min_loss = resume(&mut trainer, &dir, step)?;
            first_step = step;
            log(
                on_event,
                format!("resumed from the checkpoint of step {step}: steps 0 to {} are not run again", step - 1),
            );
        }
        let asynchronous = t.checkpoint_write == CheckpointWrite::Async;
        writer = Some(CheckpointWriter::new(dir, trainer.place(), asynchronous));
    }
    let mut tally = StepTally::new(spec, first_step, min_loss);
    for step in first_step..t.steps {
        if cancel.load(Ordering::Relaxed) {
            return Err(TrainError::Cancelled);
        }
        let step_start = Instant::now();
        let stats = pool.install(|| trainer.step(step))?;
        tally.record(on_event, t.steps, step, &stats, step_start.elapsed().as_secs_f64())?;
        if let Some(writer) = &mut writer {
            let next = step + 1;
            if next % t.checkpoint_every == 0 && next < t.steps {
                let copy_start = Instant::now();
                let ckpt = trainer.checkpoint(next, tally.min_loss, writer.spare());
                writer.save(ckpt, copy_start.elapsed().as_secs_f64() * 1e3);
            }
            report_checkpoints(on_event, writer.finished(), trainer.place(), t.checkpoint_write);
        }
    }
    if let Some(writer) = writer {
        report_checkpoints(on_event, writer.finish(), trainer.place(), t.checkpoint_write);
    }
    if let Some((calls, payload, sent)) = trainer.model.tensor_parallel().map(|tp| tp.totals()) {
        let layers = trainer.model.stage.blocks.len();
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
    Ok(RankRun { summary, spans: trainer.timeline(), memory: trainer.memory_report() })
}
