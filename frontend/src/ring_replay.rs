//! The ring replay, computed: every rank's buffer after every recorded step of one
//! ring collective (all-reduce, reduce-scatter, all-gather), of an all-reduce that
//! moves whole buffers between any two ranks (`parallel.allreduce` naive or tree: partial
//! sums towards rank 0, then the result back out), or of the hierarchical all-reduce
//! (rings inside nodes, a ring across their leaders, the result back into each node).
//!
//! Nothing here is re-derived from the textbook schedule. The replay starts from
//! the `input` each rank recorded, then applies the `RingStep`s the ranks recorded
//! (each step is recorded by its sender: chunk `chunk` went from `from` to `to`, with
//! the numbers it carried for small buffers): in the reduce-scatter phase the
//! receiver adds the numbers into its copy of the chunk, in the all-gather phase it
//! copies them over it. Beside the numbers the replay tracks whose contributions
//! each chunk holds, so the page can colour own data, partial sums ("2/4"), complete
//! sums and gathered copies even when the numbers of a large buffer were not kept.
//! At the end the replayed buffers are compared with the `output` each rank
//! recorded and with the sum of the recorded inputs.
//!
//! Plain Rust (no Leptos): the page only draws [`Replay`]; the tests replay real
//! traces saved from the worker (frontend/tests/fixtures/).

use std::collections::BTreeMap;
use std::ops::Range;

use distlab_common::all_reduce::{elements_sent, Nodes};
use distlab_common::trace::{chunk_range, CollectiveOp, CollectiveRecord, ExperimentTrace, RingPhase, RingStep};
use distlab_common::AllReduce;

use crate::format;

/// Bytes per element on the wire: the ring collectives move f32.
const ELEMENT_BYTES: u64 = 4;

/// A collective is named by its group and its sequence number in the group
/// (the same on every member).
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct CollectiveKey {
    pub group: String,
    pub id: u64,
}

impl CollectiveKey {
    /// `dp:0`, for a `<select>` value or a query parameter.
    pub fn to_param(&self) -> String {
        format!("{}:{}", self.group, self.id)
    }

    pub fn parse(s: &str) -> Option<Self> {
        let (group, id) = s.rsplit_once(':')?;
        Some(Self { group: group.to_string(), id: id.parse().ok()? })
    }
}

/// How a collective moved its data.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Schedule {
    /// Round the ring, one chunk per rank: reduce-scatter, then all-gather.
    Ring,
    /// Whole buffers between any two ranks: partial sums up to rank 0 (reduce), the result
    /// back out (broadcast). The naive and tree all-reduces.
    WholeBuffers,
    /// Rings inside each node of consecutive ranks, a ring across the nodes' first ranks
    /// (the leaders), then each leader's whole buffer to the rest of its node.
    Hierarchical,
    /// All-to-all, pairwise: at step s every rank sends the chunk meant for the rank s
    /// places on, into that rank's chunk for the sender.
    Exchange,
}

impl Schedule {
    /// Whether a step of `phase` belongs to this schedule.
    fn has(self, phase: RingPhase) -> bool {
        match self {
            Schedule::Ring => matches!(phase, RingPhase::ReduceScatter | RingPhase::AllGather),
            Schedule::WholeBuffers => matches!(phase, RingPhase::Reduce | RingPhase::Broadcast),
            Schedule::Hierarchical => {
                matches!(phase, RingPhase::ReduceScatter | RingPhase::AllGather | RingPhase::Broadcast)
            }
            Schedule::Exchange => phase == RingPhase::Exchange,
        }
    }

    /// Whether this schedule can run `op`.
    fn runs(self, op: CollectiveOp) -> bool {
        match self {
            Schedule::Ring => {
                matches!(op, CollectiveOp::AllReduce | CollectiveOp::ReduceScatter | CollectiveOp::AllGather)
            }
            Schedule::WholeBuffers | Schedule::Hierarchical => op == CollectiveOp::AllReduce,
            Schedule::Exchange => op == CollectiveOp::AllToAll,
        }
    }
}

/// Which ring a step of the hierarchical all-reduce went round (`Whole` for the others).
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum Level {
    /// The collective's own schedule (ring, naive, tree).
    Whole,
    /// The ring inside each node.
    InsideNodes,
    /// The ring across the nodes' leaders.
    AcrossLeaders,
    /// Each leader's result to the rest of its node.
    ToNodes,
}

/// A collective the trace holds in detail, that the replay can draw.
#[derive(Clone, Debug, PartialEq)]
pub struct CollectiveInfo {
    pub key: CollectiveKey,
    pub op: CollectiveOp,
    pub schedule: Schedule,
    /// Global ranks of the group in ring order.
    pub ranks: Vec<u32>,
    pub elements: u64,
    /// How many of the group's ranks recorded it (all of them once the run is over).
    pub recorded_by: usize,
    /// Ring steps recorded, over all ranks.
    pub steps: usize,
    /// Whether every recorded step carries its numbers (small buffers, the demo).
    pub has_values: bool,
}

impl CollectiveInfo {
    /// "#0 all_reduce · 16 elements · 4 ranks (dp)".
    pub fn label(&self) -> String {
        format!(
            "#{} {} · {} element{} · {} ranks ({}){}",
            self.key.id,
            self.op.as_str(),
            self.elements,
            if self.elements == 1 { "" } else { "s" },
            self.ranks.len(),
            self.key.group,
            if self.has_values { " · with numbers" } else { "" }
        ) + match self.schedule {
            Schedule::Ring => "",
            Schedule::WholeBuffers => " · whole buffers, not a ring",
            Schedule::Hierarchical => " · hierarchical: rings inside nodes, then across them",
            Schedule::Exchange => " · every rank to every other, pairwise",
        }
    }
}

/// Whether the replay can draw this operation (the schedules with chunks).
pub fn replayable(op: CollectiveOp) -> bool {
    matches!(
        op,
        CollectiveOp::AllReduce | CollectiveOp::ReduceScatter | CollectiveOp::AllGather | CollectiveOp::AllToAll
    )
}

/// The steps of `record` among `steps` (recorded by `rank`) that belong to `schedule`:
/// same id, sent by this rank (on a ring: to its right neighbour) to a rank of this group,
/// during the collective's time window (a rank can be in two groups whose collectives
/// share ids).
fn steps_of<'a>(
    rank: u32,
    record: &'a CollectiveRecord,
    steps: &'a [RingStep],
    schedule: Schedule,
) -> impl Iterator<Item = &'a RingStep> + 'a {
    let w = record.ranks.len();
    let next = record.ranks.iter().position(|&r| r == rank).map(|p| record.ranks[(p + 1) % w.max(1)]);
    steps.iter().filter(move |s| {
        of_record(rank, record, s)
            && schedule.has(s.phase)
            && match schedule {
                Schedule::Ring => Some(s.to) == next,
                Schedule::WholeBuffers | Schedule::Hierarchical | Schedule::Exchange => record.ranks.contains(&s.to),
            }
    })
}

/// Whether `step` is one `rank` sent during `record`.
fn of_record(rank: u32, record: &CollectiveRecord, step: &RingStep) -> bool {
    step.collective == record.id
        && step.from == rank
        && step.start_us >= record.start_us
        && step.start_us <= record.end_us
}

/// Whether `schedule` takes every step `rank` recorded of `record`.
fn fits(schedule: Schedule, rank: u32, record: &CollectiveRecord, steps: &[RingStep]) -> bool {
    let all = steps.iter().filter(|s| of_record(rank, record, s)).count();
    schedule.runs(record.op) && steps_of(rank, record, steps, schedule).count() == all
}

/// Every ring collective of the trace recorded in detail, ordered by group and id. Its
/// schedule is the first of ring, whole buffers, hierarchical that takes every step of
/// every rank (a rank of a hierarchical all-reduce's node only ever sends round its node's
/// ring; a plain ring is also a hierarchical all-reduce of one node).
pub fn ring_collectives(trace: &ExperimentTrace) -> Vec<CollectiveInfo> {
    // Each collective's records, with their rank's steps.
    type Recorded<'a> = Vec<(u32, &'a CollectiveRecord, &'a [RingStep])>;
    let mut recorded: BTreeMap<CollectiveKey, Recorded<'_>> = BTreeMap::new();
    for rank in &trace.ranks {
        for record in rank.comm.collectives.iter().filter(|r| replayable(r.op) && r.ranks.len() >= 2) {
            let key = CollectiveKey { group: record.group.clone(), id: record.id };
            recorded.entry(key).or_default().push((rank.rank, record, &rank.comm.steps));
        }
    }
    let mut found = Vec::new();
    for (key, records) in recorded {
        let every_rank = |schedule| records.iter().all(|&(rank, record, steps)| fits(schedule, rank, record, steps));
        let schedules = [Schedule::Ring, Schedule::WholeBuffers, Schedule::Hierarchical, Schedule::Exchange];
        let Some(schedule) = schedules.into_iter().find(|&s| every_rank(s)) else {
            continue;
        };
        let (_, first, _) = records[0];
        let mut info = CollectiveInfo {
            key,
            op: first.op,
            schedule,
            ranks: first.ranks.clone(),
            elements: first.elements,
            recorded_by: records.len(),
            steps: 0,
            has_values: true,
        };
        for &(rank, record, steps) in &records {
            let taken: Vec<&RingStep> = steps_of(rank, record, steps, schedule).collect();
            info.steps += taken.len();
            info.has_values &= taken.iter().all(|s| s.values.is_some());
        }
        if info.steps > 0 {
            found.push(info);
        }
    }
    found
}

