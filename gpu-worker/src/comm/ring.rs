//! Ring collectives, written out step by step.
//!
//! W ranks stand in a ring; each sends only to its right neighbour (position + 1) and
//! receives only from its left one. A buffer of D elements is cut into W chunks.
//!
//! all-reduce = reduce-scatter, then all-gather:
//!
//! * reduce-scatter, W-1 steps: at step s rank r sends chunk (r-s-1) mod W and receives
//!   chunk (r-s-2) mod W, adding it to its own copy. A chunk picks up one more rank's
//!   contribution per step, so after W-1 steps rank r holds chunk r summed over all ranks.
//! * all-gather, W-1 steps: at step s rank r sends chunk (r-s) mod W (finished) and
//!   receives chunk (r-s-1) mod W, copying it. After W-1 steps every rank has every chunk.
//!
//! Each rank sends (W-1)/W * D elements per phase, so 2(W-1)/W * D for an all-reduce,
//! whatever W is: the ring is bandwidth-optimal. Within a step a chunk streams in pieces,
//! sent on a helper thread while this thread receives and adds, so sending, receiving and
//! reducing overlap and large tensors never sit whole in a pipe. Incoming data is added
//! straight from the shared-memory pipe into the rank's buffer (`transport.rs`, `shm.rs`).
//!
//! A large chunk is not pushed through the pipe at all: the sender posts where it lies, the
//! receiver copies it straight out of the sender's memory (`cma.rs`; piece by piece into a
//! small cache-resident scratch when it adds), and the sender waits until it is taken before
//! it moves on. One copy per byte instead of two, and no helper thread. Fastest of all is a
//! chunk in a buffer from `alloc_shared`, which the peer has mapped: it reads it with plain
//! loads (as NCCL and PyTorch's symmetric memory do with registered buffers).
//!
//! The wire format is f32 unless `set_wire` says bf16 or fp16: then each step rounds what
//! it sends to 2 bytes (half the bytes; a reduce-scatter's partial sums are rounded at
//! every hop, as NCCL's bf16 all-reduce does) and the receiver widens it back, adding in
//! f32. Before an all-gather a rank rounds its own chunk the same way, so that every rank
//! ends with the same values. A 2-byte payload is padded to whole f32 words in the pipe
//! (every frame stays a multiple of 4 bytes); the padding is not counted as sent.
//!
//! The ring is one all-reduce algorithm of several (`set_all_reduce`); the others (the
//! parameter server's naive one, a binary tree, a hierarchy of rings) are in
//! `ring/all_reduce.rs`, built from the same steps.

mod all_reduce;
mod all_to_all;

use std::sync::Arc;
use std::time::Duration;

use distlab_common::trace::*;
use distlab_common::{AllReduce, Precision};

use super::cma;
use super::shm::{Patience, SharedBuffer};
use super::stream_copy::stream_copy;
use super::transport::{post_frame, recv_fd, send_fd, send_frame, Frame, LinkSocket, Mesh, Payload, Receiver, Sender};
use super::{chunk_range, CommError, Communicator, ReduceOp};
use crate::ops::float::{Float, Stored};
use crate::ops::simd::simd_kernel;
use crate::trace::{now_us, CommTracer, VALUE_RECORD_LIMIT};

/// Elements a broadcast forwards at a time (so a chain of ranks pipelines), and elements
/// copied out of a peer's memory at a time when adding them (they stay in cache).
const PIECE: usize = 64 * 1024;
/// Ring steps of at least this many bytes are posted rather than copied through the pipe.
const POST_BYTES: usize = 64 * 1024;
/// Tags of point-to-point messages (collectives use the group's sequence number).
const P2P_TAG: u64 = 1 << 63;

pub struct RingCommunicator {
    name: String,
    /// Global ranks of the group in ring order; `me` is this rank's position.
    members: Vec<usize>,
    me: usize,
    /// Per position: what carries messages to and from that member (shared-memory pipes on
    /// this host, TCP to another), and the socket that tells whether it is alive (None for
    /// self).
    tx: Vec<Option<Sender>>,
    rx: Vec<Option<Receiver>>,
    sockets: Vec<Option<LinkSocket>>,
    /// Per position: that member's process id, and whether it can read our memory.
    pids: Vec<i32>,
    may_post: Vec<bool>,
    /// Where posted pieces land before they are added.
    scratch: Vec<f32>,
    /// The format values cross the wire in (`set_wire`).
    wire: Precision,
    /// How `all_reduce` runs, and `hierarchical`'s node size (`set_all_reduce`).
    algorithm: AllReduce,
    ranks_per_node: usize,
    /// The 2-byte copy of what a step sends.
    packed: Vec<u16>,
    /// Buffers from `alloc_shared`, by number: ours, and every member's (by position).
    shared: Vec<SharedSet>,
    /// Collectives started in this group: the same on every member, checked in each frame.
    seq: u64,
    p2p_sent: Vec<u64>,
    p2p_received: Vec<u64>,
    bytes_sent: u64,
    timeout: Duration,
    tracer: Option<Arc<CommTracer>>,
    /// Steps of the collective in progress, when it is recorded in detail.
    steps: Option<Vec<RingStep>>,
}

