//! One rank's trainer: its model, its strategy and its data on one backend, and one
//! optimizer step (every micro-batch in the pipeline schedule's order, the gradient sum,
//! the global norm, the update), checkpoints of its state, its timeline.

use distlab_common::events::Fp8Metrics;
use std::path::PathBuf;
use std::sync::Arc;

use distlab_common::memory::RankMemoryReport;
use distlab_common::trace::{Span, SpanKind};
use distlab_common::{ExperimentSpec, LossScaling, Offload, Sharding, ValidSpec};

use crate::backend::{CpuBackend, Stored};
use crate::checkpoint::{RankCheckpoint, RankPlace};
use crate::comm::CommError;
use crate::data::Data;
use crate::loss_scale::{LossScaler, ScaledStep};
use crate::memory::{Category, MemoryTracker, Receipt};
use crate::model::experts::ExpertParallelGroup;
use crate::model::fp8_linear::{Fp8Block, FP8_SCALES};
use crate::model::{ActivationTier, Gpt, ModelState, OpenUnit, Pass, Saved, StageInput, Unit};
use crate::model::{ContextParallelGroup, ContextPlace, ExpertStats, ModelGroups, TensorParallelGroup};
use crate::offload::OffloadTo;
use crate::ops::attention::Positions;
use crate::optim::{clip_scale, lr_at, needs_master, OptimizerState};
use crate::parallel::compression::{COMPRESSION_Q, COMPRESSION_RESIDUAL};
use crate::parallel::context::ContextParallel;
use crate::parallel::expert::ExpertParallel;
use crate::parallel::pipeline::{self, PipelineGroup, PipelineLinks};
use crate::parallel::schedule::{Action, Pipeline};
use crate::parallel::tensor::TensorParallel;
use crate::parallel::{self, DpGroup, SavedState, StateView, Strategy, TrainBackend};
use crate::trace::{now_us, CommTracer};

use super::TrainError;

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
    /// Mixture of Experts: what every router of the step did, summed over the ranks.
    pub experts: Option<ExpertStats>,
    /// The share of the logit gradients stored as 0 in the step's first backward (on a
    /// rank with the LM head): underflow, in fp16 without loss scaling.
    pub logit_grad_zero_share: Option<f64>,
    /// FP8: what this step's casts on this rank's blocks saw.
    pub fp8: Option<Fp8Metrics>,
}

/// A model, its strategy (parameters, gradients, optimizer state) and its data on the CPU
/// backend with buffers of `S` (f32; bf16 or fp16 for mixed precision), ready to take
/// steps. Call it from inside the rayon pool the backend was made for (see [`train`]).
pub struct Trainer<B: TrainBackend> {
    spec: ExperimentSpec,
    pub(super) backend: B,
    pub(super) model: Gpt<B>,
    strategy: Box<dyn Strategy<B>>,
    data: Data,
    inputs: Vec<u32>,
    targets: Vec<u32>,
    /// This rank's place in data parallelism: (rank, world).
    dp: (usize, usize),
    /// Its place in its context-parallel group (consecutive data-parallel ranks).
    context: ContextPlace,
    /// Its place in the whole mesh (its checkpoint file).
    place: RankPlace,
    /// The first step this process runs (after a resume, the checkpoint's).
    first_step: u64,
    /// Pipeline parallelism: the links to the neighbouring stages (None: one stage).
    links: Option<PipelineLinks<B::Elem>>,
    /// Dynamic loss scaling (fp16 with `loss_scaling: dynamic`).
    scaler: Option<LossScaler>,
    pub(super) memory: Arc<MemoryTracker>,
    /// The staging pieces of the channels to the other ranks, booked.
    _transport: Receipt,
    /// Timeline spans of the first `SPAN_STEPS` steps (compute lane; comm spans come
    /// from the strategy).
    pub spans: Vec<Span>,
    /// The rank's communication record (None: nothing records it).
    tracer: Option<Arc<CommTracer>>,
}

/// Steps whose timeline is recorded span by span (and whose memory is sampled).
pub const SPAN_STEPS: u64 = 3;

