//! A rank on the CPU backend, its buffers stored as f32, bf16 or fp16.

use std::sync::atomic::AtomicBool;
use std::time::Instant;

use distlab_common::{RunEvent, ValidSpec};

use super::fits::{available_memory_bytes, memory_bytes};
use super::options::TrainOptions;
use super::report::RankRun;
use super::run::{kernel_pool, run};
use super::trainer::{CpuTrainer, Groups};
use crate::backend::Stored;
use crate::error::TrainError;

/// [`train_rank`](super::train_rank) on the CPU backend, with the model's parameters, gradients and
/// activations stored as `S`.
pub(super) fn train_on_cpu<S: Stored<Acc = f32>>(
    spec: &ValidSpec,
    opts: &TrainOptions,
    groups: Groups,
    on_event: &mut dyn FnMut(RunEvent),
    cancel: &AtomicBool,
) -> Result<RankRun, TrainError> {
    let started = Instant::now();
    let needed = memory_bytes(spec);
    if let Some(available) = available_memory_bytes() {
        // Leave a quarter for the rest of the machine (and the other ranks, later).
        if needed > available / 4 * 3 {
            return Err(TrainError::OutOfMemory { needed_mib: needed >> 20, available_mib: available >> 20 });
        }
    }
    let (pool, threads) = kernel_pool(opts)?;
    let trainer = pool.install(|| CpuTrainer::<S>::with_groups(spec, threads, groups))?;
    run(spec, opts, trainer, &pool, threads, started, on_event, cancel)
}
