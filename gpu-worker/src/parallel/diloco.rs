//! DiLoCo (Douillard et al. 2023, "Distributed Low-Communication Training of Language
//! Models"): local SGD with an outer optimizer. Every replica of the data-parallel group
//! holds the whole model and its own inner optimizer (AdamW or SGD) and trains on its own
//! slice of each step's batch, sending nothing; every H steps the replicas meet:
//!
//!   Δ = mean over replicas of (θ_outer - θ_replica)      one all-reduce of the parameters
//!   u = μ u + Δ                                          the outer momentum
//!   θ_outer = θ_outer - η (Δ + μ u)                      Nesterov (μ = 0: θ_outer - η Δ)
//!   θ_replica = θ_outer                                  on every replica
//!
//! so the bytes on the wire fall H-fold against DDP's gradient all-reduce every step. With
//! SGD inside, H = 1, η = 1 and μ = 0 it is DDP: θ_outer - mean(lr g_r) = θ - lr mean(g_r).
//! With AdamW inside it is not, even at H = 1: each replica normalises its own gradient by
//! its own moments before the mean is taken.
//!
//! A replica's gradient is its own mean over its tokens: the model weights every token by
//! 1 / (the global batch's tokens), so the inner update scales it by the replicas. The
//! step's gradient norm is the root mean square of the replicas' own norms (one scalar
//! all-reduce), so that every replica clips by the same factor and all of them skip a step
//! together when one gradient is not finite (a replica that skipped alone would miss the
//! outer step the others wait in).

use std::sync::Arc;

use distlab_common::trace::Span;
use distlab_common::ExperimentSpec;

use super::ddp::Replicated;
use super::{host_category, DpGroup, SavedState, StateView, Strategy, TrainBackend};
use crate::backend::Stored;
use crate::comm::{sum_scalar, CommError, Communicator, ReduceOp};
use crate::error::TrainError;
use crate::memory::{Category, MemoryTracker, Receipt};
use crate::model::{ModelState, ParamLayout, Stage};
use crate::offload::{OffloadError, OffloadTo};
use crate::trace::{blocking_comm_span, now_us};

/// A replica that steps alone and meets the others every `every` steps.
pub struct DiLoCo<B: TrainBackend> {
    /// The replica: the whole stage's parameters, gradients and inner optimizer, with no
    /// group of its own (nothing is summed after backward).
    inner: Replicated<B>,
    /// The outer step's all-reduce of the parameter changes.
    outer_comm: Box<dyn Communicator>,
    scalars: Box<dyn Communicator>,
    replicas: usize,
    outer_steps_every: u64,
    outer_lr: f64,
    outer_momentum: f64,
    /// θ_outer: the parameters every replica started from at the last outer step (fp32).
    outer: Vec<f32>,
    /// u, the outer momentum (empty without momentum).
    velocity: Vec<f32>,
    step: u64,
    record: bool,
    spans: Vec<Span>,
    memory: Arc<MemoryTracker>,
    _receipts: Vec<Receipt>,
}

impl<B: TrainBackend> DiLoCo<B> {
    pub fn new(
        spec: &ExperimentSpec,
        be: &B,
        layout: &ParamLayout,
        stage: &Stage,
        memory: &Arc<MemoryTracker>,
        dp: DpGroup,
        offload: &OffloadTo,
    ) -> Result<Self, TrainError> {
        let inner = Replicated::new(spec, be, layout, stage, memory, None, offload)?;
        let outer = be.read_host(be.all(inner.params()), |p| p.iter().map(|x| x.load()).collect::<Vec<f32>>());
        let p = &spec.parallel;
        let velocity = if p.outer_momentum > 0.0 { vec![0.0; outer.len()] } else { Vec::new() };
        let category = host_category(be, Category::OptimizerState);
        let receipts =
            [outer.len(), velocity.len()].into_iter().filter(|&n| n > 0).map(|n| memory.alloc(category, n)).collect();
        Ok(Self {
            inner,
            outer_comm: dp.grads,
            scalars: dp.scalars,
            replicas: dp.world,
            outer_steps_every: p.outer_steps_every.max(1),
            outer_lr: p.outer_lr,
            outer_momentum: p.outer_momentum,
            outer,
            velocity,
            step: 0,
            record: false,
            spans: Vec::new(),
            memory: memory.clone(),
            _receipts: receipts,
        })
    }

