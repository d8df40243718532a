//! What a rank records while it trains: collective calls and their ring steps
//! (full detail for the first ones, counters for all), read by the ring replay page.

use std::sync::Mutex;
use std::time::{SystemTime, UNIX_EPOCH};

use distlab_common::trace::*;

/// Buffers up to this many elements have their values recorded (readable demos).
pub const VALUE_RECORD_LIMIT: usize = 64;

/// Microseconds since the Unix epoch: rank processes on one machine share this clock.
pub fn now_us() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_micros() as u64)
}

/// One rank's communication record, shared by the rank's communicators (one per group).
pub struct CommTracer {
    trace: Mutex<RankCommTrace>,
}

impl CommTracer {
    pub fn new(rank: usize, detail_limit: u64) -> Self {
        let trace = RankCommTrace { rank: rank as u32, detail_limit, ..RankCommTrace::default() };
        Self { trace: Mutex::new(trace) }
    }

    /// Whether the next collective should be recorded step by step.
    pub fn wants_detail(&self) -> bool {
        let t = self.lock();
        (t.collectives.len() as u64) < t.detail_limit
    }

    /// Adds one finished collective: always to the counters, in detail while under the limit.
    pub fn record(&self, record: CollectiveRecord, steps: Vec<RingStep>) {
        let mut t = self.lock();
        let duration = record.end_us.saturating_sub(record.start_us);
        let same = |c: &&mut CollectiveCounter| c.op == record.op && c.bytes_from_formula == record.bytes_from_formula;
        match t.counters.iter_mut().find(same) {
            Some(c) => {
                c.calls += 1;
                c.elements += record.elements;
                c.bytes_sent += record.bytes_sent;
                c.total_us += duration;
            }
            None => t.counters.push(CollectiveCounter {
                op: record.op,
                calls: 1,
                elements: record.elements,
                bytes_sent: record.bytes_sent,
                bytes_from_formula: record.bytes_from_formula,
                total_us: duration,
            }),
        }
        if (t.collectives.len() as u64) < t.detail_limit {
            t.collectives.push(record);
            t.steps.extend(steps);
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
