//! A training rank on a GPU (cargo feature `cuda`): the same trainer, strategies and step
//! loop as on the CPU (`train/`), on the CUDA backend. What is particular to a GPU lives
//! here: which GPU a rank takes (its index among the ranks of its machine, mod the
//! machine's GPUs: ranks share GPUs when there are more of them), whether the run fits in
//! its memory, and how the data- and tensor-parallel groups talk: NCCL on the GPUs' memory
//! when every rank of the group has a GPU of its own and NCCL, the ranks' ring through host
//! memory otherwise (NCCL refuses two ranks of one group on one GPU). In a run across
//! workers the group's NCCL spans their machines: its unique id travels over the group's
//! ring, which the hosts set up through the server's rendezvous, and NCCL connects the
//! machines itself. Pipeline stages always pass their activations over the ring
//! (host-staged): one point-to-point message per micro-batch.

use std::sync::atomic::AtomicBool;
use std::time::Instant;

use distlab_common::{Precision, RunEvent, ValidSpec};

use super::fits::memory_bytes;
use super::options::TrainOptions;
use super::report::{log, RankRun};
use super::run::{kernel_pool, run};
use super::trainer::{Groups, Trainer};
use crate::backend::cuda::{self, CudaBackend, DeviceElem};
use crate::comm::nccl::{self, NcclCommunicator};
use crate::comm::{sum_scalar, Communicator};
use crate::error::TrainError;
use crate::memory::MemoryTracker;

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
    spec: &ValidSpec,
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
    spec: &ValidSpec,
    opts: &TrainOptions,
    mut groups: Groups,
    on_event: &mut dyn FnMut(RunEvent),
    cancel: &AtomicBool,
) -> Result<RankRun, TrainError> {
    let started = Instant::now();
    let gpus = cuda::device_count().map_err(unavailable)?.max(1);
    let (ordinal, sharing, own_gpus) = gpu_of(groups.rank, &groups.machine, gpus);
    let backend = CudaBackend::<S>::new(ordinal).map_err(unavailable)?;
    // What the run allocates on the GPU, checked before anything is (a valid spec can still
    // be far too big for this GPU). Ranks sharing a GPU each need their share.
    let sharing = sharing as u64;
    let free = backend.free_memory().map_err(unavailable)? as u64 / sharing;
    let needed = memory_bytes(spec);
    if needed > free / 10 * 9 {
        return Err(TrainError::OutOfMemory { needed_mib: needed >> 20, available_mib: free >> 20 });
    }
    log(on_event, format!("device: {} of {gpus} (CUDA backend: cuBLAS GEMMs, NVRTC kernels)", backend.device()));
    if let Some(dp) = groups.dp.as_mut() {
        let via = match nccl_group(dp.scalars.as_mut(), dp.rank, dp.world, ordinal, own_gpus, "dp")? {
            Ok(nccl) => swap_in(&mut dp.grads, nccl),
            Err(why) => why,
        };
        // The group's other communicator gets NCCL too: ZeRO-2 and FSDP reduce-scatter and
        // gather on it (FSDP's prefetch gathers on the first), and every strategy sums its
        // scalars there. (Its ring carries the votes and the id, then NCCL takes its place.)
        if dp.grads.nccl().is_some() {
            if let Ok(nccl) = nccl_group(dp.scalars.as_mut(), dp.rank, dp.world, ordinal, own_gpus, "dp")? {
                swap_in(&mut dp.scalars, nccl);
            }
        }
        // HSDP's shard and replica groups too (the same ranks' GPUs: NCCL wherever the group's is).
        if let (Some(hybrid), true) = (dp.hybrid.as_mut(), dp.grads.nccl().is_some()) {
            for (comm, name) in [(&mut hybrid.shard, "hsdp-shard"), (&mut hybrid.replicas, "hsdp-replicas")] {
                let (rank, size) = (comm.rank(), comm.size());
                if let Ok(nccl) = nccl_group(comm.as_mut(), rank, size, ordinal, own_gpus, name)? {
                    swap_in(comm, nccl);
                }
            }
        }
        log(on_event, format!("data parallel: {} ranks on {gpus} GPU(s); gradients travel over {via}", dp.world));
    }
    if let Some(tp) = groups.tp.as_mut() {
        let place = tp.place();
        // The group's one communicator carries the votes and the id, then NCCL takes its place.
        let via = match nccl_group(tp.comm_mut().as_mut(), place.rank, place.size, ordinal, own_gpus, "tp")? {
            Ok(nccl) => swap_in(tp.comm_mut(), nccl),
            Err(why) => why,
        };
        log(on_event, format!("tensor parallel: {} ranks; activation sums travel over {via}", place.size));
    }
    if let Some(ep) = groups.ep.as_mut() {
        let (rank, size) = (ep.comm_mut().rank(), ep.comm_mut().size());
        let via = match nccl_group(ep.comm_mut().as_mut(), rank, size, ordinal, own_gpus, "ep")? {
            Ok(nccl) => swap_in(ep.comm_mut(), nccl),
            Err(why) => why,
        };
        log(on_event, format!("expert parallel: {size} ranks; tokens cross to their experts by all-to-all over {via}"));
    }
    if let Some(cp) = groups.cp.as_mut() {
        let (rank, size) = (cp.comm_mut().rank(), cp.comm_mut().size());
        let via = match nccl_group(cp.comm_mut().as_mut(), rank, size, ordinal, own_gpus, "cp")? {
            Ok(nccl) => swap_in(cp.comm_mut(), nccl),
            Err(why) => why,
        };
        log(on_event, format!("context parallel (ulysses): {size} ranks; q, k, v and attention's output cross by all-to-all over {via}"));
    }
    if groups.pp.is_some() {
        log(
            on_event,
            "pipeline parallel: activations travel between stages over the ranks' ring (through host memory)".into(),
        );
    }
    let (pool, threads) = kernel_pool(opts)?;
    let trainer = pool.install(|| Trainer::build(spec, backend, MemoryTracker::new(), groups))?;
    run(spec, opts, trainer, &pool, threads, started, on_event, cancel)
}

