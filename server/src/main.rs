//! `distlab-server`: the command line. Every flag has an environment fallback.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

use anyhow::Context;
use clap::{Parser, Subcommand, ValueEnum};
use distlab_common::AuthMode;
use distlab_server::{serve, ServerConfig};

/// distlab's server: the web app, its API, the experiment queue, and local workers.
#[derive(Parser, Debug)]
#[command(name = "distlab-server", version, about)]
struct Cli {
    /// Address to listen on (port 0: pick a free one; the ready line shows it).
    #[arg(long, env = "DISTLAB_ADDR", default_value = "127.0.0.1:8080")]
    addr: SocketAddr,

    /// Directory for the database (distlab.db, unless --database-url names another),
    /// uploaded datasets and trained models; created if missing.
    #[arg(long, env = "DISTLAB_DATA_DIR", default_value = "./data", global = true)]
    data_dir: PathBuf,

    /// Run on PostgreSQL instead of DATA_DIR/distlab.db: postgres://USER:PASSWORD@HOST/DB
    /// (the database must exist). Several servers may share one. Prefer the environment
    /// variable: `ps` shows a flag's password to everyone.
    #[arg(long, env = "DISTLAB_DATABASE_URL", global = true, hide_env_values = true)]
    database_url: Option<String>,

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

    /// Live streams one account may hold at once (with --auth none: the one user).
    #[arg(long, env = "DISTLAB_MAX_STREAMS_PER_ACCOUNT", default_value_t = 32)]
    max_streams_per_account: usize,

    /// Seconds an experiment may run (each attempt) before it is stopped and failed; 0: no limit.
    #[arg(long, env = "DISTLAB_MAX_RUN_SECONDS", default_value_t = 0)]
    max_run_seconds: u64,

    /// Seconds before a request (other than a live stream) is cut off.
    #[arg(long, env = "DISTLAB_REQUEST_TIMEOUT_SECONDS", default_value_t = 30)]
    request_timeout_seconds: u64,

    /// The address of a reverse proxy in front of the server (TLS ends there): its
    /// X-Forwarded-For gives each client's address, and its X-Forwarded-Proto: https makes
    /// the session cookie Secure. Nobody else's X-Forwarded-* headers are believed.
    #[arg(long, env = "DISTLAB_TRUSTED_PROXY")]
    trusted_proxy: Option<std::net::IpAddr>,

    /// Seconds a connection has to send a request's headers, and may stay idle between
    /// requests, before it is closed.
    #[arg(long, env = "DISTLAB_HEADER_TIMEOUT_SECONDS", default_value_t = 10)]
    header_timeout_seconds: u64,

    /// `none`: one user, no sign-in (only on a loopback address). `accounts`: everyone signs
    /// in; experiments and flashcard profiles belong to accounts (`distlab-server user add`).
    #[arg(long, env = "DISTLAB_AUTH", value_enum, default_value = "none")]
    auth: Auth,

    /// Queued experiments one person may have; more are refused (429).
    #[arg(long, env = "DISTLAB_MAX_QUEUED_PER_USER", default_value_t = 20)]
    max_queued_per_user: usize,

    /// Experiments of one person running at once; 0: no limit (the rest wait their turn).
    #[arg(long, env = "DISTLAB_MAX_RUNNING_PER_USER", default_value_t = 0)]
    max_running_per_user: usize,

    /// MiB of disk one person's experiments (checkpoints, models) and datasets may take;
    /// a submission or upload beyond it is refused (507). 0: no limit.
    #[arg(long, env = "DISTLAB_MAX_DISK_PER_USER_MB", default_value_t = 4096)]
    max_disk_per_user_mb: u64,

    /// Place a run with more ranks than one worker runs (`distlab-worker --ranks`) on
    /// several idle workers at once; `--allow-multi-host false` keeps every run on one.
    #[arg(long, env = "DISTLAB_ALLOW_MULTI_HOST", default_value_t = true, action = clap::ArgAction::Set)]
    allow_multi_host: bool,

    /// Seconds (1 to 600) the workers of a run placed on several have to take their parts
    /// before it goes back to the queue.
    #[arg(long, env = "DISTLAB_GANG_TIMEOUT_SECONDS", default_value_t = 30)]
    gang_timeout_seconds: u64,

