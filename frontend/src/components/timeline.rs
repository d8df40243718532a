//! The rank timeline: one row per rank with up to four lanes (compute; comm, DDP's buckets
//! and FSDP's prefetched gathers on the communication thread, which may overlap compute;
//! DP blocking, ZeRO/FSDP's gathers and reduce-scatters, which the compute thread issues
//! and waits for; TP comm, tensor parallelism's all-reduces, also waited for), a box per
//! recorded span coloured by its kind, a time axis in ms from the earliest span of the
//! chosen step, and hover titles (name, duration, bytes sent). Under it, the overlap: how
//! much of each rank's data-parallel communication ran on the communication thread while
//! the same rank was computing (forward or backward), i.e. was hidden behind it; blocking
//! collectives never are.
//!
//! The geometry ([`TimelineModel`]) and the overlap ([`overlap`]) are plain Rust,
//! unit-tested; the component only draws them.

use std::collections::BTreeSet;

use distlab_common::trace::{lane, Span, SpanKind};
use leptos::prelude::*;

use crate::components::loss_chart::nice_step;
use crate::format;

const WIDTH: f64 = 1000.0;
const LEFT: f64 = 92.0;
const RIGHT: f64 = 20.0;
const TOP: f64 = 34.0;
const BOTTOM: f64 = 44.0;
const LANE_H: f64 = 20.0;
const LANE_GAP: f64 = 4.0;
const ROW_GAP: f64 = 12.0;
/// Boxes narrower than this get no text inside (their title still tells).
const LABEL_MIN_W: f64 = 64.0;

/// One rank's spans, as the trace holds them.
#[derive(Clone, Debug, PartialEq)]
pub struct RankSpans {
    pub rank: u32,
    pub spans: Vec<Span>,
}

/// Which steps to draw.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum StepChoice {
    All,
    Step(u64),
}

impl StepChoice {
    fn admits(self, span: &Span) -> bool {
        match self {
            StepChoice::All => true,
            StepChoice::Step(s) => span.step == s,
        }
    }

    fn to_value(self) -> String {
        match self {
            StepChoice::All => "all".into(),
            StepChoice::Step(s) => s.to_string(),
        }
    }

    fn parse(s: &str) -> Self {
        s.parse().map(StepChoice::Step).unwrap_or(StepChoice::All)
    }
}

/// The optimizer steps that have spans, in order.
pub fn recorded_steps(ranks: &[RankSpans]) -> Vec<u64> {
    ranks.iter().flat_map(|r| r.spans.iter().map(|s| s.step)).collect::<BTreeSet<_>>().into_iter().collect()
}

/// The step shown first: the second recorded one when there are several (the first
/// step pays for warm-up: allocations, first touches of memory), else the first.
pub fn default_step(steps: &[u64]) -> StepChoice {
    match steps {
        [] => StepChoice::All,
        [only] => StepChoice::Step(*only),
        [_, second, ..] => StepChoice::Step(*second),
    }
}

fn kind_class(kind: SpanKind) -> &'static str {
    match kind {
        SpanKind::Forward => "span-forward",
        SpanKind::Backward => "span-backward",
        SpanKind::Weights => "span-weights",
        SpanKind::Comm => "span-comm",
        SpanKind::Optimizer => "span-optimizer",
        SpanKind::Idle => "span-idle",
    }
}

fn kind_name(kind: SpanKind) -> &'static str {
    match kind {
        SpanKind::Forward => "forward",
        SpanKind::Backward => "backward",
        SpanKind::Weights => "weight gradients (W)",
        SpanKind::Comm => "communication",
        SpanKind::Optimizer => "optimizer",
        SpanKind::Idle => "idle / waiting",
    }
}

/// Data-parallel communication: the communication thread's, and the blocking kind.
fn is_dp_comm(span: &Span) -> bool {
    span.kind == SpanKind::Comm && (span.lane == lane::COMM || span.lane == lane::DP_BLOCKING)
}

