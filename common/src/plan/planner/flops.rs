//! The training FLOPs of one optimizer step: the 6 x parameters x tokens rule, attention's
//! share, and the forward passes activation checkpointing runs again.

use super::{Flops, StagePlan};
use crate::spec::{Checkpointing, ExperimentSpec};

/// FLOPs of one optimizer step over all ranks, T = tokens per step:
/// 6 * (active) params * T (matmuls: forward 2, backward 4) + 12 * layers * seq_len * d_model * T
/// (attention, [`ModelSpec::train_flops_per_token`](crate::spec::ModelSpec::train_flops_per_token)),
/// plus with checkpointing one more forward of every block:
/// (2 * layers * block_params + 4 * layers * seq_len * d_model) * T, or with selective
/// recompute one more of attention's two products (Q Kᵀ and P V): 4 * layers * seq_len * d_model * T.
pub(super) fn step_flops(spec: &ExperimentSpec, world_size: u64) -> Flops {
    let (m, t) = (&spec.model, &spec.train);
    let tokens = [spec.parallel.data_replicas(), t.micro_batch, t.micro_batches, t.grad_accum, m.seq_len]
        .into_iter()
        .fold(1u64, |acc, x| acc.saturating_mul(x as u64));
    let tf = tokens as f64;
    // (a token's forward uses only its experts' parameters: 6 x the active ones)
    let six_params_tokens = 6.0 * m.active_param_count() as f64 * tf;
    let training = m.train_flops_per_token() * tf;
    let (l, s, d) = (m.layers as f64, m.seq_len as f64, m.d_model as f64);
    let recompute = match t.checkpointing {
        Checkpointing::None => 0.0,
        Checkpointing::Selective => 4.0 * l * s * d * tf,
        Checkpointing::Every | Checkpointing::Sqrt => (2.0 * l * m.active_block_params() as f64 + 4.0 * l * s * d) * tf,
    };
    let total = training + recompute;
    Flops {
        tokens_per_step: tokens,
        six_params_tokens,
        attention: training - six_params_tokens,
        recompute,
        total,
        per_rank: total / world_size.max(1) as f64,
    }
}

/// Each pipeline stage's part of the model's training FLOPs per token: 6 x the (active)
/// parameters it holds, each counted once on the stage that holds it (the embeddings on the
/// first, the final norm and an untied head on the last; a tied head's matmul is counted with
/// the embedding, as the 6N rule does), plus attention for its blocks. They add up to
/// [`ModelSpec::train_flops_per_token`](crate::spec::ModelSpec::train_flops_per_token).
pub(super) fn stage_flops_per_token(spec: &ExperimentSpec, stages: &[StagePlan]) -> Vec<f64> {
    let m = &spec.model;
    let attention_per_layer = 12.0 * m.seq_len as f64 * m.d_model as f64;
    stages
        .iter()
        .map(|stage| {
            let held = stage.layers as u64 * m.active_block_params()
                + if stage.embedding { m.embedding_params() } else { 0 }
                + if stage.head { m.head_params() } else { 0 };
            6.0 * held as f64 + attention_per_layer * stage.layers as f64
        })
        .collect()
}
