//! What a run reports while it trains: the worker sends these to the server in
//! batches, the server stores them and streams them to browsers over SSE.

use serde::{Deserialize, Serialize};

/// One optimizer step.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct MetricPoint {
    pub step: u64,
    /// Mean cross-entropy over the step's global batch (nats per token).
    pub loss: f64,
    pub lr: f64,
    /// L2 norm of the gradient before clipping; `f64::MAX` when it overflowed (a step
    /// that dynamic loss scaling skipped).
    pub grad_norm: f64,
    pub tokens_per_s: f64,
    pub step_ms: f64,
    /// Dynamic loss scaling (fp16): the factor this step's loss was multiplied by.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub loss_scale: Option<f64>,
    /// Dynamic loss scaling: steps skipped so far (their gradients overflowed).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub skipped_steps: Option<u64>,
    /// Mixture of Experts: what the routers did in this step.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub experts: Option<ExpertMetrics>,
    /// The share of the logit gradients stored as exactly 0 in the step's first backward
    /// (its first 64 tokens, on a rank with the LM head): in fp16 without loss scaling,
    /// the ones that underflowed. None from a rank without the head.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub logit_grad_zero_share: Option<f64>,
    /// Mean loss on the held-out validation data after this step's update (steps that
    /// `train.eval_every` names, and the last).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub val_loss: Option<f64>,
    /// FP8 (`train.fp8`): what this step's casts on rank 0's blocks saw.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub fp8: Option<Fp8Metrics>,
}

/// One step's FP8 casts of one kind of tensor (the blocks' linear inputs, their weights, or
/// their output gradients), over every block and micro-batch of a rank.
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct Fp8Casts {
    /// The largest |x| any of them had, before scaling.
    pub amax: f64,
    /// The smallest and the largest scale they were cast with (powers of two).
    pub min_scale: f64,
    pub max_scale: f64,
    /// Elements above the format's largest value after scaling (stored as ±max): overflow.
    pub saturated: u64,
    /// Nonzero elements stored as 0: underflow.
    pub flushed: u64,
    /// Elements cast.
    pub elements: u64,
}

/// A step's FP8 casts: the linear layers' inputs and weights (E4M3) and their output
/// gradients (E5M2).
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct Fp8Metrics {
    pub inputs: Fp8Casts,
    pub weights: Fp8Casts,
    pub grads: Fp8Casts,
}

/// A Mixture-of-Experts step's routing, over every block, micro-batch and rank.
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct ExpertMetrics {
    /// The mean of the routers' load-balancing losses (Switch's E x sum_e f_e P_e): 1 when
    /// the assignments and the probabilities are spread evenly, up to E when one expert
    /// takes everything.
    pub balance: f64,
    /// Token-to-expert assignments the routers made (tokens x top_k per block).
    pub assignments: u64,
    /// Those an expert had no room for (its capacity was full): the token skipped it.
    pub dropped: u64,
}

impl ExpertMetrics {
    /// The share of assignments dropped.
    pub fn dropped_share(&self) -> f64 {
        self.dropped as f64 / self.assignments.max(1) as f64
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(rename_all = "lowercase")]
pub enum LogLevel {
    Info,
    Warn,
    Error,
}

/// A line of text for the experiment's log.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct LogLine {
    pub level: LogLevel,
    pub message: String,
}

/// What a worker reports about a running experiment. (A trace is much bigger than a
/// metric point, but there is one per rank per run: not worth a Box in every match.)
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(tag = "type", rename_all = "snake_case")]
#[allow(clippy::large_enum_variant)]
pub enum RunEvent {
    /// A run, or a new attempt at it, begins at `from_step`: 0, or the step of the
    /// checkpoint it resumes from. Metrics of that step and after are this attempt's.
    Start {
        from_step: u64,
    },
    Metric(MetricPoint),
    Log(LogLine),
    /// One rank's trace (sent once per rank at the end of a run; the server keeps the
    /// latest per rank).
    Trace(crate::wire::trace::RankTrace),
}