/// The collective the replay opens on (`list` in [`ring_collectives`]' order): the first that gives every rank of its ring at
/// least one element (a gradient bucket's all-reduce, a unit's reduce-scatter, the demo's
/// collective), not a one-number all-reduce of the loss cut into empty chunks; where there
/// is none, the first with recorded numbers, else the first.
pub fn opening_collective(list: &[CollectiveInfo]) -> Option<&CollectiveInfo> {
    list.iter()
        .find(|c| c.elements >= c.ranks.len() as u64)
        .or_else(|| list.iter().find(|c| c.has_values))
        .or(list.first())
}

/// What a chunk of a rank's buffer holds, for its colour.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ChunkKind {
    /// Nothing yet (an all-gather's rank starts with its own chunk only).
    Empty,
    /// The rank's own data, untouched.
    Own,
    /// A sum of some ranks' contributions, not all yet.
    Partial,
    /// The sum over every rank, computed here.
    Complete,
    /// A finished chunk copied from the left neighbour (all-gather).
    Gathered,
}

impl ChunkKind {
    pub fn class(self) -> &'static str {
        match self {
            ChunkKind::Empty => "chunk-empty",
            ChunkKind::Own => "chunk-own",
            ChunkKind::Partial => "chunk-partial",
            ChunkKind::Complete => "chunk-complete",
            ChunkKind::Gathered => "chunk-gathered",
        }
    }
}

/// One chunk of one rank's buffer at one moment.
#[derive(Clone, Debug, PartialEq)]
pub struct ChunkState {
    /// The numbers, when they are known (recorded inputs and step values).
    pub values: Option<Vec<f32>>,
    /// Whose contributions it holds, by ring position.
    pub holds: Vec<bool>,
    pub kind: ChunkKind,
    /// Written during this frame's step.
    pub received: bool,
    /// Sent during this frame's step (its numbers before the step).
    pub sent: bool,
}

impl ChunkState {
    pub fn count(&self) -> usize {
        self.holds.iter().filter(|&&h| h).count()
    }

    /// The short text under a chunk: "own", "2/4", "4/4 sum", "copy 4/4", "from r2".
    pub fn badge(&self, ranks: &[u32]) -> String {
        let w = self.holds.len();
        match self.kind {
            ChunkKind::Empty => "empty".into(),
            ChunkKind::Own => "own".into(),
            ChunkKind::Partial => format!("{}/{w}", self.count()),
            ChunkKind::Complete => format!("{w}/{w} sum"),
            ChunkKind::Gathered if self.count() == w => format!("copy {w}/{w}"),
            ChunkKind::Gathered => match self.holds.iter().position(|&h| h) {
                Some(p) if self.count() == 1 => format!("from r{}", ranks.get(p).copied().unwrap_or(p as u32)),
                _ => format!("copy {}/{w}", self.count()),
            },
        }
    }
}

/// One chunk crossing one link during a step.
#[derive(Clone, Debug, PartialEq)]
pub struct Transfer {
    /// Ring positions.
    pub from: usize,
    pub to: usize,
    /// The chunk, numbered in the ring it went round (0 for a whole buffer).
    pub chunk: usize,
    /// The replay's chunks it covers (one but for the hierarchical all-reduce, whose two
    /// rings cut the buffer differently: its chunks are the pieces both cuts make).
    pub covers: Range<usize>,
    pub bytes: u64,
    /// The numbers it carried, as recorded by the sender.
    pub values: Option<Vec<f32>>,
    /// Added into the receiver's chunk (reduce-scatter) or copied over it (all-gather).
    pub reduce: bool,
    /// How many ranks' contributions it carried.
    pub carried: usize,
    pub start_us: u64,
    pub end_us: u64,
}

/// The state after one step (frame 0: before the first).
#[derive(Clone, Debug, PartialEq)]
pub struct Frame {
    /// The step shown: None for the initial state.
    pub phase: Option<RingPhase>,
    /// Which ring it went round (hierarchical); `Whole` otherwise.
    pub level: Level,
    /// 0-based within its phase.
    pub step: u32,
    /// The transfers of this step, in ring order of the sender.
    pub transfers: Vec<Transfer>,
    /// `buffers[position][chunk]`.
    pub buffers: Vec<Vec<ChunkState>>,
    /// Bytes each position has sent so far.
    pub bytes_sent: Vec<u64>,
}

impl Transfer {
    /// "chunk 2", or "chunks 2-3" for a transfer covering several of the replay's chunks.
    pub fn chunks_label(&self) -> String {
        match self.covers.len() {
            0 | 1 => format!("chunk {}", self.covers.start),
            _ => format!("chunks {}-{}", self.covers.start, self.covers.end - 1),
        }
    }
}

impl Frame {
    /// Microseconds from the first transfer's start to the last one's end.
    pub fn duration_us(&self) -> Option<u64> {
        let start = self.transfers.iter().map(|t| t.start_us).min()?;
        let end = self.transfers.iter().map(|t| t.end_us).max()?;
        Some(end.saturating_sub(start))
    }
}

/// A whole collective replayed step by step.
#[derive(Clone, Debug, PartialEq)]
pub struct Replay {
    pub info: CollectiveInfo,
    /// Chunk `c` covers these elements of the full buffer.
    pub chunks: Vec<Range<usize>>,
    /// Frame 0 is the recorded inputs; frame k the state after step k.
    pub frames: Vec<Frame>,
    /// Recorded per position (small buffers only).
    pub inputs: Vec<Option<Vec<f32>>>,
    pub outputs: Vec<Option<Vec<f32>>>,
    /// Reduce-scatter steps in the schedule (W-1 when the op has that phase); for whole
    /// buffers, the reduce steps recorded.
    pub rs_steps: u32,
    /// All-gather steps (W-1); for whole buffers, the broadcast steps recorded.
    pub ag_steps: u32,
    /// Whole buffers: the all-reduce algorithm the steps follow (naive: every transfer to
    /// or from rank 0; tree otherwise); hierarchical.
    pub algorithm: AllReduce,
    /// Hierarchical: ranks per node, as the broadcasts back into the nodes show (1 else).
    pub ranks_per_node: usize,
    /// Things a learner should know about this replay (missing ranks, local changes).
    pub notes: Vec<String>,
}

/// Where a recorded step goes in the replay's order: (phase: 0 reducing, 1 copying; then
/// the send's end (whole buffers) or 0; then the ring step or the sender).
type StepKey = (u8, u64, u32);

/// What reaches a receiver in one step: (receiver, chunk, whose contributions, numbers).
type Delivery = (usize, usize, Vec<bool>, Option<Vec<f32>>);

/// Equal up to float rounding (sums in another order).
fn close(a: f32, b: f32) -> bool {
    (a - b).abs() <= 1e-5 * a.abs().max(b.abs()).max(1.0)
}

fn max_diff(a: &[f32], b: &[f32]) -> Option<f32> {
    (a.len() == b.len()).then(|| a.iter().zip(b).map(|(x, y)| (x - y).abs()).fold(0.0, f32::max))
}

fn all_close(a: &[f32], b: &[f32]) -> bool {
    a.len() == b.len() && a.iter().zip(b).all(|(x, y)| close(*x, *y))
}

/// Where a hierarchical step ran, for a label.
pub fn level_name(level: Level) -> &'static str {
    match level {
        Level::Whole => "",
        Level::InsideNodes => "inside the nodes",
        Level::AcrossLeaders => "across the leaders",
        Level::ToNodes => "back into the nodes",
    }
}

fn numbers(values: &[f32]) -> String {
    values.iter().map(|&v| format::value(v)).collect::<Vec<_>>().join(", ")
}

/// The hierarchical all-reduce's node size, from its last steps: each leader sends the
/// result to the other ranks of its node (one node of all `w` when none were recorded).
fn node_size(steps: &[(usize, &RingStep)], w: usize) -> usize {
    let mut sent_to: BTreeMap<usize, Vec<u32>> = BTreeMap::new();
    for (p, s) in steps.iter().filter(|(_, s)| s.phase == RingPhase::Broadcast) {
        let targets = sent_to.entry(*p).or_default();
        if !targets.contains(&s.to) {
            targets.push(s.to);
        }
    }
    sent_to.values().map(|t| t.len() + 1).max().unwrap_or(w)
}

/// The pieces of a buffer of `n` elements that the cuts of every node's ring and of the
/// leaders' ring make together (each ring cuts it into one chunk per member).
fn pieces(n: usize, nodes: &Nodes) -> Vec<Range<usize>> {
    let mut cuts = vec![0, n];
    let rings = nodes.leaders().into_iter().map(|leader| nodes.members(leader).len()).chain([nodes.count]);
    for size in rings.filter(|&size| size > 0) {
        cuts.extend((0..size).map(|c| chunk_range(n, size, c).start));
    }
    cuts.sort_unstable();
    cuts.dedup();
    cuts.windows(2).map(|c| c[0]..c[1]).collect()
}

/// The numbers of consecutive chunks end to end, when every one is known.
fn joined(chunks: &[ChunkState]) -> Option<Vec<f32>> {
    let mut out = Vec::new();
    for c in chunks {
        out.extend_from_slice(c.values.as_ref()?);
    }
    Some(out)
}

