//! Runs one experiment spec, whatever its shape: every run (a single rank too) and every
//! collective demo is launched as one process per rank, so that a cancel or the server's
//! time limit stops it at once, inside a step (its processes are killed), not at the next
//! step's end; a run across workers launches this worker's block of ranks, which meet the
//! other hosts' through the server's rendezvous.

use std::net::IpAddr;
use std::ops::Range;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use distlab_common::export;
use distlab_common::*;
use distlab_worker::checkpoint::CheckpointDir;
use distlab_worker::elastic;
use distlab_worker::train::{
    available_memory_bytes, ranks_fit, unsupported_features, CheckpointOptions, TrainError, TrainOptions,
};

use super::demo::{self, DemoRankResult, RankOutput};
use super::launch::{self, LaunchError, LaunchSpec};
use super::rendezvous::{self, Rendezvous, Unmet};

#[derive(Debug, thiserror::Error)]
pub enum ExecError {
    #[error(transparent)]
    Train(#[from] TrainError),
    #[error(transparent)]
    Launch(#[from] LaunchError),
    /// The hosts of a run across workers did not meet (or the server ended the attempt).
    #[error(transparent)]
    Unmet(#[from] Unmet),
    #[error("{0}")]
    Other(String),
}

impl ExecError {
    /// The server ended this attempt of a run across workers: nothing to report.
    pub fn is_attempt_over(&self) -> bool {
        matches!(self, ExecError::Unmet(Unmet::AttemptOver))
    }

    pub fn is_cancelled(&self) -> bool {
        matches!(self, ExecError::Train(TrainError::Cancelled) | ExecError::Launch(LaunchError::Cancelled))
    }

    /// This host's ranks failed because another host of the run went away.
    pub fn is_host_lost(&self) -> bool {
        matches!(self, ExecError::Launch(LaunchError::HostLost(_)))
    }

    /// The spec cannot run here (invalid, or asks for something not built yet).
    pub fn is_spec_problem(&self) -> bool {
        matches!(self, ExecError::Train(TrainError::Invalid(_) | TrainError::Unsupported(_)))
    }
}

/// Where a run's files are (each optional).
#[derive(Clone, Copy, Debug, Default)]
pub struct RunPaths<'a> {
    /// The experiment's own checkpoint directory: with a spec that asks for them,
    /// checkpoints are saved there and the run resumes from the latest complete one.
    pub checkpoints: Option<&'a Path>,
    /// Where `parallel.offload=disk` keeps the optimizer's state.
    pub offload_dir: Option<&'a Path>,
    /// Where the trained model goes when the run succeeds (`model.safetensors` and
    /// `config.json`, Hugging Face's format (GPT-2's or Llama's); a model that cannot be exported is logged, not an
    /// error).
    pub model_out: Option<&'a Path>,
    /// The text of `data.dataset: upload`.
    pub dataset: Option<&'a Path>,
    /// A resumed run starts from a checkpoint no later than this step (the server has the
    /// metric points of the steps before it: `Lease::stored_steps`); None: the latest.
    pub resume_at_most: Option<u64>,
}

/// Where a run's ranks are.
#[derive(Clone, Copy)]
pub enum Hosts<'a> {
    /// All on this machine, spread over this many simulated hosts (1: one host, shared
    /// memory between all ranks; see `launch::simulated_hosts`).
    Here { simulated: usize },
    /// This worker's part of a run across workers.
    Gang(Gang<'a>),
}

/// This worker's part of a run placed on several workers.
#[derive(Clone, Copy)]
pub struct Gang<'a> {
    pub placement: &'a Placement,
    /// The address the other hosts' ranks reach this host's ranks at.
    pub ip: IpAddr,
    pub rendezvous: &'a dyn Rendezvous,
}

impl Gang<'_> {
    fn is_host_0(&self) -> bool {
        self.placement.host == 0
    }
}

/// The longest the hosts of a run wait for each other (to take their parts, to say where to
/// resume): the server ends an unformed placement after its gang timeout (30 s by default,
/// at most 600 s), and a host then stops at once; this only bounds a server that never does.
const GANG_WAIT: Duration = Duration::from_secs(900);

