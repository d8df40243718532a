//! FSDP's prefetch: while the model computes with one unit, the unit it opens next is
//! already being all-gathered, on a communication thread over the data-parallel group's
//! second communicator (PyTorch FSDP's forward and backward prefetch). Forward opens the
//! units in order, backward in reverse (with the recomputes checkpointing adds); the model
//! announces each next unit (`ModelState::announce_next`), so every rank gathers the same
//! units in the same order, each once. At most two units are gathered at a time: the
//! open one and the next.
//!
//! The gather runs in f32 on host memory, what the communicators carry: the thread gets a
//! buffer with this rank's chunk filled in and sends it back whole. The training thread
//! turns it into the backend's buffer when it opens the unit and waits only when the
//! gather has not finished yet. The timeline draws the gather on the communication lane
//! and the wait, if any, as a collective the compute thread stopped for (exposed).
//!
//! Two rings between the same two ranks share their pipes (`comm/transport.rs`), so the
//! training thread settles the gather under way (waits for it, keeping its result) before
//! it runs a data-parallel collective of its own: backward's reduce-scatters still wait,
//! as without prefetch; forward's gathers and backward's hide under compute.

use std::sync::mpsc;
use std::thread::JoinHandle;

use distlab_common::trace::{lane, Span, SpanKind};
use distlab_common::Precision;

use crate::comm::{CommError, Communicator};
use crate::memory::Receipt;
use crate::model::Unit;
use crate::trace::now_us;

/// A gather to run: `values` holds this rank's chunk of `unit` (the rest is overwritten).
struct Request {
    unit: Unit,
    values: Vec<f32>,
    step: u64,
    record: bool,
}

/// A finished gather, with its span on the communication lane when recorded.
struct Gathered {
    unit: Unit,
    values: Vec<f32>,
    span: Option<Span>,
}

/// A unit's gathered values, with the memory ledger's record of them (dropped once the
/// values are copied into the backend's buffer).
pub struct Prefetched {
    pub values: Vec<f32>,
    pub booked: Vec<Receipt>,
}

pub struct Prefetcher {
    to_comm: Option<mpsc::Sender<Request>>,
    from_comm: mpsc::Receiver<Result<Gathered, CommError>>,
    thread: Option<JoinHandle<()>>,
    /// The unit being gathered, and the memory ledger's record of its buffer.
    in_flight: Option<(Unit, Vec<Receipt>)>,
    /// A gather settled before its unit was opened.
    ready: Option<(Unit, Prefetched)>,
    /// The gathers and the waits recorded so far.
    pub spans: Vec<Span>,
}

impl Prefetcher {
    /// Moves `comm` (the data-parallel group's second communicator) onto a new thread,
    /// its gathers crossing the wire as `wire`.
    pub fn new(mut comm: Box<dyn Communicator>, wire: Precision) -> Self {
        comm.set_wire(wire);
        let (to_comm, requests) = mpsc::channel::<Request>();
        let (done, from_comm) = mpsc::channel();
        let thread = std::thread::Builder::new()
            .name("fsdp-prefetch".into())
            .spawn(move || communication_thread(comm, requests, done))
            .expect("spawn the FSDP prefetch thread");
        Self {
            to_comm: Some(to_comm),
            from_comm,
            thread: Some(thread),
            in_flight: None,
            ready: None,
            spans: Vec::new(),
        }
    }

    /// Starts gathering `unit`, whose buffer (`values`, this rank's chunk filled in) the
    /// ledger books with `receipts` until [`Self::finish`] hands it over.
    pub fn start(&mut self, unit: Unit, values: Vec<f32>, receipts: Vec<Receipt>, step: u64, record: bool) {
        assert!(self.in_flight.is_none() && self.ready.is_none(), "one prefetch at a time");
        let sent = self.to_comm.as_ref().is_some_and(|tx| tx.send(Request { unit, values, step, record }).is_ok());
        // A thread that is gone failed on an earlier gather, which `finish` reported.
        if sent {
            self.in_flight = Some((unit, receipts));
        }
    }

    /// Waits for the gather under way, if any, keeping its result for [`Self::take`]:
    /// what the training thread does before it uses the group's pipes itself. The wait is
    /// drawn when the step is recorded.
    pub fn settle(&mut self, step: u64, record: bool) -> Result<(), CommError> {
        let Some((unit, receipts)) = self.in_flight.take() else { return Ok(()) };
        let waiting_since = now_us();
        let gathered = self.from_comm.recv().map_err(|_| misuse("the prefetch thread stopped".into()))??;
        if gathered.unit != unit {
            return Err(misuse(format!("prefetched {:?}, expected {unit:?}", gathered.unit)));
        }
        if record {
            self.spans.extend(gathered.span);
            self.spans.push(Span {
                kind: SpanKind::Comm,
                name: format!("wait for all_gather {} (prefetched)", unit.name()),
                step,
                lane: lane::DP_BLOCKING.into(),
                start_us: waiting_since,
                end_us: now_us(),
                layer: None,
                bucket: None,
                bytes: None,
                micro: None,
                chunk: None,
            });
        }
        self.ready = Some((unit, Prefetched { values: gathered.values, booked: receipts }));
        Ok(())
    }

    /// `unit`'s gathered values, when it is the unit prefetched; None when no prefetch was
    /// started.
    pub fn take(&mut self, unit: Unit, step: u64, record: bool) -> Result<Option<Prefetched>, CommError> {
        self.settle(step, record)?;
        match self.ready.take() {
            None => Ok(None),
            Some((prefetched, values)) if prefetched == unit => Ok(Some(values)),
            Some((prefetched, _)) => Err(misuse(format!("prefetched {prefetched:?}, but {unit:?} was opened"))),
        }
    }
}

fn misuse(detail: String) -> CommError {
    CommError::BadBuffer { collective: "FSDP prefetch".into(), detail }
}

impl Drop for Prefetcher {
    fn drop(&mut self) {
        self.to_comm = None;
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

/// Runs the gathers in the order they come; stops at the first failure (the group's
/// ring is then broken: the training thread reports it when it waits for the result).
fn communication_thread(
    mut comm: Box<dyn Communicator>,
    requests: mpsc::Receiver<Request>,
    done: mpsc::Sender<Result<Gathered, CommError>>,
) {
    for Request { unit, mut values, step, record } in requests {
        let (start_us, sent_before) = (now_us(), comm.bytes_sent());
        let result = comm.all_gather_in_place(&mut values);
        let failed = result.is_err();
        let span = record.then(|| Span {
            kind: SpanKind::Comm,
            name: format!("all_gather {} (prefetch)", unit.name()),
            step,
            lane: lane::COMM.into(),
            start_us,
            end_us: now_us(),
            layer: None,
            bucket: None,
            bytes: Some(comm.bytes_sent() - sent_before),
            micro: None,
            chunk: None,
        });
        if done.send(result.map(|()| Gathered { unit, values, span })).is_err() || failed {
            return;
        }
    }
}