/// What is running, for error messages and the trace.
#[derive(Clone, Copy)]
struct Step {
    op: CollectiveOp,
    id: u64,
    phase: RingPhase,
    step: u32,
    steps: u32,
}

impl RingCommunicator {
    /// A communicator over `members` (global ranks, in ring order; must include this rank).
    pub fn new(
        mesh: &Mesh,
        name: &str,
        members: Vec<usize>,
        timeout: Duration,
        tracer: Option<Arc<CommTracer>>,
    ) -> std::io::Result<Self> {
        let me = members.iter().position(|&r| r == mesh.rank).ok_or_else(|| {
            std::io::Error::new(std::io::ErrorKind::InvalidInput, format!("rank {} is not in group {name}", mesh.rank))
        })?;
        let (mut tx, mut rx, mut sockets) = (Vec::new(), Vec::new(), Vec::new());
        let (mut pids, mut may_post) = (Vec::new(), Vec::new());
        for link in mesh.links(&members)? {
            pids.push(link.as_ref().map_or(std::process::id() as i32, |l| l.peer_pid));
            may_post.push(link.as_ref().is_some_and(|l| l.may_post));
            tx.push(link.as_ref().map(|l| l.tx.clone()));
            rx.push(link.as_ref().map(|l| l.rx.clone()));
            sockets.push(link.map(|l| l.socket));
        }
        let n = members.len();
        Ok(Self {
            name: name.to_string(),
            members,
            me,
            tx,
            rx,
            sockets,
            pids,
            may_post,
            scratch: vec![0.0; PIECE],
            wire: Precision::Fp32,
            algorithm: AllReduce::Ring,
            ranks_per_node: 1,
            packed: Vec::new(),
            shared: Vec::new(),
            seq: 0,
            p2p_sent: vec![0; n],
            p2p_received: vec![0; n],
            bytes_sent: 0,
            timeout,
            tracer,
            steps: None,
        })
    }

    /// `all_reduce` runs `algorithm` from now on (`ranks_per_node`: the node size of
    /// `hierarchical`, consecutive positions of the group).
    pub fn set_all_reduce(&mut self, algorithm: AllReduce, ranks_per_node: usize) {
        (self.algorithm, self.ranks_per_node) = (algorithm, ranks_per_node.max(1));
    }

    fn next(&self) -> usize {
        (self.me + 1) % self.members.len()
    }

    fn prev(&self) -> usize {
        (self.me + self.members.len() - 1) % self.members.len()
    }

    /// Every position of the group, in ring order.
    fn whole_ring(&self) -> Vec<usize> {
        (0..self.members.len()).collect()
    }

    fn describe(&self, s: &Step) -> String {
        match s.phase {
            RingPhase::ReduceScatter | RingPhase::AllGather => format!(
                "{} #{} in group {} ({} step {}/{})",
                s.op.as_str(),
                s.id,
                self.name,
                if s.phase == RingPhase::ReduceScatter { "reduce-scatter" } else { "all-gather" },
                s.step + 1,
                s.steps
            ),
            _ => format!("{} #{} in group {}", s.op.as_str(), s.id, self.name),
        }
    }

    fn io_error(&self, e: std::io::Error, s: &Step, peer_pos: usize) -> CommError {
        let collective = self.describe(s);
        let peer = self.members[peer_pos];
        match e.kind() {
            std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut => {
                CommError::Timeout { collective, peer, waited_s: self.timeout.as_secs_f64() }
            }
            _ => CommError::Disconnected { collective, peer, cause: e },
        }
    }

    /// Counts `bytes` sent to the member at position `to`, for the rank and for the link.
    fn sent(&mut self, to: usize, bytes: u64) {
        self.bytes_sent += bytes;
        if let Some(tracer) = &self.tracer {
            tracer.count_sent_to(self.members[to] as u32, bytes);
        }
    }

    /// Starts a collective: its id, and whether it is recorded step by step.
    fn begin(&mut self) -> u64 {
        let id = self.seq;
        self.seq += 1;
        self.steps = match &self.tracer {
            Some(t) if t.wants_detail() => Some(Vec::new()),
            _ => None,
        };
        id
    }

