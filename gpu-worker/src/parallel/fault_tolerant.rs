//! Training that survives a lost replica (`parallel.fault_tolerance: replicas`, the idea of
//! TorchFT): data-parallel replicas of one rank each, every one holding the whole model,
//! that agree on who is alive instead of trusting a fixed group.
//!
//! Every collective goes through a quorum the worker keeps (`Membership`):
//!
//!   sum = all-reduce of the members' values over this quorum's ring
//!   vote: every member says whether its all-reduce succeeded
//!     all of them, none dead  -> commit: the sum is the step's
//!     otherwise               -> a new quorum of the live members, a new ring, sum again
//!
//! so a replica that dies in the middle of a step costs that step its gradient (the step's
//! batch shrinks to the live members', and the sum is scaled by W / members so that it is
//! still a mean), never the step. A replacement process for it asks to join; at the start
//! of the next step the members admit it (`heal`), and the first member copies it the
//! parameters and the optimizer's state it holds after the last update, so that the
//! replacement continues bit for bit where the others are, without a checkpoint.
//!
//! Each quorum gets a fresh ring (`Membership::group`): nothing a broken collective left in
//! the old pipes can be read by the next.

use std::sync::Arc;

use distlab_common::trace::membership::{COPIED, LOST, LOST_RANKS, PARAMETERS, REJOINED};
use distlab_common::trace::{Span, SpanKind};
use distlab_common::ExperimentSpec;
use serde::{Deserialize, Serialize};

use super::ddp::Replicated;
use super::{host_category, params_f32, SavedState, StateView, Strategy, TrainBackend};
use crate::backend::Stored;
use crate::comm::{CommError, Communicator, ReduceOp};
use crate::error::TrainError;
use crate::memory::{Category, MemoryTracker};
use crate::model::{ModelState, ParamLayout, Stage};
use crate::offload::{OffloadError, OffloadTo};
use crate::ops::optimizer::OptimizerState;
use crate::trace::{blocking_comm_span, now_us};

/// The replicas that run the collectives of a step together.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Quorum {
    /// Grows by one with every new quorum of the run.
    pub id: u64,
    /// The data-parallel ranks in it, in rank order (their positions in its ring).
    pub members: Vec<usize>,
    /// Members that have just joined and take their state from `members`' first
    /// non-joiner (the source).
    pub joiners: Vec<usize>,
    /// The step it was formed at.
    pub step: u64,
}

impl Quorum {
    /// The member that copies the joiners their state: the first that is not one.
    pub fn source(&self) -> Option<usize> {
        self.members.iter().copied().find(|r| !self.joiners.contains(r))
    }

    /// Position of `rank` in the quorum's ring.
    pub fn position(&self, rank: usize) -> Option<usize> {
        self.members.iter().position(|&r| r == rank)
    }
}

/// What the members decided about a collective they ran.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum Verdict {
    /// Every member's succeeded: its result stands.
    Commit,
    /// A member failed or died: run it again in this quorum.
    Retry(Quorum),
}

/// A failure to reach the quorum's keeper (the worker).
#[derive(Debug, thiserror::Error)]
#[error("the replicas' quorum: {0}")]
pub struct MembershipError(pub String);

/// The worker's side of the replicas' agreement, as a replica sees it.
pub trait Membership: Send {
    /// This process's place: the quorum that takes it in (the first, when the replicas
    /// start together; a later one's at its start for a replacement), or None when the run
    /// ended before one did.
    fn join(&mut self) -> Result<Option<Quorum>, MembershipError>;
    /// Whether every member's collective of `step` succeeded (`ok`: this one's did).
    fn vote(&mut self, step: u64, ok: bool) -> Result<Verdict, MembershipError>;
    /// Before `step`: a new quorum when replicas died or replacements wait to join, or
    /// None when the members are the same.
    fn heal(&mut self, step: u64) -> Result<Option<Quorum>, MembershipError>;
    /// This replica finished the run.
    fn leave(&mut self) -> Result<(), MembershipError>;
    /// A ring over the quorum's members (a fresh one for every quorum).
    fn group(&mut self, quorum: &Quorum) -> Result<Box<dyn Communicator>, MembershipError>;
}

impl From<MembershipError> for CommError {
    fn from(e: MembershipError) -> Self {
        CommError::Device { collective: "quorum".into(), detail: e.0 }
    }
}

impl From<MembershipError> for TrainError {
    fn from(e: MembershipError) -> Self {
        TrainError::Comm(e.into())
    }
}

/// How many quorums one collective may go through before the run gives up (each retry
/// drops at least one member that failed).
const MAX_RETRIES: usize = 16;

