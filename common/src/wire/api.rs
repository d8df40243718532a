//! Request and response bodies of the HTTP API (docs/api.md).

use serde::{Deserialize, Serialize};

use crate::spec::field_error::FieldError;
use crate::spec::{BackendKind, ExperimentSpec};
use crate::wire::events::*;

/// Every error response: `{"error": "...", "fields": [{"field", "message"}]}`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct ApiError {
    pub error: String,
    #[serde(default)]
    pub fields: Vec<FieldError>,
}

/// `GET /api/health`
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct Health {
    pub status: String,
    pub version: String,
    /// Workers that sent a heartbeat or lease request recently.
    pub workers: u64,
    pub queued: u64,
}

// ---- accounts (`distlab-server --auth accounts`) ----

/// How a server knows who is asking.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(rename_all = "lowercase")]
pub enum AuthMode {
    /// One user, no sign-in (only on a loopback address).
    #[default]
    None,
    /// Everyone signs in; experiments and flashcard profiles belong to accounts.
    Accounts,
}

/// `POST /api/session`
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct SignIn {
    pub name: String,
    pub password: String,
}

/// `GET /api/me`, and the answer to a sign-in.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct Me {
    pub name: String,
    pub admin: bool,
    pub auth: AuthMode,
}

/// `POST /api/users` (admins)
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct NewAccount {
    pub name: String,
    pub password: String,
    #[serde(default)]
    pub admin: bool,
}

/// `PUT /api/me/password`: a person changes their own password.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct ChangePassword {
    /// The password now (asked again: a session left open is not enough).
    pub current: String,
    pub new: String,
}

/// `PUT /api/users/{name}/password` (admins)
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct NewPassword {
    pub password: String,
}

/// One account, as `GET /api/users` lists it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct AccountView {
    pub name: String,
    pub admin: bool,
}

/// `GET /api/users`
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct AccountList {
    pub users: Vec<AccountView>,
}

/// `POST /api/experiments` -> 201
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct Created {
    pub id: i64,
    pub status: ExperimentStatus,
}

/// The largest text `POST /api/datasets` takes by default (a server setting).
pub const MAX_DATASET_BYTES: usize = 16 << 20;

/// An uploaded text (`POST /api/datasets` -> 201, and the items of `GET /api/datasets`):
/// what a spec names with `data.dataset: "upload"` and `data.upload_id`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct DatasetView {
    pub id: i64,
    pub name: String,
    pub owner: String,
    pub bytes: u64,
    /// The longest sequence it can train with: a window of seq_len + 1 bytes on each side
    /// of its split (`text_split`).
    pub max_seq_len: u64,
    pub created_at: String,
}

#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct DatasetList {
    pub datasets: Vec<DatasetView>,
}

/// `GET /api/experiments/{id}` and the items of the list.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct ExperimentView {
    pub id: i64,
    pub name: String,
    /// Who submitted it (an account's name; "local" in the single-user mode): everyone may
    /// read it, only its owner or an admin may cancel or delete it.
    #[serde(default)]
    pub owner: String,
    pub status: ExperimentStatus,
    pub spec: ExperimentSpec,
    pub created_at: String,
    pub started_at: Option<String>,
    pub finished_at: Option<String>,
    pub error: Option<String>,
    pub summary: Option<RunSummary>,
    /// How many times a worker has leased it (1 on the first run).
    pub attempt: i64,
    /// One past the last optimizer step reported (a run resumed from another experiment's
    /// checkpoint starts at its step).
    pub steps_done: u64,
}

/// `GET /api/experiments?status=&limit=&offset=`
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct ExperimentList {
    pub experiments: Vec<ExperimentView>,
    /// All experiments matching the filter (for paging).
    pub total: u64,
}

/// One lease of an experiment by a worker (`GET /api/experiments/{id}/attempts`).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct AttemptView {
    /// 1 for the first lease.
    pub attempt: i64,
    /// The worker's name (None if it is gone from the server's records).
    pub worker: Option<String>,
    pub started_at: String,
    /// Where the attempt began: 0, or the step of the checkpoint it resumed from (None
    /// until the worker has said).
    pub from_step: Option<u64>,
    /// Steps an earlier attempt had already run from `from_step` on: work done twice.
    pub lost_steps: u64,
}

