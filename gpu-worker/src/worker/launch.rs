//! The launcher (like torchrun): starts one OS process per rank, gives each its rank, the
//! world size and the rendezvous directory, and watches them.
//!
//! Each rank talks back on its stdout, one JSON `RankMessage` per line; its stderr is kept
//! (the last lines) for error reports. If any rank fails (an error, a panic, a signal),
//! every other rank is killed and the run fails with that rank's message and stderr tail.
//! A rank stuck in a collective is caught by its peers' collective timeout. With
//! fault-tolerant replicas (`replicas`) a rank that dies is started again instead, and
//! the others go on without it until it rejoins (`quorum.rs` keeps who is in). No rank process
//! outlives `launch`: they are killed and reaped on every path out, and on Linux the kernel
//! kills them if the launcher itself is killed (a SIGKILLed worker leaves no rank behind to
//! write into checkpoints another worker resumes from).

use std::collections::{BTreeMap, VecDeque};
use std::io::{BufRead, BufReader};
use std::net::IpAddr;
use std::ops::Range;
use std::os::unix::process::ExitStatusExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{mpsc, Arc, Mutex};
use std::time::{Duration, Instant};

use distlab_common::{LogLevel, LogLine, RunEvent};

use super::demo::RankOutput;
use super::protocol::RankMessage;
use super::quorum::{Notice, QuorumKeeper};

/// Keeps the last lines of a rank's stderr.
const STDERR_TAIL_LINES: usize = 20;

#[derive(Debug, thiserror::Error)]
pub enum LaunchError {
    #[error("could not start rank {rank}: {source}")]
    Spawn { rank: usize, source: std::io::Error },
    #[error("could not prepare the run directory {path}: {source}")]
    RunDir { path: PathBuf, source: std::io::Error },
    #[error("{0}")]
    RankFailed(String),
    /// This host's ranks failed because ranks of another host went away.
    #[error("{0}")]
    HostLost(String),
    #[error("cancelled")]
    Cancelled,
}

pub struct LaunchSpec<'a> {
    pub exe: &'a Path,
    pub world: usize,
    /// The ranks started here: all of them, or this host's block of a run across workers.
    pub local: Range<usize>,
    /// Every rank's host (empty: all on one). Ranks of different hosts talk over TCP, so a
    /// machine can play several hosts (`--simulated-hosts`).
    pub hosts: Vec<usize>,
    /// The address ranks of other hosts reach this host's ranks at (None: 127.0.0.1).
    pub host_ip: Option<IpAddr>,
    /// The secret the connections between hosts prove (hex): the run's, when it spans
    /// workers; None: a fresh one (simulated hosts).
    pub secret: Option<String>,
    /// Arguments after `rank --rank R --world W --dir DIR [--hosts ...]`.
    pub args: Vec<String>,
    /// Sockets live here (created if missing).
    pub run_dir: &'a Path,
    pub env: Vec<(String, String)>,
    /// Fault-tolerant data-parallel replicas: keep their quorum, and start a rank that
    /// dies again (at most `MAX_REPLACEMENTS` times each) instead of failing the run.
    pub replicas: bool,
}

/// How many times one rank of fault-tolerant replicas is started again.
pub const MAX_REPLACEMENTS: usize = 3;

struct RankProcess {
    rank: usize,
    child: Child,
    stderr_tail: Arc<Mutex<VecDeque<String>>>,
    /// The error message the rank sent before exiting, if any.
    error: Option<(String, Option<usize>)>,
    status: Option<ExitStatus>,
}

/// Kills and reaps every rank that is still running, whatever path leaves `launch`.
struct Ranks(Vec<RankProcess>);

impl Drop for Ranks {
    fn drop(&mut self) {
        for p in &mut self.0 {
            if p.status.is_none() {
                let _ = p.child.kill();
                let _ = p.child.wait();
            }
        }
    }
}

