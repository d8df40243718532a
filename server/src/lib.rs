//! distlab's HTTP server: the REST API, live streams (SSE), the experiment queue that
//! workers lease from, and the static browser app. README.md lists the API.
//!
//! - [`app`] builds the router for a given [`AppState`] (tests drive it with `oneshot`).
//! - [`serve`] opens the database, binds, prints `distlab is ready at http://ADDR/`,
//!   starts the lease reaper and the local workers, and serves until ctrl-c / SIGTERM.

pub mod accounts;
pub mod cards;
pub mod claims;
pub mod clock;
pub mod compare;
pub mod datasets;
pub mod db;
pub mod disk_quota;
pub mod error;
pub mod experiments;
pub mod extract;
pub mod fanout;
pub mod health;
pub mod listen;
pub mod local_workers;
pub mod memory;
pub mod metrics;
pub mod models;
pub mod openapi;
pub mod parts;
pub mod placement;
pub mod plan;
pub mod queue;
pub mod quiz;
pub mod review;
pub mod review_settings;
pub mod sampling;
pub mod session;
pub mod sign_in_guard;
pub mod static_files;
pub mod stream;
pub mod traces;
pub mod workers;

use std::io::Write;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, SystemTime};

use axum::body::Body;
use axum::http::{Request, Response, StatusCode};
use axum::{middleware, Extension, Router};
use distlab_common::{AuthMode, Limits};
use rand::Rng;
use tower_http::catch_panic::CatchPanicLayer;
use tower_http::compression::predicate::{DefaultPredicate, NotForContentType, Predicate};
use tower_http::compression::CompressionLayer;
use tower_http::limit::RequestBodyLimitLayer;
use tower_http::timeout::TimeoutLayer;
use tower_http::trace::TraceLayer;
use tracing::{Level, Span};
use utoipa::OpenApi;
use utoipa_axum::router::{OpenApiRouter, UtoipaMethodRouterExt};
use utoipa_axum::routes;