    /// The outer step: the replicas' mean change since the last one, the Nesterov step on
    /// it, and every replica's parameters set to the result.
    fn outer_step(&mut self, be: &B) -> Result<(), CommError> {
        let params = self.inner.params_mut();
        let _delta = self.memory.alloc(host_category(be, Category::Transient), self.outer.len());
        let mut delta = be
            .read_host(be.all(params), |p| self.outer.iter().zip(p).map(|(&o, x)| o - x.load()).collect::<Vec<f32>>());
        if self.record {
            be.synchronize();
        }
        let (start, sent_before) = (now_us(), self.outer_comm.bytes_sent());
        self.outer_comm.all_reduce(&mut delta, ReduceOp::Sum)?;
        if self.record {
            let sent = self.outer_comm.bytes_sent() - sent_before;
            self.spans.push(blocking_comm_span("all_reduce parameter changes (DiLoCo)", self.step, start, sent));
        }
        let (lr, mu, replicas) = (self.outer_lr as f32, self.outer_momentum as f32, self.replicas as f32);
        for (i, (o, d)) in self.outer.iter_mut().zip(&delta).enumerate() {
            let d = d / replicas;
            let step = match self.velocity.get_mut(i) {
                Some(u) => {
                    *u = mu * *u + d;
                    d + mu * *u
                }
                None => d,
            };
            *o -= lr * step;
        }
        let outer = &self.outer;
        be.on_host(be.all_mut(params), |p| {
            for (x, &o) in p.iter_mut().zip(outer) {
                *x = B::Elem::store(o);
            }
        });
        Ok(())
    }
}

impl<B: TrainBackend> Strategy<B> for DiLoCo<B> {
    fn begin_step(&mut self, be: &B, step: u64, record: bool) -> Result<(), TrainError> {
        (self.step, self.record) = (step, record);
        self.inner.begin_step(be, step, record)?;
        Ok(())
    }

    fn state(&mut self, last: bool) -> &mut dyn ModelState<B> {
        self.inner.state(last)
    }

    /// The replica's own gradient, unsummed; its squares as its own mean's (x replicas²),
    /// averaged over the replicas.
    fn reduce_gradients(&mut self, be: &B) -> Result<f64, CommError> {
        let replicas = self.replicas as f64;
        let own = self.inner.reduce_gradients(be)? * replicas * replicas;
        Ok(sum_scalar(self.scalars.as_mut(), own)? / replicas)
    }

    fn update(&mut self, be: &B, lr: f64, grad_scale: f64) -> Result<(), TrainError> {
        self.inner.update(be, lr, grad_scale * self.replicas as f64)?;
        if (self.step + 1).is_multiple_of(self.outer_steps_every) {
            self.outer_step(be)?;
        }
        Ok(())
    }

    fn sum_scalar(&mut self, value: f64) -> Result<f64, CommError> {
        sum_scalar(self.scalars.as_mut(), value)
    }

    fn comm_spans(&self) -> Vec<Span> {
        let mut spans = self.inner.comm_spans();
        spans.extend(self.spans.iter().cloned());
        spans
    }

    fn held_bytes(&self, be: &B) -> u64 {
        let outer = if be.buffers_on_host() { (self.outer.len() + self.velocity.len()) as u64 * 4 } else { 0 };
        self.inner.held_bytes(be) + outer
    }

    /// The first replica's parameters and inner optimizer stand for the run's (an export's
    /// model; checkpoints are refused: they would not keep the outer state).
    fn view_state(&self, be: &B, f: &mut dyn FnMut(StateView<'_>)) -> Result<(), OffloadError> {
        self.inner.view_state(be, f)
    }

    fn load(&mut self, be: &B, state: SavedState) -> Result<(), String> {
        self.inner.load(be, state)
    }
}