/// Runs `world` rank processes to completion. `on_output(rank, payload)` receives each
/// rank's outputs in order; `cancel` stops everything.
pub fn launch(
    spec: &LaunchSpec,
    on_output: &mut dyn FnMut(usize, serde_json::Value),
    cancel: &AtomicBool,
) -> Result<(), LaunchError> {
    std::fs::create_dir_all(spec.run_dir)
        .map_err(|source| LaunchError::RunDir { path: spec.run_dir.into(), source })?;
    let (tx, rx) = mpsc::channel::<(usize, RankMessage)>();
    let mut ranks = Ranks(Vec::with_capacity(spec.local.len()));
    // Ranks of different hosts prove to each other that they belong to this run.
    let mut env = spec.env.clone();
    if !spec.hosts.is_empty() {
        let secret = match &spec.secret {
            Some(secret) => secret.clone(),
            None => run_secret().map_err(|source| LaunchError::RunDir { path: spec.run_dir.into(), source })?,
        };
        env.push((super::protocol::SECRET_VAR.to_string(), secret));
    }
    // NCCL installed under its real name only: the ranks find it through a link.
    #[cfg(feature = "cuda")]
    env.extend(distlab_worker::comm::nccl_library::rank_library_path(spec.run_dir));
    let mut place_args = hosts_args(&spec.hosts);
    if let Some(ip) = spec.host_ip {
        place_args.extend(["--host-ip".to_string(), ip.to_string()]);
    }
    place_args.extend(["--local-ranks".to_string(), format!("{}..{}", spec.local.start, spec.local.end)]);
    // (listening before any rank asks it)
    let keeper = match spec.replicas {
        true => Some(
            QuorumKeeper::start(spec.run_dir, spec.world)
                .map_err(|source| LaunchError::RunDir { path: spec.run_dir.into(), source })?,
        ),
        false => None,
    };
    for rank in spec.local.clone() {
        ranks.0.push(spawn_rank(spec, rank, &place_args, &env, &tx)?);
    }
    let mut replicas = Replicas::default();

    let mut first_failure: Option<Instant> = None;
    loop {
        // Messages first, so an error line is read before its rank's exit is noticed: those
        // waiting now, or the first to come within 20 ms (never more than are waiting, or a
        // steady stream of them would keep the exits from being looked at).
        let first = rx.recv_timeout(Duration::from_millis(20)).ok();
        for (rank, msg) in first.into_iter().chain(std::iter::from_fn(|| rx.try_recv().ok())) {
            match msg {
                RankMessage::Output { payload } if spec.replicas => {
                    if let Some(payload) = replicas.pass(rank, payload) {
                        on_output(rank, payload);
                    }
                }
                RankMessage::Output { payload } => on_output(rank, payload),
                RankMessage::Error { message, peer } => {
                    if let Some(p) = ranks.0.iter_mut().find(|p| p.rank == rank) {
                        p.error = Some((message, peer));
                    }
                }
            }
        }
        if cancel.load(Ordering::Relaxed) {
            return Err(LaunchError::Cancelled);
        }
        if let Some(keeper) = &keeper {
            while let Ok(notice) = keeper.notices.try_recv() {
                replicas.heed(notice, &mut ranks.0, on_output)?;
            }
        }
        for i in 0..ranks.0.len() {
            let p = &mut ranks.0[i];
            if p.status.is_none() {
                if let Ok(Some(status)) = p.child.try_wait() {
                    p.status = Some(status);
                    if !status.success() && spec.replicas && replicas.may_replace(p.rank) {
                        let (rank, times) = (p.rank, replicas.replace(p.rank));
                        let why = describe_status(status);
                        let message = format!(
                            "rank {rank}'s process {why}: the other replicas go on without it; a new process for \
                             rank {rank} starts (replacement {times} of {MAX_REPLACEMENTS})"
                        );
                        on_output(rank, warning(message));
                        ranks.0[i] = spawn_rank(spec, rank, &place_args, &env, &tx)?;
                    } else if !status.success() && first_failure.is_none() {
                        first_failure = Some(Instant::now());
                    }
                }
            }
        }
        if ranks.0.iter().all(|p| p.status.is_some_and(|s| s.success())) {
            // Drain what is left of the outputs.
            while let Ok((rank, msg)) = rx.recv_timeout(Duration::from_millis(50)) {
                if let RankMessage::Output { payload } = msg {
                    match spec.replicas {
                        true => replicas.pass(rank, payload).into_iter().for_each(|p| on_output(rank, p)),
                        false => on_output(rank, payload),
                    }
                }
            }
            if let Some((rank, summary)) = replicas.summary() {
                on_output(rank, summary);
            }
            return Ok(());
        }
        // After a failure, give the other ranks a moment to report what they saw, then blame.
        if let Some(t) = first_failure {
            if t.elapsed() > Duration::from_millis(300) {
                let (message, elsewhere) = blame(&ranks.0, &spec.local);
                return Err(if elsewhere { LaunchError::HostLost(message) } else { LaunchError::RankFailed(message) });
            }
        }
    }
}