/// One replica of a fault-tolerant data-parallel group.
pub struct FaultTolerant<B: TrainBackend> {
    /// The model, its gradients and optimizer, with no group of its own.
    inner: Replicated<B>,
    membership: Box<dyn Membership>,
    /// This replica's data-parallel rank, and how many the run has (W).
    rank: usize,
    replicas: usize,
    quorum: Quorum,
    /// The quorum's ring (None when it could not be made: the next vote says so).
    group: Option<Box<dyn Communicator>>,
    /// A replacement's first step: the one whose start the quorum that took it in was
    /// agreed at (the run's end when none did).
    joins_at: Option<u64>,
    /// The step whose start was last agreed (`heal`).
    healed: u64,
    /// W / members of the last committed gradient sum: makes it a mean over the members.
    scale: f64,
    step: u64,
    record: bool,
    spans: Vec<Span>,
    memory: Arc<MemoryTracker>,
}

impl<B: TrainBackend> FaultTolerant<B> {
    #[allow(clippy::too_many_arguments)]
    pub fn new(
        spec: &ExperimentSpec,
        be: &B,
        layout: &ParamLayout,
        stage: &Stage,
        memory: &Arc<MemoryTracker>,
        (rank, replicas): (usize, usize),
        mut membership: Box<dyn Membership>,
        offload: &OffloadTo,
    ) -> Result<Self, TrainError> {
        let inner = Replicated::new(spec, be, layout, stage, memory, None, offload)?;
        let steps = spec.train.steps;
        let start = now_us();
        // The run ended before a quorum took this replacement in: it has no step to run.
        let quorum = membership.join()?.unwrap_or(Quorum { id: 0, members: vec![rank], joiners: vec![], step: steps });
        let mut me = Self {
            inner,
            membership,
            rank,
            replicas,
            group: None,
            joins_at: None,
            healed: quorum.step,
            scale: 1.0,
            step: quorum.step,
            record: false,
            spans: Vec::new(),
            memory: memory.clone(),
            quorum: quorum.clone(),
        };
        if quorum.id == 0 {
            me.joins_at = Some(steps);
            return Ok(me);
        }
        me.group = Some(me.membership.group(&quorum)?);
        if quorum.joiners.contains(&rank) {
            let source = quorum.source().ok_or_else(|| TrainError::Unsupported("a quorum of joiners only".into()))?;
            let (sent, hash) = me.receive_state(be, source)?;
            me.joins_at = Some(quorum.step);
            me.spans.push(membership_span(
                format!("{REJOINED}{source}, {PARAMETERS}{hash:016x}"),
                quorum.step,
                start,
                sent,
            ));
        }
        Ok(me)
    }

    /// Moves to `quorum`: its ring (None if it cannot be made, which the next vote
    /// reports as this member's failure).
    fn switch(&mut self, quorum: Quorum) {
        self.group = None;
        self.group = match self.membership.group(&quorum) {
            Ok(group) => Some(group),
            Err(e) => {
                eprintln!("replica {}: no ring for quorum {}: {e}", self.rank, quorum.id);
                None
            }
        };
        self.quorum = quorum;
    }

    /// `own` summed over the quorum's members, agreed: run again in a new quorum
    /// until every member's sum succeeded. Returns the sum and how many members made it.
    fn agreed_sum(&mut self, what: &str, own: &[f32]) -> Result<(Vec<f32>, usize), CommError> {
        for _ in 0..MAX_RETRIES {
            let mut buf = own.to_vec();
            let (start, sent_before) = (now_us(), self.group.as_ref().map_or(0, |g| g.bytes_sent()));
            let ok = match &mut self.group {
                Some(group) => group.all_reduce(&mut buf, ReduceOp::Sum).map_err(|e| e.to_string()),
                None => Err("no ring".into()),
            };
            if let Err(e) = &ok {
                eprintln!(
                    "replica {}: {what} of step {} failed in quorum {}: {e}",
                    self.rank, self.step, self.quorum.id
                );
            }
            let sent = self.group.as_ref().map_or(0, |g| g.bytes_sent()) - sent_before;
            match self.membership.vote(self.step, ok.is_ok())? {
                Verdict::Commit => {
                    if self.record {
                        let name = format!("all_reduce {what} ({} replicas)", self.quorum.members.len());
                        self.spans.push(blocking_comm_span(&name, self.step, start, sent));
                    }
                    return Ok((buf, self.quorum.members.len()));
                }
                Verdict::Retry(quorum) => {
                    let lost: Vec<usize> =
                        self.quorum.members.iter().copied().filter(|r| !quorum.members.contains(r)).collect();
                    let name = format!("{LOST}{what} again without {LOST_RANKS}{lost:?}");
                    self.spans.push(membership_span(name, self.step, start, sent));
                    self.switch(quorum);
                }
            }
        }
        Err(CommError::Device {
            collective: what.into(),
            detail: format!("no quorum agreed on it after {MAX_RETRIES} tries"),
        })
    }

