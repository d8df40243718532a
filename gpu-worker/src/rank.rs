//! The rank side of the launcher: `distlab-worker rank --rank R --world W --dir DIR TASK`.
//! Connects to the other ranks, runs the task, and reports on stdout (see launch.rs).

use std::io::Write;
use std::path::Path;
use std::time::Duration;

use serde::Serialize;

use crate::launch::RankMessage;
use distlab_worker::comm::{CommError, Mesh};
use distlab_worker::train::TrainError;

/// How long a rank waits for the others to show up at the rendezvous.
pub const RENDEZVOUS_TIMEOUT: Duration = Duration::from_secs(30);

/// Writes this rank's messages to the launcher, one JSON line each.
pub struct LauncherChannel;

impl LauncherChannel {
    pub fn output(&self, payload: &impl Serialize) {
        let payload = serde_json::to_value(payload).unwrap_or(serde_json::Value::Null);
        self.write(&RankMessage::Output { payload });
    }

    pub fn error(&self, message: String, peer: Option<usize>) {
        self.write(&RankMessage::Error { message, peer });
    }

    fn write(&self, msg: &RankMessage) {
        let line = serde_json::to_string(msg).unwrap_or_default();
        let mut out = std::io::stdout().lock();
        // The launcher gone means this rank is about to be killed; nothing to do about it.
        let _ = writeln!(out, "{line}").and_then(|_| out.flush());
    }
}

/// The peer an error blames, if it comes from another rank's failure (a communication
/// error, possibly inside a training error).
pub fn blamed_peer_of(e: &anyhow::Error) -> Option<usize> {
    e.chain().find_map(|cause| {
        if let Some(c) = cause.downcast_ref::<CommError>() {
            return blamed_peer(c);
        }
        match cause.downcast_ref::<TrainError>() {
            Some(TrainError::Comm(c)) => blamed_peer(c),
            _ => None,
        }
    })
}

fn blamed_peer(e: &CommError) -> Option<usize> {
    match e {
        CommError::Timeout { peer, .. } | CommError::Disconnected { peer, .. } | CommError::Mismatch { peer, .. } => {
            Some(*peer)
        }
        CommError::BadBuffer { .. } | CommError::Device { .. } => None,
    }
}

pub fn connect(dir: &Path, rank: usize, world: usize) -> anyhow::Result<Mesh> {
    Ok(Mesh::connect(dir, rank, world, RENDEZVOUS_TIMEOUT)?)
}