impl Replay {
    /// Replays collective `key` of `trace`; None when the trace does not hold it in detail.
    pub fn build(trace: &ExperimentTrace, key: &CollectiveKey) -> Option<Replay> {
        let info = ring_collectives(trace).into_iter().find(|c| &c.key == key)?;
        let w = info.ranks.len();
        let position = |rank: u32| info.ranks.iter().position(|&r| r == rank);
        let elements = info.elements as usize;
        let mut notes = Vec::new();

        // Each member's record and steps.
        let mut inputs = vec![None; w];
        let mut outputs = vec![None; w];
        let mut recorded = vec![false; w];
        let mut steps: Vec<(usize, &RingStep)> = Vec::new();
        for rank in &trace.ranks {
            let Some(p) = position(rank.rank) else { continue };
            let Some(record) = rank.comm.collectives.iter().find(|c| c.group == key.group && c.id == key.id) else {
                continue;
            };
            recorded[p] = true;
            inputs[p] = record.input.clone();
            outputs[p] = record.output.clone();
            steps.extend(steps_of(rank.rank, record, &rank.comm.steps, info.schedule).map(|s| (p, s)));
        }
        // A ring cuts the buffer into one chunk per rank; whole buffers are one chunk; the
        // hierarchical all-reduce's rings cut it by their sizes, into these pieces.
        let ranks_per_node = if info.schedule == Schedule::Hierarchical { node_size(&steps, w) } else { 1 };
        let nodes = Nodes::new(w, ranks_per_node);
        let chunks: Vec<Range<usize>> = match info.schedule {
            Schedule::Ring | Schedule::Exchange => (0..w).map(|c| chunk_range(elements, w, c)).collect(),
            Schedule::WholeBuffers => std::iter::once(0..elements).collect(),
            Schedule::Hierarchical => pieces(elements, &nodes),
        };
        let n_chunks = chunks.len();
        // The replay's chunks inside `range` of the buffer.
        let covering = |range: Range<usize>| {
            let first = chunks.iter().position(|c| c.start >= range.start).unwrap_or(n_chunks);
            let end = chunks.iter().position(|c| c.end > range.end).unwrap_or(n_chunks);
            first..end.max(first)
        };
        let missing: Vec<String> =
            (0..w).filter(|&p| !recorded[p]).map(|p| format!("rank {}", info.ranks[p])).collect();
        if !missing.is_empty() {
            notes.push(format!("No trace from {} yet: their sends are missing from the replay.", missing.join(", ")));
        }

        // Frame 0: the recorded inputs. An all-gather's input is the rank's own chunk only.
        let mut buffers: Vec<Vec<ChunkState>> = (0..w)
            .map(|p| {
                (0..n_chunks)
                    .map(|c| {
                        let mut holds = vec![false; w];
                        let starts_with_it = info.op != CollectiveOp::AllGather || c == p;
                        holds[p] = starts_with_it;
                        let values = match (&inputs[p], info.op) {
                            (Some(input), CollectiveOp::AllGather) if c == p && input.len() == chunks[c].len() => {
                                Some(input.clone())
                            }
                            (Some(input), op) if op != CollectiveOp::AllGather && input.len() == elements => {
                                Some(input[chunks[c].clone()].to_vec())
                            }
                            _ => None,
                        };
                        ChunkState {
                            values,
                            holds,
                            kind: if starts_with_it { ChunkKind::Own } else { ChunkKind::Empty },
                            received: false,
                            sent: false,
                        }
                    })
                    .collect()
            })
            .collect();
        if w == 1 {
            for chunk in buffers.iter_mut().flatten() {
                chunk.kind = ChunkKind::Complete;
            }
        }
        let mut bytes_sent = vec![0u64; w];
        let mut frames = vec![Frame {
            phase: None,
            level: Level::Whole,
            step: 0,
            transfers: Vec::new(),
            buffers: buffers.clone(),
            bytes_sent: bytes_sent.clone(),
        }];

        // The recorded steps: on a ring grouped by (phase, step), reduce-scatter first (all
        // ranks send at once); whole buffers one transfer at a time, reduce first, in the
        // order they were taken (a send ends when its receiver has it; a rank forwards a sum
        // only after it arrived).
        // Hierarchical: inside the nodes (reduce-scatter, all-gather), across the leaders
        // (the same), then back into the nodes, each ring step by step.
        let level_of = |p: usize, s: &RingStep| match (s.phase, position(s.to)) {
            (RingPhase::Broadcast, _) => Level::ToNodes,
            (_, Some(to)) if nodes.members(p).contains(&to) => Level::InsideNodes,
            _ => Level::AcrossLeaders,
        };
        let mut by_step: BTreeMap<StepKey, Vec<(usize, &RingStep)>> = BTreeMap::new();
        for (p, s) in steps {
            let order = u8::from(!matches!(s.phase, RingPhase::ReduceScatter | RingPhase::Reduce));
            let key = match info.schedule {
                Schedule::Ring => (order, 0, s.step),
                Schedule::WholeBuffers => (order, s.end_us, s.from),
                Schedule::Exchange => (0, 0, s.step),
                Schedule::Hierarchical => {
                    let stage = match level_of(p, s) {
                        Level::AcrossLeaders => 2 + order,
                        Level::ToNodes => 4,
                        _ => order,
                    };
                    (stage, 0, s.step)
                }
            };
            by_step.entry(key).or_default().push((p, s));
        }
        let mut changed_locally = Vec::new();
        let mut phase_counts = [0u32; 2];
        for ((order, _, ring_step), mut sends) in by_step {
            sends.sort_by_key(|(p, _)| *p);
            let level = match info.schedule {
                Schedule::Hierarchical => sends.first().map_or(Level::Whole, |&(p, s)| level_of(p, s)),
                _ => Level::Whole,
            };
            let reduce = order % 2 == 0 && level != Level::ToNodes;
            let reduce = reduce && info.schedule != Schedule::Exchange;
            let (phase, step) = match info.schedule {
                Schedule::Ring => (if reduce { RingPhase::ReduceScatter } else { RingPhase::AllGather }, ring_step),
                Schedule::Exchange => (RingPhase::Exchange, ring_step),
                Schedule::WholeBuffers => {
                    phase_counts[usize::from(order)] += 1;
                    (
                        if reduce { RingPhase::Reduce } else { RingPhase::Broadcast },
                        phase_counts[usize::from(order)] - 1,
                    )
                }
                Schedule::Hierarchical => match (level, reduce) {
                    (Level::ToNodes, _) => (RingPhase::Broadcast, ring_step),
                    (_, true) => (RingPhase::ReduceScatter, ring_step),
                    _ => (RingPhase::AllGather, ring_step),
                },
            };
            for chunk in buffers.iter_mut().flatten() {
                chunk.received = false;
                chunk.sent = false;
            }
            // Every rank sends what it held before the step, at the same time.
            let mut transfers = Vec::new();
            for (from, s) in sends {
                let Some(to) = position(s.to) else { continue };
                // The elements the step carried: a chunk of the ring it went round (of the
                // node's ring or the leaders' for the hierarchical all-reduce), or all.
                let c = s.chunk as usize;
                let ring = match (info.schedule, level_of(from, s)) {
                    (Schedule::Ring | Schedule::Exchange, _) => w,
                    (Schedule::WholeBuffers, _) | (_, Level::ToNodes) => 1,
                    (_, Level::InsideNodes) => nodes.members(from).len(),
                    _ => nodes.count,
                };
                if c >= ring {
                    notes.push(format!("rank {} recorded a step with chunk {c} of {ring}: skipped", s.from));
                    continue;
                }
                if info.schedule == Schedule::Exchange {
                    // The sender's input is not its output: it sends chunk c of its vector
                    // (its own numbers) into the receiver's chunk for the sender.
                    transfers.push(Transfer {
                        from,
                        to,
                        chunk: c,
                        covers: from..from + 1,
                        bytes: s.bytes,
                        values: s.values.clone(),
                        reduce: false,
                        carried: 1,
                        start_us: s.start_us,
                        end_us: s.end_us,
                    });
                    continue;
                }
                let covers = covering(chunk_range(elements, ring, c));
                let held = joined(&buffers[from][covers.clone()]);
                if let (Some(held), Some(sent)) = (&held, &s.values) {
                    if !all_close(held, sent) {
                        changed_locally.push(format!(
                            "rank {} sent chunk {c} as [{}] where the replay had [{}]",
                            s.from,
                            numbers(sent),
                            numbers(held)
                        ));
                    }
                }
                // What went over the wire is what the sender held: trust the recording.
                let mut at = 0;
                for c in covers.clone() {
                    let (len, piece) = (chunks[c].len(), &mut buffers[from][c]);
                    if let Some(sent) = &s.values {
                        piece.values = sent.get(at..at + len).map(<[f32]>::to_vec);
                    }
                    piece.sent = true;
                    at += len;
                }
                // (a ring's chunk is empty where the buffer is shorter than the ring)
                let carried = buffers[from].get(covers.start).map_or(0, ChunkState::count);
                transfers.push(Transfer {
                    from,
                    to,
                    chunk: c,
                    covers,
                    bytes: s.bytes,
                    values: s.values.clone(),
                    reduce,
                    carried,
                    start_us: s.start_us,
                    end_us: s.end_us,
                });
            }
            let mut deliveries: Vec<Delivery> = Vec::new();
            for t in &transfers {
                let mut at = 0;
                for c in t.covers.clone() {
                    let len = chunks[c].len();
                    let values = t.values.as_ref().and_then(|v| v.get(at..at + len)).map(<[f32]>::to_vec);
                    let holds = match info.schedule {
                        Schedule::Exchange => (0..w).map(|p| p == t.from).collect(),
                        _ => buffers[t.from][c].holds.clone(),
                    };
                    deliveries.push((t.to, c, holds, values));
                    at += len;
                }
            }
            for (to, c, holds, values) in deliveries {
                let chunk = &mut buffers[to][c];
                if reduce {
                    chunk.values = match (chunk.values.take(), values) {
                        (Some(mine), Some(incoming)) if mine.len() == incoming.len() => {
                            Some(mine.iter().zip(&incoming).map(|(a, b)| a + b).collect())
                        }
                        _ => None,
                    };
                    for (h, x) in chunk.holds.iter_mut().zip(holds) {
                        *h |= x;
                    }
                    chunk.kind = if chunk.count() == w { ChunkKind::Complete } else { ChunkKind::Partial };
                } else {
                    chunk.values = values;
                    chunk.holds = holds;
                    chunk.kind = ChunkKind::Gathered;
                }
                chunk.received = true;
            }
            for t in &transfers {
                bytes_sent[t.from] += t.bytes;
            }
            frames.push(Frame {
                phase: Some(phase),
                level,
                step,
                transfers,
                buffers: buffers.clone(),
                bytes_sent: bytes_sent.clone(),
            });
        }
        if !changed_locally.is_empty() {
            notes.push(format!(
                "Between steps a rank changed a chunk it owned (an average divides the finished sum by {w}): {}.",
                changed_locally.join("; ")
            ));
        }
        let has = |phase| info.op == CollectiveOp::AllReduce || info.op == phase;
        let phase_steps = (w as u32).saturating_sub(1);
        let (rs_steps, ag_steps, algorithm) = match info.schedule {
            Schedule::Ring => (
                if has(CollectiveOp::ReduceScatter) { phase_steps } else { 0 },
                if has(CollectiveOp::AllGather) { phase_steps } else { 0 },
                AllReduce::Ring,
            ),
            Schedule::WholeBuffers => {
                let star = frames.iter().flat_map(|f| &f.transfers).all(|t| t.from == 0 || t.to == 0);
                let algorithm = if star { AllReduce::Naive } else { AllReduce::Tree };
                // Every rank but the root sends its sum up once, and gets the result once.
                (phase_counts[0], phase_counts[1], algorithm)
            }
            // W-1 exchange steps (counted with the copies).
            Schedule::Exchange => (0, phase_steps, AllReduce::Ring),
            // Each ring's reduce-scatter and all-gather, then the steps back into the nodes.
            Schedule::Hierarchical => {
                let ring = |size: usize| (size as u32).saturating_sub(1);
                let (inside, across) = (ring(nodes.members(0).len()), ring(nodes.count));
                (inside + across, inside + across + ring(nodes.members(0).len()), AllReduce::Hierarchical)
            }
        };
        if frames.len() - 1 < (rs_steps + ag_steps) as usize && missing.is_empty() {
            notes.push(format!(
                "The trace holds {} of the {} steps of the schedule.",
                frames.len() - 1,
                rs_steps + ag_steps
            ));
        }
        Some(Replay { info, chunks, frames, inputs, outputs, rs_steps, ag_steps, algorithm, ranks_per_node, notes })
    }