/// What the end of a successful run reports.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct RunSummary {
    pub steps: u64,
    pub final_loss: f64,
    /// The last validation loss (None when the run never evaluated).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub final_val_loss: Option<f64>,
    pub min_loss: f64,
    /// Loss of a model that guesses uniformly: ln(vocab).
    pub uniform_loss: f64,
    /// Best possible loss on the dataset, when it is known (the Markov chain's entropy rate).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub loss_floor: Option<f64>,
    /// A text's held-out part: bytes per token (1 one token per byte, about 2 for a BPE of
    /// 512 tokens on English). A validation loss per token over this is the loss per byte,
    /// which compares runs whatever their tokenizers.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub held_out_bytes_per_token: Option<f64>,
    pub params: u64,
    pub tokens: u64,
    /// Mean over the run, excluding the first (warm-up) step when there are more.
    pub tokens_per_s: f64,
    pub mean_step_ms: f64,
    pub wall_s: f64,
    pub world_size: usize,
    pub threads: usize,
    /// For a collective demo (no training): what the collective did, checked.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub collective: Option<CollectiveCheck>,
    /// Model FLOPs per second the run achieved: the model's training FLOPs per token
    /// (6 x params + attention, as the planner counts them; recompute not counted) x
    /// `tokens_per_s`. 0 for a collective demo.
    #[serde(default)]
    pub model_flops_per_s: f64,
    /// The peak FLOP/s of what the run ran on, and where that number comes from; None
    /// where the worker does not know its device's peak.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub peak: Option<DevicePeak>,
    /// Model FLOP utilisation: `model_flops_per_s / peak.flops_per_s` (None without a peak).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub mfu: Option<f64>,
    /// With pipeline parallelism, the MFU of each stage's ranks: all stages run at the
    /// pipeline's one pace, so a stage's ranks compute its part of the model's FLOPs per
    /// token (`Plan::stage_flops_per_token`) at the run's tokens/s; their mean is `mfu`.
    /// Empty without pipeline parallelism (every rank's is `mfu`) or a peak.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub stage_mfu: Vec<f64>,
}

impl RunSummary {
    /// Fills `model_flops_per_s` from `flops_per_token` and the measured tokens/s, and the
    /// MFU against `peak` (the whole run's: every device it used).
    pub fn with_utilisation(mut self, flops_per_token: f64, peak: Option<DevicePeak>) -> Self {
        self.model_flops_per_s = flops_per_token * self.tokens_per_s;
        self.mfu = peak.as_ref().filter(|p| p.flops_per_s > 0.0).map(|p| self.model_flops_per_s / p.flops_per_s);
        self.peak = peak;
        self
    }

    /// Fills `stage_mfu` from each stage's FLOPs per token (two stages or more): stage s's
    /// ranks reach `mfu` x stages x its share of the model's FLOPs.
    pub fn with_stage_utilisation(mut self, stage_flops_per_token: &[f64]) -> Self {
        let total: f64 = stage_flops_per_token.iter().sum();
        self.stage_mfu = match self.mfu {
            Some(mfu) if stage_flops_per_token.len() > 1 && total > 0.0 => {
                let stages = stage_flops_per_token.len() as f64;
                stage_flops_per_token.iter().map(|f| mfu * stages * f / total).collect()
            }
            _ => Vec::new(),
        };
        self
    }
}

/// The peak FLOP/s of the devices a run used.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct DevicePeak {
    pub flops_per_s: f64,
    /// How it was found, e.g. "avx2 FMA peak measured when the worker started: 35.2 GFLOP/s
    /// per thread x 2 threads".
    pub basis: String,
}

/// The outcome of a collective demo, checked against a sequential computation.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct CollectiveCheck {
    pub op: crate::spec::DemoOp,
    pub world: usize,
    pub elements: usize,
    /// Payload bytes each rank sent, in rank order.
    pub bytes_sent: Vec<u64>,
    /// The textbook amount per rank: 2(W-1)/W * D for all-reduce, (W-1)/W * D otherwise
    /// (the ring's, for the other all-reduces too: what they are compared with).
    pub formula_bytes: f64,
    /// The all-reduce's algorithm (`parallel.allreduce`).
    #[serde(default)]
    pub algorithm: crate::spec::AllReduce,
    /// Another algorithm than the ring: what each rank sends by its formula
    /// (`all_reduce::elements_sent`), in rank order.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub rank_formula_bytes: Vec<u64>,
    /// Largest |result - expected| over all ranks and elements (0 when exact).
    pub max_abs_error: f64,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(rename_all = "lowercase")]