fn span(kind: SpanKind, name: String, step: u64, lane: &str, start_us: u64, end_us: u64, layer: Option<u32>) -> Span {
    Span {
        kind,
        name,
        step,
        lane: lane.into(),
        start_us,
        end_us,
        layer,
        bucket: None,
        bytes: None,
        micro: None,
        chunk: None,
    }
}

/// The trainer on the CPU backend with buffers of `S`.
pub type CpuTrainer<S = f32> = Trainer<CpuBackend<S>>;

impl<S: Stored<Acc = f32>> Trainer<CpuBackend<S>> {
    /// Builds everything a run needs; the spec must be supported here.
    pub fn new(spec: &ValidSpec, threads: usize) -> Result<Self, TrainError> {
        Self::with_data_parallel(spec, threads, None)
    }

    /// A trainer for one rank of a data-parallel group (`dp`), or the whole run (None).
    pub fn with_data_parallel(spec: &ValidSpec, threads: usize, dp: Option<DpGroup>) -> Result<Self, TrainError> {
        Self::with_groups(spec, threads, Groups { dp, ..Groups::default() })
    }

    /// A trainer for one rank: its data-parallel group and its pipeline group.
    pub fn with_groups(spec: &ValidSpec, threads: usize, groups: Groups) -> Result<Self, TrainError> {
        let memory = MemoryTracker::new();
        let backend = CpuBackend::<S>::new(threads).booking_scratch_in(&memory);
        Self::build(spec, backend, memory, groups)
    }
}