    pub fn world(&self) -> usize {
        self.info.ranks.len()
    }

    /// Steps recorded (frames after the initial one).
    pub fn steps(&self) -> usize {
        self.frames.len() - 1
    }

    /// The buffer's size in bytes (D in the formulas).
    pub fn buffer_bytes(&self) -> u64 {
        self.info.elements * ELEMENT_BYTES
    }

    /// What each rank sends on a ring, in the textbook: 2(W-1)/W·D for an all-reduce,
    /// (W-1)/W·D otherwise.
    pub fn formula_bytes(&self) -> f64 {
        let w = self.world() as f64;
        let d = self.buffer_bytes() as f64;
        let phases = if self.info.op == CollectiveOp::AllReduce { 2.0 } else { 1.0 };
        phases * (w - 1.0) / w * d
    }

    /// What position `p` sends by its algorithm's formula: the ring's for every rank; with
    /// whole buffers, D per buffer it sends (`all_reduce::elements_sent`).
    pub fn formula_bytes_of(&self, p: usize) -> f64 {
        match self.info.schedule {
            Schedule::Ring | Schedule::Exchange => self.formula_bytes(),
            Schedule::WholeBuffers | Schedule::Hierarchical => {
                let (n, w) = (self.info.elements as usize, self.world());
                (elements_sent(self.algorithm, n, w, self.ranks_per_node, p) * ELEMENT_BYTES as usize) as f64
            }
        }
    }

    /// "2(W-1)/W × D = 2·3/4 × 64 B = 96 B"; for whole buffers each rank's share next to it.
    pub fn formula_text(&self) -> String {
        let w = self.world();
        let (factor, sym) = if self.info.op == CollectiveOp::AllReduce { ("2·", "2(W-1)/W") } else { ("", "(W-1)/W") };
        let ring = format!(
            "{sym} × D = {factor}{}/{w} × {} B = {} B",
            w.saturating_sub(1),
            self.buffer_bytes(),
            format::value(self.formula_bytes() as f32)
        );
        if matches!(self.info.schedule, Schedule::Ring | Schedule::Exchange) {
            return ring;
        }
        let d = self.buffer_bytes();
        let shares: Vec<String> = (0..w)
            .map(|p| format!("r{} {} B", self.info.ranks[p], format::value(self.formula_bytes_of(p) as f32)))
            .collect();
        let how = match self.algorithm {
            AllReduce::Hierarchical => {
                let nodes = Nodes::new(w, self.ranks_per_node);
                format!(
                    "hierarchical: 2(L-1)/L × D inside each node of L = {} ranks, 2(N-1)/N × D across the N = {} \
                     leaders, and (L-1) × D from each leader into its node",
                    nodes.size, nodes.count
                )
            }
            AllReduce::Naive if w > 3 => {
                format!("naive: (W-1) × D = {} × {d} B through rank 0, D from every other rank", w - 1)
            }
            AllReduce::Naive => {
                "a star (naive; a tree of 3 ranks or fewer is the same star): D per buffer sent".to_string()
            }
            _ => "tree: D per tree edge, up once and down once".to_string(),
        };
        format!("{how} ({}), against the ring's {ring} from every rank", shares.join(", "))
    }

    /// "reduce-scatter step 2 of 3", or "start" for frame 0.
    pub fn phase_label(&self, k: usize) -> String {
        let Some(frame) = self.frames.get(k) else { return String::new() };
        if frame.level != Level::Whole {
            let of = self.frames.iter().filter(|f| f.level == frame.level && f.phase == frame.phase).count();
            let (ring, phase) = (level_name(frame.level), self.phase_name(frame));
            return format!("{ring}: {phase} step {} of {of}", frame.step + 1);
        }
        match frame.phase {
            None => "start: every rank holds its own input".into(),
            Some(RingPhase::ReduceScatter) => {
                format!("reduce-scatter step {} of {}", frame.step + 1, self.rs_steps.max(frame.step + 1))
            }
            Some(RingPhase::AllGather) => {
                format!("all-gather step {} of {}", frame.step + 1, self.ag_steps.max(frame.step + 1))
            }
            Some(RingPhase::Reduce) => {
                format!("reduce step {} of {}", frame.step + 1, self.rs_steps.max(frame.step + 1))
            }
            Some(RingPhase::Broadcast) => {
                format!("broadcast step {} of {}", frame.step + 1, self.ag_steps.max(frame.step + 1))
            }
            Some(RingPhase::PointToPoint) => format!("step {}", frame.step + 1),
            Some(RingPhase::Exchange) => {
                format!("exchange step {} of {}", frame.step + 1, self.ag_steps.max(frame.step + 1))
            }
        }
    }

    /// The numbers each position holds at frame k, as the result of the operation: the
    /// whole buffer (all-reduce, all-gather) or its own chunk (reduce-scatter). None
    /// while a chunk is unknown.
    pub fn result(&self, k: usize, p: usize) -> Option<Vec<f32>> {
        let buffer = self.frames.get(k)?.buffers.get(p)?;
        if self.info.op == CollectiveOp::ReduceScatter {
            return buffer.get(p)?.values.clone();
        }
        let mut out = Vec::with_capacity(self.info.elements as usize);
        for chunk in buffer {
            out.extend_from_slice(chunk.values.as_ref()?);
        }
        Some(out)
    }

    /// What the operation should leave on position p, computed from the recorded
    /// inputs: the element-wise sum (all of it, or chunk p), or the chunks gathered.
    pub fn expected(&self, p: usize) -> Option<Vec<f32>> {
        let w = self.world();
        let n = self.info.elements as usize;
        match self.info.op {
            // Chunk i: chunk p of rank i's vector.
            CollectiveOp::AllToAll => {
                let mut out = Vec::with_capacity(n);
                for input in &self.inputs {
                    let input = input.as_ref()?;
                    out.extend_from_slice(input.get(self.chunks.get(p)?.clone())?);
                }
                Some(out)
            }
            CollectiveOp::AllGather => {
                let mut out = Vec::with_capacity(n);
                for c in 0..w {
                    let input = self.inputs.get(c)?.as_ref()?;
                    if input.len() != self.chunks[c].len() {
                        return None;
                    }
                    out.extend_from_slice(input);
                }
                Some(out)
            }
            _ => {
                let mut sum = vec![0.0f32; n];
                for input in &self.inputs {
                    let input = input.as_ref()?;
                    if input.len() != n {
                        return None;
                    }
                    for (s, x) in sum.iter_mut().zip(input) {
                        *s += x;
                    }
                }
                if self.info.op == CollectiveOp::ReduceScatter {
                    Some(sum[self.chunks.get(p)?.clone()].to_vec())
                } else {
                    Some(sum)
                }
            }
        }
    }