/// Runs `spec` (its ranks where `hosts` says) with its files where `paths` says. Answers
/// the run's summary, or None for a host other than host 0 of a run across workers (host 0
/// reports the run; this host's part of it ended well).
pub fn execute(
    spec: &ValidSpec,
    threads: usize,
    collective_timeout: Duration,
    hosts: Hosts<'_>,
    paths: RunPaths<'_>,
    on_event: &mut dyn FnMut(RunEvent),
    cancel: &AtomicBool,
) -> Result<Option<RunSummary>, ExecError> {
    let RunPaths { checkpoints, offload_dir, model_out, dataset, resume_at_most } = paths;
    let gang = match hosts {
        Hosts::Gang(gang) => Some(gang),
        Hosts::Here { .. } => None,
    };
    if let Some(gang) = gang {
        rendezvous::wait_for_hosts(gang.rendezvous, GANG_WAIT, cancel)?;
    }
    // Only host 0 of a run across workers touches the checkpoint directory before the run
    // (the hosts share it, or the others hold no checkpoint of the run); it tells the
    // others where to resume.
    let host_0 = gang.is_none_or(|g| g.is_host_0());
    // What this worker cannot run (a demo on cuda, cuda without the feature) is refused
    // before anything starts, whichever way the spec runs.
    let mut unsupported = unsupported_features(spec);
    if gang.is_some() && spec.parallel.fault_tolerance == FaultTolerance::Replicas {
        unsupported.push(
            "fault_tolerance=replicas: the replicas' quorum is kept by one worker, so the run must fit on one \
             (this one holds only a block of its ranks)"
                .into(),
        );
    }
    if !unsupported.is_empty() {
        return Err(TrainError::Unsupported(unsupported.join("; ")).into());
    }
    let resume_from = spec.train.resume_from;
    let checkpoints = match checkpoints {
        Some(dir) if !host_0 && spec.demo.is_none() && (spec.train.checkpoint_every > 0 || resume_from.is_some()) => {
            let rendezvous = gang.map(|g| g.rendezvous).ok_or_else(|| ExecError::Other("no rendezvous".into()))?;
            let step = rendezvous::resume_step(rendezvous, None, GANG_WAIT)?;
            Some((CheckpointOptions { dir: dir.to_path_buf(), resume_from: step }, Vec::new()))
        }
        Some(dir) if spec.demo.is_none() && (spec.train.checkpoint_every > 0 || resume_from.is_some()) => {
            let resume =
                CheckpointDir::new(dir, spec.world_size()).prepare(spec, resume_at_most).map_err(TrainError::from)?;
            let warn = |message| LogLine { level: LogLevel::Warn, message };
            let mut lines: Vec<LogLine> = resume.warnings.into_iter().map(warn).collect();
            let mut step = resume.step;
            // Elastic resume: nothing of this run's own yet, so start from the other
            // experiment's checkpoint, re-cut for this run's ranks.
            if let (None, Some(from)) = (step, resume_from) {
                let note = elastic::recut_into(dir, spec, from).map_err(TrainError::from)?;
                lines.extend(note.map(|message| LogLine { level: LogLevel::Info, message }));
                step = Some(from.step);
            }
            if let Some(gang) = gang {
                rendezvous::resume_step(gang.rendezvous, Some(step), GANG_WAIT)?;
            }
            Some((CheckpointOptions { dir: dir.to_path_buf(), resume_from: step }, lines))
        }
        None if resume_from.is_some() => {
            return Err(ExecError::Other(
                "train.resume_from: this run has no checkpoint directory to resume in (--checkpoint-dir)".into(),
            ))
        }
        _ => None,
    };
    let from_step = checkpoints.as_ref().and_then(|c| c.0.resume_from).unwrap_or(0);
    on_event(RunEvent::Start { from_step });
    let checkpoints = checkpoints.map(|(options, lines)| {
        lines.into_iter().for_each(|line| on_event(RunEvent::Log(line)));
        options
    });
    // Each rank's final parameters go to a directory of their own (removed when dropped),
    // put together after. (A run across workers leaves each host's ranks' weights on that
    // host: it is not exported.)
    if gang.is_some_and(|g| g.is_host_0()) && model_out.is_some() {
        let message = "the trained model is not exported: its ranks' weights are on several hosts".to_string();
        on_event(RunEvent::Log(LogLine { level: LogLevel::Info, message }));
    }
    let cut_text = match spec.demo {
        Some(_) => None,
        None => cut_text_once(spec, dataset, on_event, cancel)?,
    };
    let exported = model_out.filter(|_| gang.is_none() && export::not_exportable(spec).is_none());
    let ranks_dir = exported.and_then(|out| tempfile::Builder::new().prefix(".final-weights-").tempdir_in(out).ok());
    let ranks_path = ranks_dir.as_ref().map(|d| d.path().to_path_buf());
    let opts = TrainOptions {
        threads,
        checkpoints,
        offload_dir: offload_dir.map(Path::to_path_buf),
        final_weights: ranks_path.clone(),
        dataset: dataset.map(Path::to_path_buf),
        cut_text: cut_text.as_ref().map(|dir| dir.path().to_path_buf()),
    };
    let summary = match &spec.demo {
        Some(demo) => run_demo(spec, demo, hosts, on_event, cancel),
        None => run_ranks(spec, &opts, collective_timeout, hosts, on_event, cancel),
    };
    if let (Ok(_), Some(out), Some(ranks)) = (&summary, exported, &ranks_path) {
        let tokenizer = cut_text.as_ref().map(|dir| dir.path().join(distlab_worker::tokenizer::TOKENIZER_FILE));
        let message = match distlab_worker::export::write_hf(spec, ranks, spec.train.steps, tokenizer.as_deref(), out) {
            Ok(bytes) => LogLine {
                level: LogLevel::Info,
                message: format!(
                    "the trained model: {} ({bytes} bytes, Hugging Face's {} format)",
                    export::WEIGHTS_FILE,
                    match spec.model.family {
                        distlab_common::ModelFamily::Gpt2 => "GPT-2",
                        distlab_common::ModelFamily::Llama => "Llama",
                    }
                ),
            },
            Err(e) => LogLine { level: LogLevel::Warn, message: format!("the model was not exported: {e}") },
        };
        on_event(RunEvent::Log(message));
    }
    summary
}

