//! `distlab-server`: the command line. Every flag has an environment fallback.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

use anyhow::Context;
use clap::Parser;
use distlab_server::{serve, ServerConfig};

/// distlab's server: the web app, its API, the experiment queue, and local workers.
#[derive(Parser, Debug)]
#[command(name = "distlab-server", version, about)]
struct Cli {
    /// Address to listen on (port 0: pick a free one; the ready line shows it).
    #[arg(long, env = "DISTLAB_ADDR", default_value = "127.0.0.1:8080")]
    addr: SocketAddr,

    /// Directory for the database (distlab.db); created if missing.
    #[arg(long, env = "DISTLAB_DATA_DIR", default_value = "./data")]
    data_dir: PathBuf,

    /// The built frontend (index.html, js, wasm).
    #[arg(long, env = "DISTLAB_STATIC_DIR", default_value = "target/site")]
    static_dir: PathBuf,

    /// Worker processes to start next to the server.
    #[arg(long, env = "DISTLAB_LOCAL_WORKERS", default_value_t = 1)]
    local_workers: usize,

    /// The worker executable [default: distlab-worker next to this executable].
    #[arg(long, env = "DISTLAB_WORKER_BIN")]
    worker_bin: Option<PathBuf>,

    /// A file holding the token workers must send (Authorization: Bearer ...); or set
    /// DISTLAB_WORKER_TOKEN. Never on the command line, where `ps` shows it to everyone.
    /// Default: a random one, handed to the local workers only.
    #[arg(long, env = "DISTLAB_WORKER_TOKEN_FILE")]
    worker_token_file: Option<std::path::PathBuf>,

    /// Seconds a lease lasts unless a heartbeat renews it.
    #[arg(long, env = "DISTLAB_LEASE_SECONDS", default_value_t = 30.0)]
    lease_seconds: f64,

    /// Seconds between worker heartbeats (told to workers when they register).
    #[arg(long, env = "DISTLAB_HEARTBEAT_SECONDS", default_value_t = 5.0)]
    heartbeat_seconds: f64,

    /// Live streams (SSE) open at once at most.
    #[arg(long, env = "DISTLAB_MAX_STREAMS", default_value_t = 1024)]
    max_streams: usize,

    /// Live streams one client address may hold at once.
    #[arg(long, env = "DISTLAB_MAX_STREAMS_PER_CLIENT", default_value_t = 32)]
    max_streams_per_client: usize,

    /// Seconds an experiment may run (each attempt) before it is stopped and failed; 0: no limit.
    #[arg(long, env = "DISTLAB_MAX_RUN_SECONDS", default_value_t = 0)]
    max_run_seconds: u64,

    /// Seconds before a request (other than a live stream) is cut off.
    #[arg(long, env = "DISTLAB_REQUEST_TIMEOUT_SECONDS", default_value_t = 30)]
    request_timeout_seconds: u64,
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    init_logging();
    match run(cli) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("distlab-server: {e:#}");
            ExitCode::from(1)
        }
    }
}

fn run(cli: Cli) -> anyhow::Result<()> {
    let token = distlab_server::secret_from("DISTLAB_WORKER_TOKEN", cli.worker_token_file.as_deref())?;
    let generated = token.is_none();
    let defaults = ServerConfig::default();
    let config = ServerConfig {
        addr: cli.addr,
        data_dir: cli.data_dir,
        static_dir: cli.static_dir,
        local_workers: cli.local_workers,
        worker_bin: cli.worker_bin,
        worker_token: token.unwrap_or(defaults.worker_token.clone()),
        lease_seconds: cli.lease_seconds,
        heartbeat_seconds: cli.heartbeat_seconds,
        max_sse_connections: cli.max_streams,
        max_sse_per_client: cli.max_streams_per_client,
        request_timeout: Duration::from_secs(cli.request_timeout_seconds.max(1)),
        max_run: (cli.max_run_seconds > 0).then(|| Duration::from_secs(cli.max_run_seconds)),
        ..defaults
    };
    if generated {
        tracing::info!(
            "generated a random worker token for the local workers; set DISTLAB_WORKER_TOKEN (or --worker-token-file) to let other workers join"
        );
    }
    let runtime = tokio::runtime::Runtime::new().context("cannot start the async runtime")?;
    runtime.block_on(serve(config))?;
    Ok(())
}

fn init_logging() {
    let filter = tracing_subscriber::EnvFilter::try_from_env("DISTLAB_LOG")
        .or_else(|_| tracing_subscriber::EnvFilter::try_from_default_env())
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info,sqlx=warn"));
    tracing_subscriber::fmt().with_env_filter(filter).with_writer(std::io::stderr).init();
}
