//! What the engine records about communication, for the ring replay and timelines.
//!
//! Full detail (every ring step) is kept for the first `detail_limit` collectives of a
//! rank; after that only per-operation counters grow, so a long run stays small.

use serde::{Deserialize, Serialize};

// The worker's rings and the browser's replay take the ring's chunks from here.
pub use crate::plan::ring::chunk_range;

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(rename_all = "snake_case")]
pub enum CollectiveOp {
    AllReduce,
    ReduceScatter,
    AllGather,
    /// Every rank sends chunk j of its buffer to rank j (Mixture-of-Experts' dispatch).
    AllToAll,
    Broadcast,
    Send,
    Recv,
    Barrier,
}

impl CollectiveOp {
    pub fn as_str(self) -> &'static str {
        match self {
            CollectiveOp::AllReduce => "all_reduce",
            CollectiveOp::ReduceScatter => "reduce_scatter",
            CollectiveOp::AllGather => "all_gather",
            CollectiveOp::AllToAll => "all_to_all",
            CollectiveOp::Broadcast => "broadcast",
            CollectiveOp::Send => "send",
            CollectiveOp::Recv => "recv",
            CollectiveOp::Barrier => "barrier",
        }
    }
}

/// Which half of a ring algorithm a step belongs to.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(rename_all = "snake_case")]
pub enum RingPhase {
    /// Partial sums travel round the ring; each step adds one more rank's contribution.
    ReduceScatter,
    /// Finished chunks travel round the ring and are copied.
    AllGather,
    /// A chain from the root: each rank forwards what it received (naive, tree and
    /// hierarchical all-reduces: the result sent on from the root, or a node's leader).
    Broadcast,
    /// Partial sums travel toward a root (naive and tree all-reduces).
    Reduce,
    /// A single send between two ranks.
    PointToPoint,
    /// All-to-all, written out pairwise: at step s every rank sends the chunk meant for the
    /// rank s places after it and receives from the rank s places before.
    Exchange,
}

/// One step of a collective as the sending rank saw it: chunk `chunk` went from `from` to `to`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct RingStep {
    pub collective: u64,
    pub phase: RingPhase,
    pub step: u32,
    pub chunk: u32,
    /// Global ranks.
    pub from: u32,
    pub to: u32,
    pub bytes: u64,
    /// Microseconds since the Unix epoch (all ranks share the machine's clock).
    pub start_us: u64,
    pub end_us: u64,
    /// The values sent, for small buffers (demos), so a replay can show the numbers.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub values: Option<Vec<f32>>,
}

/// One collective call on one rank.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct CollectiveRecord {
    /// Sequence number within the group (the same on every rank of the group).
    pub id: u64,
    pub op: CollectiveOp,
    /// The group's name ("world", "dp", "tp", "pp") and its global ranks in ring order.
    pub group: String,
    pub ranks: Vec<u32>,
    pub elements: u64,
    pub bytes_sent: u64,
    /// `bytes_sent` is the formula (NCCL: what a ring would send, 2(W-1)/W x D for an
    /// all-reduce; NCCL does not say what it sent), not bytes counted as they were sent.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub bytes_from_formula: bool,
    pub start_us: u64,
    pub end_us: u64,
    /// This rank's buffer before and after, for small buffers (demos).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub input: Option<Vec<f32>>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub output: Option<Vec<f32>>,
}

/// Totals per operation over the whole run, detailed or not.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct CollectiveCounter {
    pub op: CollectiveOp,
    pub calls: u64,
    pub elements: u64,
    pub bytes_sent: u64,
    /// The calls' bytes are the formula (see [`CollectiveRecord::bytes_from_formula`]).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub bytes_from_formula: bool,
    pub total_us: u64,
}

/// Everything one rank recorded about its communication.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct RankCommTrace {
    pub rank: u32,
    /// Collectives recorded in full detail (the first ones); later ones only in `counters`.
    pub detail_limit: u64,
    pub collectives: Vec<CollectiveRecord>,
    pub steps: Vec<RingStep>,
    /// Training's calls: what the optimizer steps sent.
    pub counters: Vec<CollectiveCounter>,
    /// The validation loss's calls (`train.eval_every`), apart from training's.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub evaluation: Vec<CollectiveCounter>,
    /// Bytes training sent to each peer over the traced communicators, every call counted.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub sent_to: Vec<PeerBytes>,
}

/// Bytes one rank sent to one peer (a global rank).
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct PeerBytes {
    pub to: u32,
    pub bytes: u64,
}