    fn finish(
        &mut self,
        op: CollectiveOp,
        id: u64,
        elements: usize,
        sent_before: u64,
        start_us: u64,
        io: (Option<Vec<f32>>, Option<Vec<f32>>),
    ) {
        let steps = self.steps.take();
        if let Some(tracer) = &self.tracer {
            let detailed = steps.is_some();
            let record = CollectiveRecord {
                id,
                op,
                group: self.name.clone(),
                ranks: self.members.iter().map(|&r| r as u32).collect(),
                elements: elements as u64,
                bytes_sent: self.bytes_sent - sent_before,
                bytes_from_formula: false,
                start_us,
                end_us: now_us(),
                input: if detailed { io.0 } else { None },
                output: if detailed { io.1 } else { None },
            };
            tracer.record(record, steps.unwrap_or_default());
        }
    }

    fn small_copy(&self, buf: &[f32]) -> Option<Vec<f32>> {
        (self.steps.is_some() && buf.len() <= VALUE_RECORD_LIMIT).then(|| buf.to_vec())
    }

    /// One ring step: sends `out` to the right neighbour `next` while receiving `inp.len()`
    /// elements from the left one `prev`, which are added into `inp` (`reduce`) or copied
    /// over it.
    #[allow(clippy::too_many_arguments)]
    fn ring_step(
        &mut self,
        (next, prev): (usize, usize),
        out: &[f32],
        inp: &mut [f32],
        reduce: bool,
        s: Step,
        chunk: usize,
    ) -> Result<(), CommError> {
        let start = now_us();
        let tag = s.id;
        let wire = self.wire;
        // A 2-byte wire sends a rounded copy, padded to whole f32 words.
        let mut packed = std::mem::take(&mut self.packed);
        if wire != Precision::Fp32 {
            packed.clear();
            packed.extend(out.iter().map(|&x| pack(wire, x)));
            packed.resize(out.len().next_multiple_of(2), 0);
        }
        let payload: &[u8] =
            if wire == Precision::Fp32 { bytemuck::cast_slice(out) } else { bytemuck::cast_slice(&packed) };
        let sent_bytes = wire_bytes(wire, out.len());
        let tx = self.tx[next].as_mut().expect("a ring neighbour is another rank");
        let rx = self.rx[prev].as_mut().expect("a ring neighbour is another rank");
        let (to_next, from_prev) =
            (patience(&self.sockets, next, self.timeout), patience(&self.sockets, prev, self.timeout));
        let from = Source { pid: self.pids[prev], position: prev, scratch: &mut self.scratch, shared: &self.shared };
        let in_shared =
            |out: &[f32]| self.shared.iter().enumerate().find_map(|(i, set)| Some((i, set.mine.offset_of(out)?)));
        // Only a rank of this host can take a payload from where it lies.
        let posted = match (wire == Precision::Fp32).then(|| in_shared(out)).flatten() {
            _ if payload.len() < POST_BYTES || !matches!(tx, Sender::Pipe(_)) => None,
            Some((buffer, offset)) => Some(Payload::Shared { buffer: buffer as u32, offset: offset as u64 }),
            None if self.may_post[next] => Some(Payload::Posted { address: payload.as_ptr() as u64 }),
            None => None,
        };
        let (sent, received) = if let (Some(posted), Sender::Pipe(pipe)) = (posted, &mut *tx) {
            // Post, take our own chunk from the left, then wait until the right has taken ours.
            match post_frame(pipe, tag, payload.len(), posted, &to_next) {
                Ok(ticket) => {
                    let received = receive(rx, inp, reduce, wire, tag, &from_prev, from);
                    (pipe.wait_taken(ticket, &to_next), received)
                }
                Err(e) => (Err(e), Ok(())),
            }
        } else if payload.len() <= tx.inline_bytes() {
            let sent = send_frame(tx, tag, payload, &to_next);
            (sent, receive(rx, inp, reduce, wire, tag, &from_prev, from))
        } else {
            std::thread::scope(|scope| {
                let sender = scope.spawn(|| send_frame(tx, tag, payload, &to_next));
                let received = receive(rx, inp, reduce, wire, tag, &from_prev, from);
                let sent = sender.join().unwrap_or_else(|_| Err(std::io::Error::other("send thread panicked")));
                (sent, received)
            })
        };
        self.packed = packed;
        sent.map_err(|e| self.io_error(e, &s, next))?;
        received.map_err(|e| self.receive_error(e, &s, prev, tag, frame_bytes(wire, inp.len())))?;
        self.sent(next, sent_bytes as u64);
        if let Some(steps) = &mut self.steps {
            steps.push(RingStep {
                collective: s.id,
                phase: s.phase,
                step: s.step,
                chunk: chunk as u32,
                from: self.members[self.me] as u32,
                to: self.members[next] as u32,
                bytes: sent_bytes as u64,
                start_us: start,
                end_us: now_us(),
                values: (out.len() <= VALUE_RECORD_LIMIT).then(|| out.to_vec()),
            });
        }
        Ok(())
    }

