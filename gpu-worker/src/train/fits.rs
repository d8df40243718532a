//! Whether a run fits this machine: the bytes the engine allocates for a spec on one rank,
//! what the kernel says is available, and the ranks checked together before they start.

use distlab_common::planner::OFFLOAD_PIECE_ELEMENTS;
use distlab_common::{BackendKind, ExperimentSpec, Offload, Precision};

use crate::error::TrainError;

/// Bytes the engine allocates for `spec` on one rank at most: parameters, gradients,
/// optimizer state (all counted whole, fp32 master weights included, unless offloaded) and
/// activations; what [`train`] checks against the available memory.
pub fn memory_bytes(spec: &ExperimentSpec) -> u64 {
    let params = spec.model.param_count();
    let (model_bytes, master) = match spec.train.precision {
        Precision::Fp32 => (4u64, 0u64),
        Precision::Bf16 | Precision::Fp16 => (2, 1),
    };
    let optimizer_states = if spec.train.optimizer.keeps_moments() { 2 + master } else { master };
    let ranks = (spec.parallel.tp, spec.parallel.ep, spec.parallel.cp);
    let saved = crate::model::Saved {
        checkpointing: spec.train.checkpointing,
        attention: spec.train.attention,
        sequence_parallel: spec.parallel.sequence_parallel,
        split_backward: false,
        cp_kind: spec.parallel.cp_kind,
        fp8: spec.train.fp8,
    };
    let activations = crate::model::activation_floats_for(&spec.model, spec.train.micro_batch, ranks, saved) as u64;
    // Activation offload: every block's activations but its output leave, two blocks' stay
    // on their way (the CPU backend's host memory is its device).
    let activations = match spec.train.activation_offload {
        Offload::None => activations,
        Offload::Host | Offload::Disk => {
            let block = crate::model::offloaded_block_floats(&spec.model, spec.train.micro_batch, ranks, saved) as u64;
            activations.saturating_sub(block.saturating_mul(spec.model.layers.saturating_sub(2) as u64))
        }
    };
    // ZeRO-Offload: the state leaves the device (a disk state's piece stays in host memory,
    // which is the CPU backend's device).
    let optimizer_params = match (spec.parallel.offload, spec.backend) {
        (Offload::None, _) => params,
        (Offload::Disk, BackendKind::Cpu) => params.min(OFFLOAD_PIECE_ELEMENTS as u64),
        (Offload::Host | Offload::Disk, _) => 0,
    };
    let model = model_bytes.saturating_mul(params.saturating_mul(2).saturating_add(activations));
    model.saturating_add(optimizer_params.saturating_mul(4 * optimizer_states))
}

/// Memory the kernel reports as available (Linux `MemAvailable`), when it can be read.
pub fn available_memory_bytes() -> Option<u64> {
    meminfo("MemAvailable:")
}

/// The machine's physical memory (Linux `MemTotal`), when it can be read.
pub fn total_memory_bytes() -> Option<u64> {
    meminfo("MemTotal:")
}

fn meminfo(field: &str) -> Option<u64> {
    let info = std::fs::read_to_string("/proc/meminfo").ok()?;
    let line = info.lines().find(|l| l.starts_with(field))?;
    let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kib * 1024)
}

/// Whether every rank of `spec` fits in `available` bytes together (the planner's count
/// of what they hold, against three quarters of it: the rest is the machine's), checked
/// before the ranks start so that a run too big fails saying so instead of being killed.
pub fn ranks_fit(spec: &ExperimentSpec, available: u64) -> Result<(), TrainError> {
    let Ok(plan) = distlab_common::planner::plan(spec) else { return Ok(()) };
    let needed = plan.memory_of_all_ranks();
    if needed > available / 4 * 3 {
        return Err(TrainError::OutOfMemory { needed_mib: needed >> 20, available_mib: available >> 20 });
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use distlab_common::ExperimentSpec;

    /// The ranks' memory is checked together, before they start: dp=4 of a model whose one
    /// rank fits needs four times that.
    #[test]
    fn the_ranks_are_checked_together() {
        let mut spec = ExperimentSpec::default();
        spec.parallel.dp = 4;
        let all = distlab_common::planner::plan(&spec).unwrap().memory_of_all_ranks();
        let one = all / 4;
        assert!(ranks_fit(&spec, all / 3 * 4 + 4).is_ok());
        match ranks_fit(&spec, one * 2) {
            Err(TrainError::OutOfMemory { needed_mib, .. }) => assert_eq!(needed_mib, all >> 20),
            other => panic!("{other:?}"),
        }
    }
}
