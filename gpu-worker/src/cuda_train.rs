//! Training on GPUs (cargo feature `cuda`): one rank per GPU, alone or in a data-parallel
//! group (DDP; tp = pp = 1). The model is the same `Gpt` the CPU ranks run, on the CUDA
//! backend; its parameters and gradients live in GPU memory (`FlatState`), and AdamW runs
//! there too (fp32 moments, and fp32 master weights for a bf16/fp16 model), or SGD; fp16
//! runs may use the same dynamic loss scaler as the CPU. Every buffer is
//! registered with the memory ledger in the categories the CPU ranks use.
//!
//! A step is the CPU trainer's: zero the gradients, forward + backward over this rank's
//! micro-batches, the gradients summed over the data-parallel group (in fp32, through a
//! host copy: NCCL when every rank has a GPU of its own, the CPU ring when ranks share
//! one), the global gradient norm, clipping folded into the update.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Instant;

use distlab_common::backends::unsupported_on_backend;
use distlab_common::memory::RankMemoryReport;
use distlab_common::trace::{Span, SpanKind};
use distlab_common::{BackendKind, ExperimentSpec, LossScaling, Optimizer as OptimizerKind, Precision, RunEvent};

use crate::backend::cuda::{self, CudaBackend, DeviceElem, DeviceOptimizerBuffers};
use crate::backend::Backend;
use crate::comm::nccl::{self, NcclCommunicator};
use crate::comm::{CommError, Communicator, ReduceOp};
use crate::data::Data;
use crate::loss_scale::{LossScaler, ScaledStep};
use crate::memory::{Category, MemoryTracker, Receipt};
use crate::model::{FlatState, Gpt, Saved, Stage};
use crate::optim::{clip_scale, lr_at, AdamWStep, ParamGroup, Update, ADAM_BETA1, ADAM_BETA2, ADAM_EPS};
use crate::parallel::ddp::{blocking_comm_span, sum_scalar};
use crate::parallel::DpGroup;
use crate::trace::now_us;
use crate::train::{log, memory_bytes, mib_bytes as mib, RankRun, StepStats, StepTally, TrainError, SPAN_STEPS};

/// Why the GPU cannot run this: a machine without one is a spec this worker cannot run;
/// anything else is the GPU failing.
fn unavailable(e: cuda::CudaUnavailable) -> TrainError {
    if e.no_gpu_here() {
        TrainError::Unsupported(format!("backend=cuda: {e}"))
    } else {
        TrainError::Device(e.to_string())
    }
}

const VIA_NCCL: &str = "NCCL";
const VIA_RING_SHARED: &str = "CPU ring, the ranks share a GPU";
const VIA_RING_NO_NCCL: &str = "CPU ring, NCCL is missing on some rank";

/// What [`CudaTrainer`] cannot run yet, one message each (empty: it can); the rules live
/// in `common` so the server and the browser say the same.
pub fn unsupported(spec: &ExperimentSpec) -> Vec<String> {
    let mut on_cuda = spec.clone();
    on_cuda.backend = BackendKind::Cuda;
    unsupported_on_backend(&on_cuda).iter().map(ToString::to_string).collect()
}

/// A model, its parameters, gradients and optimizer state on one GPU, and its data.
pub struct CudaTrainer<S: DeviceElem> {
    spec: ExperimentSpec,
    backend: CudaBackend<S>,
    model: Gpt<CudaBackend<S>>,
    state: FlatState<CudaBackend<S>>,
    optimizer: DeviceOptimizerBuffers,
    /// Dynamic loss scaling (fp16), as on the CPU.
    scaler: Option<LossScaler>,
    groups: Vec<ParamGroup>,
    data: Data,
    inputs: Vec<u32>,
    targets: Vec<u32>,
    updates: u64,
    dp: Option<GpuDataParallel<S>>,
    /// Forward, backward, optimizer and gradient all-reduce spans of the first `SPAN_STEPS` steps.
    spans: Vec<Span>,
    memory: Arc<MemoryTracker>,
    _receipts: Vec<Receipt>,
}

