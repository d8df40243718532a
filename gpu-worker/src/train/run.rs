//! One rank's run on any backend: the kernel threads, then the step loop from the first
//! step (or the checkpoint resumed from) to the last, with evaluations, checkpoints and
//! what the run reports.

use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Instant;

use distlab_common::{CheckpointWrite, ExperimentSpec, RunEvent};

use super::options::TrainOptions;
use super::report::{log, mib, mib_bytes, report_checkpoints, RankRun, StepTally, REJOIN_LOG};
use super::trainer::Trainer;
use crate::backend::Stored;
use crate::checkpoint::{self, CheckpointDir, CheckpointError, CheckpointWriter};
use crate::error::TrainError;
use crate::parallel::TrainBackend;

/// Kernel threads `opts` asks for (0: every core), in a rayon pool of their own.
pub(crate) fn kernel_pool(opts: &TrainOptions) -> Result<(rayon::ThreadPool, usize), TrainError> {
    let threads = match opts.threads {
        0 => std::thread::available_parallelism().map_or(1, |n| n.get()),
        n => n,
    };
    let pool = rayon::ThreadPoolBuilder::new()
        .num_threads(threads)
        .thread_name(|i| format!("distlab-kernel-{i}"))
        .build()
        .map_err(|e| TrainError::Threads { threads, message: e.to_string() })?;
    Ok((pool, threads))
}

/// Loads this rank's part of the checkpoint of `step` (and DP rank 0's, for the state it
/// writes for the whole group); returns the run's lowest loss so far.
fn resume<B: TrainBackend>(trainer: &mut Trainer<B>, dir: &CheckpointDir, step: u64) -> Result<f64, CheckpointError> {
    let place = trainer.place();
    let own = checkpoint::read(&dir.file(step, place))?;
    let zero = if place.dp == 0 { None } else { Some(checkpoint::read(&dir.file(step, place.dp_rank_zero()))?) };
    trainer
        .restore(&own, zero.as_ref().unwrap_or(&own))
        .map_err(|why| CheckpointError::Mismatch { path: dir.file(step, place), why })?;
    Ok(own.min_loss)
}

