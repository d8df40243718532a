//! `distlab-worker --server URL --token T`: register, then lease experiments one at a
//! time, train them, stream their events back in batches, and report how they ended.

use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{mpsc, Arc};
use std::thread;
use std::time::{Duration, Instant};

use distlab_common::*;

use crate::client::{ClientError, ServerClient};
use crate::execute::execute;
use distlab_worker::checkpoint::CheckpointDir;
use distlab_worker::train::TrainError;

pub struct WorkerConfig {
    pub server: String,
    pub token: String,
    pub name: String,
    pub threads: usize,
    pub collective_timeout: Duration,
    /// How long to wait between lease requests when the queue is empty.
    pub poll_interval: Duration,
    /// Exit when the server has been unreachable this long (a local worker whose server died).
    pub give_up_after: Duration,
    /// Experiments' checkpoints, one directory each (`experiment-<id>`).
    pub checkpoint_dir: PathBuf,
}

/// Events are sent when this many are pending, or when the oldest has waited `FLUSH_EVERY`.
const BATCH_EVENTS: usize = 256;
const FLUSH_EVERY: Duration = Duration::from_millis(500);

/// The backends this worker can run and its devices, as it tells the server when it
/// registers: the CPU always; CUDA when built with it and this machine has a GPU.
fn offered(threads: usize) -> (Vec<BackendKind>, Vec<String>) {
    #[allow(unused_mut)]
    let (mut backends, mut devices) = (vec![BackendKind::Cpu], vec![format!("cpu: {threads} threads")]);
    // Offered only when the backend really starts here (driver, cuBLAS, NVRTC, kernels).
    #[cfg(feature = "cuda")]
    match distlab_worker::backend::cuda::CudaBackend::<f32>::new(0)
        .and_then(|_| distlab_worker::backend::cuda::devices())
    {
        Ok(gpus) => {
            backends.push(BackendKind::Cuda);
            devices.extend(gpus);
        }
        Err(why) => tracing::info!(%why, "built with CUDA, but it cannot run here: offering the CPU backend only"),
    }
    (backends, devices)
}

pub fn run_worker(cfg: WorkerConfig) -> anyhow::Result<()> {
    let client = ServerClient::new(&cfg.server, &cfg.token);
    let threads = if cfg.threads == 0 { thread::available_parallelism().map_or(1, |n| n.get()) } else { cfg.threads };
    let (backends, devices) = offered(threads);
    let registration = RegisterWorker { name: cfg.name.clone(), backends, devices, version: VERSION.to_string() };
    let registered = retry_while_unreachable(&cfg, "register", || client.register(&registration))?;
    let heartbeat = Duration::from_secs_f64(registered.heartbeat_interval_s.clamp(0.2, 60.0));
    tracing::info!(worker_id = registered.worker_id, server = %cfg.server, "registered");

    loop {
        let lease = retry_while_unreachable(&cfg, "lease", || client.lease(registered.worker_id))?;
        match lease {
            None => thread::sleep(cfg.poll_interval),
            Some(lease) => {
                tracing::info!(experiment = lease.experiment_id, attempt = lease.attempt, "leased");
                let checkpoints = cfg.checkpoint_dir.join(format!("experiment-{}", lease.experiment_id));
                let run = Leased { lease, threads, collective_timeout: cfg.collective_timeout, heartbeat, checkpoints };
                run_leased(&client, registered.worker_id, run);
            }
        }
    }
}

/// Calls `f` until it gets an answer from the server, waiting while the server is unreachable
/// (restarting, say) but at most `give_up_after`.
fn retry_while_unreachable<T>(
    cfg: &WorkerConfig,
    what: &str,
    mut f: impl FnMut() -> Result<T, ClientError>,
) -> anyhow::Result<T> {
    let started = Instant::now();
    let mut wait = Duration::from_millis(200);
    loop {
        match f() {
            Ok(v) => return Ok(v),
            Err(e @ ClientError::Transport { .. }) if started.elapsed() < cfg.give_up_after => {
                tracing::warn!("{what}: {e}; retrying in {wait:?}");
                thread::sleep(wait);
                wait = (wait * 2).min(Duration::from_secs(5));
            }
            Err(e) => return Err(anyhow::anyhow!("{what}: {e}")),
        }
    }
}

/// An experiment this worker holds, and how to run it.
struct Leased {
    lease: Lease,
    threads: usize,
    collective_timeout: Duration,
    heartbeat: Duration,
    /// The experiment's checkpoint directory.
    checkpoints: PathBuf,
}