    #[command(subcommand)]
    command: Option<Command>,
}

#[derive(Clone, Copy, Debug, ValueEnum)]
enum Auth {
    None,
    Accounts,
}

#[derive(Subcommand, Debug)]
enum Command {
    /// Manage accounts (in the database of --data-dir; the server may be running).
    User {
        #[command(subcommand)]
        action: UserAction,
    },
}

#[derive(Subcommand, Debug)]
enum UserAction {
    /// Creates an account; its password is read from standard input (one line).
    Add {
        name: String,
        /// A teacher: may create accounts, reset passwords, and cancel or delete anyone's runs.
        #[arg(long)]
        admin: bool,
    },
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
    if let Some(Command::User { action: UserAction::Add { name, admin } }) = &cli.command {
        let location = match &cli.database_url {
            Some(url) => distlab_server::store::Location::Postgres(url),
            None => distlab_server::store::Location::DataDir(&cli.data_dir),
        };
        return add_user(location, name, *admin);
    }
    let token = distlab_server::tokens::secret_from("DISTLAB_WORKER_TOKEN", cli.worker_token_file.as_deref())?;
    let generated = token.is_none();
    let defaults = ServerConfig::default();
    let config = ServerConfig {
        addr: cli.addr,
        data_dir: cli.data_dir,
        database_url: cli.database_url,
        static_dir: cli.static_dir,
        local_workers: cli.local_workers,
        worker_bin: cli.worker_bin,
        worker_token: token.unwrap_or(defaults.worker_token.clone()),
        lease_seconds: cli.lease_seconds,
        heartbeat_seconds: cli.heartbeat_seconds,
        max_sse_connections: cli.max_streams,
        max_sse_per_account: cli.max_streams_per_account,
        request_timeout: Duration::from_secs(cli.request_timeout_seconds.max(1)),
        header_timeout: Duration::from_secs(cli.header_timeout_seconds.max(1)),
        trusted_proxy: cli.trusted_proxy,
        max_run: (cli.max_run_seconds > 0).then(|| Duration::from_secs(cli.max_run_seconds)),
        auth: match cli.auth {
            Auth::None => AuthMode::None,
            Auth::Accounts => AuthMode::Accounts,
        },
        max_queued_per_user: cli.max_queued_per_user,
        max_running_per_user: (cli.max_running_per_user > 0).then_some(cli.max_running_per_user),
        max_disk_per_user: (cli.max_disk_per_user_mb > 0).then(|| cli.max_disk_per_user_mb.saturating_mul(1024 * 1024)),
        allow_multi_host: cli.allow_multi_host,
        gang_timeout: Duration::from_secs(cli.gang_timeout_seconds),
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

/// `distlab-server user add NAME [--admin]`, the password read from standard input.
fn add_user(location: distlab_server::store::Location<'_>, name: &str, admin: bool) -> anyhow::Result<()> {
    if std::io::IsTerminal::is_terminal(&std::io::stdin()) {
        eprint!("password for {name}: ");
    }
    let mut password = String::new();
    std::io::stdin().read_line(&mut password).context("cannot read the password from standard input")?;
    let password = password.trim_end_matches(['\r', '\n']);
    let runtime = tokio::runtime::Runtime::new().context("cannot start the async runtime")?;
    let account = runtime.block_on(async {
        let db = distlab_server::store::open(location).await?;
        anyhow::Ok(distlab_server::store::accounts::create(&db, name, password, admin).await?)
    })?;
    println!("created {}account {}", if account.admin { "admin " } else { "" }, account.name);
    Ok(())
}

fn init_logging() {
    let filter = tracing_subscriber::EnvFilter::try_from_env("DISTLAB_LOG")
        .or_else(|_| tracing_subscriber::EnvFilter::try_from_default_env())
        .unwrap_or_else(|_| {
            tracing_subscriber::EnvFilter::new(format!("info,{}", distlab_server::store::QUIET_DRIVER_LOGS))
        });
    tracing_subscriber::fmt().with_env_filter(filter).with_writer(std::io::stderr).init();
}