/// A rank row's lanes, top to bottom: (the spans' `lane`, its label). Compute is always
/// drawn; the others when some span of the chosen steps is on them.
const LANES: [(&str, &str); 7] = [
    (lane::COMPUTE, ""),
    (lane::COMM, "comm"),
    (lane::DP_BLOCKING, "DP blocking"),
    (lane::TP, "TP comm"),
    (lane::EP, "EP comm"),
    (lane::CP, "CP comm"),
    (lane::OFFLOAD, "offload"),
];

fn lane_index(span: &Span) -> usize {
    LANES.iter().position(|(lane, _)| *lane == span.lane).unwrap_or(0)
}

// ---- overlap ----

/// Sorted, disjoint intervals covering the same time as `intervals` (half-open, µs).
pub fn union(intervals: impl IntoIterator<Item = (u64, u64)>) -> Vec<(u64, u64)> {
    let mut v: Vec<(u64, u64)> = intervals.into_iter().filter(|(a, b)| b > a).collect();
    v.sort_unstable();
    let mut out: Vec<(u64, u64)> = Vec::with_capacity(v.len());
    for (a, b) in v {
        match out.last_mut() {
            Some(last) if a <= last.1 => last.1 = last.1.max(b),
            _ => out.push((a, b)),
        }
    }
    out
}

pub fn total(intervals: &[(u64, u64)]) -> u64 {
    intervals.iter().map(|(a, b)| b - a).sum()
}

/// Time covered by both of two unions (each sorted and disjoint).
pub fn intersection(a: &[(u64, u64)], b: &[(u64, u64)]) -> u64 {
    let (mut i, mut j, mut sum) = (0, 0, 0);
    while i < a.len() && j < b.len() {
        let lo = a[i].0.max(b[j].0);
        let hi = a[i].1.min(b[j].1);
        if hi > lo {
            sum += hi - lo;
        }
        if a[i].1 < b[j].1 {
            i += 1;
        } else {
            j += 1;
        }
    }
    sum
}

/// How much of a rank's data-parallel communication ran under its own compute.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Overlap {
    /// None for the sum over ranks.
    pub rank: Option<u32>,
    /// Time the data-parallel comm lanes were busy (union of their spans).
    pub comm_us: u64,
    /// Of that, the time the communication thread ran while the same rank was in a
    /// forward or backward span (a blocking collective inside them is not hidden: compute
    /// waits for it).
    pub hidden_us: u64,
}

impl Overlap {
    /// The hidden share, 0..=1; None without communication.
    pub fn share(&self) -> Option<f64> {
        (self.comm_us > 0).then(|| self.hidden_us as f64 / self.comm_us as f64)
    }

    pub fn exposed_us(&self) -> u64 {
        self.comm_us - self.hidden_us
    }
}

/// The overlap of one rank's spans (those of the chosen steps).
pub fn overlap<'a>(rank: u32, spans: impl IntoIterator<Item = &'a Span> + Clone) -> Overlap {
    let comm = union(spans.clone().into_iter().filter(|s| is_dp_comm(s)).map(|s| (s.start_us, s.end_us)));
    let background = union(spans.clone().into_iter().filter(|s| s.lane == lane::COMM).map(|s| (s.start_us, s.end_us)));
    let computing = union(
        spans
            .into_iter()
            .filter(|s| matches!(s.kind, SpanKind::Forward | SpanKind::Backward) && s.lane == lane::COMPUTE)
            .map(|s| (s.start_us, s.end_us)),
    );
    Overlap { rank: Some(rank), comm_us: total(&comm), hidden_us: intersection(&background, &computing) }
}

/// Per rank (ranks with communication) and the sum over them.
pub fn overlaps(ranks: &[RankSpans], choice: StepChoice) -> (Vec<Overlap>, Overlap) {
    let per_rank: Vec<Overlap> = ranks
        .iter()
        .map(|r| overlap(r.rank, r.spans.iter().filter(|s| choice.admits(s)).collect::<Vec<_>>()))
        .filter(|o| o.comm_us > 0)
        .collect();
    let all = Overlap {
        rank: None,
        comm_us: per_rank.iter().map(|o| o.comm_us).sum(),
        hidden_us: per_rank.iter().map(|o| o.hidden_us).sum(),
    };
    (per_rank, all)
}