/// The launcher's record of fault-tolerant replicas: how often each rank was started
/// again, when each was lost, and the outputs every replica sends alike (each step's metric
/// point, the summary), passed on once.
#[derive(Default)]
struct Replicas {
    replaced: BTreeMap<usize, usize>,
    lost_at: BTreeMap<usize, Instant>,
    last_metric_step: Option<u64>,
    summaries: BTreeMap<usize, serde_json::Value>,
}

impl Replicas {
    fn may_replace(&self, rank: usize) -> bool {
        self.replaced.get(&rank).copied().unwrap_or(0) < MAX_REPLACEMENTS
    }

    /// Counts a replacement of `rank`; returns how many it has had.
    fn replace(&mut self, rank: usize) -> usize {
        self.lost_at.entry(rank).or_insert_with(Instant::now);
        let times = self.replaced.entry(rank).or_default();
        *times += 1;
        *times
    }

    /// What of a replica's output goes on: a step's metric point once (from the first
    /// replica that sends it), and no summary yet (`summary` picks one at the end).
    fn pass(&mut self, rank: usize, payload: serde_json::Value) -> Option<serde_json::Value> {
        match serde_json::from_value::<RankOutput>(payload.clone()) {
            Ok(RankOutput::Event(event)) => match *event {
                RunEvent::Metric(m) if self.last_metric_step.is_some_and(|last| m.step <= last) => None,
                RunEvent::Metric(m) => {
                    self.last_metric_step = Some(m.step);
                    Some(payload)
                }
                _ => Some(payload),
            },
            Ok(RankOutput::Summary(_)) => {
                self.summaries.insert(rank, payload);
                None
            }
            _ => Some(payload),
        }
    }

    /// The summary of the lowest rank that ran every step (never started again), else of
    /// the lowest rank.
    fn summary(&mut self) -> Option<(usize, serde_json::Value)> {
        let rank = self
            .summaries
            .keys()
            .copied()
            .find(|r| !self.replaced.contains_key(r))
            .or_else(|| self.summaries.keys().next().copied())?;
        self.summaries.remove(&rank).map(|s| (rank, s))
    }

    /// Acts on what the quorum's keeper says: its losses and rejoins go to the run's log.
    fn heed(
        &mut self,
        notice: Notice,
        ranks: &mut [RankProcess],
        on_output: &mut dyn FnMut(usize, serde_json::Value),
    ) -> Result<(), LaunchError> {
        match notice {
            Notice::Lost { rank, step, live } => {
                self.lost_at.entry(rank).or_insert_with(Instant::now);
                let message = format!(
                    "replica rank {rank} lost (the replicas last agreed on step {step}): {live} replica(s) go on, \
                     each step's batch theirs alone (the gradient their mean) until it rejoins"
                );
                on_output(rank, warning(message));
            }
            Notice::Rejoined { rank, step, source } => {
                let after = self.lost_at.remove(&rank).map(|t| t.elapsed().as_secs_f64()).unwrap_or(0.0);
                let message = format!(
                    "replica rank {rank} rejoined at step {step}, {after:.2} s after it was lost, with the \
                     parameters and optimizer state of rank {source} (no checkpoint)"
                );
                on_output(rank, warning(message));
            }
            Notice::Kill { rank } => {
                if let Some(p) = ranks.iter_mut().find(|p| p.rank == rank && p.status.is_none()) {
                    let _ = p.child.kill();
                }
            }
            Notice::Broken(why) => return Err(LaunchError::RankFailed(format!("the replicas' quorum: {why}"))),
        }
        Ok(())
    }
}

