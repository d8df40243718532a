//! The pipeline schedule's math, plain Rust and unit-tested: which forward and
//! backward boxes each stage ran in one step, the measured bubble next to the
//! schedule's formula ([`Pipeline::formula_bubble`]), and the step replayed as if every stage had a device of its own
//! ([`project`]).

use crate::plan::schedule::{Action, Pipeline};
use crate::wire::trace::{lane, RankTrace, Span, SpanKind};
use crate::ExperimentSpec;

/// True for the spans a pipeline timeline draws: forwards, backwards (B and W) and waits
/// on the compute lane.
fn is_pipeline_span(s: &Span) -> bool {
    s.lane == crate::wire::trace::lane::COMPUTE && (is_pass(s) || s.kind == SpanKind::Idle)
}

/// A forward, a backward, or (ZB-H1) a backward's weight half.
fn is_pass(s: &Span) -> bool {
    matches!(s.kind, SpanKind::Forward | SpanKind::Backward | SpanKind::Weights)
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
    /// Per rank: (rank, busy µs in F+B (+W), bubble share 1 - busy/window).
    pub per_rank: Vec<(u32, u64, f64)>,
    /// 1 - (sum of busy) / (ranks * window).
    pub overall: f64,
}

/// The bubble of `rows`; None without forward or backward spans.
pub fn measured_bubble(rows: &[StageRow]) -> Option<Bubble> {
    let compute = |s: &&Span| is_pass(s);
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

/// One stage's pass durations (µs): a forward and a backward of one micro-batch (ZB-H1:
/// the backward's B, and its W).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct StageDurations {
    pub forward: u64,
    pub backward: u64,
    /// 0 where the backward is not split.
    pub weights: u64,
}

/// Every stage's forward and backward as they take with a core to themselves: the lower
/// quartile over all its ranks (its dp and tp replicas) and micro-batches. Waiting for a
/// core only ever adds to a pass, so the faster passes are the ones that had it; a median
/// would still move when more than half of them wait (4 rank processes on 2 cores). None
/// when a stage recorded no forward or no backward.
pub fn stage_durations(rows: &[StageRow], stage_of: &[usize], stages: usize) -> Option<Vec<StageDurations>> {
    (0..stages)
        .map(|stage| {
            let quartile = |kind: SpanKind| {
                let mut took: Vec<u64> = rows
                    .iter()
                    .zip(stage_of)
                    .filter(|(_, &s)| s == stage)
                    .flat_map(|(r, _)| r.spans.iter().filter(|s| s.kind == kind))
                    .map(|s| s.end_us.saturating_sub(s.start_us))
                    .collect();
                took.sort_unstable();
                took.get(took.len() / 4).copied()
            };
            Some(StageDurations {
                forward: quartile(SpanKind::Forward)?,
                backward: quartile(SpanKind::Backward)?,
                weights: quartile(SpanKind::Weights).unwrap_or(0),
            })
        })
        .collect()
}

/// `step` of a run replayed with a core per stage, as the schedules' formulas assume: each
/// stage's passes as they take with a core to themselves ([`stage_durations`], pooled over
/// every recorded step after the first, the warm-up) laid out by the schedule
/// ([`project`]). The stages' durations and the replay's bubble; None without a pipeline
/// trace in which every stage has a forward and a backward.
pub fn replay_with_a_core_per_stage(
    spec: &ExperimentSpec,
    ranks: &[RankTrace],
    step: u64,
) -> Option<(Vec<StageDurations>, Bubble)> {
    let steps = recorded_steps(ranks);
    let mut pooled = stage_rows(ranks, step);
    pooled.iter_mut().for_each(|r| r.spans.clear());
    for &s in steps.iter().filter(|&&s| s > 0 || steps.len() == 1) {
        for (row, more) in pooled.iter_mut().zip(stage_rows(ranks, s)) {
            row.spans.extend(more.spans);
        }
    }
    let pipe = Pipeline::of(spec);
    let stages: Vec<usize> = pooled.iter().map(|r| spec.stage_of(r.rank as usize)).collect();
    let durations = stage_durations(&pooled, &stages, pipe.stages)?;
    let bubble = measured_bubble(&project(pipe, &durations, step)?)?;
    Some((durations, bubble))
}