/// Runs `trainer`'s steps from its first to the spec's last, in `pool`: reports every
/// step, writes and reports checkpoints, and sums the run up. The same for every backend.
#[allow(clippy::too_many_arguments)]
pub(crate) fn run<B: TrainBackend>(
    spec: &ExperimentSpec,
    opts: &TrainOptions,
    mut trainer: Trainer<B>,
    pool: &rayon::ThreadPool,
    threads: usize,
    started: Instant,
    on_event: &mut dyn FnMut(RunEvent),
    cancel: &AtomicBool,
) -> Result<RankRun, TrainError> {
    let (world, sharding) = (spec.world_size(), spec.parallel.sharding);
    let stored = <B::Elem as Stored>::NAME;
    let m = &spec.model;
    let t = &spec.train;
    let params = trainer.model().layout.total;
    log(
        on_event,
        format!(
            "model: GPT with {params} parameters ({:.2} MiB in {}): {} layers{}, d_model {}, {} heads, seq_len {}, \
             vocab {}, LM head not tied to the embedding",
            mib_bytes((params * size_of::<B::Elem>()) as u64),
            stored,
            m.layers,
            match m.family {
                distlab_common::ModelFamily::Gpt2 => String::new(),
                distlab_common::ModelFamily::Llama => format!(
                    " of Llama blocks ({} K/V heads, SwiGLU {}, rotary base {})",
                    m.key_value_heads(),
                    m.d_ff(),
                    m.rope_theta
                ),
            },
            m.d_model,
            m.heads,
            m.seq_len,
            m.vocab
        ),
    );
    log(on_event, trainer.data().describe());
    let held = trainer.memory.current();
    log(
        on_event,
        format!(
            "memory of this rank ({}, {}): parameters {:.2} MiB, gradients {:.2} MiB, optimizer state {:.2} MiB, \
             activations {:.2} MiB, their gradients {:.2} MiB, communication buckets {:.2} MiB",
            sharding.as_str(),
            stored,
            mib_bytes(held.parameters),
            mib_bytes(held.gradients),
            mib_bytes(held.optimizer_state),
            mib_bytes(held.activations),
            mib_bytes(held.activation_grads),
            mib_bytes(held.comm_buffers)
        ),
    );
    log(
        on_event,
        format!(
            "training: {} steps of {} sequences x {} tokens ({} micro-batch(es) of {}), {:?}, lr {} ({:?}, {} warmup \
             steps), {} kernel thread(s) on the {} backend",
            t.steps,
            spec.global_batch(),
            m.seq_len,
            t.micro_batches * t.grad_accum,
            t.micro_batch,
            t.optimizer,
            t.lr,
            t.lr_schedule,
            t.warmup_steps,
            threads,
            trainer.backend.name()
        ),
    );

    // (a fault-tolerant replacement starts where the other replicas are)
    let mut first_step = trainer.first_step();
    if first_step > 0 {
        let since = started.elapsed().as_secs_f64();
        log(on_event, format!("{REJOIN_LOG} at step {first_step}, {since:.2} s after its process started"));
    }
    let mut min_loss = f64::INFINITY;
    let mut writer = None;
    if let Some(c) = &opts.checkpoints {
        let dir = CheckpointDir::new(&c.dir, world);
        if let Some(step) = c.resume_from.filter(|&s| s > 0) {
            min_loss = resume(&mut trainer, &dir, step)?;
            first_step = step;
            log(
                on_event,
                format!("resumed from the checkpoint of step {step}: steps 0 to {} are not run again", step - 1),
            );
        }
        if t.checkpoint_every > 0 {
            let asynchronous = t.checkpoint_write == CheckpointWrite::Async;
            writer = Some(CheckpointWriter::new(dir, trainer.place(), asynchronous));
        }
    }
    let mut tally = StepTally::new(spec, first_step, min_loss);
    // Tensor-parallel all-reduces the evaluations made: (calls, payload bytes, bytes sent).
    let mut eval_tp = (0u64, 0u64, 0u64);
    for step in first_step..t.steps {
        if cancel.load(Ordering::Relaxed) {
            return Err(TrainError::Cancelled);
        }
        let step_start = Instant::now();
        let stats = pool.install(|| trainer.step(step))?;
        let seconds = step_start.elapsed().as_secs_f64();
        let evaluates = t.eval_every > 0 && ((step + 1) % t.eval_every == 0 || step + 1 == t.steps);
        let val_loss = if evaluates && stats.loss.is_finite() {
            let tp_before = trainer.model.tensor_parallel().map(|tp| tp.totals());
            let loss = pool.install(|| trainer.evaluate(step))?;
            // (the TP traffic reported at the end is training's)
            if let (Some(before), Some(tp)) = (tp_before, trainer.model.tensor_parallel()) {
                let after = tp.totals();
                eval_tp =
                    (eval_tp.0 + after.0 - before.0, eval_tp.1 + after.1 - before.1, eval_tp.2 + after.2 - before.2);
            }
            Some(loss)
        } else {
            None
        };
        tally.record(on_event, t.steps, step, &stats, seconds, val_loss)?;
        if let Some(writer) = &mut writer {
            let next = step + 1;
            if next % t.checkpoint_every == 0 && next < t.steps {
                let copy_start = Instant::now();
                let ckpt = trainer.checkpoint(next, tally.min_loss, writer.spare())?;
                writer.save(ckpt, copy_start.elapsed().as_secs_f64() * 1e3);
            }
            report_checkpoints(on_event, writer.finished(), trainer.place(), t.checkpoint_write);
        }
    }
    if let Some(writer) = writer {
        report_checkpoints(on_event, writer.finish(), trainer.place(), t.checkpoint_write);
    }
    if let Some(line) = trainer.end()? {
        log(on_event, line);
    }
    if let Some((calls, payload, sent)) = trainer.model.tensor_parallel().map(|tp| tp.totals()) {
        let (calls, payload, sent) = (calls - eval_tp.0, payload - eval_tp.1, sent - eval_tp.2);
        let layers = trainer.model.stage.block_count();
        let steps_run = (t.steps - first_step) as f64;
        let per_layer = payload as f64 / (steps_run * (t.micro_batches * t.grad_accum * layers) as f64);
        log(
            on_event,
            format!(
                "tensor parallel (this rank's group): {calls} all-reduces of activations, {:.2} MiB in all \
                 ({:.3} MiB per layer per micro-batch, forward and backward together; 4 x b x s x d x 4 bytes = \
                 {:.3} MiB); this rank sent {:.2} MiB over the ring",
                mib_bytes(payload),
                per_layer / (1024.0 * 1024.0),
                mib(4 * t.micro_batch * m.seq_len * m.d_model),
                mib_bytes(sent)
            ),
        );
    }
    let mut summary =
        tally.summary(spec, params, trainer.data().loss_floor(), started.elapsed().as_secs_f64(), threads);
    summary.held_out_bytes_per_token = trainer.data().held_out_bytes_per_token();
    // The ledger is read before the final weights' copy is booked in it.
    let run = RankRun {
        summary,
        spans: trainer.timeline(),
        memory: trainer.memory_report(),
        applied_gradients: trainer.applied_gradients(),
    };
    // The trained model is a by-product: a run whose weights cannot be written still
    // succeeded (the launcher then finds a rank's file missing and says the model was not
    // exported).
    if let Some(dir) = &opts.final_weights {
        let written = trainer.final_weights(t.steps).map_err(|e| e.to_string()).and_then(|weights| {
            let path = CheckpointDir::new(dir, world).file(t.steps, trainer.place());
            crate::checkpoint::write(&path, &weights).map_err(|e| e.to_string())
        });
        if let Err(e) = written {
            let message = format!("this rank's final weights were not written: {e}");
            on_event(RunEvent::Log(distlab_common::LogLine { level: distlab_common::LogLevel::Warn, message }));
        }
    }
    Ok(run)
}