    fn receive_error(&self, e: ReceiveError, s: &Step, peer_pos: usize, tag: u64, expected_bytes: usize) -> CommError {
        match e {
            ReceiveError::Io(e) => self.io_error(e, s, peer_pos),
            ReceiveError::Mismatch { tag: got_tag, bytes } => CommError::Mismatch {
                collective: self.describe(s),
                peer: self.members[peer_pos],
                got: format!("message #{} of {} bytes", got_tag & !P2P_TAG, bytes),
                expected: format!("message #{} of {} bytes", tag & !P2P_TAG, expected_bytes),
            },
        }
    }

    /// This rank's place in `ring` (positions of the group, in ring order) and its
    /// neighbours' positions: (index, next, prev).
    fn place_in(&self, ring: &[usize]) -> (usize, (usize, usize)) {
        let w = ring.len();
        let r = ring.iter().position(|&p| p == self.me).expect("a ring this rank is in");
        (r, (ring[(r + 1) % w], ring[(r + w - 1) % w]))
    }

    /// The reduce-scatter phase in place round `ring` (positions, in order; the whole group
    /// or, for `hierarchical`, a node or its leaders): afterwards chunk r of `buf` is
    /// complete at the r-th member of the ring.
    fn reduce_scatter_phase(
        &mut self,
        buf: &mut [f32],
        ring: &[usize],
        op: CollectiveOp,
        id: u64,
    ) -> Result<(), CommError> {
        let (w, (r, neighbours)) = (ring.len(), self.place_in(ring));
        for step in 0..w - 1 {
            let send_chunk = (r + 2 * w - step - 1) % w;
            let recv_chunk = (r + 2 * w - step - 2) % w;
            let (out, inp) =
                disjoint(buf, chunk_range(buf.len(), w, send_chunk), chunk_range(buf.len(), w, recv_chunk));
            let s = Step { op, id, phase: RingPhase::ReduceScatter, step: step as u32, steps: (w - 1) as u32 };
            self.ring_step(neighbours, out, inp, true, s, send_chunk)?;
        }
        Ok(())
    }

    /// The all-gather phase in place round `ring`: chunk r of `buf` is complete at the r-th
    /// member; afterwards all are everywhere.
    fn all_gather_phase(
        &mut self,
        buf: &mut [f32],
        ring: &[usize],
        op: CollectiveOp,
        id: u64,
    ) -> Result<(), CommError> {
        let (w, (r, neighbours)) = (ring.len(), self.place_in(ring));
        if self.wire != Precision::Fp32 {
            // Every rank keeps what the others receive of its chunk.
            let (wire, mine) = (self.wire, chunk_range(buf.len(), w, r));
            buf[mine].iter_mut().for_each(|x| *x = unpack(wire, pack(wire, *x)));
        }
        for step in 0..w - 1 {
            let send_chunk = (r + w - step) % w;
            let recv_chunk = (r + 2 * w - step - 1) % w;
            let (out, inp) =
                disjoint(buf, chunk_range(buf.len(), w, send_chunk), chunk_range(buf.len(), w, recv_chunk));
            let s = Step { op, id, phase: RingPhase::AllGather, step: step as u32, steps: (w - 1) as u32 };
            self.ring_step(neighbours, out, inp, false, s, send_chunk)?;
        }
        Ok(())
    }
}

/// Borrows two non-overlapping ranges of one buffer: one to read, one to write.
fn disjoint(buf: &mut [f32], read: std::ops::Range<usize>, write: std::ops::Range<usize>) -> (&[f32], &mut [f32]) {
    if read.start >= write.end {
        let (lo, hi) = buf.split_at_mut(read.start);
        (&hi[..read.len()], &mut lo[write])
    } else {
        let (lo, hi) = buf.split_at_mut(write.start);
        (&lo[read], &mut hi[..write.len()])
    }
}

enum ReceiveError {
    Io(std::io::Error),
    Mismatch { tag: u64, bytes: u64 },
}

impl From<std::io::Error> for ReceiveError {
    fn from(e: std::io::Error) -> Self {
        ReceiveError::Io(e)
    }
}

/// The Unix socket to a member of this host (None for self and for other hosts' members).
fn unix(socket: &Option<LinkSocket>) -> Option<&std::os::unix::net::UnixStream> {
    socket.as_ref().and_then(LinkSocket::unix)
}

/// How long to wait on the member at `pos`, and its socket to tell whether it is alive.
fn patience(sockets: &[Option<LinkSocket>], pos: usize, timeout: Duration) -> Patience<'_> {
    Patience { timeout, peer: sockets[pos].as_ref().expect("a peer is another rank").as_fd() }
}

/// The sender of a message, for copying a posted payload out of its memory.
struct Source<'a> {
    pid: i32,
    position: usize,
    scratch: &'a mut [f32],
    shared: &'a [SharedSet],
}

/// One buffer from `alloc_shared`: this rank's, and each member's mapped here.
struct SharedSet {
    mine: SharedBuffer,
    /// By position in the group (None for this rank).
    members: Vec<Option<SharedBuffer>>,
}

