//! The replicas' quorum (`parallel.fault_tolerance: replicas`): the launcher keeps it, each
//! rank process asks it over a Unix socket in the run directory (one JSON line each way).
//!
//! The keeper answers a round when every live member of the current quorum has asked:
//! - `join`: the first quorum, once all W ranks have asked; a replacement's, at the next
//!   step's start (`heal`) that admits it;
//! - `vote`: commit when every member's collective succeeded and none died since the
//!   quorum formed, else a new quorum of the live members (retry);
//! - `heal` (a step's start): a new quorum when members died or replacements wait;
//! - `leave`: the member is done; replacements still waiting when all are get no quorum.
//!
//! A member whose connection closes (its process exited) is dead to the keeper at once.
//! `QuorumClient` is a rank's side: the engine's `Membership`.

use std::collections::{BTreeMap, BTreeSet};
use std::io::{BufRead, BufReader, Write};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{mpsc, Arc};
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};

use distlab_worker::comm::{Alone, Communicator, Mesh, RingCommunicator};
use distlab_worker::parallel::fault_tolerant::{Membership, MembershipError, Quorum, Verdict};

/// The keeper's socket, in the run directory.
pub const QUORUM_SOCKET: &str = "quorum.sock";

/// How long the members of a new quorum wait for each other to connect their ring (a
/// member that died meanwhile makes the ring fail, and the vote drops it).
const RING_RENDEZVOUS: Duration = Duration::from_secs(10);

/// How long a round waits for a member that has neither answered nor died after another
/// member's collective failed, before the keeper asks the launcher to kill it.
const LAGGARD_GRACE: Duration = Duration::from_secs(60);

#[derive(Debug, Serialize, Deserialize)]
#[serde(tag = "type", rename_all = "snake_case")]
enum Request {
    Join { rank: usize },
    Vote { step: u64, ok: bool },
    Heal { step: u64 },
    Leave,
}

#[derive(Debug, Serialize, Deserialize)]
#[serde(tag = "type", rename_all = "snake_case")]
enum Answer {
    Joined { quorum: Option<Quorum> },
    Voted { verdict: Verdict },
    Healed { quorum: Option<Quorum> },
    Left,
}

/// What the keeper tells the launcher.
#[derive(Debug, PartialEq)]
pub enum Notice {
    /// A member died: the step it was lost in, and how many live members are left.
    Lost { rank: usize, step: u64, live: usize },
    /// A replacement joined; it runs from `step`, with the state of rank `source`.
    Rejoined { rank: usize, step: u64, source: usize },
    /// A member stuck in a round another member's failure ended: kill its process.
    Kill { rank: usize },
    /// The ranks broke the protocol (a bug): fail the run.
    Broken(String),
}

/// The launcher's keeper, on threads of its own until dropped.
pub struct QuorumKeeper {
    pub notices: mpsc::Receiver<Notice>,
    stop: Arc<AtomicBool>,
}

impl Drop for QuorumKeeper {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
    }
}

enum Happening {
    Connected(u64, UnixStream),
    Asked(u64, Request),
    Closed(u64),
}