    /// The first member of a new quorum copies each joiner what an optimizer step
    /// changes: the step count, the parameters, and the optimizer's buffers (m, v, master).
    fn send_state(&mut self, be: &B, joiner: usize) -> Result<(u64, u64), String> {
        let to = self.quorum.position(joiner).ok_or("the joiner is not in the quorum")?;
        let group = self.group.as_mut().ok_or("no ring")?;
        let before = group.bytes_sent();
        let (mut sent, mut hash) = (Ok(()), 0);
        self.inner
            .view_state(be, &mut |view: StateView<'_>| {
                hash = digest(&view.params);
                let o = &view.optimizer;
                let master = o.master.unwrap_or_default();
                let header =
                    state_header(view.optimizer_steps, [view.params.len(), o.m.len(), o.v.len(), master.len()]);
                sent = [&header[..], &view.params, o.m, o.v, master]
                    .into_iter()
                    .filter(|part| !part.is_empty())
                    .try_for_each(|part| group.send(part, to));
            })
            .map_err(|e| e.to_string())?;
        sent.map_err(|e| e.to_string())?;
        Ok((group.bytes_sent() - before, hash))
    }

    /// A joiner's side of `send_state`: checks the lengths against its own state, then
    /// takes the source's as its own. Returns the bytes and the parameters' digest.
    fn receive_state(&mut self, be: &B, source: usize) -> Result<(u64, u64), TrainError> {
        let from = self.quorum.position(source).ok_or_else(|| TrainError::Unsupported("no source".into()))?;
        let group = self.group.as_mut().ok_or_else(|| TrainError::Unsupported("no ring to the source".into()))?;
        let mut lengths = [0usize; 4];
        self.inner.view_state(be, &mut |view| {
            let o = &view.optimizer;
            lengths = [view.params.len(), o.m.len(), o.v.len(), o.master.map_or(0, <[f32]>::len)];
        })?;
        let mut header = [0f32; 6];
        group.recv(&mut header, from)?;
        let (steps_taken, theirs) = read_header(&header);
        if theirs != lengths {
            return Err(TrainError::Unsupported(format!(
                "the source holds {theirs:?} values (parameters, m, v, master), this replica {lengths:?}"
            )));
        }
        let _copy = self.memory.alloc(Category::Transient, lengths.iter().sum());
        let mut parts: Vec<Vec<f32>> = lengths.iter().map(|&n| vec![0f32; n]).collect();
        for part in parts.iter_mut().filter(|p| !p.is_empty()) {
            group.recv(part, from)?;
        }
        let [params, m, v, master]: [Vec<f32>; 4] = parts.try_into().expect("four parts");
        let hash = digest(&params);
        let master = (lengths[3] > 0).then_some(master);
        let optimizer = OptimizerState { steps_taken, m, v, master };
        self.inner.load(be, SavedState { params, optimizer, local: vec![] }).map_err(TrainError::Unsupported)?;
        Ok((header.len() as u64 * 4 + lengths.iter().sum::<usize>() as u64 * 4, hash))
    }
}

/// How a replica's line about its parameters starts (every replica reports it).
pub const REPLICA_DIGEST_LOG: &str = "fault-tolerant replica:";

/// FNV-1a over the values' bits: equal digests, equal parameters bit for bit (but for a
/// 1 in 2^64 chance).
pub fn digest(values: &[f32]) -> u64 {
    values
        .iter()
        .flat_map(|v| v.to_bits().to_le_bytes())
        .fold(0xcbf2_9ce4_8422_2325, |h, byte| (h ^ byte as u64).wrapping_mul(0x0000_0100_0000_01b3))
}

/// The state's first message: the optimizer's step count (as two 32-bit halves) and the
/// four parts' lengths, each carried in an f32's bits.
fn state_header(steps_taken: u64, lengths: [usize; 4]) -> [f32; 6] {
    let mut h = [0f32; 6];
    h[0] = f32::from_bits(steps_taken as u32);
    h[1] = f32::from_bits((steps_taken >> 32) as u32);
    for (slot, n) in h[2..].iter_mut().zip(lengths) {
        *slot = f32::from_bits(n as u32);
    }
    h
}

fn read_header(h: &[f32; 6]) -> (u64, [usize; 4]) {
    let steps = h[0].to_bits() as u64 | (h[1].to_bits() as u64) << 32;
    (steps, [2, 3, 4, 5].map(|i| h[i].to_bits() as usize))
}