/// Receives one framed message into `inp`: adds it (`reduce`) or copies it, piece by piece
/// as it arrives (straight out of the shared-memory pipe, or off the TCP connection), or out
/// of the sender's memory if it was posted.
fn receive(
    rx: &mut Receiver,
    inp: &mut [f32],
    reduce: bool,
    wire: Precision,
    tag: u64,
    patience: &Patience,
    from: Source,
) -> Result<(), ReceiveError> {
    let frame = Frame::read(rx, patience)?;
    if frame.tag != tag || frame.bytes != frame_bytes(wire, inp.len()) as u64 {
        return Err(ReceiveError::Mismatch { tag: frame.tag, bytes: frame.bytes });
    }
    if wire != Precision::Fp32 {
        return receive_two_bytes(rx, inp, reduce, wire, frame, patience, from);
    }
    // A payload left in the sender's memory (its shared buffer, or posted): only a rank of
    // this host sends one, over the pipe. Over TCP every payload follows its header.
    let pipe = match (frame.payload, rx.pipe()) {
        (Payload::Inline, _) => None,
        (_, Some(pipe)) => Some(pipe),
        (_, None) => return Err(ReceiveError::Mismatch { tag: frame.tag, bytes: frame.bytes }),
    };
    match (frame.payload, pipe) {
        (Payload::Shared { buffer, offset }, Some(pipe)) => {
            let theirs = from.shared.get(buffer as usize).and_then(|set| set.members[from.position].as_ref());
            let incoming = theirs
                .and_then(|b| b.range(offset as usize, inp.len()))
                .ok_or(ReceiveError::Mismatch { tag, bytes: frame.bytes })?;
            if reduce {
                add_into(inp, incoming);
            } else {
                stream_copy(inp, incoming);
            }
            pipe.mark_taken();
            return Ok(());
        }
        (Payload::Posted { address }, Some(pipe)) => {
            if reduce {
                let step = from.scratch.len();
                for (i, piece) in inp.chunks_mut(step).enumerate() {
                    let incoming = &mut from.scratch[..piece.len()];
                    let offset = (i * step * 4) as u64;
                    cma::read(from.pid, address + offset, bytemuck::cast_slice_mut(incoming))?;
                    add_into(piece, incoming);
                }
            } else {
                cma::read(from.pid, address, bytemuck::cast_slice_mut(inp))?;
            }
            pipe.mark_taken();
            return Ok(());
        }
        _ => {}
    }
    let mut at = 0;
    rx.read_with(inp.len() * 4, patience, |piece| {
        // Pieces are whole floats and 4-byte aligned: every frame is (16 + 4k) bytes long.
        let incoming: &[f32] = bytemuck::cast_slice(piece);
        let target = &mut inp[at..at + incoming.len()];
        if reduce {
            add_into(target, incoming);
        } else {
            target.copy_from_slice(incoming);
        }
        at += incoming.len();
    })?;
    Ok(())
}

simd_kernel! {
    /// The reduction's step: `acc[i] += x[i]` (AVX-512 where the CPU has it: the sum over
    /// a chunk is bound by memory, and wider loads move it faster).
    fn add_into<F: Float, S: Stored<Acc = F>>(acc: &mut [S], x: &[S]) {
        for (a, &b) in acc.iter_mut().zip(x) {
            *a = S::store(a.load() + b.load());
        }
    }
}

/// Payload bytes of `n` values in `wire`'s format (what counts as sent).
fn wire_bytes(wire: Precision, n: usize) -> usize {
    match wire {
        Precision::Fp32 => 4 * n,
        Precision::Bf16 | Precision::Fp16 => 2 * n,
    }
}

/// Bytes a frame of `n` values announces: 2-byte payloads are padded to whole f32 words.
fn frame_bytes(wire: Precision, n: usize) -> usize {
    wire_bytes(wire, n).next_multiple_of(4)
}

/// `x` rounded (to nearest even) to a 2-byte wire format, as its bits.
pub(crate) fn pack(wire: Precision, x: f32) -> u16 {
    match wire {
        Precision::Fp16 => half::f16::from_f32(x).to_bits(),
        _ => half::bf16::from_f32(x).to_bits(),
    }
}

pub(crate) fn unpack(wire: Precision, bits: u16) -> f32 {
    match wire {
        Precision::Fp16 => half::f16::from_bits(bits).to_f32(),
        _ => half::bf16::from_bits(bits).to_f32(),
    }
}

/// Adds the widened `incoming` values into `target` (`reduce`), or copies them.
fn take_two_bytes(target: &mut [f32], incoming: &[u16], reduce: bool, wire: Precision) {
    for (acc, &bits) in target.iter_mut().zip(incoming) {
        let x = unpack(wire, bits);
        *acc = if reduce { *acc + x } else { x };
    }
}