/// A BPE run's text, learned and cut into tokens once here for every rank of this machine
/// (`Data::write_cut`) in a directory removed when the run is over; None for bytes and the
/// Markov chain, which cost nothing to open. The cut runs on a thread of its own so that a
/// cancel is answered at once (learning a BPE cannot be interrupted: the thread finishes
/// into a directory already gone).
fn cut_text_once(
    spec: &ValidSpec,
    dataset: Option<&Path>,
    on_event: &mut dyn FnMut(RunEvent),
    cancel: &AtomicBool,
) -> Result<Option<tempfile::TempDir>, ExecError> {
    if spec.data.tokenizer.is_bytes() {
        return Ok(None);
    }
    let start = Instant::now();
    let dir = tempfile::Builder::new()
        .prefix("distlab-cut-text-")
        .tempdir()
        .map_err(|e| ExecError::Other(format!("no directory for the text cut into tokens: {e}")))?;
    let (data, model, global_batch) = (spec.data.clone(), spec.model.clone(), spec.global_batch());
    let (file, into) = (dataset.map(Path::to_path_buf), dir.path().to_path_buf());
    let (done, cut) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let result = distlab_worker::data::Data::open(&data, &model, global_batch, file.as_deref())
            .and_then(|text| text.write_cut(&into));
        let _ = done.send(result);
    });
    loop {
        if cancel.load(Ordering::Relaxed) {
            return Err(TrainError::Cancelled.into());
        }
        match cut.recv_timeout(Duration::from_millis(50)) {
            Ok(result) => {
                result.map_err(TrainError::from)?;
                break;
            }
            Err(std::sync::mpsc::RecvTimeoutError::Timeout) => continue,
            Err(std::sync::mpsc::RecvTimeoutError::Disconnected) => {
                return Err(ExecError::Other("cutting the text into tokens failed (its thread ended)".into()))
            }
        };
    }
    let message = format!(
        "the BPE learned and the text cut into tokens once for every rank, in {:.1} s",
        start.elapsed().as_secs_f64()
    );
    on_event(RunEvent::Log(LogLine { level: LogLevel::Info, message }));
    Ok(Some(dir))
}

