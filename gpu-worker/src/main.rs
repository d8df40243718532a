//! `distlab-worker`: lease experiments from a distlab server and train them, or run one
//! spec file locally (`distlab-worker run SPEC.json`).

mod worker;

use std::path::PathBuf;
use std::time::Duration;

use anyhow::Context;
use clap::{Parser, Subcommand};
use distlab_worker::heap::CountingAllocator;
use distlab_worker::train::{CheckpointOptions, TrainOptions};

/// Every allocation of the worker and its rank processes is counted: the memory page shows
/// the heap measured next to the ledger's bookings.
#[global_allocator]
static ALLOCATOR: CountingAllocator = CountingAllocator;

#[derive(Parser)]
#[command(name = "distlab-worker", version, about = "distlab worker: trains experiments for a distlab server")]
struct Cli {
    /// The server to lease experiments from.
    #[arg(long, env = "DISTLAB_SERVER", default_value = "http://127.0.0.1:8080")]
    server: String,
    /// A file holding the server's worker token; or set DISTLAB_WORKER_TOKEN. Never on the
    /// command line, where `ps` shows it to everyone.
    #[arg(long, env = "DISTLAB_WORKER_TOKEN_FILE")]
    token_file: Option<PathBuf>,
    /// A name for this worker, shown by the server.
    #[arg(long, env = "DISTLAB_WORKER_NAME")]
    name: Option<String>,
    /// Compute threads per experiment (0 = all cores).
    #[arg(long, env = "DISTLAB_THREADS", default_value_t = 0, global = true)]
    threads: usize,
    /// Seconds between lease requests while the queue is empty.
    #[arg(long, default_value_t = 0.5)]
    poll_seconds: f64,
    /// A rank waiting longer than this for a peer in a collective fails the run, naming
    /// the collective and the peer (a hung or dead rank).
    #[arg(long, env = "DISTLAB_COLLECTIVE_TIMEOUT_SECONDS", default_value_t = 60.0, global = true)]
    collective_timeout_seconds: f64,
    /// Spread each run's ranks over this many simulated hosts on this machine: ranks of
    /// different simulated hosts talk over TCP (loopback) instead of shared memory, as ranks
    /// of different machines would.
    #[arg(long, env = "DISTLAB_SIMULATED_HOSTS", default_value_t = 1, global = true)]
    simulated_hosts: usize,
    /// Where experiments' checkpoints go, one directory each. Workers that should resume
    /// each other's runs must share it (the server's local workers use DATA_DIR/checkpoints).
    #[arg(long, env = "DISTLAB_CHECKPOINT_DIR", default_value = "./data/checkpoints")]
    checkpoint_dir: PathBuf,
    /// Where a spec with parallel.offload=disk keeps its optimizer state: files without a
    /// name, gone when the run's processes end (the server's local workers use DATA_DIR/offload).
    #[arg(long, env = "DISTLAB_OFFLOAD_DIR", default_value = "./data/offload")]
    offload_dir: PathBuf,
    /// The most ranks this worker runs at once (its GPUs, say, or its cores); a run with
    /// more is placed on several workers by the server. Unset: any number.
    #[arg(long, env = "DISTLAB_WORKER_RANKS", value_parser = clap::value_parser!(u32).range(1..))]
    ranks: Option<u32>,
    /// The address other workers' ranks reach this worker's ranks at, in a run across
    /// workers. Unset: the address this machine reaches the server from.
    #[arg(long, env = "DISTLAB_ADVERTISE_IP")]
    advertise_ip: Option<std::net::IpAddr>,
    /// Exit after the server has been unreachable this many seconds.
    #[arg(long, env = "DISTLAB_GIVE_UP_SECONDS", default_value_t = 60.0)]
    give_up_seconds: f64,
    #[command(subcommand)]
    command: Option<Command>,
}