use crate::db::Db;
use crate::extract::BodyLimit;
use crate::local_workers::LocalWorkers;
use crate::stream::Hub;

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
    pub fn database(&self) -> db::Location<'_> {
        match &self.database_url {
            Some(url) => db::Location::Postgres(url),
            None => db::Location::DataDir(&self.data_dir),
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

/// A secret from environment variable `var`, else from the first line of `file`; None when
/// neither gives one. Secrets never come from the command line, which `ps` shows everyone.
pub fn secret_from(var: &str, file: Option<&std::path::Path>) -> std::io::Result<Option<String>> {
    if let Some(value) = std::env::var(var).ok().filter(|v| !v.trim().is_empty()) {
        return Ok(Some(value.trim().to_string()));
    }
    let Some(file) = file else { return Ok(None) };
    let text = std::fs::read_to_string(file)
        .map_err(|e| std::io::Error::new(e.kind(), format!("cannot read the token file {}: {e}", file.display())))?;
    Ok(text.lines().next().map(str::trim).filter(|t| !t.is_empty()).map(str::to_string))
}

/// `bytes` random bytes as hex.
pub fn random_hex(bytes: usize) -> String {
    let mut rng = rand::rng();
    (0..bytes).map(|_| format!("{:02x}", rng.random::<u8>())).collect()
}

/// A random 32-character token (for local workers when none is configured).
pub fn random_token() -> String {
    const CHARS: &[u8] = b"abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789";
    let mut rng = rand::rng();
    (0..32).map(|_| CHARS[rng.random_range(0..CHARS.len())] as char).collect()
}

#[derive(Debug, thiserror::Error)]
pub enum ServeError {
    #[error("invalid configuration: {0}")]
    Config(String),
    #[error(transparent)]
    Db(#[from] db::DbError),
    #[error("cannot listen on {addr}: {source}")]
    Bind { addr: SocketAddr, source: std::io::Error },
    #[error("server error: {0}")]
    Io(#[from] std::io::Error),
}

/// What every handler shares.
#[derive(Clone)]
pub struct AppState {
    pub db: Db,
    pub config: Arc<ServerConfig>,
    pub hub: Arc<Hub>,
    /// What `GET /metrics` reports (request counts and latencies accumulate here).
    pub metrics: Arc<metrics::ServerMetrics>,
    /// Held while this server decides a lease: its leases queue here rather than on the
    /// database's write lock (SQLite's busy waits sleep up to 100 ms at a time).
    pub leasing: Arc<tokio::sync::Mutex<()>>,
    /// Sign-in's queue and its failed-attempt counts.
    pub sign_in: Arc<sign_in_guard::SignInGuard>,
    /// The database's own id (`db::store_id`): checkpoint directories carry it.
    pub store_id: Arc<str>,
}

impl AppState {
    /// Opens the database (`config.database_url`, else the one in `config.data_dir`),
    /// applying the migrations, and removes what a killed server left half-written.
    pub async fn new(config: ServerConfig) -> Result<Self, ServeError> {
        let db = db::open(config.database()).await?;
        datasets::remove_half_written(&config.data_dir);
        let store_id = db::store_id(&db)
            .await
            .map_err(|source| db::DbError::Open { place: "the database's id".into(), source })?;
        let state = Self::with_db(db, config, &store_id);
        // Servers sharing a Postgres database share their live events.
        if let Some(url) = state.config.database_url.clone() {
            fanout::start(&state, &url)
                .await
                .map_err(|source| db::DbError::Open { place: db::without_password(&url), source })?;
        }
        Ok(state)
    }

    pub fn with_db(db: Db, config: ServerConfig, store_id: &str) -> Self {
        let hub = Arc::new(Hub::new(config.max_sse_connections, config.max_sse_per_account));
        let sign_in = Arc::new(sign_in_guard::SignInGuard::new(config.sign_in));
        Self {
            db,
            config: Arc::new(config),
            hub,
            metrics: Arc::new(metrics::ServerMetrics::default()),
            leasing: Arc::new(tokio::sync::Mutex::new(())),
            sign_in,
            store_id: Arc::from(store_id),
        }
    }

    /// Where the server's local workers keep experiment `id`'s checkpoints.
    pub fn checkpoint_dir(&self, id: i64) -> PathBuf {
        let name = distlab_common::elastic::checkpoint_dir_name(Some(&self.store_id), id);
        self.config.data_dir.join("checkpoints").join(name)
    }

    /// Re-queues (or fails) running experiments whose lease ended before `now`, and fails
    /// those running longer than `max_run`.
    pub async fn reap_expired(&self, now: SystemTime) -> Result<Vec<queue::Reaped>, sqlx::Error> {
        if let Some(max) = self.config.max_run {
            queue::end_overdue(&self.db, &self.hub, max, now).await?;
        }
        parts::release_unformed(&self.db, &self.hub, self.config.gang_timeout, now).await?;
        queue::reap_expired(&self.db, &self.hub, now).await
    }
}

/// The whole HTTP app: /api (JSON), /api/experiments/{id}/stream (SSE), /metrics
/// (Prometheus), /api/openapi.json (every route of the first three), and the frontend.
pub fn app(state: AppState) -> Router {
    let config = state.config.clone();
    let (routes, doc) = api_routes(&state).split_for_parts();
    let doc = openapi::Document(Arc::new(serde_json::to_string(&doc).expect("the OpenAPI document is JSON")));
    let routes = routes.layer(Extension(doc));

    let largest_body =
        [config.max_body_bytes, config.max_event_batch_bytes, config.max_model_bytes, config.max_dataset_bytes]
            .into_iter()
            .max()
            .unwrap_or(config.max_body_bytes);
    let routes = routes
        .merge(static_files::router(&config.static_dir))
        // Counted with the route each request matched (set by the routing, inside).
        .layer(middleware::from_fn_with_state(state.clone(), metrics::record))
        .layer(RequestBodyLimitLayer::new(largest_body))
        .layer(middleware::from_fn(error::same_origin))
        .layer(middleware::from_fn(error::json_errors))
        // A panic in a handler is a bug; the client still gets the JSON 500 and the
        // connection stays up.
        .layer(CatchPanicLayer::custom(error::panic_response))
        // Skips SSE (text/event-stream), images, tiny bodies and model downloads (binary
        // floats barely compress, and the file is streamed as it is read).
        .layer(
            CompressionLayer::new()
                .compress_when(DefaultPredicate::new().and(NotForContentType::const_new("application/octet-stream"))),
        )
        // Every response is logged with its status (`log_response`), an internal error's cause
        // by `HttpError::internal`: tower-http's own ERROR line for each 5xx would turn a
        // sign-in flood's 503s into a flood of ERROR lines.
        .layer(
            TraceLayer::new_for_http()
                .make_span_with(request_span)
                .on_request(())
                .on_response(log_response)
                .on_failure(()),
        );
    let routes = match config.auth {
        AuthMode::None => routes.layer(middleware::from_fn(error::loopback_names_only)),
        AuthMode::Accounts => routes,
    };
    routes.with_state(state)
}

/// Every route but the frontend's files, each registered with its OpenAPI entry.
fn api_routes(state: &AppState) -> OpenApiRouter<AppState> {
    let config = &state.config;
    let worker_credential = || middleware::from_fn_with_state(state.clone(), workers::require_credential);
    let worker_api = OpenApiRouter::new()
        .routes(routes!(workers::lease))
        .routes(routes!(workers::heartbeat))
        .routes(routes!(workers::events).layer(Extension(BodyLimit(config.max_event_batch_bytes))))
        .routes(routes!(workers::complete))
        .routes(routes!(workers::fail))
        .routes(routes!(workers::rendezvous))
        .routes(routes!(datasets::text))
        .route_layer(worker_credential())
        .routes(
            routes!(workers::register).layer(middleware::from_fn_with_state(state.clone(), workers::require_token)),
        );

    // Everything a person does: `identify` puts the caller on the request (401 without a
    // session when the server has accounts).
    let identify = || middleware::from_fn_with_state(state.clone(), session::identify);
    let user_api = OpenApiRouter::new()
        .routes(routes!(session::who))
        .routes(routes!(session::change_password))
        .routes(routes!(session::list_users, session::create_user))
        .routes(routes!(session::reset_password))
        .routes(routes!(session::unlock))
        .routes(routes!(experiments::list, experiments::create))
        .routes(routes!(experiments::get_one, experiments::delete))
        .routes(routes!(experiments::metrics))
        .routes(routes!(experiments::attempts))
        .routes(routes!(traces::trace))
        .routes(routes!(memory::memory))
        .routes(routes!(experiments::cancel))
        .routes(routes!(models::download))
        .routes(routes!(models::config))
        .routes(routes!(sampling::generate))
        .routes(routes!(plan::plan))
        .routes(routes!(plan::layouts))
        .routes(routes!(cards::cards))
        .routes(routes!(claims::checks))
        .routes(routes!(review::list_profiles, review::create_profile))
        .routes(routes!(review::review_view))
        .routes(routes!(review::review))
        .routes(routes!(review_settings::settings, review_settings::update))
        .routes(routes!(review_settings::fit_parameters))
        .routes(routes!(review::export))
        .routes(routes!(review::import).layer(Extension(BodyLimit(review::MAX_IMPORT_BYTES))))
        .routes(routes!(compare::compare))
        .routes(routes!(quiz::list))
        .routes(routes!(quiz::answer))
        .routes(routes!(quiz::results))
        .routes(routes!(datasets::list, datasets::upload))
        .routes(routes!(datasets::delete))
        .route_layer(identify());

    let api = OpenApiRouter::new()
        .routes(routes!(health::health))
        .routes(routes!(session::sign_in, session::sign_out))
        .routes(routes!(openapi::document))
        .merge(user_api)
        .nest("/workers", worker_api)
        .layer(TimeoutLayer::with_status_code(StatusCode::REQUEST_TIMEOUT, config.request_timeout))
        // Added after the timeout layer, so that long-lived streams and large model uploads
        // are not cut.
        .routes(routes!(stream::stream).layer(identify()))
        .routes(routes!(models::upload).layer(worker_credential()))
        .fallback(error::api_not_found);

    OpenApiRouter::with_openapi(openapi::ApiDoc::openapi())
        .nest("/api", api)
        .routes(routes!(metrics::metrics).layer(middleware::from_fn_with_state(state.clone(), metrics::require_reader)))
}

/// Worker polling is frequent: its requests are logged at debug, everything else at info.
fn request_span(req: &Request<Body>) -> Span {
    if req.uri().path().starts_with("/api/workers/") {
        tracing::debug_span!("request", method = %req.method(), path = %req.uri().path())
    } else {
        tracing::info_span!("request", method = %req.method(), path = %req.uri().path())
    }
}

fn log_response<B>(res: &Response<B>, latency: Duration, span: &Span) {
    let quiet = span.metadata().is_none_or(|m| *m.level() > Level::INFO);
    let ms = latency.as_secs_f64() * 1e3;
    if quiet {
        tracing::debug!(status = res.status().as_u16(), ms, "response");
    } else {
        tracing::info!(status = res.status().as_u16(), ms, "response");
    }
}

/// The URL a browser or local worker on this machine uses for a bound address.
pub fn local_url(addr: SocketAddr) -> String {
    let ip = match addr.ip() {
        IpAddr::V4(ip) if ip.is_unspecified() => IpAddr::V4(Ipv4Addr::LOCALHOST),
        IpAddr::V6(ip) if ip.is_unspecified() => IpAddr::V6(Ipv6Addr::LOCALHOST),
        ip => ip,
    };
    format!("http://{}/", SocketAddr::new(ip, addr.port()))
}

/// Runs the server until ctrl-c or SIGTERM: opens the database, binds `config.addr`, prints
/// `distlab is ready at http://ADDR/` on stdout, starts the reaper and the local workers, and
/// stops the workers on the way out.
pub async fn serve(config: ServerConfig) -> Result<(), ServeError> {
    config.validate()?;
    cards::deck().map_err(ServeError::Config)?;
    quiz::quiz().map_err(ServeError::Config)?;
    let state = AppState::new(config.clone()).await?;
    if config.auth == AuthMode::Accounts && accounts::list(&state.db).await.is_ok_and(|users| users.is_empty()) {
        tracing::warn!(
            "--auth accounts, but there are no accounts yet: create one with `distlab-server user add NAME --admin` \
             (same --data-dir)"
        );
    }
    let descriptors = listen::raise_descriptor_limit();
    let limits = listen::ConnectionLimits::for_descriptors(descriptors, config.header_timeout);
    tracing::info!(descriptors, max_connections = limits.max_connections, "connection limits");
    let listener = tokio::net::TcpListener::bind(config.addr)
        .await
        .map_err(|source| ServeError::Bind { addr: config.addr, source })?;
    let bound = listener.local_addr()?;
    let url = local_url(bound);
    {
        let mut out = std::io::stdout().lock();
        writeln!(out, "distlab is ready at {url}")?;
        if bound.ip().is_unspecified() {
            writeln!(out, "(listening on {bound}: every network interface)")?;
        }
        out.flush()?;
    }
    tracing::info!(%bound, data_dir = %config.data_dir.display(), static_dir = %config.static_dir.display(), "serving");

    let reaper = tokio::spawn(reap_forever(state.clone()));
    let worker_bin = config.worker_bin.clone().or_else(local_workers::default_worker_bin);
    let workers = match worker_bin {
        Some(bin) => {
            let server = url.trim_end_matches('/');
            LocalWorkers::spawn(&bin, config.local_workers, server, &config.worker_token, &config.data_dir)
        }
        None if config.local_workers > 0 => {
            tracing::error!("cannot find the worker executable; pass --worker-bin");
            LocalWorkers::none()
        }
        None => LocalWorkers::none(),
    };

    let (stopping_tx, mut stopping_rx) = tokio::sync::watch::channel(false);
    let hub = state.hub.clone();
    let server = listen::serve(listener, app(state), limits, async move {
        shutdown_signal().await;
        tracing::info!("shutting down");
        hub.shut_down();
        stopping_tx.send_replace(true);
    });
    // Open requests get a few seconds to finish after the signal.
    let deadline = async move {
        let _ = stopping_rx.wait_for(|s| *s).await;
        tokio::time::sleep(Duration::from_secs(5)).await;
    };
    tokio::select! {
        () = server => {}
        _ = deadline => tracing::warn!("requests still open after 5 s; stopping anyway"),
    };
    reaper.abort();
    workers.stop().await;
    Ok(())
}

async fn reap_forever(state: AppState) {
    let mut tick = tokio::time::interval(state.config.reap_interval);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tick.tick().await;
        if let Err(e) = state.reap_expired(SystemTime::now()).await {
            tracing::error!("lease reaper: {e}");
        }
    }
}

async fn shutdown_signal() {
    let ctrl_c = async {
        if let Err(e) = tokio::signal::ctrl_c().await {
            tracing::error!("cannot listen for ctrl-c: {e}");
            std::future::pending::<()>().await;
        }
    };
    #[cfg(unix)]
    let terminate = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut s) => {
                s.recv().await;
            }
            Err(e) => {
                tracing::error!("cannot listen for SIGTERM: {e}");
                std::future::pending::<()>().await;
            }
        }
    };
    #[cfg(not(unix))]
    let terminate = std::future::pending::<()>();
    tokio::select! {
        _ = ctrl_c => {}
        _ = terminate => {}
    }
}
