//! One rank's memory over time: the samples the engine took at op boundaries (after
//! "forward block 2", "gather block 3", "free block 3", ...) drawn as stacked areas by
//! category, so FSDP's gather/free sawtooth and the rise and fall of activations
//! through forward and backward are visible. x is the time since the first sample, y
//! the bytes held; each sample holds until the next one. A dashed line marks the
//! planner's predicted peak; a dotted line the process's heap at each sample (every
//! allocation counted), so the gap above the stack is what the ledger leaves untracked;
//! hovering a column names its sample.
//!
//! The geometry ([`MemoryTimelineModel`]) is plain Rust, unit-tested; the component
//! only draws it.

use distlab_common::memory::MemorySample;
use leptos::prelude::*;

use crate::components::loss_chart::nice_step;
use crate::components::memory_bars::{byte_ticks, sum_of_categories, Look, CATEGORIES};
use crate::format;

const WIDTH: f64 = 1000.0;
const HEIGHT: f64 = 260.0;
const LEFT: f64 = 84.0;
const RIGHT: f64 = 24.0;
const TOP: f64 = 22.0;
const BOTTOM: f64 = 44.0;
/// Hover columns at most (more samples are grouped, every column naming its first).
const MAX_COLUMNS: usize = 600;

/// A stacked area of one category.
#[derive(Clone, Debug, PartialEq)]
pub struct Area {
    pub class: &'static str,
    pub path: String,
}

/// A hover column: a sample's time span, with its title.
#[derive(Clone, Debug, PartialEq)]
pub struct Column {
    pub x: f64,
    pub w: f64,
    pub title: String,
}

#[derive(Clone, Debug, PartialEq)]
pub struct MemoryTimelineModel {
    pub areas: Vec<Area>,
    /// The outline of the total.
    pub total_path: String,
    /// The process heap at each sample (None when a sample has no heap figure).
    pub heap_path: Option<String>,
    pub columns: Vec<Column>,
    pub x_ticks: Vec<(f64, String)>,
    pub y_ticks: Vec<(f64, String)>,
    /// y of the planner's predicted total, and its label.
    pub planner: Option<(f64, String)>,
    pub samples: usize,
}

/// Microseconds as "1.25 ms" (or "850 µs").
fn time_text(us: u64) -> String {
    if us < 1000 {
        format!("{us} µs")
    } else {
        format!("{:.2} ms", us as f64 / 1000.0)
    }
}