#[derive(Subcommand)]
enum Command {
    /// Train one experiment spec (JSON file) with no server; prints one JSON line per step.
    Run {
        spec: PathBuf,
        /// Also write spec.json, metrics.jsonl and summary.json into this directory.
        #[arg(long)]
        out: Option<PathBuf>,
        /// Save the spec's checkpoints here (train.checkpoint_every > 0); a second run of the
        /// same spec after a crash resumes from the latest; a run that succeeds keeps the
        /// latest for another spec's train.resume_from (which looks for `experiment-<id>`
        /// next to this directory) and a second run of it starts afresh.
        #[arg(long)]
        checkpoint_dir: Option<PathBuf>,
        /// The text a spec with `data.dataset: upload` trains on (a UTF-8 file).
        #[arg(long)]
        dataset: Option<PathBuf>,
        /// The limits the spec is held to, a JSON object of the server's `limits` fields
        /// (those left out keep the defaults: max_seq_len 1024, max_world_size 8, ...).
        #[arg(long)]
        limits: Option<PathBuf>,
    },
    /// An exported model's next-token probabilities (DIR holds model.safetensors and
    /// config.json, as `run --out` writes them) after each of TOKENS: one JSON row per token,
    /// to check the export against another implementation (`xtask/reference/check_export.py`).
    Probabilities {
        dir: PathBuf,
        #[arg(required = true)]
        tokens: Vec<u32>,
    },
    /// TEXT cut into tokens by an exported BPE run's tokenizer (DIR holds tokenizer.json):
    /// a JSON list of ids, to check the export against transformers' AutoTokenizer.
    Tokenize { dir: PathBuf, text: String },
    /// Bus bandwidth of all-reduce, reduce-scatter and all-gather between W rank processes
    /// (JSON lines, nccl-tests definitions).
    BenchComm {
        #[arg(long, default_value_t = 2)]
        world: usize,
        #[arg(long, default_value_t = 1024)]
        min_bytes: usize,
        #[arg(long, default_value_t = 256 << 20)]
        max_bytes: usize,
        /// Across real hosts: every rank's host (H0,H1,...); this run starts only the ranks
        /// of `--host`, the same command on each host starts the others. Their addresses
        /// meet in `--run-dir`, which the hosts must share, and they prove the secret in
        /// DISTLAB_RENDEZVOUS_SECRET (32 hex digits, the same everywhere).
        #[arg(long, value_delimiter = ',', requires_all = ["host", "run_dir", "host_ip"])]
        hosts: Vec<usize>,
        /// This host, with --hosts.
        #[arg(long)]
        host: Option<usize>,
        /// The address the other hosts reach this one's ranks at, with --hosts.
        #[arg(long)]
        host_ip: Option<std::net::IpAddr>,
        /// The directory the hosts' ranks publish their addresses in, with --hosts.
        #[arg(long)]
        run_dir: Option<PathBuf>,
    },
    /// One rank of a multi-process run (started by the launcher, not by hand).
    #[command(hide = true)]
    Rank {
        #[arg(long)]
        rank: usize,
        #[arg(long)]
        world: usize,
        /// The rendezvous directory shared by the ranks of this host.
        #[arg(long)]
        dir: PathBuf,
        /// Every rank's host (H0,H1,...), when the ranks span hosts: ranks of one host
        /// share memory, the others talk over TCP.
        #[arg(long, value_delimiter = ',')]
        hosts: Vec<usize>,
        /// The address of this rank's host that the other hosts reach it on.
        #[arg(long, default_value = "127.0.0.1")]
        host_ip: std::net::IpAddr,
        /// The ranks started on this machine, START..END (default: all): a GPU rank takes
        /// the machine's GPU (its index among them) mod GPUs.
        #[arg(long, value_parser = parse_range)]
        local_ranks: Option<std::ops::Range<usize>>,
        #[command(subcommand)]
        task: RankTask,
    },
}

#[derive(Subcommand)]
enum RankTask {
    /// Data-parallel training (see ddp_rank.rs).
    Train {
        #[arg(long)]
        spec: PathBuf,
        /// The experiment's checkpoint directory.
        #[arg(long)]
        checkpoint_dir: Option<PathBuf>,
        /// Resume from the checkpoint of this step (in --checkpoint-dir).
        #[arg(long, requires = "checkpoint_dir")]
        resume_from: Option<u64>,
        /// Where parallel.offload=disk keeps this rank's optimizer state.
        #[arg(long)]
        offload_dir: Option<PathBuf>,
        /// Where this rank writes its final parameters when the run succeeds.
        #[arg(long)]
        final_weights: Option<PathBuf>,
        /// The text of `data.dataset: upload`.
        #[arg(long)]
        dataset: Option<PathBuf>,
        /// A BPE run's text, cut into tokens once by the launcher for every rank.
        #[arg(long)]
        cut_text: Option<PathBuf>,
    },
    /// The collective demo (see demo.rs).
    Demo {
        #[arg(long)]
        spec: PathBuf,
    },
    BenchComm {
        #[arg(long)]
        min_bytes: usize,
        #[arg(long)]
        max_bytes: usize,
    },
}

