//! Asynchronous SGD's parameter server (`sync: async_ps`), on data-parallel rank 0 beside
//! that rank's own worker: what it adds to the worker's plan.

use super::{CommVolume, ParameterServerPlan, StagePlan};
use crate::spec::{BackendKind, ExperimentSpec};

/// Bytes of a push's header (what it is, θ's version, the lr and gradient scale).
pub const PUSH_HEADER_BYTES: u64 = 24;
/// Bytes of θ's version sent before θ.
pub const VERSION_BYTES: u64 = 4;

/// Bytes a worker sends per step: its gradient (fp32) and the push's header.
pub fn worker_push_bytes(params: u64) -> u64 {
    params.saturating_mul(4).saturating_add(PUSH_HEADER_BYTES)
}

/// Rank 0: `worker` (the stage's plan, rank 0's own worker) plus the server, N parameters:
/// θ in fp32 and the optimizer's moments (AdamW's m and v), and a receive buffer for each
/// other worker's gradient, in host memory (the device's own on the CPU backend, off the
/// device beside a GPU). It pushes its own gradient in-process and sends θ and its version
/// back for each of the W - 1 other workers' pushes: (W - 1)(4N + 4) bytes per round.
pub(super) fn parameter_server(worker: &StagePlan, spec: &ExperimentSpec) -> ParameterServerPlan {
    let n = worker.params_per_rank;
    let others = (spec.parallel.dp as u64).saturating_sub(1);
    let moments = u64::from(spec.train.optimizer.keeps_moments());
    let state = n.saturating_mul(4 * (1 + 2 * moments));
    let receiving = others.saturating_mul(n).saturating_mul(4);
    let mut memory = worker.memory.clone();
    match spec.backend {
        BackendKind::Cpu => {
            memory.optimizer_state = memory.optimizer_state.saturating_add(state);
            memory.comm_buffers = memory.comm_buffers.saturating_add(receiving);
            memory.total = memory.total.saturating_add(state).saturating_add(receiving);
        }
        BackendKind::Cuda => memory.offloaded = memory.offloaded.saturating_add(state).saturating_add(receiving),
    }
    let sent = others.saturating_mul(n.saturating_mul(4).saturating_add(VERSION_BYTES));
    let comm = CommVolume { ps_push_pull: sent, total: sent, ..CommVolume::default() };
    ParameterServerPlan { memory, comm }
}
