//! The worker's side of the worker protocol: plain blocking HTTP calls to the server.

use std::time::Duration;

use distlab_common::*;
use serde::de::DeserializeOwned;
use serde::Serialize;

#[derive(Debug, thiserror::Error)]
pub enum ClientError {
    /// The server could not be reached (connection refused, timeout, ...).
    #[error("cannot reach the server at {url}: {source}")]
    Transport { url: String, source: ureq::Error },
    /// The server answered with an error status.
    #[error("the server answered {status} to {path}: {message}")]
    Status { path: String, status: u16, message: String },
    #[error("the server's answer to {path} was not understood: {message}")]
    Decode { path: String, message: String },
}

impl ClientError {
    /// 409: this worker no longer holds the experiment (cancelled, or re-queued after a lost lease).
    pub fn is_conflict(&self) -> bool {
        matches!(self, ClientError::Status { status: 409, .. })
    }

    /// A failure that may pass if the request is made again: the server unreachable, or an
    /// answer saying it is busy, restarting or failing for now (5xx, 408, 429).
    pub fn is_transient(&self) -> bool {
        match self {
            ClientError::Transport { .. } => true,
            ClientError::Status { status, .. } => *status >= 500 || *status == 408 || *status == 429,
            ClientError::Decode { .. } => false,
        }
    }
}

#[derive(Clone)]
pub struct ServerClient {
    agent: ureq::Agent,
    base: String,
    /// The worker token until the worker has registered, its own credential after.
    secret: String,
}

/// The most a worker reads of one uploaded dataset.
pub const DATASET_READ_LIMIT: u64 = 1 << 30;

impl ServerClient {
    pub fn new(base: &str, token: &str) -> Self {
        let agent: ureq::Agent = ureq::Agent::config_builder()
            .http_status_as_error(false)
            .timeout_global(Some(Duration::from_secs(30)))
            .build()
            .into();
        Self { agent, base: base.trim_end_matches('/').to_string(), secret: token.to_string() }
    }

    /// The same server, spoken to with the credential `register` answered.
    pub fn as_worker(&self, credential: &str) -> Self {
        Self { agent: self.agent.clone(), base: self.base.clone(), secret: credential.to_string() }
    }

    pub fn register(&self, body: &RegisterWorker) -> Result<Registered, ClientError> {
        self.post("/api/workers/register", body)?.ok_or_else(|| no_body("/api/workers/register"))
    }

    /// The next queued experiment for this worker (or its part of a run across workers),
    /// or None when there is nothing for it. `poll_interval` says how often it asks.
    pub fn lease(&self, worker_id: i64, poll_interval: Duration) -> Result<Option<Lease>, ClientError> {
        let request = LeaseRequest { worker_id, poll_interval_s: Some(poll_interval.as_secs_f64()) };
        self.post("/api/workers/lease", &request)
    }

    /// Publishes in a run's rendezvous and reads it (see `rendezvous.rs`).
    pub fn rendezvous(&self, body: &RendezvousRequest) -> Result<RendezvousState, ClientError> {
        self.post("/api/workers/rendezvous", body)?.ok_or_else(|| no_body("/api/workers/rendezvous"))
    }

    pub fn heartbeat(&self, worker_id: i64, experiment_id: Option<i64>) -> Result<WorkerAck, ClientError> {
        Ok(self.post("/api/workers/heartbeat", &Heartbeat { worker_id, experiment_id })?.unwrap_or_default())
    }

    pub fn send_events(&self, batch: &EventBatch) -> Result<WorkerAck, ClientError> {
        Ok(self.post("/api/workers/events", batch)?.unwrap_or_default())
    }

    pub fn complete(&self, body: &Complete) -> Result<(), ClientError> {
        self.post::<_, serde_json::Value>("/api/workers/complete", body).map(drop)
    }

    pub fn fail(&self, body: &Fail) -> Result<(), ClientError> {
        self.post::<_, serde_json::Value>("/api/workers/fail", body).map(drop)
    }