impl<S: DeviceElem> CudaTrainer<S> {
    /// Builds everything for one rank: alone (`dp` None) on GPU 0, or rank `dp.rank` of its
    /// data-parallel group on GPU `dp.rank % GPUs`. The spec must be valid, of precision
    /// `S`, and within [`unsupported`].
    pub fn new(spec: &ExperimentSpec, dp: Option<DpGroup>) -> Result<Self, TrainError> {
        let problems: Vec<String> = unsupported(spec).into_iter().map(|p| format!("backend=cuda: {p}")).collect();
        if !problems.is_empty() {
            return Err(TrainError::Unsupported(problems.join("; ")));
        }
        if S::NAME != spec.train.precision.as_str() {
            return Err(TrainError::Unsupported(format!(
                "train.precision={}: this trainer stores {}",
                spec.train.precision.as_str(),
                S::NAME
            )));
        }
        let gpus = cuda::device_count().map_err(unavailable)?.max(1);
        let ordinal = dp.as_ref().map_or(0, |g| g.rank % gpus);
        let backend = CudaBackend::<S>::new(ordinal).map_err(unavailable)?;
        // What the run allocates on the GPU, checked before anything is (a spec that is valid
        // can still be far too big for this GPU). Ranks sharing a GPU each need their share.
        let sharing = dp.as_ref().map_or(1, |g| g.world.div_ceil(gpus));
        let needed = memory_bytes(spec) + if dp.is_some() { 4 * spec.model.param_count() } else { 0 };
        let free = backend.free_memory().map_err(unavailable)? as u64 / sharing as u64;
        if needed > free / 10 * 9 {
            return Err(TrainError::OutOfMemory { needed_mib: needed >> 20, available_mib: free >> 20 });
        }
        let t = &spec.train;
        let data = Data::new(&spec.data, &spec.model, spec.global_batch())?;
        let memory = MemoryTracker::new();
        let saved = Saved { checkpointing: t.checkpointing };
        let stage = Stage::whole(spec.model.layers);
        let model = Gpt::new_stage(&backend, &spec.model, t.micro_batch, stage, saved, None, &memory);
        let params = model.layout.total;
        let state = FlatState::new(&backend, &model.layout, t.seed);
        let adamw = t.optimizer == OptimizerKind::Adamw;
        let optimizer = backend.optimizer_buffers(params, adamw, || model.layout.init_params::<f32>(t.seed));
        let mut receipts =
            vec![memory.alloc_of::<S>(Category::Parameters, params), memory.alloc_of::<S>(Category::Gradients, params)];
        if adamw {
            receipts.push(memory.alloc(Category::OptimizerState, 2 * params));
        }
        if optimizer.master.is_some() {
            receipts.push(memory.alloc(Category::OptimizerState, params));
        }
        let tokens = t.micro_batch * spec.model.seq_len;
        let dp = match dp {
            Some(group) => {
                let dp = GpuDataParallel::new(group, ordinal, gpus, params)?;
                // The host copy (the model's format and fp32), and NCCL's copy on the GPU.
                receipts.push(memory.alloc_of::<S>(Category::CommBuffers, params));
                receipts.push(memory.alloc(Category::CommBuffers, params));
                if dp.via == VIA_NCCL {
                    receipts.push(memory.alloc(Category::CommBuffers, params));
                }
                Some(dp)
            }
            None => None,
        };
        Ok(Self {
            spec: spec.clone(),
            groups: model.layout.param_groups(),
            backend,
            model,
            state,
            optimizer,
            scaler: (t.loss_scaling == LossScaling::Dynamic).then(LossScaler::default),
            data,
            inputs: vec![0; tokens],
            targets: vec![0; tokens],
            updates: 0,
            dp,
            spans: Vec::new(),
            memory,
            _receipts: receipts,
        })
    }

    pub fn backend(&self) -> &CudaBackend<S> {
        &self.backend
    }

    pub fn data(&self) -> &Data {
        &self.data
    }

    /// Parameters of the model.
    pub fn params(&self) -> usize {
        self.model.layout.total
    }