/// Bytes every rank together sent to peers on its own host and on other hosts (a run
/// whose ranks report no host: all inside), from the ranks' per-peer counts.
pub fn link_class_bytes(trace: &ExperimentTrace) -> (u64, u64) {
    let host = |rank: u32| trace.ranks.iter().find(|r| r.rank == rank).and_then(|r| r.host);
    let mut classes = (0u64, 0u64);
    for rank in &trace.ranks {
        for peer in &rank.comm.sent_to {
            match (host(rank.rank), host(peer.to)) {
                (Some(a), Some(b)) if a != b => classes.1 += peer.bytes,
                _ => classes.0 += peer.bytes,
            }
        }
    }
    classes
}

/// What a span of a rank's timeline was spent on.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(rename_all = "snake_case")]
pub enum SpanKind {
    Forward,
    /// The backward (ZB-H1: its input-gradient half, B).
    Backward,
    /// ZB-H1's weight-gradient half of a backward (W).
    Weights,
    /// A collective (e.g. one gradient bucket's all-reduce), on the communication thread.
    Comm,
    Optimizer,
    /// Waiting for something (the last bucket, a pipeline neighbour).
    Idle,
}

/// The lanes of a rank's timeline.
pub mod lane {
    /// The compute thread: forward, backward, optimizer, waits.
    pub const COMPUTE: &str = "compute";
    /// The communication thread: DDP's gradient buckets, all-reduced while backward goes on.
    pub const COMM: &str = "comm";
    /// Data-parallel collectives the compute thread issues and waits for: ZeRO/FSDP's
    /// gathers and reduce-scatters, ZeRO's parameter gather after the update.
    pub const DP_BLOCKING: &str = "dp-blocking";
    /// Tensor parallelism's all-reduces, between a block's matmuls (waited for too).
    pub const TP: &str = "tp";
    /// Expert parallelism's all-to-alls: tokens to their experts and back (waited for too).
    pub const EP: &str = "ep";
    /// Context parallelism's all-to-alls (Ulysses): q, k, v to whole sequences and
    /// attention's output back, and their gradients (waited for too).
    pub const CP: &str = "cp";
    /// Activation offload: each block's activations leaving the device after its forward
    /// and coming back (read ahead, one block before its backward), with their bytes.
    pub const OFFLOAD: &str = "offload";
}

/// How fault-tolerant replicas name the spans of their membership's changes (the engine
/// writes them, `analysis::replicas` reads them back): a loss, a replacement's copy of its
/// state, and the copy sent; the last two end with the digest of the parameters copied.
pub mod membership {
    /// "replica lost: rank(s) [2]", or "replica lost: gradients again without rank(s) [2]".
    pub const LOST: &str = "replica lost: ";
    pub const LOST_RANKS: &str = "rank(s) ";
    /// "rejoined: state copied from rank 0, parameters 3ddacd334a7b2dc4".
    pub const REJOINED: &str = "rejoined: state copied from rank ";
    /// "state copied to rank 2, which rejoins: parameters 3ddacd334a7b2dc4".
    pub const COPIED: &str = "state copied to rank ";
    pub const PARAMETERS: &str = "parameters ";
}

impl Span {
    /// A collective the compute thread stopped for: it can never be hidden under compute.
    pub fn blocks_compute(&self) -> bool {
        self.kind == SpanKind::Comm && [lane::DP_BLOCKING, lane::TP, lane::EP, lane::CP].contains(&self.lane.as_str())
    }
}

/// One interval of a rank's timeline.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct Span {
    pub kind: SpanKind,
    /// e.g. "forward", "backward layer 3", "all_reduce bucket 2 (1.0 MiB)", "optimizer".
    pub name: String,
    /// Optimizer step.
    pub step: u64,
    /// Where it is drawn, one of [`lane`]'s names: the compute thread, the communication
    /// thread, or a collective the compute thread waited for.
    pub lane: String,
    /// Microseconds since the Unix epoch.
    pub start_us: u64,
    pub end_us: u64,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub layer: Option<u32>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub bucket: Option<u32>,
    /// A collective: the bytes this rank sent during it (measured by the communicator).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub bytes: Option<u64>,
    /// The micro-batch a forward or backward span ran (pipeline timelines number them).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub micro: Option<u32>,
    /// Interleaved pipelines: which of the stage's chunks of layers the pass ran through.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub chunk: Option<u32>,
}

/// The name a recomputed block's forward span starts with (activation checkpointing).
pub const RECOMPUTE: &str = "recompute";

impl Span {
    pub fn duration_us(&self) -> u64 {
        self.end_us.saturating_sub(self.start_us)
    }

    /// A block's forward run again before its backward (activation checkpointing).
    pub fn is_recompute(&self) -> bool {
        self.kind == SpanKind::Forward && self.name.starts_with(RECOMPUTE)
    }
}