/// A warning line for the run's log, as a rank's output.
fn warning(message: String) -> serde_json::Value {
    let line = RunEvent::Log(LogLine { level: LogLevel::Warn, message });
    serde_json::to_value(RankOutput::Event(Box::new(line))).unwrap_or_default()
}

/// Starts rank `rank`'s process, its stdout and stderr read on threads of their own (its
/// messages into `tx`).
fn spawn_rank(
    spec: &LaunchSpec,
    rank: usize,
    place_args: &[String],
    env: &[(String, String)],
    tx: &mpsc::Sender<(usize, RankMessage)>,
) -> Result<RankProcess, LaunchError> {
    let mut command = Command::new(spec.exe);
    die_with_launcher(&mut command);
    let mut child = command
        .arg("rank")
        .args(["--rank", &rank.to_string(), "--world", &spec.world.to_string()])
        .arg("--dir")
        .arg(spec.run_dir)
        .args(place_args)
        .args(&spec.args)
        .envs(env.iter().map(|(k, v)| (k, v)))
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .map_err(|source| LaunchError::Spawn { rank, source })?;
    let stdout = child.stdout.take().expect("piped stdout");
    let stderr = child.stderr.take().expect("piped stderr");
    let tx = tx.clone();
    std::thread::spawn(move || {
        for line in BufReader::new(stdout).lines().map_while(Result::ok) {
            let msg = serde_json::from_str::<RankMessage>(&line).unwrap_or_else(|_| RankMessage::Output {
                payload: serde_json::json!({"type": "log", "level": "info", "message": line}),
            });
            if tx.send((rank, msg)).is_err() {
                break;
            }
        }
    });
    let stderr_tail = Arc::new(Mutex::new(VecDeque::new()));
    let tail = stderr_tail.clone();
    std::thread::spawn(move || {
        for line in BufReader::new(stderr).lines().map_while(Result::ok) {
            eprintln!("[rank {rank}] {line}");
            let mut t = tail.lock().unwrap_or_else(|p| p.into_inner());
            if t.len() == STDERR_TAIL_LINES {
                t.pop_front();
            }
            t.push_back(line);
        }
    });
    Ok(RankProcess { rank, child, stderr_tail, error: None, status: None })
}

/// 16 random bytes from the kernel, as hex.
fn run_secret() -> std::io::Result<String> {
    use std::io::Read;
    let mut bytes = [0u8; 16];
    std::fs::File::open("/dev/urandom")?.read_exact(&mut bytes)?;
    Ok(bytes.iter().map(|b| format!("{b:02x}")).collect())
}

/// `--hosts H0,H1,...` when the ranks span hosts.
fn hosts_args(hosts: &[usize]) -> Vec<String> {
    if hosts.is_empty() {
        return Vec::new();
    }
    vec!["--hosts".into(), hosts.iter().map(usize::to_string).collect::<Vec<_>>().join(",")]
}

/// The ranks of a world spread over `hosts` simulated hosts in contiguous blocks (rank r on
/// host r * hosts / world): when `hosts` divides the world and a block holds them,
/// tensor-parallel groups, then pipeline stages, stay inside a host (ranks count tp
/// fastest, then pp, then dp); uneven blocks may cut a group. Empty for one host.
pub fn simulated_hosts(world: usize, hosts: usize) -> Vec<usize> {
    if hosts <= 1 || world <= 1 {
        return Vec::new();
    }
    let hosts = hosts.min(world);
    (0..world).map(|r| r * hosts / world).collect()
}

