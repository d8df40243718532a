//! `distlab-worker --server URL` (the worker token in `DISTLAB_WORKER_TOKEN` or a file):
//! register, then, with the credential the server answers, lease experiments one at a
//! time, train them, stream their events back in batches, and report how they ended.

use std::net::IpAddr;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{mpsc, Arc};
use std::thread;
use std::time::{Duration, Instant};

use distlab_common::*;

use super::client::{ClientError, ServerClient};
use super::execute::{execute, Gang, Hosts, RunPaths};
use super::rendezvous::{self, ServerRendezvous};
use distlab_worker::checkpoint::CheckpointDir;
use distlab_worker::train::TrainError;

pub struct WorkerConfig {
    pub server: String,
    pub token: String,
    pub name: String,
    pub threads: usize,
    pub collective_timeout: Duration,
    /// Hosts this machine plays for each run's ranks (1: one; see `launch::simulated_hosts`).
    pub simulated_hosts: usize,
    /// The most ranks this worker runs at once (None: any number); a wider run is placed on
    /// several workers.
    pub ranks: Option<u32>,
    /// The address other hosts reach this one's ranks at, in a run across workers (None:
    /// the address this machine reaches the server from).
    pub advertise_ip: Option<IpAddr>,
    /// How long to wait between lease requests when the queue is empty.
    pub poll_interval: Duration,
    /// Exit when the server has been unreachable this long (a local worker whose server died).
    pub give_up_after: Duration,
    /// Experiments' checkpoints, one directory each (`experiment-<id>`).
    pub checkpoint_dir: PathBuf,
    /// Where `parallel.offload=disk` keeps optimizer state (nameless files, gone with the run).
    pub offload_dir: PathBuf,
}

/// How long host 0 of a run across workers waits for the other hosts' last reports.
const HOSTS_DONE: Duration = Duration::from_secs(60);

/// While a run is in progress the worker asks the server at least this often whether it
/// still holds it (a heartbeat answers that), so that a cancel, or the server's time limit,
/// kills the run's ranks within about a second.
const CANCEL_POLL: Duration = Duration::from_secs(1);

/// Events are sent when this many are pending, or when the oldest has waited `FLUSH_EVERY`.
const BATCH_EVENTS: usize = 256;
const FLUSH_EVERY: Duration = Duration::from_millis(500);

/// The backends this worker can run, its devices and its machine, as it tells the server
/// when it registers: the CPU always; CUDA when built with it and this machine has a GPU.
fn offered(threads: usize) -> (Vec<BackendKind>, Vec<String>, Option<WorkerCapacity>) {
    let peak = super::peak::cpu_thread_peak();
    let cpu = format!(
        "cpu: {threads} threads, {} FMA peak {:.1} GFLOP/s per thread (measured at start)",
        peak.isa, peak.gflops_per_s
    );
    #[allow(unused_mut)]
    let (mut backends, mut devices) = (vec![BackendKind::Cpu], vec![cpu]);
    let cores = thread::available_parallelism().map_or(1, |n| n.get()) as u32;
    #[allow(unused_mut)]
    let (mut gpus, mut gpu_memory_bytes) = (0, 0);
    // Offered only when the backend really starts here (driver, cuBLAS, NVRTC, kernels).
    #[cfg(feature = "cuda")]
    match distlab_worker::backend::cuda::CudaBackend::<f32>::new(0)
        .and_then(|_| distlab_worker::backend::cuda::devices())
    {
        Ok(found) => {
            backends.push(BackendKind::Cuda);
            gpus = found.len() as u32;
            gpu_memory_bytes = found.iter().map(|gpu| gpu.memory_bytes).min().unwrap_or(0);
            devices.extend(found.into_iter().map(|gpu| gpu.label));
        }
        Err(why) => tracing::info!(%why, "built with CUDA, but it cannot run here: offering the CPU backend only"),
    }
    let capacity = distlab_worker::train::total_memory_bytes().map(|memory_bytes| WorkerCapacity {
        memory_bytes,
        cores,
        gpus,
        gpu_memory_bytes,
    });
    (backends, devices, capacity)
}

