//! `distlab-worker`: lease experiments from a distlab server and train them, or run one
//! spec file locally (`distlab-worker run SPEC.json`).

mod client;
mod run_local;
mod worker_loop;

use std::path::PathBuf;
use std::time::Duration;

use clap::{Parser, Subcommand};

#[derive(Parser)]
#[command(name = "distlab-worker", version, about = "distlab worker: trains experiments for a distlab server")]
struct Cli {
    /// The server to lease experiments from.
    #[arg(long, env = "DISTLAB_SERVER", default_value = "http://127.0.0.1:8080")]
    server: String,
    /// The server's worker token (`distlab-server --worker-token`).
    #[arg(long, env = "DISTLAB_WORKER_TOKEN", hide_env_values = true)]
    token: Option<String>,
    /// A name for this worker, shown by the server.
    #[arg(long, env = "DISTLAB_WORKER_NAME")]
    name: Option<String>,
    /// Compute threads per experiment (0 = all cores).
    #[arg(long, env = "DISTLAB_THREADS", default_value_t = 0, global = true)]
    threads: usize,
    /// Seconds between lease requests while the queue is empty.
    #[arg(long, default_value_t = 0.5)]
    poll_seconds: f64,
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
    },
}

fn main() {
    tracing_subscriber::fmt()
        .with_writer(std::io::stderr)
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "info".into()),
        )
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
        Some(Command::Run { spec, out }) => run_local::run_spec_file(&spec, out, cli.threads),
        None => {
            let token = cli
                .token
                .ok_or_else(|| anyhow::anyhow!("--token (or DISTLAB_WORKER_TOKEN) is required to talk to a server"))?;
            let name = cli.name.unwrap_or_else(|| format!("worker-{}", std::process::id()));
            worker_loop::run_worker(worker_loop::WorkerConfig {
                server: cli.server,
                token,
                name,
                threads: cli.threads,
                poll_interval: Duration::from_secs_f64(cli.poll_seconds.clamp(0.05, 60.0)),
                give_up_after: Duration::from_secs_f64(cli.give_up_seconds.max(0.0)),
            })?;
            Ok(0)
        }
    }
}
