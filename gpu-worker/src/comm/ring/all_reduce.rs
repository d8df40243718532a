//! All-reduce algorithms besides the ring (`parallel.allreduce`), written out step by step
//! with the ring's own steps and pipes, so that they are traced, compared and replayed
//! alike. What each sends, rank by rank, is `distlab_common::all_reduce`.
//!
//! * naive: the parameter server. Every rank sends its buffer to rank 0, which adds them
//!   one after another, then sends the sum back to every rank: rank 0 moves (W-1) x D
//!   each way and the others wait their turn, where the ring has every rank send
//!   2(W-1)/W x D at once.
//! * tree: a binary tree rooted at rank 0 (rank r's parent is r without its lowest set
//!   bit). Partial sums climb it, the smallest subtrees first, and the result comes down:
//!   log2(W) steps each way instead of W-1, but whole buffers, not chunks, on every edge.
//! * hierarchical: ranks grouped into nodes of `ranks_per_node`. A ring all-reduce inside
//!   each node (fast links), a ring all-reduce across the nodes' first ranks (the slow
//!   links carry only the leaders' traffic), then each leader sends the result to its node.

use distlab_common::all_reduce::{tree_children, tree_parent, Nodes};
use distlab_common::trace::{CollectiveOp, RingPhase, RingStep};
use distlab_common::Precision;

use super::{frame_bytes, patience, receive, send_frame, RingCommunicator, Source, Step};
use crate::comm::CommError;
use crate::trace::{now_us, VALUE_RECORD_LIMIT};

impl RingCommunicator {
    /// Every rank's `buf` to position 0, which adds them in order and sends the sum back.
    pub(super) fn naive_all_reduce(&mut self, buf: &mut [f32], id: u64) -> Result<(), CommError> {
        let (w, me) = (self.members.len(), self.me);
        let steps = (w - 1) as u32;
        let step = |phase, step: usize| Step { op: CollectiveOp::AllReduce, id, phase, step: step as u32, steps };
        if me == 0 {
            for from in 1..w {
                self.recv_step(from, buf, true, step(RingPhase::Reduce, from - 1))?;
            }
            for to in 1..w {
                self.send_step(to, buf, step(RingPhase::Broadcast, to - 1))?;
            }
        } else {
            self.send_step(0, buf, step(RingPhase::Reduce, me - 1))?;
            self.recv_step(0, buf, false, step(RingPhase::Broadcast, me - 1))?;
        }
        Ok(())
    }

    /// Up the binary tree (each rank adds its children's partial sums, the nearest child's
    /// first, and sends the total to its parent), then the result down it.
    pub(super) fn tree_all_reduce(&mut self, buf: &mut [f32], id: u64) -> Result<(), CommError> {
        let (w, me) = (self.members.len(), self.me);
        let levels = w.next_power_of_two().trailing_zeros();
        // The level of the edge between a rank and its child or parent: log2 of their distance.
        let step = |phase, a: usize, b: usize| Step {
            op: CollectiveOp::AllReduce,
            id,
            phase,
            step: a.abs_diff(b).trailing_zeros(),
            steps: levels,
        };
        let children = tree_children(me, w);
        for &child in children.iter().rev() {
            self.recv_step(child, buf, true, step(RingPhase::Reduce, me, child))?;
        }
        if let Some(parent) = tree_parent(me) {
            self.send_step(parent, buf, step(RingPhase::Reduce, me, parent))?;
            self.recv_step(parent, buf, false, step(RingPhase::Broadcast, me, parent))?;
        }
        for &child in &children {
            self.send_step(child, buf, step(RingPhase::Broadcast, me, child))?;
        }
        Ok(())
    }

    /// A ring inside this rank's node, a ring across the nodes' leaders, then the leader's
    /// result to the rest of its node.
    pub(super) fn hierarchical_all_reduce(&mut self, buf: &mut [f32], id: u64) -> Result<(), CommError> {
        let nodes = Nodes::new(self.members.len(), self.ranks_per_node);
        let node: Vec<usize> = nodes.members(self.me).collect();
        let op = CollectiveOp::AllReduce;
        for ring in [node.clone(), nodes.leaders()] {
            if ring.len() > 1 && ring.contains(&self.me) {
                self.reduce_scatter_phase(buf, &ring, op, id)?;
                self.all_gather_phase(buf, &ring, op, id)?;
            }
        }
        let steps = (node.len() - 1) as u32;
        let step = |i: usize| Step { op, id, phase: RingPhase::Broadcast, step: i as u32, steps };
        let (leader, rest) = (node[0], &node[1..]);
        if self.me == leader {
            for (i, &member) in rest.iter().enumerate() {
                self.send_step(member, buf, step(i))?;
            }
        } else {
            let i = node.iter().position(|&m| m == self.me).expect("in its node") - 1;
            self.recv_step(leader, buf, false, step(i))?;
        }
        Ok(())
    }

    /// Sends all of `buf` to the member at position `to` (one step of a tree or a star).
    fn send_step(&mut self, to: usize, buf: &[f32], s: Step) -> Result<(), CommError> {
        let start = now_us();
        let tx = self.tx[to].as_mut().expect("a step goes to another rank");
        send_frame(tx, s.id, bytemuck::cast_slice(buf), &patience(&self.sockets, to, self.timeout))
            .map_err(|e| self.io_error(e, &s, to))?;
        let bytes = (buf.len() * 4) as u64;
        self.bytes_sent += bytes;
        if let Some(steps) = &mut self.steps {
            steps.push(RingStep {
                collective: s.id,
                phase: s.phase,
                step: s.step,
                chunk: 0,
                from: self.members[self.me] as u32,
                to: self.members[to] as u32,
                bytes,
                start_us: start,
                end_us: now_us(),
                values: (buf.len() <= VALUE_RECORD_LIMIT).then(|| buf.to_vec()),
            });
        }
        Ok(())
    }

    /// Receives all of `buf` from the member at position `from`: added to it (`reduce`) or
    /// copied over it.
    fn recv_step(&mut self, from: usize, buf: &mut [f32], reduce: bool, s: Step) -> Result<(), CommError> {
        let rx = self.rx[from].as_mut().expect("a step comes from another rank");
        let source = Source { pid: self.pids[from], position: from, scratch: &mut self.scratch, shared: &self.shared };
        receive(rx, buf, reduce, Precision::Fp32, s.id, &patience(&self.sockets, from, self.timeout), source)
            .map_err(|e| self.receive_error(e, &s, from, s.id, frame_bytes(Precision::Fp32, buf.len())))
    }
}