/// Tensor-parallel all-reduces of the chosen steps, per rank on average: (calls, µs).
/// Compute waits for every one of them: they sit between a block's matmuls.
pub fn tp_sums(ranks: &[RankSpans], choice: StepChoice) -> Option<(f64, f64)> {
    let tp: Vec<&Span> =
        ranks.iter().flat_map(|r| r.spans.iter()).filter(|s| s.lane == lane::TP && choice.admits(s)).collect();
    let n = ranks.len().max(1) as f64;
    let us: u64 = tp.iter().map(|s| s.end_us.saturating_sub(s.start_us)).sum();
    (!tp.is_empty()).then(|| (tp.len() as f64 / n, us as f64 / n))
}

// ---- geometry ----

#[derive(Clone, Debug, PartialEq)]
pub struct SpanBox {
    pub x: f64,
    pub y: f64,
    pub w: f64,
    pub h: f64,
    pub class: &'static str,
    pub title: String,
    /// Text inside the box when it is wide enough.
    pub label: Option<String>,
}

#[derive(Clone, Debug, PartialEq)]
pub struct LaneLabel {
    pub y: f64,
    pub text: String,
    /// The first lane of a rank (the rank's name goes there).
    pub rank_row: bool,
}

#[derive(Clone, Debug, PartialEq)]
pub struct TimelineModel {
    pub height: f64,
    pub boxes: Vec<SpanBox>,
    pub lanes: Vec<LaneLabel>,
    /// (x, "1.5") in ms.
    pub ticks: Vec<(f64, String)>,
    pub span_ms: f64,
    pub plot_bottom: f64,
}

fn duration_text(us: u64) -> String {
    let ms = us as f64 / 1000.0;
    if ms >= 10.0 {
        format!("{ms:.1} ms")
    } else {
        format!("{ms:.3} ms")
    }
}

impl TimelineModel {
    pub fn new(ranks: &[RankSpans], choice: StepChoice) -> Self {
        let chosen: Vec<(u32, Vec<&Span>)> =
            ranks.iter().map(|r| (r.rank, r.spans.iter().filter(|s| choice.admits(s)).collect())).collect();
        let t0 = chosen.iter().flat_map(|(_, s)| s.iter().map(|s| s.start_us)).min().unwrap_or(0);
        let t1 = chosen.iter().flat_map(|(_, s)| s.iter().map(|s| s.end_us)).max().unwrap_or(t0).max(t0 + 1);
        let span_ms = (t1 - t0) as f64 / 1000.0;
        let step = nice_step(span_ms / 8.0);
        let axis_ms = (span_ms / step).ceil().max(1.0) * step;
        let plot_w = WIDTH - LEFT - RIGHT;
        let sx = |us: u64| LEFT + (us.saturating_sub(t0)) as f64 / 1000.0 / axis_ms * plot_w;

        let drawn: Vec<usize> = (0..LANES.len())
            .filter(|&l| l == 0 || chosen.iter().any(|(_, s)| s.iter().any(|s| lane_index(s) == l)))
            .collect();
        let row_h = drawn.len() as f64 * (LANE_H + LANE_GAP) - LANE_GAP;
        let mut boxes = Vec::new();
        let mut lanes = Vec::new();
        for (i, (rank, spans)) in chosen.iter().enumerate() {
            let row_y = TOP + i as f64 * (row_h + ROW_GAP);
            let lane_y =
                |lane: usize| row_y + drawn.iter().position(|&l| l == lane).unwrap_or(0) as f64 * (LANE_H + LANE_GAP);
            for &l in &drawn {
                let (rank_row, text) =
                    if l == 0 { (true, format!("rank {rank}")) } else { (false, LANES[l].1.to_string()) };
                lanes.push(LaneLabel { y: lane_y(l), text, rank_row });
            }
            for s in spans {
                let x = sx(s.start_us);
                let w = (sx(s.end_us) - x).max(1.0);
                let us = s.end_us.saturating_sub(s.start_us);
                let mut title = format!("rank {rank} · {} · step {} · {}", s.name, s.step, duration_text(us));
                if let Some(b) = s.bytes {
                    title.push_str(&format!(" · {} sent", format::bytes(b as f64)));
                }
                title.push_str(&format!(" · starts at {}", duration_text(s.start_us.saturating_sub(t0))));
                boxes.push(SpanBox {
                    x,
                    y: lane_y(lane_index(s)),
                    w,
                    h: LANE_H,
                    class: kind_class(s.kind),
                    title,
                    label: (w >= LABEL_MIN_W).then(|| fit(&s.name, w - 8.0)),
                });
            }
        }
        let plot_bottom = TOP + chosen.len() as f64 * (row_h + ROW_GAP) - ROW_GAP + 6.0;
        let decimals = if step >= 1.0 { 0 } else { (-step.log10().floor()) as usize };
        let ticks = (0..=((axis_ms / step).round() as i64))
            .map(|i| {
                let ms = i as f64 * step;
                (LEFT + ms / axis_ms * plot_w, format!("{ms:.decimals$}"))
            })
            .collect();
        TimelineModel { height: plot_bottom + BOTTOM, boxes, lanes, ticks, span_ms, plot_bottom }
    }
}