impl QuorumKeeper {
    /// Listens in `run_dir` for the `world` replicas.
    pub fn start(run_dir: &Path, world: usize) -> std::io::Result<QuorumKeeper> {
        let path = run_dir.join(QUORUM_SOCKET);
        let _ = std::fs::remove_file(&path);
        let listener = UnixListener::bind(&path)?;
        listener.set_nonblocking(true)?;
        let stop = Arc::new(AtomicBool::new(false));
        let (happenings, inbox) = mpsc::channel();
        let (notify, notices) = mpsc::channel();
        let accepting = stop.clone();
        std::thread::spawn(move || {
            let mut next = 0u64;
            while !accepting.load(Ordering::Relaxed) {
                match listener.accept() {
                    Ok((stream, _)) => {
                        let id = next;
                        next += 1;
                        if stream.set_nonblocking(false).is_err() {
                            continue;
                        }
                        let Ok(reader) = stream.try_clone() else { continue };
                        if happenings.send(Happening::Connected(id, stream)).is_err() {
                            return;
                        }
                        let tx = happenings.clone();
                        std::thread::spawn(move || {
                            for line in BufReader::new(reader).lines() {
                                let Ok(line) = line else { break };
                                match serde_json::from_str::<Request>(&line) {
                                    Ok(request) => {
                                        if tx.send(Happening::Asked(id, request)).is_err() {
                                            return;
                                        }
                                    }
                                    Err(_) => break,
                                }
                            }
                            let _ = tx.send(Happening::Closed(id));
                        });
                    }
                    Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                        std::thread::sleep(Duration::from_millis(5))
                    }
                    Err(_) => std::thread::sleep(Duration::from_millis(50)),
                }
            }
            let _ = std::fs::remove_file(&path);
        });
        let keeping = stop.clone();
        std::thread::spawn(move || {
            let mut keeper = Keeper::new(world, notify);
            while !keeping.load(Ordering::Relaxed) {
                match inbox.recv_timeout(Duration::from_millis(200)) {
                    Ok(h) => keeper.happen(h),
                    Err(mpsc::RecvTimeoutError::Timeout) => {}
                    Err(mpsc::RecvTimeoutError::Disconnected) => return,
                }
                keeper.check_laggards();
            }
        });
        Ok(QuorumKeeper { notices, stop })
    }
}

/// A connection, and the rank it said it is.
struct Conn {
    rank: Option<usize>,
    stream: UnixStream,
}

/// What a member asked and waits for an answer to.
#[derive(Clone, Copy, Debug, PartialEq)]
enum Pending {
    Vote { step: u64, ok: bool },
    Heal { step: u64 },
}

struct Keeper {
    world: usize,
    conns: BTreeMap<u64, Conn>,
    /// The current quorum (None before the replicas start).
    quorum: Option<Quorum>,
    next_id: u64,
    /// Live members of the current quorum: rank -> connection.
    live: BTreeMap<usize, u64>,
    pending: BTreeMap<usize, Pending>,
    /// Processes waiting to join: rank -> connection.
    joiners: BTreeMap<usize, u64>,
    /// Members that finished the run.
    left: BTreeSet<usize>,
    /// The step of the last round answered (for the notices).
    step: u64,
    /// When a member's failed vote started waiting for the others.
    failed_since: Option<Instant>,
    notify: mpsc::Sender<Notice>,
}

impl Keeper {
    fn new(world: usize, notify: mpsc::Sender<Notice>) -> Keeper {
        Keeper {
            world,
            conns: BTreeMap::new(),
            quorum: None,
            next_id: 1,
            live: BTreeMap::new(),
            pending: BTreeMap::new(),
            joiners: BTreeMap::new(),
            left: BTreeSet::new(),
            step: 0,
            failed_since: None,
            notify,
        }
    }

    fn happen(&mut self, h: Happening) {
        match h {
            Happening::Connected(id, stream) => {
                self.conns.insert(id, Conn { rank: None, stream });
            }
            Happening::Asked(id, request) => self.ask(id, request),
            Happening::Closed(id) => {
                let rank = self.conns.remove(&id).and_then(|c| c.rank);
                if let Some(rank) = rank {
                    if self.live.get(&rank) == Some(&id) {
                        self.live.remove(&rank);
                        self.pending.remove(&rank);
                        let _ = self.notify.send(Notice::Lost { rank, step: self.step, live: self.live.len() });
                    }
                    if self.joiners.get(&rank) == Some(&id) {
                        self.joiners.remove(&rank);
                    }
                }
            }
        }
        self.settle();
    }

    fn ask(&mut self, id: u64, request: Request) {
        let rank = match (&request, self.conns.get_mut(&id)) {
            (Request::Join { rank }, Some(conn)) if *rank < self.world => {
                conn.rank = Some(*rank);
                // A replacement whose predecessor's close has not been seen yet: it is dead.
                if let Some(old) = self.live.remove(rank) {
                    self.conns.remove(&old);
                    self.pending.remove(rank);
                }
                self.joiners.insert(*rank, id);
                return;
            }
            (_, Some(Conn { rank: Some(rank), .. })) => *rank,
            _ => return self.broken(format!("a connection asked {request:?} before saying which rank it is")),
        };
        if self.live.get(&rank) != Some(&id) {
            return self.broken(format!("rank {rank} asked {request:?} without being a member"));
        }
        match request {
            Request::Join { .. } => {}
            Request::Vote { step, ok } => {
                if !ok && self.failed_since.is_none() {
                    self.failed_since = Some(Instant::now());
                }
                self.pending.insert(rank, Pending::Vote { step, ok });
            }
            Request::Heal { step } => {
                self.pending.insert(rank, Pending::Heal { step });
            }
            Request::Leave => {
                self.live.remove(&rank);
                self.left.insert(rank);
                self.answer(id, &Answer::Left);
            }
        }
    }