fn main() {
    tracing_subscriber::fmt()
        .with_writer(std::io::stderr)
        .with_env_filter(tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "info".into()))
        .init();
    let cli = Cli::parse();
    let code = match run(cli) {
        Ok(code) => code,
        Err(e) => {
            eprintln!("error: {e:#}");
            1
        }
    };
    std::process::exit(code);
}

fn run(cli: Cli) -> anyhow::Result<i32> {
    match cli.command {
        Some(Command::Probabilities { dir, tokens }) => {
            let config = std::fs::read_to_string(dir.join("config.json"))?;
            let model = distlab_common::export::model_of_hf_config(&serde_json::from_str(&config)?)
                .map_err(anyhow::Error::msg)?;
            let file = std::fs::read(dir.join(distlab_common::export::WEIGHTS_FILE))?;
            let params = distlab_worker::generate::load_hf(&model, &file).map_err(anyhow::Error::msg)?;
            let mut predictor =
                distlab_worker::generate::Predictor::new(&model, &params).map_err(anyhow::Error::msg)?;
            let rows = predictor.probabilities(&tokens).map_err(anyhow::Error::msg)?;
            let rows: Vec<&[f32]> = rows.chunks(model.vocab).collect();
            println!("{}", serde_json::to_string(&rows)?);
            Ok(0)
        }
        Some(Command::Tokenize { dir, text }) => {
            let json = std::fs::read_to_string(dir.join(distlab_worker::tokenizer::TOKENIZER_FILE))?;
            let tokenizer = distlab_worker::tokenizer::TextTokenizer::from_json(&json)?;
            println!("{}", serde_json::to_string(&tokenizer.encode(text.as_bytes())?)?);
            Ok(0)
        }
        Some(Command::Run { spec, out, checkpoint_dir, dataset, limits }) => worker::run_local::run_spec_file(
            &spec,
            out,
            checkpoint_dir,
            dataset,
            limits,
            cli.threads,
            collective_timeout(cli.collective_timeout_seconds),
            cli.simulated_hosts,
        ),
        Some(Command::BenchComm { world, min_bytes, max_bytes, hosts, host, host_ip, run_dir: shared }) => {
            println!("{}", serde_json::to_string(&worker::bench_comm::memcpy_point(64 << 20))?);
            let run_dir = match &shared {
                Some(dir) => dir.clone(),
                None => worker::execute::run_dir("bench-comm")?,
            };
            let exe = std::env::current_exe()?;
            let (local, hosts, secret) = match host {
                Some(host) => {
                    anyhow::ensure!(hosts.len() == world, "--hosts names {} hosts for a world of {world}", hosts.len());
                    anyhow::ensure!(
                        hosts.windows(2).all(|w| w[1] == w[0] || w[1] == w[0] + 1) && hosts.first() == Some(&0),
                        "--hosts gives each host a block of consecutive ranks, from host 0: 0,0,1,1, not {hosts:?}"
                    );
                    let first = hosts.iter().position(|&h| h == host).unwrap_or(world);
                    let here = hosts.iter().filter(|&&h| h == host).count();
                    let secret = std::env::var(worker::protocol::SECRET_VAR).map_err(|_| {
                        anyhow::anyhow!("across hosts, set {} on every host", worker::protocol::SECRET_VAR)
                    })?;
                    (first..first + here, hosts, Some(secret))
                }
                None => (0..world, worker::launch::simulated_hosts(world, cli.simulated_hosts), None),
            };
            let spec = worker::launch::LaunchSpec {
                exe: &exe,
                world,
                local,
                hosts,
                host_ip,
                secret,
                args: vec![
                    "bench-comm".into(),
                    "--min-bytes".into(),
                    min_bytes.to_string(),
                    "--max-bytes".into(),
                    max_bytes.to_string(),
                ],
                run_dir: &run_dir,
                env: vec![],
                replicas: false,
            };
            let result = worker::launch::launch(
                &spec,
                &mut |_, payload| println!("{payload}"),
                &std::sync::atomic::AtomicBool::new(false),
            );
            if shared.is_none() {
                let _ = std::fs::remove_dir_all(&run_dir);
            }
            result?;
            Ok(0)
        }
        Some(Command::Rank { rank, world, dir, hosts, host_ip, local_ranks, task }) => {
            let local = local_ranks.unwrap_or(0..world);
            let place = worker::rank::Place { rank, world, dir, hosts, host_ip, local };
            let result = match task {
                RankTask::BenchComm { min_bytes, max_bytes } => {
                    worker::bench_comm::run_rank(&place, min_bytes, max_bytes)
                }
                RankTask::Train {
                    spec,
                    checkpoint_dir,
                    resume_from,
                    offload_dir,
                    final_weights,
                    dataset,
                    cut_text,
                } => read_spec(&spec).and_then(|spec| {
                    let checkpoints = checkpoint_dir.map(|dir| CheckpointOptions { dir, resume_from });
                    let threads = cli.threads;
                    let opts = TrainOptions { threads, checkpoints, offload_dir, final_weights, dataset, cut_text };
                    worker::ddp_rank::run(&place, &spec, &opts, collective_timeout(cli.collective_timeout_seconds))
                }),
                RankTask::Demo { spec } => read_spec(&spec).and_then(|spec| match &spec.demo {
                    Some(_) => worker::demo::run_rank(&place, &spec),
                    None => Err(anyhow::anyhow!("the spec has no demo section")),
                }),
            };
            match result {
                Ok(()) => Ok(0),
                Err(e) => {
                    let peer = worker::rank::blamed_peer_of(&e);
                    worker::rank::LauncherChannel.error(format!("{e:#}"), peer);
                    Ok(1)
                }
            }
        }
        None => {
            let token = worker_token(cli.token_file.as_deref())?.ok_or_else(|| {
                anyhow::anyhow!("set DISTLAB_WORKER_TOKEN (or --token-file) to the server's worker token")
            })?;
            let name = cli.name.unwrap_or_else(|| format!("worker-{}", std::process::id()));
            worker::worker_loop::run_worker(worker::worker_loop::WorkerConfig {
                server: cli.server,
                token,
                name,
                threads: cli.threads,
                collective_timeout: collective_timeout(cli.collective_timeout_seconds),
                simulated_hosts: cli.simulated_hosts,
                ranks: cli.ranks,
                advertise_ip: cli.advertise_ip,
                poll_interval: Duration::from_secs_f64(cli.poll_seconds.clamp(0.05, 60.0)),
                give_up_after: Duration::from_secs_f64(cli.give_up_seconds.max(0.0)),
                checkpoint_dir: cli.checkpoint_dir,
                offload_dir: cli.offload_dir,
            })?;
            Ok(0)
        }
    }
}

