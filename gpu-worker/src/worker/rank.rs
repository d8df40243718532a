//! The rank side of the launcher: `distlab-worker rank --rank R --world W --dir DIR TASK`
//! (and `--hosts H0,H1,... --host-ip IP` when the ranks span hosts). Connects to the other
//! ranks, runs the task, and reports on stdout (see launch.rs).

use std::io::Write;
use std::net::IpAddr;
use std::path::PathBuf;
use std::time::Duration;

use serde::Serialize;

use super::protocol::{parse_secret, RankMessage, SECRET_VAR};

use distlab_worker::comm::{AddressFiles, CommError, Hosts, Mesh, RendezvousError};
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
        // A peer that never showed up, or whose connection failed while the ranks met.
        if let Some(RendezvousError::Timeout { rank, peer, .. } | RendezvousError::Io { rank, peer, .. }) =
            cause.downcast_ref::<RendezvousError>()
        {
            return (peer != rank).then_some(*peer);
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

/// Where a rank stands in its run.
pub struct Place {
    pub rank: usize,
    pub world: usize,
    /// The rendezvous directory this host's ranks share.
    pub dir: PathBuf,
    /// Every rank's host, when the ranks span hosts (empty: all on this one).
    pub hosts: Vec<usize>,
    /// The address of this rank's host that ranks of other hosts reach it on.
    pub host_ip: IpAddr,
    /// The ranks started on this machine (all of them, unless the run spans workers).
    pub local: std::ops::Range<usize>,
}

impl Place {
    /// This rank's host, when the ranks span hosts.
    pub fn host(&self) -> Option<u32> {
        self.hosts.get(self.rank).map(|&h| h as u32)
    }
}

/// Connects this rank to every other: shared memory inside its host, TCP to the others
/// (their addresses are published in the rendezvous directory, which the hosts of one
/// machine share).
pub fn connect(place: &Place) -> anyhow::Result<Mesh> {
    let (rank, world) = (place.rank, place.world);
    if place.hosts.is_empty() {
        return Ok(Mesh::connect(&place.dir, rank, world, RENDEZVOUS_TIMEOUT)?);
    }
    let secret = std::env::var(SECRET_VAR).ok().and_then(|hex| parse_secret(&hex)).ok_or_else(|| {
        anyhow::anyhow!("ranks on several hosts need the run's secret in {SECRET_VAR} (32 hex digits)")
    })?;
    let book = AddressFiles { dir: place.dir.clone() };
    let hosts = Hosts { of: place.hosts.clone(), ip: place.host_ip, book: &book, secret };
    Ok(Mesh::connect_hosts(&place.dir, rank, world, Some(&hosts), RENDEZVOUS_TIMEOUT)?)
}
