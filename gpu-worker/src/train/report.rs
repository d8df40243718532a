//! What a run reports: a metric point per step, the run's summary, a log line per
//! checkpoint write, and what one rank's training leaves behind.

use distlab_common::events::ExpertMetrics;
use distlab_common::memory::RankMemoryReport;
use distlab_common::trace::Span;
use distlab_common::{CheckpointWrite, ExperimentSpec, LogLevel, LogLine, MetricPoint, RunEvent, RunSummary};

use crate::checkpoint::{CheckpointError, RankPlace, Written};

use super::{StepStats, TrainError};

pub(crate) fn log(on_event: &mut dyn FnMut(RunEvent), message: String) {
    on_event(RunEvent::Log(LogLine { level: LogLevel::Info, message }));
}

pub(super) fn mib(floats: usize) -> f64 {
    (floats * 4) as f64 / (1024.0 * 1024.0)
}

pub(crate) fn mib_bytes(bytes: u64) -> f64 {
    bytes as f64 / (1024.0 * 1024.0)
}

/// How a fault-tolerant replacement's line about its rejoin starts (it reports it itself).
pub const REJOIN_LOG: &str = "this replica rejoins the others";

/// How the log line of a checkpoint write begins.
pub const CHECKPOINT_LOG: &str = "checkpoint of step";

/// A log line per checkpoint write: its size and what it cost the training loop.
pub(super) fn report_checkpoints(
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
    /// The latest validation loss.
    final_val_loss: Option<f64>,
    /// The lowest step loss so far (a resumed run starts from its checkpoint's).
    pub min_loss: f64,
    timed_seconds: f64,
    timed_steps: u64,
}

impl StepTally {
    pub fn new(spec: &ExperimentSpec, first_step: u64, min_loss: f64) -> Self {
        let tokens_per_step = spec.tokens_per_step();
        Self {
            first_step,
            tokens_per_step,
            final_loss: f64::NAN,
            final_val_loss: None,
            min_loss,
            timed_seconds: 0.0,
            timed_steps: 0,
        }
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
        val_loss: Option<f64>,
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
            experts: stats.experts.map(|e| ExpertMetrics {
                balance: e.balance_sum / e.routings.max(1) as f64,
                assignments: e.assignments,
                dropped: e.dropped,
            }),
            logit_grad_zero_share: stats.logit_grad_zero_share,
            val_loss,
            fp8: stats.fp8,
        }));
        self.final_loss = stats.loss;
        self.final_val_loss = val_loss.or(self.final_val_loss);
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
            final_val_loss: self.final_val_loss,
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
            // The model's FLOP rate and MFU: filled by the worker, which knows the devices.
            ..RunSummary::default()
        }
    }
}

/// What one rank's training leaves behind.
pub struct RankRun {
    pub summary: RunSummary,
    /// Timeline spans of the first steps.
    pub spans: Vec<Span>,
    pub memory: RankMemoryReport,
    /// Asynchronous SGD, on the parameter server's rank: every gradient it applied.
    pub applied_gradients: Vec<distlab_common::trace::AppliedGradient>,
}
