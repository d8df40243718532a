//! Runs and traces made up for the checks' unit tests.

use crate::plan::planner;
use crate::wire::events::MetricPoint;
use crate::wire::trace::{CollectiveOp, RankTrace};
use crate::{ExperimentSpec, ExperimentView};

/// A succeeded run of `spec` as the server would show it.
pub(super) fn succeeded_view(id: i64, spec: ExperimentSpec, summary: Option<crate::RunSummary>) -> ExperimentView {
    ExperimentView {
        id,
        name: spec.name.clone(),
        owner: "local".into(),
        status: crate::ExperimentStatus::Succeeded,
        spec,
        created_at: String::new(),
        started_at: None,
        finished_at: None,
        error: None,
        summary,
        attempt: 1,
        steps_done: 0,
    }
}

pub(super) fn losses(first: f64, last: f64) -> Vec<MetricPoint> {
    vec![
        MetricPoint { step: 0, loss: first, ..MetricPoint::default() },
        MetricPoint { step: 1, loss: last, ..MetricPoint::default() },
    ]
}

pub(super) fn counter(op: CollectiveOp, calls: u64, bytes_sent: u64) -> crate::wire::trace::CollectiveCounter {
    crate::wire::trace::CollectiveCounter { op, calls, elements: 0, bytes_sent, bytes_from_formula: false, total_us: 0 }
}

pub(super) fn traced(counters: Vec<crate::wire::trace::CollectiveCounter>, parameters: u64) -> Vec<RankTrace> {
    vec![RankTrace {
        comm: crate::wire::trace::RankCommTrace { counters, ..Default::default() },
        memory: Some(crate::wire::memory::RankMemoryReport {
            peak: planner::RankMemory { parameters, ..Default::default() },
            ..Default::default()
        }),
        ..RankTrace::default()
    }]
}

/// A span of step 0 on the compute lane.
pub(super) fn compute_span(
    kind: crate::wire::trace::SpanKind,
    name: &str,
    start_us: u64,
    end_us: u64,
) -> crate::wire::trace::Span {
    crate::wire::trace::Span {
        kind,
        name: name.into(),
        step: 0,
        lane: crate::wire::trace::lane::COMPUTE.into(),
        start_us,
        end_us,
        layer: None,
        bucket: None,
        bytes: None,
        micro: None,
        chunk: None,
    }
}
