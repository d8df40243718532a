//! What every handler shares ([`AppState`]): the store, the configuration, the live hub,
//! the metrics, the sign-in guard, the frequent reads' answers (`read_cache.rs`); and the reaper's step, which ends the runs whose workers
//! went silent and streams what changed.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::SystemTime;

use distlab_common::{ExperimentStatus, StatusChange};

use crate::config::{ServeError, ServerConfig};
use crate::live::fanout;
use crate::live::hub::Hub;
use crate::metrics_registry::ServerMetrics;
use crate::read_cache::{KeptJson, ReadCache};
use crate::sign_in_guard;
use crate::store::accounts::Account;
use crate::store::parts::{self, Released};
use crate::store::queue::{self, Reaped};
use crate::store::{self, Db, DbError, StoreError};

/// What every handler shares.
#[derive(Clone)]
pub struct AppState {
    pub db: Db,
    pub config: Arc<ServerConfig>,
    pub hub: Arc<Hub>,
    /// What `GET /metrics` reports (request counts and latencies accumulate here).
    pub metrics: Arc<ServerMetrics>,
    /// Held while this server decides a lease: its leases queue here rather than on the
    /// database's write lock (SQLite's busy waits sleep up to 100 ms at a time).
    pub leasing: Arc<tokio::sync::Mutex<()>>,
    /// Sign-in's queue and its failed-attempt counts.
    pub sign_in: Arc<sign_in_guard::SignInGuard>,
    /// The database's own id (`store::store_id`): checkpoint directories carry it.
    pub store_id: Arc<str>,
    /// Pages of the experiment list as sent (JSON), by (status, limit, offset).
    pub experiment_pages: Arc<ReadCache<ExperimentPage, KeptJson>>,
    /// Who holds each session token asked about lately.
    pub sessions: Arc<ReadCache<String, Account>>,
}

/// A page of the experiment list: (status, limit, offset).
pub type ExperimentPage = (Option<&'static str>, i64, i64);

/// Pages of the experiment list kept at once (a class polls a few).
const KEPT_PAGES: usize = 16;
/// Sessions kept at once (a class's browsers, many times over).
const KEPT_SESSIONS: usize = 1024;

impl AppState {
    /// Opens the database (`config.database_url`, else the one in `config.data_dir`),
    /// applying the migrations, and removes what a killed server left half-written.
    pub async fn new(config: ServerConfig) -> Result<Self, ServeError> {
        let db = store::open(config.database()).await?;
        store::datasets::remove_half_written(&config.data_dir);
        let store_id =
            store::store_id(&db).await.map_err(|source| DbError::Open { place: "the database's id".into(), source })?;
        let state = Self::with_db(db, config, &store_id);
        // Servers sharing a Postgres database share their live events.
        if let Some(url) = state.config.database_url.clone() {
            fanout::start(&state.hub, &state.db, &url)
                .await
                .map_err(|source| DbError::Open { place: store::without_password(&url), source })?;
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
            metrics: Arc::new(ServerMetrics::default()),
            leasing: Arc::new(tokio::sync::Mutex::new(())),
            sign_in,
            store_id: Arc::from(store_id),
            experiment_pages: Arc::new(ReadCache::new(KEPT_PAGES)),
            sessions: Arc::new(ReadCache::new(KEPT_SESSIONS)),
        }
    }

    /// Where the server's local workers keep experiment `id`'s checkpoints.
    pub fn checkpoint_dir(&self, id: i64) -> PathBuf {
        let name = distlab_common::elastic::checkpoint_dir_name(Some(&self.store_id), id);
        self.config.data_dir.join("checkpoints").join(name)
    }

    /// Re-queues (or fails) running experiments whose lease ended before `now`, and fails
    /// those running longer than `max_run`; each change is logged and streamed.
    pub async fn reap_expired(&self, now: SystemTime) -> Result<Vec<Reaped>, StoreError> {
        if let Some(max) = self.config.max_run {
            for (id, change) in queue::end_overdue(&self.db, max, now).await? {
                if let Some(error) = &change.error {
                    tracing::warn!(experiment = id, "{error}");
                }
                self.hub.status_changed(id, change);
            }
        }
        for released in parts::release_unformed(&self.db, self.config.gang_timeout, now).await? {
            let Released { id, attempt, message } = released;
            tracing::warn!(experiment = id, attempt, "{message}");
            self.hub.status_changed(id, StatusChange { status: ExperimentStatus::Queued, error: None, summary: None });
        }
        let reaped = queue::reap_expired(&self.db, now).await?;
        for r in &reaped {
            let status = r.status();
            tracing::warn!(
                experiment = r.id,
                attempt = r.attempt,
                status = status.as_str(),
                "lease expired: the worker stopped responding"
            );
            self.hub.status_changed(r.id, StatusChange { status, error: r.error.clone(), summary: None });
        }
        Ok(reaped)
    }
}