    /// The checks at the end of the replay.
    pub fn verify(&self) -> Verification {
        let last = self.frames.len() - 1;
        let w = self.world();
        let ranks = (0..w)
            .map(|p| {
                let result = self.result(last, p);
                let vs = |other: Option<&Vec<f32>>| match (&result, other) {
                    (Some(r), Some(o)) => match max_diff(r, o) {
                        Some(d) if all_close(r, o) => Check::Equal(d),
                        Some(d) => Check::Differs(d),
                        None => Check::Differs(f32::INFINITY),
                    },
                    _ => Check::Unknown,
                };
                let buffer = &self.frames[last].buffers[p];
                let structure = match self.info.op {
                    CollectiveOp::AllReduce => buffer.iter().all(|c| c.count() == w),
                    CollectiveOp::ReduceScatter => buffer.get(p).is_some_and(|c| c.count() == w),
                    CollectiveOp::AllToAll => buffer.iter().enumerate().all(|(i, c)| c.holds[i] && c.count() == 1),
                    _ => buffer.iter().all(|c| c.kind != ChunkKind::Empty),
                };
                RankCheck {
                    rank: self.info.ranks[p],
                    vs_output: vs(self.outputs[p].as_ref()),
                    vs_inputs: vs(self.expected(p).as_ref()),
                    complete: structure,
                }
            })
            .collect();
        Verification { ranks }
    }

    /// "reduce-scatter", "all-gather", "broadcast" for `frame`'s phase.
    fn phase_name(&self, frame: &Frame) -> &'static str {
        match frame.phase {
            Some(RingPhase::ReduceScatter) => "reduce-scatter",
            Some(RingPhase::AllGather) => "all-gather",
            Some(RingPhase::Reduce) => "reduce",
            Some(RingPhase::Broadcast) => "broadcast",
            _ => "",
        }
    }

    /// [`explain`](Self::explain) for a step of the hierarchical all-reduce.
    fn explain_hierarchical(&self, frame: &Frame) -> String {
        let (w, nodes) = (self.world(), Nodes::new(self.world(), self.ranks_per_node));
        let r = |p: usize| self.info.ranks.get(p).copied().unwrap_or(p as u32);
        let Some(t) = frame.transfers.first() else { return String::new() };
        let numbers = t.values.as_ref().map(|v| format!(" [{}]", numbers(v))).unwrap_or_default();
        let held = frame.buffers[t.to].get(t.covers.start).map_or(0, ChunkState::count);
        let last = frame.step as usize + 1
            == self.frames.iter().filter(|f| f.level == frame.level && f.phase == frame.phase).count();
        let mut text = match (frame.level, frame.phase) {
            (Level::InsideNodes, Some(RingPhase::ReduceScatter)) => format!(
                "Inside each node of {} ranks a ring runs on the fast links: rank {} sent its node ring's chunk {} ({}){numbers} to rank {}, which adds it to its own: {held}/{w} of the ranks' contributions.",
                nodes.size, r(t.from), t.chunk, t.chunks_label(), r(t.to)
            ),
            (Level::InsideNodes, _) => format!(
                "The node's sums go round its ring and are copied: rank {} sent {}{numbers} to rank {}. Every rank of a node ends with the node's sum, {} of the {w} contributions.",
                r(t.from), t.chunks_label(), r(t.to), nodes.size
            ),
            (Level::AcrossLeaders, Some(RingPhase::ReduceScatter)) => format!(
                "Only the {} leaders (each node's first rank) now talk across nodes, on the slow links, in a ring of their own that cuts the buffer in {}: rank {} sent its chunk {} ({}){numbers} to rank {}, which adds its node's sum: {held}/{w}.",
                nodes.count, nodes.count, r(t.from), t.chunk, t.chunks_label(), r(t.to)
            ),
            (Level::AcrossLeaders, _) => format!(
                "The leaders pass the finished chunks round their ring: rank {} copied {}{numbers} to rank {}.",
                r(t.from), t.chunks_label(), r(t.to)
            ),
            _ => format!(
                "Each leader sends the whole result to the other ranks of its node: rank {} to rank {}, who copies it over its buffer.",
                r(t.from), r(t.to)
            ),
        };
        if last && frame.level == Level::ToNodes {
            text.push_str(&format!(" That was the last step: every rank holds the sum. {}.", self.formula_text()));
        } else if last && frame.level == Level::AcrossLeaders && frame.phase == Some(RingPhase::AllGather) {
            text.push_str(" Every leader now holds the sum over all ranks.");
        }
        text
    }

    /// A paragraph for a learner: what happens at frame k, with this run's numbers.
    pub fn explain(&self, k: usize) -> String {
        let Some(frame) = self.frames.get(k) else { return String::new() };
        if frame.level != Level::Whole {
            return self.explain_hierarchical(frame);
        }
        if self.info.schedule == Schedule::Hierarchical && frame.phase.is_none() {
            let (w, nodes) = (self.world(), Nodes::new(self.world(), self.ranks_per_node));
            return format!(
                "Each of the {w} ranks starts with its own {} numbers. The ranks form {} nodes of {} consecutive ranks (think: GPUs in one machine, on fast links). First a ring inside every node, then a ring across the nodes' first ranks, the leaders, alone on the slow links between machines, then each leader sends the result into its node. The two rings cut the buffer into different chunks: each rank's buffer is drawn in the {} pieces both cuts make. Press step (or play) to watch it happen.",
                self.info.elements, nodes.count, nodes.size, self.chunks.len()
            );
        }
        let w = self.world();
        let n = self.info.elements;
        let base = n / w as u64;
        let per_chunk = if base * w as u64 == n { format!("{base}") } else { format!("about {base}") };
        let r = |p: usize| self.info.ranks.get(p).copied().unwrap_or(p as u32);
        let example = frame.transfers.first();
        let example_numbers =
            |t: &Transfer| t.values.as_ref().map(|v| format!(" [{}]", numbers(v))).unwrap_or_default();
        match frame.phase {
            None => {
                let what = match self.info.op {
                    CollectiveOp::AllToAll => format!(
                        "Each of the {w} ranks starts with its own vector of {n} numbers, cut into {w} chunks of {per_chunk}: chunk j is meant for rank j. In {} steps every rank sends each of the others its chunk, one peer per step (the rank 1, 2, ... places after it), and receives theirs in its place.",
                        w - 1
                    ),
                    CollectiveOp::AllGather => format!(
                        "Each of the {w} ranks starts with one chunk of {per_chunk} numbers, its own shard; the other {} chunks of its {n}-element buffer are still empty. In the all-gather every rank will pass chunks to its right neighbour {} times until every rank holds every shard.",
                        w - 1,
                        w - 1
                    ),
                    _ => format!(
                        "Each of the {w} ranks starts with its own vector of {n} numbers, cut into {w} chunks of {per_chunk}. Nobody has sent anything yet. In the reduce-scatter phase each rank will, {} times in a row, pass one chunk to its right neighbour, who adds it to its own copy of that chunk{}.",
                        w - 1,
                        if self.info.op == CollectiveOp::AllReduce {
                            "; then, in the all-gather phase, the finished chunks go round the ring once more and are copied"
                        } else {
                            ""
                        }
                    ),
                };
                format!("{what} Press step (or play) to watch it happen.")
            }
            Some(RingPhase::ReduceScatter) => {
                let s = frame.step as usize + 1;
                let carried = if s == 1 {
                    "only its sender's own numbers".to_string()
                } else {
                    format!("the sum of {s} ranks' contributions")
                };
                let mut text = format!(
                    "All {w} ranks send at the same time, each one chunk to its right neighbour, and each neighbour adds the numbers it receives into its own copy of that chunk. A chunk that arrives carries {carried}; adding the receiver's own makes {}/{w}.",
                    s + 1
                );
                if let Some(t) = example {
                    text.push_str(&format!(
                        " Here rank {} sent chunk {}{} to rank {}, which now holds {}/{w} of that chunk's sum.",
                        r(t.from),
                        t.chunk,
                        example_numbers(t),
                        r(t.to),
                        frame.buffers[t.to][t.chunk].count()
                    ));
                }
                if s as u32 == self.rs_steps {
                    text.push_str(&format!(
                        " That was the last reduce-scatter step: each rank now owns one chunk summed over all {w} ranks (rank r holds chunk r){}.",
                        if self.info.op == CollectiveOp::AllReduce { ", and the rest of its buffer is stale partial sums" } else { ", which is the result of a reduce-scatter" }
                    ));
                } else {
                    text.push_str(" Every link carries one chunk, so the step takes the same time whatever W is.");
                }
                text
            }
            Some(RingPhase::AllGather) => {
                let s = frame.step as usize + 1;
                let mut text = if self.info.op == CollectiveOp::AllReduce {
                    "Now the finished chunks go round: each rank sends a complete chunk to its right neighbour, who copies it over its stale partial sum (no addition this time).".to_string()
                } else {
                    "Each rank sends a chunk it holds to its right neighbour, who copies it into its empty slot."
                        .to_string()
                };
                if let Some(t) = example {
                    text.push_str(&format!(
                        " Here rank {} sent chunk {}{} to rank {}.",
                        r(t.from),
                        t.chunk,
                        example_numbers(t),
                        r(t.to)
                    ));
                }
                let done = s + 1;
                if s as u32 == self.ag_steps {
                    text.push_str(&format!(
                        " That was the last step: every rank holds all {w} chunks{}. Each rank sent {} chunk{} in all: {}.",
                        if self.info.op == CollectiveOp::AllReduce { ", all of them the full sum" } else { "" },
                        self.rs_steps + self.ag_steps,
                        if self.rs_steps + self.ag_steps == 1 { "" } else { "s" },
                        self.formula_text()
                    ));
                } else {
                    text.push_str(&format!(" Every rank now holds {done} of the {w} finished chunks."));
                }
                text
            }
            Some(phase @ (RingPhase::Reduce | RingPhase::Broadcast)) => self.explain_whole_buffers(frame, phase),
            Some(RingPhase::Exchange) => {
                let s = frame.step as usize + 1;
                let mut text = format!(
                    "Every rank sends, at the same time, the chunk of its vector meant for the rank {s} place{} after it; the receiver puts it in its chunk for the sender. Each step uses other links than the last.",
                    if s == 1 { "" } else { "s" }
                );
                if let Some(t) = example {
                    text.push_str(&format!(
                        " Here rank {} sent its chunk {}{} to rank {}, into that rank's chunk {}.",
                        r(t.from),
                        t.chunk,
                        example_numbers(t),
                        r(t.to),
                        t.covers.start
                    ));
                }
                if s as u32 == self.ag_steps {
                    text.push_str(&format!(
                        " That was the last step: chunk i of every rank's vector is what rank i meant for it (its own chunk never moved). {}.",
                        self.formula_text()
                    ));
                }
                text
            }
            Some(RingPhase::PointToPoint) => String::new(),
        }
    }

    /// [`explain`](Self::explain) for a step of the naive or tree all-reduce.
    fn explain_whole_buffers(&self, frame: &Frame, phase: RingPhase) -> String {
        let w = self.world();
        let r = |p: usize| self.info.ranks.get(p).copied().unwrap_or(p as u32);
        let Some(t) = frame.transfers.first() else { return String::new() };
        let numbers = t.values.as_ref().map(|v| format!(" [{}]", numbers(v))).unwrap_or_default();
        let held = frame.buffers[t.to][0].count();
        if phase == RingPhase::Reduce {
            let mut text = format!(
                "Rank {} sends its whole buffer{numbers}, {}, to rank {}, which adds it to its own: it now holds {held}/{w}.",
                r(t.from),
                if t.carried == 1 { "its own numbers".to_string() } else { format!("the sum of {} ranks' numbers", t.carried) },
                r(t.to)
            );
            text.push_str(match self.algorithm {
                AllReduce::Naive => " Every buffer goes to rank 0, one after another: its link carries them all while the others wait.",
                _ => " Up the tree: a rank sends once its children's sums are in, so the partial sums grow as they climb.",
            });
            if frame.step + 1 == self.rs_steps {
                text.push_str(&format!(" Rank {} now holds the complete sum.", r(0)));
            }
            text
        } else {
            let mut text = format!(
                "Rank {} sends the finished sum to rank {}, which copies it over its buffer.",
                r(t.from),
                r(t.to)
            );
            if frame.step + 1 == self.ag_steps {
                text.push_str(&format!(" That was the last step: every rank holds the sum. {}.", self.formula_text()));
            }
            text
        }
    }
}