    /// What the memory ledger says this rank holds, by category. Its buffers are in GPU
    /// memory, so the host heap is not set against them (no heap figures, no "untracked").
    pub fn memory_report(&self) -> RankMemoryReport {
        let mut report = self.memory.report(0);
        report.booked_heap_peak = None;
        if let Some(process) = report.process.as_mut() {
            (process.heap_peak, process.heap_current, process.start_up) = (None, None, None);
        }
        report
    }

    /// Bytes of every buffer the trainer holds on the GPU, counted from the buffers.
    pub fn held_bytes(&self) -> u64 {
        let be = &self.backend;
        let flat = (be.buf_len(&self.state.params) + be.buf_len(&self.state.grads)) * size_of::<S>();
        let optimizer = be.read_optimizer_buffers(&self.optimizer, |s| {
            (s.m.len() + s.v.len() + s.master.map_or(0, <[f32]>::len)) as u64 * 4
        });
        self.model.held_bytes(be) + flat as u64 + optimizer
    }

    /// The timeline of the first steps (the compute lane: one span per pass).
    pub fn timeline(&self) -> Vec<Span> {
        self.spans.clone()
    }

    /// Optimizer step `step` (0-based); returns once the GPU has finished it. The first
    /// `SPAN_STEPS` steps wait for the GPU after every pass to time it.
    pub fn step(&mut self, step: u64) -> Result<StepStats, TrainError> {
        let be = &self.backend;
        let t = &self.spec.train;
        let seq_len = self.spec.model.seq_len;
        let micro_steps = t.micro_batches * t.grad_accum;
        let (dp_rank, dp_world) = self.dp.as_ref().map_or((0, 1), |g| (g.rank, g.world));
        // Rank r takes sequences [r * per_rank, (r+1) * per_rank) of the global batch.
        let per_rank = micro_steps * t.micro_batch;
        let dloss = 1.0 / (dp_world * per_rank * seq_len) as f64;
        // Dynamic loss scaling multiplies the loss, so every gradient, by the scale.
        let scale = self.scaler.as_ref().map_or(1.0, LossScaler::scale);
        let record = step < SPAN_STEPS;
        let mut mark = now_us();
        let timed = |kind: SpanKind, name: String, micro: Option<usize>, spans: &mut Vec<Span>, mark: &mut u64| {
            if record {
                be.synchronize();
                let end = now_us();
                let micro = micro.map(|m| m as u32);
                let lane = "compute".into();
                let start_us = *mark;
                spans.push(Span {
                    kind,
                    name,
                    step,
                    lane,
                    start_us,
                    end_us: end,
                    layer: None,
                    bucket: None,
                    bytes: None,
                    micro,
                });
                *mark = end;
            }
        };
        self.memory.sample_step(record.then_some(step));
        self.state.zero_grads(be);
        let mut loss_sum = 0.0;
        for micro in 0..micro_steps {
            let first_sequence = dp_rank * per_rank + micro * t.micro_batch;
            self.data.fill_batch(step, first_sequence, t.micro_batch, seq_len, &mut self.inputs, &mut self.targets);
            loss_sum += self.model.forward(be, &mut self.state, &self.inputs, &self.targets)?;
            timed(SpanKind::Forward, format!("forward {micro}"), Some(micro), &mut self.spans, &mut mark);
            self.model.backward(be, &mut self.state, &self.inputs, &self.targets, dloss * scale)?;
            timed(SpanKind::Backward, format!("backward {micro}"), Some(micro), &mut self.spans, &mut mark);
        }
        if let Some(dp) = &mut self.dp {
            let start = now_us();
            dp.sum_gradients(be, &mut self.state.grads)?;
            loss_sum = sum_scalar(dp.scalars.as_mut(), loss_sum)?;
            if record {
                let bytes = dp.grads.bytes_sent() - dp.sent_before_step;
                self.spans.push(blocking_comm_span(&format!("all-reduce gradients ({})", dp.via), step, start, bytes));
                mark = now_us();
            }
            dp.sent_before_step = dp.grads.bytes_sent();
        }
        // (A NaN gradient must stay NaN: the norm decides whether the step is taken.)
        let grad_norm = be.sum_squares(be.all(&self.state.grads)).sqrt() / scale;
        let loss = loss_sum * dloss;
        let lr = lr_at(t, step);
        // Loss scaling acts on backward only: an overflow in forward (a non-finite loss) is
        // divergence whatever the scale; an overflowed gradient skips the step.
        let grads_finite = grad_norm.is_finite();
        let updated = loss.is_finite()
            && match self.scaler.as_mut() {
                Some(scaler) => scaler.update(grads_finite) == ScaledStep::Apply,
                None => grads_finite,
            };
        if updated {
            self.updates += 1;
            // Unscale (in f32, inside the update) and clip in one factor.
            let grad_scale = clip_scale(grad_norm, t.grad_clip) / scale;
            for group in &self.groups {
                let weight_decay = if group.decay { t.weight_decay } else { 0.0 };
                let (params, grads, range) = (&mut self.state.params, &self.state.grads, group.range.clone());
                match t.optimizer {
                    OptimizerKind::Adamw => {
                        let hp = AdamWStep {
                            lr,
                            beta1: ADAM_BETA1,
                            beta2: ADAM_BETA2,
                            eps: ADAM_EPS,
                            weight_decay,
                            step: self.updates,
                            grad_scale,
                        };
                        let (params, grads) = (be.view_mut(params, range.clone()), be.view(grads, range.clone()));
                        be.optimizer_update(params, grads, &mut self.optimizer, range, &Update::AdamW(hp));
                    }
                    OptimizerKind::Sgd => {
                        let (params, grads) = (be.view_mut(params, range.clone()), be.view(grads, range.clone()));
                        let update = Update::Sgd { lr, weight_decay, grad_scale };
                        be.optimizer_update(params, grads, &mut self.optimizer, range, &update);
                    }
                }
            }
        }
        timed(SpanKind::Optimizer, "optimizer".into(), None, &mut self.spans, &mut mark);
        be.synchronize();
        self.memory.sample(|| "optimizer step".into());
        self.memory.sample_step(None);
        let loss_scale = self.scaler.as_ref().map(|s| (scale, s.skipped()));
        Ok(StepStats { loss, lr, grad_norm, updated, loss_scale })
    }
}