/// A run: one process per rank of this machine, each with its share of the machine's
/// threads. The summary comes from rank 0 (None on another host of the run).
fn run_ranks(
    spec: &ValidSpec,
    opts: &TrainOptions,
    collective_timeout: Duration,
    hosts: Hosts<'_>,
    on_event: &mut dyn FnMut(RunEvent),
    cancel: &AtomicBool,
) -> Result<Option<RunSummary>, ExecError> {
    let here = local_ranks(spec.world_size(), hosts).len();
    if let (Some(available), BackendKind::Cpu, Hosts::Here { .. }) = (available_memory_bytes(), spec.backend, hosts) {
        ranks_fit(spec, available)?;
    }
    let threads = opts.threads;
    let total = if threads == 0 { std::thread::available_parallelism().map_or(1, |n| n.get()) } else { threads };
    let per_rank = (total / here).max(1);
    let mut summary = None;
    let mut args = vec![
        "--threads".into(),
        per_rank.to_string(),
        "--collective-timeout-seconds".into(),
        collective_timeout.as_secs_f64().to_string(),
    ];
    if let Some(dir) = &opts.offload_dir {
        args.extend(["--offload-dir".into(), dir.display().to_string()]);
    }
    if let Some(dir) = &opts.final_weights {
        args.extend(["--final-weights".into(), dir.display().to_string()]);
    }
    if let Some(file) = &opts.dataset {
        args.extend(["--dataset".into(), file.display().to_string()]);
    }
    if let Some(dir) = &opts.cut_text {
        args.extend(["--cut-text".into(), dir.display().to_string()]);
    }
    if let Some(c) = &opts.checkpoints {
        args.extend(["--checkpoint-dir".into(), c.dir.display().to_string()]);
        if let Some(step) = c.resume_from {
            args.extend(["--resume-from".into(), step.to_string()]);
        }
    }
    let runs_rank_0 = local_ranks(spec.world_size(), hosts).contains(&0);
    launch_ranks(
        spec,
        "train",
        args,
        hosts,
        &mut |output| match output {
            RankOutput::Event(e) => on_event(*e),
            RankOutput::Summary(s) => summary = Some(*s),
            RankOutput::Demo(_) => {}
        },
        cancel,
    )?;
    let hosts_used = match hosts {
        Hosts::Here { .. } => 1,
        Hosts::Gang(gang) => gang.placement.ranks_per_host.len(),
    };
    let peak = || super::peak::run_peak(spec, here, per_rank, hosts_used);
    let stage_flops = || distlab_common::planner::plan(spec).map(|p| p.stage_flops_per_token(spec)).unwrap_or_default();
    match (summary, runs_rank_0) {
        (None, true) => Err(ExecError::Other("rank 0 finished without a summary".into())),
        (summary, _) => Ok(summary.map(|s| {
            s.with_utilisation(spec.model.train_flops_per_token(), peak()).with_stage_utilisation(&stage_flops())
        })),
    }
}

/// The ranks of a `world` this machine runs.
fn local_ranks(world: usize, hosts: Hosts<'_>) -> Range<usize> {
    match hosts {
        Hosts::Here { .. } => 0..world,
        Hosts::Gang(gang) => gang.placement.ranks(),
    }
}