/// One rank's result against a reference.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Check {
    /// Equal up to float rounding; the largest difference.
    Equal(f32),
    Differs(f32),
    /// The numbers were not recorded (large buffers) or a rank's trace is missing.
    Unknown,
}

#[derive(Clone, Debug, PartialEq)]
pub struct RankCheck {
    pub rank: u32,
    /// The replayed buffer against the `output` the rank recorded.
    pub vs_output: Check,
    /// Against the sum (or gathering) of every rank's recorded input.
    pub vs_inputs: Check,
    /// Whether the contributions add up: every chunk of the result holds every rank's.
    pub complete: bool,
}

#[derive(Clone, Debug, PartialEq)]
pub struct Verification {
    pub ranks: Vec<RankCheck>,
}

impl Verification {
    pub fn all_match_output(&self) -> bool {
        !self.ranks.is_empty() && self.ranks.iter().all(|r| matches!(r.vs_output, Check::Equal(_)))
    }

    pub fn all_match_inputs(&self) -> bool {
        !self.ranks.is_empty() && self.ranks.iter().all(|r| matches!(r.vs_inputs, Check::Equal(_)))
    }

    pub fn all_complete(&self) -> bool {
        !self.ranks.is_empty() && self.ranks.iter().all(|r| r.complete)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use distlab_common::trace::{RankCommTrace, RankTrace};
    use distlab_common::CollectiveDemo;

    fn fixture(name: &str) -> ExperimentTrace {
        let text = match name {
            "allreduce-4x16" => include_str!("../tests/fixtures/allreduce-4x16.trace.json"),
            "allreduce-3x10" => include_str!("../tests/fixtures/allreduce-3x10.trace.json"),
            "reduce-scatter-4x16" => include_str!("../tests/fixtures/reduce-scatter-4x16.trace.json"),
            "all-gather-4x16" => include_str!("../tests/fixtures/all-gather-4x16.trace.json"),
            "ddp-2ranks" => include_str!("../tests/fixtures/ddp-2ranks-3steps.trace.json"),
            "naive-4x6" => include_str!("../tests/fixtures/naive-allreduce-4x6.trace.json"),
            "tree-5x6" => include_str!("../tests/fixtures/tree-allreduce-5x6.trace.json"),
            "hierarchical-6x6" => include_str!("../tests/fixtures/hierarchical-allreduce-6x6.trace.json"),
            "all-to-all-4x8" => include_str!("../tests/fixtures/all-to-all-4x8.trace.json"),
            "hierarchical-4x1" => include_str!("../tests/fixtures/hierarchical-allreduce-4x1.trace.json"),
            other => panic!("no fixture {other}"),
        };
        serde_json::from_str(text).expect("fixture parses as ExperimentTrace")
    }

    /// A training run opens on its first gradient bucket, not on the loss's one-number
    /// all-reduce (whose numbers are recorded, the bucket's are not).
    #[test]
    fn the_replay_opens_on_the_first_collective_worth_watching() {
        let mut list = ring_collectives(&fixture("ddp-2ranks"));
        assert!(list.len() >= 3 && list.iter().all(|c| !c.has_values), "{list:?}");
        let scalar = CollectiveInfo {
            key: CollectiveKey { group: "dp".into(), id: 0 },
            elements: 1,
            has_values: true,
            ..list[0].clone()
        };
        for c in &mut list {
            c.key.id += 1;
        }
        list.insert(0, scalar);
        let opened = opening_collective(&list).unwrap();
        assert_eq!((opened.key.id, opened.elements), (1, 110336), "{opened:?}");
        // A demo's collective is the one there is.
        let demo = ring_collectives(&fixture("allreduce-4x16"));
        assert_eq!(opening_collective(&demo).unwrap().key, dp0());
        // Only scalars: the first with numbers.
        assert_eq!(opening_collective(&list[..1]).unwrap().elements, 1);
        assert!(opening_collective(&[]).is_none());
    }

    fn dp0() -> CollectiveKey {
        CollectiveKey { group: "dp".into(), id: 0 }
    }

    fn demo_sum(world: usize, elements: usize) -> Vec<f32> {
        (0..elements).map(|i| (0..world).map(|r| CollectiveDemo::initial_value(r, i)).sum()).collect()
    }

    /// The naive (4 ranks) and tree (5 ranks) all-reduce demos: whole buffers, each
    /// transfer its own frame in the order it was sent, rank 0 complete after the last
    /// reduce, every rank the sum at the end, and each rank's bytes its algorithm's.
    #[test]
    fn whole_buffer_all_reduces_replay_to_the_sum_with_their_own_bytes() {
        for (name, w, algorithm) in [("naive-4x6", 4, AllReduce::Naive), ("tree-5x6", 5, AllReduce::Tree)] {
            let trace = fixture(name);
            let info = ring_collectives(&trace).into_iter().next().expect("the demo's all-reduce");
            assert_eq!(info.schedule, Schedule::WholeBuffers, "{name}");
            assert!(info.label().contains("whole buffers"), "{name}");
            let replay = Replay::build(&trace, &dp0()).unwrap();
            assert_eq!(replay.algorithm, algorithm, "{name}");
            assert_eq!(replay.chunks, vec![0..6]);
            // W-1 sums go up, W-1 copies come down, one transfer per frame.
            assert_eq!((replay.rs_steps, replay.ag_steps), ((w - 1) as u32, (w - 1) as u32), "{name}");
            assert!(replay.frames[1..].iter().all(|f| f.transfers.len() == 1), "{name}");
            let last_reduce = &replay.frames[w - 1];
            assert_eq!(last_reduce.phase, Some(RingPhase::Reduce));
            assert_eq!(last_reduce.buffers[0][0].kind, ChunkKind::Complete, "{name}: rank 0 holds the sum");
            assert_eq!(replay.frames[w].phase, Some(RingPhase::Broadcast));
            let end = replay.frames.len() - 1;
            for p in 0..w {
                assert_eq!(replay.result(end, p), Some(demo_sum(w, 6)), "{name} rank {p}");
                let sent = replay.frames[end].bytes_sent[p] as f64;
                assert_eq!(sent, replay.formula_bytes_of(p), "{name} rank {p}: its algorithm's bytes");
            }
            // In buffers: rank 0 sends W-1 in the naive one, the others one each; in the tree a
            // rank sends one up and one to each child (rank 0's children: 1, 2, 4; rank 2's: 3).
            let d = replay.buffer_bytes() as f64;
            let buffers: Vec<f64> = (0..w).map(|p| replay.formula_bytes_of(p) / d).collect();
            let want =
                if algorithm == AllReduce::Naive { vec![3.0, 1.0, 1.0, 1.0] } else { vec![3.0, 1.0, 2.0, 1.0, 1.0] };
            assert_eq!(buffers, want, "{name}");
            let v = replay.verify();
            assert!(v.all_match_output() && v.all_match_inputs() && v.all_complete(), "{name}: {v:?}");
            assert!(replay.explain(1).contains("sends its whole buffer"), "{name}");
            assert!(replay.formula_text().contains("against the ring's"), "{name}");
        }
    }

    /// The hierarchical all-reduce demo (6 ranks, nodes of 3, 6 numbers): the node rings
    /// cut the buffer in 3, the leaders' ring in 2, so the replay draws the 4 pieces both
    /// cuts make; each ring's steps in turn, then the leaders' results into their nodes;
    /// every rank ends with the sum, having sent its share of the formula.
    #[test]
    fn the_hierarchical_all_reduce_replays_ring_by_ring_to_the_sum() {
        let trace = fixture("hierarchical-6x6");
        let info = ring_collectives(&trace).into_iter().next().expect("the demo's all-reduce");
        assert_eq!(info.schedule, Schedule::Hierarchical);
        assert!(info.label().contains("hierarchical"));
        let replay = Replay::build(&trace, &dp0()).unwrap();
        assert_eq!((replay.algorithm, replay.ranks_per_node), (AllReduce::Hierarchical, 3));
        assert_eq!(replay.chunks, vec![0..2, 2..3, 3..4, 4..6]);
        let levels: Vec<(Level, Option<RingPhase>)> = replay.frames.iter().map(|f| (f.level, f.phase)).collect();
        use Level::*;
        use RingPhase::{AllGather as Ag, Broadcast as Bc, ReduceScatter as Rs};
        #[rustfmt::skip]
        let want = vec![
            (Whole, None),
            (InsideNodes, Some(Rs)), (InsideNodes, Some(Rs)), (InsideNodes, Some(Ag)), (InsideNodes, Some(Ag)),
            (AcrossLeaders, Some(Rs)), (AcrossLeaders, Some(Ag)),
            (ToNodes, Some(Bc)), (ToNodes, Some(Bc)),
        ];
        assert_eq!(levels, want);
        // Inside the nodes 3 ranks send at once in each node; across, the 2 leaders.
        assert_eq!(replay.frames[1].transfers.len(), 6);
        assert_eq!(replay.frames[5].transfers.len(), 2);
        assert!(replay.frames[5].transfers.iter().all(|t| [0, 3].contains(&t.from)));
        // After the node rings every chunk holds its node's 3 contributions; after the
        // leaders' reduce-scatter a leader holds one chunk of the leaders' ring complete.
        assert!(replay.frames[4].buffers.iter().flatten().all(|c| c.count() == 3));
        assert!(replay.frames[5].buffers[0][..2].iter().all(|c| c.kind == ChunkKind::Complete));
        assert!(replay.frames[5].buffers[3][2..].iter().all(|c| c.kind == ChunkKind::Complete));
        assert!(replay.frames[5].buffers[0][2..].iter().all(|c| c.kind == ChunkKind::Gathered));
        let end = replay.frames.len() - 1;
        for p in 0..6 {
            assert_eq!(replay.result(end, p), Some(demo_sum(6, 6)), "rank {p}");
            assert_eq!(replay.frames[end].bytes_sent[p] as f64, replay.formula_bytes_of(p), "rank {p}");
        }
        // A leader sends the most: 2(L-1)/L x 6 in its node, 2(N-1)/N x 6 across, and the
        // result to its 2 others; the others only their node ring's share.
        assert_eq!(replay.formula_bytes_of(0), (8 + 6 + 2 * 6) as f64 * 4.0);
        assert_eq!(replay.formula_bytes_of(1), 8.0 * 4.0);
        let v = replay.verify();
        assert!(v.all_match_output() && v.all_match_inputs() && v.all_complete(), "{v:?}");
        assert_eq!(replay.phase_label(1), "inside the nodes: reduce-scatter step 1 of 2");
        assert!(replay.explain(0).contains("4 pieces"));
        assert!(replay.explain(5).contains("leaders"));
        assert!(replay.explain(end).contains("every rank holds the sum"));
        assert!(replay.formula_text().contains("hierarchical"));

        // One number on 4 ranks in nodes of 2: every ring has an empty chunk (a zero-length
        // step), which moves nothing and breaks nothing.
        let tiny = Replay::build(&fixture("hierarchical-4x1"), &dp0()).unwrap();
        assert_eq!(tiny.chunks, vec![0..1]);
        let end = tiny.frames.len() - 1;
        for p in 0..4 {
            assert_eq!(tiny.result(end, p), Some(demo_sum(4, 1)), "rank {p}");
            assert_eq!(tiny.frames[end].bytes_sent[p] as f64, tiny.formula_bytes_of(p));
            let _ = (tiny.explain(p + 1), tiny.phase_label(p + 1));
        }
        let v = tiny.verify();
        assert!(v.all_match_output() && v.all_match_inputs() && v.all_complete(), "{v:?}");
    }

    /// The all-to-all demo (4 ranks, 8 numbers): 3 steps of 4 transfers, each to the rank
    /// 1, 2, 3 places on; at the end chunk i of every rank came from rank i (its own never
    /// moved), the numbers are the inputs' chunks, and every rank sent (W-1)/W x D.
    #[test]
    fn the_all_to_all_replays_pairwise_to_everyone_s_chunk() {
        let trace = fixture("all-to-all-4x8");
        let info = ring_collectives(&trace).into_iter().next().expect("the demo's all-to-all");
        assert_eq!((info.schedule, info.op), (Schedule::Exchange, CollectiveOp::AllToAll));
        let replay = Replay::build(&trace, &dp0()).unwrap();
        assert_eq!(replay.steps(), 3);
        for (k, frame) in replay.frames.iter().enumerate().skip(1) {
            assert_eq!(frame.phase, Some(RingPhase::Exchange));
            assert_eq!(frame.transfers.len(), 4);
            assert!(frame.transfers.iter().all(|t| t.to == (t.from + k) % 4 && t.chunk == t.to), "frame {k}");
            assert!(frame.transfers.iter().all(|t| t.covers == (t.from..t.from + 1)), "into the chunk for the sender");
        }
        let end = replay.frames.len() - 1;
        for p in 0..4 {
            let slots = &replay.frames[end].buffers[p];
            for (i, slot) in slots.iter().enumerate() {
                assert_eq!(slot.kind, if i == p { ChunkKind::Own } else { ChunkKind::Gathered }, "rank {p} chunk {i}");
                assert_eq!(
                    slot.badge(&replay.info.ranks),
                    if i == p { "own".to_string() } else { format!("from r{i}") }
                );
            }
            let want: Vec<f32> =
                (0..4).flat_map(|i| (2 * p..2 * p + 2).map(move |e| CollectiveDemo::initial_value(i, e))).collect();
            assert_eq!(replay.result(end, p), Some(want.clone()), "rank {p}");
            assert_eq!(replay.expected(p), Some(want));
            assert_eq!(replay.frames[end].bytes_sent[p], 24);
        }
        assert_eq!(replay.formula_bytes(), 24.0);
        let v = replay.verify();
        assert!(v.all_match_output() && v.all_match_inputs() && v.all_complete(), "{v:?}");
        assert_eq!(replay.phase_label(1), "exchange step 1 of 3");
        assert!(replay.explain(0).contains("chunk j is meant for rank j"));
        assert!(replay.explain(3).contains("its own chunk never moved"));
    }

    #[test]
    fn the_demo_trace_replays_to_the_sum_on_every_rank() {
        let trace = fixture("allreduce-4x16");
        let list = ring_collectives(&trace);
        assert_eq!(list.len(), 1);
        assert_eq!(list[0].op, CollectiveOp::AllReduce);
        assert_eq!(list[0].recorded_by, 4);
        assert_eq!(list[0].steps, 4 * 6);
        assert!(list[0].has_values);

        let replay = Replay::build(&trace, &dp0()).expect("replay");
        assert_eq!(replay.steps(), 6, "3 reduce-scatter + 3 all-gather steps");
        assert_eq!(replay.notes, Vec::<String>::new());
        let sum = demo_sum(4, 16);
        assert_eq!(sum[0], 1000.0);
        assert_eq!(sum[15], 1060.0);
        for p in 0..4 {
            // Frame 0 is the recorded input: rank r holds (r+1)*100 + i.
            let start: Vec<f32> = (0..16).map(|i| CollectiveDemo::initial_value(p, i)).collect();
            assert_eq!(replay.result(0, p), Some(start));
            assert_eq!(replay.result(6, p), Some(sum.clone()), "rank {p}");
            assert_eq!(replay.frames[6].bytes_sent[p], 96);
            assert!(replay.frames[6].buffers[p].iter().all(|c| c.count() == 4));
        }
        assert_eq!(replay.formula_bytes(), 96.0);
        assert_eq!(replay.formula_text(), "2(W-1)/W × D = 2·3/4 × 64 B = 96 B");
        let v = replay.verify();
        assert!(v.all_match_output() && v.all_match_inputs() && v.all_complete(), "{v:?}");
    }

    /// An all-reduce by another algorithm (a step to a rank other than the ring neighbour,
    /// or a tree's reduce step) is not offered for the ring replay.
    #[test]
    fn an_all_reduce_that_is_not_a_ring_is_not_replayed_as_one() {
        let mut trace = fixture("allreduce-4x16");
        let step = trace.ranks[1].comm.steps.iter_mut().find(|s| s.from == 1).expect("a step of rank 1");
        (step.phase, step.to) = (RingPhase::Reduce, 0);
        assert!(ring_collectives(&trace).is_empty());
    }

    #[test]
    fn partial_sums_grow_by_one_contribution_per_step() {
        let replay = Replay::build(&fixture("allreduce-4x16"), &dp0()).unwrap();
        // Before anything moves: all own data.
        assert!(replay.frames[0].buffers.iter().flatten().all(|c| c.kind == ChunkKind::Own && c.count() == 1));
        for s in 1..=3usize {
            let f = &replay.frames[s];
            assert_eq!(f.phase, Some(RingPhase::ReduceScatter));
            assert_eq!(f.transfers.len(), 4);
            for t in &f.transfers {
                // The textbook schedule comes out of the recording: rank r sends chunk (r-s) mod W.
                assert_eq!(t.to, (t.from + 1) % 4);
                assert_eq!(t.chunk, (t.from + 4 * 2 - s) % 4);
                assert_eq!(t.carried, s);
                let got = &f.buffers[t.to][t.chunk];
                assert!(got.received);
                assert_eq!(got.count(), s + 1);
                assert_eq!(got.kind, if s == 3 { ChunkKind::Complete } else { ChunkKind::Partial });
            }
            assert_eq!(replay.phase_label(s), format!("reduce-scatter step {s} of 3"));
        }
        // After reduce-scatter rank r owns chunk r, complete: the sum 1000 + 4i over its elements.
        for p in 0..4 {
            let chunk = &replay.frames[3].buffers[p][p];
            assert_eq!(chunk.kind, ChunkKind::Complete);
            let want: Vec<f32> = replay.chunks[p].clone().map(|i| 1000.0 + 4.0 * i as f32).collect();
            assert_eq!(chunk.values.as_ref(), Some(&want));
            assert_eq!(chunk.badge(&replay.info.ranks), "4/4 sum");
        }
        // After two steps rank 1 holds chunk 3 = rank 0's 112..115 + rank 1's 212..215 + ... ; check one by hand:
        // step 1: rank 0 sends chunk 3 (112..115) to rank 1 -> 112+212 = 324.
        assert_eq!(replay.frames[1].buffers[1][3].values.as_ref().map(|v| v[0]), Some(324.0));
        assert_eq!(replay.frames[1].buffers[1][3].badge(&replay.info.ranks), "2/4");
        for s in 4..=6 {
            assert_eq!(replay.frames[s].phase, Some(RingPhase::AllGather));
            for t in &replay.frames[s].transfers {
                assert_eq!(replay.frames[s].buffers[t.to][t.chunk].kind, ChunkKind::Gathered);
                assert_eq!(t.carried, 4);
            }
        }
        assert_eq!(replay.phase_label(6), "all-gather step 3 of 3");
        assert_eq!(replay.frames[3].bytes_sent, vec![48; 4]);
        assert!(replay.explain(0).contains("4 chunks of 4"));
        assert!(replay.explain(1).contains("2/4"));
        assert!(replay.explain(6).contains("96 B"));
    }

    #[test]
    fn uneven_chunks_replay_exactly() {
        // 10 elements over 3 ranks: chunks of 4, 3, 3 elements.
        let trace = fixture("allreduce-3x10");
        let replay = Replay::build(&trace, &dp0()).unwrap();
        assert_eq!(replay.chunks, vec![0..4, 4..7, 7..10]);
        assert_eq!(replay.steps(), 4);
        let sum = demo_sum(3, 10);
        for p in 0..3 {
            assert_eq!(replay.result(4, p), Some(sum.clone()));
        }
        assert!(replay.verify().all_match_output());
        // Bytes differ per rank with uneven chunks: what each rank actually sent.
        assert_eq!(replay.frames[4].bytes_sent, vec![52, 56, 52]);
    }

    #[test]
    fn reduce_scatter_and_all_gather_demos() {
        let rs = Replay::build(&fixture("reduce-scatter-4x16"), &dp0()).unwrap();
        assert_eq!(rs.info.op, CollectiveOp::ReduceScatter);
        assert_eq!(rs.steps(), 3);
        let sum = demo_sum(4, 16);
        for p in 0..4 {
            assert_eq!(rs.result(3, p), Some(sum[rs.chunks[p].clone()].to_vec()));
        }
        let v = rs.verify();
        assert!(v.all_match_output() && v.all_match_inputs() && v.all_complete(), "{v:?}");
        assert_eq!(rs.formula_bytes(), 48.0);

        let ag = Replay::build(&fixture("all-gather-4x16"), &dp0()).unwrap();
        assert_eq!(ag.steps(), 3);
        // Rank 2 starts with its chunk only.
        let start = &ag.frames[0].buffers[2];
        assert_eq!(
            start.iter().map(|c| c.kind).collect::<Vec<_>>(),
            vec![ChunkKind::Empty, ChunkKind::Empty, ChunkKind::Own, ChunkKind::Empty]
        );
        assert_eq!(ag.result(0, 2), None);
        let gathered: Vec<f32> = (0..16).map(|i| CollectiveDemo::initial_value(i / 4, i)).collect();
        for p in 0..4 {
            assert_eq!(ag.result(3, p), Some(gathered.clone()));
        }
        assert_eq!(ag.frames[3].buffers[0][2].badge(&ag.info.ranks), "from r2");
        let v = ag.verify();
        assert!(v.all_match_output() && v.all_match_inputs() && v.all_complete(), "{v:?}");
        assert!(ag.phase_label(1).starts_with("all-gather step 1 of 3"));
    }

    #[test]
    fn a_ddp_run_replays_its_gradient_all_reduces_without_numbers() {
        // 3 training steps of DDP on 2 ranks: one 110336-element bucket all-reduced per step.
        let trace = fixture("ddp-2ranks");
        let list = ring_collectives(&trace);
        assert_eq!(list.iter().map(|c| c.key.id).collect::<Vec<_>>(), vec![0, 1, 2]);
        for info in &list {
            assert!(!info.has_values);
            let replay = Replay::build(&trace, &info.key).unwrap();
            assert_eq!(replay.steps(), 2, "1 reduce-scatter + 1 all-gather step");
            assert!(replay.notes.is_empty(), "{:?}", replay.notes);
            // The bytes are what the formula says: 2(W-1)/W * D = D for W = 2.
            assert_eq!(replay.frames[2].bytes_sent, vec![replay.buffer_bytes(); 2]);
            assert_eq!(replay.formula_bytes(), replay.buffer_bytes() as f64);
            let v = replay.verify();
            assert!(v.all_complete() && !v.all_match_output(), "{v:?}");
        }
    }

    /// A synthetic all-reduce over 2 ranks whose owner divides by W between the
    /// phases (an average), and a large one recorded without numbers.
    fn synthetic(values: bool, average: bool) -> ExperimentTrace {
        let input = |r: usize| vec![1.0 + r as f32, 10.0 + r as f32];
        // Sum: [3, 21]; average: [1.5, 10.5].
        let scale = if average { 0.5 } else { 1.0 };
        let out = vec![3.0 * scale, 21.0 * scale];
        let ranks = (0..2u32)
            .map(|r| {
                let ru = r as usize;
                let other = 1 - ru;
                let step = |phase, chunk: usize, v: Vec<f32>| RingStep {
                    collective: 0,
                    phase,
                    step: 0,
                    chunk: chunk as u32,
                    from: r,
                    to: other as u32,
                    bytes: 4,
                    start_us: 10 + ru as u64,
                    end_us: 20,
                    values: values.then_some(v),
                };
                // Rank r sends chunk (r-1) mod 2 = other in reduce-scatter, then its own finished chunk.
                let rs = step(RingPhase::ReduceScatter, other, vec![input(ru)[other]]);
                let ag = step(RingPhase::AllGather, ru, vec![out[ru]]);
                RankTrace {
                    rank: r,
                    world: 2,
                    memory: None,
                    host: None,
                    applied_gradients: Vec::new(),
                    span_steps: 0,
                    spans: vec![],
                    comm: RankCommTrace {
                        rank: r,
                        detail_limit: 16,
                        collectives: vec![CollectiveRecord {
                            id: 0,
                            op: CollectiveOp::AllReduce,
                            group: "dp".into(),
                            ranks: vec![0, 1],
                            elements: 2,
                            bytes_sent: 8,
                            bytes_from_formula: false,
                            start_us: 0,
                            end_us: 100,
                            input: values.then(|| input(ru)),
                            output: values.then(|| out.clone()),
                        }],
                        steps: vec![rs, ag],
                        evaluation: vec![],
                        sent_to: vec![],
                        counters: vec![],
                    },
                }
            })
            .collect();
        ExperimentTrace { ranks }
    }

    #[test]
    fn an_average_is_followed_through_the_recorded_values() {
        let replay = Replay::build(&synthetic(true, true), &dp0()).unwrap();
        assert_eq!(replay.result(2, 0), Some(vec![1.5, 10.5]));
        assert!(replay.verify().all_match_output());
        // Against the plain sum of the inputs it differs, and the page says why.
        assert!(!replay.verify().all_match_inputs());
        assert!(replay.notes.iter().any(|n| n.contains("average")), "{:?}", replay.notes);
        let plain = Replay::build(&synthetic(true, false), &dp0()).unwrap();
        assert!(plain.notes.is_empty() && plain.verify().all_match_inputs());
    }

    #[test]
    fn without_numbers_the_contributions_are_still_tracked() {
        let trace = synthetic(false, false);
        assert!(!ring_collectives(&trace)[0].has_values);
        let replay = Replay::build(&trace, &dp0()).unwrap();
        assert_eq!(replay.result(2, 0), None);
        let v = replay.verify();
        assert!(v.all_complete());
        assert!(v.ranks.iter().all(|r| r.vs_output == Check::Unknown));
        assert_eq!(replay.frames[1].buffers[1][1].kind, ChunkKind::Complete);
    }

    #[test]
    fn a_missing_rank_is_said_and_keys_parse() {
        let mut trace = fixture("allreduce-4x16");
        trace.ranks.remove(2);
        let replay = Replay::build(&trace, &dp0()).unwrap();
        assert!(replay.notes[0].contains("rank 2"), "{:?}", replay.notes);
        assert!(!replay.verify().all_match_output());
        assert_eq!(CollectiveKey::parse("dp:3"), Some(CollectiveKey { group: "dp".into(), id: 3 }));
        assert_eq!(CollectiveKey::parse(&dp0().to_param()), Some(dp0()));
        assert_eq!(CollectiveKey::parse("nonsense"), None);
        assert!(Replay::build(&trace, &CollectiveKey { group: "tp".into(), id: 0 }).is_none());
    }
}