/// `GET /api/experiments/{id}/attempts`, oldest first.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct Attempts {
    pub attempts: Vec<AttemptView>,
}

/// `GET /api/experiments/{id}/metrics`
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct Metrics {
    pub steps: Vec<MetricPoint>,
}

// ---- worker protocol ----
// `register` carries `Authorization: Bearer <worker token>` (shared by the server's
// workers); everything after it the worker's own credential from `Registered`.

/// `POST /api/workers/register`
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct RegisterWorker {
    pub name: String,
    pub backends: Vec<BackendKind>,
    /// Human-readable devices, e.g. "cpu: 2 cores".
    pub devices: Vec<String>,
    pub version: String,
    /// What the worker's machine has (None from a worker that does not say): the server
    /// refuses a spec whose ranks need more memory than the largest live worker has.
    #[serde(default)]
    pub capacity: Option<WorkerCapacity>,
    /// The most ranks it runs at once (`distlab-worker --ranks`; None: as many as a run
    /// has). A run with more ranks than any one worker hosts is placed on several.
    #[serde(default)]
    pub ranks: Option<u32>,
}

/// A worker's machine, as it reports it when it registers.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct WorkerCapacity {
    /// Physical memory (Linux `MemTotal`).
    pub memory_bytes: u64,
    pub cores: u32,
    pub gpus: u32,
    /// The memory of its smallest GPU (0 without GPUs).
    #[serde(default)]
    pub gpu_memory_bytes: u64,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct Registered {
    pub worker_id: i64,
    /// This worker's own secret: every later request carries it as
    /// `Authorization: Bearer <credential>`, and it speaks for this `worker_id` only.
    pub credential: String,
    /// How often the worker must heartbeat a leased experiment.
    pub heartbeat_interval_s: f64,
}

/// `POST /api/workers/lease` -> 200 `Lease` or 204 when the queue is empty.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct LeaseRequest {
    pub worker_id: i64,
    /// How often this worker asks while it has nothing to run: it counts as idle, and can
    /// be given part of a run across workers, for a few of these intervals after asking.
    #[serde(default)]
    pub poll_interval_s: Option<f64>,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct Lease {
    pub experiment_id: i64,
    pub spec: ExperimentSpec,
    pub attempt: i64,
    /// The lease ends this many seconds from now unless a heartbeat renews it.
    pub lease_s: f64,
    /// Set when the run spans several workers: which of its ranks this worker runs.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub placement: Option<Placement>,
    /// The server has the metric points of steps 0 up to (not including) this one: the
    /// attempt resumes from a checkpoint no later, so that no step is left without its point.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub stored_steps: Option<u64>,
    /// The server database's own id: the experiment's checkpoint directory carries it
    /// (`elastic::checkpoint_dir_name`), so that another database's experiment of the same
    /// number never resumes from it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub store: Option<String>,
}

/// A run placed on several workers (hosts): each runs a block of consecutive ranks, host 0
/// from rank 0. Host 0's worker reports the run's metrics and how it ended; every host
/// sends its ranks' traces and logs, and heartbeats until the run has ended.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct Placement {
    /// This worker's host.
    pub host: usize,
    /// How many ranks each host runs, host 0 first; they add up to the world size.
    pub ranks_per_host: Vec<usize>,
    /// The secret every connection between the run's ranks proves (32 hex digits).
    pub secret: String,
}

impl Placement {
    /// Every rank's host.
    pub fn host_of_each_rank(&self) -> Vec<usize> {
        self.ranks_per_host.iter().enumerate().flat_map(|(host, &n)| std::iter::repeat_n(host, n)).collect()
    }

    /// The ranks this worker runs.
    pub fn ranks(&self) -> std::ops::Range<usize> {
        let first: usize = self.ranks_per_host.iter().take(self.host).sum();
        first..first + self.ranks_per_host.get(self.host).copied().unwrap_or(0)
    }

    pub fn world_size(&self) -> usize {
        self.ranks_per_host.iter().sum()
    }
}

