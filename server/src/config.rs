//! What the server can be told at start ([`ServerConfig`]: the CLI maps flags and env
//! vars onto it), its defaults and its checks, and why serving can fail ([`ServeError`]).

use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::path::PathBuf;
use std::time::Duration;

use distlab_common::{AuthMode, Limits};

use crate::sign_in_guard;
use crate::store::{DbError, Location};
use crate::tokens::random_token;

/// Everything the server can be told at start (the CLI maps flags and env vars onto this).
#[derive(Clone, Debug)]
pub struct ServerConfig {
    /// Where to listen; port 0 picks a free port (the ready line shows it).
    pub addr: SocketAddr,
    /// Holds distlab.db (unless `database_url` names another database), uploaded datasets
    /// and trained models.
    pub data_dir: PathBuf,
    /// A PostgreSQL database instead of DATA_DIR/distlab.db (`postgres://...`): several
    /// servers can share it.
    pub database_url: Option<String>,
    /// The built frontend (index.html, js, wasm).
    pub static_dir: PathBuf,
    /// Worker processes to start next to the server.
    pub local_workers: usize,
    /// The worker executable; None: `distlab-worker` next to the server's own executable.
    pub worker_bin: Option<PathBuf>,
    /// Workers register with `Authorization: Bearer <worker_token>` (then each uses the
    /// credential it was given).
    pub worker_token: String,
    /// A lease lasts this long unless a heartbeat or event batch renews it.
    pub lease_seconds: f64,
    /// How often workers heartbeat (sent to them on registration).
    pub heartbeat_seconds: f64,
    /// How often the reaper looks for expired leases.
    pub reap_interval: Duration,
    /// Open SSE streams at most; more get 503.
    pub max_sse_connections: usize,
    /// Open SSE streams one account may hold; more get 429.
    pub max_sse_per_account: usize,
    /// Body limit of user requests and most worker requests.
    pub max_body_bytes: usize,
    /// Body limit of worker event batches.
    pub max_event_batch_bytes: usize,
    /// The largest trained model a worker may hand over (model.safetensors).
    pub max_model_bytes: usize,
    /// The largest text `POST /api/datasets` takes.
    pub max_dataset_bytes: usize,
    /// Requests (other than SSE streams) taking longer are answered 408.
    pub request_timeout: Duration,
    /// How long a connection has to send a request's headers, and may stay idle between
    /// requests, before it is closed.
    pub header_timeout: Duration,
    /// What one experiment may ask for.
    pub limits: Limits,
    /// An attempt running longer than this is stopped and failed (None: no limit).
    pub max_run: Option<Duration>,
    /// How the server knows who is asking (one local user, or accounts with sign-in).
    pub auth: AuthMode,
    /// How failed sign-ins are throttled.
    pub sign_in: sign_in_guard::SignInPolicy,
    /// The reverse proxy (its address) whose `X-Forwarded-For` and `X-Forwarded-Proto` are
    /// believed: the client's address for throttling, and HTTPS for `Secure` cookies.
    pub trusted_proxy: Option<IpAddr>,
    /// A worker credential not used for this long no longer works (the worker registers
    /// again, and gets a new one).
    pub worker_credential_idle: Duration,
    /// Queued experiments one person may have; more get 429.
    pub max_queued_per_user: usize,
    /// Experiments of one person that run at once (None: no limit); the rest wait.
    pub max_running_per_user: Option<usize>,
    /// Bytes of disk one person's experiments and datasets may take (None: no limit), as
    /// `disk_quota` counts them; more get 507.
    pub max_disk_per_user: Option<u64>,
    /// Whether a run with more ranks than the worker that asks for work may be placed on
    /// it and idle workers together (each announces the ranks it runs: `--ranks`).
    pub allow_multi_host: bool,
    /// How long the workers of a run placed on several have to take their parts; after
    /// that the run goes back to the queue and they are free again.
    pub gang_timeout: Duration,
}

