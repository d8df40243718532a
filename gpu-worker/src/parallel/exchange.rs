//! A group's exchanges of backend buffers, recorded on a timeline lane: an all-to-all
//! (expert parallelism's, `expert.rs`; Ulysses', `context.rs`) or a pass to the next rank
//! of a ring (ring attention's, `context.rs`). The communicators carry f32 between host
//! slices, so the buffer crosses as copies (booked as transient memory), re-arranged on the
//! way where the group needs it.

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

/// A group's communicator, the lane its exchanges are drawn on, and their record.
pub struct RecordedExchange {
    comm: Box<dyn Communicator>,
    lane: &'static str,
    step: u64,
    record: bool,
    spans: Vec<Span>,
    memory: Arc<MemoryTracker>,
}

impl RecordedExchange {
    pub fn new(comm: Box<dyn Communicator>, lane: &'static str) -> Self {
        RecordedExchange { comm, lane, step: 0, record: false, spans: Vec::new(), memory: MemoryTracker::new() }
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

    /// `from` across the group into `to` (as long) by an all-to-all, as it is or
    /// (`arrangement`) re-arranged before and after; drawn as `name` when the step is recorded.
    pub fn all_to_all<B: TrainBackend>(
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
        self.recorded(be, (start, sent_before), name, layer);
        Ok(())
    }

    /// Ring attention's pass: the `from` columns of `send`'s rows go to the next rank of the
    /// group, and the previous rank's land in the `to` columns of `recv`'s rows (the rest of
    /// `recv` kept). Even ranks send first and odd ones receive first, so that no ring of
    /// blocking sends waits on itself.
    pub fn pass_on<B: TrainBackend>(
        &mut self,
        be: &B,
        (send, from): (&B::Buf, Columns),
        (recv, to): (&mut B::Buf, Columns),
        name: String,
        layer: usize,
    ) -> Result<(), CommError> {
        if self.record {
            be.synchronize();
        }
        let (start, sent_before) = (now_us(), self.comm.bytes_sent());
        let (rank, size) = self.place();
        let rows = be.buf_len(send) / from.row;
        let _copies = self.memory.alloc(Category::Transient, 2 * rows * from.width);
        let mine: Vec<f32> = be.read_host(be.all(send), |x| {
            x.chunks_exact(from.row)
                .flat_map(|row| row[from.at..from.at + from.width].iter().map(|v| v.load()))
                .collect()
        });
        let mut got = vec![0.0f32; rows * to.width];
        let (next, previous) = ((rank + 1) % size, (rank + size - 1) % size);
        if rank % 2 == 0 {
            self.comm.send(&mine, next)?;
            self.comm.recv(&mut got, previous)?;
        } else {
            self.comm.recv(&mut got, previous)?;
            self.comm.send(&mine, next)?;
        }
        be.on_host(be.all_mut(recv), |out| {
            for (row, values) in out.chunks_exact_mut(to.row).zip(got.chunks_exact(to.width)) {
                for (o, &v) in row[to.at..to.at + to.width].iter_mut().zip(values) {
                    *o = B::Elem::store(v);
                }
            }
        });
        self.recorded(be, (start, sent_before), name, layer);
        Ok(())
    }

    /// Records an exchange that started at `start` (µs, bytes sent by then) as a span.
    fn recorded<B: TrainBackend>(&mut self, be: &B, (start, sent_before): (u64, u64), name: String, layer: usize) {
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
    }
}

/// Which columns of a buffer's rows an exchange reads or writes: rows `row` wide, `width`
/// columns from `at`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Columns {
    pub row: usize,
    pub at: usize,
    pub width: usize,
}

impl Columns {
    /// Every column of rows `width` wide.
    pub fn all(width: usize) -> Self {
        Columns { row: width, at: 0, width }
    }
}