pub fn run_worker(cfg: WorkerConfig) -> anyhow::Result<()> {
    let client = ServerClient::new(&cfg.server, &cfg.token);
    let threads = if cfg.threads == 0 { thread::available_parallelism().map_or(1, |n| n.get()) } else { cfg.threads };
    let (backends, devices, capacity) = offered(threads);
    let registration = RegisterWorker {
        name: cfg.name.clone(),
        backends,
        devices,
        version: VERSION.to_string(),
        capacity,
        ranks: cfg.ranks,
    };
    let registered = retry_while_unreachable(&cfg, "register", || client.register(&registration))?;
    // From here on the worker speaks with its own credential.
    let client = client.as_worker(&registered.credential);
    let heartbeat = Duration::from_secs_f64(registered.heartbeat_interval_s.clamp(0.2, 60.0));
    tracing::info!(worker_id = registered.worker_id, server = %cfg.server, "registered");

    loop {
        let lease = retry_while_unreachable(&cfg, "lease", || client.lease(registered.worker_id, cfg.poll_interval))?;
        match lease {
            None => thread::sleep(cfg.poll_interval),
            Some(lease) => {
                match &lease.placement {
                    None => tracing::info!(experiment = lease.experiment_id, attempt = lease.attempt, "leased"),
                    Some(p) => tracing::info!(
                        experiment = lease.experiment_id,
                        attempt = lease.attempt,
                        host = p.host,
                        hosts = p.ranks_per_host.len(),
                        ranks = ?p.ranks(),
                        "leased a part of a run across workers"
                    ),
                }
                let name = distlab_common::elastic::checkpoint_dir_name(lease.store.as_deref(), lease.experiment_id);
                let checkpoints = cfg.checkpoint_dir.join(name);
                let run = Leased { lease, threads, collective_timeout: cfg.collective_timeout, heartbeat, checkpoints };
                run_leased(&cfg, &client, registered.worker_id, run);
            }
        }
    }
}

/// Calls `f` until it gets an answer from the server. A transient failure (a 5xx, a timeout,
/// the server unreachable while it restarts) is retried with a growing, jittered wait; only
/// a server unreachable for longer than `give_up_after` ends the worker (a local worker
/// whose server is gone), and a 5xx never does.
fn retry_while_unreachable<T>(
    cfg: &WorkerConfig,
    what: &str,
    mut f: impl FnMut() -> Result<T, ClientError>,
) -> anyhow::Result<T> {
    let mut last_contact = Instant::now();
    let mut wait = Duration::from_millis(200);
    loop {
        match f() {
            Ok(v) => return Ok(v),
            Err(e) if e.is_transient() => {
                let unreachable = matches!(e, ClientError::Transport { .. });
                if !unreachable {
                    last_contact = Instant::now();
                } else if last_contact.elapsed() >= cfg.give_up_after {
                    let waited = last_contact.elapsed().as_secs_f64();
                    return Err(anyhow::anyhow!("{what}: {e} (unreachable for {waited:.0} s: giving up)"));
                }
                let jittered = jitter(wait);
                tracing::warn!("{what}: {e}; retrying in {jittered:?}");
                thread::sleep(jittered);
                wait = (wait * 2).min(Duration::from_secs(5));
            }
            Err(e) => return Err(anyhow::anyhow!("{what}: {e}")),
        }
    }
}

/// Sends the run's model to the server, if the run wrote one: its tokenizer.json first
/// (a BPE run), then the weights. A file the server refuses (too large) is logged; the run
/// still succeeded.
fn upload_model(cfg: &WorkerConfig, client: &ServerClient, experiment_id: i64, dir: &std::path::Path) {
    if let Ok(json) = std::fs::read(dir.join(distlab_worker::tokenizer::TOKENIZER_FILE)) {
        match retry_while_unreachable(cfg, "the tokenizer", || client.upload_tokenizer(experiment_id, &json)) {
            Ok(()) => tracing::info!(experiment = experiment_id, bytes = json.len(), "tokenizer uploaded"),
            Err(e) => tracing::warn!(experiment = experiment_id, "the tokenizer was not uploaded: {e}"),
        }
    }
    let Ok(bytes) = std::fs::read(dir.join(distlab_common::export::WEIGHTS_FILE)) else { return };
    match retry_while_unreachable(cfg, "the model", || client.upload_model(experiment_id, &bytes)) {
        Ok(()) => tracing::info!(experiment = experiment_id, bytes = bytes.len(), "model uploaded"),
        Err(e) => tracing::warn!(experiment = experiment_id, "the model was not uploaded: {e}"),
    }
}