    /// Answers the round every live member has asked in, if they all have.
    fn settle(&mut self) {
        let Some(quorum) = self.quorum.clone() else {
            // The start: every rank of the run asks to join.
            if self.joiners.len() == self.world {
                let joiners = std::mem::take(&mut self.joiners);
                let q = self.new_quorum(joiners.keys().copied().collect(), vec![], 0);
                for (&rank, &id) in &joiners {
                    self.live.insert(rank, id);
                    self.answer(id, &Answer::Joined { quorum: Some(q.clone()) });
                }
            }
            return;
        };
        if self.live.is_empty() {
            // The run is over (or every replica is gone): nobody is left to join.
            for (_, id) in std::mem::take(&mut self.joiners) {
                self.answer(id, &Answer::Joined { quorum: None });
            }
            return;
        }
        if self.live.keys().any(|r| !self.pending.contains_key(r)) {
            return;
        }
        let asked: Vec<Pending> = self.pending.values().copied().collect();
        let pending = std::mem::take(&mut self.pending);
        self.failed_since = None;
        let live: Vec<usize> = self.live.keys().copied().collect();
        match asked[0] {
            Pending::Vote { step, .. } => {
                if asked.iter().any(|p| !matches!(p, Pending::Vote { step: s, .. } if *s == step)) {
                    return self.broken(format!("the members voted on different steps: {pending:?}"));
                }
                self.step = step;
                let all_ok = asked.iter().all(|p| matches!(p, Pending::Vote { ok: true, .. }));
                let verdict = if all_ok && quorum.members == live {
                    Verdict::Commit
                } else {
                    Verdict::Retry(self.new_quorum(live, vec![], step))
                };
                for id in self.live.values().copied().collect::<Vec<_>>() {
                    self.answer(id, &Answer::Voted { verdict: verdict.clone() });
                }
            }
            Pending::Heal { step } => {
                if asked.iter().any(|p| *p != Pending::Heal { step }) {
                    return self.broken(format!("the members started different steps: {pending:?}"));
                }
                self.step = step;
                let joiners: Vec<usize> = self.joiners.keys().copied().collect();
                let answer = if joiners.is_empty() && quorum.members == live {
                    None
                } else {
                    let members: BTreeSet<usize> = live.iter().chain(&joiners).copied().collect();
                    Some(self.new_quorum(members.into_iter().collect(), joiners, step))
                };
                for id in self.live.values().copied().collect::<Vec<_>>() {
                    self.answer(id, &Answer::Healed { quorum: answer.clone() });
                }
                let source = answer.as_ref().and_then(Quorum::source).unwrap_or(0);
                for (rank, id) in std::mem::take(&mut self.joiners) {
                    self.live.insert(rank, id);
                    self.answer(id, &Answer::Joined { quorum: answer.clone() });
                    let _ = self.notify.send(Notice::Rejoined { rank, step, source });
                }
            }
        }
    }

    fn new_quorum(&mut self, members: Vec<usize>, joiners: Vec<usize>, step: u64) -> Quorum {
        let q = Quorum { id: self.next_id, members, joiners, step };
        self.next_id += 1;
        self.quorum = Some(q.clone());
        q
    }

    fn answer(&mut self, id: u64, answer: &Answer) {
        let line = serde_json::to_string(answer).unwrap_or_default();
        if let Some(conn) = self.conns.get_mut(&id) {
            // A member gone meanwhile: its close is on its way.
            let _ = writeln!(conn.stream, "{line}");
        }
    }