/// [`receive`] of a 2-byte payload: copied out of the sender's memory in pieces when it was
/// posted (same host), else read as it arrives (padding included) piece by piece.
fn receive_two_bytes(
    rx: &mut Receiver,
    inp: &mut [f32],
    reduce: bool,
    wire: Precision,
    frame: Frame,
    patience: &Patience,
    from: Source,
) -> Result<(), ReceiveError> {
    match frame.payload {
        Payload::Shared { .. } => Err(ReceiveError::Mismatch { tag: frame.tag, bytes: frame.bytes }),
        Payload::Posted { address } => {
            let Some(pipe) = rx.pipe() else {
                return Err(ReceiveError::Mismatch { tag: frame.tag, bytes: frame.bytes });
            };
            let scratch: &mut [u16] = bytemuck::cast_slice_mut(from.scratch);
            let step = scratch.len();
            for (i, piece) in inp.chunks_mut(step).enumerate() {
                let incoming = &mut scratch[..piece.len()];
                cma::read(from.pid, address + (2 * i * step) as u64, bytemuck::cast_slice_mut(incoming))?;
                take_two_bytes(piece, incoming, reduce, wire);
            }
            pipe.mark_taken();
            Ok(())
        }
        Payload::Inline => {
            let mut at = 0;
            rx.read_with(frame.bytes as usize, patience, |piece| {
                // Pieces are whole f32 words (every frame is 32 + 4k bytes): whole u16s too.
                let incoming: &[u16] = bytemuck::cast_slice(piece);
                let n = incoming.len().min(inp.len() - at);
                take_two_bytes(&mut inp[at..at + n], &incoming[..n], reduce, wire);
                at += n;
            })?;
            Ok(())
        }
    }
}

fn scale(buf: &mut [f32], divisor: usize) {
    let d = divisor as f32;
    for x in buf {
        *x /= d;
    }
}

impl Communicator for RingCommunicator {
    fn rank(&self) -> usize {
        self.me
    }

    fn set_wire(&mut self, wire: Precision) {
        self.wire = wire;
    }

    fn size(&self) -> usize {
        self.members.len()
    }

    fn all_reduce(&mut self, buf: &mut [f32], op: ReduceOp) -> Result<(), CommError> {
        let id = self.begin();
        let (start, sent_before, input) = (now_us(), self.bytes_sent, self.small_copy(buf));
        let w = self.members.len();
        if w > 1 {
            match self.algorithm {
                AllReduce::Ring => {
                    let ring = self.whole_ring();
                    self.reduce_scatter_phase(buf, &ring, CollectiveOp::AllReduce, id)?;
                    if op == ReduceOp::Avg {
                        let mine = chunk_range(buf.len(), w, self.me);
                        scale(&mut buf[mine], w);
                    }
                    self.all_gather_phase(buf, &ring, CollectiveOp::AllReduce, id)?;
                }
                AllReduce::Naive => self.naive_all_reduce(buf, id)?,
                AllReduce::Tree => self.tree_all_reduce(buf, id)?,
                AllReduce::Hierarchical => self.hierarchical_all_reduce(buf, id)?,
            }
            if op == ReduceOp::Avg && self.algorithm != AllReduce::Ring {
                scale(buf, w);
            }
        }
        let output = self.small_copy(buf);
        self.finish(CollectiveOp::AllReduce, id, buf.len(), sent_before, start, (input, output));
        Ok(())
    }

    fn reduce_scatter(&mut self, input: &mut [f32], output: &mut [f32], op: ReduceOp) -> Result<(), CommError> {
        let w = self.members.len();
        let mine = chunk_range(input.len(), w, self.me);
        let id = self.begin();
        if output.len() != mine.len() {
            self.steps = None;
            return Err(CommError::BadBuffer {
                collective: format!("reduce_scatter #{id} in group {}", self.name),
                detail: format!(
                    "input has {} elements, so this rank's output needs {}, not {}",
                    input.len(),
                    mine.len(),
                    output.len()
                ),
            });
        }
        let (start, sent_before, before) = (now_us(), self.bytes_sent, self.small_copy(input));
        if w > 1 {
            let ring = self.whole_ring();
            self.reduce_scatter_phase(input, &ring, CollectiveOp::ReduceScatter, id)?;
        }
        output.copy_from_slice(&input[mine]);
        if op == ReduceOp::Avg && w > 1 {
            scale(output, w);
        }
        let after = self.small_copy(output);
        self.finish(CollectiveOp::ReduceScatter, id, input.len(), sent_before, start, (before, after));
        Ok(())
    }

