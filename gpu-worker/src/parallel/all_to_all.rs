//! An all-to-all of a backend buffer between the ranks of a group, recorded on a timeline
//! lane: expert parallelism's exchanges (`expert.rs`) and context parallelism's
//! (`context.rs`). The communicators carry f32 between host slices, so the buffer crosses
//! as copies (booked as transient memory), re-arranged on the way where the group needs it.

use std::sync::Arc;

use distlab_common::trace::{Span, SpanKind};

use super::TrainBackend;
use crate::backend::Stored;
use crate::comm::{CommError, Communicator};
use crate::memory::{Category, MemoryTracker};
use crate::trace::now_us;

/// How a buffer is laid out for an all-to-all and back: block r of what `pack` makes goes
/// to rank r, and `unpack` puts the block that came from each rank where it belongs.
pub struct Arrangement<'a> {
    pub pack: &'a dyn Fn(&[f32]) -> Vec<f32>,
    pub unpack: &'a dyn Fn(&[f32], &mut [f32]),
}

/// A group's communicator, the lane its all-to-alls are drawn on, and their record.
pub struct RecordedAllToAll {
    comm: Box<dyn Communicator>,
    lane: &'static str,
    step: u64,
    record: bool,
    spans: Vec<Span>,
    memory: Arc<MemoryTracker>,
}

impl RecordedAllToAll {
    pub fn new(comm: Box<dyn Communicator>, lane: &'static str) -> Self {
        RecordedAllToAll { comm, lane, step: 0, record: false, spans: Vec::new(), memory: MemoryTracker::new() }
    }

    /// This rank's place in the group: (rank, size).
    pub fn place(&self) -> (usize, usize) {
        (self.comm.rank(), self.comm.size())
    }

    /// The group's communicator, for a faster one over the same ranks to take its place
    /// (NCCL, see `train/cuda.rs`).
    pub fn comm_mut(&mut self) -> &mut Box<dyn Communicator> {
        &mut self.comm
    }

    /// What the group's communicator keeps for staging (see `Communicator::staging_bytes`).
    pub fn staging_bytes(&self) -> u64 {
        self.comm.staging_bytes()
    }

    pub fn begin_step(&mut self, step: u64, record: bool) {
        self.step = step;
        self.record = record;
    }

    pub fn spans(&self) -> Vec<Span> {
        self.spans.clone()
    }

    /// Books its copies in the rank's memory ledger from now on.
    pub fn attach_memory(&mut self, memory: &Arc<MemoryTracker>) {
        self.memory = memory.clone();
    }

    /// `from` across the group into `to` (as long), as it is or (`arrangement`) re-arranged
    /// before and after; drawn as `name` when the step is recorded.
    pub fn exchange<B: TrainBackend>(
        &mut self,
        be: &B,
        (from, to): (&B::Buf, &mut B::Buf),
        arrangement: Option<Arrangement<'_>>,
        name: String,
        layer: usize,
    ) -> Result<(), CommError> {
        if self.record {
            be.synchronize();
        }
        let (start, sent_before) = (now_us(), self.comm.bytes_sent());
        let len = be.buf_len(from);
        let copies = if arrangement.is_some() { 3 } else { 2 };
        let _copies = self.memory.alloc(Category::Transient, copies * len);
        let mine: Vec<f32> = be.read_host(be.all(from), |x| x.iter().map(|v| v.load()).collect());
        let mut received = vec![0.0f32; len];
        let arrived = match arrangement {
            None => {
                self.comm.all_to_all(&mine, &mut received)?;
                received
            }
            Some(Arrangement { pack, unpack }) => {
                self.comm.all_to_all(&pack(&mine), &mut received)?;
                let mut arranged = mine;
                unpack(&received, &mut arranged);
                arranged
            }
        };
        be.on_host(be.all_mut(to), |out| {
            for (o, &v) in out.iter_mut().zip(&arrived) {
                *o = B::Elem::store(v);
            }
        });
        if self.record {
            be.synchronize();
            self.spans.push(Span {
                kind: SpanKind::Comm,
                name,
                step: self.step,
                lane: self.lane.into(),
                start_us: start,
                end_us: now_us(),
                layer: Some(layer as u32),
                bucket: None,
                bytes: Some(self.comm.bytes_sent() - sent_before),
                micro: None,
                chunk: None,
            });
        }
        Ok(())
    }
}