/// On Linux: the rank gets SIGKILL when the thread that started it ends (with the process
/// when it is killed; `launch` reaps its ranks before it returns).
fn die_with_launcher(command: &mut Command) {
    #[cfg(target_os = "linux")]
    {
        use std::os::unix::process::CommandExt;
        let launcher = std::process::id();
        // SAFETY: prctl, getppid and _exit are async-signal-safe and touch no memory of the
        // parent.
        unsafe {
            command.pre_exec(move || {
                if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL) == -1 {
                    return Err(std::io::Error::last_os_error());
                }
                // The launcher died before prctl took effect.
                if libc::getppid() as u32 != launcher {
                    libc::_exit(1);
                }
                Ok(())
            });
        }
    }
    #[cfg(not(target_os = "linux"))]
    let _ = command;
}

/// Describes the failure that started it all: a rank that failed on its own (not because
/// a peer went away), else the one its peers blame, else the first failed rank. True as well
/// when no rank here failed on its own and one blames a rank of another host (outside
/// `local`): that host went away.
fn blame(ranks: &[RankProcess], local: &Range<usize>) -> (String, bool) {
    let failed: Vec<&RankProcess> = ranks.iter().filter(|p| p.status.is_some_and(|s| !s.success())).collect();
    let on_its_own = failed.iter().find(|p| !matches!(p.error, Some((_, Some(_))))).copied();
    let elsewhere = on_its_own.is_none()
        && failed.iter().any(|p| matches!(p.error, Some((_, Some(peer))) if !local.contains(&peer)));
    let Some(p) = on_its_own.or_else(|| failed.first().copied()) else { return ("a rank failed".into(), false) };
    let status = p.status.map(describe_status).unwrap_or_default();
    let tail = p.stderr_tail.lock().map(|t| t.iter().cloned().collect::<Vec<_>>().join("\n")).unwrap_or_default();
    let mut msg = match &p.error {
        Some((message, _)) => format!("rank {} failed: {message}", p.rank),
        None => format!("rank {} {status}", p.rank),
    };
    if !tail.trim().is_empty() {
        msg.push_str(&format!("\n--- rank {} stderr (last lines) ---\n{tail}", p.rank));
    }
    (msg, elsewhere)
}

fn describe_status(s: ExitStatus) -> String {
    match (s.code(), s.signal()) {
        (Some(101), _) => "panicked (exit code 101)".into(),
        (Some(code), _) => format!("exited with code {code}"),
        (None, Some(sig)) => format!("was killed by signal {sig}"),
        _ => "ended abnormally".into(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn simulated_hosts_take_contiguous_blocks_of_ranks() {
        assert!(simulated_hosts(4, 1).is_empty() && simulated_hosts(1, 2).is_empty());
        assert_eq!(simulated_hosts(4, 2), [0, 0, 1, 1]);
        // tp=2 x pp=2 x dp=2: each host holds a whole replica (its TP pairs and stages).
        assert_eq!(simulated_hosts(8, 2), [0, 0, 0, 0, 1, 1, 1, 1]);
        assert_eq!(simulated_hosts(4, 4), [0, 1, 2, 3]);
        // More hosts than ranks: one rank each.
        assert_eq!(simulated_hosts(2, 5), [0, 1]);
        assert_eq!(simulated_hosts(6, 4), [0, 0, 1, 2, 2, 3]);
        assert_eq!(hosts_args(&[0, 0, 1, 1]), ["--hosts", "0,0,1,1"]);
        let secret = run_secret().unwrap();
        assert_eq!(crate::worker::protocol::parse_secret(&secret).map(|b| b.len()), Some(16));
        assert_ne!(run_secret().unwrap(), secret);
        assert_eq!(crate::worker::protocol::parse_secret("zz"), None);
    }
}