impl MemoryTimelineModel {
    /// `predicted_total`: the planner's peak for the rank (0: no line).
    pub fn new(samples: &[MemorySample], predicted_total: u64) -> Self {
        let t0 = samples.iter().map(|s| s.t_us).min().unwrap_or(0);
        let rel: Vec<u64> = samples.iter().map(|s| s.t_us.saturating_sub(t0)).collect();
        let last = rel.iter().copied().max().unwrap_or(0);
        // The last sample holds for a sliver, so that it shows.
        let end_us = last + (last / 50).max(1);
        let span_ms = end_us as f64 / 1000.0;
        let x_step = nice_step(span_ms / 8.0);
        let x_axis = (span_ms / x_step - 1e-9).ceil().max(1.0) * x_step;
        let plot_w = WIDTH - LEFT - RIGHT;
        let sx = |us: u64| LEFT + us as f64 / 1000.0 / x_axis * plot_w;

        let heaps: Option<Vec<u64>> = samples.iter().map(|s| s.heap).collect();
        let heaps = heaps.filter(|h| !h.is_empty());
        let highest_heap = heaps.as_ref().and_then(|h| h.iter().copied().max()).unwrap_or(0);
        let highest = samples.iter().map(|s| sum_of_categories(&s.bytes)).max().unwrap_or(0).max(highest_heap);
        let (y_axis, y_ticks) = byte_ticks(highest.max(predicted_total) as f64, 4.0);
        let plot_bottom = HEIGHT - BOTTOM;
        let sy = |b: u64| plot_bottom - b as f64 / y_axis * (plot_bottom - TOP);

        // Sample i holds from x[i] to x[i + 1] (the last one to end_us).
        let xs: Vec<f64> = rel.iter().map(|&t| sx(t)).chain(std::iter::once(sx(end_us))).collect();
        let mut below = vec![0u64; samples.len()];
        let mut areas = Vec::new();
        for c in CATEGORIES {
            if samples.iter().all(|s| c.of(&s.bytes) == 0) {
                continue;
            }
            let above: Vec<u64> = samples.iter().zip(&below).map(|(s, b)| b.saturating_add(c.of(&s.bytes))).collect();
            areas.push(Area { class: c.class(), path: step_band(&xs, &above, &below, sy) });
            below = above;
        }
        let total_path = step_line(&xs, &below, sy);
        let heap_path = heaps.as_ref().map(|h| step_line(&xs, h, sy));

        let stride = samples.len().div_ceil(MAX_COLUMNS).max(1);
        let columns = (0..samples.len())
            .step_by(stride)
            .map(|i| {
                let s = &samples[i];
                let next = (i + stride).min(samples.len());
                let mut title = format!(
                    "after \"{}\" · step {} · at {} · total {}",
                    s.event,
                    s.step,
                    time_text(rel[i]),
                    format::bytes_exact(sum_of_categories(&s.bytes))
                );
                for c in CATEGORIES {
                    let b = c.of(&s.bytes);
                    if b > 0 {
                        title.push_str(&format!("\n{}: {}", c.label(), format::bytes(b as f64)));
                    }
                }
                if let Some(heap) = s.heap {
                    // Set against what the ledger booked on the heap (DDP's buckets are shared memory).
                    let untracked = heap as i64 - sum_of_categories(&s.bytes).saturating_sub(s.shared) as i64;
                    title.push_str(&format!(
                        "\nprocess heap: {} (untracked {}{})",
                        format::bytes(heap as f64),
                        if untracked < 0 { "-" } else { "" },
                        format::bytes(untracked.unsigned_abs() as f64)
                    ));
                }
                Column { x: xs[i], w: (xs[next] - xs[i]).max(0.5), title }
            })
            .collect();

        let decimals = if x_step >= 1.0 { 0 } else { (-x_step.log10().floor()) as usize };
        let x_ticks = (0..=((x_axis / x_step).round() as i64))
            .map(|i| {
                let ms = i as f64 * x_step;
                (LEFT + ms / x_axis * plot_w, format!("{ms:.decimals$}"))
            })
            .collect();
        let y_ticks = y_ticks.into_iter().map(|(b, label)| (sy(b as u64), label)).collect();
        let planner = (predicted_total > 0)
            .then(|| (sy(predicted_total), format!("planner's peak {}", format::bytes(predicted_total as f64))));
        MemoryTimelineModel { areas, total_path, heap_path, columns, x_ticks, y_ticks, planner, samples: samples.len() }
    }
}

/// The closed outline between `above` and `below`, each a step function over `xs`
/// (value i from xs[i] to xs[i + 1]).
fn step_band(xs: &[f64], above: &[u64], below: &[u64], sy: impl Fn(u64) -> f64) -> String {
    if above.is_empty() {
        return String::new();
    }
    let mut d = step_line(xs, above, &sy);
    for i in (0..below.len()).rev() {
        d.push_str(&format!(" V{:.1} H{:.1}", sy(below[i]), xs[i]));
    }
    d.push_str(" Z");
    d
}

/// `M x0 y0 H x1 V y1 H x2 ...`: the step function of `values` over `xs`.
fn step_line(xs: &[f64], values: &[u64], sy: impl Fn(u64) -> f64) -> String {
    let mut d = String::new();
    for (i, &v) in values.iter().enumerate() {
        if i == 0 {
            d.push_str(&format!("M{:.1} {:.1}", xs[0], sy(v)));
        } else {
            d.push_str(&format!(" V{:.1}", sy(v)));
        }
        d.push_str(&format!(" H{:.1}", xs[i + 1]));
    }
    d
}