/// A pipelined run's bubble as the schedules' formulas count it: its default step replayed
/// with a core per stage ([`replay_with_a_core_per_stage`]); None without pipeline
/// parallelism or its trace.
pub fn replayed_bubble(spec: &ExperimentSpec, ranks: &[RankTrace]) -> Option<f64> {
    if spec.parallel.pp < 2 {
        return None;
    }
    let step = default_step(&recorded_steps(ranks))?;
    replay_with_a_core_per_stage(spec, ranks, step).map(|(_, bubble)| bubble.overall)
}

/// ZB-H1's bubble with passes of `f`, `b` and `w` µs on P stages and M micro-batches
/// (Qi et al. 2023, section 3.1): (P-1)(F+B-W) idle against M(F+B+W) busy per stage.
pub fn zero_bubble_formula(stages: usize, micro_batches: usize, (f, b, w): (f64, f64, f64)) -> f64 {
    let idle = (stages.max(1) - 1) as f64 * (f + b - w).max(0.0);
    let busy = micro_batches as f64 * (f + b + w);
    if idle + busy > 0.0 {
        idle / (idle + busy)
    } else {
        0.0
    }
}

/// The step of `pipe` replayed from `durations` (one per stage, of one pass through one of
/// its chunks) as if every stage ran on a device of its own with nothing else on it and
/// free transfers: each stage runs its passes in the schedule's order, a forward as soon
/// as the previous model chunk's forward of the same micro-batch is done, a backward as
/// soon as the next chunk's backward is (the last chunk's: its own forward). One row per
/// stage (`rank` = the stage), its passes and its waits as spans from 0 µs; None if the
/// schedule could not finish (it always can).
///
/// With every forward taking F and every backward B, GPipe and 1F1B both finish at
/// (M+P-1)(F+B): the bubble is the formula's (P-1)/(M+P-1) (interleaved: (P-1)/(vM+P-1);
/// ZB-H1 with W as long as F and B: (P-1)/(3M+P-1)).
/// Measured durations differ by stage (the first holds the embeddings, the last the head
/// and the loss), and the slowest stage sets the pace.
pub fn project(pipe: Pipeline, durations: &[StageDurations], step: u64) -> Option<Vec<StageRow>> {
    let stages = durations.len();
    if stages != pipe.stages {
        return None;
    }
    let (m, last_chunk) = (pipe.micro_batches, pipe.model_chunks() - 1);
    let orders: Vec<Vec<Action>> = (0..stages).map(|s| pipe.actions(s)).collect();
    let mut next = vec![0usize; stages];
    let mut free = vec![0u64; stages];
    let mut forward_end = vec![vec![None::<u64>; m]; pipe.model_chunks()];
    let mut backward_end = vec![vec![None::<u64>; m]; pipe.model_chunks()];
    let mut rows: Vec<StageRow> = (0..stages).map(|s| StageRow { rank: s as u32, spans: Vec::new() }).collect();
    loop {
        let mut progressed = false;
        for s in 0..stages {
            while let Some(&action) = orders[s].get(next[s]) {
                let (micro, g) = (action.micro(), pipe.model_chunk(s, action.chunk()));
                let chunk = (pipe.chunks > 1).then_some(action.chunk());
                let (ready, took, kind) = match action {
                    Action::Forward { .. } => {
                        let ready = if g == 0 { Some(0) } else { forward_end[g - 1][micro] };
                        (ready, durations[s].forward, SpanKind::Forward)
                    }
                    Action::Backward { .. } => {
                        let ready = if g == last_chunk { forward_end[g][micro] } else { backward_end[g + 1][micro] };
                        (ready, durations[s].backward, SpanKind::Backward)
                    }
                    // (after its own B, earlier in the stage's order)
                    Action::Weights { .. } => (Some(0), durations[s].weights, SpanKind::Weights),
                };
                let Some(ready) = ready else { break };
                let start = ready.max(free[s]);
                if start > free[s] && !rows[s].spans.is_empty() {
                    rows[s].spans.push(projected_span(
                        SpanKind::Idle,
                        "wait for a neighbour".into(),
                        (micro, None),
                        step,
                        free[s],
                        start,
                    ));
                }
                let end = start + took;
                let name = format!("{} (projected)", pass_name(kind, micro, chunk));
                rows[s].spans.push(projected_span(kind, name, (micro, chunk), step, start, end));
                match kind {
                    SpanKind::Forward => forward_end[g][micro] = Some(end),
                    SpanKind::Backward => backward_end[g][micro] = Some(end),
                    _ => {}
                }
                free[s] = end;
                next[s] += 1;
                progressed = true;
            }
        }
        if (0..stages).all(|s| next[s] == orders[s].len()) {
            return Some(rows);
        }
        if !progressed {
            return None;
        }
    }
}