    /// After a member's collective failed, the members that neither answer nor die are
    /// stuck: the launcher kills them, and the round goes on without them.
    fn check_laggards(&mut self) {
        if self.failed_since.is_some_and(|t| t.elapsed() > LAGGARD_GRACE) {
            self.failed_since = Some(Instant::now());
            for &rank in self.live.keys().filter(|r| !self.pending.contains_key(r)) {
                let _ = self.notify.send(Notice::Kill { rank });
            }
        }
    }

    fn broken(&mut self, why: String) {
        let _ = self.notify.send(Notice::Broken(why));
    }
}

/// A rank's side of the quorum: the engine's `Membership` through the keeper's socket,
/// and a fresh ring over each quorum's members (shared memory, in a directory of its own).
pub struct QuorumClient {
    rank: usize,
    run_dir: PathBuf,
    collective_timeout: Duration,
    reader: BufReader<UnixStream>,
    writer: UnixStream,
}

impl QuorumClient {
    pub fn connect(run_dir: &Path, rank: usize, collective_timeout: Duration) -> std::io::Result<QuorumClient> {
        let writer = UnixStream::connect(run_dir.join(QUORUM_SOCKET))?;
        let reader = BufReader::new(writer.try_clone()?);
        Ok(QuorumClient { rank, run_dir: run_dir.into(), collective_timeout, reader, writer })
    }

    fn ask(&mut self, request: &Request) -> Result<Answer, MembershipError> {
        let failed = |e: std::io::Error| MembershipError(format!("the worker's keeper is gone: {e}"));
        let line = serde_json::to_string(request).map_err(|e| MembershipError(e.to_string()))?;
        writeln!(self.writer, "{line}").map_err(failed)?;
        let mut answer = String::new();
        if self.reader.read_line(&mut answer).map_err(failed)? == 0 {
            return Err(MembershipError("the worker's keeper closed the connection".into()));
        }
        serde_json::from_str(&answer).map_err(|e| MembershipError(format!("the keeper answered {answer:?}: {e}")))
    }
}

fn unexpected(answer: Answer) -> MembershipError {
    MembershipError(format!("the keeper answered {answer:?}"))
}

impl Membership for QuorumClient {
    fn join(&mut self) -> Result<Option<Quorum>, MembershipError> {
        match self.ask(&Request::Join { rank: self.rank })? {
            Answer::Joined { quorum } => Ok(quorum),
            other => Err(unexpected(other)),
        }
    }

    fn vote(&mut self, step: u64, ok: bool) -> Result<Verdict, MembershipError> {
        match self.ask(&Request::Vote { step, ok })? {
            Answer::Voted { verdict } => Ok(verdict),
            other => Err(unexpected(other)),
        }
    }

    fn heal(&mut self, step: u64) -> Result<Option<Quorum>, MembershipError> {
        match self.ask(&Request::Heal { step })? {
            Answer::Healed { quorum } => Ok(quorum),
            other => Err(unexpected(other)),
        }
    }

    fn leave(&mut self) -> Result<(), MembershipError> {
        match self.ask(&Request::Leave)? {
            Answer::Left => Ok(()),
            other => Err(unexpected(other)),
        }
    }