/// The chart of one rank's samples; `predicted_total` draws the planner's peak.
#[component]
pub fn MemoryTimeline(samples: Vec<MemorySample>, predicted_total: u64, rank: u32) -> impl IntoView {
    let m = MemoryTimelineModel::new(&samples, predicted_total);
    let plot_bottom = HEIGHT - BOTTOM;
    let plot_right = WIDTH - RIGHT;
    let x_ticks = m
        .x_ticks
        .into_iter()
        .map(|(x, label)| {
            view! {
                <line class="tick-mark" x1=format!("{x:.1}") x2=format!("{x:.1}") y1=plot_bottom.to_string() y2=(plot_bottom + 5.0).to_string()></line>
                <text class="tick" x=format!("{x:.1}") y=(plot_bottom + 19.0).to_string() text-anchor="middle">{label}</text>
            }
        })
        .collect_view();
    let y_ticks = m
        .y_ticks
        .into_iter()
        .map(|(y, label)| {
            view! {
                <line class="grid-line" x1=LEFT.to_string() x2=plot_right.to_string() y1=format!("{y:.1}") y2=format!("{y:.1}")></line>
                <text class="tick" x=(LEFT - 8.0).to_string() y=format!("{:.1}", y + 4.0) text-anchor="end">{label}</text>
            }
        })
        .collect_view();
    let areas = m
        .areas
        .into_iter()
        .map(|a| view! { <path class=format!("mem-area {}", a.class) d=a.path></path> })
        .collect_view();
    let planner = m.planner.map(|(y, label)| {
        view! {
            <line class="planner-peak" x1=LEFT.to_string() x2=plot_right.to_string() y1=format!("{y:.1}") y2=format!("{y:.1}") stroke-dasharray="7 5"></line>
            <text class="planner-peak-label" x=(plot_right - 6.0).to_string() y=format!("{:.1}", y - 6.0) text-anchor="end">{label}</text>
        }
    });
    let columns = m
        .columns
        .into_iter()
        .map(|c| {
            view! {
                <rect class="hover-column" x=format!("{:.1}", c.x) y=TOP.to_string() width=format!("{:.1}", c.w)
                    height=(plot_bottom - TOP).to_string()><title>{c.title}</title></rect>
            }
        })
        .collect_view();
    view! {
        <svg
            class="chart memory-timeline"
            viewBox=format!("0 0 {WIDTH} {HEIGHT}")
            role="img"
            aria-label=format!("memory of rank {rank} over time")
            data-rank=rank.to_string()
            data-samples=m.samples.to_string()
        >
            <rect class="chart-bg" x="0" y="0" width=WIDTH.to_string() height=HEIGHT.to_string()></rect>
            <g>{y_ticks}</g>
            <g class="areas">{areas}</g>
            <path class="mem-total-line" d=m.total_path fill="none"></path>
            {m.heap_path.map(|d| view! {
                <path class="mem-heap-line" d=d fill="none" stroke-dasharray="2 3"></path>
                <text class="mem-heap-label" x=(LEFT + 6.0).to_string() y=(TOP + 12.0).to_string()>"dotted: process heap (every allocation)"</text>
            })}
            {planner}
            <g>{x_ticks}</g>
            <line class="axis" x1=LEFT.to_string() x2=LEFT.to_string() y1=TOP.to_string() y2=plot_bottom.to_string()></line>
            <line class="axis" x1=LEFT.to_string() x2=plot_right.to_string() y1=plot_bottom.to_string() y2=plot_bottom.to_string()></line>
            <text class="axis-title" x=(LEFT + (plot_right - LEFT) / 2.0).to_string() y=(HEIGHT - 8.0).to_string() text-anchor="middle">
                "time since the first sample (ms)"
            </text>
            <g class="hover-columns">{columns}</g>
        </svg>
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use distlab_common::planner::RankMemory;

    fn sample(t_us: u64, event: &str, parameters: u64, gathered: u64) -> MemorySample {
        MemorySample {
            t_us,
            step: 0,
            event: event.into(),
            bytes: RankMemory {
                parameters,
                gathered_parameters: gathered,
                total: parameters + gathered,
                ..RankMemory::default()
            },
            heap: None,
            shared: 0,
        }
    }

    /// An FSDP-like sawtooth: the shard stays, a unit is gathered and freed twice.
    fn sawtooth() -> Vec<MemorySample> {
        vec![
            sample(1_000_000, "start", 1000, 0),
            sample(1_001_000, "gather block 0", 1000, 4000),
            sample(1_002_000, "free block 0", 1000, 0),
            sample(1_003_000, "gather block 1", 1000, 4000),
            sample(1_004_000, "free block 1", 1000, 0),
        ]
    }

    #[test]
    fn steps_stack_by_category_from_the_first_sample() {
        let m = MemoryTimelineModel::new(&sawtooth(), 6000);
        assert_eq!(m.samples, 5);
        assert_eq!(m.areas.iter().map(|a| a.class).collect::<Vec<_>>(), vec!["mem-parameters", "mem-gathered"]);
        // x starts at the first sample; every path is closed and stays in the plot.
        assert!(m.areas[0].path.starts_with(&format!("M{LEFT:.1} ")), "{}", m.areas[0].path);
        assert!(m.areas.iter().all(|a| a.path.ends_with('Z')));
        assert_eq!(m.total_path.matches('V').count(), 4, "one rise or fall per later sample");
        for (x, _) in &m.x_ticks {
            assert!((LEFT - 1e-9..=WIDTH - RIGHT + 1e-9).contains(x));
        }
        assert_eq!(m.x_ticks.first().map(|t| t.1.as_str()), Some("0"));
        // The planner's line sits above the highest sample (6000 > 5000).
        let (py, label) = m.planner.clone().expect("planner line");
        assert!((TOP..HEIGHT - BOTTOM).contains(&py) && label.contains("5.9 KiB"), "{py} {label}");
        // Hover columns name their sample, with its time and total.
        assert_eq!(m.columns.len(), 5);
        assert!(m.columns[1].title.starts_with("after \"gather block 0\" · step 0 · at 1.00 ms · total 4.9 KiB"));
        assert!(m.columns[1].title.contains("gathered parameters: 3.9 KiB"), "{}", m.columns[1].title);
        assert!(m.columns.windows(2).all(|w| (w[0].x + w[0].w - w[1].x).abs() < 1e-9), "columns tile the time");
    }

    #[test]
    fn the_process_heap_is_drawn_when_every_sample_has_it() {
        assert_eq!(MemoryTimelineModel::new(&sawtooth(), 6000).heap_path, None);
        let mut samples = sawtooth();
        for (i, s) in samples.iter_mut().enumerate() {
            s.heap = Some(sum_of_categories(&s.bytes) + 500 * i as u64);
        }
        let m = MemoryTimelineModel::new(&samples, 0);
        assert!(m.heap_path.as_deref().is_some_and(|d| d.starts_with('M')), "{:?}", m.heap_path);
        assert!(m.columns[4].title.contains("process heap: 2.9 KiB (untracked 2.0 KiB)"), "{}", m.columns[4].title);
    }

    #[test]
    fn step_paths() {
        let xs = [0.0, 10.0, 20.0];
        let sy = |b: u64| 100.0 - b as f64;
        assert_eq!(step_line(&xs, &[5, 7], sy), "M0.0 95.0 H10.0 V93.0 H20.0");
        assert_eq!(step_band(&xs, &[5, 7], &[1, 2], sy), "M0.0 95.0 H10.0 V93.0 H20.0 V98.0 H10.0 V99.0 H0.0 Z");
    }

    #[test]
    fn degenerate_timelines_stay_finite() {
        let m = MemoryTimelineModel::new(&[], 0);
        assert!(m.areas.is_empty() && m.columns.is_empty() && m.planner.is_none());
        // One sample, or all at the same microsecond.
        let one = vec![sample(5, "start", 10, 0), sample(5, "again", 20, 0)];
        let m = MemoryTimelineModel::new(&one, 0);
        assert_eq!(m.areas.len(), 1);
        assert!(!m.areas[0].path.contains("NaN") && !m.areas[0].path.contains("inf"));
        // Many samples are grouped into at most MAX_COLUMNS hover columns.
        let many: Vec<_> = (0..2000).map(|i| sample(i * 10, "op", 100 + i % 7, 0)).collect();
        assert!(MemoryTimelineModel::new(&many, 0).columns.len() <= MAX_COLUMNS);
    }
}