/// The GPU rank `rank` takes among a machine's `gpus`, when the machine runs the ranks
/// `machine`: its index there mod `gpus`; how many of the machine's ranks share that GPU
/// at most; and whether each has a GPU of its own.
pub fn gpu_of(rank: usize, machine: &std::ops::Range<usize>, gpus: usize) -> (usize, usize, bool) {
    let (here, gpus) = (machine.len().max(1), gpus.max(1));
    (rank.saturating_sub(machine.start) % gpus, here.div_ceil(gpus), gpus >= here)
}

/// An NCCL communicator for a group of `size` ranks (this one `rank`) when every rank of
/// the group has a GPU of its own on its machine (`own_gpus` here) and NCCL, or why the
/// group stays on the ranks' ring. `rendezvous` (a ring over the same ranks) carries the
/// votes and NCCL's id. A collective: every rank of the group calls it.
fn nccl_group(
    rendezvous: &mut dyn Communicator,
    rank: usize,
    size: usize,
    ordinal: usize,
    own_gpus: bool,
    name: &str,
) -> Result<Result<NcclCommunicator, &'static str>, TrainError> {
    // Every rank says whether it has NCCL and a GPU of its own: NCCL only if all do (a rank
    // without it would leave the others waiting in NCCL's init, where no timeout reaches;
    // the ranks of a group may be on machines with different GPU counts).
    let has_nccl = nccl::libraries_present().is_ok();
    let votes = sum_scalar(rendezvous, if has_nccl { 1.0 } else { 0.0 })?;
    let alone = sum_scalar(rendezvous, if own_gpus { 1.0 } else { 0.0 })?;
    if alone as usize != size {
        return Ok(Err("the ranks' ring through host memory (ranks share a GPU)"));
    }
    if votes as usize != size {
        return Ok(Err("the ranks' ring through host memory (NCCL is missing on some rank)"));
    }
    let device_failure = |e: nccl::NcclUnavailable| TrainError::Device(e.to_string());
    // Group rank 0 asks NCCL for the id and sends it over the group's ring.
    let id = (rank == 0).then(nccl::new_unique_id);
    let id = nccl::share_unique_id(rendezvous, 0, id).map_err(device_failure)?;
    let nccl = NcclCommunicator::new(ordinal, id, rank, (0..size).collect(), name, None).map_err(device_failure)?;
    Ok(Ok(nccl))
}

/// Puts `nccl` in `comm`'s place; says so.
fn swap_in(comm: &mut Box<dyn Communicator>, nccl: NcclCommunicator) -> &'static str {
    *comm = Box::new(nccl);
    "NCCL on the GPUs' memory"
}

#[cfg(test)]
mod tests {
    use super::gpu_of;

    #[test]
    fn ranks_take_their_machines_gpus_in_turn() {
        // Two hosts of 2 ranks with 2 GPUs each: ranks 2 and 3 take GPUs 0 and 1 of theirs.
        assert_eq!(gpu_of(2, &(2..4), 2), (0, 1, true));
        assert_eq!(gpu_of(3, &(2..4), 2), (1, 1, true));
        // 4 ranks on one machine with 2 GPUs: two to a GPU, no NCCL.
        assert_eq!(gpu_of(3, &(0..4), 2), (1, 2, false));
        // One rank alone (no machine given) takes GPU 0.
        assert_eq!(gpu_of(0, &(0..0), 8), (0, 1, true));
    }
}