pub enum ExperimentStatus {
    Queued,
    Running,
    Succeeded,
    Failed,
    Cancelled,
}

impl ExperimentStatus {
    pub const ALL: [ExperimentStatus; 5] = [
        ExperimentStatus::Queued,
        ExperimentStatus::Running,
        ExperimentStatus::Succeeded,
        ExperimentStatus::Failed,
        ExperimentStatus::Cancelled,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            ExperimentStatus::Queued => "queued",
            ExperimentStatus::Running => "running",
            ExperimentStatus::Succeeded => "succeeded",
            ExperimentStatus::Failed => "failed",
            ExperimentStatus::Cancelled => "cancelled",
        }
    }

    pub fn parse(s: &str) -> Option<Self> {
        Self::ALL.into_iter().find(|x| x.as_str() == s)
    }

    /// Succeeded, failed and cancelled experiments never change again.
    pub fn is_finished(self) -> bool {
        matches!(self, ExperimentStatus::Succeeded | ExperimentStatus::Failed | ExperimentStatus::Cancelled)
    }
}

/// A status change, as streamed to browsers.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct StatusChange {
    pub status: ExperimentStatus,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub summary: Option<RunSummary>,
}

/// One message on `GET /api/experiments/{id}/stream`. The SSE event name is the
/// `type` field (`status`, `start`, `metric`, `log`, `trace`); the data is this JSON.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum StreamEvent {
    Status(StatusChange),
    /// An attempt began at `from_step` (after a resume: the checkpoint's step); metrics
    /// of that step and later from earlier attempts are gone.
    Start {
        from_step: u64,
    },
    Metric(MetricPoint),
    Log(LogLine),
    /// A rank's trace was stored (fetch it from `/trace`).
    Trace {
        rank: u32,
    },
}

impl StreamEvent {
    pub fn name(&self) -> &'static str {
        match self {
            StreamEvent::Status(_) => "status",
            StreamEvent::Start { .. } => "start",
            StreamEvent::Metric(_) => "metric",
            StreamEvent::Log(_) => "log",
            StreamEvent::Trace { .. } => "trace",
        }
    }
}

impl From<RunEvent> for StreamEvent {
    fn from(e: RunEvent) -> Self {
        match e {
            RunEvent::Start { from_step } => StreamEvent::Start { from_step },
            RunEvent::Metric(m) => StreamEvent::Metric(m),
            RunEvent::Log(l) => StreamEvent::Log(l),
            RunEvent::Trace(t) => StreamEvent::Trace { rank: t.rank },
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_stage_computes_its_part_of_the_model_at_the_pipelines_pace() {
        let peak = DevicePeak { flops_per_s: 100.0, basis: "test".into() };
        let run = RunSummary { tokens_per_s: 2.0, ..RunSummary::default() }.with_utilisation(10.0, Some(peak));
        assert_eq!(run.mfu, Some(0.2));
        // Three stages doing 5, 3 and 2 of the 10 FLOPs per token.
        let staged = run.clone().with_stage_utilisation(&[5.0, 3.0, 2.0]);
        let expect = [0.3, 0.18, 0.12];
        assert!(staged.stage_mfu.iter().zip(expect).all(|(a, b)| (a - b).abs() < 1e-12), "{:?}", staged.stage_mfu);
        let mean = staged.stage_mfu.iter().sum::<f64>() / 3.0;
        assert!((mean - 0.2).abs() < 1e-12);
        assert!(run.clone().with_stage_utilisation(&[10.0]).stage_mfu.is_empty(), "one stage: the run's MFU");
        let no_peak = RunSummary { tokens_per_s: 2.0, ..RunSummary::default() }.with_utilisation(10.0, None);
        assert!(no_peak.with_stage_utilisation(&[5.0, 5.0]).stage_mfu.is_empty());
    }
}