impl<B: TrainBackend> Trainer<B> {
    /// A trainer for one rank on `backend`, booking into `memory`: its model, its
    /// strategy for its groups, its data.
    pub fn build(spec: &ValidSpec, backend: B, memory: Arc<MemoryTracker>, groups: Groups) -> Result<Self, TrainError> {
        let stored = <B::Elem as Stored>::NAME;
        if stored != spec.train.precision.as_str() {
            return Err(TrainError::Unsupported(format!(
                "train.precision={}: this trainer stores {stored} (the trainer must be made for the spec's precision)",
                spec.train.precision.as_str(),
            )));
        }
        let data = match &groups.cut_text {
            Some(dir) => Data::open_cut(&spec.data, &spec.model, spec.global_batch(), dir)?,
            None => Data::open(&spec.data, &spec.model, spec.global_batch(), groups.dataset.as_deref())?,
        };
        let groups_tracer = groups.tracer.clone();
        // The channels to the other ranks: the rings' staging pieces (heap) are booked; the
        // pipes (shared memory, mostly never touched) are reported beside the ledger.
        let transport = memory.alloc(Category::Transport, (groups.staging_bytes(spec.parallel.sharding) / 4) as usize);
        memory.set_pipe_bytes(groups.pipe_bytes);
        let t = &spec.train;
        let stage_index = groups.pp.as_ref().map_or(0, |g| g.stage);
        let pipe = Pipeline::of(spec);
        let stage = pipeline::stage_of(&pipe, spec.model.layers, stage_index);
        let tp_rank = groups.tp.as_ref().map_or(0, |g| g.place().rank);
        let tp = groups.tp.map(|g| Box::new(g) as Box<dyn TensorParallelGroup<B>>);
        let sequence_parallel = spec.parallel.splits_sequence();
        let split_backward = pipe.splits_backward();
        let cp_kind = spec.parallel.cp_kind;
        let saved = Saved {
            checkpointing: t.checkpointing,
            attention: t.attention,
            sequence_parallel,
            split_backward,
            cp_kind,
            fp8: t.fp8,
        };
        let ep = groups.ep.map(|g| Box::new(g) as Box<dyn ExpertParallelGroup<B>>);
        let cp = groups.cp.map(|g| Box::new(g) as Box<dyn ContextParallelGroup<B>>);
        let context = cp.as_ref().map_or(ContextPlace::ALONE, |g| g.place());
        let groups_here = ModelGroups { tp, ep, cp };
        let mut model =
            Gpt::new_stage(&backend, &spec.model, t.micro_batch, stage.clone(), saved, groups_here, &memory);
        let offload_dir = groups.offload_dir.unwrap_or_else(default_offload_dir);
        match t.activation_offload {
            Offload::None => {}
            Offload::Host => model.offload_activations(&backend, &ActivationTier::Host)?,
            Offload::Disk => model.offload_activations(&backend, &ActivationTier::Disk(offload_dir.clone()))?,
        }
        let place = groups.dp.as_ref().map_or((0, 1), |g| (g.rank, g.world));
        let offload = match spec.parallel.offload {
            Offload::None => OffloadTo::None,
            Offload::Host => OffloadTo::Host,
            Offload::Disk => OffloadTo::Disk(offload_dir),
        };
        let strategy = parallel::build(spec, &backend, &model.layout, &stage, &memory, groups.dp, &offload)?;
        let links = groups.pp.map(|g| PipelineLinks::new(g, &pipe, model.stage_output_len(), &memory));
        let first_step = strategy.joins_at().unwrap_or(0);
        // (whole sequences: context-parallel ranks read them and keep their tokens)
        let tokens = spec.train.micro_batch * spec.model.seq_len;
        memory.mark_start_up();
        Ok(Self {
            spec: ExperimentSpec::clone(spec),
            backend,
            model,
            strategy,
            data,
            inputs: vec![0; tokens],
            targets: vec![0; tokens],
            dp: place,
            context,
            place: RankPlace { dp: place.0, tp: tp_rank, pp: stage_index },
            first_step,
            links,
            scaler: (t.loss_scaling == LossScaling::Dynamic).then(LossScaler::default),
            memory,
            _transport: transport,
            spans: Vec::new(),
            tracer: groups_tracer,
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
        let received = self.links.as_ref().map_or(0, PipelineLinks::held_bytes);
        self.model.held_bytes(&self.backend) + self.strategy.held_bytes(&self.backend) + received
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
        // Replica r takes sequences [r * per_rank, (r+1) * per_rank) of the global batch
        // (its context-parallel ranks each T/cp tokens of them).
        let per_rank = micro_steps * t.micro_batch;
        let step_tokens = dp_world * per_rank * (seq_len / self.context.size);
        let dloss = 1.0 / step_tokens as f64;
        // Dynamic loss scaling multiplies the loss, so every gradient, by the scale.
        let scale = self.scaler.as_ref().map_or(1.0, LossScaler::scale);
        let record = step - self.first_step.min(step) < SPAN_STEPS;
        self.memory.sample_step(record.then_some(step));
        let pipe = Pipeline::of(&self.spec);
        let orders: Vec<Vec<Action>> = (0..pipe.stages).map(|s| pipe.actions(s)).collect();

        self.strategy.begin_step(be, step, record)?;
        if let Some(tp) = self.model.tensor_parallel() {
            tp.begin_step(step, record);
        }
        if let Some(ep) = self.model.expert_parallel() {
            ep.begin_step(step, record);
        }
        if let Some(cp) = self.model.context_parallel() {
            cp.begin_step(step, record);
        }
        self.model.begin_offload_step(step, record);
        let positions = self.token_positions();
        let mut work = StageStep {
            model: &mut self.model,
            strategy: self.strategy.as_mut(),
            data: &self.data,
            inputs: &mut self.inputs,
            targets: &mut self.targets,
            memory: &self.memory,
            spans: &mut self.spans,
            step,
            record,
            pipelined: pipe.stages > 1,
            chunked: pipe.chunks > 1,
            first_sequence: dp_rank / self.context.size * per_rank,
            micro_batch: t.micro_batch,
            seq_len,
            positions,
            dloss: dloss * scale,
            validation: false,
        };
        let mut loss_sum = pipeline::run_step(be, self.links.as_mut(), &pipe, &orders, &mut work, record)?;
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
        let ep = self.spec.parallel.ep;
        if ep > 1 {
            // Each rank holds its experts' gradients (the shared tensors count 1/ep each):
            // over the data-parallel group every part is counted dp/ep times.
            grad_norm_squared = self.strategy.sum_scalar(grad_norm_squared)? / (dp_world / ep) as f64;
        }
        let experts = self.spec.model.is_moe().then(|| self.model.take_expert_stats());
        let logit_grad_zero_share =
            self.model.take_logit_grad_zeros().map(|z| z.zeros as f64 / z.sampled.max(1) as f64);
        // (FP8's delayed scales for the next step: from this one's amaxes)
        let fp8 = self.model.fp8_end_step();
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
        let experts = match experts {
            Some(mine) => Some(sum_expert_stats(mine, self.links.as_mut(), self.dp.1, self.strategy.as_mut())?),
            None => None,
        };
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
        Ok(StepStats { loss, lr, grad_norm, updated, loss_scale, experts, logit_grad_zero_share, fp8 })
    }

    /// After the last step: what the strategy still has to do, and a line for the log
    /// (see `Strategy::end`).
    pub fn end(&mut self) -> Result<Option<String>, TrainError> {
        self.strategy.end(&self.backend)
    }

    /// Asynchronous SGD, on the parameter server's rank: every gradient it applied.
    pub fn applied_gradients(&self) -> Vec<distlab_common::trace::AppliedGradient> {
        self.strategy.applied_gradients()
    }

    /// The validation loss after step `step`: as many held-out sequences as a step's
    /// global batch, each rank taking the slice it trains on (so every layout of the same
    /// global batch evaluates the same sequences), forward only, one micro-batch at a time
    /// through every stage and chunk (its activations dropped before the next: never more
    /// memory than training), the token losses summed over the pipeline and the replicas.
    /// Nothing the next step uses changes: no gradient is made, the routers' statistics are
    /// discarded, no span is recorded.
    pub fn evaluate(&mut self, step: u64) -> Result<f64, TrainError> {
        let be = &self.backend;
        let (micro_batch, seq_len) = (self.spec.train.micro_batch, self.spec.model.seq_len);
        let micro_steps = self.spec.pipeline_micro_batches();
        let (dp_rank, dp_world) = self.dp;
        self.strategy.begin_step(be, step, false)?;
        if let Some(tp) = self.model.tensor_parallel() {
            tp.begin_step(step, false);
        }
        if let Some(ep) = self.model.expert_parallel() {
            ep.begin_step(step, false);
        }
        if let Some(cp) = self.model.context_parallel() {
            cp.begin_step(step, false);
        }
        self.model.begin_offload_step(step, false);
        // The evaluation's collectives are counted apart from training's.
        let _evaluating = self.tracer.clone().map(Evaluating::begin);
        let pipe = Pipeline::of(&self.spec);
        let positions = self.token_positions();
        let mut work = StageStep {
            model: &mut self.model,
            strategy: self.strategy.as_mut(),
            data: &self.data,
            inputs: &mut self.inputs,
            targets: &mut self.targets,
            memory: &self.memory,
            spans: &mut self.spans,
            step,
            record: false,
            pipelined: pipe.stages > 1,
            chunked: pipe.chunks > 1,
            first_sequence: dp_rank / self.context.size * micro_steps * micro_batch,
            micro_batch,
            seq_len,
            positions,
            dloss: 0.0,
            validation: true,
        };
        let mut loss_sum = 0.0;
        for micro in 0..micro_steps {
            // (every stage: the micro-batch through its chunks in order)
            let forwards: Vec<Action> = (0..pipe.chunks).map(|chunk| Action::Forward { micro, chunk }).collect();
            let orders = vec![forwards; pipe.stages];
            loss_sum += pipeline::run_step(be, self.links.as_mut(), &pipe, &orders, &mut work, false)?;
            work.model.drop_activations()?;
        }
        if let Some(links) = &mut self.links {
            links.flush()?;
            loss_sum = links.sum_scalar(loss_sum)?;
        }
        if dp_world > 1 {
            loss_sum = self.strategy.sum_scalar(loss_sum)?;
        }
        if self.spec.model.is_moe() {
            self.model.take_expert_stats();
        }
        self.model.fp8_forget_casts();
        Ok(loss_sum / (dp_world * micro_steps * micro_batch * (seq_len / self.context.size)) as f64)
    }

    /// This rank's checkpoint before step `step`: a copy of the state its strategy owns
    /// (state every DP rank holds alike is written by DP rank 0 alone; see `checkpoint.rs`).
    /// The copy goes into `reuse`'s buffers, already paged in by an earlier checkpoint.
    pub fn checkpoint(&self, step: u64, min_loss: f64, reuse: RankCheckpoint) -> Result<RankCheckpoint, TrainError> {
        self.copy_state(step, min_loss, reuse, &|_| true)
    }

    /// This rank's final weights (`export.rs`): the checkpoint's parameter sections only,
    /// the fp32 master copy where a 2-byte run keeps one ("master"), else "params".
    pub fn final_weights(&self, step: u64) -> Result<RankCheckpoint, TrainError> {
        self.copy_state(step, 0.0, RankCheckpoint::default(), &|name| name == "params" || name == "master")
    }

    fn copy_state(
        &self,
        step: u64,
        min_loss: f64,
        reuse: RankCheckpoint,
        keep: &dyn Fn(&str) -> bool,
    ) -> Result<RankCheckpoint, TrainError> {
        let mut reuse = Some(reuse);
        let mut made = None;
        self.strategy.view_state(&self.backend, &mut |view| {
            let reuse = reuse.take().unwrap_or_default();
            made = Some(self.checkpoint_of(view, step, min_loss, reuse, keep));
        })?;
        Ok(made.expect("a strategy shows its state"))
    }

    fn checkpoint_of(
        &self,
        view: StateView<'_>,
        step: u64,
        min_loss: f64,
        reuse: RankCheckpoint,
        keep: &dyn Fn(&str) -> bool,
    ) -> RankCheckpoint {
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
        // Every rank writes its own (gradient compression's residual; FP8's scales and amax
        // histories, made from this rank's inputs and gradients).
        wanted.extend(view.local.iter().map(|(name, values)| (*name, values.as_slice())));
        let fp8 = self.model.fp8_save();
        if let Some(fp8) = &fp8 {
            wanted.push((FP8_SCALES, fp8));
        }
        wanted.retain(|(name, _)| keep(name));
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
        // FP8's scales: this rank's, or where this place had no rank before (an elastic
        // resume onto more ranks), those of its data-parallel rank 0.
        if self.spec.train.fp8 != distlab_common::Fp8Recipe::None {
            self.model.fp8_restore(&find(FP8_SCALES)?)?;
        }
        // This rank's own sections (never another rank's).
        let local = own
            .sections
            .iter()
            .filter(|(name, _)| [COMPRESSION_RESIDUAL, COMPRESSION_Q].contains(&name.as_str()))
            .cloned()
            .collect();
        let state = SavedState {
            params: find("params")?,
            optimizer: OptimizerState { steps_taken: own.optimizer_steps, m, v, master },
            local,
        };
        self.strategy.load(&self.backend, state)?;
        self.first_step = own.step;
        Ok(())
    }

    fn has_moments(&self) -> bool {
        self.spec.train.optimizer.keeps_moments()
    }

    /// The first step this rank runs: 0, a resumed checkpoint's, or the step a
    /// fault-tolerant replacement joins the other replicas at.
    pub fn first_step(&self) -> u64 {
        self.first_step
    }

    pub fn place(&self) -> RankPlace {
        self.place
    }

    /// Where this rank's tokens of each sequence sit: all of them, or its context-parallel
    /// share (the balanced ring's in two runs).
    fn token_positions(&self) -> Positions {
        let (ContextPlace { rank, size }, seq) = (self.context, self.spec.model.seq_len);
        match size > 1 {
            true => {
                Positions::of_rank(rank, size, seq, self.spec.parallel.cp_kind == distlab_common::ContextParallel::Ring)
            }
            false => Positions::run(0, seq),
        }
    }

    /// This rank's timeline so far: compute spans and the strategy's communication spans.
    pub fn timeline(&self) -> Vec<Span> {
        let mut spans = self.spans.clone();
        spans.extend(self.strategy.comm_spans());
        if let Some(tp) = &self.model.tp_spans() {
            spans.extend(tp.iter().cloned());
        }
        if let Some(ep) = &self.model.ep_spans() {
            spans.extend(ep.iter().cloned());
        }
        if let Some(cp) = &self.model.cp_spans() {
            spans.extend(cp.iter().cloned());
        }
        if let Some(offload) = &self.model.offload_spans() {
            spans.extend(offload.iter().cloned());
        }
        spans.sort_by_key(|s| s.start_us);
        spans
    }
}

/// A rank's routing statistics summed over every stage (`links`) and replica (the
/// strategy's data-parallel group of `dp_world` ranks).
fn sum_expert_stats<B: TrainBackend>(
    mine: ExpertStats,
    mut links: Option<&mut PipelineLinks<B::Elem>>,
    dp_world: usize,
    strategy: &mut dyn Strategy<B>,
) -> Result<ExpertStats, CommError> {
    let mut values = [mine.balance_sum, mine.routings as f64, mine.assignments as f64, mine.dropped as f64];
    for v in &mut values {
        if let Some(links) = links.as_deref_mut() {
            *v = links.sum_scalar(*v)?;
        }
        if dp_world > 1 {
            *v = strategy.sum_scalar(*v)?;
        }
    }
    let [balance_sum, routings, assignments, dropped] = values;
    let count = |x: f64| x.round() as u64;
    Ok(ExpertStats { balance_sum, routings: count(routings), assignments: count(assignments), dropped: count(dropped) })
}

/// While alive, the tracer counts calls as an evaluation's.
struct Evaluating(Arc<CommTracer>);

impl Evaluating {
    fn begin(tracer: Arc<CommTracer>) -> Self {
        tracer.set_evaluating(true);
        Self(tracer)
    }
}

impl Drop for Evaluating {
    fn drop(&mut self) {
        self.0.set_evaluating(false);
    }
}

/// The groups of ranks one rank belongs to (None: it is alone in that dimension).
#[derive(Default)]
pub struct Groups {
    /// This rank's place in the whole run (0..world).
    pub rank: usize,
    /// The ranks running on this rank's machine (all of them, unless the run spans
    /// workers): a GPU rank takes the machine's GPU `rank - machine.start` mod GPUs.
    pub machine: std::ops::Range<usize>,
    pub dp: Option<DpGroup>,
    pub pp: Option<PipelineGroup>,
    pub tp: Option<TensorParallel>,
    /// Expert parallelism's group (its all-to-alls) and the gradient sum of the experts
    /// over their replicas (None: every rank of the data-parallel group holds them all).
    pub ep: Option<ExpertParallel>,
    /// Context parallelism's group (its all-to-alls; None: this rank holds whole sequences).
    pub cp: Option<ContextParallel>,
    /// Bytes of the shared-memory pipes to the other rank processes this rank maps.
    pub pipe_bytes: u64,
    /// Where this rank's optimizer state goes with `parallel.offload=disk` (None: the
    /// system's temporary directory).
    pub offload_dir: Option<PathBuf>,
    /// The text of `data.dataset: upload`.
    pub dataset: Option<PathBuf>,
    /// The text cut into tokens once for all the ranks (see `TrainOptions::cut_text`).
    pub cut_text: Option<PathBuf>,
    /// What records this rank's communication (an evaluation's calls are counted apart).
    pub tracer: Option<Arc<CommTracer>>,
}

/// Disk offload's directory when the worker names none.
fn default_offload_dir() -> PathBuf {
    std::env::temp_dir().join("distlab-offload")
}

impl Groups {
    /// Heap bytes the communicators the run keeps hold for staging what they move (ZeRO-2
    /// and FSDP reduce-scatter on the main data-parallel communicator and drop the other).
    fn staging_bytes(&self, sharding: Sharding) -> u64 {
        let dp = self.dp.as_ref().map_or(0, |g| {
            let grads = matches!(sharding, Sharding::None | Sharding::Zero1).then(|| g.grads.staging_bytes());
            let experts = g.experts.as_ref().map_or(0, |c| c.staging_bytes());
            let hybrid = g.hybrid.as_ref().map_or(0, |h| h.shard.staging_bytes() + h.replicas.staging_bytes());
            grads.unwrap_or(0) + g.scalars.staging_bytes() + experts + hybrid
        });
        let pp = self.pp.as_ref().map_or(0, |g| g.send.staging_bytes() + g.recv.staging_bytes());
        let ep = self.ep.as_ref().map_or(0, ExpertParallel::staging_bytes);
        let cp = self.cp.as_ref().map_or(0, ContextParallel::staging_bytes);
        dp + pp + self.tp.as_ref().map_or(0, TensorParallel::staging_bytes) + ep + cp
    }
}

/// One step's work on this stage, as the pipeline's loop asks for it: each micro-batch's
/// tokens, its pass through the model on the strategy's state, its spans.
struct StageStep<'a, B: TrainBackend> {
    model: &'a mut Gpt<B>,
    strategy: &'a mut dyn Strategy<B>,
    data: &'a Data,
    inputs: &'a mut Vec<u32>,
    targets: &'a mut Vec<u32>,
    memory: &'a MemoryTracker,
    spans: &'a mut Vec<Span>,
    step: u64,
    record: bool,
    /// Several stages: passes are recorded whole (one stage: per layer).
    pipelined: bool,
    /// Several chunks per stage (interleaved): passes are named by their chunk too.
    chunked: bool,
    /// This rank's first sequence of the global batch.
    first_sequence: usize,
    micro_batch: usize,
    /// Tokens of a whole sequence (what the data hands out).
    seq_len: usize,
    /// Where this rank's tokens of each sequence sit (context parallelism: its T/cp).
    positions: Positions,
    /// d(objective)/d(each token's loss), times the loss scale.
    dloss: f64,
    /// The held-out sequences instead of the step's (an evaluation).
    validation: bool,
}

impl<B: TrainBackend> StageStep<'_, B> {
    /// Micro-batch `micro`'s tokens and targets.
    fn fill(&mut self, micro: usize) {
        let first = self.first_sequence + micro * self.micro_batch;
        let (batch, seq) = (self.micro_batch, self.seq_len);
        self.inputs.resize(batch * seq, 0);
        self.targets.resize(batch * seq, 0);
        if self.validation {
            self.data.fill_validation(first, batch, seq, self.inputs, self.targets);
        } else {
            self.data.fill_batch(self.step, first, batch, seq, self.inputs, self.targets);
        }
        let positions = self.positions;
        let mine = positions.tokens();
        if mine < seq {
            // (each sequence's runs of this rank's tokens, moved to the front in order)
            for tokens in [&mut *self.inputs, &mut *self.targets] {
                for b in 0..batch {
                    for (r, &start) in positions.starts[..positions.parts].iter().enumerate() {
                        let from = b * seq + start;
                        tokens.copy_within(from..from + positions.part, b * mine + r * positions.part);
                    }
                }
                tokens.truncate(batch * mine);
            }
        }
    }

