//! A training rank on a GPU (cargo feature `cuda`): the same trainer, strategies and step
//! loop as on the CPU (`train/`), on the CUDA backend. What is particular to a GPU lives
//! here: which GPU a rank takes (rank mod GPUs: ranks share GPUs when there are more of
//! them), whether the run fits in its memory, and how data-parallel gradients travel:
//! NCCL when every rank has a GPU of its own and every rank has NCCL, the ranks' ring
//! otherwise (NCCL refuses two ranks of one group on one GPU).

use std::sync::atomic::AtomicBool;
use std::time::Instant;

use distlab_common::{ExperimentSpec, Precision, RunEvent};

use crate::backend::cuda::{self, CudaBackend, DeviceElem};
use crate::comm::nccl::{self, NcclCommunicator};
use crate::comm::Communicator;
use crate::memory::MemoryTracker;
use crate::parallel::ddp::sum_scalar;
use crate::parallel::DpGroup;
use crate::train::{kernel_pool, log, memory_bytes, run, Groups, RankRun, TrainError, TrainOptions, Trainer};

/// Why the GPU cannot run this: a machine without one is a spec this worker cannot run;
/// anything else is the GPU failing.
fn unavailable(e: cuda::CudaUnavailable) -> TrainError {
    if e.no_gpu_here() {
        TrainError::Unsupported(format!("backend=cuda: {e}"))
    } else {
        TrainError::Device(e.to_string())
    }
}

/// Trains this rank's part of `spec` (backend=cuda) on its GPU, with buffers of the
/// spec's precision.
pub fn train_on_gpu(
    precision: Precision,
    spec: &ExperimentSpec,
    opts: &TrainOptions,
    groups: Groups,
    on_event: &mut dyn FnMut(RunEvent),
    cancel: &AtomicBool,
) -> Result<RankRun, TrainError> {
    match precision {
        Precision::Fp32 => train_as::<f32>(spec, opts, groups, on_event, cancel),
        Precision::Bf16 => train_as::<half::bf16>(spec, opts, groups, on_event, cancel),
        Precision::Fp16 => train_as::<half::f16>(spec, opts, groups, on_event, cancel),
    }
}

fn train_as<S: DeviceElem>(
    spec: &ExperimentSpec,
    opts: &TrainOptions,
    mut groups: Groups,
    on_event: &mut dyn FnMut(RunEvent),
    cancel: &AtomicBool,
) -> Result<RankRun, TrainError> {
    let started = Instant::now();
    let world = spec.world_size();
    let gpus = cuda::device_count().map_err(unavailable)?.max(1);
    let ordinal = groups.rank % gpus;
    let backend = CudaBackend::<S>::new(ordinal).map_err(unavailable)?;
    // What the run allocates on the GPU, checked before anything is (a valid spec can still
    // be far too big for this GPU). Ranks sharing a GPU each need their share.
    let sharing = world.div_ceil(gpus) as u64;
    let free = backend.free_memory().map_err(unavailable)? as u64 / sharing;
    let needed = memory_bytes(spec);
    if needed > free / 10 * 9 {
        return Err(TrainError::OutOfMemory { needed_mib: needed >> 20, available_mib: free >> 20 });
    }
    log(on_event, format!("device: {} (CUDA backend: cuBLAS GEMMs, NVRTC kernels)", backend.device()));
    if let Some(dp) = groups.dp.as_mut() {
        let via = gradients_via_nccl(dp, ordinal, gpus >= world)?;
        log(on_event, format!("data parallel: {} ranks on {gpus} GPU(s); gradients travel over {via}", dp.world));
    }
    let (pool, threads) = kernel_pool(opts)?;
    let trainer = pool.install(|| Trainer::build(spec, backend, MemoryTracker::new(), groups))?;
    run(spec, opts, trainer, &pool, threads, started, on_event, cancel)
}

/// Puts an NCCL communicator in place of the ring for `dp`'s gradients when every rank of
/// the run has a GPU of its own (`own_gpus`) and every rank of the group has NCCL; says
/// which way the gradients go. A collective: every rank of the group calls it.
fn gradients_via_nccl(dp: &mut DpGroup, ordinal: usize, own_gpus: bool) -> Result<&'static str, TrainError> {
    // Every rank says whether it has NCCL: NCCL only if all do (a rank without it would
    // leave the others waiting in NCCL's init, where no timeout reaches).
    let has_nccl = nccl::libraries_present().is_ok();
    let votes = sum_scalar(dp.scalars.as_mut(), if has_nccl { 1.0 } else { 0.0 })?;
    if !own_gpus {
        return Ok("the ranks' ring (ranks share a GPU)");
    }
    if votes as usize != dp.world {
        return Ok("the ranks' ring (NCCL is missing on some rank)");
    }
    let device_failure = |e: nccl::NcclUnavailable| TrainError::Device(e.to_string());
    // Group rank 0 asks NCCL for the id and sends it over the group's ring.
    let id = (dp.rank == 0).then(nccl::new_unique_id);
    let id = nccl::share_unique_id(dp.scalars.as_mut(), 0, id).map_err(device_failure)?;
    let comm =
        NcclCommunicator::new(ordinal, id, dp.rank, (0..dp.world).collect(), "dp", None).map_err(device_failure)?;
    dp.grads = Box::new(comm) as Box<dyn Communicator>;
    Ok("NCCL")
}