    fn all_gather(&mut self, input: &[f32], output: &mut [f32]) -> Result<(), CommError> {
        let w = self.members.len();
        let mine = chunk_range(output.len(), w, self.me);
        let id = self.begin();
        if input.len() != mine.len() {
            self.steps = None;
            return Err(CommError::BadBuffer {
                collective: format!("all_gather #{id} in group {}", self.name),
                detail: format!(
                    "output has {} elements, so this rank's input needs {}, not {}",
                    output.len(),
                    mine.len(),
                    input.len()
                ),
            });
        }
        let (start, sent_before, before) = (now_us(), self.bytes_sent, self.small_copy(input));
        output[mine].copy_from_slice(input);
        if w > 1 {
            let ring = self.whole_ring();
            self.all_gather_phase(output, &ring, CollectiveOp::AllGather, id)?;
        }
        let after = self.small_copy(output);
        self.finish(CollectiveOp::AllGather, id, output.len(), sent_before, start, (before, after));
        Ok(())
    }

    fn reduce_scatter_in_place(&mut self, buf: &mut [f32], op: ReduceOp) -> Result<(), CommError> {
        let w = self.members.len();
        let id = self.begin();
        let (start, sent_before, before) = (now_us(), self.bytes_sent, self.small_copy(buf));
        if w > 1 {
            let ring = self.whole_ring();
            self.reduce_scatter_phase(buf, &ring, CollectiveOp::ReduceScatter, id)?;
        }
        let mine = chunk_range(buf.len(), w, self.me);
        if op == ReduceOp::Avg && w > 1 {
            scale(&mut buf[mine.clone()], w);
        }
        let after = self.small_copy(&buf[mine]);
        self.finish(CollectiveOp::ReduceScatter, id, buf.len(), sent_before, start, (before, after));
        Ok(())
    }

    fn all_gather_in_place(&mut self, buf: &mut [f32]) -> Result<(), CommError> {
        let w = self.members.len();
        let id = self.begin();
        let mine = chunk_range(buf.len(), w, self.me);
        let (start, sent_before, before) = (now_us(), self.bytes_sent, self.small_copy(&buf[mine]));
        if w > 1 {
            let ring = self.whole_ring();
            self.all_gather_phase(buf, &ring, CollectiveOp::AllGather, id)?;
        }
        let after = self.small_copy(buf);
        self.finish(CollectiveOp::AllGather, id, buf.len(), sent_before, start, (before, after));
        Ok(())
    }

    /// Pairwise, W-1 steps (`ring/all_to_all.rs`).
    fn all_to_all(&mut self, input: &[f32], output: &mut [f32]) -> Result<(), CommError> {
        let w = self.members.len();
        let id = self.begin();
        if input.len() != output.len() || !input.len().is_multiple_of(w) {
            self.steps = None;
            return Err(CommError::BadBuffer {
                collective: format!("all_to_all #{id} in group {}", self.name),
                detail: format!(
                    "input has {} elements and output {}: both must be as long, a multiple of the {w} ranks",
                    input.len(),
                    output.len()
                ),
            });
        }
        let (start, sent_before, before) = (now_us(), self.bytes_sent, self.small_copy(input));
        self.all_to_all_steps(input, output, id)?;
        let after = self.small_copy(output);
        self.finish(CollectiveOp::AllToAll, id, input.len(), sent_before, start, (before, after));
        Ok(())
    }

    /// A chain from the root round the ring, piece by piece, so it pipelines.
    fn broadcast(&mut self, buf: &mut [f32], root: usize) -> Result<(), CommError> {
        let w = self.members.len();
        let id = self.begin();
        let (start, sent_before) = (now_us(), self.bytes_sent);
        let position = (self.me + w - root % w) % w;
        let s = Step {
            op: CollectiveOp::Broadcast,
            id,
            phase: RingPhase::Broadcast,
            step: position as u32,
            steps: w as u32,
        };
        let (next, prev) = (self.next(), self.prev());
        for piece in buf.chunks_mut(PIECE) {
            if position > 0 {
                let rx = self.rx[prev].as_mut().expect("neighbour");
                receive(
                    rx,
                    piece,
                    false,
                    Precision::Fp32,
                    id,
                    &patience(&self.sockets, prev, self.timeout),
                    Source { pid: self.pids[prev], position: prev, scratch: &mut self.scratch, shared: &self.shared },
                )
                .map_err(|e| self.receive_error(e, &s, prev, id, frame_bytes(Precision::Fp32, piece.len())))?;
            }
            if position + 1 < w {
                let tx = self.tx[next].as_mut().expect("neighbour");
                send_frame(tx, id, bytemuck::cast_slice(piece), &patience(&self.sockets, next, self.timeout))
                    .map_err(|e| self.io_error(e, &s, next))?;
                self.sent(next, (piece.len() * 4) as u64);
            }
        }
        if let (Some(steps), true) = (&mut self.steps, position + 1 < w) {
            steps.push(RingStep {
                collective: id,
                phase: RingPhase::Broadcast,
                step: position as u32,
                chunk: 0,
                from: self.members[self.me] as u32,
                to: self.members[next] as u32,
                bytes: (buf.len() * 4) as u64,
                start_us: start,
                end_us: now_us(),
                values: (buf.len() <= VALUE_RECORD_LIMIT).then(|| buf.to_vec()),
            });
        }
        self.finish(CollectiveOp::Broadcast, id, buf.len(), sent_before, start, (None, None));
        Ok(())
    }