/// Trains one leased experiment on a training thread while this thread forwards its events,
/// heartbeats, and turns a cancel from the server into the training loop's cancel flag.
/// The experiment's checkpoints are deleted once the server knows it has ended for good;
/// they stay when the lease was lost (another worker resumes from them).
fn run_leased(client: &ServerClient, worker_id: i64, run: Leased) {
    let Leased { lease, threads, collective_timeout, heartbeat, checkpoints } = run;
    let experiment_id = lease.experiment_id;
    let cancel = Arc::new(AtomicBool::new(false));
    let (tx, rx) = mpsc::channel::<RunEvent>();
    let training = {
        let cancel = cancel.clone();
        let spec = lease.spec.clone();
        let checkpoints = checkpoints.clone();
        thread::Builder::new().name(format!("train-{experiment_id}")).spawn(move || {
            let mut on_event = |e: RunEvent| {
                let _ = tx.send(e);
            };
            // The spec came over the network: checked here, as it enters the worker.
            let spec = spec.validated(&Limits::default()).map_err(TrainError::Invalid)?;
            execute(&spec, threads, collective_timeout, Some(&checkpoints), &mut on_event, &cancel)
        })
    };
    let training = match training {
        Ok(handle) => handle,
        Err(e) => {
            let error = format!("could not start the training thread: {e}");
            if let Err(e) = report_failure(client, worker_id, experiment_id, error, false) {
                tracing::warn!(experiment = experiment_id, "could not report {e}");
            }
            return;
        }
    };

    let mut pending: Vec<RunEvent> = Vec::new();
    let mut last_flush = Instant::now();
    let mut last_heartbeat = Instant::now();
    // Set when the server says this worker no longer owns the experiment.
    let mut lease_lost = false;
    let on_ack = |ack: Result<WorkerAck, ClientError>, lease_lost: &mut bool| match ack {
        Ok(ack) if ack.cancel => cancel.store(true, Ordering::Relaxed),
        Ok(_) => {}
        Err(e) if e.is_conflict() => {
            *lease_lost = true;
            cancel.store(true, Ordering::Relaxed);
        }
        Err(e) => tracing::warn!(experiment = experiment_id, "{e}"),
    };
    loop {
        let done = match rx.recv_timeout(Duration::from_millis(100)) {
            Ok(event) => {
                pending.push(event);
                false
            }
            Err(mpsc::RecvTimeoutError::Timeout) => false,
            Err(mpsc::RecvTimeoutError::Disconnected) => true,
        };
        let due = pending.len() >= BATCH_EVENTS || (!pending.is_empty() && last_flush.elapsed() >= FLUSH_EVERY);
        if (due || done) && !pending.is_empty() && !lease_lost {
            let batch = EventBatch { worker_id, experiment_id, events: std::mem::take(&mut pending) };
            match client.send_events(&batch) {
                Err(ClientError::Transport { .. }) => pending = batch.events, // keep them, try again
                ack => on_ack(ack, &mut lease_lost),
            }
            last_flush = Instant::now();
            last_heartbeat = Instant::now();
        }
        if done {
            break;
        }
        if last_heartbeat.elapsed() >= heartbeat && !lease_lost {
            on_ack(client.heartbeat(worker_id, Some(experiment_id)), &mut lease_lost);
            last_heartbeat = Instant::now();
        }
    }

    let result = training.join();
    if lease_lost {
        tracing::info!(
            experiment = experiment_id,
            "stopped: the server gave the experiment back to the queue or cancelled it"
        );
        return;
    }
    let reported = match result {
        Ok(Ok(summary)) => {
            tracing::info!(experiment = experiment_id, final_loss = summary.final_loss, "succeeded");
            client.complete(&Complete { worker_id, experiment_id, summary }).map_err(|e| format!("completion: {e}"))
        }
        Ok(Err(e)) if e.is_cancelled() => report_failure(client, worker_id, experiment_id, "cancelled".into(), true),
        Ok(Err(e)) => report_failure(client, worker_id, experiment_id, e.to_string(), false),
        Err(panic) => {
            let what = panic
                .downcast_ref::<String>()
                .cloned()
                .or_else(|| panic.downcast_ref::<&str>().map(|s| s.to_string()))
                .unwrap_or_else(|| "unknown panic".into());
            report_failure(client, worker_id, experiment_id, format!("the engine crashed: {what}"), false)
        }
    };
    // The checkpoints go only once the server knows how the run ended: if the report is
    // lost, the lease expires and the next attempt resumes from them.
    match reported {
        Ok(_) => CheckpointDir::new(&checkpoints, 0).remove(),
        Err(e) => tracing::warn!(experiment = experiment_id, "could not report {e}; keeping its checkpoints"),
    }
}

fn report_failure(
    client: &ServerClient,
    worker_id: i64,
    experiment_id: i64,
    error: String,
    cancelled: bool,
) -> Result<(), String> {
    if cancelled {
        tracing::info!(experiment = experiment_id, "cancelled");
    } else {
        tracing::warn!(experiment = experiment_id, "failed: {error}");
    }
    client.fail(&Fail { worker_id, experiment_id, error, cancelled }).map_err(|e| format!("the failure: {e}"))
}