    /// The strategy's state, with the trainer watching (`last`: the step's last micro-batch):
    /// spans per layer when one stage records, memory samples always.
    fn observed(&mut self, last: bool) -> (Observed<'_, B>, &mut Gpt<B>, &[u32], &[u32]) {
        let state = Observed {
            inner: self.strategy.state(last),
            memory: self.memory,
            spans: self.spans,
            record: self.record && !self.pipelined,
            step: self.step,
            mark: now_us(),
        };
        (state, self.model, self.inputs, self.targets)
    }
}

impl<B: TrainBackend> pipeline::StageWork<B> for StageStep<'_, B> {
    type Error = TrainError;

    fn forward(&mut self, be: &B, chunk: usize, micro: usize, input: Option<&[B::Elem]>) -> Result<f64, TrainError> {
        self.fill(micro);
        let start = now_us();
        let (mut state, model, inputs, targets) = self.observed(false);
        let input = input.map_or(StageInput::Tokens(inputs), StageInput::Activation);
        let loss = model.forward_stage(be, &mut state, chunk, micro, input, targets)?;
        if self.record {
            be.synchronize();
            let chunk = self.chunked.then_some(chunk);
            self.spans.push(pipeline::pass_span(SpanKind::Forward, micro, chunk, self.step, start));
        }
        Ok(loss)
    }

    fn backward(
        &mut self,
        be: &B,
        chunk: usize,
        micro: usize,
        output_grad: Option<&[B::Elem]>,
        last: bool,
    ) -> Result<(), TrainError> {
        self.fill(micro);
        let start = now_us();
        let dloss = self.dloss;
        let per_unit = self.record && !self.pipelined;
        let (mut state, model, inputs, targets) = self.observed(last);
        model.time_recomputes(per_unit);
        model.backward_stage(be, &mut state, chunk, micro, inputs, targets, output_grad, dloss)?;
        // A segment's last block ran its forward again inside its backward span: split it off.
        for r in self.model.take_recompute_times() {
            let layer = Some(r.layer as u32);
            let around = self.spans.iter_mut().rev().find(|s| s.kind == SpanKind::Backward && s.layer == layer);
            if let Some(backward) = around.filter(|s| s.start_us <= r.start_us) {
                backward.start_us = r.end_us;
            }
            let name = format!("{} layer {}", distlab_common::trace::RECOMPUTE, r.layer);
            self.spans.push(span(SpanKind::Forward, name, self.step, "compute", r.start_us, r.end_us, layer));
        }
        if self.record && self.pipelined {
            be.synchronize();
            let chunk = self.chunked.then_some(chunk);
            self.spans.push(pipeline::pass_span(SpanKind::Backward, micro, chunk, self.step, start));
        }
        Ok(())
    }

    fn weights(&mut self, be: &B, chunk: usize, micro: usize, last: bool) -> Result<(), TrainError> {
        let start = now_us();
        let (mut state, model, _, _) = self.observed(last);
        model.weights_stage(be, &mut state, chunk, micro)?;
        if self.record {
            be.synchronize();
            let chunk = self.chunked.then_some(chunk);
            self.spans.push(pipeline::pass_span(SpanKind::Weights, micro, chunk, self.step, start));
        }
        Ok(())
    }

    fn read_output(&self, be: &B, chunk: usize, micro: usize, f: &mut dyn FnMut(&[B::Elem])) {
        be.read_host(be.all(self.model.output(chunk, micro)), f);
    }

    fn read_input_grad(&self, be: &B, f: &mut dyn FnMut(&[B::Elem])) {
        be.read_host(be.all(self.model.input_grad()), f);
    }

    fn waited(&mut self, neighbour: usize, start_us: u64, end_us: u64) {
        let name = format!("wait for stage {neighbour}");
        self.spans.push(span(SpanKind::Idle, name, self.step, "compute", start_us, end_us, None));
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

    fn open_fp8(
        &mut self,
        be: &B,
        unit: Unit,
        pass: Pass,
        fp8: &mut Fp8Block,
    ) -> Result<OpenUnit<'_, B::Buf>, CommError> {
        let open = self.inner.open_fp8(be, unit, pass, fp8)?;
        self.memory.sample(|| format!("{} {}: open", pass_name(pass), unit.name()));
        Ok(open)
    }

    fn announce_next(&mut self, next: Option<(Unit, Pass)>) {
        self.inner.announce_next(next);
    }

    fn close(&mut self, be: &B, unit: Unit, pass: Pass) -> Result<(), CommError> {
        let recorded = match (pass, unit) {
            (Pass::Forward, _) => None,
            (Pass::Recompute, Unit::Block(l)) => {
                Some((SpanKind::Forward, format!("{} layer {l}", distlab_common::trace::RECOMPUTE), Some(l)))
            }
            (Pass::Recompute, _) => None,
            (Pass::Backward { .. }, Unit::Head) => Some((SpanKind::Backward, "backward head".to_string(), None)),
            (Pass::Backward { .. }, Unit::Block(l)) => {
                Some((SpanKind::Backward, format!("backward layer {l}"), Some(l)))
            }
            (Pass::Backward { .. }, Unit::Embeddings) => {
                Some((SpanKind::Backward, "backward embeddings".to_string(), None))
            }
            // (ZB-H1 runs on several stages, whose passes are recorded whole)
            (Pass::BackwardInput | Pass::Weights, _) => None,
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
        Pass::Backward { .. } | Pass::BackwardInput => "backward",
        Pass::Weights => "weights",
    }
}