    /// Hands the server a finished run's trained model (model.safetensors), before the
    /// run is reported complete.
    pub fn upload_model(&self, experiment_id: i64, safetensors: &[u8]) -> Result<(), ClientError> {
        self.put_bytes(
            &format!("/api/workers/experiments/{experiment_id}/model"),
            "application/octet-stream",
            safetensors,
        )
    }

    /// Hands the server a BPE run's tokenizer.json, before its model.
    pub fn upload_tokenizer(&self, experiment_id: i64, json: &[u8]) -> Result<(), ClientError> {
        self.put_bytes(&format!("/api/workers/experiments/{experiment_id}/tokenizer"), "application/json", json)
    }

    /// PUTs `body` to `path`. The timeout grows with the size (at least 1 MB/s).
    fn put_bytes(&self, path: &str, content_type: &str, body: &[u8]) -> Result<(), ClientError> {
        let url = format!("{}{}", self.base, path);
        let seconds = 30 + body.len() as u64 / 1_000_000;
        let mut resp = self
            .agent
            .put(&url)
            .config()
            .timeout_global(Some(Duration::from_secs(seconds)))
            .build()
            .header("Authorization", &format!("Bearer {}", self.secret))
            .header("Content-Type", content_type)
            .send(body)
            .map_err(|source| ClientError::Transport { url: url.clone(), source })?;
        let status = resp.status().as_u16();
        if !(200..300).contains(&status) {
            let text = resp.body_mut().read_to_string().unwrap_or_default();
            let message = serde_json::from_str::<ApiError>(&text).map(|e| e.error).unwrap_or(text);
            return Err(ClientError::Status { path: path.to_string(), status, message });
        }
        Ok(())
    }

    /// An uploaded dataset's text (`data.dataset: upload`), for a run this worker holds (at
    /// most [`DATASET_READ_LIMIT`]: the server's own limit decides, this only bounds memory).
    pub fn download_dataset(&self, id: i64) -> Result<Vec<u8>, ClientError> {
        let path = format!("/api/workers/datasets/{id}");
        let url = format!("{}{}", self.base, path);
        let mut resp = self
            .agent
            .get(&url)
            .header("Authorization", &format!("Bearer {}", self.secret))
            .call()
            .map_err(|source| ClientError::Transport { url: url.clone(), source })?;
        let status = resp.status().as_u16();
        let body = resp
            .body_mut()
            .with_config()
            .limit(DATASET_READ_LIMIT)
            .read_to_vec()
            .map_err(|e| ClientError::Decode { path: path.clone(), message: e.to_string() })?;
        if !(200..300).contains(&status) {
            let text = String::from_utf8_lossy(&body).into_owned();
            let message = serde_json::from_str::<ApiError>(&text).map(|e| e.error).unwrap_or(text);
            return Err(ClientError::Status { path, status, message });
        }
        Ok(body)
    }

    /// POSTs JSON; Ok(None) for an empty answer (204), the decoded body otherwise.
    fn post<B: Serialize, T: DeserializeOwned>(&self, path: &str, body: &B) -> Result<Option<T>, ClientError> {
        let url = format!("{}{}", self.base, path);
        let mut resp = self
            .agent
            .post(&url)
            .header("Authorization", &format!("Bearer {}", self.secret))
            .send_json(body)
            .map_err(|source| ClientError::Transport { url: url.clone(), source })?;
        let status = resp.status().as_u16();
        let text = resp
            .body_mut()
            .read_to_string()
            .map_err(|e| ClientError::Decode { path: path.into(), message: e.to_string() })?;
        if !(200..300).contains(&status) {
            let message = serde_json::from_str::<ApiError>(&text).map(|e| e.error).unwrap_or(text);
            return Err(ClientError::Status { path: path.into(), status, message });
        }
        if status == 204 || text.trim().is_empty() {
            return Ok(None);
        }
        serde_json::from_str(&text)
            .map(Some)
            .map_err(|e| ClientError::Decode { path: path.into(), message: e.to_string() })
    }
}

fn no_body(path: &str) -> ClientError {
    ClientError::Decode { path: path.into(), message: "empty answer".into() }
}