    fn group(&mut self, quorum: &Quorum) -> Result<Box<dyn Communicator>, MembershipError> {
        let failed = |e: String| MembershipError(format!("the ring of quorum {}: {e}", quorum.id));
        let me = quorum.position(self.rank).ok_or_else(|| failed(format!("rank {} is not in it", self.rank)))?;
        let size = quorum.members.len();
        if size == 1 {
            return Ok(Box::new(Alone));
        }
        let dir = self.run_dir.join(format!("quorum-{}", quorum.id));
        std::fs::create_dir_all(&dir).map_err(|e| failed(e.to_string()))?;
        let mesh = Mesh::connect(&dir, me, size, RING_RENDEZVOUS).map_err(|e| failed(e.to_string()))?;
        let name = format!("replicas-{}", quorum.id);
        let ring = RingCommunicator::new(&mesh, &name, (0..size).collect(), self.collective_timeout, None)
            .map_err(|e| failed(e.to_string()))?;
        Ok(Box::new(ring))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn keeper(world: usize) -> (Keeper, mpsc::Receiver<Notice>, Vec<UnixStream>) {
        let (tx, rx) = mpsc::channel();
        let mut k = Keeper::new(world, tx);
        let mut theirs = Vec::new();
        for id in 0..world as u64 {
            let (ours, their) = UnixStream::pair().unwrap();
            k.happen(Happening::Connected(id, ours));
            theirs.push(their);
        }
        (k, rx, theirs)
    }

    fn answer(s: &UnixStream) -> Answer {
        let mut line = String::new();
        BufReader::new(s).read_line(&mut line).unwrap();
        serde_json::from_str(&line).unwrap()
    }

    #[test]
    fn a_lost_replica_is_voted_out_and_its_replacement_joins_at_the_next_step() {
        let (mut k, notices, ranks) = keeper(3);
        for r in 0..3 {
            k.happen(Happening::Asked(r as u64, Request::Join { rank: r }));
        }
        for s in &ranks {
            assert!(
                matches!(answer(s), Answer::Joined { quorum: Some(Quorum { id: 1, ref members, .. }) } if members == &[0, 1, 2])
            );
        }
        // Step 0 commits with everyone.
        for r in 0..3 {
            k.happen(Happening::Asked(r as u64, Request::Vote { step: 0, ok: true }));
        }
        for s in &ranks {
            assert!(matches!(answer(s), Answer::Voted { verdict: Verdict::Commit }));
        }
        // Step 1: rank 1 dies; the others' sums fail: a retry without it.
        k.happen(Happening::Asked(0, Request::Vote { step: 1, ok: false }));
        k.happen(Happening::Closed(1));
        assert_eq!(notices.try_recv(), Ok(Notice::Lost { rank: 1, step: 0, live: 2 }));
        k.happen(Happening::Asked(2, Request::Vote { step: 1, ok: false }));
        for s in [&ranks[0], &ranks[2]] {
            match answer(s) {
                Answer::Voted { verdict: Verdict::Retry(q) } => assert_eq!((q.id, q.members), (2, vec![0, 2])),
                other => panic!("{other:?}"),
            }
        }
        // A replacement asks to join; it waits for the next step's start.
        let (ours, replacement) = UnixStream::pair().unwrap();
        k.happen(Happening::Connected(9, ours));
        k.happen(Happening::Asked(9, Request::Join { rank: 1 }));
        for r in [0, 2] {
            k.happen(Happening::Asked(r as u64, Request::Vote { step: 1, ok: true }));
        }
        assert!(matches!(answer(&ranks[0]), Answer::Voted { verdict: Verdict::Commit }));
        assert!(matches!(answer(&ranks[2]), Answer::Voted { verdict: Verdict::Commit }));
        for r in [0, 2] {
            k.happen(Happening::Asked(r as u64, Request::Heal { step: 2 }));
        }
        let expected = Quorum { id: 3, members: vec![0, 1, 2], joiners: vec![1], step: 2 };
        for s in [&ranks[0], &ranks[2]] {
            assert!(matches!(answer(s), Answer::Healed { quorum: Some(ref q) } if *q == expected));
        }
        assert!(matches!(answer(&replacement), Answer::Joined { quorum: Some(ref q) } if *q == expected));
        assert_eq!(expected.source(), Some(0));
        assert_eq!(notices.try_recv(), Ok(Notice::Rejoined { rank: 1, step: 2, source: 0 }));
        // Nothing changes at the next start.
        for id in [0, 2, 9] {
            k.happen(Happening::Asked(id, Request::Heal { step: 3 }));
        }
        for s in [&ranks[0], &ranks[2], &replacement] {
            assert!(matches!(answer(s), Answer::Healed { quorum: None }));
        }
    }

    #[test]
    fn a_member_out_of_step_breaks_the_run() {
        let (mut k, notices, _ranks) = keeper(2);
        for r in 0..2 {
            k.happen(Happening::Asked(r as u64, Request::Join { rank: r }));
        }
        k.happen(Happening::Asked(0, Request::Vote { step: 0, ok: true }));
        k.happen(Happening::Asked(1, Request::Heal { step: 1 }));
        assert!(matches!(notices.try_recv(), Ok(Notice::Broken(_))));
    }
}
