//! The training FLOPs of one optimizer step: the 6 x parameters x tokens rule, attention's
//! share, and the forward passes activation checkpointing runs again.

use super::Flops;
use crate::spec::{Checkpointing, ExperimentSpec};

/// FLOPs of one optimizer step over all ranks, T = tokens per step:
/// 6 * (active) params * T (matmuls: forward 2, backward 4) + 12 * layers * seq_len * d_model * T
/// (attention, [`ModelSpec::train_flops_per_token`](crate::spec::ModelSpec::train_flops_per_token)),
/// plus with checkpointing one more forward of every block:
/// (2 * layers * block_params + 4 * layers * seq_len * d_model) * T.
pub(super) fn step_flops(spec: &ExperimentSpec, world_size: u64) -> Flops {
    let (m, t) = (&spec.model, &spec.train);
    let tokens = [spec.parallel.dp, t.micro_batch, t.micro_batches, t.grad_accum, m.seq_len]
        .into_iter()
        .fold(1u64, |acc, x| acc.saturating_mul(x as u64));
    let tf = tokens as f64;
    // (a token's forward uses only its experts' parameters: 6 x the active ones)
    let six_params_tokens = 6.0 * m.active_param_count() as f64 * tf;
    let training = m.train_flops_per_token() * tf;
    let (l, s, d) = (m.layers as f64, m.seq_len as f64, m.d_model as f64);
    let recompute = match t.checkpointing {
        Checkpointing::None => 0.0,
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
