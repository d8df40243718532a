//! The pipeline schedule's math, plain Rust and unit-tested: which forward and
//! backward boxes each stage ran in one step, and the measured bubble next to the
//! formula (P-1)/(M+P-1).

use crate::trace::{RankTrace, Span, SpanKind};

/// The analytic bubble of a pipeline with `stages` stages and `micro_batches`
/// micro-batches per step: (P-1)/(M+P-1).
pub fn formula_bubble(stages: usize, micro_batches: usize) -> f64 {
    let (p, m) = (stages.max(1) as f64, micro_batches.max(1) as f64);
    (p - 1.0) / (m + p - 1.0)
}

/// True for the spans a pipeline timeline draws: forwards, backwards and waits on the compute lane.
fn is_pipeline_span(s: &Span) -> bool {
    s.lane == crate::trace::lane::COMPUTE && matches!(s.kind, SpanKind::Forward | SpanKind::Backward | SpanKind::Idle)
}

/// One stage's spans of one step (forward, backward, idle).
#[derive(Clone, Debug, PartialEq)]
pub struct StageRow {
    pub rank: u32,
    pub spans: Vec<Span>,
}

/// The rows of `step`, one per rank in rank order.
pub fn stage_rows(ranks: &[RankTrace], step: u64) -> Vec<StageRow> {
    let mut rows: Vec<StageRow> = ranks
        .iter()
        .map(|r| StageRow {
            rank: r.rank,
            spans: r.spans.iter().filter(|s| s.step == step && is_pipeline_span(s)).cloned().collect(),
        })
        .collect();
    rows.sort_by_key(|r| r.rank);
    rows
}

/// The steps with spans, in order.
pub fn recorded_steps(ranks: &[RankTrace]) -> Vec<u64> {
    let mut steps: Vec<u64> = ranks.iter().flat_map(|r| r.spans.iter().map(|s| s.step)).collect();
    steps.sort_unstable();
    steps.dedup();
    steps
}

/// Step 1 (the first after warm-up) when recorded, else the first recorded step.
pub fn default_step(steps: &[u64]) -> Option<u64> {
    steps.iter().copied().find(|&s| s == 1).or(steps.first().copied())
}

/// The measured bubble of one step.
#[derive(Clone, Debug, PartialEq)]
pub struct Bubble {
    /// Earliest forward start and latest backward end over all ranks (µs).
    pub window: (u64, u64),
    /// Per rank: (rank, busy µs in F+B, bubble share 1 - busy/window).
    pub per_rank: Vec<(u32, u64, f64)>,
    /// 1 - (sum of busy) / (ranks * window).
    pub overall: f64,
}

/// The bubble of `rows`; None without forward or backward spans.
pub fn measured_bubble(rows: &[StageRow]) -> Option<Bubble> {
    let compute = |s: &&Span| matches!(s.kind, SpanKind::Forward | SpanKind::Backward);
    let start = rows.iter().flat_map(|r| r.spans.iter().filter(compute).map(|s| s.start_us)).min()?;
    let end = rows.iter().flat_map(|r| r.spans.iter().filter(compute).map(|s| s.end_us)).max()?;
    let window = end.saturating_sub(start).max(1);
    let per_rank: Vec<(u32, u64, f64)> = rows
        .iter()
        .map(|r| {
            let busy: u64 = r.spans.iter().filter(compute).map(|s| s.end_us.saturating_sub(s.start_us)).sum();
            (r.rank, busy, 1.0 - busy as f64 / window as f64)
        })
        .collect();
    let busy: u64 = per_rank.iter().map(|p| p.1).sum();
    let overall = 1.0 - busy as f64 / (window as f64 * rows.len().max(1) as f64);
    Some(Bubble { window: (start, end), per_rank, overall })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn span(kind: SpanKind, step: u64, micro: u32, start_us: u64, end_us: u64) -> Span {
        Span {
            kind,
            name: format!("{kind:?} {micro}"),
            step,
            lane: "compute".into(),
            start_us,
            end_us,
            layer: None,
            bucket: None,
            bytes: None,
            micro: Some(micro),
        }
    }

    fn rank(rank: u32, spans: Vec<Span>) -> RankTrace {
        RankTrace { rank, world: 2, span_steps: 3, spans, ..RankTrace::default() }
    }

    #[test]
    fn formula_matches_known_values() {
        assert_eq!(formula_bubble(1, 8), 0.0);
        assert!((formula_bubble(4, 8) - 3.0 / 11.0).abs() < 1e-12);
        assert!((formula_bubble(2, 1) - 0.5).abs() < 1e-12);
    }

    #[test]
    fn two_stages_one_micro_batch_idle_half_the_time() {
        // Stage 0: F [0,10), B [30,40). Stage 1: F [10,20), B [20,30). Window [0,40).
        let ranks = vec![
            rank(1, vec![span(SpanKind::Forward, 0, 0, 10, 20), span(SpanKind::Backward, 0, 0, 20, 30)]),
            rank(
                0,
                vec![
                    span(SpanKind::Forward, 0, 0, 0, 10),
                    span(SpanKind::Idle, 0, 0, 10, 30),
                    span(SpanKind::Backward, 0, 0, 30, 40),
                    span(SpanKind::Forward, 1, 0, 100, 110),
                ],
            ),
        ];
        let rows = stage_rows(&ranks, 0);
        assert_eq!(rows.iter().map(|r| r.rank).collect::<Vec<_>>(), vec![0, 1]);
        assert_eq!(rows[0].spans.len(), 3);
        let b = measured_bubble(&rows).unwrap();
        assert_eq!(b.window, (0, 40));
        assert_eq!(b.per_rank, vec![(0, 20, 0.5), (1, 20, 0.5)]);
        assert!((b.overall - 0.5).abs() < 1e-12);
        assert!((b.overall - formula_bubble(2, 1)).abs() < 1e-12);
    }

    #[test]
    fn steps_and_default() {
        let ranks = vec![rank(0, vec![span(SpanKind::Forward, 2, 0, 0, 1), span(SpanKind::Forward, 0, 0, 0, 1)])];
        assert_eq!(recorded_steps(&ranks), vec![0, 2]);
        assert_eq!(default_step(&[0, 1, 2]), Some(1));
        assert_eq!(default_step(&[0, 2]), Some(0));
        assert_eq!(default_step(&[]), None);
        assert!(measured_bubble(&stage_rows(&ranks, 7)).is_none());
    }
}
