//! What a rank records while it trains: collective calls and their ring steps
//! (full detail for the first ones, counters for all), read by the ring replay page.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Mutex;
use std::time::{SystemTime, UNIX_EPOCH};

use distlab_common::trace::*;

/// Buffers up to this many elements have their values recorded (readable demos).
pub const VALUE_RECORD_LIMIT: usize = 64;

/// Microseconds since the Unix epoch: rank processes on one machine share this clock.
pub fn now_us() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_micros() as u64)
}

thread_local! {
    /// Set on a thread whose collectives are training's whatever the rank's compute thread
    /// does (the parameter server's threads, which serve workers while rank 0 evaluates).
    static TRAINING_ONLY: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
}

/// The collectives this thread runs from now on count as training's, even while the rank
/// evaluates.
pub fn count_this_thread_as_training() {
    TRAINING_ONLY.with(|t| t.set(true));
}

/// One rank's communication record, shared by the rank's communicators (one per group).
pub struct CommTracer {
    trace: Mutex<RankCommTrace>,
    /// Set while the rank evaluates (`Trainer::evaluate`): its calls go to the evaluation's
    /// counters, so that the training's stay what the steps sent.
    evaluating: AtomicBool,
}

impl CommTracer {
    pub fn new(rank: usize, detail_limit: u64) -> Self {
        let trace = RankCommTrace { rank: rank as u32, detail_limit, ..RankCommTrace::default() };
        Self { trace: Mutex::new(trace), evaluating: AtomicBool::new(false) }
    }

    /// From now on the calls are an evaluation's (true) or training's (false).
    pub fn set_evaluating(&self, evaluating: bool) {
        self.evaluating.store(evaluating, Ordering::Relaxed);
    }

    /// Whether the call being counted is an evaluation's.
    fn evaluating(&self) -> bool {
        self.evaluating.load(Ordering::Relaxed) && !TRAINING_ONLY.with(|t| t.get())
    }

    /// Whether the next collective should be recorded step by step.
    pub fn wants_detail(&self) -> bool {
        let t = self.lock();
        (t.collectives.len() as u64) < t.detail_limit
    }

    /// Adds one finished collective: always to the counters, in detail while under the limit.
    pub fn record(&self, record: CollectiveRecord, steps: Vec<RingStep>) {
        let duration = record.end_us.saturating_sub(record.start_us);
        let call = (record.elements, record.bytes_sent, duration);
        if self.evaluating() {
            return add_to_counters(&mut self.lock().evaluation, record.op, record.bytes_from_formula, call);
        }
        let mut t = self.lock();
        add_to_counters(&mut t.counters, record.op, record.bytes_from_formula, call);
        if (t.collectives.len() as u64) < t.detail_limit {
            t.collectives.push(record);
            t.steps.extend(steps);
        }
    }

    /// Counts one call that is never recorded in detail (a pipeline's point-to-point send:
    /// many per step, each one message to one peer).
    pub fn count(&self, op: CollectiveOp, elements: u64, bytes_sent: u64, duration_us: u64) {
        let mut t = self.lock();
        let counters = if self.evaluating() { &mut t.evaluation } else { &mut t.counters };
        add_to_counters(counters, op, false, (elements, bytes_sent, duration_us));
    }

    /// Counts `bytes` this rank sent to global rank `to` in training (what each link
    /// carried, whether or not its collective is recorded step by step).
    pub fn count_sent_to(&self, to: u32, bytes: u64) {
        if self.evaluating() {
            return;
        }
        let mut t = self.lock();
        match t.sent_to.iter_mut().find(|p| p.to == to) {
            Some(p) => p.bytes += bytes,
            None => t.sent_to.push(PeerBytes { to, bytes }),
        }
    }

    pub fn snapshot(&self) -> RankCommTrace {
        self.lock().clone()
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, RankCommTrace> {
        // A panic while holding the lock cannot leave the record half-written in a way
        // that matters for reading it, so a poisoned lock is still used.
        self.trace.lock().unwrap_or_else(|p| p.into_inner())
    }
}

/// Adds one call of `op` (elements, bytes sent, µs) to `counters`.
fn add_to_counters(
    counters: &mut Vec<CollectiveCounter>,
    op: CollectiveOp,
    bytes_from_formula: bool,
    call: (u64, u64, u64),
) {
    let (elements, bytes_sent, total_us) = call;
    match counters.iter_mut().find(|c| c.op == op && c.bytes_from_formula == bytes_from_formula) {
        Some(c) => {
            c.calls += 1;
            c.elements += elements;
            c.bytes_sent += bytes_sent;
            c.total_us += total_us;
        }
        None => counters.push(CollectiveCounter { op, calls: 1, elements, bytes_sent, bytes_from_formula, total_us }),
    }
}

/// A data-parallel collective the compute thread issued and waited for, from `start_us`
/// to now, in which this rank sent `bytes_sent` bytes.
pub fn blocking_comm_span(name: &str, step: u64, start_us: u64, bytes_sent: u64) -> Span {
    Span {
        kind: SpanKind::Comm,
        name: name.into(),
        step,
        lane: lane::DP_BLOCKING.into(),
        start_us,
        end_us: now_us(),
        layer: None,
        bucket: None,
        bytes: Some(bytes_sent),
        micro: None,
        chunk: None,
    }
}