/// This rank's data-parallel group on GPUs. The gradients are summed in fp32 through a host
/// copy, as the CPU ranks sum theirs: NCCL when every rank has a GPU of its own, the CPU
/// ring otherwise (NCCL refuses two ranks of one group on one GPU).
struct GpuDataParallel<S> {
    rank: usize,
    world: usize,
    grads: Box<dyn Communicator>,
    scalars: Box<dyn Communicator>,
    /// How the gradients travel, for logs and span names.
    via: &'static str,
    host: Vec<S>,
    widened: Vec<f32>,
    sent_before_step: u64,
}

impl<S: DeviceElem> GpuDataParallel<S> {
    fn new(group: DpGroup, ordinal: usize, gpus: usize, params: usize) -> Result<Self, TrainError> {
        let DpGroup { rank, world, grads, mut scalars } = group;
        // Every rank says whether it has NCCL: NCCL only if all do (a rank without it would
        // leave the others waiting in NCCL's init, where no timeout reaches).
        let has_nccl = nccl::libraries_present().is_ok();
        let votes = sum_scalar(scalars.as_mut(), if has_nccl { 1.0 } else { 0.0 })?;
        let via = match (gpus >= world, votes as usize == world) {
            (false, _) => VIA_RING_SHARED,
            (true, false) => VIA_RING_NO_NCCL,
            (true, true) => VIA_NCCL,
        };
        let grads: Box<dyn Communicator> = if via == VIA_NCCL {
            let device_failure = |e: nccl::NcclUnavailable| TrainError::Device(e.to_string());
            // Group rank 0 asks NCCL for the id and sends it over the launcher's rendezvous.
            let id = (rank == 0).then(nccl::new_unique_id);
            let id = nccl::share_unique_id(scalars.as_mut(), 0, id).map_err(device_failure)?;
            let comm =
                NcclCommunicator::new(ordinal, id, rank, (0..world).collect(), "dp", None).map_err(device_failure)?;
            Box::new(comm)
        } else {
            grads
        };
        Ok(Self {
            rank,
            world,
            grads,
            scalars,
            via,
            host: vec![S::default(); params],
            widened: vec![0.0; params],
            sent_before_step: 0,
        })
    }