/// `wait` times a factor in [0.5, 1.5), so that workers failed by one server hiccup do not
/// all come back at the same instant.
fn jitter(wait: Duration) -> Duration {
    let nanos = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.subsec_nanos());
    wait.mul_f64(0.5 + f64::from(nanos % 1000) / 1000.0)
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
/// The experiment's latest checkpoint stays when it ends (see the end of this function).
fn run_leased(cfg: &WorkerConfig, client: &ServerClient, worker_id: i64, run: Leased) {
    let Leased { lease, threads, collective_timeout, heartbeat, checkpoints } = run;
    let experiment_id = lease.experiment_id;
    let report = Report { cfg, client, worker_id, experiment_id, attempt: lease.attempt };
    let simulated_hosts = cfg.simulated_hosts;
    // An uploaded dataset comes from the server for this attempt, into a directory of its
    // own that goes when the attempt ends.
    let dataset_dir = tempfile::Builder::new().prefix("distlab-dataset-").tempdir();
    let fetched = dataset_dir
        .map_err(|e| format!("no directory for the uploaded dataset: {e}"))
        .and_then(|dir| Ok((fetch_dataset(cfg, client, &lease.spec, dir.path())?, dir)));
    let (dataset, _dataset_dir) = match fetched {
        Ok(kept) => kept,
        Err(error) => {
            if let Err(e) = report.failure(error, false) {
                tracing::warn!(experiment = experiment_id, "could not report {e}");
            }
            return;
        }
    };
    let cancel = Arc::new(AtomicBool::new(false));
    let (tx, rx) = mpsc::channel::<RunEvent>();
    // The trained model lands here and goes to the server when the run succeeds.
    let model_dir = tempfile::tempdir().ok();
    let gang_ip = match &lease.placement {
        Some(_) => match cfg.advertise_ip.map_or_else(|| address_towards(&cfg.server), Ok) {
            Ok(ip) => Some(ip),
            Err(error) => {
                // This worker cannot take part: the run goes back to the queue (a fault of
                // this machine, not of the run).
                if let Err(e) = report.lost_host(error) {
                    tracing::warn!(experiment = experiment_id, "could not report {e}");
                }
                return;
            }
        },
        None => None,
    };
    let training = {
        let cancel = cancel.clone();
        let spec = lease.spec.clone();
        let checkpoints = checkpoints.clone();
        let offload_dir = cfg.offload_dir.clone();
        let model_out = model_dir.as_ref().map(|d| d.path().to_path_buf());
        let dataset = dataset.clone();
        let placement = lease.placement.clone();
        let attempt = lease.attempt;
        let stored_steps = lease.stored_steps;
        let client = client.clone();
        thread::Builder::new().name(format!("train-{experiment_id}")).spawn(move || {
            let mut on_event = |e: RunEvent| {
                let _ = tx.send(e);
            };
            // The spec came over the network: checked here, as it enters the worker.
            let spec = spec.validated(&Limits::default()).map_err(TrainError::Invalid)?;
            let paths = RunPaths {
                checkpoints: Some(&checkpoints),
                offload_dir: Some(&offload_dir),
                model_out: model_out.as_deref(),
                dataset: dataset.as_deref(),
                resume_at_most: stored_steps,
            };
            let rendezvous = ServerRendezvous { client: &client, worker_id, experiment_id, attempt };
            let hosts = match (&placement, gang_ip) {
                (Some(placement), Some(ip)) => Hosts::Gang(Gang { placement, ip, rendezvous: &rendezvous }),
                _ => Hosts::Here { simulated: simulated_hosts },
            };
            execute(&spec, threads, collective_timeout, hosts, paths, &mut on_event, &cancel)
        })
    };
    let training = match training {
        Ok(handle) => handle,
        Err(e) => {
            let error = format!("could not start the training thread: {e}");
            if let Err(e) = report.failure(error, false) {
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
    let withheld_from = metrics_withheld_from();
    loop {
        let done = match rx.recv_timeout(Duration::from_millis(100)) {
            Ok(RunEvent::Metric(m)) if withheld_from.is_some_and(|from| m.step >= from) => false,
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
                // The last events are sent until the server has them; earlier ones wait for
                // the next batch.
                Err(e) if e.is_transient() && done => {
                    match retry_while_unreachable(cfg, "events", || client.send_events(&batch)) {
                        Ok(ack) => on_ack(Ok(ack), &mut lease_lost),
                        Err(e) => tracing::warn!(experiment = experiment_id, "the last events were not delivered: {e}"),
                    }
                }
                Err(e) if e.is_transient() => pending = batch.events, // keep them, try again
                ack => on_ack(ack, &mut lease_lost),
            }
            last_flush = Instant::now();
            last_heartbeat = Instant::now();
        }
        if done {
            break;
        }
        if last_heartbeat.elapsed() >= heartbeat.min(CANCEL_POLL) && !lease_lost {
            on_ack(client.heartbeat(worker_id, Some(experiment_id)), &mut lease_lost);
            last_heartbeat = Instant::now();
        }
    }

    let result = training.join();
    let gang_rendezvous = ServerRendezvous { client, worker_id, experiment_id, attempt: lease.attempt };
    if lease_lost {
        tracing::info!(
            experiment = experiment_id,
            "stopped: the server gave the experiment back to the queue or cancelled it"
        );
        return;
    }
    let reported = match result {
        // Another host's part ended well: host 0 reports the run. This host stays out of
        // other work (heartbeating its part) until the run has ended.
        Ok(Ok(None)) => {
            tracing::info!(experiment = experiment_id, "this host's ranks finished; waiting for the run to end");
            if let Some(p) = &lease.placement {
                if let Err(e) = rendezvous::host_done(&gang_rendezvous, p.host) {
                    tracing::warn!(experiment = experiment_id, "{e}");
                }
            }
            wait_for_the_end(cfg, client, worker_id, experiment_id, heartbeat);
            Ok(())
        }
        Ok(Ok(Some(summary))) => {
            tracing::info!(experiment = experiment_id, final_loss = summary.final_loss, "succeeded");
            if let Some(p) = lease.placement.as_ref().filter(|p| p.ranks_per_host.len() > 1) {
                if let Err(e) = rendezvous::wait_for_hosts_done(&gang_rendezvous, p.ranks_per_host.len(), HOSTS_DONE) {
                    tracing::warn!(experiment = experiment_id, "completing the run all the same: {e}");
                }
            }
            if let Some(dir) = &model_dir {
                upload_model(cfg, client, experiment_id, dir.path());
            }
            let complete = Complete { worker_id, experiment_id, summary };
            retry_while_unreachable(cfg, "completion", || client.complete(&complete)).map_err(|e| e.to_string())
        }
        Ok(Err(e)) if e.is_cancelled() => report.failure("cancelled".into(), true),
        Ok(Err(e)) if e.is_attempt_over() => {
            tracing::info!(experiment = experiment_id, "stopped: the server ended this attempt");
            return;
        }
        Ok(Err(e)) if e.is_host_lost() => report.lost_host(e.to_string()),
        Ok(Err(e)) => report.failure(e.to_string(), false),
        Err(panic) => {
            let what = panic
                .downcast_ref::<String>()
                .cloned()
                .or_else(|| panic.downcast_ref::<&str>().map(|s| s.to_string()))
                .unwrap_or_else(|| "unknown panic".into());
            report.failure(format!("the engine crashed: {what}"), false)
        }
    };
    if let Err(e) = &reported {
        tracing::warn!(experiment = experiment_id, "could not report {e}");
    }
    keep_latest_checkpoint(&lease, &checkpoints);
}

/// For the fault tests: `DISTLAB_FAULT_WITHHOLD_METRICS_FROM=S` makes this worker keep
/// every metric point from step S on to itself, as points still buffered when a worker is
/// killed are.
fn metrics_withheld_from() -> Option<u64> {
    std::env::var("DISTLAB_FAULT_WITHHOLD_METRICS_FROM").ok()?.parse().ok()
}

/// After a run: the latest complete checkpoint stays (another experiment can start from
/// it, `train.resume_from`, and if the report was lost the lease expires and the next
/// attempt resumes from it). It goes with the experiment where the server can reach it
/// (DATA_DIR/checkpoints/experiment-<id>, its local workers'); a remote worker keeps it
/// until its directory is cleaned. Host 0 of a run across workers decides: another host
/// leaves a directory it shares with host 0 (host 0 wrote the spec there) alone, and
/// removes one of its own (its ranks' files, which no run can resume from alone).
fn keep_latest_checkpoint(lease: &Lease, checkpoints: &Path) {
    let dir = CheckpointDir::new(checkpoints, lease.spec.world_size());
    if lease.placement.as_ref().is_some_and(|p| p.host != 0) {
        if !checkpoints.join("spec.json").exists() {
            dir.remove();
        }
        return;
    }
    if lease.spec.train.checkpoint_every == 0 {
        // (a run resumed from another experiment's checkpoint saves none of its own)
        dir.remove();
    } else {
        dir.prune();
    }
}

/// `spec`'s uploaded dataset fetched into `dir` (retried while the server is unreachable),
/// or None for a built-in dataset; the error is the run's failure.
fn fetch_dataset(
    cfg: &WorkerConfig,
    client: &ServerClient,
    spec: &ExperimentSpec,
    dir: &Path,
) -> Result<Option<PathBuf>, String> {
    let (Dataset::Upload, Some(id)) = (spec.data.dataset, spec.data.upload_id) else { return Ok(None) };
    let what = format!("uploaded dataset {id}");
    let bytes = retry_while_unreachable(cfg, &what, || client.download_dataset(id))
        .map_err(|e| format!("could not fetch {what}: {e}"))?;
    let path = dir.join(format!("dataset-{id}.txt"));
    std::fs::write(&path, &bytes).map_err(|e| format!("could not keep {what} in {}: {e}", dir.display()))?;
    Ok(Some(path))
}

/// Heartbeats this host's part of a run across workers until the server says the run has
/// ended (or that this worker no longer holds it).
fn wait_for_the_end(cfg: &WorkerConfig, client: &ServerClient, worker_id: i64, experiment_id: i64, every: Duration) {
    loop {
        match client.heartbeat(worker_id, Some(experiment_id)) {
            Ok(ack) if !ack.cancel => thread::sleep(every),
            Ok(_) => return,
            Err(e) if e.is_transient() => {
                if retry_while_unreachable(cfg, "heartbeat", || client.heartbeat(worker_id, Some(experiment_id)))
                    .is_err()
                {
                    return;
                }
            }
            Err(_) => return,
        }
    }
}

/// The address of this machine that reaches `server` (the one the other hosts of a run are
/// most likely to reach it at too): where the kernel would route a packet to the server.
fn address_towards(server: &str) -> Result<IpAddr, String> {
    let authority = server.split("://").nth(1).unwrap_or(server).split('/').next().unwrap_or_default();
    let with_port = if authority.rsplit_once(':').is_some_and(|(_, p)| p.parse::<u16>().is_ok()) {
        authority.to_string()
    } else {
        format!("{authority}:80")
    };
    let cannot = |e: std::io::Error| {
        format!("cannot tell which address of this machine reaches {server}: {e} (set --advertise-ip)")
    };
    let target = std::net::ToSocketAddrs::to_socket_addrs(&with_port)
        .map_err(cannot)?
        .next()
        .ok_or_else(|| format!("{server} resolves to no address (set --advertise-ip)"))?;
    let local = if target.is_ipv4() { "0.0.0.0:0" } else { "[::]:0" };
    let socket = std::net::UdpSocket::bind(local).map_err(cannot)?;
    socket.connect(target).map_err(cannot)?;
    Ok(socket.local_addr().map_err(cannot)?.ip())
}

/// What this worker reports about the attempt of an experiment it holds (its part of it).
struct Report<'a> {
    cfg: &'a WorkerConfig,
    client: &'a ServerClient,
    worker_id: i64,
    experiment_id: i64,
    attempt: i64,
}

impl Report<'_> {
    /// The run failed (or stopped after a cancel).
    fn failure(&self, error: String, cancelled: bool) -> Result<(), String> {
        if cancelled {
            tracing::info!(experiment = self.experiment_id, "cancelled");
        } else {
            tracing::warn!(experiment = self.experiment_id, "failed: {error}");
        }
        self.send(Fail { error, cancelled, ..self.fail() })
    }

    /// This host's ranks failed because another host of the run went away: the run goes
    /// back to the queue (unless that host reports an error of its own).
    fn lost_host(&self, error: String) -> Result<(), String> {
        tracing::warn!(experiment = self.experiment_id, "another host of the run went away: {error}");
        self.send(Fail { error, lost_host: true, ..self.fail() })
    }

    fn fail(&self) -> Fail {
        Fail {
            worker_id: self.worker_id,
            experiment_id: self.experiment_id,
            attempt: Some(self.attempt),
            error: String::new(),
            cancelled: false,
            lost_host: false,
        }
    }

    /// Retried until the server answers.
    fn send(&self, fail: Fail) -> Result<(), String> {
        retry_while_unreachable(self.cfg, "the failure", || self.client.fail(&fail))
            .map(drop)
            .map_err(|e| e.to_string())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn config(give_up_after: Duration) -> WorkerConfig {
        WorkerConfig {
            server: "http://127.0.0.1:9".into(),
            token: "t".into(),
            name: "w".into(),
            threads: 1,
            collective_timeout: Duration::from_secs(1),
            simulated_hosts: 1,
            ranks: None,
            advertise_ip: None,
            poll_interval: Duration::from_millis(10),
            give_up_after,
            checkpoint_dir: PathBuf::from("unused"),
            offload_dir: PathBuf::from("unused"),
        }
    }

    fn status(code: u16) -> ClientError {
        ClientError::Status { path: "/api/workers/lease".into(), status: code, message: "busy".into() }
    }

    /// A server that answers 500 (or 503, or 429) for a while is waited for, however short
    /// `give_up_after` is: only an unreachable server ends the worker.
    #[test]
    fn server_errors_are_retried_until_the_server_answers() {
        let mut answers = vec![Err(status(500)), Err(status(503)), Err(status(429)), Ok(7)].into_iter();
        let got = retry_while_unreachable(&config(Duration::ZERO), "lease", || answers.next().unwrap());
        assert_eq!(got.unwrap(), 7);
        assert_eq!(answers.next().map(|a| a.is_ok()), None, "every answer was asked for");
    }

    #[test]
    fn an_unreachable_server_is_given_up_on_and_a_refusal_is_final() {
        let unreachable =
            || ClientError::Transport { url: "http://127.0.0.1:9".into(), source: ureq::Error::ConnectionFailed };
        let e = retry_while_unreachable::<()>(&config(Duration::ZERO), "lease", || Err(unreachable())).unwrap_err();
        assert!(e.to_string().contains("giving up"), "{e}");
        let mut calls = 0;
        let e = retry_while_unreachable::<()>(&config(Duration::from_secs(60)), "lease", || {
            calls += 1;
            Err(status(401))
        })
        .unwrap_err();
        assert_eq!(calls, 1, "a 401 is not retried: {e}");
    }

    #[test]
    fn jitter_stays_within_half_and_one_and_a_half() {
        for _ in 0..100 {
            let j = jitter(Duration::from_millis(1000));
            assert!(j >= Duration::from_millis(500) && j < Duration::from_millis(1500), "{j:?}");
        }
    }
}
