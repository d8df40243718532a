//! How the hosts of a run across workers find each other: through the server, like
//! torchrun's store. Each host's worker publishes what its ranks need the others to know
//! and reads what the others published (`POST /api/workers/rendezvous`, with its own
//! credential: only the hosts of the attempt may). The ranks never speak to the server:
//! they publish their TCP addresses in their run directory (`comm::AddressFiles`, as the
//! simulated hosts of one machine do), and [`relay`] copies them to the server and the
//! other hosts' addresses back.

use std::ops::Range;
use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use distlab_common::{RendezvousEntry, RendezvousRequest, RendezvousState};
use distlab_worker::comm::{AddressBook, AddressFiles};

use super::client::ServerClient;

/// A run's rendezvous, as one host sees it.
pub trait Rendezvous: Sync {
    /// Publishes `entries` and answers everything published for the attempt so far.
    fn exchange(&self, publish: &[RendezvousEntry]) -> Result<RendezvousState, Unmet>;
}

/// Why the hosts of a run did not meet.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum Unmet {
    /// The server ended the attempt (it released an unformed placement, re-queued the run
    /// after a host went away, or the run ended): this host just stops.
    #[error("the attempt is over")]
    AttemptOver,
    #[error("{0}")]
    Failed(String),
}

/// The rendezvous of one attempt, kept by the server.
pub struct ServerRendezvous<'a> {
    pub client: &'a ServerClient,
    pub worker_id: i64,
    pub experiment_id: i64,
    pub attempt: i64,
}

/// How long a host keeps asking an unreachable server before it gives up.
const UNREACHABLE: Duration = Duration::from_secs(30);
/// Between two looks at the rendezvous.
const POLL: Duration = Duration::from_millis(50);

impl Rendezvous for ServerRendezvous<'_> {
    fn exchange(&self, publish: &[RendezvousEntry]) -> Result<RendezvousState, Unmet> {
        let request = RendezvousRequest {
            worker_id: self.worker_id,
            experiment_id: self.experiment_id,
            attempt: self.attempt,
            publish: publish.to_vec(),
        };
        let started = Instant::now();
        loop {
            match self.client.rendezvous(&request) {
                Ok(state) => return Ok(state),
                Err(e) if e.is_conflict() => return Err(Unmet::AttemptOver),
                Err(e) if e.is_transient() && started.elapsed() < UNREACHABLE => std::thread::sleep(POLL * 4),
                Err(e) => return Err(Unmet::Failed(format!("the rendezvous: {e}"))),
            }
        }
    }
}

/// The name a rank's address is published under.
fn address_name(rank: usize) -> String {
    format!("rank-{rank}.addr")
}

/// Waits until every host's worker has taken its part (the ranks start only then, so that
/// none waits out its own rendezvous timeout for a host that is still being placed). The
/// server decides how long: it ends an attempt whose hosts do not all come
/// (`--gang-timeout-seconds`); `within` only bounds a server that never does.
pub fn wait_for_hosts(rendezvous: &dyn Rendezvous, within: Duration, cancel: &AtomicBool) -> Result<(), Unmet> {
    let started = Instant::now();
    loop {
        let state = rendezvous.exchange(&[])?;
        if state.joined >= state.hosts {
            return Ok(());
        }
        if cancel.load(Ordering::Relaxed) {
            return Err(Unmet::Failed("cancelled while waiting for the run's other hosts".into()));
        }
        if started.elapsed() > within {
            let (joined, hosts) = (state.joined, state.hosts);
            return Err(Unmet::Failed(format!("only {joined} of the run's {hosts} hosts took their part")));
        }
        std::thread::sleep(POLL * 2);
    }
}

const RESUME_STEP: &str = "resume-step";

/// The checkpoint step every host of the run resumes from (None: from the start). Host 0
/// decides (`decided`: Some) and publishes it; the others wait for it.
pub fn resume_step(
    rendezvous: &dyn Rendezvous,
    decided: Option<Option<u64>>,
    within: Duration,
) -> Result<Option<u64>, Unmet> {
    if let Some(step) = decided {
        let value = step.map_or_else(|| "none".to_string(), |s| s.to_string());
        rendezvous.exchange(&[RendezvousEntry { name: RESUME_STEP.into(), value }])?;
        return Ok(step);
    }
    let started = Instant::now();
    loop {
        let state = rendezvous.exchange(&[])?;
        if let Some(entry) = state.entries.iter().find(|e| e.name == RESUME_STEP) {
            return match entry.value.as_str() {
                "none" => Ok(None),
                step => step
                    .parse()
                    .map(Some)
                    .map_err(|_| Unmet::Failed(format!("host 0 published the resume step {step:?}"))),
            };
        }
        if started.elapsed() > within {
            return Err(Unmet::Failed(format!(
                "host 0 did not say which checkpoint to resume from within {} s",
                within.as_secs()
            )));
        }
        std::thread::sleep(POLL);
    }
}

/// The name host `host` publishes once its ranks have finished and all they reported has
/// reached the server.
fn done_name(host: usize) -> String {
    format!("host-{host}.done")
}

/// Says that this host's part of the run is over (its ranks finished, their events sent).
pub fn host_done(rendezvous: &dyn Rendezvous, host: usize) -> Result<(), Unmet> {
    rendezvous.exchange(&[RendezvousEntry { name: done_name(host), value: "ok".into() }]).map(drop)
}