/// `POST /api/workers/rendezvous`: what the hosts of a run tell each other while it starts
/// (like torchrun's store): this worker publishes its entries (its ranks' addresses, ...)
/// and is answered every entry of the attempt so far. Only the attempt's hosts may ask.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct RendezvousRequest {
    pub worker_id: i64,
    pub experiment_id: i64,
    pub attempt: i64,
    #[serde(default)]
    pub publish: Vec<RendezvousEntry>,
}

/// One name and its value in a run's rendezvous (names and values are short text).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct RendezvousEntry {
    pub name: String,
    pub value: String,
}

/// The longest rendezvous name and value, and the most entries one attempt keeps.
pub const MAX_RENDEZVOUS_NAME: usize = 64;
pub const MAX_RENDEZVOUS_VALUE: usize = 1024;
pub const MAX_RENDEZVOUS_ENTRIES: usize = 4096;

/// Answer to `POST /api/workers/rendezvous`.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct RendezvousState {
    pub entries: Vec<RendezvousEntry>,
    /// The run's hosts, and how many of their workers have taken their part so far.
    pub hosts: usize,
    pub joined: usize,
}

/// `POST /api/workers/heartbeat`
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct Heartbeat {
    pub worker_id: i64,
    pub experiment_id: Option<i64>,
}

/// Answer to heartbeats and event batches: `cancel` tells the worker to stop the run.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct WorkerAck {
    pub cancel: bool,
}

/// `POST /api/workers/events`
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct EventBatch {
    pub worker_id: i64,
    pub experiment_id: i64,
    pub events: Vec<RunEvent>,
}

/// `POST /api/workers/complete`
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct Complete {
    pub worker_id: i64,
    pub experiment_id: i64,
    pub summary: RunSummary,
}

/// `POST /api/workers/fail`
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct Fail {
    pub worker_id: i64,
    pub experiment_id: i64,
    /// The attempt this report is about (None from a worker that does not say): a report
    /// about an attempt that has already ended changes nothing.
    #[serde(default)]
    pub attempt: Option<i64>,
    pub error: String,
    /// True when the worker stopped because the experiment was cancelled.
    #[serde(default)]
    pub cancelled: bool,
    /// True when this worker's ranks failed because another host of the run went away (its
    /// ranks hung up or stopped answering): the run goes back to the queue, as when a
    /// worker's lease expires, unless that host reports an error of its own.
    #[serde(default)]
    pub lost_host: bool,
}

/// The longest prompt `POST /api/experiments/{id}/generate` takes, in tokens (bytes of a
/// text prompt).
pub const MAX_PROMPT_TOKENS: usize = 4096;
/// The most tokens one request generates.
pub const MAX_NEW_TOKENS: usize = 256;

/// `POST /api/experiments/{id}/generate`: continue a prompt with the run's trained model.
/// The prompt is text (for models trained on text: cut into tokens as the run cut its
/// text, one per byte or by its BPE) or token ids.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(deny_unknown_fields)]
pub struct GenerateRequest {
    #[serde(default)]
    pub prompt: Option<String>,
    #[serde(default)]
    pub prompt_tokens: Option<Vec<u32>>,
    #[serde(default = "default_new_tokens")]
    pub max_new_tokens: usize,
    /// 0: greedy (the likeliest token, the first on ties).
    #[serde(default = "default_temperature")]
    pub temperature: f64,
    /// Draw from the k likeliest tokens only (0: all).
    #[serde(default)]
    pub top_k: usize,
    #[serde(default)]
    pub seed: u64,
}

fn default_new_tokens() -> usize {
    64
}

fn default_temperature() -> f64 {
    1.0
}

/// The answer: the new tokens, and as text (decoded by the run's tokenizer, as UTF-8 with
/// replacement characters where the bytes are not; empty for a Markov chain's vocabulary
/// beyond bytes), and how long the sampling took.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct Generated {
    pub text: String,
    pub tokens: Vec<u32>,
    pub ms: f64,
    /// The server's time budget for one request ran out before `max_new_tokens`.
    #[serde(default)]
    pub stopped_early: bool,
}