/// The worker token from DISTLAB_WORKER_TOKEN, else from the first line of `file`.
fn worker_token(file: Option<&std::path::Path>) -> anyhow::Result<Option<String>> {
    if let Some(token) = std::env::var("DISTLAB_WORKER_TOKEN").ok().filter(|t| !t.trim().is_empty()) {
        return Ok(Some(token.trim().to_string()));
    }
    let Some(file) = file else { return Ok(None) };
    let text =
        std::fs::read_to_string(file).with_context(|| format!("cannot read the token file {}", file.display()))?;
    Ok(text.lines().next().map(str::trim).filter(|t| !t.is_empty()).map(str::to_string))
}

/// `START..END` as a range.
fn parse_range(text: &str) -> Result<std::ops::Range<usize>, String> {
    let (start, end) = text.split_once("..").ok_or_else(|| format!("{text:?} is not START..END"))?;
    let number = |n: &str| n.trim().parse::<usize>().map_err(|e| format!("{n:?}: {e}"));
    let (start, end) = (number(start)?, number(end)?);
    if start >= end {
        return Err(format!("{text:?} holds no rank"));
    }
    Ok(start..end)
}

fn collective_timeout(seconds: f64) -> Duration {
    Duration::from_secs_f64(if seconds.is_finite() { seconds.clamp(0.1, 3600.0) } else { 60.0 })
}

/// The spec a rank process is started with, checked as it enters the process (against the
/// rules; its launcher applied the run's limits).
fn read_spec(path: &std::path::Path) -> anyhow::Result<distlab_common::ValidSpec> {
    let text = std::fs::read_to_string(path)?;
    let joined = |errors: Vec<distlab_common::FieldError>| {
        anyhow::anyhow!("{}", errors.iter().map(|e| e.to_string()).collect::<Vec<_>>().join("; "))
    };
    let spec = distlab_common::ExperimentSpec::from_json_str(&text).map_err(joined)?;
    spec.validated(&distlab_common::Limits::none()).map_err(joined)
}