impl Default for ServerConfig {
    fn default() -> Self {
        Self {
            addr: SocketAddr::from((Ipv4Addr::LOCALHOST, 8080)),
            data_dir: PathBuf::from("./data"),
            database_url: None,
            static_dir: PathBuf::from("target/site"),
            local_workers: 1,
            worker_bin: None,
            worker_token: random_token(),
            lease_seconds: 30.0,
            heartbeat_seconds: 5.0,
            reap_interval: Duration::from_secs(1),
            max_sse_connections: 1024,
            max_sse_per_account: 32,
            max_body_bytes: 1 << 20,
            max_event_batch_bytes: 16 << 20,
            max_model_bytes: 256 << 20,
            max_dataset_bytes: distlab_common::MAX_DATASET_BYTES,
            request_timeout: Duration::from_secs(30),
            header_timeout: Duration::from_secs(10),
            limits: Limits::default(),
            max_run: None,
            auth: AuthMode::None,
            sign_in: sign_in_guard::SignInPolicy::default(),
            trusted_proxy: None,
            worker_credential_idle: Duration::from_secs(24 * 3600),
            max_queued_per_user: 20,
            max_running_per_user: None,
            max_disk_per_user: None,
            allow_multi_host: true,
            gang_timeout: Duration::from_secs(30),
        }
    }
}

impl ServerConfig {
    /// Where the database is.
    pub fn database(&self) -> Location<'_> {
        match &self.database_url {
            Some(url) => Location::Postgres(url),
            None => Location::DataDir(&self.data_dir),
        }
    }

    pub fn lease_duration(&self) -> Duration {
        Duration::from_secs_f64(self.lease_seconds)
    }

    /// A worker counts as alive when seen within 3 heartbeat intervals, and at least 30 s.
    pub fn worker_alive_window(&self) -> Duration {
        Duration::from_secs_f64((3.0 * self.heartbeat_seconds).max(30.0))
    }

    pub fn validate(&self) -> Result<(), ServeError> {
        let bad = |msg: String| Err(ServeError::Config(msg));
        if self.worker_token.is_empty() {
            return bad("the worker token must not be empty".into());
        }
        if !(self.lease_seconds.is_finite() && self.lease_seconds > 0.0 && self.lease_seconds <= 86_400.0) {
            return bad(format!("--lease-seconds must be above 0 and at most a day (it is {})", self.lease_seconds));
        }
        if !(self.heartbeat_seconds.is_finite()
            && self.heartbeat_seconds > 0.0
            && self.heartbeat_seconds < self.lease_seconds)
        {
            return bad(format!(
                "--heartbeat-seconds must be above 0 and shorter than --lease-seconds ({} vs {})",
                self.heartbeat_seconds, self.lease_seconds
            ));
        }
        if self.auth == AuthMode::None && !self.addr.ip().is_loopback() {
            return bad(format!(
                "--auth none lets anyone who reaches the server do anything, so it only listens on a loopback \
                 address (127.0.0.1 or ::1), not {}; to serve a class, start it with --auth accounts and create \
                 accounts with `distlab-server user add NAME`",
                self.addr.ip()
            ));
        }
        if self.max_queued_per_user == 0 || self.max_running_per_user == Some(0) {
            return bad("the per-person limits must be at least 1".into());
        }
        if self.gang_timeout.is_zero() || self.gang_timeout > Duration::from_secs(600) {
            return bad(format!(
                "--gang-timeout-seconds must be between 1 and 600 (it is {})",
                self.gang_timeout.as_secs()
            ));
        }
        if self.max_sse_connections == 0 || self.max_sse_per_account == 0 {
            return bad("the live-stream limits must be at least 1".into());
        }
        Ok(())
    }
}

#[derive(Debug, thiserror::Error)]
pub enum ServeError {
    #[error("invalid configuration: {0}")]
    Config(String),
    #[error(transparent)]
    Db(#[from] DbError),
    #[error("cannot listen on {addr}: {source}")]
    Bind { addr: SocketAddr, source: std::io::Error },
    #[error("server error: {0}")]
    Io(#[from] std::io::Error),
}