/// Everything one rank recorded: its timeline (the first `span_steps` steps) and its
/// communication.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct RankTrace {
    pub rank: u32,
    pub world: u32,
    /// Spans are kept for this many optimizer steps (the first ones).
    pub span_steps: u64,
    pub spans: Vec<Span>,
    pub comm: RankCommTrace,
    /// What the engine allocated, by category (absent in traces from before it was measured).
    #[serde(default)]
    pub memory: Option<crate::wire::memory::RankMemoryReport>,
    /// The host the rank ran on, when the run's ranks spanned hosts (None: all on one).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub host: Option<u32>,
    /// Asynchronous SGD, on the parameter server's rank: every gradient it applied, in order.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub applied_gradients: Vec<AppliedGradient>,
}

/// Asynchronous SGD: one gradient the parameter server applied.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct AppliedGradient {
    /// The data-parallel rank that pushed it.
    pub worker: u32,
    /// How many other gradients the server applied between the pull of the parameters it
    /// was computed on and its push.
    pub staleness: u32,
}

/// What the recorded ring steps sent over one link, from one rank to another.
#[derive(Clone, Debug, PartialEq)]
pub struct LinkUse {
    pub from: u32,
    pub to: u32,
    /// The two ranks ran on different hosts: the bytes went over the network (TCP), not
    /// through shared memory.
    pub crosses_hosts: bool,
    pub steps: u32,
    pub bytes: u64,
    /// The steps' time as the sender measured each (sending its chunk while receiving the
    /// next): bytes / busy time is what the link delivered under the ring's load.
    pub busy_us: u64,
}

impl LinkUse {
    /// Bytes per second delivered, in GB/s (0 without a measured time).
    pub fn gbps(&self) -> f64 {
        if self.busy_us == 0 {
            0.0
        } else {
            self.bytes as f64 / (self.busy_us as f64 * 1e3)
        }
    }
}

/// Every link the recorded ring steps used, in (from, to) order, each with whether it
/// crossed hosts (`RankTrace::host`).
pub fn link_uses(trace: &ExperimentTrace) -> Vec<LinkUse> {
    let host = |rank: u32| trace.ranks.iter().find(|r| r.rank == rank).and_then(|r| r.host);
    let mut links: std::collections::BTreeMap<(u32, u32), LinkUse> = std::collections::BTreeMap::new();
    for step in trace.ranks.iter().flat_map(|r| &r.comm.steps) {
        let link = links.entry((step.from, step.to)).or_insert_with(|| LinkUse {
            from: step.from,
            to: step.to,
            crosses_hosts: matches!((host(step.from), host(step.to)), (Some(a), Some(b)) if a != b),
            steps: 0,
            bytes: 0,
            busy_us: 0,
        });
        link.steps += 1;
        link.bytes += step.bytes;
        link.busy_us += step.end_us.saturating_sub(step.start_us);
    }
    links.into_values().collect()
}

/// `GET /api/experiments/{id}/trace`: every rank's trace, in rank order.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct ExperimentTrace {
    pub ranks: Vec<RankTrace>,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn links_add_up_their_steps_and_know_which_cross_hosts() {
        let step = |from, to, bytes, start_us, end_us| RingStep {
            collective: 0,
            phase: RingPhase::ReduceScatter,
            step: 0,
            chunk: 0,
            from,
            to,
            bytes,
            start_us,
            end_us,
            values: None,
        };
        let rank = |rank: u32, host: Option<u32>, steps: Vec<RingStep>| RankTrace {
            rank,
            world: 3,
            host,
            comm: RankCommTrace { rank, steps, ..RankCommTrace::default() },
            ..RankTrace::default()
        };
        let trace = ExperimentTrace {
            ranks: vec![
                rank(0, Some(0), vec![step(0, 1, 1000, 10, 11), step(0, 1, 3000, 20, 22)]),
                rank(1, Some(0), vec![step(1, 2, 4_000_000, 0, 2000)]),
                rank(2, Some(1), vec![step(2, 0, 500, 5, 5)]),
            ],
        };
        let links = link_uses(&trace);
        let summary: Vec<_> =
            links.iter().map(|l| (l.from, l.to, l.crosses_hosts, l.steps, l.bytes, l.busy_us)).collect();
        assert_eq!(summary, [(0, 1, false, 2, 4000, 3), (1, 2, true, 1, 4_000_000, 2000), (2, 0, true, 1, 500, 0)]);
        assert!((links[1].gbps() - 2.0).abs() < 1e-12);
        assert_eq!(links[2].gbps(), 0.0);
        // One host (no hosts recorded): nothing crosses.
        let one: ExperimentTrace =
            ExperimentTrace { ranks: trace.ranks.iter().cloned().map(|r| RankTrace { host: None, ..r }).collect() };
        assert!(link_uses(&one).iter().all(|l| !l.crosses_hosts));
    }
}
