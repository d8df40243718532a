//! The disk a run takes, as a formula: what the per-account disk quota
//! (`distlab-server --max-disk-per-user-mb`) reserves for it. A server test runs
//! experiments and holds the files they leave against it.
//!
//! A run keeps on disk its checkpoints and, when it succeeds, its model:
//!
//! - one checkpoint: the parameters each tensor-parallel rank of each pipeline stage holds
//!   (the planner's `params_per_rank`: tensor parallelism splits the matrices and keeps the
//!   embeddings, norms and some biases whole on every rank), written once however many
//!   data-parallel replicas hold them (shards by their owners); AdamW's two moments and the
//!   fp32 master weights of a 2-byte run for each of them; each data-parallel rank's
//!   gradient-compression residual; all f32 (4 bytes), plus a JSON header line per rank file;
//! - while it runs, two complete checkpoints and the one being written; once it has ended,
//!   the latest one alone (the worker prunes the rest);
//! - the model: every parameter once, f32, in safetensors (a JSON header before the values).

use crate::plan::planner;
use crate::{spec::GradCompression, ExperimentSpec, Precision};

/// Bytes allowed for one rank file's JSON header (its step, loss and section names).
const HEADER_BYTES_PER_FILE: u64 = 4096;
/// Bytes allowed for the safetensors header of a model (a name, shape and offsets per tensor).
const MODEL_HEADER_BYTES: u64 = 64 * 1024;
/// Checkpoints on disk at once while a run goes on: the two kept and the one being written.
pub const CHECKPOINTS_WHILE_RUNNING: u64 = 3;

/// The disk one experiment's files take, by the formula above.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DiskPlan {
    /// One complete checkpoint (0 when the run saves none: `train.checkpoint_every` 0).
    pub checkpoint: u64,
    /// The trained model (0 when the run trains none it can export).
    pub model: u64,
}

impl DiskPlan {
    pub fn of(spec: &ExperimentSpec) -> DiskPlan {
        let params = spec.model.param_count();
        let checkpoint = if spec.train.checkpoint_every == 0 || spec.demo.is_some() {
            0
        } else {
            let held = match planner::plan(spec) {
                Ok(plan) => plan.stages.iter().map(|s| s.params_per_rank).sum::<u64>() * spec.parallel.tp as u64,
                Err(_) => params,
            };
            let moments = if spec.train.optimizer.keeps_moments() { 2 } else { 0 };
            let master = u64::from(spec.train.precision != Precision::Fp32);
            let residuals =
                if spec.parallel.grad_compression == GradCompression::None { 0 } else { spec.parallel.dp as u64 };
            let floats = held.saturating_mul(1 + moments + master + residuals);
            floats.saturating_mul(4).saturating_add(spec.world_size() as u64 * HEADER_BYTES_PER_FILE)
        };
        let model = match crate::artifacts::export::not_exportable(spec) {
            Some(_) => 0,
            None => params.saturating_mul(4).saturating_add(MODEL_HEADER_BYTES),
        };
        DiskPlan { checkpoint, model }
    }

    /// The most the run takes while it is queued or running.
    pub fn while_running(self) -> u64 {
        self.checkpoint.saturating_mul(CHECKPOINTS_WHILE_RUNNING).saturating_add(self.model)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::Optimizer;

    #[test]
    fn adamw_keeps_three_floats_a_parameter_and_a_run_three_checkpoints() {
        let mut spec = ExperimentSpec::default();
        spec.train.checkpoint_every = 5;
        let params = spec.model.param_count();
        let plan = DiskPlan::of(&spec);
        let headers = spec.world_size() as u64 * HEADER_BYTES_PER_FILE;
        assert_eq!(plan.checkpoint, 12 * params + headers);
        assert_eq!(plan.model, 4 * params + MODEL_HEADER_BYTES);
        assert_eq!(plan.while_running(), 3 * plan.checkpoint + plan.model);
        spec.train.optimizer = Optimizer::Sgd;
        assert_eq!(DiskPlan::of(&spec).checkpoint, 4 * params + headers);
        spec.train.checkpoint_every = 0;
        assert_eq!(DiskPlan::of(&spec).checkpoint, 0);
    }
}