/// `text` cut to fit `width` pixels of the span labels (about 6 px a character), with "…".
fn fit(text: &str, width: f64) -> String {
    let max = (width / 6.0).floor().max(1.0) as usize;
    if text.chars().count() <= max {
        text.to_string()
    } else {
        let mut out: String = text.chars().take(max.saturating_sub(1)).collect();
        out.push('…');
        out
    }
}

fn percent(share: Option<f64>) -> String {
    share.map(|s| format!("{:.0}%", s * 100.0)).unwrap_or_else(|| "–".into())
}

#[component]
pub fn Timeline(ranks: Vec<RankSpans>) -> impl IntoView {
    let steps = recorded_steps(&ranks);
    let choice = RwSignal::new(default_step(&steps));
    let ranks = StoredValue::new(ranks);
    let model = Memo::new(move |_| ranks.with_value(|r| TimelineModel::new(r, choice.get())));
    let overlap = Memo::new(move |_| ranks.with_value(|r| overlaps(r, choice.get())));
    let tp = Memo::new(move |_| ranks.with_value(|r| tp_sums(r, choice.get())));
    let options = steps
        .iter()
        .map(|&s| {
            let c = StepChoice::Step(s);
            view! { <option value=c.to_value() selected=move || choice.get() == c>{format!("step {s}")}</option> }
        })
        .collect_view();
    let legend = [SpanKind::Forward, SpanKind::Backward, SpanKind::Comm, SpanKind::Optimizer, SpanKind::Idle]
        .into_iter()
        .map(|k| view! { <span class="legend-item"><span class=format!("swatch {}", kind_class(k))></span>{kind_name(k)}</span> })
        .collect_view();
    view! {
        <div class="timeline" id="timeline">
            <div class="timeline-controls">
                <label for="timeline-step">"show "</label>
                <select id="timeline-step" on:change=move |ev| choice.set(StepChoice::parse(&event_target_value(&ev)))>
                    {options}
                    <option value="all" selected=move || choice.get() == StepChoice::All>"all recorded steps"</option>
                </select>
                <span class="legend">{legend}</span>
            </div>
            <svg
                class="chart timeline-chart"
                viewBox=move || format!("0 0 {WIDTH} {:.0}", model.with(|m| m.height))
                role="img"
                aria-label="timeline of every rank: compute and communication spans"
            >
                <rect class="chart-bg" x="0" y="0" width=WIDTH.to_string() height=move || format!("{:.0}", model.with(|m| m.height))></rect>
                <text class="chart-subtitle" x=LEFT.to_string() y="20">
                    {move || format!("time since the first span of the {} (ms)", if choice.get() == StepChoice::All { "run".to_string() } else { "step".to_string() })}
                </text>
                {move || {
                    let m = model.get();
                    let bottom = m.plot_bottom;
                    let ticks = m.ticks.into_iter().map(|(x, label)| view! {
                        <line class="grid-line" x1=format!("{x:.1}") x2=format!("{x:.1}") y1=TOP.to_string() y2=format!("{bottom:.1}")></line>
                        <text class="tick" x=format!("{x:.1}") y=format!("{:.1}", bottom + 16.0) text-anchor="middle">{label}</text>
                    }).collect_view();
                    let lanes = m.lanes.into_iter().map(|l| view! {
                        <text class=if l.rank_row { "lane-label rank" } else { "lane-label" } x=(LEFT - 8.0).to_string()
                            y=format!("{:.1}", l.y + LANE_H * 0.7) text-anchor="end">{l.text}</text>
                    }).collect_view();
                    let boxes = m.boxes.into_iter().map(|b| {
                        let label = b.label.map(|t| view! {
                            <text class="span-label" x=format!("{:.1}", b.x + 4.0) y=format!("{:.1}", b.y + b.h * 0.68)>{t}</text>
                        });
                        view! {
                            <g class="span">
                                <rect class=b.class x=format!("{:.1}", b.x) y=format!("{:.1}", b.y) width=format!("{:.1}", b.w)
                                    height=format!("{:.1}", b.h) rx="2"><title>{b.title.clone()}</title></rect>
                                {label}
                            </g>
                        }
                    }).collect_view();
                    view! {
                        <g>{ticks}</g>
                        <g>{lanes}</g>
                        <g class="spans">{boxes}</g>
                        <line class="axis" x1=LEFT.to_string() x2=(WIDTH - RIGHT).to_string() y1=format!("{bottom:.1}") y2=format!("{bottom:.1}")></line>
                        <text class="axis-title" x=(LEFT + (WIDTH - LEFT - RIGHT) / 2.0).to_string() y=format!("{:.1}", bottom + 36.0) text-anchor="middle">"ms"</text>
                    }
                }}
            </svg>
            {move || {
                tp.get().map(|(calls, us)| view! {
                    <p class="muted small" id="tp-note">
                        "TP comm: " {format!("{calls:.0}")} " tensor-parallel collectives per rank (all-reduces; with "
                        "sequence parallelism all-gathers and reduce-scatters), "
                        {duration_text(us as u64)} " per rank in all. Each sits between two matmuls of a block, "
                        "so compute waits for every one: none of it is hidden."
                    </p>
                })
            }}
            {move || {
                let (per_rank, all) = overlap.get();
                (all.comm_us > 0).then(|| view! {
                    <div class="overlap" id="overlap">
                        <h3>"Communication hidden under compute"</h3>
                        <p class="muted small">
                            "The share of each rank's data-parallel communication time that ran on its communication thread while the same rank was computing (forward or backward). "
                            "That time costs nothing: DDP all-reduces the gradients of the last layers while earlier layers are still being differentiated; FSDP with prefetch gathers the next unit while this one computes. "
                            "The rest is exposed: the step waits for it. Collectives the compute thread issues and waits for (ZeRO/FSDP's gathers and reduce-scatters, and the waits for a prefetch not done yet, on the DP blocking lane) are always exposed, even inside compute."
                        </p>
                        <table class="overlap-table">
                            <thead><tr><th>"rank"</th><th>"communication"</th><th>"under compute"</th><th>"exposed"</th><th>"hidden share"</th></tr></thead>
                            <tbody>
                                {per_rank.into_iter().map(|o| view! {
                                    <tr data-rank=o.rank.map(|r| r.to_string())>
                                        <td>{o.rank.map(|r| r.to_string())}</td>
                                        <td>{duration_text(o.comm_us)}</td>
                                        <td>{duration_text(o.hidden_us)}</td>
                                        <td>{duration_text(o.exposed_us())}</td>
                                        <td class="share">{percent(o.share())}</td>
                                    </tr>
                                }).collect_view()}
                                <tr class="overall" id="overlap-overall">
                                    <td>"all"</td>
                                    <td>{duration_text(all.comm_us)}</td>
                                    <td>{duration_text(all.hidden_us)}</td>
                                    <td>{duration_text(all.exposed_us())}</td>
                                    <td class="share">{percent(all.share())}</td>
                                </tr>
                            </tbody>
                        </table>
                    </div>
                })
            }}
        </div>
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn span(kind: SpanKind, lane: &str, step: u64, start: u64, end: u64) -> Span {
        Span {
            kind,
            name: format!("{kind:?}"),
            step,
            lane: lane.into(),
            start_us: start,
            end_us: end,
            layer: None,
            bucket: None,
            bytes: Some(1024),
            micro: None,
            chunk: None,
        }
    }

    #[test]
    fn labels_fit_their_boxes() {
        assert_eq!(fit("forward 0", 100.0), "forward 0");
        assert_eq!(fit("all_reduce bucket 1 (0.10 MiB)", 60.0), "all_reduc…");
        assert_eq!(fit("x", 1.0), "x");
    }

    #[test]
    fn unions_and_intersections() {
        assert_eq!(union([(5, 10), (0, 3), (2, 4), (10, 12), (20, 20)]), vec![(0, 4), (5, 12)]);
        assert_eq!(total(&union([(0, 10), (5, 15)])), 15);
        assert_eq!(intersection(&[(0, 4), (5, 12)], &[(3, 6), (11, 30)]), 1 + 1 + 1);
        assert_eq!(intersection(&[], &[(0, 1)]), 0);
    }

    #[test]
    fn overlap_counts_comm_under_the_same_ranks_compute() {
        use SpanKind::*;
        // Rank 0: backward 0..100 (two layers, overlapping the union); comm 60..90 and 95..130:
        // hidden 30 + 5 = 35 of 65 (the comm spans themselves overlap nothing twice).
        let r0 = vec![
            span(Forward, "compute", 1, 0, 0),
            span(Backward, "compute", 1, 0, 50),
            span(Backward, "compute", 1, 50, 100),
            span(Comm, "comm", 1, 60, 90),
            span(Comm, "comm", 1, 95, 130),
            span(Comm, "comm", 1, 100, 110),
            span(Optimizer, "compute", 1, 130, 140),
        ];
        let o = overlap(0, &r0);
        assert_eq!((o.comm_us, o.hidden_us), (65, 35));
        assert!((o.share().unwrap() - 35.0 / 65.0).abs() < 1e-12);
        assert_eq!(o.exposed_us(), 30);
        // Rank 1: all comm after backward; another rank's backward does not count.
        let r1 = vec![span(Backward, "compute", 1, 0, 100), span(Comm, "comm", 1, 100, 150)];
        let ranks = vec![RankSpans { rank: 0, spans: r0 }, RankSpans { rank: 1, spans: r1 }];
        let (per, all) = overlaps(&ranks, StepChoice::Step(1));
        assert_eq!(per[1].hidden_us, 0);
        assert_eq!((all.comm_us, all.hidden_us), (115, 35));
        // A prefetched gather on the communication thread under forward is hidden too.
        let prefetch = vec![span(Forward, "compute", 1, 0, 100), span(Comm, "comm", 1, 40, 120)];
        assert_eq!(overlap(0, &prefetch).hidden_us, 60);
        // An FSDP gather inside backward, on the blocking lane: communication, never hidden.
        let fsdp = vec![span(Backward, "compute", 1, 0, 100), span(Comm, lane::DP_BLOCKING, 1, 20, 50)];
        let o = overlap(2, &fsdp);
        assert_eq!((o.comm_us, o.hidden_us), (30, 0));
        // No comm at all: no share.
        assert_eq!(overlap(3, &[span(Backward, "compute", 0, 0, 9)]).share(), None);
        let (per, all) = overlaps(&ranks, StepChoice::Step(7));
        assert!(per.is_empty() && all.share().is_none());
    }

    #[test]
    fn a_real_ddp_trace() {
        let trace: distlab_common::trace::ExperimentTrace =
            serde_json::from_str(include_str!("../../tests/fixtures/ddp-2ranks-3steps.trace.json")).unwrap();
        let ranks: Vec<RankSpans> =
            trace.ranks.iter().map(|r| RankSpans { rank: r.rank, spans: r.spans.clone() }).collect();
        let steps = recorded_steps(&ranks);
        assert_eq!(steps, vec![0, 1, 2]);
        for choice in [StepChoice::All, default_step(&steps)] {
            let m = TimelineModel::new(&ranks, choice);
            assert_eq!(m.lanes.len(), 4);
            assert!(m.boxes.iter().all(|b| b.x >= LEFT && b.x + b.w <= WIDTH - RIGHT + 1e-6), "{choice:?}");
            let (per_rank, all) = overlaps(&ranks, choice);
            assert_eq!(per_rank.len(), 2);
            assert!(all.hidden_us <= all.comm_us && all.comm_us > 0);
        }
        assert!(TimelineModel::new(&ranks, StepChoice::Step(1))
            .boxes
            .iter()
            .any(|b| b.title.contains("all_reduce bucket 0") && b.title.contains("MiB")));
    }

    #[test]
    fn geometry_per_step_and_lane() {
        use SpanKind::*;
        let mk = |rank, base: u64| RankSpans {
            rank,
            spans: vec![
                span(Forward, "compute", 0, base, base + 1000),
                span(Backward, "compute", 0, base + 1000, base + 3000),
                span(Comm, "comm", 0, base + 2000, base + 3500),
                span(Forward, "compute", 1, base + 10_000, base + 11_000),
            ],
        };
        let ranks = vec![mk(0, 1_000_000), mk(1, 1_000_200)];
        assert_eq!(recorded_steps(&ranks), vec![0, 1]);
        assert_eq!(default_step(&[0, 1]), StepChoice::Step(1));
        let m = TimelineModel::new(&ranks, StepChoice::Step(0));
        assert_eq!(m.boxes.len(), 6);
        assert_eq!(m.lanes.len(), 4, "two lanes per rank");
        // Time starts at the earliest span: rank 0's forward at x = LEFT.
        assert!((m.boxes[0].x - LEFT).abs() < 1e-9);
        assert!((m.span_ms - 3.7).abs() < 1e-9);
        assert_eq!(m.ticks.first().map(|t| t.1.as_str()), Some("0.0"));
        // Comm boxes sit on the comm lane, below the compute lane of the same rank.
        assert!(m.boxes[2].y > m.boxes[1].y && m.boxes[2].y < m.boxes[4].y);
        assert!(m.boxes.iter().all(|b| b.x >= LEFT && b.x + b.w <= WIDTH - RIGHT + 1e-9 && b.y + b.h <= m.plot_bottom));
        assert!(m.boxes[1].title.contains("2.000 ms") && m.boxes[1].title.contains("1.0 KiB"));
        // Tensor-parallel sums get a third lane, under the comm lane.
        let mut with_tp = mk(0, 0);
        with_tp.spans.push(span(Comm, "tp", 0, 500, 800));
        let m = TimelineModel::new(&[with_tp], StepChoice::Step(0));
        assert_eq!(m.lanes.iter().map(|l| l.text.as_str()).collect::<Vec<_>>(), ["rank 0", "comm", "TP comm"]);
        assert!(m.boxes[3].y > m.boxes[2].y && m.boxes[2].y > m.boxes[1].y);
        let two_sums = |rank| RankSpans { rank, spans: vec![span(Comm, "tp", 0, 0, 10), span(Comm, "tp", 0, 20, 30)] };
        assert_eq!(tp_sums(&[two_sums(0), two_sums(1)], StepChoice::All), Some((2.0, 20.0)));
        assert_eq!(tp_sums(&ranks, StepChoice::All), None);
        // Without comm spans a rank is a single lane.
        let only = vec![RankSpans { rank: 0, spans: vec![span(Forward, "compute", 0, 0, 10)] }];
        assert_eq!(TimelineModel::new(&only, StepChoice::All).lanes.len(), 1);
        // Nothing recorded: an empty, finite model.
        let m = TimelineModel::new(&[], StepChoice::All);
        assert!(m.boxes.is_empty() && m.height.is_finite());
    }
}