/// The name of a pass's span: "forward 3", or with several chunks per stage "forward 3
/// (chunk 1)"; ZB-H1's W "weights 3".
pub fn pass_name(kind: SpanKind, micro: usize, chunk: Option<usize>) -> String {
    let pass = match kind {
        SpanKind::Forward => "forward",
        SpanKind::Weights => "weights",
        _ => "backward",
    };
    match chunk {
        Some(chunk) => format!("{pass} {micro} (chunk {chunk})"),
        None => format!("{pass} {micro}"),
    }
}

fn projected_span(
    kind: SpanKind,
    name: String,
    at: (usize, Option<usize>),
    step: u64,
    start_us: u64,
    end_us: u64,
) -> Span {
    let (micro, chunk) = at;
    Span {
        kind,
        name,
        step,
        lane: lane::COMPUTE.into(),
        start_us,
        end_us,
        layer: None,
        bucket: None,
        bytes: None,
        micro: Some(micro as u32),
        chunk: chunk.map(|c| c as u32),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::spec::PpSchedule;

    fn pipe(kind: PpSchedule, stages: usize, chunks: usize, micro_batches: usize) -> Pipeline {
        Pipeline { kind, stages, chunks, micro_batches }
    }

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
            chunk: None,
        }
    }

    fn rank(rank: u32, spans: Vec<Span>) -> RankTrace {
        RankTrace { rank, world: 2, span_steps: 3, spans, ..RankTrace::default() }
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
        assert!((b.overall - pipe(PpSchedule::OneFOneB, 2, 1, 1).formula_bubble()).abs() < 1e-12);
    }

    #[test]
    fn equal_stages_replay_to_the_formula_and_a_slow_stage_sets_the_pace() {
        let mut shapes: Vec<Pipeline> = Vec::new();
        for kind in [PpSchedule::Gpipe, PpSchedule::OneFOneB] {
            for p in 1..=5 {
                shapes.extend((1..=9).map(|m| pipe(kind, p, 1, m)));
            }
        }
        for p in 2..=4 {
            for v in 2..=3 {
                shapes.extend((1..=3).map(|groups| pipe(PpSchedule::Interleaved, p, v, groups * p)));
            }
        }
        for shape in shapes {
            let (p, v, m) = (shape.stages, shape.chunks, shape.micro_batches);
            let equal = vec![StageDurations { forward: 10, backward: 23, weights: 0 }; p];
            let rows = project(shape, &equal, 1).unwrap();
            let b = measured_bubble(&rows).unwrap();
            assert_eq!(b.window, (0, (v * m + p - 1) as u64 * 33), "{shape:?}");
            assert!((b.overall - shape.formula_bubble()).abs() < 1e-12, "{shape:?}");
            // Every pass once, in the schedule's order, one at a time per stage.
            for row in &rows {
                let passes = row.spans.iter().filter(|s| s.kind != SpanKind::Idle).count();
                assert_eq!(passes, 2 * m * v);
                assert!(row.spans.windows(2).all(|w| w[0].end_us <= w[1].start_us));
            }
        }
        // ZB-H1 with F = B = W: (P-1)(F+B-W) idle against M(F+B+W) busy on every stage.
        for p in 2..=5 {
            for m in p..=9 {
                let shape = pipe(PpSchedule::ZbH1, p, 1, m);
                let equal = vec![StageDurations { forward: 10, backward: 10, weights: 10 }; p];
                let rows = project(shape, &equal, 1).unwrap();
                let b = measured_bubble(&rows).unwrap();
                assert_eq!(b.window, (0, (3 * m + p - 1) as u64 * 10), "{shape:?}");
                assert!((b.overall - shape.formula_bubble()).abs() < 1e-12, "{shape:?}");
            }
        }
        // ZBV with F = B = W per chunk pass: P-1 of them idle against 6M busy on every stage.
        for p in 2..=5 {
            for m in 2 * p - 1..=12 {
                let shape = pipe(PpSchedule::Zbv, p, 2, m);
                let equal = vec![StageDurations { forward: 10, backward: 10, weights: 10 }; p];
                let b = measured_bubble(&project(shape, &equal, 1).unwrap()).unwrap();
                assert_eq!(b.window, (0, (6 * m + p - 1) as u64 * 10), "{shape:?}");
                assert!((b.overall - shape.formula_bubble()).abs() < 1e-12, "{shape:?}");
            }
        }
        // DualPipeV with F = B = W per chunk pass, its pairs one pass after the other:
        // ZBV's P-1 of them idle against 6M busy on every stage, under DeepSeek's formula,
        // which counts a pair as one block.
        for p in 2..=5 {
            for m in 2 * p..=12 {
                let shape = pipe(PpSchedule::DualPipeV, p, 2, m);
                let equal = vec![StageDurations { forward: 10, backward: 10, weights: 10 }; p];
                let b = measured_bubble(&project(shape, &equal, 1).unwrap()).unwrap();
                assert_eq!(b.window, (0, (6 * m + p - 1) as u64 * 10), "{shape:?}");
                assert!(b.overall < shape.formula_bubble(), "{shape:?}");
            }
        }
        // The last stage twice as slow: everything waits for it.
        let mut slow = vec![StageDurations { forward: 10, backward: 20, weights: 0 }; 4];
        slow[3] = StageDurations { forward: 20, backward: 40, weights: 0 };
        let one_f_one_b = pipe(PpSchedule::OneFOneB, 4, 1, 8);
        let b = measured_bubble(&project(one_f_one_b, &slow, 1).unwrap()).unwrap();
        assert!(b.overall > one_f_one_b.formula_bubble() + 0.1, "{}", b.overall);
    }

    #[test]
    fn zero_bubble_formula_is_a_third_of_1f1b_s_bubble_when_the_passes_are_equal() {
        // P = 4, M = 8: (P-1)(F+B-W) = 3 slots idle against 24 busy, 3/27.
        assert!((zero_bubble_formula(4, 8, (1.0, 1.0, 1.0)) - 3.0 / 27.0).abs() < 1e-12);
        // W as long as F + B: no bubble; no W: 1F1B's (P-1)/(M+P-1).
        assert_eq!(zero_bubble_formula(4, 8, (1.0, 1.0, 2.0)), 0.0);
        assert!((zero_bubble_formula(4, 8, (1.0, 2.0, 0.0)) - 3.0 / 11.0).abs() < 1e-12);
        assert_eq!(zero_bubble_formula(1, 8, (1.0, 1.0, 1.0)), 0.0);
    }

    #[test]
    fn a_stage_s_duration_is_the_lower_quartile_over_its_ranks_and_micro_batches() {
        let f = |micro, start, end| span(SpanKind::Forward, 1, micro, start, end);
        let rows = vec![
            StageRow { rank: 0, spans: vec![f(0, 0, 10), f(1, 10, 19), span(SpanKind::Backward, 1, 0, 19, 39)] },
            // A pass that lost its core for a while does not move the quartile.
            StageRow { rank: 1, spans: vec![f(0, 0, 11), f(1, 11, 500), span(SpanKind::Backward, 1, 0, 500, 520)] },
        ];
        let d = stage_durations(&rows, &[0, 0], 1).unwrap();
        assert_eq!(d, vec![StageDurations { forward: 10, backward: 20, weights: 0 }]);
        assert!(stage_durations(&rows, &[0, 0], 2).is_none(), "stage 1 recorded nothing");
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