/// A span of the membership's own (a replica lost, a replacement's copy), kept whatever
/// step it happens at: the timeline marks it.
fn membership_span(name: String, step: u64, start_us: u64, bytes: u64) -> Span {
    Span { kind: SpanKind::Idle, ..blocking_comm_span(&name, step, start_us, bytes) }
}

impl<B: TrainBackend> Strategy<B> for FaultTolerant<B> {
    /// The start of a step is where replacements join: the members agree on who is in,
    /// and the first of them copies the joiners its state.
    fn begin_step(&mut self, be: &B, step: u64, record: bool) -> Result<(), TrainError> {
        (self.step, self.record) = (step, record);
        self.inner.begin_step(be, step, record)?;
        if step <= self.healed {
            return Ok(());
        }
        self.healed = step;
        let start = now_us();
        let Some(quorum) = self.membership.heal(step)? else { return Ok(()) };
        let lost: Vec<usize> = self.quorum.members.iter().copied().filter(|r| !quorum.members.contains(r)).collect();
        let joiners = quorum.joiners.clone();
        let source = quorum.source();
        self.switch(quorum);
        if !lost.is_empty() {
            self.spans.push(membership_span(format!("{LOST}{LOST_RANKS}{lost:?}"), step, start, 0));
        }
        if source == Some(self.rank) {
            for joiner in joiners {
                let start = now_us();
                // A joiner that fails to take its state dies: the next vote drops it.
                match self.send_state(be, joiner) {
                    Ok((sent, hash)) => self.spans.push(membership_span(
                        format!("{COPIED}{joiner}, which rejoins: {PARAMETERS}{hash:016x}"),
                        step,
                        start,
                        sent,
                    )),
                    Err(e) => eprintln!("replica {}: the state did not reach rank {joiner}: {e}", self.rank),
                }
            }
        }
        Ok(())
    }

    fn state(&mut self, last: bool) -> &mut dyn ModelState<B> {
        self.inner.state(last)
    }

    /// The members' gradients summed (agreed), scaled to their mean: squares x (W/m)².
    /// This replica's own gradient is kept apart (a host copy) until the sum is agreed,
    /// for a retry to start from.
    fn reduce_gradients(&mut self, be: &B) -> Result<f64, CommError> {
        let len = be.buf_len(self.inner.grads());
        let _copies = self.memory.alloc(host_category(be, Category::CommBuffers), 2 * len);
        let own = be.read_host(be.all(self.inner.grads()), |g| g.iter().map(|x| x.load()).collect::<Vec<f32>>());
        let (sums, members) = self.agreed_sum("gradients", &own)?;
        be.on_host(be.all_mut(self.inner.grads_mut()), |g| {
            for (g, &s) in g.iter_mut().zip(&sums) {
                *g = B::Elem::store(s);
            }
        });
        self.scale = self.replicas as f64 / members as f64;
        Ok(self.inner.reduce_gradients(be)? * self.scale * self.scale)
    }

    fn update(&mut self, be: &B, lr: f64, grad_scale: f64) -> Result<(), TrainError> {
        self.inner.update(be, lr, grad_scale * self.scale)
    }

    /// The members' sum, as if every one of the W replicas had given the mean.
    fn sum_scalar(&mut self, value: f64) -> Result<f64, CommError> {
        let (sum, members) = self.agreed_sum("loss", &[value as f32])?;
        Ok(sum[0] as f64 * self.replicas as f64 / members as f64)
    }

    fn comm_spans(&self) -> Vec<Span> {
        let mut spans = self.inner.comm_spans();
        spans.extend(self.spans.iter().cloned());
        spans
    }

    fn held_bytes(&self, be: &B) -> u64 {
        self.inner.held_bytes(be)
    }

    fn view_state(&self, be: &B, f: &mut dyn FnMut(StateView<'_>)) -> Result<(), OffloadError> {
        self.inner.view_state(be, f)
    }

    fn load(&mut self, be: &B, state: SavedState) -> Result<(), String> {
        self.inner.load(be, state)
    }

    fn joins_at(&self) -> Option<u64> {
        self.joins_at
    }

    /// A member leaves the quorum (a replacement the run ended before was never in one),
    /// saying what its parameters hash to: every replica's must be the same.
    fn end(&mut self, be: &B) -> Result<Option<String>, TrainError> {
        if self.quorum.id == 0 {
            return Ok(None);
        }
        self.membership.leave()?;
        let hash = be.read_host(be.all(self.inner.params()), |p| digest(&params_f32(p)));
        Ok(Some(format!("{REPLICA_DIGEST_LOG} rank {} ends with parameters {hash:016x}", self.rank)))
    }
}