/// Waits (at most `within`) until every host but host 0 has said its part is over: host 0
/// reports the run complete only then, so that no host's last events (its ranks' traces)
/// arrive after the run has ended.
pub fn wait_for_hosts_done(rendezvous: &dyn Rendezvous, hosts: usize, within: Duration) -> Result<(), Unmet> {
    let started = Instant::now();
    loop {
        let state = rendezvous.exchange(&[])?;
        let missing: Vec<usize> =
            (1..hosts).filter(|&h| !state.entries.iter().any(|e| e.name == done_name(h))).collect();
        if missing.is_empty() {
            return Ok(());
        }
        if started.elapsed() > within {
            let within = within.as_secs();
            return Err(Unmet::Failed(format!("hosts {missing:?} did not say they were done within {within} s")));
        }
        std::thread::sleep(POLL);
    }
}

/// Copies the addresses this host's ranks (`local`) publish in `dir` to the rendezvous,
/// and the other ranks' addresses from there into `dir`, until `dir` holds every rank's
/// address of the `world` (or `stop` is set).
pub fn relay(
    rendezvous: &dyn Rendezvous,
    dir: &Path,
    local: Range<usize>,
    world: usize,
    stop: &AtomicBool,
) -> Result<(), Unmet> {
    let book = AddressFiles { dir: dir.to_path_buf() };
    let local = local.start.min(world)..local.end.min(world);
    // A rank of this host is known once published, another host's once written here.
    let mut known = vec![false; world];
    loop {
        let mut publish = Vec::new();
        for (rank, known) in known.iter_mut().enumerate().filter(|(r, k)| local.contains(r) && !**k) {
            if let Ok(Some(address)) = book.lookup(rank) {
                publish.push(RendezvousEntry { name: address_name(rank), value: address.to_string() });
                *known = true;
            }
        }
        let state = rendezvous.exchange(&publish)?;
        for (rank, known) in known.iter_mut().enumerate().filter(|(r, k)| !local.contains(r) && !**k) {
            let Some(entry) = state.entries.iter().find(|e| e.name == address_name(rank)) else { continue };
            let address = entry
                .value
                .parse()
                .map_err(|e| Unmet::Failed(format!("rank {rank}'s published address {:?}: {e}", entry.value)))?;
            book.publish(rank, address)
                .map_err(|e| Unmet::Failed(format!("cannot write rank {rank}'s address in {}: {e}", dir.display())))?;
            *known = true;
        }
        if known.iter().all(|k| *k) || stop.load(Ordering::Relaxed) {
            return Ok(());
        }
        std::thread::sleep(POLL);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::net::SocketAddr;
    use std::sync::Mutex;

    /// A rendezvous in memory, shared by the test's "hosts".
    struct InMemory {
        entries: Mutex<Vec<RendezvousEntry>>,
        hosts: usize,
    }

    impl Rendezvous for InMemory {
        fn exchange(&self, publish: &[RendezvousEntry]) -> Result<RendezvousState, Unmet> {
            let mut entries = self.entries.lock().unwrap();
            for e in publish {
                if !entries.iter().any(|have| have.name == e.name) {
                    entries.push(e.clone());
                }
            }
            Ok(RendezvousState { entries: entries.clone(), hosts: self.hosts, joined: self.hosts })
        }
    }

    /// Two hosts, each with its own run directory: each relay publishes its ranks'
    /// addresses and writes the other host's into its directory.
    #[test]
    fn relays_give_each_host_every_ranks_address() {
        let rendezvous = InMemory { entries: Mutex::new(Vec::new()), hosts: 2 };
        let dirs = [tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap()];
        let address =
            |rank: usize| -> SocketAddr { format!("10.0.0.{}:{}", rank / 2 + 1, 4000 + rank).parse().unwrap() };
        for (host, dir) in dirs.iter().enumerate() {
            let book = AddressFiles { dir: dir.path().to_path_buf() };
            for rank in 2 * host..2 * host + 2 {
                book.publish(rank, address(rank)).unwrap();
            }
        }
        let stop = AtomicBool::new(false);
        std::thread::scope(|s| {
            for (host, dir) in dirs.iter().enumerate() {
                let rendezvous = &rendezvous;
                let stop = &stop;
                s.spawn(move || relay(rendezvous, dir.path(), 2 * host..2 * host + 2, 4, stop).unwrap());
            }
        });
        for dir in &dirs {
            let book = AddressFiles { dir: dir.path().to_path_buf() };
            for rank in 0..4 {
                assert_eq!(book.lookup(rank).unwrap(), Some(address(rank)));
            }
        }
        assert_eq!(resume_step(&rendezvous, Some(Some(10)), Duration::from_secs(1)), Ok(Some(10)));
        assert_eq!(resume_step(&rendezvous, None, Duration::from_secs(1)), Ok(Some(10)));
        assert!(wait_for_hosts_done(&rendezvous, 2, Duration::ZERO).is_err());
        host_done(&rendezvous, 1).unwrap();
        assert_eq!(wait_for_hosts_done(&rendezvous, 2, Duration::ZERO), Ok(()));
    }

    #[test]
    fn a_bad_address_from_another_host_is_an_error_not_a_panic() {
        let rendezvous = InMemory {
            entries: Mutex::new(vec![RendezvousEntry { name: "rank-1.addr".into(), value: "not an address".into() }]),
            hosts: 2,
        };
        let dir = tempfile::tempdir().unwrap();
        let e = relay(&rendezvous, dir.path(), 0..1, 2, &AtomicBool::new(false)).unwrap_err();
        assert!(e.to_string().contains("rank 1's published address"), "{e}");
    }
}
