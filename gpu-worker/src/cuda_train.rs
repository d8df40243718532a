//! Training on one GPU (cargo feature `cuda`): one rank, dp = tp = pp = 1. The model is
//! the same `Gpt` the CPU ranks run, on the CUDA backend; its parameters and gradients
//! live in GPU memory (`FlatState`), and AdamW runs there too (fp32 moments, and fp32
//! master weights for a bf16 model). Every buffer is registered with the memory ledger
//! in the categories the CPU ranks use.
//!
//! A step is the CPU trainer's with one rank: zero the gradients, forward + backward over
//! the step's micro-batches, the global gradient norm, clipping folded into the update.

use std::sync::Arc;

use distlab_common::memory::RankMemoryReport;
use distlab_common::{ExperimentSpec, LossScaling, Optimizer as OptimizerKind};

use crate::backend::cuda::{AdamWState, CudaBackend, DeviceElem};
use crate::backend::Backend;
use crate::data::Data;
use crate::memory::{Category, MemoryTracker, Receipt};
use crate::model::{FlatState, Gpt, Saved, Stage};
use crate::optim::{clip_scale, lr_at, AdamWStep, ParamGroup, ADAM_BETA1, ADAM_BETA2, ADAM_EPS};
use crate::train::{StepStats, TrainError};

/// What [`CudaTrainer`] cannot run yet, one message each (empty: it can).
pub fn unsupported(spec: &ExperimentSpec) -> Vec<String> {
    let mut out = Vec::new();
    if spec.world_size() > 1 {
        let p = &spec.parallel;
        out.push(format!(
            "parallel.dp={} x tp={} x pp={}: the CUDA backend runs one rank on one GPU so far (dp = tp = pp = 1)",
            p.dp, p.tp, p.pp
        ));
    }
    if spec.train.optimizer != OptimizerKind::Adamw {
        out.push("train.optimizer: the CUDA backend runs AdamW only so far".into());
    }
    if spec.train.loss_scaling == LossScaling::Dynamic {
        out.push("train.loss_scaling=dynamic: the CUDA backend has no loss scaler yet".into());
    }
    out
}

/// A model, its parameters, gradients and AdamW state on one GPU, and its data.
pub struct CudaTrainer<S: DeviceElem> {
    spec: ExperimentSpec,
    backend: CudaBackend<S>,
    model: Gpt<CudaBackend<S>>,
    state: FlatState<CudaBackend<S>>,
    adam: AdamWState,
    groups: Vec<ParamGroup>,
    data: Data,
    inputs: Vec<u32>,
    targets: Vec<u32>,
    updates: u64,
    memory: Arc<MemoryTracker>,
    _receipts: Vec<Receipt>,
}

impl<S: DeviceElem> CudaTrainer<S> {
    /// Builds everything on GPU `ordinal`; the spec must be valid, of precision `S`, and
    /// within [`unsupported`].
    pub fn new(spec: &ExperimentSpec, ordinal: usize) -> Result<Self, TrainError> {
        let problems = unsupported(spec);
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
        let backend =
            CudaBackend::<S>::new(ordinal).map_err(|e| TrainError::Unsupported(format!("backend=cuda: {e}")))?;
        let t = &spec.train;
        let data = Data::new(&spec.data, &spec.model, spec.global_batch())?;
        let memory = MemoryTracker::new();
        let saved = Saved { in_flight: 1, checkpointing: t.checkpointing };
        let stage = Stage::whole(spec.model.layers);
        let model = Gpt::new_stage(&backend, &spec.model, t.micro_batch, stage, saved, None, &memory);
        let params = model.layout.total;
        let state = FlatState::new(&backend, &model.layout, t.seed);
        let adam = backend.adamw_state(&state.params);
        let mut receipts = vec![
            memory.alloc_of::<S>(Category::Parameters, params),
            memory.alloc_of::<S>(Category::Gradients, params),
            memory.alloc(Category::OptimizerState, 2 * params),
        ];
        if adam.master.is_some() {
            receipts.push(memory.alloc(Category::OptimizerState, params));
        }
        let tokens = t.micro_batch * spec.model.seq_len;
        Ok(Self {
            spec: spec.clone(),
            groups: model.layout.param_groups(),
            backend,
            model,
            state,
            adam,
            data,
            inputs: vec![0; tokens],
            targets: vec![0; tokens],
            updates: 0,
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

    /// What the memory ledger says this rank holds, by category.
    pub fn memory_report(&self) -> RankMemoryReport {
        self.memory.report(0)
    }

    /// Bytes of every buffer the trainer holds on the GPU, counted from the buffers.
    pub fn held_bytes(&self) -> u64 {
        let be = &self.backend;
        let flat = (be.buf_len(&self.state.params) + be.buf_len(&self.state.grads)) * size_of::<S>();
        self.model.held_bytes(be) + flat as u64 + self.adam.bytes()
    }

    /// Optimizer step `step` (0-based); returns once the GPU has finished it.
    pub fn step(&mut self, step: u64) -> Result<StepStats, TrainError> {
        let be = &self.backend;
        let t = &self.spec.train;
        let seq_len = self.spec.model.seq_len;
        let micro_steps = t.micro_batches * t.grad_accum;
        let dloss = 1.0 / (micro_steps * t.micro_batch * seq_len) as f64;
        self.memory.sample_step(Some(step));
        self.state.zero_grads(be);
        let mut loss_sum = 0.0;
        for micro in 0..micro_steps {
            let first_sequence = micro * t.micro_batch;
            self.data.fill_batch(step, first_sequence, t.micro_batch, seq_len, &mut self.inputs, &mut self.targets);
            loss_sum += self.model.forward(be, &mut self.state, &self.inputs, &self.targets)?;
            self.model.backward(be, &mut self.state, &self.inputs, &self.targets, dloss)?;
        }
        let grad_norm = be.sum_squares(be.all(&self.state.grads)).sqrt();
        let loss = loss_sum * dloss;
        let lr = lr_at(t, step);
        let updated = loss.is_finite() && grad_norm.is_finite();
        if updated {
            self.updates += 1;
            for group in &self.groups {
                let hp = AdamWStep {
                    lr,
                    beta1: ADAM_BETA1,
                    beta2: ADAM_BETA2,
                    eps: ADAM_EPS,
                    weight_decay: if group.decay { t.weight_decay } else { 0.0 },
                    step: self.updates,
                    grad_scale: clip_scale(grad_norm, t.grad_clip),
                };
                be.adamw_update(&mut self.state.params, &self.state.grads, &mut self.adam, group.range.clone(), &hp);
            }
        }
        be.synchronize();
        self.memory.sample(|| "optimizer step".into());
        self.memory.sample_step(None);
        Ok(StepStats { loss, lr, grad_norm, updated, loss_scale: None })
    }
}