/// Launches this machine's rank processes of `spec` running `task` (all of them, over
/// simulated hosts, or this host's part of a run across workers, whose ranks find the
/// others' through the rendezvous), passing each rank's outputs to `on_output`.
fn launch_ranks(
    spec: &ExperimentSpec,
    task: &str,
    task_args: Vec<String>,
    hosts: Hosts<'_>,
    on_output: &mut dyn FnMut(RankOutput),
    cancel: &AtomicBool,
) -> Result<(), ExecError> {
    let run_dir = run_dir(task)?;
    let spec_path = run_dir.join("spec.json");
    std::fs::write(&spec_path, serde_json::to_vec(spec).unwrap_or_default())
        .map_err(|e| ExecError::Other(e.to_string()))?;
    let exe = std::env::current_exe().map_err(|e| ExecError::Other(e.to_string()))?;
    let mut args = vec![task.to_string(), "--spec".into(), spec_path.display().to_string()];
    args.extend(task_args);
    let world = spec.world_size();
    let launch = match hosts {
        Hosts::Here { simulated } => LaunchSpec {
            exe: &exe,
            world,
            local: 0..world,
            hosts: launch::simulated_hosts(world, simulated),
            host_ip: None,
            secret: None,
            args,
            run_dir: &run_dir,
            env: vec![],
            replicas: spec.parallel.fault_tolerance == FaultTolerance::Replicas,
        },
        Hosts::Gang(gang) => LaunchSpec {
            exe: &exe,
            world,
            local: gang.placement.ranks(),
            hosts: gang.placement.host_of_each_rank(),
            host_ip: Some(gang.ip),
            secret: Some(gang.placement.secret.clone()),
            args,
            run_dir: &run_dir,
            env: vec![],
            replicas: false,
        },
    };
    let mut forward = |_, payload| {
        if let Ok(output) = serde_json::from_value::<RankOutput>(payload) {
            on_output(output);
        }
    };
    let outcome = match hosts {
        Hosts::Here { .. } => launch::launch(&launch, &mut forward, cancel),
        // The relay passes addresses between this host's run directory and the rendezvous
        // while the ranks connect.
        Hosts::Gang(gang) => {
            let relayed = AtomicBool::new(false);
            std::thread::scope(|s| {
                let relay = s.spawn(|| {
                    let local = gang.placement.ranks();
                    rendezvous::relay(gang.rendezvous, &run_dir, local, world, &relayed)
                });
                let outcome = launch::launch(&launch, &mut forward, cancel);
                relayed.store(true, Ordering::Relaxed);
                if let Ok(Err(e)) = relay.join() {
                    tracing::warn!("{e}");
                }
                outcome
            })
        }
    };
    let _ = std::fs::remove_dir_all(&run_dir);
    Ok(outcome?)
}

fn run_demo(
    spec: &ExperimentSpec,
    demo: &CollectiveDemo,
    hosts: Hosts<'_>,
    on_event: &mut dyn FnMut(RunEvent),
    cancel: &AtomicBool,
) -> Result<Option<RunSummary>, ExecError> {
    if let Hosts::Gang(_) = hosts {
        return Err(ExecError::Other("a collective demo runs on one worker".into()));
    }
    let world = spec.parallel.dp;
    let started = Instant::now();
    let mut results: Vec<DemoRankResult> = Vec::new();
    launch_ranks(
        spec,
        "demo",
        vec![],
        hosts,
        &mut |output| match output {
            RankOutput::Event(e) => on_event(*e),
            RankOutput::Demo(r) => results.push(r),
            RankOutput::Summary(_) => {}
        },
        cancel,
    )?;
    if results.len() != world {
        return Err(ExecError::Other(format!("{} of {world} ranks reported a result", results.len())));
    }
    let check = demo::check(demo, (spec.parallel.allreduce, spec.parallel.ranks_per_node), world, &results);
    on_event(RunEvent::Log(LogLine {
        level: LogLevel::Info,
        message: format!(
            "{} of {} elements on {} ranks: each rank sent {:?} bytes (formula {:.1}); largest error {}",
            demo.op.as_str(),
            demo.elements,
            world,
            check.bytes_sent,
            check.formula_bytes,
            check.max_abs_error
        ),
    }));
    Ok(Some(RunSummary {
        world_size: world,
        threads: 1,
        wall_s: started.elapsed().as_secs_f64(),
        collective: Some(check),
        ..RunSummary::default()
    }))
}

/// A fresh private directory for one run's rendezvous sockets and files.
pub fn run_dir(what: &str) -> Result<PathBuf, ExecError> {
    let dir =
        std::env::temp_dir().join(format!("distlab-{what}-{}-{}", std::process::id(), distlab_worker::trace::now_us()));
    std::fs::create_dir_all(&dir).map_err(|e| ExecError::Other(format!("cannot create {}: {e}", dir.display())))?;
    Ok(dir)
}