    /// Replaces this rank's gradients by their sum over the group.
    fn sum_gradients(
        &mut self,
        be: &CudaBackend<S>,
        grads: &mut cudarc::driver::CudaSlice<S>,
    ) -> Result<(), CommError> {
        be.download(grads, &mut self.host);
        S::widen_slice(&self.host, &mut self.widened);
        self.grads.all_reduce(&mut self.widened, ReduceOp::Sum)?;
        S::narrow_slice(&self.widened, &mut self.host);
        be.upload(grads, &self.host);
        Ok(())
    }
}

/// Trains this rank's part of `spec` (backend=cuda) on its GPU: the whole run when `dp` is
/// None. Reports every optimizer step to `on_event` as the CPU trainer does, and checks
/// `cancel` between steps.
pub fn train_on_gpu(
    spec: &ExperimentSpec,
    dp: Option<DpGroup>,
    on_event: &mut dyn FnMut(RunEvent),
    cancel: &AtomicBool,
) -> Result<RankRun, TrainError> {
    match spec.train.precision {
        Precision::Fp32 => train_as::<f32>(spec, dp, on_event, cancel),
        Precision::Bf16 => train_as::<half::bf16>(spec, dp, on_event, cancel),
        Precision::Fp16 => train_as::<half::f16>(spec, dp, on_event, cancel),
    }
}

fn train_as<S: DeviceElem>(
    spec: &ExperimentSpec,
    dp: Option<DpGroup>,
    on_event: &mut dyn FnMut(RunEvent),
    cancel: &AtomicBool,
) -> Result<RankRun, TrainError> {
    let started = Instant::now();
    let mut trainer = CudaTrainer::<S>::new(spec, dp)?;
    let (m, t) = (&spec.model, &spec.train);
    let params = trainer.params();
    log(on_event, format!("device: {} (CUDA backend: cuBLAS GEMMs, NVRTC kernels)", trainer.backend().device()));
    if let Some(dp) = &trainer.dp {
        log(
            on_event,
            format!(
                "data parallel: {} ranks, one GPU each where there are enough; gradients summed in fp32 through a host \
                 copy ({})",
                dp.world, dp.via
            ),
        );
    }
    log(
        on_event,
        format!(
            "model: GPT with {params} parameters ({:.2} MiB in {}): {} layers, d_model {}, {} heads, seq_len {}, \
             vocab {}",
            mib((params * size_of::<S>()) as u64),
            S::NAME,
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
            "memory of this rank ({}): on the GPU parameters {:.2} MiB, gradients {:.2} MiB, optimizer state {:.2} MiB, \
             activations {:.2} MiB, their gradients {:.2} MiB; host copy of the gradients for the all-reduce {:.2} MiB",
            S::NAME,
            mib(held.parameters),
            mib(held.gradients),
            mib(held.optimizer_state),
            mib(held.activations),
            mib(held.activation_grads),
            mib(held.comm_buffers)
        ),
    );
    let mut tally = StepTally::new(spec, 0, f64::INFINITY);
    for step in 0..t.steps {
        if cancel.load(Ordering::Relaxed) {
            return Err(TrainError::Cancelled);
        }
        let step_start = Instant::now();
        let stats = trainer.step(step)?;
        tally.record(on_event, t.steps, step, &stats, step_start.elapsed().as_secs_f64())?;
    }
    let summary = tally.summary(spec, params, trainer.data().loss_floor(), started.elapsed().as_secs_f64(), 1);
    Ok(RankRun { summary, spans: trainer.timeline(), memory: trainer.memory_report() })
}