    fn send(&mut self, buf: &[f32], to: usize) -> Result<(), CommError> {
        let tag = P2P_TAG | self.p2p_sent[to];
        self.p2p_sent[to] += 1;
        let s = Step { op: CollectiveOp::Send, id: tag & !P2P_TAG, phase: RingPhase::PointToPoint, step: 0, steps: 1 };
        let tx = self.tx[to].as_mut().ok_or_else(|| CommError::BadBuffer {
            collective: format!("send in group {}", self.name),
            detail: "a rank cannot send to itself".into(),
        })?;
        let start = now_us();
        send_frame(tx, tag, bytemuck::cast_slice(buf), &patience(&self.sockets, to, self.timeout))
            .map_err(|e| self.io_error(e, &s, to))?;
        let bytes = (buf.len() * 4) as u64;
        self.sent(to, bytes);
        if let Some(tracer) = &self.tracer {
            tracer.count(CollectiveOp::Send, buf.len() as u64, bytes, now_us().saturating_sub(start));
        }
        Ok(())
    }

    fn recv(&mut self, buf: &mut [f32], from: usize) -> Result<(), CommError> {
        let tag = P2P_TAG | self.p2p_received[from];
        self.p2p_received[from] += 1;
        let s = Step { op: CollectiveOp::Recv, id: tag & !P2P_TAG, phase: RingPhase::PointToPoint, step: 0, steps: 1 };
        let rx = self.rx[from].as_mut().ok_or_else(|| CommError::BadBuffer {
            collective: format!("recv in group {}", self.name),
            detail: "a rank cannot receive from itself".into(),
        })?;
        receive(
            rx,
            buf,
            false,
            Precision::Fp32,
            tag,
            &patience(&self.sockets, from, self.timeout),
            Source { pid: self.pids[from], position: from, scratch: &mut self.scratch, shared: &self.shared },
        )
        .map_err(|e| self.receive_error(e, &s, from, tag, frame_bytes(Precision::Fp32, buf.len())))
    }

    fn barrier(&mut self) -> Result<(), CommError> {
        let mut token = [0.0f32];
        self.all_reduce(&mut token, ReduceOp::Sum)
    }

    fn bytes_sent(&self) -> u64 {
        self.bytes_sent
    }

    fn staging_bytes(&self) -> u64 {
        (self.scratch.len() * std::mem::size_of::<f32>()) as u64
    }

    /// Every member creates a memfd and sends it to every other member over their socket
    /// (all sends first: they are tiny), then maps each member's.
    fn alloc_shared(&mut self, len: usize) -> Result<SharedBuffer, CommError> {
        let number = self.shared.len();
        let what = || format!("alloc_shared #{number} of {len} floats in group {}", self.name);
        let broken = |peer: usize, cause: std::io::Error| CommError::Disconnected { collective: what(), peer, cause };
        let (mine, fd) = SharedBuffer::create(len).map_err(|e| broken(self.members[self.me], e))?;
        let hello = [(number as u64).to_le_bytes(), (len as u64).to_le_bytes()].concat();
        // Members on other hosts cannot map it: they get its chunks over TCP as usual.
        for (pos, socket) in self.sockets.iter().enumerate() {
            if let Some(socket) = unix(socket) {
                send_fd(socket, &fd, &hello).map_err(|e| broken(self.members[pos], e))?;
            }
        }
        let mut members = Vec::new();
        for (pos, socket) in self.sockets.iter().enumerate() {
            let Some(socket) = unix(socket) else {
                members.push(None);
                continue;
            };
            let peer = self.members[pos];
            let mut theirs = [0u8; 16];
            socket.set_read_timeout(Some(self.timeout)).map_err(|e| broken(peer, e))?;
            let received = recv_fd(socket, &mut theirs);
            socket.set_read_timeout(None).map_err(|e| broken(peer, e))?;
            let fd = received.map_err(|e| match e.kind() {
                std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut => {
                    CommError::Timeout { collective: what(), peer, waited_s: self.timeout.as_secs_f64() }
                }
                _ => broken(peer, e),
            })?;
            if theirs != hello.as_slice() {
                return Err(CommError::Mismatch {
                    collective: what(),
                    peer,
                    got: format!("a shared buffer announced as {theirs:?}"),
                    expected: format!("{hello:?} (number, floats)"),
                });
            }
            members.push(Some(SharedBuffer::open(fd, len).map_err(|e| broken(peer, e))?));
        }
        self.shared.push(SharedSet { mine: mine.share(), members });
        Ok(mine)
    }
}
